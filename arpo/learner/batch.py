"""Training inputs from stored trajectories: token ids as sampled, pixels from the PNGs.

    seqs = [build_sequence(item, processor, image_token_id) for item in items]
    inputs = collate(seqs[i : i + micro], model, pad_id)   # -> model(**inputs.model_kwargs)

Token-in, token-out (docs/reference/record.md): the store item's `tokens` are the training
sequence itself (prompt_0 + response_0 + prompt_1 + ...), its `offsets` the per-turn
lengths, its `logprobs` the behaviour log-probs of the response tokens in order; nothing
is decoded or tokenised again. The loss positions are the response tokens; the logits
that score response token t sit at position t - 1 (causal shift).

Pixels are made here, at training time, from the stored PNGs with the model's own
image processor (the same call the transformers engine makes when sampling), so the
number of <|image_pad|> tokens in the sequence must equal what the processor gives
the screenshots; a mismatch (an actor whose processor had other min / max pixels) is
a `RecordError` naming the trajectory.

The screenshots of every turn are in the sequence: the learner scores each response
under the whole episode so far. With the reference settings (all 15 screenshots kept)
that is exactly the context the response was sampled under; an actor with a shorter
history window sampled later turns without the oldest screenshots, and the importance
weight exp(pi_prox - mu) then also absorbs that context difference.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from arpo.errors import RecordError
from arpo.policy.family import concat_images, family_for_config


@dataclass
class TrainSequence:
    """One trajectory ready for the model (CPU tensors)."""

    input_ids: torch.Tensor
    """[T] int64: the training sequence."""
    pixels: dict[str, torch.Tensor]
    """The image processor's model inputs for its screenshots (Qwen: pixel_values [patches,
    dim] and image_grid_thw [images, 3]; SmolVLM: pixel_values [images, 1, C, H, W] and
    pixel_attention_mask); empty for a trajectory without screenshots."""
    image_meta: list[Any]
    """Per-image position data (`arpo.policy.family.Family.encode_images`)."""
    loss_pos: torch.Tensor
    """[N] int64: positions whose logits score the response tokens (response index - 1)."""
    targets: torch.Tensor
    """[N] int64: the sampled response token ids."""
    behaviour_logp: torch.Tensor
    """[N] float32: log-probs of the targets under the policy that sampled them."""
    turn_index: torch.Tensor | None = None
    """[N] int64: the turn each target belongs to (per-turn advantages of tree credit)."""


def response_positions(offsets: np.ndarray) -> np.ndarray:
    """Indices (into the token sequence) of the response tokens, from per-turn lengths."""
    if len(offsets) % 2:
        raise RecordError(f"offsets must hold (prompt, response) pairs, got {len(offsets)} values")
    pos: list[np.ndarray] = []
    start = 0
    for n_prompt, n_resp in np.asarray(offsets, dtype=np.int64).reshape(-1, 2):
        start += n_prompt
        pos.append(np.arange(start, start + n_resp, dtype=np.int64))
        start += n_resp
    return np.concatenate(pos) if pos else np.zeros(0, np.int64)


def check_item(
    item: Any, processor: Any, image_token_id: int, vocab_size: int | None = None
) -> str | None:
    """Why `item` cannot be trained on, or None: the cheap checks of `build_sequence`
    (offsets, log-prob count, token ids inside the model's vocabulary of `vocab_size`,
    image tokens only in prompts and as many as the screenshots need with this processor,
    PNGs whose chunks are complete and pass their CRCs), without decoding pixels. A policy can sample an <|image_pad|> token in a response
    (a random model does); such a trajectory has no pixels for it."""
    from arpo.policy.prompt import image_rule, image_size

    tokens = np.asarray(item.tokens)
    offsets = np.asarray(item.offsets)
    if vocab_size is not None and len(tokens):
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            return f"token id {bad} is outside the model's vocabulary [0, {vocab_size})"
    if len(offsets) % 2 or int(offsets.sum()) != len(tokens):
        return f"offsets {offsets.tolist()[:8]} do not cover its {len(tokens)} tokens"
    pos = response_positions(offsets)
    if len(pos) != len(item.logprobs):
        return f"{len(pos)} response tokens but {len(item.logprobs)} log-probs"
    if len(pos) and int((tokens[pos] == image_token_id).sum()):
        return "a response contains image placeholder tokens (sampled an image placeholder)"
    rule = image_rule(processor)
    want = 0
    for i, b in enumerate(item.blobs):
        if b:
            try:
                w, h = image_size(b)
                _verify_png(b)
            except Exception as e:
                return f"screenshot {i} cannot be read: {type(e).__name__}: {e}"
            try:
                want += rule.tokens(w, h)
            except ValueError as e:
                return f"screenshot {i} cannot be shown: {e}"
    have = int((tokens == image_token_id).sum())
    if have != want:
        return f"{have} image tokens but its screenshots need {want} with this processor"
    return None


def _verify_png(blob: Any) -> None:
    """Raise if the PNG's chunks are truncated or fail their CRCs (PIL's `verify`: reads
    the file without decoding pixels, a fraction of the cost of making them)."""
    from PIL import Image

    with Image.open(io.BytesIO(bytes(blob))) as im:
        im.verify()


def _images(blobs: tuple[bytes, ...]) -> list[Any]:
    from PIL import Image

    out = []
    for b in blobs:
        if not b:
            continue
        with Image.open(io.BytesIO(b)) as im:
            out.append(im.convert("RGB"))
    return out


def build_sequence(item: Any, processor: Any, image_token_id: int, name: str = "") -> TrainSequence:
    """The model inputs of one store item (`arpo.store_item.to_item` layout)."""
    tokens = np.asarray(item.tokens)
    offsets = np.asarray(item.offsets)
    pos = response_positions(offsets)
    if int(offsets.sum()) != len(tokens):
        raise RecordError(
            f"trajectory {name}: offsets sum to {int(offsets.sum())} but it has "
            f"{len(tokens)} tokens"
        )
    if len(pos) != len(item.logprobs):
        raise RecordError(
            f"trajectory {name}: {len(pos)} response tokens but {len(item.logprobs)} log-probs"
        )
    if len(pos) and pos[0] == 0:
        raise RecordError(f"trajectory {name}: a response cannot start the sequence")
    from arpo.policy.family import family_for_processor

    ids = torch.from_numpy(tokens.astype(np.int64))
    images = _images(item.blobs)
    pixels: dict[str, torch.Tensor] = {}
    meta: list[Any] = []
    have = int((ids == image_token_id).sum())
    want = 0
    if images:
        pixels, counts, meta = family_for_processor(processor).encode_images(processor, images)
        want = sum(counts)
    if have != want:
        raise RecordError(
            f"trajectory {name}: {have} image tokens in the sequence but its {len(images)} "
            f"screenshot(s) need {want} with this model's image processor (the actor must use "
            "the same min / max pixels as the learner's processor)"
        )
    p = torch.from_numpy(pos)
    return TrainSequence(
        input_ids=ids,
        pixels=pixels,
        image_meta=meta,
        loss_pos=p - 1,
        targets=ids[p],
        behaviour_logp=torch.from_numpy(np.array(item.logprobs, dtype=np.float32)),
        turn_index=torch.from_numpy(
            np.repeat(np.arange(len(offsets) // 2), offsets[1::2].astype(np.int64))
        ),
    )


@dataclass
class MicroBatch:
    """A right-padded micro-batch and where its loss tokens are."""

    model_kwargs: dict[str, Any]
    """input_ids, attention_mask, position_ids, logits_to_keep and the images' inputs."""
    rows: torch.Tensor
    """[B, N] indices into the kept logits' positions for each row's loss tokens (padded)."""
    targets: torch.Tensor
    """[B, N] target ids (padded with 0)."""
    behaviour_logp: torch.Tensor
    """[B, N] float32 (padded with 0)."""
    mask: torch.Tensor
    """[B, N] bool: real loss tokens."""


def collate(seqs: list[TrainSequence], model: Any, pad_id: int, device: str | torch.device = "cpu"):
    """A micro-batch for `model(**mb.model_kwargs)`.

    Only the logits at loss positions are computed: `logits_to_keep` is the sorted union
    of every row's loss positions (the model's lm_head runs on those alone; for a batch
    of one trajectory that is exactly its response tokens), and `rows` maps each row's
    loss tokens into that union.
    """
    if not seqs:
        raise ValueError("collate needs at least one sequence")
    b = len(seqs)
    length = max(len(s.input_ids) for s in seqs)
    ids = torch.full((b, length), pad_id, dtype=torch.long)
    attn = torch.zeros((b, length), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s.input_ids)] = s.input_ids
        attn[i, : len(s.input_ids)] = 1
    family = family_for_config(model)
    pixels = concat_images([s.pixels for s in seqs])
    ids, attn = ids.to(device), attn.to(device)
    meta = [m for s in seqs for m in s.image_meta]
    position_ids = family.model_positions(family.positions(model, ids, attn, meta))
    keep = torch.unique(torch.cat([s.loss_pos for s in seqs]))  # sorted
    n = max(len(s.loss_pos) for s in seqs)
    rows = torch.zeros((b, n), dtype=torch.long)
    targets = torch.zeros((b, n), dtype=torch.long)
    behav = torch.zeros((b, n), dtype=torch.float32)
    mask = torch.zeros((b, n), dtype=torch.bool)
    for i, s in enumerate(seqs):
        k = len(s.loss_pos)
        rows[i, :k] = torch.searchsorted(keep, s.loss_pos)
        targets[i, :k] = s.targets
        behav[i, :k] = s.behaviour_logp
        mask[i, :k] = True
    dtype = next(model.parameters()).dtype
    kwargs: dict[str, Any] = {
        "input_ids": ids,
        "attention_mask": attn,
        "position_ids": position_ids,
        "logits_to_keep": keep.to(device),
    }
    for k, v in pixels.items():
        kwargs[k] = v.to(device, dtype) if v.is_floating_point() else v.to(device)
    return MicroBatch(
        kwargs, rows.to(device), targets.to(device), behav.to(device), mask.to(device)
    )


def token_logprobs(
    model: Any,
    mb: MicroBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    forbidden: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, N] log-probs of the targets (float32) and optionally the entropy per token.

    `forbidden` ids get logit -inf first, as the engines mask them when sampling
    (`arpo.policy.prompt.forbidden_token_ids`): the log-probs are those of the masked
    distribution the actor sampled from.

    Logits are divided by the rollout temperature first, so that the log-probs are those
    of the distribution the actor sampled from (top-p is not applied: with the reference's
    top_p = 1.0 there is nothing to apply)."""
    out = model(**mb.model_kwargs, use_cache=False)
    logits = out.logits  # [B, K, V] at the kept positions
    b = logits.shape[0]
    sel = logits[torch.arange(b, device=logits.device)[:, None], mb.rows]  # [B, N, V]
    sel = sel.float()
    if forbidden is not None and forbidden.numel():
        sel = sel.index_fill(-1, forbidden.to(sel.device), float("-inf"))
    if temperature != 1.0:
        sel = sel / temperature
    logp_all = torch.log_softmax(sel, dim=-1)
    logp = logp_all.gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
    ent = None
    if with_entropy:
        with torch.no_grad():
            ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent

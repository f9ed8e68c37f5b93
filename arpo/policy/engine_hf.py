"""The transformers policy engine (CPU or GPU): batched sampling with exact log-probs.

Requests from many episodes arrive concurrently; a background task collects them
into batches (the first request waits up to `batch_wait_ms` for others, at most
`max_batch_size` together) and runs each batch in a worker thread so the event
loop stays free. A batch is left-padded, prefilled once (images encoded by the
vision tower, positions from the model family's rule: `arpo.policy.family`), then decoded
token by token with a KV cache. Each row samples with its own temperature, top-p,
stop tokens and `torch.Generator` (seeded by the request's seed).

The log-prob of a sampled token is read from the same logits the token was drawn
from, processed as `engine.process_logits` says; a teacher-forced forward pass
over prompt + response gives the same numbers (float32: within 1e-4, see
tests/test_policy_engine_hf.py).

Prefix cache (`prefix_cache_tokens`). Turn t + 1 of an episode shows the model turn t's
prompt and response and then one more screenshot, so its prompt starts with the tokens
turn t has already run through the model. After each batch the engine keeps every row's
keys and values (its prompt and response, less the last sampled token, which was never fed)
with the token ids and a digest of each screenshot they cover. A request is matched against
the kept entries by its longest common prefix (token ids equal and the screenshots of every
image block in it equal by digest; cut back to the start of an image block, so an image is
always encoded whole); its matched keys and values are reused and only the rest of its
prompt is prefilled, with only the screenshots not covered. The episodes of one group share
their first screenshot and instruction, so their first turns share a prefix too.

In a batch, row i's reused cache sits right-aligned in a block of the longest reused length
C, its new tokens right-aligned in a block of the longest new length S; the attention mask
is 0 on both blocks' padding, and every token keeps the multimodal rotary position it has in
its own full sequence (`get_rope_index` over the row's whole prompt), so the model computes
what a full prefill would, up to summation order (float32: within 1e-4, see
tests/test_policy_engine_hf.py). Entries are kept least recently used first within
`prefix_cache_tokens` tokens in all; an entry that a newer one extends is dropped; new
weights clear the cache (its keys and values belong to the old ones).
A batch that would cost more laid out this way than prefilled whole (a row reusing much
beside a row reusing nothing: C + S wide where the longest prompt is L; the estimate is
`_reuse_pays`'s) runs prefilled whole, and its matches count in `stats["prefix_dropped"]`
(measured before this rule: 15-turn episodes of 17,000 tokens, 4 at once, in a cache of
32,768 tokens sampled at 0.59 x the speed without the cache;
benchmarks/results/long-context-obs-list_select-2026-11-28.md).

Weights are replaced between batches: `load_state_dict` from memory, or the
safetensors files of a checkpoint folder.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from arpo.errors import EngineError
from arpo.policy.engine import Engine, EngineConfig, SamplingParams, process_logits, to_pil
from arpo.policy.family import check_folder, load_model, stop_ids
from arpo.policy.prompt import forbidden_token_ids


@dataclass
class _Request:
    ids: list[int]
    images: list[Any]
    params: SamplingParams
    future: asyncio.Future = field(repr=False)


@dataclass
class _Prefix:
    """Keys and values the model computed for `ids` (one kept prefix-cache entry)."""

    key: int
    ids: Any
    """[n] int64 numpy: the tokens whose keys and values are held."""
    digests: tuple[bytes, ...]
    """Digest of each screenshot whose image block lies in `ids`, in order."""
    meta: list[Any]
    """Their per-image position data (`Family.encode_images`' third value)."""
    kv: list[tuple[Any, Any]]
    """Per layer (keys, values), each [1, kv heads, n, head dim]."""


@dataclass
class _Row:
    """How one request of a batch is run: what is reused and what is prefilled."""

    ids: Any
    """[n] int64 numpy: the whole prompt."""
    digests: tuple[bytes, ...]
    """Digests of its screenshots (empty with the prefix cache off)."""
    reused: int
    """Leading tokens whose keys and values come from the prefix cache."""
    matched: int
    """Leading tokens that `entry` covers: `reused`, or more when the batch runs
    prefilled whole (`_reuse_pays`) and reuses nothing."""
    entry: _Prefix | None
    """The kept entry matched."""
    meta: list[Any]
    """Per-image position data of all its screenshots (`Family.encode_images`)."""
    positions: Any
    """[axes, n] positions of the whole prompt (3 multimodal rotary axes for the Qwen
    families, 1 for SmolVLM: `Family.positions`)."""


def image_digest(image: Any) -> bytes:
    """A digest of a screenshot's content (PNG bytes as given, or a PIL image's pixels)."""
    h = hashlib.blake2b(digest_size=16)
    if isinstance(image, bytes | bytearray | memoryview):
        h.update(bytes(image))
    else:
        h.update(f"{image.mode}{image.size}".encode())
        h.update(image.tobytes())
    return h.digest()


class HFEngine(Engine):
    """A transformers vision-language model (`AutoModelForImageTextToText`, any family of
    `arpo.policy.family`) behind the `Engine` interface."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.model: Any = None
        self.processor: Any = None
        self._queue: asyncio.Queue[_Request] | None = None
        self._loop_task: asyncio.Task | None = None
        self._rng_seed = int(time.time_ns() & 0x7FFF_FFFF)
        self.stats = {
            "batches": 0, "requests": 0, "tokens": 0, "decode_s": 0.0,
            "prompt_tokens": 0, "prefix_hits": 0, "prefix_tokens": 0, "prefix_dropped": 0,
        }  # fmt: skip
        """Counters: batches run, requests served, tokens sampled, seconds spent in batches,
        prompt tokens read, requests that reused a kept prefix and the tokens they reused,
        requests whose match was not used because its batch ran cheaper prefilled whole."""
        self._prefixes: collections.OrderedDict[int, _Prefix] = collections.OrderedDict()
        self._prefix_ids = 0
        self._prefix_total = 0

    async def start(self) -> None:
        if self.model is not None:
            return
        await asyncio.to_thread(self._load)
        self._queue = asyncio.Queue()
        self._ensure_async()
        self._loop_task = asyncio.create_task(self._batch_loop(), name="hf-engine-batcher")

    def _load(self) -> None:
        import torch
        from transformers import AutoProcessor

        dtype = getattr(torch, self.config.dtype)
        try:
            self.family = check_folder(self.config.model)
        except ValueError as e:
            raise EngineError(str(e)) from None
        self.processor = AutoProcessor.from_pretrained(self.config.model)
        self.model = load_model(self.config.model, dtype).to(self.config.device)
        self.model.eval()
        self._tokenizer = self.processor.tokenizer
        self._forbidden = torch.tensor(forbidden_token_ids(self._tokenizer), dtype=torch.long)
        self._stop_default = stop_ids(self.family, self._tokenizer, self.model.generation_config)
        self.image_token_id = int(self.model.config.image_token_id)
        cfg = self.model.config
        self._hidden = int(getattr(cfg, "text_config", cfg).hidden_size)

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        if self._queue is not None:
            while not self._queue.empty():
                req = self._queue.get_nowait()
                if not req.future.done():
                    req.future.set_exception(EngineError("the engine was closed"))
        self.clear_prefix_cache()
        self.model = None

    async def _generate(
        self, ids: list[int], images: list[Any], params: SamplingParams
    ) -> tuple[Sequence[int], Sequence[float]]:
        if self._queue is None or self._loop_task is None:
            raise EngineError("the engine is not started (use `async with` or `await start()`)")
        if self._loop_task.done():
            raise EngineError("the engine's batch loop has died") from self._loop_task.exception()
        fut = asyncio.get_running_loop().create_future()
        await self._queue.put(_Request(ids, images, params, fut))
        return await fut

    async def _batch_loop(self) -> None:
        assert self._queue is not None
        wait = self.config.batch_wait_ms / 1000
        while True:
            batch = [await self._queue.get()]
            deadline = time.monotonic() + wait
            while len(batch) < self.config.max_batch_size:
                left = deadline - time.monotonic()
                try:
                    batch.append(
                        self._queue.get_nowait()
                        if left <= 0
                        else await asyncio.wait_for(self._queue.get(), left)
                    )
                except (TimeoutError, asyncio.QueueEmpty):
                    break
            t0 = time.perf_counter()
            try:
                results = await asyncio.to_thread(self._run_batch, batch)
            except Exception as e:  # a bad request fails its batch, never the loop
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(
                            e
                            if isinstance(e, EngineError)
                            else EngineError(f"generation failed: {e!r}")
                        )
                continue
            self.stats["batches"] += 1
            self.stats["requests"] += len(batch)
            self.stats["decode_s"] += time.perf_counter() - t0
            for r, res in zip(batch, results, strict=True):
                self.stats["tokens"] += len(res[0])
                if not r.future.done():
                    r.future.set_result(res)

    # -- the batch, in a worker thread -------------------------------------------------

    def _prepare(self, reqs: Sequence[_Request]) -> tuple[dict[str, Any], list[_Row], int, int]:
        """The first forward's inputs for a batch, each row's plan, and the widths (C, S)
        of the reused and the new blocks (see the module docstring)."""
        import torch
        from transformers import DynamicCache

        dev = self.config.device
        keep = self.config.prefix_cache_tokens > 0
        # Per request: ids, digests, tokens matched in the cache, the entry matched, and
        # the image blocks' starts.
        plans: list[tuple[np.ndarray, tuple[bytes, ...], int, _Prefix | None, np.ndarray]] = []
        for r in reqs:
            ids = np.asarray(r.ids, dtype=np.int64)
            pad = ids == self.image_token_id
            starts = np.flatnonzero(pad & ~np.r_[False, pad[:-1]])
            ends = np.flatnonzero(pad & ~np.r_[pad[1:], False]) + 1
            digests = tuple(image_digest(im) for im in r.images) if keep else ()
            matched, entry = 0, None
            if keep and len(starts) == len(r.images):
                matched, entry = self._match(ids, digests, starts, ends)
            plans.append((ids, digests, matched, entry, starts))
        use = self._reuse_pays(reqs, plans)
        if not use:
            self.stats["prefix_dropped"] += sum(p[2] > 0 for p in plans)
        # The first image each row encodes anew (those before come with the reused prefix).
        firsts = [int(np.searchsorted(p[4], p[2])) if use and p[2] else 0 for p in plans]
        new_images = [im for r, m in zip(reqs, firsts, strict=True) for im in r.images[m:]]
        pixels: dict[str, Any] = {}
        per_image: list[int] = []
        meta: list[Any] = []
        if new_images:
            pixels, per_image, meta = self.family.encode_images(
                self.processor, [to_pil(im) for im in new_images]
            )
            pixels = {
                k: v.to(dev, self.model.dtype) if v.is_floating_point() else v.to(dev)
                for k, v in pixels.items()
            }
        rows: list[_Row] = []
        k = 0
        for r, (ids, digests, matched, entry, _), m in zip(reqs, plans, firsts, strict=True):
            reused = matched if use else 0
            fresh = len(r.images) - m
            have = int((ids == self.image_token_id).sum())
            want = int((ids[:reused] == self.image_token_id).sum()) + sum(per_image[k : k + fresh])
            if have != want:
                raise EngineError(
                    f"the prompt has {have} image tokens but its {len(r.images)} image(s) need "
                    f"{want}: build prompts with arpo.policy.prompt (same min/max pixels as the "
                    "model's processor)"
                )
            row_meta = [*(entry.meta[:m] if m else []), *meta[k : k + fresh]]
            k += fresh
            t_ids = torch.from_numpy(ids)[None]
            positions = self.family.positions(self.model, t_ids, torch.ones_like(t_ids), row_meta)
            rows.append(_Row(ids, digests, reused, matched, entry, row_meta, positions[:, 0]))
        n = len(reqs)
        width_c = max(row.reused for row in rows)
        width_s = max(len(row.ids) - row.reused for row in rows)
        pad_id = int(self._tokenizer.pad_token_id or 0)
        input_ids = torch.full((n, width_s), pad_id, dtype=torch.long)
        mask = torch.zeros((n, width_c + width_s), dtype=torch.long)
        axes = self.family.rotary_axes
        position_ids = torch.ones((axes, n, width_s), dtype=torch.long)
        for i, row in enumerate(rows):
            c, s = row.reused, len(row.ids) - row.reused
            input_ids[i, width_s - s :] = torch.from_numpy(row.ids[c:])
            mask[i, width_c - c : width_c] = 1
            mask[i, width_c + width_s - s :] = 1
            position_ids[:, i, width_s - s :] = row.positions[:, c:]
        cache = DynamicCache(config=self.model.config)
        if width_c:
            ref = next(row.entry for row in rows if row.reused)
            for layer, (k0, v0) in enumerate(ref.kv):
                keys = k0.new_zeros((n, k0.shape[1], width_c, k0.shape[3]))
                values = v0.new_zeros((n, v0.shape[1], width_c, v0.shape[3]))
                for i, row in enumerate(rows):
                    if row.reused:
                        ek, ev = row.entry.kv[layer]
                        keys[i, :, width_c - row.reused :] = ek[0, :, : row.reused]
                        values[i, :, width_c - row.reused :] = ev[0, :, : row.reused]
                cache.update(keys.to(dev), values.to(dev), layer)
        inputs = {
            "input_ids": input_ids.to(dev),
            "attention_mask": mask.to(dev),
            "position_ids": self.family.model_positions(position_ids.to(dev)),
            "past_key_values": cache,
            **pixels,
        }
        return inputs, rows, width_c, width_s

    def _match(
        self, ids: np.ndarray, digests: tuple[bytes, ...], starts: np.ndarray, ends: np.ndarray
    ) -> tuple[int, _Prefix | None]:
        """The kept entry sharing the longest usable prefix with a prompt, and that length:
        token ids equal, every image block in it whole and showing the same screenshot, and
        at least the prompt's last token left to prefill (its logits sample the response)."""
        best, best_e = 0, None
        limit = len(ids) - 1
        for e in self._prefixes.values():
            n = min(len(e.ids), limit)
            if n <= best:
                continue
            differ = np.flatnonzero(e.ids[:n] != ids[:n])
            common = int(differ[0]) if len(differ) else n
            for j in range(int(np.searchsorted(starts, common))):
                if ends[j] > common or j >= len(e.digests) or e.digests[j] != digests[j]:
                    common = int(starts[j])
                    break
            if common > best:
                best, best_e = common, e
        return best, best_e

    def _reuse_pays(self, reqs: Sequence[_Request], plans: list) -> bool:
        """Whether the batch costs less with its matched prefixes than prefilled whole
        (False when nothing matched).

        The batch is laid out as its longest reused block C plus its longest new block S
        (module docstring), so a batch mixing a row that reuses much with a row that reuses
        nothing prefills S ~ the whole longest prompt L anyway, over C + S positions. Cost
        per layer, in units of one token attending one position: every token the batch runs
        (prefill then T sampled) attends its width and passes the projections and MLP,
        about 8 x hidden size positions' worth (2 x width x d against ~16 d^2 flops):
        reuse  (S + T) x (C + S + 8d),  whole  (L + T) x (L + 8d)."""
        c = max(p[2] for p in plans)
        if not c:
            return False
        lengths = [len(p[0]) for p in plans]
        s = max(n - p[2] for n, p in zip(lengths, plans, strict=True))
        big_l = max(lengths)
        t = max(r.params.max_new_tokens for r in reqs)
        k = 8 * self._hidden
        return (s + t) * (c + s + k) < (big_l + t) * (big_l + k)

    def _keep(
        self, rows: list[_Row], cache: Any, out_ids: list[list[int]], width_c: int, width_s: int
    ) -> None:
        """Keep each row's keys and values (prompt and response less its last token)."""
        import torch

        budget = self.config.prefix_cache_tokens
        for i, row in enumerate(rows):
            if row.entry is not None and row.entry.key in self._prefixes:  # rows may share one
                self._prefixes.move_to_end(row.entry.key)
                if row.matched == len(row.entry.ids):  # the new entry extends it
                    self._drop(row.entry.key)
            fed = len(out_ids[i]) - 1
            total = len(row.ids) + fed
            if total > budget:
                continue
            c, s = row.reused, len(row.ids) - row.reused
            cols = torch.cat([
                torch.arange(width_c - c, width_c),
                torch.arange(width_c + width_s - s, width_c + width_s + fed),
            ]).to(self.config.device)  # fmt: skip
            kv = [
                (layer.keys[i : i + 1].index_select(2, cols),
                 layer.values[i : i + 1].index_select(2, cols))
                for layer in cache.layers
            ]  # fmt: skip
            ids = np.concatenate([row.ids, np.asarray(out_ids[i][:fed], dtype=np.int64)])
            self._prefix_ids += 1
            self._prefixes[self._prefix_ids] = _Prefix(
                self._prefix_ids, ids, row.digests, row.meta, kv
            )
            self._prefix_total += total
            while self._prefix_total > budget:
                self._drop(next(iter(self._prefixes)))

    def _drop(self, key: int) -> None:
        e = self._prefixes.pop(key, None)
        if e is not None:
            self._prefix_total -= len(e.ids)

    def clear_prefix_cache(self) -> None:
        """Forget every kept prefix (new weights make their keys and values stale)."""
        self._prefixes.clear()
        self._prefix_total = 0

    def _run_batch(self, reqs: Sequence[_Request]) -> list[tuple[list[int], list[float]]]:
        import torch

        dev = self.config.device
        with torch.inference_mode():
            inputs, rows, width_c, width_s = self._prepare(reqs)
            n = len(reqs)
            for row in rows:
                self.stats["prompt_tokens"] += len(row.ids)
                self.stats["prefix_hits"] += row.reused > 0
                self.stats["prefix_tokens"] += row.reused
            temps = torch.tensor([r.params.temperature for r in reqs], device=dev)
            top_p = torch.tensor([r.params.top_p for r in reqs], device=dev)
            gens = []
            for r in reqs:
                g = torch.Generator(device=dev)
                if r.params.seed is not None:
                    g.manual_seed(r.params.seed)
                else:
                    self._rng_seed = (self._rng_seed * 6364136223846793005 + 1) % 2**63
                    g.manual_seed(self._rng_seed)
                gens.append(g)
            budget = [r.params.max_new_tokens for r in reqs]
            stops = [set(r.params.stop_token_ids) for r in reqs]
            out_ids: list[list[int]] = [[] for _ in reqs]
            out_lps: list[list[float]] = [[] for _ in reqs]
            done = [False] * n
            next_pos = torch.stack([row.positions.max() + 1 for row in rows]).to(dev)  # (B,)
            mask = inputs["attention_mask"]
            cache = inputs["past_key_values"]
            out = self.model(**inputs, use_cache=True, logits_to_keep=1)
            while True:
                logprobs = process_logits(out.logits[:, -1, :], temps, top_p, self._forbidden)
                step = torch.empty(n, dtype=torch.long, device=dev)
                for i in range(n):
                    if done[i]:
                        step[i] = int(self._tokenizer.pad_token_id or 0)
                        continue
                    if reqs[i].params.temperature <= 0:
                        tok = int(logprobs[i].argmax())
                    else:
                        tok = int(torch.multinomial(logprobs[i].exp(), 1, generator=gens[i]))
                    step[i] = tok
                    out_ids[i].append(tok)
                    out_lps[i].append(float(logprobs[i, tok]))
                    if tok in stops[i] or len(out_ids[i]) >= budget[i]:
                        done[i] = True
                if all(done):
                    break
                mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=dev)], dim=1)
                pos = next_pos.view(1, n, 1).expand(self.family.rotary_axes, n, 1)
                next_pos = next_pos + 1
                out = self.model(
                    input_ids=step.view(n, 1),
                    attention_mask=mask,
                    position_ids=self.family.model_positions(pos),
                    past_key_values=cache,
                    use_cache=True,
                )
            if self.config.prefix_cache_tokens:
                self._keep(rows, cache, out_ids, width_c, width_s)
        return list(zip(out_ids, out_lps, strict=True))

    # -- weights -----------------------------------------------------------------------

    async def _load_state_dict(self, state: Mapping[str, Any]) -> None:
        await asyncio.to_thread(self._apply_state_dict, state)

    def _apply_state_dict(self, state: Mapping[str, Any]) -> None:
        import torch

        self.clear_prefix_cache()
        with torch.no_grad():
            try:
                missing, unexpected = self.model.load_state_dict(dict(state), strict=False)
            except RuntimeError as e:  # shape mismatches
                raise EngineError(f"weights do not fit the model: {e}") from None
        if unexpected:
            raise EngineError(f"weights have names the model does not: {sorted(unexpected)[:5]}")
        if missing:
            raise EngineError(f"weights are missing parameters: {sorted(missing)[:5]}")

    async def _load_folder(self, path: Path) -> None:
        await asyncio.to_thread(self._apply_folder, path)

    def _apply_folder(self, path: Path) -> None:
        # from_pretrained maps the checkpoint's key names (which may be the original
        # Qwen2.5-VL layout) onto the model's; its state dict then loads in place.
        import torch

        if not any(path.glob("*.safetensors")):
            raise EngineError(f"no .safetensors files in {str(path)!r}")
        fresh = load_model(path, getattr(torch, self.config.dtype))
        self._apply_state_dict(fresh.state_dict())

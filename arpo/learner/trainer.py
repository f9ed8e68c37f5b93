"""One GRPO / ARPO training step on Qwen2.5-VL from stored trajectories.

    trainer = Trainer(TrainerConfig(model="runs/tiny"))
    metrics = trainer.step(batch)            # batch: arpo.learner.assemble.Batch
    blob = trainer.weights_bytes()           # safetensors stream for the actors

A step (the reference's 1 PPO epoch, 2 optimizer steps per iteration):

1. Sequences from the store items (`arpo.learner.batch`): the sampled token ids as
   they are, pixels from the PNGs, the loss mask over response tokens.
2. Proximal pass: one forward pass without gradient over the whole batch gives
   pi_prox, the log-probs under the weights before this step (and the reference
   model's log-probs when `loss.kl_coef > 0`).
3. The batch is cut into `optimizer_steps` mini-batches (in order, or shuffled with
   `shuffle`); each is run in micro-batches of `micro_batch` trajectories with
   gradient accumulation, then the gradient norm is clipped to `grad_clip` and AdamW
   steps. Each micro-batch's loss (`arpo.learner.loss.arpo_loss`) is scaled by its
   share of the mini-batch (trajectories with a loss token for `seq-mean-token-mean`,
   tokens for `token-mean`), so the accumulated gradient equals the gradient of the
   mini-batch's loss computed in one piece.

Defaults are the reference settings: AdamW lr 1e-6 constant, weight decay 0.01,
betas (0.9, 0.999), grad clip 1.0, 1 epoch, 2 optimizer steps per iteration,
rollout temperature 1.0. Deviations: none in the defaults; `lr_warmup_steps` (linear
warm-up, 0 by default) and `shuffle` are options the reference does not have.

Distributed (`arpo.learner.distributed`): under torchrun every rank builds the same
model and takes its share of every mini-batch; the loss scale uses the global
trajectory / token counts, so the averaged gradient equals the single-process one.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from arpo.config import fail, option, validate
from arpo.learner.assemble import Batch, Sample
from arpo.learner.batch import TrainSequence, build_sequence, collate, token_logprobs
from arpo.learner.loss import LossConfig, arpo_loss

log = logging.getLogger("arpo.learner.trainer")

_MEAN_METRICS = ("ratio/mean", "weight/fresh_mean", "weight/replay_mean", "weight/ess",
                 "weight/truncated_frac", "clip/low_frac", "clip/high_frac", "clip/dual_frac")  # fmt: skip


@dataclass
class TrainerConfig:
    """The model, the optimizer and how a step is cut into pieces."""

    model: str = option("", "Folder of the policy (Hugging Face Qwen2.5-VL checkpoint).")
    dtype: Literal["float32", "bfloat16"] = option(
        "float32", "Parameter dtype (bfloat16 on GPUs; float32 on CPUs)."
    )
    device: str = option("cpu", "Torch device of this process ('cuda' picks the local rank's).")
    lr: float = option(1e-6, "AdamW learning rate (the reference's, constant).")
    weight_decay: float = option(0.01, "AdamW weight decay.")
    betas: list[float] = option(doc="AdamW betas.", factory=lambda: [0.9, 0.999])
    adam_eps: float = option(1e-8, "AdamW epsilon.")
    lr_warmup_steps: int = option(0, "Linear warm-up over this many optimizer steps (0: none).")
    grad_clip: float = option(1.0, "Clip the global gradient norm to this (0: no clipping).")
    epochs: int = option(1, "Passes over each batch (PPO epochs).")
    optimizer_steps: int = option(2, "Mini-batches (optimizer steps) per epoch.")
    micro_batch: int = option(1, "Trajectories per forward / backward pass.")
    shuffle: bool = option(False, "Shuffle trajectories before cutting mini-batches.")
    temperature: float = option(
        1.0, "Rollout temperature: logits are divided by it, as the actors' log-probs were."
    )
    entropy: bool = option(True, "Log the policy's entropy over the response tokens.")
    gradient_checkpointing: bool = option(False, "Recompute activations in backward (memory).")
    seed: int = option(0, "Seed of the shuffling and of torch.")
    loss: LossConfig = option(LossConfig(), "The policy loss.")

    def validate(self) -> None:
        if not self.model:
            fail("model", "give the folder of a Qwen2.5-VL checkpoint")
        if self.lr <= 0:
            fail("lr", "must be > 0")
        if self.weight_decay < 0:
            fail("weight_decay", "must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            fail("betas", "must be two numbers in [0, 1), e.g. [0.9, 0.999]")
        if self.grad_clip < 0:
            fail("grad_clip", "must be >= 0 (0 turns clipping off)")
        if self.epochs < 1:
            fail("epochs", "must be >= 1")
        if self.optimizer_steps < 1:
            fail("optimizer_steps", "must be >= 1")
        if self.micro_batch < 1:
            fail("micro_batch", "must be >= 1")
        if self.temperature <= 0:
            fail("temperature", "must be > 0 (the rollout temperature, 1.0 in the reference)")
        if self.lr_warmup_steps < 0:
            fail("lr_warmup_steps", "must be >= 0")
        self.loss.validate()


def _chunks(seq: Sequence[int], n: int) -> list[list[int]]:
    """`seq` cut into n contiguous pieces of near-equal size (no empty piece)."""
    n = max(1, min(n, len(seq)))
    k, r = divmod(len(seq), n)
    out, start = [], 0
    for i in range(n):
        end = start + k + (1 if i < r else 0)
        out.append(list(seq[start:end]))
        start = end
    return out


def _pad(rows: list[torch.Tensor], n: int) -> torch.Tensor:
    out = torch.zeros((len(rows), n), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


class Trainer:
    """The policy, its optimizer, and the training step (see the module docstring)."""

    def __init__(self, config: TrainerConfig, dist: Any = None) -> None:
        from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

        config = validate(config)
        self.config = config
        self.dist = dist
        torch.manual_seed(config.seed)
        self._rng = random.Random(config.seed)
        dtype = getattr(torch, config.dtype)
        self.device = torch.device(config.device if dist is None else dist.device)
        self.processor = AutoProcessor.from_pretrained(config.model)
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(config.model, dtype=dtype)
        model.to(self.device)
        if config.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        model.config.use_cache = False
        self.base_model = model
        """The unwrapped model (its state dict names are the checkpoint's)."""
        self.model = model
        if dist is not None and dist.world_size > 1:
            from arpo.learner import distributed

            self.model = distributed.wrap_model(model, dist.config, dist)
        self.ref_model = None
        if config.loss.kl_coef > 0:
            self.ref_model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
                config.model, dtype=dtype
            ).to(self.device)
            self.ref_model.eval().requires_grad_(False)
        self.image_token_id = int(model.config.image_token_id)
        tok = self.processor.tokenizer
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else 0)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.lr,
            betas=(config.betas[0], config.betas[1]),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )
        warm = config.lr_warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0
        )
        self.optimizer_steps_done = 0

    # ---- pieces ------------------------------------------------------------------------

    def sequences(self, samples: Sequence[Sample]) -> list[TrainSequence]:
        return [
            build_sequence(s.item, self.processor, self.image_token_id, s.trajectory_id)
            for s in samples
        ]

    def _logprobs(
        self, model: Any, seqs: list[TrainSequence], grad: bool, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        mb = collate(seqs, self.base_model if model is self.model else model, self.pad_id,
                     self.device)  # fmt: skip
        with torch.set_grad_enabled(grad):
            logp, ent = token_logprobs(model, mb, self.config.temperature, entropy)
        return logp, ent, mb

    @torch.no_grad()
    def proximal(self, seqs: list[TrainSequence], model: Any = None) -> list[torch.Tensor]:
        """Log-probs of every sequence's response tokens under `model` (default: the
        policy as it is now), without gradient: one forward pass per micro-batch."""
        model = self.model if model is None else model
        out: list[torch.Tensor] = []
        for idx in _chunks(range(len(seqs)), math.ceil(len(seqs) / self.config.micro_batch)):
            part = [seqs[i] for i in idx]
            logp, _, _ = self._logprobs(model, part, grad=False)
            for row, s in enumerate(part):
                out.append(logp[row, : len(s.targets)].detach().float().cpu())
        return out

    # ---- the step ----------------------------------------------------------------------

    def step(self, batch: Batch | Sequence[Sample]) -> dict[str, float]:
        """One iteration on `batch` (all its samples): proximal pass, then `epochs` x
        `optimizer_steps` optimizer steps. Returns metrics (losses/*, time/*, ...)."""
        samples = list(batch.samples if isinstance(batch, Batch) else batch)
        if not samples:
            raise ValueError("step needs at least one sample")
        cfg = self.config
        times: dict[str, float] = {}
        t0 = time.perf_counter()
        seqs = self.sequences(samples)
        times["time/sequences_s"] = time.perf_counter() - t0

        self.model.train()  # no dropout in Qwen2.5-VL; train() only matters for checkpointing
        t0 = time.perf_counter()
        prox = self.proximal(seqs)
        ref = self.proximal(seqs, self.ref_model) if self.ref_model is not None else None
        times["time/proximal_forward_s"] = time.perf_counter() - t0

        adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
        replay = torch.tensor([s.is_replay for s in samples], dtype=torch.bool)
        acc: dict[str, list[tuple[float, float]]] = {}
        extremes = {"ratio/min": math.inf, "ratio/max": -math.inf}
        ent_sum = ent_n = 0.0
        grad_norms: list[float] = []
        t_fb = t_opt = 0.0
        for _ in range(cfg.epochs):
            order = list(range(len(samples)))
            if cfg.shuffle:
                self._rng.shuffle(order)
            for mini in _chunks(order, cfg.optimizer_steps):
                t0 = time.perf_counter()
                self.optimizer.zero_grad(set_to_none=True)
                has_tok = [i for i in mini if len(seqs[i].targets) > 0]
                denom = (
                    float(len(has_tok))
                    if cfg.loss.agg == "seq-mean-token-mean"
                    else float(sum(len(seqs[i].targets) for i in mini))
                )
                for micro in _chunks(mini, math.ceil(len(mini) / cfg.micro_batch)):
                    part = [seqs[i] for i in micro]
                    logp, ent, mb = self._logprobs(self.model, part, grad=True, entropy=cfg.entropy)
                    n = mb.mask.shape[1]
                    lp_prox = _pad([prox[i] for i in micro], n).to(self.device)
                    lp_ref = _pad([ref[i] for i in micro], n).to(self.device) if ref else None
                    loss, m = arpo_loss(
                        logp,
                        lp_prox,
                        mb.behaviour_logp,
                        adv[micro].to(self.device),
                        mb.mask,
                        replay[micro].to(self.device),
                        cfg.loss,
                        lp_ref,
                    )
                    share = (
                        float(sum(len(seqs[i].targets) > 0 for i in micro))
                        if cfg.loss.agg == "seq-mean-token-mean"
                        else float(m["tokens"])
                    )
                    scale = share / denom if denom else 0.0
                    (loss * scale).backward()
                    w = m["tokens"]
                    for k in (*_MEAN_METRICS, "loss/pg", "loss/kl"):
                        if k in m and not math.isnan(m[k]):
                            acc.setdefault(k, []).append((m[k], w))
                    acc.setdefault("loss/total", []).append((m["loss/total"] * scale, 1.0))
                    if w:
                        extremes["ratio/min"] = min(extremes["ratio/min"], m["ratio/min"])
                        extremes["ratio/max"] = max(extremes["ratio/max"], m["ratio/max"])
                    if ent is not None:
                        ent_sum += float(ent[mb.mask].sum())
                        ent_n += float(mb.mask.sum())
                t1 = time.perf_counter()
                t_fb += t1 - t0
                params = [p for p in self.model.parameters() if p.grad is not None]
                norm = torch.nn.utils.clip_grad_norm_(
                    params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
                )
                grad_norms.append(float(norm))
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer_steps_done += 1
                t_opt += time.perf_counter() - t1
        times["time/forward_backward_s"] = t_fb
        times["time/optimizer_s"] = t_opt

        out: dict[str, float] = {}
        for k, vals in acc.items():
            if k == "loss/total":
                # Summed over micro-batches (each scaled to its share), averaged over steps.
                out["losses/loss"] = sum(v for v, _ in vals) / (cfg.epochs * len(grad_norms) or 1)
                continue
            wsum = sum(w for _, w in vals)
            out[f"losses/{k.replace('/', '_')}"] = (
                sum(v * w for v, w in vals) / wsum if wsum else math.nan
            )
        finite = math.isfinite(extremes["ratio/min"])
        out["losses/ratio_min"] = extremes["ratio/min"] if finite else math.nan
        out["losses/ratio_max"] = extremes["ratio/max"] if finite else math.nan
        out["losses/entropy"] = ent_sum / ent_n if ent_n else math.nan
        out["losses/grad_norm"] = float(np.mean(grad_norms)) if grad_norms else math.nan
        out["losses/grad_norm_max"] = float(np.max(grad_norms)) if grad_norms else math.nan
        out["losses/lr"] = float(self.scheduler.get_last_lr()[0])
        tokens = sum(len(s.input_ids) for s in seqs)
        out["data/tokens"] = float(tokens)
        out["data/loss_tokens"] = float(sum(len(s.targets) for s in seqs))
        out.update(times)
        return out

    # ---- weights -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state dict on CPU (names as the checkpoint's)."""
        return {k: v.detach().cpu() for k, v in self.base_model.state_dict().items()}

    def weights_bytes(self) -> bytes:
        """The policy's weights as one safetensors stream (what actors load)."""
        from safetensors.torch import save

        return save({k: v.contiguous() for k, v in self.state_dict().items()})

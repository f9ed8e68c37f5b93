"""One GRPO / ARPO training step on Qwen2.5-VL from stored trajectories.

    trainer = Trainer(TrainerConfig(model="runs/tiny"))
    metrics = trainer.step(batch)            # batch: arpo.learner.assemble.Batch
    blob = trainer.weights_bytes()           # safetensors stream for the actors

A step (the reference's 1 PPO epoch, 2 optimizer steps per iteration):

1. Sequences from the store items (`arpo.learner.batch`): the sampled token ids as
   they are, pixels from the PNGs, the loss mask over response tokens.
2. Proximal pass: one forward pass without gradient gives pi_prox, the log-probs
   under the weights before this step, for every trajectory outside the first
   mini-batch; the first mini-batch trains on exactly those weights, so its own forward
   pass with gradient gives its pi_prox (detached) and it needs no pass of its own
   (`fuse_proximal`: with the reference's 2 optimizer steps that halves the proximal
   pass, with 1 it removes it). The reference model's log-probs, when
   `loss.kl_coef > 0` or `track_kl`, take one more pass.
3. The batch is cut into `optimizer_steps` mini-batches (in order, or shuffled with
   `shuffle`); each is run in micro-batches of `micro_batch` trajectories with
   gradient accumulation, then the gradient norm is clipped to `grad_clip` and AdamW
   steps. Each micro-batch's loss (`arpo.learner.loss.arpo_loss`) is scaled by its
   share of the mini-batch (trajectories with a loss token for `seq-mean-token-mean`,
   tokens for `token-mean`), so the accumulated gradient equals the gradient of the
   mini-batch's loss computed in one piece. Trajectories whose advantage is 0 on every
   token (`skip_flat`, on unless a KL term needs a reference model) are not forwarded:
   their loss and gradient are exactly 0 and they still count in that share, so the
   update is unchanged; a mini-batch left empty runs one pass scaled by 0 so that AdamW
   steps exactly as it would have.

Defaults are the reference settings: AdamW lr 1e-6 constant, weight decay 0.01,
betas (0.9, 0.999), grad clip 1.0, 1 epoch, 2 optimizer steps per iteration,
rollout temperature 1.0. Deviations: none in the defaults; `lr_warmup_steps` (linear
warm-up, 0 by default), `lr_decay_steps` (linear decay, 0 by default) and `shuffle` are
options the reference does not have.

Distributed (`arpo.learner.distributed`): under torchrun every rank builds the same
model and takes its share of every mini-batch; the loss scale uses the global
trajectory / token counts, so the averaged gradient equals the single-process one.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from arpo.config import MAX_TEMPERATURE, check_range, fail, model_problem, option, validate
from arpo.learner import distributed as D
from arpo.learner.assemble import MAX_STEP_TRAJECTORIES, Batch, Sample
from arpo.learner.batch import TrainSequence, build_sequence, collate, token_logprobs
from arpo.learner.distributed import DistConfig, DistInfo
from arpo.learner.loss import LossConfig, arpo_loss, behaviour_drift
from arpo.policy.family import TRAIN_LAYERS_DOC, freeze_below
from arpo.policy.prompt import forbidden_token_ids

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
    lr_decay_steps: int = option(
        0,
        "Linear decay of the learning rate to lr_min_ratio x lr over this many optimizer "
        "steps after the warm-up, then constant (0: no decay, the reference).",
    )
    lr_min_ratio: float = option(0.0, "Where the decay ends, as a fraction of lr.")
    grad_clip: float = option(1.0, "Clip the global gradient norm to this (0: no clipping).")
    epochs: int = option(1, "Passes over each batch (PPO epochs).")
    optimizer_steps: int = option(2, "Mini-batches (optimizer steps) per epoch.")
    micro_batch: int = option(1, "Trajectories per forward / backward pass.")
    shuffle: bool = option(False, "Shuffle trajectories before cutting mini-batches.")
    temperature: float = option(
        1.0,
        "Rollout temperature: logits are divided by it, as the actors' log-probs were. The "
        "learner owns it: every task grant carries it and actors sample with it.",
    )
    top_p: float = option(
        1.0,
        "Rollout nucleus, carried by every grant like temperature. Only 1.0: the learner "
        "scores the full softmax, so a nucleus could not be scored exactly.",
    )
    entropy: bool = option(True, "Log the policy's entropy over the response tokens.")
    skip_flat: bool = option(
        True,
        "Leave trajectories whose advantage is 0 on every token (a group whose episodes "
        "all scored the same) out of the forward and backward passes: their loss and "
        "gradient are exactly 0, and they still count in the mean over trajectories (or "
        "tokens), so the update is the same; the policy's entropy and the ratio metrics "
        "then cover the trained trajectories only. Off when a reference model is loaded "
        "(the KL term has a gradient at any advantage).",
    )
    fuse_proximal: bool = option(
        True,
        "Take the first mini-batch's proximal log-probs from its own forward pass (the "
        "weights have not moved yet; same values, one forward pass fewer); false runs the "
        "proximal pass over the whole batch.",
    )
    ref_model: str = option(
        "",
        "The reference model of the KL term and of `track_kl` ('' = `model`, the starting "
        "policy; the learner keeps it across a resume).",
    )
    track_kl: bool = option(
        False,
        "Log the KL estimate to the reference model (losses/loss_kl) even when loss.kl_coef "
        "is 0 (costs one more forward pass per trajectory).",
    )
    gradient_checkpointing: bool = option(False, "Recompute activations in backward (memory).")
    train_layers: int = option(0, TRAIN_LAYERS_DOC)
    seed: int = option(0, "Seed of the shuffling and of torch.")
    loss: LossConfig = option(LossConfig(), "The policy loss.")

    def validate(self) -> None:
        if not self.model:
            fail("model", "give the folder of a Qwen2.5-VL checkpoint")
        if problem := model_problem(self.model):
            fail("model", problem)
        if self.ref_model and (problem := model_problem(self.ref_model)):
            fail("ref_model", problem)
        try:
            torch.device(self.device)
        except (RuntimeError, ValueError) as e:
            fail("device", f"{self.device!r} is not a torch device ({e}); e.g. 'cpu', 'cuda'")
        check_range("lr", self.lr, 0, MAX_LR, "the AdamW learning rate", lo_open=True)
        if self.train_layers < 0:
            fail("train_layers", "must be >= 0 (0: train every weight)")
        check_range("weight_decay", self.weight_decay, 0, 1, "AdamW's decoupled weight decay")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            fail("betas", "must be two numbers in [0, 1), e.g. [0.9, 0.999]")
        check_range("adam_eps", self.adam_eps, 0, 1, "AdamW's epsilon", lo_open=True)
        if self.grad_clip < 0:
            fail("grad_clip", "must be >= 0 (0 turns clipping off)")
        check_range("epochs", self.epochs, 1, MAX_EPOCHS, "passes over each batch")
        check_range(
            "optimizer_steps",
            self.optimizer_steps,
            1,
            MAX_STEP_TRAJECTORIES,
            "mini-batches per epoch",
        )
        check_range(
            "micro_batch",
            self.micro_batch,
            1,
            MAX_STEP_TRAJECTORIES,
            "trajectories per forward / backward pass",
        )
        check_range(
            "temperature",
            self.temperature,
            0,
            MAX_TEMPERATURE,
            "the rollout temperature, 1.0 in the reference",
            lo_open=True,
        )
        check_range("seed", self.seed, 0, 2**63 - 1, "torch takes seeds in [0, 2**64)")
        if self.top_p != 1.0:
            fail(
                "top_p",
                f"is {self.top_p}, but the learner scores log-probs of the full softmax at "
                "trainer.temperature: rollouts sampled from a nucleus (top_p < 1) cannot be "
                "scored exactly; set trainer.top_p = 1.0 (actors then sample with top_p 1.0)",
            )
        check_range(
            "lr_warmup_steps",
            self.lr_warmup_steps,
            0,
            MAX_SCHEDULE_STEPS,
            "optimizer steps; 0: no warm-up",
        )
        check_range(
            "lr_decay_steps",
            self.lr_decay_steps,
            0,
            MAX_SCHEDULE_STEPS,
            "optimizer steps; 0: no decay",
        )
        if not 0.0 <= self.lr_min_ratio <= 1.0:
            fail("lr_min_ratio", "must be in [0, 1]")
        self.loss.validate()


MAX_LR = 1.0
"""Largest learning rate accepted: AdamW moves every weight by about `lr` per step, so at
1 each step overwrites the weights (fine-tuning a VLM takes 1e-7 to 1e-4)."""
MAX_SCHEDULE_STEPS = 10_000_000
"""Longest learning-rate warm-up or decay, in optimizer steps (months of training at a step
a second): a warm-up of a few zeros more would keep the learning rate at about 0 for ever."""
MAX_EPOCHS = 100
"""Most passes over one batch (PPO epochs; the reference makes 1): more trains the same
trajectories far off-policy, where the clipped ratios stop every gradient anyway."""


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


def _flat(samples: Sequence[Any], tok_adv: dict[int, torch.Tensor | None]) -> set[int]:
    """The indices of `tok_adv` (a sample's per-token advantages, None: one for all) whose
    advantage is 0 on every token they train (`skip_flat`): with no KL term their loss and
    gradient are exactly 0."""
    return {i for i, tok in tok_adv.items()
            if (samples[i].advantage == 0.0 if tok is None
                else bool(torch.all(torch.isnan(tok) | (tok == 0))))}  # fmt: skip


def _token_advantages(sample: Any, seq: Any) -> torch.Tensor | None:
    """[N] advantages of a sample's response tokens from its per-turn advantages (NaN: a
    token another sample trains), or None when it has one advantage for every token."""
    per_turn = getattr(sample, "turn_advantages", None)
    if per_turn is None or seq.turn_index is None:
        return None
    t = torch.as_tensor(np.asarray(per_turn, dtype=np.float32))
    if len(seq.turn_index) and int(seq.turn_index.max()) >= len(t):
        raise ValueError(
            f"trajectory {sample.trajectory_id}: {len(t)} turn advantages for "
            f"{int(seq.turn_index.max()) + 1} turns"
        )
    return t[seq.turn_index]


def _pad(rows: list[torch.Tensor], n: int) -> torch.Tensor:
    out = torch.zeros((len(rows), n), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def lr_factor(config: TrainerConfig, step: int) -> float:
    """The learning rate's multiplier at optimizer step `step` (0-based): linear warm-up
    over `lr_warmup_steps`, then linear decay to `lr_min_ratio` over `lr_decay_steps`."""
    warm, decay = config.lr_warmup_steps, config.lr_decay_steps
    f = min(1.0, (step + 1) / warm) if warm else 1.0
    if decay:
        done = min(1.0, max(0, step - warm) / decay)
        f *= 1.0 - (1.0 - config.lr_min_ratio) * done
    return f


class Trainer:
    """The policy, its optimizer, and the training step (see the module docstring).

    `dist` (an `arpo.learner.distributed.DistInfo`) makes this one rank of a torchrun
    job: the model is wrapped (FSDP2 / DDP) and `step`, `proximal`, `state_dict` and
    `optimizer_state` become collectives that every rank calls with the same batch."""

    def __init__(self, config: TrainerConfig, dist: DistInfo | None = None) -> None:
        from transformers import AutoProcessor

        from arpo.policy.family import load_model

        config = validate(config)
        self.config = config
        if dist is None:
            dist = DistInfo(0, 1, 0, torch.device(config.device), True, DistConfig())
        self.dist = dist
        torch.manual_seed(config.seed)
        self._rng = random.Random(config.seed)
        dtype = getattr(torch, config.dtype)
        self.device = dist.device
        self.processor = AutoProcessor.from_pretrained(config.model)
        model = load_model(config.model, dtype)
        model.to(self.device)
        freeze_below(model, config.train_layers)
        if config.gradient_checkpointing:
            # Not re-entrant: a re-entrant checkpoint whose inputs need no gradient (the
            # frozen layers' output, with train_layers) would give its weights none either.
            model.gradient_checkpointing_enable({"use_reentrant": False})
        model.config.use_cache = False
        self.base_model = model
        """The unwrapped model: its config, its positions, and (single process) weights."""
        self.model = D.wrap_model(model, dist.config, dist) if dist.distributed else model
        self.ref_model = None
        if config.loss.kl_coef > 0 or config.track_kl:
            self.ref_model = load_model(config.ref_model or config.model, dtype).to(self.device)
            self.ref_model.eval().requires_grad_(False)
        self.image_token_id = int(model.config.image_token_id)
        self.forbidden = torch.tensor(
            forbidden_token_ids(self.processor.tokenizer), dtype=torch.long
        )
        """Token ids no response may hold (vision placeholders): -inf when scoring, as the
        engines mask them when sampling."""
        tok = self.processor.tokenizer
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else 0)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.lr,
            betas=(config.betas[0], config.betas[1]),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, functools.partial(lr_factor, config)
        )
        self.optimizer_steps_done = 0
        self.nonfinite_steps = 0
        """Optimizer steps refused because the gradient was not finite."""

    # ---- pieces ------------------------------------------------------------------------

    def sequences(self, samples: Sequence[Sample]) -> list[TrainSequence]:
        return [
            build_sequence(s.item, self.processor, self.image_token_id, s.trajectory_id)
            for s in samples
        ]

    def _logprobs(
        self, model: Any, seqs: list[TrainSequence], grad: bool, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        base = self.base_model if model is self.model else model
        mb = collate(seqs, base, self.pad_id, self.device)
        with torch.set_grad_enabled(grad):
            logp, ent = token_logprobs(
                model, mb, self.config.temperature, entropy, forbidden=self.forbidden
            )
        return logp, ent, mb

    def _micro(self, idx: list[int]) -> list[list[int]]:
        return _chunks(idx, math.ceil(len(idx) / self.config.micro_batch)) if idx else []

    @torch.no_grad()
    def proximal(
        self, seqs: list[TrainSequence], model: Any = None, dummy: TrainSequence | None = None
    ) -> list[torch.Tensor]:
        """Log-probs of every sequence's response tokens under `model` (default: the
        policy as it is now), without gradient: one forward pass per micro-batch. Under
        torchrun every rank runs as many passes as the busiest (repeating `dummy`)."""
        model = self.model if model is None else model
        out: list[torch.Tensor] = []
        chunks = self._micro(list(range(len(seqs))))
        n = D.max_count(len(chunks), self.dist) if model is self.model else len(chunks)
        for k in range(n):
            if k >= len(chunks):  # keeps FSDP's collectives in step with the other ranks
                self._logprobs(model, [dummy if dummy is not None else seqs[0]], grad=False)
                continue
            part = [seqs[i] for i in chunks[k]]
            logp, _, _ = self._logprobs(model, part, grad=False)
            for row, s in enumerate(part):
                out.append(logp[row, : len(s.targets)].detach().float().cpu())
        return out

    # ---- the step ----------------------------------------------------------------------

    def step(self, batch: Batch | Sequence[Sample]) -> dict[str, float]:
        """One iteration on `batch` (all its samples): proximal pass, then `epochs` x
        `optimizer_steps` optimizer steps. Returns metrics (losses/*, time/*, ...).
        Under torchrun every rank passes the same batch and trains on its share."""
        samples = list(batch.samples if isinstance(batch, Batch) else batch)
        if not samples:
            raise ValueError("step needs at least one sample")
        cfg, info = self.config, self.dist
        seq_mean = cfg.loss.agg == "seq-mean-token-mean"
        times: dict[str, float] = {}

        # The mini-batches are the same on every rank (same seed, same batch); each rank
        # trains on its contiguous share of each.
        order = list(range(len(samples)))
        plans = []
        for _ in range(cfg.epochs):
            if cfg.shuffle:
                self._rng.shuffle(order)
            plans += [D.shard_batch(mini, info) for mini in _chunks(order, cfg.optimizer_steps)]
        mine = sorted({i for plan in plans for i in plan})
        t0 = time.perf_counter()
        made = batch.sequences if isinstance(batch, Batch) else None
        if made is not None and len(made) == len(samples):
            seqs = {i: made[i] for i in mine}  # made ahead, while the previous step trained
        else:
            seqs = dict(zip(mine, self.sequences([samples[i] for i in mine]), strict=True))
        dummy = seqs[mine[0]] if mine else self.sequences(samples[:1])[0]
        times["time/sequences_s"] = time.perf_counter() - t0

        self.model.train()  # no dropout in Qwen2.5-VL; train() matters for checkpointing
        t0 = time.perf_counter()
        # The first mini-batch trains on the weights before the step: its forward pass with
        # gradient gives its proximal log-probs (detached), so only the others need a pass.
        first = set(plans[0]) if cfg.fuse_proximal and plans else set()
        tok_adv = {i: _token_advantages(samples[i], seqs[i]) for i in mine}
        flat = _flat(samples, tok_adv) if cfg.skip_flat and self.ref_model is None else set()
        rest = [i for i in mine if i not in first and i not in flat]
        prox = dict(zip(rest, self.proximal([seqs[i] for i in rest], dummy=dummy), strict=True))
        ref = None
        if self.ref_model is not None:
            ordered = [seqs[i] for i in mine]
            ref = dict(zip(mine, self.proximal(ordered, self.ref_model), strict=True))
        times["time/proximal_forward_s"] = time.perf_counter() - t0

        adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
        replay = torch.tensor([s.is_replay for s in samples], dtype=torch.bool)
        trained = {i: len(seqs[i].targets) if tok_adv[i] is None
                   else int((~torch.isnan(tok_adv[i])).sum()) for i in mine}  # fmt: skip
        acc: dict[str, list[tuple[float, float]]] = {}
        ratio_min, ratio_max = math.inf, -math.inf
        loss_sum = ent_sum = ent_n = 0.0
        grad_norms: list[float] = []
        lrs: list[float] = []  # the rate of each optimizer step
        t_fb = t_opt = 0.0
        for pi, plan in enumerate(plans):
            t0 = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=True)
            count = (lambda i: float(trained.get(i, 0) > 0)) if seq_mean else (
                lambda i: float(trained.get(i, 0)))  # fmt: skip
            denom = D.global_count(sum(count(i) for i in plan), info)  # flat ones count
            micros = self._micro([i for i in plan if i not in flat])
            # At least one pass: a mini-batch that is all flat runs one pass scaled by 0,
            # so every parameter the step trains has a (zero) gradient and AdamW steps as
            # it would have on the full mini-batch (its moments and weight decay move).
            n_micro = max(1, D.max_count(len(micros), info))
            for k in range(n_micro):
                real = k < len(micros)
                part_idx = micros[k] if real else [mine[0] if mine else 0]
                part = [seqs.get(i, dummy) for i in part_idx]
                logp, ent, mb = self._logprobs(self.model, part, grad=True, entropy=cfg.entropy)
                n = mb.mask.shape[1]
                if pi == 0 and real and first:
                    for row, i in enumerate(part_idx):
                        prox[i] = logp[row, : len(seqs[i].targets)].detach().float().cpu()
                lp_prox = _pad([prox.get(i, dummy.behaviour_logp) for i in part_idx], n)
                lp_ref = _pad([ref[i] for i in part_idx], n) if ref is not None else None
                a_mb, mask = adv[part_idx].to(self.device), mb.mask
                if real and any(tok_adv[i] is not None for i in part_idx):
                    rows = [tok_adv[i] if tok_adv[i] is not None
                            else adv[i].expand(len(seqs[i].targets)) for i in part_idx]  # fmt: skip
                    a_tok = _pad(rows, n).to(self.device)
                    keep = ~torch.isnan(a_tok)
                    mask = mask & keep
                    a_mb = torch.where(keep, a_tok, torch.zeros_like(a_tok))
                loss, m = arpo_loss(
                    logp,
                    lp_prox.to(self.device),
                    mb.behaviour_logp,
                    a_mb,
                    mask,
                    replay[part_idx].to(self.device),
                    cfg.loss,
                    lp_ref.to(self.device) if lp_ref is not None else None,
                )
                share = sum(count(i) for i in part_idx) if real else 0.0
                scale = D.loss_scale(share, denom, info)
                with D.grad_sync(self.model, k == n_micro - 1):
                    (loss * scale).backward()
                if not real:
                    continue
                loss_sum += m["loss/total"] * share / denom if denom else 0.0
                w = m["tokens"]
                for key in (*_MEAN_METRICS, "loss/pg", "loss/kl"):
                    if key in m and not math.isnan(m[key]):
                        acc.setdefault(key, []).append((m[key], w))
                if w:
                    ratio_min = min(ratio_min, m["ratio/min"])
                    ratio_max = max(ratio_max, m["ratio/max"])
                if ent is not None:
                    ent_sum += float(ent[mb.mask].sum())
                    ent_n += float(mb.mask.sum())
            t1 = time.perf_counter()
            t_fb += t1 - t0
            clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
            norm = D.clip_grad_norm(self.model, clip, info)  # the same on every rank
            grad_norms.append(norm)
            lrs.append(float(self.optimizer.param_groups[0]["lr"]))
            if not math.isfinite(norm):
                # A NaN or infinite gradient would write NaN into every weight it touches
                # (and into Adam's moments): the step is refused, the weights stay as they were.
                self.optimizer.zero_grad(set_to_none=True)
                self.nonfinite_steps += 1
                log.error("optimizer step refused: the gradient's norm is %s", norm)
                t_opt += time.perf_counter() - t1
                continue
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer_steps_done += 1
            t_opt += time.perf_counter() - t1
        times["time/forward_backward_s"] = t_fb
        times["time/optimizer_s"] = t_opt
        scored = [i for i in mine if i in prox]  # the flat ones were not forwarded
        drift = behaviour_drift(
            [prox[i] for i in scored],
            [seqs[i].behaviour_logp for i in scored],
            [samples[i].is_replay for i in scored],
            cfg.loss.w_max,
        )

        # Per-rank values; the mean over ranks (NaN ranks left out) is the batch's value
        # for the loss (each rank's sum is already scaled by its share) and close to it
        # for the token-weighted means.
        out: dict[str, float] = {"losses/loss": loss_sum / len(grad_norms)}
        names = (*_MEAN_METRICS, "loss/pg", *(("loss/kl",) if self.ref_model is not None else ()))
        for k in names:  # the same names on every rank (NaN: nothing measured here)
            vals = acc.get(k, [])
            wsum = sum(w for _, w in vals)
            out[f"losses/{k.replace('/', '_')}"] = (
                sum(v * w for v, w in vals) / wsum if wsum else math.nan
            )
        out["losses/entropy"] = ent_sum / ent_n if ent_n else math.nan
        out = D.all_reduce_mean(out, info)
        out["losses/loss"] *= info.world_size  # the sum over ranks of the scaled shares
        # Extremes of this rank's share (rank 0's under torchrun).
        out["losses/ratio_min"] = ratio_min if math.isfinite(ratio_min) else math.nan
        out["losses/ratio_max"] = ratio_max if math.isfinite(ratio_max) else math.nan
        out["losses/grad_norm"] = float(np.mean(grad_norms))
        out["losses/grad_norm_max"] = float(np.max(grad_norms))
        out["losses/steps_refused"] = float(sum(not math.isfinite(g) for g in grad_norms))
        out["losses/lr"] = float(np.mean(lrs))
        out["data/tokens"] = D.global_count(sum(len(seqs[i].input_ids) for i in mine), info)
        out["data/loss_tokens"] = D.global_count(sum(len(seqs[i].targets) for i in mine), info)
        out["data/flat_skipped"] = D.global_count(len(flat), info)
        out.update(drift)  # this rank's share (rank 0's under torchrun)
        out.update(times)
        return out

    # ---- weights -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full model state dict on CPU (names as the checkpoint's); under torchrun a
        collective that returns it on rank 0 and None elsewhere."""
        return D.full_state_dict(self.model, self.dist)

    def weights_bytes(self) -> bytes | None:
        """The policy's weights as one safetensors stream (what actors load); a collective
        under torchrun (None except on rank 0)."""
        from safetensors.torch import save

        state = self.state_dict()
        if state is None:
            return None
        return save({k: v.contiguous() for k, v in state.items()})

    def optimizer_state(self) -> dict[str, Any] | None:
        """The full optimizer state keyed by parameter name (loads into any world size);
        a collective under torchrun (None except on rank 0)."""
        return D.optimizer_state(self.model, self.optimizer, self.dist)

    def load_optimizer_state(self, state: dict[str, Any] | None) -> None:
        D.load_optimizer_state(self.model, self.optimizer, state, self.dist)

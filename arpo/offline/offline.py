"""The offline baselines of the ARPO paper: DPO, KTO and rejection-sampling fine-tuning (RFT).

    arpo offline --algo dpo data=runs/collect-base model=runs/sft out=runs/dpo
    arpo offline --algo kto data=runs/collect-base model=runs/sft out=runs/kto lr=1e-5
    arpo offline --algo rft data=runs/collect-base model=runs/sft out=runs/rft

    trainer = OfflineTrainer(OfflineConfig(algo="dpo", model="runs/sft", data="...", out="..."))
    history = trainer.train(trajectories)      # any iterable of arpo.record.Trajectory
    trainer.save("runs/dpo")

Data: trajectories collected from the base agent (`arpo collect`'s folder, read with
`arpo.offline.data.read_trajectories`), ok status only; a success has checker score >=
`success_score`. What each method trains on:

- dpo: pairs (success, failure) of the same task (`pairing`: every success with every
  failure, at most `max_pairs_per_task` per task, or shuffled one-to-one); a task without
  a success or without a failure gives no pair and is counted and logged;
- kto: every success (desirable) and every failure (undesirable), unpaired;
- rft: the successes only, trained with the token-mean NLL (the same loss as `arpo sft`).

A trajectory the model cannot take (`arpo.learner.batch.check_item`: e.g. a sampled
<|image_pad|> in a response) is left out, counted (`excluded_unusable`) and logged.

Sequences are built exactly as the learner builds them (`arpo.learner.batch`:
`build_sequence` from the stored token ids and PNGs, `collate`, `token_logprobs` at
temperature 1): nothing is re-tokenised. A trajectory's log-probability is the sum over
all its response tokens, every turn of the episode. The formulas are in
`arpo.offline.losses`.

Reference model (dpo, kto): `ref_model`, by default the same folder as `model`, loaded a
second time, in eval mode, with requires_grad off; its log-probs of every trajectory are
computed once (no gradient) and cached by trajectory id.

Optimisation mirrors the learner's `Trainer`: AdamW (weight decay 0.01, betas 0.9/0.999),
gradient norm clipped to `grad_clip`, a constant learning rate; each optimizer step
takes `batch_size` units (pairs for dpo, trajectories for kto / rft) in micro-batches of
`micro_batch` units with gradient accumulation, each micro-batch's loss scaled by its
share of the step (pairs, trajectories, or response tokens for rft), so the accumulated
gradient equals the gradient of the step's loss in one piece. KTO's reference point z0 is
estimated per optimizer step from a no-gradient pass of the policy over the whole step
(so it does not depend on the micro-batch size).

Learning rate: 1e-6 by default, the rate of the ARPO reference's RL runs, so that the
baselines move the real 7B model as far per step as ARPO does. The tiny test model moves
at that rate too (measured, 5 DPO steps on one pair of 1-turn trajectories, beta 0.1: the
margin (pi_c - pi_r) rises by 0.84 nats at lr 1e-6 with the loss 0.693 -> 0.660, by 8.4 at
1e-5, by 61 at 1e-4 where the loss is near 0); the tests use 1e-4 so that one step gives
a clear signal.

Deviation from the paper's offline baselines: the paper does not give their
hyper-parameters; the defaults here are the method papers' (beta 0.1, lambda_d = lambda_u
= 1) with the reference's optimizer settings.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Literal

import torch

from arpo import store_item
from arpo.config import fail, option, to_dict, validate
from arpo.errors import ArpoError, ConfigError
from arpo.learner.batch import (
    TrainSequence,
    build_sequence,
    check_item,
    collate,
    token_logprobs,
)
from arpo.offline.data import Outcomes, dpo_pairs, read_trajectories, split_outcomes
from arpo.offline.losses import dpo_loss, kto_kl_estimate, kto_loss, nll_loss, sequence_logps
from arpo.policy.family import TRAIN_LAYERS_DOC, freeze_below
from arpo.record import Trajectory

log = logging.getLogger("arpo.offline")


@dataclass
class OfflineConfig:
    """`arpo offline`: one offline method on a folder of collected trajectories."""

    # `max_steps` is an episode's turns everywhere else (`actor.episode.max_steps`).
    renamed_fields: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"max_steps": "max_optimizer_steps"}
    )

    algo: Literal["dpo", "kto", "rft"] = option("dpo", "Method: dpo, kto or rft.")
    model: str = option("", "Folder of the starting policy (Qwen2.5-VL checkpoint).")
    ref_model: str = option("", "Folder of the frozen reference model (dpo, kto); '' = model.")
    data: str = option("", "Folder of trajectories (arpo collect's output, or demos).")
    out: str = option("", "Folder the trained model and processor are saved to.")
    dtype: Literal["float32", "bfloat16"] = option("float32", "Parameter dtype.")
    device: str = option("cpu", "Torch device.")
    success_score: float = option(1.0, "A trajectory with checker score >= this is a success.")
    beta: float = option(0.1, "DPO / KTO temperature of the implicit reward.")
    dpo_loss: Literal["sigmoid", "ipo"] = option("sigmoid", "DPO variant: sigmoid (paper) or ipo.")
    label_smoothing: float = option(0.0, "Conservative DPO: assumed label-flip rate in [0, 0.5).")
    kto_lambda_d: float = option(1.0, "KTO weight of desirable (successful) trajectories.")
    kto_lambda_u: float = option(1.0, "KTO weight of undesirable (failed) trajectories.")
    kto_balance: bool = option(
        True,
        "KTO: scale the desirable weight to kto_lambda_d * n_u / n_d so that both sides weigh "
        "the same in total (the KTO paper keeps lambda_d n_d / lambda_u n_u in [1, 4/3]; with "
        "sparse successes, equal weights let the failures drown them); false: as given.",
    )
    pairing: Literal["all", "one-to-one"] = option(
        "all", "DPO pairs: every success x failure of a task, or shuffled one-to-one."
    )
    max_pairs_per_task: int = option(16, "DPO: at most this many pairs per task (random pick).")
    lr: float = option(1e-6, "AdamW learning rate (the reference's; the tiny model needs 1e-4).")
    weight_decay: float = option(0.01, "AdamW weight decay.")
    grad_clip: float = option(1.0, "Clip the global gradient norm to this (0: no clipping).")
    epochs: int = option(1, "Passes over the data.")
    batch_size: int = option(8, "Units (dpo pairs, kto / rft trajectories) per optimizer step.")
    micro_batch: int = option(1, "Units per forward / backward pass (dpo: 2 sequences each).")
    max_optimizer_steps: int = option(
        0, "Stop after this many optimizer steps (0: run all epochs)."
    )
    target_nll: float = option(
        0.0,
        "rft: stop after the first epoch whose trajectories' mean NLL per response token is "
        "at most this (0: run all epochs). Fits a warm start to a level, not a step count.",
    )
    train_layers: int = option(0, TRAIN_LAYERS_DOC)
    seed: int = option(0, "Seed of shuffling, pairing and torch.")
    log_every: int = option(10, "Log a progress line every this many optimizer steps.")

    def validate(self) -> None:
        if not self.model:
            fail("model", "give the folder of a Qwen2.5-VL checkpoint (e.g. runs/sft)")
        if self.train_layers < 0:
            fail("train_layers", "must be >= 0 (0: train every weight)")
        if self.beta <= 0:
            fail("beta", "must be > 0 (0.1 in the DPO and KTO papers)")
        if not 0 <= self.label_smoothing < 0.5:
            fail("label_smoothing", "must be in [0, 0.5) (0: the paper's DPO)")
        if self.kto_lambda_d <= 0 or self.kto_lambda_u <= 0:
            fail("kto_lambda_d", "KTO weights kto_lambda_d and kto_lambda_u must be > 0")
        if not 0 < self.success_score <= 1:
            fail("success_score", "must be in (0, 1] (checker scores are in [0, 1])")
        if self.max_pairs_per_task < 1:
            fail("max_pairs_per_task", "must be >= 1")
        if self.lr <= 0:
            fail("lr", "must be > 0")
        if self.weight_decay < 0:
            fail("weight_decay", "must be >= 0")
        if self.grad_clip < 0:
            fail("grad_clip", "must be >= 0 (0 turns clipping off)")
        if self.epochs < 1:
            fail("epochs", "must be >= 1")
        if self.batch_size < 1:
            fail("batch_size", "must be >= 1")
        if self.micro_batch < 1:
            fail("micro_batch", "must be >= 1")
        if self.max_optimizer_steps < 0:
            fail("max_optimizer_steps", "must be >= 0 (0: no limit)")
        if self.target_nll < 0:
            fail("target_nll", "must be >= 0 (0: no target, run all epochs)")
        if self.target_nll and self.algo != "rft":
            fail("target_nll", "applies to algo 'rft' only (a mean NLL of the data it fits)")
        if self.log_every < 1:
            fail("log_every", "must be >= 1")


def _chunks(seq: Sequence[Any], size: int) -> list[list[Any]]:
    return [list(seq[i : i + size]) for i in range(0, len(seq), size)]


def response_tokens(traj: Trajectory) -> int:
    return sum(len(t.response_ids) for t in traj.turns)


class OfflineTrainer:
    """The policy, the frozen reference, AdamW and the per-method steps (see module doc)."""

    def __init__(self, config: OfflineConfig) -> None:
        from transformers import AutoProcessor

        from arpo.policy.family import load_model

        config = validate(config)
        self.config = config
        torch.manual_seed(config.seed)
        self._rng = random.Random(config.seed)
        self.kto_lambda_d = config.kto_lambda_d  # kto_balance rescales it in train()
        dtype = getattr(torch, config.dtype)
        self.device = torch.device(config.device)
        self.processor = AutoProcessor.from_pretrained(config.model)
        self.model = load_model(config.model, dtype).to(self.device)
        self.model.config.use_cache = False
        freeze_below(self.model, config.train_layers)
        self.ref_model = None
        if config.algo in ("dpo", "kto"):
            self.ref_model = load_model(config.ref_model or config.model, dtype).to(self.device)
            self.ref_model.eval().requires_grad_(False)
        self.image_token_id = int(self.model.config.image_token_id)
        tok = self.processor.tokenizer
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else 0)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.lr,
            weight_decay=config.weight_decay,
        )
        self.steps_done = 0
        self._ref_cache: dict[str, float] = {}

    # ---- sequences and log-probs --------------------------------------------------------

    def sequences(self, trajs: Sequence[Trajectory]) -> list[TrainSequence]:
        return [
            build_sequence(
                store_item.to_item(t), self.processor, self.image_token_id, t.trajectory_id
            )
            for t in trajs
        ]

    def _token_logps(self, model: Any, trajs: Sequence[Trajectory], grad: bool):
        mb = collate(self.sequences(trajs), model, self.pad_id, self.device)
        with torch.set_grad_enabled(grad):
            logp, _ = token_logprobs(model, mb)
        return logp, mb.mask

    @torch.no_grad()
    def logps(self, trajs: Sequence[Trajectory], model: Any = None) -> torch.Tensor:
        """[B] summed response log-probs under `model` (default: the policy), no gradient."""
        model = self.model if model is None else model
        out = []
        for part in _chunks(list(trajs), max(1, self.config.micro_batch)):
            logp, mask = self._token_logps(model, part, grad=False)
            out.append(sequence_logps(logp, mask).float().cpu())
        return torch.cat(out) if out else torch.zeros(0)

    def mean_nll(self, trajs: Sequence[Trajectory]) -> float:
        """Token-mean NLL of the response tokens of `trajs` under the policy (no gradient)."""
        n = sum(response_tokens(t) for t in trajs)
        return -float(self.logps(trajs).sum()) / n if n else math.nan

    def ref_logps(self, trajs: Sequence[Trajectory]) -> torch.Tensor:
        """[B] summed response log-probs under the frozen reference (cached by id)."""
        if self.ref_model is None:
            raise ArpoError(f"algo {self.config.algo!r} has no reference model")
        missing = [t for t in trajs if t.trajectory_id not in self._ref_cache]
        if missing:
            vals = self.logps(missing, self.ref_model)
            for t, v in zip(missing, vals.tolist(), strict=True):
                self._ref_cache[t.trajectory_id] = v
        return torch.tensor([self._ref_cache[t.trajectory_id] for t in trajs])

    # ---- one optimizer step per method ----------------------------------------------------

    def _finish_step(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip)) if params else 0.0
        self.optimizer.step()
        self.steps_done += 1
        return norm

    @staticmethod
    def _acc(acc: dict[str, float], m: dict[str, float], w: float) -> None:
        for k, v in m.items():
            if isinstance(v, float) and not math.isnan(v):
                acc[k] = acc.get(k, 0.0) + v * w

    def step_dpo(self, pairs: Sequence[tuple[Trajectory, Trajectory]]) -> dict[str, float]:
        """One optimizer step on (chosen, rejected) pairs; the loss is the mean over pairs."""
        cfg = self.config
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        acc: dict[str, float] = {}
        for micro in _chunks(list(pairs), cfg.micro_batch):
            chosen = [c for c, _ in micro]
            rejected = [r for _, r in micro]
            logp, mask = self._token_logps(self.model, chosen + rejected, grad=True)
            pi = sequence_logps(logp, mask)
            ref_c = self.ref_logps(chosen).to(pi)
            ref_r = self.ref_logps(rejected).to(pi)
            k = len(micro)
            loss, m = dpo_loss(
                pi[:k], pi[k:], ref_c, ref_r, beta=cfg.beta, loss_type=cfg.dpo_loss,
                label_smoothing=cfg.label_smoothing,
            )  # fmt: skip
            share = k / len(pairs)
            (loss * share).backward()
            self._acc(acc, {kk: v for kk, v in m.items() if kk != "pairs"}, share)
        acc["grad_norm"] = self._finish_step()
        acc["pairs"] = float(len(pairs))
        return acc

    def step_kto(self, trajs: Sequence[Trajectory], desirable: Sequence[bool]) -> dict[str, float]:
        """One optimizer step on unpaired trajectories; z0 from a no-gradient pass of the step."""
        cfg = self.config
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        trajs = list(trajs)
        z0 = kto_kl_estimate(self.logps(trajs), self.ref_logps(trajs))
        acc: dict[str, float] = {}
        flags = torch.tensor(list(desirable), dtype=torch.bool)
        idx = list(range(len(trajs)))
        for micro in _chunks(idx, cfg.micro_batch):
            part = [trajs[i] for i in micro]
            logp, mask = self._token_logps(self.model, part, grad=True)
            pi = sequence_logps(logp, mask)
            loss, m = kto_loss(
                pi, self.ref_logps(part).to(pi), flags[micro].to(pi.device), beta=cfg.beta,
                lambda_d=self.kto_lambda_d, lambda_u=cfg.kto_lambda_u, kl=z0,
            )  # fmt: skip
            share = len(micro) / len(trajs)
            (loss * share).backward()
            self._acc(acc, {"loss/kto": m["loss/kto"]}, share)
        acc["kl"] = float(z0)
        acc["grad_norm"] = self._finish_step()
        acc["desirable"] = float(flags.sum())
        acc["undesirable"] = float((~flags).sum())
        return acc

    def step_nll(self, trajs: Sequence[Trajectory]) -> dict[str, float]:
        """One optimizer step of token-mean NLL over all response tokens of `trajs` (RFT, SFT)."""
        cfg = self.config
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        trajs = list(trajs)
        total = sum(response_tokens(t) for t in trajs)
        acc: dict[str, float] = {}
        for part in _chunks(trajs, cfg.micro_batch):
            logp, mask = self._token_logps(self.model, part, grad=True)
            loss, m = nll_loss(logp, mask)
            share = m["tokens"] / total if total else 0.0
            (loss * share).backward()
            self._acc(acc, {"loss/nll": m["loss/nll"]}, share)
        acc["grad_norm"] = self._finish_step()
        acc["tokens"] = float(total)
        return acc

    # ---- the run --------------------------------------------------------------------------

    def units(self, outcomes: Outcomes) -> tuple[list[Any], dict[str, Any]]:
        """What one epoch iterates over, and a report of how it was made."""
        cfg = self.config
        report = {
            "successes": outcomes.n_successes,
            "failures": outcomes.n_failures,
            **{f"excluded_{k}": v for k, v in outcomes.excluded.items()},
        }
        if cfg.algo == "dpo":
            pairs, rep = dpo_pairs(
                outcomes, mode=cfg.pairing, max_pairs_per_task=cfg.max_pairs_per_task,
                seed=cfg.seed,
            )  # fmt: skip
            report.update(rep)
            return pairs, report
        if cfg.algo == "kto":
            units = [(t, True) for ts in outcomes.successes.values() for t in ts]
            units += [(t, False) for ts in outcomes.failures.values() for t in ts]
            n_d, n_u = outcomes.n_successes, outcomes.n_failures
            if cfg.kto_balance and n_d and n_u:
                self.kto_lambda_d = cfg.kto_lambda_d * n_u / n_d
            report["kto_lambda_d"] = round(self.kto_lambda_d, 4)
            return units, report
        return [t for ts in outcomes.successes.values() for t in ts], report

    def train(self, trajs: Iterable[Trajectory]) -> list[dict[str, float]]:
        """`epochs` passes over the method's units of `trajs`; per-step metrics."""
        cfg = self.config
        usable, unusable = [], 0
        for t in trajs:
            why = check_item(store_item.to_item(t), self.processor, self.image_token_id)
            if why is None:
                usable.append(t)
            else:
                unusable += 1
                log.warning("trajectory %s left out: %s", t.trajectory_id, why)
        outcomes = split_outcomes(usable, cfg.success_score)
        if unusable:
            outcomes.excluded["unusable"] += unusable
        units, report = self.units(outcomes)
        self.report = report
        log.info("offline %s: %s", cfg.algo, report)
        if not units:
            what = {"dpo": "no (success, failure) pair of one task", "kto": "no trajectory",
                    "rft": "no success"}[cfg.algo]  # fmt: skip
            raise ArpoError(f"offline {cfg.algo}: {what} in the data ({report})")
        history: list[dict[str, float]] = []
        t_start = time.perf_counter()
        for epoch in range(cfg.epochs):
            order = list(units)
            self._rng.shuffle(order)
            for mini in _chunks(order, cfg.batch_size):
                t0 = time.perf_counter()
                if cfg.algo == "dpo":
                    m = self.step_dpo(mini)
                elif cfg.algo == "kto":
                    m = self.step_kto([t for t, _ in mini], [d for _, d in mini])
                else:
                    m = self.step_nll(mini)
                m["time/step_s"] = time.perf_counter() - t0
                m["epoch"] = float(epoch)
                m["step"] = float(self.steps_done)
                history.append(m)
                if self.steps_done % cfg.log_every == 0:
                    loss = next((v for k, v in m.items() if k.startswith("loss/")), math.nan)
                    log.info(
                        "%s step %d epoch %d loss %.4f (%.1f s elapsed)", cfg.algo,
                        self.steps_done, epoch, loss, time.perf_counter() - t_start,
                    )  # fmt: skip
                if cfg.max_optimizer_steps and self.steps_done >= cfg.max_optimizer_steps:
                    return history
            if cfg.target_nll:
                nll = self.mean_nll(list(units))
                if nll <= cfg.target_nll:
                    log.info("%s: mean NLL %.4f <= target %.4f after epoch %d: done",
                             cfg.algo, nll, cfg.target_nll, epoch)  # fmt: skip
                    return history
        return history

    def save(self, out: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Save the policy (`save_pretrained`) and the processor to `out`, and the config."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out)
        self.processor.save_pretrained(out)
        info = {"config": to_dict(self.config), "steps": self.steps_done, **(extra or {})}
        (out / "offline.json").write_text(json.dumps(info, indent=2, default=str))
        return out


def run(cfg: OfflineConfig) -> dict[str, Any]:
    """`arpo offline`: read `data`, train with `algo`, save to `out`; returns a summary."""
    cfg = validate(cfg)
    if not cfg.data:
        raise ConfigError("config field data: give the folder of collected trajectories")
    if not cfg.out:
        raise ConfigError("config field out: give the folder to save the model to")
    trajs = list(read_trajectories(cfg.data))
    trainer = OfflineTrainer(cfg)
    history = trainer.train(trajs)
    last = history[-1] if history else {}
    summary = {
        "algo": cfg.algo,
        "trajectories": len(trajs),
        "steps": trainer.steps_done,
        "final_loss": next((v for k, v in last.items() if k.startswith("loss/")), math.nan),
        **trainer.report,
    }
    trainer.save(cfg.out, {"summary": summary})
    return summary

"""The ARPO policy loss: decoupled clipped PPO with truncated importance weights.

Inputs are padded [B, T] tensors over the sampled response tokens of B trajectories
(docs/concepts/learner.md). For token t of trajectory i, with mu = the behaviour log-prob
stored in the record, pi_prox = the log-prob under the weights before this
optimisation step and pi_theta = the live policy:

    r_it = exp(pi_theta - pi_prox)                                      (ratio)
    w_it = sg(clamp(exp(pi_prox - mu), w_min_i, w_max))                 (weight)
    l_it = max(-A_i r_it, -A_i clip(r_it, 1 - eps_low, 1 + eps_high))   (PPO clip)
    l_it = min(l_it, c |A_i|)            if A_i < 0                     (dual clip)
    L_pg = agg_i,t(w_it * l_it)

A_i is the trajectory's advantage, or A_it a token's when a group holds tree rollouts
(`arpo.learner.tree`: per turn, and tokens another trajectory trains are not in the mask),
with w_min_i = 0 for fresh trajectories and `replay_w_min` for replayed successes,
sg = stop-gradient, and agg either `seq-mean-token-mean` (mean over each
trajectory's tokens, then mean over trajectories) or `token-mean` (mean over all
tokens of the batch). The dual clip bounds the unweighted term, as verl's dual-clip
PPO does; the weighted token loss is therefore at most w_max * c * |A|. With the
optional KL term, L = L_pg + kl_coef * agg(k3), k3 = exp(q - p) - (q - p) - 1,
p = pi_theta, q = the reference model's log-prob.

Settings against the ARPO reference (the authors' training script):

- Same as the reference: eps_low 0.2, eps_high 0.3, dual clip c = 3.0,
  `seq-mean-token-mean`, no KL term (kl_coef 0), no entropy bonus (this module has
  none).
- Additions of this project: the importance weight w (the reference has none: it
  recomputes the "old" log-probs with the current weights, so replayed successes of
  any age are scored as on-policy) and the lower floor `replay_w_min` for replayed
  successes (default 0.0, i.e. no floor). With fresh on-policy data (pi_prox = mu)
  w = 1 for every token and the loss equals the reference GRPO loss exactly.
  `correct_replay = false` restores the reference's treatment of replayed rows
  (their behaviour log-probs are replaced by the proximal ones, so w = 1).
- `token-mean` aggregation and the KL term are options, off by default.
- Numerical guards that do not change the objective: the log-ratio is clamped to
  +-20 before exp (as verl does; a token that far out is clipped or has a vanishing
  gradient anyway), padded positions are zeroed before any exp, and trajectories with
  no unmasked token are left out of the mean over trajectories.

    loss, metrics = arpo_loss(logp, logp_prox, logp_behav, adv, mask, is_replay, LossConfig())
    loss.backward()

What the correction corrects (`behaviour_drift`, logged once per step from the proximal
pass, for fresh and replayed trajectories separately): the per-sequence log-ratio
sum_t (pi_prox - mu) (how much likelier the learner finds the whole trajectory than the
policy that sampled it), the weight exp(pi_prox - mu) over the tokens whose behaviour
probability is below 0.9 (the tokens that carry the decision, e.g. coordinates; the
format tokens around them sit near probability 1 and weight 1 and hide them in a mean
over all tokens), and the share of tokens whose weight is truncated at w_max.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from arpo.config import check_range, fail, option

_LOG_RATIO_LIMIT = 20.0


@dataclass
class LossConfig:
    """The clipped policy loss and its off-policy correction."""

    eps_low: float = option(0.2, "PPO clip below: the ratio is clipped at 1 - eps_low.")
    eps_high: float = option(0.3, "PPO clip above: the ratio is clipped at 1 + eps_high.")
    dual_clip: float = option(
        3.0, "Dual clip c > 1: for A < 0 the token loss is bounded by c * |A| (verl's dual clip)."
    )
    w_max: float = option(
        2.0, "Upper truncation of the importance weight exp(pi_prox - mu); at least 1."
    )
    replay_w_min: float = option(
        0.0,
        "Lower floor of the importance weight for replayed successes (fresh data use 0), "
        "so a success the policy has drifted from still pulls; in [0, 1].",
    )
    correct_replay: bool = option(
        True,
        "Weight replayed rows by exp(pi_prox - mu); false treats them as the reference "
        "does (behaviour log-probs replaced by the proximal ones, weight 1).",
    )
    agg: Literal["seq-mean-token-mean", "token-mean"] = option(
        "seq-mean-token-mean",
        "'seq-mean-token-mean' (the reference: every trajectory weighs the same) or "
        "'token-mean' (every token weighs the same).",
    )
    kl_coef: float = option(
        0.0, "Coefficient of the k3 KL estimate to a reference model; 0 turns it off."
    )

    def validate(self) -> None:
        if not 0.0 <= self.eps_low < 1.0:
            fail("eps_low", "must be in [0, 1) so that 1 - eps_low stays positive")
        check_range("eps_high", self.eps_high, 0.0, 10.0, "the upper clip is 1 + eps_high")
        if not self.dual_clip > 1.0:
            fail("dual_clip", "must be greater than 1 (the bound c * |A| must exceed |A|)")
        check_range("dual_clip", self.dual_clip, 1.0, 1e6, "the bound c * |A|", lo_open=True)
        if self.w_max < 1.0:
            fail("w_max", "must be at least 1 so that on-policy tokens keep weight 1")
        check_range("w_max", self.w_max, 1.0, 1e6, "largest importance weight")
        if not 0.0 <= self.replay_w_min <= 1.0:
            fail("replay_w_min", "must be in [0, 1] (0 = no floor)")
        if self.agg not in ("seq-mean-token-mean", "token-mean"):
            fail("agg", "must be 'seq-mean-token-mean' or 'token-mean'")
        check_range("kl_coef", self.kl_coef, 0.0, 1e6, "0 turns the KL term off")


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """Mean of [B, T] `values` over `mask`, per `agg`; 0 (with the graph kept) if empty."""
    m = mask.to(values.dtype)
    masked = torch.where(mask, values, torch.zeros_like(values))
    if agg == "token-mean":
        return masked.sum() / m.sum().clamp(min=1.0)
    if agg == "seq-mean-token-mean":
        counts = m.sum(dim=-1)
        per_seq = masked.sum(dim=-1) / counts.clamp(min=1.0)
        has = (counts > 0).to(values.dtype)
        return (per_seq * has).sum() / has.sum().clamp(min=1.0)
    raise ValueError(f"unknown aggregation {agg!r}: use 'seq-mean-token-mean' or 'token-mean'")


def _masked_mean(x: torch.Tensor, sel: torch.Tensor) -> float:
    n = int(sel.sum())
    return float(x[sel].sum()) / n if n else math.nan


def arpo_loss(
    logp: torch.Tensor,
    logp_prox: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    is_replay: torch.Tensor,
    cfg: LossConfig,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss to minimise and its metrics (floats) for one micro-batch.

    logp [B, T]: live log-probs of the sampled tokens (with grad); logp_prox [B, T]:
    log-probs before this optimisation step; logp_behav [B, T]: behaviour log-probs
    from the records; advantages [B], or [B, T] per token (tree credit); mask [B, T] bool
    over the response tokens trained;
    is_replay [B] bool; ref_logp [B, T]: reference-model log-probs, needed when
    cfg.kl_coef > 0. Gradient flows only through `logp`.
    """
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    shape = logp.shape
    for name, t in (("logp_prox", logp_prox), ("logp_behav", logp_behav), ("mask", mask)):
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logp has {tuple(shape)}")
    if ref_logp is not None and ref_logp.shape != shape:
        raise ValueError(f"ref_logp has shape {tuple(ref_logp.shape)}, logp has {tuple(shape)}")
    if advantages.shape not in (shape[:1], shape):
        raise ValueError(
            f"advantages must be [B] = [{shape[0]}] or [B, T] = {list(shape)}, got shape "
            f"{tuple(advantages.shape)}"
        )
    if is_replay.shape != shape[:1]:
        raise ValueError(
            f"is_replay must be [B] = [{shape[0]}], got shape {tuple(is_replay.shape)}"
        )
    if mask.dtype != torch.bool or is_replay.dtype != torch.bool:
        raise ValueError("mask and is_replay must be bool tensors")
    if cfg.kl_coef > 0 and ref_logp is None:
        raise ValueError("cfg.kl_coef > 0 needs ref_logp (or set kl_coef = 0)")

    # At least float32 (bf16 log-probs are upcast); float64 inputs stay float64.
    dtype = torch.promote_types(logp.dtype, torch.float32)
    logp = logp.to(dtype)
    prox = logp_prox.detach().to(dtype)
    behav = logp_behav.detach().to(dtype)
    replay_tok = is_replay[:, None].expand(shape)
    if not cfg.correct_replay:
        behav = torch.where(replay_tok, prox, behav)
    zero = torch.zeros_like(prox)

    # Padded positions may hold anything (-inf, nan): zero the log-differences first.
    log_ratio = torch.where(mask, logp - prox, zero).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    w_min = torch.where(replay_tok, torch.full_like(prox, cfg.replay_w_min), zero)
    w = torch.maximum(torch.exp(torch.where(mask, prox - behav, zero)).clamp(max=cfg.w_max), w_min)

    adv = advantages.detach().to(dtype)
    adv = adv[:, None].expand(shape) if adv.dim() == 1 else torch.where(mask, adv, zero)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = torch.minimum(loss_ppo, -adv * cfg.dual_clip)
    loss_tok = torch.where(adv < 0, loss_dual, loss_ppo)

    pg_loss = aggregate(w * loss_tok, mask, cfg.agg)
    loss = pg_loss
    kl = None
    if ref_logp is not None:
        d = torch.where(mask, ref_logp.detach().to(dtype) - logp, zero)
        kl = aggregate(torch.exp(d) - d - 1.0, mask, cfg.agg)
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl

    # Metrics: each float() below is a device sync point.
    with torch.no_grad():
        n_tok = int(mask.sum())
        r = ratio[mask]
        clip_low = mask & (adv < 0) & (ratio < 1.0 - cfg.eps_low)
        clip_high = mask & (adv > 0) & (ratio > 1.0 + cfg.eps_high)
        clip_dual = mask & (adv < 0) & (loss_ppo > -adv * cfg.dual_clip)
        wm = w[mask]
        w_sq = float((wm * wm).sum())
        metrics = {
            "loss/total": float(loss),
            "loss/pg": float(pg_loss),
            "ratio/mean": float(r.mean()) if n_tok else math.nan,
            "ratio/min": float(r.min()) if n_tok else math.nan,
            "ratio/max": float(r.max()) if n_tok else math.nan,
            "weight/fresh_mean": _masked_mean(w, mask & ~replay_tok),
            "weight/replay_mean": _masked_mean(w, mask & replay_tok),
            # Normalised effective sample size (sum w)^2 / (n sum w^2), in [0, 1].
            "weight/ess": float(wm.sum()) ** 2 / (n_tok * w_sq) if n_tok and w_sq else 0.0,
            "weight/truncated_frac": int((wm >= cfg.w_max).sum()) / max(n_tok, 1),
            "clip/low_frac": int(clip_low.sum()) / max(n_tok, 1),
            "clip/high_frac": int(clip_high.sum()) / max(n_tok, 1),
            "clip/dual_frac": int(clip_dual.sum()) / max(n_tok, 1),
            "tokens": float(n_tok),
        }
        if kl is not None:
            metrics["loss/kl"] = float(kl)
    return loss, metrics


LOW_PROB = 0.9
"""Behaviour probability below which a token counts as a decision token in the drift
metrics (format tokens sit above it)."""


def behaviour_drift(
    prox: list[torch.Tensor], behav: list[torch.Tensor], is_replay: list[bool], w_max: float
) -> dict[str, float]:
    """Drift between the learner (pi_prox) and the behaviour policies (mu), per trajectory
    kind ("fresh", "replay"): `losses/seq_logratio_<kind>_{mean,min,max}` (sum over a
    trajectory's response tokens of pi_prox - mu), `losses/weight_lowp_<kind>_{mean,min,
    max}` (exp(pi_prox - mu) before truncation, over tokens with exp(mu) < LOW_PROB) and
    `losses/weight_truncated_<kind>_frac` (tokens with exp(pi_prox - mu) > w_max). NaN
    when a kind has no tokens. `prox` and `behav` are per-trajectory 1-D tensors."""
    out: dict[str, float] = {}
    log_low = math.log(LOW_PROB)
    for kind, want in (("fresh", False), ("replay", True)):
        rows = [i for i, r in enumerate(is_replay) if r == want and len(prox[i])]
        seq = [float((prox[i].double() - behav[i].double()).sum()) for i in rows]
        d = (
            torch.cat([(prox[i] - behav[i]).double() for i in rows])
            if rows
            else torch.zeros(0, dtype=torch.float64)
        )
        b = torch.cat([behav[i].double() for i in rows]) if rows else d
        w = torch.exp(d.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))
        low = w[b < log_low]
        nan = math.nan
        out[f"losses/seq_logratio_{kind}_mean"] = sum(seq) / len(seq) if seq else nan
        out[f"losses/seq_logratio_{kind}_min"] = min(seq) if seq else nan
        out[f"losses/seq_logratio_{kind}_max"] = max(seq) if seq else nan
        out[f"losses/weight_lowp_{kind}_mean"] = float(low.mean()) if low.numel() else nan
        out[f"losses/weight_lowp_{kind}_min"] = float(low.min()) if low.numel() else nan
        out[f"losses/weight_lowp_{kind}_max"] = float(low.max()) if low.numel() else nan
        out[f"losses/weight_truncated_{kind}_frac"] = (
            float((w > w_max).double().mean()) if w.numel() else nan
        )
    return out

"""Losses of the offline baselines (DPO, KTO, rejection-sampling fine-tuning) and of SFT.

    logp, _ = token_logprobs(model, mb)                 # [B, N] (arpo.learner.batch)
    pi = sequence_logps(logp, mb.mask)                  # [B] summed over response tokens
    loss, m = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=0.1)
    loss, m = kto_loss(pi, ref, desirable, beta=0.1)
    loss, m = nll_loss(logp, mb.mask)                   # RFT / SFT

Pure functions on tensors; every log-probability of a trajectory is the SUM over all
its response tokens (every turn of the episode), so a trajectory is scored as one
sequence, like a single completion in the papers.

DPO (Rafailov et al., 2023), with the implicit reward margin
    h = (pi_c - ref_c) - (pi_r - ref_r)      (c: chosen = success, r: rejected = failure)
- `sigmoid` (the paper's): loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h),
  eps = `label_smoothing` (conservative DPO, Mitchell 2023; 0 gives the paper's loss);
- `ipo` (Azar et al., 2023): loss = (h - 1 / (2 beta))^2.
The loss is the mean over pairs.

KTO (Ethayarajh et al., 2024), unpaired: r = pi - ref for every trajectory,
    z0 = max(0, KL estimate), detached
    desirable:   lambda_d * (1 - sigmoid(beta (r - z0)))
    undesirable: lambda_u * (1 - sigmoid(beta (z0 - r)))
and the loss is the mean over trajectories. The paper estimates the KL term from
mismatched pairs (a response scored under another example's prompt); that needs a
second forward pass of every pair. Here the estimate is, unless the caller passes its
own `kl`, the batch mean of r over all trajectories (desirable and undesirable alike),
clamped at 0 and detached: the same quantity in expectation when the batch's responses
are samples of the reference policy, and the simplification TRL's documentation
describes for its batch-level estimate.

RFT (rejection-sampling fine-tuning) and SFT: the negative log-likelihood of the
response tokens, averaged over all response tokens of the batch (token mean).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F


def sequence_logps(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] sum of the per-token log-probs `logp` [B, N] where `mask` [B, N] is True."""
    return (logp * mask.to(logp.dtype)).sum(-1)


def nll_loss(logp: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean negative log-likelihood of the masked tokens (RFT / SFT).

    Returns the loss and {"loss/nll": value, "tokens": n}; a batch without tokens has
    loss 0 (with a gradient of zeros)."""
    m = mask.to(logp.dtype)
    n = m.sum()
    total = -(logp * m).sum()
    loss = total / n if float(n) > 0 else total * 0.0
    return loss, {"loss/nll": float(loss.detach()), "tokens": float(n)}


def dpo_loss(
    pi_chosen: torch.Tensor,
    pi_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean DPO loss over pairs (see the module docstring); all inputs [P] summed log-probs.

    Metrics: loss/dpo, rewards/chosen and rewards/rejected (beta * (pi - ref), means),
    rewards/margin (mean beta h), rewards/accuracy (share of pairs with h > 0), pairs."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen = pi_chosen - ref_chosen
    rejected = pi_rejected - ref_rejected
    h = chosen - rejected
    if loss_type == "sigmoid":
        per = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(
            -beta * h
        )
    elif loss_type == "ipo":
        per = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; use 'sigmoid' or 'ipo'")
    loss = per.mean()
    with torch.no_grad():
        m = {
            "loss/dpo": float(loss),
            "rewards/chosen": float((beta * chosen).mean()),
            "rewards/rejected": float((beta * rejected).mean()),
            "rewards/margin": float((beta * h).mean()),
            "rewards/accuracy": float((h > 0).float().mean()),
            "pairs": float(len(h)),
        }
    return loss, m


def kto_kl_estimate(pi: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The reference point z0: max(0, mean(pi - ref)) over the batch, detached."""
    return (pi - ref).detach().mean().clamp(min=0)


def kto_loss(
    pi: torch.Tensor,
    ref: torch.Tensor,
    desirable: torch.Tensor,
    *,
    beta: float = 0.1,
    lambda_d: float = 1.0,
    lambda_u: float = 1.0,
    kl: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean KTO loss over trajectories (see the module docstring).

    `pi`, `ref` [B] summed log-probs; `desirable` [B] bool (success). `kl` is the
    reference point before clamping (default: `kto_kl_estimate(pi, ref)`); it is
    clamped at 0 and never differentiated. Metrics: loss/kto, kl (z0), rewards/desirable
    and rewards/undesirable (means of beta r; nan when the batch has none)."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    r = pi - ref
    if kl is None:
        z0 = kto_kl_estimate(pi, ref)
    else:
        z0 = torch.as_tensor(kl, dtype=r.dtype, device=r.device).detach().clamp(min=0)
    d = desirable.to(torch.bool)
    loss_d = lambda_d * (1 - torch.sigmoid(beta * (r - z0)))
    loss_u = lambda_u * (1 - torch.sigmoid(beta * (z0 - r)))
    per = torch.where(d, loss_d, loss_u)
    loss = per.mean()
    with torch.no_grad():
        nan = float("nan")
        m = {
            "loss/kto": float(loss),
            "kl": float(z0),
            "rewards/desirable": float((beta * r[d]).mean()) if bool(d.any()) else nan,
            "rewards/undesirable": float((beta * r[~d]).mean()) if bool((~d).any()) else nan,
            "desirable": float(d.sum()),
            "undesirable": float((~d).sum()),
        }
    return loss, m

"""The ARPO loss: hand-computed values, reduction to plain GRPO, gradients, clipping, replay."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arpo.config import validate
from arpo.errors import ConfigError
from arpo.learner.loss import LossConfig, arpo_loss

D = torch.float64
LN = math.log


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=D)


def run(logp, prox, behav, adv, mask, replay, cfg=None, ref=None):
    """arpo_loss with a leaf `logp`; returns (loss, metrics, d loss / d logp)."""
    logp = logp.clone().requires_grad_(True)
    loss, metrics = arpo_loss(logp, prox, behav, adv, mask, replay, cfg or LossConfig(), ref)
    loss.backward()
    return loss.detach(), metrics, logp.grad


def plain_grpo_loss(logp, old_logp, adv, mask, eps_low=0.2, eps_high=0.3, c=3.0):
    """The reference loss, written independently (verl's dual-clip PPO, seq-mean-token-mean)."""
    ratio = torch.exp(logp - old_logp)
    a = adv.unsqueeze(-1)
    pg1 = -a * ratio
    pg2 = -a * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    clip1 = torch.max(pg1, pg2)
    clip2 = torch.min(-a * c, clip1)
    pg = torch.where(a < 0, clip2, clip1)
    m = mask.to(pg.dtype)
    return ((pg * m).sum(-1) / m.sum(-1)).mean()


def test_hand_computed_values_and_metrics():
    # Row 0: fresh, A = +1.   Row 1: replayed success, A = -2, replay floor 0.25.
    # token (0,0): r = 1.5 > 1.3 -> clipped: l = -1.3; w = exp(ln 0.5) = 0.5     -> -0.65
    # token (0,1): r = 1.0:              l = -1.0; w = exp(ln 4) = 4 -> w_max 2  -> -2.0
    # token (1,0): r = 0.5 < 0.8: l = max(2*0.5, 2*0.8) = 1.6; w = 0.1 -> floor 0.25 -> 0.4
    # token (1,1): r = 4: l = max(2*4, 2*1.3) = 8 -> dual clip min(8, 3*2) = 6; w = 1 -> 6.0
    # seq-mean-token-mean: ((-0.65 - 2.0)/2 + (0.4 + 6.0)/2) / 2 = (-1.325 + 3.2)/2 = 0.9375
    prox = t([[-1.0, -2.0], [-0.5, -3.0]])
    logp = prox + t([[LN(1.5), 0.0], [LN(0.5), LN(4.0)]])
    behav = prox - t([[LN(0.5), LN(4.0)], [LN(0.1), 0.0]])
    adv = t([1.0, -2.0])
    mask = torch.ones(2, 2, dtype=torch.bool)
    replay = torch.tensor([False, True])
    cfg = LossConfig(replay_w_min=0.25)

    loss, m, grad = run(logp, prox, behav, adv, mask, replay, cfg)

    assert loss.item() == pytest.approx(0.9375, abs=1e-12)
    assert m["loss/pg"] == pytest.approx(0.9375, abs=1e-12)
    assert m["ratio/mean"] == pytest.approx((1.5 + 1.0 + 0.5 + 4.0) / 4)
    assert m["ratio/min"] == pytest.approx(0.5)
    assert m["ratio/max"] == pytest.approx(4.0)
    assert m["weight/fresh_mean"] == pytest.approx((0.5 + 2.0) / 2)
    assert m["weight/replay_mean"] == pytest.approx((0.25 + 1.0) / 2)
    assert m["clip/low_frac"] == pytest.approx(0.25)
    assert m["clip/high_frac"] == pytest.approx(0.25)
    assert m["clip/dual_frac"] == pytest.approx(0.25)
    # ESS = (sum w)^2 / (n sum w^2) = 3.75^2 / (4 * (0.25 + 4 + 0.0625 + 1)) = 14.0625 / 21.25
    assert m["weight/ess"] == pytest.approx(14.0625 / 21.25)
    assert m["weight/truncated_frac"] == pytest.approx(0.25)
    assert "loss/kl" not in m
    # Only token (0,1) is unclipped: d/dlogp of w * (-A r) / 2 / 2 = 2 * (-1 * 1) / 4 = -0.5.
    torch.testing.assert_close(grad, t([[0.0, -0.5], [0.0, 0.0]]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("eps", [(0.2, 0.3), (0.1, 0.1)])
def test_fresh_data_equals_plain_grpo(seed, eps):
    g = torch.Generator().manual_seed(seed)
    b, n = 6, 9
    prox = -torch.rand(b, n, generator=g, dtype=D) * 3
    logp = prox + torch.randn(b, n, generator=g, dtype=D) * 0.6  # ratios well outside the clip
    adv = torch.randn(b, generator=g, dtype=D)
    lengths = torch.randint(1, n + 1, (b,), generator=g)
    mask = torch.arange(n)[None, :] < lengths[:, None]
    replay = torch.rand(b, generator=g) < 0.5
    cfg = LossConfig(eps_low=eps[0], eps_high=eps[1], replay_w_min=0.3)

    loss, m, grad = run(logp, prox, prox.clone(), adv, mask, replay, cfg)

    ref_logp = logp.clone().requires_grad_(True)
    ref = plain_grpo_loss(ref_logp, prox, adv, mask, *eps)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_logp.grad, rtol=1e-12, atol=1e-12)
    assert m["weight/ess"] == pytest.approx(1.0)
    assert m["clip/low_frac"] + m["clip/high_frac"] > 0  # the clip was exercised


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    scale=st.floats(0.0, 30.0),
    agg=st.sampled_from(["seq-mean-token-mean", "token-mean"]),
    correct=st.booleans(),
    floor=st.floats(0.0, 1.0),
)
def test_token_losses_stay_within_the_clip_bounds(seed, scale, agg, correct, floor):
    # Per token, A > 0: loss in [-(1 + eps_high) A, 0]; A < 0: loss in [(1 - eps_low)|A|, c|A|];
    # times w in [0, w_max]. So the loss is finite and |loss| <= w_max * c * max|A|,
    # whatever the log-ratios, in float32 as in training.
    g = torch.Generator().manual_seed(seed)
    b, n = 4, 7
    prox = -torch.rand(b, n, generator=g) * 5
    logp = prox + scale * torch.randn(b, n, generator=g)
    behav = prox + scale * torch.randn(b, n, generator=g)
    adv = 3 * torch.randn(b, generator=g)
    mask = torch.rand(b, n, generator=g) < 0.7
    replay = torch.rand(b, generator=g) < 0.5
    cfg = LossConfig(agg=agg, correct_replay=correct, replay_w_min=floor)
    loss, m, grad = run(logp, prox, behav, adv, mask, replay, cfg)
    assert torch.isfinite(loss) and torch.all(torch.isfinite(grad))
    assert abs(loss.item()) <= cfg.w_max * cfg.dual_clip * adv.abs().max().item() + 1e-5
    assert torch.all(grad[~mask] == 0)
    assert 0.0 <= m["weight/ess"] <= 1.0 + 1e-6


@pytest.mark.parametrize("adv, sign", [(1.5, -1.0), (-1.5, 1.0)])
def test_gradient_sign_follows_advantage(adv, sign):
    # Inside the clip range, minimising the loss raises logp for A > 0 and lowers it for A < 0.
    prox = t([[-1.0, -2.0, -0.3]])
    logp = prox + t([[0.0, 0.1, -0.1]])
    _, _, grad = run(
        logp, prox, prox, t([adv]), torch.ones(1, 3, dtype=torch.bool), torch.tensor([False])
    )
    assert torch.all(torch.sign(grad) == sign)


def test_clipped_tokens_get_no_gradient():
    # Row 0 (A = +1): r = 1.5 (above 1.3, clipped) and r = 0.5 (below, not clipped for A > 0).
    # Row 1 (A = -1): r = 0.5 (below 0.8, clipped) and r = 1.5 (above, not clipped for A < 0).
    prox = t([[-1.0, -1.0], [-1.0, -1.0]])
    logp = prox + t([[LN(1.5), LN(0.5)], [LN(0.5), LN(1.5)]])
    _, m, grad = run(
        logp, prox, prox, t([1.0, -1.0]), torch.ones(2, 2, dtype=torch.bool), torch.zeros(2).bool()
    )
    # d(-A r)/dlogp = -A r, seq-mean over 2 tokens and 2 rows divides by 4.
    torch.testing.assert_close(grad, t([[0.0, -0.5 / 4], [0.0, 1.5 / 4]]), rtol=0, atol=1e-12)
    assert m["clip/low_frac"] == pytest.approx(0.25)
    assert m["clip/high_frac"] == pytest.approx(0.25)
    assert m["clip/dual_frac"] == 0.0


def test_dual_clip_bounds_negative_advantage_loss():
    # A = -2: r = 10 -> |A| r = 20, bounded at c |A| = 6, no gradient;
    # r = 2.5 -> 5 < 6, unclipped, gradient |A| r = 5 (one row, one of two tokens: / 2).
    prox = t([[-1.0, -1.0]])
    logp = prox + t([[LN(10.0), LN(2.5)]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, m, grad = run(logp, prox, prox, t([-2.0]), mask, torch.tensor([False]))
    assert loss.item() == pytest.approx((6.0 + 5.0) / 2)
    torch.testing.assert_close(grad, t([[0.0, 5.0 / 2]]), rtol=0, atol=1e-12)
    assert m["clip/dual_frac"] == pytest.approx(0.5)
    # An enormous ratio is still bounded at c |A| per token.
    huge = prox + t([[80.0, 80.0]])
    loss, _, grad = run(huge, prox, prox, t([-2.0]), mask, torch.tensor([False]))
    assert loss.item() == pytest.approx(6.0)
    assert torch.all(grad == 0)
    # A different c moves the bound.
    loss, _, _ = run(
        logp, prox, prox, t([-2.0]), mask, torch.tensor([False]), LossConfig(dual_clip=2.0)
    )
    assert loss.item() == pytest.approx((4.0 + 4.0) / 2)


def test_weights_are_detached_and_scale_the_gradient():
    g = torch.Generator().manual_seed(1)
    prox = (-torch.rand(3, 5, generator=g, dtype=D)).requires_grad_(True)
    behav = (prox.detach() + torch.randn(3, 5, generator=g, dtype=D)).requires_grad_(True)
    logp = prox.detach() + 0.05 * torch.randn(3, 5, generator=g, dtype=D)
    adv = t([1.0, -0.5, 2.0])
    mask = torch.ones(3, 5, dtype=torch.bool)
    replay = torch.tensor([False, True, False])

    _, _, grad = run(logp, prox, behav, adv, mask, replay)
    assert prox.grad is None and behav.grad is None

    _, _, grad_unweighted = run(logp, prox.detach(), prox.detach(), adv, mask, replay)
    w = torch.exp(prox.detach() - behav.detach()).clamp(max=2.0)
    torch.testing.assert_close(grad, w * grad_unweighted, rtol=1e-12, atol=1e-12)


def test_masked_tokens_contribute_nothing():
    g = torch.Generator().manual_seed(2)
    prox = -torch.rand(2, 4, generator=g, dtype=D)
    logp = prox + 0.1 * torch.randn(2, 4, generator=g, dtype=D)
    behav = prox + 0.2 * torch.randn(2, 4, generator=g, dtype=D)
    mask = torch.tensor([[True, True, False, False], [True, True, True, False]])
    adv, replay = t([0.7, -1.2]), torch.tensor([True, False])
    base_loss, base_m, base_grad = run(logp, prox, behav, adv, mask, replay)

    # Garbage in the padding (what a padded batch may hold) changes nothing.
    junk = torch.where(mask, 0.0, torch.tensor(float("nan"), dtype=D))
    neg_inf = torch.where(mask, 0.0, torch.tensor(-math.inf, dtype=D))
    loss, m, grad = run(logp + junk, prox + neg_inf, behav + 1e6 * (~mask), adv, mask, replay)
    assert loss.item() == base_loss.item()
    assert m == base_m
    torch.testing.assert_close(grad, base_grad, rtol=0, atol=0)
    assert torch.all(grad[~mask] == 0)

    # A fully masked row is left out of the mean over trajectories.
    mask3 = torch.cat([mask, torch.zeros(1, 4, dtype=torch.bool)])
    loss3, _, _ = run(
        torch.cat([logp, logp[:1]]),
        torch.cat([prox, prox[:1]]),
        torch.cat([behav, behav[:1]]),
        torch.cat([adv, adv[:1]]),
        mask3,
        torch.cat([replay, replay[:1]]),
    )
    assert loss3.item() == pytest.approx(base_loss.item(), abs=1e-12)


def test_aggregation_modes_differ_on_unequal_lengths():
    # r = 1 everywhere, w = 1: token losses are -A. Row 0 (A = 1): one token, -1.
    # Row 1 (A = -0.5): three tokens, 0.5 each.
    # seq-mean-token-mean = (-1 + (0.5 + 0.5 + 0.5)/3) / 2 = -0.25
    # token-mean          = (-1 + 0.5 + 0.5 + 0.5) / 4   = 0.125
    logp = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[True, False, False], [True, True, True]])
    adv, replay = t([1.0, -0.5]), torch.tensor([False, False])
    seq, _, gs = run(logp, logp, logp, adv, mask, replay)
    tok, _, gt = run(logp, logp, logp, adv, mask, replay, LossConfig(agg="token-mean"))
    assert seq.item() == pytest.approx(-0.25)
    assert tok.item() == pytest.approx(0.125)
    # Gradients: seq-mean gives row 0's token 1/2 of the weight, token-mean 1/4.
    torch.testing.assert_close(gs, t([[-0.5, 0, 0], [0.5 / 6] * 3]), rtol=0, atol=1e-12)
    torch.testing.assert_close(gt, t([[-0.25, 0, 0], [0.5 / 4] * 3]), rtol=0, atol=1e-12)


def test_correct_replay_false_treats_replayed_rows_as_the_reference():
    g = torch.Generator().manual_seed(3)
    prox = -torch.rand(2, 4, generator=g, dtype=D)
    logp = prox + 0.1 * torch.randn(2, 4, generator=g, dtype=D)
    behav = prox + torch.randn(2, 4, generator=g, dtype=D)  # far from the proximal policy
    adv, mask = t([1.0, 1.0]), torch.ones(2, 4, dtype=torch.bool)
    replay = torch.tensor([True, False])
    cfg = LossConfig(correct_replay=False, replay_w_min=0.5)

    loss, m, grad = run(logp, prox, behav, adv, mask, replay, cfg)
    assert m["weight/replay_mean"] == 1.0
    # The replayed row behaves as if behaviour == proximal; the fresh row is still weighted.
    expect_behav = torch.where(replay[:, None], prox, behav)
    loss2, _, grad2 = run(logp, prox, expect_behav, adv, mask, replay)
    assert loss.item() == pytest.approx(loss2.item(), abs=1e-12)
    torch.testing.assert_close(grad, grad2, rtol=0, atol=1e-12)
    w_fresh = torch.exp(prox[1] - behav[1]).clamp(max=2.0)
    assert m["weight/fresh_mean"] == pytest.approx(w_fresh.mean().item())
    # With correction on, the replayed row's weights differ from 1.
    _, m_on, _ = run(logp, prox, behav, adv, mask, replay, LossConfig(replay_w_min=0.5))
    assert m_on["weight/replay_mean"] != 1.0


def test_replay_floor_applies_to_replayed_rows_only():
    prox = t([[-1.0], [-1.0]])
    behav = prox + LN(100.0)  # w = 0.01 before the floor
    _, m, _ = run(
        prox,
        prox,
        behav,
        t([1.0, 1.0]),
        torch.ones(2, 1, dtype=torch.bool),
        torch.tensor([False, True]),
        LossConfig(replay_w_min=0.3),
    )
    assert m["weight/fresh_mean"] == pytest.approx(0.01)
    assert m["weight/replay_mean"] == pytest.approx(0.3)


def test_kl_term_k3():
    # ref - logp = ln 2 on every token: k3 = exp(ln 2) - ln 2 - 1 = 1 - ln 2.
    logp = t([[-1.0, -2.0]])
    ref = logp + LN(2.0)
    mask, adv, replay = torch.ones(1, 2, dtype=torch.bool), t([0.0]), torch.tensor([False])
    loss, m, grad = run(logp, logp, logp, adv, mask, replay, LossConfig(kl_coef=0.1), ref)
    assert m["loss/kl"] == pytest.approx(1 - LN(2.0))
    assert loss.item() == pytest.approx(0.1 * (1 - LN(2.0)))
    # d k3 / d logp = 1 - exp(ref - logp) = -1, times 0.1, mean over 2 tokens.
    torch.testing.assert_close(grad, t([[-0.05, -0.05]]), rtol=0, atol=1e-12)
    # kl_coef = 0: reported, not added.
    loss0, m0, _ = run(logp, logp, logp, adv, mask, replay, LossConfig(), ref)
    assert loss0.item() == 0.0 and m0["loss/kl"] == pytest.approx(1 - LN(2.0))
    with pytest.raises(ValueError, match="ref_logp"):
        arpo_loss(logp, logp, logp, adv, mask, replay, LossConfig(kl_coef=0.1))


def test_shape_errors_name_the_argument():
    x = torch.zeros(2, 3, dtype=D)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="logp_behav"):
        arpo_loss(x, x, x[:, :2], t([0.0, 0.0]), mask, torch.zeros(2).bool(), LossConfig())
    with pytest.raises(ValueError, match="advantages"):
        arpo_loss(x, x, x, t([0.0]), mask, torch.zeros(2).bool(), LossConfig())


def test_default_config_is_the_reference_setting():
    cfg = validate(LossConfig())
    assert (cfg.eps_low, cfg.eps_high, cfg.dual_clip) == (0.2, 0.3, 3.0)
    assert (cfg.agg, cfg.kl_coef, cfg.w_max, cfg.correct_replay) == (
        "seq-mean-token-mean",
        0.0,
        2.0,
        True,
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("eps_low", 1.0),
        ("eps_low", -0.1),
        ("eps_high", -0.1),
        ("dual_clip", 1.0),
        ("w_max", 0.5),
        ("replay_w_min", 1.5),
        ("replay_w_min", -0.1),
        ("agg", "sum"),
        ("kl_coef", -1.0),
    ],
)
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"config field '?{field}\b"):
        validate(LossConfig(**{field: value}))

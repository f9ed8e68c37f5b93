"""The offline losses against values worked out by hand, and the direction of their gradients."""

from __future__ import annotations

import math

import pytest
import torch

from arpo.offline.losses import dpo_loss, kto_kl_estimate, kto_loss, nll_loss, sequence_logps


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_sequence_logps_sums_masked_tokens_only() -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, -9.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert sequence_logps(logp, mask).tolist() == [-6.0, -0.5]


def test_nll_is_the_token_mean_over_the_batch() -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, -9.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    loss, m = nll_loss(logp, mask)
    assert loss.item() == pytest.approx((1 + 2 + 3 + 0.5) / 4)
    assert m["tokens"] == 4
    empty, _ = nll_loss(logp, torch.zeros_like(mask))
    assert empty.item() == 0.0


def test_dpo_sigmoid_by_hand() -> None:
    # pair 0: h = (-10 - -12) - (-20 - -19) = 2 - (-1) = 3; pair 1: h = (0) - (2) = -2
    pc, pr = torch.tensor([-10.0, -5.0]), torch.tensor([-20.0, -6.0])
    rc, rr = torch.tensor([-12.0, -5.0]), torch.tensor([-19.0, -8.0])
    beta = 0.5
    loss, m = dpo_loss(pc, pr, rc, rr, beta=beta)
    want = (-math.log(_sig(beta * 3)) - math.log(_sig(beta * -2))) / 2
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert m["rewards/accuracy"] == 0.5
    assert m["rewards/chosen"] == pytest.approx(beta * (2 + 0) / 2)
    assert m["rewards/rejected"] == pytest.approx(beta * (-1 + 2) / 2)
    assert m["rewards/margin"] == pytest.approx(beta * (3 - 2) / 2)


def test_dpo_label_smoothing_and_ipo_by_hand() -> None:
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-1.0, -3.0, -2.0, -2.0))  # h = 1 - (-1) = 2
    beta, eps = 0.1, 0.2
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=eps)
    want = -(1 - eps) * math.log(_sig(0.2)) - eps * math.log(_sig(-0.2))
    assert loss.item() == pytest.approx(want, rel=1e-6)
    ipo, _ = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type="ipo")
    assert ipo.item() == pytest.approx((2 - 1 / (2 * beta)) ** 2, rel=1e-6)


def test_dpo_gradient_raises_chosen_and_lowers_rejected() -> None:
    pc = torch.tensor([-4.0], requires_grad=True)
    pr = torch.tensor([-4.0], requires_grad=True)
    loss, _ = dpo_loss(pc, pr, torch.tensor([-4.0]), torch.tensor([-4.0]), beta=0.1)
    loss.backward()
    # descent moves against the gradient: chosen up, rejected down, by the same amount
    assert pc.grad.item() < 0 < pr.grad.item()
    assert pc.grad.item() == pytest.approx(-pr.grad.item())
    assert pc.grad.item() == pytest.approx(-0.1 * 0.5)  # -beta * sigmoid(-beta h), h = 0


def test_dpo_rejects_bad_arguments() -> None:
    t = torch.zeros(1)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(t, t, t, t, beta=0)
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(t, t, t, t, loss_type="hinge")  # type: ignore[arg-type]


def test_kto_by_hand_with_batch_mean_reference_point() -> None:
    pi = torch.tensor([-1.0, -4.0, -2.0])
    ref = torch.tensor([-2.0, -3.0, -2.5])  # r = [1, -1, 0.5]; mean 1/6 -> z0 = 1/6
    desirable = torch.tensor([True, False, True])
    beta, ld, lu = 0.5, 1.0, 2.0
    z0 = 1 / 6
    assert kto_kl_estimate(pi, ref).item() == pytest.approx(z0)
    loss, m = kto_loss(pi, ref, desirable, beta=beta, lambda_d=ld, lambda_u=lu)
    want = (
        ld * (1 - _sig(beta * (1 - z0)))
        + lu * (1 - _sig(beta * (z0 - -1)))
        + ld * (1 - _sig(beta * (0.5 - z0)))
    ) / 3
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert m["kl"] == pytest.approx(z0)
    assert m["rewards/desirable"] == pytest.approx(beta * 0.75)
    assert m["rewards/undesirable"] == pytest.approx(-beta)


def test_kto_reference_point_is_clamped_at_zero_and_detached() -> None:
    pi = torch.tensor([-3.0, -3.0], requires_grad=True)
    ref = torch.tensor([-1.0, -1.0])  # r = -2 each: the mean is negative -> z0 = 0
    loss, m = kto_loss(pi, ref, torch.tensor([True, False]), beta=1.0)
    assert m["kl"] == 0.0
    loss.backward()
    # only through r (z0 detached): d/dpi of (1 - sig(r))/2 and (1 - sig(-r))/2
    s = _sig(-2.0)
    assert pi.grad.tolist() == pytest.approx([-s * (1 - s) / 2, s * (1 - s) / 2])
    # an explicit KL estimate is used as given (clamped)
    _, m2 = kto_loss(pi.detach(), ref, torch.tensor([True, False]), kl=0.7)
    assert m2["kl"] == pytest.approx(0.7)


def test_kto_gradient_raises_desirable_and_lowers_undesirable() -> None:
    pi = torch.tensor([-5.0, -5.0], requires_grad=True)
    loss, _ = kto_loss(pi, torch.tensor([-5.0, -5.0]), torch.tensor([True, False]), beta=0.1)
    loss.backward()
    assert pi.grad[0].item() < 0 < pi.grad[1].item()


def test_nll_gradient_raises_the_targets() -> None:
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = nll_loss(logp, torch.tensor([[True, True]]))
    loss.backward()
    assert logp.grad.tolist() == [[-0.5, -0.5]]

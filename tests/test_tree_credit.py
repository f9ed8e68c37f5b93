"""Step-level credit of tree rollouts (`arpo.learner.tree`), against a tree computed by hand,
and the loss's per-token advantages: a shared turn is trained once."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from arpo.learner.groups import advantages
from arpo.learner.loss import LossConfig, arpo_loss
from arpo.learner.tree import Leaf, has_trees, turn_advantages
from arpo.record import Branch

NAN = math.nan


def _tree_group() -> list[Leaf]:
    """One tree of four leaves (branch at turn 2 into 0 / 1, each again at turn 4) and two
    plain episodes. Rewards: leaf (0, 0) and the first plain one succeed."""
    b = lambda path: Branch("T", path, (2, 4))  # noqa: E731
    return [
        Leaf(1.0, 6, b((0, 0))),
        Leaf(0.0, 6, b((0, 1))),
        Leaf(0.0, 6, b((1, 0))),
        Leaf(0.0, 6, b((1, 1))),
        Leaf(1.0, 5),
        Leaf(0.0, 5),
    ]


def test_advantages_of_a_tree_computed_by_hand():
    leaves = _tree_group()
    a_ep = advantages([lf.reward for lf in leaves])
    # By hand: R = [1, 0, 0, 0, 1, 0]; mean 1/3; sample std sqrt(4/15).
    s = math.sqrt(4 / 15)
    hi, lo = (2 / 3) / s, (-1 / 3) / s
    np.testing.assert_allclose(a_ep, [hi, lo, lo, lo, hi, lo], rtol=1e-5)
    # Sibling sets of two with values (1, 0) or (0.5, 0): step advantages +-1/sqrt(2);
    # values (0, 0): 0.
    r2 = 1 / math.sqrt(2)
    root = (hi + 3 * lo) / 4
    n0, n1 = (hi + lo) / 2 + r2, lo - r2
    got = turn_advantages(leaves, a_ep, step_weight=1.0)
    want = [
        [root, root, n0, n0, hi + r2, hi + r2],  # trains the root's and node 0's turns
        [NAN, NAN, NAN, NAN, lo - r2, lo - r2],
        [NAN, NAN, n1, n1, lo, lo],  # first leaf of node 1
        [NAN, NAN, NAN, NAN, lo, lo],
        [hi] * 5,  # plain episodes: GRPO's advantage on every turn
        [lo] * 5,
    ]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_step_weight_scales_only_the_step_term_and_plain_groups_are_grpo():
    leaves = _tree_group()
    a_ep = advantages([lf.reward for lf in leaves])
    got = turn_advantages(leaves, a_ep, step_weight=0.0)
    s = math.sqrt(4 / 15)
    hi, lo = (2 / 3) / s, (-1 / 3) / s
    np.testing.assert_allclose(got[0], [(hi + 3 * lo) / 4] * 2 + [(hi + lo) / 2] * 2 + [hi] * 2,
                               rtol=1e-4)  # fmt: skip
    plain = [Leaf(r, 3) for r in (1.0, 0.0, 0.5)]
    assert not has_trees(plain)
    a = advantages([1.0, 0.0, 0.5])
    for g, ai in zip(turn_advantages(plain, a, step_weight=1.0), a, strict=True):
        np.testing.assert_allclose(g, [ai] * 3, rtol=1e-6)


def test_every_turn_of_a_tree_is_trained_exactly_once():
    leaves = _tree_group()
    got = turn_advantages(leaves, advantages([lf.reward for lf in leaves]))
    # Turns of the tree: root [0, 2) once, nodes 0 and 1 [2, 4) once each, leaves [4, 6).
    tree_trained = sum(int((~np.isnan(g)).sum()) for g in got[:4])
    assert tree_trained == 2 + 2 * 2 + 4 * 2
    assert all(not np.isnan(g).any() for g in got[4:])


def test_a_replayed_or_dropped_leaf_changes_who_trains_the_shared_turns():
    leaves = _tree_group()[1:]  # leaf (0, 0) was dropped (stale): (0, 1) trains the root
    got = turn_advantages(leaves, advantages([lf.reward for lf in leaves]))
    assert not np.isnan(got[0][:4]).any()
    assert np.isnan(got[1][:2]).all() and not np.isnan(got[1][2:]).any()
    # Node 0 has one leaf left: no siblings in its set but node 1 -> still a set of two.
    # Leaf (0, 1) has no sibling left at depth 2: its step term there is 0.
    a_ep = advantages([lf.reward for lf in leaves])
    assert got[0][5] == pytest.approx(a_ep[0], rel=1e-5)


def test_loss_with_per_token_advantages_leaves_masked_tokens_without_gradient():
    torch.manual_seed(0)
    logp = torch.randn(2, 4, requires_grad=True)
    prox = logp.detach().clone()
    adv = torch.tensor([[1.0, 1.0, -0.5, 0.0], [0.0, 0.0, 2.0, 2.0]])
    mask = torch.tensor([[True, True, True, False], [False, False, True, True]])
    loss, m = arpo_loss(logp, prox, prox, adv, mask, torch.tensor([False, False]), LossConfig())
    loss.backward()
    assert logp.grad[0, 3] == 0 and logp.grad[1, :2].abs().sum() == 0
    assert (logp.grad[mask] != 0).all()
    assert m["tokens"] == 5
    # Per-token advantages equal to a per-row one give the same loss as the [B] form.
    same = torch.tensor([[0.7] * 4, [-0.3] * 4])
    full = torch.ones(2, 4, dtype=torch.bool)
    l1, _ = arpo_loss(
        logp.detach(), prox, prox, same, full, torch.tensor([False, False]), LossConfig()
    )
    l2, _ = arpo_loss(logp.detach(), prox, prox, torch.tensor([0.7, -0.3]), full,
                      torch.tensor([False, False]), LossConfig())  # fmt: skip
    assert l1.item() == pytest.approx(l2.item())


def test_a_tree_split_over_two_groups_trains_its_shared_turns_once():
    from arpo.learner.tree import TrainedNodes

    leaves = _tree_group()[:4]
    seen = TrainedNodes()
    first, second = leaves[:2], leaves[2:]  # leaves (0, *) then (1, *)
    a = turn_advantages(first, advantages([lf.reward for lf in first]))
    assert seen.drop_trained(first, a) == 0
    b = turn_advantages(second, advantages([lf.reward for lf in second]))
    assert not np.isnan(b[0][:2]).any()  # the second group alone would train the root again
    assert seen.drop_trained(second, b) == 2
    assert np.isnan(b[0][:2]).all() and not np.isnan(b[0][2:]).any()
    trained = sum(int((~np.isnan(x)).sum()) for x in (*a, *b))
    assert trained == 2 + 2 * 2 + 4 * 2  # each turn of the tree once, as in one group

"""Step-level credit for tree rollouts: advantages per turn, each shared turn trained once.

A group may hold the leaves of tree rollouts (`arpo.actor.tree`, `Trajectory.branch`):
leaves of one tree share their turns up to the branch point where they parted. The
credit combines GRPO's episode-level advantage with a step-level one computed within
each set of siblings (children forked from the same saved state), as GiGPO and
Tree-GRPO do.

For a group of N leaves with total rewards R_l:

    A_l        = (R_l - mean R) / (std R + eps)                 GRPO (`groups.advantages`)
    node n     = (tree, p): a tree and a start p of a leaf's path (p = () is the root)
    leaves(n)  = the group's leaves of that tree whose path starts with p
    V(n)       = mean_{l in leaves(n)} R_l
    S(n)       = the nodes (tree, p[:-1] + (j,)) with leaves in the group: the children of
                 the same branch point, n included (only for p != ())
    A_step(n)  = (V(n) - mean_S V) / (std_S V + eps)   when |S(n)| >= 2, else 0;
                 0 for a root
    A(n)       = mean_{l in leaves(n)} A_l + w * A_step(n)      (w = `step_weight`)

Every turn of a leaf belongs to exactly one node on its path: with steps s_1 < ... < s_D
(`Branch.steps`), turns [s_d, s_{d+1}) belong to the node of depth d (s_0 = 0, s_{D+1} =
the leaf's length). Those turns are the same tokens in every leaf of the node; they are
trained once, in the first of the node's leaves in the group's order, with advantage
A(n), and left out (NaN) of the others. std is the sample standard deviation (ddof 1, as
the group advantage); `norm_std = False` (Dr. GRPO) drops both divisions.

Consequences and deviations:
- A group without trees (every leaf its own root) gets exactly GRPO's advantages: A(n) =
  A_l, A_step = 0. Tree credit changes nothing for plain groups.
- The root's own turns (before the first branch point) get the mean episode advantage of
  the tree's leaves: 0 when the group is one tree, the tree's standing against the
  group's other trees and episodes otherwise. The root gets no step-level term: all roots
  start from the task's start, where the episode advantage already compares them.
- A replayed success (ARPO's replay) enters the group as a root of its own: the branch
  point it was forked from belongs to an earlier group, and the one state it shares
  with this group is the task's start, so its sibling set is the roots', where its
  credit is its episode advantage (as in plain ARPO).
- A turn trained once counts once in the loss's mean over the tokens of its trajectory
  (`seq-mean-token-mean`): a leaf whose shared turns are trained by another leaf averages
  over its own turns only. Tree-GRPO instead weights a shared prefix by its number of
  leaves; here it counts once, with its leaves' mean advantage.
- Leaves the learner dropped (stale, invalid, replaced by a replay) are not in any node:
  credit is computed from the leaves it trains.
- A group is its task's oldest trajectories in the store, so a tree's leaves, which
  arrive together, normally form one group; when they are split over two groups (several
  groups of the task in flight), each group's credit is computed from its own leaves, and
  a shared turn already trained with the first group is left out of the second
  (`TrainedNodes`): still trained once.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from arpo.record import Branch


@dataclass(frozen=True, slots=True)
class Leaf:
    """What the credit needs of one trajectory of the group."""

    reward: float
    turns: int
    branch: Branch | None = None
    """None, or ignored for a replayed success: a root of its own."""


def _spread(values: Sequence[float], norm_std: bool, eps: float) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    if v.size < 2:
        return np.zeros(v.size)
    a = v - v.mean()
    return a / (v.std(ddof=1) + eps) if norm_std else a


def has_trees(leaves: Sequence[Leaf]) -> bool:
    """Whether any two leaves share turns (a tree with more than one leaf)."""
    seen: set[str] = set()
    for lf in leaves:
        if lf.branch is not None:
            if lf.branch.tree in seen:
                return True
            seen.add(lf.branch.tree)
    return False


def turn_advantages(
    leaves: Sequence[Leaf],
    episode_adv: Sequence[float] | np.ndarray,
    *,
    step_weight: float = 1.0,
    norm_std: bool = True,
    eps: float = 1e-6,
) -> list[np.ndarray]:
    """Per leaf, one advantage per turn (float32), NaN where another leaf trains the turn
    (see the module docstring). `episode_adv`: the group's GRPO advantages, leaf order."""
    n = len(leaves)
    a_ep = np.asarray(episode_adv, dtype=np.float64)
    if a_ep.shape != (n,):
        raise ValueError(f"{n} leaves but {a_ep.shape} episode advantages")
    # Each leaf's tree and path; a leaf without a branch is a tree of its own.
    trees = [lf.branch.tree if lf.branch is not None else f"\0{i}" for i, lf in enumerate(leaves)]
    paths = [lf.branch.path if lf.branch is not None else () for lf in leaves]
    steps = [lf.branch.steps if lf.branch is not None else () for lf in leaves]
    members: dict[tuple[str, tuple[int, ...]], list[int]] = defaultdict(list)
    for i in range(n):
        for d in range(len(paths[i]) + 1):
            members[(trees[i], paths[i][:d])].append(i)
    value = {k: float(np.mean([leaves[i].reward for i in ids])) for k, ids in members.items()}
    step_adv: dict[tuple[str, tuple[int, ...]], float] = {}
    siblings: dict[tuple[str, tuple[int, ...]], list[tuple[str, tuple[int, ...]]]] = defaultdict(
        list
    )
    for key in members:
        tree, p = key
        if p:
            siblings[(tree, p[:-1])].append(key)
        else:
            step_adv[key] = 0.0
    for kids in siblings.values():
        for key, a in zip(kids, _spread([value[k] for k in kids], norm_std, eps), strict=True):
            step_adv[key] = float(a)
    node_adv = {
        k: float(a_ep[ids].mean()) + step_weight * step_adv[k] for k, ids in members.items()
    }
    out = []
    for i, lf in enumerate(leaves):
        adv = np.full(lf.turns, np.nan, dtype=np.float32)
        bounds = [0, *steps[i], lf.turns]
        for d in range(len(paths[i]) + 1):
            key = (trees[i], paths[i][:d])
            if members[key][0] != i:
                continue  # trained in the node's first leaf
            lo, hi = min(bounds[d], lf.turns), min(bounds[d + 1], lf.turns)
            adv[lo:hi] = node_adv[key]
        out.append(adv)
    return out


class TrainedNodes:
    """The tree nodes whose shared turns have been trained (bounded: the oldest are
    forgotten), so that a tree split over two groups trains each shared turn once."""

    MAX_NODES = 1 << 16

    def __init__(self) -> None:
        self._done: OrderedDict[tuple[str, tuple[int, ...]], None] = OrderedDict()

    def drop_trained(self, leaves: Sequence[Leaf], per_turn: list[np.ndarray]) -> int:
        """Set to NaN the turns of `per_turn` (from `turn_advantages`) that belong to shared
        nodes trained before, then remember the shared nodes trained now; the turns left
        out."""
        dropped = 0
        now: list[tuple[str, tuple[int, ...]]] = []
        for lf, adv in zip(leaves, per_turn, strict=True):
            b = lf.branch
            if b is None or not b.path:
                continue
            bounds = [0, *b.steps, lf.turns]
            for d in range(len(b.path)):  # the shared nodes on its path (not its own)
                key = (b.tree, b.path[:d])
                lo, hi = min(bounds[d], lf.turns), min(bounds[d + 1], lf.turns)
                if key in self._done:
                    dropped += int((~np.isnan(adv[lo:hi])).sum())
                    adv[lo:hi] = np.nan
                elif not np.isnan(adv[lo:hi]).all():
                    now.append(key)
        for key in now:
            self._done[key] = None
            self._done.move_to_end(key)
        while len(self._done) > self.MAX_NODES:
            self._done.popitem(last=False)
        return dropped

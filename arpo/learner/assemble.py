"""Groups for the GRPO step: taken from the store, filtered, replayed into, scored.

    asm = GroupAssembler(store, AssembleConfig(group_size=8, groups_per_step=16))
    batch = asm.next_batch(version=7, timeout=600)   # -> Batch (samples + counts)

A group is the `group_size` oldest fresh trajectories of one task in the store
(`ReplayStore.take_group`, all or nothing). Actors fill groups through task grants
(`arpo.service.grants`), so these are normally one grant's episodes; when more groups
of a task are in flight than one, a group may mix episodes of two grants of the same
task (same task, policy versions within the staleness bound), which GRPO treats the
same way.

For each group taken, in this order (the reference's, plus the filters of an
asynchronous system):

1. Trajectories whose status is not `ok` (ingest keeps them out of the store, but a
   store restored from elsewhere or an embedding program may hold them) are dropped
   (`data/dropped_status`). So is any trajectory the learner cannot score exactly,
   before anything is computed from the group: a turn sampled with other settings than
   `sampling` (the learner's temperature and top_p; `data/dropped_sampling`), or a
   record the model cannot train on (`check`: image tokens that disagree with the
   screenshots, token ids outside the vocabulary, an unreadable screenshot;
   `data/dropped_invalid`).
2. Successes (checker score > `replay.admit_score_above`) are noted for the task's
   replay buffer whatever their age: a success too stale to train as a fresh episode
   is still a success to replay (its importance weight corrects it).
3. Trajectories older than `max_staleness` versions (oldest turn's version <
   v - max_staleness) are dropped (`data/dropped_stale`).
4. Replay (`arpo.learner.groups`, the reference rule by default): when the group's
   checker scores have population std < 0.05 and mean < 0.2, `k` successes of the task
   from its replay buffer (uniformly, or the newest) replace the last `k` fresh
   trajectories of the group ('replace', the reference) or are added to it ('add').
   Replayed trajectories keep their own behaviour log-probs and versions; the loss's
   importance weight corrects them (`arpo.learner.loss`). A picked success that fails
   the checks of step 1 is evicted from the buffer (`replay/evicted`) and another is
   picked.
5. The successes noted in step 2 enter the buffer (the store's replay role: capacity
   per task, FIFO), after the pick, so a group never gets its own success back in
   place of a real episode.
6. Group advantages from the total rewards (after replay; `advantage_side` can keep
   only the positive or only the negative ones, an ablation). A group holding tree
   rollouts also gets advantages per turn, each shared turn trained once
   (`arpo.learner.tree`, weighted by `step_weight`). A group left with fewer
   than `min_group_size` trajectories is dropped (`data/dropped_groups`).

`next_batch` gathers `groups_per_step` groups, oldest first (of the tasks with a full
group, the one whose next group starts with the lowest policy version, then the earliest
arrival: groups are trained in the order they were sampled, so one that waited for its
last episode is not overtaken until it is stale), waiting (in slices of `poll_s`) until
enough have formed.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from arpo import store_item
from arpo.config import check_range, fail, option, validate
from arpo.errors import BufferTimeout, BufferValueError, UnknownTask
from arpo.learner.groups import ReplayConfig, advantages, needs_replay
from arpo.learner.tree import Leaf, TrainedNodes, has_trees, turn_advantages
from arpo.record import Branch, Status, Trajectory

log = logging.getLogger("arpo.learner.assemble")


MAX_STEP_TRAJECTORIES = 1 << 16
"""Most trajectories one learner step may need (group_size x groups_per_step)."""


@dataclass
class AssembleConfig:
    """How groups are formed from the store."""

    group_size: int = option(8, "Fresh episodes per group (GRPO's G).")
    groups_per_step: int = option(16, "Groups per training iteration.")
    max_staleness: int = option(
        1, "Drop fresh trajectories more than this many versions behind the learner."
    )
    min_group_size: int = option(
        2, "Drop a group left with fewer trajectories than this after filtering."
    )
    norm_std: bool = option(True, "Divide advantages by the group's std (false: Dr. GRPO).")
    advantage_side: Literal["both", "positive", "negative"] = option(
        "both",
        "Which advantages train: 'both' (GRPO), 'positive' (negative ones set to 0: only "
        "episodes better than their group are pushed up) or 'negative' (only worse ones "
        "pushed down). An ablation of what drives learning; 'both' is the method.",
    )
    drop_flat_groups: bool = option(
        False,
        "Leave out groups whose advantages are all 0 (they add no gradient; the reference "
        "keeps them, and they count in the mean over trajectories).",
    )
    step_weight: float = option(
        1.0,
        "Weight of the step-level advantage of tree rollouts (`arpo.learner.tree`: "
        "A = mean episode advantage of a node's leaves + step_weight * its advantage "
        "among its siblings); groups without trees are not affected.",
    )
    poll_s: float = option(0.05, "How often the store is checked while waiting for groups.")
    replay: ReplayConfig = option(ReplayConfig(), "Replay of past successes.")

    def validate(self) -> None:
        if self.group_size < 1:
            fail("group_size", "must be >= 1")
        if self.groups_per_step < 1:
            fail("groups_per_step", "must be >= 1")
        if self.group_size * self.groups_per_step > MAX_STEP_TRAJECTORIES:
            fail(
                "groups_per_step",
                f"x group_size is {self.group_size * self.groups_per_step} trajectories per "
                f"step; at most {MAX_STEP_TRAJECTORIES} (the paper's step is 32 x 8)",
            )
        if self.max_staleness < 0:
            fail("max_staleness", "must be >= 0")
        if self.min_group_size < 1:
            fail("min_group_size", "must be >= 1")
        check_range("poll_s", self.poll_s, 0.0, 60.0, "seconds between looks at the store",
                    lo_open=True)  # fmt: skip
        check_range("step_weight", self.step_weight, 0.0, 100.0,
                    "weight of the step-level term of tree credit")  # fmt: skip
        if self.advantage_side not in ("both", "positive", "negative"):
            fail("advantage_side", "must be 'both', 'positive' or 'negative'")
        self.replay.validate()
        if self.replay.mode == "replace" and self.replay.k >= self.group_size:
            fail("replay.k", f"must be below group_size ({self.group_size}) with mode 'replace'")


@dataclass
class Sample:
    """One trajectory of a batch, with its group advantage."""

    item: Any
    """The store item (`arpo.store_item.to_item` layout)."""
    task_id: str
    trajectory_id: str
    reward: float
    checker_score: float
    version: int
    """Oldest policy version among its turns."""
    advantage: float
    is_replay: bool
    group: int
    """Index of its group within the batch."""
    branch: Branch | None = None
    """Its place in a tree rollout (`Trajectory.branch`)."""
    turns: int = 0
    turn_advantages: np.ndarray | None = None
    """Per turn (float32), for a group with tree rollouts (`arpo.learner.tree`): the
    advantage of each turn, NaN for a turn another sample of the group trains. None: every
    turn has `advantage`."""


@dataclass
class Batch:
    samples: list[Sample]
    groups: int
    counts: dict[str, float] = field(default_factory=dict)
    """data/* and replay/* counters of this batch."""
    dropped: list[tuple[str, str]] = field(default_factory=list)
    """(trajectory id, reason) of the fresh trajectories taken from the store and left out."""
    sequences: list[Any] | None = None
    """The samples' `TrainSequence`s, in order, when they were made ahead of the step
    (the learner's prefetch); None: the trainer makes them."""


Check = Callable[[Any, Trajectory], "str | None"]
"""Why a store item (and its decoded trajectory) cannot be trained on, or None."""

_REPLAY_TRIES = 8
"""Picks per triggered group before giving up on a buffer of untrainable successes."""


def sampling_mismatch(traj: Trajectory, temperature: float, top_p: float) -> str | None:
    """Why `traj` was not sampled with (temperature, top_p), or None when every turn was."""
    for i, t in enumerate(traj.turns):
        if not (math.isclose(t.temperature, temperature, rel_tol=1e-6)
                and math.isclose(t.top_p, top_p, rel_tol=1e-6)):  # fmt: skip
            got = (
                "without recorded sampling settings"
                if math.isnan(t.temperature)
                else f"at temperature {t.temperature:g}, top_p {t.top_p:g}"
            )
            return (
                f"turn {i} was sampled {got}; the learner scores temperature "
                f"{temperature:g}, top_p {top_p:g}"
            )
    return None


def _sample(item: Any, traj: Any, task: str, *, is_replay: bool) -> Sample:
    """A sample of `item` (advantage and group filled in later)."""
    return Sample(item, task, traj.trajectory_id, traj.reward, traj.checker_score,
                  traj.min_version, 0.0, is_replay, -1, traj.branch, traj.steps)  # fmt: skip


class GroupAssembler:
    """Takes groups from a `ReplayStore` (the learner is its only consumer)."""

    def __init__(
        self,
        store: Any,
        config: AssembleConfig | None = None,
        *,
        sampling: tuple[float, float] | None = None,
        check: Check | None = None,
    ) -> None:
        """`sampling`: the (temperature, top_p) the learner scores; trajectories with a
        turn sampled otherwise are dropped (None: not checked). `check(item, traj)`: why a
        record cannot be trained on by this model, or None (see the module docstring)."""
        self.store = store
        self.config = validate(config or AssembleConfig())
        self.sampling = sampling
        self.check = check
        self.dropped_groups = 0
        """Groups taken from the store and dropped whole (never trained) so far."""
        self._pending: list[list[Sample]] = []
        """Groups taken but not yet handed out (a call that timed out keeps them)."""
        self._pending_counts: collections.Counter[str] = collections.Counter()
        self._pending_dropped: list[tuple[str, str]] = []
        self._trained_nodes = TrainedNodes()
        """Shared turns of trees already trained (a tree split over two groups)."""
        self.totals: collections.Counter[str] = collections.Counter()
        """Counters over the whole run (same names as Batch.counts)."""

    def _ready_tasks(self) -> list[str]:
        """Tasks with a full group, oldest first (see the module docstring)."""
        g = self.config.group_size
        heads = []
        for t in self.store.tasks():
            if self.store.fresh_len(t) >= g:
                head = self.store.fresh_head(t)
                if head is not None:
                    heads.append((head, t))
        return [t for _, t in sorted(heads)]

    def next_batch(self, version: int, timeout: float | None = None) -> Batch | None:
        """`groups_per_step` scored groups; None when `timeout` passes first (groups taken
        so far are kept for the next call)."""
        cfg = self.config
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self._pending) < cfg.groups_per_step:
            took = False
            for task in self._ready_tasks():
                if len(self._pending) >= cfg.groups_per_step:
                    break
                try:
                    items = self.store.take_group(task, cfg.group_size, timeout=0)
                except BufferTimeout:
                    continue
                took = True
                group = self._score(task, items, version, self._pending_counts)
                if group:
                    self._pending.append(group)
            if len(self._pending) >= cfg.groups_per_step:
                break
            if deadline is not None and time.monotonic() >= deadline:
                return None
            if not took:
                time.sleep(cfg.poll_s)
        groups = self._pending[: cfg.groups_per_step]
        self._pending = self._pending[cfg.groups_per_step :]
        return self._batch(groups, version)

    def flush(self, version: int) -> Batch | None:
        """The groups taken so far (fewer than `groups_per_step`) and the drops decided so
        far, as a last batch; None when there are none. For a stop: the final checkpoint's
        store snapshot holds no taken group, so a partial batch left here would be lost."""
        if not self._pending and not self._pending_dropped:
            return None
        groups, self._pending = self._pending, []
        return self._batch(groups, version)

    def _batch(self, groups: list[list[Sample]], version: int) -> Batch:
        samples = []
        for gi, grp in enumerate(groups):
            for s in grp:
                s.group = gi
                samples.append(s)
        counts = dict(self._pending_counts)
        self._pending_counts = collections.Counter()
        dropped, self._pending_dropped = self._pending_dropped, []
        replayed = [s for s in samples if s.is_replay]
        counts["data/groups"] = len(groups)
        counts["data/trajectories"] = len(samples)
        counts["replay/hits"] = len(replayed)
        counts["replay/version_gap_mean"] = (
            float(np.mean([version - s.version for s in replayed])) if replayed else math.nan
        )
        fresh = [s for s in samples if not s.is_replay]
        counts["data/staleness_mean"] = (
            float(np.mean([version - s.version for s in fresh])) if fresh else math.nan
        )
        counts["data/staleness_max"] = float(max((version - s.version for s in fresh), default=0))
        self.totals.update({k: v for k, v in counts.items() if not math.isnan(v)})
        return Batch(samples, len(groups), counts, dropped)

    def _untrainable(self, item: Any, traj: Trajectory) -> tuple[str, str] | None:
        """(counter, reason) when the learner cannot score `traj` exactly, else None."""
        if self.sampling is not None:
            why = sampling_mismatch(traj, *self.sampling)
            if why is not None:
                return "sampling", why
        if self.check is not None:
            try:
                why = self.check(item, traj)
            except Exception as e:  # one bad record never stops the learner
                why = f"the check failed: {type(e).__name__}: {e}"
            if why is not None:
                return "invalid", why
        return None

    def _score(
        self, task: str, items: list[Any], version: int, counts: collections.Counter[str]
    ) -> list[Sample]:
        cfg = self.config
        kept: list[Sample] = []
        successes: list[Any] = []
        for item in items:
            traj = store_item.from_item(item)
            if traj.status != Status.OK:
                counts["data/dropped_status"] += 1
                self._pending_dropped.append((traj.trajectory_id, "status"))
                continue
            bad = self._untrainable(item, traj)
            if bad is not None:
                kind, why = bad
                counts[f"data/dropped_{kind}"] += 1
                self._pending_dropped.append((traj.trajectory_id, kind))
                log.warning("dropping trajectory %s of task %s: %s", traj.trajectory_id, task,
                            why)  # fmt: skip
                continue
            if cfg.replay.admits(traj.status, traj.checker_score):
                successes.append(item)  # enters the buffer below, whatever its age
            if traj.min_version < version - cfg.max_staleness:
                counts["data/dropped_stale"] += 1
                self._pending_dropped.append((traj.trajectory_id, "stale"))
                continue
            kept.append(_sample(item, traj, task, is_replay=False))
        if kept and needs_replay([s.checker_score for s in kept], cfg.replay):
            counts["replay/triggered"] += 1
            picked = self._replay(task, counts)
            if picked:
                if cfg.replay.mode == "replace":
                    out = kept[len(kept) - len(picked) :]
                    self._pending_dropped += [(s.trajectory_id, "replaced") for s in out]
                    kept = kept[: len(kept) - len(picked)]
                kept += picked
        for item in successes:  # after the pick: never the group's own success
            self.store.add_success(task, item)
            counts["replay/admitted"] += 1
        if len(kept) < cfg.min_group_size:
            counts["data/dropped_groups"] += 1
            self.dropped_groups += 1
            self._pending_dropped += [(s.trajectory_id, "small_group") for s in kept
                                      if not s.is_replay]  # fmt: skip
            return []
        adv = advantages([s.reward for s in kept], norm_std=cfg.norm_std)
        leaves = [Leaf(s.reward, s.turns, None if s.is_replay else s.branch) for s in kept]
        per_turn = None
        if any(lf.branch is not None and lf.branch.path for lf in leaves):
            counts["data/tree_groups"] += int(has_trees(leaves))
            per_turn = turn_advantages(leaves, adv, step_weight=cfg.step_weight,
                                       norm_std=cfg.norm_std)  # fmt: skip
            self._trained_nodes.drop_trained(leaves, per_turn)
            counts["data/shared_turns"] += sum(int(np.isnan(t).sum()) for t in per_turn)
        if cfg.advantage_side == "positive":
            adv = np.maximum(adv, 0.0)
            per_turn = None if per_turn is None else [np.fmax(t, 0.0) for t in per_turn]
        elif cfg.advantage_side == "negative":
            adv = np.minimum(adv, 0.0)
            per_turn = None if per_turn is None else [np.fmin(t, 0.0) for t in per_turn]
        flat = not np.any(adv) and (
            per_turn is None or not any(np.nan_to_num(t).any() for t in per_turn)
        )
        if cfg.drop_flat_groups and flat:
            counts["data/dropped_flat_groups"] += 1
            self.dropped_groups += 1
            self._pending_dropped += [(s.trajectory_id, "flat_group") for s in kept
                                      if not s.is_replay]  # fmt: skip
            return []
        for i, (s, a) in enumerate(zip(kept, adv, strict=True)):
            s.advantage = float(a)
            s.turn_advantages = None if per_turn is None else per_turn[i]
        return kept

    def _replay(self, task: str, counts: collections.Counter[str]) -> list[Sample]:
        """`replay.k` trainable successes of `task` from its buffer (fewer if it has none):
        a picked success that cannot be trained is evicted and another one picked."""
        r = self.config.replay
        mode = "newest" if r.pick == "newest" else "uniform"
        out: list[Sample] = []
        for _ in range(_REPLAY_TRIES):
            if len(out) >= r.k:
                break
            try:
                items = self.store.sample(task, r.k - len(out), mode=mode)
            except (BufferValueError, UnknownTask):
                break  # no success of this task (left)
            for item in items:
                traj = store_item.from_item(item)
                bad = self._untrainable(item, traj)
                if bad is None:
                    out.append(_sample(item, traj, task, is_replay=True))
                    continue
                log.warning("evicting replayed success %s of task %s: %s",
                            traj.trajectory_id, task, bad[1])  # fmt: skip
                counts["replay/evicted"] += self.store.remove_replay(task, [item.key])
        return out[: r.k]

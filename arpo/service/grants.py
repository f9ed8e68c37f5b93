"""Task grants: which episode each actor runs next, so groups fill evenly and staleness stays bounded.

    book = GrantBook(tasks, GrantConfig(group_size=8, groups_per_step=16, max_staleness=1))
    server = GrantServer(book, TransportConfig(control="tcp://127.0.0.1:5556"))
    server.start()                              # answers GrantRequest / WeightsRequest / Heartbeat
    book.request("actor-0", want=1, pool="sim")  # what the server does for a GrantRequest
    server.publish_weights(version, safetensors_bytes, path)   # after each optimizer step
    Ingest(store, ..., version=lambda: server.version, on_trajectory=book.complete)

A grant is (task, group, slot) plus the task's JSON, so actors need no task files.

- Pools: every task runs on one kind of environment, its pool (`arpo.env.task.task_pool`:
  the task's "pool" field, else "sim" for simulated desktop tasks, else "desktop"). A
  request names the pool of the environment that will run the episode and gets only
  tasks of that pool (a LibreOffice task never goes to a simulated desktop); pool ""
  takes any task. Each pool visits its own tasks round robin; a pool with no tasks gets
  nothing (and a warning, once per pool, naming the pools there are).
- Groups: a new group takes the next task of the pool (round robin) and has
  `group_size` slots; open slots of older groups (of the pool) are granted before a new
  group opens, so every group fills up to its size.
- Admission (AReaL's staleness control): with the learner at policy version v, at most
  `v * groups_per_step + dropped + (max_staleness + 1) * groups_per_step` groups are
  ever opened, where `dropped` counts the groups the learner took out of the store and
  dropped whole (e.g. every episode too stale) instead of training them. The learner
  trains `groups_per_step` groups per version, in the order they complete, so a group
  opened at version v (and the grants of its slots, issued at v or later) is trained by
  version v + max_staleness when groups complete in the order they opened. A dropped
  group is replaced by one new group; a group the learner has taken but not trained yet
  (it waits for the rest of its batch) frees no place, so the window never widens.
  When nothing may be granted, the reply is empty with a `retry` delay. Admission counts
  the groups of all pools together.
- Versions: every grant carries `min_version`, the learner's version when the grant was
  issued; an actor holding older weights fetches the newest before it starts the
  episode, so no turn of it is sampled with weights older than the grant.
- Sampling: with `sampling` on (the learner turns it on) every grant carries the
  temperature and top_p the learner scores log-probs at, and the actor samples with
  them instead of its own settings.
- Re-issue: a grant not completed within `grant_timeout_s` (its actor died, its
  environment hung) goes to the next actor that asks, under a new grant id; so does
  every grant of an actor not heard from for `silent_actor_s` (no heartbeat on the data
  link, `seen`, and no request on the control link: its process or its node is gone),
  without waiting for the grant timeout. If both
  attempts deliver, the first to arrive fills the slot and the other is a surplus
  (`complete` returns False: ingest acknowledges it but does not store it).
- A trajectory with status env_error / eval_error / timeout does not fill its slot: the
  slot is granted again, up to `max_attempts` times, then given up (counted).
- Tasks out of the run: a task whose setup keeps failing (`retire_after_envs`,
  `retire_after_failures`), or whose checker keeps raising (`retire_after_eval_errors`
  eval_error episodes in a row), leaves the run (`retire`, listed in `retired` with why);
  `checker_failures` keeps each task's eval_errors (count, first and last error) for the
  learner's messages.
- A trajectory of a group the book does not know (granted before a learner restart) is
  accepted as it is.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import math
import os
import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from arpo import wire
from arpo.config import (
    MAX_TEMPERATURE,
    check_on_build,
    check_range,
    check_seconds,
    fail,
    option,
)
from arpo.env.task import task_pool
from arpo.env.taskfiles import BUSY, TaskFiles
from arpo.errors import TaskError, WireError
from arpo.logs import LogLimiter
from arpo.record import Status, Trajectory, ident_problem
from arpo.transport import RouterServer, TransportConfig, WeightsServer

log = logging.getLogger("arpo.service.grants")


@dataclass
class GrantConfig:
    """How task grants are handed out."""

    group_size: int = option(8, "Episodes per group (GRPO's G).")
    groups_per_step: int = option(16, "Groups the learner consumes per policy version.")
    max_staleness: int = option(
        1, "Most policy versions between a grant and the training step that uses it."
    )
    grant_timeout_s: float = option(
        1800.0, "A grant not completed this long is given to another actor."
    )
    silent_actor_s: float = option(
        30.0,
        "Every grant of an actor not heard from this long (no heartbeat, no request; actors "
        "send a heartbeat every transport.heartbeat_s) goes to the next actor that asks, as "
        "an expired grant does: a node or actor lost mid-run holds no slot for longer. "
        "0: only grant_timeout_s re-issues.",
    )
    max_attempts: int = option(
        3, "Grants of one slot whose episodes failed for environment reasons before giving up."
    )
    retry_s: float = option(0.5, "When nothing can be granted, actors ask again after this.")
    shuffle: bool = option(True, "Visit the tasks in a new random order every round.")
    seed: int = option(0, "Seed of the task order.")
    sampling: bool = option(
        False,
        "Grants carry temperature and top_p (the learner turns this on with its trainer's "
        "settings); off, actors sample with their own episode settings.",
    )
    temperature: float = option(
        1.0, "Sampling temperature grants carry (the learner sets trainer.temperature)."
    )
    top_p: float = option(1.0, "Nucleus grants carry (the learner sets trainer.top_p).")
    free_given_up: bool = option(
        True,
        "A group that finished with a slot given up frees its place in admission, as a "
        "dropped group does, so groups nobody can finish never fill the window (training). "
        "Pool runs, which run every task a fixed number of times, turn it off.",
    )
    retire_after_envs: int = option(
        2,
        "A task whose setup failed (setup_error: the environment reset fine, the task's "
        "setup did not) on this many different environments leaves the run: it is granted "
        "no more, its open groups are given up, and the run goes on with the other tasks.",
    )
    retire_after_failures: int = option(
        4,
        "A task whose setup failed this many times in a row, on any environments, with no "
        "setup of it going through in between, leaves the run too (a run with fewer "
        "environments than retire_after_envs).",
    )
    retire_after_eval_errors: int = option(
        4,
        "A task whose checker could not run (eval_error: a getter or metric raised) this "
        "many times in a row, with no episode of it scored in between, leaves the run too, "
        "its first and last error as the reason: a checker that raises scores no episode "
        "of it. 0: never (pool runs, which run every task a fixed number of times).",
    )

    tree_slots: int = option(
        0,
        "Tree rollouts (`arpo.actor.tree`): a new group's slots are granted this many at a "
        "time as one tree grant, which one actor runs on one environment, forking it at "
        "branch points. 0 or 1: one episode per grant (plain GRPO groups). A slot granted "
        "again (its episode failed, its grant expired) is always a plain grant.",
    )
    branch_width: int = option(2, "Children per branch point of a tree grant (2..tree_slots).")
    branch_every: int = option(
        3,
        "A tree's branch points: after every this many turns, each node still holding "
        "more than one slot forks into branch_width children.",
    )

    def __post_init__(self) -> None:
        check_on_build(self)

    def validate(self) -> None:
        if self.group_size < 1:
            fail("group_size", "must be >= 1")
        if self.groups_per_step < 1:
            fail("groups_per_step", "must be >= 1")
        if self.max_staleness < 0:
            fail("max_staleness", "must be >= 0 (0: fully synchronous)")
        if self.tree_slots:
            # Against group_size where the grants are handed out (GrantBook), and against
            # assemble.group_size in a learner's config, whose grants take that group size.
            check_range("tree_slots", self.tree_slots, 0, wire.MAX_TREE_SLOTS,
                        "slots per tree rollout; 0: no trees")  # fmt: skip
            if self.tree_slots >= 2:
                check_range("branch_width", self.branch_width, 2, self.tree_slots,
                            "children per branch point")  # fmt: skip
                check_range("branch_every", self.branch_every, 1, wire.MAX_BRANCH_EVERY,
                            "turns between branch points")  # fmt: skip
        check_seconds("grant_timeout_s", self.grant_timeout_s)
        check_seconds("silent_actor_s", self.silent_actor_s, zero="0: never")
        if self.max_attempts < 1:
            fail("max_attempts", "must be >= 1")
        if not 0.0 < self.retry_s <= 60.0:
            fail("retry_s", "must be in (0, 60] seconds (how soon a refused actor asks again)")
        if self.seed < 0:
            fail("seed", "must be >= 0")
        check_range("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1]")
        if self.retire_after_envs < 1:
            fail("retire_after_envs", "must be >= 1 (environments a task's setup failed on)")
        if self.retire_after_failures < 1:
            fail("retire_after_failures", "must be >= 1 (setup failures in a row)")
        check_range("retire_after_eval_errors", self.retire_after_eval_errors, 0, 1_000_000,
                    "checker failures in a row; 0: never")  # fmt: skip

    def check_tree_slots(self, group_size: int, source: str, field: str = "tree_slots") -> None:
        """`fail(field, ...)` unless `tree_slots` is in [0, min(group_size, MAX_TREE_SLOTS)]:
        a tree grant holds slots of one group. `source` names the field `group_size` is from
        (a learner's grants take the group size of its `assemble`)."""
        top = min(group_size, wire.MAX_TREE_SLOTS)
        check_range(field, self.tree_slots, 0, top,
                    f"slots per tree rollout, at most {source}; 0: no trees")  # fmt: skip


def _grant_id(group_id: str, slot: int, attempt: int) -> str:
    """A grant's id: its group, slot and attempt (`_slot_of` reads it back)."""
    return f"{group_id}/{slot}/{attempt}"


RELEASE_REASONS = frozenset({"policy_error", "stopping", "tree_ended", "cannot_fork"})
"""Reasons an actor gives a grant back for (GrantRelease.reason), each counted as
`released_<reason>`; any other is counted as `released_other`."""


def _slot_of(grant_id: str) -> tuple[str, int]:
    """(group id, slot) of a `_grant_id`; slot -1 when it is not one."""
    head, _, _attempt = grant_id.rpartition("/")
    group_id, _, slot = head.rpartition("/")
    return group_id, int(slot) if slot.isdigit() else -1


@dataclass
class _Slot:
    state: str = "open"  # open | granted | done | abandoned
    grant_id: str = ""
    actor: str = ""
    issued: float = 0.0
    attempts: int = 0
    trajectory_id: str = ""
    """The trajectory that filled the slot (a resend of it is not a surplus)."""
    last_error: str = ""
    """Why its last attempt did not fill it (a trajectory's status and error, a release)."""


@dataclass
class _Group:
    group_id: str
    task_id: str
    version: int
    slots: list[_Slot] = field(default_factory=list)

    def finished(self) -> bool:
        return all(s.state in ("done", "abandoned") for s in self.slots)


@dataclass
class _SetupFailures:
    """A task's failed setups (setup_error trajectories), or its checker's failures
    (eval_error trajectories)."""

    envs: set[str] = field(default_factory=set)
    streak: int = 0
    """Failures since the last setup of the task that went through (the last episode of it
    that was scored)."""
    count: int = 0
    first: str = ""
    last: str = ""


MAX_GIVEN_UP_KEPT = 1000
"""Given-up groups listed in `given_up` (the counter counts them all)."""


class GrantBook:
    """The bookkeeping of grants (thread-safe; no sockets)."""

    def __init__(self, tasks: Sequence[Mapping[str, Any]], config: GrantConfig | None = None):
        if not tasks:
            raise ValueError("GrantBook needs at least one task")
        self.config = config or GrantConfig()
        check_on_build(
            self.config, lambda: self.config.check_tree_slots(self.config.group_size, "group_size")
        )
        self._tasks: dict[str, str] = {}
        self._pool_of: dict[str, str] = {}
        for t in tasks:
            tid = t.get("id")
            if not isinstance(tid, str) or not tid:
                raise ValueError(f"every task needs a string 'id', got {tid!r}")
            why = ident_problem(tid)
            if why is not None:
                raise ValueError(f"task id {tid!r:.80} {why}")
            try:
                self._pool_of[tid] = task_pool(t)
            except TaskError as e:
                raise ValueError(str(e)) from None
            self._tasks[tid] = json.dumps(t, ensure_ascii=False)
        self._order: dict[str, list[str]] = {"": list(self._tasks)}
        """Pool -> its task ids ("" -> every task)."""
        for tid, pool in self._pool_of.items():
            self._order.setdefault(pool, []).append(tid)
        self._rng = random.Random(self.config.seed)
        self._cycles: dict[str, list[str]] = {}
        """Pool -> the tasks still to visit in its current round."""
        self._warned_pools: set[str] = set()
        self._lock = threading.Lock()
        self._groups: collections.OrderedDict[str, _Group] = collections.OrderedDict()
        self._finished: collections.OrderedDict[str, frozenset[str]] = collections.OrderedDict()
        """Finished group ids -> the trajectory ids that filled their slots."""
        self._counter = itertools.count()
        self.epoch = os.urandom(4).hex()
        """Part of every group id: a restarted learner's new book never reuses the ids of
        groups granted before the restart (their late trajectories stay unknown groups)."""
        self.version = 0
        self.opened = 0
        self.dropped = 0
        """Groups the learner took out of the store and dropped whole (`set_dropped`)."""
        self.counts: collections.Counter[str] = collections.Counter()

        self.closed = False
        """No more grants (`close`)."""
        self.retired: dict[str, dict[str, Any]] = {}
        """Tasks out of the run -> {"reason", "failures", "envs"} (`retire`)."""
        self._failures: dict[str, _SetupFailures] = {}
        self._checker: dict[str, _SetupFailures] = {}
        self.given_up_groups = 0
        """Groups that finished with a slot given up: each frees its place in admission."""
        self.given_up: collections.deque[dict[str, str]] = collections.deque(
            maxlen=MAX_GIVEN_UP_KEPT
        )
        """The latest given-up groups: {"group", "task", "reason"}."""
        self._seen: dict[str, float] = {}
        """Actor id -> time.monotonic() it was last heard from (`seen`, its requests)."""
        self._silent: set[str] = set()
        """Actors whose grants were re-issued for their silence (logged once each)."""
        self._last_reopen = -math.inf
        """When `_reopen_silent` last walked the granted slots (monotonic seconds)."""
        self.started = time.monotonic()
        self.last_progress = self.started
        """When an `ok` trajectory last filled a slot (time.monotonic())."""

    def seen(self, actor: str, now: float | None = None) -> None:
        """`actor` is alive (its heartbeat arrived): its grants are not re-issued for silence."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._heard(actor, now)

    def _heard(self, actor: str, now: float) -> None:
        """Note `actor` as heard at `now`; forget actors silent 10 times `silent_actor_s`
        (bounded: ids come from actors). Called with the lock held."""
        self._seen[actor] = now
        self._silent.discard(actor)
        limit = self.config.silent_actor_s
        if len(self._seen) > 10_000 or (limit and len(self._seen) > 64):
            horizon = now - 10 * max(limit, self.config.grant_timeout_s)
            for a in [a for a, t in self._seen.items() if t < horizon]:
                del self._seen[a]

    def _reopen_silent(self, now: float) -> None:
        """Open again every slot granted to an actor silent for `silent_actor_s` (counted
        as `reissued_silent`). The walk over the granted slots runs at most once every
        min(1 s, silent_actor_s / 4), however often grants are asked for. Called with the
        lock held."""
        limit = self.config.silent_actor_s
        if not limit or now - self._last_reopen < min(1.0, limit / 4):
            return
        self._last_reopen = now
        for g in self._groups.values():
            for s in g.slots:
                if s.state != "granted":
                    continue
                last = self._seen.get(s.actor, s.issued)
                if now - max(last, s.issued) > limit:
                    s.state = "open"
                    s.last_error = f"its actor {s.actor} fell silent"
                    self.counts["reissued_silent"] += 1
                    if s.actor not in self._silent:
                        self._silent.add(s.actor)
                        log.warning(
                            "actor %s has not been heard from for %.0f s (silent_actor_s): "
                            "its grants are issued again", s.actor, now - max(last, s.issued),
                        )  # fmt: skip

    def set_version(self, version: int) -> None:
        with self._lock:
            self.version = max(self.version, version)

    def close(self) -> None:
        """Issue no more grants (the learner has run its iterations): requests are answered
        with none, so the actors finish what they hold and then idle."""
        with self._lock:
            self.closed = True

    def set_dropped(self, groups: int) -> None:
        """The learner has dropped `groups` whole groups so far (taken out of the store and
        not trained, e.g. as too stale): each frees a place for one new group, so groups the
        learner had to drop can never starve it of new ones."""
        with self._lock:
            self.dropped = max(self.dropped, groups)

    def _admissible(self) -> bool:
        c = self.config
        window = (c.max_staleness + 1) * c.groups_per_step
        freed = self.dropped + (self.given_up_groups if c.free_given_up else 0)
        return self.opened < self.version * c.groups_per_step + freed + window

    @property
    def exhausted(self) -> bool:
        """Every task has left the run: nothing can be granted any more."""
        return not self._order[""]

    def retire(self, task_id: str, reason: str) -> bool:
        """Take `task_id` out of the run: no new group of it, its open groups given up
        (their places freed), listed in `retired` with `reason`. False if it was out
        already or is not a task of the book."""
        abandoned = self._retire(task_id, reason)
        if abandoned is None:
            return False
        for _ in range(abandoned):
            if self.on_abandon is not None:
                self.on_abandon(task_id)
        return True

    def _retire(self, task_id: str, reason: str) -> int | None:
        with self._lock:
            if task_id in self.retired or task_id not in self._tasks:
                return None
            f = self._failures.get(task_id) or self._checker.get(task_id) or _SetupFailures()
            self.retired[task_id] = {
                "reason": reason[:500],
                "failures": f.count,
                "envs": len(f.envs),
            }
            self.counts["tasks_retired"] += 1
            for ids in (*self._order.values(), *self._cycles.values()):
                if task_id in ids:
                    ids.remove(task_id)
            abandoned = 0
            for g in [g for g in self._groups.values() if g.task_id == task_id]:
                for sl in g.slots:
                    if sl.state in ("open", "granted"):
                        sl.state = "abandoned"
                        sl.last_error = sl.last_error or f"task retired: {reason[:200]}"
                        abandoned += 1
                self._close_if_finished(g)
            self.counts["abandoned"] += abandoned
        log.error(
            "task %s leaves the run (%d open slot(s) given up): %s", task_id, abandoned, reason
        )
        return abandoned

    def _note_setup(self, traj: Trajectory) -> str | None:
        """Count a setup_error of `traj`'s task (or reset its streak when the setup went
        through); the reason to retire the task, or None. Called with the lock held."""
        f = self._failures.setdefault(traj.task_id, _SetupFailures())
        if traj.status != Status.SETUP_ERROR:
            f.streak = 0
            return None
        f.count += 1
        f.streak += 1
        f.envs.add(f"{traj.actor_id} {traj.env}")
        f.last = traj.error or "setup failed (no reason given)"
        c = self.config
        if len(f.envs) >= c.retire_after_envs or f.streak >= c.retire_after_failures:
            return f"setup failed {f.count} time(s) on {len(f.envs)} environment(s); last: {f.last}"
        return None

    def _note_checker(self, traj: Trajectory) -> str | None:
        """Count an eval_error of `traj`'s task (or reset its streak when an episode of it
        was scored); the reason to retire the task, or None. Called with the lock held."""
        if traj.status == Status.OK:
            if traj.task_id in self._checker:
                self._checker[traj.task_id].streak = 0
            return None
        if traj.status != Status.EVAL_ERROR:
            return None
        f = self._checker.setdefault(traj.task_id, _SetupFailures())
        f.count += 1
        f.streak += 1
        f.envs.add(f"{traj.actor_id} {traj.env}")
        f.last = (traj.error or "the checker failed (no reason given)")[:300]
        f.first = f.first or f.last
        n = self.config.retire_after_eval_errors
        if n and f.streak >= n:
            return (
                f"its checker could not run {f.streak} time(s) in a row on {len(f.envs)} "
                f"environment(s) (eval_error); first: {f.first}"
                + (f"; last: {f.last}" if f.last != f.first else "")
            )
        return None

    def checker_failures(self) -> dict[str, dict[str, Any]]:
        """Task -> {"count", "first", "last"} of the eval_errors of every task whose checker
        could not run at least once (the learner names them when the run cannot go on)."""
        with self._lock:
            return {
                t: {"count": f.count, "first": f.first, "last": f.last}
                for t, f in self._checker.items()
            }

    def waiting_for(self) -> str:
        """What the run waits for, in a line: given-up groups and retired tasks."""
        with self._lock:
            parts = []
            if self.given_up_groups:
                parts.append(f"{self.given_up_groups} group(s) given up")
            if self.retired:
                names = ", ".join(
                    f"{t} ({r['reason'][:80]})" for t, r in list(self.retired.items())[:5]
                )
                more = f", and {len(self.retired) - 5} more" if len(self.retired) > 5 else ""
                parts.append(f"{len(self.retired)} task(s) out of the run: {names}{more}")
            age = time.monotonic() - self.last_progress
            parts.append(f"no episode has filled a slot for {age:.0f} s")
            return "; ".join(parts)

    @property
    def pools(self) -> dict[str, int]:
        """Pool -> number of its tasks."""
        return {p: len(ids) for p, ids in self._order.items() if p}

    def _next_task(self, pool: str) -> str:
        cycle = self._cycles.get(pool)
        if not cycle:
            cycle = self._cycles[pool] = list(self._order[pool])
            if self.config.shuffle:
                self._rng.shuffle(cycle)
        return cycle.pop(0)

    def _grant(self, g: _Group, i: int, actor: str, now: float) -> wire.Grant:
        s = g.slots[i]
        s.attempts += 1
        s.state, s.actor, s.issued = "granted", actor, now
        s.grant_id = _grant_id(g.group_id, i, s.attempts)
        c = self.config
        return wire.Grant(
            s.grant_id,
            g.task_id,
            g.group_id,
            i,
            self.version,
            self._tasks[g.task_id],
            min_version=self.version,
            temperature=c.temperature if c.sampling else None,
            top_p=c.top_p if c.sampling else None,
        )

    def _grant_tree(self, g: _Group, idx: list[int], actor: str, now: float) -> wire.Grant:
        """One tree grant filling slots `idx` of `g` (one plain grant when there is one)."""
        grants = [self._grant(g, i, actor, now) for i in idx]
        if len(grants) == 1:
            return grants[0]
        c = self.config
        tree = wire.TreeSpec(
            tuple(idx),
            tuple(x.grant_id for x in grants),
            min(c.branch_width, len(idx)),
            c.branch_every,
        )
        self.counts["tree_grants"] += 1
        return dataclasses.replace(grants[0], tree=tree)

    def _fresh_run(self, g: _Group, start: int) -> list[int]:
        """Slots of `g` from `start` that one tree grant takes: never-granted open slots in
        a row, at most `tree_slots` (just `start` without trees or when it was granted)."""
        c = self.config
        out = [start]
        if c.tree_slots < 2 or g.slots[start].attempts:
            return out
        j = start + 1
        while (len(out) < c.tree_slots and j < len(g.slots) and g.slots[j].state == "open"
               and not g.slots[j].attempts):  # fmt: skip
            out.append(j)
            j += 1
        return out

    def request(
        self, actor: str, want: int = 1, now: float | None = None, pool: str = ""
    ) -> list[wire.Grant]:
        """Up to `want` grants of tasks of `pool` ("" any) for `actor`: open or expired slots
        first, then new groups."""
        now = time.monotonic() if now is None else now
        out: list[wire.Grant] = []
        with self._lock:
            self._heard(actor, now)
            if self.closed:
                self.counts["refused_closed"] += 1
                return out
            if pool not in self._order:
                self.counts["unknown_pool"] += 1
                self.counts["refused"] += 1
                if pool not in self._warned_pools and len(self._warned_pools) < 1000:
                    self._warned_pools.add(pool)  # bounded: pool names come from actors
                    log.warning(
                        "actor %s asks for tasks of pool %r, which has none; the pools are %s",
                        actor,
                        pool,
                        ", ".join(f"{p!r} ({n} tasks)" for p, n in self.pools.items()),
                    )
                return out
            timeout = self.config.grant_timeout_s
            self._reopen_silent(now)
            for g in self._groups.values():
                if len(out) >= want:
                    break
                if pool and self._pool_of[g.task_id] != pool:
                    continue
                for i, s in enumerate(g.slots):
                    if len(out) >= want:
                        break
                    if s.state == "granted" and now - s.issued > timeout:
                        self.counts["reissued"] += 1
                        log.info(
                            "grant %s (actor %s) expired; issuing it again", s.grant_id, s.actor
                        )
                        s.state = "open"
                    if s.state == "open":
                        out.append(self._grant_tree(g, self._fresh_run(g, i), actor, now))
            while len(out) < want and self._order[pool] and self._admissible():
                task = self._next_task(pool)
                gid = f"{task}/{self.epoch}-g{next(self._counter)}"
                g = _Group(
                    gid, task, self.version, [_Slot() for _ in range(self.config.group_size)]
                )
                self._groups[gid] = g
                self.opened += 1
                for i in range(len(g.slots)):
                    if len(out) >= want:
                        break
                    if g.slots[i].state == "open":
                        out.append(self._grant_tree(g, self._fresh_run(g, i), actor, now))
            self.counts["granted"] += sum(1 if x.tree is None else len(x.tree.slots)
                                          for x in out)  # fmt: skip
            if not out:
                self.counts["refused"] += 1
        return out

    def release(self, grant_id: str, actor: str, reason: str = "") -> bool:
        """An actor gives `grant_id` back (its episode ended without a trajectory): the slot
        is granted again now, or given up after `max_attempts` (then `on_abandon(task_id)`
        is called). False when the book does not hold that grant any more (re-issued,
        filled, or unknown)."""
        given_up = ""
        with self._lock:
            group_id, slot = _slot_of(grant_id)
            g = self._groups.get(group_id)
            s = g.slots[slot] if g is not None and 0 <= slot < len(g.slots) else None
            if g is None or s is None or s.state != "granted" or s.grant_id != grant_id:
                self.counts["release_unknown"] += 1
                return False
            if s.actor != actor:  # only the actor holding a grant gives it back
                self.counts["release_not_holder"] += 1
                log.warning("grant %s (held by %s): a release by %s refused",
                            grant_id, s.actor, actor)  # fmt: skip
                return False
            self.counts["released"] += 1
            s.last_error = f"released by its actor ({reason[:64]})"
            # one counter per known reason; a sender's own words do not make new counters
            self.counts[f"released_{reason if reason in RELEASE_REASONS else 'other'}"] += 1
            if s.attempts >= self.config.max_attempts:
                s.state = "abandoned"
                self.counts["abandoned"] += 1
                given_up = g.task_id
                log.warning("slot %s/%s given up after %d attempts (released: %s)",
                            group_id, slot, s.attempts, reason)  # fmt: skip
                self._close_if_finished(g)
            else:
                s.state = "open"
                log.info("grant %s released by %s (%s): granted again", grant_id, actor, reason)
        if given_up and self.on_abandon is not None:
            self.on_abandon(given_up)
        return True

    on_abandon: Any = None
    """Called with the task id for every slot given up (after its last attempt, by a
    release, or when its task left the run): a pool run counts it as unknown."""

    def complete(self, traj: Trajectory) -> bool:
        """Book a delivered trajectory; False when its slot was already filled (a surplus)."""
        with self._lock:
            done = self._finished.get(traj.group_id)
            if done is not None:
                # The same trajectory again (ingest could not keep it the first time, e.g.
                # a full disk): it still fills its slot. Any other one is a surplus.
                if traj.trajectory_id in done:
                    self.counts["redelivered"] += 1
                    return True
                self.counts["surplus"] += 1
                return False
            g = self._groups.get(traj.group_id)
            if g is None or not 0 <= traj.slot < len(g.slots):
                self.counts["unknown_group"] += 1
                if traj.status == Status.OK:  # granted before a restart: still progress
                    self.last_progress = time.monotonic()
                return True
            s = g.slots[traj.slot]
            if s.state == "done" and s.trajectory_id == traj.trajectory_id:
                self.counts["redelivered"] += 1
                return True
            if s.state in ("done", "abandoned"):
                self.counts["surplus"] += 1
                return False
            retire = self._note_setup(traj) or self._note_checker(traj)
            gave_up = False
            if traj.status == Status.OK:
                s.state = "done"
                s.trajectory_id = traj.trajectory_id
                self.counts["completed"] += 1
                self.last_progress = time.monotonic()
            elif s.attempts >= self.config.max_attempts:
                s.state = "abandoned"
                self.counts["abandoned"] += 1
                gave_up = True
                log.warning(
                    "slot %s/%d given up after %d attempts (last: %s)",
                    g.group_id,
                    traj.slot,
                    s.attempts,
                    traj.status.value,
                )
            else:
                s.state = "open"  # an environment fault: grant the slot again
                self.counts[f"regrant_{traj.status.value}"] += 1
            if traj.status != Status.OK:
                s.last_error = f"{traj.status.value}: {traj.error or 'no reason given'}"[:500]
            self._close_if_finished(g)
        if gave_up and self.on_abandon is not None:
            self.on_abandon(traj.task_id)
        if retire is not None:
            self.retire(traj.task_id, retire)
        return True

    def _close_if_finished(self, g: _Group) -> None:
        """Forget a group whose every slot is done or given up (its trajectory ids kept, to
        tell a resend from a surplus); a group with a slot given up frees its place in
        admission and is listed in `given_up`. Called with the lock held."""
        if g.finished():
            lost = [x for x in g.slots if x.state == "abandoned"]
            if lost:
                self.given_up_groups += 1
                self.given_up.append(
                    {"group": g.group_id, "task": g.task_id, "reason": lost[-1].last_error}
                )
            del self._groups[g.group_id]
            self._finished[g.group_id] = frozenset(
                x.trajectory_id for x in g.slots if x.trajectory_id
            )
            while len(self._finished) > 100_000:
                self._finished.popitem(last=False)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            in_flight = sum(s.state == "granted" for g in self._groups.values() for s in g.slots)
            return {
                **self.counts,
                "version": self.version,
                "groups_opened": self.opened,
                "groups_open": len(self._groups),
                "groups_given_up": self.given_up_groups,
                "in_flight": in_flight,
            }


class QueuedReplies:
    """Bytes of reply frames handed to ZeroMQ and not yet let go of: each frame is sent
    zero-copy with a tracker and counts until ZeroMQ releases it (written to the peer's
    connection, dropped on a full queue, or dropped with the connection of a peer that
    left: the server thread's polling lets ZeroMQ end such a peer's queue). `peak` is the
    most ever counted. Thread-safe (the server thread adds, anyone may read).

    Locking: `_lock` guards `_held`, `_bytes` and `peak`; nothing else is done under it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.peak = 0
        self._held: list[tuple[zmq.MessageTracker, int]] = []
        self._bytes = 0
        self._prune_at = 256
        self._lock = threading.Lock()

    def _prune(self) -> None:
        kept = [(t, n) for t, n in self._held if not t.done]
        self._held = kept
        self._bytes = sum(n for _, n in kept)

    @property
    def nbytes(self) -> int:
        with self._lock:
            self._prune()
            return self._bytes

    def room(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit under the limit (pruning only when they might not)."""
        with self._lock:
            if self._bytes + nbytes > self.limit:
                self._prune()
            return self._bytes + nbytes <= self.limit

    def frame(self, data: bytes) -> zmq.Frame:
        """`data` as a tracked frame to send, counted from now until ZeroMQ lets go."""
        f = zmq.Frame(data, track=True, copy=False)
        assert f.tracker is not None
        with self._lock:
            if len(self._held) >= self._prune_at:  # many small replies: amortised O(1)
                self._prune()
                self._prune_at = max(256, 2 * len(self._held))
            self._held.append((f.tracker, len(data)))
            self._bytes += len(data)
            self.peak = max(self.peak, self._bytes)
        return f


class GrantServer:
    """The control link's server: grants, weights, task files and heartbeats (one thread)."""

    def __init__(
        self,
        book: GrantBook,
        transport: TransportConfig | None = None,
        *,
        weights: WeightsServer | None = None,
        learner_id: str = "learner",
        files: TaskFiles | None = None,
    ) -> None:
        """`files`: the task files this learner serves by content (the index `load_pool`
        filled); None serves none (a FileRequest is answered with an error)."""
        self.book = book
        self.files = files if files is not None else TaskFiles()
        self.transport = transport or TransportConfig()
        self.weights = weights or WeightsServer()
        self.learner_id = learner_id
        self.rejected: collections.Counter[str] = collections.Counter()
        """Requests not served, by reason: malformed, unexpected, unauthenticated,
        file_refused (a task file this learner does not serve, or whose file changed),
        file_busy (deferred: `transport.max_queued_file_bytes` of file replies queued)."""
        self.weight_requests = 0
        """Weights requests served (announcements and chunks)."""
        self.file_replies = QueuedReplies(self.transport.max_queued_file_bytes)
        self._seq = 0
        self._log = LogLimiter(log)
        self.server = RouterServer(
            self.transport.control,
            self.transport,
            self.handle,
            name="grants",
            on_auth_failure=lambda ev: self.rejected.update(["unauthenticated"]),
        )

    @property
    def version(self) -> int:
        return self.book.version

    def start(self) -> str:
        return self.server.start()

    def stop(self) -> None:
        self.server.stop()

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def publish_weights(self, version: int, data: bytes | memoryview, path: str = "") -> None:
        """Serve new weights as `version`; grants from now on carry it."""
        self.weights.publish(version, data, path)
        self.book.set_version(version)

    @property
    def file_queued_bytes(self) -> int:
        """Bytes of task-file chunks queued for actors and not sent on yet (a gauge)."""
        return self.file_replies.nbytes

    @property
    def file_queued_peak(self) -> int:
        """The most `file_queued_bytes` has been."""
        return self.file_replies.peak

    def handle(self, frames: list[Any]) -> list[wire.Frames]:
        try:
            msg = wire.decode(frames)
        except WireError as e:
            self.rejected["malformed"] += 1
            self._log.log(logging.WARNING, "malformed",
                          "grants: rejected a malformed message: %s", str(e)[:300])  # fmt: skip
            return []
        if isinstance(msg, wire.GrantRequest):
            grants = self.book.request(msg.actor, msg.want, pool=msg.pool)
            retry = 0.0 if grants else self.book.config.retry_s
            return [wire.encode(wire.GrantReply(msg.req, tuple(grants), retry))]
        if isinstance(msg, wire.GrantRelease):
            self.book.release(msg.grant_id, msg.actor, msg.reason)
            return [wire.encode(wire.GrantReply(msg.req, (), 0.0))]
        if isinstance(msg, wire.WeightsRequest):
            self.weight_requests += 1
            return self.weights.handle(msg)
        if isinstance(msg, wire.FileRequest):
            return [self._file_chunk(msg)]
        if isinstance(msg, wire.Heartbeat):  # nothing is kept per sender: answered only
            self._seq += 1
            hb = wire.Heartbeat(
                self.learner_id, "learner", self._seq, self.version, time.time(), {}
            )
            return [wire.encode(hb)]
        self.rejected["unexpected"] += 1
        return []

    def _file_chunk(self, msg: wire.FileRequest) -> list[Any]:
        """The reply to a FileRequest: the chunk (its data frame tracked in `file_replies`),
        'busy' when it would not fit under `transport.max_queued_file_bytes` (nothing is
        read then), or why it is refused. Never blocks: `TaskFiles.chunk` opens only
        regular files."""
        nbytes, total, size = self.files.extent(msg.sha256, msg.chunk)
        if nbytes and not self.file_replies.room(nbytes):
            self.rejected["file_busy"] += 1
            self._log.log(
                logging.INFO, "file_busy",
                "task file %s... chunk %d deferred: the queue of file replies for actors is "
                "full (transport.max_queued_file_bytes = %d MiB)",
                msg.sha256[:12], msg.chunk, self.file_replies.limit >> 20,
            )  # fmt: skip
            error = f"{BUSY} the learner's queue of file replies is full; ask again shortly"
            return wire.encode(wire.FileChunk(msg.sha256, msg.chunk, total, size, error))
        data, total, size, error = self.files.chunk(msg.sha256, msg.chunk)
        if error:
            self.rejected["file_refused"] += 1
            self._log.log(logging.WARNING, "file_refused", "task file %s... chunk %d refused: %s",
                          msg.sha256[:12], msg.chunk, error)  # fmt: skip
        chunk = wire.FileChunk(msg.sha256, msg.chunk, total, size, error, data)
        frames: list[Any] = list(wire.encode(chunk))
        if data:
            frames[-1] = self.file_replies.frame(data)
        return frames

"""Trajectory folders for the offline methods: write, read, split by outcome, pair.

    write_trajectories("runs/demos", trajs)        # the ingest journal's record format
    trajs = list(read_trajectories("runs/demos"))  # also reads a collection folder
    split = split_outcomes(trajs, success_score=1.0)
    pairs, report = dpo_pairs(split, mode="all", max_pairs_per_task=16, seed=0)

On disk a folder holds journal segments (`journal-<n>.log`, `arpo.service.journal.Journal`),
each record one trajectory's wire frames (`arpo.wire.encode`): the format the learner's
ingest journal and `arpo collect` write, so one reader
(`arpo.service.journal.read_collection`) serves demonstrations and collections; it
skips, counts and logs torn or corrupt records.

Outcomes: only `ok` trajectories count (environment and checker failures say nothing
about the agent); a success has checker score >= `success_score`, a failure has less.
"""

from __future__ import annotations

import collections
import logging
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from arpo import wire
from arpo.record import Status, Trajectory
from arpo.service.journal import Journal, read_collection

log = logging.getLogger("arpo.offline.data")


def write_trajectories(folder: str | Path, trajs: Iterable[Trajectory]) -> int:
    """Append `trajs` to a new journal segment in `folder`; returns how many were written."""
    journal = Journal(folder, fsync_every=1 << 30)
    n = 0
    try:
        for t in trajs:
            journal.append(wire.encode(t))
            n += 1
    finally:
        journal.close()  # fsyncs the segment
    return n


def read_trajectories(folder: str | Path) -> Iterator[Trajectory]:
    """The trajectories of a demonstration or collection folder, in the order stored
    (`arpo.service.journal.read_collection`: the folder's segments, or those of its
    trajectories/ sub-folder)."""
    return read_collection(folder)


@dataclass
class Outcomes:
    """Trajectories by task, split into successes and failures (ok status only)."""

    successes: dict[str, list[Trajectory]] = field(default_factory=dict)
    failures: dict[str, list[Trajectory]] = field(default_factory=dict)
    excluded: collections.Counter[str] = field(default_factory=collections.Counter)
    """Trajectories left out, by reason (status env_error / eval_error / timeout, no_turns)."""

    @property
    def n_successes(self) -> int:
        return sum(map(len, self.successes.values()))

    @property
    def n_failures(self) -> int:
        return sum(map(len, self.failures.values()))

    def tasks(self) -> list[str]:
        """Every task with at least one trajectory, in first-seen order."""
        return list(dict.fromkeys([*self.successes, *self.failures]))


def split_outcomes(trajs: Iterable[Trajectory], success_score: float = 1.0) -> Outcomes:
    """Successes (ok, checker score >= success_score) and failures (ok, below) by task."""
    out = Outcomes()
    seen: set[str] = set()
    for t in trajs:
        if t.trajectory_id in seen:
            out.excluded["duplicate"] += 1
            continue
        seen.add(t.trajectory_id)
        if t.status != Status.OK:
            out.excluded[str(t.status)] += 1
            continue
        if not t.turns:
            out.excluded["no_turns"] += 1
            continue
        side = out.successes if t.checker_score >= success_score else out.failures
        side.setdefault(t.task_id, []).append(t)
        (out.failures if side is out.successes else out.successes).setdefault(t.task_id, [])
    return out


def dpo_pairs(
    outcomes: Outcomes, *, mode: str = "all", max_pairs_per_task: int = 16, seed: int = 0
) -> tuple[list[tuple[Trajectory, Trajectory]], dict[str, int]]:
    """(chosen, rejected) pairs: a success and a failure of the same task.

    `mode="all"`: every success with every failure of the task (at most
    `max_pairs_per_task` of them, drawn at random when there are more); `mode="one-to-one"`:
    successes and failures shuffled and zipped, each trajectory in at most one pair.
    Tasks without a success or without a failure give no pair: they are counted in the
    report (`tasks_without_success`, `tasks_without_failure`) and logged, not raised.
    """
    if mode not in ("all", "one-to-one"):
        raise ValueError(f"unknown pairing mode {mode!r}; use 'all' or 'one-to-one'")
    rng = random.Random(seed)
    pairs: list[tuple[Trajectory, Trajectory]] = []
    report = {"tasks": 0, "tasks_paired": 0, "tasks_without_success": 0, "tasks_without_failure": 0}
    for task in outcomes.tasks():
        report["tasks"] += 1
        good = list(outcomes.successes.get(task, []))
        bad = list(outcomes.failures.get(task, []))
        if not good or not bad:
            key = "tasks_without_success" if not good else "tasks_without_failure"
            report[key] += 1
            log.info("task %s: %d successes, %d failures: no DPO pair", task, len(good), len(bad))
            continue
        if mode == "all":
            task_pairs = [(g, b) for g in good for b in bad]
            if len(task_pairs) > max_pairs_per_task:
                task_pairs = rng.sample(task_pairs, max_pairs_per_task)
        else:
            rng.shuffle(good)
            rng.shuffle(bad)
            task_pairs = list(zip(good, bad, strict=False))[:max_pairs_per_task]
        pairs += task_pairs
        report["tasks_paired"] += 1
    report["pairs"] = len(pairs)
    if report["tasks_without_success"] or report["tasks_without_failure"]:
        log.warning(
            "DPO pairing: %d of %d tasks have no pair (%d without a success, %d without a failure)",
            report["tasks"] - report["tasks_paired"],
            report["tasks"],
            report["tasks_without_success"],
            report["tasks_without_failure"],
        )
    return pairs, report

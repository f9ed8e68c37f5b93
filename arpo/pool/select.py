"""Task selection: run the base agent N times on every task of a pool, keep the tasks it can solve.

ARPO trains only on tasks where the base policy succeeds at least once in 16 tries, so
every group it trains on can produce signal. This module runs those tries through the
real rollout path (the same grant server, ingest and `arpo-actor` processes as training)
and writes the result:

    arpo select-tasks tasks=runs/task_pool runs_per_task=16 out=runs/selection.json \\
        transport.data=tcp://0.0.0.0:5555 transport.control=tcp://0.0.0.0:5556 ...
    arpo-actor envs=[...] engine.model=... transport.data=tcp://learner:5555 ...  # any number
    arpo select-tasks tasks=runs/task_pool local_actor=true \\
        'local_actor_args=["sim_envs=4", "policy=scripted"]'     # or one actor started here

    result = run_selection(load_config(SelectConfig, None, ["tasks=runs/task_pool"]))
    selected = load_selection("runs/selection.json")    # the learner's task list (arpo.env.task)

How it runs (`arpo.pool.rollouts.run_pool`, shared with `arpo eval` and `arpo collect`):

- The grant book opens exactly one group of `runs_per_task` slots per task
  (`groups_per_step` = the number of tasks, `max_staleness` 0, the policy version never
  moves, so admission stops after one round over the pool).
- A delivered `ok` episode fills its slot: a run, a success when its checker score is at
  least `success_score`. An `env_error` / `eval_error` / `timeout` episode is counted as
  an environment error and its slot is granted again, up to `max_attempts` grants; a slot
  given up after that is `unknown` (neither success nor failure). A grant not delivered
  within `grant_timeout_s` goes to another actor; the first delivery fills the slot.
- When every slot of every task is done (runs + unknown = runs_per_task for each task),
  `out` is written atomically (tmp file + rename):

      {"runs_per_task": 16, "min_successes": 1, "max_successes": -1, "success_score": 1.0,
       "complete": true, "created": "2026-11-22T03:04:05+00:00", "elapsed_s": 812.4,
       "tasks": {"<id>": {"runs": 16, "successes": 3, "env_errors": 0, "unknown": 0,
                          "success_rate": 0.1875}, ...},
       "selected": ["<id>", ...]}

  `selected` keeps the pool's order: the tasks with `min_successes <= successes` (and
  `successes <= max_successes` unless that is -1). A task with unknown runs is judged on
  the runs it has. With `trajectories` set, every `ok` episode is also kept there (the
  journal format of `arpo collect`) and the result names the folder under
  "trajectories": `learner.assemble.replay.prefill` starts the replay buffers with its
  successes. If `timeout_s` passes first, the file is written with
  `"complete": false` (which `load_selection` refuses) and an `ArpoError` is raised.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arpo.config import fail, folder_problem, option
from arpo.env.task import load_task_pool
from arpo.env.taskfiles import TaskFiles
from arpo.errors import ArpoError, ConfigError
from arpo.files import write_json_atomic
from arpo.pool.rollouts import (
    PoolConfig,
    PoolTally,
    counts_table,
    run_command,
    run_pool,
)
from arpo.service.ingest import IngestConfig
from arpo.service.journal import list_segments

__all__ = [
    "SelectConfig",
    "SelectionTally",
    "format_table",
    "main",
    "run_selection",
]

log = logging.getLogger("arpo.pool.select")

SelectionTally = PoolTally
"""Outcome counts per task (`arpo.pool.rollouts.PoolTally`)."""


@dataclass
class SelectConfig(PoolConfig):
    """`arpo select-tasks`: N runs of the base agent per task, keep the tasks it can solve.

    The shared fields (tasks, transport, local actor, timeouts) are `PoolConfig`'s.
    """

    runs_per_task: int = option(16, "Episodes of the base agent per task (the paper: 16).")
    local_actor_log: str = option(
        "", "File that receives the local actor's stderr (default: <out>.actor.log)."
    )
    min_successes: int = option(1, "Keep a task with at least this many successes.")
    max_successes: int = option(
        -1,
        "Keep a task with at most this many successes (-1: no upper bound; e.g. "
        "runs_per_task - 1 leaves out tasks already solved every time).",
    )
    out: str = option("runs/selection.json", "Where the selection result is written (JSON).")
    trajectories: str = option(
        "",
        "Folder that keeps every `ok` episode (the journal of `arpo collect`'s "
        "trajectories/, read with `read_collection`), for `learner.assemble.replay.prefill`; "
        "it must not hold one already. '' = episodes are discarded.",
    )

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.min_successes <= self.runs_per_task:
            fail("min_successes", f"must be in [0, runs_per_task = {self.runs_per_task}]")
        if self.max_successes != -1 and self.max_successes < self.min_successes:
            fail("max_successes", "must be -1 (no upper bound) or >= min_successes")
        if not self.out:
            fail("out", "is required: the path of the result JSON")
        if Path(self.out).is_dir():
            fail("out", f"{self.out!r} is a folder; give the path of the result JSON")
        if problem := folder_problem(self.trajectories):
            fail("trajectories", problem)


def _result(cfg: SelectConfig, counts: Mapping[str, Mapping[str, int]], complete: bool,
            elapsed: float) -> dict[str, Any]:  # fmt: skip
    tasks: dict[str, Any] = {}
    selected: list[str] = []
    for tid, c in counts.items():
        runs, k = c["runs"], c["successes"]
        tasks[tid] = {**c, "success_rate": k / runs if runs else None}
        if k >= cfg.min_successes and (cfg.max_successes < 0 or k <= cfg.max_successes):
            selected.append(tid)
    return {
        "runs_per_task": cfg.runs_per_task,
        "min_successes": cfg.min_successes,
        "max_successes": cfg.max_successes,
        "success_score": cfg.success_score,
        "complete": complete,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "elapsed_s": round(elapsed, 3),
        "tasks": tasks,
        "selected": selected if complete else [],
    }


def run_selection(
    cfg: SelectConfig,
    *,
    store: Any = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Run `runs_per_task` episodes of every task, write `cfg.out`, return its content.

    `store` receives every `ok` episode as ingest stores it (`store.put(task, item)`, e.g. a
    `ReplayStore`); by default they are discarded. `on_progress(done, total)` is called
    from this thread whenever the number of finished runs changes.
    """
    files = TaskFiles()
    tasks = load_task_pool(cfg.tasks, files)
    out = Path(cfg.out)
    ingest_config = None
    if cfg.trajectories:
        if list_segments(cfg.trajectories):
            raise ConfigError(
                f"config field trajectories: {cfg.trajectories!r} already holds kept "
                "episodes; choose an empty folder or delete it"
            )
        Path(cfg.trajectories).mkdir(parents=True, exist_ok=True)
        ingest_config = IngestConfig(journal_dir=cfg.trajectories)
    res = run_pool(
        cfg,
        tasks,
        actor_log=Path(cfg.local_actor_log or f"{out}.actor.log"),
        spool=out.parent / f"{out.name}.actor-spool",
        learner_id="select-tasks",
        actor_id="select-local",
        files=files,
        ingest_config=ingest_config,
        store=store,
        on_progress=on_progress,
    )
    result = _result(cfg, res.counts, res.complete, res.elapsed_s)
    if cfg.trajectories:
        result["trajectories"] = cfg.trajectories
    write_json_atomic(out, result)
    if not res.complete:
        raise ArpoError(
            f"task selection timed out after {cfg.timeout_s:g} s with {res.done} of "
            f"{res.total} runs finished; partial counts in {cfg.out} (marked incomplete)"
        )
    return result


def format_table(result: Mapping[str, Any]) -> str:
    """A plain-text table of the counts per task, selected tasks marked with `*`."""
    return counts_table(result["tasks"], frozenset(result.get("selected", ())))


def main(cfg: SelectConfig) -> int:
    """`arpo select-tasks`: run, print the table and the output path; the exit code."""

    def report(result: dict[str, Any]) -> str:
        return (
            f"{format_table(result)}\n"
            f"{len(result['selected'])} of {len(result['tasks'])} tasks selected "
            f"(successes >= {cfg.min_successes}"
            + (f" and <= {cfg.max_successes}" if cfg.max_successes >= 0 else "")
            + f" in {cfg.runs_per_task} runs); written to {cfg.out}"
        )

    return run_command("select-tasks", cfg.progress_s,
                       lambda progress: run_selection(cfg, on_progress=progress), report)  # fmt: skip

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
    selected = load_selection("runs/selection.json")    # the learner's task list

How it runs:

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
  the runs it has. If `timeout_s` passes first, the file is written with
  `"complete": false` (which `load_selection` refuses) and an `ArpoError` is raised.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arpo.config import fail, option
from arpo.env.task import Task
from arpo.errors import ArpoError, ConfigError, TaskError
from arpo.learner.grants import GrantBook, GrantConfig, GrantServer
from arpo.learner.ingest import Ingest, IngestConfig
from arpo.record import Status, Trajectory
from arpo.transport import TransportConfig

log = logging.getLogger("arpo.learner.select")


@dataclass
class SelectConfig:
    """`arpo select-tasks`: N runs of the base agent per task, keep the tasks it can solve."""

    tasks: str = option(
        "",
        "The task pool: a folder searched recursively for task JSON files (other JSON files "
        "there, such as index files, are skipped), or a .json file with a list of tasks, or a "
        ".jsonl file with one task per line.",
    )
    runs_per_task: int = option(16, "Episodes of the base agent per task (the paper: 16).")
    min_successes: int = option(1, "Keep a task with at least this many successes.")
    max_successes: int = option(
        -1,
        "Keep a task with at most this many successes (-1: no upper bound; e.g. "
        "runs_per_task - 1 leaves out tasks already solved every time).",
    )
    success_score: float = option(
        1.0, "An episode succeeds when its checker score is at least this (in (0, 1])."
    )
    out: str = option("runs/selection.json", "Where the selection result is written (JSON).")
    transport: TransportConfig = option(
        TransportConfig(), "The endpoints actors connect to (the learner's data and control)."
    )
    grant_timeout_s: float = option(
        1800.0, "An episode not delivered this long after its grant is granted to another actor."
    )
    max_attempts: int = option(
        3,
        "Grants of one run whose episodes ended in env_error / eval_error / timeout before "
        "the run is given up and counted unknown.",
    )
    timeout_s: float = option(
        0.0, "Give up when the selection has not finished after this long, seconds (0: never)."
    )
    shuffle: bool = option(True, "Hand out the tasks in a random order (spreads slow tasks).")
    seed: int = option(0, "Seed of that order.")
    local_actor: bool = option(
        False, "Start one arpo-actor process for this run (stopped with SIGTERM at the end)."
    )
    local_actor_args: list[str] = option(
        doc="field=value overrides of the local actor (e.g. sim_envs=4, engine.model=...); "
        "its transport endpoints are set to this run's.",
        factory=list,
    )
    local_actor_log: str = option(
        "", "File that receives the local actor's stderr (default: <out>.actor.log)."
    )
    progress_s: float = option(10.0, "Interval of the progress line on stderr (0: none).")

    def validate(self) -> None:
        if not self.tasks:
            fail("tasks", "is required: a folder of task JSON files, or a .json / .jsonl file")
        if not Path(self.tasks).exists():
            fail("tasks", f"{self.tasks!r} does not exist")
        if self.runs_per_task < 1:
            fail("runs_per_task", "must be >= 1 (the paper runs 16 per task)")
        if not 0 <= self.min_successes <= self.runs_per_task:
            fail("min_successes", f"must be in [0, runs_per_task = {self.runs_per_task}]")
        if self.max_successes != -1 and self.max_successes < self.min_successes:
            fail("max_successes", "must be -1 (no upper bound) or >= min_successes")
        if not 0.0 < self.success_score <= 1.0:
            fail("success_score", "must be in (0, 1] (checker scores are in [0, 1])")
        if not self.out:
            fail("out", "is required: the path of the result JSON")
        if self.grant_timeout_s <= 0:
            fail("grant_timeout_s", "must be > 0 seconds")
        if self.max_attempts < 1:
            fail("max_attempts", "must be >= 1")
        if self.timeout_s < 0:
            fail("timeout_s", "must be >= 0 seconds (0: no limit)")
        if self.progress_s < 0:
            fail("progress_s", "must be >= 0 seconds (0: no progress line)")
        for a in self.local_actor_args:
            if "=" not in a:
                fail("local_actor_args", f"{a!r} is not of the form field=value")


# ---------------------------------------------------------------------------- the task pool


def _task_dicts(raw: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(raw, dict) and isinstance(raw.get("tasks"), list):
        raw = raw["tasks"]
    if isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, list):
        raise TaskError(f"{where}: expected a task object or a list of tasks")
    return raw


def load_task_pool(path: str | Path) -> list[dict[str, Any]]:
    """The tasks of a pool (see `SelectConfig.tasks`), each checked as an OSWorld task.

    Raises `TaskError` naming the file for a malformed task or a task id given twice.
    """
    p = Path(path)
    found: list[tuple[dict[str, Any], str]] = []
    if p.is_dir():
        for f in sorted(p.rglob("*.json")):
            try:
                raw = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise TaskError(f"{f}: cannot read a task file: {e}") from None
            # A task has an id and an evaluator; index files and the like are skipped.
            if isinstance(raw, dict) and "id" in raw and "evaluator" in raw:
                found.append((raw, str(f)))
    elif p.is_file():
        try:
            text = p.read_text(encoding="utf-8")
            if p.suffix == ".jsonl":
                items = [
                    (json.loads(line), f"{p}:{i + 1}")
                    for i, line in enumerate(text.splitlines())
                    if line.strip()
                ]
            else:
                items = [(t, str(p)) for t in _task_dicts(json.loads(text), str(p))]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TaskError(f"{p}: cannot read the task list: {e}") from None
        found = items
    else:
        raise TaskError(f"{p}: no such task folder or file")
    tasks: list[dict[str, Any]] = []
    where_of: dict[str, str] = {}
    for raw, where in found:
        task = Task.from_dict(raw, path=where)  # TaskError names the file
        if task.id in where_of:
            raise TaskError(f"{where}: task id {task.id} is also in {where_of[task.id]}")
        where_of[task.id] = where
        tasks.append(raw)
    if not tasks:
        raise TaskError(f"{p}: holds no tasks (JSON objects with 'id' and 'evaluator')")
    return tasks


# ---------------------------------------------------------------------------- counting


class _Discard:
    """The ingest's store during selection: nothing is kept for training."""

    def put(self, task: str, item: Any) -> None:
        del task, item


class SelectionTally:
    """Outcome counts per task, fed by the ingest thread through the grant book."""

    def __init__(self, book: GrantBook, task_ids: list[str], success_score: float) -> None:
        self.book = book
        self.success_score = success_score
        self._lock = threading.Lock()
        self.tasks: dict[str, dict[str, int]] = {
            t: {"runs": 0, "successes": 0, "env_errors": 0, "unknown": 0} for t in task_ids
        }

    def on_trajectory(self, traj: Trajectory) -> bool:
        """Ingest's callback: book the episode in the grant book, then count it."""
        # Ingest calls this from its one thread, so the book's `abandoned` counter changes
        # only inside this call: its difference says whether this episode gave up a slot.
        before = self.book.counts["abandoned"]
        fresh = self.book.complete(traj)
        abandoned = self.book.counts["abandoned"] > before
        c = self.tasks.get(traj.task_id)
        if not fresh or c is None:
            return fresh
        with self._lock:
            if traj.status == Status.OK:
                c["runs"] += 1
                c["successes"] += traj.checker_score >= self.success_score
            else:
                c["env_errors"] += 1
                c["unknown"] += abandoned
        return fresh

    def done(self) -> int:
        """Runs finished or given up, over all tasks."""
        with self._lock:
            return sum(c["runs"] + c["unknown"] for c in self.tasks.values())

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {t: dict(c) for t, c in self.tasks.items()}


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


def _write_atomic(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- the local actor


def _start_local_actor(cfg: SelectConfig, data: str, control: str) -> tuple[Any, Path, Path]:
    """One `arpo-actor` process: `local_actor_args` after the defaults, our endpoints last."""
    out = Path(cfg.out)
    log_path = Path(cfg.local_actor_log or f"{out}.actor.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    spool = out.parent / f"{out.name}.actor-spool"
    args = [
        sys.executable, "-m", "arpo.actor.cli",
        "actor_id=select-local", f"spool_dir={str(spool)!r}",
        *cfg.local_actor_args,
        f"transport.data={data!r}", f"transport.control={control!r}",
    ]  # fmt: skip
    with log_path.open("ab") as err:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=err, stderr=err)
    log.info("started the local actor (pid %d), its log: %s", proc.pid, log_path)
    return proc, log_path, spool


def _stop_local_actor(proc: Any, spool: Path, timeout_s: float = 60.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("the local actor did not stop within %.0f s; killing it", timeout_s)
            proc.kill()
            proc.wait()
    if proc.returncode:
        log.warning("the local actor exited with code %d", proc.returncode)
    with contextlib.suppress(OSError):  # an empty spool folder: everything was delivered
        spool.rmdir()
    return proc.returncode


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


# ---------------------------------------------------------------------------- the run


def _bind(start: Callable[[], str], field: str, endpoint: str) -> str:
    try:
        return start()
    except Exception as e:  # zmq's bind errors (address in use, ...) and refusals
        raise ArpoError(f"cannot bind {field} = {endpoint!r}: {e}") from e


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
    tasks = load_task_pool(cfg.tasks)
    ids = [t["id"] for t in tasks]
    total = len(ids) * cfg.runs_per_task
    book = GrantBook(
        tasks,
        GrantConfig(
            group_size=cfg.runs_per_task,
            groups_per_step=len(ids),
            max_staleness=0,
            grant_timeout_s=cfg.grant_timeout_s,
            max_attempts=cfg.max_attempts,
            shuffle=cfg.shuffle,
            seed=cfg.seed,
        ),
    )
    tally = SelectionTally(book, ids, cfg.success_score)
    start = time.monotonic()
    grants = GrantServer(book, cfg.transport)
    ingest = Ingest(
        store if store is not None else _Discard(),
        IngestConfig(learner_id="select-tasks"),
        cfg.transport,
        version=lambda: book.version,
        on_trajectory=tally.on_trajectory,
    )
    proc = None
    actor_log: Path | None = None
    with contextlib.ExitStack() as stack:
        control = _bind(grants.start, "transport.control", cfg.transport.control)
        stack.callback(grants.stop)
        data = _bind(ingest.start, "transport.data", cfg.transport.data)
        stack.callback(ingest.stop)
        log.info(
            "selection: %d tasks x %d runs; actors connect to data %s, control %s",
            len(ids),
            cfg.runs_per_task,
            data,
            control,
        )
        if cfg.local_actor:
            proc, actor_log, spool = _start_local_actor(cfg, data, control)
            stack.callback(_stop_local_actor, proc, spool)
        last = -1
        while True:
            done = tally.done()
            if done != last:
                last = done
                if on_progress is not None:
                    on_progress(done, total)
            if done >= total:
                break
            if cfg.timeout_s and time.monotonic() - start > cfg.timeout_s:
                result = _result(cfg, tally.snapshot(), False, time.monotonic() - start)
                _write_atomic(Path(cfg.out), result)
                raise ArpoError(
                    f"task selection timed out after {cfg.timeout_s:g} s with {done} of "
                    f"{total} runs finished; partial counts in {cfg.out} (marked incomplete)"
                )
            if proc is not None and proc.poll() is not None:
                assert actor_log is not None
                raise ArpoError(
                    f"the local actor exited (code {proc.returncode}) with {done} of {total} "
                    f"runs finished; its log {actor_log} ends with:\n{_tail(actor_log)}"
                )
            time.sleep(0.05)
    result = _result(cfg, tally.snapshot(), True, time.monotonic() - start)
    _write_atomic(Path(cfg.out), result)
    return result


def load_selection(path: str | Path) -> list[str]:
    """The selected task ids of a result written by `run_selection`.

    Raises `ConfigError` naming the file when it is missing, not JSON, not a selection
    result, or from a run that did not finish.
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"task selection file {str(p)!r} does not exist (run `arpo select-tasks` first)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"task selection file {str(p)!r} is not readable JSON: {e}") from None
    sel = data.get("selected") if isinstance(data, dict) else None
    if not isinstance(sel, list) or not all(isinstance(t, str) and t for t in sel):
        raise ConfigError(
            f"task selection file {str(p)!r} has no 'selected' list of task ids "
            "(is it the output of `arpo select-tasks`?)"
        )
    if data.get("complete") is False:
        raise ConfigError(
            f"task selection file {str(p)!r} is from a run that did not finish "
            "(complete: false); run `arpo select-tasks` again"
        )
    return list(sel)


def format_table(result: Mapping[str, Any]) -> str:
    """A plain-text table of the counts per task, selected tasks marked with `*`."""
    chosen = set(result.get("selected", ()))
    tasks = result["tasks"]
    width = max([len("task"), *(len(t) for t in tasks)])
    lines = [f"  {'task':<{width}}  {'runs':>5}  {'successes':>9}  {'env_errors':>10}  unknown"]
    for tid, c in tasks.items():
        mark = "*" if tid in chosen else " "
        lines.append(
            f"{mark} {tid:<{width}}  {c['runs']:>5}  {c['successes']:>9}  "
            f"{c['env_errors']:>10}  {c['unknown']:>7}"
        )
    return "\n".join(lines)


def main(cfg: SelectConfig) -> int:
    """`arpo select-tasks`: run, print the table and the output path; the exit code."""
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    last_print = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if cfg.progress_s and (now - last_print[0] >= cfg.progress_s or done == total):
            last_print[0] = now
            print(f"select-tasks: {done}/{total} runs finished", file=sys.stderr, flush=True)

    try:
        result = run_selection(cfg, on_progress=progress)
    except ArpoError as e:  # TaskError too
        print(f"arpo select-tasks: {e}", file=sys.stderr)
        return 1
    print(format_table(result))
    print(
        f"{len(result['selected'])} of {len(result['tasks'])} tasks selected "
        f"(successes >= {cfg.min_successes}"
        + (f" and <= {cfg.max_successes}" if cfg.max_successes >= 0 else "")
        + f" in {cfg.runs_per_task} runs); written to {cfg.out}"
    )
    return 0

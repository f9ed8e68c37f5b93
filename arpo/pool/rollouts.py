"""Run every task of a pool N times through the real rollout path and count the outcomes.

The shared core of `arpo select-tasks`, `arpo eval` and `arpo collect`: the same grant
server, ingest and `arpo-actor` processes as training, with a grant book that opens
exactly one group of `runs_per_task` slots per task and never moves the policy version.

    pool = load_pool("runs/task_pool")      # arpo.env.task: [PoolTask(task, source, domain)]
    res = run_pool(cfg, [p.task for p in pool], actor_log=Path("runs/x/actor.log"),
                   spool=Path("runs/x/actor-spool"), learner_id="eval")
    res.complete, res.counts["<task id>"], res.episodes      # per task counts, per episode

`cfg` is a `PoolConfig` (or a subclass: `SelectConfig`, `EvalConfig`, `CollectConfig`).

Counting:

- A delivered `ok` episode fills its slot: a run, a success when its checker score is at
  least `success_score`. An `env_error` / `eval_error` / `timeout` episode is counted as
  an environment error and its slot is granted again, up to `max_attempts` grants; a slot
  given up after that is `unknown` (neither success nor failure). A grant not delivered
  within `grant_timeout_s` goes to another actor; the first delivery fills the slot and
  a later one is a surplus (not counted, not stored).
- The run ends when every slot of every task is done (runs + unknown = runs_per_task for
  each task), or with `complete=False` when `timeout_s` passes first. A local actor that
  exits before the end is an `ArpoError` carrying the end of its log.

The policy under test (`resolve_policy`): a checkpoint folder (`<ckpt>/model/` is the
model), a folder of checkpoints (the newest valid one is used), or a model folder / hub id.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arpo.config import (
    MAX_TEMPERATURE,
    check_range,
    check_seconds,
    fail,
    folder_problem,
    model_problem,
    option,
)
from arpo.env.task import pool_problem
from arpo.env.taskfiles import TaskFiles
from arpo.errors import ERRORS, ArpoError, ConfigError, SnapshotError
from arpo.learner.checkpoint import MANIFEST, latest_checkpoint, verify_checkpoint
from arpo.record import Status, Trajectory
from arpo.service.grants import GrantBook, GrantConfig, GrantServer
from arpo.service.ingest import Ingest, IngestConfig
from arpo.transport import TransportConfig

log = logging.getLogger("arpo.pool.rollouts")


@dataclass
class PoolConfig:
    """N episodes of a policy on every task of a pool, through grant server, ingest and actors."""

    tasks: str = option(
        "",
        "The task pool: a folder searched recursively for JSON files of a task or a list of "
        "tasks (files without tasks there, such as index files, are skipped), or a .json "
        "file with a list of tasks, or a .jsonl file with one task per line.",
    )
    runs_per_task: int = option(16, "Episodes per task.")
    success_score: float = option(
        1.0, "An episode succeeds when its checker score is at least this (in (0, 1])."
    )
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
        0.0, "Give up when the run has not finished after this long, seconds (0: never)."
    )
    shuffle: bool = option(True, "Hand out the tasks in a random order (spreads slow tasks).")
    seed: int = option(0, "Seed of that order.")
    local_actor: bool = option(
        False, "Start one arpo-actor process for this run (stopped with SIGTERM at the end)."
    )
    local_actor_args: list[str] = option(
        doc="field=value overrides of the local actor (e.g. sim_envs=4, envs=[...]); "
        "its transport endpoints are set to this run's.",
        factory=list,
    )
    local_actor_log: str = option("", "File that receives the local actor's stderr.")
    progress_s: float = option(10.0, "Interval of the progress line on stderr (0: none).")

    def validate(self) -> None:
        if not self.tasks:
            fail("tasks", "is required: a folder of task JSON files, or a .json / .jsonl file")
        if problem := pool_problem(self.tasks):
            fail("tasks", problem)
        check_range("runs_per_task", self.runs_per_task, 1, MAX_RUNS_PER_TASK, "episodes per task")
        check_range(
            "success_score", self.success_score, 0, 1, "checker scores are in [0, 1]", lo_open=True
        )
        check_seconds("grant_timeout_s", self.grant_timeout_s, "from a grant to its episode")
        check_range("max_attempts", self.max_attempts, 1, 100, "grants of one run")
        check_seconds("timeout_s", self.timeout_s, "of the whole run", zero="0: no limit")
        check_range("seed", self.seed, 0, 2**63 - 1, "seed of the order of the tasks")
        check_seconds("progress_s", self.progress_s, "between progress lines", zero="0: none")
        for a in self.local_actor_args:
            if "=" not in a:
                fail("local_actor_args", f"{a!r} is not of the form field=value")


MAX_RUNS_PER_TASK = 10_000
"""Most episodes per task of one pool run (`runs_per_task`), as `arpo train` allows for its
evaluations: a few zeros too many would keep a run going for months."""


POLICY_ACTOR_FIELDS = {
    "engine.model": "the model or checkpoint field",
    "episode.temperature": "the temperature field",
    "episode.top_p": "the top_p field",
}
"""Actor fields a policy run sets itself (refused in `local_actor_args`)."""


@dataclass
class PolicyPoolConfig(PoolConfig):
    """A pool run of one given policy (a checkpoint or a model) at given sampling settings:
    the shared fields of `arpo eval` and `arpo collect`."""

    checkpoint: str = option(
        "",
        "A learner checkpoint folder (its model/ is used), or a run's checkpoints folder "
        "(the newest valid checkpoint is used).",
    )
    model: str = option(
        "", "A model folder or hub id instead of a checkpoint (a checkpoint folder works too)."
    )
    verify: bool = option(
        True,
        "Check the checkpoint's sha256 hashes (false: of the small files only, the configs, "
        "tokenizer and state; faster for big models).",
    )
    temperature: float = option(1.0, "Sampling temperature.")
    top_p: float = option(1.0, "Nucleus of the sampling.")
    local_actor: bool = option(
        True, "Start one arpo-actor process for this run (stopped with SIGTERM at the end)."
    )
    local_actor_log: str = option(
        "", "File that receives the local actor's stderr (default: <out>/actor.log)."
    )
    out: str = option("runs/pool", "Output folder.")

    def validate(self) -> None:
        super().validate()
        if not self.checkpoint and not self.model:
            fail(self._policy_field, "give checkpoint=<folder> or model=<model folder>")
        if self.checkpoint and self.model:
            fail("model", "give either checkpoint or model, not both")
        if self.checkpoint and not Path(self.checkpoint).exists():
            fail("checkpoint", f"{self.checkpoint!r} does not exist")
        if self.checkpoint and not Path(self.checkpoint).is_dir():
            fail(
                "checkpoint",
                f"{self.checkpoint!r} is not a folder (a checkpoint, or a run's "
                "checkpoints folder)",
            )
        if self.model and not Path(self.model).is_dir() and (problem := model_problem(self.model)):
            fail("model", problem)
        check_range("temperature", self.temperature, 0, MAX_TEMPERATURE, "0: greedy")
        check_range("top_p", self.top_p, 0, 1, "the nucleus", lo_open=True)
        if problem := folder_problem(self.out):
            fail("out", problem)
        if not self.out:
            fail("out", "is required: the output folder")
        check_not_set(self.local_actor_args, POLICY_ACTOR_FIELDS, "local_actor_args")

    _policy_field = "checkpoint"
    """The field named when neither checkpoint nor model is given."""


# ---------------------------------------------------------------------------- the policy


@dataclass(frozen=True)
class PolicySource:
    """The model a run uses, and the checkpoint it came from (if any)."""

    model: str
    """A Hugging Face model folder or hub id (what the actor's `engine.model` gets)."""
    checkpoint: str | None = None
    iteration: int | None = None
    policy_version: int | None = None
    """The learner's policy version saved in the checkpoint's state.json."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "checkpoint": self.checkpoint,
            "iteration": self.iteration,
            "policy_version": self.policy_version,
        }


def _is_checkpoint_dir(p: Path) -> bool:
    return p.is_dir() and ((p / MANIFEST).exists() or (p / "state.json").exists())


def _holds_checkpoints(p: Path) -> bool:
    return p.is_dir() and any(c.name.startswith("ckpt-") for c in p.iterdir())


def resolve_policy(
    checkpoint: str = "", model: str = "", *, verify: bool = True, field_name: str = "checkpoint"
) -> PolicySource:
    """The model folder of `checkpoint`, else of `model` (which may be a checkpoint too).

    A checkpoint path is a checkpoint folder (verified against its manifest; `verify=False`
    checks sizes only) or a run's checkpoints folder (the newest valid one is used).
    Raises `ConfigError` naming `field_name` (or "model") when nothing usable is there.
    """
    if not checkpoint and model:
        p = Path(model)
        if not (_is_checkpoint_dir(p) or _holds_checkpoints(p)):
            return PolicySource(model=model)
        checkpoint, field_name = model, "model"
    if not checkpoint:
        raise ConfigError(f"config field {field_name}: a checkpoint or a model is required")
    p = Path(checkpoint)
    if not p.is_dir():
        raise ConfigError(f"config field {field_name}: {checkpoint!r} is not a folder")
    if not _is_checkpoint_dir(p):
        newest = latest_checkpoint(p, verify=verify)
        if newest is None:
            raise ConfigError(
                f"config field {field_name}: {checkpoint!r} holds no valid checkpoint "
                "(ckpt-<iteration>/ folders with a MANIFEST.json)"
            )
        p = newest
    try:
        verify_checkpoint(p, hashes=verify)
        meta = json.loads((p / "state.json").read_text(encoding="utf-8"))
    except (SnapshotError, OSError, ValueError) as e:
        raise ConfigError(f"config field {field_name}: {p} is not a usable checkpoint: {e}") from e
    state = meta.get("state") if isinstance(meta.get("state"), dict) else {}
    version = state.get("version")
    return PolicySource(
        model=str(p / "model"),
        checkpoint=str(p),
        iteration=int(meta["iteration"]) if "iteration" in meta else None,
        policy_version=int(version) if isinstance(version, int) else None,
    )


# ---------------------------------------------------------------------------- counting


class _Discard:
    """The ingest's store when nothing is kept."""

    def put(self, task: str, item: Any) -> None:
        del task, item


@dataclass(frozen=True)
class EpisodeOutcome:
    """One delivered episode (not a surplus) as counted."""

    trajectory_id: str
    task_id: str
    status: str
    checker_score: float
    reward: float
    steps: int
    slot: int
    success: bool
    abandoned: bool
    """An environment error that made its slot give up (counted unknown)."""
    unparsed: int = 0
    """Turns whose response did not parse as an action (`Turn.parsed` false)."""


class PoolTally:
    """Outcome counts per task, fed by the ingest thread through the grant book."""

    def __init__(self, book: GrantBook, task_ids: list[str], success_score: float) -> None:
        self.book = book
        self.success_score = success_score
        self._lock = threading.Lock()
        self.tasks: dict[str, dict[str, int]] = {
            t: {"runs": 0, "successes": 0, "env_errors": 0, "unknown": 0} for t in task_ids
        }
        self.episodes: list[EpisodeOutcome] = []
        """Every counted episode, in delivery order."""
        book.on_abandon = self._given_up

    def _given_up(self, task_id: str) -> None:
        """A slot given up (its last attempt failed, it was released, its task left)."""
        with self._lock:
            c = self.tasks.get(task_id)
            if c is not None:
                c["unknown"] += 1

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
        ok = traj.status == Status.OK
        success = ok and traj.checker_score >= self.success_score
        with self._lock:
            if ok:
                c["runs"] += 1
                c["successes"] += success
            else:
                c["env_errors"] += 1  # a given-up slot is counted by _given_up
            self.episodes.append(
                EpisodeOutcome(
                    traj.trajectory_id,
                    traj.task_id,
                    traj.status.value,
                    traj.checker_score,
                    traj.reward,
                    traj.steps,
                    traj.slot,
                    success,
                    abandoned and not ok,
                    sum(not t.parsed for t in traj.turns),
                )
            )
        return fresh

    def done(self) -> int:
        """Runs finished or given up, over all tasks."""
        with self._lock:
            return sum(c["runs"] + c["unknown"] for c in self.tasks.values())

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {t: dict(c) for t, c in self.tasks.items()}

    def episode_list(self) -> list[EpisodeOutcome]:
        with self._lock:
            return list(self.episodes)


# ---------------------------------------------------------------------------- the local actor


def start_local_actor(
    args: list[str], data: str, control: str, *, actor_id: str, log_path: Path, spool: Path
) -> subprocess.Popen:
    """One `arpo-actor` process: defaults, then `args`, then our endpoints (they win)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable, "-m", "arpo.actor.cli",
        f"actor_id={actor_id!r}", f"spool_dir={str(spool)!r}",
        *args,
        f"transport.data={data!r}", f"transport.control={control!r}",
    ]  # fmt: skip
    with log_path.open("ab") as err:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err)
    log.info("started the local actor (pid %d), its log: %s", proc.pid, log_path)
    return proc


def stop_local_actor(proc: subprocess.Popen, spool: Path, timeout_s: float = 60.0) -> int:
    """SIGTERM (the actor flushes its spool), kill after `timeout_s`; returns the exit code."""
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
    # Everything delivered: only the ledger of finished episodes and the spool's marker are
    # left; remove the folder.
    from arpo.actor.spool import LEDGER, MARKER

    with contextlib.suppress(OSError):
        if {p.name for p in spool.iterdir()} <= {LEDGER, MARKER}:
            for name in (LEDGER, MARKER):
                (spool / name).unlink(missing_ok=True)
            spool.rmdir()
    return proc.returncode


def tail(path: Path, n: int = 3000) -> str:
    """The last `n` characters of a text file ("" when unreadable)."""
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


# ---------------------------------------------------------------------------- the run


@dataclass
class PoolResult:
    """What `run_pool` saw."""

    counts: dict[str, dict[str, int]]
    """Per task: runs, successes, env_errors, unknown."""
    episodes: list[EpisodeOutcome]
    complete: bool
    done: int
    total: int
    elapsed_s: float
    ingest: dict[str, Any] = field(default_factory=dict)
    """The ingest's counters at the end."""


def _bind(start: Callable[[], str], name: str, endpoint: str) -> str:
    try:
        return start()
    except Exception as e:  # zmq's bind errors (address in use, ...) and refusals
        raise ArpoError(f"cannot bind {name} = {endpoint!r}: {e}") from e


def run_pool(
    cfg: PoolConfig,
    tasks: list[dict[str, Any]],
    *,
    actor_log: Path,
    spool: Path,
    learner_id: str = "rollouts",
    actor_id: str = "pool-local",
    actor_args: list[str] | None = None,
    ingest_config: IngestConfig | None = None,
    store: Any = None,
    on_progress: Callable[[int, int], None] | None = None,
    files: TaskFiles | None = None,
) -> PoolResult:
    """Run `cfg.runs_per_task` episodes of every task in `tasks`; the counts.

    With `cfg.local_actor`, one actor process is started with `actor_args` (default
    `cfg.local_actor_args`), its stderr to `actor_log`, its spool in `spool`. `store`
    receives every stored `ok` episode (`store.put(task, item)`); by default they are
    discarded. `ingest_config` (e.g. with a `journal_dir`) is used with `learner_id` as its
    name. `on_progress(done, total)` is called from this thread whenever the number of
    finished runs changes. On `cfg.timeout_s` the result comes back with `complete=False`.
    `files`: the task files the pool's tasks name by content (the index `load_pool`
    filled), served to the actors.
    """
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
            free_given_up=False,  # every task runs runs_per_task times, no more
            retire_after_eval_errors=0,  # and a checker that raises is counted, each time
        ),
    )
    tally = PoolTally(book, ids, cfg.success_score)
    start = time.monotonic()
    icfg = dataclasses.replace(ingest_config or IngestConfig(), learner_id=learner_id)
    grants = GrantServer(book, cfg.transport, files=files)
    ingest = Ingest(
        store if store is not None else _Discard(),
        icfg,
        cfg.transport,
        version=lambda: book.version,
        on_trajectory=tally.on_trajectory,
    )
    proc = None
    complete = False
    with contextlib.ExitStack() as stack:
        control = _bind(grants.start, "transport.control", cfg.transport.control)
        stack.callback(grants.stop)
        stack.callback(ingest.stop)  # stops a started ingest, closes the journal of any
        data = _bind(ingest.start, "transport.data", cfg.transport.data)
        log.info(
            "%s: %d tasks x %d runs; actors connect to data %s, control %s",
            learner_id,
            len(ids),
            cfg.runs_per_task,
            data,
            control,
        )
        if cfg.local_actor:
            args = cfg.local_actor_args if actor_args is None else actor_args
            proc = start_local_actor(
                args, data, control, actor_id=actor_id, log_path=actor_log, spool=spool
            )
            stack.callback(stop_local_actor, proc, spool)
        last = -1
        while True:
            done = tally.done()
            if done != last:
                last = done
                if on_progress is not None:
                    on_progress(done, total)
            if done >= total:
                complete = True
                break
            if cfg.timeout_s and time.monotonic() - start > cfg.timeout_s:
                break
            if proc is not None and proc.poll() is not None:
                raise ArpoError(
                    f"the local actor exited (code {proc.returncode}) with {done} of {total} "
                    f"runs finished; its log {actor_log} ends with:\n{tail(actor_log)}"
                )
            time.sleep(0.05)
    return PoolResult(
        counts=tally.snapshot(),
        episodes=tally.episode_list(),
        complete=complete,
        done=tally.done(),
        total=total,
        elapsed_s=time.monotonic() - start,
        ingest=ingest.stats(),
    )


def check_not_set(args: list[str], keys: Mapping[str, Any], field_name: str) -> None:
    """In a `validate()`: fail `field_name` when one of `args` (field=value) sets one of `keys`."""
    for a in args:
        key = a.split("=", 1)[0].strip()
        if key in keys:
            fail(field_name, f"{a!r} sets {key}, which this command sets itself ({keys[key]})")


def with_overrides(args: list[str], forced: Mapping[str, Any]) -> list[str]:
    """`args` followed by `forced` as field=value overrides (TOML values: the last one wins)."""
    return [*args, *(f"{k}={json.dumps(v)}" for k, v in forced.items())]


def counts_table(
    tasks: Mapping[str, Mapping[str, Any]], marked: frozenset[str] | None = None
) -> str:
    """A plain-text table of runs / successes / env errors / unknown per task; with
    `marked`, those tasks get a `*` in a first column."""
    width = max([len("task"), *(len(t) for t in tasks)])
    lead = "  " if marked is not None else ""
    lines = [f"{lead}{'task':<{width}}  {'runs':>5}  {'successes':>9}  {'env_errors':>10}  unknown"]
    for tid, c in tasks.items():
        mark = ("* " if tid in marked else "  ") if marked is not None else ""
        lines.append(
            f"{mark}{tid:<{width}}  {c['runs']:>5}  {c['successes']:>9}  "
            f"{c['env_errors']:>10}  {c['unknown']:>7}"
        )
    return "\n".join(lines)


def run_command(
    name: str,
    progress_s: float,
    run: Callable[[Callable[[int, int], None]], Any],
    report: Callable[[Any], str],
) -> int:
    """The body of `arpo <name>`: logging to stderr, a rate-limited progress line, errors
    as exit codes (2: configuration, 1: anything else the run reports), the report printed."""
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    last_print = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if progress_s and (now - last_print[0] >= progress_s or done == total):
            last_print[0] = now
            print(f"{name}: {done}/{total} runs finished", file=sys.stderr, flush=True)

    try:
        result = run(progress)
    except ConfigError as e:
        print(f"arpo {name}: {e}", file=sys.stderr)
        return 2
    except ERRORS as e:  # TaskError too
        print(f"arpo {name}: {e}", file=sys.stderr)
        return 1
    print(report(result))
    return 0

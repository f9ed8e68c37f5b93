"""Task audit: every task of a pool set up on a real environment of its pool, no agent.

    arpo audit-tasks tasks=runs/task_pool                         # simulated tasks: sim desktops
    arpo audit-tasks tasks=envs/arpo_envs/tasks/local local_desktops=2
    arpo audit-tasks tasks=envs/arpo_envs/tasks/local local_desktops=2 local_atspi=true  # the tree
    arpo audit-tasks tasks=... vms=2                              # QEMU VMs of the test image
    arpo audit-tasks tasks=... 'env_urls=["http://10.0.0.5:5000"]' env_provider=static
    arpo audit-tasks tasks=... checks=false                       # revert + setup only

    audits = await audit_tasks(load_pool(path, index), {"sim": [EnvSpec(url, provider="sim")]},
                               FileSource.local(index, BlobCache(tmp)), checks=True)

Each task runs on one environment of its pool (`arpo.env.task.task_pool`: "sim",
"desktop" or the task's own "pool"); the environments of a pool work in parallel, one
task at a time each, every task bounded by `task_timeout_s`. For each task:

1. revert + setup (`Environment.reset`: the provider's revert, then the task's `config`
   steps; the files its `upload_file` steps send are fetched by content through the
   `FileSource`, as an actor gets them from the learner);
2. with `checks`: the checker on the untouched initial state (`evaluate` right after the
   setup, no action): it must score 0, or the checker passes an episode that did nothing;
3. with `checks` and an `oracle` (the simulated and local suites carry one): set up again,
   run each oracle action, then DONE, evaluate: it must score 1.

Verdicts, the first that applies: `setup_failed` (the setup raised: a broken task, a
step that failed, no environment of the task's pool, or the per-task timeout during the
setup), `eval_error` (a checker could not run: status eval_error or env_error of an
evaluation, or the timeout there), `do_nothing_scores` (the do-nothing score is above 0:
the checker is too lax), `oracle_fails` (the oracle scores below 1, or one of its actions
failed at the environment), `ok`. A `reason` says what was found ("" when ok).

A failed revert (`ResetError`) is the environment's fault, never the task's: the task
goes back to its pool's queue for another environment, and an environment whose revert
failed `reset_failures` times in a row is retired (a fleet VM first gets the time the
fleet needs to replace it). Tasks left when every environment of their pool is retired,
or whose pool has none, are `setup_failed` with that reason: nothing is skipped silently.

`arpo train` calls `audit_tasks(..., checks=False)` as a preflight on the environments it
started; it passes them as `EnvSpec`s (URL, token, provider kind) grouped by pool.

Output of `arpo audit-tasks` (`out` is a path stem): `<out>.json`

    {"command", "note", "tasks_source", "created", "elapsed_s", "commit", "machine",
     "checks", "environments": {"<pool>": {"<kind>": n}}, "files": {"fetched", "hits",
     "refused"}, "summary": {"tasks", "ok", "setup_failed", "eval_error",
     "do_nothing_scores", "oracle_fails"},
     "tasks": [{"task_id", "domain", "pool", "env", "setup_ok", "setup_s",
                "do_nothing_score", "oracle_score", "seconds", "verdict", "reason"}, ...]}

and `<out>.md`, the same as Markdown with the command at its top (also printed). Exit
code: 0 when every task is `ok` (or `strict=false`: whenever the audit ran), 1 when a
task is not ok or the audit could not run, 2 for a configuration error, 130 when
interrupted (Ctrl-C / SIGTERM; the environments started here are stopped either way).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import datetime
import logging
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from arpo.config import (
    check_range,
    check_seconds,
    fail,
    folder_problem,
    option,
    to_dict,
)
from arpo.env.bringup import (
    DESKTOP_POOL,
    MAX_LOCAL_ENVS,
    Bringup,
    EnvironmentsConfig,
    EnvSpec,
)
from arpo.env.environment import Environment
from arpo.env.osworld.client import EvaluatorConfig, OSWorldEvaluator, find_python
from arpo.env.runner import DESKTOP_ACTION_PAUSE_S, RunnerConfig
from arpo.env.task import PoolTask, Task, load_pool, pool_problem, task_domain, task_pool
from arpo.env.taskfiles import BlobCache, FileSource, TaskFiles
from arpo.errors import ArpoError, EnvError, ResetError
from arpo.files import write_atomic, write_json_atomic
from arpo.markdown import md_cell

log = logging.getLogger("arpo.pool.audit")

VERDICTS = ("ok", "setup_failed", "eval_error", "do_nothing_scores", "oracle_fails")
"""Every verdict, in the order they are checked after `ok` (the first that applies wins)."""
SIM_POOL = "sim"
"""Pool of the simulated desktops started by `arpo audit-tasks` (`sim_envs`)."""


# ---------------------------------------------------------------------------- one task


@dataclass(frozen=True, slots=True)
class TaskAudit:
    """What the audit found for one task."""

    task_id: str
    domain: str
    pool: str
    setup_ok: bool
    """Revert + setup raised nothing (both setups, with the oracle run)."""
    setup_s: float
    """Seconds of the first revert + setup (until it failed, when it did)."""
    reason: str
    """"" when ok; else what was found: exception types and messages, scores, timeouts."""
    do_nothing_score: float | None = None
    """The checker on the untouched initial state; None without checks or when it could
    not run."""
    oracle_score: float | None = None
    """The checker after the oracle and DONE; None without checks, without an oracle, or
    when the oracle run broke off."""
    verdict: str = "ok"
    """One of VERDICTS."""
    env: str = ""
    """URL of the environment that ran it ("" when none did)."""
    seconds: float = 0.0
    """Wall time of the whole audit of the task on its environment."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _ResetFailed(Exception):
    """The environment's revert failed during the audit of a task: not the task's fault."""


def _verdict(setup_ok: bool, eval_problems: list[str], dn: float | None, oracle_bad: bool) -> str:
    if not setup_ok:
        return "setup_failed"
    if eval_problems:
        return "eval_error"
    if dn is not None and dn > 0:
        return "do_nothing_scores"
    if oracle_bad:
        return "oracle_fails"
    return "ok"


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


async def _audit_one(
    env: Environment, task: Task, pool: str, checks: bool, timeout_s: float
) -> TaskAudit:
    """Audit `task` on `env`; raises _ResetFailed when the environment's revert failed."""
    runner, provider = env.runner, env.provider
    t0 = time.perf_counter()
    setup_s = 0.0
    setup_ok = False
    dn: float | None = None
    orc: float | None = None
    oracle = task.extra.get("oracle")
    has_oracle = checks and isinstance(oracle, list) and bool(oracle)
    problems: list[str] = []  # every finding, in order: the reason
    eval_problems: list[str] = []
    oracle_bad = False
    phase = "setup"

    async def setup(what: str) -> bool:
        try:
            await env.reset(task)
        except ResetError as e:
            raise _ResetFailed(_err(e)) from e
        except Exception as e:  # the task's setup: a broken task or a step that failed
            problems.append(f"{what}: {_err(e)}")
            await provider.report(task.id, False, _err(e))
            return False
        await provider.report(task.id, True)
        return True

    async def evaluate(what: str) -> float | None:
        """The checker's score, or None (and an eval problem) when it could not run."""
        try:
            r = await env.evaluate(task)
        except Exception as e:  # e.g. a postconfig file whose bytes are not what it names
            eval_problems.append(f"{what}: {_err(e)}")
        else:
            if r.status == "ok":
                return r.score
            eval_problems.append(f"{what}: {r.status}: {r.error}")
        problems.append(eval_problems[-1])
        return None

    try:
        async with asyncio.timeout(timeout_s):
            setup_ok = await setup("setup")
            setup_s = time.perf_counter() - t0
            if setup_ok and checks:
                phase = "do-nothing evaluation"
                dn = await evaluate(phase)
                if dn is not None and dn > 0:
                    problems.append(
                        f"doing nothing scores {dn:g} (the checker passes the untouched "
                        "initial state)"
                    )
            if setup_ok and has_oracle:
                phase = "setup of the oracle run"
                setup_ok = await setup("setup of the oracle run")
            if setup_ok and has_oracle:
                assert isinstance(oracle, list)
                phase = "oracle actions"
                notes: list[str] = []
                broke = False
                for i, action in enumerate([*oracle, "DONE"]):
                    try:
                        res = await runner.act(str(action))
                    except EnvError as e:
                        problems.append(f"oracle action {i}: {_err(e)}")
                        broke = oracle_bad = True
                        break
                    if res is not None and res.returncode not in (0, None):
                        err = res.error.strip().splitlines()[-1:] or [res.status]
                        notes.append(f"oracle action {i} exited with {res.returncode}: {err[0]}")
                if not broke:
                    phase = "oracle evaluation"
                    orc = await evaluate(phase)
                    if orc is not None and orc < 1:
                        oracle_bad = True
                        problems.append(f"the oracle scores {orc:g}")
                        problems += notes
    except TimeoutError:
        # `asyncio.timeout` turns its own cancellation into TimeoutError; the runner's
        # EnvTimeouts never get here (setup catches them, evaluate reports them).
        problems.append(f"timeout: the audit took over {timeout_s:g} s (in the {phase})")
        if phase.startswith("setup"):
            setup_ok = False
            setup_s = setup_s or time.perf_counter() - t0
        elif "evaluation" in phase:
            eval_problems.append(problems[-1])
        else:
            oracle_bad = True
    return TaskAudit(
        task_id=task.id,
        domain=task.domain,
        pool=pool,
        setup_ok=setup_ok,
        setup_s=round(setup_s, 3),
        reason="; ".join(problems) if problems else "",
        do_nothing_score=dn,
        oracle_score=orc,
        verdict=_verdict(setup_ok, eval_problems, dn, oracle_bad),
        env=env.url,
        seconds=round(time.perf_counter() - t0, 3),
    )


# ---------------------------------------------------------------------------- a pool's queue


class _Queue:
    """The tasks of one pool, shared by its environments. A task whose environment failed
    its revert comes back to the front; an idle worker waits while another still holds a
    task (it may come back), and stops when the queue is empty and nothing is held."""

    def __init__(self, items: Sequence[int]) -> None:
        self.items = collections.deque(items)
        self.held = 0
        self.cond = asyncio.Condition()

    async def take(self) -> int | None:
        async with self.cond:
            while not self.items and self.held:
                await self.cond.wait()
            if not self.items:
                return None
            self.held += 1
            return self.items.popleft()

    async def done(self, back: int | None = None) -> None:
        async with self.cond:
            self.held -= 1
            if back is not None:
                self.items.appendleft(back)
            self.cond.notify_all()


# ---------------------------------------------------------------------------- the shared core


async def audit_tasks(
    pool_tasks: Sequence[PoolTask | Mapping[str, Any]],
    envs_by_pool: Mapping[str, Sequence[EnvSpec | Environment]],
    files: FileSource | None,
    *,
    checks: bool,
    task_timeout_s: float = 300.0,
    reset_failures: int = 2,
    osworld: OSWorldEvaluator | None = None,
    on_result: Callable[[TaskAudit], None] | None = None,
) -> list[TaskAudit]:
    """Audit every task on an environment of its pool; one `TaskAudit` per task, in order.

    `pool_tasks`: `load_pool`'s `PoolTask`s (or plain task dicts; their domain is then
    `task_domain`'s). `envs_by_pool`: pool name -> its environments, each an `EnvSpec`
    (URL + token + provider kind: built here into the actor's `Environment` and closed at
    the end) or an `Environment` already built (used as it is, left open). `files`:
    where the files tasks name by content come from (`FileSource.local(index,
    BlobCache(dir))` for a pool loaded in this process, an actor's source otherwise); used
    for the specs built here. None: the files are read beside the task file, hash
    checked. `checks`: also the do-nothing and oracle scores (see the module docstring);
    False: revert + setup only (the preflight of `arpo train`). Every task is bounded by
    `task_timeout_s`; an environment whose revert failed `reset_failures` times in a row
    is retired. `osworld`: OSWorld evaluator workers for the specs' runners (None: a pool
    of up to 2 started here when a task first needs one, stopped at the end).
    `on_result` is called with each TaskAudit as it is made.
    """
    if task_timeout_s <= 0 or not math.isfinite(task_timeout_s):
        raise ValueError(f"task_timeout_s must be a finite number > 0, got {task_timeout_s}")
    if reset_failures < 1:
        raise ValueError(f"reset_failures must be >= 1, got {reset_failures}")
    results: list[TaskAudit | None] = [None] * len(pool_tasks)

    def record(i: int, a: TaskAudit) -> None:
        results[i] = a
        if on_result is not None:
            on_result(a)

    # The tasks, parsed, by pool; a task that cannot be read is a setup failure at once.
    parsed: dict[int, tuple[Task, str]] = {}
    by_pool: dict[str, list[int]] = {}
    for i, item in enumerate(pool_tasks):
        raw = item.task if isinstance(item, PoolTask) else dict(item)
        domain = item.domain if isinstance(item, PoolTask) else task_domain(raw)
        source = item.source if isinstance(item, PoolTask) else ""
        try:
            pool = task_pool(raw)
            # With a file source the task is read as an actor reads a grant: no path, its
            # files by content only. Without one, beside its task file.
            path = source.rsplit(":", 1)[0] if files is None and source else None
            task = Task.from_dict(raw, domain=domain, path=path)
        except Exception as e:
            record(i, TaskAudit(str(raw.get("id", "?")), domain, str(raw.get("pool", "?")),
                                False, 0.0, f"the task cannot be read: {_err(e)}",
                                verdict="setup_failed"))  # fmt: skip
            continue
        parsed[i] = (task, pool)
        by_pool.setdefault(pool, []).append(i)

    own_osworld = osworld is None
    n_specs = sum(isinstance(e, EnvSpec) for envs in envs_by_pool.values() for e in envs)
    if osworld is None:
        osworld = OSWorldEvaluator(EvaluatorConfig(workers=max(1, min(n_specs, 2))))
    built: list[Environment] = []
    retired: dict[str, list[str]] = {}  # pool -> why each retired environment was retired

    async def worker(env: Environment, pool: str, queue: _Queue) -> None:
        failures = 0
        while (i := await queue.take()) is not None:
            task, _ = parsed[i]
            try:
                a = await _audit_one(env, task, pool, checks, task_timeout_s)
            except _ResetFailed as e:
                failures += 1
                log.warning("env %s: revert failed before task %s (%d in a row): %s",
                            env.url, task.id, failures, e)  # fmt: skip
                await queue.done(back=i)
                if failures >= reset_failures or (
                    env.replaceable and not await env.wait_healthy(task_timeout_s)
                ):
                    why = f"{env.url}: {failures} failed reverts, the last {e}"
                    retired.setdefault(pool, []).append(why)
                    log.error("env %s retired from the audit: %s", env.url, why)
                    return
                continue
            except BaseException:
                await queue.done()
                raise
            failures = 0
            await queue.done()
            record(i, a)

    try:
        jobs = []
        index = 0
        for pool, ids in by_pool.items():
            queue = _Queue(ids)
            for e in envs_by_pool.get(pool, ()):
                if isinstance(e, EnvSpec):
                    e = e.environment(index, files, osworld)
                    built.append(e)
                index += 1
                jobs.append(worker(e, pool, queue))
        async with asyncio.TaskGroup() as tg:  # a worker that raises cancels the others
            for job in jobs:
                tg.create_task(job)
    finally:
        closing = [e.close() for e in built] + ([osworld.aclose()] if own_osworld else [])
        try:
            async with asyncio.timeout(15.0):  # a stuck connection cannot hold the audit
                await asyncio.gather(*closing, return_exceptions=True)
        except TimeoutError:
            log.warning("closing the audit's environments timed out")

    for i, (task, pool) in parsed.items():
        if results[i] is None:
            if pool in retired:
                why = f"every environment of pool {pool!r} was retired ({'; '.join(retired[pool])})"
            else:
                why = f"no environment of pool {pool!r}"
            record(i, TaskAudit(task.id, task.domain, pool, False, 0.0, why,
                                verdict="setup_failed"))  # fmt: skip
    return [a for a in results if a is not None]


def summarize(audits: Sequence[TaskAudit]) -> dict[str, int]:
    """Tasks in all and by verdict (every verdict present, 0 when none)."""
    counts = collections.Counter(a.verdict for a in audits)
    return {"tasks": len(audits), **{v: counts.get(v, 0) for v in VERDICTS}}


# ---------------------------------------------------------------------------- the command


@dataclass
class AuditConfig(EnvironmentsConfig):
    """`arpo audit-tasks`: every task of a pool set up (and checked) on environments of
    its pool, started here or given by URL (the environments section, `EnvironmentsConfig`,
    is `arpo train`'s)."""

    tasks: str = option(
        "",
        "The task pool to audit: a folder, .json or .jsonl (as `arpo train` / the learner "
        "read it), e.g. envs/arpo_envs/tasks/local.",
    )
    out: str = option("runs/task-audit", "Path stem of the report: <out>.json and <out>.md.")
    checks: bool = option(
        True,
        "Also score each task's checker on the untouched initial state (must be 0) and, "
        "when the task has an oracle, after the oracle's actions and DONE (must be 1); "
        "false: revert + setup only.",
    )
    local_atspi: bool = option(
        False,
        "Start the local_desktops with the accessibility tree (`arpo-envs up --atspi`: a "
        "session bus, the AT-SPI registry and LibreOffice's GTK 3 plugin), as `arpo train` "
        "starts them for an observation type that shows a table; false: LibreOffice's X11 "
        "plugin, no bus (as `make demo`).",
    )
    sim_envs: int = option(
        4,
        "Simulated desktops started in this process for the tasks of pool 'sim' (only when "
        "the pool has such tasks, at most one per task).",
    )
    env_provider: Literal["desktop", "static"] = option(
        "desktop",
        "How the env_urls servers are reverted before each setup: 'desktop' (POST /reset: "
        "local desktops) or 'static' (nothing: a server without /reset, such as an OSWorld "
        "VM you run yourself; then every task starts where the last one ended).",
    )
    evaluator: Literal["own", "auto", "osworld"] = option(
        "auto",
        "Who sets up and scores the tasks of the local desktops, VMs and env_urls: 'own' "
        "(this project's code), 'osworld' (OSWorld's published code) or 'auto' (own where "
        "it has everything a task needs); the simulated desktops always use 'own'.",
    )
    cache_dir: str = option(
        "", "Local file cache for `download` steps and `cloud_file` getters ('': none)."
    )
    file_cache_dir: str = option(
        "",
        "Content-addressed cache of the files tasks name by sha256 ('': a temporary folder, "
        "so every file is fetched through the file source as on a fresh actor host).",
    )
    task_timeout_s: float = option(
        300.0, "Bound on the whole audit of one task (setups, oracle, evaluations)."
    )
    reset_failures: int = option(
        2,
        "An environment whose revert failed this many times in a row is retired; its "
        "tasks go to the other environments of its pool.",
    )
    strict: bool = option(
        True, "Exit 1 when a task is not ok; false: exit 0 whenever the audit ran."
    )
    note: str = option("", "A line put under the report's title (how the pool was made, why).")

    def validate(self) -> None:
        if not self.tasks:
            fail("tasks", "give the task pool to audit, e.g. tasks=envs/arpo_envs/tasks/local")
        if problem := pool_problem(self.tasks):
            fail("tasks", problem)
        if not self.out:
            fail("out", "give a path stem for the report, e.g. out=runs/task-audit")
        if self.local_atspi and not self.local_desktops:
            fail("local_atspi", "starts local desktops with the tree: give local_desktops=N too")
        super().validate()
        if not 0 <= self.sim_envs <= MAX_LOCAL_ENVS:
            fail("sim_envs", f"is {self.sim_envs}; give 0..{MAX_LOCAL_ENVS} (environments on "
                 "this machine)")  # fmt: skip
        check_seconds("task_timeout_s", self.task_timeout_s, "the whole audit of one task")
        check_range("reset_failures", self.reset_failures, 1, 100, "failed reverts in a row")
        for name in ("cache_dir", "file_cache_dir"):
            if problem := folder_problem(getattr(self, name)):
                fail(name, problem)
        if self.evaluator == "osworld" and find_python(None) is None:
            fail("evaluator", "'osworld' needs OSWorld's evaluator environment: run "
                 "`make osworld-evaluator` or set $ARPO_OSWORLD_PYTHON")  # fmt: skip


def command_line(cfg: AuditConfig) -> str:
    """The `arpo audit-tasks` command that gives `cfg`: every field that differs from its
    default, as `field=value` (TOML values, quoted for a POSIX shell)."""
    defaults, given = to_dict(AuditConfig()), to_dict(cfg)
    words = ["arpo", "audit-tasks"]
    for k, v in given.items():
        if v == defaults[k]:
            continue
        if isinstance(v, str):
            # A bare word is read as a string only where TOML cannot parse it as a value.
            bare = (
                bool(v)
                and (v[0].isalpha() or v[0] in "/._")
                and all(c.isalnum() or c in "/._-" for c in v)
            )
            text = v if bare and v not in ("true", "false", "inf", "nan") else _toml_str(v)
        elif isinstance(v, bool):
            text = "true" if v else "false"
        elif isinstance(v, list):
            text = "[" + ", ".join(_toml_str(x) for x in v) + "]"
        else:
            text = repr(v)
        words.append(shlex.quote(f"{k}={text}"))
    return " ".join(words)


def _toml_str(s: str) -> str:
    import json

    return json.dumps(s, ensure_ascii=False)


def _commit() -> str | None:
    """`git describe --always --dirty` of the repository this file is in, if it is one."""
    try:
        out = subprocess.run(
            ["git", "-C", str(Path(__file__).resolve().parents[2]), "describe", "--always",
             "--dirty"], capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt while the audit runs, so that it stops the
    environments it started as Ctrl-C does (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run_audit(
    cfg: AuditConfig, *, on_result: Callable[[TaskAudit], None] | None = None
) -> dict[str, Any]:
    """Audit the pool, write `<out>.json` and `<out>.md`, return the JSON's content.

    Raises `TaskError` for a pool that cannot be loaded, `ArpoError` when environments
    cannot be started; KeyboardInterrupt (Ctrl-C, or SIGTERM while it runs) after
    stopping every environment started here."""
    t0 = time.perf_counter()
    created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    index = TaskFiles()
    pool = load_pool(cfg.tasks, index)
    wanted = collections.Counter(task_pool(p.task) for p in pool)
    desktop_runner = RunnerConfig(
        reset_before_setup=True, evaluator=cfg.evaluator, action_pause_s=DESKTOP_ACTION_PAUSE_S,
        cache_dir=Path(cfg.cache_dir) if cfg.cache_dir else None,
    )  # fmt: skip
    static_runner = dataclasses.replace(desktop_runner, reset_before_setup=False)
    specs: dict[str, list[EnvSpec]] = {}
    kinds: dict[str, collections.Counter[str]] = {}

    def add(pool_name: str, kind: str, items: list[EnvSpec]) -> None:
        if not items:
            return
        specs.setdefault(pool_name, []).extend(items)
        kinds.setdefault(pool_name, collections.Counter())[kind] += len(items)

    with contextlib.ExitStack() as stack, _sigterm_interrupts():
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="arpo-audit-")))
        envs = stack.enter_context(Bringup(tmp))  # stopped before tmp goes
        if cfg.local_desktops:
            add(DESKTOP_POOL, "local desktop",
                envs.start_desktops(cfg.local_desktops, atspi=cfg.local_atspi,
                                    runner=desktop_runner))  # fmt: skip
        fleet = cfg.vm_fleet
        if cfg.vms:
            fleet = str(envs.start_vms(cfg.vms, tempfile.mkdtemp(prefix="arpo-audit-vms-")))
        if fleet:
            try:
                add(cfg.vm_pool, "VM", EnvSpec.fleet_vms(fleet, static_runner))
            except ValueError as e:
                raise ArpoError(str(e)) from e
        url_runner = desktop_runner if cfg.env_provider == "desktop" else static_runner
        add(cfg.env_pool, f"{cfg.env_provider} server", cfg.url_specs(cfg.env_provider, url_runner))
        cache = BlobCache(cfg.file_cache_dir or tmp / "task-files")
        source = FileSource.local(index, cache)
        n_sims = min(cfg.sim_envs, wanted.get(SIM_POOL, 0))

        async def main() -> list[TaskAudit]:
            runners: list[Any] = []
            try:
                if n_sims:
                    from arpo_envs.sim.server import SimConfig, start_servers

                    runners, urls = await start_servers(
                        [SimConfig(port=0, index=i) for i in range(n_sims)]
                    )
                    add(SIM_POOL, "simulated desktop", [EnvSpec(u, provider="sim") for u in urls])
                return await audit_tasks(
                    pool, specs, source, checks=cfg.checks, task_timeout_s=cfg.task_timeout_s,
                    reset_failures=cfg.reset_failures, on_result=on_result,
                )  # fmt: skip
            finally:
                for r in runners:
                    await r.cleanup()

        audits = asyncio.run(main())
    report = {
        "command": command_line(cfg),
        "note": cfg.note,
        "tasks_source": cfg.tasks,
        "created": created,
        "elapsed_s": round(time.perf_counter() - t0, 3),
        "commit": _commit(),
        "machine": _machine(),
        "checks": cfg.checks,
        "environments": {p: dict(sorted(c.items())) for p, c in kinds.items()},
        "files": {"fetched": source.fetched, "hits": source.hits, "refused": source.refused},
        "summary": summarize(audits),
        "tasks": [a.to_dict() for a in audits],
    }
    out = Path(cfg.out)
    write_json_atomic(out.with_name(out.name + ".json"), report)
    write_atomic(out.with_name(out.name + ".md"), format_markdown(report))
    return report


# ---------------------------------------------------------------------------- the report


def _score(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def format_markdown(report: Mapping[str, Any]) -> str:
    """The report as Markdown: the command, the run, counts by verdict, then every task."""
    s = report["summary"]
    lines = ["# Task audit", "", "```", report["command"], "```", ""]
    if report.get("note"):
        lines += [report["note"], ""]
    envs = "; ".join(
        f"pool {md_cell(p)}: " + ", ".join(f"{n} {k}" for k, n in c.items())
        for p, c in report["environments"].items()
    )
    f = report["files"]
    checks = "revert + setup, do-nothing score, oracle score" if report["checks"] else (
        "revert + setup only")  # fmt: skip
    lines += [
        f"- tasks: {md_cell(report['tasks_source'])}, {s['tasks']} tasks; checks: {checks}",
        f"- environments: {envs or 'none'}",
        f"- created {report['created']}, wall time {report['elapsed_s']:.1f} s; commit "
        f"{report['commit'] or 'unknown'}; {report['machine']}",
        f"- task files by content: {f['fetched']} fetched, {f['hits']} from the cache, "
        f"{f['refused']} refused",
        "",
        "| verdict | tasks |",
        "|---|---|",
        *(f"| {v} | {s[v]} |" for v in VERDICTS),
        f"| all | {s['tasks']} |",
        "",
        "## Tasks",
        "",
        "| task | domain | pool | setup | setup s | do-nothing | oracle | s | verdict | reason |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in report["tasks"]:
        lines.append(
            f"| {md_cell(t['task_id'])} | {md_cell(t['domain'])} | {md_cell(t['pool'])} | "
            f"{'ok' if t['setup_ok'] else 'failed'} | {t['setup_s']:.1f} | "
            f"{_score(t['do_nothing_score'])} | {_score(t['oracle_score'])} | "
            f"{t['seconds']:.1f} | {t['verdict']} | {md_cell(t['reason'], 400)} |"
        )
    return "\n".join(lines) + "\n"


def main(cfg: AuditConfig) -> int:
    """`arpo audit-tasks`: run, print the Markdown report; the exit code (module docstring)."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )  # fmt: skip
    done = [0]

    def progress(a: TaskAudit) -> None:
        done[0] += 1
        log.info("%d: %s %s (do-nothing %s, oracle %s, %.1f s)%s", done[0], a.task_id,
                 a.verdict, _score(a.do_nothing_score), _score(a.oracle_score), a.seconds,
                 f": {a.reason}" if a.reason else "")  # fmt: skip

    try:
        report = run_audit(cfg, on_result=progress)
    except KeyboardInterrupt:
        print("arpo audit-tasks: interrupted; the environments started here are stopped",
              file=sys.stderr)  # fmt: skip
        return 130
    print(format_markdown(report))
    print(f"written to {cfg.out}.json and {cfg.out}.md")
    s = report["summary"]
    return 1 if cfg.strict and s["ok"] < s["tasks"] else 0

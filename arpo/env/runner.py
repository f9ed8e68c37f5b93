"""Runs OSWorld tasks against an environment server, with OSWorld's semantics.

One `TaskRunner` per environment; episodes run one after another:

    runner = TaskRunner(client, RunnerConfig(cache_dir="osworld_cache"))
    await runner.setup(task)                 # the task's `config` steps (no revert)
    await runner.act("pyautogui.click(10, 20)")   # or WAIT / DONE / FAIL
    result = await runner.evaluate()         # postconfig, getters, metrics -> EvalResult
    runner.close()

Setup steps: download (from the local file cache, never the network), upload_file, open,
launch, execute and command (with OSWorld's `{SCREEN_WIDTH}`-style placeholders, `until`
polling and `stdout` / `stderr` capture into the episode's work dir), sleep, activate_window,
close_window, and the simulated desktop's `sim_scene` (`POST /sim/scene`). Any other step type
raises `TaskError` before anything runs. The runner runs steps on the environment as it is:
bringing it back to a clean state first is its `Environment`'s job (arpo.env.environment).

Which code sets up and scores a task is `RunnerConfig.evaluator`: "own" (this module's steps,
`arpo.env.getters` and `arpo.env.metrics`), "osworld" (OSWorld's published setup controller,
getters and metrics, run by a worker in the evaluator environment, `arpo.env.osworld`), or
"auto" (the default: this module's where it has everything the task needs, OSWorld's
otherwise). `unsupported(task, evaluator)` lists what neither can do.

Scoring follows `DesktopEnv.evaluate`: postconfig steps first; an `infeasible` task scores 1
exactly when the last action is FAIL, and any other task scores 0 when it is; then each metric
is applied to its getters' values and the scores combine with `conj` ("and": 0 as soon as one
metric is 0, else the mean; "or": 1 as soon as one is 1, else the max). Where OSWorld would
crash or silently give 0, this runner reports a status instead: `env_error` when the
environment failed (transport, server error, missing cached file), `eval_error` when a getter
or metric raised or is not implemented here. Those results carry score 0 and must not be
trained on as failures of the agent.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import logging
import math
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from arpo.env.cache import FileCache, cache_name
from arpo.env.client import EnvClient, ExecResult
from arpo.env.getters import GETTERS, GetterContext
from arpo.env.metrics import METRICS, TABLE_CELL_PROPS, TABLE_RULES
from arpo.env.osworld.client import EvaluatorConfig, OSWorldError, OSWorldEvaluator, find_python
from arpo.env.osworld.names import osworld_unsupported
from arpo.env.task import STEP_TYPES, Step, Task
from arpo.env.taskfiles import BlobMismatch, FileRef, FileSource, sha256_file
from arpo.errors import EnvError, EnvHTTPError, EnvTimeout, FileCacheMiss, TaskError

log = logging.getLogger(__name__)

SPECIAL_ACTIONS = ("WAIT", "DONE", "FAIL")
DESKTOP_ACTION_PAUSE_S = 1.0
"""`RunnerConfig.action_pause_s` on real desktops and VMs: UI-TARS's own converter waits 1 s
between the actions of one response."""
EVALUATORS = ("own", "auto", "osworld")


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """How the runner sets up, drives and checks tasks."""

    cache_dir: str | Path | None = None
    """Local file cache for `download` steps and `cloud_file` getters (see arpo.env.cache). With
    OSWorld's evaluator and no cache, OSWorld's own code downloads the files (networked hosts)."""
    work_root: str | Path | None = None
    """Where per-episode work dirs are made (system temp dir when None)."""
    screen_width: int | None = None
    """Screen width for the `{SCREEN_WIDTH}` placeholders; None asks the server (`/screen_size`)."""
    screen_height: int | None = None
    """Screen height, as `screen_width`."""
    client_password: str = "password"
    """Replaces `{CLIENT_PASSWORD}` in commands (OSWorld's VM user password)."""
    sleep_scale: float = 1.0
    """Multiplies every `sleep` step (0 on a simulated desktop that needs no waiting)."""
    wait_seconds: float = 1.0
    """How long the WAIT action waits."""
    action_pause_s: float = 0.0
    """Pause between two actions of one response, times `sleep_scale` (`between_actions`). A
    real application needs the time to react (a dialog opens, a focus moves): the actor and the
    environment bring-up use `DESKTOP_ACTION_PAUSE_S` for desktops and VMs. A simulated
    desktop reacts at once and needs none."""
    until_poll_s: float = 0.3
    """Interval between tries of an `execute` step with `until` (OSWorld: 0.3 s)."""
    until_timeout_s: float = 120.0
    """Give up an `until` poll after this long (OSWorld polls forever) with EnvTimeout."""
    execute_max_failures: int = 5
    """Failed `execute` step requests tolerated before the step fails (OSWorld: 5)."""
    reset_before_setup: bool = False
    """Read by `Environment` (arpo.env.environment) without an explicit provider: the desktop's
    `POST /reset` reverts it before the setup steps (local and simulated desktops); False:
    nothing does. VMs of the fleet are reverted by their provider."""
    evaluator: str = "auto"
    """Who sets up and scores tasks: "own" (this project's steps, getters and metrics only),
    "osworld" (OSWorld's published code through its worker, always: benchmark scores exactly) or
    "auto" (own where it has everything a task needs, OSWorld's otherwise, if installed)."""
    osworld_python: str | Path | None = None
    """Python of OSWorld's evaluator environment; None: $ARPO_OSWORLD_PYTHON, else the
    repository's `.venv-osworld` (`make osworld-evaluator`)."""
    osworld_timeout_s: float = 600.0
    """Bound on one OSWorld setup or evaluation; a worker that overruns it is killed."""
    osworld_probe_timeout_s: float = 10.0
    """Before each OSWorld setup or evaluation the runner asks the environment for
    `GET /platform` within this many seconds; one that does not answer is `env_error` at once
    (OSWorld's own code retries an unreachable server for about 100 s). 0: no check."""

    def __post_init__(self) -> None:
        if self.evaluator not in EVALUATORS:
            raise ValueError(
                f"RunnerConfig.evaluator must be one of {', '.join(EVALUATORS)}, "
                f"got {self.evaluator!r}"
            )
        if self.evaluator == "osworld" and find_python(self.osworld_python) is None:
            raise ValueError(
                "RunnerConfig.evaluator='osworld' needs OSWorld's evaluator environment: run "
                "`make osworld-evaluator`, or set osworld_python (or $ARPO_OSWORLD_PYTHON) to "
                f"its python (not found: {self.osworld_python or '.venv-osworld/bin/python'})"
            )
        if not (math.isfinite(self.osworld_timeout_s) and self.osworld_timeout_s > 0):
            raise ValueError(
                f"RunnerConfig.osworld_timeout_s must be finite and > 0, got {self.osworld_timeout_s}"
            )
        if not (math.isfinite(self.osworld_probe_timeout_s) and self.osworld_probe_timeout_s >= 0):
            raise ValueError(
                "RunnerConfig.osworld_probe_timeout_s must be finite and >= 0 (0: no check), "
                f"got {self.osworld_probe_timeout_s}"
            )
        if self.sleep_scale < 0:
            raise ValueError(f"RunnerConfig.sleep_scale must be >= 0, got {self.sleep_scale}")
        if (self.screen_width is None) != (self.screen_height is None):
            raise ValueError("RunnerConfig: set both screen_width and screen_height, or neither")
        if self.until_timeout_s <= 0 or self.until_poll_s < 0:
            raise ValueError("RunnerConfig: until_timeout_s must be > 0 and until_poll_s >= 0")
        if self.execute_max_failures < 1:
            raise ValueError("RunnerConfig.execute_max_failures must be >= 1")


@dataclass(frozen=True, slots=True)
class EvalResult:
    """The outcome of checking one episode."""

    task_id: str
    score: float
    """Checker score in [0, 1]; 0 whenever status is not "ok"."""
    status: str
    """"ok", "eval_error" (the checker could not run) or "env_error" (the environment failed)."""
    metric_scores: tuple[float | None, ...] = ()
    """Score of each metric; None for metrics not reached (short-circuit or error)."""
    error: str | None = None
    """What went wrong, for statuses other than "ok"."""
    seconds: float = 0.0
    """Wall time of the evaluation."""


def unsupported(task: Task, evaluator: str = "auto") -> list[str]:
    """What the runner cannot do for `task` with `evaluator` (see RunnerConfig.evaluator): step
    types, getters, metrics (and credentials, for OSWorld's). Empty when the task can run. With
    "auto", a task is reported only when neither side can run it; OSWorld's gaps are then
    prefixed "osworld: ". Whether OSWorld's environment is installed is not checked here."""
    if evaluator not in EVALUATORS:
        raise ValueError(f"evaluator must be one of {', '.join(EVALUATORS)}, got {evaluator!r}")
    if evaluator == "osworld":
        return osworld_unsupported(task)
    own = own_unsupported(task)
    if evaluator == "own" or not own:
        return own
    theirs = osworld_unsupported(task)
    return own + [f"osworld: {g}" for g in theirs] if theirs else []


def own_unsupported(task: Task) -> list[str]:
    """What this project's own steps, getters and metrics cannot do for `task`."""
    missing = []
    for phase, steps in (("config", task.config), ("postconfig", task.evaluator.postconfig)):
        missing += [f"{phase} step {s.type}" for s in steps if s.type not in STEP_TYPES]
    ev = task.evaluator
    if not ev.is_infeasible:
        missing += [f"metric {f}" for f in ev.funcs if f not in METRICS]
        for f, opts in zip(ev.funcs, ev.options, strict=True):
            if f != "compare_table":
                continue
            for rule in opts.get("rules", []):
                if rule.get("type") not in TABLE_RULES:
                    missing.append(f"compare_table rule {rule.get('type')}")
                elif rule["type"] == "check_cell":
                    missing += [
                        f"compare_table check_cell property {p}"
                        for p in rule.get("props", {})
                        if p not in TABLE_CELL_PROPS
                    ]
        for g in (*ev.result, *ev.expected):
            if g is not None and g.type not in GETTERS:
                missing.append(f"getter {g.type}")
    return sorted(set(missing))


class TaskRunner:
    """Sets up, drives and checks OSWorld tasks on one environment."""

    def __init__(
        self,
        client: EnvClient,
        config: RunnerConfig | None = None,
        osworld: OSWorldEvaluator | None = None,
        files: FileSource | None = None,
        *,
        probe_before_setup: bool = True,
        osworld_ports: Mapping[str, int] | None = None,
    ) -> None:
        """`osworld`: a pool of OSWorld evaluator workers to share between runners; by default
        each runner starts its own single worker when a task first needs it. `files`: where
        the files a task names by content (`sha256`, `arpo.env.taskfiles`) come from (an
        actor's: the learner); None: only from beside the task file, hash checked. Given by
        the environment's provider (`Environment`): `probe_before_setup`, whether to ask
        the server for `GET /platform` before OSWorld's setup (`_probe`; not after a
        desktop's `/reset` answered), and `osworld_ports`, a VM's forwarded Chrome / VLC
        ports for OSWorld's getters (none: OSWorld's defaults)."""
        self.client = client
        self.files = files
        self.config = config or RunnerConfig()
        self.probe_before_setup = probe_before_setup
        self.osworld_ports = dict(osworld_ports or {})
        self._own_osworld = osworld is None
        self.osworld = osworld or OSWorldEvaluator(
            EvaluatorConfig(
                python=self.config.osworld_python, request_timeout_s=self.config.osworld_timeout_s
            )
        )
        self.cache = FileCache(self.config.cache_dir)
        self.task: Task | None = None
        self.history: list[str] = []
        self._work_dir: Path | None = None
        self._task_dir: Path | None = None
        self._screen: tuple[int, int] | None = (
            (self.config.screen_width, self.config.screen_height)
            if self.config.screen_width is not None and self.config.screen_height is not None
            else None
        )

    # ---- episode lifecycle -------------------------------------------------------------------

    @property
    def work_dir(self) -> Path:
        """The current episode's scratch dir (downloaded results, captured command output)."""
        if self._work_dir is None:
            root = self.config.work_root
            if root is not None:
                Path(root).mkdir(parents=True, exist_ok=True)
            self._work_dir = Path(tempfile.mkdtemp(prefix="arpo-task-", dir=root))
        return self._work_dir

    def _clear_work_dir(self) -> None:
        if self._work_dir is not None:
            shutil.rmtree(self._work_dir, ignore_errors=True)
            self._work_dir = None

    def close(self) -> None:
        """Delete the current episode's work dir; kill this runner's own OSWorld worker."""
        self._clear_work_dir()
        if self._own_osworld:
            self.osworld.kill()

    async def aclose(self) -> None:
        """`close`, then wait for this runner's own OSWorld worker to exit."""
        self._clear_work_dir()
        if self._own_osworld:
            await self.osworld.aclose()

    def backend(self, task: Task) -> str:
        """ "own" or "osworld": whose code sets up and scores `task` (RunnerConfig.evaluator)."""
        if self.config.evaluator == "own":
            return "own"
        if self.config.evaluator == "osworld" or own_unsupported(task):
            return "osworld"
        return "own"

    def check(self, task: Task) -> None:
        """Raise TaskError when `task` cannot be set up here: a step type this project's code
        does not know, or (for OSWorld's code, `backend`) what OSWorld's evaluator lacks.
        Nothing is sent to the environment."""
        if self.backend(task) == "osworld":
            gaps = self._osworld_gaps(task)
            if gaps:
                own = own_unsupported(task) if self.config.evaluator == "auto" else []
                raise TaskError(
                    f"task {task.id}: cannot be set up here: "
                    + "; ".join([*own, *(f"OSWorld's evaluator: {g}" for g in gaps)])
                )
            return
        for phase, steps in (
            ("config", task.config),
            ("evaluator.postconfig", task.evaluator.postconfig),
        ):
            for i, step in enumerate(steps):
                if step.type not in STEP_TYPES:
                    raise TaskError(
                        f"task {task.id}: {phase}[{i}] has unknown step type {step.type!r} "
                        f"(parameters {dict(step.parameters)!r:.200}); supported: {', '.join(STEP_TYPES)}"
                    )

    async def setup(self, task: Task) -> None:
        """Start an episode of `task` on the environment as it is: check the task (`check`),
        run its `config` steps (or OSWorld's setup of it). Nothing is reverted here:
        `Environment.reset` reverts first, as OSWorld's reset reverts the VM's snapshot.

        Raises TaskError for an unknown step type (before any step runs) and EnvError when the
        environment fails.
        """
        self.check(task)
        self._start_episode(task)
        if self.backend(task) == "osworld":
            return await self._setup_osworld(task)
        await self.run_steps(task.config, task_id=task.id, phase="config")

    def adopt(self, task: Task, history: Sequence[str]) -> None:
        """Take over an episode of `task` set up elsewhere, with the actions run so far: a
        forked environment continues its parent's episode (no revert, no setup)."""
        self._start_episode(task)
        self.history = list(history)

    def _start_episode(self, task: Task) -> None:
        self._clear_work_dir()
        self.task = task
        self._task_dir = Path(task.path).parent if task.path else None
        self.history = []

    async def act(self, action: str) -> ExecResult | None:
        """Run one action: pyautogui code, or WAIT / DONE / FAIL. Returns /execute's reply for code."""
        if not isinstance(action, str):
            raise TypeError(
                f"an action is a string of pyautogui code or WAIT/DONE/FAIL, got {action!r}"
            )
        self.history.append(action)
        if action == "WAIT":
            await asyncio.sleep(self.config.wait_seconds)
            return None
        if action in ("DONE", "FAIL"):
            return None
        return await self.client.execute_pyautogui(action)

    async def between_actions(self) -> None:
        """The pause between two actions of one response (`RunnerConfig.action_pause_s` times
        `sleep_scale`)."""
        if pause := self.config.action_pause_s * self.config.sleep_scale:
            await asyncio.sleep(pause)

    async def run(self, task: Task, actions: Sequence[str]) -> EvalResult:
        """Set up `task` (no revert: `Environment.run` reverts first), play `actions` (stopping
        at DONE / FAIL), evaluate; env failures become an `env_error` result. TaskError (a bad
        task) is raised."""
        t0 = time.perf_counter()
        try:
            await self.setup(task)
            for a in actions:
                await self.act(a)
                if a in ("DONE", "FAIL"):
                    break
        except EnvError as e:
            return EvalResult(
                task.id,
                0.0,
                "env_error",
                error=f"{type(e).__name__}: {e}",
                seconds=time.perf_counter() - t0,
            )
        return await self.evaluate()

    # ---- steps -------------------------------------------------------------------------------

    async def run_steps(
        self, steps: Sequence[Step], *, task_id: str = "", phase: str = "config"
    ) -> None:
        for i, step in enumerate(steps):
            handler = getattr(self, f"_step_{step.type}", None)
            if step.type not in STEP_TYPES or handler is None:
                raise TaskError(
                    f"task {task_id}: {phase}[{i}] has unknown step type {step.type!r}; "
                    f"supported: {', '.join(STEP_TYPES)}"
                )
            params = dict(step.parameters)
            try:
                inspect.signature(handler).bind(**params)
            except TypeError as e:
                raise TaskError(
                    f"task {task_id}: {phase}[{i}] ({step.type}) has bad parameters "
                    f"{params!r:.200}: {e}"
                ) from e
            await handler(**params)

    async def screen_size(self) -> tuple[int, int]:
        if self._screen is None:
            self._screen = await self.client.screen_size()
        return self._screen

    async def substitute(self, command: list[str] | str) -> list[str] | str:
        """Fill OSWorld's placeholders: {CLIENT_PASSWORD}, {SCREEN_WIDTH}, {SCREEN_HEIGHT},
        {SCREEN_WIDTH_HALF}, {SCREEN_HEIGHT_HALF} (the screen size is asked for only if needed)."""
        items = [command] if isinstance(command, str) else list(command)
        if any("{SCREEN_" in s for s in items):
            w, h = await self.screen_size()
        else:
            w, h = 0, 0
        table = {
            "{CLIENT_PASSWORD}": self.config.client_password,
            "{SCREEN_WIDTH_HALF}": str(w // 2),
            "{SCREEN_HEIGHT_HALF}": str(h // 2),
            "{SCREEN_WIDTH}": str(w),
            "{SCREEN_HEIGHT}": str(h),
        }
        out = []
        for s in items:
            for key, value in table.items():
                s = s.replace(key, value)
            out.append(s)
        return out[0] if isinstance(command, str) else out

    async def _step_download(self, files: list[Mapping[str, str]]) -> None:
        for f in files:
            url, path = f.get("url"), f.get("path")
            if not url or not path:
                raise TaskError(f"download step needs 'url' and 'path', got {dict(f)!r}")
            src = self.cache.lookup(url, PurePosixPath(path).name)
            data = await asyncio.to_thread(src.read_bytes)
            await self.client.upload(path, data)

    def upload_source(self, local_path: str) -> Path:
        """The host file an `upload_file` step sends, named by `local_path` relative to the
        task file's folder, and read only from there: never the working directory (OSWorld
        reads relative paths from it, which handed any file under the actor's working
        directory to the desktop), never an absolute path, no `..`, no symbolic link that
        leads out. TaskError for a refused path, or for a task without a folder (not read
        from a file; such a task names its files by content, `upload_path`);
        FileCacheMiss when the file is not there."""
        rel = PurePosixPath(str(local_path))
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise TaskError(
                f"upload_file step: local_path {local_path!r} must be a relative path inside "
                "the task file's folder (no absolute path, no '..')"
            )
        base = self._task_dir
        if base is None:
            raise TaskError(
                f"upload_file step: local_path {local_path!r}: the task was not read from a "
                "file, so there is no folder to read it from; such a task names its files by "
                "content ('sha256' and 'size', arpo.env.taskfiles) and the runner fetches them "
                "from its file source (TaskRunner(files=...))"
            )
        root = base.resolve()
        cand = (root / rel).resolve()
        if not cand.is_relative_to(root):
            raise TaskError(
                f"upload_file step: local_path {local_path!r} leads out of {base} (a symbolic "
                "link); refused"
            )
        if not cand.is_file():
            raise FileCacheMiss(
                f"upload_file step: local file {local_path} is not in the task file's folder {base}"
            )
        return cand

    async def upload_path(self, entry: Mapping[str, Any]) -> Path:
        """The local file an `upload_file` entry sends: by content when it names its
        `sha256` (fetched and checked by `files`, or beside the task file with the same
        hash), else `upload_source(local_path)`."""
        ref = FileRef.of(entry)
        if ref is None:
            return self.upload_source(str(entry.get("local_path", "")))
        if self.files is not None:
            return await self.files.path(ref)
        try:
            local = self.upload_source(str(entry.get("local_path", "")))
        except FileCacheMiss:
            raise TaskError(
                f"upload_file: the task names {entry.get('local_path')!r} by content "
                f"(sha256 {ref.sha256[:12]}...), and this runner has no file source to fetch "
                "it from (TaskRunner(files=...)) nor the file beside the task"
            ) from None
        got, size = await asyncio.to_thread(sha256_file, local)
        if got != ref.sha256 or size != ref.size:
            raise BlobMismatch(
                f"upload_file: {local} is not the file the task names (sha256 "
                f"{ref.sha256[:12]}..., {ref.size} bytes; the file has {got[:12]}..., {size})"
            )
        return local

    async def _step_upload_file(self, files: list[Mapping[str, Any]]) -> None:
        for f in files:
            local = await self.upload_path(f)
            await self.client.upload(f["path"], await asyncio.to_thread(local.read_bytes))

    async def _step_open(self, path: str) -> None:
        await self.client.open_file(path)

    async def _step_launch(self, command: list[str] | str, shell: bool = False) -> None:
        if not shell and isinstance(command, str) and len(command.split()) > 1:
            command = command.split()
        try:
            await self.client.launch(command, shell=shell)
        except EnvHTTPError as e:  # OSWorld logs a failed launch and goes on
            log.warning("launch %r failed: %s", command, e)

    async def _step_execute(
        self,
        command: list[str] | str,
        stdout: str = "",
        stderr: str = "",
        shell: bool = False,
        until: Mapping[str, Any] | None = None,
    ) -> None:
        cmd = await self.substitute(command)
        until = dict(until or {})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.until_timeout_s
        failures: list[EnvHTTPError] = []
        while True:
            res: ExecResult | None = None
            try:
                res = await self.client.execute(cmd, shell=shell, setup=True)
            except EnvHTTPError as e:  # OSWorld retries a failed setup command a few times
                failures.append(e)
            if res is not None:
                if stdout:
                    (self.work_dir / PurePosixPath(stdout).name).write_text(res.output)
                if stderr:
                    (self.work_dir / PurePosixPath(stderr).name).write_text(res.error)
                if not until or _until_met(until, res):
                    return
            elif len(failures) >= self.config.execute_max_failures:
                raise failures[-1]
            if loop.time() >= deadline:
                raise EnvTimeout(
                    f"execute step {cmd!r:.200}: condition {until} not met within "
                    f"{self.config.until_timeout_s} s"
                )
            await asyncio.sleep(self.config.until_poll_s)

    async def _step_command(self, command: list[str] | str, **kwargs: Any) -> None:
        await self._step_execute(command, **kwargs)

    async def _step_sleep(self, seconds: float) -> None:
        await asyncio.sleep(float(seconds) * self.config.sleep_scale)

    async def _step_activate_window(
        self, window_name: str, strict: bool = False, by_class: bool = False
    ) -> None:
        try:
            await self.client.activate_window(window_name, strict=strict, by_class=by_class)
        except EnvHTTPError as e:  # OSWorld logs it and goes on (the window may be gone)
            log.info("activate_window %r failed: %s", window_name, e)

    async def _step_close_window(
        self, window_name: str, strict: bool = False, by_class: bool = False
    ) -> None:
        try:
            await self.client.close_window(window_name, strict=strict, by_class=by_class)
        except EnvHTTPError as e:
            log.info("close_window %r failed: %s", window_name, e)

    async def _step_sim_scene(self, **params: Any) -> None:
        if not isinstance(params.get("family"), str):
            raise TaskError(f"sim_scene step needs a string 'family', got {params!r:.200}")
        try:
            await self.client.sim_scene(params)
        except EnvHTTPError as e:
            if 400 <= e.status < 500:  # the task's scene is wrong
                raise TaskError(f"sim_scene {params!r:.200} refused: {e}") from e
            raise

    # ---- evaluation --------------------------------------------------------------------------

    async def evaluate(
        self, task: Task | None = None, actions: Sequence[str] | None = None
    ) -> EvalResult:
        """Check the episode (default: the task of the last `setup` and the actions since)."""
        task = task or self.task
        if task is None:
            raise RuntimeError("evaluate() before setup(): no task to check")
        history = list(self.history if actions is None else actions)
        t0 = time.perf_counter()

        def done(
            score: float, status: str, scores: Sequence[float | None], error: str | None = None
        ) -> EvalResult:
            return EvalResult(
                task.id, score, status, tuple(scores), error, time.perf_counter() - t0
            )

        ev = task.evaluator
        n = len(ev.funcs)
        self._task_dir = Path(task.path).parent if task.path else None
        if self.backend(task) == "osworld":
            status, score, error = await self._evaluate_osworld(task, history)
            scores = [score if status == "ok" and n == 1 else None] * n
            return done(score if status == "ok" else 0.0, status, scores, error)
        try:
            await self.run_steps(ev.postconfig, task_id=task.id, phase="evaluator.postconfig")
        except EnvError as e:
            return done(0.0, "env_error", [None] * n, f"postconfig: {type(e).__name__}: {e}")

        last_fail = bool(history) and history[-1] == "FAIL"
        if ev.is_infeasible:
            return done(float(last_fail), "ok", [float(last_fail)])
        if last_fail:
            return done(0.0, "ok", [None] * n)

        ctx = GetterContext(self.client, self.cache, self.work_dir)
        scores: list[float | None] = [None] * n
        for i, name in enumerate(ev.funcs):
            fn = METRICS.get(name)
            if fn is None:
                return done(0.0, "eval_error", scores, f"metric {name!r} is not implemented")
            try:
                result = await self._get(ctx, ev.result[i])
                expected_spec = ev.expected[i] if ev.has_expected else None
                args = [result]
                if expected_spec is not None:
                    args.append(await self._get(ctx, expected_spec))
                value = await asyncio.to_thread(fn, *args, **dict(ev.options[i]))
                score = float(value)
            except EnvError as e:
                return done(
                    0.0, "env_error", scores, f"metric {i} ({name}): {type(e).__name__}: {e}"
                )
            except Exception as e:
                log.exception("task %s: metric %d (%s) could not run", task.id, i, name)
                return done(
                    0.0, "eval_error", scores, f"metric {i} ({name}): {type(e).__name__}: {e}"
                )
            scores[i] = score
            if ev.conj == "and" and score == 0.0:
                return done(0.0, "ok", scores)
            if ev.conj == "or" and score == 1.0:
                return done(1.0, "ok", scores)
        got = [s for s in scores if s is not None]
        total = sum(got) / len(got) if ev.conj == "and" else max(got)
        return done(total, "ok", scores)

    # ---- OSWorld's evaluator ------------------------------------------------------------------

    def _osworld_gaps(self, task: Task) -> list[str]:
        gaps = osworld_unsupported(task)
        if not self.osworld.available:
            gaps.append(self.osworld.missing_reason())
        if task.raw is None:
            gaps.append("the task has no JSON to hand to OSWorld's code (built without from_dict)")
        if "/" in task.id or task.id in (".", ".."):
            gaps.append(f"task id {task.id!r} is not a directory name (OSWorld's cache key)")
        return gaps

    async def _setup_osworld(self, task: Task) -> None:
        """OSWorld's setup of `task` (checked, its episode started: `setup`)."""
        if self.probe_before_setup:
            await self._probe()
        raw = await self._osworld_task(task, task.config)
        try:
            await self.osworld.setup(
                await self._osworld_env(raw),
                raw,
                self._osworld_cache_base(),
                timeout_s=self.config.osworld_timeout_s,
            )
        except OSWorldError as e:
            if e.kind == "request":
                raise TaskError(f"task {task.id}: OSWorld's setup refused it: {e}") from e
            raise EnvError(f"task {task.id}: OSWorld's setup failed ({e.kind}): {e}") from e

    async def _evaluate_osworld(
        self, task: Task, history: list[str]
    ) -> tuple[str, float, str | None]:
        """(status, score, error) of OSWorld's `DesktopEnv.evaluate` through the worker."""
        gaps = self._osworld_gaps(task)
        if gaps:
            return "eval_error", 0.0, "OSWorld's evaluator: " + "; ".join(gaps)
        try:
            await self._probe()
            raw = await self._osworld_task(task, task.evaluator.postconfig, getters=True)
            score = await self.osworld.evaluate(
                await self._osworld_env(raw),
                raw,
                self._osworld_cache_base(),
                history,
                timeout_s=self.config.osworld_timeout_s,
            )
        except EnvError as e:
            return "env_error", 0.0, f"{type(e).__name__}: {e}"
        except TaskError as e:  # a path of the task is refused (see upload_source)
            return "eval_error", 0.0, str(e)
        except OSWorldError as e:
            status = "env_error" if e.kind == "env" else "eval_error"
            return status, 0.0, f"OSWorld's evaluator ({e.kind}): {e}"
        if not 0.0 <= score <= 1.0:
            return "eval_error", 0.0, f"OSWorld's evaluator gave {score}, outside [0, 1]"
        return "ok", score, None

    async def _probe(self) -> None:
        """Raise EnvError unless the environment answers `GET /platform` within
        `osworld_probe_timeout_s`. OSWorld's setup controller, which `DesktopEnv.evaluate`
        also runs, retries an unreachable server 20 times 5 s apart and then goes on, so its
        getters see nothing and a metric can score 0; this check makes that an env_error."""
        limit = self.config.osworld_probe_timeout_s
        if limit == 0:
            return
        try:
            async with asyncio.timeout(limit):
                await self.client.platform(timeout=limit)
        except TimeoutError:
            raise EnvTimeout(
                f"the environment at {self.client.config.base_url} did not answer GET /platform "
                f"within {limit:g} s (RunnerConfig.osworld_probe_timeout_s)"
            ) from None
        except EnvHTTPError:
            return  # it answered: an old server without /platform is still reachable

    def _osworld_cache_base(self) -> Path:
        """OSWorld's cache_dir_base for this episode; its cache dir is `<base>/<task id>`."""
        return self.work_dir / "osworld"

    async def _osworld_env(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        if self._screen is None and "{SCREEN_" in json.dumps(raw):
            await self.screen_size()
        w, h = self._screen or (1920, 1080)  # OSWorld's default screen
        return {
            "url": self.client.config.base_url,
            "token": self.client.config.token,
            "screen": [w, h],
            "client_password": self.config.client_password,
            # a fleet VM's forwarded Chrome / VLC ports (OSWorld's defaults otherwise)
            **self.osworld_ports,
        }

    async def _osworld_task(
        self, task: Task, steps: Sequence[Step], *, getters: bool = False
    ) -> dict[str, Any]:
        """The task's JSON for OSWorld's code, with the files it would download from the
        network put into its cache dir from the local file cache, and `upload_file` paths made
        absolute the way this runner resolves them."""
        assert task.raw is not None
        raw = copy.deepcopy(dict(task.raw))
        cache = self._osworld_cache_base() / task.id
        cache.mkdir(parents=True, exist_ok=True)
        wanted: list[tuple[str, str, str]] = []  # (url, OSWorld's cache file name, file name)
        for step in steps:
            if step.type == "download":
                for f in step.parameters.get("files", []):
                    url, path = str(f.get("url", "")), str(f.get("path", ""))
                    name = Path(path).name
                    wanted.append((url, cache_name(url, name), name))
        if getters:
            ev = task.evaluator
            for spec in (*ev.result, *ev.expected):
                if spec is None or spec.type != "cloud_file":
                    continue
                multi = spec.params.get("multi", False)
                urls = spec.params["path"] if multi else [spec.params["path"]]
                dests = spec.params["dest"] if multi else [spec.params["dest"]]
                names = [Path(str(d)).name for d in dests]
                wanted += [(str(u), n, n) for u, n in zip(urls, names, strict=False)]
        for url, their_name, name in wanted:
            target = cache / their_name
            if not url or not name or target.exists():
                continue
            if self.cache.root is None:
                continue  # no local cache: OSWorld's code downloads it, as on a networked host
            src = self.cache.lookup(url, name)
            await asyncio.to_thread(shutil.copyfile, src, target)
        for phase in (
            raw.get("config") or [],
            (raw.get("evaluator") or {}).get("postconfig") or [],
        ):
            for step in phase:
                if isinstance(step, dict) and step.get("type") == "upload_file":
                    for f in (step.get("parameters") or {}).get("files", []):
                        f["local_path"] = str(await self.upload_path(f))
        if getters:
            _check_getter_dests(task)
        return raw

    async def _get(self, ctx: GetterContext, spec: Any) -> Any:
        if spec is None:
            return None
        fn = GETTERS.get(spec.type)
        if fn is None:
            raise NotImplementedError(f"getter {spec.type!r} is not implemented")
        return await fn(ctx, spec.params)


def _check_getter_dests(task: Task) -> None:
    """OSWorld's getters write what they fetch to `<cache dir>/<dest>`: a `dest` must be a
    plain file name, or the task could write any host path (TaskError otherwise)."""
    ev = task.evaluator
    for spec in (*ev.result, *ev.expected):
        if spec is None:
            continue
        dest = spec.params.get("dest")
        for d in dest if isinstance(dest, list) else [dest] if dest is not None else []:
            name = str(d)
            if not name or name in (".", "..") or PurePosixPath(name).name != name or "\\" in name:
                raise TaskError(
                    f"task {task.id}: getter {spec.type} has dest {name!r}; a dest must be a "
                    "plain file name (it is written into the episode's cache folder)"
                )


def _until_met(until: Mapping[str, Any], res: ExecResult) -> bool:
    """OSWorld's `until`: returncode equals, or `stdout` / `stderr` text appears in the output."""
    return (
        ("returncode" in until and res.returncode == until["returncode"])
        or ("stdout" in until and str(until["stdout"]) in res.output)
        or ("stderr" in until and str(until["stderr"]) in res.error)
    )

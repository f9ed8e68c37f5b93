"""The project's side of OSWorld's evaluator: worker processes, bounded and restarted.

`OSWorldEvaluator` runs OSWorld's own setup controller, getters and metrics (`worker.py`, in the
evaluator environment `make osworld-evaluator` creates) for the task runner, never blocking the
event loop: each worker is an asyncio subprocess spoken to in JSON lines, one request at a time,
and every request has a timeout.

    evaluator = OSWorldEvaluator(EvaluatorConfig(workers=2))
    await evaluator.setup(env, task_json, cache_dir)                  # the task's config steps
    score = await evaluator.evaluate(env, task_json, cache_dir, actions)
    score = await evaluator.metric("compare_table", [result, expected], {"rules": [...]})
    await evaluator.aclose()

A worker that hangs past its timeout, dies, writes something that is not a reply (a line longer
than MAX_REPLY_BYTES among them) or answers with a score that is not a number in [0, 1] is
killed (its whole process group: OSWorld's getters may start a browser driver) and a fresh one
starts for the next request. Every failure raises `OSWorldError` with `kind` saying whose it was:
"env" (the environment could not be reached), "eval" (OSWorld's code raised), "request" (the
request was malformed) or "worker" (the worker itself failed, hung or is not installed). The
runner turns them into `env_error` / `eval_error` results, never a score.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arpo.errors import EvalError

log = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("worker.py")
"""The worker program (runs under the evaluator environment's python)."""
REPO_VENV = Path(__file__).resolve().parents[3] / ".venv-osworld"
"""Where `make osworld-evaluator` puts the evaluator environment."""
PYTHON_ENV_VAR = "ARPO_OSWORLD_PYTHON"
"""Names the evaluator environment's python when it is not the repository's `.venv-osworld`."""
KINDS = ("env", "eval", "request", "worker")
MAX_REPLY_BYTES = 1 << 20
"""Longest reply line read from a worker; a longer one is a protocol error (worker replaced).
The longest a worker writes is a failure (its error and traceback cut to 12,000 characters,
at most 12 bytes each once JSON-escaped) or `hello`'s names (about 10 KB)."""
MAX_ERROR_CHARS = 4000
"""What is kept of the error a worker reports (`OSWorldError`'s message)."""
STDERR_TAIL_BYTES = 16 << 10
"""What is kept of a worker's stderr for error messages (it is drained continuously)."""
MARKER_ENV = "ARPO_OSWORLD_WORKER"
"""Set to a per-worker token in the worker's environment (its children inherit it): a kill
also finds the descendants that left its session."""


def _marked(marker: str) -> list[int]:
    """Pids of this user's processes whose environment holds MARKER_ENV=marker."""
    needle = f"{MARKER_ENV}={marker}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                out.append(int(d.name))
        except OSError:
            continue
    return out


class OSWorldError(EvalError):
    """OSWorld's evaluator could not give a score; `kind` is one of KINDS."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def find_python(python: str | Path | None = None) -> Path | None:
    """The evaluator environment's python: `python` if given, else $ARPO_OSWORLD_PYTHON, else the
    repository's `.venv-osworld/bin/python`; None when none of them exists."""
    for cand in (python, os.environ.get(PYTHON_ENV_VAR), REPO_VENV / "bin" / "python"):
        if cand and Path(cand).is_file():
            return Path(cand)
        if python is not None:
            return None  # an explicit path that does not exist is not replaced by another
    return None


@dataclass(frozen=True, slots=True)
class EvaluatorConfig:
    """How OSWorld's evaluator workers are run."""

    python: str | Path | None = None
    """The evaluator environment's python; None finds it (see `find_python`)."""
    workers: int = 1
    """Worker processes at most; each serves one request at a time (about 300 MB each)."""
    start_timeout_s: float = 120.0
    """A worker must import OSWorld's modules and answer `hello` within this (about 3 s here)."""
    request_timeout_s: float = 600.0
    """Bound on one setup / evaluate / metric request; the worker is then killed."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"EvaluatorConfig.workers must be >= 1, got {self.workers}")
        for name in ("start_timeout_s", "request_timeout_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"EvaluatorConfig.{name} must be a finite number > 0, got {v}")


class _Worker:
    """One worker process; requests are serialised by the pool."""

    def __init__(self, python: Path, start_timeout_s: float) -> None:
        self.python = python
        self.start_timeout_s = start_timeout_s
        self.proc: asyncio.subprocess.Process | None = None
        self.names: dict[str, Any] = {}
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=40)
        self.marker = os.urandom(16).hex()
        self._drain: asyncio.Task[None] | None = None
        self._killed = False
        self._cwd = tempfile.mkdtemp(prefix="arpo-osworld-worker-")
        self.started_s = 0.0
        """Seconds the last start took (spawn + import + hello)."""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and not self._killed

    async def start(self) -> None:
        t0 = time.perf_counter()
        # Its own session: a kill takes the worker's children (browser drivers) with it. The
        # working directory is a scratch one, so OSWorld's relative paths and .env lookups
        # find nothing of the project's.
        self.proc = await asyncio.create_subprocess_exec(
            str(self.python),
            str(WORKER),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=self._cwd,
            start_new_session=True,
            limit=MAX_REPLY_BYTES,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore",
                 MARKER_ENV: self.marker},
        )  # fmt: skip
        self._drain = asyncio.create_task(self._drain_stderr(self.proc))
        result = await self.request({"op": "hello"}, self.start_timeout_s, what="start-up")
        try:
            self.names = _names(result)
        except OSWorldError:
            self.kill()
            raise
        self.started_s = time.perf_counter() - t0
        log.info(
            "OSWorld worker %d up in %.1f s (%s %s)",
            self.proc.pid,
            self.started_s,
            self.names.get("package"),
            self.names.get("version"),
        )

    async def _drain_stderr(self, proc: asyncio.subprocess.Process) -> None:
        """Read stderr as it comes, in chunks (a flood or a line without end never blocks the
        worker or raises here); the last lines are kept, bounded, for error messages."""
        assert proc.stderr is not None
        pending = b""
        with contextlib.suppress(Exception):
            while chunk := await proc.stderr.read(65536):
                pending = (pending + chunk)[-STDERR_TAIL_BYTES:]
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    text = line.decode("utf-8", "replace").rstrip()[:500]
                    self.stderr_tail.append(text)
                    log.debug("osworld worker %d: %s", proc.pid, text)

    def _tail(self) -> str:
        lines = [ln for ln in self.stderr_tail if ln.strip()][-5:]
        return (" | stderr: " + " / ".join(lines))[:1500] if lines else ""

    async def request(self, msg: dict[str, Any], timeout_s: float, what: str = "") -> Any:
        if not self.alive:
            raise OSWorldError("worker", "OSWorld worker is not running")
        proc = self.proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        # A fresh random id per request: a reply nobody asked for cannot match the next one.
        rid = os.urandom(12).hex()
        line = json.dumps({**msg, "id": rid}, allow_nan=False) + "\n"
        what = what or _describe(msg)
        try:
            async with asyncio.timeout(timeout_s):
                proc.stdin.write(line.encode())
                await proc.stdin.drain()
                raw = await proc.stdout.readline()
        except (ValueError, asyncio.LimitOverrunError):  # a line longer than MAX_REPLY_BYTES
            self.kill()
            raise OSWorldError(
                "worker",
                f"OSWorld worker's reply to {what} is longer than {MAX_REPLY_BYTES} bytes; killed",
            ) from None
        except TimeoutError:
            self.kill()
            raise OSWorldError(
                "worker", f"OSWorld worker gave no answer to {what} within {timeout_s:g} s; killed"
            ) from None
        except (ConnectionError, BrokenPipeError) as e:
            self.kill()
            raise OSWorldError("worker", f"OSWorld worker pipe broke during {what}: {e}") from e
        if not raw:
            code = await self._reap()
            raise OSWorldError(
                "worker", f"OSWorld worker died during {what} (exit code {code}){self._tail()}"
            )
        try:
            reply = json.loads(raw)
            if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
                raise TypeError("not a reply object")
            got_id = reply["id"]
        except (ValueError, KeyError, TypeError, RecursionError):
            self.kill()
            raise OSWorldError(
                "worker", f"OSWorld worker wrote {raw[:200]!r} instead of a reply to {what}; killed"
            ) from None
        if got_id != rid:
            self.kill()
            raise OSWorldError(
                "worker",
                f"OSWorld worker answered request {got_id!r:.40}, not {what} ({rid}): a reply "
                "nobody asked for; killed",
            )
        ok = reply["ok"]
        if not ok:
            kind = reply.get("kind") if reply.get("kind") in KINDS else "eval"
            raise OSWorldError(kind, str(reply.get("error", "unknown error"))[:MAX_ERROR_CHARS])
        return reply.get("result")

    async def _reap(self) -> int | None:
        if self.proc is None:
            return None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                return await self.proc.wait()
        self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the worker's process group and every process that carries its marker (a
        descendant that started its own session); no waiting, the loop reaps the worker."""
        self._killed = True
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in _marked(self.marker):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    async def aclose(self) -> None:
        self.kill()
        if self.proc is not None:
            with contextlib.suppress(TimeoutError, ProcessLookupError):
                async with asyncio.timeout(10):
                    await self.proc.wait()
        if self._drain is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                async with asyncio.timeout(5):
                    await self._drain
        self.proc = None
        shutil.rmtree(self._cwd, ignore_errors=True)


class OSWorldEvaluator:
    """A bounded pool of OSWorld evaluator workers, started on first use.

    One pool can serve many task runners of one event loop (an actor shares one between its
    environments): at most `workers` requests run at once, one per worker process; a request
    waits for a free worker first, and its timeout counts from when a worker takes it.
    """

    def __init__(self, config: EvaluatorConfig | None = None) -> None:
        self.config = config or EvaluatorConfig()
        self.python = find_python(self.config.python)
        self._idle: list[_Worker] = []
        self._all: list[_Worker] = []
        self._slots = asyncio.Semaphore(self.config.workers)
        self.requests = 0
        self.restarts = 0
        self.starts = 0
        """Worker processes started so far (first starts and replacements)."""

    @property
    def available(self) -> bool:
        """Whether the evaluator environment is installed."""
        return self.python is not None

    def missing_reason(self) -> str:
        where = self.config.python or f"${PYTHON_ENV_VAR} or {REPO_VENV}"
        return (
            f"OSWorld's evaluator environment is not installed ({where} has no python); "
            "run `make osworld-evaluator`"
        )

    async def call(
        self,
        msg: dict[str, Any],
        timeout_s: float | None = None,
        check: Callable[[Any], Any] | None = None,
    ) -> Any:
        """Send one request to a free worker (starting one if needed) and return its result,
        or `check(result)` when given: an `OSWorldError` it raises kills the worker (a worker
        that breaks the protocol serves nothing more)."""
        if self.python is None:
            raise OSWorldError("worker", self.missing_reason())
        timeout = self.config.request_timeout_s if timeout_s is None else timeout_s
        async with self._slots:
            worker = self._idle.pop() if self._idle else None
            if worker is None or not worker.alive:
                if worker is not None:
                    self.restarts += 1
                    self._all.remove(worker)
                    await worker.aclose()
                worker = _Worker(self.python, self.config.start_timeout_s)
                self._all.append(worker)
                self.starts += 1
                try:
                    await worker.start()
                except BaseException:
                    self._all.remove(worker)
                    await worker.aclose()
                    raise
            try:
                self.requests += 1
                result = await worker.request(msg, timeout)
                if check is None:
                    return result
                try:
                    return check(result)
                except OSWorldError:
                    worker.kill()
                    raise
            finally:
                self._idle.append(worker)  # a dead one is replaced on its next turn

    async def hello(self) -> dict[str, Any]:
        """The installed package's version and the names it has (steps, getters, metrics)."""
        return await self.call({"op": "hello"}, check=_names)

    async def setup(
        self, env: dict[str, Any], task: dict[str, Any], cache_dir: str | Path, **kw: Any
    ) -> None:
        """Run the task's `config` steps with OSWorld's SetupController against `env`."""
        await self.call(
            {"op": "setup", "env": env, "task": task, "cache_dir": str(cache_dir)}, **kw
        )

    async def evaluate(
        self,
        env: dict[str, Any],
        task: dict[str, Any],
        cache_dir: str | Path,
        actions: list[str],
        **kw: Any,
    ) -> float:
        """OSWorld's `DesktopEnv.evaluate` for the task after `actions`: its score."""
        msg = {
            "op": "evaluate",
            "env": env,
            "task": task,
            "cache_dir": str(cache_dir),
            "actions": list(actions),
        }
        return await self.call(msg, check=_score, **kw)

    async def metric(
        self, func: str, args: list[Any], options: dict[str, Any] | None = None, **kw: Any
    ) -> float:
        """One of OSWorld's metrics applied to `args` (file paths, strings, rules) as is."""
        msg = {"op": "metric", "func": func, "args": list(args), "options": dict(options or {})}
        return await self.call(msg, check=_score, **kw)

    def kill(self) -> None:
        """Kill every worker now (sync; for a runner closed outside a coroutine)."""
        for w in self._all:
            w.kill()

    async def aclose(self) -> None:
        """Stop every worker and wait for them."""
        workers, self._all, self._idle = self._all, [], []
        for w in workers:
            await w.aclose()

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._all if w.proc is not None and w.alive]


def _describe(msg: dict[str, Any]) -> str:
    """The request as an error message names it: its op and, when it has one, the task id."""
    task = msg.get("task")
    tid = task.get("id") if isinstance(task, dict) else None
    return f"{msg.get('op')} of task {tid}" if tid else f"{msg.get('op')} request"


def _names(result: Any) -> dict[str, Any]:
    """The result of `hello`: an object."""
    if not isinstance(result, dict):
        raise OSWorldError("worker", f"OSWorld worker answered hello with {result!r:.200}")
    return result


def _score(result: Any) -> float:
    """The score of an evaluate / metric result `{"score": x}`: x a JSON number in [0, 1].

    OSWorld's metrics return floats and ints 0 / 1, and the worker refuses anything else
    with an "eval" failure, so a bool, a string, NaN, an infinity, a number outside
    [0, 1] or an integer too large for a float here is a worker that broke the protocol
    (the caller kills it). An integer is compared as it is, never converted first.
    """
    score = result.get("score") if isinstance(result, dict) else None
    if isinstance(score, bool) or not isinstance(score, int | float):
        raise OSWorldError(
            "worker", f"OSWorld worker returned {result!r:.200}, not a score (a number in [0, 1])"
        )
    if not 0 <= score <= 1:  # NaN fails this too
        raise OSWorldError(
            "worker", f"OSWorld worker returned the score {score!s:.40}, not a number in [0, 1]"
        )
    return float(score)

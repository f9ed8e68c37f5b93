"""Running what /execute is sent: pyautogui code in a warm executor process, anything else
as a subprocess.

OSWorld's host controller sends every action as `["python", "-c", "import pyautogui; ...
<code>"]` and reads what it printed. A new interpreter per action costs ~290 ms here
(importing pyautogui and Xlib); a fork of a process that has them imported, ~3.5 ms
per action all told (`forkserver`; benchmarks/results/execute-2026-11-24.md). The program then runs in a process of its own, as a subprocess
would: it cannot reach the server (no shared memory, interpreter or GIL), its exit code,
output and traceback are the ones `python -c` gives, and a timeout kills its process
group. `WarmExecutor` is the server's side of it.

Only code that would run the same in a fork as in a fresh interpreter takes that path:
it must parse, import pyautogui, import nothing outside `INPROCESS_MODULES` and call
none of `open`, `exec`, `eval`, `compile`, `__import__`, `input`, `globals`, `locals`,
`vars`, `setattr`, `delattr`, `getattr` (the warm process has more modules loaded than
a fresh interpreter, which such code could notice). Everything else runs as a real
subprocess in its own session, killed with its group on timeout.

The captured output of either path is capped at MAX_OUTPUT_BYTES per stream, and the
two streams together at MAX_ANSWER_BYTES (32 MiB) of JSON text (`fit_answer`): a NUL byte is six
bytes once escaped, so 16 MiB of them on each stream made a 201 MB answer.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass

from arpo_envs.desktop.forkserver import EXITED, HEADER, REPLY, STARTED
from arpo_envs.desktop.user import DesktopUser
from arpo_envs.procs import disown, own, process_table, set_parent_death_signal

INPROCESS_MODULES = frozenset(
    {"pyautogui", "time", "platform", "math", "random", "string", "re", "json"}
)
_REFUSED_NAMES = frozenset(
    {
        "open",
        "exec",
        "eval",
        "compile",
        "__import__",
        "input",
        "globals",
        "locals",
        "vars",
        "setattr",
        "delattr",
        "getattr",
        "breakpoint",
    }
)
PYTHON_NAMES = frozenset({"python", "python3", f"python3.{sys.version_info.minor}"})


@dataclass(frozen=True, slots=True)
class CommandResult:
    output: str
    error: str
    returncode: int | None
    timed_out: bool = False
    in_process: bool = False


# ---- what to run and where --------------------------------------------------------------------


def normalize(command: str | list[str], shell: bool, home: str) -> str | list[str]:
    """OSWorld's rules: a string without shell is split like a shell would; `~/` args expand."""
    if isinstance(command, str) and not shell:
        command = shlex.split(command)
    if isinstance(command, list):
        command = [home + a[1:] if a.startswith("~/") else a for a in command]
    return command


def inprocess_code(command: str | list[str], shell: bool) -> str | None:
    """The code of a `python -c <code>` command that may run in this process, else None."""
    if shell or not isinstance(command, list) or len(command) != 3 or command[1] != "-c":
        return None
    if os.path.basename(command[0]) not in PYTHON_NAMES:
        return None
    code = command[2]
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None  # a subprocess reports the syntax error exactly as Python does
    imports_pyautogui = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            roots = [(node.module or "").split(".")[0]] if node.level == 0 else [""]
        elif (isinstance(node, ast.Name) and node.id in _REFUSED_NAMES) or (
            isinstance(node, ast.Attribute) and node.attr.startswith("__")
        ):
            return None
        else:
            continue
        if any(r not in INPROCESS_MODULES for r in roots):
            return None
        imports_pyautogui |= "pyautogui" in roots
    return code if imports_pyautogui else None


# ---- the warm executor -----------------------------------------------------------------------


class WarmExecutor:
    """Runs `python -c` pyautogui code of one desktop in forks of a warm process (`forkserver`).

    One program at a time. A program that outlives its timeout is killed with its process
    group; the warm process is replaced when it dies or stops answering. Nothing a program
    does reaches the server: it shares no memory, no interpreter and no GIL with it.

    The warm process's reports (ready, a child gone) are read by a callback of the event
    loop as they come, so none is lost and its death (end of the socket) is seen at once.
    """

    START_TIMEOUT_S = 60.0
    """Longest wait for a (re)started warm process to import pyautogui and say it is ready."""

    def __init__(
        self,
        env: dict[str, str],
        cwd: str,
        pause_s: float,
        log_path: str,
        user: DesktopUser | None = None,
    ):
        self.env = env
        self.user = user
        """Whom the warm process and its programs run as (None: the server's user)."""
        self.cwd = cwd
        self.pause_s = pause_s
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._watched: asyncio.AbstractEventLoop | None = None
        """The loop whose reader callback reads the socket (None: nobody reads it yet)."""
        self._buf = bytearray()
        """Bytes received from the warm process, not yet a whole report."""
        self._ready = False
        self._gone = False
        """The socket ended: the warm process is dead (or was stopped)."""
        self._exits: dict[int, int] = {}
        """Exit codes the warm process reported, by child pid (cleared before each program)."""
        self._news = asyncio.Event()
        self._lock = asyncio.Lock()

    @property
    def lock(self) -> asyncio.Lock:
        """Held while a program runs (a reset holds it too)."""
        return self._lock

    @property
    def pid(self) -> int | None:
        """The warm process's pid while it runs."""
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def pids(self) -> list[int]:
        """The warm process and its idle child waiting for the next program (a reset keeps
        both; with the lock held no program runs, so that child is its only one)."""
        if self.pid is None:
            return []
        return [self.pid, *(p for p, st in process_table().items() if st[0] == self.pid)]

    # ---- the process ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the warm process (returns at once; the first run waits until it is ready)."""
        self.stop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with open(self.log_path, "ab") as log:
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "arpo_envs.desktop.forkserver", str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),),
                    env=self.env,
                    cwd=self.cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                    preexec_fn=set_parent_death_signal,
                    **(self.user.popen_kwargs() if self.user else {}),
                )
            finally:
                theirs.close()
        own(self.proc.pid)
        ours.setblocking(False)
        self._sock = ours
        self._buf = bytearray()
        self._ready = self._gone = False
        self._exits.clear()

    def stop(self) -> None:
        """Kill the warm process (and nothing it started: programs are killed by reset)."""
        if self._sock is not None:
            if self._watched is not None:
                self._watched.remove_reader(self._sock.fileno())
                self._watched = None
            self._sock.close()
            self._sock = None
        self._gone = True
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
            disown(self.proc.pid)
            self.proc = None

    def wait_ready_sync(self) -> None:
        """Block until the warm process is ready (at server start, before the event loop)."""
        assert self._sock is not None
        self._sock.settimeout(self.START_TIMEOUT_S)
        try:
            msg = self._sock.recv(REPLY.size, socket.MSG_WAITALL)
        except TimeoutError:
            msg = b""
        finally:
            self._sock.setblocking(False)
        if msg[:1] != b"R":
            self._not_started()
        self._ready = True

    def _not_started(self) -> None:
        code = self.proc.poll() if self.proc is not None else None
        self.stop()
        raise ExecutorDied(
            f"the warm executor did not start (exit code {code}); see {self.log_path}"
        )

    # ---- its reports ------------------------------------------------------------------------

    def _readable(self) -> None:
        """Event-loop callback: read what the warm process sent."""
        assert self._sock is not None
        try:
            chunk = self._sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._gone = True
            if self._watched is not None:
                self._watched.remove_reader(self._sock.fileno())
                self._watched = None
        self._buf += chunk
        while len(self._buf) >= REPLY.size:
            kind, pid, code = REPLY.unpack(self._buf[: REPLY.size])
            del self._buf[: REPLY.size]
            if kind == b"R":
                self._ready = True
            elif kind == b"S":
                self._exits[pid] = code
        self._news.set()

    async def _until(self, condition, timeout_s: float | None) -> None:
        """Wait until `condition()` holds (TimeoutError after `timeout_s`)."""
        async with asyncio.timeout(timeout_s):
            while not condition():
                self._news.clear()
                await self._news.wait()

    async def _exit_code(self, pid: int, timeout_s: float | None) -> int:
        """The exit code the warm process reports for its child `pid` (EOFError if it died)."""
        await self._until(lambda: pid in self._exits or self._gone, timeout_s)
        if pid not in self._exits:
            raise EOFError
        return self._exits[pid]

    # ---- programs ---------------------------------------------------------------------------

    async def run(self, code: str, timeout_s: float) -> CommandResult:
        """Run `code` as `python -c code` would; at most `timeout_s` seconds."""
        async with self._lock:
            return await self.run_locked(code, timeout_s)

    async def run_locked(self, code: str, timeout_s: float) -> CommandResult:
        """`run` for a caller that holds `lock`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            return await self._start_and_run(code, timeout_s)
        except _NotTaken:  # it died before any process took the program: once more, anew
            return await self._start_and_run(code, max(deadline - loop.time(), 0.001))

    async def _start_and_run(self, code: str, timeout_s: float) -> CommandResult:
        if self._sock is None or self._gone or self.proc is None or self.proc.poll() is not None:
            self.start()  # it died (a program can kill it): a new one
        assert self._sock is not None
        if self._watched is None:
            self._watched = asyncio.get_running_loop()
            self._watched.add_reader(self._sock.fileno(), self._readable)
        if not self._ready:
            with contextlib.suppress(TimeoutError):
                await self._until(lambda: self._ready or self._gone, self.START_TIMEOUT_S)
            if not self._ready:
                self._not_started()
        self._exits.clear()  # earlier programs' exit codes came on their status pipes
        return await self._run(code, timeout_s)

    async def _run(self, code: str, timeout_s: float) -> CommandResult:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        out: list[bytes] = []
        err: list[bytes] = []
        readers: list[asyncio.Task] = []
        transport: asyncio.BaseTransport | None = None
        child: int | None = None
        rc: int | None = None
        try:
            data = code.encode("utf-8")
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            st_r, st_w = os.pipe()
            try:
                socket.send_fds(
                    self._sock, [HEADER.pack(len(data), self.pause_s)], [out_w, err_w, st_w]
                )
            finally:
                for fd in (out_w, err_w, st_w):
                    os.close(fd)
            readers = [
                asyncio.create_task(_drain_fd(out_r, out)),
                asyncio.create_task(_drain_fd(err_r, err)),
            ]
            status, transport = await _pipe_reader(st_r)
            await loop.sock_sendall(self._sock, data)
            async with asyncio.timeout_at(deadline):
                # the child that takes the program says who it is, unless the warm process
                # died before it forked one
                started = asyncio.ensure_future(status.readexactly(STARTED.size))
                gone = asyncio.ensure_future(self._until(lambda: self._gone, None))
                try:
                    await asyncio.wait({started, gone}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    gone.cancel()
                    if not started.done():
                        started.cancel()
                if not started.done():
                    raise _NotTaken
                child = STARTED.unpack(started.result())[0]
                try:
                    rc = EXITED.unpack(await status.readexactly(EXITED.size))[0]
                except asyncio.IncompleteReadError:  # exited without it (os._exit, a signal)
                    rc = await self._exit_code(child, None)
        except TimeoutError:
            rc = None
            if child is None:
                self.stop()  # no process took the program: replaced on the next run
            else:  # the program's group; the warm process then reports its end
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child, signal.SIGKILL)
                try:
                    await self._exit_code(child, 2.0)
                except (EOFError, TimeoutError):
                    self.stop()
        except _NotTaken:
            self.stop()
            await _finish(readers)
            raise
        except (EOFError, OSError, asyncio.IncompleteReadError):  # the warm process died
            self.stop()
            await _finish(readers)
            if child is None:
                raise _NotTaken from None  # the program did not start
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child, signal.SIGKILL)
            raise ExecutorDied(
                "the executor process died while running the program; it is restarted "
                "on the next action"
            ) from None
        finally:
            if transport is not None:
                transport.close()
        # output still in the pipes; a background child holding them is not waited for
        await _finish(readers)
        return _result(out, err, rc, timed_out=rc is None, in_process=True)


async def _pipe_reader(fd: int) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    """An asyncio reader of the read end of a pipe (closing the transport closes the fd)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0)
    )
    return reader, transport


async def _finish(readers: list[asyncio.Task]) -> None:
    """Give output readers 0.2 s to reach the end of their pipes, then stop them."""
    if readers:
        _, pending = await asyncio.wait(readers, timeout=0.2)
        for t in pending:
            t.cancel()


class ExecutorDied(RuntimeError):
    """The warm executor process died while it ran a program, or did not start."""


class _NotTaken(Exception):
    """The warm process died before any of its children took the program (it did not run)."""


# ---- subprocesses -----------------------------------------------------------------------------


async def _drain_fd(fd: int, sink: list[bytes]) -> None:
    """`_drain` of the read end of a pipe (closed when done)."""
    reader, transport = await _pipe_reader(fd)
    try:
        await _drain(reader, sink)
    finally:
        transport.close()


MAX_OUTPUT_BYTES = 16 << 20
"""Most bytes of a command's stdout (and of its stderr) kept for the answer; the rest is
read and discarded (the command never blocks on a full pipe) and the kept text ends with
TRUNCATED_NOTE."""
TRUNCATED_NOTE = "\n[output truncated: more than {n} bytes]"


MAX_ANSWER_BYTES = 2 * MAX_OUTPUT_BYTES
"""Most bytes an answer carrying a command's output and error may take as JSON (both
streams, escapes and the other fields together; 32 MiB); `fit_answer` cuts the streams to
fit. Either stream alone at the capture cap fits whole unless more than half of it needs
escaping (16 MiB of `y\\n` is 24 MiB of JSON); 16 MiB of NUL bytes (96 MiB escaped) does not."""
ANSWER_CUT_NOTE = (
    "\n[answer truncated: {n} more characters cut to keep the answer under {limit} bytes]"
)
_ANSWER_SLACK = 4096
"""Bytes of the limit left for the other fields of the answer and the notes."""


def _json_prefix(text: str, budget: int, chunk: int = 1 << 16) -> tuple[int, int]:
    """(characters, bytes) of the longest prefix of `text` whose JSON string escaping
    (`json.dumps`, ASCII only, as aiohttp writes it) takes at most `budget` bytes.

    Measured a chunk at a time, so the escaped text of a large stream never exists whole."""
    used = pos = 0
    while pos < len(text):
        part = text[pos : pos + chunk]
        size = len(json.dumps(part)) - 2
        if used + size > budget:
            lo, hi = 0, len(part)  # the longest prefix of this chunk that still fits
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if len(json.dumps(part[:mid])) - 2 <= budget - used:
                    lo = mid
                else:
                    hi = mid - 1
            return pos + lo, used + len(json.dumps(part[:lo])) - 2
        used += size
        pos += len(part)
    return pos, used


def fit_answer(output: str, error: str, limit: int = MAX_ANSWER_BYTES) -> tuple[str, str]:
    """`output` and `error` cut so that both as JSON strings take less than `limit` bytes
    with room for an answer's other fields; each cut one ends with ANSWER_CUT_NOTE.

    Each stream may use half the budget, and what one leaves the other may use."""
    budget = limit - _ANSWER_SLACK
    n_out, used_out = _json_prefix(output, budget)
    n_err, used_err = _json_prefix(error, budget)
    if n_out == len(output) and n_err == len(error) and used_out + used_err <= budget:
        return output, error
    n_out, used_out = _json_prefix(output, budget - min(used_err, budget // 2))
    n_err, _ = _json_prefix(error, budget - used_out)

    def cut(text: str, n: int) -> str:
        if n == len(text):
            return text
        return text[:n] + ANSWER_CUT_NOTE.format(n=len(text) - n, limit=limit)

    return cut(output, n_out), cut(error, n_err)


def _result(out: list[bytes], err: list[bytes], rc: int | None, **kw: bool) -> CommandResult:
    """The CommandResult of captured output: decoded, the two streams fitted to an answer."""
    output, error = fit_answer(
        b"".join(out).decode("utf-8", "replace"), b"".join(err).decode("utf-8", "replace")
    )
    return CommandResult(output, error, rc, **kw)


async def _drain(stream: asyncio.StreamReader | None, sink: list[bytes]) -> None:
    """Read `stream` to its end, keeping at most MAX_OUTPUT_BYTES (then a note)."""
    if stream is None:
        return
    kept = 0
    while chunk := await stream.read(65536):
        if kept < MAX_OUTPUT_BYTES:
            part = chunk[: MAX_OUTPUT_BYTES - kept]
            sink.append(part)
            kept += len(part)
            if kept >= MAX_OUTPUT_BYTES and len(part) < len(chunk):
                sink.append(TRUNCATED_NOTE.format(n=MAX_OUTPUT_BYTES).encode())
        elif sink and not sink[-1].startswith(b"\n[output truncated"):
            sink.append(TRUNCATED_NOTE.format(n=MAX_OUTPUT_BYTES).encode())


async def run_subprocess(
    command: str | list[str],
    shell: bool,
    *,
    env: dict[str, str],
    cwd: str,
    timeout_s: float,
    merge_stderr: bool = False,
    user: DesktopUser | None = None,
) -> CommandResult:
    """Run a command in its own session (as `user` where given); kill its process group on
    timeout.

    The answer comes when the command exits, not when its pipes close: a command that
    leaves a background child (`soffice x.xlsx &`) holding the pipes answers at once
    with what was printed so far (the child keeps running). (asyncio's own subprocess
    `wait()` waits for the pipes too, so the exit is watched here.)
    """
    if isinstance(command, list) and command and os.path.basename(command[0]) in PYTHON_NAMES:
        command = [sys.executable, *command[1:]]  # the interpreter that has pyautogui
    if shell:  # subprocess(shell=True) semantics: list items after the script are its args
        argv = ["/bin/sh", "-c", *([command] if isinstance(command, str) else command)]
    else:
        argv = [command] if isinstance(command, str) else command
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        env=env,
        cwd=cwd,
        start_new_session=True,
        **(user.popen_kwargs() if user else {}),
    )
    own(proc.pid)
    out: list[bytes] = []
    err: list[bytes] = []
    readers = []
    for stream, sink in ((proc.stdout, out), (proc.stderr, err)):
        if stream is not None:
            readers.append(asyncio.create_task(_drain_fd(os.dup(stream.fileno()), sink)))
            stream.close()
    timed_out = False
    try:
        try:
            await asyncio.wait_for(_exited(proc), timeout_s)
        except TimeoutError:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await _exited(proc)
    finally:
        if proc.returncode is None:  # cancelled: do not leave it behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.to_thread(proc.wait)
        disown(proc.pid)
    # output still in the pipes; a background child holding them is not waited for
    await _finish(readers)
    return _result(out, err, None if timed_out else proc.returncode, timed_out=timed_out)


async def _exited(proc: subprocess.Popen) -> int:
    """Wait until `proc` exits (a pidfd readable by the event loop; polling without one)."""
    loop = asyncio.get_running_loop()
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # Linux < 5.3
        while proc.poll() is None:
            await asyncio.sleep(0.01)
        return proc.returncode
    done = loop.create_future()
    loop.add_reader(pidfd, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    return proc.wait()  # it has exited: no blocking

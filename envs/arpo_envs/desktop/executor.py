"""Running what /execute is sent: pyautogui code in this process, anything else as a subprocess.

OSWorld's host controller sends every action as `["python", "-c", "import pyautogui; ...
<code>"]` and reads what it printed. A new interpreter per action costs about 170 ms;
running the code in the server process costs milliseconds. The answer must be the
same as a subprocess would give, so in-process code runs:

- as `__main__`, with fresh globals, compiled as `<string>` (tracebacks read the same);
- with its stdout and stderr captured per thread (`print` output comes back as `output`,
  an uncaught exception as a traceback in `error` with return code 1, `sys.exit(n)` as n);
- with pyautogui's settings put back first (`PAUSE` is the server's, near 0; `FAILSAFE`
  True as in a fresh interpreter), so one action's settings never leak into the next.

Only code that needs nothing of a process's own state runs in process: it must parse,
import pyautogui, import nothing outside `INPROCESS_MODULES` and call none of
`open`, `exec`, `eval`, `compile`, `__import__`, `input`, `globals`, `locals`, `vars`,
`setattr`, `delattr`, `getattr` (a relative path or a changed attribute would mean
something else here than in a fresh interpreter). Everything else runs as a real
subprocess in its own session, killed with its group on timeout.

A hanging in-process action (`time.sleep(1e6)`, a busy loop) is stopped at the
timeout: `time.sleep` of the code waits on an event the timeout sets, and the thread
gets an asynchronous `TimeoutError`. Until that thread has finished, the next actions
run as subprocesses.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import contextlib
import ctypes
import io
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
import types
from dataclasses import dataclass
from typing import Any

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


# ---- per-thread stdout/stderr -------------------------------------------------------------------


class _ThreadRouter(io.TextIOBase):
    """Stands in for sys.stdout/sys.stderr: writes of a capturing thread go to its buffer."""

    def __init__(self, original, local: threading.local, attr: str):
        self._original = original
        self._local = local
        self._attr = attr

    def _target(self):
        return getattr(self._local, self._attr, None) or self._original

    def write(self, s: str) -> int:
        return self._target().write(s)

    def flush(self) -> None:
        self._target().flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._original.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self._original, "encoding", "utf-8")


_local = threading.local()
_install_lock = threading.Lock()


def _install_routers() -> None:
    with _install_lock:
        if not isinstance(sys.stdout, _ThreadRouter):
            sys.stdout = _ThreadRouter(sys.stdout, _local, "out")
        if not isinstance(sys.stderr, _ThreadRouter):
            sys.stderr = _ThreadRouter(sys.stderr, _local, "err")


# ---- the in-process runner ------------------------------------------------------------------


class _Cancelled(TimeoutError):
    pass


def _time_module(cancel: threading.Event) -> types.ModuleType:
    """A copy of `time` whose sleep returns early (raising) when `cancel` is set."""
    mod = types.ModuleType("time")
    mod.__dict__.update(time.__dict__)

    def sleep(seconds: float) -> None:
        if seconds < 0:
            raise ValueError("sleep length must be non-negative")
        if cancel.wait(seconds):
            raise _Cancelled("timed out")

    mod.sleep = sleep  # type: ignore[attr-defined]
    return mod


class InProcessRunner:
    """Runs pyautogui code in this process, one program at a time."""

    def __init__(self, pause_s: float = 0.0):
        import pyautogui  # needs DISPLAY set: it connects at import

        self.pyautogui = pyautogui
        self.pause_s = pause_s
        self._busy: threading.Thread | None = None
        self._lock = asyncio.Lock()
        _install_routers()

    def available(self) -> bool:
        """False while an earlier program that timed out is still running."""
        return self._busy is None or not self._busy.is_alive()

    def reconnect(self, display_name: str) -> None:
        """Point pyautogui at a restarted X server (it keeps one connection from import)."""
        from pyautogui import _pyautogui_x11 as x11
        from Xlib.display import Display

        with contextlib.suppress(Exception):
            x11._display.close()
        x11._display = Display(display_name)

    def _run_sync(self, code: str, cancel: threading.Event, box: dict[str, Any]) -> None:
        out, err = io.StringIO(), io.StringIO()
        _local.out, _local.err = out, err
        p = self.pyautogui
        p.PAUSE, p.FAILSAFE = self.pause_s, True
        real_import = builtins.__import__
        timemod = _time_module(cancel)

        def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
            if name == "time":
                return timemod
            return real_import(name, globals, locals, fromlist, level)

        env_builtins = dict(builtins.__dict__)
        env_builtins["__import__"] = guarded_import
        scope = {"__name__": "__main__", "__builtins__": env_builtins}
        rc = 0
        try:
            exec(compile(code, "<string>", "exec"), scope)
        except SystemExit as e:
            if e.code is None:
                rc = 0
            elif isinstance(e.code, int):
                rc = e.code
            else:
                err.write(f"{e.code}\n")
                rc = 1
        except BaseException as e:  # a subprocess reports any uncaught exception the same way
            tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
            err.write("".join(traceback.format_exception(type(e), e, tb)))
            rc = 1
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
            _local.out = _local.err = None
            box["result"] = (out.getvalue(), err.getvalue(), rc)

    async def run(self, code: str, timeout_s: float) -> CommandResult:
        async with self._lock:
            loop = asyncio.get_running_loop()
            done = asyncio.Event()
            cancel = threading.Event()
            box: dict[str, Any] = {}

            def target() -> None:
                try:
                    self._run_sync(code, cancel, box)
                finally:
                    loop.call_soon_threadsafe(done.set)

            thread = threading.Thread(target=target, name="pyautogui-exec", daemon=True)
            self._busy = thread
            thread.start()
            try:
                await asyncio.wait_for(done.wait(), timeout_s)
            except TimeoutError:
                cancel.set()  # ends a time.sleep of the code
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), 0.1)
                if not done.is_set():  # a busy loop or a blocking call: interrupt the thread
                    _async_raise(thread, _Cancelled)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(done.wait(), 0.5)
                out, err, _ = box.get("result", ("", "", None))
                return CommandResult(out, err, None, timed_out=True, in_process=True)
            out, err, rc = box["result"]
            return CommandResult(out, err, rc, in_process=True)


def _async_raise(thread: threading.Thread, exc: type[BaseException]) -> None:
    """Raise `exc` in `thread` at its next Python bytecode."""
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread.ident), ctypes.py_object(exc)
        )


# ---- subprocesses -----------------------------------------------------------------------------


MAX_OUTPUT_BYTES = 16 << 20
"""Most bytes of a command's stdout (and of its stderr) kept for the answer; the rest is
read and discarded (the command never blocks on a full pipe) and the kept text ends with
TRUNCATED_NOTE."""
TRUNCATED_NOTE = "\n[output truncated: more than {n} bytes]"


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
) -> CommandResult:
    """Run a command in its own session; kill its process group on timeout.

    The answer comes when the command exits, not when its pipes close: a command that
    leaves a background child (`soffice x.xlsx &`) holding the pipes answers at once
    with what was printed so far (the child keeps running).
    """
    if isinstance(command, list) and command and os.path.basename(command[0]) in PYTHON_NAMES:
        command = [sys.executable, *command[1:]]  # the interpreter that has pyautogui
    kwargs: dict[str, Any] = dict(
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    if shell:
        if isinstance(command, list):  # subprocess(shell=True) semantics: args after the script
            proc = await asyncio.create_subprocess_exec("/bin/sh", "-c", *command, **kwargs)
        else:
            proc = await asyncio.create_subprocess_exec("/bin/sh", "-c", command, **kwargs)
    else:
        if isinstance(command, str):
            command = [command]
        proc = await asyncio.create_subprocess_exec(*command, **kwargs)
    out: list[bytes] = []
    err: list[bytes] = []
    readers = [
        asyncio.create_task(_drain(proc.stdout, out)),
        asyncio.create_task(_drain(proc.stderr, err)),
    ]
    timed_out = False
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
    except TimeoutError:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
    # output still in the pipes; a background child holding them is not waited for
    _, pending = await asyncio.wait(readers, timeout=0.2)
    for t in pending:
        t.cancel()
    return CommandResult(
        b"".join(out).decode("utf-8", "replace"),
        b"".join(err).decode("utf-8", "replace"),
        None if timed_out else proc.returncode,
        timed_out=timed_out,
    )

"""The warm executor process of one desktop: pyautogui imported once, each program run in a fork.

    python -m arpo_envs.desktop.forkserver <socket fd>      # started by executor.WarmExecutor

A new interpreter per action costs hundreds of ms (most of it importing pyautogui and
Xlib); running actions inside the server let them reach it (`os._exit` killed it, a patched
`json.loads` broke its endpoints, a C loop holding the GIL stalled every request).
This process is the middle way: it imports what actions use, then forks a child that
connects to the display and waits for the next program; the program runs in that
child, a process of its own (its state dies with it, a timeout is a SIGKILL of its
process group), and the fork and the connection are paid before the program arrives.

The child runs the code as `python -c` would: as `__main__` with fresh globals,
compiled as `<string>`, stdout block-buffered and stderr line-buffered on the pipes
the server passed (unbuffered with PYTHONUNBUFFERED), an uncaught exception printed
as a traceback with exit code 1, `sys.exit(n)` as n. It has its own connection to the X display (an X connection
cannot be shared between processes) and starts with pyautogui's `PAUSE` set to the
server's value and `FAILSAFE` True, as in a fresh interpreter.

Protocol (one program at a time):

- socket (a UNIX stream socket pair with the server), this process once ready:
  b"R" + its pid (struct REPLY);
- server: HEADER (code length, pyautogui.PAUSE) with three file descriptors attached,
  the child's stdout, its stderr and a status pipe; then the code as UTF-8. Whichever
  child is waiting reads it (a killed one never does; the next one will);
- that child, on the status pipe: its pid (STARTED) at once; when the program is done
  it closes stdout and stderr and writes the exit code (EXITED), then exits (the
  answer does not wait for the teardown of its address space);
- socket, this process: b"S" + pid + exit status of every child once it is gone
  (negative: killed by that signal). The server reads the exit code from there when
  the status pipe closed without one (`os._exit`, a timeout's SIGKILL) and otherwise
  discards these reports.

The process dies with the server (parent-death signal, set by the server) and exits
when the socket closes.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import sys

HEADER = struct.Struct("!Id")
"""Server -> child: code length in bytes, pyautogui.PAUSE."""
REPLY = struct.Struct("!cqq")
"""This process -> server: kind (b"R" ready, b"S" a child is gone), pid, exit code."""
STARTED = struct.Struct("!q")
"""Child -> server on the status pipe: its pid, once it has the program."""
EXITED = struct.Struct("!i")
"""Child -> server on the status pipe: the program's exit code."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _spare(sock: socket.socket) -> None:
    """A forked child: connect to the display, wait for one program, run it; never returns."""
    rc = 1
    try:
        os.setsid()  # its own process group: a timeout kills it and whatever it started
        display_fd = None
        try:
            from pyautogui import _pyautogui_x11 as x11
            from Xlib.display import Display

            x11._display = Display(os.environ["DISPLAY"])
            display_fd = x11._display.fileno()
            failed: BaseException | None = None
        except Exception as e:  # reported when the program comes, as its import would be
            failed = e
        try:
            head, fds, _, _ = socket.recv_fds(sock, HEADER.size, 3)
            if len(head) < HEADER.size:
                head += _recv_exact(sock, HEADER.size - len(head))
            size, pause = HEADER.unpack(head)
            code = _recv_exact(sock, size).decode("utf-8")
        except EOFError:
            rc = 0  # the server closed the socket: nothing to run
            return
        if len(fds) != 3:
            return  # not the server speaking
        out_fd, err_fd, status_fd = fds
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        # every other inherited fd closed (the socket to the server first)
        keep = sorted(f for f in (display_fd, status_fd) if f is not None)
        low = 3
        for fd in keep:
            os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, 65536)
        os.set_inheritable(status_fd, False)  # not for what the program starts
        os.write(status_fd, STARTED.pack(os.getpid()))
        rc = _run(code, pause, failed)
        # The answer before this process's teardown: output closed, then the exit code.
        os.close(1)
        os.close(2)
        os.write(status_fd, EXITED.pack(rc))
    finally:
        os._exit(rc & 0xFF)


def _run(code: str, pause: float, failed: BaseException | None) -> int:
    """Run `code` as `python -c` would, with stdout and stderr on fds 1 and 2."""
    import builtins
    import io
    import traceback
    import types

    # the streams a fresh interpreter would make for pipes (PYTHONUNBUFFERED as `-u`)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))

    def stream(fd: int, **kw) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        binary = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(binary, encoding="utf-8", write_through=unbuffered, **kw)  # type: ignore[arg-type]

    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = stream(1)
    sys.stderr = stream(2, errors="backslashreplace", line_buffering=True)
    sys.argv = ["-c"]
    import pyautogui

    pyautogui.PAUSE, pyautogui.FAILSAFE = pause, True
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    try:
        if failed is not None:
            raise failed
        exec(compile(code, "<string>", "exec"), main.__dict__)
        rc = 0
    except SystemExit as e:
        if e.code is None:
            rc = 0
        elif isinstance(e.code, int):
            rc = e.code
        else:
            print(e.code, file=sys.stderr)
            rc = 1
    except BaseException as e:  # reported as python -c reports an uncaught exception
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        traceback.print_exception(type(e), e, tb)
        rc = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return rc & 0xFF


def serve(sock: socket.socket) -> None:
    import builtins  # noqa: F401  (what the children use: imported once, here)
    import io  # noqa: F401
    import json  # noqa: F401
    import math  # noqa: F401
    import platform  # noqa: F401
    import random  # noqa: F401
    import re  # noqa: F401
    import string  # noqa: F401
    import time  # noqa: F401
    import traceback  # noqa: F401
    import types  # noqa: F401

    import pyautogui  # noqa: F401  (connects to $DISPLAY at import and reads its keymap)
    from pyautogui import _pyautogui_x11 as x11

    x11._display.close()  # every child opens its own connection
    sock.sendall(REPLY.pack(b"R", os.getpid(), 0))
    while True:
        # The next program's process is forked before it is asked for: the fork and the
        # display connection are off the request's path.
        pid = os.fork()
        if pid == 0:
            _spare(sock)
        _, status = os.waitpid(pid, 0)
        sock.sendall(REPLY.pack(b"S", pid, os.waitstatus_to_exitcode(status)))


def main() -> int:
    sock = socket.socket(fileno=int(sys.argv[1]))
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the server went away
        serve(sock)
    return 0


if __name__ == "__main__":
    sys.exit(main())

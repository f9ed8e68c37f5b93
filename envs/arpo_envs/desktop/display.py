"""One X display: an Xvfb server and the openbox window manager on it.

Xvfb is started with `-displayfd`, so it reports its display number once it accepts
connections: no polling, and when no number is asked for, Xvfb itself picks the
first free one (its lock file makes that race-free between concurrent servers).
Both processes die with the desktop server (parent-death signal), and `stop()`
removes the lock file and socket Xvfb leaves behind when killed.

`XDisplay.answers()` is a round trip to the X server with a deadline, on an asyncio
connection of its own: a client holding a server grab (XGrabServer) makes every other
client's requests, even a new connection's setup, wait until it lets go, so X work is
preceded by this probe instead of hanging a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import struct
import subprocess
import time
from pathlib import Path

from arpo_envs.desktop.user import DesktopUser
from arpo_envs.procs import disown, own, set_parent_death_signal, wait_gone


class DisplayError(RuntimeError):
    """Xvfb or openbox did not start."""


def lock_paths(number: int, tmp: str = "/tmp") -> tuple[Path, Path]:
    """Xvfb's lock file and socket for display `:number` (`tmp`: the host's /tmp)."""
    return Path(f"{tmp}/.X{number}-lock"), Path(f"{tmp}/.X11-unix/X{number}")


def remove_stale_lock(number: int, tmp: str = "/tmp") -> bool:
    """Delete the lock file and socket of `:number` if the pid in the lock is dead."""
    lock, sock = lock_paths(number, tmp)
    try:
        pid = int(lock.read_text().strip())
    except (OSError, ValueError):
        pid = 0
    if pid and Path(f"/proc/{pid}").exists():
        return False
    for p in (lock, sock):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    return True


class XDisplay:
    """Xvfb + openbox for one desktop."""

    def __init__(
        self,
        width: int,
        height: int,
        env: dict[str, str],
        number: int | None = None,
        host_ns: int | None = None,
        host_tmp: str = "/tmp",
        user: DesktopUser | None = None,
    ):
        self.width = width
        self.height = height
        self.env = env
        self.number = number
        """Display number; None until started when Xvfb is to pick a free one."""
        self.host_ns = host_ns
        """Descriptor of the mount namespace Xvfb runs in when the server has a private one
        (its /tmp is the desktop's own; Xvfb's lock files must be where other desktops'
        Xvfb look for them)."""
        self.host_tmp = host_tmp
        """The host's /tmp as this process reaches it (for the lock files)."""
        self.user = user
        """Whom Xvfb and openbox run as (None: the server's user)."""
        self.xvfb: subprocess.Popen | None = None
        self.wm: subprocess.Popen | None = None
        self._probe: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._probe_lock: asyncio.Lock | None = None
        self._probe_stale = False
        """The X server was stopped since the probe connected (dropped by the next probe,
        in the event loop: `stop` runs in other threads)."""

    @property
    def name(self) -> str:
        return f":{self.number}"

    def pids(self) -> list[int]:
        return [p.pid for p in (self.xvfb, self.wm) if p is not None and p.poll() is None]

    def alive(self) -> bool:
        return all(p is not None and p.poll() is None for p in (self.xvfb, self.wm))

    def start(self, timeout_s: float = 10.0, attempts: int = 3) -> None:
        """Start Xvfb (keeping the display number of an earlier start) and openbox.

        Retried: a display picked by Xvfb can still be taken by a server of another
        user of the machine whose lock file went missing (Xvfb then fails on its socket).
        """
        for attempt in range(attempts):
            try:
                self._start(timeout_s)
                return
            except DisplayError:
                self.stop()
                if attempt == attempts - 1:
                    raise

    def _start(self, timeout_s: float) -> None:
        if self.number is not None:
            remove_stale_lock(self.number, self.host_tmp)
        read_fd, write_fd = os.pipe()
        cmd = ["Xvfb"] + ([self.name] if self.number is not None else [])
        cmd += [
            "-displayfd",
            str(write_fd),
            "-screen",
            "0",
            f"{self.width}x{self.height}x24",
            "-nolisten",
            "tcp",
            "-dpi",
            "96",
            "-noreset",
        ]
        try:
            self.xvfb = subprocess.Popen(
                cmd,
                pass_fds=(write_fd,),
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=self._xvfb_preexec,
            )
        finally:
            os.close(write_fd)
        own(self.xvfb.pid)
        try:
            number = _read_display_number(read_fd, self.xvfb, timeout_s)
        finally:
            os.close(read_fd)
        self.number = number
        self.env["DISPLAY"] = self.name
        self.wm = subprocess.Popen(
            ["openbox", "--sm-disable"],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=set_parent_death_signal,
            **(self.user.popen_kwargs() if self.user else {}),
        )
        own(self.wm.pid)
        self._wait_wm(timeout_s)

    def _wait_wm(self, timeout_s: float) -> None:
        """Wait until openbox has taken over the root window (windows get managed from then on)."""
        from Xlib import X, display

        d = display.Display(self.name)
        try:
            root = d.screen().root
            check = d.intern_atom("_NET_SUPPORTING_WM_CHECK")
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if self.wm is not None and self.wm.poll() is not None:
                    raise DisplayError(f"openbox exited with code {self.wm.returncode}")
                prop = root.get_full_property(check, X.AnyPropertyType)
                if prop is not None and len(prop.value):
                    return
                time.sleep(0.01)
            raise DisplayError(f"openbox did not manage {self.name} within {timeout_s} s")
        finally:
            d.close()

    async def answers(self, timeout_s: float = 2.0) -> bool:
        """True if the X server answers a GetInputFocus round trip within `timeout_s`.

        False when it does not (a client holds a server grab, Xvfb is stopped or dead). A
        probe that timed out leaves its reply in flight, so its connection is dropped and
        the next probe connects anew."""
        if self._probe_lock is None:
            self._probe_lock = asyncio.Lock()
        try:
            async with asyncio.timeout(timeout_s), self._probe_lock:
                if self._probe_stale:
                    self._drop_probe()
                    self._probe_stale = False
                if self._probe is None:
                    self._probe = await _x_connect(self.number)
                reader, writer = self._probe
                writer.write(_GET_INPUT_FOCUS)
                await writer.drain()
                reply = await reader.readexactly(32)
            if (
                reply[0] != 1
            ):  # not a reply: an error or an event on a connection that asks for none
                self._drop_probe()
            return True
        except (TimeoutError, OSError, EOFError, asyncio.IncompleteReadError):
            self._drop_probe()
            return False

    def _drop_probe(self) -> None:
        if self._probe is not None:
            self._probe[1].close()
            self._probe = None

    def stop(self) -> None:
        """Kill openbox and Xvfb, then remove the display's lock file and socket."""
        self._probe_stale = True
        procs = [p for p in (self.wm, self.xvfb) if p is not None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        wait_gone([p.pid for p in procs], 5)
        for p in procs:
            disown(p.pid)
        if self.number is not None:
            remove_stale_lock(self.number, self.host_tmp)
        self.xvfb = self.wm = None

    def _xvfb_preexec(self) -> None:
        """In Xvfb's child before exec: the host's mount namespace (needs root), then the
        desktop's user, then die with the server (a change of user clears that signal)."""
        if self.host_ns is not None:
            import ctypes

            if ctypes.CDLL(None, use_errno=True).setns(self.host_ns, 0x00020000) != 0:
                raise OSError(ctypes.get_errno(), "setns to the host's mount namespace")
        if self.user is not None:
            self.user.become()
        set_parent_death_signal()


_SETUP = b"l\x00" + struct.pack("<HHHH2x", 11, 0, 0, 0)
"""X connection setup: little-endian, protocol 11.0, no authorization (Xvfb runs without)."""
_GET_INPUT_FOCUS = struct.pack("<BxH", 43, 1)
"""The smallest request with a reply (32 bytes)."""


async def _x_connect(number: int | None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection to display `number` (the abstract socket, else the file in /tmp)."""
    if number is None:
        raise OSError("the display has not started")
    path = f"/tmp/.X11-unix/X{number}"
    try:
        reader, writer = await asyncio.open_unix_connection("\0" + path)
    except OSError:
        reader, writer = await asyncio.open_unix_connection(path)
    try:
        writer.write(_SETUP)
        await writer.drain()
        head = await reader.readexactly(8)
        extra = struct.unpack("<H", head[6:8])[0] * 4
        body = await reader.readexactly(extra)
        if head[0] != 1:
            raise OSError(f"X connection refused: {body[: head[1]].decode(errors='replace')}")
    except BaseException:
        writer.close()
        raise
    return reader, writer


def _read_display_number(fd: int, proc: subprocess.Popen, timeout_s: float) -> int:
    buf = b""
    deadline = time.monotonic() + timeout_s
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            proc.kill()
            raise DisplayError(f"Xvfb did not report its display within {timeout_s} s")
        ready, _, _ = select.select([fd], [], [], min(left, 0.1))
        if ready:
            chunk = os.read(fd, 64)
            if not chunk:
                break
            buf += chunk
        elif proc.poll() is not None:
            break
    if not buf.strip().isdigit():
        code = proc.poll()
        raise DisplayError(
            f"Xvfb failed to start (exit code {code}); is the display in use, or is Xvfb "
            "installed (`make sysdeps`)?"
        )
    return int(buf.strip())

"""One X display: an Xvfb server and the openbox window manager on it.

Xvfb is started with `-displayfd`, so it reports its display number once it accepts
connections: no polling, and when no number is asked for, Xvfb itself picks the
first free one (its lock file makes that race-free between concurrent servers).
Both processes die with the desktop server (parent-death signal), and `stop()`
removes the lock file and socket Xvfb leaves behind when killed.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import time
from pathlib import Path

from arpo_envs.desktop.procs import disown, own, set_parent_death_signal, wait_gone


class DisplayError(RuntimeError):
    """Xvfb or openbox did not start."""


def lock_paths(number: int) -> tuple[Path, Path]:
    """Xvfb's lock file and socket for display `:number`."""
    return Path(f"/tmp/.X{number}-lock"), Path(f"/tmp/.X11-unix/X{number}")


def remove_stale_lock(number: int) -> bool:
    """Delete the lock file and socket of `:number` if the pid in the lock is dead."""
    lock, sock = lock_paths(number)
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

    def __init__(self, width: int, height: int, env: dict[str, str], number: int | None = None):
        self.width = width
        self.height = height
        self.env = env
        self.number = number
        """Display number; None until started when Xvfb is to pick a free one."""
        self.xvfb: subprocess.Popen | None = None
        self.wm: subprocess.Popen | None = None

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
            remove_stale_lock(self.number)
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
                preexec_fn=set_parent_death_signal,
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

    def stop(self) -> None:
        """Kill openbox and Xvfb, then remove the display's lock file and socket."""
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
            remove_stale_lock(self.number)
        self.xvfb = self.wm = None


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

"""Processes of one desktop: their environment, their marker, and killing all of them.

Every process a desktop server starts (Xvfb, openbox, applications, commands) gets
`ARPO_DESKTOP_ROOT=<the desktop's root dir>` in its environment, and so does anything
those processes start in turn. That marker is how a reset or `arpo-envs down` finds
every process of one desktop, including ones that left their process group (a
`soffice ... &` from a shell command, a double-forking launcher): scanning
/proc/*/environ costs a few ms.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

MARKER = "ARPO_DESKTOP_ROOT"

# Variables of the server's own environment that must not leak into the desktop's apps:
# they would point them at the caller's session bus, display or config.
_DROP = (
    "DISPLAY",
    "WAYLAND_DISPLAY",
    "DBUS_SESSION_BUS_ADDRESS",
    "XDG_CONFIG_HOME",
    "XDG_DATA_HOME",
    "XDG_CACHE_HOME",
    "XDG_STATE_HOME",
    "XDG_RUNTIME_DIR",
    "XAUTHORITY",
    "SESSION_MANAGER",
    # the server's secret: nothing that runs on the desktop may read it
    "ARPO_ENV_TOKEN",
)


def desktop_env(root: Path, display: str, home: str) -> dict[str, str]:
    """The environment of every process of the desktop at `root` on `display`."""
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    runtime = root / "run"
    runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
    env.update(
        {
            MARKER: str(root),
            "DISPLAY": display,
            "HOME": home,
            "XDG_RUNTIME_DIR": str(runtime),
            # no session bus: GTK apps must not autolaunch a dbus-daemon that outlives them
            "DBUS_SESSION_BUS_ADDRESS": "disabled:",
            "NO_AT_BRIDGE": "1",
            "GSETTINGS_BACKEND": "memory",
            # LibreOffice's own X11 toolkit: no GTK/Qt plugin lookups, same look everywhere
            "SAL_USE_VCLPLUGIN": "gen",
            "LANG": os.environ.get("LANG") or "C.UTF-8",
        }
    )
    return env


def write_python_wrappers(bin_dir: Path) -> None:
    """`python` and `python3` in `bin_dir` (first on the desktop's PATH) run this interpreter,
    which has pyautogui, as `python` does on an OSWorld VM; shell commands of tasks
    (`python3 -c "import pyautogui; ..."`) then work as they do there."""
    import sys

    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in ("python", "python3"):
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
        script.chmod(0o755)


def marked_pids(root: Path | str, exclude: Iterable[int] = ()) -> list[int]:
    """Live processes (not zombies) whose environment carries the marker of `root`."""
    needle = f"{MARKER}={root}\0".encode()
    skip = {os.getpid(), *exclude}
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                data = f.read() + b"\0"
        except OSError:
            continue  # gone, or not ours to read
        if needle in data and _alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    """True unless the process is gone or a zombie (a zombie holds no resources but a pid)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] != b"Z"


def kill_all(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    """Signal each pid and its process group (a group leader takes its children along)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            pgid = os.getpgid(pid)
            if pgid == pid:
                os.killpg(pgid, sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def wait_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Wait until every pid is gone or a zombie; returns the ones still alive at the deadline."""
    pending = list(pids)
    deadline = time.monotonic() + timeout_s
    while pending:
        pending = [p for p in pending if _alive(p)]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    return pending


def kill_marked(root: Path | str, exclude: Iterable[int] = (), timeout_s: float = 3.0) -> int:
    """SIGKILL every marked process of `root` (but `exclude`) and wait for them; returns the count.

    Repeats the scan until none is left: a process may fork between the scan and the kill.
    """
    exclude = set(exclude)
    total = 0
    for _ in range(5):
        pids = marked_pids(root, exclude)
        if not pids:
            break
        kill_all(pids)
        total += len(pids)
        wait_gone(pids, timeout_s)
    return total


def set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL the calling (child) process when its parent dies (preexec_fn).

    Used for Xvfb and openbox so a server killed hard does not leave its display behind.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

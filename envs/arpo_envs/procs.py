"""Processes of the environments: how they are found and killed, and free ports to serve on.

Both fleets use these: the local desktops (`arpo_envs.desktop`: a desktop's environment,
its marker, its server's process tree) and the VMs (`arpo_envs.vm`: `alive`, `kill_all`,
`wait_gone`, `free_port`, `set_parent_death_signal`). `free_port` is the one helper for a
free loopback port in the project (its tests and benchmarks import it from here).

Two links find every process of one desktop, including ones that left their process
group and session (a `soffice ... &` from a shell command, a double-forking launcher,
`setsid`):

- the marker: every process a desktop server starts gets `ARPO_DESKTOP_ROOT=<the
  desktop's root dir>` in its environment, and so does anything it starts in turn
  (unless a command removes it: `env -u ARPO_DESKTOP_ROOT ...`);
- the process tree: the server is a child subreaper (`become_subreaper`), so a process
  whose parent exits is re-parented to the server instead of to init. Every process a
  command starts stays a descendant of the server, whatever it does to its
  environment, group or session; `descendants` walks /proc from the server's pid.

A reset kills the union of both. `arpo-envs down` records each server's tree before it
stops the server, so what the server could not kill itself (it was killed hard) is
still found. Orphans re-parented to the server are reaped by `reap_orphans`; the pids
the server waits for itself are registered with `own` so that is never done to them.
Scanning /proc costs a few ms.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
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


_KEPT = ("PATH", "LANG", "LANGUAGE", "TZ", "TERM", "PYTHONUNBUFFERED")
"""What a clean environment (`desktop_env(user=...)`) keeps of the server's, with LC_*."""


def desktop_env(root: Path, display: str, home: str, user: str | None = None) -> dict[str, str]:
    """The environment of every process of the desktop at `root` on `display`.

    `user`: the programs run as that user (`arpo_envs.desktop.user`): the environment is
    built from `_KEPT` alone, not from the server's (which may hold its caller's secrets)."""
    if user is None:
        env = {k: v for k, v in os.environ.items() if k not in _DROP}
    else:
        env = {k: v for k, v in os.environ.items() if k in _KEPT or k.startswith("LC_")}
        env.update({"USER": user, "LOGNAME": user, "SHELL": "/bin/sh"})
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


# ---- the process tree ---------------------------------------------------------------------------

TREE_FILE = "tree.json"
"""In a desktop's root: its server's process tree, pid -> start time, rewritten when it
changes (at most every second), for `arpo-envs down` after the server was killed hard."""

_OWN: set[int] = set()
"""Children this process started and waits for itself (never reaped by `reap_orphans`)."""


def own(pid: int) -> None:
    """Register a child this process waits for itself."""
    _OWN.add(pid)


def disown(pid: int) -> None:
    """Forget a child registered with `own` (once it has been waited for)."""
    _OWN.discard(pid)


def become_subreaper() -> bool:
    """Make this process the parent of every orphan among its descendants (Linux >= 3.4).

    Returns False where the kernel refuses (then only the marker finds them)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_CHILD_SUBREAPER = 36
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _stat(pid: int | str) -> tuple[int, str, int] | None:
    """(parent pid, state letter, start time in clock ticks since boot), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[1]), fields[0].decode(), int(fields[19])


def process_table() -> dict[int, tuple[int, str, int]]:
    """Every process: pid -> (parent pid, state, start time)."""
    table = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (st := _stat(entry.name)) is not None:
            table[int(entry.name)] = st
    return table


def descendants(pid: int, table: dict[int, tuple[int, str, int]] | None = None) -> list[int]:
    """Live (not zombie) processes below `pid` in the process tree."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for p, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(p)
    found, stack = [], list(children.get(pid, ()))
    while stack:
        p = stack.pop()
        if table[p][1] != "Z":
            found.append(p)
        stack.extend(children.get(p, ()))
    return found


def tree_snapshot(pid: int) -> dict[int, int]:
    """The live descendants of `pid` with their start times (to tell a reused pid later)."""
    table = process_table()
    return {p: table[p][2] for p in descendants(pid, table)}


def still_running(snapshot: dict[int, int]) -> list[int]:
    """The processes of a `tree_snapshot` still alive (same pid and start time)."""
    alive = []
    for pid, start in snapshot.items():
        st = _stat(pid)
        if st is not None and st[2] == start and st[1] != "Z":
            alive.append(pid)
    return alive


def reap_orphans(min_age_s: float = 120.0) -> int:
    """Reap zombie children of this process that it did not start itself; returns the count.

    Only zombies started at least `min_age_s` ago: a child this process starts and waits
    for itself but has not registered yet (a `subprocess.run` of wmctrl) is never that
    old, so its exit code always reaches its own waiter.
    """
    me = os.getpid()
    ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/uptime") as f:
        now = float(f.read().split()[0]) * ticks
    reaped = 0
    for pid, (ppid, state, start) in process_table().items():
        if ppid == me and state == "Z" and pid not in _OWN and now - start >= min_age_s * ticks:
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    reaped += 1
    return reaped


# ---- the marker -------------------------------------------------------------------------------


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
        if needle in data and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
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
        pending = [p for p in pending if alive(p)]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    return pending


def kill_marked(
    root: Path | str,
    exclude: Iterable[int] = (),
    timeout_s: float = 3.0,
    tree: int | None = None,
) -> int:
    """SIGKILL every marked process of `root` and, with `tree`, every descendant of that pid
    (but `exclude`), and wait for them; returns the count.

    Repeats the scan until none is left: a process may fork between the scan and the kill.
    """
    exclude = set(exclude)
    total = 0
    for _ in range(5):
        pids = marked_pids(root, exclude)
        if tree is not None:
            pids = sorted(set(pids) | (set(descendants(tree)) - exclude))
        if not pids:
            break
        kill_all(pids)
        total += len(pids)
        wait_gone(pids, timeout_s)
    return total


# ---- ports ------------------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of `host` that nothing listens on now (the kernel's pick; free when asked,
    so a process started with it may still find it taken by then)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(k: int, exclude: Iterable[int] = (), host: str = "127.0.0.1") -> list[int]:
    """`k` distinct free ports of `host`, none of them in `exclude` (ports handed out already
    but maybe not bound yet)."""
    taken = set(exclude)
    out: list[int] = []
    while len(out) < k:
        p = free_port(host)
        if p not in taken:
            taken.add(p)
            out.append(p)
    return out


# ---- processes started by this one ------------------------------------------------------------


def set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL the calling (child) process when its parent dies (preexec_fn).

    Used for Xvfb and openbox so a server killed hard does not leave its display behind.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

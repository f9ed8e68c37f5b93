"""N local desktops, one server process each: `arpo-envs up`, `status` and `down`.

    arpo-envs up -n 8 --base-port 5200       # prints "env <i> <url> <display>", stays up
    arpo-envs up -n 8 --detach               # returns once all answer; stop with `down`
    arpo-envs status                         # which servers run (a FleetStatus, as JSON)
    arpo-envs down                           # from any shell

`up`, `status`, `down` and `read_state` have the shapes of every fleet's (`arpo_envs.fleet`):
`up` returns a `DesktopFleet` handle, the state file is a `DesktopFleetState` record
(`arpo_envs.fleet_records`).

`up` builds the LibreOffice profile template once, starts the servers (each in its
own session, with its own display, root directory, home and port), waits for each
to announce itself and answer GET /platform, and writes a state file (pids, ports,
displays, roots) so that `down` works from another shell. Ctrl-C or SIGTERM on a
foreground `up` stops them all the same way `down` does:

1. a snapshot of every server's process tree (each server is a child subreaper, so
   its tree holds everything its commands started, marker or not; a server killed
   hard earlier left the last tree it recorded in its root, `tree.json`);
2. SIGTERM to every server (each kills its apps, openbox and Xvfb, removes its locks);
3. after a grace period, SIGKILL of what is left of each server's process group;
4. a sweep for any process of those trees still running (same pid and start time) or
   still carrying a desktop's marker (see `arpo_envs.procs`), and removal of stale X lock
   files and LibreOffice lock files of those desktops.

Tokens (`tokens=True`): each server gets its own random token through a pipe it inherits
(`--token-fd`), reads and closes before it runs anything; the token is in no file, no
environment and no command line. The state file keeps only each token's sha256
(`token_sha256`: who holds a token can check which desktop it opens); the tokens
themselves are returned to the caller of `up` (`FleetEnv.token`, in memory), and written
to a file only where the caller asks (`FleetConfig.tokens_file`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arpo_envs.desktop.display import remove_stale_lock
from arpo_envs.desktop.home import libreoffice_template, remove_lock_files
from arpo_envs.fleet import FleetEnv, FleetHandle
from arpo_envs.fleet_records import (
    DesktopEntry,
    DesktopFleetState,
    EnvStatus,
    FleetStatus,
    load,
    save,
    write_private,
)
from arpo_envs.procs import (
    TREE_FILE,
    alive,
    kill_all,
    kill_marked,
    marked_pids,
    still_running,
    tree_snapshot,
    wait_gone,
)


def default_state_file() -> Path:
    return Path(
        os.environ.get("ARPO_DESKTOP_STATE") or f"/tmp/arpo-envs-desktop-{os.getuid()}.json"
    )


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """A set of local desktop servers."""

    n: int = 1
    """Number of desktops."""
    base_port: int = 5200
    """Desktop i listens on base_port + i (0: any free port each)."""
    host: str = "127.0.0.1"
    """Address to bind; anything but loopback needs a token."""
    tokens: bool = False
    """Give every desktop its own random bearer token (handed to its server through a pipe;
    the state file keeps only its sha256): code on one desktop cannot drive another.
    Required for a host other than loopback. The caller of `up` gets the tokens in the
    returned members; see `tokens_file` for clients started elsewhere."""
    tokens_file: Path | None = None
    """With `tokens`: also write `{url: token}` here (mode 0600, `read_tokens`) for clients
    started from another shell. A program of the same user that finds the file can read
    it: keep it out of the desktops' folders and the well-known places (not /tmp). None:
    the tokens are in no file."""
    width: int = 1280
    """Screen width of every desktop."""
    height: int = 720
    """Screen height of every desktop."""
    files_template: str | None = None
    """Directory copied into every home on reset."""
    atspi: bool = False
    """Each desktop runs a session bus, the AT-SPI registry and LibreOffice's GTK 3 plugin,
    so GET /accessibility gives GTK apps' and LibreOffice's whole trees
    (`arpo_envs.desktop.atspi`); False: windows as frames only, LibreOffice's X11 plugin."""
    a11y_max_nodes: int = 10_000
    """With `atspi`: most nodes one GET /accessibility answer walks (`DesktopConfig`)."""
    state_file: Path = field(default_factory=default_state_file)
    """Where pids and ports are kept for `down`."""
    root_base: str = "/tmp"
    """Each desktop's root is <root_base>/arpo-desktop-<port or index>-<random>."""
    start_timeout_s: float = 60.0
    """How long a server may take to announce itself and answer."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.base_port and not 0 < self.base_port + self.n <= 65536:
            raise ValueError(f"ports {self.base_port}..{self.base_port + self.n - 1} out of range")
        if not 100 <= self.a11y_max_nodes <= 1_000_000:
            raise ValueError(
                f"a11y_max_nodes is {self.a11y_max_nodes}: give 100..1000000 (nodes of one "
                "/accessibility answer; a Calc sheet in view is a few thousand)"
            )
        if self.tokens_file is not None and not self.tokens:
            raise ValueError("tokens_file needs tokens=True (there is no token to write)")
        if not self.tokens and self.host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(
                f"host {self.host!r} is exposed: set tokens=True (`arpo-envs up --tokens`) so "
                "that every desktop needs its own bearer token"
            )


GRACE_S = 10.0
"""Default seconds `down` waits for the servers to stop before SIGKILL."""


@dataclass
class _Server:
    """One desktop server while `up` starts it."""

    index: int
    pid: int
    url: str = ""
    display: str = ""
    root: str = ""
    token: str = ""
    """This desktop's bearer token ('' = none); in memory only, never in the state file."""

    def entry(self) -> DesktopEntry:
        return DesktopEntry(self.index, self.pid, self.url, self.display, self.root,
                            token_sha256(self.token))  # fmt: skip


@dataclass(frozen=True, slots=True)
class DesktopFleet(FleetHandle):
    """The desktops `up` started (`arpo_envs.fleet.FleetHandle`)."""

    kind = "desktop"
    state: DesktopFleetState
    """What the state file holds (pids, roots, displays; no token)."""


def _server_cmd(cfg: FleetConfig, i: int, root: str) -> list[str]:
    port = 0 if cfg.base_port == 0 else cfg.base_port + i
    cmd = [sys.executable, "-m", "arpo_envs.desktop.server", "--host", cfg.host]
    cmd += ["--port", str(port), "--width", str(cfg.width), "--height", str(cfg.height)]
    cmd += ["--root", root]
    if cfg.files_template:
        cmd += ["--files-template", cfg.files_template]
    if cfg.atspi:
        cmd += ["--atspi", "--a11y-max-nodes", str(cfg.a11y_max_nodes)]
    return cmd


def _health(url: str, token: str | None, timeout_s: float = 5.0) -> bool:
    req = urllib.request.Request(url + "/platform")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status == 200 and r.read().strip() == b"Linux"
    except OSError:
        return False


def write_state(
    path: Path, servers: list[_Server], up_pid: int | None, tokens_file: Path | None = None
) -> DesktopFleetState:
    """The state file (mode 0600): pids, ports, displays, roots and each token's sha256,
    never a token; where the tokens file is, if any (`down` removes it)."""
    state = DesktopFleetState(up_pid, tuple(s.entry() for s in servers), str(tokens_file or ""))
    save(path, state)
    return state


def read_state(state_file: Path | None = None) -> DesktopFleetState | None:
    """The state file's record; None when there is none. OSError when it cannot be read,
    `FleetRecordError` when it is not a desktop fleet's."""
    path = state_file or default_state_file()
    if not path.exists():
        return None
    return load(path, DesktopFleetState)


def token_sha256(token: str) -> str:
    """What the state file keeps of a token: its sha256 in hex ('' for no token)."""
    return hashlib.sha256(token.encode()).hexdigest() if token else ""


def read_tokens(tokens_file: Path) -> dict[str, str]:
    """URL -> bearer token of every desktop, from the `tokens_file` of `up`."""
    data = json.loads(Path(tokens_file).read_text())
    return {str(u): str(t) for u, t in data.items()}


def _pass_token(token: str) -> int:
    """A pipe's read end holding `token` (the write end closed): the server's --token-fd."""
    r, w = os.pipe()
    try:
        os.write(w, token.encode())  # a few bytes: far below the pipe's buffer
    finally:
        os.close(w)
    return r


_CHILDREN: dict[int, subprocess.Popen] = {}
"""The servers `up` started in this process, by pid, until `down` stops and reaps them."""


def up(cfg: FleetConfig, announce: Callable[[str], Any] = print) -> DesktopFleet:
    """Start the servers; returns once every one answers (stops them all on any failure)."""
    old = read_state(cfg.state_file)
    if old is not None and any(alive(s.pid) for s in old.servers):
        raise RuntimeError(
            f"desktops from {cfg.state_file} are still running; `arpo-envs down` first "
            "(or set ARPO_DESKTOP_STATE for a second set)"
        )
    libreoffice_template()  # once here, not raced by N servers
    # The token never goes into a server's environment, command line or any file (a
    # program on the desktop could read /proc/<server>/environ or cmdline, or the file):
    # an inherited pipe the server reads and closes before it runs anything.
    env = {k: v for k, v in os.environ.items() if k != "ARPO_ENV_TOKEN"}
    members: list[_Server] = []
    procs: list[subprocess.Popen] = []
    sel = selectors.DefaultSelector()
    t0 = time.perf_counter()
    try:
        for i in range(cfg.n):
            tag = cfg.base_port + i if cfg.base_port else i
            root = os.path.join(cfg.root_base, f"arpo-desktop-{tag}-{os.urandom(3).hex()}")
            os.makedirs(root)
            # stderr to a file: an inherited terminal or pipe would outlive a detached `up`
            with open(os.path.join(root, "server.log"), "ab") as log:
                cmd = _server_cmd(cfg, i, root)
                token = secrets.token_urlsafe(24) if cfg.tokens else ""
                pipe = _pass_token(token) if token else None
                if pipe is not None:
                    cmd += ["--token-fd", str(pipe)]
                try:
                    p = subprocess.Popen(
                        cmd,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=log,
                        start_new_session=True,
                        text=True,
                        pass_fds=(pipe,) if pipe is not None else (),
                    )
                finally:
                    if pipe is not None:
                        os.close(pipe)
            procs.append(p)
            members.append(_Server(i, p.pid, root=root, token=token))
            assert p.stdout is not None
            sel.register(p.stdout, selectors.EVENT_READ, i)
        write_state(cfg.state_file, members, os.getpid())
        pending = set(range(cfg.n))
        deadline = time.monotonic() + cfg.start_timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"desktops {sorted(pending)} did not start in time")
            for key, _ in sel.select(timeout=0.5):
                i = key.data
                line = key.fileobj.readline()  # type: ignore[union-attr]
                if not line:
                    code = procs[i].wait()
                    raise RuntimeError(
                        f"desktop {i} exited with code {code}: {_log_tail(members[i])}"
                    )
                with contextlib.suppress(json.JSONDecodeError):
                    msg = json.loads(line)
                    if msg.get("event") == "ready":
                        members[i].url, members[i].display = msg["url"], msg["display"]
                        sel.unregister(key.fileobj)
                        pending.discard(i)
            for i in list(pending):
                if procs[i].poll() is not None:
                    code = procs[i].returncode
                    raise RuntimeError(
                        f"desktop {i} exited with code {code}: {_log_tail(members[i])}"
                    )
        for m in members:
            if not _health(m.url, m.token or None):
                raise RuntimeError(f"desktop {m.index} at {m.url} does not answer GET /platform")
        state = write_state(cfg.state_file, members, os.getpid(), cfg.tokens_file)
        if cfg.tokens_file is not None:
            cfg.tokens_file.parent.mkdir(parents=True, exist_ok=True)
            write_private(cfg.tokens_file, json.dumps({m.url: m.token for m in members}))
    except BaseException:
        down(cfg.state_file, announce=lambda s: None)
        raise
    finally:
        sel.close()
        for p in procs:  # the servers print nothing more; do not keep the pipes open
            if p.stdout is not None:
                p.stdout.close()
    _CHILDREN.update((p.pid, p) for p in procs)
    announce(f"arpo-envs up: {cfg.n} desktops ready in {time.perf_counter() - t0:.2f} s")
    for m in members:
        announce(f"env {m.index} {m.url} display {m.display} pid {m.pid}")
    envs = tuple(FleetEnv(f"desktop-{m.index}", m.url, m.token, m.pid) for m in members)
    return DesktopFleet(cfg.state_file, envs, state)


def _log_tail(m: _Server, lines: int = 5) -> str:
    try:
        text = Path(m.root, "server.log").read_text(errors="replace")
    except OSError:
        return "(no log)"
    return " | ".join(text.strip().splitlines()[-lines:]) or "(empty log)"


def status(state_file: Path | None = None) -> FleetStatus:
    """Which desktops of the state file run (any shell)."""
    path = state_file or default_state_file()
    state = read_state(path)
    if state is None:
        return FleetStatus("desktop", str(path), running=False, stale=False, envs=())
    envs = tuple(
        EnvStatus(f"desktop-{s.index}", s.url, "running" if alive(s.pid) else "exited", s.pid)
        for s in state.servers
    )
    running = any(e.state == "running" for e in envs)
    return FleetStatus("desktop", str(path), running=running, stale=not running, envs=envs)


def down(
    state_file: Path | None = None,
    grace_s: float = GRACE_S,
    announce: Callable[[str], Any] = print,
) -> list[str]:
    """Stop every desktop of the state file; what was done, one line (also announced)."""
    state_file = state_file or default_state_file()
    state = read_state(state_file)
    if state is None:
        line = f"arpo-envs down: no state file {state_file}; nothing to stop"
        announce(line)
        return [line]
    servers = state.servers
    trees = _trees(servers)
    for m in servers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(m.pid, signal.SIGTERM)
    left = wait_gone([m.pid for m in servers], grace_s)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    wait_gone(left, 5)
    left_of_trees = still_running(trees)
    kill_all(left_of_trees)
    wait_gone(left_of_trees, 5)
    for m in servers:  # a server started by this process: reaped, not left a zombie
        child = _CHILDREN.pop(m.pid, None)
        if child is not None:
            child.poll()
    swept = len(left_of_trees)
    for m in servers:
        if not m.root:
            continue
        swept += kill_marked(m.root)
        if m.display.startswith(":"):
            remove_stale_lock(int(m.display[1:]))
        remove_lock_files(Path(m.root))
        shutil.rmtree(m.root, ignore_errors=True)
    up_pid = state.up_pid
    if up_pid and up_pid != os.getpid():
        with contextlib.suppress(ProcessLookupError):
            os.kill(up_pid, signal.SIGTERM)
    with contextlib.suppress(FileNotFoundError):
        state_file.unlink()
    if state.tokens_file:
        with contextlib.suppress(OSError):
            Path(state.tokens_file).unlink()
    line = f"arpo-envs down: stopped {len(servers)} desktops" + (
        f" ({len(left)} killed after {grace_s:g} s, {swept} stray processes swept)"
        if left or swept
        else ""
    )
    announce(line)
    return [line]


def _trees(servers: tuple[DesktopEntry, ...]) -> dict[int, int]:
    """Every process of the servers' trees (pid -> start time): live ones walked now, and
    what each server last recorded (all a server killed hard left behind)."""
    tree: dict[int, int] = {}
    for m in servers:
        if m.root:
            with contextlib.suppress(OSError, ValueError):
                recorded = json.loads(Path(m.root, TREE_FILE).read_text())
                tree.update({int(pid): int(start) for pid, start in recorded.items()})
        if alive(m.pid):
            tree.update(tree_snapshot(m.pid))
    return tree


def orphans(roots: list[str]) -> list[int]:
    """Processes still carrying the marker of any of `roots` (for tests and checks)."""
    return [pid for r in roots for pid in marked_pids(r)]


def wait_foreground(state_file: Path) -> None:
    """Block until SIGINT/SIGTERM or until a server dies, then stop them all."""
    stop = {"why": ""}

    def handler(signum, frame):
        stop["why"] = signal.Signals(signum).name

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)
    state = read_state(state_file)
    pids = [s.pid for s in state.servers] if state is not None else []
    while not stop["why"]:
        dead = [p for p in pids if not alive(p)]
        if dead:
            stop["why"] = f"server(s) {dead} exited"
            break
        time.sleep(0.5)
    print(f"arpo-envs up: stopping ({stop['why']})", flush=True)
    if state_file.exists():
        down(state_file)

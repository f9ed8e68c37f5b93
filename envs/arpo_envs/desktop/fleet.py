"""N local desktops, one server process each: `arpo-envs up` and `arpo-envs down`.

    arpo-envs up -n 8 --base-port 5200       # prints "env <i> <url> <display>", stays up
    arpo-envs up -n 8 --detach               # returns once all answer; stop with `down`
    arpo-envs down                           # from any shell

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
   still carrying a desktop's marker (see `procs`), and removal of stale X lock files
   and LibreOffice lock files of those desktops.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from arpo_envs.desktop.display import remove_stale_lock
from arpo_envs.desktop.home import libreoffice_template, remove_lock_files
from arpo_envs.desktop.procs import (
    TREE_FILE,
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
    """Give every desktop its own random bearer token, listed in the state file (mode 0600)
    as each server's `token` (clients read it from there: `read_tokens`): code on one
    desktop cannot drive another. Required for a host other than loopback."""
    width: int = 1280
    """Screen width of every desktop."""
    height: int = 720
    """Screen height of every desktop."""
    files_template: str | None = None
    """Directory copied into every home on reset."""
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
        if not self.tokens and self.host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(
                f"host {self.host!r} is exposed: set tokens=True (`arpo-envs up --tokens`) so "
                "that every desktop needs its own bearer token"
            )


@dataclass
class Member:
    index: int
    pid: int
    url: str = ""
    display: str = ""
    root: str = ""
    token: str = ""
    """This desktop's bearer token ('' = none)."""


def _server_cmd(cfg: FleetConfig, i: int, root: str) -> list[str]:
    port = 0 if cfg.base_port == 0 else cfg.base_port + i
    cmd = [sys.executable, "-m", "arpo_envs.desktop.server", "--host", cfg.host]
    cmd += ["--port", str(port), "--width", str(cfg.width), "--height", str(cfg.height)]
    cmd += ["--root", root]
    if cfg.files_template:
        cmd += ["--files-template", cfg.files_template]
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


def write_state(path: Path, members: list[Member], up_pid: int | None) -> None:
    """The state file, mode 0600 (it holds the desktops' tokens)."""
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(json.dumps({"up_pid": up_pid, "servers": [asdict(m) for m in members]}))
    os.replace(tmp, path)


def read_tokens(state_file: Path) -> dict[str, str]:
    """URL -> bearer token of every desktop of a state file written by `up`."""
    servers = json.loads(Path(state_file).read_text()).get("servers", [])
    return {s["url"]: s.get("token", "") for s in servers if s.get("url")}


def up(cfg: FleetConfig, announce=print) -> list[Member]:
    """Start the servers; returns once every one answers (stops them all on any failure)."""
    if cfg.state_file.exists() and any(
        _pid_alive(s["pid"]) for s in json.loads(cfg.state_file.read_text()).get("servers", [])
    ):
        raise RuntimeError(
            f"desktops from {cfg.state_file} are still running; `arpo-envs down` first "
            "(or set ARPO_DESKTOP_STATE for a second set)"
        )
    libreoffice_template()  # once here, not raced by N servers
    # The token never goes into a server's environment or command line (a program on the
    # desktop could read /proc/<server>/environ or cmdline): a 0600 file the server reads
    # once and removes before it runs anything.
    env = {k: v for k, v in os.environ.items() if k != "ARPO_ENV_TOKEN"}
    members: list[Member] = []
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
                if token:
                    cfg.state_file.parent.mkdir(parents=True, exist_ok=True)
                    fd, token_file = tempfile.mkstemp(prefix=".token-", dir=cfg.state_file.parent)
                    with os.fdopen(fd, "w") as f:
                        f.write(token)
                    cmd += ["--token-file", token_file]
                p = subprocess.Popen(
                    cmd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    start_new_session=True,
                    text=True,
                )
            procs.append(p)
            members.append(Member(i, p.pid, root=root, token=token))
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
        write_state(cfg.state_file, members, os.getpid())
    except BaseException:
        down(cfg.state_file, announce=lambda s: None)
        raise
    finally:
        sel.close()
        for p in procs:  # the servers print nothing more; do not keep the pipes open
            if p.stdout is not None:
                p.stdout.close()
    announce(f"arpo-envs up: {cfg.n} desktops ready in {time.perf_counter() - t0:.2f} s")
    for m in members:
        announce(f"env {m.index} {m.url} display {m.display} pid {m.pid}")
    return members


def _log_tail(m: Member, lines: int = 5) -> str:
    try:
        text = Path(m.root, "server.log").read_text(errors="replace")
    except OSError:
        return "(no log)"
    return " | ".join(text.strip().splitlines()[-lines:]) or "(empty log)"


def _pid_alive(pid: int) -> bool:
    return bool(wait_gone([pid], 0))


def down(state_file: Path | None = None, grace_s: float = 10.0, announce=print) -> int:
    """Stop every desktop of the state file; returns how many processes had to be swept."""
    state_file = state_file or default_state_file()
    if not state_file.exists():
        announce(f"arpo-envs down: no state file {state_file}; nothing to stop")
        return 0
    state = json.loads(state_file.read_text())
    servers = [Member(**s) for s in state.get("servers", [])]
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
    swept = len(left_of_trees)
    for m in servers:
        if not m.root:
            continue
        swept += kill_marked(m.root)
        if m.display.startswith(":"):
            remove_stale_lock(int(m.display[1:]))
        remove_lock_files(Path(m.root))
        shutil.rmtree(m.root, ignore_errors=True)
    up_pid = state.get("up_pid")
    if up_pid and up_pid != os.getpid():
        with contextlib.suppress(ProcessLookupError):
            os.kill(up_pid, signal.SIGTERM)
    with contextlib.suppress(FileNotFoundError):
        state_file.unlink()
    announce(
        f"arpo-envs down: stopped {len(servers)} desktops"
        + (
            f" ({len(left)} killed after {grace_s:g} s, {swept} stray processes swept)"
            if left or swept
            else ""
        )
    )
    return swept


def _trees(servers: list[Member]) -> dict[int, int]:
    """Every process of the servers' trees (pid -> start time): live ones walked now, and
    what each server last recorded (all a server killed hard left behind)."""
    tree: dict[int, int] = {}
    for m in servers:
        if m.root:
            with contextlib.suppress(OSError, ValueError):
                recorded = json.loads(Path(m.root, TREE_FILE).read_text())
                tree.update({int(pid): int(start) for pid, start in recorded.items()})
        if _pid_alive(m.pid):
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
    state = json.loads(state_file.read_text())
    pids = [s["pid"] for s in state["servers"]]
    while not stop["why"]:
        dead = [p for p in pids if not _pid_alive(p)]
        if dead:
            stop["why"] = f"server(s) {dead} exited"
            break
        time.sleep(0.5)
    print(f"arpo-envs up: stopping ({stop['why']})", flush=True)
    if state_file.exists():
        down(state_file)

"""`arpo-envs up` / `arpo-envs down` with real desktops: endpoints answer, nothing is left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from arpo_envs.desktop.fleet import orphans
from arpo_envs.procs import MARKER
from test_desktop_common import ESCAPE, Desk, pids_running, require_desktop
from test_desktop_common import wait_until as until

CLI = [sys.executable, "-m", "arpo_envs.cli"]


def _desk(member: dict) -> Desk:
    return Desk(member["url"], member["display"], member["root"], "/home/user", member["pid"], None)


def _soffice_pids(roots: list[str]) -> set[int]:
    """LibreOffice processes of the desktops at `roots` (by the marker in their
    environment: other desktops on the machine, e.g. a training run's, do not count)."""
    marks = {f"{MARKER}={r}".encode() for r in roots}
    out = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if b"soffice.bin" not in Path(f"/proc/{entry.name}/cmdline").read_bytes():
                    continue
                env = set(Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0"))
                if env & marks:
                    out.add(int(entry.name))
            except OSError:
                pass
    return out


def _assert_nothing_left(members: list[dict], state: Path) -> None:
    roots = [m["root"] for m in members]
    assert orphans(roots) == [], "processes of a stopped desktop are still running"
    for m in members:
        n = m["display"][1:]
        assert not Path(f"/tmp/.X{n}-lock").exists(), f"stale lock of display :{n}"
        assert not Path(f"/tmp/.X11-unix/X{n}").exists()
        assert not Path(m["root"]).exists()
        assert not _pid_alive(m["pid"])
    assert not state.exists()


def _pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_up_detached_then_down_leaves_no_orphans(tmp_path) -> None:
    require_desktop()
    state = tmp_path / "state.json"
    try:
        r = subprocess.run(
            [*CLI, "up", "-n", "2", "--base-port", "0", "--detach", "--state", str(state)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.count("\nenv ") == 2, r.stdout
        members = json.loads(state.read_text())["servers"]
        assert len({m["display"] for m in members}) == 2
        assert len({m["url"] for m in members}) == 2
        roots = [m["root"] for m in members]
        before = _soffice_pids(roots)
        for m in members:
            d = _desk(m)
            assert d.get("/platform").text == "Linux"
            assert d.get("/terminal").json()["status"] == "success"
        # leave real apps running: Calc (soffice.bin, its lock file) and an xterm
        d = _desk(members[0])
        d.sh("printf 'x,y\\n1,2\\n' > ~/t.csv")
        assert d.post("/setup/open_file", {"path": "/home/user/t.csv"}).status == 200
        assert Path(members[0]["root"], "home", ".~lock.t.csv#").exists()
        _desk(members[1]).post("/setup/launch", {"command": ["xterm"]})
        # a process that is no X client does not die with the display: down must find it
        _desk(members[1]).post("/setup/launch", {"command": ["sleep", "300"]})
        # nor one without the marker in a session of its own, on either server
        for i, m in enumerate(members):
            d = _desk(m)
            assert d.post("/execute", {"command": ESCAPE.format(n=784 + i), "shell": True})
            assert d.post("/run_bash_script", {"script": ESCAPE.format(n=786 + i)})
        escaped = [["sleep", str(n)] for n in range(784, 788)]
        until(lambda: all(pids_running(a) for a in escaped))
        time.sleep(1.5)  # the hard-killed server has recorded its tree
        until(lambda: _soffice_pids(roots) - before)
        assert orphans([m["root"] for m in members])
        # a server killed hard cannot clean up after itself
        os.kill(members[1]["pid"], signal.SIGKILL)
        until(lambda: not _pid_alive(members[1]["pid"]))
    finally:
        down = subprocess.run(
            [*CLI, "down", "--state", str(state)], capture_output=True, text=True, timeout=60
        )
    assert down.returncode == 0, down.stderr
    assert "stopped 2 desktops" in down.stdout
    _assert_nothing_left(members, state)
    assert not (_soffice_pids(roots) - before)
    assert [p for a in escaped for p in pids_running(a)] == []


def test_up_in_the_foreground_stops_everything_on_sigterm(tmp_path) -> None:
    require_desktop()
    state = tmp_path / "state.json"
    out_file = tmp_path / "up.out"
    with open(out_file, "w") as out:
        proc = subprocess.Popen(
            [*CLI, "up", "-n", "2", "--base-port", "0", "--state", str(state)], stdout=out
        )
    try:
        until(lambda: out_file.read_text().count("\nenv ") == 2 or proc.poll(), timeout=120)
        assert proc.poll() is None, out_file.read_text()
        members = json.loads(state.read_text())["servers"]
        for m in members:
            assert _desk(m).get("/platform").text == "Linux"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            subprocess.run([*CLI, "down", "--state", str(state)], timeout=60)
            proc.wait(timeout=30)
    assert proc.returncode == 0
    assert "stopped 2 desktops" in out_file.read_text()
    _assert_nothing_left(members, state)


def test_vm_up_flags_set_the_fleets_fork_bounds() -> None:
    """`arpo-envs vm up` sets every bound of the fleet's forks, and a bad one stops it with
    the field named before any VM starts."""
    from arpo_envs.cli import _vm_config, build_parser

    args = build_parser().parse_args(
        ["vm", "up", "--max-clones", "2", "--max-snapshots", "1", "--snapshot-ttl", "60",
         "--snapshot-ram-dir", "/tmp"]
    )  # fmt: skip
    cfg = _vm_config(args)
    assert (cfg.max_clones, cfg.max_snapshots, cfg.snapshot_ttl_s, cfg.snapshot_ram_dir) == (
        2, 1, 60.0, "/tmp"
    )  # fmt: skip
    out = subprocess.run(
        [*CLI, "vm", "up", "--snapshot-ttl", "0"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1 and "snapshot_ttl_s must be > 0" in out.stderr, out.stderr

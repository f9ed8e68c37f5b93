"""The desktop's bearer token never reaches a program on the desktop.

`arpo-envs up` hands each server its token in a 0600 file the server reads and removes before it
runs anything: not in its environment, not on its command line. A program run through
`/execute` reads the server's /proc environ and cmdline, its parent's and its own, and finds
no token. Before: `tr '\\0' '\\n' < /proc/$PPID/environ | grep TOKEN` printed it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from test_desktop_common import Desk, require_desktop

CLI = [sys.executable, "-m", "arpo_envs.cli"]
SECRET = "tok-" + os.urandom(8).hex()


def test_no_program_on_the_desktop_can_read_its_token(tmp_path) -> None:
    require_desktop()
    state = tmp_path / "state.json"
    env = {**os.environ, "ARPO_ENV_TOKEN": SECRET}
    try:
        r = subprocess.run(
            [*CLI, "up", "-n", "1", "--base-port", "0", "--detach", "--state", str(state)],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        (m,) = json.loads(state.read_text())["servers"]
        d = Desk(m["url"], m["display"], m["root"], "/home/user", m["pid"], None, token=SECRET)
        assert d.get("/platform", token=False).status == 401
        assert d.get("/platform").status == 200
        script = (
            f"for f in /proc/{m['pid']}/environ /proc/{m['pid']}/cmdline /proc/$PPID/environ "
            "/proc/$PPID/cmdline /proc/self/environ; do tr '\\0' '\\n' < $f; done; "
            "env; echo END"
        )
        out = d.sh(script)["output"]
        assert "END" in out and out.count("PATH=") >= 3  # the environments were readable
        assert SECRET not in out, "a program on the desktop read the token"
        assert not list(state.parent.glob(".token-*")), "the token file was left behind"
    finally:
        subprocess.run([*CLI, "down", "--state", str(state)], capture_output=True, timeout=60)

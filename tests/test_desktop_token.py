"""The desktop's bearer token never reaches a program on the desktop, and each desktop has its own.

`arpo-envs up --tokens` hands each server its own random token in a 0600 file the server reads
and removes before it runs anything: not in its environment, not on its command line; the
state file (mode 0600) lists each desktop's token. A program run through `/execute` reads the
server's /proc environ and cmdline, its parent's and its own, and finds no token; one desktop's
token is refused by the other. Before: `tr '\\0' '\\n' < /proc/$PPID/environ | grep TOKEN`
printed the token, and every desktop of `up` had the same one.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

from arpo_envs.desktop.fleet import read_tokens
from test_desktop_common import Desk, require_desktop, running_desk

CLI = [sys.executable, "-m", "arpo_envs.cli"]
SECRET = "tok-" + os.urandom(8).hex()


def test_no_program_on_the_desktop_can_read_its_token_and_each_has_its_own(tmp_path) -> None:
    require_desktop()
    state = tmp_path / "state.json"
    # A token in the caller's environment is not handed on to the servers either.
    env = {**os.environ, "ARPO_ENV_TOKEN": SECRET}
    try:
        r = subprocess.run(
            [*CLI, "up", "-n", "2", "--base-port", "0", "--tokens", "--detach", "--state",
             str(state)],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert stat.S_IMODE(state.stat().st_mode) == 0o600
        servers = json.loads(state.read_text())["servers"]
        assert read_tokens(state) == {m["url"]: m["token"] for m in servers}
        a, b = (
            Desk(m["url"], m["display"], m["root"], "/home/user", m["pid"], None, token=m["token"])
            for m in servers
        )
        assert a.token and b.token and a.token != b.token
        assert a.get("/platform", token=False).status == 401
        assert a.get("/platform").status == 200 and b.get("/platform").status == 200
        assert a.get("/platform", token=b.token).status == 401
        assert b.get("/platform", token=a.token).status == 401
        pid = servers[0]["pid"]
        script = (
            f"for f in /proc/{pid}/environ /proc/{pid}/cmdline /proc/$PPID/environ "
            "/proc/$PPID/cmdline /proc/self/environ; do tr '\\0' '\\n' < $f; done; "
            "env; echo END"
        )
        out = a.sh(script)["output"]
        assert "END" in out and out.count("PATH=") >= 3  # the environments were readable
        for secret in (a.token, b.token, SECRET):
            assert secret not in out, "a program on the desktop read a token"
        assert not list(state.parent.glob(".token-*")), "a token file was left behind"
    finally:
        subprocess.run([*CLI, "down", "--state", str(state)], capture_output=True, timeout=60)


def test_a_token_given_by_hand_still_works_and_the_log_says_programs_can_read_it(
    tmp_path,
) -> None:
    require_desktop()
    with running_desk(tmp_path / "d", "--token", SECRET) as d:
        assert d.get("/platform", token=False).status == 401
        assert d.get("/platform", token=SECRET).status == 200
    log = (tmp_path / "d" / "server.log").read_text()
    assert "programs on this desktop can read it" in log

"""The desktop's bearer token never reaches a program on the desktop, and each desktop has its own.

`arpo-envs up --tokens` (`fleet.up`) hands each server its own random token through an
inherited pipe the server reads and closes before it runs anything: not in its environment,
not on its command line, in no file. The state file keeps only each token's sha256; the
tokens are the caller's (in memory, or a 0600 `tokens_file` where the caller asks). A
program run through `/execute` reads the server's /proc environ, cmdline and stdout, its
parent's and its own, and the server's log, and finds no token; no file `up` writes but the
tokens file holds one; one desktop's token is refused by the other. Before: `tr '\\0' '\\n' < /proc/$PPID/environ | grep TOKEN` printed
the token, then the state file listed every desktop's token, and a malformed request put
the token into the server's log (its stdout, /proc/<pid>/fd/1).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

from arpo_envs.desktop.fleet import down, read_tokens
from test_desktop_common import Desk, require_desktop, running_desk

SECRET = "tok-" + os.urandom(8).hex()


def _malformed_request(url: str, token: str) -> bytes:
    """A request whose Authorization line aiohttp cannot parse (a control character after
    the token): aiohttp quotes that line in its error. Returns the answer's head."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /platform HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                  + token.encode() + b"\x01\r\n\r\n")  # fmt: skip
        return s.recv(1 << 16)


def test_no_program_on_the_desktop_can_read_its_token_and_each_has_its_own(
    tmp_path: Path,
) -> None:
    require_desktop()
    state, tokens_file = tmp_path / "state.json", tmp_path / "keys" / "tokens.json"
    # `up` in a process of its own that returns once the desktops answer (as a detached
    # `arpo-envs up`); a token in its environment is not handed on to the servers either.
    starter = (
        "from pathlib import Path\n"
        "from arpo_envs.desktop.fleet import FleetConfig, up\n"
        f"up(FleetConfig(n=2, base_port=0, tokens=True, state_file=Path({str(state)!r}), "
        f"tokens_file=Path({str(tokens_file)!r})), announce=lambda *a: None)\n"
    )
    env = {**os.environ, "ARPO_ENV_TOKEN": SECRET}
    try:
        r = subprocess.run([sys.executable, "-c", starter], capture_output=True, text=True,
                           timeout=120, env=env)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert stat.S_IMODE(state.stat().st_mode) == 0o600
        assert stat.S_IMODE(tokens_file.stat().st_mode) == 0o600
        tokens = read_tokens(tokens_file)
        servers = json.loads(state.read_text())["servers"]
        assert sorted(tokens) == sorted(m["url"] for m in servers)
        a, b = (
            Desk(m["url"], m["display"], m["root"], "/home/user", m["pid"], None,
                 token=tokens[m["url"]])
            for m in servers
        )  # fmt: skip
        assert a.token and b.token and a.token != b.token
        # the state file: each token's hash, never a token
        assert [s["token_sha256"] for s in servers] == [
            hashlib.sha256(t.encode()).hexdigest() for t in (a.token, b.token)
        ]
        assert a.token not in state.read_text() and b.token not in state.read_text()
        assert a.get("/platform", token=False).status == 401
        assert a.get("/platform").status == 200 and b.get("/platform").status == 200
        assert a.get("/platform", token=b.token).status == 401
        assert b.get("/platform", token=a.token).status == 401
        assert _malformed_request(a.url, a.token).startswith(b"HTTP/1.")  # now in a's log?
        pid = servers[0]["pid"]
        script = (
            f"for f in /proc/{pid}/environ /proc/{pid}/cmdline /proc/$PPID/environ "
            f"/proc/$PPID/cmdline /proc/self/environ /proc/{pid}/fd/1 /proc/{pid}/fd/2 "
            f"{a.root}/server.log {state}; do tr '\\0' '\\n' < $f; done; "
            "env; echo END"
        )
        out = a.sh(script)["output"]
        # as root the server runs its programs as another user (test_desktop_user.py): the
        # server's environ and log are refused to them; else they read them, without a token
        other_user = a.sh("id -u")["output"].strip() != str(os.getuid())
        assert "END" in out and out.count("PATH=") >= (2 if other_user else 3)
        assert ("malformed request refused" in out) != other_user  # the server's log
        for secret in (a.token, b.token, SECRET):
            assert secret not in out, "a program on the desktop read a token"
        for m in servers:  # nothing `up` wrote holds a token, but the file asked for
            for f in [*Path(m["root"]).glob("*.log"), *Path(m["root"]).glob("logs/*.log")]:
                assert a.token not in f.read_text(errors="replace"), f
        assert not list(state.parent.glob(".token-*")), "a token file was left behind"
    finally:
        down(state, announce=lambda *a: None)
    assert not tokens_file.exists(), "down leaves the tokens file behind"


def test_a_malformed_request_with_the_token_is_logged_without_it(tmp_path: Path) -> None:
    """The server's log is its stderr (and stdout, /proc/<pid>/fd/1): aiohttp's error for a
    header it cannot parse quoted the Authorization line, token included."""
    require_desktop()
    with running_desk(tmp_path / "d", token=SECRET) as d:
        assert _malformed_request(d.url, SECRET).startswith(b"HTTP/1.0 400")
        assert d.get("/platform").status == 200  # it keeps serving
        time.sleep(0.2)
        assert os.path.realpath(f"/proc/{d.pid}/fd/1") == os.path.realpath(d.log)
    log = (tmp_path / "d" / "server.log").read_text()
    assert "malformed request refused (BadHttpMessage 400" in log
    assert SECRET not in log and "Traceback" not in log


def test_a_token_given_by_hand_still_works_and_the_log_says_programs_can_read_it(
    tmp_path,
) -> None:
    require_desktop()
    with running_desk(tmp_path / "d", "--token", SECRET) as d:
        assert d.get("/platform", token=False).status == 401
        assert d.get("/platform", token=SECRET).status == 200
    log = (tmp_path / "d" / "server.log").read_text()
    assert "programs on this desktop can read it" in log

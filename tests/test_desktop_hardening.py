"""The local desktop against what an adversarial episode leaves behind (real Xvfb, no mocks):
files in /tmp, answers too big to send, held keys, a grabbed X server.

One server process serves most tests; the test that grabs the display starts its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from arpo_envs.desktop.executor import MAX_ANSWER_BYTES
from arpo_envs.procs import marked_pids
from test_desktop_common import Desk, require_desktop, running_desk, start_desk, stop_desk_proc
from test_desktop_common import wait_until as until


@pytest.fixture(scope="module")
def desk(tmp_path_factory) -> Desk:
    require_desktop()
    root = tmp_path_factory.mktemp("hard")
    d = start_desk(root, "--execute-timeout", "30")
    # where a fresh desktop has the pointer, before anything moved it
    d.fresh_pointer = d.get("/cursor_position").json()  # type: ignore[attr-defined]
    yield d
    stop_desk_proc(d.proc)
    assert d.proc.returncode == 0
    assert marked_pids(d.root) == [], "processes of the desktop outlived its server"


@pytest.fixture
def clean(desk: Desk) -> Desk:
    assert desk.post("/reset").status == 200
    return desk


def _namespaced(desk: Desk) -> bool:
    """The server runs in its private mount namespace (root or CAP_SYS_ADMIN)."""
    return desk.get("/desktop/info").json().get("private_tmp", False)


# ---- 1. /tmp is the desktop's own and a reset empties it ----------------------------------------


def test_reset_empties_the_desktops_tmp_and_the_hosts_tmp_never_sees_it(clean: Desk) -> None:
    name = f"arpo-hardening-{os.getpid()}-{time.monotonic_ns()}.bin"
    # 20 MB through a shell command, as an agent's `dd of=/tmp/...` would
    r = clean.sh(f"head -c 20000000 /dev/zero > /tmp/{name} && ls -l /tmp/{name}")
    assert r["returncode"] == 0, r
    tmpdir = clean.sh('printf %s "$TMPDIR"')["output"]
    r = clean.sh(f'head -c 1000 /dev/zero > "$TMPDIR/t-{name}"')
    assert r["returncode"] == 0, r
    if _namespaced(clean):
        assert tmpdir == "/tmp"
        assert not os.path.exists(f"/tmp/{name}"), "the host's /tmp received the desktop's file"
    else:
        assert Path(tmpdir).is_relative_to(clean.root)
    assert clean.file(f"/tmp/{name}").status == 200
    body = clean.post("/reset").json()
    assert body["tmp_bytes"] >= 1000
    assert clean.sh(f'ls -A /tmp/{name} "$TMPDIR/t-{name}"')["returncode"] != 0
    assert clean.file(f"/tmp/{name}").status == 404
    # the display still works for apps (its socket is reachable from the desktop's /tmp)
    assert clean.sh("xdotool getmouselocation")["returncode"] == 0


def test_the_desktops_tmp_is_bounded(clean: Desk) -> None:
    if not _namespaced(clean):
        pytest.skip("no private mount namespace: /tmp is the host's, bounded only by reset")
    limit = clean.get("/desktop/info").json()["tmp_max_bytes"]
    r = clean.sh(f"head -c {limit + (1 << 20)} /dev/zero > /tmp/big; echo rc=$?; df -B1 /tmp")
    assert "rc=0" not in r["output"], r
    assert "No space left" in r["error"], r
    assert clean.post("/reset").json()["tmp_bytes"] <= limit
    assert clean.sh("ls -A /tmp/big")["returncode"] != 0


# ---- 2. the answer of /execute is bounded, whatever the program printed ---------------------------


def test_an_answer_of_nul_bytes_on_both_streams_is_bounded_and_says_it_was_cut(
    clean: Desk,
) -> None:
    code = (
        "import sys; sys.stdout.buffer.write(bytes(16 << 20)); "
        "sys.stderr.buffer.write(bytes(16 << 20))"
    )
    for path, body in (
        ("/execute", {"command": ["python3", "-c", code], "shell": False}),
        ("/execute", {"command": f'python3 -c "{code}"', "shell": True}),
        ("/run_python", {"code": code}),
        ("/run_bash_script", {"script": f'python3 -c "{code}"'}),
    ):
        a = clean.post(path, body, timeout=120)
        assert a.status == 200, a.body[:300]
        assert len(a.body) <= MAX_ANSWER_BYTES, (path, len(a.body))
        answer = a.json()
        text = answer.get("output", "") + answer.get("error", "")
        assert "[answer truncated:" in text, path
    # the whole 16 MiB of a plain text stream still comes through
    big = clean.sh("head -c 16000000 /dev/zero | tr '\\0' a")
    assert len(big["output"]) == 16000000


def test_the_server_does_not_balloon_on_escaped_output(clean: Desk) -> None:
    code = "import sys; sys.stdout.buffer.write(bytes(16 << 20)); sys.stderr.buffer.write(bytes(16 << 20))"
    clean.post("/execute", {"command": ["python3", "-c", code]}, timeout=120)
    status = Path(f"/proc/{clean.pid}/status").read_text()
    hwm_kb = int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1])
    assert hwm_kb < 400 * 1024, f"server memory peaked at {hwm_kb // 1024} MiB"


# ---- 3. reset releases held keys and buttons and puts the pointer back -----------------------------


def _held(display: str) -> tuple[list[int], int]:
    from Xlib import X
    from Xlib.display import Display

    d = Display(display)
    try:
        keymap = d.query_keymap()
        mask = d.screen().root.query_pointer().mask
    finally:
        d.close()
    keys = [i * 8 + b for i, byte in enumerate(keymap) for b in range(8) if byte >> b & 1]
    buttons = mask & (X.Button1Mask | X.Button2Mask | X.Button3Mask | X.Button4Mask | X.Button5Mask)
    return keys, buttons


def test_reset_releases_every_key_and_button_and_puts_the_pointer_where_a_fresh_desktop_has_it(
    desk: Desk, clean: Desk
) -> None:
    fresh = desk.fresh_pointer  # type: ignore[attr-defined]
    for corner in ((0, 0), (1279, 719)):
        clean.act(
            "pyautogui.keyDown('shift'); pyautogui.keyDown('a'); pyautogui.keyDown('ctrlright');"
            f" pyautogui.mouseDown(button='right'); pyautogui.moveTo{corner}"
        )
        keys, buttons = _held(clean.display)
        assert keys and buttons, "the episode did not hold anything down"
        assert clean.post("/reset").status == 200
        assert _held(clean.display) == ([], 0)
        assert clean.get("/cursor_position").json() == fresh


# ---- 4. a grabbed display: fast 503s, and reset recovers ------------------------------------------

GRAB = """
import time
from Xlib.display import Display
d = Display()
d.grab_server()
d.sync()
print('grabbed', flush=True)
time.sleep(3600)
"""


def test_a_grabbed_display_answers_503_fast_and_reset_recovers(tmp_path) -> None:
    require_desktop()
    with running_desk(tmp_path / "g") as d:
        script = Path(d.root) / "grab.py"  # the desktop's /tmp is not the host's
        script.write_text(GRAB)
        assert d.post("/setup/launch", {"command": ["python3", str(script)]}).status == 200
        log = Path(d.root) / "logs" / "launched.log"
        until(lambda: log.exists() and "grabbed\n" in log.read_text().splitlines(True), timeout=20)
        for path, method, body in (
            ("/screenshot", "GET", None),
            ("/cursor_position", "GET", None),
            ("/accessibility", "GET", None),
            (
                "/execute",
                "POST",
                {"command": ["python", "-c", "import pyautogui; pyautogui.click(5, 5)"]},
            ),
            ("/setup/activate_window", "POST", {"window_name": "x"}),
        ):
            t0 = time.monotonic()
            a = d.request(method, path, json_body=body, timeout=30)
            took = time.monotonic() - t0
            assert a.status == 503, (path, a.status, a.body[:300])
            assert "X display" in json.loads(a.body)["message"], a.body
            assert took < 5, (path, took)
        t0 = time.monotonic()
        body = d.post("/reset", timeout=60).json()
        took = time.monotonic() - t0
        assert body["status"] == "success", body
        assert took < 20, took
        shot = d.get("/screenshot", timeout=10)
        assert shot.status == 200 and shot.body[:4] == b"\x89PNG"
        out = d.act("pyautogui.moveTo(50, 60); print(pyautogui.position())", timeout=20)
        assert out["output"] == "Point(x=50, y=60)\n"
        assert body["display_restarted"] is False  # killing the grabbing program was enough

        # a grab held by a process that is not the desktop's: reset restarts the display
        env = {**os.environ, "DISPLAY": d.display}
        outsider = subprocess.Popen(
            [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True
        )
        try:
            assert outsider.stdout is not None and outsider.stdout.readline() == "grabbed\n"
            assert d.get("/screenshot", timeout=10).status == 503
            t0 = time.monotonic()
            body = d.post("/reset", timeout=60).json()
            assert body["status"] == "success" and body["display_restarted"] is True, body
            assert time.monotonic() - t0 < 20
            assert d.get("/screenshot", timeout=10).status == 200
            assert d.get("/cursor_position", timeout=10).json() == [640, 360]
        finally:
            outsider.kill()
            outsider.communicate()


# ---- 5. the fork executor under concurrency -------------------------------------------------

DAEMON = """
import os, sys, time
if os.fork() == 0:  # a daemon that keeps the program's stdout and stderr open
    os.setsid()
    with open(os.path.expanduser("~/daemon.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
    os._exit(0)
print("parent done", flush=True)
"""


def test_concurrent_programs_one_leaving_a_daemon_each_answered_alone(clean: Desk) -> None:
    """Eight programs at once through the warm executor, one of them leaving a daemon that
    holds its stdout and stderr: each answer is its own program's, none waits for the
    daemon, the server answers a screenshot meanwhile, and a reset kills the daemon."""
    from concurrent.futures import ThreadPoolExecutor

    def run(i: int) -> tuple[int, dict, float]:
        t0 = time.monotonic()
        if i == 3:
            a = clean.post("/execute", {"command": ["python", "-c", DAEMON]}, timeout=60)
            assert a.status == 200, a.body
            return i, a.json(), time.monotonic() - t0
        out = clean.act(f"time.sleep(0.2); print('program {i}', pyautogui.size())", timeout=60)
        return i, out, time.monotonic() - t0

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(run, i) for i in range(8)]
        shot = clean.get("/screenshot", timeout=30)
        results = [f.result() for f in futures]
    assert shot.status == 200 and shot.body[:4] == b"\x89PNG"
    for i, out, took in results:
        want = "parent done\n" if i == 3 else f"program {i} Size(width=1280, height=720)\n"
        assert out["output"] == want and out["returncode"] == 0, (i, out)
        assert took < 20, (i, took)  # the daemon's open pipes hold no answer
    pid = int(until(lambda: clean.sh("cat ~/daemon.pid 2>/dev/null")["output"].strip()))
    assert Path(f"/proc/{pid}").exists(), "the daemon runs until the reset"
    assert clean.post("/reset").status == 200
    until(lambda: not Path(f"/proc/{pid}").exists() or b"Z" in _state(pid), timeout=10)


def _state(pid: int) -> bytes:
    """The process state letter(s) of `pid` (b"Z": a zombie), b"" when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return b""

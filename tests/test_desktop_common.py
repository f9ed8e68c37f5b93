"""Helpers of the local desktop tests: start a real desktop server process, talk HTTP to it.

It holds no tests; the other tests/test_desktop_*.py import it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

NEEDED = ("Xvfb", "openbox", "soffice", "mousepad", "xterm", "xdotool", "wmctrl")


def require_desktop() -> None:
    """Skip (fail under CI, where `make sysdeps` must have installed them) without the apps."""
    missing = [b for b in NEEDED if shutil.which(b) is None]
    if missing:
        msg = f"local desktop needs {missing}: run `make sysdeps`"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


@dataclass
class Answer:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode()


@dataclass
class Desk:
    """A running desktop server process."""

    url: str
    display: str
    root: str
    home: str
    pid: int
    proc: subprocess.Popen
    token: str | None = None
    log: Path | None = None
    """The server's stderr (where it logs)."""

    def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        raw: bytes | None = None,
        form: dict[str, str] | None = None,
        token: str | bool | None = True,
        timeout: float = 60.0,
        headers: dict[str, str] | None = None,
    ) -> Answer:
        headers = dict(headers or {})
        data = raw
        if json_body is not None:
            data = json.dumps(json_body).encode()
            headers["Content-Type"] = "application/json"
        elif form is not None:
            data = urllib.parse.urlencode(form).encode()
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        tok = self.token if token is True else (token or None)
        if tok:
            headers["Authorization"] = f"Bearer {tok}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return Answer(r.status, r.read())
        except urllib.error.HTTPError as e:
            with e:
                return Answer(e.code, e.read())

    def get(self, path: str, **kw) -> Answer:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any = None, **kw) -> Answer:
        return self.request("POST", path, json_body=body if body is not None else {}, **kw)

    def act(self, code: str, timeout: float = 60.0) -> dict:
        """An action as OSWorld's controller sends it."""
        prefix = "import pyautogui; import time; pyautogui.FAILSAFE = False; "
        a = self.post("/execute", {"command": ["python", "-c", prefix + code]}, timeout=timeout)
        assert a.status == 200, a.body
        return a.json()

    def sh(self, script: str) -> dict:
        a = self.post("/execute", {"command": script, "shell": True})
        assert a.status == 200, a.body
        return a.json()

    def windows(self) -> list[str]:
        """Titles of the top-level windows (from the minimal accessibility tree)."""
        import xml.etree.ElementTree as ET

        at = self.get("/accessibility").json()["AT"]
        return [f.get("name", "") for f in ET.fromstring(at).iter("frame")]

    def file(self, path: str) -> Answer:
        return self.request("POST", "/file", form={"file_path": path})


def start_desk(root: Path, *args: str, token: str | None = None, timeout: float = 60) -> Desk:
    cmd = [sys.executable, "-m", "arpo_envs.desktop.server", "--port", "0", "--root", str(root)]
    cmd += list(args)
    env = dict(os.environ)
    env.pop("ARPO_ENV_TOKEN", None)
    root.mkdir(parents=True, exist_ok=True)
    if token:  # a 0600 file the server reads and removes, as `arpo-envs up --tokens` does
        fd = os.open(root / ".token", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        cmd += ["--token-file", str(root / ".token")]
    log = root / "server.log"
    with open(log, "ab") as err:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    line = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            break
        if proc.poll() is not None:
            break
    proc.stdout.close()
    if not line:
        stop_desk_proc(proc)
        raise RuntimeError(
            f"desktop server did not start (exit code {proc.poll()}): {log.read_text()[-2000:]}"
        )
    info = json.loads(line)
    return Desk(
        info["url"], info["display"], info["root"], info["home"], info["pid"], proc, token, log
    )


def stop_desk_proc(proc: subprocess.Popen, timeout: float = 15) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def running_desk(root: Path, *args: str, token: str | None = None) -> Iterator[Desk]:
    desk = start_desk(root, *args, token=token)
    try:
        yield desk
    finally:
        stop_desk_proc(desk.proc)


ESCAPE = "env -u ARPO_DESKTOP_ROOT setsid sleep {n} &"
"""A shell command whose child drops the desktop's marker and leaves the command's session."""


def pids_running(argv: list[str]) -> list[int]:
    """Live processes whose command line is exactly `argv`."""
    needle = b"\0".join(a.encode() for a in argv) + b"\0"
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if Path(f"/proc/{entry.name}/cmdline").read_bytes() != needle:
                continue
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] != "Z":
            found.append(int(entry.name))
    return found


def wait_until(fn: Callable[[], Any], timeout: float = 20.0, interval: float = 0.1) -> Any:
    """fn()'s first truthy value; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout} s (last value {value!r})")
        time.sleep(interval)

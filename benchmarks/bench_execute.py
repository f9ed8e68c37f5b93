"""Latency of one /execute on a real local desktop: the fast path vs a subprocess per action.

    .venv/bin/python benchmarks/bench_execute.py               # 200 calls per row
    .venv/bin/python benchmarks/bench_execute.py --calls 50

Starts two desktop servers (Xvfb + openbox, no applications): one default (`python -c`
pyautogui code on the fast path) and one with `--no-inprocess` (every action a new
interpreter, as OSWorld's own server runs it). Before any timing, each server is
checked: a moveTo lands where it was sent and both answer a failing program with the
same return code and last traceback line. Then the rows alternate call by call, so a
machine busy with something else slows both alike. One call = POST /execute of
`pyautogui.moveTo(x, y)` sent as OSWorld's controller sends it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator

from _machine import run_header

PREFIX = "import pyautogui; import time; pyautogui.FAILSAFE = False; "


@contextlib.contextmanager
def server(*args: str) -> Iterator[str]:
    root = tempfile.mkdtemp(prefix="arpo-bench-exec-")
    cmd = [sys.executable, "-m", "arpo_envs.desktop.server", "--port", "0", "--root", root]
    proc = subprocess.Popen(
        [*cmd, *args], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True
    )
    assert proc.stdout is not None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else b""
        if not line:
            raise RuntimeError(f"desktop server did not start (exit code {proc.poll()})")
        yield json.loads(line)["url"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def execute(url: str, code: str) -> dict:
    body = json.dumps({"command": ["python", "-c", PREFIX + code]}).encode()
    req = urllib.request.Request(
        url + "/execute", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def check(url: str) -> tuple[int, str]:
    out = execute(url, "pyautogui.moveTo(321, 234); print(tuple(pyautogui.position()))")
    assert out["output"] == "(321, 234)\n", out
    bad = execute(url, "print('x'); 1 / 0")
    return bad["returncode"], bad["error"].splitlines()[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200, help="calls per row")
    args = ap.parse_args()
    with server() as fast, server("--no-inprocess") as slow:
        assert check(fast) == check(slow), (check(fast), check(slow))
        times: dict[str, list[float]] = {"fast path": [], "subprocess": []}
        for i in range(args.calls):
            for name, url in (("fast path", fast), ("subprocess", slow)):
                t0 = time.perf_counter()
                res = execute(url, f"pyautogui.moveTo({100 + i % 500}, 200)")
                times[name].append(time.perf_counter() - t0)
                assert res["returncode"] == 0, res
    header = run_header()
    print(
        f"/execute of one pyautogui.moveTo, {args.calls} calls per row, "
        f"{header['date']}, commit {header['commit']}, "
        f"load average {header['load_average'][0]:.2f}, {header['machine']}"
    )
    print("| row | median ms | p90 ms | min ms |\n|---|---:|---:|---:|")
    for name, xs in times.items():
        xs.sort()
        med, p90, low = statistics.median(xs), xs[int(0.9 * len(xs))], xs[0]
        print(f"| {name} | {med * 1e3:.1f} | {p90 * 1e3:.1f} | {low * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Step latency and throughput of simulated desktops, measured over HTTP like an actor sees them.

    arpo-envs sim-bench -n 8 --episodes 20        # 8 desktops in a child process

The desktops run in a child `arpo-envs sim` process (so client and server do not share
one event loop); each of `n` concurrent clients plays oracle episodes: load a scene,
then per step one screenshot and one /execute, then the checker. Every episode must
end solved before any timing is reported (a benchmark that measures a broken
environment measures nothing). Reports the median and p90 of each request and the
total steps per second. Run it alone on the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp

from arpo_envs.sim.tasks import FAMILIES, generate_tasks

PREFIX = "import pyautogui; import time; pyautogui.FAILSAFE = False; "


@dataclass
class Timings:
    screenshot: list[float] = field(default_factory=list)
    execute: list[float] = field(default_factory=list)
    steps: int = 0
    episodes: int = 0


@contextlib.contextmanager
def child_desktops(n: int, extra: list[str]) -> Iterator[list[str]]:
    """Start `arpo-envs sim -n <n>` in a child process; yields the desktops' URLs."""
    cmd = [sys.executable, "-m", "arpo_envs.cli", "sim", "-n", str(n), "--base-port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        urls: list[str] = []
        assert proc.stdout is not None
        while len(urls) < n:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the desktops did not start (exit code {proc.poll()})")
            if line.startswith("env "):
                urls.append(line.split()[2])
        yield urls
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _client(url: str, tasks: list[dict], t: Timings) -> None:
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        for task in tasks:
            params = task["config"][0]["parameters"]
            async with s.post(f"{url}/sim/scene", json=params) as r:
                r.raise_for_status()
            for code in task["oracle"]:
                t0 = time.perf_counter()
                async with s.get(f"{url}/screenshot") as r:
                    r.raise_for_status()
                    await r.read()
                t1 = time.perf_counter()
                body = {"command": ["python", "-c", PREFIX + code], "shell": False}
                async with s.post(f"{url}/execute", json=body) as r:
                    r.raise_for_status()
                    res = await r.json()
                t2 = time.perf_counter()
                if res["returncode"] != 0:
                    raise RuntimeError(f"oracle step failed: {res['error']}")
                t.screenshot.append(t1 - t0)
                t.execute.append(t2 - t1)
                t.steps += 1
            ev = task["evaluator"]
            async with s.post(f"{url}/sim/state", json={"path": ev["result"]["path"]}) as r:
                value = (await r.json())["value"]
            if value != ev["expected"]["rules"]["expected"]:
                raise RuntimeError(f"task {task['id']} not solved by its oracle: {value!r}")
            t.episodes += 1


def _q(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1000


async def measure(urls: list[str], episodes: int) -> tuple[Timings, float]:
    per_family = max(1, episodes // len(FAMILIES) + 1)
    pool = [t for f in FAMILIES for t in generate_tasks(f, per_family, seed=11)]
    t = Timings()
    start = time.perf_counter()
    await asyncio.gather(
        *(
            _client(url, [pool[(i * 7 + k) % len(pool)] for k in range(episodes)], t)
            for i, url in enumerate(urls)
        )
    )
    return t, time.perf_counter() - start


def main(n: int, episodes: int, extra: list[str]) -> int:
    with child_desktops(n, extra) as urls:
        t, wall = asyncio.run(measure(urls, episodes))
    print(f"sim-bench: {n} desktops, {t.episodes} episodes solved, {t.steps} steps in {wall:.2f} s")
    print(
        f"  machine: {platform.machine()} {platform.python_implementation()} {platform.python_version()}"
    )
    for name, xs in (("screenshot", t.screenshot), ("execute", t.execute)):
        med = statistics.median(xs) * 1000
        print(
            f"  {name:<10} median {med:6.2f} ms   p90 {_q(xs, 0.9):6.2f} ms   ({len(xs)} requests)"
        )
    print(f"  throughput {t.steps / wall:.1f} steps/s (one step = screenshot + execute)")
    return 0

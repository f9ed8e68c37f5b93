"""Forking an environment mid-task vs getting the same state by reset + replay.

    .venv/bin/python benchmarks/bench_fork.py                     # sim and vm, writes results
    .venv/bin/python benchmarks/bench_fork.py --kinds sim --quick # fewer repeats; no file

A tree rollout (`arpo.actor.tree`) needs `n` environments in the state one reached after
a prefix of actions. Two ways, side by side in one run:

- **fork**: `POST /snapshot` then `POST /fork {n}` on the environment (through
  `DesktopProvider`), then the first screenshot of every child (all at once);
- **replay**: `POST /reset` then the prefix's actions again, one `/execute` each, then a
  screenshot: what one environment pays to reach the state without forking (n of them
  need n free environments doing it at once).

Kinds, one function each (`KINDS`):

- `sim` (`bench_sim`): the simulated desktop, `arpo-envs sim -n 1` in a child process;
  the prefix is the first 2, 5 or 10 oracle actions of a fill_form task; fork of
  n = 1, 4, 16. Also the server's own time for the copies (`/sim/stats` spans
  `snapshot`, `fork`) and memory per child: RSS of the server process before the fork of
  16, after it, after one action and screenshot on each child, and after the release.
- `vm` (`bench_vm`): the fleet's VMs, not written yet (its place is marked below).

Before any timing, per prefix: a child's first screenshot is byte for byte the parent's
at snapshot time, so is the replayed desktop's, and a child that plays the rest of the
oracle solves the task. Run alone on the machine (2 cores: anything else distorts it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _machine import cpu_model
from arpo_envs.sim.desktop import Desktop
from arpo_envs.sim.tasks import load_scene

from arpo.env.client import ClientConfig, EnvClient
from arpo.env.provider import DesktopProvider

ROOT = Path(__file__).resolve().parent.parent

SIM_TASK = ("fill_form", 2)
"""A task with a 13-action oracle: prefixes of 10 leave actions to check the children with."""
SIM_PREFIXES = (2, 5, 10)
SIM_FORKS = (1, 4, 16)


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# ---- sim --------------------------------------------------------------------------------------


@contextlib.contextmanager
def sim_process() -> Iterator[tuple[str, int]]:
    """`arpo-envs sim -n 1` in a child process; yields its URL and pid."""
    cmd = [sys.executable, "-m", "arpo_envs.cli", "sim", "-n", "1", "--base-port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("env "):
                yield line.split()[2], proc.pid
                return
        raise RuntimeError(f"the simulated desktop did not start (exit code {proc.poll()})")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _replay(env: EnvClient, actions: list[str]) -> bytes:
    """/reset, the actions, a screenshot: the state reached without forking."""
    await env.reset()
    for code in actions:
        r = await env.execute_pyautogui(code)
        assert r.returncode == 0, r.error
    return await env.screenshot()


async def _fork(provider: DesktopProvider, n: int) -> tuple[str, list[bytes], float, float]:
    """Snapshot, fork `n`, first screenshot of each child; (handle, shots, fork s, total s)."""
    t0 = time.perf_counter()
    handle = await provider.snapshot()
    clones = await provider.fork(handle, n)
    t1 = time.perf_counter()
    async with contextlib.AsyncExitStack() as stack:
        kids = [
            await stack.enter_async_context(EnvClient(ClientConfig(base_url=c.url))) for c in clones
        ]
        shots = await asyncio.gather(*(k.screenshot() for k in kids))
    return handle, list(shots), t1 - t0, time.perf_counter() - t0


async def _check_sim(env: EnvClient, provider: DesktopProvider, oracle: list[str]) -> None:
    """Correctness before timing: fork and replay reach the parent's state; a child solves."""
    family, seed = SIM_TASK
    expected = load_scene(Desktop(), family, seed).expected
    for k in SIM_PREFIXES:
        parent = await _replay(env, oracle[:k])
        handle, shots, _, _ = await _fork(provider, 2)
        assert all(s == parent for s in shots), f"prefix {k}: a child's screen is not the parent's"
        (clone,) = await provider.fork(handle, 1)
        async with EnvClient(ClientConfig(base_url=clone.url)) as kid:
            for code in oracle[k:]:
                await kid.execute_pyautogui(code)
            assert await kid.sim_state("submitted") == expected, f"prefix {k}: not solved"
        await provider.release(handle)
        assert await env.sim_state("submitted") is None, "the child's submit reached the parent"
        assert await _replay(env, oracle[:k]) == parent, f"prefix {k}: replay differs"


async def _measure_sim(url: str, pid: int, repeats: int) -> dict[str, Any]:
    family, seed = SIM_TASK
    oracle = load_scene(Desktop(), family, seed).oracle
    out: dict[str, Any] = {"task": f"{family}/{seed}", "oracle_len": len(oracle)}
    async with EnvClient(ClientConfig(base_url=url)) as env:
        provider = DesktopProvider(env)
        await env.sim_scene({"family": family, "seed": seed})
        await _check_sim(env, provider, oracle)
        rows = []
        for k in SIM_PREFIXES:
            replay = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                await _replay(env, oracle[:k])
                replay.append(time.perf_counter() - t0)
            row: dict[str, Any] = {"prefix": k, "replay_s": replay, "fork": {}}
            for n in SIM_FORKS:
                forks, totals, releases = [], [], []
                for _ in range(repeats):
                    handle, _, fork_s, total_s = await _fork(provider, n)
                    t0 = time.perf_counter()
                    await provider.release(handle)
                    releases.append(time.perf_counter() - t0)
                    forks.append(fork_s)
                    totals.append(total_s)
                row["fork"][str(n)] = {
                    "fork_s": forks,
                    "to_first_screenshots_s": totals,
                    "release_s": releases,
                }
            rows.append(row)
        out["rows"] = rows
        stats = await env._request("GET", "/sim/stats", expect="json")
        out["server_spans"] = {k: stats[k] for k in ("snapshot", "fork") if k in stats}
        out["memory"] = await _memory_sim(env, provider, pid, oracle)
    return out


async def _memory_sim(
    env: EnvClient, provider: DesktopProvider, pid: int, oracle: list[str]
) -> dict[str, float]:
    """RSS of the server process around a fork of 16 children."""
    n = max(SIM_FORKS)
    await _replay(env, oracle[:5])
    mem = {"before_mib": rss_mib(pid)}
    handle = await provider.snapshot()
    clones = await provider.fork(handle, n)
    mem["forked_mib"] = rss_mib(pid)
    async with contextlib.AsyncExitStack() as stack:
        kids = [
            await stack.enter_async_context(EnvClient(ClientConfig(base_url=c.url))) for c in clones
        ]
        for kid in kids:  # each child renders its own frame and re-encodes changed bands
            await kid.execute_pyautogui(oracle[5])
            await kid.screenshot()
    mem["acted_mib"] = rss_mib(pid)
    await provider.release(handle)
    mem["released_mib"] = rss_mib(pid)
    mem["per_child_forked_mib"] = (mem["forked_mib"] - mem["before_mib"]) / n
    mem["per_child_acted_mib"] = (mem["acted_mib"] - mem["before_mib"]) / n
    mem["children"] = n
    return mem


def bench_sim(repeats: int = 10) -> dict[str, Any]:
    """Fork vs reset + replay on the simulated desktop (see the module docstring)."""
    with sim_process() as (url, pid):
        return asyncio.run(_measure_sim(url, pid, repeats))


def render_sim(r: dict[str, Any]) -> list[str]:
    ms = lambda xs: f"{med(xs) * 1e3:.1f}"  # noqa: E731
    lines = [
        f"## Simulated desktop (`arpo-envs sim`, task {r['task']}, oracle of "
        f"{r['oracle_len']} actions)",
        "",
        "Median ms over the repeats. fork n: snapshot + fork returned; (first screenshots: "
        "until every child's first screenshot arrived).",
        "",
        "| prefix actions | reset + replay (one desktop) | "
        + " | ".join(f"fork n={n} (first screenshots)" for n in SIM_FORKS)
        + f" | release n={max(SIM_FORKS)} |",
        "|---|---|" + "---|" * len(SIM_FORKS) + "---|",
    ]
    for row in r["rows"]:
        forks = [row["fork"][str(n)] for n in SIM_FORKS]
        cells = [f"{ms(f['fork_s'])} ({ms(f['to_first_screenshots_s'])})" for f in forks]
        lines.append(
            f"| {row['prefix']} | {ms(row['replay_s'])} | "
            + " | ".join(cells)
            + f" | {ms(forks[-1]['release_s'])} |"
        )
    spans = r["server_spans"]
    m = r["memory"]
    lines += [
        "",
        "Server side (`/sim/stats`, all forks above): copy of the state at /snapshot "
        f"{spans['snapshot']['mean_ms']:.2f} ms mean; /fork (a copy and a started server per "
        f"child) {spans['fork']['mean_ms']:.2f} ms mean.",
        "",
        f"Memory of the server process, fork of {m['children']}: {m['before_mib']:.0f} MiB "
        f"before, {m['forked_mib']:.0f} after the fork ({m['per_child_forked_mib']:.2f} MiB "
        f"per child), {m['acted_mib']:.0f} after one action and screenshot on each child "
        f"({m['per_child_acted_mib']:.2f} MiB per child), {m['released_mib']:.0f} after the "
        "release (freed memory stays with the process's allocator).",
    ]
    return lines


# ---- vm ---------------------------------------------------------------------------------------
# The fleet's VMs: `bench_vm(repeats) -> dict` and `render_vm(results) -> list[str]` go here,
# measured the same way (fork latency of n = 1, 4, 16 and memory per clone, against a revert
# plus a replay of the prefix), then listed in KINDS.


def bench_vm(repeats: int = 10) -> dict[str, Any]:
    raise SystemExit("bench_fork.py: the vm kind is not written yet; run with --kinds sim")


def render_vm(r: dict[str, Any]) -> list[str]:
    return []


KINDS: dict[str, tuple[Callable[[int], dict[str, Any]], Callable[[dict[str, Any]], list[str]]]] = {
    "sim": (bench_sim, render_sim),
    "vm": (bench_vm, render_vm),
}


def render(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [
        f"# Fork vs reset + replay ({r['date']})",
        "",
        f"commit {r['commit']}; {m['cpu']}, {m['cores']} cores; load at start "
        f"{m['load_at_start'][0]:.2f}; {r['repeats']} repeats.",
        f"Command: `.venv/bin/python benchmarks/bench_fork.py --kinds {','.join(r['kinds'])}` "
        "(run alone).",
        "",
    ]
    for kind in r["kinds"]:
        lines += [*KINDS[kind][1](r[kind]), ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default="sim,vm", help="comma-separated: sim, vm (default both)")
    p.add_argument("--repeats", type=int, default=10, help="timings per configuration")
    p.add_argument("--quick", action="store_true", help="3 repeats, no results file")
    args = p.parse_args()
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        p.error(f"unknown kinds {unknown}; use a comma-separated list of {', '.join(KINDS)}")
    repeats = 3 if args.quick else args.repeats
    r: dict[str, Any] = {
        "date": dt.date.today().isoformat(),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "load_at_start": os.getloadavg(),
        },
        "kinds": kinds,
        "repeats": repeats,
    }
    for kind in kinds:
        r[kind] = KINDS[kind][0](repeats)
    text = render(r)
    print(text)
    if not args.quick:
        out = ROOT / "benchmarks" / "results" / f"fork-{'-'.join(kinds)}-{r['date']}"
        out.with_suffix(".json").write_text(json.dumps(r, indent=2))
        out.with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

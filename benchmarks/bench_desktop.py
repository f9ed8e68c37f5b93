"""Local desktop vs simulated desktop: step latency, steps/s at 1-16 environments, reset, memory.

    .venv/bin/python benchmarks/bench_desktop.py                 # full run, writes results
    .venv/bin/python benchmarks/bench_desktop.py --quick         # n = 1, 2; short; no file

One step = GET /screenshot + POST /execute of one pyautogui click (sent as OSWorld's
controller sends it, `python -c "import pyautogui; ..."`). Every environment gets one
client that steps as fast as it can for `--seconds`; all clients run at once.

Real desktops: `arpo-envs up -n N` (one server process, Xvfb, openbox each), every one
showing a CSV in LibreOffice Calc (so screenshots carry a real window, not a black
screen); clicks land on cells. Simulated desktops: `arpo-envs sim -n N` in one child
process. Before any timing, each environment is checked: a click moves the real
pointer where it was sent (/cursor_position) and the screenshot is a PNG of the
screen size. Reset: open Calc on a file, then POST /reset, 15 times on one desktop.
Memory: proportional set size (PSS; shared pages split between sharers) and RSS of
every process of one desktop (server, Xvfb, openbox, soffice.bin), Calc open.

Run alone on the machine (2 cores: anything else distorts it); the load average at
the start is recorded with the results.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from _machine import cpu_model, run_header
from arpo_envs.desktop.fleet import FleetConfig, down, up
from arpo_envs.procs import marked_pids
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "import pyautogui; import time; pyautogui.FAILSAFE = False; "
W, H = 1280, 720


def q(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))] * 1000 if s else float("nan")


async def act(s: aiohttp.ClientSession, url: str, code: str) -> dict:
    body = {"command": ["python", "-c", PREFIX + code], "shell": False}
    async with s.post(f"{url}/execute", json=body) as r:
        r.raise_for_status()
        return await r.json()


async def check(s: aiohttp.ClientSession, url: str) -> None:
    """Correctness first: the pointer goes where sent, the screenshot is a PNG of the screen."""
    res = await act(s, url, "pyautogui.click(321, 234)")
    assert res["returncode"] == 0, res
    async with s.get(f"{url}/cursor_position") as r:
        assert await r.json() == [321, 234], "the click did not move the pointer"
    async with s.get(f"{url}/screenshot") as r:
        img = Image.open(io.BytesIO(await r.read()))
        assert img.format == "PNG" and img.size == (W, H), (img.format, img.size)


async def client(url: str, seconds: float, seed: int, out: dict) -> None:
    rng = random.Random(seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        await check(s, url)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            async with s.get(f"{url}/screenshot") as r:
                r.raise_for_status()
                png = await r.read()
            t1 = time.perf_counter()
            x, y = rng.randrange(80, 1100), rng.randrange(160, 620)
            res = await act(s, url, f"pyautogui.click({x}, {y})")
            t2 = time.perf_counter()
            assert res["returncode"] == 0, res
            out["screenshot"].append(t1 - t0)
            out["execute"].append(t2 - t1)
            out["png_bytes"].append(len(png))
            out["steps"] += 1


async def measure(urls: list[str], seconds: float) -> dict:
    out: dict = {"screenshot": [], "execute": [], "png_bytes": [], "steps": 0}
    t0 = time.perf_counter()
    await asyncio.gather(*(client(u, seconds, i, out) for i, u in enumerate(urls)))
    wall = time.perf_counter() - t0
    return {
        "n": len(urls),
        "steps": out["steps"],
        "steps_per_s": out["steps"] / wall,
        "screenshot_p50_ms": q(out["screenshot"], 0.5),
        "screenshot_p99_ms": q(out["screenshot"], 0.99),
        "execute_p50_ms": q(out["execute"], 0.5),
        "execute_p99_ms": q(out["execute"], 0.99),
        "png_kb_median": statistics.median(out["png_bytes"]) / 1024,
    }


def memory_of(pids: list[int]) -> dict:
    rss = pss = 0
    by_name: dict[str, float] = {}
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
                    by_name[name] = by_name.get(name, 0.0) + int(line.split()[1]) / 1024
        except OSError:
            pass
    return {
        "rss_mib": rss / 1024,
        "pss_mib": pss / 1024,
        "processes": len(pids),
        "pss_mib_by_process": {k: round(v, 1) for k, v in sorted(by_name.items())},
    }


async def open_calc(urls: list[str]) -> float:
    """Every desktop shows a CSV in Calc; returns the median time of /setup/open_file."""
    rows = "".join(f"item{i},{i},{i * 3}\\n" for i in range(40))
    times = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:

        async def one(url: str) -> None:
            script = {"script": f"printf 'name,a,b\\n{rows}' > /home/user/data.csv"}
            async with s.post(f"{url}/run_bash_script", json=script) as r:
                r.raise_for_status()
            t0 = time.perf_counter()
            async with s.post(f"{url}/setup/open_file", json={"path": "/home/user/data.csv"}) as r:
                assert r.status == 200, await r.text()
            times.append(time.perf_counter() - t0)

        await asyncio.gather(*(one(u) for u in urls))
    await asyncio.sleep(1.0)  # let Calc finish drawing
    return statistics.median(times)


async def reset_times(url: str, rounds: int) -> dict:
    resets, opens = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        for _ in range(rounds):
            async with s.post(f"{url}/run_bash_script", json={"script": "echo a,b > ~/r.csv"}) as r:
                r.raise_for_status()
            t0 = time.perf_counter()
            async with s.post(f"{url}/setup/open_file", json={"path": "/home/user/r.csv"}) as r:
                assert r.status == 200, await r.text()
            opens.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            async with s.post(f"{url}/reset", json={}) as r:
                body = await r.json()
            resets.append(time.perf_counter() - t0)
            assert body["status"] == "success" and body["killed"] >= 1, body
            async with s.post(f"{url}/file", data={"file_path": "/home/user/r.csv"}) as r:
                assert r.status == 404, "reset left the task file behind"
    return {
        "reset_p50_ms": q(resets, 0.5),
        "reset_max_ms": max(resets) * 1000,
        "calc_open_warm_p50_ms": q(opens, 0.5),
        "rounds": rounds,
    }


def real_run(n: int, seconds: float, state: Path) -> tuple[dict, dict]:
    cfg = FleetConfig(n=n, base_port=0, state_file=state, width=W, height=H)
    t0 = time.perf_counter()
    fleet = up(cfg, announce=lambda s: None)
    startup = time.perf_counter() - t0
    try:
        urls = [e.url for e in fleet.envs]
        open_s = asyncio.run(open_calc(urls))
        res = asyncio.run(measure(urls, seconds))
        res["startup_s"] = startup
        res["calc_open_p50_s"] = open_s
        m0 = fleet.state.servers[0]
        mem = memory_of([m0.pid, *marked_pids(m0.root)])
    finally:
        down(state, announce=lambda s: None)
    return res, mem


def sim_run(n: int, seconds: float) -> tuple[dict, dict]:
    cmd = [sys.executable, "-m", "arpo_envs.cli", "sim", "-n", str(n), "--base-port", "0"]
    cmd += ["--width", str(W), "--height", str(H)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        urls = []
        assert proc.stdout is not None
        while len(urls) < n:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("sim desktops did not start")
            if line.startswith("env "):
                urls.append(line.split()[2])
        res = asyncio.run(measure(urls, seconds))
        mem = memory_of([proc.pid])
        mem = {k: (v / n if k in ("rss_mib", "pss_mib") else v) for k, v in mem.items()}
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()
    return res, mem


def machine() -> dict:
    cpu = cpu_model()
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "load_at_start": os.getloadavg(),
    }


def render(results: dict) -> str:
    lines = [
        f"# Local desktop vs simulated desktop ({results['date']})",
        "",
        f"commit {results['commit']}; {results['machine']['cpu']}, "
        f"{results['machine']['cores']} cores, {results['machine']['memory_gib']} GiB; "
        f"load average at start {results['machine']['load_at_start'][0]:.2f}"
        f"{' (the machine was busy: figures are pessimistic)' if results['machine']['load_at_start'][0] >= 1 else ''}.",
        f"Screen {W}x{H}; a step = screenshot + one pyautogui click; {results['seconds']:g} s "
        "per configuration, all environments stepping at once.",
        "",
        "| env | n | steps/s total | screenshot p50 / p99 ms | execute p50 / p99 ms | PNG KiB |",
        "|---|---|---|---|---|---|",
    ]
    for kind in ("real", "sim"):
        for r in results[kind]:
            lines.append(
                f"| {kind} | {r['n']} | {r['steps_per_s']:.1f} | "
                f"{r['screenshot_p50_ms']:.1f} / {r['screenshot_p99_ms']:.1f} | "
                f"{r['execute_p50_ms']:.1f} / {r['execute_p99_ms']:.1f} | {r['png_kb_median']:.0f} |"
            )
    rs = results["reset"]
    lines += [
        "",
        f"Reset (Calc open, then POST /reset; {rs['rounds']} rounds): median "
        f"{rs['reset_p50_ms']:.0f} ms, max {rs['reset_max_ms']:.0f} ms. Calc window after "
        f"/setup/open_file (warm): median {rs['calc_open_warm_p50_ms']:.0f} ms.",
        "",
        "| env | memory per environment |",
        "|---|---|",
        f"| real (server + Xvfb + openbox + Calc) | PSS {results['memory']['real']['pss_mib']:.0f} MiB, "
        f"RSS {results['memory']['real']['rss_mib']:.0f} MiB; PSS by process: "
        + ", ".join(
            f"{k} {v:.0f}" for k, v in results["memory"]["real"]["pss_mib_by_process"].items()
        )
        + " |",
        f"| sim (one process for all, divided by n) | PSS {results['memory']['sim']['pss_mib']:.0f} MiB, "
        f"RSS {results['memory']['sim']['rss_mib']:.0f} MiB |",
        "",
        "Start-up of N real desktops (`arpo-envs up`, until all answer): "
        + ", ".join(f"n={r['n']}: {r['startup_s']:.1f} s" for r in results["real"])
        + ".",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="n = 1, 2 for 4 s each; no file")
    ap.add_argument("--seconds", type=float, default=12.0, help="measuring time per config")
    ap.add_argument("--counts", default="1,4,8,16", help="numbers of environments")
    args = ap.parse_args()
    counts = [1, 2] if args.quick else [int(c) for c in args.counts.split(",")]
    seconds = 4.0 if args.quick else args.seconds
    info = machine()
    if info["load_at_start"][0] >= 1:
        print(f"warning: load average {info['load_at_start'][0]:.2f}; results will be pessimistic")
    state = Path(tempfile.mkdtemp(prefix="bench-desktop-")) / "state.json"
    results: dict = {
        "machine": info,
        "seconds": seconds,
        "real": [],
        "sim": [],
        "memory": {},
    }
    for n in counts:
        real, mem = real_run(n, seconds, state)
        results["real"].append(real)
        results["memory"].setdefault("real", mem)
        print(f"real n={n}: {json.dumps(real)}", flush=True)
        sim, smem = sim_run(n, seconds)
        results["sim"].append(sim)
        results["memory"]["sim"] = smem
        print(f"sim  n={n}: {json.dumps(sim)}", flush=True)
    cfg = FleetConfig(n=1, base_port=0, state_file=state, width=W, height=H)
    env = up(cfg, announce=lambda s: None).envs[0]
    try:
        results["reset"] = asyncio.run(reset_times(env.url, 5 if args.quick else 15))
    finally:
        down(state, announce=lambda s: None)
    print(f"reset: {json.dumps(results['reset'])}")
    header = run_header()
    results = {
        "date": header["date"],
        "commit": header["commit"],
        **results,
        "load_average": header["load_average"],
    }
    md = render(results)
    print(md)
    if not args.quick:
        out = ROOT / "benchmarks" / "results"
        out.mkdir(parents=True, exist_ok=True)
        day = results["date"][:10]
        (out / f"desktop-{day}.json").write_text(json.dumps(results, indent=2))
        (out / f"desktop-{day}.md").write_text(md)
        print(f"wrote {out}/desktop-{day}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""QEMU VMs of the fleet: revert by snapshot vs cold boot, provisioning, steps/s, memory.

    .venv/bin/python benchmarks/bench_vm.py                  # full run, writes results
    .venv/bin/python benchmarks/bench_vm.py --quick          # fewer repeats; no file

Side by side in one run, on the project's test image (`arpo-envs vm build`), with the
accelerator the fleet picks on this host (KVM, or software emulation where the host CPU
has no vmx/svm):

- **cold boot**: a VM started on a fresh overlay of the image, to its first screenshot:
  what OSWorld's docker provider pays for every revert (it restarts the container);
- **revert**: the fleet's `POST /vms/<name>/revert` (QMP `loadvm` of the snapshot taken
  when the desktop first answered, then a screenshot), each after the VM was dirtied
  (a file written, a window opened); checked: the file and the window are gone;
- **provisioning**: a new VM from the golden overlay (copy of the overlay, QEMU with
  `-loadvm`, first screenshot): what replacing a dead VM costs;
- **steps**: a step = GET /screenshot + POST /execute of one pyautogui click sent as
  OSWorld's controller sends it; per VM alone, and for the fleet with all VMs at once;
- **memory**: RSS and PSS of each QEMU process after the steps, and how many VMs fit
  in this machine's memory beside a training run (`--reserve-gib`, default 8).

An episode's environment wait is revert + its steps' environment time; the figure
`revert / episode` is for an episode of `--episode-steps` steps (ARPO's 15).
Run alone on the machine (2 cores: anything else distorts it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from _machine import cpu_model, run_header
from arpo_envs.fleet_records import Reverted, RevertRequest, decode, encode
from arpo_envs.procs import free_port
from arpo_envs.vm.fleet import FleetConfig, VMFleet, down, status, up
from arpo_envs.vm.image import build
from arpo_envs.vm.qemu import Machine, MachineConfig, QemuVM
from arpo_envs.vm.supervisor import screenshot_ok

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "import pyautogui; import time; pyautogui.FAILSAFE = False; "


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


async def execute(s: aiohttp.ClientSession, url: str, cmd: str | list[str], shell: bool) -> dict:
    async with s.post(f"{url}/execute", json={"command": cmd, "shell": shell}) as r:
        r.raise_for_status()
        return await r.json()


async def cold_boots(rounds: int, tmp: Path) -> list[float]:
    """Cold boot to the first screenshot, on a fresh overlay each time."""
    img = build()
    machine = Machine.detect(MachineConfig())
    out = []
    for i in range(rounds):
        port = free_port()
        vm = QemuVM(f"cold-{i}", tmp / f"cold-{i}", machine, port, base=img.disk,
                    kernel=img.kernel, initrd=img.initrd, append=img.append)  # fmt: skip
        t0 = time.perf_counter()
        await vm.start()
        try:
            while True:
                ok, _ = await screenshot_ok(vm.url, 5.0)
                if ok:
                    break
                if time.perf_counter() - t0 > 900:
                    raise RuntimeError("no screenshot within 900 s of a cold boot")
                await asyncio.sleep(0.25)
            out.append(time.perf_counter() - t0)
        finally:
            await vm.kill()
            vm.remove_files()
    return out


async def reverts(fleet: VMFleet, rounds: int) -> tuple[list[float], list[float]]:
    """(revert seconds as the actor sees them, loadvm seconds), each after dirtying the VM."""
    st = fleet.state
    vm = st.vms[0]
    hdr = {"Authorization": f"Bearer {st.token}"}
    total, load = [], []
    for i in range(rounds):
        # a new session each round: after a revert the guest's TCP state is the snapshot's
        async with aiohttp.ClientSession() as s:
            cmd = f"echo {i} > /home/user/dirty.txt; xterm -title Dirty &"
            await execute(s, vm.url, cmd, True)
            t0 = time.perf_counter()
            url = f"{st.control}/vms/{vm.name}/revert"
            async with s.post(url, json=encode(RevertRequest()), headers=hdr) as r:
                r.raise_for_status()
                body = decode(await r.json(), Reverted)
            total.append(time.perf_counter() - t0)
            load.append(body.loadvm_s)
    async with aiohttp.ClientSession() as s:
        left = await execute(s, vm.url, "ls /home/user; wmctrl -l", True)
    assert "dirty.txt" not in left["output"] and "Dirty" not in left["output"], left
    return total, load


async def steps(urls: list[str], seconds: float) -> list[dict]:
    """Every VM steps (screenshot + one click) as fast as it can for `seconds`, all at once."""

    async def one(url: str) -> dict:
        lat: list[float] = []
        shot: list[float] = []
        async with aiohttp.ClientSession() as s:
            end = time.perf_counter() + seconds
            k = 0
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                async with s.get(f"{url}/screenshot") as r:
                    png = await r.read()
                t1 = time.perf_counter()
                assert png[:8] == b"\x89PNG\r\n\x1a\n"
                x, y = 100 + (k * 37) % 1000, 100 + (k * 53) % 500
                await execute(
                    s, url, ["python", "-c", PREFIX + f"pyautogui.click({x}, {y})"], False
                )
                lat.append(time.perf_counter() - t0)
                shot.append(t1 - t0)
                k += 1
        return {"url": url, "steps": len(lat), "step_s": med(lat), "screenshot_s": med(shot),
                "steps_per_s": len(lat) / seconds}  # fmt: skip

    return list(await asyncio.gather(*(one(u) for u in urls)))


def memory(pid: int) -> dict:
    rss = pss = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Rss:"):
            rss = int(line.split()[1])
        elif line.startswith("Pss:"):
            pss = int(line.split()[1])
    return {"rss_mib": rss / 1024, "pss_mib": pss / 1024}


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def run(args: argparse.Namespace) -> dict:
    img = build()
    tmp = Path(tempfile.mkdtemp(prefix="bench-vm-"))
    results: dict = {
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "load_at_start": os.getloadavg(),
        },
        "image": {"build_seconds": img.build_seconds, "disk_mib": img.disk_bytes >> 20},
    }
    try:
        results["cold_boot_s"] = asyncio.run(cold_boots(args.cold, tmp))
        fleet_dir = tmp / "fleet"
        t0 = time.perf_counter()
        fleet = up(FleetConfig(n=args.n, dir=str(fleet_dir), health_interval_s=0),
                   announce=lambda s: None)  # fmt: skip
        results["fleet_up_s"] = time.perf_counter() - t0
        results["accel"], results["accel_reason"] = fleet.state.accel, fleet.state.accel_reason
        results["provision_s"] = [
            e["seconds"]
            for e in map(json.loads, (fleet_dir / "events.jsonl").read_text().splitlines())
            if e["event"] == "vm_started"
        ]
        total, load = asyncio.run(reverts(fleet, args.reverts))
        results["revert_s"], results["loadvm_s"] = total, load
        urls = [e.url for e in fleet.envs]
        results["steps_alone"] = asyncio.run(steps(urls[:1], args.seconds))
        results["steps_fleet"] = asyncio.run(steps(urls, args.seconds))
        report = status(fleet.state_file).report
        assert report is not None
        results["memory"] = [memory(v.qemu_pid) for v in report.vms]
        fleet.down(announce=lambda s: None)
    finally:
        down(tmp / "fleet" / "fleet.json", announce=lambda s: None)
        subprocess.run(["rm", "-rf", str(tmp)])
    cold, rev = med(results["cold_boot_s"]), med(results["revert_s"])
    step = results["steps_alone"][0]["step_s"]
    rss = max(m["rss_mib"] for m in results["memory"])
    results["summary"] = {
        "cold_boot_median_s": cold,
        "revert_median_s": rev,
        "cold_over_revert": cold / rev,
        "provision_median_s": med(results["provision_s"]),
        "step_median_s": step,
        "revert_share_of_episode": rev / (rev + args.episode_steps * step),
        "vm_rss_mib": rss,
        "vms_that_fit": int((mem_available_gib() - args.reserve_gib) * 1024 // rss),
        "fleet_steps_per_s": sum(r["steps_per_s"] for r in results["steps_fleet"]),
    }
    results["episode_steps"], results["reserve_gib"] = args.episode_steps, args.reserve_gib
    header = run_header()
    return {
        "date": header["date"],
        "commit": header["commit"],
        **results,
        "load_average": header["load_average"],
    }


def render(r: dict) -> str:
    s = r["summary"]
    m = r["machine"]
    return "\n".join([
        f"# QEMU VMs of the fleet ({r['date']})",
        "",
        f"commit {r['commit']}; {m['cpu']}, {m['cores']} cores; load at start "
        f"{m['load_at_start'][0]:.2f}. Accelerator: **{r['accel']}** ({r['accel_reason']}). "
        f"Test image: {r['image']['disk_mib']} MiB qcow2 (its last build took "
        f"{r['image']['build_seconds']:.0f} s).",
        "Command: `.venv/bin/python benchmarks/bench_vm.py` (run alone).",
        "",
        "| what | median | all runs (s) |",
        "|---|---|---|",
        f"| cold boot to the first screenshot (a container restart's cost) | {s['cold_boot_median_s']:.1f} s | "
        + ", ".join(f"{x:.1f}" for x in r["cold_boot_s"]) + " |",
        f"| revert by snapshot (fleet API: loadvm + screenshot) | {s['revert_median_s']:.2f} s | "
        + ", ".join(f"{x:.2f}" for x in r["revert_s"]) + " |",
        "| of which QMP loadvm | " + f"{med(r['loadvm_s']):.2f} s | "
        + ", ".join(f"{x:.2f}" for x in r["loadvm_s"]) + " |",
        f"| provisioning a VM from the golden overlay | {s['provision_median_s']:.2f} s | "
        + ", ".join(f"{x:.2f}" for x in r["provision_s"]) + " |",
        "",
        f"**Revert is {s['cold_over_revert']:.0f}x faster than a cold boot.** "
        f"A step (screenshot + one click) takes {s['step_median_s'] * 1000:.0f} ms on one VM "
        f"(screenshot {r['steps_alone'][0]['screenshot_s'] * 1000:.0f} ms); in an episode of "
        f"{r['episode_steps']} steps the revert is {s['revert_share_of_episode']:.0%} of the "
        "environment's time (the agent's own time, the model, comes on top).",
        "",
        "| steps | VMs | steps/s in all | per VM |",
        "|---|---|---|---|",
        f"| one VM alone | 1 | {r['steps_alone'][0]['steps_per_s']:.1f} | "
        f"{r['steps_alone'][0]['steps_per_s']:.1f} |",
        f"| the fleet at once | {len(r['steps_fleet'])} | {s['fleet_steps_per_s']:.1f} | "
        + ", ".join(f"{x['steps_per_s']:.1f}" for x in r["steps_fleet"]) + " |",
        "",
        "Host memory per VM (QEMU process after the steps): "
        + ", ".join(f"RSS {x['rss_mib']:.0f} MiB / PSS {x['pss_mib']:.0f} MiB" for x in r["memory"])
        + f". With {r['reserve_gib']} GiB kept for a training run, **{s['vms_that_fit']} VMs** "
        "fit in the memory this machine had available (CPU, not memory, limits them under "
        "software emulation).",
        "",
    ])  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats, no results file")
    p.add_argument("-n", type=int, default=2, help="VMs of the fleet (default 2)")
    p.add_argument("--cold", type=int, default=3, help="cold boots (default 3)")
    p.add_argument("--reverts", type=int, default=10, help="reverts (default 10)")
    p.add_argument("--seconds", type=float, default=20.0, help="stepping time (default 20)")
    p.add_argument("--episode-steps", type=int, default=15)
    p.add_argument("--reserve-gib", type=float, default=8.0)
    args = p.parse_args()
    if args.quick:
        args.cold, args.reverts, args.seconds = 1, 3, 5.0
    r = run(args)
    print(render(r))
    if not args.quick:
        out = ROOT / "benchmarks" / "results" / f"vm-{r['date'][:10]}"
        out.with_suffix(".json").write_text(json.dumps(r, indent=2))
        out.with_suffix(".md").write_text(render(r))
        print(f"wrote {out}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

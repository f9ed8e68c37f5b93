"""Forking an environment mid-task vs getting the same state by reset + replay.

    .venv/bin/python benchmarks/bench_fork.py                     # sim and vm, writes results
    .venv/bin/python benchmarks/bench_fork.py --kinds sim --quick # fewer repeats; no file

A tree rollout (`arpo.actor.tree`) needs `n` environments in the state one reached after
a prefix of actions. Two ways, side by side in one run:

- **fork**: `POST /snapshot` then `POST /fork {n}` on the environment (through
  `DesktopProvider`; a VM: `FleetVMProvider` and the fleet's control API), then the first
  screenshot of every child (all at once);
- **replay**: `POST /reset` (a VM: the fleet's revert) then the prefix's actions again,
  one `/execute` each, then a screenshot: what one environment pays to reach the state
  without forking (n of them need n free environments doing it at once).

Kinds, one function each (`KINDS`):

- `sim` (`bench_sim`): the simulated desktop, `arpo-envs sim -n 1` in a child process;
  the prefix is the first 2, 5 or 10 oracle actions of a fill_form task; fork of
  n = 1, 4, 16. Also the server's own time for the copies (`/sim/stats` spans
  `snapshot`, `fork`) and memory per child: RSS of the server process before the fork of
  16, after it, after one action and screenshot on each child, and after the release.
- `vm` (`bench_vm`): a VM of the project's fleet (`arpo-envs vm`, its own fleet of one VM
  in a temporary folder), through `FleetVMProvider`; after the revert, the task's setup
  (a terminal) and the prefix: the first 2, 5 or 10 of alternating clicks and typed
  command lines (pyautogui through `/execute`); fork of n = 1, 2, 4 (at most
  `VM_MAX_REPEATS` repeats: each is seconds). Also the fleet's own split of a snapshot
  (pause, RAM transfer, disk copy; from its events) and host memory: RSS, PSS and USS of
  4 clones right after the fork and after one action and a screenshot each, against the
  parent VM's, and the size of the saved RAM file they share.

Before any timing, per prefix: on the simulated desktop a child's first screenshot is
byte for byte the parent's at snapshot time, so is the replayed desktop's, and a child
that plays the rest of the oracle solves the task; on a VM the replay reaches the
prefix's state (the typed lines), each of 2 clones is in it, and what one clone types
reaches neither its sibling nor the parent. Run alone on the machine (2 cores: anything
else distorts it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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

from _machine import cpu_model, run_header
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

VM_PREFIXES = (2, 5, 10)
VM_FORKS = (1, 2, 4)
VM_MAX_REPEATS = 5
"""Timings per configuration on VMs at most (a VM fork is seconds, not milliseconds)."""
VM_TITLE = "BenchTerm"


def _fleet_report(fleet_dir: Path) -> Any:
    """The running fleet's `FleetReport` (its VMs, clones and snapshots)."""
    from arpo_envs.vm.fleet import status

    report = status(fleet_dir / "fleet.json").report
    assert report is not None, f"the fleet of {fleet_dir} does not run"
    return report


def _smaps(pid: int) -> dict[str, float]:
    """RSS, PSS and USS (private pages) of a process, MiB, from /proc/<pid>/smaps_rollup."""
    kb: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        k, v = line.split(":", 1)
        kb[k] = int(v.split()[0])
    return {
        "rss_mib": kb["Rss"] / 1024,
        "pss_mib": kb["Pss"] / 1024,
        "uss_mib": (kb["Private_Clean"] + kb["Private_Dirty"]) / 1024,
    }


def _vm_actions(k: int, center: tuple[int, int]) -> list[str]:
    """A prefix of `k` agent actions as OSWorld sends them (pyautogui through /execute):
    a click into the terminal, then a typed command line, in turn. Each typed line appends
    its number to /home/user/prefix.txt, so the state reached says how many actions ran."""
    x, y = center
    out = []
    for i in range(k):
        if i % 2 == 0:
            out.append(f"pyautogui.click({x + i}, {y})")
        else:
            out.append(f"pyautogui.write('echo {i} >> /home/user/prefix.txt\\n', interval=0.005)")
    return out


async def _vm_setup(env: EnvClient) -> tuple[int, int]:
    """The task's setup after a revert: a terminal whose shell runs, waited for; its centre."""
    await env.launch(f"xterm -title {VM_TITLE} -e bash --norc --noprofile", shell=True)
    for _ in range(120):
        r = await env.execute(
            f"xdotool search --onlyvisible --name '^{VM_TITLE}$' getwindowgeometry --shell %1 && "
            'pgrep -x bash -P "$(pgrep -n -x xterm)"',
            shell=True,
        )
        if r.returncode == 0 and "WIDTH=" in r.output:
            g = dict(line.split("=", 1) for line in r.output.split() if "=" in line)
            return int(g["X"]) + int(g["WIDTH"]) // 2, int(g["Y"]) + int(g["HEIGHT"]) // 2
        await asyncio.sleep(0.25)
    raise RuntimeError(f"no {VM_TITLE} window 30 s after its launch")


async def _vm_replay(provider: Any, env: EnvClient, k: int) -> bytes:
    """Revert (the fleet's loadvm), the setup, `k` actions, a screenshot."""
    await provider.revert_to_snapshot()
    center = await _vm_setup(env)
    for code in _vm_actions(k, center):
        r = await env.execute_pyautogui(code)
        assert r.returncode == 0, r.error
    return await env.screenshot()


async def _prefix_lines(env: EnvClient, want: list[str]) -> list[str]:
    """The lines of the prefix's file once they are `want` (the shell in the terminal runs
    what was typed at its own pace), or as they are after 10 s."""
    for _ in range(40):
        r = await env.execute("cat /home/user/prefix.txt 2>/dev/null; true", shell=True)
        if r.output.split() == want:
            break
        await asyncio.sleep(0.25)
    return r.output.split()


async def _vm_fork(provider: Any, n: int) -> tuple[str, list[Any], float, float, float]:
    """Snapshot, fork `n`, first screenshot of each clone (all at once):
    (handle, clones, snapshot s, fork s, snapshot to the last first screenshot s)."""
    t0 = time.perf_counter()
    handle = await provider.snapshot()
    t1 = time.perf_counter()
    clones = await provider.fork(handle, n)
    t2 = time.perf_counter()
    async with contextlib.AsyncExitStack() as stack:
        kids = [
            await stack.enter_async_context(EnvClient(ClientConfig(base_url=c.url))) for c in clones
        ]
        shots = await asyncio.gather(*(k.screenshot() for k in kids))
    assert all(s[:8] == b"\x89PNG\r\n\x1a\n" for s in shots)
    return handle, clones, t1 - t0, t2 - t1, time.perf_counter() - t0


async def _check_vm(provider: Any, env: EnvClient) -> None:
    """Correctness before timing, per prefix: the replay reaches the prefix's state, each
    of 2 clones is in it, and what one clone types reaches neither the other nor the parent."""
    for k in VM_PREFIXES:
        await _vm_replay(provider, env, k)
        want = [str(i) for i in range(1, k, 2)]
        got = await _prefix_lines(env, want)
        assert got == want, f"prefix {k}: the replay did not get there: {got} != {want}"
        handle, clones, *_ = await _vm_fork(provider, 2)
        async with contextlib.AsyncExitStack() as stack:
            kids = [
                await stack.enter_async_context(EnvClient(ClientConfig(base_url=c.url)))
                for c in clones
            ]
            for kid in kids:
                assert await _prefix_lines(kid, want) == want, f"prefix {k}: a clone is elsewhere"
                assert VM_TITLE in (await kid.execute("wmctrl -l", shell=True)).output
            await kids[0].execute_pyautogui("pyautogui.write('echo x >> /home/user/prefix.txt\\n')")
            assert await _prefix_lines(kids[0], [*want, "x"]) == [*want, "x"]
            assert await _prefix_lines(kids[1], want) == want, "a clone saw its sibling's action"
        assert await _prefix_lines(env, want) == want, "the parent saw a clone's action"
        await provider.release(handle)


async def _memory_vm(provider: Any, env: EnvClient, parent_pid: int, fleet_dir: Path) -> dict:
    """Host memory of 4 clones after the prefix of 5: right after the fork, and after one
    action and a screenshot each; the parent's; the saved RAM file."""
    n = 4
    await _vm_replay(provider, env, 5)
    mem: dict[str, Any] = {"clones": n, "parent": _smaps(parent_pid)}
    handle, clones, *_ = await _vm_fork(provider, n)
    pids = {c.name: c.qemu_pid for c in _fleet_report(fleet_dir).clones}
    mem["forked"] = [_smaps(pids[c.name]) for c in clones]
    async with contextlib.AsyncExitStack() as stack:
        kids = [
            await stack.enter_async_context(EnvClient(ClientConfig(base_url=c.url))) for c in clones
        ]
        for kid in kids:
            await kid.execute_pyautogui("pyautogui.write('echo acted >> /home/user/prefix.txt\\n')")
            await kid.screenshot()
    mem["acted"] = [_smaps(pids[c.name]) for c in clones]
    (snap,) = [s for s in _fleet_report(fleet_dir).snapshots if s.id == handle]
    mem["snapshot_ram_file_mib"] = snap.ram_mib
    await provider.release(handle)
    return mem


async def _measure_vm(fleet: Any, fleet_dir: Path, repeats: int) -> dict[str, Any]:
    from arpo.env.provider import FleetLink, FleetVMProvider

    vm = fleet.state.vms[0]
    out: dict[str, Any] = {"accel": fleet.state.accel, "accel_reason": fleet.state.accel_reason}
    async with EnvClient(ClientConfig(base_url=vm.url)) as env:
        provider = FleetVMProvider(env, FleetLink.from_state(fleet.state_file), vm.name)
        try:
            await _check_vm(provider, env)
            rows = []
            for k in VM_PREFIXES:
                replay = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    await _vm_replay(provider, env, k)
                    replay.append(time.perf_counter() - t0)
                row: dict[str, Any] = {"prefix": k, "replay_s": replay, "fork": {}}
                await _vm_replay(provider, env, k)  # the parent at the prefix, once
                for n in VM_FORKS:
                    snaps, forks, totals, releases = [], [], [], []
                    for _ in range(repeats):
                        handle, _, snap_s, fork_s, total_s = await _vm_fork(provider, n)
                        t0 = time.perf_counter()
                        await provider.release(handle)
                        releases.append(time.perf_counter() - t0)
                        snaps.append(snap_s)
                        forks.append(fork_s)
                        totals.append(total_s)
                    row["fork"][str(n)] = {"snapshot_s": snaps, "fork_s": forks,
                                           "to_first_screenshots_s": totals,
                                           "release_s": releases}  # fmt: skip
                rows.append(row)
            out["rows"] = rows
            out["memory"] = await _memory_vm(provider, env, vm.qemu_pid, fleet_dir)
        finally:
            await provider.stop()
    events = [json.loads(x) for x in (fleet_dir / "events.jsonl").read_text().splitlines()]
    snaps = [e for e in events if e["event"] == "snapshot"]
    out["fleet_snapshot_s"] = {
        k: [e[k] for e in snaps] for k in ("transfer_s", "disk_s", "paused_s", "total_s")
    }
    out["fleet_snapshot_ram_mib"] = [e["ram_mib"] for e in snaps]
    forks = [e for e in events if e["event"] == "fork"]
    out["fleet_fork_s"] = {str(n): [e["seconds"] for e in forks if e["n"] == n] for n in VM_FORKS}
    return out


def bench_vm(repeats: int = 10) -> dict[str, Any]:
    """Fork vs revert + replay on a VM of the fleet (see the module docstring)."""
    import tempfile

    from arpo_envs.vm.fleet import FleetConfig, down, up

    repeats = min(repeats, VM_MAX_REPEATS)
    tmp = Path(tempfile.mkdtemp(prefix="bench-fork-vm-"))
    fleet_dir = tmp / "fleet"
    try:
        fleet = up(FleetConfig(n=1, dir=str(fleet_dir), health_interval_s=0),
                   announce=lambda s: None)  # fmt: skip
        out = asyncio.run(_measure_vm(fleet, fleet_dir, repeats))
    finally:
        down(fleet_dir / "fleet.json", announce=lambda s: None)
        subprocess.run(["rm", "-rf", str(tmp)])
    out["repeats"] = repeats
    out["load_at_end"] = os.getloadavg()
    return out


def render_vm(r: dict[str, Any]) -> list[str]:
    s = lambda xs: f"{med(xs):.2f}"  # noqa: E731
    lines = [
        f"## VM of the fleet (`arpo-envs vm`, accelerator {r['accel']}: {r['accel_reason']})",
        "",
        f"Median seconds over {r['repeats']} repeats; load average at the end "
        f"{r['load_at_end'][0]:.2f} (1 min), {r['load_at_end'][2]:.2f} (15 min). "
        "Prefix: after the revert, the task's "
        "setup (a terminal, waited for) and the prefix's actions, a click or a typed command "
        "line each (pyautogui through `/execute`, as OSWorld's controller sends them). "
        "snapshot: `FleetVMProvider.snapshot`; fork n: `fork(handle, n)` returned (every "
        "clone's server answers); (to first screenshots: snapshot + fork + every clone's first "
        "screenshot). revert + replay is one VM's way to the same state; n environments need "
        "n VMs doing it at once.",
        "",
        "| prefix actions | revert + replay (one VM) | snapshot | "
        + " | ".join(f"fork n={n} (to first screenshots)" for n in VM_FORKS)
        + f" | release n={max(VM_FORKS)} |",
        "|---|---|---|" + "---|" * len(VM_FORKS) + "---|",
    ]
    for row in r["rows"]:
        forks = [row["fork"][str(n)] for n in VM_FORKS]
        snaps = [x for f in forks for x in f["snapshot_s"]]
        cells = [f"{s(f['fork_s'])} ({s(f['to_first_screenshots_s'])})" for f in forks]
        lines.append(
            f"| {row['prefix']} | {s(row['replay_s'])} | {s(snaps)} | "
            + " | ".join(cells)
            + f" | {s(forks[-1]['release_s'])} |"
        )
    fs = r["fleet_snapshot_s"]
    m = r["memory"]
    per = lambda key, what: ", ".join(f"{x[key]:.0f}" for x in m[what])  # noqa: E731
    lines += [
        "",
        f"Snapshot, fleet side (median of all {len(fs['total_s'])}): {s(fs['total_s'])} s, of "
        f"which the VM was paused {s(fs['paused_s'])} s (RAM transfer to the holder "
        f"{s(fs['transfer_s'])} s, disk copy {s(fs['disk_s'])} s); saved RAM "
        f"{med(r['fleet_snapshot_ram_mib']):.0f} MiB (the guest's non-zero pages).",
        "",
        f"Host memory, fork of {m['clones']} after the prefix of 5 (MiB per clone, "
        "smaps_rollup; USS = pages the clone alone holds):",
        "",
        "| | RSS | PSS | USS |",
        "|---|---|---|---|",
        f"| the parent VM | {m['parent']['rss_mib']:.0f} | {m['parent']['pss_mib']:.0f} | "
        f"{m['parent']['uss_mib']:.0f} |",
        f"| each clone, right after the fork | {per('rss_mib', 'forked')} | "
        f"{per('pss_mib', 'forked')} | {per('uss_mib', 'forked')} |",
        f"| each clone, after one action and a screenshot | {per('rss_mib', 'acted')} | "
        f"{per('pss_mib', 'acted')} | {per('uss_mib', 'acted')} |",
        "",
        f"The saved RAM file the clones share: {m['snapshot_ram_file_mib']:.0f} MiB "
        "(tmpfs; counted once, in the clones' PSS shares).",
    ]
    return lines


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
        "(meant to run alone: the load at start says whether it did).",
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
    header = run_header()
    r = {
        "date": header["date"],
        "commit": header["commit"],
        **r,
        "load_average": header["load_average"],
    }
    text = render(r)
    print(text)
    if not args.quick:
        out = ROOT / "benchmarks" / "results" / f"fork-{'-'.join(kinds)}-{r['date'][:10]}"
        out.with_suffix(".json").write_text(json.dumps(r, indent=2))
        out.with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

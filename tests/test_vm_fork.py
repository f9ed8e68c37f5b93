"""Forks of a real QEMU VM of the fleet (under KVM where the host has it, software emulation
otherwise), through the actor's provider (`FleetVMProvider.snapshot / fork / release`).

The fleet is the session's (conftest's `vm_fleet`, shared with test_vm.py). What is checked:

- a file written and a window opened in the parent before the snapshot are in every clone
  (read through the clone's own server), read back from the disk, not only from the
  guest's page cache;
- what a clone writes after the fork is seen by no other clone and not by the parent, and
  what the parent writes after the snapshot reaches no clone;
- a clone forks again (a tree of two levels): its children have what it wrote;
- bounds and refusals are `EnvError`s naming the reason: a fork over `max_clones`, a revert
  of a clone, a fork or release of an unknown snapshot, a fork whose saved state is broken
  (and it leaves no clone behind); a clone whose QEMU dies is reported by its health;
- after the release the clones are gone (no process, no folder, no RAM file) and the
  parent still serves and reverts;
- a snapshot nobody releases is released by the fleet after `snapshot_ttl_s`, and logged;
- the provider against a fleet that answers nonsense: every answer it cannot use is an
  `EnvError` naming what was wrong, never another exception (no VM needed).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

if shutil.which("qemu-system-x86_64") is None or shutil.which("debootstrap") is None:
    pytest.fail("the VM tests need `make sysdeps` (qemu-system-x86, debootstrap)", pytrace=False)

from arpo_envs.fleet_records import (
    Failure,
    FleetReport,
    Forked,
    Released,
    SnapshotTaken,
    VMEntry,
    encode,
)
from arpo_envs.vm.fleet import FleetConfig, read_state, status

from arpo.env.client import ClientConfig, EnvClient
from arpo.env.provider import Clone, FleetLink, FleetVMProvider
from arpo.errors import EnvError

PNG = b"\x89PNG\r\n\x1a\n"
# read files from the disk, not from the guest's page cache (the server runs as root)
FROM_DISK = "sync; echo 3 > /proc/sys/vm/drop_caches; "


async def _sh(client: EnvClient, cmd: str) -> str:
    res = await client.execute(cmd, shell=True)
    assert res.returncode == 0, (cmd, res.error)
    return res.output


async def _window(client: EnvClient, title: str) -> str:
    """Launch an xterm titled `title` and wait for its window; `wmctrl -l`."""
    await client.launch(f"xterm -title {title}", shell=True)
    for _ in range(120):  # it maps within seconds, also under emulation
        windows = await _sh(client, "wmctrl -l")
        if title in windows:
            return windows
        await asyncio.sleep(0.5)
    raise AssertionError(f"no window {title} after 60 s: {windows}")


def _vm(fleet: FleetConfig, i: int) -> tuple[VMEntry, FleetLink]:
    st = read_state(fleet.state_file)
    assert st is not None
    return st.vms[i], FleetLink.from_state(fleet.state_file)


def _report(fleet: FleetConfig) -> FleetReport:
    """The running fleet's own report (`GET /fleet`)."""
    report = status(fleet.state_file).report
    assert report is not None
    return report


async def _ready(provider: FleetVMProvider) -> None:
    """Wait until the fleet says the VM serves (an earlier test may have had it replaced)."""
    for _ in range(180):
        health = await provider.health()
        if health.ok:
            return
        assert not health.final, health
        await asyncio.sleep(1.0)
    raise AssertionError(f"{provider.name} not ready after 180 s: {health}")


def _qemu_pids(cfg: FleetConfig, prefix: str) -> list[int]:
    """QEMU processes whose command line names a folder of `prefix` (a snapshot's)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if b"qemu-system" in cmd and f"/snapshots/{prefix}".encode() in cmd:
                out.append(int(p.name))
    return out


def test_clones_have_the_parents_file_and_window_and_diverge(vm_fleet: FleetConfig) -> None:
    vm, link = _vm(vm_fleet, 0)
    timings: dict[str, float] = {}

    async def main() -> None:
        parent = EnvClient(ClientConfig(base_url=vm.url))
        provider = FleetVMProvider(parent, link, vm.name)
        kids: list[EnvClient] = []
        handle = ""
        try:
            await _ready(provider)
            await provider.revert_to_snapshot()  # whatever the tests before left
            await _sh(parent, "echo from-parent > /home/user/forked.txt")
            await _window(parent, "ForkWindow")

            t0 = time.perf_counter()
            handle = await provider.snapshot()
            timings["snapshot_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            clones = await provider.fork(handle, 2)
            timings["fork_of_2_s"] = time.perf_counter() - t0
            assert len({c.url for c in clones} | {vm.url}) == 3
            for c in clones:
                assert c.token is None  # the fleet's VMs have no token: loopback only
                assert c.ports is not None and set(c.ports) == {"chromium_port", "vlc_port"}
                assert all(isinstance(p, int) for p in c.ports.values())
            kids = [EnvClient(ClientConfig(base_url=c.url)) for c in clones]

            # the parent goes on, and what it does now reaches no clone
            await _sh(parent, "echo later > /home/user/parent-after.txt")
            for kid in kids:
                assert (await kid.screenshot())[:8] == PNG
                got = await _sh(kid, FROM_DISK + "cat /home/user/forked.txt; ls /home/user")
                assert got.startswith("from-parent\n") and "parent-after.txt" not in got, got
                assert "ForkWindow" in await _sh(kid, "wmctrl -l")

            # the clones diverge: what one writes, the other and the parent never see
            for i, kid in enumerate(kids):
                await _sh(kid, f"echo {i} > /home/user/only-clone-{i}.txt; sync")
            seen = [await _sh(k, FROM_DISK + "ls /home/user") for k in [parent, *kids]]
            assert "only-clone" not in seen[0], seen[0]
            assert "only-clone-0" in seen[1] and "only-clone-1" not in seen[1], seen[1]
            assert "only-clone-1" in seen[2] and "only-clone-0" not in seen[2], seen[2]

            await _refusals(provider, kids[0], clones, handle)
            await _nested(provider, kids[0], clones[0])
            await _dead_clone_is_reported(vm_fleet, provider, kids[1], clones[1])

            t0 = time.perf_counter()
            await provider.release(handle)
            timings["release_s"] = time.perf_counter() - t0
            report = _report(vm_fleet)
            assert report.clones == () and report.snapshots == (), report
            assert _qemu_pids(vm_fleet, handle) == []
            assert not (Path(vm_fleet.dir) / "snapshots" / handle).exists()
            state = read_state(vm_fleet.state_file)
            assert state is not None and state.clones == ()
            ram_dir = Path(state.ram_dir)
            assert list(ram_dir.glob("*")) == []
            with pytest.raises(EnvError, match=handle):
                await provider.release(handle)

            # the parent serves, still has its own files, and reverts
            got = await _sh(parent, FROM_DISK + "ls /home/user; wmctrl -l")
            assert "forked.txt" in got and "parent-after.txt" in got and "only-clone" not in got
            assert "ForkWindow" in got
            await provider.revert_to_snapshot()
            got = await _sh(parent, "ls /home/user; wmctrl -l")
            assert "forked.txt" not in got and "ForkWindow" not in got, got
        finally:
            for kid in kids:
                await kid.close()
            if handle and any(x.id == handle for x in _report(vm_fleet).snapshots):
                await provider.release(handle)  # a failed test leaves no clone to the next
            await provider.stop()
            await parent.close()

    asyncio.run(main())
    print(f"\nVM fork timings: {timings}")


async def _refusals(
    provider: FleetVMProvider, kid: EnvClient, clones: list[Clone], handle: str
) -> None:
    """Over the fleet's clone bound, a clone's revert: EnvErrors saying why; nothing starts."""
    with pytest.raises(EnvError, match="max_clones"):
        await provider.fork(handle, 7)  # 2 alive + 7 > 8
    clone_provider = provider.for_clone(kid, clones[0])
    with pytest.raises(EnvError, match="is a clone of snapshot"):
        await clone_provider.revert_to_snapshot()
    await clone_provider.stop()


async def _nested(provider: FleetVMProvider, kid: EnvClient, clone: Clone) -> None:
    """A clone forks again: its child has what the clone wrote, and the window."""
    clone_provider = provider.for_clone(kid, clone)
    try:
        handle = await clone_provider.snapshot()
        (grandchild,) = await clone_provider.fork(handle, 1)
        async with EnvClient(ClientConfig(base_url=grandchild.url)) as g:
            got = await _sh(g, FROM_DISK + "cat /home/user/forked.txt; ls /home/user; wmctrl -l")
        assert got.startswith("from-parent\n"), got
        assert "only-clone-0" in got and "only-clone-1" not in got and "ForkWindow" in got, got
        assert await kid.platform() == "Linux"  # the clone went on after its snapshot
        await clone_provider.release(handle)
    finally:
        await clone_provider.stop()


async def _dead_clone_is_reported(
    cfg: FleetConfig, provider: FleetVMProvider, kid: EnvClient, clone: Clone
) -> None:
    clone_provider = provider.for_clone(kid, clone)
    try:
        (me,) = [c for c in _report(cfg).clones if c.name == clone.name]
        os.kill(me.qemu_pid, signal.SIGKILL)
        for _ in range(100):  # the exit is seen at once; a health check can see it first
            health = await clone_provider.health()
            if health.final:
                break
            await asyncio.sleep(0.1)
        assert not health.ok and health.final and "QEMU exited" in health.reason, health
    finally:
        await clone_provider.stop()


def test_fork_failures_are_env_errors_and_leave_no_clone(vm_fleet: FleetConfig) -> None:
    vm, link = _vm(vm_fleet, 1)

    async def main() -> None:
        client = EnvClient(ClientConfig(base_url=vm.url))
        provider = FleetVMProvider(client, link, vm.name)
        try:
            await _ready(provider)
            with pytest.raises(EnvError, match="snap-nope"):
                await provider.fork("snap-nope", 2)
            with pytest.raises(EnvError, match="snap-nope"):
                await provider.release("snap-nope")

            handle = await provider.snapshot()
            state = Path(vm_fleet.dir) / "snapshots" / handle / "state.mig"
            state.chmod(0o644)
            state.write_bytes(state.read_bytes()[:4096])  # a saved state cut short
            with pytest.raises(EnvError, match=r"fork of .* failed"):
                await provider.fork(handle, 2)
            report = _report(vm_fleet)
            assert report.clones == (), report.clones
            assert _qemu_pids(vm_fleet, handle) == []
            assert [s.clones for s in report.snapshots] == [()]
            await provider.release(handle)
            assert (await client.screenshot())[:8] == PNG  # the parent is untouched
        finally:
            await provider.stop()
            await client.close()

    asyncio.run(main())


def test_the_provider_turns_every_unusable_fleet_answer_into_an_env_error() -> None:
    """A fake fleet: good answers give `Clone`s with their ports; wrong ones, EnvErrors."""
    answers: dict[str, tuple[int, Any]] = {}

    async def handler(request: web.Request) -> web.Response:
        status, body = answers[f"{request.method} {request.path}"]
        return web.json_response(body, status=status)

    async def main() -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        client = EnvClient(ClientConfig(base_url="http://127.0.0.1:9", max_retries=0))
        provider = FleetVMProvider(client, FleetLink(url, "t"), "vm-0", timeout_s=5.0)
        clone = VMEntry("snap-1-0", "http://127.0.0.1:7", 7, 0, chromium_port=8, vlc_port=9,
                        snapshot="snap-1")  # fmt: skip
        taken = encode(SnapshotTaken("snap-1", {"paused_s": 0.5}))
        forked = encode(Forked("snap-1", 1.0, (clone,)))
        try:
            assert provider.can_fork
            answers["POST /vms/vm-0/snapshot"] = (200, taken)
            assert await provider.snapshot() == "snap-1"
            answers["POST /snapshots/snap-1/fork"] = (200, forked)
            (c,) = await provider.fork("snap-1", 1)
            assert (c.name, c.url, c.ports) == ("snap-1-0", clone.url, {
                "chromium_port": 8, "vlc_port": 9})  # fmt: skip
            assert provider.for_clone(client, c).name == "snap-1-0"
            answers["DELETE /snapshots/snap-1"] = (200, encode(Released("snap-1", 1, 2.0)))
            await provider.release("snap-1")

            wrong_port = {**forked, "clones": [{**encode(clone), "vlc_port": "9"}]}
            bad = [
                ("POST /vms/vm-0/snapshot", 409, encode(Failure("vm-0 is reverting")), "reverting"),
                ("POST /vms/vm-0/snapshot", 200, {"status": "ok"}, "snapshot_taken"),
                ("POST /vms/vm-0/snapshot", 200, {k: v for k, v in taken.items()
                                                  if k != "snapshot"}, "snapshot: missing"),
                ("POST /vms/vm-0/snapshot", 200, {**taken, "snapshot": 3}, "snapshot: expected str"),
                ("POST /vms/vm-0/snapshot", 200, {**taken, "version": 0}, "version: 0"),
                ("POST /vms/vm-0/snapshot", 200, {**taken, "snapshot": ""}, "not a snapshot id"),
                ("POST /snapshots/snap-1/fork", 429, encode(Failure("over max_clones")), "max_clones"),
                ("POST /snapshots/snap-1/fork", 200, {**forked, "clones": []}, "fork of 1"),
                ("POST /snapshots/snap-1/fork", 200, {**forked, "clones": ["x"]}, r"clones\[0\]"),
                ("POST /snapshots/snap-1/fork", 200, wrong_port, "vlc_port: expected int"),
                ("POST /snapshots/snap-1/fork", 200, taken, "expected forked"),
                ("DELETE /snapshots/snap-1", 404, encode(Failure("no snapshot 'snap-1'")), "snap-1"),
                ("DELETE /snapshots/snap-1", 200, encode(Failure("why 200")), "status 200"),
            ]  # fmt: skip
            for route, status, body, says in bad:
                answers[route] = (status, body)
                with pytest.raises(EnvError, match=says):
                    if "vms" in route:
                        await provider.snapshot()
                    elif route.startswith("POST"):
                        await provider.fork("snap-1", 1)
                    else:
                        await provider.release("snap-1")
        finally:
            await provider.stop()
            await client.close()
            await runner.cleanup()

    asyncio.run(main())


def test_a_snapshot_nobody_releases_is_released_by_the_fleet(tmp_path: Path) -> None:
    """The timer every snapshot starts: at `snapshot_ttl_s` the fleet releases it (its files
    deleted) and says so in its events (a saved state of files only: no VM needed)."""
    from arpo_envs.vm.qemu import SavedState
    from arpo_envs.vm.supervisor import Fleet, Snapshot

    async def main() -> list[dict[str, Any]]:
        cfg = FleetConfig(dir=str(tmp_path / "fleet"), snapshot_ttl_s=0.3,
                          snapshot_ram_dir=str(tmp_path / "ram"))  # fmt: skip
        fleet = Fleet(cfg)
        fleet.dir.mkdir(parents=True)
        folder = fleet.dir / "snapshots" / "snap-old"
        folder.mkdir(parents=True)
        cfg.ram_dir.mkdir(parents=True)
        saved = SavedState(folder, folder / "state.mig", cfg.ram_dir / "snap-old.ram",
                           folder / "disk.qcow2")  # fmt: skip
        for f in (saved.state, saved.ram, saved.disk):
            f.write_bytes(b"x")
        fleet.snapshots["snap-old"] = Snapshot("snap-old", "vm-0", saved, time.monotonic(), {})
        fleet.spawn(fleet._expire("snap-old"))  # as `Fleet.snapshot` does
        await asyncio.sleep(0.2)
        assert "snap-old" in fleet.snapshots
        await asyncio.sleep(0.5)
        assert fleet.snapshots == {} and not folder.exists() and not saved.ram.exists()
        await fleet.stop()
        assert (tmp_path / "ram").exists() and not cfg.ram_dir.exists()  # its own folder only
        return [json.loads(x) for x in (fleet.dir / "events.jsonl").read_text().splitlines()]

    events = asyncio.run(main())
    assert [e["event"] for e in events] == ["snapshot_expired", "snapshot_released"]
    assert "expired: not released within" in events[1]["reason"]

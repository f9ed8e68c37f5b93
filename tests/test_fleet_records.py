"""The fleets' typed, versioned records (`arpo_envs.fleet_records`) and their one interface.

- every record survives `encode` -> JSON -> `decode` unchanged;
- a record of another version, with a field missing, unknown or of the wrong type, or of a
  kind not expected there is refused with a `FleetRecordError` naming the record and the
  field; a range is checked where the record is made;
- the real control app of the VM fleet (`make_app` of a `Fleet` whose VM is never booted: no
  QEMU runs) answers a malformed body 400 with a `Failure` naming the field and goes on
  serving; a quarantined task's revert is a `Quarantined` answer (409 kept), which the
  actor's provider raises as `TaskQuarantined`, the one class of it;
- `status` and `down` of either kind of fleet read their own state file and no other.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import io
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from arpo_envs import fleet_records as fr
from arpo_envs.procs import free_port

ROOT = Path(__file__).resolve().parent.parent

VM = fr.VMEntry("vm-0", "http://127.0.0.1:5301", 5301, 4242, 9301, 9302)
CLONE = fr.VMEntry("snap-1-0", "http://127.0.0.1:5401", 5401, 4343, 9401, 9402, "snap-1")
VM_STATUS = fr.VMStatus("vm-0", VM.url, "ready", 4242, "", replacements=1, failure_streak=2)
DESKTOP_STATUS = fr.FleetStatus(
    "desktop", "/tmp/s.json", False, True,
    (fr.EnvStatus("desktop-0", "http://127.0.0.1:5200", "exited", 124),),
)  # fmt: skip
REPORT = fr.FleetReport(
    accel="tcg", accel_reason="software emulation", qemu="8.2.2",
    golden={"cold_boot_s": 25.5, "savevm_s": 1.5, "accel": "tcg", "bytes": 123456},
    vms=(VM_STATUS,),
    clones=(fr.VMStatus(CLONE.name, CLONE.url, "failed", 0, "QEMU exited", snapshot="snap-1"),),
    snapshots=(fr.SnapshotStatus("snap-1", "vm-0", ("snap-1-0",), 3.5, 450),),
    counters={"reverts": 3, "health_checks": 10},
    revert_median_s=None,
    quarantined_tasks={"t-bad": "setup failed on 2 VM(s)"},
    limits=fr.Limits(8, 4, 1800.0),
)  # fmt: skip


EXAMPLES: list[Any] = [
    fr.DesktopFleetState(None, (), ""),
    fr.DesktopFleetState(
        123, (fr.DesktopEntry(0, 124, "http://127.0.0.1:5200", ":7", "/tmp/d-0", "ab" * 32),),
        "/home/u/tokens.json",
    ),
    fr.VMFleetState(99, True, "/tmp/f", "http://127.0.0.1:7000", "tok", "kvm", "KVM",
                    (VM,), (CLONE,), "/dev/shm/arpo-vm"),
    fr.RevertRequest(),
    fr.RevertRequest("t-1"),
    fr.ReportRequest("t-1", False, "boom"),
    fr.SnapshotRequest(),
    fr.ForkRequest(4),
    fr.Failure("no VM 'vm-9'"),
    fr.Failure("revert failed", "replacing"),
    fr.Quarantined("t-bad", "setup failed on 2 VM(s)"),
    fr.Reverted(0.812, 0.5),
    fr.Reported("ready", True),
    fr.VMHealth(True, "ready"),
    fr.SnapshotTaken("snap-1", {"paused_s": 0.6, "ram_mib": 450.0}),
    fr.Forked("snap-1", 1.25, (CLONE,)),
    fr.Released("snap-1", 2, 30.0),
    fr.VMReport(VM_STATUS),
    REPORT,
    DESKTOP_STATUS,
    fr.FleetStatus("vm", "/tmp/f/fleet.json", True, False,
                   (fr.EnvStatus("vm-0", VM.url, "ready", 4242),), REPORT),
    VM, CLONE, VM_STATUS, fr.Limits(0, 0, 1.0),
    fr.DesktopEntry(1, 2, "", "", "/r", ""),
    fr.SnapshotStatus("s", "p", (), 0.0, 0),
    fr.EnvStatus("vm-1", "", "gone", 0),
]  # fmt: skip
"""One record of every kind (several where a field may be absent or None)."""


def test_every_record_survives_encode_json_decode() -> None:
    seen = set()
    for rec in EXAMPLES:
        cls = type(rec)
        seen.add(cls)
        data = json.loads(json.dumps(fr.encode(rec)))
        if hasattr(cls, "RECORD"):
            assert (data["record"], data["version"]) == (cls.RECORD, fr.VERSION)
            assert fr.decode(data, cls) == rec
            assert fr.decode(data) == rec  # any message, by its name
            assert fr.loads(fr.dumps(rec), cls) == rec
        else:
            assert "record" not in data and "version" not in data
            assert fr.decode(data, cls) == rec
    assert seen == {*fr.MESSAGES, *fr.PARTS}, "a record without an example here"
    for cls in (*fr.MESSAGES, *fr.PARTS):  # frozen and slotted: what crosses a process
        assert cls.__dataclass_params__.frozen and "__slots__" in vars(cls), cls  # type: ignore[attr-defined]
        assert ("version" in fr.hints(cls)) == (cls in fr.MESSAGES), cls


BAD = [
    ({"version": 2}, "vm_fleet_state.version: 2, but this side reads version 1"),
    ({"version": "1"}, "vm_fleet_state.version: '1'"),
    ({"version": None}, "vm_fleet_state.version: None"),
    ({"pid": "99"}, "vm_fleet_state.pid: expected int, got str '99'"),
    ({"pid": True}, "vm_fleet_state.pid: expected int, got bool True"),
    ({"ready": 1}, "vm_fleet_state.ready: expected bool, got int 1"),
    ({"vms": {}}, "vm_fleet_state.vms: expected a list, got an object"),
    ({"vms": [{**fr.encode(VM), "port": 1.5}]}, r"vm_fleet_state.vms\[0\].port: expected int"),
    ({"vms": ["vm-0"]}, r"vm_fleet_state.vms\[0\]: expected an object, got str 'vm-0'"),
    ({"clones": [{**fr.encode(CLONE), "extra": 1}]}, r"clones\[0\]: unknown field\(s\) extra"),
    ({"surprise": 1}, r"vm_fleet_state: unknown field\(s\) surprise"),
    ({"record": "vm_health"}, "expected vm_fleet_state, got record 'vm_health'"),
]


@pytest.mark.parametrize(("change", "says"), BAD)
def test_a_malformed_record_names_the_field(change: dict[str, Any], says: str) -> None:
    good = fr.encode(EXAMPLES[2])
    with pytest.raises(fr.FleetRecordError, match=says):
        fr.decode({**good, **change}, fr.VMFleetState)


def test_missing_fields_and_other_malformed_messages_are_named() -> None:
    state = fr.encode(EXAMPLES[2])
    for name in ("version", "pid", "token", "vms"):
        with pytest.raises(fr.FleetRecordError, match=rf"vm_fleet_state.{name}: missing"):
            fr.decode({k: v for k, v in state.items() if k != name}, fr.VMFleetState)
    cases = [
        ([1, 2], "is a JSON object, got a list"),
        ({"version": 1}, "got an object without 'record'"),
        ({**fr.encode(fr.ReportRequest("t", True)), "ok": "yes"}, "report_request.ok: expected"),
        ({**fr.encode(fr.ForkRequest(1)), "n": 0}, r"fork_request.n: must be in 1..1024, got 0"),
        ({**fr.encode(REPORT), "revert_median_s": "fast"}, r"expected float \| None, got str"),
        ({**fr.encode(REPORT), "counters": {"reverts": 1.5}}, r"counters\['reverts'\]: expected"),
        ({**fr.encode(REPORT), "limits": None}, "fleet_report.limits: expected an object, got null"),
        ({**fr.encode(DESKTOP_STATUS), "kind": "cloud"}, "fleet_status.kind: expected Literal"),
        ({**fr.encode(DESKTOP_STATUS), "report": {"record": "failure"}}, "report: expected"),
        ({**fr.encode(fr.RevertRequest()), "task_id": "x" * 2000}, "at most 1024 characters"),
    ]  # fmt: skip
    for data, says in cases:
        with pytest.raises(fr.FleetRecordError, match=says):
            fr.decode(data)
    with pytest.raises(fr.FleetRecordError, match="not JSON"):
        fr.loads(b"[" * 100_000)  # nested deeper than the parser goes
    with pytest.raises(fr.FleetRecordError, match=r"fork_request\.n"):
        fr.ForkRequest(1025)  # where it is made, too


def test_there_is_one_task_quarantined_class() -> None:
    from arpo.env import provider

    assert provider.TaskQuarantined is fr.TaskQuarantined
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for pkg in (ROOT / "arpo", ROOT / "envs" / "arpo_envs")
        for path in sorted(pkg.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.name == "TaskQuarantined"
    ]
    assert found == ["envs/arpo_envs/fleet_records.py:" + found[0].split(":")[1]], found
    e = fr.Quarantined("t", "why").error()
    assert (e.task_id, e.reason, str(e)) == ("t", "why", "task t is quarantined: why")


def test_status_and_down_read_their_own_kind_of_state_file(tmp_path: Path) -> None:
    from arpo_envs.desktop import fleet as desktops
    from arpo_envs.vm import fleet as vms

    vm_state = tmp_path / "f" / "fleet.json"
    desk_state = tmp_path / "desktops.json"
    for kind, mod, path in (("desktop", desktops, desk_state), ("vm", vms, vm_state)):
        st = mod.status(path)
        assert (st.kind, st.running, st.stale, st.envs) == (kind, False, False, ())
    # A VM fleet whose process is gone and whose pid now names a process that is not a
    # fleet (alive here, where pid 99 once ran another process and the status asked it
    # for the fleet's report): the fleet is stale, and `down` leaves that process alone.
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    vm_state.parent.mkdir()
    fr.save(vm_state, dataclasses.replace(EXAMPLES[2], pid=other.pid))
    fr.save(desk_state, EXAMPLES[1])
    assert oct(vm_state.stat().st_mode & 0o777) == "0o600"
    assert vms.status(vm_state).stale and [e.state for e in vms.status(vm_state).envs] == [
        "gone", "gone"]  # fmt: skip
    with pytest.raises(fr.FleetRecordError, match="expected desktop_fleet_state"):
        desktops.read_state(vm_state)
    assert vms.read_state(desk_state) is None  # `down` of a VM fleet then sweeps by folder
    with pytest.raises(ValueError, match="not a VM fleet's state file"):
        vms.down(tmp_path, announce=lambda s: None)  # never the folder above a fleet's
    try:
        done = vms.down(vm_state, announce=lambda s: None)
        assert not vm_state.parent.exists() and any("removed" in line for line in done), done
        assert not any(str(other.pid) in line for line in done), done
        assert other.poll() is None  # not signalled: it is not the fleet
    finally:
        other.kill()
        other.wait()
    assert tmp_path.exists()


# ---- the real control app, no VM booted -----------------------------------------------------


@pytest.fixture
def control(tmp_path: Path) -> Any:
    """(fleet, its control app): a real `Fleet` with one VM slot whose QEMU is never
    started, and `make_app` of it."""
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("the fleet needs qemu-system-x86_64 (`make sysdeps`)")
    from arpo_envs.vm.control import make_app
    from arpo_envs.vm.qemu import QemuVM
    from arpo_envs.vm.supervisor import Fleet, FleetConfig, Member

    cfg = FleetConfig(dir=str(tmp_path / "fleet"), task_quarantine_vms=1,
                      snapshot_ram_dir=str(tmp_path / "ram"))  # fmt: skip
    fleet = Fleet(cfg)
    fleet.dir.mkdir(parents=True)
    port = free_port()
    vm = QemuVM("vm-0", fleet.dir / "vm-0", fleet.machine, port, base=tmp_path / "no.qcow2",
                kernel=None, initrd=None, append=None, extra_ports={"chromium": 1, "vlc": 2})  # fmt: skip
    fleet.members["vm-0"] = Member("vm-0", port, vm)  # "starting": nothing answers on it
    return fleet, make_app(fleet)


async def _serve(app: Any) -> tuple[Any, str]:
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def test_the_control_app_answers_a_bad_body_400_and_keeps_serving(control: Any) -> None:
    fleet, app = control
    revert = fr.encode(fr.RevertRequest("t-1"))
    bad = [
        ("/vms/vm-0/revert", b"{not json", "body is not JSON"),
        ("/vms/vm-0/revert", b"[" * 100_000, "nested too deeply"),
        ("/vms/vm-0/revert", b"", "body is not JSON"),
        ("/vms/vm-0/revert", json.dumps({**revert, "version": 7}).encode(),
         "revert_request.version: 7, but this side reads version 1"),
        ("/vms/vm-0/revert", json.dumps({"task_id": "t-1"}).encode(), "without 'record'"),
        ("/vms/vm-0/revert", json.dumps({**revert, "task_id": 5}).encode(),
         "revert_request.task_id: expected str, got int 5"),
        ("/vms/vm-0/report", json.dumps(fr.encode(fr.RevertRequest())).encode(),
         "expected report_request, got record 'revert_request'"),
        ("/vms/vm-0/report", json.dumps({k: v for k, v in fr.encode(
            fr.ReportRequest("t", True)).items() if k != "ok"}).encode(), "report_request.ok: missing"),
        ("/snapshots/snap-1/fork", json.dumps({**fr.encode(fr.ForkRequest(1)), "n": 0}).encode(),
         "fork_request.n: must be in 1..1024"),
        ("/vms/vm-0/snapshot", json.dumps({"record": "snapshot_request"}).encode(),
         "snapshot_request.version: missing"),
    ]  # fmt: skip

    async def main() -> None:
        runner, url = await _serve(app)
        auth = {"Authorization": f"Bearer {fleet.token}"}
        try:
            async with aiohttp.ClientSession(headers=auth) as s:
                for path, body, says in bad:
                    async with s.post(url + path, data=body) as r:
                        assert r.status == 400, (path, body[:60], r.status, await r.text())
                        failure = fr.decode(await r.json(), fr.Failure)
                        assert says in failure.error, (path, failure)
                    async with s.get(url + "/fleet") as r:  # it keeps serving
                        assert r.status == 200
                        report = fr.decode(await r.json(), fr.FleetReport)
                        assert [v.name for v in report.vms] == ["vm-0"]
                        assert report.vms[0].state == "starting"
                async with s.post(url + "/vms/vm-9/revert", json=revert) as r:
                    assert r.status == 404
                    assert "no VM 'vm-9'" in fr.decode(await r.json(), fr.Failure).error
            async with (
                aiohttp.ClientSession() as s,
                s.get(url + "/fleet", headers={"Authorization": "Bearer wrong"}) as r,
            ):
                assert r.status == 401 and "token" in fr.decode(await r.json()).error
        finally:
            await runner.cleanup()
            await fleet.stop()

    asyncio.run(main())


def test_a_quarantined_task_is_a_typed_answer_the_provider_raises(control: Any) -> None:
    """Through the actor's real provider: a setup failure reported with
    `task_quarantine_vms=1` quarantines the task; its revert is a `Quarantined` record
    (HTTP 409 kept) and the provider raises `TaskQuarantined`; another task's revert of the
    VM that is not ready is a `Failure` with the VM's state (503), an `EnvError`."""
    from arpo.env.client import ClientConfig, EnvClient
    from arpo.env.provider import FleetLink, FleetVMProvider, TaskQuarantined
    from arpo.errors import EnvError, TaskError

    fleet, app = control

    async def main() -> None:
        runner, url = await _serve(app)
        client = EnvClient(ClientConfig(base_url="http://127.0.0.1:9", max_retries=0))
        provider = FleetVMProvider(client, FleetLink(url, fleet.token), "vm-0", timeout_s=10.0)
        try:
            await provider.report("t-bad", False, "the setup's download failed")
            assert "t-bad" in fleet.quarantined_tasks
            with pytest.raises(TaskQuarantined, match="task t-bad is quarantined") as e:
                await provider.revert_to_snapshot("t-bad")
            assert e.value.task_id == "t-bad" and "download failed" in e.value.reason
            assert not isinstance(e.value, EnvError | TaskError)
            async with (
                aiohttp.ClientSession() as s,
                s.post(f"{url}/vms/vm-0/revert", json=fr.encode(fr.RevertRequest("t-bad")),
                       headers={"Authorization": f"Bearer {fleet.token}"}) as r,
            ):  # fmt: skip
                assert r.status == 409  # for clients that read only the status
                q = fr.decode(await r.json(), fr.Quarantined)
                assert q.task_id == "t-bad"
            with pytest.raises(EnvError, match=r"revert failed \(503\): vm-0 is starting"):
                await provider.revert_to_snapshot("t-good")
            health = await provider.health()
            assert not health.ok and not health.final and health.reason.startswith("starting")
        finally:
            await provider.stop()
            await client.close()
            await runner.cleanup()
            await fleet.stop()

    asyncio.run(main())


# ---- decode raises its own error for any input -----------------------------------------------


def _deep(n: int, leaf: Any = 1) -> Any:
    v = leaf
    for _ in range(n):
        v = [v]
    return v


class _Unshowable:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


HOSTILE = [
    10**5000,  # repr() refuses ints of more than 4300 digits
    -(10**5000),
    _deep(5000),  # repr() of it recurses past the interpreter's limit
    {"a": _deep(5000)},
    float("nan"),
    _Unshowable(),
    (1, 2),
    b"bytes",
]


def test_decode_raises_only_fleet_record_errors_for_any_value() -> None:
    """Every field of every record, and `version`, given each hostile value (as a direct
    caller could: `decode` takes Python data, not only what `json.loads` makes), and the
    hostile value as the whole record: `FleetRecordError` and nothing else."""
    cases: list[tuple[Any, tuple[type, ...]]] = []
    for rec in EXAMPLES:
        cls = type(rec)
        good = fr.encode(rec)
        for name in [*fr.hints(cls), "record", 10**5000]:
            for bad in HOSTILE:
                cases.append(({**good, name: bad}, (cls,)))
    cases += [(bad, ()) for bad in HOSTILE]
    cases += [({10**5000: 1, "record": "revert_request", "version": 1}, ())]
    for data, expected in cases:
        try:
            fr.decode(data, *expected)
        except fr.FleetRecordError as e:
            assert len(str(e)) < 1000, str(e)[:200]
        except BaseException as e:  # pragma: no cover - the failure this test is about
            raise AssertionError(f"decode raised {type(e).__name__}: {str(e)[:200]}") from e
    with pytest.raises(
        fr.FleetRecordError, match=r"vm_fleet_state\.version: an int of 5001 digits"
    ):
        fr.decode({**fr.encode(EXAMPLES[2]), "version": 10**5000}, fr.VMFleetState)
    with pytest.raises(fr.FleetRecordError, match=r"revert_request.version: a list, but"):
        fr.decode({**fr.encode(fr.RevertRequest()), "version": _deep(5000)})
    with pytest.raises(fr.FleetRecordError, match=r"revert_request.task_id: expected str, got an"):
        fr.decode({**fr.encode(fr.RevertRequest()), "task_id": 10**5000})


# ---- every answer of the control API is a record ---------------------------------------------


def test_the_control_apps_own_refusals_are_failure_records(control: Any) -> None:
    """A body over the app's bound (413), a route it does not have (404), a method a route
    does not take (405, its Allow header kept) are `Failure` records too, with the status
    and the reason; a wrong token on an unknown route is still 401."""
    fleet, app = control

    async def main() -> None:
        runner, url = await _serve(app)
        auth = {"Authorization": f"Bearer {fleet.token}"}
        try:
            async with aiohttp.ClientSession(headers=auth) as s:
                big = json.dumps({**fr.encode(fr.RevertRequest()), "task_id": "x" * (2 << 20)})
                cases = [
                    ("POST", "/vms/vm-0/revert", io.BytesIO(big.encode()), 413, "too large"),
                    ("GET", "/no/such/route", None, 404, "/no/such/route"),
                    ("POST", "/fleet", b"{}", 405, "POST"),
                    ("GET", "/vms/vm-0/revert", None, 405, "GET"),
                ]
                for method, path, data, status, says in cases:
                    async with s.request(method, url + path, data=data) as r:
                        text = await r.text()
                        assert r.status == status, (path, r.status, text[:200])
                        assert r.content_type == "application/json", (path, text[:200])
                        failure = fr.loads(text, fr.Failure)
                        assert says in failure.error, (path, failure)
                        if status == 405:
                            assert r.headers["Allow"], path
                async with s.get(url + "/fleet") as r:  # it keeps serving
                    assert r.status == 200
            async with (
                aiohttp.ClientSession() as s,
                s.get(url + "/no/such/route", headers={"Authorization": "Bearer no"}) as r,
            ):
                assert r.status == 401 and "token" in fr.decode(await r.json(), fr.Failure).error
        finally:
            await runner.cleanup()
            await fleet.stop()

    asyncio.run(main())


def test_a_second_fleet_is_refused_only_while_the_first_ones_process_runs(tmp_path: Path) -> None:
    """`up` refuses a folder whose state file names a running fleet process, and starts
    where that pid now names another process (a state file outlives its fleet), where it
    was once refused with a pid that was no fleet's."""
    import dataclasses as dc
    import sys
    import time

    from arpo_envs.vm import fleet as vms
    from arpo_envs.vm.supervisor import FleetConfig

    cfg = FleetConfig(dir=str(tmp_path / "f"))
    cfg.state_file.parent.mkdir(parents=True)
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    # a process whose command line names the fleet's module, as `arpo_envs.vm.control` does
    fleet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "arpo_envs"],
                             start_new_session=True)  # fmt: skip
    try:
        fr.save(cfg.state_file, dc.replace(EXAMPLES[2], pid=other.pid))
        vms._refuse_second(cfg)  # not a fleet: nothing refused
        fr.save(cfg.state_file, dc.replace(EXAMPLES[2], pid=fleet.pid))
        # the child's command line in /proc can lag its start by a moment
        deadline = time.monotonic() + 10
        while "arpo_envs" not in vms._cmdline(fleet.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(RuntimeError, match=rf"a fleet already runs .*pid {fleet.pid}"):
            vms._refuse_second(cfg)
    finally:
        for p in (other, fleet):
            p.kill()
            p.wait()

"""Real QEMU VMs of the project's test image (`arpo-envs vm`), under KVM where the host has it
and software emulation otherwise.

The image is built once per machine into the cache (`arpo-envs vm build`, about 2 minutes
from Debian's mirror) and every fleet starts its VMs from the golden snapshot (one cold boot
per image, about 25 s), so the whole module takes a few minutes. What is checked:

- an episode's file and window are gone when the next episode starts on the same VM
  (the fleet's snapshot revert, called by the runner's provider);
- OSWorld's own host controller (`desktop_env`'s `PythonController`) drives a VM;
- the local task suite's oracles pass on a VM through the real actor, scored by OSWorld's
  evaluator code; SIGKILL of the VM's QEMU mid-run makes an episode `env_error`, the VM is
  replaced and the rest of the run goes on it, every trajectory accounted for;
- a check that runs after the fleet replaced the VM (it reads the replacement, in its
  golden state) makes the episode `env_error`, not a score;
- a task whose setup always fails is quarantined after failing on 2 VMs, the VMs are not
  blamed and the other tasks run;
- `down` after SIGKILL of the fleet leaves no process and no folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import loopback
from day_shard import sweep_shard

from arpo.config import validate
from arpo.env.client import ClientConfig, EnvClient
from arpo.env.environment import Environment
from arpo.env.provider import FleetLink, FleetVMProvider
from arpo.env.runner import RunnerConfig
from arpo.env.task import Task
from arpo.pool.collect import CollectConfig, run_collect

if shutil.which("qemu-system-x86_64") is None or shutil.which("debootstrap") is None:
    pytest.fail("the VM tests need `make sysdeps` (qemu-system-x86, debootstrap)", pytrace=False)

from arpo_envs.fleet_records import FleetReport
from arpo_envs.procs import wait_gone
from arpo_envs.vm.fleet import FleetConfig, down, read_state, status, up

REPO = Path(__file__).resolve().parent.parent
LOCAL_TASKS = REPO / "envs" / "arpo_envs" / "tasks" / "local"
OSWORLD_PY = REPO / ".venv-osworld" / "bin" / "python"


@pytest.fixture(scope="module")
def fleet(vm_fleet: FleetConfig) -> FleetConfig:
    """The session's fleet of 2 VMs (conftest's `vm_fleet`, shared with test_vm_fork.py)."""
    return vm_fleet


def _fleet_status(cfg: FleetConfig) -> FleetReport:
    """The running fleet's own report (`GET /fleet`)."""
    st = status(cfg.state_file)
    assert st.running and st.report is not None, st
    return st.report


def _task(tid: str, config: list[dict[str, Any]]) -> Task:
    raw = {
        "id": tid,
        "instruction": "test",
        "config": config,
        "evaluator": {"func": "infeasible"},
    }
    return Task.from_dict(raw, domain="vm")


async def _shell(client: EnvClient, cmd: str) -> str:
    res = await client.execute(cmd, shell=True)
    return res.output


def test_the_next_episode_starts_from_the_snapshot(fleet: FleetConfig) -> None:
    st = read_state(fleet.state_file)
    assert st is not None and st.accel in ("kvm", "tcg")
    vm = st.vms[0]
    link = FleetLink.from_state(fleet.state_file)

    async def main() -> tuple[str, str, str, str]:
        env = Environment(
            0, vm.url, RunnerConfig(evaluator="own", osworld_probe_timeout_s=0),
            provider=lambda c: FleetVMProvider(c, link, vm.name),
        )  # fmt: skip
        client = env.client
        try:
            await env.reset(
                _task(
                    "leave-a-mess",
                    [
                        {"type": "execute", "parameters": {
                            "command": "echo mess > /home/user/leak.txt", "shell": True}},
                        {"type": "launch", "parameters": {
                            "command": "xterm -title LeftOpen", "shell": True}},
                    ],
                )
            )  # fmt: skip
            for _ in range(60):  # the window maps within seconds, also under emulation
                windows = await _shell(client, "wmctrl -l")
                if "LeftOpen" in windows:
                    break
                await asyncio.sleep(0.5)
            files = await _shell(client, "ls /home/user")
            await env.reset(_task("second", []))
            return (
                files,
                windows,
                await _shell(client, "ls /home/user"),
                await _shell(client, "wmctrl -l"),
            )
        finally:
            await env.runner.aclose()
            await env.close()

    files1, windows1, files2, windows2 = asyncio.run(main())
    assert "leak.txt" in files1 and "LeftOpen" in windows1
    assert "leak.txt" not in files2 and "LeftOpen" not in windows2
    counters = _fleet_status(fleet).counters
    assert counters["reverts"] >= 2


def test_osworld_python_controller_drives_a_vm(fleet: FleetConfig) -> None:
    assert OSWORLD_PY.exists(), "make osworld-evaluator installs OSWorld's code"
    st = read_state(fleet.state_file)
    assert st is not None
    port = st.vms[1].port
    script = f"""
import json
from desktop_env.controllers.python import PythonController
c = PythonController(vm_ip="127.0.0.1", server_port={port})
png = c.get_screenshot()
r = c.execute_python_command("print(6 * 7); open('/home/user/f.txt', 'w').write('from osworld')")
data = c.get_file("/home/user/f.txt")
print(json.dumps({{"png": png[:8].hex() if png else None, "out": r and r.get("output"),
                   "file": data.decode() if data else None,
                   "platform": c.get_vm_platform()}}))
"""
    out = subprocess.run(
        [str(OSWORLD_PY), "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["png"] == "89504e470d0a1a0a"
    assert got["out"].strip() == "42"
    assert got["file"] == "from osworld"
    assert got["platform"] == "Linux"


def test_health_checks_beside_reverts_never_replace_a_healthy_vm(fleet: FleetConfig) -> None:
    """A health check, then a revert asked for 0 to 150 ms later (while the check's screenshot
    is in flight): the fleet runs them one after the other. A request in flight across a
    `loadvm` hangs until its timeout (the guest's TCP state is the snapshot's), and the
    fleet used to replace the healthy VM for it, in the middle of the next episode."""
    st = read_state(fleet.state_file)
    assert st is not None
    vm = st.vms[1]
    link = FleetLink.from_state(fleet.state_file)
    before = _fleet_status(fleet)

    async def main() -> list[Any]:
        client = EnvClient(ClientConfig(base_url=vm.url))
        provider = FleetVMProvider(client, link, vm.name)

        async def revert_after(s: float) -> None:
            await asyncio.sleep(s)
            await provider.revert_to_snapshot()

        out = []
        try:
            for delay in (0.0, 0.03, 0.06, 0.09, 0.12, 0.15):
                check, _ = await asyncio.gather(provider.health(), revert_after(delay))
                out.append(check)
        finally:
            await provider.stop()
            await client.close()
        return out

    health = asyncio.run(main())
    assert all(h.ok for h in health), health
    after = _fleet_status(fleet)
    assert after.vms[1].replacements == before.vms[1].replacements, after
    assert after.vms[1].state == "ready", after


# Slow (25 s): the replacement path also runs in test_oracles_pass_on_a_vm_and_a_killed_qemu_is_replaced.
@pytest.mark.slow
def test_a_guest_that_stops_answering_is_replaced_by_the_health_timer(
    fleet: FleetConfig,
) -> None:
    before = _fleet_status(fleet).vms[1]
    os.kill(before.qemu_pid, signal.SIGSTOP)  # the guest freezes; QEMU stays alive
    try:
        end = time.monotonic() + 180
        now = before
        while time.monotonic() < end:
            now = _fleet_status(fleet).vms[1]
            if now.qemu_pid != before.qemu_pid and now.state == "ready":
                break
            time.sleep(1.0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(before.qemu_pid, signal.SIGCONT)
    assert now.qemu_pid != before.qemu_pid and now.state == "ready", now
    assert now.replacements == before.replacements + 1
    assert "health check" in now.last_error
    with urllib.request.urlopen(now.url + "/screenshot", timeout=30) as r:
        assert r.read(8) == b"\x89PNG\r\n\x1a\n"


# A check that first waits (60 s at most) for the host to open its gate, /tmp/gate in the
# guest: the episode is held between its actions and its check until the test acts.
CHECK_GATE = (
    "touch /tmp/at-check; for i in $(seq 600); do [ -e /tmp/gate ] && exit 0; sleep 0.1; "
    "done; exit 1"
)


def _terminal_task(k: int, *, gated: bool = False) -> dict[str, Any]:
    """A task in OSWorld's schema: type a command into a terminal the setup opened; its
    oracle is plain pyautogui (the scripted policy turns it into UI-TARS actions). `gated`:
    its check waits for the host's gate (CHECK_GATE)."""
    out = f"/home/user/out-{k}.txt"
    gate = [{"type": "execute", "parameters": {"command": CHECK_GATE, "shell": True}}]
    return {
        "id": f"vm-terminal-{k}",
        "instruction": f"In the terminal, write vm-ok-{k} into {out}.",
        "config": [
            {"type": "launch", "parameters": {"command": "xterm -title VMTerm", "shell": True}},
            {"type": "execute", "parameters": {
                "command": "wmctrl -l", "shell": True, "until": {"stdout": "VMTerm"}}},
            {"type": "activate_window", "parameters": {"window_name": "VMTerm"}},
            {"type": "execute", "parameters": {"command": "touch /tmp/setup-done", "shell": True}},
        ],
        "evaluator": {
            "postconfig": [
                *(gate if gated else []), {"type": "sleep", "parameters": {"seconds": 2}}],
            "func": "exact_match",
            "result": {"type": "vm_command_line", "command": f"cat {out}", "shell": True},
            "expected": {"type": "rule", "rules": {"expected": f"vm-ok-{k}\n"}},
        },
        "oracle": [f"pyautogui.write('echo vm-ok-{k} > {out}\\n', interval=0.01)"],
    }  # fmt: skip


def _collect_on_vms(
    fleet: FleetConfig, tmp: Path, tasks: Path, runs: int, attempts: int, *actor_args: str
) -> dict[str, Any]:
    """`arpo collect` of `tasks` by a real actor on the fleet's VMs with the scripted policy."""
    cfg = CollectConfig(
        tasks=str(tasks),
        model="scripted",
        runs_per_task=runs,
        max_attempts=attempts,
        out=str(tmp / "collect"),
        transport=loopback(),
        local_actor_args=[
            f"vm_fleet='{fleet.state_file}'",
            "policy='scripted'",
            "progress_s=0",
            *actor_args,
        ],
        local_actor_log=str(tmp / "actor.log"),
        timeout_s=900,
        progress_s=0,
    )
    return run_collect(validate(cfg))


def _os_tasks(tmp: Path, n: int, *, gated: bool = False) -> Path:
    """`n` terminal tasks in <tmp>/tasks/os/."""
    out = tmp / "tasks" / "os"
    out.mkdir(parents=True)
    for k in range(n):
        (out / f"vm-terminal-{k}.json").write_text(json.dumps(_terminal_task(k, gated=gated)))
    return out.parent


@pytest.mark.timeout(600)
def test_a_vm_replaced_before_the_check_makes_the_episode_env_error(fleet: FleetConfig) -> None:
    """The fleet replaces a killed VM on the same URL from its golden snapshot; a check that
    runs after that reads the replacement (OSWorld's setup controller even waits for it) and
    scores 0. `Environment.evaluate` compares the machine with the one of the episode's start
    and makes that result env_error; the next episode on the replacement is scored again."""
    vm = _fleet_status(fleet).vms[1]
    link = FleetLink.from_state(fleet.state_file)
    task = Task.from_dict(
        {
            "id": "vm-replaced",
            "instruction": "test",
            "config": [{"type": "execute", "parameters": {
                "command": "echo vm-ok > /home/user/out.txt", "shell": True}}],
            "evaluator": {
                "func": "exact_match",
                "result": {"type": "vm_command_line", "command": "cat /home/user/out.txt",
                           "shell": True},
                "expected": {"type": "rule", "rules": {"expected": "vm-ok\n"}},
            },
        },
        domain="vm",
    )  # fmt: skip

    def replaced() -> Any:
        end = time.monotonic() + 300
        while time.monotonic() < end:
            now = _fleet_status(fleet).vms[1]
            if now.qemu_pid not in (0, vm.qemu_pid) and now.state == "ready":
                return now
            time.sleep(0.5)
        raise AssertionError(f"vm-1 was not replaced within 300 s: {now}")

    async def main() -> tuple[Any, ...]:
        env = Environment(
            0, vm.url, RunnerConfig(evaluator="own", osworld_probe_timeout_s=0),
            provider=lambda c: FleetVMProvider(c, link, vm.name),
        )  # fmt: skip
        try:
            assert await env.prepare(task) is None
            started_on = env.instance
            before = await env.evaluate(task)
            os.kill(vm.qemu_pid, signal.SIGKILL)
            now = await asyncio.to_thread(replaced)
            await env.client.close()  # the old guest's connections are dead
            plain = await env.runner.evaluate(task)  # what the checker alone says
            after = await env.evaluate(task)
            assert await env.prepare(task) is None
            again = await env.evaluate(task)
            return started_on, before, now, plain, after, again
        finally:
            await env.runner.aclose()
            await env.close()

    started_on, before, now, plain, after, again = asyncio.run(main())
    assert started_on == f"QEMU pid {vm.qemu_pid}, replacement {vm.replacements}"

    # the provider asks the fleet for this VM's line alone; a name it does not have is "gone"
    async def ghost() -> str:
        client = EnvClient(ClientConfig(base_url=vm.url))
        provider = FleetVMProvider(client, link, "vm-9")
        try:
            return await provider.instance()
        finally:
            await provider.stop()
            await client.close()

    assert asyncio.run(ghost()) == "gone"
    assert (before.status, before.score) == ("ok", 1.0), before
    assert (plain.status, plain.score) == ("ok", 0.0), plain  # the replacement has no file
    assert (after.status, after.score) == ("env_error", 0.0), after
    assert "replaced during the episode" in (after.error or "")
    assert started_on in after.error and f"QEMU pid {now.qemu_pid}" in after.error, after.error
    assert (again.status, again.score) == ("ok", 1.0), again


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_oracles_pass_on_a_vm_and_a_killed_qemu_is_replaced(
    fleet: FleetConfig, tmp_path: Path
) -> None:
    """QEMU killed inside an episode, every time: each task's check waits for the host's
    gate (CHECK_GATE); the first episode to reach it has its VM killed there instead, and
    every later one is let through. So the kill always lands after the episode's actions and
    before its check, and that episode must come back env_error."""
    tasks = _os_tasks(tmp_path, 2, gated=True)
    runs = 2
    before = _fleet_status(fleet)
    vm0_pid = before.vms[0].qemu_pid
    killed: dict[str, Any] = {}
    done = threading.Event()

    url = before.vms[0].url

    def guest(command: str) -> str:
        req = urllib.request.Request(
            url + "/execute",
            data=json.dumps({"command": command, "shell": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return str(json.loads(r.read()).get("output", ""))
        except OSError:  # the VM is down or being replaced
            return ""

    def gatekeeper() -> None:
        # vm-0 is the actor's only VM (vm_count=1); the revert takes /tmp's files away
        while not done.is_set():
            if "yes" in guest("test -e /tmp/at-check && echo yes"):
                if "at" not in killed:
                    os.kill(vm0_pid, signal.SIGKILL)
                    killed["at"] = time.monotonic()
                else:
                    guest("touch /tmp/gate")
            done.wait(0.2)

    keeper = threading.Thread(target=gatekeeper, daemon=True)
    keeper.start()
    try:
        result = _collect_on_vms(
            fleet, tmp_path, tasks, runs, 3, "vm_count=1", "runner.evaluator='osworld'"
        )
    finally:
        done.set()
        keeper.join(timeout=15)
    assert "at" in killed, "the run ended before an episode started"
    assert result["complete"] is True, (tmp_path / "actor.log").read_text()[-3000:]
    per_task = result["tasks"]
    assert len(per_task) == 2
    for tid, c in per_task.items():
        assert c["runs"] == runs and c["unknown"] == 0, (tid, c)
        assert c["successes"] == runs, (tid, c)  # the oracles pass, scored by OSWorld's code
    assert sum(c["env_errors"] for c in per_task.values()) == 1  # the killed episode
    after = _fleet_status(fleet)
    assert after.vms[0].qemu_pid != vm0_pid and after.vms[0].state == "ready"
    events = [
        json.loads(line) for line in (Path(fleet.dir) / "events.jsonl").read_text().splitlines()
    ]
    assert any(
        e["event"] == "vm_replace" and e["vm"] == "vm-0" and "QEMU exited" in e["reason"]
        for e in events
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_task_whose_setup_always_fails_is_quarantined(fleet: FleetConfig, tmp_path: Path) -> None:
    tasks = _os_tasks(tmp_path, 1)
    bad = {
        "id": "always-fails",
        "instruction": "never set up",
        "config": [{"type": "open", "parameters": {"path": "/nonexistent/missing.txt"}}],
        "evaluator": {"func": "infeasible"},
        "oracle": ["WAIT"],
    }
    (tasks / "os" / "always-fails.json").write_text(json.dumps(bad))
    before = _fleet_status(fleet)
    result = _collect_on_vms(fleet, tmp_path, tasks, 2, 4, "environment.reset_retries=1")
    after = _fleet_status(fleet)
    assert "always-fails" in after.quarantined_tasks, after
    assert "2 VM" in after.quarantined_tasks["always-fails"]
    # the VMs were not blamed for the task
    assert [v.replacements for v in after.vms] == [v.replacements for v in before.vms]
    good = [t for t in result["tasks"] if t != "always-fails"]
    assert good and all(result["tasks"][t]["successes"] == 2 for t in good)
    assert result["tasks"]["always-fails"]["successes"] == 0


def test_down_after_sigkill_of_the_fleet_leaves_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "killed"
    cfg = FleetConfig(n=1, dir=str(folder), health_interval_s=0)
    fleet = up(cfg, announce=lambda s: None)
    qemu = fleet.envs[0].pid
    with urllib.request.urlopen(fleet.envs[0].url + "/screenshot", timeout=30) as r:
        assert r.read(8) == b"\x89PNG\r\n\x1a\n"
    os.kill(fleet.state.pid, signal.SIGKILL)
    assert wait_gone([fleet.state.pid], 10.0) == []
    assert fleet.status().stale
    done = down(cfg.state_file, announce=lambda s: None)  # as from another shell
    assert not folder.exists(), done
    assert not Path(f"/proc/{qemu}").exists() or b"Z" in Path(f"/proc/{qemu}/stat").read_bytes()
    leftovers = subprocess.run(["pgrep", "-f", str(folder)], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""


async def _play_on_vm(
    fleet: FleetConfig, tasks: list[Task], index: int = 0
) -> list[tuple[str, float, str, str]]:
    """Each task's oracle on vm-<index>, reverted before each, scored by OSWorld's evaluator."""
    st = read_state(fleet.state_file)
    assert st is not None
    vm = st.vms[index]
    link = FleetLink.from_state(fleet.state_file)
    out = []
    env = Environment(
        0, vm.url, RunnerConfig(evaluator="osworld"),
        provider=lambda c: FleetVMProvider(c, link, vm.name),
    )  # fmt: skip
    try:
        for t in tasks:
            res = await env.run(t, [*t.extra["oracle"], "DONE"])
            out.append((t.id, res.score, res.status, res.error or ""))
    finally:
        await env.runner.aclose()
        await env.close()
    return out


# In `make test-all`: `make test` runs oracles on a VM in test_oracles_pass_on_a_vm_and_a_
# killed_qemu_is_replaced, and the local suite's on real desktops in test_local_tasks.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_local_suite_oracles_pass_on_a_vm_subset(fleet: FleetConfig) -> None:
    from arpo_envs.tasks import SUITE_DIR

    from arpo.env import load_tasks

    wanted = ("os-run-typed-command", "os-move-logs", "editor-append-line")
    tasks = [t for t in load_tasks(SUITE_DIR) if t.id in wanted]
    assert len(tasks) == len(wanted)
    results = asyncio.run(_play_on_vm(fleet, tasks))
    failed = [r for r in results if r[1] != 1.0]
    assert not failed, f"{len(failed)}/{len(results)} oracles did not score 1 on a VM: {failed}"


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_local_suite_oracles_pass_on_vms_one_shard(fleet: FleetConfig) -> None:
    """The oracles of one shard of the local suite (tests/day_shard.py: the whole suite takes
    about 2 hours on one VM under software emulation; ARPO_VM_SUITE_SHARD=all for every task,
    `make vm-suite`), on both VMs of the fleet at once."""
    from arpo_envs.tasks import SUITE_DIR

    from arpo.env import load_tasks

    tasks, name = sweep_shard(load_tasks(SUITE_DIR), "ARPO_VM_SUITE_SHARD")

    async def both() -> list[tuple[str, float, str, str]]:
        halves = await asyncio.gather(*(_play_on_vm(fleet, tasks[i::2], i) for i in (0, 1)))
        return [r for half in halves for r in half]

    results = asyncio.run(both())
    assert len(results) == len(tasks)
    failed = [r for r in results if r[1] != 1.0]
    assert not failed, (
        f"shard {name}: {len(failed)}/{len(results)} oracles did not score 1 on a VM: {failed}"
    )


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_training_run_on_vms(tmp_path: Path) -> None:
    """`arpo train vms=1`: its own fleet, the tiny model, 2 iterations on VM episodes only;
    every trajectory accounted for and the fleet gone at the end."""

    from train_configs import small_run

    from arpo.learner.checkpoint import CheckpointConfig
    from arpo.learner.metrics import read_metrics
    from arpo.policy.tiny import build_tiny_model
    from arpo.train import TrainRun

    tasks = _os_tasks(tmp_path, 2)
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    cfg = small_run(
        tmp_path, model, tasks, checkpoint=CheckpointConfig(every=1, keep=2),
        actors=0, vms=1, minutes=0,
    )  # fmt: skip
    result = TrainRun(cfg).run()
    rows = read_metrics(Path(cfg.run_dir) / "learner" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    acc = result["accounting"]
    assert acc["unaccounted"] == 0 and acc["trained_twice"] == 0
    assert acc["finished_by_status"].get("ok", 0) >= 8
    assert not (Path(cfg.run_dir) / "vms").exists()  # the run's fleet is down
    leftovers = subprocess.run(["pgrep", "-f", str(Path(cfg.run_dir) / "vms")], capture_output=True)
    assert leftovers.stdout.strip() == b""

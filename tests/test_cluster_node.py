"""The parts of `arpo train` on a Ray cluster that need no cluster: a node's agent (plain
Python: it starts `arpo-actor` on its node and hands back its log and spool ledger), the
driver's copy of what it hands back, the accounting of a lost node's spool, and the checks
of the `cluster` section. tests/test_train_ray.py runs them on a real cluster."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import make_trajectory

from arpo.actor.spool import Spool
from arpo.errors import ConfigError
from arpo.learner.learner import TRAINED_LOG, trained_log_lines
from arpo.record import Trajectory
from arpo.train import TrainConfig, account
from arpo.train.cluster import ClusterConfig, keep_poll, mark_lost
from arpo.train.node import NodeAgent


def _traj(tid: str) -> Trajectory:
    t = make_trajectory(np.random.default_rng(len(tid)), turns=2, tokens=60, png_bytes=200)
    return dataclasses.replace(t, trajectory_id=tid)


def _agent(tmp_path: Path) -> NodeAgent:
    toml = 'actor_id = "nodeX"\nspool_dir = "@NODE@/spool"\n[engine]\nmodel = "@MODEL@"\n'
    keys = {"actor.key_secret": b"secret", "learner.key": b"public"}
    return NodeAgent("nodeX", toml, keys, "/models/m", None, f"test-{tmp_path.name}")


def test_an_agent_hands_back_its_spool_and_the_accounting_counts_a_lost_node(
    tmp_path: Path,
) -> None:
    agent = _agent(tmp_path)
    try:
        text = agent.config.read_text()
        assert f'spool_dir = "{agent.folder}/spool"' in text and '"/models/m"' in text
        assert (agent.folder / "keys" / "actor.key_secret").stat().st_mode & 0o077 == 0
        spool = Spool(agent.spool)  # what the node's actor wrote
        for tid in ("trained", "pending-trained-later", "pending-lost"):
            spool.put(_traj(tid))
        spool.remove("trained")
        run = tmp_path / "run"
        keep_poll(run, "nodeX", agent.poll())
        assert agent.poll()["ledger"] == b""  # each ledger line comes back once
        mark_lost(run, "nodeX", {"why": "SIGKILL"})
    finally:
        agent.remove()
    assert not agent.folder.parent.exists()
    (run / "learner").mkdir()
    (run / "learner" / TRAINED_LOG).write_text(
        trained_log_lines(1, [("trained", False), ("pending-trained-later", False)], [])
    )
    out = account(run, None)
    assert out["finished"] == 3 and out["trained"] == 2
    assert out["lost_with_node"] == 1 and out["in_spool"] == 0
    assert out["unaccounted"] == 0 and out["trained_twice"] == 0


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"address": "nowhere"}, "cluster.address"),
        ({"address": "auto", "bind_host": "0.0.0.0"}, "cluster.bind_host"),
        ({"address": "auto", "poll_s": 0}, "cluster.poll_s"),
        ({"address": "auto", "sim_resource": "arpo sim"}, "cluster.sim_resource"),
    ],
)
def test_a_bad_cluster_section_is_refused_naming_its_field(fields: dict, named: str) -> None:
    from arpo.config import validate

    with pytest.raises(ConfigError, match=named):
        validate(TrainConfig(cluster=ClusterConfig(**fields)))


def test_a_cluster_run_refuses_local_simulated_actors() -> None:
    from arpo.config import validate

    with pytest.raises(ConfigError, match="actors"):
        validate(TrainConfig(actors=3, cluster=ClusterConfig(address="auto")))
    with pytest.raises(ConfigError, match="sim_envs_per_actor"):
        validate(TrainConfig(sim_envs_per_actor=0, cluster=ClusterConfig(address="auto")))


def _agent_in_child(actor_id: str, toml: str, run_id: str, kind: str, timeout: float):
    """A `NodeAgent` (with `kind`, e.g. 'desktops=1') started in a child process, which
    prints its folder once `start` returned and then waits to be killed (a node lost)."""
    code = (
        "import time\n"
        "from arpo.train.node import NodeAgent\n"
        f"a = NodeAgent({actor_id!r}, {toml!r}, {{}}, '/no/model', None, {run_id!r}, {kind},"
        f" start_timeout_s={timeout})\n"
        "a.start()\nprint(a.folder, flush=True)\ntime.sleep(3600)\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


DESKTOP_BINS = [b for b in ("Xvfb", "openbox") if not shutil.which(b)]


def _desktop_state(agent: NodeAgent) -> list[tuple[int, str]]:
    from arpo_envs.desktop.fleet import read_state

    state = read_state(agent.folder / "desktops.json")
    return [(s.pid, s.root) for s in state.servers] if state is not None else []


def _get(url: str, token: str) -> int:
    req = urllib.request.Request(url + "/platform", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _gone(pids: list[int], roots: list[str], timeout: float = 60.0) -> bool:
    from arpo_envs.desktop.fleet import orphans
    from arpo_envs.procs import alive

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not any(alive(p) for p in pids) and not orphans(roots):
            return True
        time.sleep(0.3)
    return False


@pytest.mark.skipif(bool(DESKTOP_BINS), reason=f"missing {DESKTOP_BINS} (make sysdeps)")
def test_a_node_agent_runs_its_desktops_restarts_them_and_takes_them_down_when_it_dies(
    tmp_path: Path,
) -> None:
    """A node with local desktops: the agent starts them (each its own token, written into
    its actor's config), starts them again after one died, and when the agent's process is
    SIGKILLed (its node lost) the desktops stop too: nothing is left running."""
    from arpo.actor.config import ActorConfig
    from arpo.config import load_config

    toml = 'actor_id = "nodeD"\nspool_dir = "@NODE@/spool"\n[engine]\nmodel = "@MODEL@"\n'
    agent = NodeAgent("nodeD", toml, {}, "/no/model", None, f"test-{tmp_path.name}",
                      desktops=1, start_timeout_s=90)  # fmt: skip
    try:
        agent.start()  # the actor exits at once (no model): the desktops are what is tested
        ac = load_config(ActorConfig, agent.config)
        assert len(ac.envs) == 1 and ac.envs[0].startswith("http://127.0.0.1:")
        assert _get(ac.envs[0], ac.env_tokens[0]) == 200
        assert _get(ac.envs[0], "wrong") == 401
        first = _desktop_state(agent)
        os.kill(first[0][0], signal.SIGKILL)  # the desktop dies: its fleet goes down
        deadline = time.monotonic() + 60
        while agent.poll()["desktops"] and time.monotonic() < deadline:
            time.sleep(0.3)
        answer = agent.poll()
        assert answer["desktops"] == 0 and not answer["alive"], answer
        agent.start()  # both again, on a new port with a new token
        again = load_config(ActorConfig, agent.config)
        assert again.env_tokens != ac.env_tokens and _get(again.envs[0], again.env_tokens[0]) == 200
        second = _desktop_state(agent)
        agent.stop(10)
        assert _gone([p for p, _ in first + second], [r for _, r in first + second])
    finally:
        agent.remove()

    # The agent's own process killed hard: the desktops it started stop as well.
    child = _agent_in_child("nodeE", toml, f"test-{tmp_path.name}-e", "desktops=1", 90)
    try:
        folder = Path(child.stdout.readline().strip())  # type: ignore[union-attr]
        agent_e = NodeAgent.__new__(NodeAgent)
        agent_e.folder = folder
        servers = _desktop_state(agent_e)
        assert servers, "the child's agent started no desktop"
        child.kill()
        child.wait(30)
        assert _gone([p for p, _ in servers], [r for _, r in servers])
    finally:
        child.kill()
        child.wait(30)
        child.stdout.close()  # type: ignore[union-attr]
        shutil.rmtree(
            Path(tempfile.gettempdir()) / f"arpo-test-{tmp_path.name}-e", ignore_errors=True
        )


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="QEMU missing")
def test_a_node_agent_runs_its_vms_and_they_stop_when_it_dies(tmp_path: Path) -> None:
    """A node offering VMs: the agent's child starts a VM fleet in its node folder, waits
    until it is ready and names it in its actor's config; the agent's process SIGKILLed,
    the fleet stops its VMs (no QEMU of it is left)."""
    from arpo_envs.fleet_records import VMFleetState, load
    from arpo_envs.vm.image import build

    build()  # cached after the first time on a machine
    toml = 'actor_id = "nodeV"\nspool_dir = "@NODE@/spool"\n[engine]\nmodel = "@MODEL@"\n'
    run_id = f"test-{tmp_path.name}-v"
    child = _agent_in_child("nodeV", toml, run_id, "vms=1", 600)
    try:
        line = child.stdout.readline().strip()  # type: ignore[union-attr]
        assert line, "the agent did not start its VMs"
        folder = Path(line)
        state = load(folder / "vms" / "fleet.json", VMFleetState)
        assert state.ready and len(state.vms) == 1
        qemu = [v.qemu_pid for v in state.vms]
        text = (folder / "actor.toml").read_text()
        assert f'vm_fleet = "{folder / "vms" / "fleet.json"}"' in text, text
        child.kill()
        child.wait(30)
        end = time.monotonic() + 120
        while any(Path(f"/proc/{p}").exists() for p in qemu) and time.monotonic() < end:
            time.sleep(0.5)
        assert not any(Path(f"/proc/{p}").exists() for p in qemu), "a VM outlived its node"
    finally:
        child.kill()
        child.wait(30)
        child.stdout.close()  # type: ignore[union-attr]
        shutil.rmtree(Path(tempfile.gettempdir()) / f"arpo-{run_id}", ignore_errors=True)

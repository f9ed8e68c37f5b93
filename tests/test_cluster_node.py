"""The parts of `arpo train` on a Ray cluster that need no cluster: a node's agent (plain
Python: it starts `arpo-actor` on its node and hands back its log and spool ledger), the
driver's copy of what it hands back, the accounting of a lost node's spool, and the checks
of the `cluster` section. tests/test_train_ray.py runs them on a real cluster."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from conftest import make_trajectory

from arpo.actor.spool import Spool
from arpo.errors import ConfigError
from arpo.learner.learner import TRAINED_LOG, trained_log_lines
from arpo.record import Trajectory
from arpo.train import TrainConfig, account
from arpo.train.cluster import ClusterConfig, NodeAgent, keep_poll, mark_lost


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

"""`arpo train learner_procs=N`: the learner as a torchrun group (`python -m
torch.distributed.run`, gloo on CPU, FSDP2), rank 0 binding the links; the run trains and
accounts for every trajectory as with one process. The group over Ray nodes is in
tests/test_train_ray.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from arpo.train.node import learner_command


def test_the_learner_command_is_torchrun_only_with_more_than_one_rank() -> None:
    cfg = Path("/run/learner.toml")
    one = learner_command(cfg)
    assert one == [sys.executable, "-m", "arpo.learner.cli", "--config", str(cfg)]
    two = learner_command(cfg, procs=2)
    assert two[1:3] == ["-m", "torch.distributed.run"] and "--standalone" in two
    assert "--nproc-per-node=2" in two and two[-4:] == one[1:]
    nodes = learner_command(cfg, procs=1, nnodes=3, node_rank=2, master="10.0.0.1:29400")
    assert "--standalone" not in nodes
    for arg in ("--nnodes=3", "--node-rank=2", "--master-addr=10.0.0.1", "--master-port=29400"):
        assert arg in nodes, nodes


@pytest.mark.slow
def test_a_run_with_two_learner_ranks_trains_and_accounts_for_everything(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torch")
    from arpo_envs.sim.tasks import write_tasks
    from train_configs import small_run

    from arpo.config import to_toml
    from arpo.learner.metrics import read_metrics
    from arpo.policy.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", seed=0)
    write_tasks(tmp_path / "tasks", ["click_button"], 4, seed=0)
    (tmp_path / "tasks" / "test_all.json").unlink()
    cfg = small_run(tmp_path, model, tmp_path / "tasks", iterations=2, max_new_tokens=16,
                    actors=1, sim_envs_per_actor=2, learner_procs=2)  # fmt: skip
    config = tmp_path / "run.toml"
    config.write_text(to_toml(cfg))
    out = subprocess.run(
        [sys.executable, "-m", "arpo.train", "--config", str(config)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    run = tmp_path / "run"
    assert out.returncode == 0, out.stderr[-4000:]
    log = (run / "logs" / "learner.log").read_text()
    assert "2 rank(s)" in log, log[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    acc = summary["accounting"]
    assert summary["finished"] and acc["unaccounted"] == 0 and acc["trained_twice"] == 0, acc
    assert [m["step"] for m in read_metrics(run / "learner" / "metrics.jsonl")][-1] == 2

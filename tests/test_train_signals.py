"""Signals say what they did: the first SIGTERM / SIGINT stops training, evaluates the last
checkpoint and exits 128 + the signal (the run did not finish); a second one stops every
process of the run at once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from arpo.learner.metrics import read_metrics
from arpo.policy.tiny import build_tiny_model
from arpo.train import _descendants


def _start(tmp_path: Path, model: Path) -> tuple[subprocess.Popen, Path]:
    from arpo_envs.sim.tasks import write_tasks

    write_tasks(tmp_path / "tasks", ["click_button"], 2, seed=0)
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "arpo.cli", "train", f"run_dir={run}", f"model={model}",
         f"tasks={tmp_path / 'tasks'}", "warm_start=false", "learner.iterations=500",
         "eval_runs_per_task=2", "eval_warm_start=false", "prefill_runs_per_task=0",
         "prefill_demos_from_turns=0", "sim_envs_per_actor=2", "progress_s=0",
         "learner.assemble.group_size=2", "learner.assemble.groups_per_step=2",
         "learner.checkpoint.every=1", "actor.episode.max_steps=2",
         "actor.episode.max_new_tokens=16"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    return proc, run


def _wait_for_iterations(proc: subprocess.Popen, run: Path, n: int) -> None:
    metrics = run / "learner" / "metrics.jsonl"
    end = time.monotonic() + 400
    while not (metrics.exists() and len(read_metrics(metrics)) >= n):
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.monotonic() < end, "no training iteration in 400 s"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_a_signal_evaluates_the_last_checkpoint_and_exits_non_zero(
    tmp_path: Path, tiny: Path
) -> None:
    proc, run = _start(tmp_path, tiny)
    _wait_for_iterations(proc, run, 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGTERM, err[-4000:]
    assert "stopping: evaluating the last checkpoint; Ctrl-C again stops now" in err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["signal"] == signal.SIGTERM and summary["finished"] is False
    assert summary["checkpoint"] and summary["eval"]  # evaluated what training had reached
    assert (run / "eval" / "eval.md").exists()


def test_a_second_signal_stops_everything_at_once(tmp_path: Path, tiny: Path) -> None:
    proc, run = _start(tmp_path, tiny)
    _wait_for_iterations(proc, run, 1)
    children = _descendants(proc.pid)
    assert len(children) >= 2  # the learner and the actor
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert time.monotonic() - t0 < 30
    assert "stopping now" in err
    time.sleep(0.5)
    alive = [p for p in children if Path(f"/proc/{p}").exists()
             and "Z" not in Path(f"/proc/{p}/stat").read_text().split(")")[-1][:3]]  # fmt: skip
    assert not alive, [Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in alive]

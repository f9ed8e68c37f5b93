"""A run always makes progress or stops and says why: a task whose setup always fails
leaves the run and training finishes without it; a pool nobody can set up stops the run
with exit code 3 naming its tasks; a learner that hears from nobody stops after stall_s."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from train_configs import small_run

from arpo.errors import EXIT_STALLED
from arpo.learner.checkpoint import CheckpointConfig
from arpo.learner.metrics import read_metrics
from arpo.policy.tiny import build_tiny_model
from arpo.train import TrainConfig, main

MISSING_URL = "https://files.invalid/nobody-has/report.xlsx"


def _broken(task: dict, new_id: str) -> dict:
    """`task` whose setup first downloads a file no cache holds: its setup fails on every
    environment (FileCacheMiss, an environment-side error) after the desktop reset fine."""
    out = json.loads(json.dumps(task))
    out["id"] = new_id
    out["config"].insert(0, {"type": "download", "parameters": {"files": [
        {"url": MISSING_URL, "path": "/home/user/report.xlsx"}]}})  # fmt: skip
    return out


def _pool(root: Path, good: int, broken: int) -> list[str]:
    from arpo_envs.sim.tasks import generate_tasks

    tasks = generate_tasks("click_button", good + broken, seed=3)
    ids = []
    for i, t in enumerate(tasks):
        if i >= good:
            t = _broken(t, f"broken-{i - good}")
        ids.append(t["id"])
        (root / "click_button").mkdir(parents=True, exist_ok=True)
        (root / "click_button" / f"{t['id']}.json").write_text(json.dumps(t))
    return ids


def _config(tmp_path: Path, model: Path, *, iterations: int, preflight: bool) -> TrainConfig:
    return small_run(
        tmp_path, model, tmp_path / "tasks", iterations=iterations,
        checkpoint=CheckpointConfig(every=2, keep=2, verify=False), max_new_tokens=16,
        learner={"stall_s": 60.0}, environment={"reset_retries": 2, "reset_backoff_s": 0.2},
        actors=1, sim_envs_per_actor=2, prefill_runs_per_task=0, prefill_demos_from_turns=0,
        preflight=preflight,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_a_task_whose_setup_always_fails_leaves_the_run_and_training_finishes(
    tmp_path: Path, tiny: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _pool(tmp_path / "tasks", good=3, broken=1)
    cfg = _config(tmp_path, tiny, iterations=4, preflight=False)
    assert main(cfg) == 0
    out = capsys.readouterr().out
    rows = read_metrics(Path(cfg.run_dir) / "learner" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # every iteration trained
    summary = json.loads((Path(cfg.run_dir) / "summary.json").read_text())
    # The broken task is out of the run, named with its reason, in the report and the output.
    assert list(summary["tasks_out"]) == ["broken-0"]
    reason = summary["tasks_out"]["broken-0"]["reason"]
    assert "FileCacheMiss" in reason and MISSING_URL in reason
    assert summary["tasks_out"]["broken-0"]["envs"] == 2
    assert "broken-0" in out and "FileCacheMiss" in out
    acc = summary["accounting"]
    assert acc["unaccounted"] == 0 and acc["trained_twice"] == 0, acc
    assert acc["finished_by_status"].get("setup_error", 0) >= 2
    assert (
        list(acc["tasks_out"]) == ["broken-0"]
        and "FileCacheMiss" in acc["tasks_out"]["broken-0"]["reason"]
    )
    # Only the good tasks were trained on.
    trained = (Path(cfg.run_dir) / "learner" / "trained.log").read_text()
    assert "broken-0" not in trained
    assert any(line.endswith("\tfresh") for line in trained.splitlines())  # the others trained


@pytest.mark.slow
def test_a_pool_nobody_can_set_up_stops_the_run_with_exit_3_naming_its_tasks(
    tmp_path: Path, tiny: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _pool(tmp_path / "tasks", good=0, broken=2)
    cfg = _config(tmp_path, tiny, iterations=50, preflight=False)
    t0 = time.monotonic()
    assert main(cfg) == EXIT_STALLED
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert "cannot go on" in err and "every one of the 2 tasks has left the run" in err
    assert "broken-0" in err and "broken-1" in err and "FileCacheMiss" in err
    assert took < cfg.learner.stall_s + 60, took  # not the stall timer: at once, named
    summary = json.loads((Path(cfg.run_dir) / "summary.json").read_text())
    assert sorted(summary["tasks_out"]) == ["broken-0", "broken-1"]
    assert summary["iterations"] == 0 and "eval" not in summary


@pytest.mark.slow
def test_the_learner_stops_after_stall_s_when_no_episode_arrives(
    tmp_path: Path, tiny: Path
) -> None:
    _pool(tmp_path / "tasks", good=2, broken=0)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "arpo.learner.cli", f"trainer.model={tiny}",
         f"tasks={tmp_path / 'tasks'}", f"run_dir={tmp_path / 'learner'}", "iterations=5",
         "stall_s=4", "transport.data=tcp://127.0.0.1:0", "transport.control=tcp://127.0.0.1:0"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == EXIT_STALLED, proc.stderr[-3000:]
    assert "no episode has filled a grant's slot for" in proc.stderr
    assert "stall_s = 4" in proc.stderr
    assert time.monotonic() - t0 < 240
    status = json.loads((tmp_path / "learner" / "tasks_out.json").read_text())
    assert status["tasks_out"] == {} and "no episode has filled a slot" in status["waiting_for"]


def test_the_preflight_leaves_out_a_broken_task_before_training(
    tmp_path: Path, tiny: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _pool(tmp_path / "tasks", good=2, broken=1)
    cfg = _config(tmp_path, tiny, iterations=2, preflight=True)
    assert main(cfg) == 0
    err = capsys.readouterr().err
    assert "preflight: task broken-0 left out" in err and "FileCacheMiss" in err
    run = Path(cfg.run_dir)
    assert "broken-0" in (run / "preflight.md").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert list(summary["preflight"]["left_out"]) == ["broken-0"]
    assert summary["preflight"]["tasks"] == 3
    out = summary["tasks_out"]["broken-0"]
    assert out["reason"].startswith("left out before the run: ") and out["failures"] == 0
    # It was never granted: no episode of it, and both iterations trained.
    assert summary["accounting"]["finished_by_status"].get("setup_error", 0) == 0
    assert [r["step"] for r in read_metrics(run / "learner" / "metrics.jsonl")] == [1, 2]


def test_a_preflight_that_sets_up_no_task_stops_before_training(
    tmp_path: Path, tiny: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _pool(tmp_path / "tasks", good=0, broken=2)
    cfg = _config(tmp_path, tiny, iterations=5, preflight=True)
    assert main(cfg) == EXIT_STALLED
    err = capsys.readouterr().err
    assert "no task could be set up" in err and "broken-1" in err
    assert not (Path(cfg.run_dir) / "learner" / "metrics.jsonl").exists()


def _checker_raises(root: Path, n: int) -> list[str]:
    """`n` simulated tasks whose checker raises KeyError (its rules lack 'expected'): every
    episode of them ends in eval_error."""
    from arpo_envs.sim.tasks import generate_tasks

    ids = []
    for i, t in enumerate(generate_tasks("click_button", n, seed=5)):
        t["id"] = f"raises-{i}"
        rules = t["evaluator"]["expected"]["rules"]
        rules["wanted"] = rules.pop("expected")
        (root / "click_button").mkdir(parents=True, exist_ok=True)
        (root / "click_button" / f"{t['id']}.json").write_text(json.dumps(t))
        ids.append(t["id"])
    return ids


@pytest.mark.slow
def test_tasks_whose_checker_raises_leave_the_run_and_the_stop_names_them(
    tmp_path: Path, tiny: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every checker raises: each task leaves the run after `retire_after_eval_errors`
    eval_errors in a row, as a task whose setup keeps failing does, and the run stops
    (exit 3) at once, naming every task and its checker's error, saying "cannot go on"
    once; not after stall_s with "Tasks out of the run (0): none"."""
    ids = _checker_raises(tmp_path / "tasks", 2)
    cfg = _config(tmp_path, tiny, iterations=50, preflight=False)
    t0 = time.monotonic()
    assert main(cfg) == EXIT_STALLED
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert err.count("the run cannot go on") == 1, err[-3000:]
    assert "every one of the 2 tasks has left the run" in err, err[-3000:]
    for tid in ids:
        assert f"{tid}: its checker could not run 4 time(s) in a row" in err, err[-3000:]
    assert "KeyError" in err and "'expected'" in err
    assert took < cfg.learner.stall_s + 60, took  # not the stall timer: at once, named
    summary = json.loads((Path(cfg.run_dir) / "summary.json").read_text())
    assert sorted(summary["tasks_out"]) == ids
    assert all("KeyError" in r["reason"] for r in summary["tasks_out"].values())

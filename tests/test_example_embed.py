"""The embedding example runs as a user would run it, and learns with the store as its buffer."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gymnasium")
pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "embed_gymnasium.py"


@pytest.fixture(scope="module")
def summary() -> dict:
    # -W error: the example must run clean, as the test suite itself does.
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLE), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_loop_ran_every_update_and_episode(summary: dict) -> None:
    # --quick: 15 iterations x 2 optimizer steps; 4 tasks x groups of 8 per iteration.
    assert summary["updates"] == 30
    assert summary["episodes"] == 15 * 4 * 8
    assert summary["param_change_l1"] > 0


def test_policy_beats_random(summary: dict) -> None:
    # A uniformly random CartPole policy survives about 22 steps; the trained one should
    # at least double that on held-out reset seeds.
    assert summary["eval_return"] >= 2 * summary["random_return"], summary


def test_store_counted_every_insert_take_and_sample(summary: dict) -> None:
    total = summary["store_stats"]["total"]
    assert summary["successes_added"] > 0
    assert total["inserts"] == summary["episodes"] + summary["successes_added"]
    assert total["takes"] == summary["episodes"]  # every episode was trained on exactly once
    assert total["fresh"] == 0  # no episode left behind in a fresh queue
    # One sample per replay hit, plus the newest-first read-back of every buffer at the end.
    assert total["samples"] == summary["replay_hits"] + total["replay"]
    assert len(summary["store_stats"]["tasks"]) == 4


def test_snapshot_restores_the_replay_buffers(summary: dict) -> None:
    restored = summary["restored"]
    assert len(restored) == 4
    for task, r in restored.items():
        assert r["items"] > 0, task
        assert r["identical"], task

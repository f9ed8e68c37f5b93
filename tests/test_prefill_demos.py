"""Demonstrations in the replay buffers: all of them with `prefill_demos`, else those of
the multi-step tasks (`prefill_demos_from_turns`), scored by the warm start at the rollout
settings. The real `arpo sft` warm start (one epoch) on generated tasks of a short and a
long family, and `arpo train`'s own pre-fill step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from arpo.config import ConfigError, load_config
from arpo.learner.assemble import sampling_mismatch
from arpo.offline.data import read_trajectories
from arpo.train import TrainConfig, TrainRun, long_tasks


def _run(tmp_path: Path, *extra: str) -> TrainRun:
    cfg = load_config(
        TrainConfig,
        None,
        [f"run_dir={str(tmp_path)!r}", 'sim_families=["click_button", "fill_form"]',
         "sim_tasks_per_family=2", "sft_epochs=1", "sft_target_nll=0.0", *extra],
    )  # fmt: skip
    run = TrainRun(cfg)
    run.run_dir.mkdir(parents=True, exist_ok=True)
    return run


def test_multi_step_tasks_get_their_demonstrations_replayed_by_default(tmp_path: Path) -> None:
    run = _run(tmp_path / "a")
    model, pool = run.policy(), run.task_pool()
    oracle = {}
    for f in Path(pool).rglob("*.json"):
        t = json.loads(f.read_text())
        oracle[t["id"]] = len(t["oracle"])
    long = {k for k, n in oracle.items() if n + 1 >= 3}
    # fill_form needs 6-14 turns, click_button 2: exactly the fill_form tasks are replayed
    # under the default of 3 turns (and under 6).
    assert long == long_tasks(pool, 3) == long_tasks(pool, 6), oracle
    assert len(long) == 2 and len(oracle) == 4, oracle

    out = run._prefill_demos(model, None, pool)
    scored = list(read_trajectories(out["trajectories"]))
    assert {d.task_id for d in scored} == long
    assert out["successes"] == {k: 1 for k in long} and out["demos"] == 2
    for d in scored:
        # Replayable at the rollout settings: the warm start's log-probs, its temperature.
        assert sampling_mismatch(d, 1.0, 1.0) is None and d.checker_score == 1.0
        assert len(d.turns) >= 6

    # prefill_demos: every task's demonstration; 0 turns and no prefill_demos: none.
    every = _run(tmp_path / "a", "prefill_demos=true")._prefill_demos(model, None, pool)
    assert {d.task_id for d in read_trajectories(every["trajectories"])} == set(oracle)
    off = _run(tmp_path / "a", "prefill_demos_from_turns=20")
    assert off._prefill_demos(model, None, pool) is None
    with pytest.raises(ConfigError, match="prefill_demos_from_turns"):
        _run(tmp_path / "b", "prefill_demos_from_turns=-1")

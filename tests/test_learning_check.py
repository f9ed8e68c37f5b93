"""The test command's learning check (tests/learning_check.py): a healthy learner passes it,
and each of five broken learners fails it.

One seeded run of the whole pipeline (episode loop on a simulated desktop, transformers
engine, Rust replay store, group assembler with ARPO's replay, the ARPO step, weights back
to the engine) on a task the starting policy never solves, so replay is its only signal.
The run is deterministic for a seed, and the verdict reads exact quantities (the oracle
response's log-probability, the importance weights the learner applied) whose healthy and
broken values lie far apart: over 20 seeds, see `benchmarks/learning_check_spread.py`.
Each run takes 5-30 s on the project's 2-core machine, shared with other work (the whole
module: 59 s at a load of 3, 130 s at a load of 6).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from learning_check import (
    ITERATIONS,
    MIN_GAIN,
    SABOTAGES,
    run_check,
    sabotaged,
    start,
)

SEED = 0
"""The seed of the test command's runs (the spread script runs others)."""


@pytest.fixture(scope="module")
def start_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return start(tmp_path_factory.mktemp("learning-check"), seed=SEED)


def test_a_healthy_learner_passes_the_learning_check(start_dir: Path, tmp_path: Path) -> None:
    res = run_check(start_dir, tmp_path, seed=SEED)
    print(res.report())
    assert res.passed, res.report()
    # Every step replayed the success (every fresh group failed), and the weights it got
    # moved off 1 as the policy moved towards it.
    assert len(res.replay_weights) == ITERATIONS
    assert res.fresh_successes == [0] * ITERATIONS
    assert res.replay_weights[0][1] == pytest.approx(1.0, abs=1e-3)  # scored by this policy
    assert res.gain >= MIN_GAIN


@pytest.mark.parametrize("sabotage", sorted(SABOTAGES))
def test_the_learning_check_fails_a_broken_learner(
    start_dir: Path, tmp_path: Path, sabotage: str
) -> None:
    with sabotaged(sabotage):
        res = run_check(start_dir, tmp_path, seed=SEED)
    print(f"{sabotage} ({SABOTAGES[sabotage]}): {res.report()}")
    assert not res.passed, f"{sabotage}: {res.report()}"
    if sabotage in ("sign_flipped", "lr_zero", "replay_never_triggered"):
        assert res.gain < MIN_GAIN, res.report()
    elif sabotage == "stops_after_first":  # its first step learns; the later ones do not
        assert any("raised the oracle response's log-prob by less" in f for f in res.failures)
    else:  # the outcome moves as a healthy learner's; the weights it applied do not
        assert any("weighted the replayed success's tokens" in f for f in res.failures)


def test_a_sabotage_is_undone_on_exit() -> None:
    from arpo.learner import assemble, trainer

    before = (assemble.advantages, assemble.needs_replay, trainer.lr_factor, trainer.arpo_loss)
    for name in SABOTAGES:
        with sabotaged(name):
            now = (assemble.advantages, assemble.needs_replay, trainer.lr_factor,
                   trainer.arpo_loss)  # fmt: skip
            assert now != before, name
    assert (assemble.advantages, assemble.needs_replay, trainer.lr_factor,
            trainer.arpo_loss) == before  # fmt: skip
    with pytest.raises(ValueError, match="unknown sabotage"), sabotaged("nope"):
        pass

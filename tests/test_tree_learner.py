"""Tree rollouts through the whole system: a learner granting tree grants over ZeroMQ, a real
actor process forking its simulated desktops with the tiny model, the learner training
tree groups (each shared turn once) and stopping at its environment-step budget."""

from __future__ import annotations

import subprocess

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import test_learner
from test_learner import actor_args, config

from arpo.learner.assemble import AssembleConfig
from arpo.learner.learner import Learner
from arpo.service.grants import GrantConfig

tiny_dir = test_learner.tiny_dir  # the module's fixtures
sim_tasks_file = test_learner.sim_tasks_file


def test_tree_grants_train_and_the_run_stops_at_its_environment_step_budget(
    tmp_path,
    tiny_dir,
    sim_tasks_file,
):
    budget = 40
    cfg = config(
        tmp_path, tiny_dir, sim_tasks_file, iterations=50, max_env_steps=budget,
        assemble=AssembleConfig(group_size=2, groups_per_step=2, max_staleness=2),
        grants=GrantConfig(tree_slots=2, branch_width=2, branch_every=1),
    )  # fmt: skip
    learner = Learner(cfg)
    learner.setup()
    # Unparsable responses of the random model cost their turn only, so episodes go on
    # and the roots reach their branch point.
    proc = subprocess.Popen(
        actor_args(
            learner,
            tiny_dir,
            tmp_path,
            "sim_envs=1",
            "episode.max_steps=3",
            "episode.on_parse_failure='continue'",
        )
    )
    try:
        learner.run()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert learner.env_steps.total >= budget
    assert 0 < learner.iteration < 50, "stopped by the step budget, not the iterations"
    totals = learner.assembler.totals
    assert totals["data/tree_groups"] > 0 and totals["data/shared_turns"] > 0
    book = learner.grants.book.counts
    assert book["tree_grants"] > 0
    steps = [h["charts/env_steps"] for h in learner.history]
    assert steps == sorted(steps) and steps[-1] <= learner.env_steps.total
    # The budget may be reached while the learner waits (then no iteration records it) or
    # during a step; past it, only batches already taken train: the prefetched one and an
    # incomplete one flushed at the stop.
    assert sum(s >= budget for s in steps) <= 3, steps

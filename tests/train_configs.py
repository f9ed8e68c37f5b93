"""The short `arpo train` configuration the training tests share.

    cfg = small_run(tmp_path, model, tasks, iterations=2, local_desktops=2, actors=0)

No warm start, no evaluation, no progress lines; groups of 2, two groups a step, at most
2 iterations of staleness; episodes of at most 2 turns with short answers. A test names
only what it changes: `learner=` / `actor=` / `episode=` / `environment=` take fields to
replace in those sections, the rest go to `TrainConfig` itself.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from arpo.learner.assemble import AssembleConfig
from arpo.learner.checkpoint import CheckpointConfig
from arpo.train import TrainConfig


def small_run(
    tmp_path: Path,
    model: Path | str,
    tasks: Path | str,
    *,
    iterations: int = 2,
    checkpoint: CheckpointConfig | None = None,
    max_new_tokens: int = 24,
    learner: dict[str, Any] | None = None,
    actor: dict[str, Any] | None = None,
    environment: dict[str, Any] | None = None,
    **fields: Any,
) -> TrainConfig:
    """A short run in `tmp_path/run` of `model` on `tasks` (module doc); `checkpoint`
    defaults to one every iteration, 2 kept, not verified."""
    base = TrainConfig()
    return TrainConfig(
        **{
            "run_dir": str(tmp_path / "run"),
            "model": str(model),
            "warm_start": False,
            "tasks": str(tasks),
            "progress_s": 0,
            "eval_runs_per_task": 0,
            **fields,
        },
        learner=replace(
            base.learner,
            iterations=iterations,
            assemble=AssembleConfig(group_size=2, groups_per_step=2, max_staleness=2),
            checkpoint=checkpoint or CheckpointConfig(every=1, keep=2, verify=False),
            **(learner or {}),
        ),
        actor=replace(
            base.actor,
            episode=replace(base.actor.episode, max_steps=2, max_new_tokens=max_new_tokens),
            environment=replace(base.actor.environment, **(environment or {})),
            **(actor or {}),
        ),
    )

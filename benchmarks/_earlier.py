"""The `arpo train` defaults that the results of 2026-11-22 to 2026-11-24 were measured with.

Since then `arpo train`'s defaults are `make demo`'s recipe (60 SFT epochs stopped at NLL 0.06,
8 tasks per family, a replay pre-fill of 16 runs per task, 90 iterations with the learning rate
decayed over them, episodes fitted to the task, 128-token responses). The scripts that produced
the earlier results put these overrides before their own, so their commands still reproduce
them.
"""

EARLIER_DEFAULTS = [
    "sft_epochs=17",
    "sft_target_nll=0.0",
    "sim_tasks_per_family=16",
    "minutes=5.0",
    "eval_runs_per_task=8",
    "prefill_runs_per_task=0",
    "decay_lr=false",
    "learner.iterations=0",
    "actor.episode.max_steps=4",
    "actor.episode.max_new_tokens=48",
]


def earlier_config(**fields):
    """`TrainConfig` with the earlier defaults and `fields` (keyword: value) over them."""
    from dataclasses import replace

    from arpo.config import load_config
    from arpo.train import TrainConfig

    return replace(load_config(TrainConfig, None, EARLIER_DEFAULTS), **fields)

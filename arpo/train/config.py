"""`arpo train`'s configuration: `TrainConfig`, its embedded learner and actor, its checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from arpo.actor.config import MAX_ENVS, ActorConfig
from arpo.actor.episode import MAX_STEPS_LIMIT
from arpo.config import (
    MAX_TEMPERATURE,
    SET_BY_TRAIN,
    changed_overrides,
    check_range,
    check_seconds,
    fail,
    folder_problem,
    model_problem,
    option,
)
from arpo.env.bringup import EnvironmentsConfig
from arpo.env.task import pool_problem
from arpo.learner.learner import LearnerConfig
from arpo.policy.engine import EngineConfig
from arpo.train.cluster import ClusterConfig

_SET_BY_TRAIN = SET_BY_TRAIN
READER_SFT_LR = 5e-5
"""The reader's warm-start learning rate (AdamW; the table-lookup probe's: it learned the
lookup at 5e-5 and keeps the decoder's reading)."""


def _default_learner() -> LearnerConfig:
    """The embedded default: small groups and batches that train in minutes on 2 cores,
    90 iterations (the learning rate decays linearly to 0 over them: `decay_lr`).

    Two settings differ from the reference's, both measured on the tiny model
    (`benchmarks/ablate_learning.py`, docs/results/diagnosing.md): group
    advantages without the division by the group's std (Dr. GRPO: a group of failures
    whose only difference is one unparseable response otherwise gets advantages as
    large as a group with a success, and pushes its parseable wrong clicks up), and
    replayed successes weighted at least 1 (`loss.replay_w_min = 1`: a success the
    policy has drifted away from still pulls it back; with the floor at 0 the
    correction switches replay off exactly when the policy has collapsed)."""
    from arpo.learner.assemble import AssembleConfig
    from arpo.learner.checkpoint import CheckpointConfig
    from arpo.learner.loss import LossConfig
    from arpo.learner.metrics import MetricsConfig
    from arpo.learner.trainer import TrainerConfig

    return LearnerConfig(
        tasks=_SET_BY_TRAIN,
        iterations=90,
        trainer=TrainerConfig(
            model=_SET_BY_TRAIN,
            lr=1e-4,
            micro_batch=4,
            optimizer_steps=1,
            loss=LossConfig(replay_w_min=1.0),
        ),
        assemble=AssembleConfig(group_size=4, groups_per_step=4, max_staleness=2, norm_std=False),
        checkpoint=CheckpointConfig(every=5, keep=2),
        metrics=MetricsConfig(progress_s=0),
    )


def _default_actor() -> ActorConfig:
    """Episodes fitted to their task (`max_steps = 0`: the task's oracle + 3 turns, at most
    the reference's 15; 15 for a task without an oracle) and responses of at most 128
    tokens (the reference allows more; the longest oracle response of the simulated
    families is 78 tokens, list_select's scrolls, the others at most 37: a policy that has
    not ended its response by 128 tokens is not writing an action)."""
    from arpo.actor.episode import EpisodeConfig

    return ActorConfig(
        sim_envs=1,
        engine=EngineConfig(model=_SET_BY_TRAIN),
        episode=EpisodeConfig(max_steps=0, max_new_tokens=128),
        progress_s=0,
    )


@dataclass
class TrainConfig(EnvironmentsConfig):
    """A training run on this machine (see the package docstring); its environments
    section (`EnvironmentsConfig`) is `arpo audit-tasks`'s."""

    run_dir: str = option("runs/train", "Folder of the run (everything it writes).")
    model: str = option("", "Policy to start from ('' = `base` built here, warm-started).")
    base: Literal["tiny", "reader"] = option(
        "tiny",
        "With model '': the policy built into <run_dir>/<base> and warm-started: 'tiny' (a "
        "random Qwen2.5-VL of 2 text layers, `arpo-tiny-model`) or 'reader' (SmolLM2-135M-"
        "Instruct's pre-trained decoder in a SmolVLM, `arpo-reader`: it reads, at about 10 "
        "times the tiny model's cost; benchmarks/results/reader-cost-*.md).",
    )
    reader_layers: int = option(
        30,
        "base=reader: the decoder's first layers kept (of 30); fewer are cheaper but read "
        "worse (docs/guides/own-model.md, 'The reader').",
    )
    sft_lr: float = option(
        0.0,
        "Warm start's AdamW learning rate (0: the base's own: 1e-3 for the tiny model, which "
        "starts from random weights; 5e-5 for the reader, which must keep what it knows).",
    )
    tiny_max_pixels: int = option(
        0,
        "Image budget of the tiny model's processor (`max_pixels`, written into "
        "<run_dir>/tiny): a screenshot is resized to at most this many pixels, one image "
        "token per 28x28 (0 = the default, 64 x 28 x 28: a 1280x720 screenshot is 60 "
        "tokens; benchmarks/bench_long_context.py --max-pixels measures the cost of more). "
        "Only with model ''; another model's budget is its saved processor's (max_pixels).",
    )
    warm_start: bool = option(True, "With model '': `arpo sft` on oracle demonstrations first.")
    sft_epochs: int = option(
        60,
        "Warm start: the most passes over the demonstrations of the generated tasks "
        "(sft_target_nll usually stops it earlier).",
    )
    sft_target_nll: float = option(
        0.06,
        "Warm start: stop `arpo sft` after the first epoch whose demonstrations' mean NLL is "
        "at most this (0: run all sft_epochs). The NLL, unlike an epoch count, tracks the "
        "warm start's strength; the default leaves it solving some but not all of its tasks "
        "(docs/results/demo.md has the measurements).",
    )
    tasks: str = option("", "Task pool ('' = simulated tasks generated into run_dir/tasks).")
    sim_families: list[str] = option(
        doc="Simulated task families of the generated pool (also the warm start's tasks).",
        factory=lambda: ["click_button"],
    )
    sim_tasks_per_family: int = option(8, "Generated tasks per family.")
    seed: int = option(0, "Seed of the generated tasks and of the learner.")
    actors: int = option(1, "Actor processes with simulated desktops.")
    learner_procs: int = option(
        1,
        "Learner processes (ranks) on the learner's machine, or on each of its nodes "
        "(cluster.learner_nodes): more than 1 runs it under torchrun (python -m "
        "torch.distributed.run), each step's batch split over the ranks (learner.dist: FSDP2 "
        "by default, gloo on CPU, nccl with CUDA); rank 0 binds the links and writes the "
        "run's files.",
    )
    sim_envs_per_actor: int = option(4, "Simulated desktops per actor.")
    local_tasks: str = option(
        "", "Tasks for the real desktops and the VMs ('' = the package's local task suite)."
    )
    minutes: float = option(
        0.0, "Training wall-clock budget (0: until learner.iterations, 90 by default)."
    )
    decay_lr: bool = option(
        True,
        "Decay the learning rate linearly to 0 over learner.iterations (when they bound the "
        "run and learner.trainer.lr_decay_steps is 0): lr_decay_steps = iterations x "
        "optimizer steps per iteration. The reference keeps it constant (docs/results/demo.md "
        "has why the default decays).",
    )
    restart: bool = option(True, "Start a dead actor again, and a dead learner with --resume.")
    resume: bool = option(
        False,
        "Continue the run in run_dir after `arpo train` itself was lost (killed, its machine "
        "or Ray node gone): the learner starts from its last checkpoint and journal, the "
        "starting policy, its evaluation, the pre-fill and the preflight of the first start "
        "are reused, the actors start again (a local actor's spool sends what was not "
        "acknowledged; what a lost node held is counted lost with it), and the accounting "
        "spans every start. Run it with the same config; run_dir must be on storage this "
        "machine reaches.",
    )
    max_restarts: int = option(5, "Restarts per process at most.")
    progress_s: float = option(10.0, "Interval of the progress line (0: none).")
    preflight: bool = option(
        True,
        "Before training, set every task up once on an environment of its pool (revert or "
        "reset, then the task's setup; no agent: `arpo audit-tasks` without its checks) "
        "and leave out the tasks that fail, each listed with its reason in "
        "<run_dir>/preflight.md and the final report.",
    )
    preflight_fatal: bool = option(
        False, "Stop before training (exit code 3) when the preflight leaves out any task."
    )
    preflight_task_timeout_s: float = option(
        300.0,
        "The preflight's bound on one task, its revert or reset and its setup: a task not "
        "set up within it is left out with 'timeout' as its reason. (A signal stops the "
        "preflight at once, whatever this is.)",
    )
    eval_runs_per_task: int = option(
        16,
        "Episodes per task in the final evaluation, and in the starting policy's (0: none).",
    )
    eval_temperature: float = option(0.6, "Sampling temperature of the evaluations.")
    prefill_runs_per_task: int = option(
        16,
        "Before training, run the starting policy this many times per simulated task at the "
        "rollout sampling settings (`arpo collect` into <run_dir>/prefill) and start ARPO's "
        "replay buffers with its successes (learner.assemble.replay.prefill); skipped when "
        "the run has no simulated desktops or learner.assemble.replay.prefill names "
        "successes already collected. 0: the buffers start empty (the reference; the "
        "paper's pipeline has this step; docs/results/demo.md has what it changes).",
    )
    prefill_demos: bool = option(
        False,
        "Also start the replay buffers with the warm start's oracle demonstrations, scored "
        "by the warm-start model at the rollout sampling settings (their behaviour "
        "log-probs are the warm start's, so replaying them is off-policy data the "
        "importance weight corrects): every task then has a success to replay from the "
        "first iteration, also where the starting policy never succeeds (long tasks).",
    )
    prefill_demos_from_turns: int = option(
        3,
        "Without prefill_demos, still start the replay buffers with the demonstrations of "
        "the multi-step tasks: those whose oracle needs at least this many turns (its "
        "steps and DONE: every multi-step family of the simulated desktop needs 3-14, a "
        "single click 2). 0: only with prefill_demos. docs/results/long-tasks.md has the "
        "runs that chose the default.",
    )
    eval_warm_start: bool = option(
        True,
        "Also evaluate the starting policy before training, with the same protocol, and "
        "report trained minus start with its standard error.",
    )
    learner: LearnerConfig = option(
        _default_learner(),
        "The learner (run_dir, tasks, trainer.model and the endpoints are set by train).",
    )
    actor: ActorConfig = option(
        _default_actor(),
        "Template of every actor (envs, sim_envs, engine.model, endpoints are set by train).",
    )
    cluster: ClusterConfig = option(
        ClusterConfig(),
        "A Ray cluster to place the actors on (cluster.address; '' = this machine): one "
        "actor per node offering cluster.sim_resource or cluster.desktop_resource, with its "
        "simulated and local desktops; the learner on this machine (docs/guides/scaling.md).",
    )

    def validate(self) -> None:
        if not self.run_dir:
            fail("run_dir", "must name a folder")
        super().validate()  # the environments section
        for name, (most, why) in LIMITS.items():
            if getattr(self, name) > most:
                fail(name, f"is {getattr(self, name)}, at most {most}: {why}")
        if self.actors < 0 or self.sim_envs_per_actor < 0:
            fail("actors", "actors and sim_envs_per_actor must be >= 0")
        if self.seed < 0:
            fail("seed", "must be >= 0")
        if not 1 <= self.learner_procs <= 64:
            fail("learner_procs", f"is {self.learner_procs}; give 1 to 64 ranks per machine")
        if self.cluster.address and self.actors > 1:
            fail("actors", f"is {self.actors}; with cluster.address the run places one actor "
                 f"per node offering {self.cluster.sim_resource!r} (give actors=1 and start "
                 "more nodes, or more desktops per node: sim_envs_per_actor)")  # fmt: skip
        if self.cluster.address and not (
            (self.actors and self.sim_envs_per_actor) or self.local_desktops or self.vms
        ):
            fail("sim_envs_per_actor", "must be >= 1 with cluster.address (and actors=1), or "
                 "local_desktops or vms >= 1: the nodes run simulated or local desktops or "
                 "VMs")  # fmt: skip
        if self.cluster.engines == "shared" and self.actor.engine.kind not in ("hf", "vllm"):
            fail("actor.engine.kind", f"is {self.actor.engine.kind!r}; with cluster.engines="
                 "'shared' the run's engine servers run it in process: 'hf' or 'vllm'")  # fmt: skip
        if self.cluster.learner_resource and (self.vm_fleet or self.env_urls):
            fail("cluster.learner_resource", "with the learner on a node of its own the run's "
                 "actors are the nodes' (their simulated and local desktops and VMs): leave "
                 "vm_fleet and env_urls empty")  # fmt: skip
        if self.base not in ("tiny", "reader"):
            fail("base", f"must be 'tiny' or 'reader', got {self.base!r}")
        if self.model and self.base != "tiny":
            fail("base", f"builds the policy when model is ''; this run starts from {self.model}")
        if not 1 <= self.reader_layers <= 30:
            fail(
                "reader_layers",
                f"must be in [1, 30] (SmolLM2-135M has 30), got {self.reader_layers}",
            )
        if self.sft_lr < 0 or self.sft_lr != self.sft_lr:
            fail("sft_lr", f"must be >= 0 (0: the base's own), got {self.sft_lr}")
        if self.tiny_max_pixels and self.base != "tiny":
            fail(
                "tiny_max_pixels", "applies to base=tiny; the reader's image is a 256-pixel square"
            )
        if self.tiny_max_pixels:
            from arpo.policy.tiny import TINY_MIN_PIXELS

            if self.model:
                fail(
                    "tiny_max_pixels",
                    f"applies to the tiny model only; {self.model}'s image budget is its "
                    "saved processor's max_pixels (the actor and the learner both read it "
                    "there: edit its processor config)",
                )
            if self.tiny_max_pixels < TINY_MIN_PIXELS:
                fail("tiny_max_pixels", f"must be 0 or >= {TINY_MIN_PIXELS} (its min_pixels)")
        if not self.tasks and self.sim_tasks_per_family < 1:
            fail("sim_tasks_per_family", "must be >= 1 (tasks generated per family)")
        if not self.tasks:
            from arpo_envs.sim.tasks import FAMILIES

            unknown = [f for f in self.sim_families if f not in FAMILIES]
            if unknown or not self.sim_families:
                fail(
                    "sim_families",
                    f"unknown {unknown or 'empty list'}; known: {', '.join(FAMILIES)}",
                )
        if len(self.env_urls) > MAX_ENVS:
            fail(
                "env_urls", f"lists {len(self.env_urls)} URLs; one actor drives at most {MAX_ENVS}"
            )
        envs = self.actors * self.sim_envs_per_actor + self.local_desktops + len(self.env_urls)
        if envs + self.vms == 0 and not self.vm_fleet:
            fail(
                "actors",
                "no environments: give actors and sim_envs_per_actor, local_desktops, vms, "
                "vm_fleet or env_urls",
            )
        check_range(
            "minutes", self.minutes, 0, 525_600, "a year at most; 0: until learner.iterations"
        )
        if self.minutes == 0 and self.learner.iterations == 0:
            fail("minutes", "give minutes > 0 or learner.iterations > 0, or the run never ends")
        check_range("max_restarts", self.max_restarts, 0, 1000, "restarts per process")
        check_range("sft_epochs", self.sft_epochs, 1, LIMITS["sft_epochs"][0], "warm-start epochs")
        check_seconds("progress_s", self.progress_s, "between progress lines", zero="0: none")
        check_seconds(
            "preflight_task_timeout_s",
            self.preflight_task_timeout_s,
            "the preflight's revert + setup of one task",
        )
        check_range("eval_temperature", self.eval_temperature, 0, MAX_TEMPERATURE, "0: greedy")
        check_range(
            "sft_target_nll",
            self.sft_target_nll,
            0,
            100,
            "mean NLL of a demonstration token that stops the warm start; 0: run all "
            "sft_epochs; a uniform guess over Qwen's 151,665 tokens scores 12",
        )
        check_range(
            "prefill_demos_from_turns",
            self.prefill_demos_from_turns,
            0,
            MAX_STEPS_LIMIT + 1,
            "turns of an oracle, DONE included; 0: only with prefill_demos",
        )
        if self.eval_runs_per_task < 0:
            fail("eval_runs_per_task", "must be >= 0")
        if self.prefill_runs_per_task < 0:
            fail("prefill_runs_per_task", "must be >= 0 (0: no pre-fill)")
        from arpo.actor.episode import EpisodeConfig

        default = EpisodeConfig()
        for name in ("temperature", "top_p"):
            a, t = getattr(self.actor.episode, name), getattr(self.learner.trainer, name)
            if a != getattr(default, name) and a != t:
                fail(
                    f"actor.episode.{name}",
                    f"is {a} but learner.trainer.{name} is {t}: the learner owns the rollout "
                    f"sampling settings and sends them with every grant, so the actors' "
                    f"log-probs are the ones it scores; set learner.trainer.{name} only",
                )
        if problem := folder_problem(self.run_dir):
            fail("run_dir", problem)
        if self.model and (problem := model_problem(self.model)):
            fail("model", problem)
        # The pools are loaded here, before anything starts: a pool the learner cannot load
        # (a duplicate id, a file that is not UTF-8, a missing folder) is refused on this
        # command's output, naming the file and the task, instead of killing the learner.
        if self.tasks and (problem := pool_problem(self.tasks)):
            fail("tasks", problem)
        if self.local_tasks and (problem := pool_problem(self.local_tasks)):
            fail("local_tasks", problem)

    def pool_actor_args(self) -> list[str]:
        """Options of the local actor of an evaluation, selection or collection of this run's
        simulated tasks: this run's desktops per actor, episode limits (steps, tokens) and what
        the policy is shown (the observation type, its table budget, where marks come from:
        every episode field this run sets but the sampling's, which the pool sets)."""
        ep = self.actor.episode
        shown = [
            f"episode.max_steps={ep.max_steps}",
            f"episode.max_new_tokens={ep.max_new_tokens}",
            f"episode.observation_type={ep.observation_type!r}",
            f"episode.a11y_max_tokens={ep.a11y_max_tokens}",
        ]
        named = {o.split("=", 1)[0] for o in shown}
        rest = [o for o in changed_overrides(ep, "episode.", skip=("temperature", "top_p"))
                if o.split("=", 1)[0] not in named]  # fmt: skip
        return [f"sim_envs={max(1, self.sim_envs_per_actor)}", *shown, *rest]


_ONE_MACHINE = (
    "`arpo train` starts these on this machine (for more, place actors on the nodes of a "
    "Ray cluster with cluster.address, or start `arpo-actor` on other machines: "
    "docs/guides/scaling.md)"
)
LIMITS = {
    "actors": (256, _ONE_MACHINE),
    "sim_envs_per_actor": (1024, _ONE_MACHINE),
    "sim_tasks_per_family": (10_000, "tasks generated per family"),
    "eval_runs_per_task": (10_000, "evaluation episodes per task"),
    "prefill_runs_per_task": (10_000, "pre-fill episodes per task"),
    "sft_epochs": (10_000, "warm-start epochs (sft_target_nll usually stops them earlier)"),
}
"""Largest accepted value of these TrainConfig fields, and what they count: a typo of a few
zeros started a hundred thousand processes, or a run that never ends."""

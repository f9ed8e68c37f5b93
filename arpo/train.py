"""`arpo train`: a whole training run on one machine — learner, actors, environments, eval.

    arpo train                                   # the embedded default (make demo's recipe):
                                                 # tiny model, simulated desktops, 90 iterations
    arpo train --config run.toml                 # any configuration (`--show-config` lists it)
    arpo train local_desktops=2                  # plus real desktops (Xvfb + LibreOffice ...)
    arpo train vms=2                             # plus QEMU VMs of the test image (arpo-envs vm)
    arpo train minutes=30 learner.iterations=0   # a wall-clock budget instead of iterations

What it does, in order (every stage logs what it starts and where its log goes):

1. the policy: `model`, or the tiny Qwen2.5-VL built into `<run_dir>/tiny`, warm-started
   with `arpo sft` on oracle demonstrations of the simulated tasks when `warm_start`;
2. the task pool: `tasks`, or simulated tasks generated into `<run_dir>/tasks`
   (`sim_families` x `sim_tasks_per_family`), plus the local desktop tasks when
   `local_desktops > 0`;
   then, with `eval_warm_start`, `arpo eval` of the starting policy on the simulated tasks,
   and with `prefill_runs_per_task`, `arpo collect` of the starting policy on them at the
   rollout sampling settings (`<run_dir>/prefill`), whose successes start ARPO's replay
   buffers (the paper's pipeline has this step, the reference code comments it out);
3. processes: `arpo-learner` (its config written to `<run_dir>/learner.toml`), `actors`
   `arpo-actor` processes with `sim_envs_per_actor` simulated desktops each, and with
   `local_desktops > 0` that many real desktops (`arpo-envs up`) driven by one more actor,
   with `vms > 0` a fleet of that many VMs (`arpo-envs vm up`, reverted to their snapshot
   before every episode) or with `vm_fleet` a fleet started elsewhere, driven by one more;
   each process logs to `<run_dir>/logs/`;
4. supervision: a progress line from the learner's metrics; an actor that dies is
   started again (its spool resends what the learner has not acknowledged), a learner
   that dies is started again with `--resume` (`restart`), each at most
   `max_restarts` times; after `minutes` (or when the learner has run `iterations`)
   the learner gets SIGTERM (it finishes the iteration and checkpoints), then the
   actors, then the desktops;
5. results: `<run_dir>/learner/metrics.jsonl` (+ TensorBoard files), a plot of success
   rate and reward against iteration with the starting policy's evaluation as a line
   (`<run_dir>/curve.png`), `arpo eval` of the final checkpoint on the simulated tasks of
   the pool (`<run_dir>/eval/eval.md`) beside the same evaluation of the starting policy,
   run before training (`<run_dir>/eval_warm/eval.md`, `eval_warm_start`), with standard
   errors, and the checkpoint's path.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from arpo_envs.procs import free_port

from arpo.actor.config import MAX_ENVS, ActorConfig, fleet_problem
from arpo.actor.episode import MAX_STEPS_LIMIT
from arpo.config import (
    MAX_TEMPERATURE,
    SET_BY_TRAIN,
    check_range,
    check_seconds,
    fail,
    folder_problem,
    model_problem,
    option,
    to_toml,
    url_problem,
    validate,
)
from arpo.env.task import pool_problem
from arpo.errors import EXIT_STALLED, ArpoError, RunStalled
from arpo.learner.checkpoint import latest_checkpoint
from arpo.learner.learner import LearnerConfig
from arpo.learner.metrics import read_metrics
from arpo.markdown import md_cell
from arpo.policy.engine import EngineConfig

log = logging.getLogger("arpo.train")


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
class TrainConfig:
    """A training run on this machine (see the module docstring)."""

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
    sim_envs_per_actor: int = option(4, "Simulated desktops per actor.")
    local_desktops: int = option(
        0,
        "Real local desktops (Xvfb + openbox + apps) driven by one more actor; with an "
        "observation type that shows a table they serve their apps' AT-SPI trees "
        "(`arpo-envs up --atspi`).",
    )
    local_tasks: str = option(
        "", "Tasks for the real desktops ('' = the package's local task suite)."
    )
    vms: int = option(
        0,
        "VMs of the project's test image (`arpo-envs vm up`, in <run_dir>/vms: each reverted "
        "to its snapshot before every episode, replaced when it dies) driven by one more "
        "actor with the local desktop tasks; stopped at the end.",
    )
    vm_fleet: str = option(
        "",
        "State file of a VM fleet started elsewhere (`arpo-envs vm up`: <dir>/fleet.json, "
        "e.g. of OSWorld's own image), driven by one more actor with tasks of vm_pool.",
    )
    vm_pool: str = option("desktop", "The task pool of the VMs (vms or vm_fleet).")
    env_urls: list[str] = option(
        doc="Environment servers started elsewhere (OSWorld VMs, desktops), driven by one "
        "more actor that asks for tasks of env_urls_pool.",
        factory=list,
    )
    env_urls_pool: str = option("desktop", "The task pool of the env_urls environments.")
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

    def validate(self) -> None:
        if not self.run_dir:
            fail("run_dir", "must name a folder")
        for name, (most, why) in LIMITS.items():
            if getattr(self, name) > most:
                fail(name, f"is {getattr(self, name)}, at most {most}: {why}")
        if self.vms:
            from arpo_envs.vm.qemu import MachineConfig

            per_vm, have = MachineConfig().memory_mb, _memory_total()
            need = self.vms * per_vm * 2**20
            if need > have:
                fail(
                    "vms",
                    f"{self.vms} VMs of {per_vm} MB need {need / 2**30:.1f} GiB; "
                    f"this machine has {have / 2**30:.1f} GiB",
                )
        if self.actors < 0 or self.sim_envs_per_actor < 0 or self.local_desktops < 0:
            fail("actors", "actors, sim_envs_per_actor and local_desktops must be >= 0")
        if self.vms < 0:
            fail("vms", "must be >= 0")
        if self.seed < 0:
            fail("seed", "must be >= 0")
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
        if self.vms and self.vm_fleet:
            fail("vms", "and vm_fleet both name VMs; give one (vms starts a fleet for the run)")
        if self.vm_fleet and (problem := fleet_problem(self.vm_fleet)):
            fail("vm_fleet", problem)
        if len(self.env_urls) > MAX_ENVS:
            fail(
                "env_urls", f"lists {len(self.env_urls)} URLs; one actor drives at most {MAX_ENVS}"
            )
        for u in self.env_urls:
            if problem := url_problem(u):
                fail("env_urls", problem)
        for name in ("vm_pool", "env_urls_pool"):
            if not getattr(self, name) or len(getattr(self, name)) > 1024:
                fail(name, "must be a pool name of 1..1024 characters (e.g. 'desktop')")
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
        the policy is shown (the observation type and its table budget)."""
        ep = self.actor.episode
        return [
            f"sim_envs={max(1, self.sim_envs_per_actor)}",
            f"episode.max_steps={ep.max_steps}",
            f"episode.max_new_tokens={ep.max_new_tokens}",
            f"episode.observation_type={ep.observation_type!r}",
            f"episode.a11y_max_tokens={ep.a11y_max_tokens}",
        ]


_ONE_MACHINE = (
    "`arpo train` starts every process and environment on this machine (for more, start "
    "`arpo-actor` on other machines: docs/guides/scaling.md)"
)
LIMITS = {
    "actors": (256, _ONE_MACHINE),
    "sim_envs_per_actor": (1024, _ONE_MACHINE),
    "local_desktops": (64, _ONE_MACHINE),
    "vms": (64, _ONE_MACHINE),
    "sim_tasks_per_family": (10_000, "tasks generated per family"),
    "eval_runs_per_task": (10_000, "evaluation episodes per task"),
    "prefill_runs_per_task": (10_000, "pre-fill episodes per task"),
    "sft_epochs": (10_000, "warm-start epochs (sft_target_nll usually stops them earlier)"),
}
"""Largest accepted value of these TrainConfig fields, and what they count: a typo of a few
zeros started a hundred thousand processes, or a run that never ends."""


def _memory_total() -> int:
    """Bytes of memory of this machine (MemTotal)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class _Proc:
    name: str
    args: list[str]
    log: Path
    popen: subprocess.Popen | None = None
    restarts: int = 0
    extra_on_restart: list[str] = field(default_factory=list)
    signalled: bool = False

    def start(self, restarted: bool = False) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        args = self.args + (self.extra_on_restart if restarted else [])
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
            )
        log.info("%s: pid %d, log %s", self.name, self.popen.pid, self.log)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def terminate(self) -> None:
        """Ask the process to stop (SIGTERM, once); `stop` then waits for it."""
        if self.popen is not None and self.popen.poll() is None and not self.signalled:
            self.popen.send_signal(signal.SIGTERM)
            self.signalled = True

    def stop(self, timeout: float) -> int | None:
        p = self.popen
        if p is None:
            return None
        if p.poll() is None:
            self.terminate()
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s: SIGKILL", self.name, timeout)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
        return p.returncode


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, {} when it is missing or half-written."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _learner_error(log_path: Path) -> str:
    """Why the learner stopped: its last 'arpo-learner: ...' line, from its log, without
    the "the run cannot go on: " its message starts with (the caller says that once)."""
    try:
        lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return f"see {log_path}"
    for line in reversed(lines):
        if line.startswith("arpo-learner: "):
            return line[len("arpo-learner: ") :].removeprefix("the run cannot go on: ")
    return f"see {log_path}"


class RunInterrupted(ArpoError):
    """A signal stopped `arpo train` before training (or in its final evaluation): what
    the phase had started is stopped; `main` exits 128 + the signal."""

    def __init__(self, signum: int, phase: str) -> None:
        name = signal.Signals(signum).name
        done = (
            "training had finished; the evaluation did not"
            if phase == "the final evaluation"
            else "nothing was trained"
        )
        super().__init__(
            f"stopped by {name} during {phase}: every process the run had started is "
            f"stopped; {done}"
        )
        self.signum, self.phase = signum, phase


def _say(line: str) -> None:
    """`line` to stderr from a signal handler: one write(2), never `print` (the main thread
    may be inside a write to stderr, which `print` would re-enter)."""
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode("utf-8", "replace"))


def _running(pid: int) -> bool:
    """`pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += children.get(p, [])
    return out


def long_tasks(pool: str | Path, turns: int) -> set[str]:
    """Ids of the tasks under `pool` whose oracle needs at least `turns` turns (its steps
    and the final DONE); tasks without an oracle are not counted."""
    out: set[str] = set()
    for f in Path(pool).rglob("*.json"):
        try:
            task = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        oracle = task.get("oracle") if isinstance(task, dict) else None
        if isinstance(oracle, list) and oracle and len(oracle) + 1 >= turns:
            out.add(str(task.get("id")))
    return out


class TrainRun:
    """The processes of one run and their supervision (see the module docstring)."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = validate(config)
        self.run_dir = Path(self.config.run_dir).resolve()
        self.procs: list[_Proc] = []
        self.learner: _Proc | None = None
        self.desktop_state: Path | None = None
        """State file of the run's local desktops, known before their `up` (for `down`)."""
        self.vm_state: Path | None = None
        """State file of the run's VM fleet, known before its `up` (for `down`)."""
        self.restarts: dict[str, int] = {}
        self.summary: dict[str, Any] = {}
        self.warm_eval: dict[str, Any] | None = None
        """The starting policy's evaluation (with `eval_warm_start`)."""
        self.prefill: dict[str, Any] | None = None
        """The pre-fill collection's folder and its successes (with `prefill_runs_per_task`)."""

    # ---- preparation -------------------------------------------------------------------

    def policy(self) -> str:
        cfg = self.config
        if cfg.model:
            return cfg.model
        from arpo.policy.tiny import TINY_MAX_PIXELS, build_tiny_model

        tiny = self.run_dir / "tiny"
        budget = cfg.tiny_max_pixels or TINY_MAX_PIXELS
        if cfg.base == "reader":
            from arpo.policy.reader import build_reader

            tiny = self.run_dir / f"reader-{cfg.reader_layers}"
            if not (tiny / "config.json").exists():
                build_reader(tiny, layers=cfg.reader_layers, seed=cfg.seed)
        elif not (tiny / "config.json").exists():
            build_tiny_model(tiny, seed=cfg.seed, max_pixels=budget)
        else:
            made = _tiny_max_pixels(tiny)
            if made != budget:
                raise ArpoError(
                    f"{tiny} was built with an image budget of {made} pixels, and this run "
                    f"asks for {budget} (tiny_max_pixels): give another run_dir, or remove "
                    "that folder (and its warm start, sft/) to build it again"
                )
        if not cfg.warm_start:
            return str(tiny)
        sft_dir = self.run_dir / ("sft" if cfg.base == "tiny" else f"sft-{tiny.name}")
        shown = cfg.actor.episode.observation_type
        if (sft_dir / "config.json").exists():
            made = _warm_start_observation(sft_dir)
            if made != shown:
                raise ArpoError(
                    f"{sft_dir} is a warm start on {made!r} prompts, and this run shows the "
                    f"policy {shown!r} (actor.episode.observation_type): give another "
                    "run_dir, or remove that folder to warm-start again"
                )
        else:
            from arpo.offline.sft import SFTConfig
            from arpo.offline.sft import run as run_sft

            log.info("warm start: arpo sft on oracle demonstrations -> %s", sft_dir)
            run_sft(
                SFTConfig(
                    model=str(tiny),
                    out=str(sft_dir),
                    # The tasks RL trains on: the tiny model learns the tasks it was shown
                    # (it does not generalise to new ones), so the warm start succeeds
                    # sometimes on exactly these.
                    families=list(cfg.sim_families),
                    per_family=cfg.sim_tasks_per_family,
                    task_seed=cfg.seed,
                    epochs=cfg.sft_epochs,
                    target_nll=cfg.sft_target_nll,
                    max_steps=cfg.actor.episode.max_steps,
                    max_new_tokens=cfg.actor.episode.max_new_tokens,
                    observation_type=shown,
                    lr=cfg.sft_lr or (1e-3 if cfg.base == "tiny" else READER_SFT_LR),
                )
            )
        return str(sft_dir)

    def task_pool(self) -> str:
        cfg = self.config
        if cfg.tasks:
            return cfg.tasks
        from arpo_envs.sim.tasks import write_tasks

        out = self.run_dir / "tasks"
        write_tasks(out / "sim", list(cfg.sim_families), cfg.sim_tasks_per_family, cfg.seed)
        (out / "sim" / "test_all.json").unlink(missing_ok=True)
        if cfg.local_desktops or cfg.vms:
            import shutil

            src = Path(cfg.local_tasks) if cfg.local_tasks else _local_suite()
            shutil.copytree(src, out / "desktop", dirs_exist_ok=True)
        return str(out)

    # ---- processes ---------------------------------------------------------------------

    def _learner_proc(
        self, model: str, tasks: str, data: str, control: str, left_out: dict[str, str]
    ) -> _Proc:
        cfg = self.config
        assemble = cfg.learner.assemble
        if self.prefill is not None:
            replay = replace(assemble.replay, prefill=self.prefill["trajectories"])
            assemble = replace(assemble, replay=replay)
        trainer = replace(cfg.learner.trainer, model=model)
        if cfg.decay_lr and cfg.minutes == 0 and not trainer.lr_decay_steps:
            steps = cfg.learner.iterations * trainer.optimizer_steps * trainer.epochs
            trainer = replace(trainer, lr_decay_steps=steps)
        lc = replace(
            cfg.learner,
            hold_after_iterations=True,  # _shutdown stops the actors first, then the learner
            run_dir=str(self.run_dir / "learner"),
            tasks=tasks,
            left_out=str(self._write_left_out(left_out)) if left_out else "",
            seed=cfg.seed,
            trainer=trainer,
            assemble=assemble,
            transport=replace(cfg.learner.transport, data=data, control=control),
        )
        validate(lc)
        path = self.run_dir / "learner.toml"
        path.write_text(to_toml(lc))
        args = [sys.executable, "-m", "arpo.learner.cli", "--config", str(path)]
        return _Proc("learner", args, self.run_dir / "logs" / "learner.log",
                     extra_on_restart=["--resume"])  # fmt: skip

    def _write_left_out(self, left_out: dict[str, str]) -> Path:
        path = self.run_dir / "left_out.json"
        path.write_text(json.dumps(left_out, indent=1, sort_keys=True))
        return path

    def _actor_proc(self, i: int, model: str, data: str, control: str, **kw: Any) -> _Proc:
        cfg = self.config
        ac = replace(
            cfg.actor,
            actor_id=f"actor-{i}",
            engine=replace(cfg.actor.engine, model=model),
            transport=replace(cfg.actor.transport, data=data, control=control),
            spool_dir=str(self.run_dir / "spool" / f"actor-{i}"),
            file_cache_dir=cfg.actor.file_cache_dir or str(self.run_dir / "task-files"),
            **kw,
        )
        validate(ac)
        path = self.run_dir / f"actor-{i}.toml"
        # It may hold the desktops' bearer tokens (env_tokens): readable by this user only.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(to_toml(ac))
        path.chmod(0o600)
        args = [sys.executable, "-m", "arpo.actor.cli", "--config", str(path)]
        return _Proc(f"actor-{i}", args, self.run_dir / "logs" / f"actor-{i}.log")

    def _vm_fleet(self) -> str:
        """The run's own fleet (vms > 0): started here, stopped by _shutdown."""
        from arpo_envs.vm.fleet import FleetConfig, up

        cfg = FleetConfig(n=self.config.vms, dir=str(self.run_dir / "vms"))
        self.vm_state = cfg.state_file
        log.info("starting %d VMs (the test image; the first start makes its snapshot)", cfg.n)
        up(cfg, announce=lambda s: log.info("fleet: %s", s))
        return str(cfg.state_file)

    def _desktops(self) -> tuple[list[str], list[str]]:
        """The run's local desktops: their URLs and each one's own bearer token."""
        from arpo_envs.desktop.fleet import FleetConfig, up

        # a tree in the prompt: the desktops serve their apps' AT-SPI trees
        tree = self.config.actor.episode.observation_type != "screenshot"
        cfg = FleetConfig(n=self.config.local_desktops, base_port=0, atspi=tree,
                          state_file=self.run_dir / "desktops.json", tokens=True)  # fmt: skip
        self.desktop_state = cfg.state_file
        fleet = up(cfg, announce=lambda s: log.info("desktop: %s", s))
        return [e.url for e in fleet.envs], [e.token for e in fleet.envs]

    # ---- the run -----------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """The whole run (module docstring). Signals are handled from its first line: the
        first SIGTERM / SIGINT before training (policy, evaluation, pre-fill, desktops,
        preflight, starting the processes) or in the final evaluation raises
        `RunInterrupted` where the run is, which stops what that phase started, then every
        process of the run (`_stop_descendants`); during training it stops the learner and
        the actors and evaluates the last checkpoint. A second signal kills everything."""
        stop = {"flag": False}

        def on_signal(signum: int, frame: Any) -> None:
            name = signal.Signals(signum).name
            if stop["flag"]:
                _say(f"arpo train: {name} again: stopping now")
                self._kill_everything()
                os._exit(128 + signum)
            stop["flag"] = True
            self.signalled = signum
            if self._phase is not None:
                _say(f"arpo train: {name}: stopping {self._phase} and everything it started; "
                     f"{name} again stops now")  # fmt: skip
                raise RunInterrupted(signum, self._phase)
            _say("arpo train: stopping: evaluating the last checkpoint; Ctrl-C again stops now")
            log.info("signal %d: stopping the run", signum)

        self._phase = "building the starting policy"
        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._run(stop)
        except RunInterrupted:
            self._phase = None
            self._stop_descendants(grace_s=30.0)
            raise
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _run(self, stop: dict[str, bool]) -> dict[str, Any]:
        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        model = self.policy()  # phase "building the starting policy", set by `run`
        self._phase = "writing the task pool"
        tasks = self.task_pool()
        if cfg.eval_warm_start and cfg.eval_runs_per_task and cfg.sim_envs_per_actor:
            self._phase = "the starting policy's evaluation"
            log.info("evaluating the starting policy (the same protocol as the final one)")
            self.warm_eval = self._evaluate(tasks, {"model": model}, self.run_dir / "eval_warm")
        self._phase = "the replay pre-fill"
        if cfg.learner.assemble.replay.prefill:
            log.info(
                "replay pre-fill: the successes in %s (learner.assemble.replay.prefill); no "
                "pre-fill collection", cfg.learner.assemble.replay.prefill,
            )  # fmt: skip
        elif cfg.prefill_runs_per_task and cfg.actors and cfg.sim_envs_per_actor:
            self.prefill = self._prefill(model, tasks)
        elif cfg.prefill_runs_per_task:
            log.info("replay pre-fill skipped: the run has no simulated desktops to run it on")
        if (cfg.prefill_demos or cfg.prefill_demos_from_turns) and not (
            cfg.learner.assemble.replay.prefill
        ):
            self.prefill = self._prefill_demos(model, self.prefill, tasks)
        data = f"tcp://127.0.0.1:{free_port()}"
        control = f"tcp://127.0.0.1:{free_port()}"
        try:
            self._phase = "starting the local desktops"
            desktops = self._desktops() if cfg.local_desktops else None
            self._phase = "starting the VMs"
            fleet = self._vm_fleet() if cfg.vms else cfg.vm_fleet
            self._phase = "the preflight"
            left_out = self._preflight(tasks, desktops, fleet) if cfg.preflight else {}
            self._phase = "starting the learner and the actors"
            self.learner = self._learner_proc(model, tasks, data, control, left_out)
            for i in range(cfg.actors):
                if cfg.sim_envs_per_actor:
                    self.procs.append(self._actor_proc(i, model, data, control, envs=[],
                                      sim_envs=cfg.sim_envs_per_actor))  # fmt: skip
            if desktops is not None:
                urls, tokens = desktops
                self.procs.append(self._actor_proc(len(self.procs), model, data, control,
                                                   envs=urls, env_tokens=tokens,
                                                   sim_envs=0))  # fmt: skip
            if fleet:
                self.procs.append(self._actor_proc(len(self.procs), model, data, control,
                                                   envs=[], sim_envs=0, vm_fleet=fleet,
                                                   vm_pool=cfg.vm_pool))  # fmt: skip
            if cfg.env_urls:
                self.procs.append(self._actor_proc(len(self.procs), model, data, control,
                                                   envs=list(cfg.env_urls), sim_envs=0,
                                                   env_pool=cfg.env_urls_pool))  # fmt: skip
            self.learner.start()
            for p in self.procs:
                p.start()
            self._phase = None  # training: a signal stops it and the last checkpoint is evaluated
            self._supervise(stop)
        finally:
            self._shutdown()
        return self._results(tasks)

    def _stop_descendants(self, grace_s: float) -> None:
        """Every process of the run still running after an interrupted phase cleaned up
        (what it did not know it had started): SIGTERM, then SIGKILL after `grace_s`."""
        left = _descendants(os.getpid())
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + grace_s
        while left and time.monotonic() < end:
            time.sleep(0.2)
            left = [p for p in left if _running(p)]
        for pid in left:
            log.warning("pid %d did not stop within %.0f s of SIGTERM: SIGKILL", pid, grace_s)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    _phase: str | None = None
    """What the run is doing when it is not training (a signal then raises RunInterrupted
    there); None while it trains."""
    signalled: int | None = None
    """The signal that stopped the run (None: it was not stopped by one)."""
    preflight_report: dict[str, Any] | None = None
    """The preflight's outcome: its report files and the tasks it left out."""
    stalled: str | None = None
    """Why the learner could not go on (it exited with EXIT_STALLED), or None."""

    def _kill_everything(self) -> None:
        """A second signal: every process of the run killed at once (SIGKILL to the process
        groups of the learner, the actors and every other descendant: a pool run's actor,
        the desktops), the desktops' and VMs' state files swept."""
        for p in [*self.procs, *([self.learner] if self.learner else [])]:
            if p.popen is not None and p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.popen.pid, signal.SIGKILL)
        own = os.getpgrp()  # a pool run's actor is in this process's group: not the group
        for pid in _descendants(os.getpid()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if (group := os.getpgid(pid)) != own:
                    os.killpg(group, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            if self.desktop_state is not None:
                from arpo_envs.desktop.fleet import down

                down(self.desktop_state, grace_s=0.0, announce=lambda s: None)
        with contextlib.suppress(Exception):
            if self.vm_state is not None:
                from arpo_envs.vm.fleet import down as vm_down

                vm_down(self.vm_state, announce=lambda s: None)

    def _preflight(
        self, tasks: str, desktops: tuple[list[str], list[str]] | None, fleet: str
    ) -> dict[str, str]:
        """Every task set up once on an environment of its pool, no agent
        (`arpo.pool.audit`); the tasks that failed -> why, written to
        <run_dir>/preflight.{json,md} and <run_dir>/left_out.json (the learner's
        `left_out`). RunStalled when `preflight_fatal` and a task failed, or when every
        task failed."""
        import asyncio

        from arpo.env.task import load_pool
        from arpo.env.taskfiles import BlobCache, FileSource, TaskFiles
        from arpo.pool.audit import EnvSpec, audit_tasks, summarize

        cfg = self.config
        index = TaskFiles()
        pool = load_pool(tasks, index)
        runner = cfg.actor.runner.runner_config(reset_before_setup=cfg.actor.reset_before_setup)
        specs: dict[str, list[EnvSpec]] = {}
        if desktops is not None:
            specs["desktop"] = [
                EnvSpec(u, token=t, provider="desktop", runner=runner)
                for u, t in zip(*desktops, strict=True)
            ]
        if fleet:
            specs.setdefault(cfg.vm_pool, []).extend(EnvSpec.fleet_vms(fleet, runner))
        kind = "desktop" if cfg.actor.reset_before_setup else "static"
        specs.setdefault(cfg.env_urls_pool, []).extend(
            EnvSpec(u, token=cfg.actor.env_token, provider=kind, runner=runner)
            for u in cfg.env_urls
        )
        sims = min(4, cfg.actors * cfg.sim_envs_per_actor)
        t0 = time.monotonic()

        async def run() -> list[Any]:
            runners: list[Any] = []
            if sims:
                from arpo_envs.sim.server import SimConfig, start_servers

                runners, urls = await start_servers([SimConfig(port=0) for _ in range(sims)])
                specs.setdefault(cfg.actor.sim_pool, []).extend(
                    EnvSpec(u, provider="sim") for u in urls
                )
            try:
                source = FileSource.local(index, BlobCache(self.run_dir / "preflight-files"))
                return await audit_tasks(pool, specs, source, checks=False,
                                         task_timeout_s=cfg.preflight_task_timeout_s)  # fmt: skip
            finally:
                for r in runners:
                    await r.cleanup()

        log.info("preflight: setting up each of the %d tasks once on an environment of its "
                 "pool", len(pool))  # fmt: skip
        audits = asyncio.run(run())
        left_out = {a.task_id: a.reason for a in audits if a.verdict != "ok"}
        report = {
            "seconds": round(time.monotonic() - t0, 1),
            "summary": summarize(audits),
            "left_out": left_out,
            "tasks": [a.to_dict() for a in audits],
        }
        (self.run_dir / "preflight.json").write_text(json.dumps(report, indent=1))
        (self.run_dir / "preflight.md").write_text(preflight_markdown(audits, report["seconds"]))
        self.preflight_report = {
            "tasks": len(audits),
            "left_out": left_out,
            "seconds": report["seconds"],
            "report": str(self.run_dir / "preflight.md"),
        }
        log.info("preflight: %d of %d tasks set up in %.0f s on %s; %d left out%s", len(audits)
                 - len(left_out), len(audits), report["seconds"],
                 ", ".join(f"{len(v)} of pool {p!r}" for p, v in specs.items()), len(left_out),
                 "".join(f"\n  {t}: {r}" for t, r in list(left_out.items())[:20]))  # fmt: skip
        for t, r in left_out.items():
            print(f"arpo train: preflight: task {t} left out: {r}", file=sys.stderr)
        if left_out and (cfg.preflight_fatal or len(left_out) == len(audits)):
            why = ("preflight_fatal is set" if len(left_out) < len(audits)
                   else "no task could be set up")  # fmt: skip
            raise RunStalled(
                f"the preflight left out {len(left_out)} of {len(audits)} tasks and {why}: "
                + "; ".join(f"{t}: {r}" for t, r in list(left_out.items())[:20])
                + f" (all of them: {self.run_dir / 'preflight.md'})"
            )
        return left_out

    def _supervise(self, stop: dict[str, bool]) -> None:
        cfg = self.config
        assert self.learner is not None
        start = time.monotonic()
        last_progress = last_check = 0.0
        metrics = self.run_dir / "learner" / "metrics.jsonl"
        status = self.run_dir / "learner" / "tasks_out.json"
        from arpo.learner.metrics import ProgressLine
        from arpo.progress import Progress

        # Training with an estimate of the time left when the iterations bound the run;
        # a line saying what the run waits for when no iteration has finished for a while.
        bar = (
            Progress("training", cfg.learner.iterations, unit="iteration", every_s=cfg.progress_s)
            if cfg.learner.iterations and cfg.progress_s
            else None
        )
        step, step_at = -1, time.monotonic()
        told_out: set[str] = set()
        while not stop["flag"]:
            time.sleep(0.5)
            if cfg.minutes and time.monotonic() - start > cfg.minutes * 60:
                log.info("time budget of %.1f min used: stopping", cfg.minutes)
                break
            if not self.learner.alive():
                code = self.learner.popen.returncode if self.learner.popen else None
                if code == 0:
                    log.info("the learner finished its iterations")
                    break
                if code == EXIT_STALLED:
                    self.stalled = _learner_error(self.learner.log)
                    print(f"arpo train: the run cannot go on: {self.stalled}", file=sys.stderr)
                    break
                self._restart(self.learner, f"the learner exited with code {code}")
            elif cfg.learner.iterations and time.monotonic() - last_check >= 1.0:
                last_check = time.monotonic()
                rows = read_metrics(metrics) if metrics.exists() else []
                if rows and rows[-1]["step"] >= cfg.learner.iterations:
                    log.info("the learner finished its iterations: stopping the actors, then it")
                    break
            for p in self.procs:
                if not p.alive():
                    self._restart(p, f"{p.name} exited with code {p.popen.returncode}")
            if not cfg.progress_s or time.monotonic() - last_progress < cfg.progress_s:
                continue
            last_progress = time.monotonic()
            rows = read_metrics(metrics) if metrics.exists() else []
            waiting = _read_json(status)
            for tid, r in (waiting.get("tasks_out") or {}).items():
                if tid not in told_out:
                    told_out.add(tid)
                    print(f"arpo train: task {tid} is out of the run: {r.get('reason')}",
                          file=sys.stderr)  # fmt: skip
            if rows and rows[-1]["step"] != step:
                step, step_at = rows[-1]["step"], time.monotonic()
            stuck = time.monotonic() - step_at
            if (rows or waiting) and stuck > max(3 * cfg.progress_s, 30.0) and waiting:
                print(f"[{time.monotonic() - start:5.0f} s] training: {max(step, 0)}/"
                      f"{cfg.learner.iterations or '?'} iterations; waiting {stuck:.0f} s for "
                      f"groups: {waiting.get('waiting_for', '?')}", file=sys.stderr)  # fmt: skip
            elif rows and bar is not None:
                bar.update_to(rows[-1]["step"], ProgressLine.format(rows[-1]["step"], rows[-1]))
            elif rows:
                print(ProgressLine.format(rows[-1]["step"], rows[-1]), file=sys.stderr)
            else:
                elapsed = time.monotonic() - start
                print(f"[{elapsed:5.0f} s] waiting for the first iteration ...",
                      file=sys.stderr)  # fmt: skip
        if bar is not None:
            bar.close()

    def _pool_progress(self, desc: str) -> tuple[Any, Any]:
        """(on_progress callback for a pool run, close): a bar with the time left on a
        terminal, plain lines every `progress_s` otherwise (none when it is 0)."""
        from arpo.progress import Progress

        holder: dict[str, Progress] = {}

        def on_progress(done: int, total: int) -> None:
            if "p" not in holder:
                holder["p"] = Progress(desc, total, unit="episode", every_s=self.config.progress_s)
            holder["p"].update_to(done)

        def close() -> None:
            if "p" in holder:
                holder["p"].close()

        return on_progress, close

    def _pool_fields(self, tasks: str) -> dict[str, Any]:
        """The fields an evaluation or the pre-fill collection of this run shares: the
        simulated tasks of the pool, this run's actor limits, free loopback ports."""
        cfg = self.config
        return {
            "tasks": str(Path(tasks) / "sim") if (Path(tasks) / "sim").is_dir() else tasks,
            # Simulated episodes take seconds: a grant not delivered in 2 minutes is lost
            # (once seen: one of 128 grants of an evaluation never ran) and goes to the
            # actor again instead of stalling the run for the default 30 min.
            "grant_timeout_s": 120.0,
            "local_actor_args": cfg.pool_actor_args(),
            "progress_s": 0,
            "transport": replace(
                cfg.learner.transport,
                data=f"tcp://127.0.0.1:{free_port()}",
                control=f"tcp://127.0.0.1:{free_port()}",
            ),
        }

    def _prefill(self, model: str, tasks: str) -> dict[str, Any]:
        """`arpo collect` of the starting policy on the simulated tasks at the rollout
        sampling settings (`learner.trainer.temperature`, `top_p`, so the learner can
        train the kept episodes), `prefill_runs_per_task` per task, into <run_dir>/prefill
        (replacing what is there); the folder and the successes per task."""
        from arpo.pool.collect import CollectConfig, run_collect

        cfg = self.config
        out = self.run_dir / "prefill"
        log.info(
            "replay pre-fill: the starting policy, %d runs per simulated task at "
            "temperature %g -> %s", cfg.prefill_runs_per_task,
            cfg.learner.trainer.temperature, out,
        )  # fmt: skip
        on_progress, close = self._pool_progress("replay pre-fill")
        try:
            res = run_collect(
                CollectConfig(
                    model=model,
                    **self._pool_fields(tasks),
                    runs_per_task=cfg.prefill_runs_per_task,
                    temperature=cfg.learner.trainer.temperature,
                    top_p=cfg.learner.trainer.top_p,
                    out=str(out),
                    overwrite=True,
                ),
                on_progress=on_progress,
            )
        finally:
            close()
        by_task = {t: int(r.get("successes") or 0) for t, r in res["tasks"].items()}
        log.info(
            "replay pre-fill: %d successes in %d of %d tasks",
            sum(by_task.values()), sum(1 for k in by_task.values() if k), len(by_task),
        )  # fmt: skip
        return {"trajectories": str(out), "successes": by_task}

    def _prefill_demos(
        self, model: str, prefill: dict[str, Any] | None, tasks: str
    ) -> dict[str, Any] | None:
        """The warm start's demonstrations (<model>/demos, written by `arpo sft`) scored by
        `model` at the rollout sampling settings, with the pre-fill collection's
        trajectories, in <run_dir>/prefill-replay: what the learner's buffers start with.
        All of them with `prefill_demos`; else those of the pool's multi-step tasks
        (`prefill_demos_from_turns`)."""
        import shutil

        from arpo.offline.data import read_trajectories, write_trajectories
        from arpo.offline.demos import score_demos

        cfg = self.config
        src = Path(model) / "demos"
        if not src.is_dir():
            log.info("replay pre-fill of demonstrations skipped: %s has no demos folder", model)
            return prefill
        demos = list(read_trajectories(src))
        if not cfg.prefill_demos:
            long = long_tasks(tasks, cfg.prefill_demos_from_turns)
            demos = [d for d in demos if d.task_id in long]
            if not demos:
                return prefill
            log.info(
                "replay pre-fill: the demonstrations of %d multi-step task(s) (oracle + DONE >= %d "
                "turns; prefill_demos_from_turns)", len(long), cfg.prefill_demos_from_turns,
            )  # fmt: skip
        scored = score_demos(
            demos, model, temperature=cfg.learner.trainer.temperature,
            top_p=cfg.learner.trainer.top_p,
        )  # fmt: skip
        out = self.run_dir / "prefill-replay"
        shutil.rmtree(out, ignore_errors=True)
        collected = list(read_trajectories(prefill["trajectories"])) if prefill else []
        write_trajectories(out, [*collected, *scored])
        successes = dict(prefill["successes"]) if prefill else {}
        for d in scored:
            successes[d.task_id] = successes.get(d.task_id, 0) + 1
        log.info(
            "replay pre-fill: %d oracle demonstrations scored by the starting policy at "
            "temperature %g, with %d collected trajectories -> %s",
            len(scored), cfg.learner.trainer.temperature, len(collected), out,
        )  # fmt: skip
        return {"trajectories": str(out), "successes": successes, "demos": len(scored)}

    def _evaluate(self, tasks: str, policy: dict[str, str], out: Path) -> dict[str, Any]:
        """`arpo eval` of `policy` ({"checkpoint": ...} or {"model": ...}) on the simulated
        tasks of the pool, `eval_runs_per_task` episodes per task at `eval_temperature`;
        the success rate over episodes and its standard error."""
        from arpo.pool.evaluate import EvalConfig, run_eval

        cfg = self.config
        on_progress, close = self._pool_progress(f"evaluation ({out.name})")
        try:
            ev = run_eval(
                EvalConfig(
                    **policy,
                    **self._pool_fields(tasks),
                    runs_per_task=cfg.eval_runs_per_task,
                    temperature=cfg.eval_temperature,
                    out=str(out),
                ),
                on_progress=on_progress,
            )
        finally:
            close()
        overall = ev.get("overall", {})
        p = float(overall.get("success_rate_episodes") or 0.0)
        n = int(overall.get("episodes") or 0)
        return {
            "success_rate": p,
            "episodes": n,
            "se": (p * (1 - p) / n) ** 0.5 if n else float("nan"),
            "mean_steps": float(overall.get("mean_steps") or 0.0),
            "report": str(out / "eval.md"),
            "by_task": {
                t: {"successes": int(r.get("successes") or 0), "runs": int(r.get("runs") or 0)}
                for t, r in ev.get("tasks", {}).items()
            },
        }

    def _restart(self, p: _Proc, why: str) -> None:
        if not self.config.restart or p.restarts >= self.config.max_restarts:
            raise ArpoError(f"{why}; see {p.log}")
        p.restarts += 1
        self.restarts[p.name] = p.restarts
        log.warning("%s: starting it again (%d of %d)", why, p.restarts, self.config.max_restarts)
        p.start(restarted=True)

    def _shutdown(self) -> None:
        # Actors first, all at once: they finish or abandon their episodes and flush their
        # spools to the learner while it still runs (it holds after its iterations: no new
        # grants, every delivery acknowledged); then the learner checkpoints what it holds.
        t0 = time.monotonic()
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.stop(timeout=180)
        if self.procs:
            log.info("actors stopped in %.1f s", time.monotonic() - t0)
        if self.learner is not None:
            code = self.learner.stop(timeout=600)
            log.info("learner stopped (code %s)", code)
        if self.desktop_state is not None:
            from arpo_envs.desktop.fleet import down

            down(self.desktop_state)
        if self.vm_state is not None:
            from arpo_envs.vm.fleet import down as vm_down

            vm_down(self.vm_state, announce=lambda s: log.info("VMs: %s", s))

    # ---- results -----------------------------------------------------------------------

    def _results(self, tasks: str) -> dict[str, Any]:
        cfg = self.config
        learner_dir = self.run_dir / "learner"
        metrics = learner_dir / "metrics.jsonl"
        rows = read_metrics(metrics) if metrics.exists() else []
        ckpt = latest_checkpoint(learner_dir / "checkpoints", verify=False)
        finished = bool(cfg.learner.iterations and rows
                        and rows[-1]["step"] >= cfg.learner.iterations)  # fmt: skip
        out: dict[str, Any] = {
            "metrics": str(metrics),
            "iterations": len(rows),
            "finished": finished,
            "checkpoint": str(ckpt) if ckpt else None,
            "restarts": dict(self.restarts),
        }
        if self.stalled is not None:
            out["stalled"] = self.stalled
        if self.signalled is not None:
            out["signal"] = self.signalled
        if self.preflight_report is not None:
            out["preflight"] = self.preflight_report
        status = _read_json(learner_dir / "tasks_out.json")
        out["tasks_out"] = status.get("tasks_out", {})
        out["groups_given_up"] = status.get("groups_given_up", 0)
        if self.warm_eval is not None:
            out["eval_warm_start"] = self.warm_eval
        if self.prefill is not None:
            out["prefill"] = self.prefill
        if self.stalled is not None:
            log.info("no final evaluation: the run stopped before its end (%s)", self.stalled)
        elif ckpt is not None and cfg.eval_runs_per_task and cfg.sim_envs_per_actor:
            # After a signal stopped training a second one kills everything; else the
            # first one stops this evaluation (RunInterrupted).
            self._phase = "the final evaluation" if self.signalled is None else None
            ev = self._evaluate(tasks, {"checkpoint": str(ckpt)}, self.run_dir / "eval")
            self._phase = None
            out["eval"] = str(self.run_dir / "eval" / "eval.md")
            out["eval_success_rate"] = ev["success_rate"]
            out["eval_trained"] = ev
            if self.warm_eval is not None:
                out["eval_gain"] = _gain(self.warm_eval, ev)
        if rows:
            out["plot"] = str(plot_curves(
                rows, self.run_dir / "curve.png", warm_start=self.warm_eval,
                eval_temperature=cfg.eval_temperature, trained=out.get("eval_trained"),
                rollout_temperature=cfg.learner.trainer.temperature,
            ))  # fmt: skip
        out["accounting"] = account(self.run_dir, ckpt)
        (self.run_dir / "summary.json").write_text(json.dumps(out, indent=2))
        self.summary = out
        return out


def _tiny_max_pixels(model: Path) -> int:
    """The `max_pixels` a saved tiny model's processor was built with."""
    from transformers import AutoProcessor

    from arpo.policy.prompt import pixel_bounds

    return int(pixel_bounds(AutoProcessor.from_pretrained(str(model)))[1])


def _warm_start_observation(sft_dir: Path) -> str:
    """The observation type the warm start in `sft_dir` was trained on (`arpo sft`'s saved
    config; 'screenshot' for one saved before the field existed)."""
    try:
        info = json.loads((sft_dir / "offline.json").read_text())
    except (OSError, ValueError):
        return "screenshot"
    return str((info.get("sft") or {}).get("observation_type", "screenshot"))


def _gain(warm: dict[str, Any], trained: dict[str, Any]) -> dict[str, float]:
    """Trained minus warm-start success rate and its standard error (independent
    evaluations of the same tasks with the same protocol)."""
    diff = trained["success_rate"] - warm["success_rate"]
    se = (warm["se"] ** 2 + trained["se"] ** 2) ** 0.5
    return {"points": 100 * diff, "se_points": 100 * se}


def account(run_dir: Path, checkpoint: Path | None) -> dict[str, Any]:
    """Where every trajectory the actors finished went.

    Finished (the actors' spool ledgers, by status) against: trained (the learner's
    `trained.log`, as of the final checkpoint), dropped by the learner with a reason
    (stale, replaced by a replayed success, invalid, ...), still in the store (the final
    checkpoint's snapshot) or in the journal after it, still in an actor's spool (never
    acknowledged), or kept aside there as refused for good by the learner. `unaccounted` lists `ok` trajectories found in none of them;
    `trained_twice` counts fresh trajectories trained in two iterations. Both must be 0."""
    import collections

    from arpo import store_item, wire
    from arpo.actor.spool import REFUSED, SUFFIX, read_ledger
    from arpo.buffer import ReplayStore
    from arpo.learner.checkpoint import load_checkpoint
    from arpo.service.journal import list_segments, read_segment, segment_path

    finished: dict[str, tuple[str, str]] = {}
    in_spool: set[str] = set()
    refused: set[str] = set()
    for d in sorted((run_dir / "spool").glob("*")):
        finished.update(read_ledger(d))
        in_spool |= {p.name[: -len(SUFFIX)] for p in d.glob("*" + SUFFIX)}
        refused |= {p.name[: -len(SUFFIX)] for p in (d / REFUSED).glob("*" + SUFFIX)}
    trained: collections.Counter[str] = collections.Counter()
    dropped: dict[str, str] = {}
    ledger = run_dir / "learner" / "trained.log"
    if ledger.exists():
        for line in ledger.read_text(encoding="utf-8").splitlines():
            parts = line.split("\t")
            if len(parts) != 3:
                continue
            if parts[2] == "fresh":
                trained[parts[1]] += 1
            elif parts[2].startswith("dropped_"):
                dropped[parts[1]] = parts[2][len("dropped_") :]
    in_store: set[str] = set()
    in_journal: set[str] = set()
    if checkpoint is not None:
        ck = load_checkpoint(checkpoint, verify=False)
        if ck.store_path is not None:
            store = ReplayStore.restore(ck.store_path)
            for task in store.tasks():
                n = store.fresh_len(task)
                if n:
                    in_store |= {store_item.from_item(i).trajectory_id
                                 for i in store.take_group(task, n, timeout=0)}  # fmt: skip
            store.close()
        journal = run_dir / "learner" / "journal"
        for seg in list_segments(journal):
            if ck.journal_segment is not None and seg >= ck.journal_segment:
                for rec in read_segment(segment_path(journal, seg)):
                    in_journal.add(wire.decode(rec.frames).trajectory_id)
    ok = {tid for tid, (status, _) in finished.items() if status == "ok"}
    accounted = set(trained) | set(dropped) | in_store | in_journal | in_spool | refused
    unaccounted = sorted(ok - accounted)
    return {
        "finished": len(finished),
        "finished_by_status": dict(collections.Counter(st for st, _ in finished.values())),
        "trained": len(set(trained) & ok),
        "dropped_by_reason": dict(collections.Counter(dropped[t] for t in set(dropped) & ok)),
        "in_store": len(in_store & ok),
        "in_journal": len(in_journal & ok),
        "in_spool": len(in_spool & ok),
        "refused": len(refused & ok),
        "unaccounted": len(unaccounted),
        "unaccounted_ids": unaccounted[:20],
        # every task out of the run: why, and how many of its trajectories were dropped
        "tasks_out": {
            t: {"reason": r.get("reason", ""), "dropped": r.get("dropped", 0)}
            for t, r in (
                _read_json(run_dir / "learner" / "tasks_out.json").get("tasks_out") or {}
            ).items()
        },
        "trained_twice": sum(1 for n in trained.values() if n > 1),
    }


def _local_suite() -> Path:
    import arpo_envs.tasks as t

    return Path(t.__file__).parent / "local"


def _ema(values: list[float], alpha: float = 0.15) -> list[float]:
    out, m = [], None
    for v in values:
        m = v if m is None else alpha * v + (1 - alpha) * m
        out.append(m)
    return out


def plot_curves(
    rows: list[dict[str, Any]],
    path: Path,
    warm_start: dict[str, Any] | float | None = None,
    eval_temperature: float = 0.6,
    trained: dict[str, Any] | None = None,
    rollout_temperature: float | None = None,
) -> Path:
    """Training success and mean reward against iteration, as a PNG: each training
    iteration's value faint, its exponential moving average (alpha 0.15) solid, labelled
    with the rollout temperature; the warm start's evaluation (`warm_start`: an evaluation
    dict, or a success rate) at iteration 0 and the trained policy's (`trained`) at the last
    iteration as points with 95 % error bars (1.96 standard errors), at `eval_temperature`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    t_roll = "" if rollout_temperature is None else f", T={rollout_temperature:g}"
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    for a, key, label in (
        (ax[0], "charts/success_rate", "success rate"),
        (ax[1], "charts/reward_mean", "mean reward"),
    ):
        pts = [(s, r.get(key)) for s, r in zip(steps, rows, strict=True) if r.get(key) is not None]
        if pts:
            xs, ys = [p[0] for p in pts], [float(p[1]) for p in pts]
            a.plot(xs, ys, color="tab:blue", alpha=0.25, linewidth=0.8,
                   label=f"training episodes{t_roll}")  # fmt: skip
            a.plot(xs, _ema(ys), color="tab:blue", linewidth=2, label="training, smoothed (EMA)")
        if key == "charts/success_rate":
            last = steps[-1] if steps else 1
            for x, ev, name, color in ((0, warm_start, "warm start", "grey"),
                                       (last, trained, "trained", "tab:green")):  # fmt: skip
                if ev is None:
                    continue
                p = ev if isinstance(ev, float | int) else ev.get("success_rate")
                se = 0.0 if isinstance(ev, float | int) else float(ev.get("se") or 0.0)
                if p is None:
                    continue
                a.errorbar([x], [p], yerr=[1.96 * se], fmt="o", color=color, capsize=4,
                           label=f"{name}, evaluated (T={eval_temperature:g}, 95 % CI)")  # fmt: skip
            a.set_ylim(-0.02, 1.02)
        a.legend(fontsize=7, loc="best")
        a.set_xlabel("iteration")
        a.set_ylabel(label)
        a.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def verdict(gain: dict[str, float]) -> str:
    """Whether training helped, in words: the difference and its 95 % interval."""
    lo = gain["points"] - 1.96 * gain["se_points"]
    hi = gain["points"] + 1.96 * gain["se_points"]
    ci = f"{gain['points']:+.1f} points, 95 % CI {lo:+.1f} to {hi:+.1f}"
    if lo > 0:
        return f"Training helped: {ci} (the interval excludes 0)."
    if hi < 0:
        return f"Training made the policy worse: {ci} (the interval excludes 0)."
    return f"No measurable effect: {ci} (the interval includes 0)."


def comparison(out: dict[str, Any]) -> str:
    """The starting and the trained policy's evaluations side by side (Markdown)."""
    w, t = out.get("eval_warm_start"), out.get("eval_trained")
    rows = ["| policy | success rate | standard error | episodes |", "|---|---:|---:|---:|"]
    for name, ev in (("start (warm start)", w), ("trained", t)):
        if ev:
            rows.append(f"| {name} | {100 * ev['success_rate']:.1f} % | "
                        f"{100 * ev['se']:.1f} | {ev['episodes']} |")  # fmt: skip
    g = out.get("eval_gain")
    if g:
        rows.append(f"| trained - start | {g['points']:+.1f} points | {g['se_points']:.1f} | |")
        rows += ["", verdict(g)]
    wt, tt = (w or {}).get("by_task") or {}, (t or {}).get("by_task") or {}
    pre = (out.get("prefill") or {}).get("successes")
    if wt and tt:
        # Per task: a gain overall can hide tasks that were lost while others were learned.
        head, rule = "| task | start | trained | change |", "|---|---:|---:|---:|"
        if pre is not None:
            head, rule = head + " replay pre-fill |", rule + "---:|"
        rows += ["", head, rule]
        for task in sorted(set(wt) | set(tt)):
            a, b = wt.get(task), tt.get(task)
            cells = [f"{x['successes']}/{x['runs']}" if x else "-" for x in (a, b)]
            d = b["successes"] - a["successes"] if a and b and a["runs"] == b["runs"] else None
            line = (f"| {md_cell(task)} | {cells[0]} | {cells[1]} | "
                    f"{'' if d is None else f'{d:+d}'} |")  # fmt: skip
            if pre is not None:
                line += f" {pre.get(task, '-')} |"
            rows.append(line)
    return "\n".join(rows)


def main(cfg: TrainConfig) -> int:
    """Run; the exit code: 0 when training finished (or its wall-clock budget ran out),
    EXIT_STALLED (3) when it could not go on, 128 + the signal's number when a signal
    stopped it before its end."""
    try:
        out = TrainRun(cfg).run()
    except RunStalled as e:
        print(f"arpo train: {e}", file=sys.stderr)
        return EXIT_STALLED
    except RunInterrupted as e:
        print(f"arpo train: {e}", file=sys.stderr)
        return 128 + e.signum
    print(json.dumps(out, indent=2))
    if out.get("eval"):
        print(Path(out["eval"]).read_text())
    if out.get("eval_trained"):
        print(comparison(out))
    if out.get("tasks_out"):
        print(tasks_out_table(out["tasks_out"]))
    if out.get("stalled"):
        # Why was said when the learner stopped (`_supervise`), once.
        print(f"arpo train: stopped before its end (details: {cfg.run_dir}/learner/"
              f"tasks_out.json; the last checkpoint: {out.get('checkpoint')})",
              file=sys.stderr)  # fmt: skip
        return EXIT_STALLED
    if out.get("signal") is not None and not out.get("finished"):
        return 128 + int(out["signal"])
    return 0


def tasks_out_table(tasks_out: dict[str, Any]) -> str:
    """The tasks that were out of the run (left out before it, or left during it), a line
    each with their reason, failures and environments."""
    lines = [f"{len(tasks_out)} task(s) out of the run:", "", "| task | failures | envs | "
             "dropped | reason |", "|---|---|---|---|---|"]  # fmt: skip
    for tid, r in sorted(tasks_out.items()):
        reason = md_cell(r.get("reason", ""), 300)
        lines.append(f"| {md_cell(tid)} | {r.get('failures', 0)} | {r.get('envs', 0)} | "
                     f"{r.get('dropped', 0)} | {reason} |")  # fmt: skip
    return "\n".join(lines)


def preflight_markdown(audits: Sequence[Any], seconds: float) -> str:
    """`<run_dir>/preflight.md`: a line per task of the preflight (`TaskAudit`s), its pool,
    its setup's seconds and why it was left out ("ok" when it was not)."""
    left_out = sum(a.verdict != "ok" for a in audits)
    lines = [f"# Preflight: {len(audits)} tasks set up once, {left_out} left out ({seconds} s)",
             "", "| task | pool | setup s | reason |", "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {md_cell(a.task_id)} | {md_cell(a.pool)} | {a.setup_s:.1f} | "
              f"{md_cell(a.reason, 300) or 'ok'} |" for a in audits]  # fmt: skip
    return "\n".join(lines) + "\n"

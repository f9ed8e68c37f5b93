"""`arpo sft`: the supervised warm start on oracle demonstrations of the tasks.

    arpo sft model=runs/tiny out=runs/sft eval_tasks=16     # click_button, 16 tasks, 17 epochs
    arpo sft tasks=runs/task_pool model=runs/tiny out=runs/sft       # tasks with an "oracle"
    arpo sft demos=runs/demos model=runs/tiny out=runs/sft           # demos recorded before
    arpo sft tasks=envs/arpo_envs/tasks/local/libreoffice_calc local_desktops=2 \
        model=runs/reader out=runs/sft-calc observation_type=som       # on real local desktops

The paper starts RL from an agent that already succeeds sometimes; the tiny test model
has random weights. This fine-tunes it on demonstrations (`arpo.offline.demos`: each
task's oracle played through the real episode path, the response ids from the model's
own tokenizer, only demonstrations the checker scores 1) so that it starts with a low
but non-zero success rate. When `demos` is empty they are recorded first and saved to
`<out>/demos` (the journal format `arpo.offline.data` reads): on simulated desktops served
in this process, or with `local_desktops` on real local desktops started for the recording
(the local suite's oracles pause between keystrokes; the UI-TARS text drops the pauses,
and a demonstration the checker then fails is dropped like any other).

Training: the token-mean negative log-likelihood of the response tokens over each
optimizer step's trajectories (`arpo.offline.losses.nll_loss`), with the learner's
sequence building (`arpo.learner.batch`), AdamW and gradient clipping, i.e. the `rft`
step of `arpo.offline.offline.OfflineTrainer` on the demonstrations. The model and the
processor are saved to `out` with `save_pretrained` (a folder actors and the learner
load). With `eval_tasks > 0` the greedy success rate of the result on that many of the
tasks is measured by running episodes (engine + simulated desktop + checker).

The defaults are the warm start measured for the tiny model (`arpo-tiny-model` seed 0;
2026-11-22, the project's 2-core machine shared with other jobs): 16 `click_button`
demonstrations (task seed 0), lr 1e-3, 8 per step, greedy success on those 16 tasks by
epochs: 15 -> 6.25 %, 17 -> 18.75 % (the default, 34 steps, about a minute of training),
20 -> 43.75 %, 40 -> 93.75 % (memorised); 64 demonstrations x 10 epochs -> 0 % (every
response parses, the clicks land at nearly the same spot: the tiny vision tower does not
locate the target at 280x168 after that much training, it learns the tasks it saw).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from arpo.actor.episode import A11Y_MAX_TOKENS, HISTORY_IMAGES, PROMPT_FIELDS, EpisodeConfig
from arpo.config import fail, option, to_dict, validate
from arpo.env.bringup import MAX_LOCAL_ENVS
from arpo.offline.data import read_trajectories, write_trajectories
from arpo.offline.offline import OfflineConfig, OfflineTrainer
from arpo.policy.family import TRAIN_LAYERS_DOC

if TYPE_CHECKING:
    from arpo.env.taskfiles import TaskFiles

log = logging.getLogger("arpo.offline.sft")


@dataclass
class SFTConfig:
    """`arpo sft`: record oracle demonstrations (unless given), fine-tune, save."""

    # `max_steps` is the episode's turns; the optimizer's bound has its own name.
    renamed_fields: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"max_steps_train": "max_optimizer_steps"}
    )

    model: str = option("", "Folder of the starting model (e.g. the tiny model runs/tiny).")
    out: str = option("", "Folder the fine-tuned model and processor are saved to.")
    tasks: str = option("", "Task pool (folder / .json / .jsonl) whose tasks carry an oracle.")
    families: list[str] = option(
        doc="Simulated task families to generate when tasks is empty.",
        factory=lambda: ["click_button"],
    )
    per_family: int = option(16, "Generated tasks per family.")
    task_seed: int = option(0, "Seed of the generated tasks.")
    demos: str = option("", "Folder of demonstrations recorded before ('' records them).")
    max_sequences: int = option(0, "Train on at most this many demonstrations (0: all).")
    n_envs: int = option(4, "Simulated desktops used to record (and evaluate) in parallel.")
    local_desktops: int = option(
        0,
        "Record (and evaluate) on this many real local desktops started for it (`arpo-envs "
        "up`, stopped after), for a pool of local tasks (tasks=..., e.g. envs/arpo_envs/tasks/"
        "local: LibreOffice, the editor, the shell); they serve their apps' trees when the "
        "observation shows one. 0: simulated desktops in this process (n_envs).",
    )
    max_steps: int = option(
        15,
        "Turns per episode when recording and evaluating (0: fitted to each task's oracle, "
        "arpo.actor.episode.step_budget). A demonstration that needs more is dropped.",
    )
    max_new_tokens: int = option(
        0,
        "Longest response the policy will be allowed (the actors' episode.max_new_tokens); a "
        "demonstration with a longer response is dropped, since the policy could never sample "
        "it whole (0: no bound).",
    )
    observation_type: Literal["screenshot", "a11y_tree", "screenshot_a11y_tree", "som"] = option(
        "screenshot",
        "What each demonstration's prompts show, and the evaluation's (the actors' "
        "episode.observation_type: a warm start learns to read what it is shown; with 'som' "
        "the oracle's clicks name their mark).",
    )
    marks_source: Literal["tree", "ocr", "auto"] = option(
        "tree",
        "With 'som': what makes the mark table of each demonstration's prompts and of the "
        "evaluation (the actors' episode.marks_source: a warm start for OCR marks learns on "
        "OCR tables).",
    )
    a11y_max_tokens: int = option(
        A11Y_MAX_TOKENS,
        "Tokens each prompt's table is cut to, when recording and evaluating (the actors' "
        "episode.a11y_max_tokens: a warm start learns on the tables RL will show it).",
    )
    history_images: int = option(
        HISTORY_IMAGES,
        "Observations kept in each prompt's context, when recording and evaluating (the "
        "actors' episode.history_images).",
    )
    dtype: Literal["float32", "bfloat16"] = option("float32", "Parameter dtype.")
    device: str = option("cpu", "Torch device.")
    lr: float = option(1e-3, "AdamW learning rate (high: the tiny model starts from random).")
    weight_decay: float = option(0.0, "AdamW weight decay.")
    grad_clip: float = option(1.0, "Clip the global gradient norm to this (0: no clipping).")
    epochs: int = option(17, "Passes over the demonstrations.")
    batch_size: int = option(8, "Demonstrations per optimizer step.")
    micro_batch: int = option(4, "Demonstrations per forward / backward pass.")
    max_optimizer_steps: int = option(0, "Stop after this many optimizer steps (0: all epochs).")
    target_nll: float = option(
        0.0,
        "Stop after the first epoch whose demonstrations' mean NLL per response token is at "
        "most this (0: all epochs): the tiny model's success after SFT follows this fit, "
        "not the epoch count, which varies widely with the seed.",
    )
    train_layers: int = option(0, TRAIN_LAYERS_DOC)
    seed: int = option(0, "Seed of shuffling and torch.")
    eval_tasks: int = option(0, "After training, greedy episodes on this many tasks (0: none).")
    log_every: int = option(10, "Log a progress line every this many optimizer steps.")

    def validate(self) -> None:
        if not self.model:
            fail("model", "give the folder of the starting model (arpo-tiny-model --out DIR)")
        if not self.out:
            fail("out", "give the folder to save the fine-tuned model to")
        if not self.tasks and not self.demos and not self.families:
            fail("families", "give task families, a task pool (tasks=...) or demos=...")
        if self.per_family < 1:
            fail("per_family", "must be >= 1")
        if self.max_sequences < 0:
            fail("max_sequences", "must be >= 0 (0: all)")
        if self.n_envs < 1:
            fail("n_envs", "must be >= 1")
        if not 0 <= self.local_desktops <= MAX_LOCAL_ENVS:
            fail("local_desktops", f"must be in [0, {MAX_LOCAL_ENVS}] (0: simulated desktops)")
        if self.local_desktops and not self.tasks:
            fail("local_desktops", "runs a pool of local tasks: give tasks=<folder> too "
                 "(the generated families are simulated tasks)")  # fmt: skip
        if self.max_steps == 1 or self.max_steps < 0:
            fail("max_steps", "must be >= 2 (an oracle step and finished()), or 0 to fit")
        if self.max_new_tokens < 0:
            fail("max_new_tokens", "must be >= 0 (0: no bound)")
        if self.eval_tasks < 0:
            fail("eval_tasks", "must be >= 0")
        if self.max_optimizer_steps < 0:
            fail("max_optimizer_steps", "must be >= 0 (0: no limit)")
        if self.target_nll < 0:
            fail("target_nll", "must be >= 0 (0: no target, run all epochs)")
        # What the prompts show (marks only with som, the table budget, the context window),
        # checked as the actors check it.
        self.shown().validate()
        # The optimizer fields are checked by OfflineConfig.validate.

    def shown(self) -> EpisodeConfig:
        """What each recorded and evaluated prompt shows, as the actors' episode settings."""
        return EpisodeConfig(**{k: getattr(self, k) for k in PROMPT_FIELDS})

    def offline_config(self) -> OfflineConfig:
        """The `rft` trainer configuration these settings make."""
        return OfflineConfig(
            algo="rft", model=self.model, out=self.out, dtype=self.dtype, device=self.device,
            lr=self.lr, weight_decay=self.weight_decay, grad_clip=self.grad_clip,
            epochs=self.epochs, batch_size=self.batch_size, micro_batch=self.micro_batch,
            max_optimizer_steps=self.max_optimizer_steps, target_nll=self.target_nll,
            seed=self.seed, log_every=self.log_every, train_layers=self.train_layers,
        )  # fmt: skip


def task_pool(cfg: SFTConfig, files: TaskFiles | None = None) -> list[dict[str, Any]]:
    """The tasks: the pool at `tasks` (the files they upload indexed in `files`), else
    `per_family` generated tasks of each family."""
    if cfg.tasks:
        from arpo.env.task import load_task_pool

        return load_task_pool(cfg.tasks, files)
    from arpo.offline.demos import sim_task_pool

    return sim_task_pool(cfg.families, cfg.per_family, cfg.task_seed)


def run(cfg: SFTConfig) -> dict[str, Any]:
    """Record (or read) the demonstrations, fine-tune, save; returns a summary."""
    from pathlib import Path

    from arpo.env.taskfiles import TaskFiles
    from arpo.offline.demos import LocalDesktops

    cfg = validate(cfg)
    tasks: list[dict[str, Any]] = []
    report: dict[str, Any] = {}
    files = TaskFiles()
    shown = cfg.shown()
    local = (
        LocalDesktops(cfg.local_desktops, files, atspi=shown.needs_tree)
        if cfg.local_desktops
        else None
    )
    if cfg.demos:
        demos = list(read_trajectories(cfg.demos))
    else:
        from arpo.offline.demos import record_demos

        tasks = task_pool(cfg, files)
        demos, report = record_demos(
            tasks,
            cfg.model,
            n_envs=cfg.n_envs,
            max_steps=cfg.max_steps,
            max_new_tokens=cfg.max_new_tokens,
            observation_type=cfg.observation_type,
            marks_source=cfg.marks_source,
            a11y_max_tokens=cfg.a11y_max_tokens,
            history_images=cfg.history_images,
            local=local,
        )
        write_trajectories(Path(cfg.out) / "demos", demos)
    if cfg.max_sequences:
        demos = demos[: cfg.max_sequences]
    trainer = OfflineTrainer(cfg.offline_config())
    before = trainer.mean_nll(demos)
    history = trainer.train(demos)
    after = trainer.mean_nll(demos)
    summary: dict[str, Any] = {
        "demos": len(demos),
        "steps": trainer.steps_done,
        "final_loss": history[-1]["loss/nll"] if history else math.nan,
        "nll_before": before,
        "nll_after": after,
        **{f"record_{k}": v for k, v in report.items()},
    }
    trainer.save(cfg.out, {"summary": summary, "sft": to_dict(cfg)})
    if cfg.eval_tasks:
        from arpo.offline.demos import evaluate_greedy

        tasks = tasks or task_pool(cfg, files)
        res = evaluate_greedy(
            cfg.out, tasks[: cfg.eval_tasks], n_envs=cfg.n_envs, max_steps=cfg.max_steps,
            observation_type=cfg.observation_type, marks_source=cfg.marks_source,
            a11y_max_tokens=cfg.a11y_max_tokens, history_images=cfg.history_images, local=local,
        )  # fmt: skip
        summary.update({f"eval_{k}": v for k, v in res.items()})
    return summary

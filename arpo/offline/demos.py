"""Demonstrations from the tasks' oracles, recorded through the real episode path; greedy evaluation.

    tasks = sim_task_pool(["click_button", "menu_pick"], per_family=32, seed=0)
    demos, report = record_demos(tasks, "runs/tiny")           # list[Trajectory], counts
    write_trajectories("runs/demos", demos)                     # arpo.offline.data
    result = evaluate_greedy("runs/sft", tasks[:16])            # {"success_rate": ..., ...}

Recording runs `arpo.actor.episode.run_episode`, the actor's own loop, against simulated
desktop servers started in this process (real HTTP on loopback, the OSWorld protocol), or
with `LocalDesktops` against real local desktops started for the call (`run_on_desktops`):
revert + the task's setup, then per turn the screenshot, the turn's prompt ids from
`EpisodePrompt` with the model's processor, one response, parse, execute; at the end the
task's checker. The response comes from `OraclePolicy` instead of a model: the oracle's
next pyautogui step written as UI-TARS text by the scripted policy's conversion
(`arpo.actor.scripted.oracle_to_actions` + `actions.format_response`, coordinates in the
frame of the screenshot shown), then `finished()`; the text is tokenised with the model's
own tokenizer and <|im_end|> appended, so the response ids are what the model would have
to sample. Behaviour log-probs are 0 (nobody sampled them). Only demonstrations the
checker scores 1 (status ok) are kept.

Greedy evaluation runs the same loop with the transformers engine (`HFEngine`,
temperature 0) on the model folder, and reports the success rate (checker score 1), the
share of responses that parsed, and the mean episode length.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from arpo import store_item, wire
from arpo.actor.episode import (
    A11Y_MAX_TOKENS,
    HISTORY_IMAGES,
    MAX_STEPS,
    EpisodeConfig,
    run_episode,
    step_budget,
)
from arpo.actor.scripted import by_mark, oracle_to_actions, turn_frame
from arpo.env.environment import Environment, EnvironmentConfig
from arpo.env.runner import RunnerConfig
from arpo.errors import ArpoError, EngineError
from arpo.policy import actions as A
from arpo.policy.engine import Completion, SamplingParams
from arpo.policy.family import family_for_processor
from arpo.record import Status, Trajectory

if TYPE_CHECKING:
    from arpo.env.taskfiles import TaskFiles

log = logging.getLogger("arpo.offline.demos")

DEMO_THOUGHT = "I will do the next step of the task."
"""The Thought line of every demonstrated step (the same words each time: the tiny model
learns the format, the coordinates carry the information)."""
DONE_THOUGHT = "The task is complete."


def sim_task_pool(families: Sequence[str], per_family: int, seed: int = 0) -> list[dict[str, Any]]:
    """`per_family` simulated tasks (OSWorld dicts with their oracle) of every family."""
    from arpo_envs.sim.tasks import generate_tasks

    return [t for f in families for t in generate_tasks(f, per_family, seed=seed)]


class OraclePolicy:
    """The engine-shaped oracle: answers turn k with the oracle's step k as UI-TARS text.

    `processor` is the model's `AutoProcessor` (its tokenizer and min / max pixels are
    what `run_episode` builds the prompt with)."""

    def __init__(self, processor: Any, thought: str = DEMO_THOUGHT, scroll_clicks: int = 5):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.family = family_for_processor(processor)
        self.image_rule = self.family.image_rule(processor)
        self.thought = thought
        self.scroll_clicks = scroll_clicks
        self.end_id = self.family.chat(self.tokenizer).end
        """The family's end-of-message token, which ends every response."""

    def episode(self, task: Any) -> _OracleEpisode:
        oracle = task.extra.get("oracle")
        if not oracle:
            raise EngineError(f"task {task.id} has no oracle")
        return _OracleEpisode(self, [str(s) for s in oracle])

    def response_text(
        self, oracle: list[str], step: int, frame: A.Frame, marks: Sequence[Any] | None = None
    ) -> str:
        """The UI-TARS text of turn `step` (the oracle's step, or finished() after it); with
        set-of-marks `marks`, a click inside a mark names the mark (`click(mark=N)`)."""
        if step >= len(oracle):
            return A.format_response(DONE_THOUGHT, [A.Finished()], frame)
        acts = [by_mark(a, marks) for a in oracle_to_actions(oracle[step], self.scroll_clicks)]
        return A.format_response(self.thought, acts, frame)


class _OracleEpisode:
    def __init__(self, policy: OraclePolicy, oracle: list[str]) -> None:
        self.policy = policy
        self.oracle = oracle
        self.step = 0
        self.seen: Any = None
        """The turn's observation (`arpo.actor.episode.Observation`, shown by `observe`)."""

    def observe(self, observation: Any) -> None:
        """The turn's observation: its coordinate frame and (som) its marks."""
        self.seen = observation

    async def generate(
        self, token_ids: Any, images: Sequence[Any] = (), params: SamplingParams | None = None
    ) -> Completion:
        p = self.policy
        frame = turn_frame(self.seen, images, p.image_rule, "the oracle")
        marks = getattr(self.seen, "marks", None)
        text = p.response_text(self.oracle, self.step, frame, marks)
        self.step += 1
        body = list(p.tokenizer.encode(p.family.response_lead() + text, add_special_tokens=False))
        ids = np.asarray([*body, p.end_id], dtype=np.int32)
        # The text the actor parses is the decoded ids, as an engine would return it.
        decoded = p.tokenizer.decode(body, skip_special_tokens=True)
        return Completion(ids, np.zeros(len(ids), np.float32), decoded, "stop", 0)


def _screen(tasks: Sequence[dict[str, Any]]) -> tuple[int, int]:
    for t in tasks:
        for step in t.get("config") or []:
            if step.get("type") == "sim_scene" and step.get("parameters", {}).get("screen"):
                w, h = step["parameters"]["screen"]
                return int(w), int(h)
    return 1280, 720


async def run_on_envs(
    tasks: Sequence[dict[str, Any]],
    policy: Any,
    episode: EpisodeConfig,
    envs: Sequence[Environment],
    *,
    actor_id: str = "offline",
) -> list[Trajectory | None]:
    """Run one episode per task (in order of `tasks`) on `envs`, one task at a time each;
    returns the trajectories (None where the policy failed). The caller closes `envs`."""
    results: list[Trajectory | None] = [None] * len(tasks)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(tasks)):
        queue.put_nowait(i)

    async def worker(env: Environment) -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            task = tasks[i]
            grant = wire.Grant(
                grant_id=uuid.uuid4().hex,
                task_id=str(task["id"]),
                group=str(task["id"]),
                slot=0,
                version=0,
                task_json=json.dumps(task),
            )
            results[i] = await run_episode(env, grant, policy, episode, actor_id=actor_id)

    await asyncio.gather(*(worker(e) for e in envs))
    return results


async def run_on_sim(
    tasks: Sequence[dict[str, Any]],
    policy: Any,
    episode: EpisodeConfig,
    *,
    n_envs: int = 2,
    actor_id: str = "offline",
    environment: EnvironmentConfig | None = None,
) -> list[Trajectory | None]:
    """`run_on_envs` on `n_envs` simulated desktops served in this process, set up as
    `environment` says (default: `EnvironmentConfig()`)."""
    from arpo_envs.sim.server import SimConfig, running

    w, h = _screen(tasks)
    n = max(1, min(n_envs, len(tasks)))
    runner = RunnerConfig(sleep_scale=0.0, wait_seconds=0.0)
    async with running([SimConfig(port=0, width=w, height=h) for _ in range(n)]) as urls:
        envs = [Environment(i, url, runner, config=environment) for i, url in enumerate(urls)]
        try:
            return await run_on_envs(tasks, policy, episode, envs, actor_id=actor_id)
        finally:
            for e in envs:
                await e.close()


@dataclass(frozen=True)
class LocalDesktops:
    """Local desktops (`arpo-envs up`) to run the episodes of local tasks on (LibreOffice,
    the editor, the shell: `envs/arpo_envs/tasks/local`), started for the call and stopped
    after it."""

    n: int
    """How many desktops (at most one per task)."""
    files: TaskFiles
    """The files the tasks name by content: the index `load_pool(path, files)` filled."""
    atspi: bool = False
    """The desktops serve their applications' accessibility trees (`arpo-envs up --atspi`:
    the tree som marks are made from; without it only the desktop's own windows)."""


async def run_on_desktops(
    tasks: Sequence[dict[str, Any]],
    policy: Any,
    episode: EpisodeConfig,
    local: LocalDesktops,
    *,
    actor_id: str = "offline",
    environment: EnvironmentConfig | None = None,
) -> list[Trajectory | None]:
    """`run_on_envs` on `local.n` real local desktops started here (each reverted with its
    `/reset` before a task's setup, its task files fetched by content from `local.files`,
    its checkers run as an actor's are), stopped when the episodes are done."""
    import tempfile

    from arpo.env.bringup import Bringup
    from arpo.env.osworld.client import EvaluatorConfig, OSWorldEvaluator
    from arpo.env.taskfiles import BlobCache, FileSource

    n = max(1, min(local.n, len(tasks)))
    with tempfile.TemporaryDirectory(prefix="arpo-demos-") as tmp, Bringup(tmp) as up:
        specs = await asyncio.to_thread(up.start_desktops, n, atspi=local.atspi)
        osworld = OSWorldEvaluator(EvaluatorConfig(workers=min(n, 2)))
        files = FileSource.local(local.files, BlobCache(Path(tmp) / "task-files"))
        envs = [s.environment(i, files, osworld, config=environment) for i, s in enumerate(specs)]
        try:
            return await run_on_envs(tasks, policy, episode, envs, actor_id=actor_id)
        finally:
            for e in envs:
                await e.close()
            await osworld.aclose()


async def _run(
    tasks: Sequence[dict[str, Any]],
    policy: Any,
    episode: EpisodeConfig,
    n_envs: int,
    local: LocalDesktops | None,
    *,
    actor_id: str,
) -> list[Trajectory | None]:
    """The episodes of `record_demos` and `evaluate_greedy`: on the local desktops of
    `local`, else on `n_envs` simulated ones; a failed setup is tried again twice."""
    environment = EnvironmentConfig(reset_retries=2)
    if local is not None:
        return await run_on_desktops(tasks, policy, episode, local, actor_id=actor_id,
                                     environment=environment)  # fmt: skip
    return await run_on_sim(tasks, policy, episode, n_envs=n_envs, actor_id=actor_id,
                            environment=environment)  # fmt: skip


def _greedy_episode(**fields: Any) -> EpisodeConfig:
    """The greedy episode settings of `record_demos` and `evaluate_greedy`, validated, so a
    bad value fails here naming the field instead of deep in an episode."""
    cfg = EpisodeConfig(temperature=0.0, **fields)
    cfg.validate()
    return cfg


def record_demos(
    tasks: Sequence[dict[str, Any]],
    model: str | Path | Any,
    *,
    n_envs: int = 2,
    max_steps: int = 15,
    max_new_tokens: int = 0,
    observation_type: str = "screenshot",
    marks_source: str = "tree",
    a11y_max_tokens: int = A11Y_MAX_TOKENS,
    history_images: int = HISTORY_IMAGES,
    local: LocalDesktops | None = None,
) -> tuple[list[Trajectory], dict[str, Any]]:
    """Record one oracle demonstration per task (see the module docstring), each turn's
    prompt showing `observation_type` (`EpisodeConfig.observation_type`; with `som` the
    oracle's clicks name the mark that holds them, marks made by `marks_source`,
    `EpisodeConfig.marks_source`; tables cut to `a11y_max_tokens`, at most `history_images`
    observations in the context: the actors' episode settings and their defaults), on
    `n_envs` simulated desktops, or with `local` on local desktops started for it
    (`LocalDesktops`: the pool's tasks are local ones).

    `model` is a model folder (its processor is loaded) or a loaded `AutoProcessor`.
    `max_steps` is the episode's step budget (0: fitted to each task, `step_budget`);
    `max_new_tokens` the longest response the policy may sample (0: no bound). Returns the
    demonstrations scored 1 and a report: counts (tasks, kept, and one count per reason a
    demonstration was dropped: no_oracle, oracle_too_long (more turns than the step budget),
    response_too_long (a response longer than max_new_tokens: the policy could never sample
    it whole), failed (checker score below 1), not_ok (env / eval errors), policy_failed),
    `dropped` (reason -> the task ids), `longest_response` (tokens, with <|im_end|>) and
    `longest_episode` (turns) of the kept ones. Every reason is logged with its tasks; a
    pool of which nothing is kept raises ArpoError naming the field to change."""
    if isinstance(model, str | Path):
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(str(model))
    else:
        processor = model
    counts: collections.Counter[str] = collections.Counter(tasks=len(tasks))
    dropped: dict[str, list[str]] = collections.defaultdict(list)

    def drop(reason: str, task: dict[str, Any]) -> None:
        counts[reason] += 1
        dropped[reason].append(str(task.get("id")))

    usable = []
    need = 0
    for t in tasks:
        oracle = t.get("oracle")
        if not oracle:
            drop("no_oracle", t)
            continue
        need = max(need, len(oracle) + 1)
        if len(oracle) + 1 > step_budget(t, max_steps):
            drop("oracle_too_long", t)
            continue
        usable.append(t)
    policy = OraclePolicy(processor)
    cfg = _greedy_episode(
        max_steps=max_steps, observation_type=observation_type, marks_source=marks_source,
        a11y_max_tokens=a11y_max_tokens, history_images=history_images,
    )  # fmt: skip
    trajs = asyncio.run(_run(usable, policy, cfg, n_envs, local, actor_id="oracle-demos"))
    kept: list[Trajectory] = []
    longest = 0
    for task, traj in zip(usable, trajs, strict=True):
        if traj is None:
            drop("policy_failed", task)
        elif traj.status != Status.OK:
            drop("not_ok", task)
        elif traj.checker_score < 1.0:
            drop("failed", task)
        elif max_new_tokens and max(len(t.response_ids) for t in traj.turns) > max_new_tokens:
            longest = max(longest, max(len(t.response_ids) for t in traj.turns))
            drop("response_too_long", task)
        else:
            kept.append(traj)
    counts["kept"] = len(kept)
    report: dict[str, Any] = dict(counts)
    report["dropped"] = dict(dropped)
    report["longest_response"] = max(
        (len(t.response_ids) for d in kept for t in d.turns), default=0
    )
    report["longest_episode"] = max((d.steps for d in kept), default=0)
    why = {
        "no_oracle": "the task has no oracle",
        "oracle_too_long": f"the oracle needs more turns than the step budget (max_steps "
        f"{max_steps}; the longest needs {need} with finished())",
        "response_too_long": f"a response is longer than max_new_tokens {max_new_tokens} "
        f"(the longest: {longest} tokens)",
        "failed": "the checker scored the oracle below 1",
        "not_ok": "an environment or checker error",
        "policy_failed": "the oracle policy failed",
    }
    for reason, ids in dropped.items():
        log.warning(
            "demonstrations dropped (%s): %d of %d: %s%s",
            why[reason], len(ids), len(tasks), ", ".join(ids[:5]), " ..." if len(ids) > 5 else "",
        )  # fmt: skip
    if tasks and not kept:
        fixes = []
        if counts["oracle_too_long"]:
            fixes.append(
                f"raise max_steps to at least {need} or set it to 0 to fit every task (at most "
                f"{MAX_STEPS}); in arpo train the field is actor.episode.max_steps"
            )
        if counts["response_too_long"]:
            fixes.append(
                f"raise max_new_tokens to at least {longest}; in arpo train the field is "
                "actor.episode.max_new_tokens (0 fits the demonstrations)"
            )
        if not fixes:
            fixes.append("check the tasks' oracles and the desktop's screen size")
        raise ArpoError(
            f"no oracle demonstration of {len(tasks)} tasks is usable "
            f"({', '.join(f'{k}: {v}' for k, v in counts.items() if k != 'tasks')}): "
            + "; ".join(fixes)
        )
    return kept, report


def evaluate_greedy(
    model: str | Path,
    tasks: Sequence[dict[str, Any]],
    *,
    n_envs: int = 2,
    max_steps: int = 15,
    max_new_tokens: int = 64,
    device: str = "cpu",
    observation_type: str = "screenshot",
    marks_source: str = "tree",
    a11y_max_tokens: int = A11Y_MAX_TOKENS,
    history_images: int = HISTORY_IMAGES,
    local: LocalDesktops | None = None,
) -> dict[str, float]:
    """Greedy episodes of the model on every task (the real engine, parser and checker),
    showing it `observation_type` (with `som`, marks made by `marks_source`; tables and
    context bounded as in `record_demos`); on `n_envs` simulated desktops, or with `local`
    on local desktops started for it.

    Returns success_rate (checker score 1 among ok episodes), score_mean, parsed_rate (of
    all turns), steps_mean, episodes, not_ok."""
    from arpo.policy.engine import EngineConfig
    from arpo.policy.engine_hf import HFEngine

    cfg = _greedy_episode(
        max_steps=max_steps, max_new_tokens=max_new_tokens, observation_type=observation_type,
        marks_source=marks_source, a11y_max_tokens=a11y_max_tokens,
        history_images=history_images,
    )  # fmt: skip

    async def go() -> list[Trajectory | None]:
        engine = HFEngine(
            EngineConfig(model=str(model), device=device, max_batch_size=max(1, n_envs))
        )
        async with engine:
            return await _run(tasks, engine, cfg, n_envs, local, actor_id="offline-eval")

    trajs = asyncio.run(go())
    ok = [t for t in trajs if t is not None and t.status == Status.OK]
    turns = [turn for t in ok for turn in t.turns]
    n = len(ok)
    return {
        "episodes": float(len(trajs)),
        "not_ok": float(len(trajs) - n),
        "success_rate": sum(t.checker_score >= 1.0 for t in ok) / n if n else float("nan"),
        "score_mean": sum(t.checker_score for t in ok) / n if n else float("nan"),
        "parsed_rate": sum(t.parsed for t in turns) / len(turns) if turns else float("nan"),
        "steps_mean": sum(t.steps for t in ok) / n if n else float("nan"),
    }


def score_demos(
    demos: Sequence[Trajectory],
    model: str | Path,
    *,
    temperature: float,
    top_p: float = 1.0,
    device: str = "cpu",
) -> list[Trajectory]:
    """The demonstrations as if `model` had sampled them at `temperature`, `top_p`: every
    response token's behaviour log-prob is the model's (teacher-forced, one forward pass per
    demonstration, the learner's own scoring code), and every turn carries those sampling
    settings. The learner can then replay them as off-policy successes: their importance
    weight pi_now / pi_model corrects for how far the policy has moved from `model`.
    Only top_p = 1 is supported (a nucleus would need the token's rank under the model)."""
    from dataclasses import replace

    from arpo.learner.batch import build_sequence
    from arpo.learner.trainer import Trainer, TrainerConfig

    if top_p != 1.0:
        raise ArpoError(f"scoring demonstrations needs top_p = 1, got {top_p}")
    trainer = Trainer(TrainerConfig(model=str(model), device=device, temperature=temperature))
    out: list[Trajectory] = []
    for d in demos:
        item = store_item.to_item(d)
        (lp,) = trainer.proximal([build_sequence(item, trainer.processor, trainer.image_token_id)])
        lp = lp.numpy().astype(np.float32)
        turns, pos = [], 0
        for t in d.turns:
            n = len(t.response_ids)
            turns.append(
                replace(t, logprobs=lp[pos : pos + n], temperature=temperature, top_p=top_p)
            )
            pos += n
        out.append(replace(d, turns=tuple(turns), trajectory_id=uuid.uuid4().hex))
    return out

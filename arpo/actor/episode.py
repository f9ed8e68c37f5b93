"""One episode on one environment: setup, screenshot -> prompt -> engine -> parse -> execute, evaluate.

    env = Environment(0, "http://127.0.0.1:5000", runner_config)
    traj = await run_episode(env, grant, policy, EpisodeConfig(), actor_id="actor-0")

The loop (the ARPO reference's, asynchronous per environment):

1. reset + the task's setup steps (`Environment.prepare`, arpo.env.environment); a failed
   reset is the environment's fault (retried with capped backoff,
   `EnvironmentConfig.reset_retries`; then the environment is unhealthy and the episode is
   `env_error` with no turns), a failed setup on an environment that reset fine the
   task's (`setup_error`, the reason in `Trajectory.error`: the learner takes a task whose
   setup keeps failing out of the run);
2. up to `step_budget(task, max_steps)` turns (`max_steps`, or fitted to the task's
   oracle): the observation (`observe`: the screenshot, the accessibility table, or
   both, or the set-of-marks from the tree or from OCR of the screenshot, as
   `observation_type` and `marks_source` say), the turn's prompt ids
   (`EpisodePrompt`), one
   sampled response (token ids + behaviour log-probs + the policy version that
   produced them + the temperature and top_p they were drawn with: the grant's when it
   carries them, else `EpisodeConfig`'s), parse (`try_parse_response`), execute the
   commands; the episode ends on DONE / FAIL, at the step limit, or on a parse failure
   (format reward -1; a response holding an <|image_pad|> token counts as one, since no
   next prompt can hold it), unless `on_parse_failure = "continue"`: then that turn does
   nothing and the next one starts;
3. evaluate with the task's checker; reward = checker score + `format_weight` * format
   reward.

Environment faults are not agent failures: a screenshot or an action that fails gives
status `env_error`, a checker that cannot run `eval_error` (from the runner); such
trajectories are delivered but not trained on. A policy failure (engine error) is not
the environment's fault either: the episode is abandoned (returns None) and the grant
expires on the learner side.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from arpo import wire
from arpo.config import (
    MAX_TEMPERATURE,
    check_on_build,
    check_range,
    check_seconds,
    fail,
    option,
)
from arpo.env import a11y, ocr
from arpo.env.environment import Environment
from arpo.env.ocr import OcrConfig
from arpo.env.task import Task
from arpo.errors import EnvError, TaskError
from arpo.policy import actions as A
from arpo.policy.engine import Completion, SamplingParams
from arpo.policy.family import ImageRule
from arpo.policy.prompt import EpisodePrompt, image_size
from arpo.record import MARKS_SOURCES, OBSERVATION_TYPES, Branch, Status, Trajectory, Turn

log = logging.getLogger("arpo.actor.episode")


A11Y_MAX_TOKENS = 1280
"""`EpisodeConfig.a11y_max_tokens`'s default (`arpo sft` records and evaluates with it too)."""
HISTORY_IMAGES = 15
"""`EpisodeConfig.history_images`'s default (the reference's: every screenshot of a 15-step
episode kept)."""
PROMPT_FIELDS = ("observation_type", "marks_source", "a11y_max_tokens", "history_images")
"""The `EpisodeConfig` fields that decide what a prompt shows: a warm start recorded with
other values learned on prompts the run never shows (`arpo train` compares them)."""


class EpisodePolicy(Protocol):
    async def generate(
        self, token_ids: Any, images: Sequence[Any] = (), params: SamplingParams | None = None
    ) -> Completion: ...


@dataclass
class EpisodeConfig:
    """How one episode runs."""

    max_steps: int = option(
        15,
        "Turns per episode (the reference's 15). 0: fit each task: a task that carries an "
        "oracle (the simulated and local desktop tasks) gets its oracle's length + "
        "STEP_SLACK turns (finished() and two more), at most MAX_STEPS (15); any other "
        "task MAX_STEPS. `arpo train` uses 0.",
    )
    observation_type: Literal["screenshot", "a11y_tree", "screenshot_a11y_tree", "som"] = option(
        "screenshot",
        "What the model is shown each turn, as OSWorld's run.py names it: 'screenshot' (the "
        "reference's, UI-TARS's); 'a11y_tree' the accessibility tree linearised to a table "
        "(tag, name, text, position, size of the visible elements) instead of the image; "
        "'screenshot_a11y_tree' both; 'som' the screenshot with numbered marks drawn on the "
        "elements and the table of the marks, and click(mark=N) in the action grammar. With "
        "a table the model's coordinates are screen pixels (the table's unit); with the "
        "screenshot alone, pixels of the resized image (UI-TARS's).",
    )
    marks_source: Literal["tree", "ocr", "auto"] = option(
        "tree",
        "Where som's marks come from (observation_type 'som' only): 'tree' the accessibility "
        "tree's elements (OSWorld's); 'ocr' the text read from the screenshot "
        "(`arpo.env.ocr`: each text element a mark, 0.5 to 5 s a 1280x720 screen on two "
        "cores), for screens without a tree; 'auto' the tree, and OCR on a screen whose "
        "tree gives no mark. Each turn's record says which one made its table "
        "(`Turn.marks_source`).",
    )
    ocr: OcrConfig = option(
        OcrConfig(), "How marks are read from pixels when marks_source is 'ocr' or 'auto'."
    )
    a11y_max_tokens: int = option(
        A11Y_MAX_TOKENS,
        "Tokens (the policy's tokenizer's) each turn's table is cut to, '[...]' marking the "
        "cut (OSWorld's a11y_tree_max_tokens, 10,000 there for 128k-context models). The "
        "learner trains a whole episode as one sequence, so the default keeps 15 turns of "
        "table + screenshot + a max_new_tokens response inside the tiny model's 32,768 "
        "positions; the simulated desktop's tables are 150-1,020 tokens (1..MAX_A11Y_TOKENS).",
    )
    history_images: int = option(
        HISTORY_IMAGES,
        "Observations (screenshots and / or tables) kept in the model's context; older "
        "turns keep their responses (1..MAX_STEPS_LIMIT).",
    )
    temperature: float = option(
        1.0,
        "Sampling temperature of episodes whose grant carries none (pool runs); a training "
        "learner's grants carry its trainer.temperature, which wins (0..MAX_TEMPERATURE).",
    )
    top_p: float = option(
        1.0, "Nucleus of episodes whose grant carries none; a learner's grants carry theirs."
    )
    max_new_tokens: int = option(512, "Longest response per turn.")
    format_weight: float = option(
        0.5,
        "reward = checker score + format_weight * format reward (0..MAX_FORMAT_WEIGHT).",
    )
    on_parse_failure: Literal["end", "continue"] = option(
        "end",
        "A response that does not parse: 'end' ends the episode (the reference); 'continue' "
        "costs only that turn: nothing is executed, the response stays in the context as "
        "sampled and the next turn starts from a new screenshot (the step budget still "
        "counts it). Either way the format reward is -1.",
    )
    scroll_clicks: int = option(
        5, "Wheel clicks per scroll action (the reference's 5; 1..MAX_SCROLL_CLICKS)."
    )
    step_timeout_s: float = option(
        600.0, "Longest policy call plus action of one turn (> 0, at most a week)."
    )

    def __post_init__(self) -> None:
        check_on_build(self)

    @property
    def needs_tree(self) -> bool:
        """The observation shows the accessibility tree or marks made from it, so local
        desktops must serve their apps' AT-SPI trees (`arpo-envs up --atspi`); set-of-marks
        read from pixels alone (marks_source 'ocr') needs none."""
        return self.observation_type != "screenshot" and not (
            self.observation_type == "som" and self.marks_source == "ocr"
        )

    def validate(self) -> None:
        if not 0 <= self.max_steps <= MAX_STEPS_LIMIT:
            fail("max_steps", f"must be in [1, {MAX_STEPS_LIMIT}], or 0 to fit each task's oracle")
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            fail(
                "max_new_tokens",
                f"must be in [1, {MAX_NEW_TOKENS_LIMIT}] (tokens of one response; the "
                "paper's agent writes about 100)",
            )
        if self.observation_type not in OBSERVATION_TYPES:
            fail("observation_type", f"must be one of {', '.join(OBSERVATION_TYPES)}")
        if self.marks_source not in (*MARKS_SOURCES, "auto"):
            fail("marks_source", f"must be one of {', '.join(MARKS_SOURCES)} or auto")
        if self.marks_source != "tree" and self.observation_type != "som":
            fail(
                "marks_source",
                f"is {self.marks_source!r} but only the som observation has marks "
                f"(observation_type is {self.observation_type!r}): set observation_type=som, "
                "or leave marks_source at 'tree'",
            )
        check_range(
            "a11y_max_tokens", self.a11y_max_tokens, 1, MAX_A11Y_TOKENS, "tokens of one table"
        )
        check_range("temperature", self.temperature, 0, MAX_TEMPERATURE, "0: greedy")
        check_range("top_p", self.top_p, 0, 1, "the nucleus", lo_open=True)
        check_range(
            "history_images", self.history_images, 1, MAX_STEPS_LIMIT, "screenshots in the context"
        )
        check_range(
            "format_weight",
            self.format_weight,
            0,
            MAX_FORMAT_WEIGHT,
            "weight of the format reward beside a checker score in [0, 1]",
        )
        check_range(
            "scroll_clicks",
            self.scroll_clicks,
            1,
            MAX_SCROLL_CLICKS,
            "wheel clicks per scroll; the direction gives the sign",
        )
        check_seconds("step_timeout_s", self.step_timeout_s, "one policy call plus its action")


MAX_STEPS_LIMIT = 1000
"""Largest `max_steps` accepted (OSWorld's own runs go to 100)."""
MAX_NEW_TOKENS_LIMIT = 1 << 17
"""Largest `max_new_tokens` accepted (a long-context model's whole window)."""
MAX_A11Y_TOKENS = 1 << 17
"""Largest `a11y_max_tokens` accepted (a long-context model's whole window)."""
MAX_FORMAT_WEIGHT = 100.0
"""Largest `format_weight`: checker scores are in [0, 1], so beyond 100 the format reward
is all a group's advantages see (and 1e308 overflows them to inf)."""
MAX_SCROLL_CLICKS = 100
"""Most wheel clicks in one scroll action: 100 clicks move about 300 lines (3 a click on
common desktops), more than any window shows; beyond it every scroll jumps to an end."""
MAX_STEPS = 15
"""The reference's step budget: the most turns a fitted budget (max_steps = 0) gives."""
STEP_SLACK = 3
"""Turns a fitted budget adds to the oracle's steps: finished(), and two to recover from a
misstep (a click beside its target, a field typed twice)."""


def step_budget(task: Task | dict[str, Any], max_steps: int) -> int:
    """Turns of an episode of `task`: `max_steps`, or when it is 0 the task's oracle length +
    STEP_SLACK, at most MAX_STEPS (MAX_STEPS for a task without an oracle)."""
    if max_steps:
        return max_steps
    extra = task.get("oracle") if isinstance(task, dict) else task.extra.get("oracle")
    if isinstance(extra, list) and extra:
        return min(MAX_STEPS, len(extra) + STEP_SLACK)
    return MAX_STEPS


@functools.lru_cache(maxsize=4)
def _saved_processor(model: str) -> Any:
    """The image processor and tokenizer saved with `model` (loaded once per process)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model)


def _prompt_for(
    policy: Any, instruction: str, cfg: EpisodeConfig
) -> tuple[EpisodePrompt, ImageRule]:
    """The episode's prompt builder (showing `cfg.observation_type`) and the image rule of
    the model's family and processor (`arpo.policy.family`): the policy's own processor
    (transformers engine), its `image_rule` (or Qwen2.5-VL's rule with its `min_pixels` /
    `max_pixels`) and `tokenizer` (a scripted policy, Qwen2.5-VL's chat), else the processor saved with its model (`config.model` of the vLLM and
    OpenAI-compatible engines, which keep none in the actor).

    The image budget has one source, the processor saved with the model
    (`preprocessor_config.json`: `min_pixels` / `max_pixels`, as Qwen2.5-VL and UI-TARS ship
    it): the engines (transformers, vLLM, a vLLM server) and the learner load the same
    folder, so the image-token counts of the actor's prompts are the ones the learner's
    processor gives (`arpo.learner.batch` refuses a trajectory where they differ). To change
    it, save the model with other bounds (`arpo-tiny-model --min-pixels/--max-pixels`, or
    edit the file); `play` logs the budget and the image tokens per screenshot once."""
    processor = getattr(policy, "processor", None)
    if (
        processor is None
        and not hasattr(policy, "image_rule")
        and not hasattr(policy, "min_pixels")
    ):
        model = getattr(getattr(policy, "config", None), "model", "")
        if model:
            processor = _saved_processor(str(model))
    if processor is not None:
        prompt = EpisodePrompt.from_processor(
            processor, instruction, history_images=cfg.history_images,
            observation_type=cfg.observation_type,
        )  # fmt: skip
    else:
        rule = getattr(policy, "image_rule", None) or ImageRule(
            "grid", A.IMAGE_FACTOR, policy.min_pixels, policy.max_pixels
        )
        prompt = EpisodePrompt(
            policy.tokenizer, instruction, rule=rule,
            history_images=cfg.history_images, observation_type=cfg.observation_type,
        )  # fmt: skip
    return prompt, prompt.rule


@dataclass
class EpisodeRun:
    """An episode in progress: what `play` advances and a fork copies (`branch`)."""

    task: Task
    prompt: EpisodePrompt
    policy: Any
    """The policy of this episode (`policy.episode(task)` for a policy with per-episode
    state, else the policy itself)."""
    params: SamplingParams
    action_cfg: A.ActionConfig
    rule: ImageRule
    """How the model's image processor shows a screenshot (its family's rule and budget)."""
    budget: int
    """Most turns (`step_budget`)."""
    turns: list[Turn] = field(default_factory=list)
    fmt: float = 0.0
    """The format reward: -1 once a response did not parse."""
    frame: A.Frame | None = None
    ended: bool = False
    """DONE / FAIL, or a response that ends the episode."""
    timings: dict[str, float] = field(
        default_factory=lambda: {"reset": 0.0, "policy": 0.0, "env": 0.0, "evaluate": 0.0}
    )

    @property
    def over(self) -> bool:
        return self.ended or len(self.turns) >= self.budget

    def branch(self, child: int) -> EpisodeRun:
        """A copy that continues on its own from here (a fork's child `child`): the turns
        so far are shared (they no longer change), the prompt and the policy's own
        episode state are copied (`branch(child)` of each, when the policy has one)."""
        pol = self.policy.branch(child) if hasattr(self.policy, "branch") else self.policy
        return dataclasses.replace(
            self, prompt=self.prompt.branch(), policy=pol, turns=list(self.turns),
            timings=dict(self.timings),
        )  # fmt: skip


def start_run(task: Task, grant: wire.Grant, policy: Any, cfg: EpisodeConfig) -> EpisodeRun:
    """A new episode of `task` with the grant's sampling settings (else `cfg`'s)."""
    episode = policy.episode(task) if hasattr(policy, "episode") else policy
    prompt, rule = _prompt_for(policy, task.instruction, cfg)
    params = SamplingParams(
        temperature=cfg.temperature if grant.temperature is None else grant.temperature,
        top_p=cfg.top_p if grant.top_p is None else grant.top_p,
        max_new_tokens=cfg.max_new_tokens,
    )
    return EpisodeRun(
        task, prompt, episode, params, A.ActionConfig(scroll_clicks=cfg.scroll_clicks),
        rule, step_budget(task, cfg.max_steps),
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Observation:
    """What one turn shows the model (`observe`)."""

    screenshot: bytes | None
    """The PNG shown (for som with the marks drawn on it); None: the turn shows none."""
    table: str | None
    """The accessibility table (som: the mark table), cut to `a11y_max_tokens`; None for
    `screenshot`."""
    marks: tuple[a11y.Mark, ...] | None
    """som: the marks drawn, numbered from 1 (None for the other types)."""
    frame: A.Frame
    """How the model's coordinates map to the screen: the resized image's pixels for
    `screenshot` (UI-TARS's), the screen's own pixels with a table (the table's unit)."""
    marks_source: str = ""
    """som: what made the marks, "tree" or "ocr" (`EpisodeConfig.marks_source`); "" for the
    other types."""

    @property
    def points(self) -> dict[int, A.Point] | None:
        """Each mark's index -> the screen point `click(mark=N)` clicks: its box's centre,
        where OSWorld's `tag_N` points."""
        if self.marks is None:
            return None
        return {m.index: A.Point(*m.center) for m in self.marks}


_reported_budgets: set[tuple[Any, ...]] = set()


def _frame(run: EpisodeRun, kind: str, screen: tuple[int, int]) -> A.Frame:
    """The episode's coordinate frame (made at its first turn), logged once per process for
    each (observation type, screen, image budget)."""
    if run.frame is not None:
        return run.frame
    (w, h), rule = screen, run.rule
    if kind == "screenshot":
        run.frame = A.Frame.shown(w, h, rule)
    else:
        run.frame = A.Frame(w, h, w, h)
    key = (kind, w, h, rule)
    if key not in _reported_budgets:
        _reported_budgets.add(key)
        if kind == "a11y_tree":
            shown = "no screenshot in the prompt"
        else:
            iw, ih = rule.shown_size(w, h)
            shown = f"a {w}x{h} screenshot is shown at {iw}x{ih}, {rule.tokens(w, h)} image tokens"
        log.info(
            "observation %s; image budget %s (the model's saved processor): %s",
            kind, rule.describe(), shown,
        )  # fmt: skip
    return run.frame


async def observe(env: Environment, run: EpisodeRun, cfg: EpisodeConfig) -> Observation:
    """The turn's observation of type `run.prompt.observation_type`: the screenshot, then (as
    OSWorld takes them, in that order) the accessibility tree, linearised and filtered
    (`arpo.env.a11y`; som: marks chosen and drawn on a copy of the screenshot), cut to
    `cfg.a11y_max_tokens` of the policy's tokens. With som, `cfg.marks_source` says where
    the marks come from: the tree; OCR of the screenshot (`arpo.env.ocr`, no tree asked
    for); or the tree, and OCR when it gives no mark ('auto'). EnvError when the
    environment fails, sends a tree no environment sends (`EnvProtocolError`), or OCR
    takes longer than `cfg.ocr.timeout_s` (`EnvTimeout`). Time spent waiting on the
    environment goes to `timings["env"]`; building the table and drawing the marks (in a
    worker thread: tens of ms for a 1280x720 som from the tree, 0.5 to 5 s from OCR) to
    `timings["observe"]`."""
    kind, timings = run.prompt.observation_type, run.timings
    source = cfg.marks_source if kind == "som" else "tree"
    t0 = time.perf_counter()
    png = xml = None
    if kind != "a11y_tree":
        png = await env.timed(env.client.screenshot())
    if kind != "screenshot" and source != "ocr":
        xml = await env.timed(env.client.accessibility())
    if png is not None:
        screen = image_size(png)
    elif run.frame is not None:
        screen = run.frame.screen_w, run.frame.screen_h
    else:  # a11y_tree: the screen's size, once (the frame of the table's positions)
        screen = await env.timed(env.client.screen_size())
    timings["env"] += time.perf_counter() - t0
    frame = _frame(run, kind, screen)
    if kind == "screenshot":
        return Observation(png, None, None, frame)

    t0 = time.perf_counter()
    marks, made_by = None, ""
    if kind == "som":
        assert png is not None
        som = None
        if xml is not None:
            som = await asyncio.to_thread(a11y.set_of_marks, xml, png)
            made_by = "tree"
        if som is None or (source == "auto" and not som.marks):
            som = await ocr.read_set_of_marks(png, cfg.ocr)
            made_by = "ocr"
        png, table, marks = som.screenshot, som.table, som.marks
    else:
        assert xml is not None
        table = await asyncio.to_thread(a11y.linearize, xml)
    table = a11y.trim(table, run.prompt.tokenizer, cfg.a11y_max_tokens)
    timings["observe"] = timings.get("observe", 0.0) + time.perf_counter() - t0
    return Observation(png, table, marks, frame, made_by)


async def play(
    env: Environment,
    run: EpisodeRun,
    cfg: EpisodeConfig,
    until: int,
    *,
    grant_id: str,
    on_step: Any = None,
) -> None:
    """Advance `run` on `env` until it has `until` turns or is over. EnvError when the
    environment fails; any other exception is the policy's failure.

    A policy with an `observe(observation)` method (the scripted oracle) is shown each
    turn's `Observation` before it is asked; the engines have none."""
    prompt, timings = run.prompt, run.timings
    while not run.over and len(run.turns) < until:
        obs = await observe(env, run, cfg)
        prompt_ids = prompt.add_observation(obs.screenshot, obs.table)
        ids, images = prompt.model_input()
        if hasattr(run.policy, "observe"):
            run.policy.observe(obs)
        t0 = time.perf_counter()
        async with asyncio.timeout(cfg.step_timeout_s):
            comp = await run.policy.generate(ids, images, run.params)
        timings["policy"] += time.perf_counter() - t0
        response = np.asarray(comp.token_ids, np.int32)
        if (response == prompt.image_pad).any():
            # The next turn's prompt would hold an image placeholder without a
            # screenshot (no engine can run it, no learner can train it): the episode
            # ends here as on any unparsable response.
            log.warning(
                "grant %s: the response holds an image placeholder; ended as a parse failure",
                grant_id,
            )
            parsed = A.ParsedResponse(
                text=comp.text, parsed=False, error="the response holds an image placeholder"
            )
        else:
            parsed = A.try_parse_response(
                comp.text, obs.frame, config=run.action_cfg, marks=obs.points
            )
        run.turns.append(
            Turn(
                prompt_ids=prompt_ids,
                screenshot=obs.screenshot or b"",
                response_ids=response,
                logprobs=np.asarray(comp.logprobs, np.float32),
                policy_version=int(comp.policy_version),
                action=parsed.action,
                parsed=parsed.parsed,
                temperature=run.params.temperature,
                top_p=run.params.top_p,
                marks_source=obs.marks_source,
            )
        )
        if on_step is not None:
            on_step()
        if not parsed.parsed or len(response) == 0:
            run.fmt = -1.0
            # An empty response or one holding <|image_pad|> cannot go into the context.
            if (
                cfg.on_parse_failure == "end"
                or len(response) == 0
                or (response == prompt.image_pad).any()
            ):
                run.ended = True
                return
            prompt.add_response(response)
            continue
        prompt.add_response(response)
        t0 = time.perf_counter()
        for i, cmd in enumerate(parsed.commands):
            if i:
                await env.runner.between_actions()
            await env.timed(env.runner.act(cmd))
            run.ended = cmd in (A.DONE, A.FAIL)
        timings["env"] += time.perf_counter() - t0


async def conclude(env: Environment, run: EpisodeRun) -> tuple[Status, float, str]:
    """Check the finished episode on `env`: (status, checker score, error)."""
    t0 = time.perf_counter()
    try:
        result = await env.evaluate(run.task)
    except EnvError as e:
        log.warning("env %d: evaluation failed: %s", env.index, e)
        return Status.ENV_ERROR, 0.0, f"evaluate: {type(e).__name__}: {e}"
    except Exception as e:
        log.exception("task %s: the checker failed", run.task.id)
        return Status.EVAL_ERROR, 0.0, f"checker: {type(e).__name__}: {e}"
    finally:
        run.timings["evaluate"] += time.perf_counter() - t0
    status = (
        Status(result.status) if result.status in Status._value2member_map_ else Status.EVAL_ERROR
    )
    if status != Status.OK:
        log.warning(
            "env %d: task %s is %s: %s", env.index, run.task.id, status.value, result.error or "?"
        )
    return status, result.score, result.error or ""


def trajectory(
    grant: wire.Grant,
    turns: Sequence[Turn],
    score: float,
    fmt: float,
    status: Status,
    cfg: EpisodeConfig,
    *,
    actor_id: str,
    env: str,
    timings: dict[str, float],
    error: str = "",
    slot: int | None = None,
    branch: Branch | None = None,
) -> Trajectory:
    """The record of a finished episode of `grant` (slot `slot`, default the grant's)."""
    ok = status == Status.OK
    return Trajectory(
        task_id=grant.task_id,
        turns=tuple(turns),
        checker_score=score if ok else 0.0,
        format_reward=fmt,
        reward=(score if ok else 0.0) + cfg.format_weight * fmt,
        status=status,
        group_id=grant.group,
        slot=grant.slot if slot is None else slot,
        actor_id=actor_id,
        timings=timings,
        error="" if ok else error,
        env=env,
        branch=branch,
        observation_type=cfg.observation_type,
    )


def read_task(grant: wire.Grant) -> Task | str:
    """The granted task, or why it cannot be read."""
    try:
        return Task.from_dict(json.loads(grant.task_json), domain="granted")
    except (TaskError, ValueError) as e:
        log.error("grant %s: the task cannot be read: %s", grant.grant_id, e)
        return f"the task cannot be read: {e}"


async def run_episode(
    env: Environment,
    grant: wire.Grant,
    policy: Any,
    cfg: EpisodeConfig,
    *,
    actor_id: str,
    on_step: Any = None,
) -> Trajectory | None:
    """Run the granted episode on `env`; the finished Trajectory (None if the policy failed)."""
    t_start = time.perf_counter()
    timings = {"reset": 0.0, "policy": 0.0, "env": 0.0, "evaluate": 0.0}

    def finish(
        turns: Sequence[Turn], score: float, fmt: float, status: Status, error: str = ""
    ) -> Trajectory:
        timings["total"] = time.perf_counter() - t_start
        return trajectory(grant, turns, score, fmt, status, cfg, actor_id=actor_id,
                          env=env.url, timings=timings, error=error)  # fmt: skip

    task = read_task(grant)
    if isinstance(task, str):
        return finish([], 0.0, 0.0, Status.SETUP_ERROR, task)

    t0 = time.perf_counter()
    failed = await env.prepare(task)
    timings["reset"] = time.perf_counter() - t0
    if failed is not None:
        return finish([], 0.0, 0.0, failed.status, failed.reason)

    run = start_run(task, grant, policy, cfg)
    run.timings = timings
    try:
        await play(env, run, cfg, run.budget, grant_id=grant.grant_id, on_step=on_step)
    except EnvError as e:
        log.warning("env %d: step failed, episode is env_error: %s", env.index, e)
        return finish(run.turns, 0.0, run.fmt, Status.ENV_ERROR, f"step: {type(e).__name__}: {e}")
    except Exception:  # the policy engine failed (or timed out): not the env's fault
        log.exception("grant %s: the policy failed; episode abandoned", grant.grant_id)
        return None
    status, score, error = await conclude(env, run)
    return finish(run.turns, score, run.fmt, status, error)

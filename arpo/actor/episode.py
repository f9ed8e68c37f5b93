"""One episode on one environment: setup, screenshot -> prompt -> engine -> parse -> execute, evaluate.

    env = Environment(0, "http://127.0.0.1:5000", runner_config)
    traj = await run_episode(env, grant, policy, EpisodeConfig(), actor_id="actor-0")

The loop (the ARPO reference's, asynchronous per environment):

1. reset + the task's setup steps (`TaskRunner.setup`, `reset_env`); a failed reset is
   the environment's fault (retried with capped backoff, `reset_retries`; then the
   environment is unhealthy and the episode is `env_error` with no turns), a failed setup
   on an environment that reset fine the task's (`setup_error`, the reason in
   `Trajectory.error`: the learner takes a task whose setup keeps failing out of the run);
2. up to `step_budget(task, max_steps)` turns (`max_steps`, or fitted to the task's
   oracle): screenshot, the turn's prompt ids (`EpisodePrompt`), one
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
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from arpo import wire
from arpo.config import MAX_TEMPERATURE, check_range, check_seconds, fail, option
from arpo.env.client import ClientConfig, EnvAuthError, EnvClient, auth_failure
from arpo.env.osworld.client import OSWorldEvaluator
from arpo.env.provider import TaskQuarantined
from arpo.env.runner import RunnerConfig, TaskRunner
from arpo.env.task import Task
from arpo.errors import EnvError, ResetError, TaskError
from arpo.policy import actions as A
from arpo.policy.engine import Completion, SamplingParams
from arpo.policy.prompt import EpisodePrompt, image_size, pixel_bounds
from arpo.record import Branch, Status, Trajectory, Turn

log = logging.getLogger("arpo.actor.episode")


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
    history_images: int = option(
        15, "Screenshots kept in the model's context (1..MAX_STEPS_LIMIT)."
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
    reset_retries: int = option(
        3, "Tries of reset + setup before the environment is unhealthy (1..MAX_RESET_RETRIES)."
    )
    reset_backoff_s: float = option(
        1.0,
        "Delay before the second try; doubles, capped at RESET_BACKOFF_CAP_S (30 s), which "
        "bounds it too (0: none).",
    )
    step_timeout_s: float = option(
        600.0, "Longest policy call plus action of one turn (> 0, at most a week)."
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
        check_range(
            "reset_retries", self.reset_retries, 1, MAX_RESET_RETRIES, "tries of reset + setup"
        )
        check_range(
            "reset_backoff_s",
            self.reset_backoff_s,
            0,
            RESET_BACKOFF_CAP_S,
            "seconds; the delay doubles up to this cap",
        )
        check_seconds("step_timeout_s", self.step_timeout_s, "one policy call plus its action")


MAX_STEPS_LIMIT = 1000
"""Largest `max_steps` accepted (OSWorld's own runs go to 100)."""
MAX_NEW_TOKENS_LIMIT = 1 << 17
"""Largest `max_new_tokens` accepted (a long-context model's whole window)."""
MAX_FORMAT_WEIGHT = 100.0
"""Largest `format_weight`: checker scores are in [0, 1], so beyond 100 the format reward
is all a group's advantages see (and 1e308 overflows them to inf)."""
MAX_SCROLL_CLICKS = 100
"""Most wheel clicks in one scroll action: 100 clicks move about 300 lines (3 a click on
common desktops), more than any window shows; beyond it every scroll jumps to an end."""
MAX_RESET_RETRIES = 20
"""Most tries of reset + setup: with the delay between tries capped at RESET_BACKOFF_CAP_S,
20 tries wait at most 19 x 30 s (under 10 minutes) before the environment is unhealthy
and the grant is handed back."""
RESET_BACKOFF_CAP_S = 30.0
"""The cap of the doubling delay between tries of reset + setup (`prepare`), and so the
largest `reset_backoff_s`: a larger first delay would hold the grant past the cap."""
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


class Environment:
    """One environment server, its provider and the runner driving it. `healthy` turns False
    after repeated reset failures of an environment nobody replaces (the actor then asks it
    every `env_recheck_s` until it answers); a fleet VM instead waits until the fleet has it
    serving again. `retired` says why it is given up for good: an environment that refuses
    the client's token is never asked again (until its configuration changes)."""

    def __init__(
        self,
        index: int,
        url: str,
        runner: RunnerConfig | None = None,
        token: str | None = None,
        osworld: OSWorldEvaluator | None = None,
        provider: Any = None,
        quarantine: dict[str, str] | None = None,
        files: Any = None,
    ):
        """`osworld`: OSWorld evaluator workers shared with other environments (the actor's
        pool); None: the runner starts its own when a task first needs one. `provider`: a
        function of the client giving its provider (arpo.env.provider); None: the runner's
        default (the desktop's /reset when `runner.reset_before_setup`). `files`: the
        actor's `FileSource` of the task files grants name by content."""
        self.index = index
        self.url = url
        self.client = EnvClient(ClientConfig(base_url=url, token=token, max_retries=2))
        self.provider = provider(self.client) if provider is not None else None
        self.runner = TaskRunner(
            self.client, runner, osworld=osworld, provider=self.provider, files=files
        )
        self.replaceable = getattr(self.provider, "kind", "") == "vm"
        """A fleet VM: a failed revert waits for the fleet's replacement, never retires it."""
        self.quarantined: dict[str, str] = {} if quarantine is None else quarantine
        """Tasks not set up again (a bad task, or the fleet's verdict), with the reason; the
        actor shares one dict between its environments."""
        self.healthy = True
        self.retired = ""
        """Why this environment is given up for good ("" while it may serve again): it
        refuses the token, or it is unhealthy and nobody rechecks it."""
        self.busy_s = 0.0
        """Seconds this environment spent in requests (reset, screenshots, actions, checks)."""

    def retire_refused(self, refused: EnvAuthError) -> None:
        """Give this environment up for good: it refuses the client's token."""
        self.healthy = False
        self.retired = (
            f"it refuses the token (HTTP {refused.status}): the token configured for "
            f"{self.url} is wrong (the actor's env_tokens / env_token, or the fleet's state "
            "file); it is not asked again until its configuration changes"
        )

    async def close(self) -> None:
        self.runner.close()
        if self.provider is not None:
            await self.provider.stop()
        await self.client.close()

    async def wait_healthy(self, bound_s: float = 600.0) -> bool:
        """For a fleet VM: wait until the fleet says it serves (it may be being replaced);
        False after `bound_s` or when the fleet gave the VM up."""
        if self.provider is None:
            return True
        end = time.monotonic() + bound_s
        while True:
            h = await self.runner.provider.health()
            if h.ok:
                return True
            if h.final or time.monotonic() > end:
                log.error("env %d (%s): not serving: %s", self.index, self.url, h.reason)
                return False
            await asyncio.sleep(max(0.5, h.retry_s))


@functools.lru_cache(maxsize=4)
def _saved_processor(model: str) -> Any:
    """The image processor and tokenizer saved with `model` (loaded once per process)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model)


def _prompt_for(
    policy: Any, instruction: str, cfg: EpisodeConfig
) -> tuple[EpisodePrompt, int, int]:
    """The episode's prompt builder and the (min, max) pixels of the model's image processor:
    the policy's own processor (transformers engine), its `min_pixels` / `max_pixels` /
    `tokenizer` (the scripted policy), else the processor saved with its model (`config.model`
    of the vLLM and OpenAI-compatible engines, which keep none in the actor)."""
    processor = getattr(policy, "processor", None)
    if processor is None and not hasattr(policy, "min_pixels"):
        model = getattr(getattr(policy, "config", None), "model", "")
        if model:
            processor = _saved_processor(str(model))
    if processor is not None:
        lo, hi = pixel_bounds(processor)
        tok = processor.tokenizer
    else:
        lo, hi = policy.min_pixels, policy.max_pixels
        tok = policy.tokenizer
    prompt = EpisodePrompt(
        tok, instruction, min_pixels=lo, max_pixels=hi, history_images=cfg.history_images
    )
    return prompt, lo, hi


async def _timed(env: Environment, coro: Any) -> Any:
    t0 = time.perf_counter()
    try:
        return await coro
    finally:
        env.busy_s += time.perf_counter() - t0


@dataclass(frozen=True, slots=True)
class SetupFailure:
    """Why an episode could not start: `status` env_error (the environment would not
    reset) or setup_error (it reset, the task's setup failed), and the reason."""

    status: Status
    reason: str


async def reset_env(env: Environment, task: Task, cfg: EpisodeConfig) -> SetupFailure | None:
    """Revert + setup with retries; None on success, else why the episode cannot start.

    Who is at fault decides the outcome:
    - the environment refuses the token (401, or 403 outside the file endpoints, from the
      revert or any step; `auth_failure`): final until its configuration changes. Not
      retried: the environment is unhealthy and `retired` says why (the actor logs it once
      and never asks it again); env_error.
    - the revert / reset failed (ResetError; that includes any malformed, oversize or late
      answer of the environment to it, and a reset answered with a status other than
      success): the environment's fault, never the task's. Retried with capped backoff;
      after `reset_retries` tries an environment nobody replaces is marked unhealthy (the
      actor rechecks it), a fleet VM waits for its replacement; env_error.
    - the task is broken (TaskError: an unknown step, bad parameters, a refused path, a
      task file whose bytes do not match its hash, or the fleet quarantined it; or any
      other exception of its setup code): quarantined on this actor, setup_error at once.
    - a setup step failed on an environment that reset fine (EnvError): retried; after
      `reset_retries` tries setup_error, and the environment stays healthy. The learner
      takes a task out of the run when its setup fails on several environments.
    Every outcome is reported to the provider (the fleet counts them too)."""
    if task.id in env.quarantined:
        return SetupFailure(
            Status.SETUP_ERROR, f"quarantined on this actor: {env.quarantined[task.id]}"
        )
    delay = cfg.reset_backoff_s
    err = ""
    reset_failed = False
    provider = env.runner.provider
    for attempt in range(cfg.reset_retries):
        if attempt:
            await asyncio.sleep(delay * (0.5 + random.random() / 2))
            delay = min(RESET_BACKOFF_CAP_S, delay * 2)
            if env.replaceable and not await env.wait_healthy():
                env.healthy = False  # the fleet gave the VM up, or is gone
                return SetupFailure(Status.ENV_ERROR, err or "the VM is not serving")
        try:
            await _timed(env, env.runner.setup(task))
            await provider.report(task.id, True)
            return None
        except TaskQuarantined as e:
            env.quarantined[task.id] = str(e)
            log.error("env %d: %s; its grants end as setup_error", env.index, e)
            return SetupFailure(Status.SETUP_ERROR, str(e))
        except EnvError as e:
            refused = auth_failure(e)
            if refused is not None:
                env.retire_refused(refused)
                return SetupFailure(Status.ENV_ERROR, f"token refused: {refused}")
            if isinstance(e, ResetError):
                err, reset_failed = f"reset: {e}", True
                log.warning(
                    "env %d (%s): reset failed (try %d): %s", env.index, env.url, attempt + 1, e
                )
                continue
            err, reset_failed = f"setup: {type(e).__name__}: {e}", False
            log.warning(
                "env %d (%s): setup of task %s failed (try %d): %s",
                env.index, env.url, task.id, attempt + 1, err,
            )  # fmt: skip
            await provider.report(task.id, False, err)
        except Exception as e:  # the task's setup itself is broken: the task's failure
            err = f"{type(e).__name__}: {e}"
            env.quarantined[task.id] = err
            log.error("env %d: task %s cannot be set up, quarantined: %s", env.index, task.id, err)
            await provider.report(task.id, False, err)
            return SetupFailure(Status.SETUP_ERROR, err)
    if not reset_failed:
        return SetupFailure(Status.SETUP_ERROR, err)
    if not env.replaceable:
        env.healthy = False
        log.error(
            "env %d (%s): unhealthy after %d failed resets", env.index, env.url, cfg.reset_retries
        )
    return SetupFailure(Status.ENV_ERROR, err)


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
    pixels: tuple[int, int]
    """(min, max) pixels of the model's image processor."""
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
    prompt, lo, hi = _prompt_for(policy, task.instruction, cfg)
    params = SamplingParams(
        temperature=cfg.temperature if grant.temperature is None else grant.temperature,
        top_p=cfg.top_p if grant.top_p is None else grant.top_p,
        max_new_tokens=cfg.max_new_tokens,
    )
    return EpisodeRun(
        task, prompt, episode, params, A.ActionConfig(scroll_clicks=cfg.scroll_clicks),
        (lo, hi), step_budget(task, cfg.max_steps),
    )  # fmt: skip


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
    environment fails; any other exception is the policy's failure."""
    prompt, timings = run.prompt, run.timings
    lo, hi = run.pixels
    while not run.over and len(run.turns) < until:
        t0 = time.perf_counter()
        png = await _timed(env, env.client.screenshot())
        if run.frame is None:
            w, h = image_size(png)
            run.frame = A.Frame.for_screen(w, h, min_pixels=lo, max_pixels=hi)
        timings["env"] += time.perf_counter() - t0

        prompt_ids = prompt.add_screenshot(png)
        ids, images = prompt.model_input()
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
                "grant %s: the response holds <|image_pad|>; ended as a parse failure", grant_id
            )
            parsed = A.ParsedResponse(
                text=comp.text, parsed=False, error="the response holds <|image_pad|>"
            )
        else:
            parsed = A.try_parse_response(comp.text, run.frame, config=run.action_cfg)
        run.turns.append(
            Turn(
                prompt_ids=prompt_ids,
                screenshot=png,
                response_ids=response,
                logprobs=np.asarray(comp.logprobs, np.float32),
                policy_version=int(comp.policy_version),
                action=parsed.action,
                parsed=parsed.parsed,
                temperature=run.params.temperature,
                top_p=run.params.top_p,
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
        for cmd in parsed.commands:
            await _timed(env, env.runner.act(cmd))
            run.ended = cmd in (A.DONE, A.FAIL)
        timings["env"] += time.perf_counter() - t0


async def conclude(env: Environment, run: EpisodeRun) -> tuple[Status, float, str]:
    """Check the finished episode on `env`: (status, checker score, error)."""
    t0 = time.perf_counter()
    try:
        result = await _timed(env, env.runner.evaluate(run.task))
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
    failed = await reset_env(env, task, cfg)
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

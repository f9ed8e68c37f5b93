"""One environment's life: its provider, its task runner, and a clean setup before every episode.

    env = Environment(0, "http://127.0.0.1:5000", RunnerConfig(reset_before_setup=True))
    failed = await env.prepare(task)      # revert + setup, retried; None: ready for `task`
    await env.timed(env.runner.act("pyautogui.click(10, 20)"))
    result = await env.evaluate(task)     # the checker; env_error if the VM was replaced
    await env.close()

An `Environment` holds the server's client, the provider that reverts it (arpo.env.provider:
the one given, else the desktop's `POST /reset` when `RunnerConfig.reset_before_setup`, else
nothing) and the `TaskRunner` that runs a task's steps on it. It owns every decision of a
reset: the revert (`revert`), one try of revert + setup (`reset`, as OSWorld's
`DesktopEnv.reset` reverts the VM and sets the task up), the retries with capped backoff,
the report to the provider, the health waits of a fleet VM and the quarantine of a broken
task (`prepare`, which answers "ready" or a typed `SetupFailure`). The runner runs steps
and knows no provider: whether to probe the server before OSWorld's setup and the VM's
OSWorld ports come from the provider (`needs_probe`, `osworld_ports`).

Quarantine has one type: the fleet's verdict arrives as `TaskQuarantined` (the class of
`arpo_envs.fleet_records`, re-exported by `arpo.env.provider`) from the revert, and every
task this actor will not set up again is in `Environment.quarantined` (a dict the actor
shares between its environments), with the reason.

Forks (`arpo.actor.tree`): `snapshot()` saves the environment's state, `clones(handle, n,
task)` gives `n` environments in that state continuing the same episode, `release(handle)`
frees it; `can_fork` says whether to try.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from arpo.config import check_on_build, check_range, option
from arpo.env.client import ClientConfig, EnvAuthError, EnvClient, auth_failure
from arpo.env.osworld.client import OSWorldEvaluator
from arpo.env.provider import DesktopProvider, Provider, StaticProvider, TaskQuarantined
from arpo.env.runner import EvalResult, RunnerConfig, TaskRunner
from arpo.env.task import Task
from arpo.env.taskfiles import FileSource
from arpo.errors import BlobCacheError, EnvError, ResetError, TaskError
from arpo.record import Status

log = logging.getLogger("arpo.env.environment")

T = TypeVar("T")

MAX_RESET_RETRIES = 20
"""Most tries of reset + setup: with the delay between tries capped at RESET_BACKOFF_CAP_S,
20 tries wait at most 19 x 30 s (under 10 minutes) before the environment is unhealthy
and the grant is handed back."""
RESET_BACKOFF_CAP_S = 30.0
"""The cap of the doubling delay between tries of reset + setup (`prepare`), and so the
largest `reset_backoff_s`: a larger first delay would hold the grant past the cap."""


@dataclass
class EnvironmentConfig:
    """How an environment is brought to a clean state, set up for its task, before an episode."""

    reset_retries: int = option(
        3, "Tries of reset + setup before the environment is unhealthy (1..MAX_RESET_RETRIES)."
    )
    reset_backoff_s: float = option(
        1.0,
        "Delay before the second try; doubles, capped at RESET_BACKOFF_CAP_S (30 s), which "
        "bounds it too (0: none).",
    )

    def __post_init__(self) -> None:
        check_on_build(self)

    def validate(self) -> None:
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


def reset_delays(first_s: float, tries: int) -> Iterator[float]:
    """The delays before the 2nd..`tries`th try of reset + setup: `first_s`, doubling, each
    at most RESET_BACKOFF_CAP_S (the first too: its config is checked, but a field can be
    set after the config was built)."""
    delay = min(RESET_BACKOFF_CAP_S, max(0.0, first_s))
    for _ in range(tries - 1):
        yield delay
        delay = min(RESET_BACKOFF_CAP_S, delay * 2)


@dataclass(frozen=True, slots=True)
class SetupFailure:
    """Why an episode could not start: `status` env_error (the environment would not
    reset) or setup_error (it reset, the task's setup failed), and the reason."""

    status: Status
    reason: str


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
        provider: Callable[[EnvClient], Provider] | None = None,
        quarantine: dict[str, str] | None = None,
        files: FileSource | None = None,
        config: EnvironmentConfig | None = None,
    ):
        """`osworld`: OSWorld evaluator workers shared with other environments (the actor's
        pool); None: the runner starts its own when a task first needs one. `provider`: a
        function of the client giving its provider (arpo.env.provider); None: the desktop's
        `/reset` when `runner.reset_before_setup`, else nothing reverts it (a server started
        elsewhere, not warned about). `files`: the actor's `FileSource` of the task files
        grants name by content. `config`: the retries of `prepare`."""
        self.index = index
        self.url = url
        self.config = config or EnvironmentConfig()
        self.client = EnvClient(ClientConfig(base_url=url, token=token, max_retries=2))
        runner = runner or RunnerConfig()
        self.provider: Provider
        if provider is not None:
            self.provider = provider(self.client)
        elif runner.reset_before_setup:
            self.provider = DesktopProvider(self.client)
        else:
            self.provider = StaticProvider(self.client, warn=False)
        self.runner = TaskRunner(
            self.client,
            runner,
            osworld=osworld,
            files=files,
            probe_before_setup=self.provider.needs_probe,
            osworld_ports=self.provider.osworld_ports,
        )
        self.replaceable = self.provider.kind == "vm"
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
        self._saved: dict[str, list[str]] = {}
        """The episode's actions at each saved state (`snapshot` handle -> actions)."""
        self.instance = ""
        """Which machine served the episode since its revert (`Provider.instance`; '' when
        the provider cannot tell): `evaluate` checks it again after the checker ran."""

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
        await self.provider.stop()
        await self.client.close()

    async def timed(self, coro: Awaitable[T]) -> T:
        """Await `coro`, a request to this environment, counting its time in `busy_s`."""
        t0 = time.perf_counter()
        try:
            return await coro
        finally:
            self.busy_s += time.perf_counter() - t0

    async def wait_healthy(self, bound_s: float = 600.0) -> bool:
        """For a fleet VM: wait until the fleet says it serves (it may be being replaced);
        False after `bound_s` or when the fleet gave the VM up. True at once for an
        environment nobody replaces."""
        if not self.replaceable:
            return True
        end = time.monotonic() + bound_s
        while True:
            h = await self.provider.health()
            if h.ok:
                return True
            if h.final or time.monotonic() > end:
                log.error("env %d (%s): not serving: %s", self.index, self.url, h.reason)
                return False
            await asyncio.sleep(max(0.5, h.retry_s))

    # ---- reset --------------------------------------------------------------------------------

    async def revert(self, task: Task) -> None:
        """The provider's revert before `task`; any failure of it is raised as ResetError
        (the environment's fault, never the task's), the error it wraps as its cause (a
        refused token: `arpo.env.client.auth_failure` finds it). Only TaskQuarantined (the
        fleet quarantined the task) and TaskError pass through: whatever else a provider
        raises, an environment's answer cannot make its task look broken."""
        try:
            await self.provider.revert_to_snapshot(task.id)
            self.instance = await self.provider.instance()
        except (ResetError, TaskError, TaskQuarantined):
            raise
        except Exception as e:
            raise ResetError(f"{type(e).__name__}: {e}") from e

    async def reset(self, task: Task) -> None:
        """One try of a clean start of `task`: check its steps (TaskError before anything
        runs), revert the environment (`revert`), run the task's setup (`TaskRunner.setup`).
        Raises as those do; `prepare` is the retried, reported form."""
        self.runner.check(task)
        await self.revert(task)
        await self.runner.setup(task)

    async def prepare(self, task: Task) -> SetupFailure | None:
        """Revert + setup with retries; None on success, else why the episode cannot start.

        Who is at fault decides the outcome:
        - the environment refuses the token (401, or 403 outside the file endpoints, from the
          revert or any step; `auth_failure`): final until its configuration changes. Not
          retried: the environment is unhealthy and `retired` says why (the actor logs it
          once and never asks it again); env_error.
        - the revert / reset failed (ResetError; that includes any malformed, oversize or
          late answer of the environment to it, and a reset answered with a status other
          than success): the environment's fault, never the task's. Retried with capped
          backoff; after `config.reset_retries` tries an environment nobody replaces is
          marked unhealthy (the actor rechecks it), a fleet VM waits for its replacement;
          env_error.
        - this actor host's cache of task files is at fault (BlobCacheError: something it
          cannot remove sits at a file's place, or it cannot be written; faults it can
          remove are repaired on the way): not retried, not reported as the task's; env_error,
          so the task stays in the run.
        - the task is broken (TaskError: an unknown step, bad parameters, a refused path, a
          task file whose bytes do not match its hash, or the fleet quarantined it; or any
          other exception of its setup code): quarantined on this actor, setup_error at once.
        - a setup step failed on an environment that reset fine (EnvError): retried; after
          `config.reset_retries` tries setup_error, and the environment stays healthy. The
          learner takes a task out of the run when its setup fails on several environments.
        Every outcome is reported to the provider (the fleet counts them too)."""
        if task.id in self.quarantined:
            return SetupFailure(
                Status.SETUP_ERROR, f"quarantined on this actor: {self.quarantined[task.id]}"
            )
        delays = reset_delays(self.config.reset_backoff_s, self.config.reset_retries)
        err = ""
        reset_failed = False
        provider = self.provider
        for attempt in range(self.config.reset_retries):
            if attempt:
                await asyncio.sleep(next(delays) * (0.5 + random.random() / 2))
                if self.replaceable and not await self.wait_healthy():
                    self.healthy = False  # the fleet gave the VM up, or is gone
                    return SetupFailure(Status.ENV_ERROR, err or "the VM is not serving")
            try:
                await self.timed(self.reset(task))
                await provider.report(task.id, True)
                return None
            except TaskQuarantined as e:
                self.quarantined[task.id] = str(e)
                log.error("env %d: %s; its grants end as setup_error", self.index, e)
                return SetupFailure(Status.SETUP_ERROR, str(e))
            except BlobCacheError as e:  # this host's cache of task files: not the task's
                log.error("env %d: setup of task %s: %s", self.index, task.id, e)
                return SetupFailure(Status.ENV_ERROR, f"setup: {type(e).__name__}: {e}")
            except EnvError as e:
                refused = auth_failure(e)
                if refused is not None:
                    self.retire_refused(refused)
                    return SetupFailure(Status.ENV_ERROR, f"token refused: {refused}")
                if isinstance(e, ResetError):
                    err, reset_failed = f"reset: {e}", True
                    log.warning(
                        "env %d (%s): reset failed (try %d): %s",
                        self.index, self.url, attempt + 1, e,
                    )  # fmt: skip
                    continue
                err, reset_failed = f"setup: {type(e).__name__}: {e}", False
                log.warning(
                    "env %d (%s): setup of task %s failed (try %d): %s",
                    self.index, self.url, task.id, attempt + 1, err,
                )  # fmt: skip
                await provider.report(task.id, False, err)
            except Exception as e:  # the task's setup itself is broken: the task's failure
                err = f"{type(e).__name__}: {e}"
                self.quarantined[task.id] = err
                log.error(
                    "env %d: task %s cannot be set up, quarantined: %s", self.index, task.id, err
                )
                await provider.report(task.id, False, err)
                return SetupFailure(Status.SETUP_ERROR, err)
        if not reset_failed:
            return SetupFailure(Status.SETUP_ERROR, err)
        if not self.replaceable:
            self.healthy = False
            log.error(
                "env %d (%s): unhealthy after %d failed resets",
                self.index, self.url, self.config.reset_retries,
            )  # fmt: skip
        return SetupFailure(Status.ENV_ERROR, err)

    async def evaluate(self, task: Task) -> EvalResult:
        """The runner's check of the episode of `task` (`TaskRunner.evaluate`, timed), then
        whether the machine that served the episode still does: a fleet VM replaced during
        the episode (its QEMU killed, its guest hung) comes back on the same URL in its
        golden state, and OSWorld's setup controller waits for it (20 tries 5 s apart), so a
        getter can read the replacement and score 0 an episode the agent may have solved.
        A changed `Provider.instance` (or one that cannot be asked) makes the result
        `env_error` with both names: the score is not this episode's. Raises as
        `TaskRunner.evaluate` does."""
        return await self._same_machine(task, await self.timed(self.runner.evaluate(task)))

    async def _same_machine(self, task: Task, result: EvalResult) -> EvalResult:
        """`result`, or env_error when the machine that served the episode was replaced."""
        if not self.instance or result.status == "env_error":
            return result
        try:
            now = await self.timed(self.provider.instance())
        except EnvError as e:
            now = f"unknown ({type(e).__name__}: {e})"
        if now == self.instance:
            return result
        log.warning(
            "env %d (%s): replaced during the episode of %s (%s, now %s); its result is "
            "env_error", self.index, self.url, task.id, self.instance, now,
        )  # fmt: skip
        return dataclasses.replace(
            result,
            score=0.0,
            status="env_error",
            error=(
                f"the environment was replaced during the episode ({self.instance} when it "
                f"started, {now} after its check): the checker's {result.status} score "
                f"{result.score:g} is not this episode's"
            ),
        )

    async def run(self, task: Task, actions: Sequence[str]) -> EvalResult:
        """`TaskRunner.run` from a clean environment: check the task, revert, then the
        runner's setup, `actions` and evaluation; a failed revert is an `env_error` result,
        as the runner's own environment failures are and a machine replaced meanwhile
        (`evaluate`). TaskError (a bad task) is raised."""
        t0 = time.perf_counter()
        self.runner.check(task)
        try:
            await self.revert(task)
        except EnvError as e:
            return EvalResult(
                task.id, 0.0, "env_error", error=f"{type(e).__name__}: {e}",
                seconds=time.perf_counter() - t0,
            )  # fmt: skip
        return await self._same_machine(task, await self.runner.run(task, actions))

    # ---- forks --------------------------------------------------------------------------------

    @property
    def can_fork(self) -> bool:
        """Whether to try `snapshot` (the provider may still answer ForkUnsupported)."""
        return bool(getattr(self.provider, "can_fork", False))

    async def snapshot(self) -> str:
        """Save this environment's current state, with the episode's actions so far; a
        handle for `clones` and `release`. ForkUnsupported when it cannot be saved, EnvError
        for any other failure."""
        handle = await self.provider.snapshot()
        self._saved[handle] = list(self.runner.history)
        return handle

    async def clones(self, handle: str, n: int, task: Task) -> list[Environment]:
        """`n` new environments in the state saved as `handle`, each continuing this
        environment's episode of `task` from there, with the actions it had run when it was
        saved (no revert, no setup): the same index, runner settings, OSWorld workers, file
        source, quarantine and config, each reverted by its own provider (`for_clone` of
        this one's). The caller closes them. EnvError when the fork fails."""
        made = await self.provider.fork(handle, n)
        history = self._saved.get(handle, self.runner.history)
        out = []
        for c in made:
            e = Environment(
                self.index,
                c.url,
                self.runner.config,
                token=c.token,
                osworld=self.runner.osworld,
                provider=lambda client, c=c: self.provider.for_clone(client, c),
                quarantine=self.quarantined,
                files=self.runner.files,
                config=self.config,
            )
            e.runner.adopt(task, history)
            out.append(e)
        try:
            for e in out:
                e.instance = await e.provider.instance()
        except BaseException:
            for e in out:
                await e.close()
            raise
        return out

    async def release(self, handle: str) -> None:
        """End the clones of `handle` and free the saved state (EnvError when it fails)."""
        self._saved.pop(handle, None)
        await self.provider.release(handle)

"""The actor: one asyncio process driving many environments, one episode coroutine per environment.

    arpo-actor sim_envs=8 policy=scripted transport.data=tcp://127.0.0.1:5555 \\
               transport.control=tcp://127.0.0.1:5556 spool_dir=runs/actor-0

Coroutines (all in one event loop; every one of them is watched: an unexpected failure
stops the actor loudly instead of leaving it hung):

- one worker per environment: wait for room in the spool, get a grant (control link)
  for a task of the environment's pool (`sim_pool` for the simulated desktops started
  here, `env_pool` for the `envs` URLs, so the learner never sends a task to an
  environment that cannot run it), make sure the policy holds weights of at least the
  grant's `min_version` (asking the weights coroutine to fetch them now, not at the next
  heartbeat, and waiting for them: no episode starts with weights older than its
  grant), run the episode (`episode.run_episode`), write the
  trajectory to the spool, wake the sender; an environment marked unhealthy is asked
  every `env_recheck_s` whether it answers and rejoins when it does (0: it retires);
- sender: sends spooled trajectories not yet acknowledged (oldest first, at most
  `max_unacked` in flight), and again after `ack_timeout_s`; an acknowledgement deletes the
  spool file. What is in the spool at start is sent first: nothing finished is ever lost;
- heartbeat: both links every `heartbeat_s`; notices (and logs) a learner that stops
  answering and its return; collection goes on into the spool meanwhile;
- weights: when the learner's heartbeat announces a newer version, or a worker holds a
  grant that needs one, fetch the newest (chunks or a shared path) and hand it to the
  engine, which applies it between requests;
- progress: the live line (episodes, successes, steps/s, in flight, spool, version).

Shutdown (SIGTERM / Ctrl-C / `stop()`): no new grants; in-flight episodes get
`shutdown_deadline_s` to finish (then they are abandoned: the learner re-issues their
grants); the spool gets `flush_deadline_s` to be acknowledged (what is left stays on
disk for the next start); exit 0.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import random
import signal
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arpo import wire
from arpo.actor.config import ActorConfig, default_actor_id
from arpo.actor.episode import run_episode
from arpo.actor.spool import Spool
from arpo.actor.tree import TreeStats, run_tree
from arpo.env.client import EnvAuthError
from arpo.env.environment import Environment
from arpo.env.osworld.client import OSWorldEvaluator
from arpo.env.provider import FleetLink, FleetVMProvider, StaticProvider
from arpo.env.runner import RunnerConfig
from arpo.env.taskfiles import BlobCache, FileSource, default_cache_dir
from arpo.errors import EngineError, EnvError
from arpo.record import Status, Trajectory
from arpo.transport import ActorLink, fetch_weights

log = logging.getLogger("arpo.actor")


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait for `event` at most `timeout` seconds; True if it is set.

    `asyncio.timeout`, not `asyncio.wait_for`: on Python 3.11 wait_for can swallow a
    cancellation that arrives as the event is set, and a loop around it then never ends
    (a shutdown that hangs).
    """
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()
    return event.is_set()


@dataclass
class ActorStats:
    """Counters of one actor (also sent in its heartbeats)."""

    episodes: int = 0
    successes: int = 0
    steps: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    sent: int = 0
    resent: int = 0
    acked: int = 0
    abandoned: int = 0
    refused: int = 0
    """Trajectories the learner refused for good (kept in the spool's `refused/`)."""
    released: int = 0
    """Grants given back to the learner at once (their episode ended without a trajectory)."""
    grants: int = 0
    grant_waits: int = 0
    by_pool: dict[str, int] = field(default_factory=dict)
    """Finished episodes per environment pool."""
    weight_waits: int = 0
    """Grants that waited for newer weights before their episode started."""
    weight_wait_s: float = 0.0
    """Seconds environments spent waiting for those weights."""
    grant_wait_s: float = 0.0
    """Seconds environments spent asking for a grant (answered, refused or retried)."""
    episode_s: float = 0.0
    """Seconds environments spent running episodes (setup, steps, evaluation)."""
    tree: TreeStats = field(default_factory=TreeStats)
    """Forks of tree grants (`arpo.actor.tree`)."""


class Actor:
    """See the module docstring. `await Actor(cfg).run()`; `stop()` from a signal or a test."""

    def __init__(
        self, config: ActorConfig, *, policy: Any = None, env_urls: list[str] | None = None
    ) -> None:
        self.config = config
        self.actor_id = config.actor_id or default_actor_id()
        self.policy = policy
        self._extra_urls = env_urls or []
        self.spool = Spool(config.spool_dir, config.spool_max_bytes)
        self.stats = ActorStats()
        self.envs: list[Environment] = []
        self.osworld: OSWorldEvaluator | None = None
        """OSWorld evaluator workers shared by the environments' runners (`config.runner`)."""
        self.link: ActorLink | None = None
        self._stopping = asyncio.Event()
        self._wake_sender = asyncio.Event()
        self._inflight: dict[str, float] = {}  # trajectory id -> time sent (monotonic)
        self._episodes_running = 0
        self._req = 0
        self.silent_links: set[str] = set()
        """Links ("data", "control") on which the learner has been silent too long."""
        self._t0 = time.monotonic()
        self._sim_runners: list[Any] = []
        self.env_pools: dict[int, str] = {}
        """Environment index -> the pool its grants are asked for."""
        self._owns_policy = policy is None
        self._weights_wanted = asyncio.Event()
        """Set by a worker whose grant needs newer weights: fetch now."""
        self._want_version = 0
        self._refused = -1
        self._no_fork: set[int] = set()
        """Environments found unable to fork (logged once each)."""
        """A version the engine rejected (not fetched again; its grants run on older weights)."""

    # ---- control ----------------------------------------------------------------------

    def stop(self) -> None:
        """Stop taking grants and shut down (see the module docstring)."""
        if not self._stopping.is_set():
            log.info("actor %s: stopping", self.actor_id)
        self._stopping.set()

    @property
    def version(self) -> int:
        return int(getattr(self.policy, "policy_version", 0))

    # ---- setup ------------------------------------------------------------------------

    async def _make_policy(self) -> Any:
        c = self.config
        if c.policy == "scripted":
            from arpo.actor.scripted import ScriptedPolicy

            return ScriptedPolicy(
                quit_prob=c.scripted_quit_prob,
                garbage_prob=c.scripted_garbage_prob,
                error_prob=c.scripted_error_prob,
                scroll_clicks=c.episode.scroll_clicks,
            )
        from arpo.policy.engines import make_engine

        return make_engine(c.engine)

    async def _start_sims(self) -> list[str]:
        c = self.config
        if c.sim_envs < 1:
            return []
        from arpo_envs.sim.latency import LatencyConfig
        from arpo_envs.sim.server import SimConfig, start_servers

        latency = LatencyConfig.parse(
            c.sim_latency,
            slow_env=c.sim_slow_env if c.sim_slow_env >= 0 else None,
            slow_factor=c.sim_slow_factor,
        )
        runners, urls = await start_servers(
            [SimConfig(port=0, latency=latency, index=i) for i in range(c.sim_envs)]
        )
        self._sim_runners = runners
        return urls

    def _fleet_vms(self, cfg: RunnerConfig) -> list[tuple[str, str, RunnerConfig, Any]]:
        """The fleet's VMs (vm_fleet), each with a provider that reverts it by snapshot."""
        c = self.config
        if not c.vm_fleet:
            return []
        link = FleetLink.from_state(c.vm_fleet)
        vms = list(link.vms)
        if c.vm_count:
            if c.vm_count > len(vms):
                raise ValueError(
                    f"vm_count={c.vm_count} but the fleet {c.vm_fleet} has {len(vms)} VMs"
                )
            vms = vms[: c.vm_count]
        log.info("actor %s: %d VMs of the fleet %s", self.actor_id, len(vms), c.vm_fleet)
        return [
            (v.url, c.vm_pool, cfg,
             lambda cl, v=v: FleetVMProvider(cl, link, v.name, ports=v.osworld_ports))
            for v in vms
        ]  # fmt: skip

    # ---- main -------------------------------------------------------------------------

    async def run(self) -> ActorStats:
        c = self.config
        if self.policy is None:
            self.policy = await self._make_policy()
        if hasattr(self.policy, "start"):
            await self.policy.start()  # idempotent for every engine
        # Simulated desktops started here have no animations to wait for: their setup
        # `sleep` steps are skipped.
        # Simulated desktops' scenes and checks are the project's own (evaluator "own").
        desktop_cfg = c.runner.runner_config(reset_before_setup=c.reset_before_setup)
        sim_cfg = RunnerConfig(
            reset_before_setup=c.reset_before_setup, sleep_scale=0.0, evaluator="own"
        )
        static = None if c.reset_before_setup else (lambda cl: StaticProvider(cl))
        envs: list[tuple[str, str, RunnerConfig, Any]] = [
            (u, c.env_pool, desktop_cfg, static) for u in list(c.envs) + self._extra_urls
        ]
        envs += self._fleet_vms(desktop_cfg)
        envs += [(u, c.sim_pool, sim_cfg, None) for u in await self._start_sims()]
        # One pool of OSWorld evaluator workers for every environment; none starts until a
        # task needs OSWorld's code.
        self.osworld = OSWorldEvaluator(c.runner.evaluator_config(len(envs)))
        self.files = FileSource(
            BlobCache(c.file_cache_dir or default_cache_dir()), self._fetch_file_chunk
        )
        self.quarantined: dict[str, str] = {}
        tokens = dict(zip(c.envs, c.env_tokens, strict=False))
        self.envs = [
            Environment(i, u, cfg, token=tokens.get(u) or c.env_token or None,
                        osworld=self.osworld, provider=prov, quarantine=self.quarantined,
                        files=self.files, config=c.environment)
            for i, (u, _, cfg, prov) in enumerate(envs)
        ]  # fmt: skip
        self.env_pools = {i: pool for i, (_, pool, _, _) in enumerate(envs)}
        self.link = ActorLink(
            c.transport, on_ack=self._acked, on_refuse=self._on_refuse, actor_id=self.actor_id
        )
        self.link.start()
        if len(self.spool):
            log.info(
                "actor %s: %d trajectories in the spool from an earlier run; sending them first",
                self.actor_id,
                len(self.spool),
            )
        self._t0 = time.monotonic()
        pools = collections.Counter(self.env_pools.values())
        log.info(
            "actor %s: %d environments, spool %s (%s)",
            self.actor_id,
            len(self.envs),
            c.spool_dir,
            ", ".join(f"{n} in pool {p!r}" for p, n in sorted(pools.items())),
        )
        services = [
            self._watch(self._sender(), "sender"),
            self._watch(self._heartbeats(), "heartbeat"),
            self._watch(self._weights(), "weights"),
        ]
        if c.progress_s > 0:
            services.append(self._watch(self._progress(), "progress"))
        service_tasks = [asyncio.create_task(s) for s in services]
        workers = [
            asyncio.create_task(self._watch(self._worker(e), f"env {e.index}")) for e in self.envs
        ]
        try:
            await self._stopping.wait()
            # Let running episodes finish within the deadline, then abandon them.
            _, pending = (
                await asyncio.wait(workers, timeout=c.shutdown_deadline_s)
                if workers
                else (set(), set())
            )
            for t in pending:
                t.cancel()
            if pending:
                self.stats.abandoned += len(pending)
                log.warning(
                    "actor %s: abandoned %d episodes at the deadline", self.actor_id, len(pending)
                )
            await asyncio.gather(*workers, return_exceptions=True)
            await self._flush(c.flush_deadline_s)
            log.info(
                "actor %s: %d grants waited for newer policy weights before their episode "
                "(%.1f environment-seconds); environment-seconds in episodes %.1f, asking "
                "for grants %.1f",
                self.actor_id,
                self.stats.weight_waits,
                self.stats.weight_wait_s,
                self.stats.episode_s,
                self.stats.grant_wait_s,
            )
        finally:
            log.debug("actor %s: stopping services", self.actor_id)
            for t in service_tasks:
                t.cancel()
            await asyncio.gather(*service_tasks, return_exceptions=True)
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            log.debug("actor %s: closing the links", self.actor_id)
            await self.link.close()
            log.debug("actor %s: closing environments and policy", self.actor_id)
            # Bounded, so a stuck connection cannot keep a stopping actor alive.
            for what, closing in (
                ("environments", [e.close() for e in self.envs]),
                ("OSWorld evaluator workers", [self.osworld.aclose()] if self.osworld else []),
                ("simulated desktops", [r.cleanup() for r in self._sim_runners]),
                ("policy", [self.policy.close()] if self._owns_policy else []),
            ):
                try:
                    async with asyncio.timeout(15.0):
                        await asyncio.gather(*closing)
                except TimeoutError:
                    log.warning("actor %s: closing the %s timed out", self.actor_id, what)
            self._print_progress(final=True)
        return self.stats

    async def _watch(self, coro: Awaitable[Any], name: str) -> None:
        """Run a coroutine; an unexpected exception is logged with its traceback and stops
        the actor (a dead coroutine must never leave the process silently hung)."""
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("actor %s: %s failed; stopping", self.actor_id, name)
            self.failed = True
            self.stop()

    failed = False

    async def _flush(self, deadline_s: float) -> None:
        """Wait until the spool is acknowledged, at most `deadline_s`."""
        end = time.monotonic() + deadline_s
        while len(self.spool) and time.monotonic() < end:
            self._wake_sender.set()
            await asyncio.sleep(0.05)
        if len(self.spool):
            log.warning(
                "actor %s: %d trajectories not acknowledged yet; they stay in %s for the next start",
                self.actor_id,
                len(self.spool),
                self.config.spool_dir,
            )

    # ---- episodes ---------------------------------------------------------------------

    async def _grant(self, pool: str) -> wire.Grant | None:
        """A grant of a task of `pool`; None when stopping."""
        assert self.link is not None
        delay = 0.2
        while not self._stopping.is_set():
            self._req += 1
            req = self._req
            reply = await self._unless_stopping(
                self.link.request(
                    wire.GrantRequest(self.actor_id, req, 1, pool),
                    lambda m, req=req: isinstance(m, wire.GrantReply) and m.req == req,
                )
            )
            if self._stopping.is_set():
                break
            if isinstance(reply, wire.GrantReply) and reply.grants:
                self.stats.grants += 1
                return reply.grants[0]
            self.stats.grant_waits += 1
            wait = reply.retry if isinstance(reply, wire.GrantReply) else delay
            delay = min(5.0, delay * 2) if reply is None else 0.2
            await wait_event(self._stopping, max(0.05, wait))
        return None

    async def _unless_stopping(self, coro: Awaitable[Any]) -> Any:
        """`coro`'s result, or None as soon as the actor stops (it is cancelled then).
        Control requests are serialised on one socket and wait `request_timeout_s` each:
        without this, workers asking a learner that is gone would keep a stopping actor
        alive for one timeout per worker."""
        task = asyncio.ensure_future(coro)
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None

    async def _worker(self, env: Environment) -> None:
        """Episodes on `env` until the actor stops. An environment that becomes unhealthy
        (its resets failed `environment.reset_retries` times) is probed every `env_recheck_s`
        and rejoins when it answers; with `env_recheck_s=0` it is retired for good. One that
        refuses its token (`Environment.retired`) is retired at once, said once at ERROR
        with its URL: no recheck makes a wrong token right. The actor stops when every
        environment is retired."""
        c = self.config
        while True:
            await self._episodes(env)
            if env.healthy or self._stopping.is_set():
                return
            if not env.retired and c.env_recheck_s > 0 and not env.replaceable:
                log.error(
                    "actor %s: env %d (%s) is unhealthy; asking it every %g s, it rejoins "
                    "when it answers", self.actor_id, env.index, env.url, c.env_recheck_s,
                )  # fmt: skip
                if await self._recheck(env):
                    continue
                if not env.retired:
                    return  # stopping
            if env.retired:
                log.error("actor %s: env %d (%s) retired: %s", self.actor_id, env.index, env.url,
                          env.retired)  # fmt: skip
            else:
                env.retired = "unhealthy"
                log.error(
                    "actor %s: env %d (%s) retired as unhealthy", self.actor_id, env.index, env.url
                )
            if all(e.retired for e in self.envs):
                log.error("actor %s: no environment left", self.actor_id)
                self.stop()
            return

    async def _recheck(self, env: Environment) -> bool:
        """Wait until `env` answers again (True: it is healthy again), or the actor stops,
        or it refuses the token (False, `env.retired` says so). An answer that is not valid
        HTTP is no answer."""
        t0 = time.monotonic()
        delay, told = self.config.env_recheck_s, False
        while True:
            probe = env.client.wait_ready(deadline_s=math.inf, interval_s=delay)
            try:
                await self._unless_stopping(probe)
                # A desktop that answers but still cannot reset (garbage, an error status)
                # would fail its next episode's reset again: its reset is the probe.
                if not self._stopping.is_set() and env.provider.kind == "desktop":
                    await self._unless_stopping(env.provider.revert_to_snapshot(""))
            except EnvAuthError as e:
                env.retire_refused(e)
                return False
            except EnvError as e:
                if not told:
                    told = True
                    log.error("actor %s: env %d (%s) answers, but its reset still fails (%s); "
                              "asked again with backoff up to 60 s", self.actor_id, env.index,
                              env.url, e)  # fmt: skip
                if await wait_event(self._stopping, delay):
                    return False
                delay = min(60.0, delay * 2)
                continue
            break
        if self._stopping.is_set():
            return False
        env.healthy = True
        log.warning(
            "actor %s: env %d (%s) answers again after %.0f s: it rejoins",
            self.actor_id, env.index, env.url, time.monotonic() - t0,
        )  # fmt: skip
        return True

    async def _episodes(self, env: Environment) -> None:
        """Grants run on `env` until the actor stops, `max_episodes` is reached or `env`
        becomes unhealthy."""
        c = self.config
        pool = self.env_pools[env.index]
        warned = False
        while not self._stopping.is_set() and env.healthy:
            if c.max_episodes and self.stats.episodes + self._episodes_running >= c.max_episodes:
                break
            if self.spool.full:
                if not warned:
                    log.warning(
                        "actor %s: spool full (%d bytes); no new episodes until the learner "
                        "acknowledges",
                        self.actor_id,
                        self.spool.bytes_used,
                    )
                    warned = True
                await wait_event(self._stopping, 0.5)
                continue
            warned = False
            t_ask = time.monotonic()
            grant = await self._grant(pool)
            self.stats.grant_wait_s += time.monotonic() - t_ask
            if grant is None:
                break
            self._episodes_running += 1
            try:
                if not await self._ensure_version(grant):
                    self.stats.abandoned += 1
                    ids = grant.tree.grant_ids if grant.tree is not None else (grant.grant_id,)
                    for gid in ids:
                        await self._release(gid, "stopping")
                    continue
                if grant.tree is not None:
                    await self._tree(env, grant, pool)
                    continue
                t_run = time.monotonic()
                try:
                    traj = await run_episode(
                        env,
                        grant,
                        self.policy,
                        c.episode,
                        actor_id=self.actor_id,
                        on_step=self._stepped,
                    )
                finally:
                    self.stats.episode_s += time.monotonic() - t_run
                if traj is not None:
                    await self._keep(env, pool, traj)
                else:
                    self.stats.abandoned += 1
                    await self._release(grant.grant_id, "policy_error")
            finally:
                self._episodes_running -= 1
        if c.max_episodes and self.stats.episodes >= c.max_episodes and not self._episodes_running:
            self.stop()

    async def _keep(self, env: Environment, pool: str, traj: Trajectory) -> None:
        """Spool a finished trajectory for the sender."""
        await asyncio.to_thread(self.spool.put, traj)
        self._finished(traj)
        s = self.stats.by_pool
        s[pool] = s.get(pool, 0) + 1
        log.debug(
            "actor %s: env %d (pool %r, %s) ran trajectory %s of task %s: %s",
            self.actor_id, env.index, pool, env.url, traj.trajectory_id, traj.task_id,
            traj.status.value,
        )  # fmt: skip
        self._wake_sender.set()

    async def _tree(self, env: Environment, grant: wire.Grant, pool: str) -> None:
        """Run tree grant `grant` on `env` (`arpo.actor.tree`): spool its leaves, give back
        the slots it could not fill."""
        t_run = time.monotonic()
        before = self.stats.tree.unsupported
        try:
            results, give_back = await run_tree(
                env, grant, self.policy, self.config.episode, actor_id=self.actor_id,
                on_step=self._stepped, stats=self.stats.tree,
            )  # fmt: skip
        finally:
            self.stats.episode_s += time.monotonic() - t_run
        if self.stats.tree.unsupported > before and env.index not in self._no_fork:
            self._no_fork.add(env.index)
            log.warning(
                "actor %s: env %d (%s) cannot fork: its tree grants run one plain episode "
                "and give the other slots back (the learner grants them as plain episodes)",
                self.actor_id, env.index, env.url,
            )  # fmt: skip
        for _slot, _gid, traj in results:
            if traj is not None:
                await self._keep(env, pool, traj)
        for gid, reason in give_back.items():
            if reason == "policy_error":
                self.stats.abandoned += 1
            await self._release(gid, reason)

    async def _release(self, grant_id: str, reason: str) -> None:
        """Give grant `grant_id` back so the learner grants its slot again now, not after its
        grant timeout (best effort: if the learner does not answer, the timeout still holds)."""
        assert self.link is not None
        self._req += 1
        req = self._req
        reply = await self.link.request(
            wire.GrantRelease(self.actor_id, req, grant_id, reason),
            lambda m, req=req: isinstance(m, wire.GrantReply) and m.req == req,
            timeout=min(5.0, self.config.transport.request_timeout_s),
        )
        if reply is not None:
            self.stats.released += 1
        log.info("actor %s: grant %s given back (%s)%s", self.actor_id, grant_id, reason,
                 "" if reply is not None else "; the learner did not answer")  # fmt: skip

    async def _fetch_file_chunk(self, sha256: str, index: int) -> tuple[Any, int, int, str] | None:
        """Chunk `index` of the task file `sha256` from the learner (None: no answer)."""
        assert self.link is not None
        reply = await self.link.request(
            wire.FileRequest(sha256, index),
            lambda m: isinstance(m, wire.FileChunk) and m.sha256 == sha256 and m.index == index,
        )
        if not isinstance(reply, wire.FileChunk):
            return None
        return memoryview(reply.data).cast("B"), reply.total, reply.size, reply.error

    async def _ensure_version(self, grant: wire.Grant) -> bool:
        """Wait until the policy holds weights of at least `grant.min_version` (False when
        the actor stops first). A shared engine server (`follows_learner`) is asked every
        0.2 s until it serves the version. A policy that cannot take weights, or a version
        the engine refused, does not wait (the learner's staleness filter is the backstop)."""
        need = grant.min_version
        follows = getattr(self.policy, "follows_learner", False)
        if self.version >= need or not (follows or hasattr(self.policy, "update_weights")):
            return True
        self.stats.weight_waits += 1
        t0 = last_log = time.monotonic()
        why = ""
        try:
            while self.version < need and self._refused < need:
                if self._stopping.is_set():
                    return False
                if follows:  # a shared engine server loads it: ask until it serves `need`
                    try:
                        await self.policy.refresh_version()
                    except EngineError as e:
                        why = f" (the engine server: {str(e)[:200]})"
                    else:
                        why = ""
                    await wait_event(self._stopping, 0.2)
                else:
                    self._want_version = max(self._want_version, need)
                    self._weights_wanted.set()
                    await wait_event(self._stopping, 0.02)
                if time.monotonic() - last_log > 30.0:
                    last_log = time.monotonic()
                    log.warning(
                        "actor %s: grant %s waits for policy v%d for %.0f s (holding v%d)%s",
                        self.actor_id,
                        grant.grant_id,
                        need,
                        last_log - t0,
                        self.version,
                        why,
                    )
            return True
        finally:
            self.stats.weight_wait_s += time.monotonic() - t0

    def _stepped(self) -> None:
        self.stats.steps += 1

    def _finished(self, traj: Trajectory) -> None:
        s = self.stats
        s.episodes += 1
        s.by_status[traj.status.value] = s.by_status.get(traj.status.value, 0) + 1
        if traj.status == Status.OK and traj.checker_score >= 1.0:
            s.successes += 1

    # ---- delivery ---------------------------------------------------------------------

    def _on_refuse(self, ids: tuple[str, ...], reason: str) -> None:
        """The learner will never store these: kept aside in the spool (`refused/`), not
        sent again, counted and logged."""
        for tid in ids:
            self._inflight.pop(tid, None)
            if self.spool.set_aside(tid, reason):
                self.stats.refused += 1
                log.error("actor %s: the learner refuses trajectory %s for good (%s); kept in "
                          "%s", self.actor_id, tid, reason, self.spool.refused_dir)  # fmt: skip
        self._wake_sender.set()

    def _acked(self, ids: tuple[str, ...]) -> None:
        for tid in ids:
            self._inflight.pop(tid, None)
            if self.spool.remove(tid):
                self.stats.acked += 1
        self._wake_sender.set()

    async def _sender(self) -> None:
        assert self.link is not None
        c = self.config
        ack_timeout = c.transport.ack_timeout_s
        while True:
            self._wake_sender.clear()
            now = time.monotonic()
            for tid in self.spool.ids():
                sent = self._inflight.get(tid)
                if sent is not None and now - sent < ack_timeout:
                    continue
                if sent is None and len(self._inflight) >= c.max_unacked:
                    break
                frames = await asyncio.to_thread(self.spool.frames, tid)
                if frames is None:
                    self._inflight.pop(tid, None)
                    continue
                if not await self.link.send(frames, timeout=1.0):
                    break  # no room: the learner is slow or away; try again later
                if sent is not None:
                    self.stats.resent += 1
                self.stats.sent += 1
                self._inflight[tid] = time.monotonic()
            await wait_event(self._wake_sender, 0.5)

    # ---- heartbeats, weights, progress ------------------------------------------------

    async def _heartbeats(self) -> None:
        assert self.link is not None
        c = self.config.transport
        seq = 0
        while True:
            seq += 1
            stats = {
                "episodes": self.stats.episodes,
                "successes": self.stats.successes,
                "steps": self.stats.steps,
                "in_flight": self._episodes_running,
                "spool": len(self.spool),
                "spool_bytes": self.spool.bytes_used,
                "weight_waits": self.stats.weight_waits,
                "weight_wait_s": round(self.stats.weight_wait_s, 3),
                "grant_wait_s": round(self.stats.grant_wait_s, 3),
                "episode_s": round(self.stats.episode_s, 3),
                "envs": len(self.envs),
                "envs_down": sum(not e.healthy for e in self.envs),
                "refused": self.stats.refused,
                "files_fetched": self.files.fetched,
                "files_refused": self.files.refused,
                "forks": self.stats.tree.forks,
                "fork_clones": self.stats.tree.clones,
                "fork_errors": self.stats.tree.fork_errors,
                "fork_s": round(self.stats.tree.fork_s, 3),
            }
            await self.link.heartbeat(
                wire.Heartbeat(
                    self.actor_id, "actor", seq, max(0, self.version), time.time(), stats
                )
            )
            now = time.monotonic()
            silent_control = self.link.control_timeouts > 0
            if silent_control and "control" not in self.silent_links:
                self.silent_links.add("control")
                log.warning("actor %s: the learner's grant server does not answer", self.actor_id)
            elif not silent_control and "control" in self.silent_links:
                self.silent_links.discard("control")
                log.warning("actor %s: the learner's grant server answers again", self.actor_id)
            for name, heard in self.link.last_heard.items():
                silent_for = now - max(heard, self._t0)
                if silent_for > c.peer_timeout_s and name not in self.silent_links:
                    self.silent_links.add(name)
                    log.warning(
                        "actor %s: the learner's %s link has not answered for %.0f s; "
                        "collecting into the spool (%d waiting)",
                        self.actor_id,
                        name,
                        silent_for,
                        len(self.spool),
                    )
                elif silent_for <= c.peer_timeout_s and name in self.silent_links:
                    self.silent_links.discard(name)
                    log.warning(
                        "actor %s: the learner's %s link answers again", self.actor_id, name
                    )
            await asyncio.sleep(c.heartbeat_s)

    async def _weights(self) -> None:
        assert self.link is not None
        # A fetch that brought nothing newer (the version a grant wants is not published yet,
        # or the learner did not answer) waits before the next: 0.1 s doubling to 5 s, with
        # jitter; a new version applied resets it.
        backoff = 0.1
        while True:
            await wait_event(self._weights_wanted, self.config.transport.heartbeat_s)
            self._weights_wanted.clear()
            newest = max(self.link.learner_version, self._want_version)
            if (
                newest <= max(self.version, self._refused)
                or not hasattr(self.policy, "update_weights")
                or getattr(self.policy, "follows_learner", False)  # its server loads them
            ):
                continue
            got = await fetch_weights(self.link)
            if got is None or got[0].version <= self.version:
                if backoff >= 2.5:
                    log.info(
                        "actor %s: the learner has no weights newer than v%d yet (v%d wanted); "
                        "asking again in %.1f s", self.actor_id, self.version, newest, backoff,
                    )  # fmt: skip
                await wait_event(self._stopping, backoff * (0.5 + random.random() / 2))
                backoff = min(5.0, backoff * 2)
                continue
            backoff = 0.1
            ann, data = got
            t0 = time.perf_counter()
            if self.config.weights_delay_s:
                await asyncio.sleep(self.config.weights_delay_s)
            try:
                weights = await self._weights_for_engine(ann, data)
                await self.policy.update_weights(weights, ann.version)
            except Exception:
                self._refused = ann.version
                log.exception(
                    "actor %s: policy v%d could not be applied; still serving v%d",
                    self.actor_id,
                    ann.version,
                    self.version,
                )
                continue
            log.info(
                "actor %s: policy v%d applied (%.1f MB, %s, %.2f s)",
                self.actor_id,
                ann.version,
                ann.nbytes / 1e6,
                "shared path" if isinstance(data, Path) else "streamed",
                time.perf_counter() - t0,
            )

    async def _weights_for_engine(self, ann: wire.WeightsAnnounce, data: bytes | Path) -> Any:
        """What `update_weights` takes: the raw stream for the scripted policy, else a state dict."""
        from arpo.actor.scripted import ScriptedPolicy

        if isinstance(self.policy, ScriptedPolicy):
            return data

        def load() -> Any:
            import safetensors.torch

            if isinstance(data, Path):
                return safetensors.torch.load_file(str(data))
            return safetensors.torch.load(data)

        return await asyncio.to_thread(load)

    def progress_line(self) -> str:
        s = self.stats
        dt = max(1e-9, time.monotonic() - self._t0)
        silent = ",".join(sorted(self.silent_links))
        learner = f"learner SILENT ({silent})" if silent else "learner ok"
        pools = ""
        if len(s.by_pool) > 1:
            pools = "; " + ", ".join(f"{p} {n}" for p, n in sorted(s.by_pool.items()))
        return (
            f"[{self.actor_id}] episodes {s.episodes} (success {s.successes}{pools}) | "
            f"{s.steps / dt:.1f} steps/s | in flight {self._episodes_running} | "
            f"spool {len(self.spool)} ({self.spool.bytes_used / 1e6:.1f} MB) | "
            f"policy v{max(0, self.version)} | {learner}"
        )

    def _print_progress(self, final: bool = False) -> None:
        if self.config.progress_s <= 0:
            return
        tty = sys.stderr.isatty()
        end = "\n" if final or not tty else ""
        sys.stderr.write(("\r" if tty else "") + self.progress_line() + end)
        sys.stderr.flush()

    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(self.config.progress_s)
            self._print_progress()


def install_signal_handlers(actor: Actor) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, actor.stop)

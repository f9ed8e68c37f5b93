"""The actor end to end: real sockets on loopback, simulated desktops over HTTP, real processes.

The learner side here is the real one (grant server + ingest + the Rust store); the
policy is the scripted one (a task's oracle written as UI-TARS text, behind the engine
interface), so every episode's outcome is known in advance.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from arpo_envs.sim.tasks import generate_tasks
from conftest import sim_desktop

from arpo import store_item
from arpo.actor.actor import Actor
from arpo.actor.config import ActorConfig
from arpo.actor.episode import EpisodeConfig
from arpo.actor.scripted import ByteTokenizer, oracle_to_actions
from arpo.buffer import ReplayStore
from arpo.env.environment import EnvironmentConfig
from arpo.policy import actions as A
from arpo.record import Status, Trajectory
from arpo.service.grants import GrantBook, GrantConfig, GrantServer
from arpo.service.ingest import Ingest, IngestConfig
from arpo.transport import TransportConfig

FAMILIES = ["click_button", "click_sequence", "type_submit", "menu_pick", "dialog_confirm",
            "list_select", "fill_form"]  # fmt: skip


def sim_tasks(per_family: int = 2, families: list[str] = FAMILIES) -> list[dict[str, Any]]:
    return [t for f in families for t in generate_tasks(f, per_family, seed=11)]


def wait_for(cond, what: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


async def async_wait_for(cond, what: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)


class SlowStore:
    """The real store behind a slow `put` (a busy learner), so acks lag behind episodes."""

    def __init__(self, store: ReplayStore, delay_s: float) -> None:
        self.store, self.delay_s = store, delay_s

    def put(self, task: str, item: Any) -> None:
        time.sleep(self.delay_s)
        self.store.put(task, item)


class Learner:
    """The learner's receiving side: grants + ingest + store, on loopback."""

    def __init__(self, tasks: list[dict[str, Any]], grants: GrantConfig, tmp: Path,
                 put_delay_s: float = 0.0) -> None:  # fmt: skip
        self.store = ReplayStore(max_bytes=4 << 30, fresh_capacity=4096, seed=0)
        self.book = GrantBook(tasks, grants)
        self.grants = GrantServer(self.book, TransportConfig(control="tcp://127.0.0.1:0"))
        self.control = self.grants.start()
        self.seen_log = str(tmp / "seen.log")
        self.put_delay_s = put_delay_s
        self.ingest: Ingest | None = None
        self.data = "tcp://127.0.0.1:0"
        self.start_ingest()
        self.tasks = {t["id"]: t for t in tasks}

    def start_ingest(self) -> None:
        store = SlowStore(self.store, self.put_delay_s) if self.put_delay_s else self.store
        self.ingest = Ingest(
            store,
            IngestConfig(seen_log=self.seen_log),
            TransportConfig(data=self.data),
            version=lambda: self.grants.version,
            on_trajectory=self.book.complete,
        )
        self.data = self.ingest.start()  # the same port again after a restart

    def stop_ingest(self) -> None:
        assert self.ingest is not None
        self.ingest.stop()

    def transport(self, **kw: Any) -> TransportConfig:
        return TransportConfig(data=self.data, control=self.control, **kw)

    def stored(self) -> int:
        return sum(self.store.fresh_len(t) for t in self.store.tasks())

    def drain(self) -> list[Trajectory]:
        out = []
        for t in self.store.tasks():
            out += [
                store_item.from_item(i)
                for i in self.store.take_group(t, self.store.fresh_len(t), 0)
            ]
        return out

    def close(self) -> None:
        if self.ingest is not None:
            self.ingest.stop()
        self.grants.stop()
        self.store.close()


@pytest.fixture
def learner_factory(tmp_path: Path):
    made: list[Learner] = []

    def make(*args: Any, **kw: Any) -> Learner:
        made.append(Learner(*args, tmp=tmp_path, **kw))
        return made[-1]

    yield make
    for lr in made:
        lr.close()


def expected_responses(task: dict[str, Any], scroll_clicks: int) -> int:
    """Turns of the scripted episode: one per oracle step, then finished()."""
    return len(task["oracle"]) + 1


def check_trajectory(tr: Trajectory, task: dict[str, Any], scroll_clicks: int = 1) -> None:
    assert tr.status == Status.OK and tr.checker_score == 1.0 and tr.reward == 1.0, tr.timings
    assert tr.format_reward == 0.0 and tr.task_id == task["id"]
    assert tr.steps == expected_responses(task, scroll_clicks)
    tok = ByteTokenizer()
    frame = A.Frame.for_screen(1280, 720)
    for k, turn in enumerate(tr.turns):
        assert turn.parsed and bytes(turn.screenshot[:4]) == b"\x89PNG"
        assert len(turn.logprobs) == len(turn.response_ids) and (turn.logprobs <= 0).all()
        text = tok.decode(turn.response_ids.tolist(), skip_special_tokens=False)
        assert text.endswith("<|im_end|>")
        parsed = A.parse_response(
            text.removesuffix("<|im_end|>"), frame, config=A.ActionConfig(scroll_clicks=1)
        )
        assert turn.action == parsed.action
        if k < len(task["oracle"]):
            # The oracle's step, as actions (coordinates round-trip through the image frame).
            want = oracle_to_actions(task["oracle"][k], scroll_clicks)
            assert [type(a) for a in parsed.actions] == [type(a) for a in want]
        else:
            assert turn.action == "DONE"
    # Turn 0 carries the system prompt, the instruction and the first image; later turns
    # only their image message (token-in, token-out: nothing re-tokenised).
    img = tok.convert_tokens_to_ids("<|image_pad|>")
    assert (tr.turns[0].prompt_ids == img).sum() == (tr.turns[-1].prompt_ids == img).sum() > 0
    assert len(tr.turns[0].prompt_ids) > len(tr.turns[-1].prompt_ids)
    versions = [t.policy_version for t in tr.turns]
    assert versions == sorted(versions)


# ---------------------------------------------------------------------------- in process


def test_many_episodes_on_eight_desktops_end_in_the_store(learner_factory, tmp_path: Path) -> None:
    tasks = sim_tasks(per_family=2)
    lr = learner_factory(tasks, GrantConfig(group_size=4, groups_per_step=6, max_staleness=0))
    cfg = ActorConfig(
        actor_id="actor-a",
        sim_envs=8,
        policy="scripted",
        spool_dir=str(tmp_path / "spool"),
        transport=lr.transport(heartbeat_s=0.2),
        episode=EpisodeConfig(scroll_clicks=1),
        progress_s=0,
    )

    async def go() -> Actor:
        actor = Actor(cfg)
        run = asyncio.create_task(actor.run())
        # Version 0 admits 6 groups (24 episodes); then the learner publishes version 1,
        # which admits 6 more, and the actor fetches the new weights by itself.
        await async_wait_for(lambda: lr.stored() >= 24, "the first 24 episodes")
        await asyncio.to_thread(lr.grants.publish_weights, 1, b"weights-v1" * 100)
        await async_wait_for(lambda: lr.stored() >= 48, "48 episodes")
        actor.stop()
        await asyncio.wait_for(run, 120)
        return actor

    actor = asyncio.run(go())
    trajs = lr.drain()
    assert len(trajs) == 48 and len({t.trajectory_id for t in trajs}) == 48
    assert actor.stats.episodes == 48 and actor.stats.successes == 48 and len(actor.spool) == 0
    groups = collections.Counter(t.group_id for t in trajs)
    assert len(groups) == 12 and set(groups.values()) == {4}  # every group filled to its size
    assert sorted(collections.Counter((t.group_id, t.slot) for t in trajs).values()) == [1] * 48
    for tr in trajs:
        check_trajectory(tr, lr.tasks[tr.task_id])
        assert tr.actor_id == "actor-a"
    versions = {t.policy_version for tr in trajs for t in tr.turns}
    assert versions == {0, 1} and actor.version == 1


def test_unparsable_response_ends_the_episode_with_format_penalty(
    learner_factory, tmp_path: Path
) -> None:
    tasks = sim_tasks(per_family=1, families=["click_button", "fill_form"])
    lr = learner_factory(tasks, GrantConfig(group_size=2, groups_per_step=2, max_staleness=0))
    cfg = ActorConfig(
        sim_envs=2,
        policy="scripted",
        scripted_garbage_prob=1.0,
        spool_dir=str(tmp_path / "spool"),
        transport=lr.transport(),
        max_episodes=4,
        progress_s=0,
    )
    asyncio.run(Actor(cfg).run())
    wait_for(lambda: lr.stored() == 4, "4 episodes")
    for tr in lr.drain():
        assert tr.steps == 1 and not tr.turns[0].parsed and tr.turns[0].action == ""
        assert (tr.format_reward, tr.checker_score, tr.reward) == (-1.0, 0.0, -0.5)
        assert tr.status == Status.OK


def test_learner_ingest_down_then_back(learner_factory, tmp_path: Path) -> None:
    """The actor keeps collecting into its spool while ingest is away, then delivers it all."""
    tasks = sim_tasks(per_family=1)
    lr = learner_factory(tasks, GrantConfig(group_size=4, groups_per_step=7, max_staleness=0))
    cfg = ActorConfig(
        sim_envs=4,
        policy="scripted",
        spool_dir=str(tmp_path / "spool"),
        transport=lr.transport(heartbeat_s=0.2, peer_timeout_s=1.0, ack_timeout_s=2.0),
        episode=EpisodeConfig(scroll_clicks=1),
        progress_s=0,
    )

    async def go() -> Actor:
        actor = Actor(cfg)
        run = asyncio.create_task(actor.run())
        await async_wait_for(lambda: lr.stored() >= 4, "the first episodes")
        await asyncio.to_thread(lr.stop_ingest)
        await async_wait_for(lambda: len(actor.spool) >= 6, "episodes spooled while away")
        await async_wait_for(lambda: "data" in actor.silent_links, "the silent ingest noticed")
        await asyncio.to_thread(lr.start_ingest)
        await async_wait_for(lambda: lr.stored() >= 28, "all 28 episodes")
        await async_wait_for(lambda: len(actor.spool) == 0, "an empty spool")
        await async_wait_for(lambda: not actor.silent_links, "the ingest heard again")
        actor.stop()
        await asyncio.wait_for(run, 120)
        return actor

    actor = asyncio.run(go())
    trajs = lr.drain()
    assert len(trajs) == 28 == actor.stats.episodes
    assert len({t.trajectory_id for t in trajs}) == 28  # no duplicates stored
    for tr in trajs:
        check_trajectory(tr, lr.tasks[tr.task_id])


def test_desktop_killed_mid_episode_is_an_env_error(learner_factory, tmp_path: Path) -> None:
    tasks = sim_tasks(per_family=2, families=["fill_form"])
    lr = learner_factory(tasks, GrantConfig(group_size=2, groups_per_step=1, max_staleness=0))
    sim, url = sim_desktop("--latency", "fixed:150")
    try:
        cfg = ActorConfig(
            envs=[url],
            env_pool="sim",  # a simulated desktop's server, given as a URL
            policy="scripted",
            spool_dir=str(tmp_path / "spool"),
            transport=lr.transport(),
            environment=EnvironmentConfig(reset_retries=2, reset_backoff_s=0.1),
            env_recheck_s=0,  # retired for good
            progress_s=0,
        )

        async def go() -> Actor:
            actor = Actor(cfg)
            run = asyncio.create_task(actor.run())
            await async_wait_for(lambda: actor.stats.steps >= 2, "an episode under way")
            sim.kill()  # the desktop dies mid-episode
            await asyncio.wait_for(run, 120)  # the only env is retired: the actor stops
            return actor

        actor = asyncio.run(go())
    finally:
        sim.kill()
        sim.wait()
        sim.stdout.close()
    assert actor.stats.by_status.get("env_error", 0) >= 1 and not actor.envs[0].healthy
    assert actor.failed is False
    assert lr.ingest.stats().get("excluded_env_error", 0) >= 1
    (tr, *_) = [t for t in lr.ingest.excluded if t.turns]
    assert tr.status == Status.ENV_ERROR and tr.reward == 0.0 and tr.checker_score == 0.0
    assert lr.stored() == 0  # delivered, but kept out of training
    assert lr.book.stats().get("regrant_env_error", 0) >= 1  # the slot goes to another actor


def test_a_desktop_that_comes_back_rejoins_the_actor(learner_factory, tmp_path: Path) -> None:
    """The only desktop dies mid-episode and comes back on the same port 3 s later: the actor
    marks it unhealthy, asks it every `env_recheck_s`, and runs episodes on it again; it
    never stops on its own."""
    tasks = sim_tasks(per_family=2, families=["fill_form"])
    lr = learner_factory(tasks, GrantConfig(group_size=2, groups_per_step=1, max_staleness=0))
    sims = [sim_desktop("--latency", "fixed:150")]
    url = sims[0][1]
    port = int(url.rsplit(":", 1)[1])
    cfg = ActorConfig(
        envs=[url],
        env_pool="sim",
        policy="scripted",
        spool_dir=str(tmp_path / "spool"),
        transport=lr.transport(),
        environment=EnvironmentConfig(reset_retries=2, reset_backoff_s=0.1),
        env_recheck_s=0.5,
        progress_s=0,
    )

    async def go() -> Actor:
        actor = Actor(cfg)
        run = asyncio.create_task(actor.run())
        await async_wait_for(lambda: actor.stats.steps >= 2, "an episode under way")
        sims[0][0].kill()
        await async_wait_for(lambda: not actor.envs[0].healthy, "the desktop noticed down")
        await asyncio.sleep(3.0)
        assert not run.done(), "the actor stopped while its desktop was down"
        ok_before = actor.stats.by_status.get("ok", 0)
        sims.append(await asyncio.to_thread(sim_desktop, "--latency", "fixed:150", port=port))
        await async_wait_for(
            lambda: actor.stats.by_status.get("ok", 0) >= ok_before + 2,
            "episodes after it came back",
        )
        assert actor.envs[0].healthy
        actor.stop()
        await asyncio.wait_for(run, 120)
        return actor

    try:
        actor = asyncio.run(go())
    finally:
        for sim, _ in sims:
            sim.kill()
            sim.wait()
            sim.stdout.close()
    assert actor.failed is False
    assert actor.stats.by_status.get("env_error", 0) >= 1


# ---------------------------------------------------------------------------- processes


def _actor_process(lr: Learner, spool: Path, log: Path) -> subprocess.Popen:
    args = [
        sys.executable, "-m", "arpo.actor.cli", "--log-level", "DEBUG",
        "sim_envs=4", "policy=scripted", "actor_id=proc", f"spool_dir={str(spool)!r}",
        f"transport.data={lr.data!r}", f"transport.control={lr.control!r}",
        "transport.ack_timeout_s=3.0", "episode.scroll_clicks=1", "progress_s=1",
        "shutdown_deadline_s=30",
    ]  # fmt: skip
    with log.open("ab") as err:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err)


def test_kill_9_and_restart_delivers_every_finished_trajectory_once(
    learner_factory, tmp_path: Path
) -> None:
    tasks = sim_tasks(per_family=2)
    grants = GrantConfig(group_size=4, groups_per_step=20, max_staleness=0, grant_timeout_s=5.0)
    lr = learner_factory(tasks, grants, put_delay_s=0.25)  # acks lag: the spool fills
    spool, log = tmp_path / "spool", tmp_path / "actor.log"
    proc = _actor_process(lr, spool, log)
    try:
        wait_for(lambda: lr.stored() >= 3 and len(list(spool.glob("*.traj"))) >= 3,
                 "stored and spooled episodes")  # fmt: skip
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    finished = {p.stem for p in spool.glob("*.traj")} | set(lr.ingest.seen._ids)
    proc = _actor_process(lr, spool, log)
    try:
        wait_for(lambda: log.read_text().count("environments, spool") == 2, "the restart")
        wait_for(lambda: finished <= set(lr.ingest.seen._ids), "every finished trajectory")
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # the actor dumps its stacks into the log
            time.sleep(2)
            raise AssertionError(log.read_text()[-6000:]) from None
        assert rc == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not list(spool.glob("*.traj")) and not list(spool.glob("*.tmp"))
    trajs = lr.drain()
    ids = [t.trajectory_id for t in trajs]
    assert len(ids) == len(set(ids))  # exactly once
    assert finished <= set(ids)
    for tr in trajs:
        check_trajectory(tr, lr.tasks[tr.task_id])
    text = log.read_text()
    assert "trajectories in the spool from an earlier run" in text
    assert "episodes" in text and "spool" in text  # the progress line


def test_cli_rejects_a_bad_field() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "arpo.actor.cli", "sim_env=8"], capture_output=True, text=True
    )
    assert p.returncode == 2 and "sim_envs" in p.stderr
    p = subprocess.run(
        [sys.executable, "-m", "arpo.actor.cli", "policy=scripted"], capture_output=True, text=True
    )
    assert p.returncode == 2 and "sim_envs=N" in p.stderr


def test_full_spool_stops_new_episodes_and_drops_nothing(learner_factory, tmp_path: Path) -> None:
    tasks = sim_tasks(per_family=1, families=["click_button", "menu_pick"])
    lr = learner_factory(tasks, GrantConfig(group_size=4, groups_per_step=10, max_staleness=0))
    lr.stop_ingest()  # nothing is acknowledged: the spool can only grow
    cfg = ActorConfig(
        sim_envs=2,
        policy="scripted",
        spool_dir=str(tmp_path / "spool"),
        spool_max_bytes=600_000,  # a few trajectories (each a few 100 KB of PNGs)
        transport=lr.transport(ack_timeout_s=2.0),
        progress_s=0,
    )

    async def go() -> tuple[Actor, int]:
        actor = Actor(cfg)
        run = asyncio.create_task(actor.run())
        await async_wait_for(lambda: actor.spool.full, "a full spool")
        # Episodes under way when it filled still finish and are kept; no new one starts.
        await async_wait_for(lambda: actor._episodes_running == 0, "running episodes to end")
        at_full = actor.stats.episodes
        await asyncio.sleep(2.0)
        assert actor.stats.episodes == at_full and actor._episodes_running == 0
        await asyncio.to_thread(lr.start_ingest)
        await async_wait_for(lambda: actor.stats.episodes > at_full, "episodes after the drain")
        actor.stop()
        await asyncio.wait_for(run, 120)
        return actor, at_full

    actor, at_full = asyncio.run(go())
    trajs = lr.drain()
    assert len(trajs) == actor.stats.episodes > at_full  # every episode delivered, none dropped
    assert len({t.trajectory_id for t in trajs}) == len(trajs)


@pytest.mark.parametrize("field", ["env_pool", "sim_pool"])
def test_config_rejects_an_empty_pool(field: str) -> None:
    from arpo.config import load_config
    from arpo.errors import ConfigError

    with pytest.raises(ConfigError, match=field):
        load_config(ActorConfig, None, ["sim_envs=1", "policy='scripted'", f"{field}=''"])


def test_a_grant_for_unpublished_weights_does_not_poll_the_learner_hot(
    learner_factory, tmp_path: Path
) -> None:
    """A grant asks for policy v5 while the learner has published only v1: the actor asks for
    weights with a capped backoff (before: about 90 requests a second), and once v5 is
    published it takes it and runs the episode."""
    tasks = sim_tasks(per_family=1)
    lr = learner_factory(tasks, GrantConfig(group_size=1, groups_per_step=1, max_staleness=0))
    lr.grants.publish_weights(1, b"weights-v1" * 10)
    lr.book.set_version(5)  # grants now carry min_version 5; no such weights yet
    cfg = ActorConfig(
        actor_id="waiter",
        sim_envs=1,
        policy="scripted",
        spool_dir=str(tmp_path / "spool"),
        transport=lr.transport(heartbeat_s=0.2),
        progress_s=0,
    )

    async def go() -> Actor:
        actor = Actor(cfg)
        run = asyncio.create_task(actor.run())
        await async_wait_for(lambda: actor.stats.weight_waits >= 1, "a grant waiting for v5")
        before = lr.grants.weight_requests
        await asyncio.sleep(4.0)
        polled = lr.grants.weight_requests - before
        assert polled <= 20, f"{polled} weights requests in 4 s"
        assert lr.stored() == 0 and actor.version == 1
        await asyncio.to_thread(lr.grants.publish_weights, 5, b"weights-v5" * 10)
        await async_wait_for(lambda: lr.stored() >= 1, "the episode with v5", timeout=60)
        actor.stop()
        await asyncio.wait_for(run, 120)
        return actor

    actor = asyncio.run(go())
    assert actor.version == 5

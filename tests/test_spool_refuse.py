"""Nothing acknowledged is lost, nothing of the user's is touched: a trajectory the store
can never hold is refused (never acknowledged) and kept aside by the actor; the spool
opens only a folder that is its own."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from arpo.actor.actor import Actor
from arpo.actor.config import ActorConfig
from arpo.actor.episode import EpisodeConfig
from arpo.actor.spool import MARKER, Spool
from arpo.buffer import ReplayStore
from arpo.env.environment import EnvironmentConfig
from arpo.record import Trajectory
from arpo.service.grants import GrantBook, GrantConfig, GrantServer
from arpo.service.ingest import Ingest, IngestConfig
from arpo.transport import TransportConfig


def test_the_spool_never_opens_a_folder_holding_someone_elses_files(tmp_path: Path) -> None:
    user = tmp_path / "mine"
    user.mkdir()
    (user / "draft.tmp").write_text("a user's unsaved work")
    (user / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="holds files a spool did not write") as e:
        Spool(user)
    assert "draft.tmp" in str(e.value) and "spool_dir" in str(e.value)
    assert (user / "draft.tmp").read_text() == "a user's unsaved work"  # untouched
    with pytest.raises(ValueError, match="spool_dir"):
        Spool("")
    # A new folder becomes the spool's (marker); its own crash leftovers go, nothing else.
    s = Spool(tmp_path / "spool")
    assert (tmp_path / "spool" / MARKER).is_file()
    s.put(Trajectory(task_id="t", turns=(), checker_score=0.0, trajectory_id="abc"))
    (tmp_path / "spool" / "dead.traj.tmp").write_bytes(b"half written")
    assert Spool(tmp_path / "spool").ids() == ["abc"]
    assert not (tmp_path / "spool" / "dead.traj.tmp").exists()
    # An older spool's folder (no marker, only a spool's files) is adopted as it is.
    (tmp_path / "spool" / MARKER).unlink()
    assert Spool(tmp_path / "spool").ids() == ["abc"]


def test_a_trajectory_larger_than_the_store_is_refused_and_kept_never_lost(
    tmp_path: Path,
) -> None:
    from arpo_envs.sim.tasks import generate_tasks

    tasks = generate_tasks("click_button", 2, seed=3)
    # A byte budget below one episode (a 1280x720 PNG alone is larger): nothing fits.
    store = ReplayStore(max_bytes=4096, fresh_capacity=64, seed=0)
    book = GrantBook(tasks, GrantConfig(group_size=2, groups_per_step=2, max_staleness=0))
    grants = GrantServer(book, TransportConfig(control="tcp://127.0.0.1:0"))
    control = grants.start()
    ingest = Ingest(store, IngestConfig(), TransportConfig(data="tcp://127.0.0.1:0"),
                    on_trajectory=book.complete)  # fmt: skip
    data = ingest.start()
    cfg = ActorConfig(
        actor_id="actor-r", sim_envs=2, policy="scripted", spool_dir=str(tmp_path / "spool"),
        transport=TransportConfig(data=data, control=control, heartbeat_s=0.2,
                                  ack_timeout_s=0.5),
        episode=EpisodeConfig(scroll_clicks=1), progress_s=0, max_episodes=3,
    )  # fmt: skip

    async def go() -> Actor:
        actor = Actor(cfg)
        run = asyncio.create_task(actor.run())
        end = time.monotonic() + 120
        while actor.stats.refused < 3:
            assert time.monotonic() < end, actor.stats
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.5)  # three ack timeouts: a refused one is never sent again
        sent = actor.stats.sent
        await asyncio.sleep(1.5)
        assert actor.stats.sent == sent
        actor.stop()
        await asyncio.wait_for(run, 60)
        return actor

    try:
        actor = asyncio.run(go())
    finally:
        ingest.stop()
        grants.stop()
    n = actor.stats.episodes
    assert n >= 3 and actor.stats.acked == 0 and actor.stats.refused == n
    assert sum(store.fresh_len(t) for t in store.tasks()) == 0
    kept = sorted(p.name for p in (tmp_path / "spool" / "refused").glob("*.traj"))
    assert len(kept) == n  # every refused trajectory is still on disk
    reason = next((tmp_path / "spool" / "refused").glob("*.reason")).read_text()
    assert "above its whole budget of 4096 bytes" in reason and "store_max_bytes" in reason
    assert ingest.stats()["rejected"].get("refused_too_large", 0) >= n
    assert len(actor.spool) == 0


def test_a_desktop_that_answers_but_cannot_reset_burns_one_grant_not_one_per_recheck(
    tmp_path: Path,
) -> None:
    """Its /platform answers (a recheck by liveness alone would let it rejoin at once), its
    /reset answers garbage: the actor's recheck probes the reset itself and keeps it out."""
    from aiohttp import web
    from arpo_envs.sim.tasks import generate_tasks

    resets = {"n": 0}

    async def reset(request: web.Request) -> web.Response:
        resets["n"] += 1
        return web.Response(text="[" * 50_000 + "]" * 50_000, content_type="application/json")

    async def platform(request: web.Request) -> web.Response:
        return web.Response(text="Linux")

    tasks = generate_tasks("click_button", 2, seed=3)
    store = ReplayStore(max_bytes=1 << 30, fresh_capacity=4096, seed=0)
    book = GrantBook(tasks, GrantConfig(group_size=2, groups_per_step=1000, max_staleness=0,
                                        max_attempts=1000))  # fmt: skip
    grants = GrantServer(book, TransportConfig(control="tcp://127.0.0.1:0"))
    control = grants.start()
    ingest = Ingest(store, IngestConfig(), TransportConfig(data="tcp://127.0.0.1:0"),
                    on_trajectory=book.complete)  # fmt: skip
    data = ingest.start()

    async def go() -> Actor:
        app = web.Application()
        app.router.add_post("/reset", reset)
        app.router.add_get("/platform", platform)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        bad = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        cfg = ActorConfig(
            actor_id="actor-g", sim_envs=1, envs=[bad], env_pool="sim", policy="scripted",
            spool_dir=str(tmp_path / "spool"), env_recheck_s=0.2,
            transport=TransportConfig(data=data, control=control, heartbeat_s=0.2),
            episode=EpisodeConfig(scroll_clicks=1),
            environment=EnvironmentConfig(reset_retries=1, reset_backoff_s=0.1),
            progress_s=0,
        )  # fmt: skip
        actor = Actor(cfg)
        run = asyncio.create_task(actor.run())
        await asyncio.sleep(8.0)
        actor.stop()
        await asyncio.wait_for(run, 60)
        await runner.cleanup()
        return actor

    try:
        actor = asyncio.run(go())
    finally:
        ingest.stop()
        grants.stop()
    assert actor.stats.by_status.get("ok", 0) > 5  # the good desktop kept working
    assert actor.stats.by_status.get("env_error", 0) == 1, actor.stats.by_status
    assert 2 <= resets["n"] <= 8, resets  # one failed reset, then the backed-off probes

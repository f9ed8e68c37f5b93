"""No lost episode holds a group: an episode that ends without a trajectory (the engine
failed) gives its grant back at once over the control link (`GrantRelease`), and the slot is
granted again, so a run with a 30-minute grant timeout does not wait for it."""

from __future__ import annotations

import time
from pathlib import Path

from arpo_envs.sim.tasks import write_tasks
from conftest import SCRIPTED_ACTOR, ListStore, loopback

from arpo import wire
from arpo.config import validate
from arpo.env.task import load_task_pool
from arpo.pool.collect import CollectConfig, run_collect
from arpo.service.grants import GrantBook, GrantConfig


def test_wire_round_trip_and_validation() -> None:
    msg = wire.GrantRelease("actor-0", 7, "t/0-g1/2/1", "policy_error")
    assert wire.decode(wire.encode(msg)) == msg


def test_a_released_grant_is_granted_again_then_given_up(tmp_path: Path) -> None:
    write_tasks(tmp_path, ["click_button"], n=1, seed=1)
    book = GrantBook(load_task_pool(tmp_path), GrantConfig(group_size=1, max_attempts=2))
    abandoned: list[str] = []
    book.on_abandon = abandoned.append
    g1 = book.request("a", 1, pool="sim")[0]
    assert book.release(g1.grant_id, "a", "policy_error")
    assert not book.release(g1.grant_id, "a", "policy_error")  # once only
    g2 = book.request("a", 1, pool="sim")[0]
    assert (g2.group, g2.slot) == (g1.group, g1.slot) and g2.grant_id != g1.grant_id
    assert book.release(g2.grant_id, "a", "policy_error")  # the second attempt: given up
    assert abandoned == [g1.task_id]
    assert book.counts["released"] == 2 and book.counts["release_unknown"] == 1


def test_engine_faults_do_not_hold_a_run(tmp_path: Path) -> None:
    write_tasks(tmp_path / "pool", ["click_button", "menu_pick"], n=2, seed=4)
    cfg = validate(
        CollectConfig(
            tasks=str(tmp_path / "pool"),
            model="scripted",
            runs_per_task=3,
            max_attempts=20,
            grant_timeout_s=1800.0,  # a lost grant would hold the run for 30 minutes
            out=str(tmp_path / "collect"),
            transport=loopback(),
            local_actor_args=[*SCRIPTED_ACTOR, "scripted_error_prob=0.3"],
            local_actor_log=str(tmp_path / "actor.log"),
            timeout_s=120,
            progress_s=0,
        )
    )
    t0 = time.monotonic()
    result = run_collect(cfg, store=ListStore())
    assert result["complete"] is True
    assert time.monotonic() - t0 < 90
    assert all(c["runs"] == 3 for c in result["tasks"].values())
    log = (tmp_path / "actor.log").read_text()
    assert "given back (policy_error)" in log


def test_a_release_by_another_actor_or_with_made_up_reasons_changes_nothing(
    tmp_path: Path,
) -> None:
    """A grant id is guessable (task/epoch-group/slot/attempt): another sender releasing it
    must not take the slot from the actor running it; the reasons a sender writes must not
    grow the counters."""
    write_tasks(tmp_path, ["click_button"], n=1, seed=1)
    book = GrantBook(load_task_pool(tmp_path), GrantConfig(group_size=2, max_attempts=500))
    g = book.request("a", 1, pool="sim")[0]
    assert not book.release(g.grant_id, "intruder", "policy_error")
    assert book.counts["release_not_holder"] == 1 and book.counts["released"] == 0
    # the slot is still a's: the next request gets the group's other slot, not this one
    other = book.request("b", 1, pool="sim")[0]
    assert (other.group, other.slot) == (g.group, 1 - g.slot)
    before = len(book.counts)
    for i in range(200):
        assert book.release(g.grant_id, "a", f"made-up reason {i}")
        g = book.request("a", 1, pool="sim")[0]
    assert book.counts["released_other"] == 200
    assert len(book.counts) <= before + 2  # released and released_other


def test_the_grant_server_keeps_nothing_per_heartbeat_sender(tmp_path: Path) -> None:
    """20,000 heartbeats from distinct senders: each answered, no per-sender state kept."""
    import tracemalloc

    from arpo.service.grants import GrantServer
    from arpo.transport import TransportConfig

    write_tasks(tmp_path, ["click_button"], n=1, seed=1)
    server = GrantServer(
        GrantBook(load_task_pool(tmp_path), GrantConfig()), TransportConfig(control="inproc://x")
    )

    def beat(i: int) -> None:
        hb = wire.Heartbeat(f"actor-{i}", "actor", 1, 0, time.time(), {"episodes": 1.0})
        (reply,) = server.handle(wire.encode(hb))
        assert isinstance(wire.decode(reply), wire.Heartbeat)

    for i in range(200):  # warm up
        beat(i)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(200, 20_200):
        beat(i)
    grown = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert grown < 200_000, f"{grown} bytes kept after 20,000 senders"

"""A lost actor holds no slot for long: every grant of an actor not heard from for
`silent_actor_s` (no heartbeat, no request) goes to the next actor that asks, long before
the grant timeout; an actor that keeps sending heartbeats keeps its grants."""

from __future__ import annotations

from pathlib import Path

import pytest
from arpo_envs.sim.tasks import write_tasks

from arpo.env.task import load_task_pool
from arpo.errors import ConfigError
from arpo.service.grants import GrantBook, GrantConfig


def _book(tmp_path: Path, **kw: float) -> GrantBook:
    write_tasks(tmp_path, ["click_button"], n=2, seed=1)
    cfg = GrantConfig(group_size=2, groups_per_step=1, max_staleness=0, grant_timeout_s=1800, **kw)
    return GrantBook(load_task_pool(tmp_path), cfg)


def test_a_silent_actors_grants_are_issued_again(tmp_path: Path) -> None:
    book = _book(tmp_path, silent_actor_s=30.0)
    lost = book.request("node-a", 2, now=0.0, pool="sim")
    assert len(lost) == 2
    book.seen("node-b", now=10.0)
    assert book.request("node-b", 2, now=20.0, pool="sim") == []  # node-a heard 20 s ago
    again = book.request("node-b", 2, now=31.0, pool="sim")
    assert [(g.group, g.slot) for g in again] == [(g.group, g.slot) for g in lost]
    assert all(g.grant_id not in {x.grant_id for x in lost} for g in again)
    assert book.counts["reissued_silent"] == 2 and book.counts["reissued"] == 0


def test_heartbeats_keep_an_actors_grants(tmp_path: Path) -> None:
    book = _book(tmp_path, silent_actor_s=30.0)
    assert len(book.request("busy", 2, now=0.0, pool="sim")) == 2
    for t in range(10, 100, 10):
        book.seen("busy", now=float(t))  # long episodes: no request, heartbeats only
    assert book.request("other", 2, now=100.0, pool="sim") == []
    assert book.counts["reissued_silent"] == 0


def test_zero_turns_it_off(tmp_path: Path) -> None:
    book = _book(tmp_path, silent_actor_s=0.0)
    book.request("gone", 2, now=0.0, pool="sim")
    assert book.request("other", 2, now=1000.0, pool="sim") == []


def test_a_negative_window_is_refused() -> None:
    with pytest.raises(ConfigError, match="silent_actor_s"):
        GrantConfig(silent_actor_s=-1.0)


def test_heartbeats_over_the_data_link_reach_the_book(tmp_path: Path) -> None:
    """The learner's wiring (`Ingest.on_actor_heartbeat = book.seen`) over a real socket:
    an actor that only sends heartbeats keeps its grants; one that stops loses them."""
    import time

    import zmq

    from arpo import wire
    from arpo.buffer import ReplayStore
    from arpo.service.ingest import Ingest, IngestConfig
    from arpo.transport import TransportConfig, connect_dealer

    book = _book(tmp_path, silent_actor_s=1.0)
    ctx = zmq.Context()
    tc = TransportConfig(data="tcp://127.0.0.1:0")
    store = ReplayStore(max_bytes=1 << 24, fresh_capacity=8, seed=0)
    ingest = Ingest(store, IngestConfig(), tc, version=lambda: 0)
    ingest.on_actor_heartbeat = book.seen
    sock = connect_dealer(ctx, ingest.start(), tc)
    try:
        assert len(book.request("alive", 2, pool="sim")) == 2
        for seq in range(8):  # 2 s of heartbeats, each answered
            sock.send_multipart(wire.encode(wire.Heartbeat("alive", "actor", seq, 0, time.time())))
            assert sock.poll(5000), "the ingest did not answer a heartbeat"
            sock.recv_multipart()
            time.sleep(0.25)
        assert book.request("other", 2, pool="sim") == []
        time.sleep(1.2)  # the heartbeats stop
        assert len(book.request("other", 2, pool="sim")) == 2
        assert book.counts["reissued_silent"] == 2
    finally:
        sock.close(0)
        ingest.stop()
        store.close()
        ctx.term()

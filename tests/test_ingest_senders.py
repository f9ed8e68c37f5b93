"""The ingest's per-sender state is bounded: 20,000 heartbeats from distinct actor ids leave at
most `max_senders` tracked, the rest dropped and counted, and a real actor is still served."""

from __future__ import annotations

import time

import numpy as np
import zmq
from conftest import make_trajectory

from arpo import wire
from arpo.buffer import ReplayStore
from arpo.service.ingest import Ingest, IngestConfig
from arpo.transport import TransportConfig, connect_dealer

SENDERS = 20_000


def test_heartbeats_of_20000_senders_are_bounded_and_counted(png_pool: list[bytes]) -> None:
    ctx = zmq.Context()
    store = ReplayStore(max_bytes=1 << 28, fresh_capacity=64, seed=0)
    tc = TransportConfig(data="tcp://127.0.0.1:0")
    cfg = IngestConfig()
    ingest = Ingest(store, cfg, tc, version=lambda: 0)
    sock = connect_dealer(ctx, ingest.start(), tc)
    try:
        for i in range(SENDERS):
            hb = wire.Heartbeat(f"actor-{i}", "actor", 0, 0, time.time(), {"episodes": 1})
            sock.send_multipart(wire.encode(hb))
            while sock.poll(0):
                sock.recv_multipart()
        end = time.monotonic() + 60
        while ingest.stats()["heartbeats"] < SENDERS and time.monotonic() < end:
            while sock.poll(50):
                sock.recv_multipart()
        stats = ingest.stats()
        assert stats["heartbeats"] == SENDERS, stats
        assert stats["actors"] == cfg.max_senders, stats
        assert stats["senders_dropped"] == SENDERS - cfg.max_senders, stats
        # the newest senders are the ones kept, and their counters are the ones summed
        assert "actor-19999" in ingest.actors and "actor-0" not in ingest.actors
        assert ingest.actor_totals(("episodes",)) == {"episodes": float(cfg.max_senders)}

        t = make_trajectory(np.random.default_rng(0), turns=2, tokens=200, pngs=png_pool)
        sock.send_multipart(wire.encode(t))
        end = time.monotonic() + 30
        acked = False
        while not acked and time.monotonic() < end:
            if sock.poll(100):
                acked = wire.decode(sock.recv_multipart()) == wire.Ack((t.trajectory_id,))
        assert acked and store.fresh_len(t.task_id) == 1
    finally:
        sock.close(0)
        ingest.stop()
        ctx.term()


def test_a_silent_sender_expires() -> None:
    ctx = zmq.Context()
    store = ReplayStore(max_bytes=1 << 24, fresh_capacity=8, seed=0)
    tc = TransportConfig(data="tcp://127.0.0.1:0")
    ingest = Ingest(store, IngestConfig(sender_expiry_s=0.2), tc, version=lambda: 0)
    sock = connect_dealer(ctx, ingest.start(), tc)
    try:
        for name in ("old", "new"):
            sock.send_multipart(wire.encode(wire.Heartbeat(name, "actor", 0, 0, time.time(), {})))
            assert sock.poll(30_000)
            sock.recv_multipart()
            time.sleep(0.3 if name == "old" else 0)
        assert list(ingest.actors) == ["new"] and ingest.stats()["senders_dropped"] == 1
    finally:
        sock.close(0)
        ingest.stop()
        ctx.term()

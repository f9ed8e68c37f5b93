"""The learner's ingest on a real socket: store + ack, duplicates, garbage, oversize, restarts."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from conftest import make_trajectory

from arpo import store_item, wire
from arpo.buffer import ReplayStore
from arpo.record import Status, Trajectory
from arpo.service.ingest import Ingest, IngestConfig
from arpo.transport import TransportConfig, connect_dealer

TIMEOUT_MS = 30_000


def _reply(sock: zmq.Socket) -> wire.Message | None:
    if not sock.poll(TIMEOUT_MS):
        return None
    return wire.decode(sock.recv_multipart())


def _no_reply(sock: zmq.Socket) -> bool:
    return not sock.poll(300)


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def _traj(seed: int, png_pool: list[bytes], **kw) -> Trajectory:
    t = make_trajectory(np.random.default_rng(seed), turns=4, tokens=2000, pngs=png_pool)
    if kw:
        t = Trajectory(**{**{f: getattr(t, f) for f in t.__slots__}, **kw})
    return t


def test_ingest_stores_acks_and_survives_everything(
    ctx: zmq.Context, tmp_path: Path, png_pool: list[bytes]
) -> None:
    store = ReplayStore(max_bytes=1 << 30, fresh_capacity=64, seed=0)
    tc = TransportConfig(data="tcp://127.0.0.1:0", max_trajectory_bytes=2 << 20)
    seen_log = tmp_path / "seen.log"
    ingest = Ingest(store, IngestConfig(seen_log=str(seen_log)), tc, version=lambda: 7)
    endpoint = ingest.start()
    sock = connect_dealer(ctx, endpoint, tc)
    try:
        first = _traj(1, png_pool)
        frames = [bytes(f) for f in wire.encode(first)]
        sock.send_multipart(frames)
        assert _reply(sock) == wire.Ack((first.trajectory_id,))
        assert store.fresh_len(first.task_id) == 1
        (item,) = store.take_group(first.task_id, 1, timeout=0)
        assert store_item.from_item(item) == first  # exactly what the actor sent
        store.put(first.task_id, item)

        # Replayed: acknowledged again (the actor lost our ack), never stored twice.
        sock.send_multipart(frames)
        assert _reply(sock) == wire.Ack((first.trajectory_id,))
        assert store.fresh_len(first.task_id) == 1

        # Garbage, truncated, wrong-kind and oversized messages: counted, no reply, no stop.
        bad = [
            [b"hello"],
            [b"GET / HTTP/1.1\r\n\r\n"],
            [struct.pack("<4sBBH", b"ARPO", 9, 1, 0), b"\x80"],
            frames[:-1],  # a PNG frame missing
            [*frames[:-1], frames[-1][:100]],  # a PNG cut short
            [frames[0], frames[1][:-3], *frames[2:]],  # header cut short
            [frames[0], b"\xff" * 64, *frames[2:]],
            [bytes(f) for f in wire.encode(wire.GrantRequest("a", 1, 1))],  # wrong link
            [*frames[:5], *([frames[5]] * 40)],  # 40 PNGs of ~90 KB: above 2 MB
            [b""] * 1000,
        ]
        for msg in bad:
            sock.send_multipart(msg)
        assert _no_reply(sock)
        _wait(lambda: ingest.stats().get("rejected_total", 0) == len(bad), "rejections")
        rejected = ingest.stats()["rejected"]
        assert rejected == {"malformed": 8, "unexpected": 1, "oversized": 1}, rejected

        # A heartbeat is answered with the learner's version.
        sock.send_multipart(wire.encode(wire.Heartbeat("actor-x", "actor", 1, 0, time.time())))
        hb = _reply(sock)
        assert isinstance(hb, wire.Heartbeat) and hb.role == "learner" and hb.version == 7

        # Environment faults are delivered (acked) but kept out of the training store.
        env_err = _traj(2, png_pool, status=Status.ENV_ERROR, checker_score=0.0, reward=0.0)
        sock.send_multipart(wire.encode(env_err))
        assert _reply(sock) == wire.Ack((env_err.trajectory_id,))
        assert store.fresh_len(env_err.task_id) == 1
        assert ingest.stats()["excluded_env_error"] == 1

        # Still serving after all that.
        second = _traj(3, png_pool)
        sock.send_multipart(wire.encode(second))
        assert _reply(sock) == wire.Ack((second.trajectory_id,))
        assert ingest.stats()["stored"] == 2 and ingest.stats()["duplicates"] == 1
    finally:
        sock.close(0)
        ingest.stop()

    # A restarted learner reloads the ids it stored and still drops the duplicate.
    again = Ingest(store, IngestConfig(seen_log=str(seen_log)), tc)
    endpoint = again.start()
    sock = connect_dealer(ctx, endpoint, tc)
    try:
        sock.send_multipart(frames)
        assert _reply(sock) == wire.Ack((first.trajectory_id,))
        assert again.stats()["duplicates"] == 1 and store.fresh_len(first.task_id) == 2
    finally:
        sock.close(0)
        again.stop()
        store.close()


def test_frames_above_the_socket_limit_drop_the_peer_not_the_learner(
    ctx: zmq.Context, png_pool: list[bytes]
) -> None:
    store = ReplayStore(max_bytes=1 << 30, seed=0)
    tc = TransportConfig(data="tcp://127.0.0.1:0", max_message_bytes=1 << 20)
    ingest = Ingest(store, transport=tc)
    endpoint = ingest.start()
    try:
        rogue = connect_dealer(ctx, endpoint, tc)
        rogue.send_multipart([b"x" * (4 << 20)])
        time.sleep(0.5)
        rogue.close(0)
        good = connect_dealer(ctx, endpoint, tc)
        t = _traj(4, png_pool)
        good.send_multipart(wire.encode(t))
        assert _reply(good) == wire.Ack((t.trajectory_id,))
        good.close(0)
    finally:
        ingest.stop()
        store.close()


def test_seen_ids_are_bounded(tmp_path: Path) -> None:
    from arpo.service.ingest import SeenIds

    seen = SeenIds(3, tmp_path / "ids", fsync_every=2)
    for i in range(10):
        seen.add(f"id{i}")
    assert len(seen) == 3 and "id9" in seen and "id6" not in seen
    seen.close()
    reloaded = SeenIds(3, tmp_path / "ids")
    assert [i in reloaded for i in ("id7", "id8", "id9", "id6")] == [True, True, True, False]
    reloaded.close()
    assert len((tmp_path / "ids").read_text().split()) <= 2 * 3 + 1  # compacted


def test_a_large_trajectory_is_measured_once_and_stored(
    tmp_path: Path, png_pool: list[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trajectory near the store's budget is turned into its store item once: the item
    built to measure it (is it above the whole budget?) is the one stored."""
    traj = _traj(7, png_pool)
    size = store_item.to_item(traj).nbytes
    store = ReplayStore(max_bytes=size + 1024, seed=0)  # it fits, and it is large
    assert traj.png_bytes + 4 * traj.num_tokens > store.max_bytes // 2
    built = []
    real = store_item.to_item
    monkeypatch.setattr(store_item, "to_item", lambda t: built.append(t.trajectory_id) or real(t))
    ingest = Ingest(store, IngestConfig(), TransportConfig(data="tcp://127.0.0.1:0"))
    [reply] = ingest.handle(wire.encode(traj))
    assert isinstance(wire.decode(reply), wire.Ack)
    assert built == [traj.trajectory_id]
    assert store.fresh_len(traj.task_id) == 1

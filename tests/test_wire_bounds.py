"""Every integer of a trajectory is bounded at the wire, and nothing the store refused is acked.

A policy version of 2^63 used to be acknowledged by the ingest and then refused by the replay
store (its versions are signed 64-bit), so the actor dropped it from its spool and it was
lost. Now the decoder refuses it, counted with the field named, and the actor keeps it; the
largest version the store holds (2^63 - 1) goes through, stored and acknowledged. A store
that refuses a record for any other reason gets no acknowledgement either.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zmq
from conftest import make_trajectory

from arpo import wire
from arpo.buffer import ReplayStore
from arpo.errors import RecordError, WireError
from arpo.record import MAX_VERSION, Turn
from arpo.service.ingest import Ingest, IngestConfig
from arpo.transport import TransportConfig, connect_dealer


def _with_header(frames: list, **changes) -> list[bytes]:
    """The frames of a trajectory with header fields (or turns[0] entries) changed."""
    out = [bytes(f) for f in frames]
    header = msgpack.unpackb(out[1])
    for key, value in changes.items():
        if key.startswith("turn0_"):
            header["turns"][0][int(key.removeprefix("turn0_"))] = value
        else:
            header[key] = value
    out[1] = msgpack.packb(header)
    return out


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"turn0_3": 1 << 63}, "turns[0]"),  # the policy version
        ({"turn0_3": (1 << 64) - 1}, "turns[0]"),
        ({"turn0_3": -1}, "turns[0]"),
        ({"turn0_0": (1 << 64) - 1}, "turns[0]"),  # a prompt length
        ({"slot": 1 << 40}, "slot"),
        ({"score": float("inf")}, "checker_score"),
    ],
)
def test_the_decoder_refuses_integers_out_of_range_naming_the_field(
    png_pool: list[bytes], change: dict, field: str
) -> None:
    t = make_trajectory(np.random.default_rng(0), turns=2, tokens=200, pngs=png_pool)
    frames = _with_header(wire.encode(t), **change)
    with pytest.raises(WireError, match=field.replace("[", r"\[").replace("]", r"\]")):
        wire.decode(frames)


def test_a_record_cannot_carry_a_version_the_store_cannot_hold(png_pool: list[bytes]) -> None:
    t = make_trajectory(np.random.default_rng(0), turns=1, tokens=50, pngs=png_pool)
    (turn,) = t.turns
    fields = {f: getattr(turn, f) for f in turn.__slots__}
    with pytest.raises(RecordError, match="policy_version"):
        Turn(**{**fields, "policy_version": MAX_VERSION + 1})
    assert Turn(**{**fields, "policy_version": MAX_VERSION}).policy_version == MAX_VERSION


def test_the_ingest_acks_only_what_the_store_took(png_pool: list[bytes]) -> None:
    ctx = zmq.Context()
    store = ReplayStore(max_bytes=1 << 28, fresh_capacity=64, seed=0)
    tc = TransportConfig(data="tcp://127.0.0.1:0")
    ingest = Ingest(store, IngestConfig(), tc, version=lambda: 0)
    sock = connect_dealer(ctx, ingest.start(), tc)
    try:
        rng = np.random.default_rng(3)
        over = make_trajectory(rng, turns=2, tokens=200, pngs=png_pool)
        sock.send_multipart(_with_header(wire.encode(over), turn0_3=1 << 63))
        assert not sock.poll(500), "a record the store cannot hold was acknowledged"
        top = make_trajectory(rng, turns=2, tokens=200, pngs=png_pool)
        sock.send_multipart(_with_header(wire.encode(top), turn0_3=MAX_VERSION))
        assert sock.poll(30_000)
        assert wire.decode(sock.recv_multipart()) == wire.Ack((top.trajectory_id,))
        assert sum(store.fresh_len(t) for t in {top.task_id, over.task_id}) == 1
        stats = ingest.stats()
        assert stats["rejected"].get("malformed") == 1, stats

        # A store that refuses a record (here: closed under the ingest's feet would be a
        # shutdown; a put that raises anything else) is a counted rejection, not an ack.
        class Refusing:
            def put(self, *a, **k):
                raise ValueError("refused")

            def __getattr__(self, name):
                return getattr(store, name)

        ingest.store = Refusing()
        third = make_trajectory(rng, turns=2, tokens=200, pngs=png_pool)
        sock.send_multipart([bytes(f) for f in wire.encode(third)])
        assert not sock.poll(500), "a record the store refused was acknowledged"
        assert ingest.stats()["rejected"].get("store_error") == 1
        ingest.store = store
        sock.send_multipart([bytes(f) for f in wire.encode(third)])  # the actor's resend
        assert sock.poll(30_000)
        assert wire.decode(sock.recv_multipart()) == wire.Ack((third.trajectory_id,))
    finally:
        sock.close(0)
        ingest.stop()
        ctx.term()

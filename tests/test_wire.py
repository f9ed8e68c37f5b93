"""The wire format: round trips, zero-copy decoding, and every malformed input."""

from __future__ import annotations

import math
import struct
from dataclasses import replace

import msgpack
import numpy as np
import pytest
import zmq
from conftest import make_png, make_trajectory
from hypothesis import given, settings
from hypothesis import strategies as st

from arpo import store_item, wire
from arpo.errors import RecordError, WireError
from arpo.record import PNG_SIGNATURE, Status, Trajectory, Turn, ident_problem


def roundtrip(t: Trajectory) -> Trajectory:
    out = wire.decode(wire.encode(t))
    assert isinstance(out, Trajectory)
    return out


def test_realistic_roundtrip(realistic: Trajectory) -> None:
    assert realistic.steps == 15
    assert 19_000 <= realistic.num_tokens <= 20_000
    assert realistic.png_bytes > 15 * 80_000
    frames = wire.encode(realistic)
    assert len(frames) == 5 + 15
    # The PNGs are handed to the socket as the record's own objects: no copy.
    assert all(f is t.screenshot for f, t in zip(frames[5:], realistic.turns, strict=True))
    out = wire.decode(frames)
    assert out == realistic
    assert out.turns[3].policy_version == realistic.turns[3].policy_version
    assert out.turns[-1].action == "DONE"
    assert out.timings == {"reset": 0.41, "total": 23.5}
    ids, mask, lps = out.sequence()
    assert len(ids) == out.num_tokens and mask.sum() == sum(len(t.response_ids) for t in out.turns)
    assert np.array_equal(lps[mask], np.concatenate([t.logprobs for t in realistic.turns]))


def test_decode_returns_views_not_copies(realistic: Trajectory) -> None:
    frames = [bytearray(bytes(f)) for f in wire.encode(realistic)]
    out = wire.decode(frames)
    t0 = out.turns[0]
    # Mutating the received frame shows through the decoded record: it is a view.
    frames[2][0:4] = struct.pack("<i", 123456)
    assert t0.prompt_ids[0] == 123456
    frames[5][20] ^= 0xFF
    assert t0.screenshot[20] == frames[5][20]
    assert np.shares_memory(out.turns[1].response_ids, np.frombuffer(frames[3], np.int32))


def test_roundtrip_over_a_real_zmq_socket(realistic: Trajectory) -> None:
    ctx = zmq.Context()
    try:
        pull = ctx.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push = ctx.socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send_multipart(wire.encode(realistic), copy=False)
        assert pull.poll(10_000)
        frames = pull.recv_multipart(copy=False)
        out = wire.decode(frames)
        assert out == realistic
        ack = wire.Ack((out.trajectory_id,))
        push.send_multipart(wire.encode(ack))
        assert pull.poll(10_000)
        assert wire.decode(pull.recv_multipart()) == ack
        push.close(0)
        pull.close(0)
    finally:
        ctx.term()


def _turn(
    version: int = 0, *, png: bytes = b"", n_prompt: int = 3, n_resp: int = 2, action: str = ""
) -> Turn:
    return Turn(
        prompt_ids=np.arange(n_prompt, dtype=np.int32),
        screenshot=png,
        response_ids=np.arange(n_resp, dtype=np.int32) + 7,
        logprobs=np.full(n_resp, -0.5, np.float32),
        policy_version=version,
        action=action,
        parsed=bool(action),
    )


@pytest.mark.parametrize(
    "traj",
    [
        Trajectory(task_id="t", turns=(), checker_score=0.0),
        Trajectory(task_id="t", turns=(_turn(),), checker_score=0.0, status=Status.ENV_ERROR),
        Trajectory(
            task_id="täsk-ü-任务-🚀", turns=(_turn(action=""),), checker_score=0.5, reward=0.5
        ),
        Trajectory(task_id="t", turns=(_turn(n_prompt=0, n_resp=0),), checker_score=0.0),
        Trajectory(
            task_id="t",
            turns=(_turn(1, action="pyautogui.typewrite('héllo\\n')"), _turn(2, action="FAIL")),
            checker_score=0.0,
            format_reward=-1.0,
            reward=-0.5,
            status=Status.TIMEOUT,
            timings={},
        ),
    ],
    ids=["zero-turns", "env-error", "unicode-task", "empty-arrays", "timeout"],
)
def test_edge_case_roundtrips(traj: Trajectory) -> None:
    assert roundtrip(traj) == traj


def test_ack_roundtrip() -> None:
    ack = wire.Ack(("a", "b" * 64, "ü"))
    assert wire.decode(wire.encode(ack)) == ack
    assert wire.decode(wire.encode(wire.Ack(()))) == wire.Ack(())


# ------------------------------------------------------------------ property tests

_text = st.text(max_size=60, alphabet=st.characters(exclude_categories=("Cs",)))
# Ids: printable, no whitespace (`arpo.record.ident_problem`).
_id_chars = st.characters(exclude_categories=("Cs", "Cc", "Cf", "Co", "Cn", "Zs", "Zl", "Zp"))
_name = st.text(min_size=1, max_size=40, alphabet=_id_chars).filter(
    lambda s: ident_problem(s) is None
)
_opt_name = st.one_of(st.just(""), _name)


@st.composite
def turns(draw: st.DrawFn) -> Turn:
    n_p = draw(st.integers(0, 40))
    n_r = draw(st.integers(0, 40))
    i32 = st.integers(-(2**31), 2**31 - 1)
    png = draw(st.one_of(st.just(b""), st.binary(max_size=64).map(lambda b: PNG_SIGNATURE + b)))
    return Turn(
        prompt_ids=np.array(draw(st.lists(i32, min_size=n_p, max_size=n_p)), dtype=np.int32),
        screenshot=png,
        response_ids=np.array(draw(st.lists(i32, min_size=n_r, max_size=n_r)), dtype=np.int32),
        logprobs=np.array(
            draw(st.lists(st.floats(-1e9, 0.0, width=32), min_size=n_r, max_size=n_r)),
            dtype=np.float32,
        ),
        policy_version=draw(st.integers(0, 2**62)),
        action=draw(_text),
        parsed=draw(st.booleans()),
    )


@st.composite
def trajectories(draw: st.DrawFn) -> Trajectory:
    num = st.floats(allow_nan=False, allow_infinity=False)
    return Trajectory(
        task_id=draw(_name),
        turns=tuple(draw(st.lists(turns(), max_size=6))),
        checker_score=draw(num),
        format_reward=draw(num),
        reward=draw(num),
        status=draw(st.sampled_from(list(Status))),
        trajectory_id=draw(_name),
        group_id=draw(_opt_name),
        slot=draw(st.integers(0, 2**31)),
        actor_id=draw(_opt_name),
        timings=draw(st.dictionaries(_name, num, max_size=4)),
    )


@settings(max_examples=300, deadline=None)
@given(trajectories())
def test_roundtrip_property(traj: Trajectory) -> None:
    assert roundtrip(traj) == traj


# ------------------------------------------------------------------ malformed input


def _small() -> Trajectory:
    rng = np.random.default_rng(5)
    return make_trajectory(rng, turns=3, tokens=60, pngs=[make_png(rng, 300)])


def _header(frames: list) -> dict:
    return msgpack.unpackb(frames[1])


def _with_header(frames: list, **changes: object) -> list:
    h = _header(frames)
    h.update(changes)
    return [frames[0], msgpack.packb(h), *frames[2:]]


def _cases() -> list[tuple[str, object, str]]:
    f = [bytes(x) for x in wire.encode(_small())]
    h = _header(f)
    big_turn = list(h["turns"][0])
    big_turn[0] = 2**60
    bad_ver = struct.pack("<4sBBH", b"ARPO", 99, 1, 0)
    return [
        ("not-a-list", b"ARPO", "sequence of frames"),
        ("empty", [], "at least 2 frames"),
        ("one-frame", f[:1], "at least 2 frames"),
        ("bad-magic", [b"XXXX" + f[0][4:], *f[1:]], "bad magic"),
        ("short-preamble", [f[0][:5], *f[1:]], "preamble must be"),
        ("wrong-version", [bad_ver, *f[1:]], "wire version 99"),
        (
            "unknown-kind",
            [struct.pack("<4sBBH", b"ARPO", 1, 77, 0), *f[1:]],
            "unknown message kind",
        ),
        ("reserved", [struct.pack("<4sBBH", b"ARPO", 1, 1, 5), *f[1:]], "reserved"),
        ("garbage-header", [f[0], b"\xc1\xc1\xc1", *f[2:]], "not valid msgpack"),
        ("truncated-header", [f[0], f[1][: len(f[1]) // 2], *f[2:]], "not valid msgpack"),
        ("header-not-map", [f[0], msgpack.packb([1, 2]), *f[2:]], "must be a map"),
        ("missing-frame", f[:-1], "payload frames"),
        ("extra-frame", [*f, b"x"], "payload frames"),
        (
            "missing-key",
            [f[0], msgpack.packb({k: v for k, v in h.items() if k != "task"}), *f[2:]],
            "missing ['task']",
        ),
        ("extra-key", _with_header(f, evil=1), "unexpected ['evil']"),
        ("wrong-type-task", _with_header(f, task=5), "'task' must be a string"),
        ("bool-slot", _with_header(f, slot=True), "'slot' must be an int"),
        ("unknown-status", _with_header(f, status="great"), "unknown status"),
        ("nan-score", _with_header(f, score=float("nan")), "must be finite"),
        ("turn-shape", _with_header(f, turns=[[1, 2], *h["turns"][1:]]), "turns[0] must be"),
        (
            "negative-len",
            _with_header(f, turns=[[-1, *h["turns"][0][1:]], *h["turns"][1:]]),
            "turns[0] must be",
        ),
        ("huge-declared", _with_header(f, turns=[big_turn, *h["turns"][1:]]), "header declares"),
        ("lengths-disagree", [*f[:2], f[2][:-4], *f[3:]], "prompt ids frame has"),
        (
            "int64-tokens",
            [*f[:2], np.frombuffer(f[2], np.int32).astype(np.int64).tobytes(), *f[3:]],
            "prompt ids frame has",
        ),
        ("png-length", [*f[:5], f[5] + b"x", *f[6:]], "PNG frame has"),
        ("not-png", _with_header([*f[:5], b"GIF89a" + f[5][6:], *f[6:]]), "not a PNG"),
        (
            "nan-logprob",
            [*f[:4], np.full(len(f[4]) // 4, np.nan, np.float32).tobytes(), *f[5:]],
            "NaN",
        ),
        ("frame-not-bytes", [f[0], f[1], 12345, *f[3:]], "not a bytes-like"),
        (
            "ext-type",
            [f[0], msgpack.packb({"x": msgpack.ExtType(3, b"")}), *f[2:]],
            "extension type",
        ),
        (
            "too-many-turns",
            _with_header(f, turns=[h["turns"][0]] * (wire.MAX_TURNS + 1)),
            "above the limit",
        ),
        (
            "ack-extra",
            [struct.pack("<4sBBH", b"ARPO", 1, 2, 0), msgpack.packb({"ids": []}), b""],
            "ack has 2 frames",
        ),
        (
            "ack-bad-ids",
            [struct.pack("<4sBBH", b"ARPO", 1, 2, 0), msgpack.packb({"ids": [1]})],
            "ack id must be a string",
        ),
        (
            "ack-id-with-newline",
            [struct.pack("<4sBBH", b"ARPO", 1, 2, 0), msgpack.packb({"ids": ["a\nforged"]})],
            "ack id contains '\\n'",
        ),
        ("deep-nesting", [f[0], b"\x91" * 100_000 + b"\x90", *f[2:]], "not valid msgpack"),
    ]


@pytest.mark.parametrize(("name", "frames", "reason"), _cases(), ids=[c[0] for c in _cases()])
def test_malformed_input_names_the_reason(name: str, frames: object, reason: str) -> None:
    with pytest.raises(WireError) as e:
        wire.decode(frames)  # type: ignore[arg-type]
    assert reason in str(e.value), (name, str(e.value))


def test_fuzz_only_wire_error_is_ever_raised() -> None:
    """100,000 mutated and random messages: only WireError, never anything else."""
    rng = np.random.default_rng(1234)
    seeds = [
        [bytes(x) for x in wire.encode(_small())],
        [bytes(x) for x in wire.encode(wire.Ack(("a", "b")))],
    ]
    seeds.append(
        [bytes(x) for x in wire.encode(Trajectory(task_id="t", turns=(), checker_score=0.0))]
    )
    seeds += [[bytes(x) for x in wire.encode(m)] for m in _control_messages()]
    ok = errors = 0
    for i in range(100_000):
        frames = [bytearray(x) for x in seeds[i % len(seeds)]]
        op = rng.integers(0, 8)
        if op == 0:  # flip random bits in a random frame
            j = rng.integers(0, len(frames))
            for _ in range(rng.integers(1, 4)):
                if frames[j]:
                    k = rng.integers(0, len(frames[j]))
                    frames[j][k] ^= 1 << rng.integers(0, 8)
        elif op == 1:  # overwrite header bytes with random values
            h = frames[1]
            for _ in range(rng.integers(1, 6)):
                if h:
                    h[rng.integers(0, len(h))] = rng.integers(0, 256)
        elif op == 2:  # truncate a frame
            j = rng.integers(0, len(frames))
            frames[j] = frames[j][: rng.integers(0, len(frames[j]) + 1)]
        elif op == 3:  # drop a frame
            del frames[rng.integers(0, len(frames))]
        elif op == 4:  # duplicate a frame
            j = rng.integers(0, len(frames))
            frames.insert(j, frames[j])
        elif op == 5:  # random garbage frames
            frames = [bytearray(rng.bytes(rng.integers(0, 64))) for _ in range(rng.integers(0, 8))]
        elif op == 6:  # valid preamble, random header
            frames = [frames[0], bytearray(rng.bytes(rng.integers(0, 200))), *frames[2:]]
        else:  # swap two frames
            a, b = rng.integers(0, len(frames), 2)
            frames[a], frames[b] = frames[b], frames[a]
        try:
            wire.decode(frames)
            ok += 1
        except WireError:
            errors += 1
    assert ok + errors == 100_000
    assert errors > 50_000  # the mutations really did break most messages


def test_store_item_roundtrip_keeps_png_objects(realistic: Trajectory) -> None:
    from arpo.buffer import ReplayStore

    frames = [bytes(f) for f in wire.encode(realistic)]  # as recv_multipart(copy=True) gives
    decoded = wire.decode(frames)
    item = store_item.to_item(decoded)
    # The received PNG frames go into the store by reference, not copied.
    assert all(b is f for b, f in zip(item.blobs, frames[5:], strict=True))
    store = ReplayStore(max_bytes=1 << 26, seed=0)
    store.put(realistic.task_id, item)
    (got,) = store.take_group(realistic.task_id, 1, timeout=0)
    back = store_item.from_item(got)
    assert back == realistic
    ids, _, _ = back.sequence()
    assert np.array_equal(ids, got.tokens)  # the stored tokens are the training sequence
    assert got.version == realistic.min_version and got.rewards[0] == realistic.reward


def test_store_item_of_frames_received_without_copy_shares_their_memory(
    realistic: Trajectory,
) -> None:
    from arpo.buffer import ReplayStore

    ctx = zmq.Context()
    try:
        pull = ctx.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push = ctx.socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send_multipart(wire.encode(realistic), copy=False)
        assert pull.poll(10_000)
        frames = pull.recv_multipart(copy=False)  # what the learner's ingest receives
        push.close(0)
        pull.close(0)
    finally:
        ctx.term()
    item = store_item.to_item(wire.decode(frames))
    # Each PNG blob is a read-only view of its received frame: same memory, no copy.
    for blob, frame in zip(item.blobs, frames[5:], strict=True):
        assert isinstance(blob, memoryview) and blob.readonly and blob.obj is frame
        assert (
            np.frombuffer(blob, np.uint8).ctypes.data == np.frombuffer(frame, np.uint8).ctypes.data
        )
    del frames
    store = ReplayStore(max_bytes=1 << 26, seed=0)
    store.put(realistic.task_id, item)
    del item
    (got,) = store.take_group(realistic.task_id, 1, timeout=0)
    assert store_item.from_item(got) == realistic  # the store kept the frames alive


def test_store_item_copies_pngs_in_mutable_memory() -> None:
    png = make_png(np.random.default_rng(0), 2_000)
    traj = Trajectory(task_id="t", turns=(_turn(png=png),), checker_score=1.0, reward=1.0)
    frames = [bytearray(bytes(f)) for f in wire.encode(traj)]
    item = store_item.to_item(wire.decode(frames))
    (blob,) = item.blobs
    assert type(blob) is bytes and blob == png  # a bytearray can change: stored as a copy
    frames[-1][10] ^= 0xFF
    assert item.blobs[0] == png


# ------------------------------------------------------------------ control messages


def _control_messages() -> list[wire.Message]:
    grant = wire.Grant("g-1", "task-1", "task-1/0", 3, 7, '{"id": "task-1", "instruction": "x"}')
    return [
        wire.GrantRequest("actor-0", 12, 4),
        wire.GrantRequest("actor-0", 13, 1, "sim"),
        wire.GrantReply(12, (grant, wire.Grant("g-2", "t", "t/1", 0, 0, "{}")), 0.0),
        wire.GrantReply(14, (wire.Grant("g-3", "t", "t/2", 1, 9, "{}", 9, 0.7, 1.0),), 0.0),
        wire.GrantReply(13, (), 0.5),
        wire.Heartbeat("actor-0", "actor", 5, 2, 1.7e9, {"spool": 3, "steps_per_s": 1.5}),
        wire.Heartbeat("learner", "learner", 0, 0, 0.0, {}),
        wire.WeightsAnnounce(4, 10_000, 3, 4096, "ab" * 32, "/tmp/w/v4.safetensors"),
        wire.WeightsAnnounce(0, 0, 0, 1, "00" * 32, ""),
        wire.WeightsRequest(4, -1),
        wire.WeightsRequest(4, 2),
        wire.WeightsChunk(4, 2, 3, b"\x00" * 1808),
        wire.FileRequest("ab" * 32, 0),
        wire.FileChunk("ab" * 32, 1, 3, 9_000_000, "", b"\x01" * 1000),
        wire.FileChunk("cd" * 32, 0, 0, 0, "no task file of this learner has that sha256"),
    ]


@pytest.mark.parametrize("msg", _control_messages(), ids=lambda m: type(m).__name__)
def test_control_message_roundtrip(msg: wire.Message) -> None:
    out = wire.decode([bytes(f) for f in wire.encode(msg)])
    if isinstance(msg, wire.WeightsChunk):
        assert isinstance(out, wire.WeightsChunk)
        assert (out.version, out.index, out.total) == (msg.version, msg.index, msg.total)
        assert bytes(out.data) == bytes(msg.data)
    elif isinstance(msg, wire.FileChunk):
        assert isinstance(out, wire.FileChunk)
        assert (out.sha256, out.index, out.total, out.size, out.error) == (
            msg.sha256, msg.index, msg.total, msg.size, msg.error)  # fmt: skip
        assert bytes(out.data) == bytes(msg.data)
    else:
        assert out == msg


def _control(kind: int, header: object, *payload: bytes) -> list[bytes]:
    return [struct.pack("<4sBBH", b"ARPO", 1, kind, 0), msgpack.packb(header), *payload]


_HB = {"sender": "a", "role": "actor", "seq": 0, "version": 0, "time": 0.0, "stats": {}}
_ANN = {"version": 1, "nbytes": 10, "chunks": 1, "chunk_bytes": 10, "sha256": "0" * 64, "path": ""}


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        (_control(3, {"actor": "a", "req": 0}), "missing ['want']"),
        (_control(3, {"actor": "a", "req": 0, "want": 0}), "want must be an int in [1, 256]"),
        (_control(3, {"actor": "a", "req": True, "want": 1}), "req must be an int"),
        (_control(3, {"actor": "", "req": 0, "want": 1}), "actor must not be empty"),
        (_control(3, {"actor": "a", "req": 0, "want": 1}, b"x"), "has 2 frames, got 3"),
        (_control(3, {"actor": "a", "req": 0, "want": 1, "pool": 3}), "pool must be a string"),
        (_control(3, {"actor": "a", "req": 0, "want": 1, "pool": "p" * 1025}), "pool must be"),
        (_control(3, {"actor": "a", "req": 0, "pool": "sim"}), "missing ['want']"),
        (_control(3, {"actor": "a", "req": 0, "want": 1, "pool": "", "x": 1}), "unexpected ['x']"),
        (_control(4, {"req": 0, "grants": [["g", "t", "t/0", 0, 0]], "retry": 0}), "grants[0]"),
        (_control(4, {"req": 0, "grants": [["g", "t", "t/0", -1, 0, "{}"]], "retry": 0}), "slot"),
        (_control(4, {"req": 0, "grants": [], "retry": float("nan")}), "retry must be a finite"),
        (_control(4, {"req": 0, "grants": [[]] * 257, "retry": 0}), "at most 256 entries"),
        (
            _control(
                4, {"req": 0, "grants": [["g", "t", "t/0", 0, 0, "{}", 0, 1.0, None]], "retry": 0}
            ),
            "temperature and top_p must both be set or both be nil",
        ),
        (
            _control(
                4, {"req": 0, "grants": [["g", "t", "t/0", 0, 0, "{}", 0, 1.0, 1.5]], "retry": 0}
            ),
            "top_p must be in (0, 1]",
        ),
        (
            _control(
                4, {"req": 0, "grants": [["g", "t", "t/0", 0, 0, "{}", -1, None, None]], "retry": 0}
            ),
            "min_version must be an int",
        ),
        (_control(5, {**_HB, "role": "boss"}), "role must be 'actor' or 'learner'"),
        (_control(5, {**_HB, "stats": {"x": "1"}}), "stats['x'] must be a finite number"),
        (_control(5, {**_HB, "stats": {str(i): 0 for i in range(65)}}), "at most 64 counters"),
        (_control(5, {**_HB, "extra": 1}), "unexpected ['extra']"),
        (_control(6, {**_ANN, "chunks": 2}), "2 chunks cannot hold 10 bytes"),
        (_control(6, {**_ANN, "sha256": "z" * 64}), "64 hex characters"),
        (_control(6, {**_ANN, "chunk_bytes": 1 << 30}), "chunk_bytes must be an int"),
        (_control(7, {"version": 0, "chunk": -2}), "chunk must be an int in [-1"),
        (
            _control(8, {"version": 0, "index": 1, "total": 1}, b""),
            "index must be an int in [0, 0]",
        ),
        (_control(8, {"version": 0, "index": 0, "total": 1}), "has 3 frames, got 2"),
        (_control(10, {"sha256": "AB" * 32, "chunk": 0}), "64 lowercase hex characters"),
        (_control(10, {"sha256": "ab" * 32}), "missing ['chunk']"),
        (
            _control(
                11, {"sha256": "ab" * 32, "index": 0, "total": 1, "size": 1, "error": "gone"}, b"x"
            ),
            "both an error and data",
        ),
        (_control(99, {}), "unknown message kind 99"),
    ],
)
def test_malformed_control_message_names_the_reason(frames: list[bytes], reason: str) -> None:
    with pytest.raises(WireError) as e:
        wire.decode(frames)
    assert reason in str(e.value), str(e.value)


def test_grant_request_carries_its_pool_and_accepts_the_header_without_it() -> None:
    frames = wire.encode(wire.GrantRequest("actor-0", 7, 2, "desktop"))
    assert msgpack.unpackb(frames[1]) == {
        "actor": "actor-0",
        "req": 7,
        "want": 2,
        "pool": "desktop",
    }
    assert wire.decode([bytes(f) for f in frames]).pool == "desktop"
    # A request from an actor that does not send the key yet: any pool.
    old = wire.decode(_control(3, {"actor": "a", "req": 1, "want": 1}))
    assert old == wire.GrantRequest("a", 1, 1, "") and old.pool == ""
    assert wire.GrantRequest("a", 1).pool == ""
    with pytest.raises(WireError, match="pool"):
        wire.GrantRequest("a", 1, 1, None)  # type: ignore[arg-type]


def test_grants_carry_min_version_and_sampling_and_old_grants_still_decode() -> None:
    g = wire.Grant("g", "t", "t/0", 2, 5, "{}", min_version=5, temperature=0.7, top_p=1.0)
    (out,) = wire.decode([bytes(f) for f in wire.encode(wire.GrantReply(1, (g,)))]).grants
    assert (out.min_version, out.temperature, out.top_p) == (5, 0.7, 1.0)
    # A grant of a learner from before these fields: no minimum, the actor's own sampling.
    old = wire.decode(_control(4, {"req": 1, "grants": [["g", "t", "t/0", 2, 5, "{}"]],
                                   "retry": 0.0}))  # fmt: skip
    (og,) = old.grants
    assert (og.min_version, og.temperature, og.top_p) == (0, None, None)


def test_turns_carry_their_sampling_settings() -> None:
    turn = replace(_turn(1, n_resp=3), temperature=0.6, top_p=0.9)
    traj = Trajectory(task_id="t", turns=(turn,), checker_score=0.0)
    frames = wire.encode(traj)
    assert msgpack.unpackb(frames[1])["turns"][0][6:8] == [0.6, 0.9]
    (t,) = wire.decode([bytes(f) for f in frames]).turns
    assert (t.temperature, t.top_p) == (0.6, 0.9)
    assert (store_item.from_item(store_item.to_item(traj)).turns[0].top_p) == 0.9
    # A record from before the fields (6-entry turns): settings not recorded (NaN).
    header = msgpack.unpackb(frames[1])
    header["turns"] = [x[:6] for x in header["turns"]]
    old = wire.decode([frames[0], msgpack.packb(header), *map(bytes, frames[2:])])
    assert math.isnan(old.turns[0].temperature) and math.isnan(old.turns[0].top_p)
    # Out-of-range settings are malformed input.
    header["turns"] = [[*x[:6], 0.6, 0.0] for x in header["turns"]]
    with pytest.raises(WireError, match=r"turns\[0\]\.top_p must be in \(0, 1\]"):
        wire.decode([frames[0], msgpack.packb(header), *map(bytes, frames[2:])])
    with pytest.raises(RecordError, match=r"turn\.temperature must be a finite number >= 0"):
        replace(turn, temperature=-1.0)


def test_som_turns_carry_what_made_their_marks_and_old_records_read_as_the_tree() -> None:
    """`Turn.marks_source` (the tree or OCR) crosses the wire and the replay store; a record
    written before it existed (8-entry turns) decodes as "tree" for som, the only source
    then, and "" for the other types; a source no actor writes is malformed input."""
    turns = (replace(_turn(1, n_resp=3), marks_source="ocr"),
             replace(_turn(2, n_resp=2), marks_source="tree"))  # fmt: skip
    traj = Trajectory(task_id="t", turns=turns, checker_score=0.0, observation_type="som")
    frames = [bytes(f) for f in wire.encode(traj)]
    assert [x[8] for x in msgpack.unpackb(frames[1])["turns"]] == ["ocr", "tree"]
    back = wire.decode(frames)
    assert back == traj and [t.marks_source for t in back.turns] == ["ocr", "tree"]
    assert store_item.from_item(store_item.to_item(traj)) == traj
    header = msgpack.unpackb(frames[1])
    header["turns"] = [x[:8] for x in header["turns"]]
    old = wire.decode([frames[0], msgpack.packb(header), *frames[2:]])
    assert [t.marks_source for t in old.turns] == ["tree", "tree"]
    header["obs"] = "screenshot_a11y_tree"
    old = wire.decode([frames[0], msgpack.packb(header), *frames[2:]])
    assert [t.marks_source for t in old.turns] == ["", ""]
    header = msgpack.unpackb(frames[1])
    header["turns"][0][8] = "pixels"
    with pytest.raises(WireError, match=r"turns\[0\]\.marks_source must be one of tree, ocr"):
        wire.decode([frames[0], msgpack.packb(header), *frames[2:]])
    with pytest.raises(RecordError, match=r"turn\.marks_source must be one of"):
        replace(turns[0], marks_source="pixels")
    with pytest.raises(RecordError, match="only som turns have marks"):
        replace(traj, observation_type="screenshot")


@pytest.mark.parametrize("bad", ["a\nb", "a\rb", "a\tb", " a", "a ", "a\u2028b", "a\x00b"])
def test_ids_that_could_forge_ledger_lines_are_refused(bad: str) -> None:
    """Ids are written one per line (seen.log, trained.log, spool ledgers): newlines,
    carriage returns, tabs, any whitespace or control character are refused by the record,
    the trajectory decoder, acks and control messages, naming the field."""
    t = make_trajectory(np.random.default_rng(1), turns=2)
    with pytest.raises(RecordError, match=r"trajectory\.trajectory_id contains"):
        replace(t, trajectory_id=bad)
    header = msgpack.unpackb(wire.encode(t)[1])
    header["tid"] = bad
    frames = [bytes(f) for f in wire.encode(t)]
    with pytest.raises(WireError, match="trajectory_id contains"):
        wire.decode([frames[0], msgpack.packb(header), *frames[2:]])
    with pytest.raises(WireError, match="ack id contains"):
        wire.Ack((bad,))
    with pytest.raises(WireError, match="grant id contains"):
        wire.Grant(bad, "t", "t/0", 0, 0, "{}")
    with pytest.raises(WireError, match="grant request actor contains"):
        wire.GrantRequest(bad, 1)


def test_trajectories_carry_their_error_and_environment_and_old_headers_still_decode() -> None:
    t = Trajectory(task_id="t", turns=(), checker_score=0.0, status=Status.SETUP_ERROR,
                   error="setup: FileCacheMiss: x" + "y" * 5000, env="http://10.0.0.5:5000")  # fmt: skip
    assert len(t.error) == 2000 and t.error.endswith("...")  # cut, not refused
    out = wire.decode([bytes(f) for f in wire.encode(t)])
    assert out == t and out.status == Status.SETUP_ERROR and out.env == "http://10.0.0.5:5000"
    frames = [bytes(f) for f in wire.encode(t)]
    header = msgpack.unpackb(frames[1])
    del header["error"], header["env"]  # a record written before the fields existed
    old = wire.decode([frames[0], msgpack.packb(header), *frames[2:]])
    assert (old.error, old.env) == ("", "")

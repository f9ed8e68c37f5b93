"""The replay store's Python API: contract, zero-copy views and every error path."""

from __future__ import annotations

import gc
import mmap
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest
import zmq

from arpo.buffer import (
    BufferClosed,
    BufferTimeout,
    BufferValueError,
    Item,
    ReplayStore,
    SnapshotError,
    UnknownTask,
)


def make_item(version: int = 0, n: int = 4, blob: bytes = b"png", meta: bytes = b"") -> Item:
    return Item(
        np.arange(n, dtype=np.int32),
        np.full(n, -0.5, dtype=np.float32),
        np.array([0], dtype=np.int32),
        np.array([1.0], dtype=np.float32),
        version,
        blobs=(blob,),
        metadata=meta,
    )


# ----- Item -----


def test_item_fields_and_nbytes() -> None:
    blob1, blob2 = b"a" * 100, b"b" * 7
    it = Item([1, 2, 3], [0.5, 0.25, 0.0], [0, 2], 2.5, 7, blobs=[blob1, blob2], metadata=b"xyz")
    assert it.tokens.dtype == np.int32 and it.tokens.tolist() == [1, 2, 3]
    assert it.logprobs.dtype == np.float32 and it.logprobs.tolist() == [0.5, 0.25, 0.0]
    assert it.offsets.tolist() == [0, 2]
    assert it.rewards.dtype == np.float32 and it.rewards.tolist() == [2.5]
    assert it.version == 7
    assert it.metadata == b"xyz"
    assert it.nbytes == 4 * (3 + 3 + 2 + 1) + 107 + 3
    assert isinstance(it.blobs, tuple)
    assert it.blobs[0] is blob1 and it.blobs[1] is blob2
    empty = Item([], [], [], [], 0)
    assert empty.nbytes == 0 and empty.blobs == () and empty.metadata == b""
    assert empty.tokens.shape == (0,)
    assert it.key != empty.key
    assert "version=7" in repr(it)


def test_item_keys_unique_and_equality_by_key() -> None:
    items = [make_item() for _ in range(100)]
    assert len({it.key for it in items}) == 100
    s = ReplayStore(seed=0)
    s.put("t", items[0])
    (back,) = s.take_group("t", 1, timeout=0)
    assert back == items[0] and hash(back) == hash(items[0]) and back != items[1]
    assert back.__eq__("not an item") is NotImplemented


def test_item_arrays_are_readonly_views_that_keep_the_item_alive() -> None:
    it = make_item(n=16)
    key = it.key
    arr = it.tokens
    assert not arr.flags.writeable and not arr.flags.owndata
    assert arr.base is it
    with pytest.raises(ValueError, match="read-only"):
        arr[0] = 5
    with pytest.raises(ValueError):
        arr.flags.writeable = True
    # Two views share the item's memory (no copy per access).
    assert np.shares_memory(it.tokens, it.tokens)
    ref = weakref.ref(it)
    del it
    gc.collect()
    assert ref() is not None, "the view keeps the item alive"
    assert arr.base.key == key
    assert arr.tolist() == list(range(16))
    del arr
    gc.collect()
    assert ref() is None


def test_item_copies_arrays_once_at_construction() -> None:
    tokens = np.arange(8, dtype=np.int32)
    it = Item(tokens, np.zeros(8, np.float32), [0], [1.0], 0)
    tokens[0] = 99
    assert it.tokens[0] == 0, "later writes to the input do not reach the item"
    strided = np.arange(16, dtype=np.int32)[::2]
    assert Item(strided, [], [], [], 0).tokens.tolist() == list(range(0, 16, 2))


def test_sampled_blob_is_the_inserted_bytes_object() -> None:
    png = bytes(range(256)) * 1000
    meta = b"meta-object"
    s = ReplayStore(seed=0)
    it = make_item(blob=png, meta=meta)
    s.add_success("t", it)
    s.put("t", it)
    (a,) = s.sample("t", 1)
    (b,) = s.sample("t", 1, mode="newest")
    (c,) = s.take_group("t", 1, timeout=0)
    for x in (a, b, c):
        assert x.blobs[0] is png
        assert x.metadata is meta
        assert np.shares_memory(x.tokens, it.tokens), "same item memory, no copy"


@pytest.mark.parametrize(
    ("kwargs", "field", "fragment"),
    [
        ({"tokens": np.arange(3)}, "tokens", "int32"),
        ({"tokens": np.zeros((2, 2), np.int32)}, "tokens", "1-D"),
        ({"tokens": "abc"}, "tokens", "sequence"),
        ({"tokens": [1.5]}, "tokens", "sequence"),
        ({"tokens": [2**40]}, "tokens", "sequence"),
        ({"logprobs": np.zeros(3)}, "logprobs", "float32"),
        ({"logprobs": np.zeros((1, 3), np.float32)}, "logprobs", "1-D"),
        ({"offsets": np.zeros(2, np.int64)}, "offsets", "int32"),
        ({"offsets": None}, "offsets", "sequence"),
        ({"rewards": np.ones(1)}, "rewards", "float32"),
        ({"rewards": "x"}, "rewards", "sequence"),
        ({"version": "3"}, "version", "int"),
        ({"version": True}, "version", "bool"),
        ({"blobs": b"single"}, "blobs", "wrap"),
        ({"blobs": [b"ok", bytearray(b"no")]}, "blobs[1]", "bytes"),
        ({"blobs": 5}, "blobs", "sequence"),
        ({"metadata": "text"}, "metadata", "bytes"),
    ],
)
def test_item_rejects_bad_fields_naming_them(kwargs: dict, field: str, fragment: str) -> None:
    args = {
        "tokens": np.arange(3, dtype=np.int32),
        "logprobs": np.zeros(3, np.float32),
        "offsets": [0],
        "rewards": [1.0],
        "version": 0,
        "blobs": (),
        "metadata": b"",
    }
    args.update(kwargs)
    with pytest.raises(BufferValueError) as exc:
        Item(**args)
    msg = str(exc.value)
    assert msg.startswith(field) and fragment in msg, msg
    assert isinstance(exc.value, ValueError)


# ----- blobs kept by reference: bytes, zmq.Frame, read-only memoryviews of them -----


def _received_frame(payload: bytes) -> zmq.Frame:
    """A frame as the learner's ingest gets it: sent over a real socket, received with
    copy=False (its memory belongs to libzmq)."""
    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send(payload)
        assert pull.poll(10_000)
        return pull.recv(copy=False)
    finally:
        push.close(0)
        pull.close(0)


def _address(buf: object) -> int:
    """Address of the first byte of a buffer."""
    return np.frombuffer(buf, np.uint8).ctypes.data  # type: ignore[call-overload]


def test_frame_and_readonly_view_blobs_are_kept_by_identity() -> None:
    payload = bytes(range(256)) * 400
    frame = _received_frame(payload)
    view = memoryview(frame).toreadonly()
    part = memoryview(payload)[100:200]
    small = _received_frame(b"tiny")  # libzmq keeps messages this small inside the frame
    it = Item([1], [0.0], [1], 0.0, 0, blobs=[frame, view, part, small, payload])
    assert all(a is b for a, b in zip(it.blobs, [frame, view, part, small, payload], strict=True))
    assert it.nbytes == 4 * 4 + 2 * len(payload) + 100 + 4 + len(payload)
    s = ReplayStore(seed=0)
    s.put("t", it)
    (got,) = s.take_group("t", 1, timeout=0)
    assert got.blobs[0] is frame and got.blobs[1] is view and got.blobs[2] is part
    # No copy: the stored view's memory is the frame's.
    assert _address(got.blobs[1]) == _address(frame)
    assert bytes(got.blobs[0]) == payload and bytes(got.blobs[3]) == b"tiny"


def _bad_blobs() -> list[tuple[str, object, str]]:
    frame = zmq.Frame(b"x" * 100_000)
    arr = np.zeros(16, np.uint8)
    return [
        ("bytearray", bytearray(b"no"), "must be bytes"),
        ("writable view of a frame", memoryview(frame), "writable memoryview"),
        ("view of a bytearray", memoryview(bytearray(b"no")), "memoryview of a bytearray"),
        ("read-only view of a bytearray", memoryview(bytearray(4)).toreadonly(), "bytearray"),
        ("numpy array", arr, "got ndarray"),
        ("view of a numpy array", memoryview(arr).toreadonly(), "memoryview of a ndarray"),
        ("mmap", mmap.mmap(-1, 4096), "got mmap"),
        ("view of an mmap", memoryview(mmap.mmap(-1, 4096)).toreadonly(), "of a mmap"),
        ("strided view of bytes", memoryview(b"abcdef")[::2], "contiguous"),
        ("str", "text", "must be bytes"),
    ]


@pytest.mark.parametrize(("name", "blob", "fragment"), _bad_blobs(), ids=lambda x: str(x))
def test_mutable_or_closable_blobs_are_rejected_naming_the_index(
    name: str, blob: object, fragment: str
) -> None:
    with pytest.raises(BufferValueError) as exc:
        Item([1], [0.0], [1], 0.0, 0, blobs=[b"ok", zmq.Frame(b"ok"), blob])
    msg = str(exc.value)
    assert msg.startswith("blobs[2]") and fragment in msg, (name, msg)
    if isinstance(blob, memoryview):
        blob.release()  # the rejected item holds no export of it
    if isinstance(blob, mmap.mmap):
        blob.close()


def test_single_frame_or_view_must_be_wrapped() -> None:
    for single in (zmq.Frame(b"x"), memoryview(b"x")):
        with pytest.raises(BufferValueError, match="wrap it as"):
            Item([1], [0.0], [1], 0.0, 0, blobs=single)


def test_frame_lives_as_long_as_the_item() -> None:
    payload = b"\x89PNG" + bytes(range(256)) * 300
    frame = _received_frame(payload)
    gone = weakref.ref(frame)
    s = ReplayStore(seed=0)
    s.put("t", Item([1], [0.0], [1], 0.0, 0, blobs=[memoryview(frame).toreadonly()]))
    del frame
    gc.collect()
    assert gone() is not None, "the stored item keeps the frame alive"
    (got,) = s.take_group("t", 1, timeout=0)
    assert bytes(got.blobs[0]) == payload
    del got
    gc.collect()
    assert gone() is None, "the frame is freed with the last item holding it"


def test_released_view_cannot_free_the_memory_the_store_reads(tmp_path) -> None:
    payload = bytes(range(256)) * 300
    frame = _received_frame(payload)
    gone = weakref.ref(frame)
    view = memoryview(frame).toreadonly()
    s = ReplayStore(seed=0)
    s.put("t", Item([1], [0.0], [1], 0.0, 0, blobs=[view]))
    view.release()  # drops the view's own reference to the frame
    del frame
    gc.collect()
    assert gone() is not None, "the item holds the frame, not only the view"
    s.snapshot(tmp_path / "s.snap")
    restored = ReplayStore.restore(tmp_path / "s.snap")
    (got,) = restored.take_group("t", 1, timeout=0)
    assert got.blobs == (payload,)


def test_snapshot_restore_of_frame_and_view_blobs(tmp_path) -> None:
    payload = bytes(range(256)) * 500
    frame = _received_frame(payload)
    blobs = [frame, memoryview(frame).toreadonly()[10:50], memoryview(payload).toreadonly(), b""]
    s = ReplayStore(seed=0)
    s.put("t", Item([1, 2], [0.0], [1, 1], 1.0, 3, blobs=blobs, metadata=b"m"))
    s.add_success("t", Item([3], [0.0], [1], 1.0, 4, blobs=[_received_frame(b"ok")]))
    s.snapshot(tmp_path / "s.snap")
    r = ReplayStore.restore(tmp_path / "s.snap")
    (fresh,) = r.take_group("t", 1, timeout=0)
    assert all(type(b) is bytes for b in fresh.blobs), "restored blobs are bytes"
    assert fresh.blobs == (payload, payload[10:50], payload, b"")
    assert fresh.metadata == b"m" and fresh.tokens.tolist() == [1, 2]
    (replay,) = r.sample("t", 1)
    assert replay.blobs == (b"ok",)


# ----- fresh queue -----


def test_take_group_is_fifo_and_atomic() -> None:
    s = ReplayStore(seed=0)
    items = [make_item(v) for v in range(5)]
    for it in items:
        s.put("t", it)
    assert s.fresh_len("t") == 5
    with pytest.raises(BufferTimeout, match='"t" has 5 fresh items, fewer than n=6'):
        s.take_group("t", 6, timeout=0)
    assert s.fresh_len("t") == 5, "a failed take removes nothing"
    group = s.take_group("t", 3, timeout=0)
    assert [g.key for g in group] == [it.key for it in items[:3]]
    assert s.fresh_len("t") == 2
    assert s.fresh_len("never-seen") == 0
    assert s.task_stats("t")["takes"] == 3


def test_take_group_waits_for_a_group() -> None:
    s = ReplayStore(seed=0)
    out: list = []

    def taker() -> None:
        out.extend(s.take_group("new-task", 3, timeout=10))

    th = threading.Thread(target=taker)
    th.start()
    time.sleep(0.05)
    assert "new-task" in s.tasks(), "waiting registers the task"
    for v in range(3):
        s.put("new-task", make_item(v))
    th.join(5)
    assert not th.is_alive()
    assert [it.version for it in out] == [0, 1, 2]


def test_take_group_timeout_is_honoured() -> None:
    s = ReplayStore(seed=0)
    t0 = time.monotonic()
    with pytest.raises(BufferTimeout, match="take_group"):
        s.take_group("t", 2, timeout=0.3)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    with pytest.raises(BufferTimeout):
        s.take_group("other", 1, timeout=0)
    assert "other" not in s.tasks(), "timeout=0 on an unknown task registers nothing"


def test_fresh_capacity_evicts_oldest() -> None:
    s = ReplayStore(fresh_capacity=3, seed=0)
    for v in range(5):
        s.put("t", make_item(v))
    assert [it.version for it in s.take_group("t", 3, timeout=0)] == [2, 3, 4]
    assert s.task_stats("t")["evictions"] == 2


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda s: s.take_group("t", 0), "n must be >= 1"),
        (lambda s: s.take_group("t", -1), "n must be >= 1"),
        (lambda s: s.take_group("t", 5), "fresh_capacity=4"),
        (lambda s: s.take_group("t", 1, timeout=-1), "timeout"),
        (lambda s: s.take_group("t", 1, timeout=float("nan")), "timeout"),
        (lambda s: s.put("t", "not an item"), "item must be"),
        (lambda s: s.add_success("t", make_item(), priority=-1.0), "priority"),
        (lambda s: s.add_success("t", make_item(), priority=float("inf")), "priority"),
        (lambda s: s.add_success("t", object()), "item must be"),
        (lambda s: s.sample("t", 1, mode="best"), "mode"),
        (lambda s: s.sample("t", -1), "k must be"),
        (lambda s: s.sample("t", 1, min_size=0), "min_size"),
        (lambda s: s.wait_min_size("t", 3), "replay_capacity=2"),
        (lambda s: s.wait_min_size("t", -1), "n must be"),
        (lambda s: s.update_priorities("t", [1, 2], [1.0]), "same length"),
        (lambda s: s.update_priorities("t", [-1], [1.0]), "keys"),
        (lambda s: s.update_priorities("t", [1], ["x"]), "priorities"),
        (lambda s: s.put("t", make_item(blob=b"x" * 2000)), "max_bytes=1000"),
    ],
)
def test_value_errors_name_the_argument(call, fragment: str) -> None:
    s = ReplayStore(max_bytes=1000, fresh_capacity=4, replay_capacity=2, seed=0)
    s.add_success("t", make_item())
    with pytest.raises(BufferValueError, match=fragment):
        call(s)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_bytes": 0}, "max_bytes"),
        ({"fresh_capacity": 0}, "fresh_capacity"),
        ({"replay_capacity": -3}, "replay_capacity"),
        ({"seed": -1}, "seed"),
    ],
)
def test_constructor_rejects_bad_config(kwargs: dict, field: str) -> None:
    with pytest.raises(BufferValueError, match=field):
        ReplayStore(**kwargs)


# ----- replay buffer -----


def test_replay_fifo_and_sampling_modes() -> None:
    s = ReplayStore(replay_capacity=3, seed=0)
    for v in range(5):
        s.add_success("t", make_item(v))
    assert s.replay_len("t") == 3
    assert [it.version for it in s.sample("t", 10, mode="newest")] == [4, 3, 2]
    assert [it.version for it in s.sample("t", 2, mode="newest")] == [4, 3]
    uniform = s.sample("t", 300)
    assert len(uniform) == 300
    counts = {v: sum(it.version == v for it in uniform) for v in (2, 3, 4)}
    assert all(60 < c < 140 for c in counts.values()), counts
    assert s.sample("t", 0) == []
    only_new = s.sample("t", 20, min_version=4)
    assert {it.version for it in only_new} == {4}
    assert [it.version for it in s.sample("t", 5, mode="newest", min_version=3)] == [4, 3]
    assert s.task_stats("t")["evictions"] == 2


def test_sample_below_min_size_and_unknown_task() -> None:
    s = ReplayStore(seed=0)
    s.add_success("t", make_item(1))
    with pytest.raises(
        BufferValueError, match=r'task "t" has 1 replay items, fewer than min_size=2'
    ):
        s.sample("t", 1, min_size=2)
    with pytest.raises(BufferValueError, match="version >= 5"):
        s.sample("t", 1, min_version=5)
    s.put("fresh-only", make_item())
    with pytest.raises(BufferValueError, match="fresh-only"):
        s.sample("fresh-only", 1)
    for call in (
        lambda: s.sample("nope", 1),
        lambda: s.replay_len("nope"),
        lambda: s.update_priorities("nope", [1], [1.0]),
        lambda: s.task_stats("nope"),
    ):
        with pytest.raises(UnknownTask, match='"nope"') as exc:
            call()
        assert isinstance(exc.value, KeyError)


def test_priority_sampling_and_updates() -> None:
    s = ReplayStore(seed=1)
    a, b, c = make_item(), make_item(), make_item()
    s.add_success("t", a, priority=1.0)
    s.add_success("t", b, priority=3.0)
    s.add_success("t", c, priority=0.0)
    draws = s.sample("t", 4000, mode="priority")
    share_b = sum(d.key == b.key for d in draws) / 4000
    assert abs(share_b - 0.75) < 0.04
    assert not any(d.key == c.key for d in draws)
    assert s.update_priorities("t", [a.key, b.key, c.key, 10**12], [0.0, 0.0, 5.0, 1.0]) == 3
    assert {d.key for d in s.sample("t", 50, mode="priority")} == {c.key}
    assert s.update_priorities("t", np.array([c.key]), np.array([0.0])) == 1
    with pytest.raises(BufferValueError, match="sum"):
        s.sample("t", 1, mode="priority")


def test_seed_makes_sampling_reproducible() -> None:
    def run() -> list[int]:
        s = ReplayStore(seed=42)
        for v in range(8):
            s.add_success("t", make_item(v), priority=v + 1.0)
        return [it.version for it in s.sample("t", 20) + s.sample("t", 20, mode="priority")]

    assert run() == run()


def test_wait_min_size() -> None:
    s = ReplayStore(seed=0)
    s.wait_min_size("t", 0, timeout=0)
    with pytest.raises(BufferTimeout, match="wait_min_size"):
        s.wait_min_size("t", 1, timeout=0.1)
    th = threading.Timer(0.1, lambda: [s.add_success("t", make_item(v)) for v in range(2)])
    th.start()
    s.wait_min_size("t", 2, timeout=10)
    assert s.replay_len("t") == 2
    th.join()


# ----- budget, versions, stats -----


def test_byte_budget_evicts_oldest_across_tasks() -> None:
    one = make_item(blob=b"x" * 100).nbytes
    s = ReplayStore(max_bytes=4 * one, seed=0)
    shared = make_item(0, blob=b"x" * 100)
    s.put("a", shared)
    s.add_success("b", make_item(1, blob=b"x" * 100))
    s.put("c", make_item(2, blob=b"x" * 100))
    s.add_success("a", shared)  # same object, second residency
    assert s.bytes_used == 4 * one
    s.put("d", make_item(3, blob=b"x" * 100))
    assert s.bytes_used == 4 * one
    assert s.fresh_len("a") == 0 and s.replay_len("a") == 1
    s.put("d", make_item(4, blob=b"x" * 100))
    assert s.replay_len("b") == 0
    assert s.stats()["total"]["evictions"] == 2


def test_drop_older_than_and_stats() -> None:
    s = ReplayStore(seed=0)
    for v in range(6):
        s.put("a", make_item(v))
        s.add_success("b", make_item(v))
    before = s.bytes_used
    assert s.drop_older_than(4) == 8
    assert s.fresh_len("a") == 2 and s.replay_len("b") == 2
    assert s.bytes_used == before // 3
    st = s.stats()
    assert set(st) == {"total", "tasks"}
    assert set(st["tasks"]) == {"a", "b"}
    total = st["total"]
    assert total["dropped"] == 8 and total["inserts"] == 12
    assert total["min_version"] == 4 and total["max_version"] == 5
    assert total["items"] == 4 and total["bytes"] == s.bytes_used
    assert st["tasks"]["a"] == s.task_stats("a")
    assert s.tasks() == ["a", "b"]
    empty = ReplayStore().stats()["total"]
    assert empty["min_version"] is None and empty["items"] == 0


# ----- close -----


def test_close_rejects_calls_and_wakes_waiters(tmp_path) -> None:
    s = ReplayStore(seed=0)
    s.add_success("t", make_item())
    errors: list[BaseException] = []

    def wait(call) -> None:
        try:
            call()
        except BaseException as e:
            errors.append(e)

    threads = [
        threading.Thread(target=wait, args=(lambda: s.take_group("t", 2),)),
        threading.Thread(target=wait, args=(lambda: s.wait_min_size("t", 5),)),
    ]
    for th in threads:
        th.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    s.close()
    for th in threads:
        th.join(10)
    # the waiters have no timeout: only close() can have woken them
    assert time.monotonic() - t0 < 10.0
    assert len(errors) == 2 and all(isinstance(e, BufferClosed) for e in errors)
    assert s.closed
    for call in (
        lambda: s.put("t", make_item()),
        lambda: s.add_success("t", make_item()),
        lambda: s.take_group("t", 1, timeout=0),
        lambda: s.sample("t", 1),
        lambda: s.fresh_len("t"),
        lambda: s.replay_len("t"),
        lambda: s.tasks(),
        lambda: s.bytes_used,
        lambda: s.stats(),
        lambda: s.drop_older_than(0),
        lambda: s.snapshot(tmp_path / "x.snap"),
    ):
        with pytest.raises(BufferClosed, match="closed"):
            call()
    s.close()  # idempotent
    with ReplayStore() as s2:
        assert not s2.closed
    assert s2.closed


def test_restore_of_missing_file_is_a_snapshot_error(tmp_path) -> None:
    with pytest.raises(SnapshotError, match="cannot open"):
        ReplayStore.restore(tmp_path / "missing.snap")


def test_importing_the_store_does_not_import_torch() -> None:
    code = "import sys, arpo.buffer; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_store_edges_give_clean_errors(tmp_path) -> None:
    """A k too large to allocate is a BufferValueError naming k (it was a Rust panic, a
    BaseException); a snapshot onto something that is not a regular file is refused and
    leaves it as it was."""
    import os
    import stat

    from arpo.buffer import BufferValueError, ReplayStore, SnapshotError

    s = ReplayStore(max_bytes=1 << 20, fresh_capacity=4, replay_capacity=4, seed=0)
    s.add_success("t", Item([1, 2], [-0.5, -0.5], [0, 2], [1.0], 0))
    with pytest.raises(BufferValueError, match="k = 4611686018427387904"):
        s.sample("t", 2**62)
    assert len(s.sample("t", 2)) == 2
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(SnapshotError, match="not a regular file"):
        s.snapshot(fifo)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    with pytest.raises(SnapshotError, match="not a regular file"):
        s.snapshot(tmp_path)  # a folder
    s.snapshot(tmp_path / "ok.snap")
    s.snapshot(tmp_path / "ok.snap")  # a regular file is replaced
    assert ReplayStore.restore(tmp_path / "ok.snap").replay_len("t") == 1

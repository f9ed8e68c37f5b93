"""Snapshots of the replay store: round trip, bad files, failed writes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest

from arpo.buffer import SNAPSHOT_FORMAT_VERSION, BufferValueError, Item, ReplayStore, SnapshotError


def make_item(version: int, blob: bytes = b"png" * 100) -> Item:
    n = 16 + version
    return Item(
        np.arange(n, dtype=np.int32),
        np.linspace(-1, 0, n, dtype=np.float32),
        np.array([0, n // 2], dtype=np.int32),
        np.array([version / 10, 0.5], dtype=np.float32),
        version,
        blobs=(blob, blob[::-1]),
        metadata=f"v{version}".encode(),
    )


def filled_store() -> tuple[ReplayStore, Item]:
    store = ReplayStore(max_bytes=1 << 24, fresh_capacity=32, replay_capacity=4, seed=3)
    for v in range(6):
        store.put("a", make_item(v))
    shared = make_item(9)
    store.put("b", shared)
    store.add_success("b", shared, priority=2.0)
    for v in range(3):
        store.add_success("c", make_item(v), priority=float(v))
    store.take_group("a", 2, timeout=0)
    store.sample("c", 5)
    return store, shared


def assert_same_item(a: Item, b: Item) -> None:
    assert a.key == b.key and a.version == b.version and a.nbytes == b.nbytes
    for field in ("tokens", "logprobs", "offsets", "rewards"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype and np.array_equal(x, y)
    assert a.blobs == b.blobs and a.metadata == b.metadata


def test_round_trip(tmp_path) -> None:
    store, shared = filled_store()
    path = tmp_path / "store.snap"
    store.snapshot(str(path))  # str and PathLike both work
    restored = ReplayStore.restore(path)
    assert restored.stats() == store.stats()
    assert restored.bytes_used == store.bytes_used
    assert (restored.max_bytes, restored.fresh_capacity, restored.replay_capacity) == (
        1 << 24,
        32,
        4,
    )
    live = store.take_group("a", 4, timeout=0)
    back = restored.take_group("a", 4, timeout=0)
    for a, b in zip(live, back, strict=True):
        assert_same_item(a, b)
    # Priorities survive: c's item of priority 0 is never drawn.
    drawn = {it.version for it in restored.sample("c", 200, mode="priority")}
    assert drawn == {1, 2}
    # An item in two roles is one item after restore (one copy of its blobs).
    (fresh_b,) = restored.take_group("b", 1, timeout=0)
    (replay_b,) = restored.sample("b", 1, mode="newest")
    assert_same_item(fresh_b, shared)
    assert fresh_b.blobs[0] is replay_b.blobs[0]
    # New items never reuse a restored key.
    assert make_item(0).key > max(it.key for it in back)


def test_restore_overrides_limits(tmp_path) -> None:
    store, _ = filled_store()
    path = tmp_path / "store.snap"
    store.snapshot(path)
    small = ReplayStore.restore(path, fresh_capacity=2, replay_capacity=1, seed=5)
    assert small.fresh_len("a") == 2 and small.replay_len("c") == 1
    assert [it.version for it in small.take_group("a", 2, timeout=0)] == [4, 5]
    budget = make_item(9).nbytes + 10
    tight = ReplayStore.restore(path, max_bytes=budget)
    assert tight.bytes_used <= budget
    with pytest.raises(BufferValueError, match="max_bytes"):
        ReplayStore.restore(path, max_bytes=0)


def test_corrupted_and_truncated_snapshots_fail_and_the_good_one_still_restores(
    tmp_path,
) -> None:
    store, _ = filled_store()
    good = tmp_path / "good.snap"
    store.snapshot(good)
    store.put("a", make_item(7))
    latest = tmp_path / "latest.snap"
    store.snapshot(latest)
    data = latest.read_bytes()
    assert data[:8] == b"ARPOSNAP"

    cases = {
        "truncated": [data[:n] for n in (0, 20, 32, 33, len(data) // 2, len(data) - 1)],
        "corrupted": [
            data[:pos] + bytes([data[pos] ^ 0xFF]) + data[pos + 1 :]
            for pos in (40, len(data) // 2, len(data) - 2)
        ]
        + [data + b"\0"],
        "header checksum": [data[:16] + b"\xff" + data[17:]],
        "bad magic": [b"NOTASNAP" + data[8:], b"hello"],
    }
    bad = tmp_path / "bad.snap"
    for reason, variants in cases.items():
        for variant in variants:
            bad.write_bytes(variant)
            with pytest.raises(SnapshotError) as exc:
                ReplayStore.restore(bad)
            msg = str(exc.value)
            if reason == "bad magic" and len(variant) < 32:
                reason = "truncated"
            assert reason in msg and "bad.snap" in msg, msg
    # A file of another format version is refused, by number.
    header = bytearray(data[:32])
    header[8:12] = (SNAPSHOT_FORMAT_VERSION + 1).to_bytes(4, "little")
    header[28:32] = zlib.crc32(bytes(header[:28])).to_bytes(4, "little")
    bad.write_bytes(bytes(header) + data[32:])
    with pytest.raises(SnapshotError, match=f"version {SNAPSHOT_FORMAT_VERSION + 1}"):
        ReplayStore.restore(bad)

    # The previous good snapshot is untouched and restores to the earlier state.
    restored = ReplayStore.restore(good)
    assert restored.fresh_len("a") == 4
    assert ReplayStore.restore(latest).fresh_len("a") == 5


def test_overwrite_leaves_no_temporary_files(tmp_path) -> None:
    store, _ = filled_store()
    path = tmp_path / "store.snap"
    for _ in range(3):
        store.snapshot(path)
        store.put("a", make_item(1))
    assert os.listdir(tmp_path) == ["store.snap"]
    with pytest.raises(SnapshotError, match="cannot write"):
        store.snapshot(tmp_path / "missing-dir" / "x.snap")
    assert os.listdir(tmp_path) == ["store.snap"]


def test_a_write_that_fails_midway_keeps_the_previous_snapshot(tmp_path) -> None:
    """The disk fills up (simulated by a file-size limit) while a snapshot is written."""
    path = tmp_path / "store.snap"
    script = textwrap.dedent(
        f"""
        import resource, signal
        import numpy as np
        from arpo.buffer import Item, ReplayStore, SnapshotError

        def item(v):
            return Item(np.arange(8, dtype=np.int32), np.zeros(8, np.float32), [0], [1.0], v,
                        blobs=(bytes([v]) * 50_000,))

        store = ReplayStore(seed=0)
        store.put("t", item(1))
        store.snapshot({str(path)!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
        for v in range(2, 10):
            store.put("t", item(v))
        try:
            store.snapshot({str(path)!r})
        except SnapshotError as e:
            print("failed:", e)
        else:
            raise SystemExit("the snapshot should have failed")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert "failed: cannot write snapshot" in out.stdout, out
    restored = ReplayStore.restore(path)
    assert restored.fresh_len("t") == 1, "the previous snapshot is intact"
    assert os.listdir(tmp_path) == ["store.snap"], "the temporary file was removed"

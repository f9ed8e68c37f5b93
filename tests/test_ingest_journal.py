"""The ingest's write-ahead journal: nothing acknowledged is lost when the learner dies.

A learner process is killed with SIGKILL after a paused checkpoint (rotation + store
snapshot) and more deliveries; the store restored from the snapshot plus the replayed
journal holds every acknowledged trajectory exactly once; torn and corrupted records are
skipped and counted; an actor resending everything after the restart stores nothing twice.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from conftest import make_trajectory

from arpo import store_item, wire
from arpo.buffer import ReplayStore
from arpo.config import validate
from arpo.errors import ConfigError
from arpo.record import Status, Trajectory
from arpo.service.ingest import Ingest, IngestConfig
from arpo.service.journal import Journal, list_segments, read_segment, replay_journal, segment_path
from arpo.transport import TransportConfig, connect_dealer

TIMEOUT_S = 30.0
TASKS = ("task-a", "task-b", "task-c")


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def _trajs(n: int, png_pool: list[bytes], start: int = 0) -> list[Trajectory]:
    return [
        make_trajectory(
            np.random.default_rng(100 + i),
            turns=4,
            tokens=2000,
            pngs=png_pool,
            task_id=TASKS[i % len(TASKS)],
        )
        for i in range(start, start + n)
    ]


def _deliver(sock: zmq.Socket, trajs: list[Trajectory]) -> set[str]:
    """Send all, then collect the acks; returns the acknowledged ids."""
    for t in trajs:
        sock.send_multipart(wire.encode(t))
    return _acks(sock, len(trajs))


def _acks(sock: zmq.Socket, n: int) -> set[str]:
    """Wait for `n` ack messages; returns the ids they acknowledge."""
    acked: set[str] = set()
    end = time.monotonic() + TIMEOUT_S
    for i in range(n):
        assert sock.poll(max(1, int((end - time.monotonic()) * 1000))), f"{i}/{n} acks"
        msg = wire.decode(sock.recv_multipart())
        assert isinstance(msg, wire.Ack)
        acked.update(msg.ids)
    return acked


def _drain_ids(store: ReplayStore) -> list[str]:
    """Every trajectory id in the store's fresh queues (taken out), with repetitions."""
    ids = []
    for task in store.tasks():
        n = store.fresh_len(task)
        if n:
            ids += [store_item.from_item(it).trajectory_id for it in store.take_group(task, n, 0)]
    return ids


_LEARNER = textwrap.dedent(
    """
    import os, sys, time, pathlib
    from arpo.buffer import ReplayStore
    from arpo.service.ingest import Ingest, IngestConfig
    from arpo.transport import TransportConfig

    work = pathlib.Path(sys.argv[1])
    store = ReplayStore(max_bytes=1 << 30, fresh_capacity=64, seed=0)
    cfg = IngestConfig(seen_log=str(work / "seen.log"), journal_dir=str(work / "journal"))
    ingest = Ingest(store, cfg, TransportConfig(data="tcp://127.0.0.1:0"))
    (work / "endpoint.tmp").write_text(ingest.start())
    os.replace(work / "endpoint.tmp", work / "endpoint")
    while not (work / "checkpoint.go").exists():
        time.sleep(0.01)
    with ingest.paused():
        seg = ingest.rotate_journal()
        store.snapshot(work / "store.snap")
    (work / "seg.tmp").write_text(str(seg))
    os.replace(work / "seg.tmp", work / "seg")
    time.sleep(600)  # killed by the test
    """
)


def _wait_file(path: Path, proc: subprocess.Popen) -> str:
    end = time.monotonic() + TIMEOUT_S
    while not path.exists():
        assert proc.poll() is None, f"learner exited: {proc.communicate()[1]!r}"
        assert time.monotonic() < end, f"timed out waiting for {path.name}"
        time.sleep(0.01)
    return path.read_text()


def test_killed_learner_loses_nothing_acknowledged(
    ctx: zmq.Context, tmp_path: Path, png_pool: list[bytes]
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _LEARNER, str(tmp_path)],
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    tc = TransportConfig(data="tcp://127.0.0.1:0")
    first, later = _trajs(20, png_pool), _trajs(10, png_pool, start=20)
    sent = first + later
    try:
        sock = connect_dealer(ctx, _wait_file(tmp_path / "endpoint", proc), tc)
        assert _deliver(sock, first) == {t.trajectory_id for t in first}
        (tmp_path / "checkpoint.go").touch()
        seg = int(_wait_file(tmp_path / "seg", proc))
        assert _deliver(sock, later) == {t.trajectory_id for t in later}
        sock.close(0)
    finally:
        proc.send_signal(signal.SIGKILL)  # no clean stop, no snapshot: a crash
        proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == -signal.SIGKILL
    journal = tmp_path / "journal"
    assert seg == 1 and list_segments(journal) == [0, 1]

    # Resume: the store from the snapshot, then the journal from the checkpoint's segment.
    store = ReplayStore.restore(tmp_path / "store.snap")
    assert store.stats()["total"]["items"] == 20
    cfg = IngestConfig(seen_log=str(tmp_path / "seen.log"), journal_dir=str(journal))
    ingest = Ingest(store, cfg, tc)
    counts = ingest.replay_journal(seg)
    assert counts["replayed"] == 10 and counts["records"] == 10
    assert counts["torn"] == counts["corrupt"] == counts["duplicates"] == 0
    assert list_segments(journal) == [0, 1, 2]  # the restarted ingest writes to a new one

    # The actor lost every ack and resends all 30: all acknowledged, none stored again.
    sock = connect_dealer(ctx, ingest.start(), tc)
    try:
        assert _deliver(sock, sent) == {t.trajectory_id for t in sent}
        stats = ingest.stats()
        assert stats["duplicates"] == 30 and stats.get("stored", 0) == 0
    finally:
        sock.close(0)
        ingest.stop()
    ids = _drain_ids(store)
    assert sorted(ids) == sorted(t.trajectory_id for t in sent)  # none twice, none missing
    store.close()

    # A crash mid-write leaves a torn last record: skipped and counted, the rest replayed.
    last = segment_path(journal, seg)
    with last.open("r+b") as f:
        f.truncate(last.stat().st_size - 5000)
    again = ReplayStore.restore(tmp_path / "store.snap")
    counts = replay_journal(journal, again, seg)
    assert counts["replayed"] == 9 and counts["torn"] == 1 and counts["corrupt"] == 0
    assert sorted(_drain_ids(again)) == sorted(t.trajectory_id for t in sent[:29])
    again.close()


def test_checkpoint_while_trajectories_stream_in(
    ctx: zmq.Context, tmp_path: Path, png_pool: list[bytes]
) -> None:
    """The pause makes the snapshot/journal boundary exact under concurrent delivery."""
    store = ReplayStore(max_bytes=1 << 30, fresh_capacity=64, seed=0)
    tc = TransportConfig(data="tcp://127.0.0.1:0")
    journal = tmp_path / "journal"
    ingest = Ingest(store, IngestConfig(journal_dir=str(journal)), tc)
    sock = connect_dealer(ctx, ingest.start(), tc)
    sent = _trajs(30, png_pool)
    acked: set[str] = set()
    pausing = threading.Event()

    def stream() -> None:
        for i, t in enumerate(sent):
            if i == 15:  # the rest is sent while the checkpoint holds the ingest paused
                pausing.wait(TIMEOUT_S)
            sock.send_multipart(wire.encode(t))
            time.sleep(0.005)

    sender = threading.Thread(target=stream)
    sender.start()
    try:
        end = time.monotonic() + TIMEOUT_S
        while ingest.stats().get("stored", 0) < 10:
            assert time.monotonic() < end
            time.sleep(0.005)
        with ingest.paused():
            pausing.set()
            stored = ingest.stats()["stored"]
            time.sleep(0.1)  # trajectories arrive and wait (one in the handler, on the lock)
            assert ingest.stats()["stored"] == stored  # nothing goes in while paused
            seg = ingest.rotate_journal()
            store.snapshot(tmp_path / "store.snap")
        sender.join(TIMEOUT_S)
        acked = _acks(sock, 30)
    finally:
        pausing.set()
        sender.join(TIMEOUT_S)
        sock.close(0)
        ingest.stop()
    assert acked == {t.trajectory_id for t in sent}
    in_snapshot = ReplayStore.restore(tmp_path / "store.snap")
    n_snap = in_snapshot.stats()["total"]["items"]
    assert 10 <= n_snap <= 15  # the checkpoint really fell mid-stream
    counts = replay_journal(journal, in_snapshot, seg)
    assert counts["replayed"] == 30 - n_snap and counts["duplicates"] == 0
    assert sorted(_drain_ids(in_snapshot)) == sorted(acked)
    assert ingest.prune_journal(seg) == 1 and list_segments(journal) == [seg]
    store.close()
    in_snapshot.close()


def test_journal_records_round_trip_and_bad_bytes_are_skipped(
    tmp_path: Path, png_pool: list[bytes]
) -> None:
    trajs = _trajs(4, png_pool)
    j = Journal(tmp_path, fsync_every=3)
    for t in trajs:
        j.append(wire.encode(t))
    assert j.records == 4 and j.rotate() == 1
    j.append([b"not", b"a trajectory"])
    j.close()
    seg0 = segment_path(tmp_path, 0)
    recs = list(read_segment(seg0))
    assert [wire.decode(r.frames) for r in recs] == trajs
    assert [r.segment for r in recs] == [0] * 4

    # A message that is not a trajectory is counted as malformed; the rest goes in.
    store = ReplayStore(max_bytes=1 << 30, fresh_capacity=64, seed=0)
    counts = replay_journal(tmp_path, store, 0)
    assert counts["replayed"] == 4 and counts["malformed"] == 1 and counts["segments"] == 2
    assert store.stats()["total"]["items"] == 4

    # A flipped byte in the third record's payload: its CRC fails, the reader finds the
    # fourth (the next whole record that validates), so only the third is lost (counted).
    clean = seg0.read_bytes()
    data = bytearray(clean)
    data[recs[2].offset + 5000] ^= 0xFF
    seg0.write_bytes(bytes(data))
    counts = collections.Counter()
    got = [wire.decode(r.frames) for r in read_segment(seg0, counts)]
    assert got == [trajs[0], trajs[1], trajs[3]]
    assert counts["corrupt"] == 1 and counts["resynced"] == 1
    assert counts["skipped_bytes"] == recs[3].offset - recs[2].offset
    # A flipped byte in its frame-length table: the same, the fourth is found again.
    data = bytearray(clean)
    data[recs[2].offset + 16 + 1] ^= 0xFF
    seg0.write_bytes(bytes(data))
    counts = collections.Counter()
    got = [wire.decode(r.frames) for r in read_segment(seg0, counts)]
    assert got == [trajs[0], trajs[1], trajs[3]] and counts["corrupt"] == 1

    # A prefix that declares an enormous record: torn, nothing allocated from the claim.
    seg0.write_bytes(bytes(data[: recs[1].offset]) + b"ARJ1" + (3).to_bytes(4, "little") * 3)
    counts = collections.Counter()
    assert len(list(read_segment(seg0, counts))) == 1 and counts["torn"] == 1
    # Garbage and an empty file.
    seg0.write_bytes(b"\x00" * 100)
    counts = collections.Counter()
    assert list(read_segment(seg0, counts)) == [] and counts["corrupt"] == 1
    seg0.write_bytes(b"")
    assert list(read_segment(seg0)) == []

    # Already known ids are skipped; pruning keeps the open segment.
    fresh = ReplayStore(max_bytes=1 << 30, fresh_capacity=64, seed=0)
    j2 = Journal(tmp_path)
    assert j2.segment == 2
    for t in trajs:
        j2.append(wire.encode(t))
    counts = replay_journal(tmp_path, fresh, 2, known_ids={trajs[0].trajectory_id})
    assert counts["replayed"] == 3 and counts["duplicates"] == 1
    assert j2.prune(10) == 2 and list_segments(tmp_path) == [2]
    j2.close()
    store.close()
    fresh.close()


def test_only_stored_trajectories_are_journaled(
    ctx: zmq.Context, tmp_path: Path, png_pool: list[bytes]
) -> None:
    store = ReplayStore(max_bytes=1 << 30, fresh_capacity=64, seed=0)
    tc = TransportConfig(data="tcp://127.0.0.1:0")
    ingest = Ingest(store, IngestConfig(journal_dir=str(tmp_path / "j")), tc)
    sock = connect_dealer(ctx, ingest.start(), tc)
    ok = _trajs(2, png_pool)
    err = Trajectory(
        **{
            **{f: getattr(ok[0], f) for f in ok[0].__slots__},
            "trajectory_id": "env-fault",
            "status": Status.ENV_ERROR,
            "checker_score": 0.0,
            "reward": 0.0,
        }
    )
    try:
        assert _deliver(sock, [ok[0], err, ok[1], ok[0]]) == {
            *(t.trajectory_id for t in ok),
            "env-fault",
        }
    finally:
        sock.close(0)
        ingest.stop()
    recs = list(read_segment(segment_path(tmp_path / "j", 0)))
    assert [wire.decode(r.frames).trajectory_id for r in recs] == [t.trajectory_id for t in ok]
    store.close()


def test_journal_config() -> None:
    with pytest.raises(ConfigError, match="journal_fsync_every"):
        validate(IngestConfig(journal_dir="j", journal_fsync_every=0))
    store = ReplayStore(max_bytes=1 << 20, seed=0)
    ingest = Ingest(store)  # no journal: rotation is a no-op
    assert ingest.journal is None and ingest.rotate_journal() == 0
    assert ingest.prune_journal(5) == 0 and ingest.replay_journal(0) == {}
    ingest.stop()
    store.close()


_FULL_DISK = textwrap.dedent(
    """
    import json, resource, signal, sys
    from pathlib import Path
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from conftest import make_png, make_trajectory
    from arpo import wire
    from arpo.buffer import ReplayStore
    from arpo.service.ingest import Ingest, IngestConfig
    from arpo.transport import TransportConfig, connect_dealer
    import zmq

    work = Path(sys.argv[1])
    pngs = [make_png(np.random.default_rng(0)) for _ in range(2)]
    trajs = [
        make_trajectory(np.random.default_rng(i), turns=4, tokens=2000, pngs=pngs)
        for i in range(4)
    ]
    record = sum(len(f) for f in wire.encode(trajs[0])) + 100
    store = ReplayStore(max_bytes=1 << 30, seed=0)
    tc = TransportConfig(data="tcp://127.0.0.1:0")
    ingest = Ingest(store, IngestConfig(journal_dir=str(work / "j")), tc)
    # Files may grow to 2.5 records: the third write fails half-way with EFBIG.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limit = int(2.5 * record)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    ctx = zmq.Context()
    sock = connect_dealer(ctx, ingest.start(), tc)
    acked = []
    for t in trajs:
        sock.send_multipart(wire.encode(t))
        if sock.poll(3000):
            acked += wire.decode(sock.recv_multipart()).ids
    print(json.dumps({"acked": acked, "sent": [t.trajectory_id for t in trajs],
                      "stats": ingest.stats(), "seen": [t.trajectory_id in ingest.seen for t in trajs]}))
    sock.close(0)
    ingest.stop()
    ctx.term()
    """
)


def test_a_failed_journal_write_is_not_acknowledged(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tmp_path), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert res["acked"] == res["sent"][:2]  # the journal is full after two: no more acks
    assert res["stats"]["journal_errors"] == 2 and res["stats"]["stored"] == 2
    assert res["seen"] == [True, True, False, False]  # a resend will be stored
    # The failed writes were cut back: the segment reads cleanly, nothing torn.
    counts = collections.Counter()
    recs = list(read_segment(segment_path(tmp_path / "j", 0), counts))
    assert [wire.decode(r.frames).trajectory_id for r in recs] == res["sent"][:2]
    assert counts["torn"] == counts["corrupt"] == 0

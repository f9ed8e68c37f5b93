"""The ingest: trajectories off the data socket, into the replay store, acknowledged.

    store = ReplayStore(max_bytes=8 << 30, fresh_capacity=64, replay_capacity=8)
    ingest = Ingest(store, IngestConfig(), TransportConfig(data="tcp://127.0.0.1:5555"))
    ingest.start()           # a thread: receive, decode, validate, store, acknowledge
    ...
    ingest.stats()           # counters: stored, duplicates, malformed by reason, ...
    ingest.stop()

For each message on the data link (a ROUTER, `arpo.transport`):

1. size check (`max_trajectory_bytes`), then `wire.decode` (strict validation);
2. a trajectory id already stored is a duplicate (the actor resent it because our ack
   was lost): acknowledged again, not stored again;
3. an `ok` trajectory is appended to the journal (when `journal_dir` is set, below) and
   goes into the store (`store.put(task, wire.to_item(traj))`); an
   `env_error` / `eval_error` / `timeout` one is delivered but excluded from training:
   counted by status, kept in a short list for inspection, not stored;
4. `on_trajectory(traj, stored)` lets the grant book close the slot (and say whether the
   slot was already filled by a re-issued grant: then the trajectory is a surplus and is
   not stored);
5. only then the acknowledgement goes back: the actor deletes its spool file.

Heartbeats are answered with the learner's heartbeat (policy version, counters).
Malformed messages are counted by reason and logged (rate-limited); nothing a peer sends
stops the loop. Refused CURVE handshakes are counted as `unauthenticated`.

Seen ids: a bounded set (`seen_capacity`, oldest forgotten first), optionally written to
`seen_log` (one id per line, appended and flushed before the ack; fsynced every
`seen_fsync_every` ids) and reloaded on start, so a restarted learner still drops
duplicates of what it stored before. Like the store (which is durable only as of its last
snapshot), the log is as durable as its last fsync.

Journal (`journal_dir`): a write-ahead log of every trajectory that goes into the store,
so an acknowledged trajectory survives a learner crash. Before an `ok` trajectory is put
into the store, the frames it arrived in are written (unbuffered) to the end of the
current segment `journal-<n:08d>.log`; a failed write (disk full) is cut back and the
trajectory is neither stored nor acknowledged (the actor sends it again). The segment
is fsynced every `journal_fsync_every`
records (1, the default: before every ack, which is what the ack promises; with N > 1 a
killed process still loses nothing, the kernel has the bytes, but a power loss or kernel
crash can lose up to N - 1 acknowledged trajectories; an fsync of a 400 KB record costs
about 2 ms on the project machine). Only `ok` trajectories are journaled: the others are
counted and not stored. The journal holds every stored byte since the oldest kept
checkpoint (about 1.4 MB per 15-turn episode of 1080p screenshots). A record is

    b"ARJ1", n_frames (u32), payload bytes (u64) | n_frames lengths (u64) | frames | crc32

(little-endian; the CRC covers everything before it), so a torn tail is detected and
skipped by the reader. A checkpoint (`arpo.learner.checkpoint`) pairs the journal with a
store snapshot; inserting is paused for the length of the snapshot (about 0.2 s for a
200 MB store here; messages wait in ZeroMQ's queues meanwhile), so the snapshot holds
exactly the segments before the rotation and none after:

    with ingest.paused():
        seg = ingest.rotate_journal()      # segments < seg are in the snapshot
        store.snapshot(path)
    ...                                    # the checkpoint is complete
    ingest.prune_journal(seg)              # delete segments < seg

    # on resume: the store from the snapshot, then what arrived after it
    store = ReplayStore.restore(path)
    ingest = Ingest(store, config, transport)
    ingest.replay_journal(seg)             # re-inserts segments >= seg, marks them seen
    ingest.start()

Replayed trajectories go straight into the store (the grant book is not told again).

A folder of journal segments is also how trajectories are kept on disk: `arpo collect`,
`arpo select-tasks`' kept episodes and the demonstrations of `arpo sft` write it, and
`read_collection` reads it back, decoded, for the learner's replay prefill and the
offline methods.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import struct
import threading
import time
import zlib
from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arpo import wire
from arpo.config import fail, option
from arpo.errors import ArpoError, BufferClosed, BufferError, WireError
from arpo.files import fsync_dir
from arpo.record import Status, Trajectory
from arpo.transport import RouterServer, TransportConfig

log = logging.getLogger("arpo.service.ingest")


@dataclass
class IngestConfig:
    """The learner's receiving side."""

    seen_capacity: int = option(1_000_000, "Trajectory ids remembered to drop duplicates.")
    seen_log: str = option("", "File of seen ids (reloaded on start); empty: memory only.")
    seen_fsync_every: int = option(64, "fsync the seen-id log every this many ids.")
    excluded_keep: int = option(256, "Excluded (env_error...) trajectories kept for inspection.")
    learner_id: str = option("learner", "Sender name in the learner's heartbeats.")
    journal_dir: str = option(
        "",
        "Folder of the write-ahead journal of stored trajectories (replayed on resume); "
        "empty: no journal, a crash loses what arrived after the last store snapshot.",
    )
    journal_fsync_every: int = option(
        1,
        "fsync the journal every this many records; 1 fsyncs before every ack (the ack "
        "promises durability); N > 1 is faster, but a power loss can lose up to N - 1 "
        "acknowledged trajectories (a crash of the process alone loses none).",
    )

    def validate(self) -> None:
        if self.seen_capacity < 1:
            fail("seen_capacity", "must be >= 1")
        if self.seen_fsync_every < 1:
            fail("seen_fsync_every", "must be >= 1")
        if self.journal_fsync_every < 1:
            fail("journal_fsync_every", "must be >= 1 (1: fsync before every ack)")


class SeenIds:
    """A bounded set of trajectory ids, oldest forgotten first, optionally logged to a file."""

    def __init__(self, capacity: int, path: str | Path | None = None, fsync_every: int = 64):
        self.capacity = capacity
        self._ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._path = Path(path) if path else None
        self._fsync_every = fsync_every
        self._unsynced = 0
        self._lines = 0
        self._file: Any = None
        if self._path is not None:
            if self._path.exists():
                with self._path.open("r", encoding="utf-8", errors="replace") as f:
                    for line in f:
                        if line.endswith("\n") and line.strip():
                            self._remember(line.strip())
                            self._lines += 1
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self._path.open("a", encoding="utf-8")
            if self._lines > 2 * capacity:
                self._compact()

    def __contains__(self, tid: str) -> bool:
        return tid in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def _remember(self, tid: str) -> None:
        self._ids[tid] = None
        self._ids.move_to_end(tid)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def add(self, tid: str) -> None:
        self._remember(tid)
        if self._file is not None:
            self._file.write(tid + "\n")
            self._file.flush()
            self._lines += 1
            self._unsynced += 1
            if self._unsynced >= self._fsync_every:
                self.sync()
            if self._lines > 2 * self.capacity:
                self._compact()

    def sync(self) -> None:
        if self._file is not None and self._unsynced:
            os.fsync(self._file.fileno())
            self._unsynced = 0

    def _compact(self) -> None:
        assert self._path is not None
        tmp = self._path.with_suffix(self._path.suffix + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            f.writelines(t + "\n" for t in self._ids)
            f.flush()
            os.fsync(f.fileno())
        if self._file is not None:
            self._file.close()
        os.replace(tmp, self._path)
        self._file = self._path.open("a", encoding="utf-8")
        self._lines = len(self._ids)
        self._unsynced = 0

    def close(self) -> None:
        if self._file is not None:
            self.sync()
            self._file.close()
            self._file = None


# ---------------------------------------------------------------------------- the journal

JOURNAL_MAGIC = b"ARJ1"
_RECORD_PREFIX = struct.Struct("<4sIQ")  # magic, number of frames, payload bytes
_CRC = struct.Struct("<I")
_MAX_FRAMES = 3 + 2 * wire.MAX_TURNS
"""Most frames a journal record may declare (a trajectory has 5 + turns frames)."""
_SEGMENT = re.compile(r"^journal-(\d{8,})\.log$")


def segment_path(journal_dir: str | Path, n: int) -> Path:
    """The file of journal segment `n`."""
    return Path(journal_dir) / f"journal-{n:08d}.log"


def list_segments(journal_dir: str | Path) -> list[int]:
    """The segment numbers present in `journal_dir`, ascending ([] when it does not exist)."""
    try:
        names = os.listdir(journal_dir)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(_SEGMENT.match, names) if m)


class Journal:
    """The append side of the journal: one open segment, records appended unbuffered.

    Not thread-safe on its own: the `Ingest` calls it under its store lock. Opening a
    journal starts a new segment after the highest one present, so a segment written
    before a crash (possibly with a torn tail) is never appended to.
    """

    def __init__(self, journal_dir: str | Path, fsync_every: int = 1) -> None:
        self.dir = Path(journal_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync_every = fsync_every
        existing = list_segments(self.dir)
        self.segment = existing[-1] + 1 if existing else 0
        self._unsynced = 0
        self.records = 0
        self.bytes = 0
        self._fd: int | None = None
        self._size = 0
        self._open()

    def _open(self) -> None:
        # Created eagerly and the folder fsynced: the newest segment number always exists
        # on disk, so a restarted learner never reuses a number below a checkpoint's.
        path = segment_path(self.dir, self.segment)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        self._size = os.fstat(self._fd).st_size
        fsync_dir(self.dir)

    def _write(self, buf: memoryview | bytes) -> None:
        assert self._fd is not None
        mv = memoryview(buf)
        while mv.nbytes:
            n = os.write(self._fd, mv)  # unbuffered: after it returns the kernel has the bytes
            self._size += n
            mv = mv[n:]

    def append(self, frames: Sequence[Any]) -> None:
        """Append one record (the message's frames); fsync per `fsync_every`.

        On a write error (disk full, file size limit) the segment is cut back to where the
        record began, so no torn record sits before later ones (if even that fails, later
        records go to a new segment), and the OSError is raised.
        """
        if self._fd is None:
            raise OSError("the journal is closed")
        views = [memoryview(getattr(fr, "buffer", fr)).cast("B") for fr in frames]
        head = _RECORD_PREFIX.pack(JOURNAL_MAGIC, len(views), sum(v.nbytes for v in views))
        head += struct.pack(f"<{len(views)}Q", *(v.nbytes for v in views))
        start = self._size
        try:
            crc = zlib.crc32(head)
            self._write(head)
            for v in views:
                crc = zlib.crc32(v, crc)
                self._write(v)
            self._write(_CRC.pack(crc))
            self._unsynced += 1
            if self._unsynced >= self.fsync_every:
                self.sync()
        except OSError:
            try:
                os.ftruncate(self._fd, start)
                self._size = start
            except OSError:
                with contextlib.suppress(OSError):
                    self.rotate()
            raise
        self.records += 1
        self.bytes += self._size - start

    def sync(self) -> None:
        """fsync the open segment (a sync point: it waits for the disk)."""
        if self._fd is not None and self._unsynced:
            os.fsync(self._fd)
            self._unsynced = 0

    def rotate(self) -> int:
        """Close the current segment (fsynced) and start the next; returns the new number."""
        self.close()
        self.segment += 1
        self._open()
        return self.segment

    def prune(self, before: int) -> int:
        """Delete the segments numbered below `before` (never the open one); returns how many."""
        before = min(before, self.segment)
        gone = 0
        for n in list_segments(self.dir):
            if n < before:
                segment_path(self.dir, n).unlink(missing_ok=True)
                gone += 1
        if gone:
            fsync_dir(self.dir)
        return gone

    def close(self) -> None:
        """fsync and close the open segment (a later `append` raises OSError)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self._unsynced = 0


@dataclass
class JournalRecord:
    """One record read back from the journal: its segment number, offset and frames."""

    segment: int
    offset: int
    frames: list[bytes]


def _record_starts(f: Any, at: int, size: int) -> bool:
    """Whether a record prefix with the journal's magic starts at `at` (or the file ends
    there); leaves the file positioned at `at`."""
    if at == size:
        return True
    f.seek(at)
    prefix = f.read(_RECORD_PREFIX.size)
    f.seek(at)
    return len(prefix) == _RECORD_PREFIX.size and _RECORD_PREFIX.unpack(prefix)[0] == (
        JOURNAL_MAGIC
    )


def read_segment(
    path: str | Path, counts: collections.Counter[str] | None = None
) -> Iterator[JournalRecord]:
    """The intact records of one segment file, in order.

    Reading stops at the first record that is cut short (`counts["torn"]`: a crash during
    the write) or fails its checks (`counts["corrupt"]`: bad magic or lengths), since the
    records after it cannot be located. A record whose framing is intact but whose CRC
    fails (a flipped bit in its payload) is skipped alone when the next record starts where
    its framing says (or the file ends there): `counts["corrupt_skipped_records"]`. It
    never raises for the file's contents.
    Nothing is allocated beyond the file's own size, whatever a record declares.
    """
    counts = counts if counts is not None else collections.Counter()
    path = Path(path)
    n = int(m.group(1)) if (m := _SEGMENT.match(path.name)) else -1
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        while True:
            offset = f.tell()
            prefix = f.read(_RECORD_PREFIX.size)
            if not prefix:
                return
            bad = ""
            if len(prefix) < _RECORD_PREFIX.size:
                counts["torn"] += 1
                bad = "a record prefix cut short"
            else:
                magic, n_frames, payload = _RECORD_PREFIX.unpack(prefix)
                end = offset + _RECORD_PREFIX.size + 8 * n_frames + payload + _CRC.size
                if magic != JOURNAL_MAGIC or n_frames > _MAX_FRAMES:
                    counts["corrupt"] += 1
                    bad = "no record starts here (bad magic or frame count)"
                elif end > size:
                    counts["torn"] += 1
                    bad = f"a record of {end - offset} bytes cut short at the end of the file"
                else:
                    raw = f.read(8 * n_frames)
                    lengths = struct.unpack(f"<{n_frames}Q", raw)
                    crc = zlib.crc32(raw, zlib.crc32(prefix))
                    if sum(lengths) != payload:
                        counts["corrupt"] += 1
                        bad = "frame lengths disagree with the record's size"
                    else:
                        frames = [f.read(k) for k in lengths]
                        for fr in frames:
                            crc = zlib.crc32(fr, crc)
                        (stored,) = _CRC.unpack(f.read(_CRC.size))
                        if stored != crc and _record_starts(f, end, size):
                            # The framing is intact and locates the next record: only
                            # this one is lost (a flipped bit in its payload).
                            counts["corrupt"] += 1
                            counts["corrupt_skipped_records"] += 1
                            log.warning(
                                "journal %s: CRC mismatch in the record at offset %d; that "
                                "record is skipped, the next one is read",
                                path,
                                offset,
                            )
                            continue
                        if stored != crc:
                            counts["corrupt"] += 1
                            bad = "CRC mismatch"
                        else:
                            counts["records"] += 1
                            yield JournalRecord(n, offset, frames)
                            continue
            log.warning(
                "journal %s: %s at offset %d; the rest of the segment (%d bytes) is skipped",
                path,
                bad,
                offset,
                size - offset,
            )
            counts["skipped_bytes"] += size - offset
            return


def replay_journal(
    journal_dir: str | Path,
    store: Any,
    from_segment: int,
    *,
    seen: Any = None,
    known_ids: Container[str] = (),
) -> dict[str, int]:
    """Put every trajectory of segments >= `from_segment` back into `store`, in order.

    For resuming after `ReplayStore.restore` of a snapshot taken with the ingest paused
    right after `rotate_journal()` returned `from_segment`: that snapshot holds everything
    of the segments below and nothing of the rest, so each record is inserted once.
    `known_ids` (ids already in the store) are skipped, and so is an id met twice in the
    replay. Every replayed id is added to `seen` (the ingest's `SeenIds`, if given), so a
    resend by an actor is a duplicate even if the seen-id log lost its unsynced tail.

    Returns counts: segments, records, replayed, duplicates, torn, corrupt, malformed
    (a record whose frames do not decode), rejected (the store refused the item),
    skipped_bytes. Bad records are counted and logged, never raised.
    """
    counts: collections.Counter[str] = collections.Counter()
    replayed: set[str] = set()
    for n in list_segments(journal_dir):
        if n < from_segment:
            continue
        counts["segments"] += 1
        for rec in read_segment(segment_path(journal_dir, n), counts):
            try:
                traj = wire.decode(rec.frames)
            except WireError as e:
                counts["malformed"] += 1
                log.warning("journal segment %d offset %d: %s", n, rec.offset, e)
                continue
            if not isinstance(traj, Trajectory):
                counts["malformed"] += 1
                continue
            tid = traj.trajectory_id
            if tid in replayed or tid in known_ids:
                counts["duplicates"] += 1
                continue
            try:
                store.put(traj.task_id, wire.to_item(traj))
            except BufferClosed:
                raise
            except BufferError as e:
                counts["rejected"] += 1
                log.warning("journal: the store refused %s: %s", tid, e)
            else:
                counts["replayed"] += 1
            replayed.add(tid)
            if seen is not None and tid not in seen:
                seen.add(tid)
    for key in ("segments", "records", "replayed", "duplicates", "torn", "corrupt"):
        counts.setdefault(key, 0)
    for key in ("malformed", "rejected", "skipped_bytes"):
        counts.setdefault(key, 0)
    return dict(counts)


TRAJECTORIES = "trajectories"
"""The folder of a collection's journal (`arpo collect`'s `<out>/trajectories/`)."""


def _journal_dir(path: str | Path) -> Path:
    p = Path(path)
    return p / TRAJECTORIES if (p / TRAJECTORIES).is_dir() else p


def read_collection(
    path: str | Path, counts: collections.Counter[str] | None = None
) -> Iterator[Trajectory]:
    """Every stored trajectory of a collection: a journal folder, or a folder that holds
    one as `trajectories/` (`arpo collect`'s output).

    Decoded with `arpo.wire.decode` (strict validation), in the order they were stored.
    Torn or corrupt records and records that do not decode to a trajectory are skipped,
    logged and counted in `counts` (torn, corrupt, malformed; records: the intact ones).
    """
    counts = counts if counts is not None else collections.Counter()
    jdir = _journal_dir(path)
    if not jdir.is_dir():
        raise ArpoError(f"{path}: not a collection (no {TRAJECTORIES}/ folder)")
    for n in list_segments(jdir):
        for rec in read_segment(segment_path(jdir, n), counts):
            try:
                msg = wire.decode(rec.frames)
            except WireError as e:
                counts["malformed"] += 1
                log.warning("collection %s segment %d offset %d: %s", jdir, n, rec.offset, e)
                continue
            if not isinstance(msg, Trajectory):
                counts["malformed"] += 1
                continue
            yield msg


class Ingest:
    """Receive, decode, validate, store, acknowledge (see the module docstring)."""

    def __init__(
        self,
        store: Any,
        config: IngestConfig | None = None,
        transport: TransportConfig | None = None,
        *,
        version: Callable[[], int] = lambda: 0,
        on_trajectory: Callable[[Trajectory], bool] | None = None,
    ) -> None:
        self.store = store
        self.config = config or IngestConfig()
        self.transport = transport or TransportConfig()
        self._version = version
        self._on_trajectory = on_trajectory
        self.seen = SeenIds(
            self.config.seen_capacity, self.config.seen_log or None, self.config.seen_fsync_every
        )
        self._lock = threading.Lock()
        """Guards the counters (short holds, taken by `stats()` from any thread)."""
        self._store_lock = threading.RLock()
        """Held from "journal append" to "seen" for every stored trajectory, and by
        `paused()`: while a checkpoint holds it, no trajectory is half-way in."""
        self.journal = (
            Journal(self.config.journal_dir, self.config.journal_fsync_every)
            if self.config.journal_dir
            else None
        )
        self.counts: collections.Counter[str] = collections.Counter()
        self.rejected: collections.Counter[str] = collections.Counter()
        """Malformed / refused messages by reason (the reason's first words)."""
        self.excluded: collections.deque[Trajectory] = collections.deque(
            maxlen=self.config.excluded_keep
        )
        self.actors: dict[str, float] = {}
        """Actor id -> time.monotonic() of its last heartbeat."""
        self.actor_stats: dict[str, dict[str, float]] = {}
        """Actor id -> the numeric counters of its last heartbeat (time split, episodes)."""
        self._hb_seq = 0
        self._last_log = 0.0
        self.server = RouterServer(
            self.transport.data,
            self.transport,
            self.handle,
            name="ingest",
            on_auth_failure=self._auth_failure,
        )

    # ---- lifecycle --------------------------------------------------------------------

    def start(self) -> str:
        """Bind the data endpoint and start the receiving thread; returns the endpoint."""
        return self.server.start()

    def stop(self) -> None:
        self.server.stop()
        with self._store_lock:
            self.seen.close()
            if self.journal is not None:
                self.journal.close()

    # ---- durability (called by the learner's checkpoint and resume) -------------------

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold off inserting for the duration: messages wait in ZeroMQ's queues meanwhile.

        Inside, the store, the journal and the seen ids agree: every trajectory is either
        stored, journaled and seen, or none of them.
        """
        with self._store_lock:
            yield

    def rotate_journal(self) -> int:
        """Close the current journal segment (fsynced) and start the next; returns its number.

        The returned number is the first segment NOT in a store snapshot taken after this
        call with the ingest still paused (`with ingest.paused(): seg =
        ingest.rotate_journal(); store.snapshot(p)`). Without a journal it returns 0 and
        does nothing. The seen-id log is fsynced too.
        """
        with self._store_lock:
            self.seen.sync()
            if self.journal is None:
                return 0
            return self.journal.rotate()

    def prune_journal(self, before: int) -> int:
        """Delete journal segments numbered below `before`; returns how many went."""
        with self._store_lock:
            return 0 if self.journal is None else self.journal.prune(before)

    def replay_journal(self, from_segment: int, *, known_ids: Container[str] = ()) -> dict:
        """`replay_journal` of this ingest's journal into its store, marking the ids seen.

        Call it on resume, after restoring the store and before `start()`; returns the
        counts of the module function.
        """
        if not self.config.journal_dir:
            return {}
        with self._store_lock:
            counts = replay_journal(
                self.config.journal_dir,
                self.store,
                from_segment,
                seen=self.seen,
                known_ids=known_ids,
            )
            self.seen.sync()
        with self._lock:
            self.counts["journal_replayed"] += counts["replayed"]
        log.info("ingest: replayed the journal from segment %d: %s", from_segment, counts)
        return counts

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                **self.counts,
                "rejected": dict(self.rejected),
                "seen": len(self.seen),
                "actors": len(self.actors),
            }

    # ---- the handler (server thread) --------------------------------------------------

    def _reject(self, reason: str, detail: str) -> None:
        with self._lock:
            self.rejected[reason] += 1
            self.counts["rejected_total"] += 1
        now = time.monotonic()
        if now - self._last_log > 1.0:  # a flood of garbage must not flood the log
            self._last_log = now
            log.warning("ingest: rejected a message (%s): %s", reason, detail[:300])

    def _auth_failure(self, event: str) -> None:
        self._reject("unauthenticated", f"handshake refused ({event})")

    def handle(self, frames: list[Any]) -> list[wire.Frames]:
        size = sum(len(f) for f in frames)  # bytes or zmq.Frame
        with self._lock:
            self.counts["messages"] += 1
            self.counts["bytes"] += size
        if size > self.transport.max_trajectory_bytes:
            self._reject("oversized", f"{size} bytes > {self.transport.max_trajectory_bytes}")
            return []
        try:
            msg = wire.decode(frames)
        except WireError as e:
            self._reject("malformed", str(e))
            return []
        if isinstance(msg, wire.Heartbeat):
            return [self._heartbeat(msg)]
        if not isinstance(msg, Trajectory):
            self._reject("unexpected", f"a {type(msg).__name__} on the data link")
            return []
        return [wire.encode(wire.Ack((msg.trajectory_id,)))] if self._ingest(msg, frames) else []

    def actor_totals(self, keys: tuple[str, ...]) -> dict[str, float]:
        """Sums over actors of these counters of their last heartbeats (0 when none has)."""
        with self._lock:
            return {k: sum(a.get(k, 0.0) for a in self.actor_stats.values()) for k in keys}

    def _heartbeat(self, hb: wire.Heartbeat) -> wire.Frames:
        with self._lock:
            self.counts["heartbeats"] += 1
            if hb.role == "actor":
                self.actors[hb.sender] = time.monotonic()
                self.actor_stats[hb.sender] = {
                    k: float(v)
                    for k, v in hb.stats.items()
                    if isinstance(v, int | float) and not isinstance(v, bool)
                }
            self._hb_seq += 1
            stats = {k: v for k, v in self.counts.items() if isinstance(v, int)}
        reply = wire.Heartbeat(
            self.config.learner_id,
            "learner",
            self._hb_seq,
            max(0, self._version()),
            time.time(),
            dict(list(stats.items())[: wire.MAX_STATS]),
        )
        return wire.encode(reply)

    def _ingest(self, traj: Trajectory, frames: Sequence[Any] = ()) -> bool:
        """Store (or exclude) a trajectory; True when it may be acknowledged."""
        tid = traj.trajectory_id
        if tid in self.seen:
            with self._lock:
                self.counts["duplicates"] += 1
            return True
        fresh = True
        if self._on_trajectory is not None:
            fresh = self._on_trajectory(traj)
        if not fresh:
            with self._lock:
                self.counts["surplus"] += 1
        elif traj.status != Status.OK:
            with self._lock:
                self.counts[f"excluded_{traj.status.value}"] += 1
                self.excluded.append(traj)
        else:
            with self._store_lock:
                if self.journal is not None:
                    try:
                        # Written ahead: a crash after this line replays it on resume.
                        self.journal.append(frames or wire.encode(traj))
                    except OSError as e:  # disk full...: not acknowledged, the actor resends
                        with self._lock:
                            self.counts["journal_errors"] += 1
                        log.error("ingest: journal write failed, %s not acknowledged: %s", tid, e)
                        return False
                try:
                    self.store.put(traj.task_id, wire.to_item(traj))
                except BufferClosed:  # shutting down: not acknowledged, the actor sends it again
                    return False
                except BufferError as e:  # can never fit (larger than the store's budget)
                    self._reject("store", f"{tid}: {e}")
                else:
                    with self._lock:
                        self.counts["stored"] += 1
                        self.counts["steps"] += traj.steps
                self.seen.add(tid)
            return True
        self.seen.add(tid)
        return True

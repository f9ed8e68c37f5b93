"""The write-ahead journal: segment files of wire-encoded messages, their writer and readers.

    journal = Journal("runs/demos")              # a new segment after the highest present
    journal.append(wire.encode(traj))            # one record, written unbuffered
    journal.close()                              # fsyncs the segment
    for traj in read_collection("runs/demos"):   # decoded; torn or corrupt records skipped
        ...

A journal is a folder of segments `journal-<n:08d>.log`, each a run of records appended
unbuffered by one `Journal` (a new one opens a segment after the highest present, so a
segment written before a crash is never appended to). A record is

    b"ARJ1", n_frames (u32), payload bytes (u64) | n_frames lengths (u64) | frames | crc32

(little-endian; the CRC covers everything before it), so a torn tail is detected and
skipped by the reader (`read_segment`).

The ingest (`arpo.service.ingest`) journals every trajectory before it goes into the
store, so an acknowledged trajectory survives a learner crash; `replay_journal` puts the
segments written after a store snapshot back into the store on resume.

A folder of journal segments is also how trajectories are kept on disk: `arpo collect`,
`arpo select-tasks`' kept episodes and the demonstrations of `arpo sft` write it, and
`read_collection` reads it back, decoded, for the learner's replay prefill and the
offline methods.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import os
import re
import stat
import struct
import zlib
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arpo import store_item, wire
from arpo.errors import ArpoError, BufferClosed, BufferError, WireError
from arpo.files import fsync_dir
from arpo.record import Trajectory

log = logging.getLogger("arpo.service.journal")

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


def _record_at(buf: Any, at: int, size: int) -> tuple[list[bytes], int] | str:
    """The frames of the record starting at `at` and where it ends, or why none is there
    ("torn": cut short by the end of the file; anything else: damaged)."""
    if size - at < _RECORD_PREFIX.size:
        return "torn"
    magic, n_frames, payload = _RECORD_PREFIX.unpack_from(buf, at)
    if magic != JOURNAL_MAGIC or n_frames > _MAX_FRAMES:
        return "no record starts here (bad magic or frame count)"
    head_end = at + _RECORD_PREFIX.size + 8 * n_frames
    end = head_end + payload + _CRC.size
    if end > size:
        return "torn"
    lengths = struct.unpack_from(f"<{n_frames}Q", buf, at + _RECORD_PREFIX.size)
    if sum(lengths) != payload:
        return "frame lengths disagree with the record's size"
    crc = zlib.crc32(buf[at:head_end])
    frames, pos = [], head_end
    for k in lengths:
        frames.append(bytes(buf[pos : pos + k]))
        crc = zlib.crc32(frames[-1], crc)
        pos += k
    (stored,) = _CRC.unpack_from(buf, pos)
    if stored != crc:
        return "CRC mismatch"
    return frames, end


def _regular(path: Path, counts: collections.Counter[str]) -> bool:
    """Whether `path` is a regular file (a directory, FIFO, socket or device named like a
    segment is refused by name, counted as not_a_file, and never opened)."""
    try:
        st = os.stat(path)
    except OSError as e:
        counts["not_a_file"] += 1
        log.warning("journal %s: cannot be read (%s); skipped", path, e)
        return False
    if not stat.S_ISREG(st.st_mode):
        counts["not_a_file"] += 1
        log.warning("journal %s: not a regular file; skipped", path)
        return False
    return True


def read_segment(
    path: str | Path, counts: collections.Counter[str] | None = None
) -> Iterator[JournalRecord]:
    """The intact records of one segment file, in order.

    Every record carries its own CRC, so damage never costs more than the damaged bytes:
    after a record that fails its checks (a flipped bit in its magic, frame count, lengths or
    payload: `counts["corrupt"]`), the reader searches forward for the next position where
    a whole record validates (magic, framing and CRC) and goes on from there
    (`counts["resynced"]`, `counts["skipped_bytes"]`). A record cut short by the end of the
    file is a torn tail (`counts["torn"]`: a crash during the write). A path that is not a
    regular file (a directory, a FIFO) is skipped by name without being opened. It never
    raises for the file's contents, and allocates nothing beyond the records it returns.
    """
    counts = counts if counts is not None else collections.Counter()
    path = Path(path)
    n = int(m.group(1)) if (m := _SEGMENT.match(path.name)) else -1
    if not _regular(path, counts):
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        counts["not_a_file"] += 1
        log.warning("journal %s: cannot be opened (%s); skipped", path, e)
        return
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # replaced since the check
            counts["not_a_file"] += 1
            return
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            at = 0
            while at < size:
                got = _record_at(buf, at, size)
                if not isinstance(got, str):
                    frames, at_next = got
                    counts["records"] += 1
                    yield JournalRecord(n, at, frames)
                    at = at_next
                    continue
                # Damaged or torn here: the next position where a whole record validates.
                nxt = buf.find(JOURNAL_MAGIC, at + 1)
                while nxt != -1 and isinstance(_record_at(buf, nxt, size), str):
                    nxt = buf.find(JOURNAL_MAGIC, nxt + 1)
                stop = size if nxt == -1 else nxt
                if got == "torn" and nxt == -1:
                    counts["torn"] += 1
                else:
                    counts["corrupt"] += 1
                counts["skipped_bytes"] += stop - at
                if nxt == -1:
                    log.warning(
                        "journal %s: %s at offset %d; no intact record after it (%d bytes "
                        "skipped)", path, got, at, size - at,
                    )  # fmt: skip
                    return
                counts["resynced"] += 1
                log.warning(
                    "journal %s: %s at offset %d; %d bytes skipped, reading again at offset "
                    "%d", path, got, at, nxt - at, nxt,
                )  # fmt: skip
                at = nxt


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
                store.put(traj.task_id, store_item.to_item(traj))
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


def journal_trajectory_ids(journal_dir: str | Path, from_segment: int) -> set[str]:
    """Ids of the trajectories in segments >= `from_segment` of `journal_dir` (what
    `replay_journal` would put back into a store restored with that segment); torn,
    corrupt and undecodable records are skipped, as there."""
    out: set[str] = set()
    for n in list_segments(journal_dir):
        if n < from_segment:
            continue
        for rec in read_segment(segment_path(journal_dir, n)):
            try:
                msg = wire.decode(rec.frames)
            except WireError:
                continue
            if isinstance(msg, Trajectory):
                out.add(msg.trajectory_id)
    return out


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

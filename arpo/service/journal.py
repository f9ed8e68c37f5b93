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
import os
import re
import struct
import zlib
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arpo import wire
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

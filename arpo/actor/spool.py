"""The actor's spool: every finished trajectory on local disk until the learner acknowledged it.

    spool = Spool("runs/actor-0/spool", max_bytes=2 << 30)
    spool.put(traj)              # encode, write <tid>.traj.tmp, fsync, rename to <tid>.traj, fsync dir
    frames = spool.frames(tid)   # the wire frames again, to (re)send
    spool.remove(tid)            # once acknowledged
    spool.ids()                  # what is waiting, oldest first (resent on start)

A spool file is the trajectory's wire message (`arpo.wire`) framed for a file:
b"ARPOSPL1", the frame count (u32), each frame's length (u64), then the frames. Reading
it back runs the wire decoder, so a damaged file is detected; it is moved to `bad/`
and logged, never sent. Left-over `<id>.traj.tmp` files (a crash while writing) are
deleted on open: their trajectory was not yet reported as spooled, so nothing
acknowledged is lost. The ledger (`finished.log`) gets its line after the file: on open a
torn last line is cut and a spooled file without a line gets one, read from the file.
A trajectory the learner refuses for good (`arpo.wire.Refuse`) is
moved to `refused/` with its reason, never sent again.

The spool owns only what it writes: it opens a folder that has its marker file
(`.arpo-spool`), is empty, or holds only a spool's files; any other folder (a user's
files, the working directory) is refused with the reason.

`full` is true once the spool holds `max_bytes`: the actor then starts no new episode
(it never drops a finished one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import struct
import threading
from pathlib import Path

from arpo import wire
from arpo.errors import WireError
from arpo.files import fsync_dir
from arpo.record import Trajectory

log = logging.getLogger("arpo.actor.spool")

MAGIC = b"ARPOSPL1"
_COUNT = struct.Struct("<I")
_LEN = struct.Struct("<Q")
SUFFIX = ".traj"
LEDGER = "finished.log"
"""Every trajectory ever put in the spool: `<id>\t<status>\t<task>` per line (kept when the
trajectory itself leaves the spool), so a run can account for what its actors finished."""


MARKER = ".arpo-spool"
"""The file that says a folder is a spool: the spool deletes or moves only what it wrote,
in a folder it created or found empty (or holding only a spool's files: an older spool)."""
TMP_SUFFIX = SUFFIX + ".tmp"
REFUSED = "refused"
"""Subfolder of trajectories the learner refused for good (kept, never sent again)."""
_OWN = re.compile(r"^[0-9A-Za-z_-]{1,200}(\.traj|\.traj\.tmp)$")
"""Names a spool writes (ids are printable without whitespace; the spool's own are hex)."""


def write_frames(path: Path, frames: list[wire.Frame]) -> int:
    """Write `frames` to `path` atomically (tmp + fsync + rename + fsync of the folder)."""
    tmp = path.with_name(path.name + ".tmp")
    head = (
        MAGIC + _COUNT.pack(len(frames)) + b"".join(_LEN.pack(memoryview(f).nbytes) for f in frames)
    )
    with open(tmp, "wb") as f:
        f.write(head)
        for fr in frames:
            f.write(fr)
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return size


def read_ledger(folder: str | Path) -> dict[str, tuple[str, str]]:
    """The spool's ledger: trajectory id -> (status, task id); a torn last line is skipped."""
    path = Path(folder) / LEDGER
    out: dict[str, tuple[str, str]] = {}
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").split("\n")[:-1]:  # [-1]: "" or torn
        parts = line.split("\t")
        if len(parts) == 3:
            out[parts[0]] = (parts[1], parts[2])
    return out


@dataclasses.dataclass(frozen=True)
class SpoolContents:
    """What a spool folder holds, read from disk without opening it as a `Spool`."""

    finished: dict[str, tuple[str, str]]
    """The ledger: every trajectory ever put, id -> (status, task id)."""
    pending: set[str]
    """Ids still in the spool: written, never acknowledged."""
    refused: set[str]
    """Ids set aside in `refused/`: refused for good by the learner."""


def _ledger_entry(path: Path) -> tuple[str, str] | None:
    """(status, task id) of the spool file at `path`, read from its record; None when the
    file is damaged (the spool moves it to bad/ when it next opens)."""
    try:
        msg = wire.decode(read_frames(path))
    except (OSError, WireError) as e:
        log.warning("spool: %s cannot be read for the ledger: %s", path.name, e)
        return None
    if not isinstance(msg, Trajectory):
        return None
    return msg.status.value, msg.task_id


def read_spool(folder: str | Path) -> SpoolContents:
    """The ledger, the pending and the refused trajectories of the spool in `folder` (the
    files `Spool.put` and `Spool.set_aside` write); empty for a folder that is not there.
    A spooled trajectory whose ledger line a crash kept from being written (`put` writes
    the file first) is read from its file, so `finished` names every trajectory put."""
    folder = Path(folder)
    finished = read_ledger(folder)
    pending = {p.name[: -len(SUFFIX)] for p in folder.glob("*" + SUFFIX)}
    for tid in sorted(pending - set(finished)):
        entry = _ledger_entry(folder / (tid + SUFFIX))
        if entry is not None:
            finished[tid] = entry
    return SpoolContents(
        finished=finished,
        pending=pending,
        refused={p.name[: -len(SUFFIX)] for p in (folder / REFUSED).glob("*" + SUFFIX)},
    )


def read_frames(path: Path) -> list[memoryview]:
    """The frames of a spool file; WireError if it is damaged."""
    data = memoryview(path.read_bytes())
    if len(data) < len(MAGIC) + _COUNT.size or data[: len(MAGIC)] != MAGIC:
        raise WireError(f"{path.name}: not a spool file (bad magic or too short)")
    (n,) = _COUNT.unpack_from(data, len(MAGIC))
    pos = len(MAGIC) + _COUNT.size
    if n > 4 * wire.MAX_TURNS + 8 or pos + n * _LEN.size > len(data):
        raise WireError(f"{path.name}: frame table of {n} frames does not fit")
    lens = [_LEN.unpack_from(data, pos + i * _LEN.size)[0] for i in range(n)]
    pos += n * _LEN.size
    if pos + sum(lens) != len(data):
        raise WireError(f"{path.name}: frames hold {sum(lens)} bytes, file has {len(data) - pos}")
    out = []
    for n_bytes in lens:
        out.append(data[pos : pos + n_bytes])
        pos += n_bytes
    return out


class Spool:
    """A folder of trajectories waiting for their acknowledgement (thread-safe)."""

    def __init__(self, folder: str | Path, max_bytes: int = 2 << 30) -> None:
        if max_bytes < 1:
            raise ValueError(f"spool max_bytes must be >= 1, got {max_bytes}")
        if not str(folder).strip():
            raise ValueError("the spool folder is empty: give spool_dir a folder of its own")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._claim()
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}
        for tmp in self.folder.glob("*" + TMP_SUFFIX):
            log.warning("spool: deleting %s, left by a crash while it was written", tmp.name)
            tmp.unlink(missing_ok=True)
        files = sorted(self.folder.glob("*" + SUFFIX), key=lambda p: (p.stat().st_mtime, p.name))
        for p in files:
            self._sizes[p.name[: -len(SUFFIX)]] = p.stat().st_size
        self._mend_ledger()

    def _mend_ledger(self) -> None:
        """After a crash: cut a torn last ledger line (a later append would run on from it
        and spoil both lines), then write the line of every spooled trajectory that has
        none (`put` writes the file, then its line: a kill between the two left the
        trajectory to be sent on restart with no ledger line, so a run's accounting never
        saw it)."""
        path = self.folder / LEDGER
        if path.exists():
            data = path.read_bytes()
            if data and not data.endswith(b"\n"):
                keep = data.rfind(b"\n") + 1
                log.warning("spool: cutting a torn ledger line %r", data[keep:][:200])
                with open(path, "r+b") as f:
                    f.truncate(keep)
                    os.fsync(f.fileno())
        known = read_ledger(self.folder)
        lines = []
        for tid in [t for t in self._sizes if t not in known]:
            entry = _ledger_entry(self._path(tid))
            if entry is not None:
                lines.append(f"{tid}\t{entry[0]}\t{entry[1]}\n")
        if lines:
            log.warning("spool: %d spooled trajectories had no ledger line; written", len(lines))
            with open(path, "a", encoding="utf-8") as f:
                f.write("".join(lines))
                f.flush()
                os.fsync(f.fileno())

    def _claim(self) -> None:
        """Make sure the folder is this spool's: it has the marker, or is empty, or holds
        only what a spool writes (its files, ledger, bad/ and refused/: an older spool);
        then it gets the marker. ValueError naming the folder otherwise: the spool deletes
        its leftovers, so it never opens a folder that holds anybody else's files."""
        if (self.folder / MARKER).is_file():
            return
        foreign = [
            p.name
            for p in self.folder.iterdir()
            if not (
                (p.name in (LEDGER, "bad", REFUSED) and not p.is_symlink())
                or (_OWN.match(p.name) and p.is_file() and not p.is_symlink())
            )
        ]
        if foreign:
            raise ValueError(
                f"spool folder {self.folder} holds files a spool did not write "
                f"({', '.join(sorted(foreign)[:5])}{', ...' if len(foreign) > 5 else ''}); "
                "give spool_dir a new or empty folder of its own"
            )
        (self.folder / MARKER).write_text("arpo actor spool\n")

    @property
    def refused_dir(self) -> Path:
        return self.folder / REFUSED

    def set_aside(self, tid: str, reason: str) -> bool:
        """Move a trajectory the learner refused for good to `refused/` (kept, never sent
        again), with the reason beside it; False if it was not in the spool."""
        with self._lock:
            if self._sizes.pop(tid, None) is None:
                return False
        self.refused_dir.mkdir(exist_ok=True)
        path = self._path(tid)
        with contextlib.suppress(FileNotFoundError):
            os.replace(path, self.refused_dir / path.name)
        (self.refused_dir / f"{tid}.reason").write_text(reason + "\n", encoding="utf-8")
        return True

    def _path(self, tid: str) -> Path:
        if not tid or "/" in tid or "\\" in tid or tid.startswith("."):
            raise ValueError(f"trajectory id {tid!r} cannot name a spool file")
        return self.folder / (tid + SUFFIX)

    def put(self, traj: Trajectory) -> int:
        """Write `traj` durably, then its line in the ledger; returns its size on disk."""
        path = self._path(traj.trajectory_id)
        size = write_frames(path, wire.encode(traj))
        with self._lock:
            self._sizes[traj.trajectory_id] = size
            with open(self.folder / LEDGER, "a", encoding="utf-8") as f:
                f.write(f"{traj.trajectory_id}\t{traj.status.value}\t{traj.task_id}\n")
                f.flush()
                os.fsync(f.fileno())
        return size

    def frames(self, tid: str) -> list[memoryview] | None:
        """The wire frames of a spooled trajectory; None (and the file moved to bad/) if damaged."""
        path = self._path(tid)
        try:
            frames = read_frames(path)
            msg = wire.decode(frames)
            # An acknowledgement names the trajectory inside: a file whose name is another
            # id (renamed) would be sent and never acknowledged under its name, forever.
            if not isinstance(msg, Trajectory) or msg.trajectory_id != tid:
                inside = getattr(msg, "trajectory_id", type(msg).__name__)
                raise WireError(f"the file holds {inside!r}, not the trajectory its name says")
            return frames
        except FileNotFoundError:
            with self._lock:
                self._sizes.pop(tid, None)
            return None
        except WireError as e:
            log.error("spool: %s is damaged (%s); moved to bad/, not sent", path.name, e)
            (self.folder / "bad").mkdir(exist_ok=True)
            os.replace(path, self.folder / "bad" / path.name)
            with self._lock:
                self._sizes.pop(tid, None)
            return None

    def load(self, tid: str) -> Trajectory | None:
        frames = self.frames(tid)
        if frames is None:
            return None
        msg = wire.decode(frames)
        assert isinstance(msg, Trajectory)
        return msg

    def remove(self, tid: str) -> bool:
        """Delete an acknowledged trajectory; False if it was not in the spool."""
        with self._lock:
            if self._sizes.pop(tid, None) is None:
                return False
        self._path(tid).unlink(missing_ok=True)
        return True

    def ids(self) -> list[str]:
        """Spooled trajectory ids, oldest first."""
        with self._lock:
            return list(self._sizes)

    def __contains__(self, tid: str) -> bool:
        with self._lock:
            return tid in self._sizes

    def __len__(self) -> int:
        with self._lock:
            return len(self._sizes)

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    @property
    def full(self) -> bool:
        return self.bytes_used >= self.max_bytes

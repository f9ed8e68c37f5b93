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
   goes into the store (`store.put(task, store_item.to_item(traj))`); an
   `env_error` / `eval_error` / `timeout` one is delivered but excluded from training:
   counted by status, kept in a short list for inspection, not stored;
4. `on_trajectory(traj, stored)` lets the grant book close the slot (and say whether the
   slot was already filled by a re-issued grant: then the trajectory is a surplus and is
   not stored);
5. only then the acknowledgement goes back: the actor deletes its spool file. A
   trajectory the store can never take (larger than its whole byte budget) is refused
   before step 3 (`Refuse`, counted as `refused_too_large`), never acknowledged: the
   actor keeps it aside in its spool and logs the reason.

Heartbeats are answered with the learner's heartbeat (policy version, counters).
Malformed messages are counted by reason and logged (rate-limited); nothing a peer sends
stops the loop. Refused CURVE handshakes are counted as `unauthenticated`.

Seen ids: a bounded set (`seen_capacity`, oldest forgotten first), optionally written to
`seen_log` (one id per line, appended and flushed before the ack; fsynced every
`seen_fsync_every` ids) and reloaded on start, so a restarted learner still drops
duplicates of what it stored before. Like the store (which is durable only as of its last
snapshot), the log is as durable as its last fsync.

Journal (`journal_dir`; the format and its readers are in `arpo.service.journal`): a
write-ahead log of every trajectory that goes into the store, so an acknowledged
trajectory survives a learner crash. Before an `ok` trajectory is put into the store,
the frames it arrived in are written (unbuffered) to the end of the current segment
`journal-<n:08d>.log`; a failed write (disk full) is cut back and the trajectory is
neither stored nor acknowledged (the actor sends it again). The segment is fsynced every
`journal_fsync_every` records (1, the default: before every ack, which is what the ack
promises; with N > 1 a killed process still loses nothing, the kernel has the bytes, but
a power loss or kernel crash can lose up to N - 1 acknowledged trajectories; an fsync of
a 400 KB record costs about 2 ms on the project machine). Only `ok` trajectories are
journaled: the others are counted and not stored. The journal holds every stored byte
since the oldest kept checkpoint (about 1.4 MB per 15-turn episode of 1080p
screenshots). A record carries a CRC, so a torn tail is detected and skipped by the
reader (`arpo.service.journal`). A checkpoint (`arpo.learner.checkpoint`) pairs the
journal with a store snapshot; inserting is paused for the length of the snapshot (about
0.2 s for a 200 MB store here; messages wait in ZeroMQ's queues meanwhile), so the
snapshot holds exactly the segments before the rotation and none after:

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
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arpo import store_item, wire
from arpo.config import check_seconds, fail, option
from arpo.errors import BufferClosed, WireError
from arpo.record import Status, Trajectory
from arpo.service.journal import Journal, replay_journal
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

    max_senders: int = option(
        1024,
        "Actors whose last heartbeat is tracked (their counters feed the learner's metrics); "
        "past this, the one heard from longest ago is dropped and counted (senders_dropped).",
    )
    sender_expiry_s: float = option(
        600.0, "An actor not heard from this long is dropped from the tracked ones (counted)."
    )

    def validate(self) -> None:
        if self.max_senders < 1:
            fail("max_senders", "must be >= 1")
        check_seconds("sender_expiry_s", self.sender_expiry_s)
        if self.excluded_keep < 0:
            fail("excluded_keep", "must be >= 0 (0 keeps none for inspection)")
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
        self.actors: collections.OrderedDict[str, float] = collections.OrderedDict()
        """Actor id -> time.monotonic() of its last heartbeat."""
        self.actor_stats: dict[str, dict[str, float]] = {}
        """Actor id -> the numeric counters of its last heartbeat (time split, episodes)."""
        self._hb_seq = 0
        self._last_log = 0.0
        self.on_actor_heartbeat: Callable[[str], None] | None = None
        """Called with the sender of every actor heartbeat (the learner's grant book notes
        the actor as alive: `GrantBook.seen`)."""
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
        refused, item = self._refusal(msg)
        if refused is not None:
            self._reject("refused_too_large", f"{msg.trajectory_id}: {refused}")
            return [wire.encode(wire.Refuse((msg.trajectory_id,), refused))]
        stored = self._ingest(msg, frames, item)
        return [wire.encode(wire.Ack((msg.trajectory_id,)))] if stored else []

    def _refusal(self, traj: Trajectory) -> tuple[str | None, store_item.Item | None]:
        """Why the store can never take `traj` (it is larger than the store's whole byte
        budget), or None; with the store's item when it was built to measure it (a large
        trajectory), so that it is built once. Such a trajectory is refused, never
        acknowledged: an actor deletes what is acknowledged."""
        budget = getattr(self.store, "max_bytes", None)
        if traj.status != Status.OK or not isinstance(budget, int):
            return None, None
        if traj.png_bytes + 4 * traj.num_tokens <= budget // 2:
            return None, None  # far below the budget: not worth measuring exactly
        item = store_item.to_item(traj)
        if item.nbytes <= budget:
            return None, item
        return (
            f"the trajectory needs {item.nbytes} bytes in the replay store, above its whole "
            f"budget of {budget} bytes (learner store_max_bytes): it can never be stored"
        ), None

    def actor_totals(self, keys: tuple[str, ...]) -> dict[str, float]:
        """Sums over actors of these counters of their last heartbeats (0 when none has)."""
        with self._lock:
            return {k: sum(a.get(k, 0.0) for a in self.actor_stats.values()) for k in keys}

    def _heartbeat(self, hb: wire.Heartbeat) -> wire.Frames:
        with self._lock:
            self.counts["heartbeats"] += 1
            if hb.role == "actor":
                now = time.monotonic()
                self.actors[hb.sender] = now
                self.actors.move_to_end(hb.sender)
                # Bounded: the senders heard from longest ago go first (oldest at the front).
                while self.actors and (
                    len(self.actors) > self.config.max_senders
                    or next(iter(self.actors.values())) < now - self.config.sender_expiry_s
                ):
                    gone, _ = self.actors.popitem(last=False)
                    self.actor_stats.pop(gone, None)
                    self.counts["senders_dropped"] += 1
                self.actor_stats[hb.sender] = {
                    k: float(v)
                    for k, v in hb.stats.items()
                    if isinstance(v, int | float) and not isinstance(v, bool)
                }
            self._hb_seq += 1
            stats = {k: v for k, v in self.counts.items() if isinstance(v, int)}
        if hb.role == "actor" and self.on_actor_heartbeat is not None:
            self.on_actor_heartbeat(hb.sender)
        reply = wire.Heartbeat(
            self.config.learner_id,
            "learner",
            self._hb_seq,
            max(0, self._version()),
            time.time(),
            dict(list(stats.items())[: wire.MAX_STATS]),
        )
        return wire.encode(reply)

    def _ingest(
        self, traj: Trajectory, frames: Sequence[Any] = (), item: store_item.Item | None = None
    ) -> bool:
        """Store (or exclude) a trajectory (`item`: its store item, when already built);
        True when it may be acknowledged."""
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
                    self.store.put(
                        traj.task_id, item if item is not None else store_item.to_item(traj)
                    )
                except BufferClosed:  # shutting down: not acknowledged, the actor sends it again
                    return False
                except Exception as e:  # the store refused it: never acknowledged as stored
                    self._reject("store_error", f"{tid}: {type(e).__name__}: {e}")
                    return False
                else:
                    with self._lock:
                        self.counts["stored"] += 1
                        self.counts["steps"] += traj.steps
                self.seen.add(tid)
            return True
        self.seen.add(tid)
        return True

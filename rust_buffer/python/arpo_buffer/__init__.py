"""A concurrent replay store keyed by task, for reinforcement learning: fresh groups and replay.

The Python face of the Rust crate `arpo-buffer` (`rust_buffer/` in the arpo repository): a
wheel of its own whose only dependency is numpy, so any RL project can embed it::

    from arpo_buffer import Item, ReplayStore

    store = ReplayStore(max_bytes=1 << 30, fresh_capacity=64, replay_capacity=8, seed=0)
    item = Item(tokens, logprobs, offsets, rewards, version, blobs=(png,), metadata=b"")
    store.put("task-17", item)                          # actors: fresh trajectories
    group = store.take_group("task-17", 8, timeout=60)  # learner: a complete group, FIFO
    store.add_success("task-17", group[0], priority=1.0)
    (success,) = store.sample("task-17", 1)             # replay of a past success

The store keeps, per task, two roles: a FIFO of fresh items and a replay buffer of successes.
Every error it raises is a `BufferError` (the classes below, each also the built-in exception
a caller would expect: `BufferValueError` is a `ValueError`, `UnknownTask` a `KeyError`, ...).

Semantics (the contract other components rely on):

* `Item(tokens, logprobs, offsets, rewards, version, blobs=(), metadata=b"")`: tokens and
  offsets are 1-D int32, logprobs and rewards 1-D float32. A numpy array must already have
  that dtype and be 1-D (else `BufferValueError` naming the field); a list is converted
  (rewards also takes one number). The arrays are copied once; `blobs` and `metadata`
  (`bytes`) are kept by reference, never copied. A blob is `bytes`, a `zmq.Frame` (a frame
  received with `recv_multipart(copy=False)`), or a read-only C-contiguous `memoryview` whose
  `.obj` is `bytes` or a `zmq.Frame` (a slice of one, `memoryview(frame).toreadonly()`):
  objects whose memory cannot move or change while the item holds them. Anything else (a
  bytearray, a writable memoryview, a numpy array, an mmap, a view of one of them) is a
  `BufferValueError` naming `blobs[i]`; pass `bytes(blob)` to store a copy. The item holds a
  strong reference to each blob and to the object a memoryview views (so `view.release()`
  cannot free the memory the store reads). `item.tokens`, `.logprobs`, `.offsets`,
  `.rewards` are read-only numpy views of the item's memory (their `base` is the item, which
  they keep alive); `item.blobs` is a tuple of the very objects given (read them through the
  buffer protocol: `memoryview(b)`, `bytes(b)`, `io.BytesIO(b)`); `item.key` is unique in
  the process; items compare equal by key.
  `item.nbytes` = 4 * (len(tokens) + len(logprobs) + len(offsets) + len(rewards)) + the blob
  lengths + len(metadata).
* Fresh queue: `put` appends; beyond `fresh_capacity` the task's oldest fresh item is
  evicted. `take_group(task, n, timeout)` removes the n oldest at once (all or nothing) and
  returns them oldest first. `timeout=None` waits until a group forms or the store closes,
  `timeout=0` never blocks; `BufferTimeout` on expiry. Waiting on a task never seen
  registers it (it then shows in `tasks()`); `fresh_len` of a task never seen is 0.
  `n > fresh_capacity` is a `BufferValueError` (the group could never form).
  `fresh_head(task)` is `(version, seq)` of the task's oldest fresh item (None when it has
  none): `seq` grows with every insert across all tasks, so heads of different tasks
  compare by arrival (the learner takes the group whose head is oldest first).
* Replay buffer: `add_success` appends (FIFO beyond `replay_capacity`). `sample` considers the
  items with `version >= min_version` (all if `None`) and raises `BufferValueError` if fewer
  than `min_size` are eligible. `mode="uniform"` returns k items drawn uniformly with
  replacement; `"priority"` k items drawn with replacement proportionally to priority
  (priority-0 items are never drawn; all zero is a `BufferValueError`); `"newest"` returns
  the min(k, eligible) newest items, newest first, without replacement. `wait_min_size`
  blocks until the buffer holds n items (same timeout rules as `take_group`).
  `update_priorities(task, keys, priorities)` skips keys that are not in the buffer (evicted
  meanwhile) and returns the number of entries updated; `remove_replay(task, keys)` takes
  those items out of the replay buffer (counted as dropped) and returns how many went. `sample`, `replay_len`,
  `update_priorities`, `remove_replay` and `task_stats` raise `UnknownTask` for a task
  never seen.
* Budget: `bytes_used` is the exact sum of `nbytes` over resident items, once per residency
  (an item both fresh and in replay counts twice). Above `max_bytes` the oldest residencies
  across all tasks and both roles are evicted first; an item larger than `max_bytes` is
  rejected with `BufferValueError`. `drop_older_than(v)` removes items with version < v
  from both roles of every task and returns how many residencies went.
* `stats()` is `{"total": {...}, "tasks": {task: {...}}}`; each dict has fresh, replay, items,
  bytes, inserts, takes, samples (items handed out), evictions, dropped, min_version and
  max_version (None when empty).
* `snapshot(path)` writes the whole store atomically (tmp file + fsync + rename) while it
  keeps working; `ReplayStore.restore(path, max_bytes=None, ...)` loads it (None keeps the
  snapshot's setting; items beyond smaller limits are evicted oldest first). Snapshots write
  every blob's bytes, whatever object held them; restored blobs are `bytes`. Restored items
  keep their keys (an item resident twice is restored as one item); keys made afterwards in
  this process never collide with them, but restoring one file twice gives two stores whose
  items share keys. A bad file
  raises `SnapshotError` with the reason. There is no log between snapshots: a crash loses
  what happened after the last snapshot.
* `close()`: every later call raises `BufferClosed`; blocked callers wake with it.

Inserts and samples are lock-free and release the GIL; blocking calls wait with the GIL
released. The store does not rely on the GIL for thread safety.
"""

from arpo_buffer._errors import (
    BufferClosed,
    BufferError,
    BufferTimeout,
    BufferValueError,
    SnapshotError,
    UnknownTask,
)
from arpo_buffer._native import SNAPSHOT_FORMAT_VERSION, Item, ReplayStore, __version__

__all__ = [
    "SNAPSHOT_FORMAT_VERSION",
    "BufferClosed",
    "BufferError",
    "BufferTimeout",
    "BufferValueError",
    "Item",
    "ReplayStore",
    "SnapshotError",
    "UnknownTask",
    "__version__",
]

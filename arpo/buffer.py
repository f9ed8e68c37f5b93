"""The replay store keyed by task, re-exported from its own package `arpo_buffer`.

The store is a wheel of its own (`rust_buffer/`: the Rust crate `arpo-buffer` and its Python
module `arpo_buffer`, numpy its only dependency, nothing of arpo), so that other RL projects
can embed it (docs/guides/replay-store.md). Its API contract is the docstring of
`arpo_buffer`. Its exception classes are its own; `arpo.errors` re-exports them too.
"""

from arpo_buffer import (
    SNAPSHOT_FORMAT_VERSION,
    BufferClosed,
    BufferError,
    BufferTimeout,
    BufferValueError,
    Item,
    ReplayStore,
    SnapshotError,
    UnknownTask,
)

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
]

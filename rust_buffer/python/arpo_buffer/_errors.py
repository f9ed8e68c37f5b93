"""The replay store's exception classes, raised by the compiled part (`_native`).

Defined in Python, where a class can have two bases: each is also the built-in exception
a caller would expect (`BufferValueError` is a `ValueError`, `BufferTimeout` a
`TimeoutError`, `UnknownTask` a `KeyError`). The binding maps every Rust error to one of
them in one function (`rust_buffer/python/src/errors.rs`). Each message says what was wrong.
"""


class BufferError(Exception):  # not the built-in BufferError, which it shadows where imported
    """Base class of the replay store's errors."""


class BufferValueError(BufferError, ValueError):
    """An argument to the replay store has a wrong dtype, shape or value."""


class BufferTimeout(BufferError, TimeoutError):
    """A blocking call of the replay store did not complete within its timeout."""


class BufferClosed(BufferError):
    """The replay store was closed; no further calls are accepted."""


class UnknownTask(BufferError, KeyError):
    """The task id is not in the replay store."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the sentence readable
        return str(self.args[0]) if self.args else "unknown task"


class SnapshotError(BufferError):
    """A snapshot file is missing, truncated, corrupted or of an unsupported version."""

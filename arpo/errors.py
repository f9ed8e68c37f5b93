"""The project's exception classes, one hierarchy for every component.

Each error's message says what was wrong and how to fix it. The compiled replay
store (`arpo._buffer`) raises the `Buffer*` classes defined here.
"""


class ArpoError(Exception):
    """Base class of every error raised by arpo."""


class ConfigError(ArpoError, ValueError):
    """A configuration field has a wrong name, type or value; the message names the field."""


class WireError(ArpoError, ValueError):
    """A message that crossed a socket is malformed; the message gives the reason."""


class RecordError(ArpoError, ValueError):
    """A trajectory record is inconsistent (array lengths, dtypes, unknown status)."""


class BufferError(ArpoError):
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

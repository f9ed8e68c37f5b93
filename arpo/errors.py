"""The project's exception classes: `ArpoError` and below, and the replay store's.

Each error's message says what was wrong and how to fix it. The replay store is a
package of its own (`arpo_buffer`, which imports nothing of arpo): its classes
(`BufferError` and below) are re-exported here but are not `ArpoError`s, so whatever
catches every error of the project catches `ERRORS`, the two roots.
"""

# The store's classes, re-exported (`X as X`: an explicit re-export).
from arpo_buffer import BufferClosed as BufferClosed
from arpo_buffer import BufferError as BufferError
from arpo_buffer import BufferTimeout as BufferTimeout
from arpo_buffer import BufferValueError as BufferValueError
from arpo_buffer import SnapshotError as SnapshotError
from arpo_buffer import UnknownTask as UnknownTask


class ArpoError(Exception):
    """Base class of arpo's own errors (the replay store's are `BufferError`s: `ERRORS`)."""


class ConfigError(ArpoError, ValueError):
    """A configuration field has a wrong name, type or value; the message names the field."""


class WireError(ArpoError, ValueError):
    """A message that crossed a socket is malformed; the message gives the reason."""


class RecordError(ArpoError, ValueError):
    """A trajectory record is inconsistent (array lengths, dtypes, unknown status)."""


class EnvError(ArpoError):
    """Base class of the errors raised while talking to an environment (OSWorld VM or local desktop)."""


class EnvTransportError(EnvError):
    """The environment server could not be reached (connection refused or reset), even after retries."""


class EnvHTTPError(EnvError):
    """The environment server answered with an HTTP error status; `status` and `body` say what it sent."""

    def __init__(self, message: str, *, status: int, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class EnvTimeout(EnvError, TimeoutError):
    """A call to the environment server did not complete within its timeout."""


class EnvProtocolError(EnvError):
    """The environment answered something that is not a valid answer: not HTTP, a malformed
    status line or header, a body that is not UTF-8 or not the JSON expected, JSON nested
    too deeply. The environment's fault, never the task's."""


class EnvAnswerTooLarge(EnvProtocolError):
    """An answer is larger than the client's limit for its kind (ClientConfig); the message
    names the limit."""


class EnvAuthError(EnvHTTPError):
    """The environment refuses the client's bearer token (401, or 403 outside the file
    endpoints): final for that environment until its configuration changes."""


class ResetError(EnvError):
    """The environment could not be brought back to its clean state (its provider's revert,
    the desktop's /reset): the environment's failure, never the task's."""


class ForkUnsupported(EnvError):
    """This environment cannot be saved mid-task and started again (`Provider.snapshot` /
    `fork`): the actor runs plain groups on it instead."""


class FileCacheMiss(EnvError, LookupError):
    """A task needs a file (by URL) that is not in the local file cache; the message says how to add it."""


class BlobCacheError(EnvError):
    """The actor host's cache of task files (`arpo.env.taskfiles.BlobCache`, the actor's
    `file_cache_dir`) holds at a file's place something it cannot remove or use (a folder
    with files in it), or cannot be written. The host's fault, never the task's: the episode
    ends as env_error and the task stays in the run. The message names the path and the fix."""


class TaskError(ArpoError, ValueError):
    """A task file is malformed or uses an unknown step type; the message names the task and the step."""


class EvalError(ArpoError):
    """A task's evaluator could not be run (unknown getter or metric, malformed options)."""


class ActionParseError(ArpoError, ValueError):
    """A model response is not in UI-TARS's action format (no `Action:`, an unknown action, a
    missing or malformed argument); the message says what and where. The episode records
    format reward -1 and ends, as in the ARPO reference."""


class EngineError(ArpoError):
    """A policy engine could not serve a request or load weights; the message says why."""


class RunStalled(ArpoError):
    """A run can make no more progress: every task left it, or no episode filled a slot
    for `stall_s`. The message names the tasks that left and why."""


EXIT_STALLED = 3
"""Exit code of `arpo-learner` and `arpo train` for a RunStalled."""


ERRORS: tuple[type[Exception], ...] = (ArpoError, BufferError)
"""Every error of the project: arpo's own and the replay store's (what the commands catch).
`SnapshotError` is the store's class; arpo raises it too, for a checkpoint that does not load."""

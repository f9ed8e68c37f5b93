"""The trajectory record: one episode of one task, token-in / token-out.

Everything needed to rebuild the exact training sequence without tokenising text
again (docs/reference/record.md, 'Token-in, token-out'):

- per turn: the prompt token ids added at this turn (the user message with its
  image placeholder tokens), the PNG bytes of the screenshot shown, the sampled
  response token ids, the behaviour log-probability of every sampled token, the
  policy version that generated the turn, the sampling settings it was drawn with
  (temperature, top_p), the parsed action and whether it parsed;
- outcome: checker score, format reward, total reward, status, wall times;
- ids: trajectory (uuid hex), task, group (the task grant), slot in the group, actor;
- what the model was shown each turn (`observation`: screenshot, a11y_tree,
  screenshot_a11y_tree or som; a turn without an image has an empty screenshot), and for
  som what made each turn's marks (`Turn.marks_source`: the tree or OCR).

The training sequence is `prompt_0 + response_0 + prompt_1 + response_1 + ...`;
the loss mask covers the response tokens only (`Trajectory.sequence()`).

Records cross process boundaries, so they are frozen, slotted dataclasses and
validate on construction: dtypes (int32 ids, float32 log-probs, 1-D), equal
lengths of response ids and log-probs, PNG signature, finite rewards, a known
status. Lists are accepted and converted; numpy arrays of the right dtype are
kept as they are (views from the wire decoder stay views).
"""

from __future__ import annotations

import enum
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from arpo.errors import RecordError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

Bytes = bytes | bytearray | memoryview


class Status(enum.StrEnum):
    """How an episode ended. Only `ok` episodes are trained on."""

    OK = "ok"
    """The episode ran and was evaluated; the checker score is meaningful."""
    ENV_ERROR = "env_error"
    """The environment failed (reset, setup, screenshot, execute): not the agent's fault."""
    EVAL_ERROR = "eval_error"
    """The evaluator raised: the score is unknown, never 0."""
    TIMEOUT = "timeout"
    """The episode exceeded its wall-clock budget."""
    SETUP_ERROR = "setup_error"
    """The task could not be set up on an environment that reset fine (a step of its setup
    failed, or the task is broken): evidence against the task, not the environment. The
    learner takes a task out of the run when this keeps happening (`arpo.service.grants`)."""


def _array(value: Any, dtype: np.dtype, name: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        if value.dtype != dtype:
            raise RecordError(
                f"{name} must have dtype {dtype.name}, got {value.dtype.name} "
                f"(convert with .astype(np.{dtype.name}))"
            )
        if value.ndim != 1:
            raise RecordError(f"{name} must be 1-D, got shape {value.shape}")
        return value
    if isinstance(value, str | bytes | bytearray | memoryview) or not isinstance(value, Sequence):
        raise RecordError(
            f"{name} must be a 1-D array or list of numbers, got {type(value).__name__}"
        )
    try:
        raw = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise RecordError(f"{name} cannot be converted to {dtype.name}: {e}") from None
    if raw.ndim != 1:
        raise RecordError(f"{name} must be 1-D, got shape {raw.shape}")
    if raw.size:
        allowed = "iu" if dtype.kind == "i" else "iuf"
        if raw.dtype.kind not in allowed:
            kind = "integers" if dtype.kind == "i" else "numbers"
            raise RecordError(f"{name} must contain {kind}, got {raw.dtype.name} values")
        if dtype.kind == "i":
            info = np.iinfo(dtype)
            if int(raw.min()) < info.min or int(raw.max()) > info.max:
                raise RecordError(f"{name} has values outside the {dtype.name} range")
    arr = raw.astype(dtype)
    return arr


_I32 = np.dtype(np.int32)
_F32 = np.dtype(np.float32)


MAX_VERSION = (1 << 63) - 1
"""Largest policy version a record may carry: the replay store keeps versions as i64."""
MAX_SLOT = 1 << 31
"""Largest slot in a group (the grants' bound)."""
MAX_ERROR_CHARS = 2000
"""Longest `Trajectory.error` kept (a longer one is cut)."""
MAX_ID_BYTES = 1024
"""Longest id (trajectory, task, group, grant, actor, tree), in UTF-8 bytes."""
OBSERVATION_TYPES = ("screenshot", "a11y_tree", "screenshot_a11y_tree", "som")
"""What the model is shown each turn, as OSWorld's run.py names it (`observation_type`):
the screenshot; the linearised accessibility table instead; both; the screenshot with
numbered marks drawn on it and the table of the marks (`arpo.env.a11y`)."""
MARKS_SOURCES = ("tree", "ocr")
"""What made a som turn's marks (`Turn.marks_source`): the accessibility tree's elements
(`arpo.env.a11y`), or the text read from the screenshot (`arpo.env.ocr`)."""


@dataclass(frozen=True, slots=True, eq=False)
class Turn:
    """One step of an episode: what the model saw, what it sampled, what it did."""

    prompt_ids: np.ndarray
    """Token ids (int32) appended to the context at this turn, before the response."""
    screenshot: Bytes
    """PNG bytes of the screenshot shown at this turn (empty if none was shown)."""
    response_ids: np.ndarray
    """Sampled token ids (int32) of the model's response."""
    logprobs: np.ndarray
    """Behaviour log-probability (float32) of every sampled token; same length as response_ids."""
    policy_version: int
    """Version of the policy weights that sampled this turn."""
    action: str = ""
    """The parsed action: pyautogui code, or WAIT / DONE / FAIL; empty when not parsed."""
    parsed: bool = True
    """Whether the response parsed into an action."""
    temperature: float = 1.0
    """Sampling temperature the response was drawn with (0: greedy; NaN: not recorded, a
    record from before the field existed). The learner trains only turns sampled with its
    own settings (`arpo.learner.assemble`)."""
    top_p: float = 1.0
    """Nucleus the response was drawn with, in (0, 1] (NaN: not recorded)."""
    marks_source: str = ""
    """What made the marks of a som turn, one of MARKS_SOURCES: "tree" or "ocr" (the prompt
    ids hold the table it made, the screenshot its marks); "" for a turn of another
    observation type. A som record from before the field existed decodes as "tree", the
    only source then."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "prompt_ids", _array(self.prompt_ids, _I32, "turn.prompt_ids"))
        set_(self, "response_ids", _array(self.response_ids, _I32, "turn.response_ids"))
        set_(self, "logprobs", _array(self.logprobs, _F32, "turn.logprobs"))
        if self.logprobs.size and not np.isfinite(self.logprobs).all():
            raise RecordError("turn.logprobs must be finite (no NaN or inf)")
        if len(self.logprobs) != len(self.response_ids):
            raise RecordError(
                f"turn.logprobs has {len(self.logprobs)} entries but turn.response_ids has "
                f"{len(self.response_ids)}: there must be one log-prob per sampled token"
            )
        if not isinstance(self.screenshot, bytes | bytearray | memoryview):
            raise RecordError(
                f"turn.screenshot must be PNG bytes, got {type(self.screenshot).__name__}"
            )
        if len(self.screenshot) and bytes(self.screenshot[:8]) != PNG_SIGNATURE:
            raise RecordError("turn.screenshot is not a PNG (missing the PNG signature)")
        if not isinstance(self.policy_version, int) or isinstance(self.policy_version, bool):
            raise RecordError(
                f"turn.policy_version must be an int, got {type(self.policy_version).__name__}"
            )
        if not 0 <= self.policy_version <= MAX_VERSION:
            raise RecordError(
                f"turn.policy_version must be in [0, {MAX_VERSION}] (the replay store keeps "
                f"versions as signed 64-bit integers), got {self.policy_version}"
            )
        if not isinstance(self.action, str):
            raise RecordError(f"turn.action must be a str, got {type(self.action).__name__}")
        if not isinstance(self.parsed, bool):
            raise RecordError(f"turn.parsed must be a bool, got {type(self.parsed).__name__}")
        t, p = sampling_values(self.temperature, self.top_p, "turn.")
        set_(self, "temperature", t)
        set_(self, "top_p", p)
        if self.marks_source != "" and self.marks_source not in MARKS_SOURCES:
            raise RecordError(
                f"turn.marks_source must be one of {', '.join(MARKS_SOURCES)}, or '' for a "
                f"turn without marks; got {self.marks_source!r:.60}"
            )

    @classmethod
    def trusted(
        cls,
        prompt_ids: np.ndarray,
        screenshot: Bytes,
        response_ids: np.ndarray,
        logprobs: np.ndarray,
        policy_version: int,
        action: str,
        parsed: bool,
        temperature: float = 1.0,
        top_p: float = 1.0,
        marks_source: str = "",
    ) -> Turn:
        """Build a Turn from values the caller has already validated (the wire decoder
        checks whole frames at once); skips the per-field checks of the constructor."""
        t = object.__new__(cls)
        set_ = object.__setattr__
        set_(t, "prompt_ids", prompt_ids)
        set_(t, "screenshot", screenshot)
        set_(t, "response_ids", response_ids)
        set_(t, "logprobs", logprobs)
        set_(t, "policy_version", policy_version)
        set_(t, "action", action)
        set_(t, "parsed", parsed)
        set_(t, "temperature", temperature)
        set_(t, "top_p", top_p)
        set_(t, "marks_source", marks_source)
        return t

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Turn):
            return NotImplemented
        return (
            np.array_equal(self.prompt_ids, other.prompt_ids)
            and bytes(self.screenshot) == bytes(other.screenshot)
            and np.array_equal(self.response_ids, other.response_ids)
            and np.array_equal(self.logprobs, other.logprobs, equal_nan=True)
            and self.policy_version == other.policy_version
            and self.action == other.action
            and self.parsed == other.parsed
            and _same_float(self.temperature, other.temperature)
            and _same_float(self.top_p, other.top_p)
            and self.marks_source == other.marks_source
        )

    __hash__ = None  # type: ignore[assignment]


def _same_float(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def sampling_values(temperature: Any, top_p: Any, prefix: str = "") -> tuple[float, float]:
    """Checked (temperature, top_p) of a sampled turn: temperature >= 0, top_p in (0, 1];
    NaN stands for 'not recorded' (either both NaN or neither)."""
    out = []
    for name, v in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise RecordError(f"{prefix}{name} must be a number, got {type(v).__name__}")
        out.append(float(v))
    t, p = out
    if math.isnan(t) and math.isnan(p):
        return t, p
    if not (math.isfinite(t) and t >= 0.0):
        raise RecordError(f"{prefix}temperature must be a finite number >= 0, got {t}")
    if not 0.0 < p <= 1.0:
        raise RecordError(f"{prefix}top_p must be in (0, 1], got {p}")
    return t, p


def _finite(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RecordError(f"{name} must be a number, got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:
        raise RecordError(f"{name} must be finite, got an integer too large for a float") from None
    if not math.isfinite(value):
        raise RecordError(f"{name} must be finite, got {value}")
    return value


def ident_problem(value: Any, *, allow_empty: bool = False) -> str | None:
    """What is wrong with `value` as an id, or None. An id (trajectory, task, group, grant,
    actor, tree) is a string of 1..MAX_ID_BYTES UTF-8 bytes ("" too where `allow_empty`) of
    printable characters without whitespace: ledgers (`seen.log`, `trained.log`, spool
    ledgers) write ids one per line, tab-separated, so a newline, carriage return, tab, line
    separator or surrounding space in an id would forge or split lines. The record raises
    the answer as a RecordError, the wire as a WireError, both after the field's name."""
    if not isinstance(value, str):
        return f"must be a string, got {type(value).__name__}"
    if not value and not allow_empty:
        return "must not be empty"
    try:
        n = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not valid unicode (lone surrogate)"
    if n > MAX_ID_BYTES:
        return f"must be at most {MAX_ID_BYTES} bytes in UTF-8, got {n}"
    for c in value:
        if c.isspace() or not c.isprintable():
            return (
                f"contains {c!r}: ids must be printable characters without whitespace "
                "or control characters"
            )
    return None


def _ident(value: Any, name: str, *, allow_empty: bool = False) -> str:
    if (why := ident_problem(value, allow_empty=allow_empty)) is not None:
        raise RecordError(f"{name} {why}")
    return value


MAX_TREE_DEPTH = 64
"""Most branch points on one trajectory's path from its tree's root."""


@dataclass(frozen=True, slots=True)
class Branch:
    """Where a trajectory of a tree rollout sits in its tree (`arpo.actor.tree`).

    A tree starts as one episode (its root); at a branch point its environment is forked
    and each child continues the episode from exactly that state. A trajectory is one
    leaf: all of its turns, the shared ones included. Two leaves of the same tree share
    their first `steps[d]` turns, where d is the length of the common start of their
    paths: those turns are the same tokens, log-probs and versions in both records, and
    the learner trains them once (`arpo.learner.tree`)."""

    tree: str
    """The tree's id (unique within its group)."""
    path: tuple[int, ...] = ()
    """The child taken at each branch point, from the root (() for a leaf that never
    branched: the root itself)."""
    steps: tuple[int, ...] = ()
    """The number of turns before each branch point (strictly increasing, one per entry
    of `path`): the children of branch point d share turns [0, steps[d])."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        _ident(self.tree, "trajectory.branch.tree")
        for name in ("path", "steps"):
            v = getattr(self, name)
            if isinstance(v, str | bytes) or not isinstance(v, Sequence):
                raise RecordError(f"trajectory.branch.{name} must be a sequence of ints")
            v = tuple(v)
            if len(v) > MAX_TREE_DEPTH or not all(type(x) is int and 0 <= x <= MAX_SLOT for x in v):
                raise RecordError(
                    f"trajectory.branch.{name} must hold at most {MAX_TREE_DEPTH} ints in "
                    f"[0, {MAX_SLOT}], got {v!r:.100}"
                )
            set_(self, name, v)
        if len(self.path) != len(self.steps):
            raise RecordError(
                f"trajectory.branch: path has {len(self.path)} entries, steps "
                f"{len(self.steps)}; one step count per branch point"
            )
        if any(b <= a for a, b in zip(self.steps, self.steps[1:], strict=False)) or (
            self.steps and self.steps[0] < 1
        ):
            raise RecordError(
                f"trajectory.branch.steps must be positive and strictly increasing, got "
                f"{self.steps!r:.100}"
            )

    def to_json(self) -> dict[str, Any]:
        return {"tree": self.tree, "path": list(self.path), "steps": list(self.steps)}

    @classmethod
    def from_json(cls, d: Any) -> Branch:
        if not isinstance(d, dict) or set(d) != {"tree", "path", "steps"}:
            raise RecordError(
                f"trajectory.branch must be a map of tree, path, steps; got {d!r:.100}"
            )
        return cls(d["tree"], d["path"], d["steps"])


@dataclass(frozen=True, slots=True)
class Trajectory:
    """One episode of one task, as sent by an actor and stored for training."""

    task_id: str
    """The task's id (OSWorld task ids are uuids; any non-empty string)."""
    turns: tuple[Turn, ...]
    """The episode's turns in order."""
    checker_score: float
    """The task checker's score in [0, 1] (0 when status is not ok)."""
    format_reward: float = 0.0
    """0, or -1 when a response could not be parsed (which also ends the episode)."""
    reward: float = 0.0
    """The total reward used for advantages: checker_score + 0.5 * format_reward by default."""
    status: Status = Status.OK
    """How the episode ended; only `ok` episodes are trained on."""
    trajectory_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Unique id of the episode; the learner ignores an id it has already stored."""
    group_id: str = ""
    """The task grant this episode fills (GRPO groups are formed by group id)."""
    slot: int = 0
    """The position of this episode in its group."""
    actor_id: str = ""
    """The actor process that ran the episode."""
    timings: Mapping[str, float] = field(default_factory=dict)
    """Wall times in seconds by stage (e.g. reset, setup, policy, env, evaluate, total)."""
    error: str = ""
    """Why the status is not `ok` (at most MAX_ERROR_CHARS characters; "" when ok)."""
    env: str = ""
    """The environment that ran the episode (its URL or name; "" when not recorded)."""
    branch: Branch | None = None
    """Its place in a tree rollout (None: an episode of its own, from the task's start)."""
    observation_type: str = "screenshot"
    """What the model was shown each turn (one of OBSERVATION_TYPES). The turns' prompt ids
    hold it all (a table's tokens), their PNGs the images as shown (for `som` with the marks
    drawn; none for `a11y_tree`), so the learner scores exactly what was sampled; this says
    which kind it was."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        _ident(self.task_id, "trajectory.task_id")
        _ident(self.trajectory_id, "trajectory.trajectory_id")
        _ident(self.group_id, "trajectory.group_id", allow_empty=True)
        _ident(self.actor_id, "trajectory.actor_id", allow_empty=True)
        if isinstance(self.turns, Turn | str | bytes) or not isinstance(self.turns, Sequence):
            raise RecordError(
                f"trajectory.turns must be a sequence of Turn, got {type(self.turns).__name__}"
            )
        turns = tuple(self.turns)
        for i, t in enumerate(turns):
            if not isinstance(t, Turn):
                raise RecordError(f"trajectory.turns[{i}] must be a Turn, got {type(t).__name__}")
        set_(self, "turns", turns)
        set_(self, "checker_score", _finite(self.checker_score, "trajectory.checker_score"))
        set_(self, "format_reward", _finite(self.format_reward, "trajectory.format_reward"))
        set_(self, "reward", _finite(self.reward, "trajectory.reward"))
        try:
            set_(self, "status", Status(self.status))
        except ValueError:
            known = ", ".join(s.value for s in Status)
            raise RecordError(f"trajectory.status {self.status!r} is not one of {known}") from None
        if (
            isinstance(self.slot, bool)
            or not isinstance(self.slot, int)
            or not 0 <= self.slot <= MAX_SLOT
        ):
            raise RecordError(
                f"trajectory.slot must be an int in [0, {MAX_SLOT}], got {self.slot!r}"
            )
        if not isinstance(self.timings, Mapping):
            raise RecordError(
                f"trajectory.timings must be a mapping, got {type(self.timings).__name__}"
            )
        timings = {}
        for k, v in self.timings.items():
            _ident(k, "trajectory.timings key")
            timings[k] = _finite(v, f"trajectory.timings[{k!r}]")
        set_(self, "timings", timings)
        if self.branch is not None:
            if not isinstance(self.branch, Branch):
                raise RecordError(
                    f"trajectory.branch must be a Branch or None, got {type(self.branch).__name__}"
                )
            if self.branch.steps and self.branch.steps[-1] > len(turns):
                raise RecordError(
                    f"trajectory.branch: branch point at turn {self.branch.steps[-1]} of an "
                    f"episode of {len(turns)} turns"
                )
        if self.observation_type not in OBSERVATION_TYPES:
            raise RecordError(
                f"trajectory.observation_type must be one of {', '.join(OBSERVATION_TYPES)}, got "
                f"{self.observation_type!r:.60}"
            )
        if self.observation_type != "som":
            for i, t in enumerate(turns):
                if t.marks_source:
                    raise RecordError(
                        f"trajectory.turns[{i}].marks_source is {t.marks_source!r} but the "
                        f"observation is {self.observation_type!r}: only som turns have marks"
                    )
        for name, limit in (("error", MAX_ERROR_CHARS), ("env", 1024)):
            v = getattr(self, name)
            if not isinstance(v, str):
                raise RecordError(f"trajectory.{name} must be a str, got {type(v).__name__}")
            if len(v) > limit:
                set_(self, name, v[: limit - 3] + "...")

    @property
    def steps(self) -> int:
        """Number of turns (actions sampled) in the episode."""
        return len(self.turns)

    @property
    def min_version(self) -> int:
        """Oldest policy version among the turns (-1 for an episode without turns)."""
        return min((t.policy_version for t in self.turns), default=-1)

    @property
    def max_version(self) -> int:
        """Newest policy version among the turns (-1 for an episode without turns)."""
        return max((t.policy_version for t in self.turns), default=-1)

    @property
    def num_tokens(self) -> int:
        return sum(len(t.prompt_ids) + len(t.response_ids) for t in self.turns)

    @property
    def png_bytes(self) -> int:
        return sum(len(t.screenshot) for t in self.turns)

    def sequence(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The training sequence: (token ids int32, loss mask bool, behaviour log-probs float32).

        Log-probs are 0 where the mask is False (prompt tokens).
        """
        ids, mask, lps = [], [], []
        for t in self.turns:
            ids += [t.prompt_ids, t.response_ids]
            mask += [np.zeros(len(t.prompt_ids), bool), np.ones(len(t.response_ids), bool)]
            lps += [np.zeros(len(t.prompt_ids), np.float32), t.logprobs]
        if not ids:
            return np.zeros(0, np.int32), np.zeros(0, bool), np.zeros(0, np.float32)
        return np.concatenate(ids), np.concatenate(mask), np.concatenate(lps)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trajectory):
            return NotImplemented
        return (
            self.task_id == other.task_id
            and self.trajectory_id == other.trajectory_id
            and self.group_id == other.group_id
            and self.slot == other.slot
            and self.actor_id == other.actor_id
            and self.checker_score == other.checker_score
            and self.format_reward == other.format_reward
            and self.reward == other.reward
            and self.status == other.status
            and dict(self.timings) == dict(other.timings)
            and self.error == other.error
            and self.env == other.env
            and self.branch == other.branch
            and self.observation_type == other.observation_type
            and self.turns == other.turns
        )

    __hash__ = None  # type: ignore[assignment]

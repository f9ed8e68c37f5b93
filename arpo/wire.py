"""The wire format: the one encoder and decoder for everything that crosses a socket.

A message is a list of frames (a ZeroMQ multipart message):

    frame 0   preamble, 8 bytes: b"ARPO", wire version (u8), message kind (u8), 2 zero bytes
    frame 1   header: a msgpack map with exactly the keys of the kind (no ext types)
    frame 2.. payload frames declared by the header (raw little-endian arrays, PNG bytes)

Trajectory (kind 1): header keys `tid task group slot actor score fmt reward
status timings turns error env branch obs` (`error`, `env`, `branch` and `obs` may be left
out by records written before they existed: "", "", nil and "screenshot"; `branch` is nil or
`{"tree", "path", "steps"}`, the leaf's place in a tree rollout, `arpo.record.Branch`; `obs`
the observation type, `Trajectory.observation_type`, one of `arpo.record.OBSERVATION_TYPES`;
the wire keeps its short key, which peers of every version read), where `turns` is a list of
`[n_prompt, n_response, n_png, policy_version, parsed, action, temperature, top_p,
marks_source]` (the sampling settings the turn was drawn with, and what made a som turn's
marks: "tree", "ocr", or "" for the other types, `arpo.record.Turn.marks_source`; the
decoder also accepts the 8-entry form of records written before marks_source existed,
which decodes as "tree" for som, the only source then, and "" otherwise, and the 6-entry
form of records written before the sampling settings existed, which decodes with NaN for
both, "not recorded", and the learner does not train such turns); then three frames
holding every turn's prompt ids (int32), response ids (int32) and log-probs
(float32) concatenated in turn order, then one frame per turn with its PNG.

Ack (kind 2): header `{"ids": [trajectory ids]}`, no payload frames.

Refuse (kind 12): header `{"ids": [trajectory ids], "reason": str}`, no payload frames:
the learner will never store these trajectories (e.g. one larger than its store's byte
budget); the actor keeps them on disk, stops sending them and logs the reason.

Control messages (no payload frames unless said):

- grant request (3), actor -> learner: `{"actor", "req", "want", "pool"}`: ask for up
  to `want` task grants of tasks in environment pool `pool` ("" any task; see
  `arpo.env.task.task_pool`); `req` is echoed in the reply. The encoder always
  writes `pool`; the decoder also accepts a header without it (an actor from before the
  key existed), which means pool "". Every other key set is rejected.
- grant (4), learner -> actor: `{"req", "grants", "retry"}`; `grants` is a list of
  `[grant_id, task_id, group, slot, version, task_json, min_version, temperature,
  top_p]`: the task file's JSON text (so actors need no task files), the oldest policy
  version the episode may be sampled with (the actor fetches newer weights before it
  starts the episode), and the sampling settings the learner scores (nil: the actor's
  own; the decoder also accepts the 6-entry form, which means min_version 0 and the
  actor's own settings), and `tree`: nil, or `{"slots", "grant_ids", "width", "every"}` for
  a grant that fills several slots of its group with one tree rollout (`TreeSpec`; the
  9-entry form means nil); `retry` says how many seconds to wait before asking again when
  the list is empty (admission control or nothing to do).
- heartbeat (5), both ways: `{"sender", "role", "seq", "version", "time", "stats"}`;
  `role` is "actor" or "learner", `version` the policy version the sender holds,
  `stats` a small map of counters (name -> number).
- weights announce (6), learner -> actor: `{"version", "nbytes", "chunks", "chunk_bytes",
  "sha256", "path"}`: the newest weights as one safetensors byte stream of `nbytes`
  bytes in `chunks` chunks; `path` is where the learner wrote the same file (use it
  when it exists with that size: a shared filesystem), "" when not written.
- weights request (7), actor -> learner: `{"version", "chunk"}`: chunk `chunk` of
  `version`, or the newest announcement when `chunk` is -1.
- weights chunk (8), learner -> actor: `{"version", "index", "total"}` + 1 frame of
  safetensors bytes (at most MAX_CHUNK_BYTES).
- file request (10), actor -> learner: `{"sha256", "chunk"}`: chunk `chunk` of the task
  file with that SHA-256 (a grant's task names the files its `upload_file` steps send by
  `sha256` and `size`; `arpo.env.taskfiles`).
- file chunk (11), learner -> actor: `{"sha256", "index", "total", "size", "error"}` + 1
  frame: chunk `index` of `total` of a file of `size` bytes, or an empty frame and the
  reason in `error` when the learner does not serve that file.

Nothing large is copied or pickled: `encode` hands out the record's own PNG
buffers as frames (the three token frames are one concatenation, a few tens of
KB), and `decode` returns numpy views and memoryviews into the received frames
(keep the frames alive as long as the record; the views do that themselves).

Any malformed input (wrong magic or version, unknown kind, truncated or extra or
missing frames, lengths that disagree, wrong types in the header, garbage bytes,
declared sizes beyond the limits below) raises `WireError` with the reason, and
nothing else. Memory use is bounded by the size of the frames received: the
decoder never allocates from a declared size.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from arpo.errors import RecordError, WireError
from arpo.record import (
    MARKS_SOURCES,
    MAX_SLOT,
    MAX_VERSION,
    PNG_SIGNATURE,
    Branch,
    Status,
    Trajectory,
    Turn,
    ident_problem,
    sampling_values,
)
from arpo.record import MAX_ID_BYTES as MAX_ID_BYTES  # a wire limit too (control message ids)

WIRE_VERSION = 1
MAGIC = b"ARPO"
_PREAMBLE = struct.Struct("<4sBBH")

KIND_TRAJECTORY = 1
KIND_ACK = 2
KIND_GRANT_REQUEST = 3
KIND_GRANT = 4
KIND_HEARTBEAT = 5
KIND_WEIGHTS_ANNOUNCE = 6
KIND_WEIGHTS_REQUEST = 7
KIND_WEIGHTS_CHUNK = 8
KIND_GRANT_RELEASE = 9
KIND_FILE_REQUEST = 10
KIND_FILE_CHUNK = 11
KIND_REFUSE = 12
_KINDS = frozenset(range(1, 13))

MAX_HEADER_BYTES = 4 << 20
"""Largest accepted header frame (a 15-turn trajectory's header is about 1 KB)."""
MAX_TURNS = 4096
"""Most turns accepted in one trajectory."""
MAX_ACK_IDS = 65536
"""Most trajectory ids in one acknowledgement."""
MAX_STR_BYTES = 1 << 20
"""Longest string accepted in a header (actions can hold typed text; a grant's task JSON)."""
MAX_GRANTS = 256
"""Most grants in one reply (and most asked for in one request)."""
MAX_STATS = 64
"""Most counters in a heartbeat's stats map."""
MAX_CHUNK_BYTES = 256 << 20
"""Largest weights chunk."""

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")

_TRAJ_KEYS = frozenset(
    (
        "tid",
        "task",
        "group",
        "slot",
        "actor",
        "score",
        "fmt",
        "reward",
        "status",
        "timings",
        "turns",
        "error",
        "env",
        "branch",
        "obs",
    )
)
_TRAJ_OPTIONAL = frozenset(("error", "env", "branch", "obs"))
"""Trajectory header keys a record written before they existed leaves out ("")."""


@dataclass(frozen=True, slots=True)
class Ack:
    """The learner's acknowledgement: these trajectories are safely in the store."""

    ids: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", tuple(self.ids))
        for i in self.ids:
            _check_id(i, "ack id")


@dataclass(frozen=True, slots=True)
class Refuse:
    """The learner refuses these trajectories for good (they are not stored, and sending
    them again changes nothing): the actor keeps them aside and logs `reason`."""

    ids: tuple[str, ...]
    reason: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", tuple(self.ids))
        if len(self.ids) > MAX_ACK_IDS:
            raise WireError(f"refuse holds at most {MAX_ACK_IDS} ids")
        for i in self.ids:
            _check_id(i, "refuse id")
        if type(self.reason) is not str or len(self.reason) > 1024:
            raise WireError("refuse reason must be a string of at most 1024 characters")


def _check_id(v: Any, name: str, *, allow_empty: bool = False) -> str:
    if (why := ident_problem(v, allow_empty=allow_empty)) is not None:
        raise WireError(f"{name} {why}")
    return v


def _check_int(v: Any, name: str, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    # `type(v) is int` also rejects bools (a bool is an int subclass).
    if type(v) is not int or not lo <= v <= hi:
        raise WireError(f"{name} must be an int in [{lo}, {hi}], got {v!r:.80}")
    return v


def _check_float(v: Any, name: str, lo: float = 0.0) -> float:
    if type(v) not in (int, float) or not math.isfinite(v) or v < lo:
        raise WireError(f"{name} must be a finite number >= {lo}, got {v!r:.80}")
    return float(v)


@dataclass(frozen=True, slots=True)
class GrantRequest:
    """An actor asks the learner for up to `want` task grants."""

    actor: str
    """The asking actor's id (grants are booked to it)."""
    req: int
    """Request number, echoed in the reply (a reply to an older request is ignored)."""
    want: int = 1
    """How many grants the actor can start now (1..MAX_GRANTS)."""
    pool: str = ""
    """Environment pool the grants are for ("sim", "desktop", ...); "" takes any task."""

    def __post_init__(self) -> None:
        _check_id(self.actor, "grant request actor")
        _check_int(self.req, "grant request req")
        _check_int(self.want, "grant request want", 1, MAX_GRANTS)
        _check_id(self.pool, "grant request pool", allow_empty=True)


@dataclass(frozen=True, slots=True)
class GrantRelease:
    """An actor gives a grant back: its episode ended without a trajectory (the policy
    failed, the actor is stopping), so the slot is granted again at once instead of after
    the grant timeout. Answered with an empty GrantReply carrying `req`."""

    actor: str
    req: int
    """Request number, echoed in the reply."""
    grant_id: str
    """The grant given back (a release of a grant the book no longer holds is counted)."""
    reason: str = ""
    """Why, in a few words ("policy_error", "stopping", ...): counted by the learner."""

    def __post_init__(self) -> None:
        _check_id(self.actor, "grant release actor")
        _check_int(self.req, "grant release req")
        _check_id(self.grant_id, "grant release grant_id")
        if not isinstance(self.reason, str) or len(self.reason) > 64:
            raise WireError("grant release reason must be a string of at most 64 characters")


MAX_TREE_SLOTS = 64
"""Most slots one tree grant fills."""
MAX_BRANCH_EVERY = 1000
"""Largest `TreeSpec.every` (the longest episode accepted, `MAX_STEPS_LIMIT`)."""


@dataclass(frozen=True, slots=True)
class TreeSpec:
    """A grant that fills several slots of its group with one tree rollout on one
    environment (`arpo.actor.tree`): the grant's own slot is `slots[0]`."""

    slots: tuple[int, ...]
    """The slots the tree's leaves fill, one leaf each."""
    grant_ids: tuple[str, ...]
    """The book's grant id of each slot (a leaf that cannot be run is released by it)."""
    width: int
    """Children per branch point (2..len(slots))."""
    every: int
    """Branch after every `every` turns (a node with one slot left runs to its end)."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for name in ("slots", "grant_ids"):
            v = getattr(self, name)
            if type(v) not in (list, tuple) or not 2 <= len(v) <= MAX_TREE_SLOTS:
                raise WireError(f"grant tree {name} must be a list of 2..{MAX_TREE_SLOTS} entries")
            set_(self, name, tuple(v))
        for i, sl in enumerate(self.slots):
            _check_int(sl, f"grant tree slots[{i}]", 0, MAX_SLOT)
        for gid in self.grant_ids:
            _check_id(gid, "grant tree grant id")
        if len(set(self.slots)) != len(self.slots) or len(self.grant_ids) != len(self.slots):
            raise WireError("grant tree slots must be distinct, with one grant id each")
        _check_int(self.width, "grant tree width", 2, len(self.slots))
        _check_int(self.every, "grant tree every", 1, MAX_BRANCH_EVERY)

    def to_json(self) -> dict[str, Any]:
        return {"slots": list(self.slots), "grant_ids": list(self.grant_ids),
                "width": self.width, "every": self.every}  # fmt: skip

    @classmethod
    def from_json(cls, d: Any) -> TreeSpec:
        if type(d) is not dict or set(d) != {"slots", "grant_ids", "width", "every"}:
            raise WireError("grant tree must be a map of slots, grant_ids, width, every")
        return cls(d["slots"], d["grant_ids"], d["width"], d["every"])


@dataclass(frozen=True, slots=True)
class Grant:
    """One episode to run: slot `slot` of group `group` of task `task_id` (or, with
    `tree`, one tree rollout filling several slots)."""

    grant_id: str
    """Unique id of this grant (a re-issued slot gets a new one)."""
    task_id: str
    group: str
    """The GRPO group this episode fills (Trajectory.group_id)."""
    slot: int
    """Position in the group (Trajectory.slot)."""
    version: int
    """The learner's policy version when the grant was issued."""
    task_json: str
    """The task file as JSON text (OSWorld schema)."""
    min_version: int = 0
    """The episode must be sampled with policy weights of at least this version: an actor
    holding older weights fetches the newest before it starts (staleness control)."""
    temperature: float | None = None
    """Sampling temperature the learner scores (None: the actor's own setting)."""
    top_p: float | None = None
    """Nucleus the learner scores (None: the actor's own setting)."""
    tree: TreeSpec | None = None
    """Run as a tree rollout filling `tree.slots` (None: one episode)."""

    def __post_init__(self) -> None:
        _check_id(self.grant_id, "grant id")
        _check_id(self.task_id, "grant task id")
        _check_id(self.group, "grant group")
        _check_int(self.slot, "grant slot", 0, 1 << 31)
        _check_int(self.version, "grant version")
        if type(self.task_json) is not str or len(self.task_json) > MAX_STR_BYTES:
            raise WireError(f"grant task_json must be a string of at most {MAX_STR_BYTES} bytes")
        _check_int(self.min_version, "grant min_version")
        if (self.temperature is None) != (self.top_p is None):
            raise WireError("grant temperature and top_p must both be set or both be nil")
        if self.temperature is not None:
            t = _check_float(self.temperature, "grant temperature")
            p = _check_float(self.top_p, "grant top_p")
            if not 0.0 < p <= 1.0:
                raise WireError(f"grant top_p must be in (0, 1], got {p!r:.40}")
            object.__setattr__(self, "temperature", t)
            object.__setattr__(self, "top_p", p)
        if self.tree is not None:
            if not isinstance(self.tree, TreeSpec):
                raise WireError("grant tree must be a TreeSpec or nil")
            if self.tree.slots[0] != self.slot or self.tree.grant_ids[0] != self.grant_id:
                raise WireError("a tree grant's own slot and id must come first in its tree")


@dataclass(frozen=True, slots=True)
class GrantReply:
    """The learner's answer to a GrantRequest: zero or more grants."""

    req: int
    grants: tuple[Grant, ...] = ()
    retry: float = 0.0
    """Seconds to wait before asking again (used when `grants` is empty)."""

    def __post_init__(self) -> None:
        _check_int(self.req, "grant reply req")
        object.__setattr__(self, "grants", tuple(self.grants))
        if len(self.grants) > MAX_GRANTS or not all(isinstance(g, Grant) for g in self.grants):
            raise WireError(f"grant reply holds at most {MAX_GRANTS} Grant objects")
        object.__setattr__(self, "retry", _check_float(self.retry, "grant reply retry"))


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Liveness and state, sent both ways: actors to the learner and back."""

    sender: str
    role: str
    """"actor" or "learner"."""
    seq: int
    version: int
    """Policy version the sender holds (the learner: the newest it publishes)."""
    time: float
    """Sender's wall clock (seconds since the epoch) when sent."""
    stats: dict[str, float] = field(default_factory=dict)
    """A few counters: episodes, spool size, in-flight episodes..."""

    def __post_init__(self) -> None:
        _check_id(self.sender, "heartbeat sender")
        if self.role not in ("actor", "learner"):
            raise WireError(f"heartbeat role must be 'actor' or 'learner', got {self.role!r:.40}")
        _check_int(self.seq, "heartbeat seq")
        _check_int(self.version, "heartbeat version")
        object.__setattr__(self, "time", _check_float(self.time, "heartbeat time"))
        if not isinstance(self.stats, dict) or len(self.stats) > MAX_STATS:
            raise WireError(f"heartbeat stats must be a map of at most {MAX_STATS} counters")
        stats = {}
        for k, v in self.stats.items():
            _check_id(k, "heartbeat stats key")
            if type(v) not in (int, float) or not math.isfinite(v):
                raise WireError(f"heartbeat stats[{k!r:.40}] must be a finite number")
            stats[k] = v
        object.__setattr__(self, "stats", stats)


@dataclass(frozen=True, slots=True)
class WeightsAnnounce:
    """The newest policy weights: one safetensors byte stream, by chunks or by path."""

    version: int
    nbytes: int
    """Size of the safetensors stream."""
    chunks: int
    """Number of chunks the stream is served in (ceil(nbytes / chunk_bytes))."""
    chunk_bytes: int
    """Size of every chunk but the last."""
    sha256: str
    """Hex SHA-256 of the whole stream."""
    path: str = ""
    """The same file on the learner's filesystem ("" if not written); an actor that sees
    it with size `nbytes` loads it directly (shared filesystem)."""

    def __post_init__(self) -> None:
        _check_int(self.version, "weights version")
        _check_int(self.nbytes, "weights nbytes", 0, 1 << 50)
        _check_int(self.chunk_bytes, "weights chunk_bytes", 1, MAX_CHUNK_BYTES)
        _check_int(self.chunks, "weights chunks", 0, 1 << 31)
        if self.chunks != -(-self.nbytes // self.chunk_bytes):
            raise WireError(
                f"weights announce: {self.chunks} chunks cannot hold {self.nbytes} bytes "
                f"in chunks of {self.chunk_bytes}"
            )
        if type(self.sha256) is not str or len(self.sha256) != 64:
            raise WireError("weights sha256 must be 64 hex characters")
        try:
            bytes.fromhex(self.sha256)
        except ValueError:
            raise WireError("weights sha256 must be 64 hex characters") from None
        if type(self.path) is not str or len(self.path) > 4096:
            raise WireError("weights path must be a string of at most 4096 characters")


@dataclass(frozen=True, slots=True)
class WeightsRequest:
    """Ask for chunk `chunk` of `version`, or (chunk -1) for the newest announcement."""

    version: int
    chunk: int

    def __post_init__(self) -> None:
        _check_int(self.version, "weights request version")
        _check_int(self.chunk, "weights request chunk", -1, 1 << 31)


@dataclass(frozen=True, slots=True)
class WeightsChunk:
    """Bytes `index * chunk_bytes ...` of the safetensors stream of `version`."""

    version: int
    index: int
    total: int
    data: Any = b""
    """The chunk's bytes (bytes, memoryview or a received frame's buffer)."""

    def __post_init__(self) -> None:
        _check_int(self.version, "weights chunk version")
        _check_int(self.total, "weights chunk total", 1, 1 << 31)
        _check_int(self.index, "weights chunk index", 0, self.total - 1)
        try:
            n = memoryview(self.data).nbytes
        except TypeError:
            raise WireError(
                f"weights chunk data must be bytes, got {type(self.data).__name__}"
            ) from None
        if n > MAX_CHUNK_BYTES:
            raise WireError(f"weights chunk of {n} bytes is above the limit of {MAX_CHUNK_BYTES}")


@dataclass(frozen=True, slots=True)
class FileRequest:
    """Ask the learner for chunk `chunk` of the task file whose SHA-256 is `sha256`
    (`arpo.env.taskfiles`: a grant names the files its task uploads by content)."""

    sha256: str
    chunk: int = 0

    def __post_init__(self) -> None:
        _check_sha256(self.sha256, "file request sha256")
        _check_int(self.chunk, "file request chunk", 0, 1 << 31)


@dataclass(frozen=True, slots=True)
class FileChunk:
    """Chunk `index` of `total` of the task file `sha256` (`size` bytes in all), or an
    `error` (then `data` is empty) when the learner does not serve it."""

    sha256: str
    index: int
    total: int
    size: int
    error: str = ""
    data: Any = b""

    def __post_init__(self) -> None:
        _check_sha256(self.sha256, "file chunk sha256")
        _check_int(self.total, "file chunk total", 0, 1 << 31)
        _check_int(self.index, "file chunk index", 0, 1 << 31)
        _check_int(self.size, "file chunk size", 0, 1 << 50)
        if type(self.error) is not str or len(self.error) > 1024:
            raise WireError("file chunk error must be a string of at most 1024 characters")
        try:
            n = memoryview(self.data).nbytes
        except TypeError:
            raise WireError(
                f"file chunk data must be bytes, got {type(self.data).__name__}"
            ) from None
        if n > MAX_CHUNK_BYTES:
            raise WireError(f"file chunk of {n} bytes is above the limit of {MAX_CHUNK_BYTES}")
        if self.error and n:
            raise WireError("file chunk carries both an error and data")


def _check_sha256(v: Any, name: str) -> str:
    if type(v) is not str or len(v) != 64 or not all(c in "0123456789abcdef" for c in v):
        raise WireError(f"{name} must be 64 lowercase hex characters, got {v!r:.80}")
    return v


Message = (
    Trajectory
    | Ack
    | Refuse
    | GrantRequest
    | GrantRelease
    | GrantReply
    | Heartbeat
    | WeightsAnnounce
    | WeightsRequest
    | WeightsChunk
    | FileRequest
    | FileChunk
)
Frame = bytes | bytearray | memoryview


def _preamble(kind: int) -> bytes:
    return _PREAMBLE.pack(MAGIC, WIRE_VERSION, kind, 0)


def _pack(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def encode(msg: Message) -> list[Frame]:
    """Encode a message into frames. PNG frames are the record's own buffers (no copy)."""
    if isinstance(msg, Trajectory):
        return _encode_trajectory(msg)
    if isinstance(msg, Ack):
        return [_preamble(KIND_ACK), _pack({"ids": list(msg.ids)})]
    if isinstance(msg, GrantRequest):
        h = {"actor": msg.actor, "req": msg.req, "want": msg.want, "pool": msg.pool}
        return [_preamble(KIND_GRANT_REQUEST), _pack(h)]
    if isinstance(msg, GrantRelease):
        h = {"actor": msg.actor, "req": msg.req, "grant_id": msg.grant_id, "reason": msg.reason}
        return [_preamble(KIND_GRANT_RELEASE), _pack(h)]
    if isinstance(msg, GrantReply):
        grants = [
            [g.grant_id, g.task_id, g.group, g.slot, g.version, g.task_json, g.min_version,
             g.temperature, g.top_p, None if g.tree is None else g.tree.to_json()]
            for g in msg.grants
        ]  # fmt: skip
        return [
            _preamble(KIND_GRANT),
            _pack({"req": msg.req, "grants": grants, "retry": msg.retry}),
        ]
    if isinstance(msg, Heartbeat):
        h = {
            "sender": msg.sender,
            "role": msg.role,
            "seq": msg.seq,
            "version": msg.version,
            "time": msg.time,
            "stats": dict(msg.stats),
        }
        return [_preamble(KIND_HEARTBEAT), _pack(h)]
    if isinstance(msg, WeightsAnnounce):
        h = {
            "version": msg.version,
            "nbytes": msg.nbytes,
            "chunks": msg.chunks,
            "chunk_bytes": msg.chunk_bytes,
            "sha256": msg.sha256,
            "path": msg.path,
        }
        return [_preamble(KIND_WEIGHTS_ANNOUNCE), _pack(h)]
    if isinstance(msg, WeightsRequest):
        h = {"version": msg.version, "chunk": msg.chunk}
        return [_preamble(KIND_WEIGHTS_REQUEST), _pack(h)]
    if isinstance(msg, WeightsChunk):
        h = {"version": msg.version, "index": msg.index, "total": msg.total}
        return [_preamble(KIND_WEIGHTS_CHUNK), _pack(h), msg.data]
    if isinstance(msg, Refuse):
        return [_preamble(KIND_REFUSE), _pack({"ids": list(msg.ids), "reason": msg.reason})]
    if isinstance(msg, FileRequest):
        return [_preamble(KIND_FILE_REQUEST), _pack({"sha256": msg.sha256, "chunk": msg.chunk})]
    if isinstance(msg, FileChunk):
        h = {"sha256": msg.sha256, "index": msg.index, "total": msg.total, "size": msg.size,
             "error": msg.error}  # fmt: skip
        return [_preamble(KIND_FILE_CHUNK), _pack(h), msg.data]
    raise TypeError(f"cannot encode {type(msg).__name__}; not a wire message")


def trajectory_header(traj: Trajectory) -> dict[str, Any]:
    """The header map of a trajectory (frame 1 of its message, packed)."""
    return {
        "tid": traj.trajectory_id,
        "task": traj.task_id,
        "group": traj.group_id,
        "slot": traj.slot,
        "actor": traj.actor_id,
        "score": traj.checker_score,
        "fmt": traj.format_reward,
        "reward": traj.reward,
        "status": traj.status.value,
        "timings": dict(traj.timings),
        "error": traj.error,
        "env": traj.env,
        "branch": None if traj.branch is None else traj.branch.to_json(),
        "obs": traj.observation_type,
        "turns": [
            [
                len(t.prompt_ids),
                len(t.response_ids),
                len(t.screenshot),
                t.policy_version,
                t.parsed,
                t.action,
                t.temperature,
                t.top_p,
                t.marks_source,
            ]
            for t in traj.turns
        ],
    }


def pack_trajectory_header(traj: Trajectory) -> bytes:
    """The trajectory's header frame: `trajectory_header` as msgpack. A replay store item
    keeps the same bytes as its metadata (`arpo.store_item`)."""
    return _pack(trajectory_header(traj))


def _concat(arrays: list[np.ndarray], dtype: np.dtype) -> bytes | memoryview:
    if not arrays:
        return b""
    if len(arrays) == 1:
        return memoryview(np.ascontiguousarray(arrays[0], dtype=dtype)).cast("B")
    return np.concatenate(arrays).astype(dtype, copy=False).tobytes()


def _encode_trajectory(traj: Trajectory) -> list[Frame]:
    turns = traj.turns
    frames: list[Frame] = [
        _preamble(KIND_TRAJECTORY),
        pack_trajectory_header(traj),
        _concat([t.prompt_ids for t in turns], _I32),
        _concat([t.response_ids for t in turns], _I32),
        _concat([t.logprobs for t in turns], _F32),
    ]
    frames.extend(t.screenshot for t in turns)
    return frames


# ---------------------------------------------------------------------------- decoding


def _view(frame: Any, index: int) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # a zmq.Frame exposes its bytes as .buffer
    try:
        mv = memoryview(buf)
    except TypeError:
        raise WireError(
            f"frame {index} is a {type(frame).__name__}, not a bytes-like object"
        ) from None
    if not mv.c_contiguous:
        raise WireError(f"frame {index} is not contiguous")
    if mv.format != "B" or mv.ndim != 1:
        try:
            mv = mv.cast("B")
        except TypeError as e:
            raise WireError(f"frame {index} cannot be read as bytes: {e}") from None
    return mv


def _reject_ext(code: int, data: bytes) -> Any:
    raise WireError(f"header contains a msgpack extension type ({code}), which is not allowed")


def _unpack(mv: memoryview) -> dict[str, Any]:
    if len(mv) > MAX_HEADER_BYTES:
        raise WireError(f"header frame is {len(mv)} bytes, above the limit of {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(
            mv,
            raw=False,
            strict_map_key=True,
            ext_hook=_reject_ext,
            max_str_len=MAX_STR_BYTES,
            max_bin_len=0,
        )
    except WireError:
        raise
    except Exception as e:  # msgpack raises many types for garbage; all are malformed input
        raise WireError(f"header is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise WireError(f"header must be a map, got {type(header).__name__}")
    return header


def peek_kind(frames: Sequence[Any]) -> int:
    """The message kind from the preamble (validated), without decoding the rest."""
    if not isinstance(frames, Sequence) or isinstance(frames, bytes | bytearray | memoryview | str):
        raise WireError(f"a message is a sequence of frames, got {type(frames).__name__}")
    if len(frames) < 2:
        raise WireError(f"a message has at least 2 frames (preamble, header), got {len(frames)}")
    pre = _view(frames[0], 0)
    if len(pre) != _PREAMBLE.size:
        raise WireError(f"preamble must be {_PREAMBLE.size} bytes, got {len(pre)}")
    magic, version, kind, reserved = _PREAMBLE.unpack(pre)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}: not an arpo message")
    if version != WIRE_VERSION:
        raise WireError(
            f"wire version {version} is not supported (this side speaks {WIRE_VERSION})"
        )
    if reserved != 0:
        raise WireError("preamble reserved bytes must be zero")
    if kind not in _KINDS:
        raise WireError(f"unknown message kind {kind}")
    return kind


def decode(frames: Sequence[Any]) -> Message:
    """Decode frames into a message; raises only WireError on malformed input."""
    kind = peek_kind(frames)
    header = _unpack(_view(frames[1], 1))
    if kind == KIND_ACK:
        if len(frames) != 2:
            raise WireError(f"ack has 2 frames, got {len(frames)}")
        if set(header) != {"ids"}:
            raise WireError(f"ack header must have exactly the key 'ids', got {sorted(header)}")
        ids = header["ids"]
        if not isinstance(ids, list) or len(ids) > MAX_ACK_IDS:
            raise WireError(f"ack 'ids' must be a list of at most {MAX_ACK_IDS} strings")
        return Ack(tuple(ids))
    if kind == KIND_TRAJECTORY:
        return decode_trajectory_parts(header, frames[2:], first_index=2)
    if kind == KIND_REFUSE:
        if len(frames) != 2:
            raise WireError(f"refuse has 2 frames, got {len(frames)}")
        if set(header) != {"ids", "reason"}:
            raise WireError(f"refuse header must have the keys ids, reason; got {sorted(header)}")
        if not isinstance(header["ids"], list):
            raise WireError("refuse 'ids' must be a list of strings")
        return Refuse(tuple(header["ids"]), header["reason"])
    return _decode_control(kind, header, frames)


_CONTROL_KEYS = {
    KIND_GRANT_REQUEST: ("grant request", frozenset(("actor", "req", "want", "pool")), 2),
    KIND_GRANT: ("grant", frozenset(("req", "grants", "retry")), 2),
    KIND_GRANT_RELEASE: ("grant release", frozenset(("actor", "req", "grant_id", "reason")), 2),
    KIND_HEARTBEAT: (
        "heartbeat",
        frozenset(("sender", "role", "seq", "version", "time", "stats")),
        2,
    ),
    KIND_WEIGHTS_ANNOUNCE: (
        "weights announce",
        frozenset(("version", "nbytes", "chunks", "chunk_bytes", "sha256", "path")),
        2,
    ),
    KIND_WEIGHTS_REQUEST: ("weights request", frozenset(("version", "chunk")), 2),
    KIND_WEIGHTS_CHUNK: ("weights chunk", frozenset(("version", "index", "total")), 3),
    KIND_FILE_REQUEST: ("file request", frozenset(("sha256", "chunk")), 2),
    KIND_FILE_CHUNK: ("file chunk", frozenset(("sha256", "index", "total", "size", "error")), 3),
}
_OPTIONAL_KEYS = {KIND_GRANT_REQUEST: frozenset(("pool",))}
"""Keys a header may leave out (messages written before the key existed)."""


def _decode_control(kind: int, header: dict[str, Any], frames: Sequence[Any]) -> Message:
    name, keys, n_frames = _CONTROL_KEYS[kind]
    if len(frames) != n_frames:
        raise WireError(f"{name} has {n_frames} frames, got {len(frames)}")
    got, optional = set(header), _OPTIONAL_KEYS.get(kind, frozenset())
    if not keys - optional <= got <= keys:
        missing, extra = sorted(keys - optional - got), sorted(got - keys)
        raise WireError(f"{name} header keys wrong: missing {missing}, unexpected {extra}")
    if kind == KIND_GRANT_REQUEST:
        pool = header.get("pool", "")
        return GrantRequest(header["actor"], header["req"], header["want"], pool)
    if kind == KIND_GRANT_RELEASE:
        return GrantRelease(header["actor"], header["req"], header["grant_id"], header["reason"])
    if kind == KIND_GRANT:
        raw = header["grants"]
        if type(raw) is not list or len(raw) > MAX_GRANTS:
            raise WireError(f"grant 'grants' must be a list of at most {MAX_GRANTS} entries")
        grants = []
        for i, g in enumerate(raw):
            if type(g) is not list or len(g) not in (6, 9, 10):
                raise WireError(
                    f"grants[{i}] must be [grant_id, task_id, group, slot, version, task_json, "
                    "min_version, temperature, top_p, tree] (or the first 6 or 9 of them)"
                )
            if len(g) == 10:
                g = [*g[:9], None if g[9] is None else TreeSpec.from_json(g[9])]
            grants.append(Grant(*g))
        return GrantReply(header["req"], tuple(grants), header["retry"])
    if kind == KIND_HEARTBEAT:
        return Heartbeat(
            header["sender"],
            header["role"],
            header["seq"],
            header["version"],
            header["time"],
            header["stats"],
        )
    if kind == KIND_WEIGHTS_ANNOUNCE:
        return WeightsAnnounce(
            header["version"],
            header["nbytes"],
            header["chunks"],
            header["chunk_bytes"],
            header["sha256"],
            header["path"],
        )
    if kind == KIND_WEIGHTS_REQUEST:
        return WeightsRequest(header["version"], header["chunk"])
    if kind == KIND_FILE_REQUEST:
        return FileRequest(header["sha256"], header["chunk"])
    if kind == KIND_FILE_CHUNK:
        return FileChunk(
            header["sha256"],
            header["index"],
            header["total"],
            header["size"],
            header["error"],
            _view(frames[2], 2),
        )
    return WeightsChunk(header["version"], header["index"], header["total"], _view(frames[2], 2))


def _get(header: dict[str, Any], key: str, types: type | tuple[type, ...], what: str) -> Any:
    v = header[key]
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise WireError(f"header field {key!r} must be {what}, got a bool")
    if not isinstance(v, types):
        raise WireError(f"header field {key!r} must be {what}, got {type(v).__name__}")
    return v


def _array(mv: memoryview, dtype: np.dtype, n: int, name: str) -> np.ndarray:
    if len(mv) != n * dtype.itemsize:
        raise WireError(
            f"{name} frame has {len(mv)} bytes but the header declares {n} values "
            f"({n * dtype.itemsize} bytes)"
        )
    return np.frombuffer(mv, dtype=dtype)


def _turn_specs(header: dict[str, Any]) -> list[list[Any]]:
    """Check the trajectory header's keys and per-turn entries; return the turn specs."""
    keys = set(header)
    if not _TRAJ_KEYS - _TRAJ_OPTIONAL <= keys <= _TRAJ_KEYS:
        missing = sorted(_TRAJ_KEYS - _TRAJ_OPTIONAL - keys)
        extra = sorted(keys - _TRAJ_KEYS)
        raise WireError(f"trajectory header keys wrong: missing {missing}, unexpected {extra}")
    turns_h = _get(header, "turns", list, "a list")
    if len(turns_h) > MAX_TURNS:
        raise WireError(f"trajectory has {len(turns_h)} turns, above the limit of {MAX_TURNS}")
    for i, t in enumerate(turns_h):
        # `type(x) is int` also rejects bools (a bool is an int subclass).
        if (
            type(t) is not list
            or len(t) not in (6, 8, 9)
            or type(t[0]) is not int
            or type(t[1]) is not int
            or type(t[2]) is not int
            or type(t[3]) is not int
            or type(t[4]) is not bool
            or type(t[5]) is not str
            or not 0 <= t[0] <= MAX_VERSION
            or not 0 <= t[1] <= MAX_VERSION
            or not 0 <= t[2] <= MAX_VERSION
            or not 0 <= t[3] <= MAX_VERSION
        ):
            raise WireError(
                f"turns[{i}] must be [n_prompt, n_response, n_png, version, parsed, action, "
                f"temperature, top_p, marks_source] with ints in [0, 2^63 - 1], a bool, a "
                f"str, two numbers and a str; got {t!r:.200}"
            )
        if len(t) == 6:
            t.extend((math.nan, math.nan))  # a record from before the sampling fields
        else:
            try:
                t[6], t[7] = sampling_values(t[6], t[7], f"turns[{i}].")
            except RecordError as e:
                raise WireError(str(e)) from None
        if len(t) == 8:  # a record from before marks_source: som's marks were the tree's
            t.append(MARKS_SOURCES[0] if header.get("obs") == "som" else "")
        elif type(t[8]) is not str or (t[8] and t[8] not in MARKS_SOURCES):
            raise WireError(
                f"turns[{i}].marks_source must be one of {', '.join(MARKS_SOURCES)} or '', "
                f"got {t[8]!r:.60}"
            )
    return turns_h


def unpack_trajectory_header(buf: Any) -> dict[str, Any]:
    """The header map packed in `buf` (`pack_trajectory_header`'s bytes), checked: its keys,
    and its `turns` as 9-entry specs (older forms filled in as the module doc says). WireError when
    malformed. The payload is checked by `assemble_trajectory`."""
    header = _unpack(memoryview(buf))
    _turn_specs(header)
    return header


def decode_trajectory_parts(
    header: dict[str, Any], payload: Sequence[Any], *, first_index: int = 0
) -> Trajectory:
    """Build a Trajectory from a header map and its payload frames (zero-copy views)."""
    specs = _turn_specs(header)
    n_turns = len(specs)
    if len(payload) != 3 + n_turns:
        raise WireError(
            f"trajectory with {n_turns} turns needs {3 + n_turns} payload frames "
            f"(3 arrays + 1 PNG per turn), got {len(payload)}"
        )
    views = [_view(f, first_index + j) for j, f in enumerate(payload)]
    total_p = sum(s[0] for s in specs)
    total_r = sum(s[1] for s in specs)
    prompt = _array(views[0], _I32, total_p, "prompt ids")
    response = _array(views[1], _I32, total_r, "response ids")
    logprobs = _array(views[2], _F32, total_r, "log-probs")
    prompts, responses, lps = [], [], []
    op = orr = 0
    for n_p, n_r, *_ in specs:
        prompts.append(prompt[op : op + n_p])
        responses.append(response[orr : orr + n_r])
        lps.append(logprobs[orr : orr + n_r])
        op += n_p
        orr += n_r
    return assemble_trajectory(header, prompts, responses, lps, logprobs, views[3:])


def assemble_trajectory(
    header: dict[str, Any],
    prompts: list[np.ndarray],
    responses: list[np.ndarray],
    lps: list[np.ndarray],
    all_logprobs: np.ndarray,
    pngs: Sequence[memoryview],
) -> Trajectory:
    """The Trajectory of a checked header (`unpack_trajectory_header`, or
    `decode_trajectory_parts`' own check) and every turn's prompt ids, response ids,
    log-probs and PNG, kept as the views they are; `all_logprobs` holds every turn's
    log-probs (one finiteness check for all). Checks what the header could not: PNG sizes
    and signatures, finite log-probs, the record's fields. WireError when malformed."""
    specs = header["turns"]
    timings = _get(header, "timings", dict, "a map")
    if all_logprobs.size and not np.isfinite(all_logprobs).all():
        raise WireError("log-probs frame holds NaN or inf")
    try:
        turns = []
        for i, (_, _, n_png, ver, parsed, action, temp, top_p, source) in enumerate(specs):
            png = pngs[i]
            if len(png) != n_png:
                raise WireError(f"turns[{i}] PNG frame has {len(png)} bytes, header says {n_png}")
            if n_png and png[:8] != PNG_SIGNATURE:
                raise WireError(f"turns[{i}] screenshot frame is not a PNG (bad signature)")
            # Every field was checked above, frame-wide: skip the per-turn constructor checks.
            turns.append(
                Turn.trusted(
                    prompts[i],
                    png,
                    responses[i],
                    lps[i],
                    ver,
                    action,
                    parsed,
                    temp,
                    top_p,
                    source,
                )
            )
        status = _get(header, "status", str, "a string")
        if status not in Status._value2member_map_:
            raise WireError(f"unknown status {status!r}")
        return Trajectory(
            task_id=_get(header, "task", str, "a string"),
            turns=tuple(turns),
            checker_score=_get(header, "score", (int, float), "a number"),
            format_reward=_get(header, "fmt", (int, float), "a number"),
            reward=_get(header, "reward", (int, float), "a number"),
            status=Status(status),
            trajectory_id=_get(header, "tid", str, "a string"),
            group_id=_get(header, "group", str, "a string"),
            slot=_check_int(_get(header, "slot", int, "an int"), "trajectory slot", 0, MAX_SLOT),
            actor_id=_get(header, "actor", str, "a string"),
            timings=timings,
            error=_get(header, "error", str, "a string") if "error" in header else "",
            env=_get(header, "env", str, "a string") if "env" in header else "",
            branch=None if header.get("branch") is None else Branch.from_json(header["branch"]),
            observation_type=_get(header, "obs", str, "a string")
            if "obs" in header
            else "screenshot",
        )
    except RecordError as e:
        raise WireError(f"invalid trajectory: {e}") from None

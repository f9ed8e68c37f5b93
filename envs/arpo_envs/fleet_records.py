"""The records the fleets exchange: the VM fleet's control API, both fleets' state files, status.

Every body of the VM fleet's control API (`arpo_envs.vm.control.make_app`; its client is
`arpo.env.provider.FleetVMProvider`), both state files (a VM fleet's `<dir>/fleet.json`, the
local desktops' state file of `arpo-envs up`) and the status of either fleet is one of the
records below: a frozen, slotted dataclass carrying `version`, written as a JSON object by
`encode` and read back by `decode`, the one pair of functions for all of them:

    body = encode(RevertRequest(task_id="t1"))
    # {"record": "revert_request", "version": 1, "task_id": "t1"}
    request = decode(body, RevertRequest)   # FleetRecordError when it is not one

A record is a message (its JSON object names it: `"record": <name>`, and carries `version`)
or a part of one (`VMEntry`, `VMStatus`, ...: a JSON object inside a message, read as the
type of the field that holds it). Validation is strict and the same on both sides: a
message of another version or of a kind the reader does not expect there, a field missing,
unknown or of the wrong type, a value out of its range raises `FleetRecordError`, whose
message names the record and the field (`report_request.ok: expected bool, got str 'yes'`).
The fleet answers such a request 400 with a `Failure` saying so and goes on serving; its
client turns such an answer into the environment's error.

A quarantined task is a `Quarantined` answer (and `TaskQuarantined`, the one exception for
it on both sides), not a status code. The HTTP statuses are kept as they were, for clients
that read only those: 409 a quarantined task or a request the VM's state refuses, 503 a
failed revert / snapshot / fork, 429 over a bound, 404 an unknown VM or snapshot, 400 a
malformed body, 401 a wrong token.

A change to any record's fields changes `VERSION`. Nothing here imports anything but the
standard library: the trainer (`arpo`) reads these records through this module.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

VERSION = 1
"""Version of every record below; a reader refuses a message of another version."""

MAX_TASK_ID_CHARS = 1024
"""Longest task id a request may carry."""
MAX_FORK = 1024
"""Most clones one fork may ask for."""

R = TypeVar("R")


class FleetRecordError(ValueError):
    """A fleet record is malformed: another version, an unexpected kind, a field missing,
    unknown, of the wrong type or out of range. The message names the record and the field."""


class TaskQuarantined(Exception):
    """The fleet quarantined this task: its setup failed on several VMs. Neither the agent's
    fault nor a VM's. Raised by the fleet's revert of the task, answered as a `Quarantined`
    record, raised again from that record by the actor's provider (`arpo.env.provider`
    re-exports this class)."""

    def __init__(self, task_id: str, reason: str):
        super().__init__(f"task {task_id} is quarantined: {reason}")
        self.task_id, self.reason = task_id, reason

    def record(self) -> Quarantined:
        return Quarantined(self.task_id, self.reason)


# ---- parts: objects inside a message, read as the type of the field that holds them -----------


@dataclass(frozen=True, slots=True)
class VMEntry:
    """One VM of a fleet, or a clone of one, as its clients reach it."""

    name: str
    """Its name in the control API (`vm-0`; a clone: `<snapshot id>-<i>`)."""
    url: str
    """Base URL of its OSWorld server (`http://127.0.0.1:<port>`)."""
    port: int
    """Host port forwarded to the guest's server (guest port 5000)."""
    qemu_pid: int
    """Pid of its QEMU process (0: not started)."""
    chromium_port: int
    """Host port forwarded to Chrome's debugging port (guest 9222), for OSWorld's getters."""
    vlc_port: int
    """Host port forwarded to VLC's web interface (guest 8080), for OSWorld's getters."""
    snapshot: str = ""
    """A clone: the id of the snapshot it was started from; '' for the fleet's own VMs."""

    @property
    def osworld_ports(self) -> dict[str, int]:
        """The host ports OSWorld's getters need ("chromium_port", "vlc_port")."""
        return {"chromium_port": self.chromium_port, "vlc_port": self.vlc_port}


@dataclass(frozen=True, slots=True)
class DesktopEntry:
    """One local desktop server of `arpo-envs up`, as the state file keeps it (no token)."""

    index: int
    """Its place in the fleet (0..n-1)."""
    pid: int
    """Pid of its server process (a session leader and child subreaper)."""
    url: str
    """Base URL of its server ('' until it announced itself)."""
    display: str
    """Its X display (`:<n>`; '' until it announced itself)."""
    root: str
    """Its folder (home, logs, lock files, recorded process tree); removed by `down`."""
    token_sha256: str
    """sha256 (hex) of its bearer token ('' = no token); the token is in no file but the
    tokens file the caller asked for."""


@dataclass(frozen=True, slots=True)
class VMStatus:
    """One VM or clone in the fleet's report."""

    name: str
    """Its name in the control API."""
    url: str
    """Base URL of its OSWorld server."""
    state: str
    """starting | ready | reverting | snapshotting | replacing | failing | failed | released."""
    qemu_pid: int
    """Pid of its current QEMU process (0: none)."""
    last_error: str
    """Why it last failed or was replaced ('' = never)."""
    replacements: int = 0
    """How many times its QEMU was replaced (a clone: never)."""
    failure_streak: int = 0
    """Reverts and setups failed in a row on it."""
    snapshot: str = ""
    """A clone: the snapshot it was started from; '' for the fleet's own VMs."""


@dataclass(frozen=True, slots=True)
class SnapshotStatus:
    """One saved state of a VM that the fleet holds."""

    id: str
    """The snapshot's id (`snap-<hex>`)."""
    parent: str
    """Name of the VM it was saved from."""
    clones: tuple[str, ...]
    """Names of the clones started from it and alive."""
    age_s: float
    """Seconds since it was saved."""
    ram_mib: int
    """MiB its RAM file takes (the guest's non-zero pages)."""


@dataclass(frozen=True, slots=True)
class Limits:
    """The fleet's bounds on forks (`FleetConfig`)."""

    max_clones: int
    """Clones alive at once."""
    max_snapshots: int
    """Snapshots held at once."""
    snapshot_ttl_s: float
    """Seconds after which a snapshot nobody released is released by the fleet."""


@dataclass(frozen=True, slots=True)
class EnvStatus:
    """One environment of either kind of fleet in `FleetStatus`."""

    name: str
    """`desktop-<i>`, or the VM's name."""
    url: str
    """Base URL of its server."""
    state: str
    """A desktop: running | exited; a VM: its fleet state (`VMStatus.state`); `gone` when
    the VM fleet's process is."""
    pid: int
    """Pid of its server (a desktop) or of its QEMU (a VM)."""


# ---- messages: the JSON object names the record and carries its version -------------------------


@dataclass(frozen=True, slots=True)
class DesktopFleetState:
    """The state file of `arpo-envs up` (mode 0600): what `status` and `down` need."""

    RECORD: ClassVar[str] = "desktop_fleet_state"
    up_pid: int | None
    """Pid of the `up` that started the desktops (a foreground `up` is stopped by `down`)."""
    servers: tuple[DesktopEntry, ...]
    """Every desktop server, in index order."""
    tokens_file: str
    """Where `up` wrote the tokens, for `down` to remove ('' = nowhere)."""
    version: int = VERSION
    """Version of the records (`VERSION`)."""


@dataclass(frozen=True, slots=True)
class VMFleetState:
    """A VM fleet's state file `<dir>/fleet.json` (mode 0600), written by the fleet process
    whenever its VMs or clones change: how to reach its control API and its VMs."""

    RECORD: ClassVar[str] = "vm_fleet_state"
    pid: int
    """Pid of the fleet process."""
    ready: bool
    """Every VM answered: clients may use them (`up` returns then)."""
    dir: str
    """The fleet's folder (state file, overlays, sockets, logs)."""
    control: str
    """Base URL of the control API."""
    token: str
    """Bearer token of the control API."""
    accel: str
    """kvm | tcg: the accelerator of every VM."""
    accel_reason: str
    """Why that accelerator."""
    vms: tuple[VMEntry, ...]
    """The fleet's own VMs."""
    clones: tuple[VMEntry, ...]
    """The clones alive (started from snapshots)."""
    ram_dir: str
    """The fleet's folder of snapshot RAM files (`down` removes it)."""
    version: int = VERSION
    """Version of the records (`VERSION`)."""


@dataclass(frozen=True, slots=True)
class RevertRequest:
    """Body of `POST /vms/<name>/revert`: back to the snapshot `clean` before a task."""

    RECORD: ClassVar[str] = "revert_request"
    task_id: str = ""
    """The task about to be set up ('' = none): a quarantined one is refused."""
    version: int = VERSION
    """Version of the records (`VERSION`)."""

    def __post_init__(self) -> None:
        _check_task_id(self, self.task_id)


@dataclass(frozen=True, slots=True)
class ReportRequest:
    """Body of `POST /vms/<name>/report`: how a task's setup went on the VM."""

    RECORD: ClassVar[str] = "report_request"
    task_id: str
    """The task set up."""
    ok: bool
    """Whether its setup succeeded."""
    error: str = ""
    """Why it failed (the fleet keeps its first 2000 characters)."""
    version: int = VERSION
    """Version of the records (`VERSION`)."""

    def __post_init__(self) -> None:
        _check_task_id(self, self.task_id)


@dataclass(frozen=True, slots=True)
class SnapshotRequest:
    """Body of `POST /vms/<name>/snapshot`: save the running VM's state for forks."""

    RECORD: ClassVar[str] = "snapshot_request"
    version: int = VERSION
    """Version of the records (`VERSION`)."""


@dataclass(frozen=True, slots=True)
class ForkRequest:
    """Body of `POST /snapshots/<id>/fork`: start clones of a snapshot."""

    RECORD: ClassVar[str] = "fork_request"
    n: int
    """How many clones (1..`MAX_FORK`)."""
    version: int = VERSION
    """Version of the records (`VERSION`)."""

    def __post_init__(self) -> None:
        if not 1 <= self.n <= MAX_FORK:
            raise FleetRecordError(f"fork_request.n: must be in 1..{MAX_FORK}, got {self.n}")


@dataclass(frozen=True, slots=True)
class Failure:
    """Any answer of the control API but a success or a quarantine: a refused token (401),
    a malformed body (400), an unknown VM or snapshot (404), a state that refuses the
    request (409), a bound (429), a revert, snapshot or fork that failed (503)."""

    RECORD: ClassVar[str] = "failure"
    error: str
    """What went wrong, and how to fix it where that is known."""
    state: str = ""
    """State of the VM asked about ('' = none or unknown)."""
    version: int = VERSION
    """Version of the records (`VERSION`)."""


@dataclass(frozen=True, slots=True)
class Quarantined:
    """Answer to a revert for a quarantined task (HTTP 409): its setup failed on several
    VMs; the client gives the task up (`TaskQuarantined`), the VM is not at fault."""

    RECORD: ClassVar[str] = "quarantined"
    task_id: str
    """The task."""
    reason: str
    """Why it was quarantined (the VMs its setup failed on, the first error)."""
    version: int = VERSION
    """Version of the records (`VERSION`)."""

    def error(self) -> TaskQuarantined:
        """The exception this answer means."""
        return TaskQuarantined(self.task_id, self.reason)


@dataclass(frozen=True, slots=True)
class Reverted:
    """Answer to a revert that succeeded: the VM is in its snapshot's state and answers."""

    RECORD: ClassVar[str] = "reverted"
    seconds: float
    """Seconds of the whole revert (loadvm and the screenshot after it)."""
    loadvm_s: float
    """Seconds of QMP's `loadvm`."""
    version: int = VERSION
    """Version of the records (`VERSION`)."""


@dataclass(frozen=True, slots=True)
class Reported:
    """Answer to a report."""

    RECORD: ClassVar[str] = "reported"
    vm_state: str
    """The VM's state after the report (`replacing`: it was quarantined)."""
    task_quarantined: bool
    """Whether the task is quarantined now."""
    version: int = VERSION
    """Version of the records (`VERSION`)."""


@dataclass(frozen=True, slots=True)
class VMHealth:
    """Answer to `GET /vms/<name>/health`."""

    RECORD: ClassVar[str] = "vm_health"
    ok: bool
    """The VM is ready and answered a screenshot now."""
    state: str
    """Its state (`VMStatus.state`); `failed`: it will not serve again."""
    error: str = ""
    """Why it is not ok."""
    version: int = VERSION
    """Version of the records (`VERSION`)."""


@dataclass(frozen=True, slots=True)
class SnapshotTaken:
    """Answer to a snapshot: the VM's state is saved, the VM goes on."""

    RECORD: ClassVar[str] = "snapshot_taken"
    snapshot: str
    """The snapshot's id, for fork and release."""
    info: dict[str, float]
    """Seconds of each part of the save (`holder_s`, `transfer_s`, `disk_s`, `paused_s`,
    ...) and the RAM moved (`ram_mib`)."""
    version: int = VERSION
    """Version of the records (`VERSION`)."""


@dataclass(frozen=True, slots=True)
class Forked:
    """Answer to a fork: every clone's server answers."""

    RECORD: ClassVar[str] = "forked"
    snapshot: str
    """The snapshot forked."""
    seconds: float
    """Seconds until every clone answered."""
    clones: tuple[VMEntry, ...]
    """The new clones."""
    version: int = VERSION
    """Version of the records (`VERSION`)."""


@dataclass(frozen=True, slots=True)
class Released:
    """Answer to `DELETE /snapshots/<id>`: its clones killed, its files deleted."""

    RECORD: ClassVar[str] = "released"
    snapshot: str
    """The snapshot released."""
    clones_stopped: int
    """How many clones were killed."""
    age_s: float
    """Seconds it was held."""
    version: int = VERSION
    """Version of the records (`VERSION`)."""


@dataclass(frozen=True, slots=True)
class VMReport:
    """Answer to `GET /vms/<name>`: that VM's (or clone's) line of the fleet's report."""

    RECORD: ClassVar[str] = "vm_report"
    vm: VMStatus
    """Its state, QEMU process and replacements."""
    version: int = VERSION
    """Version of the records (`VERSION`)."""


@dataclass(frozen=True, slots=True)
class FleetReport:
    """Answer to `GET /fleet`: the VM fleet's states, counters and bounds."""

    RECORD: ClassVar[str] = "fleet_report"
    accel: str
    """kvm | tcg."""
    accel_reason: str
    """Why that accelerator."""
    qemu: str
    """QEMU's version."""
    golden: dict[str, float | str]
    """The golden snapshot (`cold_boot_s`, `savevm_s`, `accel`, `bytes`); empty before it."""
    vms: tuple[VMStatus, ...]
    """The fleet's own VMs."""
    clones: tuple[VMStatus, ...]
    """The clones alive."""
    snapshots: tuple[SnapshotStatus, ...]
    """The snapshots held."""
    counters: dict[str, int]
    """Events and requests counted since the start (`reverts`, `revert_failed`,
    `health_checks`, `vm_replace`, `task_quarantined`, ...)."""
    revert_median_s: float | None
    """Median seconds of the last 512 reverts (None: none yet)."""
    quarantined_tasks: dict[str, str]
    """Task id -> why it is quarantined."""
    limits: Limits
    """The bounds on forks."""
    version: int = VERSION
    """Version of the records (`VERSION`)."""


@dataclass(frozen=True, slots=True)
class FleetStatus:
    """`status` of either kind of fleet (`arpo-envs status`, `arpo-envs vm status`)."""

    RECORD: ClassVar[str] = "fleet_status"
    kind: Literal["desktop", "vm"]
    """Which kind of fleet."""
    state_file: str
    """Its state file."""
    running: bool
    """It serves: a desktop server or the VM fleet's process is alive."""
    stale: bool
    """A state file is there but nothing of it runs (`down` cleans up)."""
    envs: tuple[EnvStatus, ...]
    """Every environment it names (a VM fleet: its VMs, then its clones)."""
    report: FleetReport | None = None
    """A running VM fleet: its own report (`GET /fleet`); None otherwise."""
    version: int = VERSION
    """Version of the records (`VERSION`)."""


MESSAGES: tuple[type, ...] = (
    DesktopFleetState, VMFleetState, RevertRequest, ReportRequest, SnapshotRequest, ForkRequest,
    Failure, Quarantined, Reverted, Reported, VMHealth, SnapshotTaken, Forked, Released,
    VMReport, FleetReport, FleetStatus,
)  # fmt: skip
"""Every message, in the order of the reference page."""
PARTS: tuple[type, ...] = (VMEntry, DesktopEntry, VMStatus, SnapshotStatus, Limits, EnvStatus)
"""Every part (an object inside a message)."""

_BY_NAME: dict[str, type] = {m.RECORD: m for m in MESSAGES}  # type: ignore[attr-defined]


def _check_task_id(rec: Any, task_id: str) -> None:
    if isinstance(task_id, str) and len(task_id) > MAX_TASK_ID_CHARS:
        raise FleetRecordError(
            f"{rec.RECORD}.task_id: at most {MAX_TASK_ID_CHARS} characters, got {len(task_id)}"
        )


# ---- the codec ----------------------------------------------------------------------------------


def encode(rec: Any) -> dict[str, Any]:
    """The JSON object of a record (a message names itself: `"record"`, then `"version"`)."""
    if not dataclasses.is_dataclass(rec) or isinstance(rec, type):
        raise TypeError(f"not a fleet record: {type(rec).__name__}")
    out: dict[str, Any] = {}
    name = getattr(rec, "RECORD", None)
    if name is not None:
        out["record"] = name
        out["version"] = rec.version  # type: ignore[attr-defined]
    for f in dataclasses.fields(rec):
        out.setdefault(f.name, _plain(getattr(rec, f.name)))
    return out


def _plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return encode(v)
    if isinstance(v, tuple | list):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return v


def decode(data: Any, *expected: type[R]) -> R:
    """The message `data` holds (a decoded JSON object), one of `expected` (any message when
    none is given), or the part when `expected` is one part class. FleetRecordError naming
    the record and the field when it is not one, and for any other value whatever it holds
    (an int too long to print, a list nested past the interpreter's recursion limit): no
    other exception. Only a bug of a record class (a field of a type the codec does not
    know) raises TypeError."""
    try:
        return _decode(data, expected)
    except RecursionError:  # a value nested deeper than the checks go
        raise FleetRecordError("a value nested too deeply to read") from None


def _decode(data: Any, expected: tuple[type[R], ...]) -> R:
    if not isinstance(data, dict):
        raise FleetRecordError(f"a fleet record is a JSON object, got {_what(data)}")
    if len(expected) == 1 and not hasattr(expected[0], "RECORD"):
        return typing.cast(R, _read(expected[0], data, expected[0].__name__))
    kinds = {c.RECORD: c for c in expected} if expected else _BY_NAME  # type: ignore[attr-defined]
    name = data.get("record")
    if not isinstance(name, str) or name not in kinds:
        want = " or ".join(kinds) if len(kinds) < 4 else "a fleet record"
        got = f"record {name!r}" if isinstance(name, str) else "an object without 'record'"
        raise FleetRecordError(f"expected {want}, got {_short(got)}")
    return typing.cast(R, _read(kinds[name], data, name))


def dumps(rec: Any) -> str:
    """`encode` as JSON text."""
    return json.dumps(encode(rec), indent=2)


def loads(text: str | bytes, *expected: type[R]) -> R:
    """`decode` of JSON text; FleetRecordError when it is not JSON either."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise FleetRecordError(f"not JSON: {type(e).__name__}: {_short(str(e))}") from None
    return decode(data, *expected)


def save(path: Path, rec: Any) -> None:
    """Write a record to `path` atomically, mode 0600 from its creation (state files hold
    pids, paths and the control API's token)."""
    write_private(path, dumps(rec))


def load(path: Path, *expected: type[R]) -> R:
    """The record in the file `path`; OSError when it cannot be read, FleetRecordError naming
    the file when it is not one of `expected`."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    try:
        return loads(text, *expected)
    except FleetRecordError as e:
        raise FleetRecordError(f"{path}: {e}") from None


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` atomically, mode 0600 from its creation."""
    tmp = Path(path).with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)
    os.replace(tmp, path)


_HINTS: dict[type, dict[str, Any]] = {}


def hints(cls: type) -> dict[str, Any]:
    """Field name -> type of a record class (its dataclass fields, in order)."""
    if cls not in _HINTS:
        resolved = typing.get_type_hints(cls)
        _HINTS[cls] = {f.name: resolved[f.name] for f in dataclasses.fields(cls)}
    return _HINTS[cls]


def _read(cls: type, data: dict[str, Any], where: str) -> Any:
    fields = hints(cls)
    if "version" in fields:
        if "version" not in data:
            raise FleetRecordError(f"{where}.version: missing (this side reads version {VERSION})")
        v = data["version"]
        if type(v) is not int or v != VERSION:
            raise FleetRecordError(
                f"{where}.version: {_shown(v)}, but this side reads version {VERSION} "
                "(the fleet and its client must run the same release)"
            )
    allowed = set(fields) | ({"record"} if hasattr(cls, "RECORD") else set())
    unknown = sorted(_shown(k) if type(k) is not str else k for k in data if k not in allowed)
    if unknown:
        raise FleetRecordError(f"{where}: unknown field(s) {_short(', '.join(unknown))}")
    values = {}
    for name, hint in fields.items():
        if name not in data:
            raise FleetRecordError(f"{where}.{name}: missing")
        values[name] = _value(hint, data[name], f"{where}.{name}")
    try:
        return cls(**values)
    except FleetRecordError:
        raise
    except (TypeError, ValueError) as e:
        raise FleetRecordError(f"{where}: {e}") from None


def _value(hint: Any, v: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for alt in typing.get_args(hint):
            try:
                return _value(alt, v, where)
            except FleetRecordError:
                pass
        raise FleetRecordError(f"{where}: expected {type_name(hint)}, got {_what(v)}")
    if origin is Literal:
        if v in typing.get_args(hint) and type(v) in (str, int, bool):
            return v
        raise FleetRecordError(f"{where}: expected {type_name(hint)}, got {_what(v)}")
    if origin is tuple:
        if not isinstance(v, list):
            raise FleetRecordError(f"{where}: expected a list, got {_what(v)}")
        (item, _) = typing.get_args(hint)
        return tuple(_value(item, x, f"{where}[{i}]") for i, x in enumerate(v))
    if origin is dict:
        if not isinstance(v, dict):
            raise FleetRecordError(f"{where}: expected an object, got {_what(v)}")
        _, item = typing.get_args(hint)
        return {k: _value(item, x, f"{where}[{_shown(k)}]") for k, x in v.items()}
    if dataclasses.is_dataclass(hint):
        if not isinstance(v, dict):
            raise FleetRecordError(f"{where}: expected an object, got {_what(v)}")
        name = getattr(hint, "RECORD", None)
        if name is not None and v.get("record") != name:
            raise FleetRecordError(f"{where}: expected record {name!r}, got {_what(v)}")
        return _read(typing.cast(type, hint), v, where)
    if hint is type(None):
        if v is None:
            return None
    elif hint is bool:
        if type(v) is bool:
            return v
    elif hint is int:
        if type(v) is int:
            return v
    elif hint is float:
        if type(v) in (int, float):
            return v
    elif hint is str:
        if type(v) is str:
            return v
    else:  # a record whose field has a type the codec does not know: a bug here
        raise TypeError(f"{where}: no decoder for type {hint!r}")
    raise FleetRecordError(f"{where}: expected {type_name(hint)}, got {_what(v)}")


def type_name(hint: Any) -> str:
    """A type as the reference page and the errors write it (`tuple[VMEntry, ...]`)."""
    if hint is type(None):
        return "None"
    if isinstance(hint, type) and typing.get_origin(hint) is None:
        return hint.__name__
    text = str(hint).replace("typing.", "").replace("arpo_envs.fleet_records.", "")
    return text.replace("NoneType", "None")


def _what(v: Any) -> str:
    """A value as an error names it: its JSON type, and itself when it is a short scalar
    (never the repr of a nested value, which could be deep or large)."""
    kind = {dict: "an object", list: "a list", type(None): "null"}.get(type(v))
    if kind is not None:
        return kind
    if type(v) is int and abs(v) >= _SHOWN_INT:
        return _shown(v)
    return f"{type(v).__name__} {_shown(v)}"


_SHOWN_INT = 10**20
"""Ints from this size on are named by their length: `repr` refuses ints of more than
4300 digits (`sys.get_int_max_str_digits`)."""


def _shown(v: Any) -> str:
    """`repr(v)` cut to 80 characters, for an error message; the kind of `v` instead where
    its repr would be long, deep or fail (a huge int, a nested list, an object whose repr
    raises)."""
    if type(v) is int and abs(v) >= _SHOWN_INT:
        return f"an int of {int(math.log10(abs(v))) + 1} digits"
    if type(v) in (dict, list, tuple, set, frozenset):
        return {dict: "an object"}.get(type(v), f"a {type(v).__name__}")
    try:
        return _short(repr(v))
    except Exception:  # a repr that fails says nothing about the record
        return f"a {type(v).__name__}"


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."

"""Providers: what brings an environment back to a clean state before every episode.

OSWorld's `DesktopEnv.reset()` asks its VM provider to `revert_to_snapshot` before each
task, then runs the task's setup. An environment (`arpo.env.environment.Environment`) does
the same through one of these (`Environment.reset` calls `revert_to_snapshot(task_id)`,
then `TaskRunner.setup`):

| provider | environment | revert |
|---|---|---|
| `DesktopProvider` | the local desktop, the simulated desktop | `POST /reset` (apps killed, home rebuilt; the scene cleared) |
| `FleetVMProvider` | a VM of the project's fleet (`arpo-envs vm up`) | the fleet's `loadvm` of the snapshot taken when the desktop first answered |
| `StaticProvider` | a server started elsewhere (an OSWorld VM you run yourself) | nothing: logged once, since scores then depend on the episodes before |

The interface (start, revert_to_snapshot, health, report, stop) follows OSWorld's provider
methods where they match. A revert that fails raises `EnvError` with the reason: the
episode is `env_error`, never a failure of the agent. Whatever an environment or the
fleet's control API answers, a provider call raises nothing but `EnvError` (`health`
returns a `Health`; `TaskQuarantined` is the fleet's explicit verdict on a task): answers
are bounded in size (`CONTROL_MAX_BYTES`) and time, and one that is not the record expected
is the environment's failure. A refused token (`EnvAuthError`) is final. `report` tells the
fleet how the task's setup went, so it can tell a broken task (quarantined) from a broken VM
(replaced).

The fleet's control API speaks the typed, versioned records of `arpo_envs.fleet_records`
(its bodies and answers, and the state file `fleet.json` that `FleetLink` reads), encoded
and checked by that module's `encode` / `decode` on both sides: an answer that is not the
record expected (another version, a field missing or of the wrong type) is an
`EnvProtocolError` naming the field. A quarantined task is a `Quarantined` answer, raised
here as `TaskQuarantined`, the one class of it, defined by `arpo_envs.fleet_records` and
re-exported here.

Fork (group rollouts from one mid-task state, `arpo.actor.tree`): `snapshot()` saves the
environment's current state and returns a handle; `fork(handle, n)` gives `n` new
environments (`Clone`: a URL of their own, served like any environment) in exactly that
state; `release(handle)` ends the clones and frees the saved state. `can_fork` says
whether to try; a provider that cannot fork raises `ForkUnsupported` (an `EnvError`), and
any other failure of the three is an `EnvError` with its reason.

| provider | fork |
|---|---|
| `DesktopProvider` | the simulated desktop copies its scene into `n` child servers (`POST /snapshot`, `/fork`, `/release`); the local desktop answers 501: `ForkUnsupported` |
| `FleetVMProvider` | the fleet saves the VM's state and starts `n` VMs from it on copy-on-write overlays (control API `/vms/<name>/snapshot`, `/snapshots/<id>/fork`, `DELETE /snapshots/<id>`) |
| `StaticProvider` | `ForkUnsupported` |

    provider = make_provider("http://127.0.0.1:5301", fleet="/tmp/arpo-vm-fleet-0/fleet.json")
    await provider.revert_to_snapshot("task-id")
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError
from arpo_envs.fleet_records import (
    Failure,
    FleetRecordError,
    Forked,
    ForkRequest,
    Quarantined,
    Released,
    Reported,
    ReportRequest,
    Reverted,
    RevertRequest,
    SnapshotRequest,
    SnapshotTaken,
    VMEntry,
    VMFleetState,
    VMHealth,
    VMReport,
    decode,
    encode,
    load,
)
from arpo_envs.fleet_records import TaskQuarantined as TaskQuarantined  # the one class of it

from arpo.env.client import (
    EnvAuthError,
    EnvClient,
    EnvHTTPError,
    EnvProtocolError,
    brief,
    one_line,
    read_limited,
)
from arpo.errors import EnvError, EnvTimeout, ForkUnsupported

log = logging.getLogger("arpo.env.provider")

CONTROL_MAX_BYTES = 1 << 20
"""Largest answer read from a fleet's control API (1 MiB): its answers are small JSON
objects (`GET /fleet` of a hundred VMs is tens of KB)."""


@dataclass(frozen=True, slots=True)
class Health:
    ok: bool
    reason: str = ""
    retry_s: float = 0.0
    """When not ok: how long to wait before asking again (a VM being replaced)."""
    final: bool = False
    """When not ok: it will not serve again (the fleet gave the VM up); stop asking."""


@dataclass(frozen=True, slots=True)
class Clone:
    """One environment started from a snapshot (`Provider.fork`)."""

    url: str
    """Its server's base URL (the OSWorld protocol, like its parent's)."""
    name: str
    """Its name at the provider (logs; a VM clone's fleet name)."""
    token: str | None = None
    """Bearer token of its server (None: its parent's)."""
    ports: dict[str, int] | None = None
    """A VM clone's host ports of Chrome's debugging port and VLC ("chromium_port",
    "vlc_port"), for OSWorld's getters."""


class Provider(Protocol):
    kind: str
    needs_probe: bool
    """Whether the runner asks the server for `GET /platform` before OSWorld's setup (a
    desktop whose `/reset` just answered needs no such check)."""
    osworld_ports: dict[str, int]
    """Host ports of the environment's Chrome debugging port and VLC web interface for
    OSWorld's getters ("chromium_port", "vlc_port"); empty: OSWorld's defaults."""

    async def start(self) -> None: ...

    async def revert_to_snapshot(self, task_id: str = "") -> None: ...

    async def health(self) -> Health: ...

    async def report(self, task_id: str, ok: bool, error: str = "") -> None: ...

    async def stop(self) -> None: ...

    async def instance(self) -> str:
        """Which machine serves now: a string that changes whenever the environment is
        replaced by another (a fleet VM's new QEMU); '' when the provider cannot tell.
        EnvError when it cannot be asked."""
        ...

    can_fork: bool

    async def snapshot(self) -> str: ...

    async def fork(self, handle: str, n: int) -> list[Clone]: ...

    async def release(self, handle: str) -> None: ...

    def for_clone(self, client: EnvClient, clone: Clone) -> Provider: ...


class StaticProvider:
    """A server someone else started and reverts (or nobody does: logged once)."""

    kind = "static"
    needs_probe = True

    def __init__(self, client: EnvClient, *, warn: bool = True):
        self.client = client
        self.osworld_ports: dict[str, int] = {}
        self._warned = not warn

    async def start(self) -> None:
        return None

    async def revert_to_snapshot(self, task_id: str = "") -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "%s: nothing reverts this environment between episodes (a server started "
                "elsewhere); each episode starts where the last one ended. Use the VM fleet "
                "(arpo-envs vm up; the actor's vm_fleet) to get OSWorld's snapshot reverts",
                self.client.config.base_url,
            )

    async def health(self) -> Health:
        try:
            await self.client.platform(timeout=10.0)
        except EnvAuthError as e:
            return Health(False, str(e), final=True)
        except EnvError as e:
            return Health(False, str(e), retry_s=5.0)
        return Health(True)

    async def report(self, task_id: str, ok: bool, error: str = "") -> None:
        return None

    async def stop(self) -> None:
        return None

    async def instance(self) -> str:
        """'': a server started elsewhere, or a desktop, is not replaced behind the
        actor's back (a desktop that restarts loses its connections, and the episode's next
        request fails)."""
        return ""

    can_fork = False

    async def snapshot(self) -> str:
        raise ForkUnsupported(
            f"{self.client.config.base_url}: a server started elsewhere cannot be forked"
        )

    async def fork(self, handle: str, n: int) -> list[Clone]:
        raise ForkUnsupported(f"{self.client.config.base_url}: cannot fork")

    async def release(self, handle: str) -> None:
        return None

    def for_clone(self, client: EnvClient, clone: Clone) -> StaticProvider:
        raise ForkUnsupported(f"{self.client.config.base_url}: has no clones")


class DesktopProvider(StaticProvider):
    """The local or simulated desktop: `POST /reset` is the revert."""

    kind = "desktop"
    needs_probe = False
    """Its `/reset` answered right before the setup."""

    def __init__(self, client: EnvClient):
        super().__init__(client, warn=False)

    async def revert_to_snapshot(self, task_id: str = "") -> None:
        await self.client.reset()

    can_fork = True
    """Tried; the local desktop answers 404 or 501 and the first try says so for good."""

    async def _fork_call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One call of the desktop's fork protocol: a JSON object with status "success";
        ForkUnsupported when the server has no such endpoint (404 / 501)."""
        try:
            data = await self.client._request(
                "POST", path, json_body=body, timeout=60.0, expect="json"
            )
        except EnvHTTPError as e:
            if e.status in (404, 405, 501):
                self.can_fork = False
                raise ForkUnsupported(
                    f"{self.client.config.base_url} cannot fork (POST {path} -> HTTP "
                    f"{e.status}): the local desktop has no snapshot of its running apps"
                ) from e
            raise
        if not isinstance(data, dict) or data.get("status") != "success":
            raise EnvProtocolError(
                f"{self.client.config.base_url}: POST {path} answered {brief(data)}, not "
                "status 'success'"
            )
        return data

    async def snapshot(self) -> str:
        data = await self._fork_call("/snapshot", {})
        handle = data.get("handle")
        if not isinstance(handle, str) or not 0 < len(handle) <= 128:
            raise EnvProtocolError(f"POST /snapshot answered no handle: {brief(data)}")
        return handle

    async def fork(self, handle: str, n: int) -> list[Clone]:
        data = await self._fork_call("/fork", {"handle": handle, "n": n})
        clones = data.get("clones")
        if not isinstance(clones, list) or len(clones) != n:
            raise EnvProtocolError(f"POST /fork of {n} answered {brief(data)}")
        out = []
        for c in clones:
            if not (isinstance(c, dict) and isinstance(c.get("url"), str)
                    and isinstance(c.get("name"), str)):  # fmt: skip
                raise EnvProtocolError(f"POST /fork: a clone is not {{url, name}}: {brief(c)}")
            out.append(Clone(url=c["url"], name=c["name"], token=self.client.config.token))
        return out

    async def release(self, handle: str) -> None:
        await self._fork_call("/release", {"handle": handle})

    def for_clone(self, client: EnvClient, clone: Clone) -> DesktopProvider:
        """The provider of a clone of this desktop (it forks like its parent)."""
        return DesktopProvider(client)


@dataclass(frozen=True, slots=True)
class FleetLink:
    """How to reach a fleet's control API, and its VMs (from its state file)."""

    control: str
    token: str
    vms: tuple[VMEntry, ...] = ()
    """The VMs the state file lists (name, url, ports)."""

    @classmethod
    def from_state(cls, path: str | Path) -> FleetLink:
        """Read `<dir>/fleet.json` of `arpo-envs vm up` (a `VMFleetState` record); ValueError
        if it is not one, or if the fleet is still starting its VMs."""
        try:
            st = load(Path(path), VMFleetState)
        except (OSError, FleetRecordError) as e:
            raise ValueError(
                f"{path}: not a fleet state file ({e}); start one with `arpo-envs vm up` and "
                "give its <dir>/fleet.json"
            ) from e
        if not st.ready:
            raise ValueError(f"{path}: the fleet is not ready yet (still starting its VMs)")
        return cls(st.control, st.token, st.vms)

    def vm(self, name: str) -> VMEntry | None:
        """The VM of that name, None if the state file lists none."""
        return next((v for v in self.vms if v.name == name), None)


class FleetVMProvider:
    """A VM of the project's fleet, reverted by snapshot through the fleet's control API.

    It forks through the fleet too: `snapshot` saves the VM's state (the VM goes on), `fork`
    starts clones of it (fleet members of their own, on their own ports; a clone's provider
    is `for_clone`'s, and a clone can be snapshotted and forked again, but not reverted),
    `release` kills them and frees the saved state."""

    kind = "vm"
    needs_probe = True

    def __init__(
        self,
        client: EnvClient,
        link: FleetLink,
        name: str,
        timeout_s: float = 180.0,
        ports: dict[str, int] | None = None,
    ):
        """`ports`: host ports of the VM's Chrome debugging port and VLC web interface
        ("chromium_port", "vlc_port", as in the fleet's state file), for OSWorld's getters."""
        self.client = client
        self.link = link
        self.name = name
        self.osworld_ports = dict(ports or {})
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {self.link.token}"}
            )
        return self._session

    async def _call(self, method: str, path: str, body: Any, *answers: type) -> tuple[int, Any]:
        """(HTTP status, answer) of one control API call with the record `body` (None: no
        body). The answer is one of the records `answers`, or a `Failure`: any error answer
        (an HTTP status but 200) that is no record becomes a `Failure` with its text. At
        most CONTROL_MAX_BYTES within `timeout_s`. EnvAuthError when the fleet refuses the
        token, EnvProtocolError for a 200 answer that is not one of `answers`, EnvError for
        anything else that goes wrong; no other exception."""
        url = f"{self.link.control}{path}"
        try:
            async with (
                asyncio.timeout(self.timeout_s + 1.0),
                self._http().request(
                    method, url, json=None if body is None else encode(body),
                    timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                ) as r,
            ):  # fmt: skip
                status = r.status
                raw = await read_limited(r, CONTROL_MAX_BYTES, f"VM fleet {method} {path}")
        except TimeoutError as e:
            raise EnvTimeout(f"VM fleet at {url}: no answer within {self.timeout_s} s") from e
        except EnvError:
            raise
        except (aiohttp.ClientError, HttpProcessingError, OSError) as e:
            raise EnvError(
                f"VM fleet at {self.link.control} unreachable or its answer is not HTTP "
                f"({type(e).__name__}: {one_line(str(e))})"
            ) from e
        try:
            data: Any = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            if status == 200:
                raise EnvProtocolError(
                    f"VM fleet {method} {path}: the answer is not JSON ({type(e).__name__})"
                ) from None
            data = {"error": one_line(raw[:300].decode("utf-8", "replace"))}
        try:
            answer = decode(data, *answers, Failure)
        except FleetRecordError as e:
            if status == 200:
                raise EnvProtocolError(
                    f"VM fleet {method} {path}: the answer is not a record expected: {e}"
                ) from None
            said = data.get("error") if isinstance(data, dict) else None
            answer = Failure(said if isinstance(said, str) else brief(data))
        if status in (401, 403):
            raise EnvAuthError(
                f"VM fleet at {self.link.control} refuses its token (HTTP {status}): the "
                "token of the fleet's state file is wrong or stale",
                status=status,
                body=brief(getattr(answer, "error", ""), 500),
            )
        if status == 200 and isinstance(answer, Failure):
            raise EnvProtocolError(
                f"VM fleet {method} {path}: status 200 with a failure: {brief(answer.error, 500)}"
            )
        if status != 200 and not isinstance(answer, Failure | Quarantined):
            answer = Failure(f"HTTP {status} with a {answer.RECORD} answer")
        return status, answer

    @staticmethod
    def _request(cls: type, **fields: Any) -> Any:
        """The request record; EnvError when a field is out of its range (a task id longer
        than the fleet takes, a fork of too many clones)."""
        try:
            return cls(**fields)
        except FleetRecordError as e:
            raise EnvError(f"VM fleet: {e}") from None

    async def start(self) -> None:
        return None

    async def revert_to_snapshot(self, task_id: str = "") -> None:
        request = self._request(RevertRequest, task_id=task_id)
        status, answer = await self._call(
            "POST", f"/vms/{self.name}/revert", request, Reverted, Quarantined
        )
        if isinstance(answer, Quarantined):
            raise answer.error()
        if isinstance(answer, Failure):
            raise EnvError(f"VM {self.name}: revert failed ({status}): {brief(answer.error, 500)}")
        # The guest's TCP state is the snapshot's now: connections kept alive before are dead.
        await self.client.close()

    async def health(self) -> Health:
        try:
            _, answer = await self._call("GET", f"/vms/{self.name}/health", None, VMHealth)
        except EnvAuthError as e:
            return Health(False, str(e), final=True)
        except EnvError as e:
            return Health(False, str(e), retry_s=5.0)
        if isinstance(answer, VMHealth) and answer.ok:
            return Health(True)
        state = brief(answer.state or "?", 40)
        reason = brief(answer.error, 500)
        return Health(False, f"{state}: {reason}", retry_s=2.0, final=state == "failed")

    async def report(self, task_id: str, ok: bool, error: str = "") -> None:
        try:
            request = self._request(ReportRequest, task_id=task_id, ok=ok, error=error)
            await self._call("POST", f"/vms/{self.name}/report", request, Reported)
        except EnvError as e:
            log.warning("VM %s: could not report the setup of %s: %s", self.name, task_id, e)

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def instance(self) -> str:
        """The VM's QEMU process and replacement count (`GET /vms/<name>`, its line of the
        fleet's report): the fleet replaces a VM whose QEMU exited or whose guest stopped
        answering by a new one started from the golden snapshot, on the same URL, so a
        request in flight can land on the replacement; 'gone' when the fleet no longer has
        it (404)."""
        status, answer = await self._call("GET", f"/vms/{self.name}", None, VMReport)
        if status == 404:
            return "gone"
        if isinstance(answer, Failure):
            raise EnvError(f"VM fleet: GET /vms/{self.name} failed: {brief(answer.error, 500)}")
        return f"QEMU pid {answer.vm.qemu_pid}, replacement {answer.vm.replacements}"

    can_fork = True

    async def snapshot(self) -> str:
        status, answer = await self._call(
            "POST", f"/vms/{self.name}/snapshot", SnapshotRequest(), SnapshotTaken
        )
        if isinstance(answer, Failure):
            raise EnvError(
                f"VM {self.name}: snapshot failed ({status}): {brief(answer.error, 500)}"
            )
        if not 0 < len(answer.snapshot) <= 128:
            raise EnvProtocolError(
                f"VM {self.name}: the fleet answered the snapshot with "
                f"{brief(answer.snapshot)}: not a snapshot id"
            )
        return str(answer.snapshot)

    async def fork(self, handle: str, n: int) -> list[Clone]:
        request = self._request(ForkRequest, n=n)
        status, answer = await self._call(
            "POST", f"{self._snapshot_path(handle)}/fork", request, Forked
        )
        if isinstance(answer, Failure):
            raise EnvError(
                f"VM {self.name}: fork of {n} from snapshot {handle!r} failed ({status}): "
                f"{brief(answer.error, 500)}"
            )
        if len(answer.clones) != n:
            raise EnvProtocolError(
                f"VM {self.name}: the fleet answered a fork of {n} from {handle!r} with "
                f"{len(answer.clones)} clones"
            )
        return [Clone(c.url, c.name, token=self.client.config.token, ports=c.osworld_ports)
                for c in answer.clones]  # fmt: skip

    async def release(self, handle: str) -> None:
        status, answer = await self._call("DELETE", self._snapshot_path(handle), None, Released)
        if isinstance(answer, Failure):
            raise EnvError(
                f"VM {self.name}: release of snapshot {handle!r} failed ({status}): "
                f"{brief(answer.error, 500)}"
            )

    @staticmethod
    def _snapshot_path(handle: str) -> str:
        from urllib.parse import quote

        return f"/snapshots/{quote(handle, safe='')}"

    def for_clone(self, client: EnvClient, clone: Clone) -> FleetVMProvider:
        """The provider of a clone of this VM: the same fleet, the clone's name and ports."""
        return FleetVMProvider(client, self.link, clone.name, self.timeout_s, ports=clone.ports)

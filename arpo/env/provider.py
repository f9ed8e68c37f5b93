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
are bounded in size (`CONTROL_MAX_BYTES`) and time, and one that is not the JSON expected
is the environment's failure. A refused token (`EnvAuthError`) is final. `report` tells the fleet how the
task's setup went, so it can tell a broken task (quarantined) from a broken VM (replaced).

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

from arpo.env.client import (
    EnvAuthError,
    EnvClient,
    EnvHTTPError,
    EnvProtocolError,
    brief,
    one_line,
    read_limited,
)
from arpo.errors import EnvError, EnvTimeout, ForkUnsupported, TaskError

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


class TaskQuarantined(TaskError):
    """The fleet quarantined this task (its setup failed on several VMs); not the agent's fault."""


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
    vms: tuple[dict[str, Any], ...] = ()
    """The VMs the state file lists: name, url, port, chromium_port, vlc_port."""

    @classmethod
    def from_state(cls, path: str | Path) -> FleetLink:
        """Read `<dir>/fleet.json` of `arpo-envs vm up`; ValueError if it is not one, or if the
        fleet is still starting its VMs."""
        try:
            st = json.loads(Path(path).read_text())
            link = cls(str(st["control"]), str(st["token"]), tuple(st["vms"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"{path}: not a fleet state file ({e}); start one with `arpo-envs vm up` and "
                "give its <dir>/fleet.json"
            ) from e
        if not st.get("ready"):
            raise ValueError(f"{path}: the fleet is not ready yet (still starting its VMs)")
        return link


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

    async def _call(self, method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
        """(status, answer) of one control API call. The answer is a JSON object (an error
        answer that is not one becomes {"error": <its text>}); at most CONTROL_MAX_BYTES
        within `timeout_s`. EnvAuthError when the fleet refuses the token, EnvError for
        anything else that goes wrong; no other exception."""
        url = f"{self.link.control}{path}"
        try:
            async with (
                asyncio.timeout(self.timeout_s + 1.0),
                self._http().request(
                    method, url, json=body, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
                ) as r,
            ):
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
        if not isinstance(data, dict):
            if status == 200:
                raise EnvProtocolError(
                    f"VM fleet {method} {path}: the answer is not a JSON object: {brief(data)}"
                )
            data = {"error": brief(data)}
        if status in (401, 403):
            raise EnvAuthError(
                f"VM fleet at {self.link.control} refuses its token (HTTP {status}): the "
                "token of the fleet's state file is wrong or stale",
                status=status,
                body=brief(data.get("error", ""), 500),
            )
        return status, data

    async def start(self) -> None:
        return None

    async def revert_to_snapshot(self, task_id: str = "") -> None:
        status, data = await self._call("POST", f"/vms/{self.name}/revert", {"task_id": task_id})
        err = brief(data.get("error", ""), 500)
        if status == 409 and data.get("quarantined") is True:
            raise TaskQuarantined(f"task {task_id}: {err}")
        if status != 200:
            raise EnvError(f"VM {self.name}: revert failed ({status}): {err}")
        if data.get("status") != "ok":
            raise EnvProtocolError(
                f"VM {self.name}: the fleet answered the revert with {brief(data)}, not status 'ok'"
            )
        # The guest's TCP state is the snapshot's now: connections kept alive before are dead.
        await self.client.close()

    async def health(self) -> Health:
        try:
            status, data = await self._call("GET", f"/vms/{self.name}/health")
        except EnvAuthError as e:
            return Health(False, str(e), final=True)
        except EnvError as e:
            return Health(False, str(e), retry_s=5.0)
        if status == 200 and data.get("ok") is True:
            return Health(True)
        reason = brief(data.get("error", ""), 500)
        state = brief(data.get("state", "?"), 40)
        return Health(False, f"{state}: {reason}", retry_s=2.0, final=state == "failed")

    async def report(self, task_id: str, ok: bool, error: str = "") -> None:
        try:
            await self._call(
                "POST", f"/vms/{self.name}/report", {"task_id": task_id, "ok": ok, "error": error}
            )
        except EnvError as e:
            log.warning("VM %s: could not report the setup of %s: %s", self.name, task_id, e)

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    can_fork = True

    async def snapshot(self) -> str:
        status, data = await self._call("POST", f"/vms/{self.name}/snapshot", {})
        if status != 200:
            raise EnvError(
                f"VM {self.name}: snapshot failed ({status}): {brief(data.get('error', ''), 500)}"
            )
        sid = data.get("snapshot")
        if data.get("status") != "ok" or not isinstance(sid, str) or not 0 < len(sid) <= 128:
            raise EnvProtocolError(
                f"VM {self.name}: the fleet answered the snapshot with {brief(data)}, not "
                "status 'ok' and a snapshot id"
            )
        return sid

    async def fork(self, handle: str, n: int) -> list[Clone]:
        status, data = await self._call("POST", f"{self._snapshot_path(handle)}/fork", {"n": n})
        if status != 200:
            raise EnvError(
                f"VM {self.name}: fork of {n} from snapshot {handle!r} failed ({status}): "
                f"{brief(data.get('error', ''), 500)}"
            )
        clones = data.get("clones")
        if data.get("status") != "ok" or not isinstance(clones, list) or len(clones) != n:
            raise EnvProtocolError(
                f"VM {self.name}: the fleet answered a fork of {n} from {handle!r} with "
                f"{brief(data)}"
            )
        out = []
        for c in clones:
            d: dict[str, Any] = c if isinstance(c, dict) else {}
            ports = {k: d.get(k) for k in ("chromium_port", "vlc_port")}
            if not (isinstance(d.get("url"), str) and isinstance(d.get("name"), str)
                    and all(isinstance(p, int) for p in ports.values())):  # fmt: skip
                raise EnvProtocolError(
                    f"VM {self.name}: a clone of the fork of {handle!r} is not {{name, url, "
                    f"chromium_port, vlc_port}}: {brief(c)}"
                )
            out.append(Clone(d["url"], d["name"], token=self.client.config.token, ports=ports))
        return out

    async def release(self, handle: str) -> None:
        status, data = await self._call("DELETE", self._snapshot_path(handle))
        if status != 200:
            raise EnvError(
                f"VM {self.name}: release of snapshot {handle!r} failed ({status}): "
                f"{brief(data.get('error', ''), 500)}"
            )

    @staticmethod
    def _snapshot_path(handle: str) -> str:
        from urllib.parse import quote

        return f"/snapshots/{quote(handle, safe='')}"

    def for_clone(self, client: EnvClient, clone: Clone) -> FleetVMProvider:
        """The provider of a clone of this VM: the same fleet, the clone's name and ports."""
        return FleetVMProvider(client, self.link, clone.name, self.timeout_s, ports=clone.ports)

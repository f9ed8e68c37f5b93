"""Providers: what brings an environment back to a clean state before every episode.

OSWorld's `DesktopEnv.reset()` asks its VM provider to `revert_to_snapshot` before each
task, then runs the task's setup. The task runner does the same through one of these
(`TaskRunner.setup` calls `revert_to_snapshot(task_id)` first):

| provider | environment | revert |
|---|---|---|
| `DesktopProvider` | the local desktop, the simulated desktop | `POST /reset` (apps killed, home rebuilt; the scene cleared) |
| `FleetVMProvider` | a VM of the project's fleet (`arpo-envs vm up`) | the fleet's `loadvm` of the snapshot taken when the desktop first answered |
| `StaticProvider` | a server started elsewhere (an OSWorld VM you run yourself) | nothing: logged once, since scores then depend on the episodes before |

The interface (start, revert_to_snapshot, health, report, stop) follows OSWorld's provider
methods where they match. A revert that fails raises `EnvError` with the reason: the
episode is `env_error`, never a failure of the agent. `report` tells the fleet how the
task's setup went, so it can tell a broken task (quarantined) from a broken VM (replaced).
A future `fork(n)` (several environments started from one running state) fits here.

    provider = make_provider("http://127.0.0.1:5301", fleet="/tmp/arpo-vm-fleet-0/fleet.json")
    await provider.revert_to_snapshot("task-id")
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from arpo.env.client import EnvClient
from arpo.errors import EnvError, TaskError

log = logging.getLogger("arpo.env.provider")


@dataclass(frozen=True, slots=True)
class Health:
    ok: bool
    reason: str = ""
    retry_s: float = 0.0
    """When not ok: how long to wait before asking again (a VM being replaced)."""
    final: bool = False
    """When not ok: it will not serve again (the fleet gave the VM up); stop asking."""


class TaskQuarantined(TaskError):
    """The fleet quarantined this task (its setup failed on several VMs); not the agent's fault."""


class Provider(Protocol):
    kind: str

    async def start(self) -> None: ...

    async def revert_to_snapshot(self, task_id: str = "") -> None: ...

    async def health(self) -> Health: ...

    async def report(self, task_id: str, ok: bool, error: str = "") -> None: ...

    async def stop(self) -> None: ...


class StaticProvider:
    """A server someone else started and reverts (or nobody does: logged once)."""

    kind = "static"

    def __init__(self, client: EnvClient, *, warn: bool = True):
        self.client = client
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
        except EnvError as e:
            return Health(False, str(e), retry_s=5.0)
        return Health(True)

    async def report(self, task_id: str, ok: bool, error: str = "") -> None:
        return None

    async def stop(self) -> None:
        return None


class DesktopProvider(StaticProvider):
    """The local or simulated desktop: `POST /reset` is the revert."""

    kind = "desktop"

    def __init__(self, client: EnvClient):
        super().__init__(client, warn=False)

    async def revert_to_snapshot(self, task_id: str = "") -> None:
        await self.client.reset()


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
    """A VM of the project's fleet, reverted by snapshot through the fleet's control API."""

    kind = "vm"

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

    async def _call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        try:
            async with self._http().request(
                method,
                f"{self.link.control}{path}",
                json=body,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            ) as r:
                try:
                    data = await r.json(content_type=None)
                except (ValueError, aiohttp.ContentTypeError):
                    data = {"error": (await r.text())[:300]}
                return r.status, data
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise EnvError(f"VM fleet at {self.link.control} unreachable: {e}") from e

    async def start(self) -> None:
        return None

    async def revert_to_snapshot(self, task_id: str = "") -> None:
        status, data = await self._call("POST", f"/vms/{self.name}/revert", {"task_id": task_id})
        err = data.get("error") if isinstance(data, dict) else str(data)
        if status == 409:
            raise TaskQuarantined(f"task {task_id}: {err}")
        if status != 200:
            raise EnvError(f"VM {self.name}: revert failed ({status}): {err}")
        # The guest's TCP state is the snapshot's now: connections kept alive before are dead.
        await self.client.close()

    async def health(self) -> Health:
        try:
            status, data = await self._call("GET", f"/vms/{self.name}/health")
        except EnvError as e:
            return Health(False, str(e), retry_s=5.0)
        if status == 200 and isinstance(data, dict) and data.get("ok"):
            return Health(True)
        reason = data.get("error", "") if isinstance(data, dict) else str(data)
        state = data.get("state", "?") if isinstance(data, dict) else "?"
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

"""The one interface of both kinds of fleet: N local desktops and N QEMU VMs.

    from arpo_envs.desktop import fleet          # or: from arpo_envs.vm import fleet
    handle = fleet.up(fleet.FleetConfig(n=2))    # returns once every environment answers
    urls = [e.url for e in handle.envs]
    print(handle.status().running)               # a FleetStatus record
    handle.down()                                # or fleet.down(config.state_file), any shell

Both modules, `arpo_envs.desktop.fleet` (one server process per desktop under Xvfb) and
`arpo_envs.vm.fleet` (one fleet process owning every QEMU, with a control API), have the
same verbs with the same shapes:

| verb | does | returns |
|---|---|---|
| `up(config, announce=print)` | starts the fleet; returns once every environment answers, stops what it started on any failure (also Ctrl-C) | its `FleetHandle` (`DesktopFleet` / `VMFleet`) |
| `status(state_file=None)` | from any shell | a `FleetStatus` record |
| `down(state_file=None, grace_s=..., announce=print)` | stops everything the state file names (also after the fleet was SIGKILLed) and removes its files | what was done, one line each (each also announced) |
| `read_state(state_file)` | the state file's record | `DesktopFleetState` / `VMFleetState`, None without one |

`state_file=None` is the kind's default (`$ARPO_DESKTOP_STATE` or a file in /tmp; a VM
fleet's `<$ARPO_VM_FLEET_DIR or /tmp/arpo-vm-fleet-<uid>>/fleet.json`). `config.state_file`
is known before `up` is called, so a caller can always `down` what an `up` that failed or
was interrupted left behind. State files are records of `arpo_envs.fleet_records`.
"""

from __future__ import annotations

import sys
from abc import ABC
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from arpo_envs.fleet_records import FleetStatus


@dataclass(frozen=True, slots=True)
class FleetEnv:
    """One environment of a fleet, as a client reaches it."""

    name: str
    """`desktop-<i>`, or the VM's name in the fleet's control API (`vm-<i>`)."""
    url: str
    """Base URL of its server (the OSWorld VM protocol)."""
    token: str = ""
    """Its own bearer token ('' = none: the VMs, desktops started without tokens). In memory
    only: no state file holds it."""
    pid: int = 0
    """Pid of its server (a desktop) or its QEMU (a VM)."""
    ports: dict[str, int] = field(default_factory=dict)
    """Host ports OSWorld's getters need ("chromium_port", "vlc_port"; empty: a desktop)."""


@dataclass(frozen=True, slots=True)
class FleetHandle(ABC):
    """A running fleet, as `up` returns it: its state file and its environments."""

    kind: ClassVar[str]
    """desktop | vm."""
    state_file: Path
    """Its state file (`status` and `down` from any shell read it)."""
    envs: tuple[FleetEnv, ...]
    """Its environments, in order."""

    def _kind_module(self) -> ModuleType:
        """The module of the handle's kind: its `status`, `down` and `GRACE_S` are the verbs."""
        return sys.modules[type(self).__module__]

    def status(self) -> FleetStatus:
        """The fleet's `FleetStatus` now (the kind's `status(state_file)`)."""
        return self._kind_module().status(self.state_file)  # type: ignore[no-any-return]

    def down(
        self, grace_s: float | None = None, announce: Callable[[str], Any] = print
    ) -> list[str]:
        """Stop the fleet (the kind's `down`; `grace_s` before SIGKILL, None: its GRACE_S)."""
        kind = self._kind_module()
        grace = kind.GRACE_S if grace_s is None else grace_s
        return kind.down(self.state_file, grace, announce)  # type: ignore[no-any-return]

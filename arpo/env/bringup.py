"""The environments a command brings up on this machine or is given, and their bring-up.

    cfg = EnvironmentsConfig(local_desktops=2, env_urls=["http://10.0.0.5:5000"])
    with Bringup(folder) as envs:
        desktops = envs.start_desktops(cfg.local_desktops)       # [EnvSpec], own tokens
        fleet = envs.start_vms(cfg.vms, folder / "vms")          # a fleet's state file
        given = cfg.url_specs(provider="static")                 # the env_urls servers
    # every desktop and VM started here is stopped, also on an error or Ctrl-C

`EnvironmentsConfig` is the one environments section of `arpo train` and `arpo audit-tasks`
(both configs are it plus their own fields): the local desktops and VMs to start, a VM fleet
started elsewhere, and environment servers given by URL, each with the task pool it serves.
`Bringup` starts the desktops (`arpo_envs.desktop.fleet`) and the VM fleet
(`arpo_envs.vm.fleet`) and stops them; `EnvSpec` is one environment server as the task
audit (and `arpo train`'s preflight, which is that audit) drives it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Literal

from arpo.config import fail, option, url_problem
from arpo.env.client import EnvClient
from arpo.env.environment import Environment, EnvironmentConfig
from arpo.env.osworld.client import OSWorldEvaluator
from arpo.env.provider import FleetLink, FleetVMProvider, StaticProvider
from arpo.env.runner import DESKTOP_ACTION_PAUSE_S, RunnerConfig
from arpo.env.taskfiles import FileSource
from arpo.errors import ArpoError

log = logging.getLogger("arpo.env.bringup")

DESKTOP_POOL = "desktop"
"""The task pool of the local desktops started here (`local_desktops`)."""
MAX_LOCAL_ENVS = 64
"""Most local desktops, and most VMs, one command starts on this machine."""
MAX_TOKEN_CHARS = 4096
"""Longest bearer token accepted (`arpo-envs up --tokens` makes 43 characters)."""


def token_problem(token: str) -> str | None:
    """Why `token` cannot be a bearer token in an HTTP header, or None ('' is no token)."""
    if len(token) > MAX_TOKEN_CHARS:
        return f"is {len(token)} characters; a bearer token has at most {MAX_TOKEN_CHARS}"
    if any(c.isspace() or not c.isprintable() or not c.isascii() for c in token):
        return "holds a space, a control or a non-ASCII character: not an HTTP bearer token"
    return None


def fleet_problem(path: str) -> str | None:
    """Why `path` is not a VM fleet's state file (`arpo-envs vm up`: <dir>/fleet.json), or
    None: a regular JSON file holding a `VMFleetState` record of `arpo_envs.fleet_records`
    (the fleet's control URL, token and VMs)."""
    from arpo_envs.fleet_records import FleetRecordError, VMFleetState, decode

    fix = "`arpo-envs vm up` writes <dir>/fleet.json (default /tmp/arpo-vm-fleet-<uid>/fleet.json)"
    p = Path(path)
    if not p.is_file():
        return f"{path!r} is not a file; {fix}"
    if p.stat().st_size > 1 << 20:
        return f"{path!r} is larger than 1 MiB: not a fleet state file; {fix}"
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        return f"{path!r} is not a fleet state file (not JSON: {e}); {fix}"
    try:
        st = decode(data, VMFleetState)
    except FleetRecordError as e:
        return f"{path!r} is not a fleet state file ({e}); {fix}"
    if (why := url_problem(st.control)) is not None:
        return f"{path!r} is not a fleet state file (control: {why}); {fix}"
    return None


def memory_total() -> int:
    """Bytes of memory of this machine (MemTotal)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# ---------------------------------------------------------------------------- the config


@dataclass
class EnvironmentsConfig:
    """The environments section shared by `arpo train` and `arpo audit-tasks`: what is
    started on this machine (stopped at the end, also on an error or a signal) and what
    runs elsewhere, each serving the tasks of one pool."""

    renamed_fields: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"env_urls_pool": "env_pool"}  # `arpo train`'s earlier name of the same field
    )

    local_desktops: int = option(
        0,
        "Real local desktops (Xvfb + openbox + apps, `arpo-envs up --tokens`, each with its "
        "own bearer token) started for the tasks of pool 'desktop'. `arpo train` drives them "
        "with one more actor, and with an observation type that shows a table they serve "
        "their apps' AT-SPI trees (`arpo-envs up --atspi`). With `arpo train cluster."
        "address`: the most on each node offering cluster.desktop_resource (none here).",
    )
    vms: int = option(
        0,
        "VMs of the project's test image (`arpo-envs vm up`; `arpo train`: in <run_dir>/vms, "
        "`arpo audit-tasks`: in a temporary folder) started for the tasks of vm_pool, each "
        "reverted to its snapshot before every episode or setup and replaced when it dies. "
        "With `arpo train cluster.address`: the most on each node offering "
        "cluster.vm_resource (none here).",
    )
    vm_fleet: str = option(
        "",
        "State file of a VM fleet started elsewhere (`arpo-envs vm up`: <dir>/fleet.json, "
        "e.g. of OSWorld's own image); its VMs serve the tasks of vm_pool and are left running.",
    )
    vm_pool: str = option("desktop", "The task pool of the VMs (vms or vm_fleet).")
    env_urls: list[str] = option(
        doc="Environment servers started elsewhere (local desktops, OSWorld VMs), e.g. "
        "http://10.0.0.5:5000; they serve the tasks of env_pool (`arpo train` drives them "
        "with one more actor).",
        factory=list,
    )
    env_tokens: list[str] = option(
        doc="Bearer token of each env_urls server, in order (`arpo-envs up --tokens "
        "--tokens-file F` writes them to F); empty: none (`arpo train`: actor.env_token "
        "for all).",
        factory=list,
    )
    env_pool: str = option("desktop", "The task pool of the env_urls servers.")

    def validate(self) -> None:
        for name in ("local_desktops", "vms"):
            n = getattr(self, name)
            if not 0 <= n <= MAX_LOCAL_ENVS:
                fail(name, f"is {n}; give 0..{MAX_LOCAL_ENVS} (environments on this machine)")
        if self.vms:
            from arpo_envs.vm.qemu import MachineConfig

            per_vm, have = MachineConfig().memory_mb, memory_total()
            need = self.vms * per_vm * 2**20
            if need > have:
                fail(
                    "vms",
                    f"{self.vms} VMs of {per_vm} MB need {need / 2**30:.1f} GiB; "
                    f"this machine has {have / 2**30:.1f} GiB",
                )
        if self.vms and self.vm_fleet:
            fail(
                "vm_fleet", "give vms=N (a fleet started here) or vm_fleet (one running), not both"
            )
        if self.vm_fleet and (problem := fleet_problem(self.vm_fleet)):
            fail("vm_fleet", problem)
        for u in self.env_urls:
            if problem := url_problem(u):
                fail("env_urls", problem)
        for t in self.env_tokens:
            if problem := token_problem(t):
                fail("env_tokens", problem)
        if self.env_tokens and len(self.env_tokens) != len(self.env_urls):
            fail("env_tokens", f"{len(self.env_tokens)} tokens for {len(self.env_urls)} "
                 "env_urls: give one per URL, in the same order, or none")  # fmt: skip
        for name in ("vm_pool", "env_pool"):
            if not getattr(self, name) or len(getattr(self, name)) > 1024:
                fail(name, "must be a pool name of 1..1024 characters (e.g. 'desktop')")

    def url_specs(
        self,
        provider: Literal["desktop", "static"],
        runner: RunnerConfig | None = None,
        token: str = "",
    ) -> list[EnvSpec]:
        """One `EnvSpec` per `env_urls` server with its `env_tokens` token (`token` for
        all when there are none), reverted as `provider` says."""
        tokens = list(self.env_tokens) or [token] * len(self.env_urls)
        return [
            EnvSpec(u, token=t, provider=provider, runner=runner)
            for u, t in zip(self.env_urls, tokens, strict=True)
        ]


# ---------------------------------------------------------------------------- one server


@dataclass(frozen=True, slots=True)
class EnvSpec:
    """One environment server the audit drives: where it is, its token, how it is reverted.

    `provider` (arpo.env.provider): "desktop" (`POST /reset` before each setup: a local
    desktop), "sim" (the same on a simulated desktop, with the project's own evaluator
    and no setup sleeps, as the actor drives its simulated desktops), "static" (nothing
    reverts it: a server started elsewhere, e.g. an OSWorld VM you run yourself), "vm"
    (the VM `vm` of the fleet whose state file is `fleet`, reverted to its snapshot)."""

    url: str
    token: str = ""
    """Bearer token ('' = none: OSWorld VMs, the simulated desktops)."""
    provider: Literal["desktop", "sim", "static", "vm"] = "desktop"
    vm: str = ""
    """The fleet's name of the VM (provider "vm")."""
    fleet: str = ""
    """The fleet's state file, `<dir>/fleet.json` (provider "vm")."""
    runner: RunnerConfig | None = None
    """How tasks are set up and scored; None: the provider kind's default (evaluator
    "auto", or "own" with sleep_scale 0 on a simulated desktop)."""

    @classmethod
    def fleet_vms(cls, state_file: str | Path, runner: RunnerConfig | None = None) -> list[EnvSpec]:
        """One spec per VM of a running fleet (`arpo-envs vm up`); ValueError when the file
        is not a ready fleet's state."""
        link = FleetLink.from_state(state_file)
        return [
            cls(v.url, provider="vm", vm=v.name, fleet=str(state_file), runner=runner)
            for v in link.vms
        ]

    def runner_config(self) -> RunnerConfig:
        if self.runner is not None:
            return self.runner
        if self.provider == "sim":
            return RunnerConfig(reset_before_setup=True, sleep_scale=0.0, evaluator="own")
        return RunnerConfig(
            reset_before_setup=self.provider == "desktop", action_pause_s=DESKTOP_ACTION_PAUSE_S
        )

    def environment(
        self,
        index: int,
        files: FileSource | None,
        osworld: OSWorldEvaluator | None,
        config: EnvironmentConfig | None = None,
    ) -> Environment:
        """The actor's `Environment` for this server (client, provider, task runner);
        `config`: its retries (None: the defaults)."""
        provider: Callable[[EnvClient], Any] | None = None
        if self.provider == "static":
            provider = StaticProvider
        elif self.provider == "vm":
            link = FleetLink.from_state(self.fleet)
            v = link.vm(self.vm)
            if v is None:
                raise ValueError(f"the fleet {self.fleet} has no VM named {self.vm!r}")
            ports = v.osworld_ports
            provider = lambda cl: FleetVMProvider(cl, link, self.vm, ports=ports)  # noqa: E731
        return Environment(
            index, self.url, self.runner_config(), token=self.token or None, osworld=osworld,
            provider=provider, files=files, config=config,
        )  # fmt: skip


# ---------------------------------------------------------------------------- bring-up


class Bringup:
    """The local desktops and the VM fleet a command starts on this machine, and their stop.

    Each start records its state file before it waits for the environments to answer, so
    `stop` (or leaving the `with` block) stops what was started even when a start failed
    or was interrupted half way; `stop(now=True)` stops them without grace (a second
    signal)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        """Where the desktops' state file goes (`desktops.json`)."""
        self.desktop_state: Path | None = None
        """State file of the local desktops started here (None: none started)."""
        self.vm_state: Path | None = None
        """State file of the VM fleet started here (None: none started)."""

    def __enter__(self) -> Bringup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start_desktops(
        self, n: int, *, atspi: bool = False, runner: RunnerConfig | None = None
    ) -> list[EnvSpec]:
        """`n` real local desktops, each with its own bearer token (with `atspi`, serving
        their apps' AT-SPI trees); ArpoError when they do not start."""
        from arpo_envs.desktop.fleet import FleetConfig, up

        cfg = FleetConfig(n=n, base_port=0, atspi=atspi, state_file=self.folder /
                          "desktops.json", tokens=True)  # fmt: skip
        self.desktop_state = cfg.state_file
        try:
            fleet = up(cfg, announce=lambda s: log.info("desktop: %s", s))
        except (RuntimeError, OSError, ValueError) as e:
            raise ArpoError(f"the local desktops did not start: {e}") from e
        return [
            EnvSpec(e.url, token=e.token, provider="desktop", runner=runner) for e in fleet.envs
        ]

    def start_vms(self, n: int, folder: str | Path) -> Path:
        """A fleet of `n` VMs of the test image in `folder` (the first start of the image
        makes its snapshot); its state file. ArpoError when it does not start."""
        import subprocess

        from arpo_envs.vm.fleet import FleetConfig, up

        cfg = FleetConfig(n=n, dir=str(folder))
        self.vm_state = cfg.state_file
        log.info("starting %d VMs (the first start of an image makes its snapshot)", n)
        try:
            up(cfg, announce=lambda s: log.info("fleet: %s", s))
        except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as e:
            raise ArpoError(f"the VM fleet did not start: {e}") from e
        return cfg.state_file

    def stop(self, *, now: bool = False) -> None:
        """Stop the desktops, then the VMs, started here (the VMs also when stopping the
        desktops failed); each is forgotten once stopped, so a second call stops only what
        the first did not reach. With `now`: no grace, nothing logged and no error raised
        (a second signal, which may interrupt a first call)."""

        def say(what: str) -> Callable[[str], Any]:
            return (lambda s: None) if now else (lambda s: log.info("%s: %s", what, s))

        errors = contextlib.suppress(Exception) if now else contextlib.nullcontext()
        try:
            with errors:
                if self.desktop_state is not None and self.desktop_state.exists():
                    from arpo_envs.desktop.fleet import GRACE_S, down

                    down(
                        self.desktop_state,
                        grace_s=0.0 if now else GRACE_S,
                        announce=say("desktops"),
                    )
                self.desktop_state = None
        finally:
            with errors:
                if self.vm_state is not None:
                    from arpo_envs.vm.fleet import down as vm_down

                    vm_down(self.vm_state, announce=say("VMs"))
                self.vm_state = None

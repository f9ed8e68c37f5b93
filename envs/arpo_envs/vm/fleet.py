"""N QEMU VMs in one fleet process, from any shell: `arpo-envs vm up`, `status` and `down`.

    arpo-envs vm build                       # the test image, once (cached)
    arpo-envs vm up -n 2 --detach            # 2 VMs; prints "vm <name> <url>" per VM
    arpo-envs vm status                      # state, accelerator, counters, quarantined tasks
    arpo-envs vm down                        # from any shell; also after the fleet was SIGKILLed
    arpo-envs vm up -n 2 --image ~/osworld/Ubuntu.qcow2    # OSWorld's own image (boots its disk)

The fleet is one process (`control.py`: the control API around the state machine of
`supervisor.py`, which owns every QEMU); this module starts, reads and stops it from any
shell.

- **up / status / down** have the shapes of every fleet's (`arpo_envs.fleet`): `up` starts
  the fleet process in the background and returns a `VMFleet` handle once every VM
  answers; the state file `<dir>/fleet.json` is a `VMFleetState` record.
- **Stop.** SIGTERM / Ctrl-C / `down`: every QEMU killed (clones too), the fleet's folder
  (overlays, sockets, logs, saved states) and its saved RAM files removed. QEMU also
  exits when the fleet dies (`exit-with-parent`), and `down` kills by pid whatever the
  state file names and any QEMU whose command line holds the fleet's folder, and removes
  the RAM folder the state file names, so nothing is left after a SIGKILL either.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from arpo_envs.fleet import FleetEnv, FleetHandle
from arpo_envs.fleet_records import (
    EnvStatus,
    FleetRecordError,
    FleetReport,
    FleetStatus,
    VMFleetState,
    decode,
    load,
)
from arpo_envs.procs import alive, kill_all, wait_gone
from arpo_envs.vm.control import serve
from arpo_envs.vm.qemu import qmp_path
from arpo_envs.vm.supervisor import STATE_FILE, FleetConfig, default_dir, ram_dir_of

GRACE_S = 15.0
"""Default seconds `down` waits for the fleet process to stop before SIGKILL."""


@dataclass(frozen=True, slots=True)
class VMFleet(FleetHandle):
    """A running fleet, as `up` returns it (`arpo_envs.fleet.FleetHandle`)."""

    kind = "vm"
    state: VMFleetState
    """Its state file's record when it became ready (control API, token, VMs)."""


def read_state(state_file: Path | None = None) -> VMFleetState | None:
    """The state file's record; None when there is none or it cannot be read as one."""
    try:
        return load(state_file or default_dir() / STATE_FILE, VMFleetState)
    except (OSError, FleetRecordError):
        return None


def _refuse_second(config: FleetConfig) -> None:
    old = read_state(config.state_file)
    if old and _is_fleet(old.pid):
        raise RuntimeError(
            f"a fleet already runs from {config.folder} (pid {old.pid}); "
            "`arpo-envs vm down` first, or give another --dir"
        )


def up(config: FleetConfig, announce: Callable[[str], Any] = print) -> VMFleet:
    """Start the fleet process in the background; returns once every VM answers
    (RuntimeError with the fleet's log tail if it dies first). On any failure, also
    Ctrl-C, what was started is stopped (`down`)."""
    _refuse_second(config)
    try:
        return _up(config, announce)
    except BaseException:
        down(config.state_file, announce=lambda s: None)
        raise


def _up(config: FleetConfig, announce: Callable[[str], Any]) -> VMFleet:
    config.folder.mkdir(parents=True, exist_ok=True)
    config.state_file.unlink(missing_ok=True)
    logf = config.folder.parent / f"{config.folder.name}.log"
    cfg = asdict(config)
    with open(logf, "ab") as out:
        # `setsid -f`: the fleet runs in its own session, and is not this process's child
        # (nothing here has to wait for it)
        subprocess.run(
            ["setsid", "-f", sys.executable, "-m", "arpo_envs.vm.control", json.dumps(cfg)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            check=True,
        )
    t0 = time.monotonic()
    deadline = t0 + config.start_timeout_s + config.n * config.provision_timeout_s
    while time.monotonic() < deadline:
        st = read_state(config.state_file)
        if st and st.ready:
            for v in st.vms:
                announce(f"vm {v.name} {v.url} accel {st.accel}")
            envs = tuple(FleetEnv(v.name, v.url, pid=v.qemu_pid, ports=v.osworld_ports)
                         for v in st.vms)  # fmt: skip
            return VMFleet(config.state_file, envs, st)
        dead = st is not None and not alive(st.pid)
        if dead or (st is None and time.monotonic() - t0 > 60):
            tail = logf.read_text(errors="replace").strip().splitlines()[-8:]
            raise RuntimeError("the fleet did not start:\n  " + "\n  ".join(tail))
        time.sleep(0.5)
    raise RuntimeError(f"the fleet was not ready within the deadline; see {logf}")


def run_foreground(config: FleetConfig, announce: Callable[[str], Any] = print) -> None:
    """Run the fleet in this process until SIGTERM / SIGINT (`arpo-envs vm up` without
    --detach), then stop every VM and remove the folder."""
    _refuse_second(config)
    asyncio.run(serve(config, announce))


def status(state_file: Path | None = None) -> FleetStatus:
    """The fleet's status (any shell): its own report through the control API if it runs."""
    path = state_file or default_dir() / STATE_FILE
    st = read_state(path)
    if st is None:
        return FleetStatus("vm", str(path), running=False, stale=False, envs=())
    if not _is_fleet(st.pid):
        envs = tuple(EnvStatus(v.name, v.url, "gone", v.qemu_pid) for v in (*st.vms, *st.clones))
        return FleetStatus("vm", str(path), running=False, stale=True, envs=envs)
    req = urllib.request.Request(
        st.control + "/fleet", headers={"Authorization": f"Bearer {st.token}"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        report = decode(json.loads(r.read()), FleetReport)
    envs = tuple(
        EnvStatus(v.name, v.url, v.state, v.qemu_pid) for v in (*report.vms, *report.clones)
    )
    return FleetStatus("vm", str(path), running=True, stale=False, envs=envs, report=report)


def down(
    state_file: Path | None = None,
    grace_s: float = GRACE_S,
    announce: Callable[[str], Any] = print,
) -> list[str]:
    """Stop the fleet of `state_file` (`<dir>/fleet.json`) and everything it started, and
    remove its folder; what was done, one line each (each also announced)."""
    state_file = state_file or default_dir() / STATE_FILE
    if state_file.name != STATE_FILE or state_file.is_dir():
        raise ValueError(
            f"{state_file} is not a VM fleet's state file (<dir>/{STATE_FILE}): `down` "
            "removes the folder it is in"
        )
    folder = state_file.parent
    done: list[str] = []

    def did(line: str) -> None:
        done.append(line)
        announce(line)

    st = read_state(state_file)
    pid = st.pid if st else 0
    if pid and _is_fleet(pid):
        kill_all([pid], signal.SIGTERM)
        if wait_gone([pid], grace_s):
            kill_all([pid])
            did(f"fleet pid {pid} killed")
        else:
            did(f"fleet pid {pid} stopped")
    marker = str(folder.resolve()) if folder.exists() else str(folder)
    listed = {v.qemu_pid for v in (*st.vms, *st.clones)} if st else set()
    qemus = [q for q in set(_qemu_pids(marker)) | listed if alive(q) and marker in _cmdline(q)]
    kill_all(qemus)
    wait_gone(qemus, 10.0)
    for q in qemus:
        did(f"QEMU pid {q} killed")
    for vm in st.vms if st else ():  # sockets kept outside the folder (long paths)
        qmp_path(folder / vm.name).unlink(missing_ok=True)
    for c in st.clones if st else ():
        qmp_path(folder / "snapshots" / c.snapshot / c.name).unlink(missing_ok=True)
    ram_dir = Path(st.ram_dir) if st and st.ram_dir else ram_dir_of(folder)
    if ram_dir.exists():  # the snapshots' RAM (tmpfs: memory until removed)
        shutil.rmtree(ram_dir, ignore_errors=True)
        did(f"removed {ram_dir}")
    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
        did(f"removed {folder}")
    return done


def _is_fleet(pid: int) -> bool:
    """True when `pid` runs and is a fleet's process (`python -m arpo_envs.vm.control`,
    `arpo-envs vm up`). A state file outlives its fleet (SIGKILL, a reboot), and its pid may
    then belong to another process, which is neither asked for the fleet's report nor
    signalled by `down`."""
    cmd = _cmdline(pid)
    return alive(pid) and ("arpo_envs" in cmd or "arpo-envs" in cmd)


def _cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def _qemu_pids(marker: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            cmd = _cmdline(int(p.name))
            if "qemu-system" in cmd and marker in cmd:
                out.append(int(p.name))
    return out

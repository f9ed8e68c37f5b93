"""The VM fleet's state machine: golden snapshot, provisioning, reverts, health, replacement,
quarantine, snapshots and their clones (`Fleet`, configured by `FleetConfig`).

One process (the fleet) owns every QEMU of the fleet (`qemu.QemuVM`, one VM each). Each VM
runs on a copy-on-write overlay of the image and serves OSWorld's protocol on
`127.0.0.1:<port>`. The fleet's HTTP control API, which turns requests into calls of
`Fleet`, is `control.py`; `up` / `status` / `down` from any shell are `fleet.py`.

- **Golden snapshot.** Once per image and virtual hardware, one VM boots cold, and when
  its desktop first answers a screenshot the internal snapshot `clean` is saved into its
  overlay (the golden overlay, kept beside the image). Every VM then starts from a copy
  of it with `-loadvm clean`: seconds instead of a boot.
- **Revert** (`POST /vms/<name>/revert`, called by the actor's provider before every
  episode, as OSWorld's `DesktopEnv.reset` reverts to its snapshot): QMP `loadvm clean`,
  then a screenshot within `health_timeout_s`. A failure answers 503 with the reason
  (the episode is `env_error`, never the agent's failure) and the VM is replaced.
- **Health.** Every `health_interval_s`, each idle VM must answer a screenshot within
  `health_timeout_s`; a QEMU that exits is noticed at once. Either way the VM is replaced
  from the golden overlay on the same port, while the other VMs keep serving. A check and
  a revert of one VM never overlap (a request in flight across a `loadvm` hangs).
- **Quarantine.** Actors report every setup (`POST /vms/<name>/report`). A task whose setup
  failed on `task_quarantine_vms` different VMs (or that many times on a fleet of fewer
  VMs) is quarantined: reverts for it answer 409 and it no longer counts against VMs. A
  VM whose last `vm_max_failures` reverts or setups failed, on at least two different
  tasks, is quarantined and replaced.
- **Forks** (group rollouts from one mid-task state): `POST /vms/<name>/snapshot` saves a
  running VM's state (RAM, devices, disk) and answers `SnapshotTaken` (the snapshot's id);
  the VM is paused for about 0.6 s (under TCG) and then goes on, reverts as always, and
  never shares its RAM or disk with the saved state. `POST /snapshots/<id>/fork` with a
  `ForkRequest` of n starts n clones in exactly that state and answers `Forked` (each
  clone's name, URL and ports) once each clone's server answers; `DELETE /snapshots/<id>`
  kills its clones and deletes them and the saved state (`Released`). Clones are fleet
  members: their own forwarded ports, health checks (a clone whose QEMU dies, or whose
  guest stops answering, is `failed` and says so in `GET /vms/<clone>/health`; it is never
  replaced: it cannot be made again), snapshots of their own (trees of several levels),
  killed by the fleet's stop and `down`. A clone cannot be reverted (409: it has no
  snapshot `clean` of its own). Bounds: `max_clones` alive and `max_snapshots` held at
  once (over either: 429 with the numbers), and a snapshot not released within
  `snapshot_ttl_s` is released by the fleet (event `snapshot_expired`). A fork that fails
  answers 503 with the reason and leaves no clone of it behind; an unknown snapshot is 404
  naming it. How a snapshot and a clone are made (QEMU's VM templating through a holder
  process), and what was measured against the alternatives: `qemu.py`'s docstring.
- **Records.** Every decision (start, revert failure, replacement, quarantine) is a line
  of `<dir>/events.jsonl` and a log line with its reason; counters are in `GET /fleet`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import secrets
import shutil
import time
import urllib.request
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arpo_envs.fleet_records import (
    FleetReport,
    Forked,
    Limits,
    Released,
    Reported,
    Reverted,
    SnapshotStatus,
    SnapshotTaken,
    TaskQuarantined,
    VMEntry,
    VMFleetState,
    VMStatus,
    save,
)
from arpo_envs.procs import alive, free_port, free_ports
from arpo_envs.vm.qemu import (
    GUEST_PORTS,
    Machine,
    MachineConfig,
    QemuVM,
    SavedState,
    VMError,
    compact_ram,
    save_state,
)

log = logging.getLogger("arpo_envs.vm.fleet")

SNAPSHOT = "clean"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STATE_FILE = "fleet.json"
"""The state file's name in the fleet's folder."""
CLONE_EXIT_GRACE_S = 5.0
"""How long a clone whose health check failed is given to show that its QEMU exited
before it is killed as hung."""


def default_dir() -> Path:
    return Path(os.environ.get("ARPO_VM_FLEET_DIR") or f"/tmp/arpo-vm-fleet-{os.getuid()}")


def ram_dir_of(folder: Path, parent: str = "") -> Path:
    """Where a fleet in `folder` keeps its snapshots' RAM files: a folder of its own (named
    by a hash of its folder) in `parent`, default /dev/shm (tmpfs: clones map them from
    memory)."""
    digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:12]
    return Path(parent or "/dev/shm") / f"arpo-vm-{os.getuid()}-{digest}"


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """A fleet of VMs on one host."""

    n: int = 1
    """Number of VMs."""
    dir: str = ""
    """The fleet's folder (state file, overlays, sockets, logs); '' = $ARPO_VM_FLEET_DIR or
    /tmp/arpo-vm-fleet-<uid>. Removed by `down`."""
    image: str = ""
    """A qcow2 image to boot from its own disk (e.g. OSWorld's Ubuntu.qcow2); '' = the
    project's test image (`arpo-envs vm build`), booted with its kernel directly."""
    base_port: int = 0
    """VM i serves on 127.0.0.1:base_port+i (0: free ports)."""
    machine: MachineConfig = field(default_factory=MachineConfig)
    """Virtual hardware and accelerator of every VM."""
    control_host: str = "127.0.0.1"
    """Address of the control API (it always needs the fleet's token)."""
    control_port: int = 0
    """Port of the control API (0: a free one)."""
    start_timeout_s: float = 900.0
    """A cold boot (the golden snapshot) must answer a screenshot within this."""
    provision_timeout_s: float = 120.0
    """A VM started from the golden snapshot must answer within this."""
    health_interval_s: float = 30.0
    """Interval of the health check of idle VMs (0: only between episodes)."""
    health_timeout_s: float = 20.0
    """A screenshot must come within this (reverts and health checks)."""
    vm_max_failures: int = 3
    """A VM whose last this many reverts / setups failed (on two or more tasks) is replaced."""
    task_quarantine_vms: int = 2
    """A task whose setup failed on this many different VMs is quarantined."""
    max_replacements: int = 20
    """Replacements per VM slot before the slot is given up (a broken image or host)."""
    max_clones: int = 8
    """Clones alive at once, of all snapshots (a fork over it answers 429). A clone costs a
    QEMU process with about 0.1-0.2 GB of memory of its own (the rest of its RAM is the
    snapshot's, shared) and, under software emulation, a share of the host's cores: 8 is
    a group of ARPO's size on one 2-core host."""
    max_snapshots: int = 4
    """Snapshots held at once (a snapshot over it answers 429). Each holds the guest's RAM
    (its non-zero pages: about 0.45 GB for the test image) in `snapshot_ram_dir`."""
    snapshot_ttl_s: float = 1800.0
    """A snapshot not released within this is released by the fleet (clones killed; event
    `snapshot_expired`): an actor that died mid-tree leaves nothing behind for long."""
    snapshot_ram_dir: str = ""
    """Where the snapshots' RAM files go: the fleet makes a folder of its own in it
    (`arpo-vm-<uid>-<hash of dir>`, removed with the fleet); '' = /dev/shm (tmpfs: the
    clones' shared pages stay in memory; a disk folder works too, through the page cache)."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.image and not Path(self.image).is_file():
            raise ValueError(f"image {self.image!r} is not a file (a qcow2 disk image)")
        if not 0 <= self.base_port < 65536 - self.n:
            raise ValueError(f"base_port must be in 0..{65535 - self.n}, got {self.base_port}")
        for name in ("start_timeout_s", "provision_timeout_s", "health_timeout_s"):
            v = getattr(self, name)
            if not v > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {v}")
        if self.health_interval_s < 0:
            raise ValueError("health_interval_s must be >= 0 (0: no timer)")
        if self.vm_max_failures < 1 or self.task_quarantine_vms < 1:
            raise ValueError("vm_max_failures and task_quarantine_vms must be >= 1")
        if self.max_clones < 0 or self.max_snapshots < 0:
            raise ValueError("max_clones and max_snapshots must be >= 0 (0: no forks)")
        if not self.snapshot_ttl_s > 0:
            raise ValueError(f"snapshot_ttl_s must be > 0 seconds, got {self.snapshot_ttl_s}")

    @property
    def folder(self) -> Path:
        return Path(self.dir) if self.dir else default_dir()

    @property
    def state_file(self) -> Path:
        return self.folder / STATE_FILE

    @property
    def ram_dir(self) -> Path:
        """The fleet's own folder of RAM files (in `snapshot_ram_dir`)."""
        return ram_dir_of(self.folder, self.snapshot_ram_dir)


@dataclass
class Member:
    """One VM slot of the fleet; the QEMU behind it changes when it is replaced."""

    name: str
    port: int
    vm: QemuVM
    state: str = "starting"
    """starting | ready | reverting | snapshotting | replacing | failing (a clone, its reason
    being settled) | failed | released"""
    streak: list[str] = field(default_factory=list)
    """What failed since the last success: task ids, or '<revert>' / '<health>'."""
    replacements: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held by a revert, a health check and a replacement: one at a time per VM."""
    last_error: str = ""
    snapshot: str = ""
    """A clone: the id of the snapshot it was started from ('' for the fleet's own VMs)."""

    def entry(self) -> VMEntry:
        """How clients reach it (the state file, a fork's answer)."""
        return VMEntry(self.name, self.vm.url, self.port, self.vm.pid or 0,
                       self.vm.extra_ports.get("chromium", 0), self.vm.extra_ports.get("vlc", 0),
                       self.snapshot)  # fmt: skip

    def status(self) -> VMStatus:
        """Its line in the fleet's report (`GET /fleet`, `GET /vms/<name>`)."""
        return VMStatus(self.name, self.vm.url, self.state, self.vm.pid or 0, self.last_error,
                        replacements=self.replacements, failure_streak=len(self.streak),
                        snapshot=self.snapshot)  # fmt: skip

    def require_ready(self) -> None:
        """VMError naming the state (and why) unless the VM is ready."""
        if self.state != "ready":
            why = f" ({self.last_error})" if self.last_error else ""
            raise VMError(f"{self.name} is {self.state}{why}")


@dataclass
class Snapshot:
    """A saved state of a VM and the clones started from it."""

    id: str
    parent: str
    """Name of the VM it was saved from."""
    saved: SavedState
    created: float
    """time.monotonic() when it was saved."""
    info: dict[str, float]
    """Seconds of each part of the save (`save_state`)."""
    clones: list[str] = field(default_factory=list)
    forked: int = 0
    """Clones started from it so far (the next clone's index)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held by a fork and by the release: a release waits for a fork under way."""


class Refused(Exception):
    """A request the fleet turns down as asked (a bound, a state); `status` is its HTTP code."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Fleet:
    """The VMs, their golden snapshot, the health loop and the decisions."""

    def __init__(self, config: FleetConfig):
        self.config = config
        self.dir = config.folder
        self.machine = Machine.detect(config.machine)
        self.members: dict[str, Member] = {}
        self.token = secrets.token_urlsafe(24)
        self.counters: Counter[str] = Counter()
        self.revert_s: deque[float] = deque(maxlen=512)
        self.task_failures: dict[str, set[str]] = {}
        self.task_attempts: Counter[str] = Counter()
        self.quarantined_tasks: dict[str, str] = {}
        self.golden: Path | None = None
        self.golden_info: dict[str, Any] = {}
        self.snapshots: dict[str, Snapshot] = {}
        self.clones: dict[str, Member] = {}
        self._starting_clones = 0
        """Clones of forks under way (counted against `max_clones` before they run)."""
        self._starting_snapshots = 0
        """Snapshots under way (counted against `max_snapshots` before they exist)."""
        self._boot: dict[str, Any] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = False

    # ---- records ------------------------------------------------------------------------

    def event(self, kind: str, vm: str = "", **info: Any) -> None:
        self.counters[kind] += 1
        rec = {"t": round(time.time(), 3), "event": kind, "vm": vm, **info}
        log.info("fleet: %s %s %s", kind, vm, " ".join(f"{k}={v}" for k, v in info.items()))
        with open(self.dir / "events.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    def write_state(self, ready: bool) -> None:
        save(self.config.state_file, VMFleetState(
            pid=os.getpid(), ready=ready, dir=str(self.dir),
            control=f"http://{self.config.control_host}:{self._control_port}",
            token=self.token, accel=self.machine.accel, accel_reason=self.machine.reason,
            vms=tuple(m.entry() for m in self.members.values()),
            clones=tuple(m.entry() for m in self.clones.values()),
            ram_dir=str(self.config.ram_dir),
        ))  # fmt: skip

    _control_port = 0

    # ---- image and golden snapshot ------------------------------------------------------

    def _boot_source(self) -> dict[str, Any]:
        """Base disk and kernel of the image, and the key of its golden snapshot."""
        if self._boot:
            return self._boot
        if self.config.image:
            disk = Path(self.config.image).resolve()
            st = disk.stat()
            key = f"{disk}:{st.st_size}:{int(st.st_mtime)}"
            self._boot = {"base": disk, "kernel": None, "initrd": None, "append": None,
                          "key": self.machine.key(key), "golden_dir": self.dir.parent
                          / f"arpo-vm-golden-{os.getuid()}"}  # fmt: skip
        else:
            from arpo_envs.vm.image import build, hold

            img = build()
            self._hold = hold(img)  # kept open while the fleet runs
            self._boot = {"base": img.disk, "kernel": img.kernel, "initrd": img.initrd,
                          "append": img.append, "key": self.machine.key(img.key),
                          "golden_dir": img.dir}  # fmt: skip
        return self._boot

    def _vm(
        self,
        name: str,
        port: int,
        folder: Path,
        extra: dict[str, int] | None = None,
        backing: Path | None = None,
    ) -> QemuVM:
        b = self._boot_source()
        if extra is None:
            extra = {k: free_port() for k in GUEST_PORTS if k != "server"}
        return QemuVM(name, folder, self.machine, port, base=b["base"], kernel=b["kernel"],
                      initrd=b["initrd"], append=b["append"], extra_ports=extra,
                      backing=backing)  # fmt: skip

    async def ensure_golden(self) -> Path:
        """The golden overlay (with the snapshot `clean`), made by one cold boot if needed."""
        b = self._boot_source()
        gdir = Path(b["golden_dir"])
        gdir.mkdir(parents=True, exist_ok=True)
        golden = gdir / f"golden-{b['key']}.qcow2"
        info_file = golden.with_suffix(".json")
        if golden.exists() and info_file.exists():
            self.golden, self.golden_info = golden, json.loads(info_file.read_text())
            return golden
        log.info("fleet: no golden snapshot for this image and hardware: one cold boot (%s)",
                 self.machine.reason)  # fmt: skip
        port = free_port()
        vm = self._vm("golden", port, self.dir / "golden")
        t0 = time.monotonic()
        try:
            await vm.start()
            await self._wait_ready(vm, self.config.start_timeout_s, "cold boot")
            boot_s = time.monotonic() - t0
            await asyncio.sleep(2.0)  # let the first frame settle before it is frozen
            save_s = await vm.savevm(SNAPSHOT)
            await vm.quit()
        except BaseException:
            await vm.kill()
            raise
        tmp = golden.with_suffix(".partial")
        shutil.move(str(vm.disk), tmp)
        os.replace(tmp, golden)
        self.golden_info = {"cold_boot_s": round(boot_s, 2), "savevm_s": round(save_s, 2),
                            "accel": self.machine.accel, "bytes": golden.stat().st_size}  # fmt: skip
        info_file.write_text(json.dumps(self.golden_info))
        vm.remove_files()
        self.event("golden_snapshot", "golden", **self.golden_info)
        self.golden = golden
        return golden

    async def _wait_ready(self, vm: QemuVM, timeout_s: float, what: str) -> float:
        """Seconds until the VM's desktop answers a screenshot; VMError after `timeout_s`."""
        t0 = time.monotonic()
        last = ""
        while time.monotonic() - t0 < timeout_s:
            if not vm.alive():
                raise VMError(f"{vm.name}: QEMU exited during {what}: {vm.log_tail()}")
            ok, last = await screenshot_ok(vm.url, min(10.0, self.config.health_timeout_s))
            if ok:
                return time.monotonic() - t0
            await asyncio.sleep(0.5)
        raise VMError(f"{vm.name}: no screenshot within {timeout_s:.0f} s of {what} ({last})")

    # ---- members ------------------------------------------------------------------------

    async def provision(self, m: Member) -> None:
        assert self.golden is not None
        t0 = time.monotonic()
        m.vm = self._vm(m.name, m.port, self.dir / m.name, m.vm.extra_ports)
        await m.vm.start(overlay_from=self.golden, loadvm=SNAPSHOT)
        await self._wait_ready(m.vm, self.config.provision_timeout_s, "start from the snapshot")
        m.state = "ready"
        self._watch_qemu(m)
        self.event("vm_started", m.name, seconds=round(time.monotonic() - t0, 2),
                   qemu_pid=m.vm.pid, port=m.port)  # fmt: skip

    def _watch_qemu(self, m: Member) -> None:
        vm = m.vm

        async def watch() -> None:
            assert vm.proc is not None
            code = await vm.proc.wait()
            if not self._stopping and m.vm is vm and m.state not in ("replacing", "released"):
                self.spawn(self.replace(m, f"QEMU exited with code {code}"))

        self.spawn(watch())

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def shielded(self, coro: Any) -> Any:
        """Run `coro` to its end even if the request that asked for it goes away (a snapshot
        stopped midway would leave its VM paused, a fork its clones half-started)."""
        return await asyncio.shield(self.spawn(coro))

    async def replace(self, m: Member, reason: str) -> None:
        """Kill the member's QEMU and start a new one from the golden snapshot."""
        if self._stopping or m.state in ("replacing", "failing", "failed", "released"):
            return
        if m.snapshot:  # a clone cannot be made again: it is failed until its release
            # 'failing' while the reason is settled: a client polling the health sees
            # 'failed' only with the final reason beside it
            m.state = "failing"
            proc = m.vm.proc
            if proc is not None and "QEMU exited" not in reason:
                # a check can see the guest's connection reset before QEMU is gone (a
                # killed QEMU's exit, the teardown of its guest RAM, takes over a second
                # on a loaded machine): say which it was (a guest that hangs is killed
                # after this grace)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(CLONE_EXIT_GRACE_S):
                        await proc.wait()
                if proc.returncode is not None:
                    reason = f"QEMU exited with code {proc.returncode} ({reason})"
            m.last_error = reason
            if m.state == "failing":  # not released meanwhile
                m.state = "failed"
            self.event("clone_failed", m.name, snapshot=m.snapshot, reason=reason)
            await m.vm.kill()
            self.write_state(ready=True)
            return
        m.state = "replacing"
        m.last_error = reason
        self.event("vm_replace", m.name, reason=reason)
        async with m.lock:
            while not self._stopping:
                await m.vm.kill()
                m.vm.remove_files()
                if m.replacements >= self.config.max_replacements:
                    m.state = "failed"
                    self.event("vm_given_up", m.name, replacements=m.replacements)
                    return
                m.replacements += 1
                try:
                    await self.provision(m)
                    m.streak.clear()
                    self.write_state(ready=True)
                    return
                except VMError as e:
                    self.event("vm_start_failed", m.name, reason=str(e))
                    await asyncio.sleep(1.0)

    async def revert(self, m: Member, task_id: str = "") -> Reverted:
        """loadvm + a screenshot; raises VMError (and replaces the VM) on failure."""
        if task_id in self.quarantined_tasks:
            raise TaskQuarantined(task_id, self.quarantined_tasks[task_id])
        if m.snapshot:
            raise Refused(
                409,
                f"{m.name} is a clone of snapshot {m.snapshot}: it has no snapshot of its own "
                "to revert to (release the snapshot and revert its parent)",
            )
        m.require_ready()
        async with m.lock:
            m.require_ready()  # again: a health check it waited for may have failed
            m.state = "reverting"
            t0 = time.perf_counter()
            try:
                load_s = await m.vm.loadvm(SNAPSHOT)
                ok, why = await screenshot_ok(m.vm.url, self.config.health_timeout_s)
                if not ok:
                    raise VMError(f"{m.name}: no screenshot after loadvm: {why}")
            except (VMError, OSError) as e:
                self.counters["revert_failed"] += 1
                m.state = "ready"
                m.streak.append("<revert>")
                self.spawn(self.replace(m, f"revert failed: {e}"))
                raise VMError(f"revert failed: {e}") from e
            m.state = "ready"
        total = time.perf_counter() - t0
        self.counters["reverts"] += 1
        self.revert_s.append(total)
        return Reverted(seconds=round(total, 3), loadvm_s=round(load_s, 3))

    def report(self, m: Member, task_id: str, ok: bool, error: str = "") -> Reported:
        """An actor's word on one setup: counts toward the task's or the VM's quarantine."""
        if ok:
            m.streak.clear()
            self.task_failures.pop(task_id, None)
            self.task_attempts.pop(task_id, None)
            return Reported(m.state, task_quarantined=False)
        self.counters["setup_failed"] += 1
        if task_id in self.quarantined_tasks:
            return Reported(m.state, task_quarantined=True)
        vms = self.task_failures.setdefault(task_id, set())
        vms.add(m.name)
        self.task_attempts[task_id] += 1
        need = self.config.task_quarantine_vms
        if len(vms) >= need or (len(self.members) < need and self.task_attempts[task_id] >= need):
            reason = f"setup failed on {len(vms)} VM(s) ({', '.join(sorted(vms))}): {error[:300]}"
            self.quarantined_tasks[task_id] = reason
            self.event("task_quarantined", m.name, task=task_id, reason=reason)
            for other in self.members.values():  # the task's failures are not the VMs'
                other.streak = [t for t in other.streak if t != task_id]
            return Reported(m.state, task_quarantined=True)
        m.streak.append(task_id)
        k = self.config.vm_max_failures
        if len(m.streak) >= k and len(set(m.streak[-k:])) >= 2:
            self.event("vm_quarantined", m.name, failures=list(m.streak[-k:]), error=error[:300])
            self.spawn(self.replace(m, f"{k} failures in a row: {error[:200]}"))
        return Reported(m.state, task_quarantined=False)

    async def health_loop(self) -> None:
        every = self.config.health_interval_s
        if every <= 0:
            return
        while not self._stopping:
            await asyncio.sleep(every)
            for m in [*self.members.values(), *self.clones.values()]:
                if m.state != "ready" or m.lock.locked():
                    continue  # a revert or a replacement is under way
                await self.check(m)

    async def check(self, m: Member) -> tuple[bool, str]:
        """A screenshot within `health_timeout_s`, or the VM is replaced. Holds the VM's lock,
        so a revert waits for the check: a request in flight across a `loadvm` is lost with
        the guest's TCP state and hangs until its timeout, which replaced a healthy VM in
        the middle of the next episode (tests/test_vm.py, checks beside reverts)."""
        async with m.lock:
            if m.state != "ready":
                return False, f"{m.name} is {m.state}"
            self.counters["health_checks"] += 1
            ok, why = await screenshot_ok(m.vm.url, self.config.health_timeout_s)
            if not ok and m.state == "ready":
                self.counters["health_failed"] += 1
                why = self.health_reason(m, why)
                self.spawn(self.replace(m, why))
        return ok, why

    def health_reason(self, m: Member, why: str) -> str:
        """Why a failed health check replaces `m`: a QEMU that has exited (the check can see
        it before the exit watcher does) is named as such."""
        if m.vm.pid and not alive(m.vm.pid):
            return f"QEMU exited (seen by the health check: {why})"
        return f"health check: {why}"

    def status(self) -> FleetReport:
        rs = sorted(self.revert_s)
        return FleetReport(
            accel=self.machine.accel,
            accel_reason=self.machine.reason,
            qemu=self.machine.qemu_version,
            golden=dict(self.golden_info),
            vms=tuple(m.status() for m in self.members.values()),
            clones=tuple(m.status() for m in self.clones.values()),
            snapshots=tuple(
                SnapshotStatus(snap.id, snap.parent, tuple(snap.clones),
                               age_s=round(time.monotonic() - snap.created, 1),
                               ram_mib=round(snap.saved.ram_bytes() / 2**20))
                for snap in self.snapshots.values()
            ),
            counters=dict(self.counters),
            revert_median_s=round(rs[len(rs) // 2], 3) if rs else None,
            quarantined_tasks=dict(self.quarantined_tasks),
            limits=Limits(self.config.max_clones, self.config.max_snapshots,
                          self.config.snapshot_ttl_s),
        )  # fmt: skip

    # ---- life ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        log.info("fleet: %d VMs, %s", self.config.n, self.machine.reason)
        shutil.rmtree(self.config.ram_dir, ignore_errors=True)  # a killed fleet's, unless `down`
        await self.ensure_golden()
        ports = (
            [self.config.base_port + i for i in range(self.config.n)]
            if self.config.base_port
            else free_ports(self.config.n)
        )
        for i, port in enumerate(ports):
            name = f"vm-{i}"
            self.members[name] = Member(name, port, self._vm(name, port, self.dir / name))
        # one at a time: under software emulation parallel starts only compete for the CPUs
        for m in self.members.values():
            await self.provision(m)

    async def stop(self) -> None:
        self._stopping = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        every = [*self.members.values(), *self.clones.values()]
        await asyncio.gather(*(m.vm.kill() for m in every), return_exceptions=True)
        for m in every:
            m.vm.remove_files()
        shutil.rmtree(self.config.ram_dir, ignore_errors=True)

    # ---- forks --------------------------------------------------------------------------

    def find(self, name: str) -> Member | None:
        """A VM of the fleet or a clone, by name."""
        return self.members.get(name) or self.clones.get(name)

    def live_clones(self) -> int:
        return self._starting_clones + sum(c.state != "failed" for c in self.clones.values())

    async def snapshot(self, m: Member) -> SnapshotTaken:
        """Save `m`'s state for forks (`qemu.save_state`); it goes on serving. Refused (409
        not ready, 429 over `max_snapshots`); VMError when the save failed (the VM goes on;
        replaced if its QEMU did not survive)."""
        held = len(self.snapshots) + self._starting_snapshots
        if held >= self.config.max_snapshots:
            raise Refused(
                429,
                f"the fleet holds {held} snapshots, its max_snapshots is "
                f"{self.config.max_snapshots}: release one (DELETE /snapshots/<id>) first",
            )
        _ready_or_refused(m)
        self._starting_snapshots += 1
        try:
            return await self._snapshot(m)
        finally:
            self._starting_snapshots -= 1

    async def _snapshot(self, m: Member) -> SnapshotTaken:
        async with m.lock:
            _ready_or_refused(m)  # again: a revert or a check it waited for may have failed
            sid = f"snap-{secrets.token_hex(4)}"
            m.state = "snapshotting"
            try:
                saved, info = await save_state(
                    m.vm,
                    self.dir / "snapshots" / sid,
                    self.config.ram_dir / f"{sid}.ram",
                    self.config.provision_timeout_s,
                )
            except VMError as e:
                self.counters["snapshot_failed"] += 1
                self.event("snapshot_failed", m.name, reason=str(e))
                m.state = "ready"
                if not m.vm.alive():
                    self.spawn(self.replace(m, f"QEMU exited during a snapshot: {e}"))
                raise
            m.state = "ready"
        snap = Snapshot(sid, m.name, saved, time.monotonic(), info)
        self.snapshots[sid] = snap
        self.spawn(self._expire(sid))
        if m.snapshot in self.snapshots:  # the clone's RAM was read whole: see compact_ram
            self.spawn(self._compact(self.snapshots[m.snapshot]))
        out = {k: round(v, 3) for k, v in info.items()}
        self.event("snapshot", m.name, snapshot=sid, **out)
        self.write_state(ready=True)
        return SnapshotTaken(sid, out)

    async def fork(self, sid: str, n: int) -> Forked:
        """`n` clones of snapshot `sid`, each serving once this returns. Refused (404 unknown
        snapshot, 429 over `max_clones`); VMError if a clone failed (none of this fork's
        clones is left)."""
        snap = self.snapshots.get(sid)
        if snap is None:
            known = ", ".join(self.snapshots) or "none"
            raise Refused(404, f"no snapshot {sid!r} (released, expired or never made); "
                          f"snapshots: {known}")  # fmt: skip
        if self.live_clones() + n > self.config.max_clones:
            raise Refused(
                429,
                f"a fork of {n} would make {self.live_clones() + n} clones alive, over the "
                f"fleet's max_clones of {self.config.max_clones}: release a snapshot "
                "(DELETE /snapshots/<id>) first, or start the fleet with a larger max_clones",
            )
        self._starting_clones += n
        try:
            async with snap.lock:
                if sid not in self.snapshots:
                    raise Refused(404, f"snapshot {sid!r} was released during the fork")
                return await self._fork(snap, n)
        finally:
            self._starting_clones -= n

    async def _fork(self, snap: Snapshot, n: int) -> Forked:
        t0 = time.perf_counter()
        ports = self._free_ports(n * len(GUEST_PORTS))
        made = []
        for i in range(n):
            name = f"{snap.id}-{snap.forked + i}"
            mine = ports[i * len(GUEST_PORTS) : (i + 1) * len(GUEST_PORTS)]
            extra = {k: mine[j + 1] for j, k in enumerate(k for k in GUEST_PORTS if k != "server")}
            vm = self._vm(name, mine[0], snap.saved.folder / name, extra, backing=snap.saved.disk)
            made.append(Member(name, mine[0], vm, snapshot=snap.id))
        snap.forked += n

        async def start(c: Member) -> float:
            await c.vm.start_clone(snap.saved, self.config.provision_timeout_s)
            await wait_serving(c.vm, self.config.provision_timeout_s)
            return time.perf_counter() - t0

        async def discard() -> None:
            await asyncio.gather(*(c.vm.kill() for c in made), return_exceptions=True)
            for c in made:
                c.vm.remove_files()

        try:
            results = await asyncio.gather(*(start(c) for c in made), return_exceptions=True)
        except BaseException:  # cancelled (the fleet stops): no half-started clone is left
            await discard()
            raise
        failed = [
            (c, r) for c, r in zip(made, results, strict=True) if isinstance(r, BaseException)
        ]
        if failed:
            await discard()
            c, why = failed[0]
            reason = f"{len(failed)} of {n} clones did not start; {c.name}: {why}"
            self.counters["fork_failed"] += 1
            self.event("fork_failed", snap.parent, snapshot=snap.id, reason=reason)
            if not isinstance(why, Exception):  # cancelled, or the interpreter is stopping
                raise why
            raise VMError(f"fork of {snap.id} failed: {reason}")
        for c in made:
            c.state = "ready"
            self.clones[c.name] = c
            snap.clones.append(c.name)
            self._watch_qemu(c)
        seconds = time.perf_counter() - t0
        self.counters["clones_started"] += n
        self.event("fork", snap.parent, snapshot=snap.id, n=n, seconds=round(seconds, 3),
                   each_s=[round(float(r), 3) for r in results])  # fmt: skip
        self.write_state(ready=True)
        return Forked(snap.id, round(seconds, 3), tuple(c.entry() for c in made))

    async def release(self, sid: str, reason: str = "released") -> Released:
        """Kill the clones of `sid` and delete them and the saved state. Refused 404 if unknown."""
        snap = self.snapshots.get(sid)
        if snap is None:
            raise Refused(404, f"no snapshot {sid!r} (released, expired or never made)")
        async with snap.lock:  # a fork under way finishes first
            if self.snapshots.pop(sid, None) is None:
                raise Refused(404, f"snapshot {sid!r} was released meanwhile")
            gone = [self.clones.pop(name) for name in snap.clones if name in self.clones]
            for c in gone:
                c.state = "released"
            await asyncio.gather(*(c.vm.kill() for c in gone), return_exceptions=True)
            for c in gone:
                c.vm.remove_files()
            shutil.rmtree(snap.saved.folder, ignore_errors=True)
            snap.saved.ram.unlink(missing_ok=True)
        age = time.monotonic() - snap.created
        self.event("snapshot_released", snap.parent, snapshot=sid, clones=len(gone),
                   age_s=round(age, 1), reason=reason)  # fmt: skip
        self.write_state(ready=True)
        return Released(sid, clones_stopped=len(gone), age_s=round(age, 1))

    async def _compact(self, snap: Snapshot) -> None:
        try:
            freed = await compact_ram(snap.saved.ram)
        except (VMError, OSError) as e:  # released meanwhile, or no fallocate: memory only
            log.info("fleet: RAM file of %s not compacted: %s", snap.id, e)
            return
        self.event("snapshot_compacted", snap.parent, snapshot=snap.id, freed_mib=freed >> 20)

    async def _expire(self, sid: str) -> None:
        await asyncio.sleep(self.config.snapshot_ttl_s)
        snap = self.snapshots.get(sid)
        if snap is not None:
            ttl = self.config.snapshot_ttl_s
            log.warning("fleet: snapshot %s was not released within %.0f s: releasing it", sid, ttl)
            self.event("snapshot_expired", snap.parent, snapshot=sid, clones=len(snap.clones),
                       ttl_s=ttl)  # fmt: skip
            with contextlib.suppress(Refused):
                await self.release(sid, f"expired: not released within {ttl:.0f} s")

    def _free_ports(self, k: int) -> list[int]:
        """`k` distinct free loopback ports that no VM or clone of the fleet forwards."""
        used = {
            p
            for m in [*self.members.values(), *self.clones.values()]
            for p in (m.port, *m.vm.extra_ports.values())
        }
        return free_ports(k, exclude=used)


def _ready_or_refused(m: Member) -> None:
    try:
        m.require_ready()
    except VMError as e:
        raise Refused(409, f"cannot snapshot now: {e}") from None


async def screenshot_ok(url: str, timeout_s: float) -> tuple[bool, str]:
    """(True, '') when GET <url>/screenshot gives a PNG within `timeout_s`, else (False, why).
    A new connection every time: after a revert the guest's TCP state is the snapshot's."""

    def get() -> tuple[bool, str]:
        try:
            with urllib.request.urlopen(f"{url}/screenshot", timeout=timeout_s) as r:
                body = r.read()
        except Exception as e:  # any failure is an unhealthy VM
            return False, f"{type(e).__name__}: {e}"
        if not body.startswith(PNG_MAGIC):
            return False, f"not a PNG ({len(body)} bytes)"
        return True, ""

    try:
        async with asyncio.timeout(timeout_s + 2):
            return await asyncio.to_thread(get)
    except TimeoutError:
        return False, f"no answer within {timeout_s} s"


async def wait_serving(vm: QemuVM, timeout_s: float) -> float:
    """Seconds until the guest's server answers `GET /platform` (a clone: its screen is the
    saved one already, so the cheapest request says it serves); VMError if QEMU exits or
    `timeout_s` passes."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if not vm.alive():
            raise VMError(f"{vm.name}: QEMU exited: {vm.log_tail()}")
        if await answers(vm.url, "/platform", 5.0):
            return time.monotonic() - t0
        await asyncio.sleep(0.05)
    raise VMError(f"{vm.name}: its server did not answer within {timeout_s:.0f} s")


async def answers(url: str, path: str, timeout_s: float) -> bool:
    """Whether `GET <url><path>` answers 200 within `timeout_s` (a new connection: QEMU's
    forwarded port accepts before the guest does, and closes when the guest refuses)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
            await writer.drain()
            line = await reader.readline()
            return line.split(b" ")[1:2] == [b"200"]
    except (OSError, TimeoutError, IndexError):
        return False
    finally:
        if writer is not None:
            writer.close()

"""One QEMU virtual machine: its command line, its QMP link, snapshots, and how it dies.

    m = Machine.detect(MachineConfig())                       # KVM or software emulation
    vm = QemuVM("vm-0", folder, image, m, port=5300)
    await vm.start(overlay_from=golden, loadvm="clean")      # a copy-on-write overlay
    await vm.loadvm("clean")                                  # revert: QMP, about 1-2 s
    await vm.kill()

- **Disk.** Each VM runs on its own qcow2 overlay whose backing file is the image's
  `base.qcow2` (never written). A VM started from the fleet's golden overlay gets a copy
  of it (the golden overlay holds the internal snapshot `clean`, taken once the desktop
  first answered) and starts with `-loadvm clean`: seconds, not a boot.
- **Network.** QEMU user-mode networking; the guest's port 5000 (OSWorld's server) is
  forwarded from `127.0.0.1:<port>` only. The guest cannot reach any other host unless
  `MachineConfig.internet` is set (`restrict=on` otherwise).
- **Acceleration.** `auto` uses KVM when the host CPU has vmx or svm and /dev/kvm is
  usable, else QEMU's software emulation (TCG); `Machine.reason` says why. A host with
  /dev/kvm but no vmx/svm (a paravirtual KVM) cannot run a stock kernel under it.
- **QMP.** A unix socket in the VM's folder; `human-monitor-command` runs `savevm` /
  `loadvm` (internal snapshots in the overlay).
- **Death.** QEMU gets SIGKILL when the process that started it dies, even by SIGKILL
  (Linux's parent-death signal); `kill()` and the fleet's `down` also kill it by pid.

Forks (`save_state`, `QemuVM.start_clone`): a running VM's state is saved once and any
number of clones start from it, each on its own copy-on-write disk, sharing the saved
RAM pages (QEMU's VM templating, `docs/system/vm-templating.rst`):

    saved, seconds = await save_state(vm, folder, Path("/dev/shm/x/s1.ram"), timeout_s=120)
    clone = QemuVM("c0", ..., backing=saved.disk)
    await clone.start_clone(saved, timeout_s=120)              # then: its server answers

1. *Save.* The VM is paused (`stop`: the state is the one of the moment asked, not a
   second later) and its whole state migrated over a unix socket (multifd, 2 channels,
   no rate limit) into a *holder*: a second QEMU, paused (`-S`), whose RAM is a
   `memory-backend-file` with `share=on` on tmpfs. Multifd's receiver never touches a
   zero page it has not received before, so the file holds only the guest's non-zero
   pages (about 0.43 GB of the 1.5 GB test VM; a plain migration stream reads every zero
   page on arrival, which on tmpfs allocates it). While the VM is still paused, its disk
   overlay (flushed and inactive once the migration completed) is copied as a new qcow2
   on the image's base (`qemu-img convert -B`: only the overlay's own clusters, about
   5 MB and 0.05 s; a clone's overlay, whose backing is a snapshot's disk, is then
   rebased onto the base so no snapshot depends on another). Then the VM goes on
   (`cont`): paused about 0.6 s here under TCG (0.4-1.1 s). The holder saves its
   device state without RAM (`x-ignore-shared`: its RAM is the shared file) to a file of
   about 0.7 MB and exits. The RAM file, the device state and the disk are the saved
   state; nothing of it is the VM's own RAM or disk, which go on changing.
2. *Clone.* QEMU with the same hardware, its RAM `share=off,readonly=on,rom=off` on the
   saved RAM file (a private copy-on-write mapping: it reads the file's pages, shared with
   every other clone through the page cache, and its writes stay its own), a new overlay
   on the saved disk, `-incoming defer`, `x-ignore-shared`, `migrate-incoming file:` of
   the device state, `cont`. One clone serves about 0.3 s later, 4 at once about 1-1.3 s
   (median; 0.8-2.5 s on this shared 2-core host; `benchmarks/bench_fork.py --kinds vm`).

Why not the other ways (measured on this 2-core host, TCG): running every VM's RAM on a
shared tmpfs file and copying it at the snapshot made every VM cost 1.66 GB instead of
0.59 GB (a `loadvm` revert reads every zero page, which on tmpfs allocates it) for a
pause of 1.4-2.8 s; migrating to a file and starting each clone with `-incoming` from it
copies all of the RAM into every clone: about 6 s and a full VM's memory per clone. A
clone is snapshotted the same way as any VM (its RAM is private, so it too goes through
a holder), which is what a tree with more than one level needs; reading the clone whole
makes its own snapshot's RAM file whole too (`compact_ram` gives the zero pages back).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arpo_envs.procs import set_parent_death_signal

log = logging.getLogger("arpo_envs.vm.qemu")

QEMU = "qemu-system-x86_64"
GUEST_PORT = 5000
GUEST_PORTS = {"server": 5000, "chromium": 9222, "vlc": 8080}
"""Guest ports forwarded from 127.0.0.1: OSWorld's server, Chrome's debugging port and VLC's
web interface (the ports OSWorld's docker provider publishes, but for its VNC view)."""
MULTIFD_CHANNELS = 2
"""Parallel streams of a snapshot's RAM transfer (multifd; its receiver leaves zero pages
alone, which keeps the holder's tmpfs file sparse)."""
MIGRATE_MAX_BANDWIDTH = 1 << 36
"""Bytes/s: a local transfer is not rate limited (QEMU's default is 128 MiB/s)."""
OVMF_CODE = ("/usr/share/OVMF/OVMF_CODE_4M.fd", "/usr/share/OVMF/OVMF_CODE.fd")
OVMF_VARS = ("/usr/share/OVMF/OVMF_VARS_4M.fd", "/usr/share/OVMF/OVMF_VARS.fd")


class VMError(RuntimeError):
    """A VM could not be started, reverted or reached; the message says why."""


@dataclass(frozen=True, slots=True)
class MachineConfig:
    """The virtual hardware of every VM of a fleet."""

    memory_mb: int = 1536
    """Guest memory (LibreOffice Calc needs about 300 MB of it)."""
    cpus: int = 1
    """Virtual CPUs (under software emulation 1 was faster than 2 on a 2-core host)."""
    accel: str = "auto"
    """"kvm", "tcg" (software emulation) or "auto" (KVM when the host CPU has vmx/svm)."""
    width: int = 1280
    """Screen width of the guest's desktop."""
    height: int = 720
    """Screen height of the guest's desktop."""
    internet: bool = False
    """Let the guest reach other hosts (OSWorld's VMs have the internet); off: only the
    forwarded port reaches it and it reaches nothing."""
    firmware: str = "bios"
    """"bios" (SeaBIOS; the test image boots its kernel directly) or "uefi" (OVMF, from
    Debian's `ovmf`: OSWorld's Ubuntu.qcow2 boots only with UEFI). The firmware's variable
    store is read-only, so the VM's whole state is its overlay and its RAM."""

    def __post_init__(self) -> None:
        if self.firmware not in ("bios", "uefi"):
            raise ValueError(f"firmware must be bios or uefi, got {self.firmware!r}")
        if self.accel not in ("auto", "kvm", "tcg"):
            raise ValueError(f"accel must be auto, kvm or tcg, got {self.accel!r}")
        if self.memory_mb < 512:
            raise ValueError(f"memory_mb must be >= 512 (a desktop needs it), got {self.memory_mb}")
        if not 1 <= self.cpus <= 64:
            raise ValueError(f"cpus must be in 1..64, got {self.cpus}")


@dataclass(frozen=True, slots=True)
class Machine:
    """A MachineConfig resolved on this host: which accelerator, and why."""

    config: MachineConfig
    accel: str
    reason: str
    qemu_version: str

    @classmethod
    def detect(cls, config: MachineConfig) -> Machine:
        exe = shutil.which(QEMU)
        if exe is None:
            raise VMError(
                f"{QEMU} is not installed; `make sysdeps` installs Debian's qemu-system-x86"
            )
        out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
        m = re.search(r"version (\d+\.\d+(?:\.\d+)?)", out)
        version = m.group(1) if m else "unknown"
        flags = ""
        with contextlib.suppress(OSError):
            flags = Path("/proc/cpuinfo").read_text()
        hw = bool(re.search(r"\b(vmx|svm)\b", flags))
        kvm_ok = os.access("/dev/kvm", os.R_OK | os.W_OK)
        if config.accel == "tcg":
            return cls(config, "tcg", "software emulation (TCG), as asked", version)
        if config.accel == "kvm":
            if not kvm_ok:
                raise VMError("accel=kvm but /dev/kvm is missing or not writable by this user")
            return cls(config, "kvm", "KVM, as asked", version)
        if hw and kvm_ok:
            return cls(config, "kvm", "KVM: the CPU has vmx/svm and /dev/kvm is usable", version)
        why = (
            "the CPU has no vmx/svm flag (a paravirtual /dev/kvm cannot boot a stock kernel)"
            if kvm_ok
            else "/dev/kvm is not usable"
        )
        return cls(config, "tcg", f"software emulation (TCG): {why}", version)

    def key(self, image_key: str) -> str:
        """Identity of a snapshot: it loads only on the same image, hardware and QEMU."""
        c = self.config
        raw = json.dumps(
            [image_key, self.accel, c.memory_mb, c.cpus, c.width, c.height, self.qemu_version,
             c.firmware, sorted(GUEST_PORTS.values())]
        )  # fmt: skip
        return hashlib.sha256(raw.encode()).hexdigest()[:12]


def qemu_args(
    machine: Machine,
    *,
    name: str,
    disk: Path,
    folder: Path,
    port: int | None,
    kernel: Path | None,
    initrd: Path | None,
    append: str | None,
    loadvm: str | None = None,
    extra_ports: dict[str, int] | None = None,
    ram_file: Path | None = None,
    ram_shared: bool = True,
    incoming: bool = False,
    paused: bool = False,
) -> list[str]:
    """QEMU's command line for one VM (the same hardware for the golden boot, every copy,
    holder and clone, so saved states load in each).

    `port` None: no forwarded port (a holder, which never runs). `ram_file`: the guest's
    RAM in that file (id `pc.ram`, the id of QEMU's default RAM, so a state saved with
    anonymous RAM loads into it and back): `ram_shared` writes go to the file (a holder),
    else a private copy-on-write view of a file opened read-only (a clone). `incoming`:
    wait for a migration (`migrate-incoming`); `paused`: do not run after it (`-S`)."""
    c = machine.config
    accel = (
        ["-accel", "kvm", "-cpu", "host"]
        if machine.accel == "kvm"
        else ["-accel", "tcg", "-cpu", "max"]
    )
    restrict = "off" if c.internet else "on"
    fwd = [] if port is None else [f"hostfwd=tcp:127.0.0.1:{port}-:{GUEST_PORT}"]
    fwd += [
        f"hostfwd=tcp:127.0.0.1:{host}-:{GUEST_PORTS[k]}" for k, host in (extra_ports or {}).items()
    ]
    netdev = ",".join([f"user,id=n0,restrict={restrict}", *fwd])
    args = [
        QEMU,
        "-name", name,
        "-machine", "q35" if ram_file is None else "q35,memory-backend=pc.ram",
        *accel,
        "-m", str(c.memory_mb),
        "-smp", str(c.cpus),
        "-nodefaults",
        "-display", "none",
        "-vga", "none",
        "-drive", f"file={disk},if=virtio,format=qcow2,cache=unsafe,discard=unmap",
        "-netdev", netdev,
        "-device", "virtio-net-pci,netdev=n0",
        "-device", "virtio-rng-pci",
        "-serial", f"file:{folder / 'console.log'}",
        "-qmp", f"unix:{qmp_path(folder)},server=on,wait=off",
        "-pidfile", str(folder / "qemu.pid"),
    ]  # fmt: skip
    if c.firmware == "uefi":
        code = next((p for p in OVMF_CODE if Path(p).exists()), None)
        vars_ = next((p for p in OVMF_VARS if Path(p).exists()), None)
        if code is None or vars_ is None:
            raise VMError("firmware=uefi needs OVMF: `make sysdeps` installs Debian's ovmf")
        args += ["-drive", f"if=pflash,format=raw,readonly=on,file={code}",
                 "-drive", f"if=pflash,format=raw,readonly=on,file={vars_}"]  # fmt: skip
    if kernel is not None:
        args += ["-kernel", str(kernel), "-initrd", str(initrd)]
        args += ["-append", f"{append} arpo.width={c.width} arpo.height={c.height} quiet"]
    if ram_file is not None:
        mode = "share=on" if ram_shared else "share=off,readonly=on,rom=off"
        args += ["-object", f"memory-backend-file,id=pc.ram,size={c.memory_mb}M,"
                 f"mem-path={ram_file},{mode}"]  # fmt: skip
    if loadvm:
        args += ["-loadvm", loadvm]
    if incoming:
        args += ["-incoming", "defer"]
    if paused:
        args += ["-S"]
    return args


def qmp_path(folder: Path) -> Path:
    """The VM's QMP socket: in its folder, or in /tmp when that path is too long for a unix
    socket (108 bytes); the fleet's folder name is in it either way (for `down`)."""
    return _socket_path(folder, "qmp")


def _socket_path(folder: Path, what: str) -> Path:
    p = folder / f"{what}.sock"
    if len(str(p).encode()) < 100:
        return p
    digest = hashlib.sha256(str(folder).encode()).hexdigest()[:16]
    return Path(f"/tmp/arpo-{what}-{digest}.sock")


class QMP:
    """A QMP client on a unix socket: one command at a time, events skipped."""

    def __init__(self, path: Path):
        self.path = path
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()

    async def connect(self, deadline_s: float = 10.0) -> None:
        end = time.monotonic() + deadline_s
        while True:
            try:
                self._reader, self._writer = await asyncio.open_unix_connection(
                    str(self.path), limit=1 << 24
                )
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > end:
                    raise VMError(
                        f"QMP socket {self.path} did not open within {deadline_s} s"
                    ) from None
                await asyncio.sleep(0.05)
        await self._read()  # the greeting
        await self.execute("qmp_capabilities")

    async def _read(self) -> dict[str, Any]:
        assert self._reader is not None
        while True:
            line = await self._reader.readline()
            if not line:
                raise VMError("QMP connection closed (QEMU exited?)")
            msg = json.loads(line)
            if "event" not in msg:
                return msg

    async def execute(self, command: str, timeout_s: float = 60.0, **arguments: Any) -> Any:
        if self._writer is None:
            raise VMError("QMP is not connected")
        async with self._lock:
            msg: dict[str, Any] = {"execute": command}
            if arguments:
                msg["arguments"] = arguments
            self._writer.write(json.dumps(msg).encode() + b"\n")
            try:
                async with asyncio.timeout(timeout_s):
                    await self._writer.drain()
                    reply = await self._read()
            except TimeoutError:
                raise VMError(f"QMP {command} gave no answer within {timeout_s} s") from None
        if "error" in reply:
            raise VMError(f"QMP {command}: {reply['error'].get('desc', reply['error'])}")
        return reply.get("return")

    async def hmp(self, line: str, timeout_s: float = 120.0) -> str:
        """A human-monitor command (savevm / loadvm); its text output, empty on success."""
        out = await self.execute("human-monitor-command", timeout_s, **{"command-line": line})
        return str(out or "").strip()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
        self._writer = self._reader = None


class QemuVM:
    """One QEMU process, its folder (overlay, QMP socket, console log, pid file) and port."""

    def __init__(
        self,
        name: str,
        folder: Path,
        machine: Machine,
        port: int,
        *,
        base: Path,
        kernel: Path | None,
        initrd: Path | None,
        append: str | None,
        extra_ports: dict[str, int] | None = None,
        backing: Path | None = None,
    ):
        self.name = name
        self.extra_ports = dict(extra_ports or {})
        """Host ports of the guest's other services (GUEST_PORTS' keys but "server")."""
        self.folder = folder
        self.machine = machine
        self.port = port
        self.base = base
        """The image's base disk (never written)."""
        self.backing = backing or base
        """The backing file of the VM's overlay: the base, or for a clone its saved disk."""
        self.kernel, self.initrd, self.append = kernel, initrd, append
        self.proc: asyncio.subprocess.Process | None = None
        self.qmp: QMP | None = None
        self.started_at = 0.0

    @property
    def disk(self) -> Path:
        return self.folder / "overlay.qcow2"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self, *, overlay_from: Path | None = None, loadvm: str | None = None) -> None:
        """Make the overlay (a copy of `overlay_from`, else a new one on the base image) and
        start QEMU; returns once QMP answers (the guest may still be booting)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in (qmp_path(self.folder), self.folder / "qemu.pid", self.disk):
            stale.unlink(missing_ok=True)
        if overlay_from is not None:
            await asyncio.to_thread(_copy_sparse, overlay_from, self.disk)
        else:
            await _new_overlay(self.backing, self.disk)
        await self._spawn(loadvm=loadvm)

    async def start_clone(self, saved: SavedState, timeout_s: float) -> float:
        """Start this VM in the saved state (a clone): a new overlay on the saved disk, the
        saved RAM mapped copy-on-write, the device state loaded; returns once the guest runs
        (seconds). VMError (and QEMU killed) if any of it fails."""
        t0 = time.perf_counter()
        self.folder.mkdir(parents=True, exist_ok=True)
        await _new_overlay(saved.disk, self.disk)
        await self._spawn(ram_file=saved.ram, ram_shared=False, incoming=True)
        assert self.qmp is not None
        try:
            await _capability(self.qmp, "x-ignore-shared", True)
            await self.qmp.execute("migrate-incoming", uri=f"file:{saved.state}")
            await _migration_done(self.qmp, timeout_s, f"{self.name}: loading the saved state")
            # off again: a later snapshot of this clone must send its (private) RAM
            await _capability(self.qmp, "x-ignore-shared", False)
            await self.qmp.execute("cont")  # the state was saved paused
        except (VMError, OSError) as e:
            await self.kill()
            raise VMError(f"{self.name}: {e} ({self.log_tail()})") from None
        return time.perf_counter() - t0

    async def _spawn(self, **extra: Any) -> None:
        """Start QEMU on the overlay; returns once QMP answers."""
        for stale in (qmp_path(self.folder), self.folder / "qemu.pid"):
            stale.unlink(missing_ok=True)
        args = qemu_args(
            self.machine,
            name=self.name,
            disk=self.disk,
            folder=self.folder,
            port=self.port,
            kernel=self.kernel,
            initrd=self.initrd,
            append=self.append,
            extra_ports=self.extra_ports,
            **extra,
        )
        self.proc, self.qmp = await _spawn(args, self.folder, self.name)
        self.started_at = time.monotonic()

    def log_tail(self, n: int = 3) -> str:
        return _log_tail(self.folder, n)

    async def savevm(self, tag: str) -> float:
        return await self._snapshot("savevm", tag)

    async def loadvm(self, tag: str) -> float:
        return await self._snapshot("loadvm", tag)

    async def _snapshot(self, verb: str, tag: str) -> float:
        if not self.alive() or self.qmp is None:
            raise VMError(f"{self.name}: {verb} on a VM whose QEMU is not running")
        t0 = time.perf_counter()
        out = await self.qmp.hmp(f"{verb} {tag}")
        if out:  # HMP prints only errors for these
            raise VMError(f"{self.name}: {verb} {tag}: {out}")
        status = await self.qmp.execute("query-status")
        if status.get("status") != "running":
            await self.qmp.execute("cont")
        return time.perf_counter() - t0

    async def quit(self, timeout_s: float = 10.0) -> None:
        """Ask QEMU to exit (the overlay is flushed), else kill it."""
        if self.alive() and self.qmp is not None:
            with contextlib.suppress(VMError, OSError):
                await self.qmp.execute("quit", timeout_s=timeout_s)
        await self.kill(grace_s=timeout_s)

    async def kill(self, grace_s: float = 0.0) -> None:
        if self.qmp is not None:
            await self.qmp.close()
            self.qmp = None
        if self.proc is not None:
            if self.proc.returncode is None and grace_s > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(grace_s):
                        await self.proc.wait()
            if self.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signal.SIGKILL)
                await self.proc.wait()

    def remove_files(self) -> None:
        qmp_path(self.folder).unlink(missing_ok=True)
        shutil.rmtree(self.folder, ignore_errors=True)


@dataclass(frozen=True, slots=True)
class SavedState:
    """A VM's state frozen for clones (`save_state`); none of it is a running VM's."""

    folder: Path
    """Holds `state` and `disk` (and the clones' folders, when the fleet puts them there)."""
    state: Path
    """The device state: a migration stream without the RAM (x-ignore-shared)."""
    ram: Path
    """The guest's RAM as a file (tmpfs, sparse), mapped read-only and copy-on-write by clones."""
    disk: Path
    """The disk at that moment: a qcow2 on the image's base (read-only)."""

    def ram_bytes(self) -> int:
        """Host memory the RAM file holds (its allocated blocks)."""
        try:
            return self.ram.stat().st_blocks * 512
        except OSError:
            return 0


async def save_state(
    vm: QemuVM, folder: Path, ram: Path, timeout_s: float
) -> tuple[SavedState, dict[str, float]]:
    """Save the running `vm`'s state for clones (module docstring, *Save*) and let it go on;
    (the saved state, seconds of each part). The VM is paused from the start to `cont`
    (`paused_s`). VMError if anything fails: what was made is removed and the VM resumed."""
    if not vm.alive() or vm.qmp is None:
        raise VMError(f"{vm.name}: snapshot of a VM whose QEMU is not running")
    t0 = time.perf_counter()
    folder.mkdir(parents=True)
    ram.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # guest memory: ours alone
    saved = SavedState(folder, folder / "state.mig", ram, folder / "disk.qcow2")
    hold_dir = folder / "holder"
    hold_dir.mkdir()
    sock = _socket_path(hold_dir, "migrate")
    times: dict[str, float] = {}
    holder: tuple[asyncio.subprocess.Process, QMP] | None = None
    q = vm.qmp
    paused = multifd = False
    try:
        # the holder: the same hardware, paused, RAM shared into `ram`, waiting for the state
        await _new_overlay(vm.base, hold_dir / "overlay.qcow2")  # never written: it never runs
        args = qemu_args(vm.machine, name=f"{vm.name}-holder", disk=hold_dir / "overlay.qcow2",
                         folder=hold_dir, port=None, kernel=vm.kernel, initrd=vm.initrd,
                         append=vm.append, ram_file=ram, ram_shared=True, incoming=True,
                         paused=True)  # fmt: skip
        holder = await _spawn(args, hold_dir, f"{vm.name}-holder")
        hq = holder[1]
        for side in (hq, q):
            multifd = True  # on the VM (its reverts need it off again), whatever happens next
            await _capability(side, "multifd", True)
            await side.execute("migrate-set-parameters", **{
                "multifd-channels": MULTIFD_CHANNELS, "max-bandwidth": MIGRATE_MAX_BANDWIDTH})  # fmt: skip
        await hq.execute("migrate-incoming", uri=f"unix:{sock}")
        times["holder_s"] = time.perf_counter() - t0

        t1 = time.perf_counter()
        await q.execute("stop")
        paused = True
        try:
            await q.execute("migrate", uri=f"unix:{sock}")
            info = await _migration_done(q, timeout_s, f"{vm.name}: saving its state")
        except VMError:
            with contextlib.suppress(VMError, OSError):
                await q.execute("migrate_cancel")
                await _migration_done(q, 10.0, "", settled=True)
            raise
        times["transfer_s"] = time.perf_counter() - t1
        times["ram_mib"] = info.get("ram", {}).get("transferred", 0) / 2**20
        # the VM's block devices are flushed and inactive now: its overlay is a stable file
        t2 = time.perf_counter()
        await _check_call(["qemu-img", "convert", "-U", "-f", "qcow2", "-O", "qcow2",
                           "-B", str(vm.backing.resolve()), "-F", "qcow2", str(vm.disk),
                           str(saved.disk)])  # fmt: skip
        if vm.backing.resolve() != vm.base.resolve():  # a clone: stand on the base alone
            await _check_call(["qemu-img", "rebase", "-f", "qcow2", "-b", str(vm.base.resolve()),
                               "-F", "qcow2", str(saved.disk)])  # fmt: skip
        times["disk_s"] = time.perf_counter() - t2
        await _capability(q, "multifd", False)
        multifd = False
        await q.execute("cont")
        paused = False
        times["paused_s"] = time.perf_counter() - t1

        t3 = time.perf_counter()
        await _migration_done(hq, timeout_s, f"{vm.name}-holder: receiving the state")
        await _capability(hq, "multifd", False)
        await _capability(hq, "x-ignore-shared", True)
        await hq.execute("migrate", uri=f"file:{saved.state}")
        await _migration_done(hq, timeout_s, f"{vm.name}-holder: saving the device state")
        times["device_state_s"] = time.perf_counter() - t3
    except BaseException as e:
        _unlink_quietly(ram)
        shutil.rmtree(folder, ignore_errors=True)
        if isinstance(e, OSError):  # QMP's socket closed under us: QEMU died
            raise VMError(f"{vm.name}: snapshot failed: {type(e).__name__}: {e}") from e
        raise
    finally:  # after a failure the VM goes on as it was
        if multifd:
            with contextlib.suppress(VMError, OSError):
                await _capability(q, "multifd", False)
        if paused:
            with contextlib.suppress(VMError, OSError):
                await q.execute("cont")
        if holder is not None:
            await _end(*holder)
        shutil.rmtree(hold_dir, ignore_errors=True)
        sock.unlink(missing_ok=True)
        qmp_path(hold_dir).unlink(missing_ok=True)
    for p in (saved.disk, saved.state):
        p.chmod(0o444)
    times["total_s"] = time.perf_counter() - t0
    times["ram_file_mib"] = saved.ram_bytes() / 2**20
    return saved, times


async def compact_ram(ram: Path) -> int:
    """Give back the zero pages of a saved RAM file (bytes freed). A snapshot of a clone
    reads every page of the clone, and a read of a tmpfs hole through the clones' mappings
    allocates a zero page in the file: after one, the file holds the whole guest memory.
    Safe while clones run: nobody writes the file, and a clone that reads a punched page
    again gets a zero page. Costs a read of the file (about 1 s per 1.5 GB here), at low
    CPU priority."""
    before = ram.stat().st_blocks * 512
    p = await asyncio.create_subprocess_exec(
        "nice", "-n", "19", "fallocate", "--dig-holes", str(ram),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    _, err = await p.communicate()
    if p.returncode != 0:
        raise VMError(f"fallocate --dig-holes {ram} failed: {err.decode()[-300:]}")
    return before - ram.stat().st_blocks * 512


async def _spawn(
    args: list[str], folder: Path, name: str
) -> tuple[asyncio.subprocess.Process, QMP]:
    """Start QEMU with `args` (its log in `folder`); returns once QMP answers."""
    (folder / "cmdline.json").write_text(json.dumps(args))
    with open(folder / "qemu.log", "ab") as errf:
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=subprocess.DEVNULL,
            stdout=errf,
            stderr=errf,
            preexec_fn=set_parent_death_signal,  # dies with the fleet, even by SIGKILL
        )
    qmp = QMP(qmp_path(folder))
    try:
        await qmp.connect()
    except (VMError, OSError):
        await asyncio.sleep(0.2)
        await _end(proc, qmp)
        raise VMError(f"{name}: QEMU did not start: {_log_tail(folder)}") from None
    return proc, qmp


async def _end(proc: asyncio.subprocess.Process, qmp: QMP) -> None:
    await qmp.close()
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
    await proc.wait()


async def _capability(qmp: QMP, name: str, on: bool) -> None:
    await qmp.execute("migrate-set-capabilities", capabilities=[{"capability": name, "state": on}])


async def _migration_done(
    qmp: QMP, timeout_s: float, what: str, settled: bool = False
) -> dict[str, Any]:
    """`query-migrate` until the migration (either side) completed; VMError if it failed or
    took longer than `timeout_s`. `settled`: until it is over, however it ended."""
    end = time.monotonic() + timeout_s
    while True:
        info = await qmp.execute("query-migrate")
        status = info.get("status")
        if status == "completed" or (settled and status in (None, "failed", "cancelled")):
            return info
        if status in ("failed", "cancelled"):
            raise VMError(f"{what}: migration {status}: {info.get('error-desc', '')}")
        if time.monotonic() > end:
            raise VMError(f"{what}: migration not done within {timeout_s:.0f} s ({status})")
        await asyncio.sleep(0.01)


async def _new_overlay(backing: Path, disk: Path) -> None:
    await _check_call(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(backing.resolve()),
                       "-F", "qcow2", str(disk)])  # fmt: skip


def _log_tail(folder: Path, n: int = 3) -> str:
    try:
        lines = (folder / "qemu.log").read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no qemu.log)"
    return " | ".join(lines[-n:]) or "(qemu.log is empty)"


def _unlink_quietly(p: Path) -> None:
    with contextlib.suppress(OSError):
        p.unlink()


def _copy_sparse(src: Path, dst: Path) -> None:
    tmp = dst.with_suffix(".copying")
    subprocess.run(
        ["cp", "--reflink=auto", "--sparse=always", str(src), str(tmp)],
        check=True,
        capture_output=True,
    )
    os.replace(tmp, dst)


async def _check_call(cmd: list[str]) -> None:
    p = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = await p.communicate()
    if p.returncode != 0:
        raise VMError(f"{' '.join(cmd[:3])} failed ({p.returncode}): {out.decode()[-300:]}")

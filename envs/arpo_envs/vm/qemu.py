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

from arpo_envs.desktop.procs import set_parent_death_signal

log = logging.getLogger("arpo_envs.vm.qemu")

QEMU = "qemu-system-x86_64"
GUEST_PORT = 5000
GUEST_PORTS = {"server": 5000, "chromium": 9222, "vlc": 8080}
"""Guest ports forwarded from 127.0.0.1: OSWorld's server, Chrome's debugging port and VLC's
web interface (the ports OSWorld's docker provider publishes, but for its VNC view)."""
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
    port: int,
    kernel: Path | None,
    initrd: Path | None,
    append: str | None,
    loadvm: str | None = None,
    extra_ports: dict[str, int] | None = None,
) -> list[str]:
    """QEMU's command line for one VM (the same for the golden boot and every copy, so the
    snapshot's devices match)."""
    c = machine.config
    accel = (
        ["-accel", "kvm", "-cpu", "host"]
        if machine.accel == "kvm"
        else ["-accel", "tcg", "-cpu", "max"]
    )
    restrict = "off" if c.internet else "on"
    fwd = [f"hostfwd=tcp:127.0.0.1:{port}-:{GUEST_PORT}"]
    fwd += [
        f"hostfwd=tcp:127.0.0.1:{host}-:{GUEST_PORTS[k]}" for k, host in (extra_ports or {}).items()
    ]
    args = [
        QEMU,
        "-name", name,
        "-machine", "q35",
        *accel,
        "-m", str(c.memory_mb),
        "-smp", str(c.cpus),
        "-nodefaults",
        "-display", "none",
        "-vga", "none",
        "-drive", f"file={disk},if=virtio,format=qcow2,cache=unsafe,discard=unmap",
        "-netdev", f"user,id=n0,restrict={restrict},{','.join(fwd)}",
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
    if loadvm:
        args += ["-loadvm", loadvm]
    return args


def qmp_path(folder: Path) -> Path:
    """The VM's QMP socket: in its folder, or in /tmp when that path is too long for a unix
    socket (108 bytes); the fleet's folder name is in it either way (for `down`)."""
    p = folder / "qmp.sock"
    if len(str(p).encode()) < 100:
        return p
    digest = hashlib.sha256(str(folder).encode()).hexdigest()[:16]
    return Path(f"/tmp/arpo-qmp-{digest}.sock")


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
    ):
        self.name = name
        self.extra_ports = dict(extra_ports or {})
        """Host ports of the guest's other services (GUEST_PORTS' keys but "server")."""
        self.folder = folder
        self.machine = machine
        self.port = port
        self.base = base
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
            await _check_call(
                ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(self.base.resolve()),
                 "-F", "qcow2", str(self.disk)]
            )  # fmt: skip
        args = qemu_args(
            self.machine,
            name=self.name,
            disk=self.disk,
            folder=self.folder,
            port=self.port,
            kernel=self.kernel,
            initrd=self.initrd,
            append=self.append,
            loadvm=loadvm,
            extra_ports=self.extra_ports,
        )
        (self.folder / "cmdline.json").write_text(json.dumps(args))
        with open(self.folder / "qemu.log", "ab") as errf:
            self.proc = await asyncio.create_subprocess_exec(
                *args,
                stdin=subprocess.DEVNULL,
                stdout=errf,
                stderr=errf,
                preexec_fn=set_parent_death_signal,  # dies with the fleet, even by SIGKILL
            )
        self.started_at = time.monotonic()
        self.qmp = QMP(qmp_path(self.folder))
        try:
            await self.qmp.connect()
        except VMError:
            await asyncio.sleep(0.2)
            raise VMError(f"{self.name}: QEMU did not start: {self.log_tail()}") from None

    def log_tail(self, n: int = 3) -> str:
        try:
            lines = (self.folder / "qemu.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no qemu.log)"
        return " | ".join(lines[-n:]) or "(qemu.log is empty)"

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

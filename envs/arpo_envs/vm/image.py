"""The project's test VM image, built from Debian's packages: `arpo-envs vm build`.

    arpo-envs vm build                 # once; later calls reuse the cache (seconds)
    arpo-envs vm build --force         # rebuild everything

The image is a Debian bookworm desktop that speaks OSWorld's VM protocol on port 5000:
Xvfb, openbox, LibreOffice Calc, mousepad, xterm and the project's desktop server
(`arpo_envs.desktop.server`), started by a small PID 1 (`guest_init.py`) instead of
systemd. Nothing is downloaded but Debian's packages (debootstrap from the Debian mirror)
and the Python packages the desktop server needs, taken from this machine's environment
(they came from PyPI: aiohttp, pillow, mss, pyautogui, python-xlib and their
dependencies); the guest's python3 is 3.11, as here.

Steps, each logged by name; a failing step says which one failed and where its log is:

1. `debootstrap`: `--variant=minbase` with `PACKAGES` into `<cache>/rootfs-<key>` (key:
   the suite, mirror and package list; 5-10 min on a 2-core machine, the longest step);
2. `configure`: an initramfs with only the modules a QEMU VM needs (virtio, ext4), the
   user `user` with password `password` (OSWorld's), hostname, apt caches dropped;
3. `project`: the desktop server, its Python packages and the guest's PID 1 copied in
   (`/usr/local/lib/python3.11/dist-packages`, `/usr/local/sbin/arpo-guest-init`);
4. `filesystem`: `mke2fs -t ext4 -d rootfs` (no mount needed) into a raw disk,
   converted to `base.qcow2`, with the kernel and initrd beside it for direct boot.

Steps 3-4 make `<cache>/image-<key>` (key: step 1's plus a hash of the project files), so
a change of the server's code costs about a minute, not a new debootstrap. A build
holds a lock on the cache; a second build waits for it. The cache is
`$ARPO_VM_CACHE`, default `~/.cache/arpo-envs/vm`, outside the repository.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata as md
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("arpo_envs.vm.image")

RECIPE_VERSION = 2
"""Bump when the steps change in a way the package list and files do not show."""

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = (
    "linux-image-amd64",
    "initramfs-tools",
    "iproute2",
    "procps",
    "sudo",
    "python3",
    "python3-tk",
    "dbus-x11",
    "xvfb",
    "openbox",
    "xterm",
    "mousepad",
    "x11-utils",
    "x11-xserver-utils",
    "xdotool",
    "wmctrl",
    "fonts-dejavu-core",
    "libreoffice-calc",
)
"""Debian packages of the image (without their recommendations)."""

INITRAMFS_MODULES = ("virtio_pci", "virtio_blk", "virtio_net", "virtio_rng", "ext4")
GUEST_USER, GUEST_PASSWORD = "user", "password"
FREE_SPACE_MB = 1024
"""Free space left in the root filesystem for what tasks write."""


class BuildError(RuntimeError):
    """A build step failed; the message names the step and its log."""


def cache_root() -> Path:
    return Path(os.environ.get("ARPO_VM_CACHE") or Path.home() / ".cache" / "arpo-envs" / "vm")


@dataclass(frozen=True, slots=True)
class Image:
    """A built image: what a VM boots."""

    dir: Path
    disk: Path
    """base.qcow2: the root filesystem; every VM runs on a copy-on-write overlay of it."""
    kernel: Path
    initrd: Path
    append: str
    """Kernel command line (root device, init, console); the fleet adds the screen size."""
    key: str
    build_seconds: float
    disk_bytes: int

    @classmethod
    def load(cls, d: Path) -> Image:
        m = json.loads((d / "manifest.json").read_text())
        return cls(
            dir=d,
            disk=d / "base.qcow2",
            kernel=d / "vmlinuz",
            initrd=d / "initrd.img",
            append=m["append"],
            key=m["key"],
            build_seconds=float(m["build_seconds"]),
            disk_bytes=int(m["disk_bytes"]),
        )


def _sha(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:16]


def rootfs_key() -> str:
    return _sha(str(RECIPE_VERSION), SUITE, MIRROR, *PACKAGES, *INITRAMFS_MODULES)


# ---- the Python packages of the desktop server -----------------------------------------


def _requirements(dist: str, extras: tuple[str, ...] = ()) -> set[str]:
    """Names of every distribution `dist` (with `extras`) needs, recursively, installed here."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo: list[tuple[str, tuple[str, ...]]] = [(dist, extras)]
    while todo:
        name, ex = todo.pop()
        try:
            d = md.distribution(name)
        except md.PackageNotFoundError as e:
            raise BuildError(
                f"project: the desktop server needs {name!r}, which is not installed here "
                "(run `make setup`, or `pip install -e 'envs[desktop]'`)"
            ) from e
        for r in d.requires or []:
            req = Requirement(r)
            envs = [{"extra": e} for e in ex] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(e) for e in envs):
                continue
            key = req.name.lower().replace("_", "-")
            if key not in seen:
                seen.add(key)
                todo.append((req.name, tuple(req.extras)))
    return seen


def _dist_files(names: set[str]) -> list[tuple[Path, str]]:
    """(absolute source, path relative to site-packages) of every file of `names`."""
    out: list[tuple[Path, str]] = []
    for name in sorted(names):
        d = md.distribution(name)
        for f in d.files or []:
            rel = str(f)
            if rel.startswith("..") or "__pycache__" in rel:
                continue  # scripts in bin/, byte code
            src = Path(str(d.locate_file(f)))
            if src.is_file():
                out.append((src, rel))
    return out


HOST_ONLY = (
    "vm/fleet.py",
    "vm/control.py",
    "vm/supervisor.py",
    "vm/qemu.py",
    "vm/image.py",
)
"""Modules of arpo_envs that run on the host only (they start VMs): left out of the guest,
so changing them neither rebuilds the image nor invalidates its golden snapshot."""


def _project_files() -> list[tuple[Path, str]]:
    """Files copied into the guest's dist-packages: arpo_envs (but HOST_ONLY) and its
    dependencies."""
    import arpo_envs

    pkg = Path(arpo_envs.__file__).parent
    files = [
        (p, str(Path("arpo_envs") / p.relative_to(pkg)))
        for p in sorted(pkg.rglob("*"))
        if p.is_file()
        and "__pycache__" not in p.parts
        and p.relative_to(pkg).as_posix() not in HOST_ONLY
    ]
    return files + _dist_files(_requirements("arpo-envs", ("desktop",)))


def image_key(files: list[tuple[Path, str]] | None = None) -> str:
    files = _project_files() if files is None else files
    h = hashlib.sha256()
    for src, rel in files:
        h.update(rel.encode() + b"\0" + src.read_bytes() + b"\0")
    return _sha(rootfs_key(), h.hexdigest(), sys.version.split()[0].rsplit(".", 1)[0])


# ---- steps ------------------------------------------------------------------------------


@contextlib.contextmanager
def _lock(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(step: str, cmd: list[str], logf: Path, timeout: float = 3600.0) -> None:
    """Run one command of `step`, appending its output to `logf`; BuildError names both."""
    with open(logf, "ab") as out:
        out.write(f"\n$ {' '.join(cmd)}\n".encode())
        out.flush()
        try:
            r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
        except FileNotFoundError as e:
            raise BuildError(
                f"{step}: {cmd[0]} is not installed (make sysdeps installs debootstrap, "
                "qemu-utils and qemu-system-x86)"
            ) from e
        except subprocess.TimeoutExpired as e:
            raise BuildError(
                f"{step}: {' '.join(cmd[:3])} ran over {timeout:.0f} s; see {logf}"
            ) from e
    if r.returncode != 0:
        tail = logf.read_text(errors="replace").strip().splitlines()[-5:]
        raise BuildError(
            f"{step}: `{' '.join(cmd[:4])} ...` exited with {r.returncode}; see {logf}:\n  "
            + "\n  ".join(tail)
        )


def _check_tools() -> None:
    if os.geteuid() != 0:
        raise BuildError(
            "debootstrap: building the image needs root (debootstrap, chroot); run "
            "`sudo arpo-envs vm build`, or use an image built elsewhere (--image)"
        )
    missing = [t for t in ("debootstrap", "mke2fs", "qemu-img") if shutil.which(t) is None]
    if missing:
        raise BuildError(
            f"tools: {', '.join(missing)} not found; `make sysdeps` installs debootstrap, "
            "e2fsprogs and qemu-utils"
        )


def _debootstrap(root: Path, logf: Path) -> Path:
    target = root / f"rootfs-{rootfs_key()}"
    if (target / ".complete").exists():
        return target
    tmp = root / f"rootfs-{rootfs_key()}.partial"
    _remove_tree(tmp)
    log.info("vm build: debootstrap %s (minbase) into %s", SUITE, tmp)
    _run("debootstrap", ["debootstrap", "--variant=minbase", SUITE, str(tmp), MIRROR], logf)
    # apt's resolver in the chroot (debootstrap's own picks wrong alternatives, e.g.
    # libreoffice-core-nogui for Calc)
    log.info("vm build: apt-get install (%d packages)", len(PACKAGES))
    (tmp / "usr" / "sbin" / "policy-rc.d").write_text("#!/bin/sh\nexit 101\n")
    (tmp / "usr" / "sbin" / "policy-rc.d").chmod(0o755)
    with _chroot_mounts(tmp, logf):
        env = ["env", "DEBIAN_FRONTEND=noninteractive", "LC_ALL=C"]
        _run("apt-get install", ["chroot", str(tmp), *env, "apt-get", "update", "-q"], logf)
        _run(
            "apt-get install",
            ["chroot", str(tmp), *env, "apt-get", "install", "-y", "-q",
             "--no-install-recommends", *PACKAGES],
            logf,
        )  # fmt: skip
    _configure(tmp, logf)
    (tmp / ".complete").write_text(time.strftime("%Y-%m-%dT%H:%M:%S"))
    _remove_tree(target)
    tmp.rename(target)
    return target


@contextlib.contextmanager
def _chroot_mounts(rootfs: Path, logf: Path) -> Iterator[None]:
    """/proc, /sys and /dev of the host inside the chroot, for apt and its triggers."""
    done: list[Path] = []
    try:
        for src, opts in (("/proc", ["-t", "proc", "proc"]), ("/sys", ["--rbind", "/sys"]),
                          ("/dev", ["--rbind", "/dev"])):  # fmt: skip
            target = rootfs / src.lstrip("/")
            target.mkdir(exist_ok=True)
            _run("chroot mounts", ["mount", *opts, str(target)], logf)
            done.append(target)
        yield
    finally:
        for target in reversed(done):
            subprocess.run(["umount", "-R", "-l", str(target)], capture_output=True)


def _configure(rootfs: Path, logf: Path) -> None:
    step = "configure"
    log.info("vm build: configure (initramfs, user, hostname)")
    conf = rootfs / "etc" / "initramfs-tools"
    (conf / "initramfs.conf").write_text(
        re.sub(
            r"(?m)^MODULES=.*$",
            "MODULES=list",
            (conf / "initramfs.conf").read_text(),
        )
    )
    (conf / "modules").write_text("\n".join(INITRAMFS_MODULES) + "\n")
    with _chroot_mounts(rootfs, logf):
        _run(step, ["chroot", str(rootfs), "update-initramfs", "-u", "-k", "all"], logf, 900)
    (rootfs / "etc" / "hostname").write_text("arpo-vm\n")
    (rootfs / "etc" / "hosts").write_text("127.0.0.1 localhost\n127.0.1.1 arpo-vm\n")
    (rootfs / "etc" / "fstab").write_text("/dev/vda / ext4 rw,relatime 0 1\n")
    _run(step, ["chroot", str(rootfs), "useradd", "-m", "-s", "/bin/bash", GUEST_USER], logf)
    subprocess.run(
        ["chroot", str(rootfs), "chpasswd"],
        input=f"{GUEST_USER}:{GUEST_PASSWORD}\nroot:{GUEST_PASSWORD}\n".encode(),
        check=True,
        capture_output=True,
    )
    (rootfs / "etc" / "sudoers.d" / "arpo").write_text(f"{GUEST_USER} ALL=(ALL) NOPASSWD:ALL\n")
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man"):
        p = rootfs / junk
        if p.is_dir():
            for child in p.iterdir():
                if child.is_dir() and child.name != "partial":
                    shutil.rmtree(child, ignore_errors=True)
                elif child.is_file():
                    child.unlink()


def _remove_tree(path: Path) -> None:
    """Remove a rootfs folder; first unmount anything a killed build left mounted in it."""
    if not path.exists():
        return
    for sub in ("proc", "sys", "dev"):
        subprocess.run(["umount", "-R", "-l", str(path / sub)], capture_output=True)
    shutil.rmtree(path, ignore_errors=True)


def _project(rootfs: Path, files: list[tuple[Path, str]]) -> None:
    log.info("vm build: project files (%d) into the image", len(files))
    site = rootfs / "usr" / "local" / "lib" / "python3.11" / "dist-packages"
    shutil.rmtree(site, ignore_errors=True)
    for src, rel in files:
        dst = site / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    init = rootfs / "usr" / "local" / "sbin" / "arpo-guest-init"
    init.parent.mkdir(parents=True, exist_ok=True)
    body = (Path(__file__).parent / "guest_init.py").read_text()
    init.write_text("#!/usr/bin/python3\n" + body)
    init.chmod(0o755)


def _du_bytes(path: Path) -> int:
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def _filesystem(rootfs: Path, out: Path, logf: Path) -> int:
    step = "filesystem"
    log.info("vm build: ext4 filesystem and qcow2 image")
    raw = out / "disk.raw"
    size_mb = _du_bytes(rootfs) * 12 // 10 // (1 << 20) + FREE_SPACE_MB
    _run(
        step,
        ["mke2fs", "-q", "-F", "-t", "ext4", "-L", "arpo-root", "-d", str(rootfs), str(raw),
         f"{size_mb}M"],
        logf,
    )  # fmt: skip
    _run(step, ["qemu-img", "convert", "-O", "qcow2", str(raw), str(out / "base.qcow2")], logf)
    raw.unlink()
    boot = rootfs / "boot"
    kernels = sorted(boot.glob("vmlinuz-*"))
    initrds = sorted(boot.glob("initrd.img-*"))
    if not kernels or not initrds:
        raise BuildError(f"{step}: no kernel or initrd in {boot} (did linux-image-amd64 install?)")
    shutil.copy2(kernels[-1], out / "vmlinuz")
    shutil.copy2(initrds[-1], out / "initrd.img")
    return (out / "base.qcow2").stat().st_size


def build(force: bool = False, root: Path | None = None) -> Image:
    """The test image, from the cache when its recipe and files have not changed."""
    root = root or cache_root()
    with _lock(root):
        files = _project_files()
        key = image_key(files)
        out = root / f"image-{key}"
        if not force and (out / "manifest.json").exists():
            return Image.load(out)
        _check_tools()
        t0 = time.monotonic()
        logf = root / f"build-{key}.log"
        logf.write_text("")
        if force:
            _remove_tree(root / f"rootfs-{rootfs_key()}")
        rootfs = _debootstrap(root, logf)
        _project(rootfs, files)
        tmp = root / f"image-{key}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        size = _filesystem(rootfs, tmp, logf)
        manifest = {
            "key": key,
            "rootfs_key": rootfs_key(),
            "suite": SUITE,
            "packages": list(PACKAGES),
            "append": "root=/dev/vda rw console=ttyS0 net.ifnames=0 "
            "init=/usr/local/sbin/arpo-guest-init",
            "build_seconds": round(time.monotonic() - t0, 1),
            "disk_bytes": size,
            "built": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "user": GUEST_USER,
            "password": GUEST_PASSWORD,
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        for old in root.glob("image-*"):  # earlier builds that no running fleet uses
            if old != out and old.is_dir() and not _in_use(old):
                shutil.rmtree(old, ignore_errors=True)
        for old in root.glob("build-*.log"):
            if old != logf:
                old.unlink(missing_ok=True)
        for old in root.glob("rootfs-*"):  # earlier package lists
            if old != rootfs and old.is_dir():
                _remove_tree(old)
        log.info("vm build: %s in %.0f s (%d MB)", out, manifest["build_seconds"], size >> 20)
        return Image.load(out)


def hold(img: Image) -> int:
    """A shared lock on the image, held by a fleet while it runs (the file descriptor; it is
    released when the process exits): a build never deletes an image a fleet uses."""
    fd = os.open(img.dir / ".in-use", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _in_use(d: Path) -> bool:
    try:
        fd = os.open(d / ".in-use", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def describe(img: Image) -> dict[str, object]:
    d = asdict(img)
    return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}

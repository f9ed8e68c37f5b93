"""PID 1 of the project's test VM image: mounts, network, and the desktop server, kept alive.

The image boots straight into this script (`init=/usr/local/sbin/arpo-guest-init` on the
kernel command line, see `image.py`); there is no systemd, which about halves a cold boot
under software emulation. It uses the standard library only (the guest's python3).

What it does, in order:

1. mounts /proc, /sys, /dev (devtmpfs), /dev/pts, /dev/shm, /run and /tmp (tmpfs);
2. brings up `lo` and `eth0` with QEMU user-mode networking's fixed addresses (guest
   10.0.2.15/24, gateway 10.0.2.2, DNS 10.0.2.3);
3. starts the desktop server (`python3 -m arpo_envs.desktop.server`) on 0.0.0.0:5000, the
   port of OSWorld's VM server, with the screen size of the kernel command line
   (`arpo.width=`, `arpo.height=`); it is reachable only through the host's forwarded
   port, which the fleet binds to 127.0.0.1 (see `qemu.py`);
4. reaps every orphan (it is PID 1) and starts the server again when it exits, with a
   capped backoff;
5. on SIGTERM or SIGINT: stops the server, syncs the disks and powers the guest off.

Every line it writes goes to the serial console, which the fleet keeps in the VM's
folder as `console.log`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

SERVER_PORT = 5000
GUEST_ADDR = "10.0.2.15/24"
GATEWAY = "10.0.2.2"
DNS = "10.0.2.3"
DESKTOP_ROOT = "/var/lib/arpo-desktop"
RB_POWER_OFF = 0x4321FEDC


def say(msg: str) -> None:
    line = f"arpo-guest: {msg}\n"
    try:
        with open("/dev/console", "w") as f:
            f.write(line)
    except OSError:
        sys.stderr.write(line)


def run(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        say(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[:200]}")


def mount_all() -> None:
    for src, target, fstype, opts in (
        ("proc", "/proc", "proc", "nosuid,nodev,noexec"),
        ("sysfs", "/sys", "sysfs", "nosuid,nodev,noexec"),
        ("devtmpfs", "/dev", "devtmpfs", "mode=0755,nosuid"),
        ("devpts", "/dev/pts", "devpts", "gid=5,mode=620,ptmxmode=666"),
        ("tmpfs", "/dev/shm", "tmpfs", "nosuid,nodev,mode=1777"),
        ("tmpfs", "/run", "tmpfs", "nosuid,nodev,mode=0755"),
        ("tmpfs", "/tmp", "tmpfs", "nosuid,nodev,mode=1777"),
    ):
        os.makedirs(target, exist_ok=True)
        if os.path.ismount(target):
            continue
        run("mount", "-t", fstype, "-o", opts, src, target)


def network() -> None:
    run("ip", "link", "set", "lo", "up")
    run("ip", "link", "set", "eth0", "up")
    run("ip", "addr", "add", GUEST_ADDR, "dev", "eth0")
    run("ip", "route", "add", "default", "via", GATEWAY)
    try:
        with open("/etc/resolv.conf", "w") as f:
            f.write(f"nameserver {DNS}\n")
    except OSError as e:
        say(f"cannot write /etc/resolv.conf: {e}")


def cmdline() -> dict[str, str]:
    try:
        with open("/proc/cmdline") as f:
            words = f.read().split()
    except OSError:
        return {}
    return dict(w.split("=", 1) for w in words if "=" in w)


def start_server(args: dict[str, str]) -> subprocess.Popen[bytes]:
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [
        "python3",
        "-m",
        "arpo_envs.desktop.server",
        "--host",
        "0.0.0.0",
        "--port",
        str(SERVER_PORT),
        "--vm-guest",
        # the programs run as root, as before: the guest server has no token to protect
        # and the VM is a machine of its own (`arpo_envs.desktop.user`)
        "--run-as",
        "",
        "--root",
        DESKTOP_ROOT,
        "--width",
        args.get("arpo.width", "1280"),
        "--height",
        args.get("arpo.height", "720"),
    ]
    os.makedirs(DESKTOP_ROOT, exist_ok=True)
    say(f"starting the desktop server on port {SERVER_PORT}")
    with open("/var/log/arpo-desktop.log", "ab") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=log, cwd="/")


def say_log_tail(n: int = 12) -> None:
    """The server's last lines, to the console (the host keeps it as console.log)."""
    for path in ("/var/log/arpo-desktop.log", f"{DESKTOP_ROOT}/logs/executor.log"):
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 4000))
                lines = f.read().decode(errors="replace").splitlines()[-n:]
        except OSError:
            continue
        say(f"{path}:")
        for line in lines:
            say(f"  | {line}")


def power_off(server: subprocess.Popen[bytes] | None) -> None:
    say("powering off")
    if server is not None and server.poll() is None:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
    os.sync()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.reboot(RB_POWER_OFF)
    os._exit(0)


class _Stop(Exception):
    pass


def main() -> None:
    mount_all()
    os.makedirs("/var/log", exist_ok=True)
    try:
        with open("/etc/hostname") as f:
            run("hostname", f.read().strip() or "arpo-vm")
    except OSError:
        pass
    network()
    args = cmdline()

    def on_signal(signum: int, frame: object) -> None:
        raise _Stop  # out of waitpid, which Python would otherwise retry

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server: subprocess.Popen[bytes] | None = None
    backoff = 1.0
    started = time.monotonic()
    try:
        server = start_server(args)
        while True:
            try:
                pid, status = os.waitpid(-1, 0)  # reaps orphans too: this is PID 1
            except ChildProcessError:
                time.sleep(0.5)
                continue
            if pid == server.pid:
                say(f"the desktop server exited ({status}); starting it again in {backoff:.0f} s")
                say_log_tail()
                time.sleep(backoff)
                backoff = 1.0 if time.monotonic() - started > 60 else min(30.0, backoff * 2)
                started = time.monotonic()
                server = start_server(args)
    except _Stop:
        pass
    power_off(server)


if __name__ == "__main__":
    main()

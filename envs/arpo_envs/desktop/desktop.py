"""One local desktop: a real Xvfb display with openbox, its home, its /tmp and the programs on it.

    desk = Desktop(DesktopConfig(), root, alias_mounted=False)
    desk.start()                         # display, home, warm executor, screen
    await desk.reset(restart_display=False)
    desk.stop()

A desktop owns one display (Xvfb + openbox) and the applications started on it
(LibreOffice Calc, mousepad, xterm, ...). Its home directory is `<root>/home`, seen by
the apps as `/home/user` like on an OSWorld VM (see `home.private_home`), and its /tmp is
its own: a tmpfs of `tmp_max_bytes` that every reset empties (`home.private_tmp`; without
a private mount namespace only `$TMPDIR`, `<root>/tmp`, is its own). `Desktop` starts and
stops all of it, resets it to a clean desktop, maps a request's paths to its files, and
launches programs in it, as a user of their own when the server is root (`user.py`); the
OSWorld protocol in front of it is `server.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arpo_envs.desktop import home as homes
from arpo_envs.desktop.atspi import A11yBus
from arpo_envs.desktop.display import XDisplay
from arpo_envs.desktop.executor import WarmExecutor, run_subprocess
from arpo_envs.desktop.screen import Screen
from arpo_envs.desktop.user import USER_NAME, DesktopUser
from arpo_envs.desktop.windows import WindowList
from arpo_envs.procs import (
    become_subreaper,
    desktop_env,
    disown,
    kill_marked,
    own,
    reap_orphans,
    write_python_wrappers,
)
from arpo_envs.server_common import RequestError, ServerSecurity

log = logging.getLogger("arpo_envs.desktop")

_VAR = re.compile(r"\$(?:\{(\w+)\}|(\w+))")  # $NAME or ${NAME}, expanded in the desktop's env
PATH_MAX, NAME_MAX = 4096, 255  # Linux's limits on a path and on one name in it, in bytes
X_PROBE_S = 2.0
"""Longest wait for the X server to answer a round trip before X work; else 503 (a program
holding a server grab made screenshots hang and every thread that touched X wait)."""
WINDOWS_GONE_S = 5.0
"""Longest wait, at reset, for the killed programs' windows to leave the window manager's
list; a warning names what is left after it."""

SETTLE_INPUT = """\
from Xlib import X
from Xlib.display import Display
from Xlib.ext import xtest
d = Display()
for i, byte in enumerate(d.query_keymap()):
    for bit in range(8):
        if byte >> bit & 1:
            xtest.fake_input(d, X.KeyRelease, i * 8 + bit)
mask = d.screen().root.query_pointer().mask
for button in range(1, 6):
    if mask & (X.Button1Mask << (button - 1)):
        xtest.fake_input(d, X.ButtonRelease, button)
if mask & X.LockMask:
    caps = d.keysym_to_keycode(0xFFE5)
    xtest.fake_input(d, X.KeyPress, caps)
    xtest.fake_input(d, X.KeyRelease, caps)
xtest.fake_input(d, X.MotionNotify, x={x}, y={y})
d.sync()
"""
"""Run in a fork of the warm executor (or a new interpreter) at every reset."""


@dataclass(frozen=True, slots=True)
class DesktopConfig:
    """One local desktop server."""

    width: int = 1280
    """Screen width in pixels (Xvfb's screen)."""
    height: int = 720
    """Screen height in pixels."""
    host: str = "127.0.0.1"
    """Address to bind; anything but loopback needs `token`."""
    port: int = 5000
    """TCP port (0: any free port)."""
    token: str | None = None
    """Bearer token every request must carry (None: no auth, loopback only)."""
    display: int | None = None
    """X display number; None lets Xvfb pick a free one."""
    root: str | None = None
    """Directory of this desktop's state (home, runtime dir, logs); default a new temp dir."""
    files_template: str | None = None
    """Directory copied into the home directory on every reset (the task files)."""
    home_alias: str | None = "/home/user"
    """Path at which the apps see the home directory (OSWorld's VM home); None: none."""
    execute_timeout_s: float = 120.0
    """Longest run of one /execute command (OSWorld's server: 120 s); requests may ask less."""
    open_timeout_s: float = 60.0
    """Longest wait for the window of /setup/open_file unless the request says otherwise."""
    pause_s: float = 0.0
    """pyautogui.PAUSE for actions on the fast path (its default 0.1 s per call would dominate)."""
    draw_cursor: bool = True
    """Draw the pointer into screenshots."""
    inprocess: bool = True
    """Run `python -c` pyautogui code in forks of a warm executor process (False: always a
    new interpreter)."""
    vm_guest: bool = False
    """Inside a VM of the project's fleet (`arpo_envs.vm`): may bind 0.0.0.0 without a token,
    since the guest is reachable only through the host's loopback port forward."""
    tmp_max_bytes: int = 512 << 20
    """Size of the desktop's own /tmp (a tmpfs, emptied by every reset) where the server has
    a private mount namespace; elsewhere `$TMPDIR` is `<root>/tmp`, emptied by reset, which
    reports its bytes and logs when they exceed this."""
    run_as: str = "arpo-desktop"
    """The user every program of the desktop runs as (Xvfb, openbox, the buses, the pyautogui
    executor, apps, commands) when the server runs as root, so that none can read the
    server's memory and token (`arpo_envs.desktop.user`): created as a system user when
    missing; the home is handed to it. '': the server's own user. A server that is not
    root cannot switch and runs them as itself (logged; see `require_own_user`)."""
    require_own_user: bool = False
    """Refuse to start, naming why, when the programs cannot run as `run_as` (the server is
    not root); False: say so once in the log and run them as the server's user."""
    atspi: bool = False
    """Run a session bus and the AT-SPI registry (`arpo_envs.desktop.atspi`, kept across
    resets), and LibreOffice with its GTK 3 plugin (`SAL_USE_VCLPLUGIN=gtk3`): GTK 3 apps
    (mousepad, LibreOffice) then register their widgets, and GET /accessibility answers
    their whole trees as OSWorld's VM server does (Calc's cells in view, toolbars, menus,
    dialogs); apps without a bridge (xterm) stay frames. False: frames only, no bus, and
    LibreOffice with its own X11 plugin (`gen`), as `make demo` runs it."""
    a11y_max_nodes: int = 10_000
    """With `atspi`: most nodes one GET /accessibility walks, in OSWorld's document order
    (depth first); past it the rest is left out and logged. It bounds the answer's time
    and size: a 1280x720 Calc window is about 2,500 nodes, 0.8 MB, 1.8 s, and zoomed out
    to 50 % 3,400 nodes, 1.3 MB, 3.3 s (`benchmarks/bench_calc_tree.py`)."""

    def __post_init__(self) -> None:
        if self.width < 320 or self.height < 240:
            raise ValueError(f"screen {self.width}x{self.height} is too small; use >= 320x240")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.tmp_max_bytes < 1 << 20:
            raise ValueError(f"tmp_max_bytes must be at least 1 MiB, got {self.tmp_max_bytes}")
        if self.execute_timeout_s <= 0 or self.open_timeout_s <= 0:
            raise ValueError("execute_timeout_s and open_timeout_s must be > 0")
        if self.files_template is not None and not Path(self.files_template).is_dir():
            raise ValueError(f"files_template {self.files_template!r} is not a directory")
        if self.run_as and (not USER_NAME.fullmatch(self.run_as) or self.run_as == "root"):
            raise ValueError(
                f"run_as {self.run_as!r} is not an unprivileged user name: use lower-case "
                "letters, digits, '_' and '-' (at most 32, not 'root'), or '' for the server's user"
            )
        if self.require_own_user and not self.run_as:
            raise ValueError("require_own_user needs run_as (the user to run the programs as)")
        if not 100 <= self.a11y_max_nodes <= 1_000_000:
            raise ValueError(
                f"a11y_max_nodes is {self.a11y_max_nodes}: give 100..1000000 (nodes of one "
                "/accessibility answer; a Calc sheet in view is a few thousand)"
            )
        # refuses an exposed address without a token (outside a fleet VM)
        ServerSecurity(self.host, self.token, vm_guest=self.vm_guest)


class Desktop:
    """The display, the home directory and the processes of one desktop."""

    def __init__(
        self,
        config: DesktopConfig,
        root: Path,
        alias_mounted: bool,
        host_ns: int | None = None,
        host_tmp: int | None = None,
        user: DesktopUser | None = None,
    ):
        """`host_ns`, `host_tmp`: descriptors of the host's mount namespace and /tmp when
        this process has its own /tmp (`home.private_tmp`); `user`: whom the desktop's
        programs run as (None: this process's user)."""
        self.config = config
        self.root = root
        self.user = user
        self.private_tmp = host_tmp is not None
        self.tmp_dir = Path("/tmp") if self.private_tmp else root / "tmp"
        """The desktop's temporary folder ($TMPDIR), emptied by every reset."""
        self.tmp_dir.mkdir(exist_ok=True)
        self._tmp_keep = (
            (self.tmp_dir / ".X11-unix", root,
             *homes.host_tmp_kept(root, (config.files_template or "",)))
            if self.private_tmp
            else ()
        )  # fmt: skip
        """What in the desktop's /tmp is not its own: the displays' sockets, the server's root."""
        self.home_dir = root / "home"
        self.alias_mounted = alias_mounted
        self.home = config.home_alias if alias_mounted and config.home_alias else str(self.home_dir)
        self.env = desktop_env(root, ":0", self.home, user.name if user else None)
        # each desktop's LibreOffice under its own profile path (see write_office_wrappers)
        homes.write_office_wrappers(root / "bin", self.home_dir / ".config" / "libreoffice" / "4")
        write_python_wrappers(root / "bin")
        self.env["PATH"] = f"{root / 'bin'}:{self.env.get('PATH', os.defpath)}"
        self.env["TMPDIR"] = str(self.tmp_dir)
        self.display = XDisplay(
            config.width,
            config.height,
            self.env,
            config.display,
            host_ns=host_ns if self.private_tmp else None,
            host_tmp=f"/proc/self/fd/{host_tmp}" if host_tmp is not None else "/tmp",
            user=user,
        )
        self.lo_template: Path | None = None
        self.executor: WarmExecutor | None = None
        self.bus: A11yBus | None = A11yBus(root, self.env, user) if config.atspi else None
        if self.bus is not None:  # every process of the desktop on its session bus
            self.env.update(self.bus.session_env())
            self.env.pop("NO_AT_BRIDGE", None)
            # LibreOffice's GTK 3 plugin registers its widgets; its X11 plugin has no bridge
            self.env["SAL_USE_VCLPLUGIN"] = "gtk3"
        self.screen: Screen | None = None
        self.launched: list[subprocess.Popen] = []
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="reset")
        """Reset's own threads: threads of the shared pool can all be waiting on a grabbed X."""
        (root / "logs").mkdir(parents=True, exist_ok=True)
        if user is not None:
            self._hand_over()

    def _hand_over(self) -> None:
        """The root folder as the desktop's user may see it: reached by name only (0711);
        its `bin` readable, `run` (the runtime folder, the bus) and a `tmp` of its own
        the user's; the server's files (logs, its log and state) its own, 0700 and 0600."""
        assert self.user is not None
        os.chmod(self.root, 0o711)
        for entry in os.scandir(self.root):  # what the server's starter put there: its log
            if entry.is_file(follow_symlinks=False):
                os.chmod(entry.path, 0o600)
        for name in ("logs", "spool"):
            if (self.root / name).is_dir():
                os.chmod(self.root / name, 0o700)
        os.chmod(self.root / "bin", 0o755)
        os.chown(self.root / "run", self.user.uid, self.user.gid)
        if not self.private_tmp:
            os.chown(self.tmp_dir, self.user.uid, self.user.gid)

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        # orphans of commands (`setsid sleep 780 &`) become our children: reset finds them
        if not become_subreaper():
            log.warning("not a child subreaper: only the marker finds what commands leave")
        self.lo_template = homes.libreoffice_template()
        self._rebuild_home()
        self.display.start()
        if self.bus is not None:
            self.bus.start()
        if self.config.inprocess:
            self.executor = WarmExecutor(
                self.env,
                self.home,
                self.config.pause_s,
                str(self.root / "logs" / "executor.log"),
                self.user,
            )
            self.executor.start()
            self.executor.wait_ready_sync()
        self.screen = Screen(self.display.name, self.config.draw_cursor)

    def _keep(self) -> list[int]:
        """Processes a reset keeps: the display, the warm executor and the buses."""
        return (
            self.display.pids()
            + (self.executor.pids() if self.executor else [])
            + (self.bus.pids() if self.bus else [])
        )

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.executor is not None:
            self.executor.stop()
        if self.bus is not None:
            self.bus.stop()
        kill_marked(self.root, exclude=self.display.pids(), tree=os.getpid())
        self.display.stop()
        kill_marked(self.root, tree=os.getpid())
        if self.screen is not None:
            with contextlib.suppress(Exception):
                self.screen.close()

    def _rebuild_home(self) -> None:
        template = Path(self.config.files_template) if self.config.files_template else None
        homes.rebuild_home(self.home_dir, template, self.lo_template)
        if self.user is not None:  # the files the server copied are the desktop's
            self.user.give(self.home_dir)

    def _reap(self) -> None:
        for p in self.launched:
            if p.poll() is not None:
                disown(p.pid)
        self.launched = [p for p in self.launched if p.returncode is None]
        reap_orphans()

    async def _bg(self, fn, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def need_x(self) -> None:
        """Raise a 503 naming the reason unless the X server answers within X_PROBE_S."""
        name = self.display.name
        if not self.display.alive():
            raise RequestError(f"the X display {name} is not running; POST /reset restarts it", 503)
        if not await self.display.answers(X_PROBE_S):
            raise RequestError(
                f"the X display {name} does not answer within {X_PROBE_S:g} s (a program may "
                "hold a server grab, or Xvfb is stopped); POST /reset recovers it",
                503,
            )

    async def kill_programs(self) -> int:
        """Kill every process of the desktop but the display and the warm executor's own
        process, without the executor's lock: a program waiting on a grabbed X server
        holds that lock until its timeout (up to 120 s)."""
        keep = (
            self.display.pids()
            + ([self.executor.pid] if self.executor is not None else [])
            + (self.bus.pids() if self.bus is not None else [])
        )
        return await self._bg(kill_marked, self.root, [p for p in keep if p], 3.0, os.getpid())

    async def reset(self, restart_display: bool) -> dict[str, Any]:
        """Kill every app and command, rebuild the home directory, restart the display if it
        died, does not answer (a grab held by a process that is not the desktop's) or when
        asked, release held keys and buttons and centre the pointer."""
        t0 = time.perf_counter()
        killed = await self._bg(kill_marked, self.root, self._keep(), 3.0, os.getpid())
        self._reap()
        restarted = False
        if restart_display or not self.display.alive() or not await self.display.answers(X_PROBE_S):
            await self._bg(self.display.stop)
            await self._bg(self.display.start)
            restarted = True
        if self.bus is not None and (restarted or not self.bus.alive()):
            await self._bg(self.bus.stop)  # the bus launcher holds the old display
            await self._bg(self.bus.start)
            if self.executor is not None:  # its pyautogui read the old display's keymap
                self.executor.start()
            if self.screen is not None:
                await self.screen.reconnect(self.display.name)
        left = await self._bg(self._wait_windows_gone, WINDOWS_GONE_S)
        if left:
            log.warning("windows still listed %g s after reset killed their programs: %s",
                        WINDOWS_GONE_S, left)  # fmt: skip
        await self._bg(self._rebuild_home)
        tmp_bytes = await self._bg(self._empty_tmp)
        # back to the first workspace, in case an action switched (openbox has several)
        await self._bg(
            functools.partial(
                subprocess.run, ["wmctrl", "-s", "0"], env=self.env, capture_output=True, timeout=10
            )
        )
        await self._settle_input()
        return {
            "status": "success",
            "seconds": round(time.perf_counter() - t0, 4),
            "killed": killed,
            "display_restarted": restarted,
            "tmp_bytes": tmp_bytes,
        }

    def _wait_windows_gone(self, timeout: float) -> list[str]:
        """Wait until the window manager lists no window (reset killed every program that
        had one); the titles still listed after `timeout`. A killed program's window stays
        listed for some ms after its process died: an `open_file` right after the reset
        matched the last episode's window by its title, answered before the new program
        had a window, and the first keys of the episode went nowhere (1 run in 25 of a
        text-editor task)."""
        try:
            wl = WindowList(self.display.name)
        except Exception as e:  # reported by the caller's warning
            return [f"(the window list could not be read: {e})"]
        try:
            deadline = time.monotonic() + timeout
            while True:
                titles = [w.title for w in wl.windows()]
                if not titles or time.monotonic() > deadline:
                    return titles
                time.sleep(0.005)
        finally:
            wl.close()

    def _empty_tmp(self) -> int:
        """Empty the desktop's temporary folder; returns the bytes it held."""
        used = homes.tmp_bytes(self.tmp_dir, self._tmp_keep)
        if used > self.config.tmp_max_bytes:  # only without a tmpfs, which cannot grow past it
            log.warning("the desktop's %s held %d bytes (limit %d)", self.tmp_dir, used,
                        self.config.tmp_max_bytes)  # fmt: skip
        homes.empty_tmp(self.tmp_dir, self._tmp_keep)
        return used

    async def _settle_input(self) -> None:
        """Release every key and mouse button the X server has down, unlock Caps Lock and put
        the pointer where a fresh Xvfb has it, the screen's centre (the caller holds the
        executor's lock).

        Through XTest, not pyautogui: with the pointer in a corner pyautogui's fail-safe
        raised before its first keyUp, and it only knew the keys it was told to release.
        """
        code = SETTLE_INPUT.format(x=self.config.width // 2, y=self.config.height // 2)
        if self.executor is not None:
            res = await self.executor.run_locked(code, 10.0)
        else:
            res = await run_subprocess(
                [sys.executable, "-c", code],
                False,
                env=self.env,
                cwd=self.home,
                timeout_s=10.0,
                user=self.user,
            )
        if res.returncode != 0:
            log.warning("settling the input after reset failed: %s", res.error[-500:])

    # ---- paths ----------------------------------------------------------------------------

    def path(self, raw: str) -> Path:
        """A path of a request as this process sees it (`~`, `$VAR`, the home alias when it
        is not mounted, and a relative path in the desktop's home)."""
        p = _VAR.sub(lambda m: self.env.get(m.group(1) or m.group(2), m.group(0)), raw)
        if p == "~" or p.startswith("~/"):
            p = self.home + p[1:]
        alias = self.config.home_alias
        if alias and not self.alias_mounted and (p == alias or p.startswith(alias + "/")):
            p = str(self.home_dir) + p[len(alias) :]
        if "\x00" in p:
            raise RequestError(f"path contains a NUL character: {raw[:80]!r}")
        encoded = p.encode("utf-8", "surrogateescape")
        if len(encoded) >= PATH_MAX or any(len(c) > NAME_MAX for c in encoded.split(b"/")):
            raise RequestError(
                f"path too long ({len(encoded)} bytes; at most {PATH_MAX - 1} in all and "
                f"{NAME_MAX} per name): {raw[:80]!r}..."
            )
        if not os.path.isabs(p):  # relative to the desktop's home, not the server's cwd
            return self.home_dir / p
        return Path(p)

    def popen(self, argv: list[str] | str, shell: bool, cwd: str | None = None) -> subprocess.Popen:
        log_file = open(self.root / "logs" / "launched.log", "ab")  # noqa: SIM115
        try:
            p = subprocess.Popen(
                argv,
                shell=shell,
                env=self.env,
                cwd=cwd or self.home,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                start_new_session=True,
                **(self.user.popen_kwargs() if self.user else {}),
            )
        finally:
            log_file.close()
        own(p.pid)
        self._reap()
        self.launched.append(p)
        return p

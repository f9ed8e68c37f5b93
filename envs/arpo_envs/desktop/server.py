"""The local desktop's HTTP server: the OSWorld VM protocol over a real Xvfb desktop.

    python -m arpo_envs.desktop.server --port 5200      # one desktop; `arpo-envs up` starts N

One server process owns one desktop (`desktop.Desktop`: its display, home, /tmp and
programs) and answers the protocol below for it; `main` is that process.

| method, path | body | answer |
|---|---|---|
| GET /screenshot | - | PNG of the screen with the pointer (mss, compress level 1) |
| POST /execute, /setup/execute | {command: list or str, shell, timeout?} | {status, output, error, returncode}; `python -c` pyautogui code runs in a fork of a warm process (`executor`), the rest as a subprocess; a timeout is 500 JSON |
| POST /setup/launch | {command, shell} | text; started in its own session, not waited for |
| POST /setup/upload | multipart file_path, file_data | text "File Uploaded: <n> bytes" |
| POST /setup/open_file | {path, window_name?, timeout_seconds?} | text once a window titled after the file is up (Calc for spreadsheets, mousepad for text, xterm for folders) |
| POST /setup/activate_window, /setup/close_window | {window_name, strict?, by_class?} | text (wmctrl; 200 even when nothing matched, as OSWorld) |
| POST /file | form or JSON file_path | the file's bytes; 404 JSON if it does not exist |
| POST /screen_size | - | {width, height} |
| GET /platform | - | text "Linux" |
| GET /terminal | - | {output: null, status} (no AT-SPI; a liveness ping) |
| GET /accessibility | - | {AT: xml}: with `atspi`, the AT-SPI trees of the apps that register (GTK 3, LibreOffice) in OSWorld's format (`atspi`), at most `a11y_max_nodes` nodes; other windows as application > frame (`windows`) |
| GET /cursor_position | - | [x, y] |
| POST /run_python | {code} | {status, message, need_more, output, error, return_code} |
| POST /run_bash_script | {script, timeout?, working_dir?} | {status, output (stdout+stderr), error, returncode} |
| POST /reset | {restart_display?} | the project's: clean desktop, {status, seconds, killed, display_restarted, tmp_bytes} |
| GET /desktop/info | - | the project's: display, root, home, pids of Xvfb and openbox |
| POST /snapshot, /fork, /release | - | 501 JSON: a local desktop cannot be forked (its apps are real processes) |

Errors are JSON (see `server_common`); the server keeps serving after any of them. X work
is preceded by a round trip to the X server: when it does not answer within X_PROBE_S
(a program holds a server grab) the request is a 503 naming that, and /reset recovers
the display. The answer of a command is at most MAX_ANSWER_BYTES of JSON (`executor`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from arpo_envs.desktop import home as homes
from arpo_envs.desktop import user as users
from arpo_envs.desktop.atspi import read_apps
from arpo_envs.desktop.desktop import Desktop, DesktopConfig
from arpo_envs.desktop.executor import (
    MAX_ANSWER_BYTES,
    CommandResult,
    ExecutorDied,
    fit_answer,
    inprocess_code,
    normalize,
    run_subprocess,
)
from arpo_envs.desktop.windows import WindowList, accessibility_xml, matches, wmctrl
from arpo_envs.procs import (
    TREE_FILE,
    tree_snapshot,
)
from arpo_envs.server_common import RequestError, ServerSecurity, check_type, make_app, read_json

log = logging.getLogger("arpo_envs.desktop")

CALC_SUFFIXES = frozenset({".xlsx", ".xls", ".xlsm", ".ods", ".csv", ".tsv"})
OFFICE_SUFFIXES = frozenset({".docx", ".doc", ".odt", ".rtf", ".pptx", ".ppt", ".odp"})
MAX_UPLOAD = 512 * 1024 * 1024
X_WORK_S = 10.0
"""Longest wait for X work that began while the server answered (a grab can start
mid-way); else 503."""
ATSPI_DEADLINE_S = 30.0
"""Longest walk of the AT-SPI applications for one /accessibility answer (each D-Bus call
waits at most 5 s); applications not walked by then are left out and logged."""


class DesktopServer:
    """The aiohttp application of one desktop."""

    def __init__(self, desktop: Desktop):
        self.desk = desktop
        self.config = desktop.config
        self._reset_lock = asyncio.Lock()

    def make_app(self) -> web.Application:
        app = make_app(
            ServerSecurity(self.config.host, self.config.token, vm_guest=self.config.vm_guest),
            client_max_size=MAX_UPLOAD,
        )
        r = app.router
        r.add_get("/screenshot", self.screenshot)
        r.add_post("/execute", self.execute)
        r.add_post("/setup/execute", self.execute)
        r.add_post("/setup/launch", self.launch)
        r.add_post("/setup/upload", self.upload)
        r.add_post("/setup/open_file", self.open_file)
        r.add_post("/setup/activate_window", self.activate_window)
        r.add_post("/setup/close_window", self.close_window)
        r.add_post("/file", self.file)
        r.add_post("/screen_size", self.screen_size)
        r.add_get("/platform", self.platform)
        r.add_get("/terminal", self.terminal)
        r.add_get("/accessibility", self.accessibility)
        r.add_get("/cursor_position", self.cursor_position)
        r.add_post("/run_python", self.run_python)
        r.add_post("/run_bash_script", self.run_bash_script)
        r.add_post("/reset", self.reset)
        r.add_get("/desktop/info", self.info)
        for path in ("/snapshot", "/fork", "/release"):
            r.add_post(path, cannot_fork)
        return app

    # ---- screen ---------------------------------------------------------------------------

    async def _x(self, work):
        """`work` (an awaitable doing X work) after the X server answered a probe, within
        X_WORK_S; a 503 naming the reason otherwise."""
        try:
            await self.desk.need_x()
            return await asyncio.wait_for(work, X_WORK_S)
        except TimeoutError:
            raise RequestError(
                f"the X display {self.desk.display.name} stopped answering (a program may hold "
                f"a server grab): no answer within {X_WORK_S:g} s; POST /reset recovers it",
                503,
            ) from None
        finally:
            if asyncio.iscoroutine(work):
                work.close()  # never awaited when the probe failed

    async def screenshot(self, request: web.Request) -> web.Response:
        assert self.desk.screen is not None
        png = await self._x(self.desk.screen.png())
        return web.Response(body=png, content_type="image/png")

    async def cursor_position(self, request: web.Request) -> web.Response:
        assert self.desk.screen is not None
        return web.json_response(list(await self._x(self.desk.screen.pointer())))

    async def screen_size(self, request: web.Request) -> web.Response:
        return web.json_response({"width": self.config.width, "height": self.config.height})

    async def platform(self, request: web.Request) -> web.Response:
        return web.Response(text="Linux")

    async def terminal(self, request: web.Request) -> web.Response:
        return web.json_response({"output": None, "status": "success"})

    async def accessibility(self, request: web.Request) -> web.Response:
        windows = await self._x(asyncio.to_thread(self._windows))
        registered = []
        bus = self.desk.bus
        if bus is not None:
            if not bus.alive():
                raise RequestError(
                    "the desktop's session bus or AT-SPI registry is not running; POST /reset "
                    "restarts it", 503,
                )  # fmt: skip
            registered, _ = await asyncio.to_thread(
                read_apps, bus.a11y, 5.0, ATSPI_DEADLINE_S, self.config.a11y_max_nodes
            )
        return web.json_response({"AT": accessibility_xml(windows, registered)})

    def _windows(self):
        wl = WindowList(self.desk.display.name)
        try:
            return wl.windows()
        finally:
            wl.close()

    # ---- commands -------------------------------------------------------------------------

    @staticmethod
    def _command(body: dict[str, Any]) -> tuple[str | list[str], bool]:
        if "command" not in body:
            raise RequestError("missing field 'command'")
        command = body["command"]
        check_type("command", command, (str, list))
        shell = body.get("shell", False)
        check_type("shell", shell, bool)
        if isinstance(command, list) and not all(isinstance(a, str) for a in command):
            raise RequestError("field 'command' must be a string or a list of strings")
        if not command:
            raise RequestError("field 'command' is empty")
        return command, shell

    def _timeout(self, body: dict[str, Any], name: str, default: float) -> float:
        """The request's timeout, at most `default` (NaN and infinity are refused: NaN
        compared below the cap and disabled it)."""
        value = body.get(name, default)
        check_type(name, value, (int, float))
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**53:
            raise RequestError(f"field {name!r} must be a finite number > 0, got an integer "
                               f"of {len(str(value))} digits")  # fmt: skip
        if isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise RequestError(f"field {name!r} must be a finite number > 0, got {value}")
        return float(min(value, default))

    def _normalize(self, command: str | list[str], shell: bool) -> str | list[str]:
        try:
            return normalize(command, shell, self.desk.home)
        except ValueError as e:  # shlex: "No closing quotation", "No escaped character"
            raise RequestError(f"cannot split field 'command' like a shell: {e}") from None

    async def _run(self, command: str | list[str], shell: bool, timeout: float) -> CommandResult:
        command = self._normalize(command, shell)
        executor = self.desk.executor
        code = inprocess_code(command, shell)
        async with self._reset_lock:
            pass  # a running reset finishes first
        if code is not None:  # pyautogui: X work
            await self.desk.need_x()
        if code is not None and executor is not None:
            try:
                return await executor.run(code, timeout)
            except ExecutorDied as e:
                raise RequestError(str(e), 500) from None
        with _spawn_errors(command):
            return await run_subprocess(
                command,
                shell,
                env=self.desk.env,
                cwd=self.desk.home,
                timeout_s=timeout,
                user=self.desk.user,
            )

    async def execute(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        command, shell = self._command(body)
        timeout = self._timeout(body, "timeout", self.config.execute_timeout_s)
        res = await self._run(command, shell, timeout)
        if res.timed_out:
            return web.json_response(
                {
                    "status": "error",
                    "message": f"command timed out after {timeout:g} s and was killed",
                    "output": res.output,
                    "error": res.error,
                    "returncode": None,
                },
                status=500,
            )
        return web.json_response(
            {
                "status": "success",
                "output": res.output,
                "error": res.error,
                "returncode": res.returncode,
            }
        )

    async def run_python(self, request: web.Request) -> web.Response:
        body = await read_json(request, {"code": str})
        if not body["code"].strip():
            raise RequestError("field 'code' is empty")
        tmp = self.desk.root / "run"
        with tempfile.NamedTemporaryFile("w", suffix=".py", dir=tmp, delete=False) as f:
            f.write(body["code"])
            if self.desk.user is not None:  # the program reads its code as the desktop's user
                os.fchown(f.fileno(), self.desk.user.uid, self.desk.user.gid)
        try:
            res = await run_subprocess(
                [sys.executable, f.name],
                False,
                env=self.desk.env,
                cwd=self.desk.home,
                timeout_s=min(30.0, self.config.execute_timeout_s),
                user=self.desk.user,
            )
        finally:
            os.unlink(f.name)
        if res.timed_out:
            return web.json_response(
                {
                    "status": "error",
                    "message": "Execution timeout: Code took too long to execute",
                    "error": "TimeoutExpired",
                    "need_more": False,
                    "output": res.output,
                },
                status=500,
            )
        # output and error are sent twice (message joins them): half the limit each time
        output, error = fit_answer(res.output, res.error, MAX_ANSWER_BYTES // 2)
        error = error or (f"Process exited with code {res.returncode}" if res.returncode else "")
        message = output + (("\n" if output else "") + error if error else "")
        return web.json_response(
            {
                "status": "success" if res.returncode == 0 else "error",
                "message": message,
                "need_more": False,
                "output": output,
                "error": error,
                "return_code": res.returncode,
            }
        )

    async def run_bash_script(self, request: web.Request) -> web.Response:
        body = await read_json(request, {"script": str})
        if not body["script"].strip():
            raise RequestError("field 'script' is empty")
        timeout = self._timeout(body, "timeout", 100.0)
        cwd = self.desk.home
        if body.get("working_dir") is not None:
            check_type("working_dir", body["working_dir"], str)
            wd = self.desk.path(body["working_dir"])
            if not wd.is_dir():
                raise RequestError(f"working directory does not exist: {body['working_dir']}")
            cwd = str(wd)
        with _spawn_errors("/bin/bash"):
            res = await run_subprocess(
                ["/bin/bash", "-c", body["script"]],
                False,
                env=self.desk.env,
                cwd=cwd,
                timeout_s=timeout,
                merge_stderr=True,
                user=self.desk.user,
            )
        if res.timed_out:
            return web.json_response(
                {
                    "status": "error",
                    "output": f"Script execution timed out after {timeout:g} seconds",
                    "error": "",
                    "returncode": -1,
                },
                status=500,
            )
        return web.json_response(
            {
                "status": "success" if res.returncode == 0 else "error",
                "output": res.output,
                "error": "",
                "returncode": res.returncode,
            }
        )

    async def launch(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        command, shell = self._command(body)
        command = self._normalize(command, shell)
        with _spawn_errors(command):
            await asyncio.to_thread(self.desk.popen, command, shell)
        shown = command if isinstance(command, str) else " ".join(command)
        return web.Response(text=f"{shown} launched successfully")

    # ---- files ----------------------------------------------------------------------------

    async def upload(self, request: web.Request) -> web.Response:
        if not request.content_type.startswith("multipart/"):
            raise RequestError("send multipart/form-data with fields file_path and file_data")
        form = await _read_form(request)
        file_path, data = form.get("file_path"), form.get("file_data")
        if not isinstance(file_path, str) or not file_path or data is None:
            raise RequestError("file_path and file_data are required")
        target = self.desk.path(file_path)
        user = self.desk.user

        def write() -> int:
            _check_kernel_path(os.path.realpath(target), file_path)
            # Opened without truncating and without blocking (a FIFO nobody reads), then
            # checked: only a regular file outside the kernel's file systems takes an upload.
            if user is None:  # the desktop's programs are the server's user: nothing to guard
                created = [d for d in (target, *target.parents) if not os.path.lexists(d)]
                target.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(target, _UPLOAD_FLAGS, 0o666)
            else:  # a link the desktop's user made is never followed (_open_unlinked)
                fd, created = _open_unlinked(target)
            try:
                _check_upload_target(fd, file_path)
                os.set_blocking(fd, True)
                if user is not None:
                    # what the upload creates (the file, missing folders) is the desktop user's
                    for made in created:
                        with contextlib.suppress(FileNotFoundError):
                            os.lchown(made, user.uid, user.gid)
                os.ftruncate(fd, 0)
                with open(fd, "wb", closefd=False) as out:
                    if isinstance(data, web.FileField):  # aiohttp keeps it in a temporary file
                        shutil.copyfileobj(data.file, out, 1 << 20)
                    else:
                        out.write(str(data).encode())
                return os.fstat(fd).st_size
            finally:
                os.close(fd)

        try:
            size = await asyncio.to_thread(write)
        except FileExistsError:  # mkdir of a parent that is a regular file
            raise RequestError(
                f"cannot write {file_path}: a folder on its path is a file", 400
            ) from None
        except OSError as e:
            reason = e.strerror
            if e.errno == errno.ENXIO:  # opening a FIFO nobody reads, without blocking
                reason = "not a regular file (a FIFO or a device nobody reads)"
            raise RequestError(f"cannot write {file_path}: {reason}", _os_status(e)) from None
        return web.Response(text=f"File Uploaded: {size} bytes")

    async def file(self, request: web.Request) -> web.StreamResponse:
        if request.content_type == "application/json":
            body = await read_json(request, {"file_path": str})
            file_path = body["file_path"]
        else:
            form = await _read_form(request)
            file_path = form.get("file_path")
            if not isinstance(file_path, str) or not file_path:
                raise RequestError("file_path is required")
        target = self.desk.path(file_path)
        if not target.exists():
            raise RequestError(f"File not found: {file_path}", 404)
        if not target.is_file():
            raise RequestError(f"not a regular file: {file_path}", 400)
        if not os.access(target, os.R_OK):
            raise RequestError(f"cannot read {file_path}: permission denied", 403)
        # streamed from the file (sendfile): a file of many GB never sits in memory
        return web.FileResponse(
            target,
            headers={
                "Content-Type": "application/octet-stream",
                "Content-Disposition": f'attachment; filename="{target.name}"',
            },
        )

    # ---- windows --------------------------------------------------------------------------

    def _open_command(self, target: Path) -> tuple[list[str], str | None]:
        """How to open `target`, and the working directory for it."""
        suffix = target.suffix.lower()
        if target.is_dir():
            return ["xterm", "-T", target.name or str(target)], str(target)
        if suffix in (".csv", ".tsv"):  # comma or tab, UTF-8, no Text Import dialog
            sep = "44" if suffix == ".csv" else "9"
            infilter = f"--infilter=Text - txt - csv (StarCalc):{sep},34,76,1"
            return ["soffice", "--calc", "--norestore", "--nologo", infilter, str(target)], None
        if suffix in CALC_SUFFIXES:
            return ["soffice", "--calc", "--norestore", "--nologo", str(target)], None
        if suffix in OFFICE_SUFFIXES:
            return ["soffice", "--norestore", "--nologo", str(target)], None
        return ["mousepad", str(target)], None

    async def open_file(self, request: web.Request) -> web.Response:
        body = await read_json(request, {"path": str})
        raw = body["path"]
        if not raw.strip():
            raise RequestError("field 'path' is empty: give a file, a folder or a program")
        window_name = body.get("window_name")
        if window_name is not None:
            check_type("window_name", window_name, str)
        timeout = self._timeout(body, "timeout_seconds", self.config.open_timeout_s)
        target = self.desk.path(raw)
        if target.exists():
            argv, cwd = self._open_command(target)
            candidates = [target.name, target.stem]
        elif shutil.which(raw):
            argv, cwd = [raw], None
            candidates = [raw]
        else:
            raise RequestError(f"Application/file not found: {raw}", 404)
        if window_name:
            candidates = [window_name]
        candidates = [c for c in candidates if c]
        await asyncio.to_thread(self.desk.popen, argv, False, cwd)
        win = await self._wait_window(candidates, timeout)
        if win is None:
            titles = [w.title for w in await self._x(asyncio.to_thread(self._windows))]
            raise RequestError(
                f"Failed to find window for {candidates} within {timeout:g} seconds "
                f"(windows: {titles})",
                500,
            )
        await asyncio.to_thread(
            subprocess.run,
            ["wmctrl", "-i", "-a", hex(win.wid)],
            env=self.desk.env,
            capture_output=True,
            timeout=10,
        )
        return web.Response(text="File opened and window activated successfully")

    async def _wait_window(self, candidates: list[str], timeout: float):
        """The first window whose title contains a candidate, polled until `timeout`: one
        short look per 0.1 s in a worker thread, so waiting requests never hold the thread
        pool that every other endpoint needs (six 90 s waits made /accessibility wait 87 s)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            for w in await self._x(asyncio.to_thread(self._windows)):
                if any(c in w.title for c in candidates):
                    return w
            if loop.time() > deadline:
                return None
            await asyncio.sleep(0.1)

    async def _window_action(self, request: web.Request, action: str) -> tuple[bool, str]:
        body = await read_json(request, {"window_name": str})
        name = body["window_name"]
        if not name:
            raise RequestError("window_name required")
        strict = body.get("strict", False)
        by_class = body.get("by_class", False)
        check_type("strict", strict, bool)
        check_type("by_class", by_class, bool)
        windows = await self._x(asyncio.to_thread(self._windows))
        found = any(matches(w, name, strict, by_class) for w in windows)
        if found:
            await asyncio.to_thread(wmctrl, action, name, strict, by_class, self.desk.env)
        return found, name

    async def activate_window(self, request: web.Request) -> web.Response:
        found, name = await self._window_action(request, "a")
        if not found:  # OSWorld's server answers 200 here too
            return web.Response(text=f"Window {name} not found; nothing activated")
        return web.Response(text="Window activated successfully")

    async def close_window(self, request: web.Request) -> web.Response:
        found, name = await self._window_action(request, "c")
        if not found:
            return web.Response(text=f"Window {name} not found; nothing closed")
        return web.Response(text="Window closed successfully.")

    # ---- the project's endpoints ------------------------------------------------------------

    async def reset(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        restart = body.get("restart_display", False)
        check_type("restart_display", restart, bool)
        killed = 0
        async with self._reset_lock:
            executor = self.desk.executor
            if executor is None:
                answer = await self.desk.reset(restart)
            else:
                try:
                    async with asyncio.timeout(0.5):
                        await executor.lock.acquire()
                except TimeoutError:  # a program runs (maybe stuck in X): killed, it lets go
                    killed = await self.desk.kill_programs()
                    await executor.lock.acquire()
                try:
                    answer = await self.desk.reset(restart)
                finally:
                    executor.lock.release()
        answer["killed"] += killed
        return web.json_response(answer)

    async def info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "display": self.desk.display.name,
                "root": str(self.desk.root),
                "home": self.desk.home,
                "home_dir": str(self.desk.home_dir),
                "pid": os.getpid(),
                "xvfb_pid": self.desk.display.xvfb.pid if self.desk.display.xvfb else None,
                "wm_pid": self.desk.display.wm.pid if self.desk.display.wm else None,
                "inprocess": self.desk.executor is not None,
                "executor_pid": self.desk.executor.pid if self.desk.executor else None,
                "private_tmp": self.desk.private_tmp,
                "tmp_dir": str(self.desk.tmp_dir),
                "tmp_max_bytes": self.config.tmp_max_bytes,
            }
        )


KERNEL_FILE_SYSTEMS = ("/proc", "/sys", "/dev")
"""Where an upload is refused even onto a file that looks regular (/proc/self/mem): these
files are the kernel's (processes, devices), not the desktop's data. /dev/shm is a tmpfs
of ordinary files and is allowed."""


async def cannot_fork(request: web.Request) -> web.Response:
    """The fork protocol of the simulated desktop (`arpo_envs.sim.server`), refused: the
    state of running applications cannot be copied into a second desktop."""
    raise RequestError(
        f"{request.path}: a local desktop cannot be snapshotted or forked (its apps are real "
        "processes); fork the simulated desktop or a VM of the fleet",
        501,
    )


_UPLOAD_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
MAX_UPLOAD_LINKS = 40
"""Symbolic links an upload's path may pass through (the kernel's own limit)."""


def _open_unlinked(target: Path) -> tuple[int, list[Path]]:
    """`target` opened for an upload (`_UPLOAD_FLAGS`), its missing folders made, walking
    the path one name at a time from / with O_NOFOLLOW: a symbolic link is followed only
    when root owns it (the system's own, e.g. /lib), so a link that the desktop's user
    planted (in its home, in /tmp) can never send a write of the server (root) elsewhere.
    Returns the descriptor and the paths made. OSError(ELOOP) for a link the desktop's user
    owns, FileExistsError when a folder on the path is a file."""
    created: list[Path] = []
    links = 0
    names = list(target.parts[1:])
    at = Path("/")
    dirfd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        while names:
            name = names.pop(0)
            last = not names
            if name in ("", "."):
                continue
            try:
                st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISLNK(st.st_mode):
                if st.st_uid != 0:
                    raise OSError(
                        errno.ELOOP,
                        f"{at / name} is a symbolic link the desktop's user made; an upload "
                        "never follows one",
                    )
                links += 1
                if links > MAX_UPLOAD_LINKS:
                    raise OSError(errno.ELOOP, f"more than {MAX_UPLOAD_LINKS} links on the path")
                link = os.readlink(name, dir_fd=dirfd)
                names = [*Path(link).parts, *names]
                if link.startswith("/"):
                    names = names[1:]
                    os.close(dirfd)
                    dirfd, at = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), Path("/")
                continue
            if last:
                return os.open(name, _UPLOAD_FLAGS | os.O_NOFOLLOW, 0o666, dir_fd=dirfd), [
                    *created,
                    *([] if st is not None else [at / name]),
                ]
            if name == "..":
                nxt = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dirfd)
                at = at.parent
            else:
                if st is None:
                    os.mkdir(name, 0o777, dir_fd=dirfd)
                    created.append(at / name)
                elif not stat.S_ISDIR(st.st_mode):
                    raise FileExistsError(errno.EEXIST, f"{at / name} is not a folder")
                nxt = os.open(
                    name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd
                )
                at = at / name
            os.close(dirfd)
            dirfd = nxt
        raise IsADirectoryError(errno.EISDIR, f"{target} names a folder")
    finally:
        os.close(dirfd)


def _check_upload_target(fd: int, file_path: str) -> None:
    """400 unless the open file `fd` is a regular file outside KERNEL_FILE_SYSTEMS (a
    device such as /dev/full, a FIFO, a socket, /proc/self/mem): an upload onto such a path
    is the client's mistake, not the server's failure."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise RequestError(
            f"cannot write {file_path}: not a regular file (an upload writes files; this is a "
            "device, a FIFO or a socket)"
        )
    _check_kernel_path(os.readlink(f"/proc/self/fd/{fd}"), file_path)


def _check_kernel_path(real: str, file_path: str) -> None:
    """400 if the resolved path `real` lies in one of KERNEL_FILE_SYSTEMS."""
    if real.startswith(tuple(k + "/" for k in KERNEL_FILE_SYSTEMS)) and not real.startswith(
        "/dev/shm/"
    ):
        raise RequestError(
            f"cannot write {file_path}: {real} is a file of the kernel (under "
            f"{', '.join(KERNEL_FILE_SYSTEMS)}), not one an upload may write"
        )


def _os_status(e: OSError) -> int:
    """The HTTP status of a failed file operation: the client's path (400), a permission
    (403), or the machine (500: a full disk, an I/O error)."""
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return 403
    if e.errno in (
        errno.EISDIR,
        errno.ENOTDIR,
        errno.ENOENT,
        errno.ENAMETOOLONG,
        errno.ELOOP,
        errno.EINVAL,
        errno.ENXIO,
        errno.ESPIPE,
    ):  # a path nothing can be written to
        return 400
    return 500


async def _read_form(request: web.Request):
    """The request's form fields; 400 naming the problem if the body is not a valid form."""
    try:
        return await request.post()
    except (ValueError, LookupError, HttpProcessingError) as e:
        reason = str(e).replace("\n", " ").strip() or type(e).__name__
        raise RequestError(f"malformed form body ({request.content_type}): {reason}") from None


@contextlib.contextmanager
def _spawn_errors(command: str | list[str]):
    """The client's mistakes in starting a program as 400s naming them."""
    try:
        yield
    except FileNotFoundError as e:
        raise RequestError(f"no such program: {e.filename or command}") from None
    except PermissionError as e:
        raise RequestError(f"not executable: {e.filename or command}") from None
    except OSError as e:
        if e.errno == errno.E2BIG:
            raise RequestError(
                "the command and its arguments are longer than the system allows "
                "(E2BIG); pass long data in a file (/setup/upload) instead"
            ) from None
        if e.errno == errno.ENAMETOOLONG:
            raise RequestError(f"a file name in the command is too long: {e}") from None
        raise


# ---- one server process ------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m arpo_envs.desktop.server", description="one local desktop server"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5000, help="0: any free port")
    p.add_argument(
        "--token",
        default=None,
        help="bearer token (default: $ARPO_ENV_TOKEN); programs on this desktop can read either "
        "in /proc (this server's cmdline or environ): prefer --token-file",
    )
    p.add_argument(
        "--token-file",
        default=None,
        help="read the bearer token from this file and remove it (the token then sits in no "
        "environment or command line a program on the desktop can read)",
    )
    p.add_argument(
        "--token-fd",
        type=int,
        default=None,
        help="read the bearer token from this inherited descriptor (a pipe) and close it "
        "before anything runs: the token is never in a file (`arpo-envs up --tokens`)",
    )
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=720)
    p.add_argument("--display", type=int, default=None, help="X display number (default: free)")
    p.add_argument("--root", default=None, help="state directory (default: a new temp dir)")
    p.add_argument("--files-template", default=None, help="copied into home on every reset")
    p.add_argument("--home-alias", default="/home/user", help="'' for none")
    p.add_argument("--execute-timeout", type=float, default=120.0)
    p.add_argument("--no-inprocess", action="store_true", help="every command as a subprocess")
    p.add_argument("--no-cursor", action="store_true", help="no pointer in screenshots")
    p.add_argument(
        "--tmp-max-mb", type=int, default=512, help="size of the desktop's own /tmp (MiB)"
    )
    p.add_argument(
        "--atspi",
        action="store_true",
        help="a session bus, the AT-SPI registry and LibreOffice's GTK 3 plugin: /accessibility "
        "gives GTK apps' and LibreOffice's whole trees",
    )
    p.add_argument(
        "--a11y-max-nodes",
        type=int,
        default=10_000,
        help="with --atspi: most nodes one /accessibility answer walks (the rest is left out)",
    )
    p.add_argument(
        "--run-as",
        default="arpo-desktop",
        help="as root, run the desktop's programs (Xvfb, apps, commands) as this user, created "
        "if missing, so none can read this server's memory or token; '' for the server's user",
    )
    p.add_argument(
        "--require-own-user",
        action="store_true",
        help="refuse to start when the programs cannot run as --run-as (not root)",
    )
    p.add_argument(
        "--vm-guest",
        action="store_true",
        help="inside a fleet VM: bind any address without a token (only the host's loopback "
        "port forward reaches it)",
    )
    return p


def _token(args: argparse.Namespace) -> str | None:
    """The bearer token: from --token-fd (a pipe, read to its end and closed), else
    --token-file (read, then the file removed), else --token, else $ARPO_ENV_TOKEN (taken
    out of this process's environment, which its children inherit). The last two stay
    readable by programs on this desktop in /proc/<server pid>/cmdline or environ, which is
    logged."""
    if args.token_fd is not None:
        try:
            with open(args.token_fd, "rb", closefd=True) as pipe:
                token = pipe.read(4096).decode("utf-8", "replace").strip()
        except OSError as e:
            raise ValueError(f"--token-fd {args.token_fd}: cannot read the token: {e}") from None
        if not token:
            raise ValueError(f"--token-fd {args.token_fd}: the descriptor holds no token")
        os.environ.pop("ARPO_ENV_TOKEN", None)
        return token
    if args.token_file:
        path = Path(args.token_file)
        try:
            token = path.read_text().strip()
        finally:
            path.unlink(missing_ok=True)
        if not token:
            raise ValueError(f"--token-file {args.token_file}: the file holds no token")
        os.environ.pop("ARPO_ENV_TOKEN", None)
        return token
    token = args.token or os.environ.pop("ARPO_ENV_TOKEN", None) or None
    if token:
        log.warning(
            "the bearer token came from %s: programs on this desktop can read it in "
            "/proc/%d/%s; pass it with --token-file instead",
            "--token" if args.token else "$ARPO_ENV_TOKEN", os.getpid(),
            "cmdline" if args.token else "environ",
        )  # fmt: skip
    return token


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    try:
        config = DesktopConfig(
            width=args.width,
            height=args.height,
            host=args.host,
            port=args.port,
            token=_token(args),
            display=args.display,
            root=args.root,
            files_template=args.files_template,
            home_alias=args.home_alias or None,
            execute_timeout_s=args.execute_timeout,
            inprocess=not args.no_inprocess,
            draw_cursor=not args.no_cursor,
            vm_guest=args.vm_guest,
            atspi=args.atspi,
            a11y_max_nodes=args.a11y_max_nodes,
            tmp_max_bytes=args.tmp_max_mb << 20,
            run_as=args.run_as,
            require_own_user=args.require_own_user,
        )
    except ValueError as e:
        print(f"desktop server: {e}", file=sys.stderr)
        return 2
    own_root = config.root is None
    root = Path(config.root or tempfile.mkdtemp(prefix="arpo-desktop-")).resolve()
    (root / "home").mkdir(parents=True, exist_ok=True)
    # before any thread exists: a mount namespace is per thread
    host_ns = homes.private_namespace()
    mounted = (
        host_ns is not None
        and bool(config.home_alias)
        and homes.private_home(root / "home", config.home_alias)
    )
    host_tmp = (
        homes.private_tmp(root, config.tmp_max_bytes, (config.files_template or "",))
        if host_ns is not None
        else None
    )
    if host_tmp is None:
        log.warning("no private /tmp: the desktop's $TMPDIR is %s, emptied on reset", root / "tmp")
    else:  # the server's own temporary files (uploads) do not count against the desktop's
        tempfile.tempdir = str(root / "spool")
        os.makedirs(tempfile.tempdir, exist_ok=True)
        # what the server reads from the host's /tmp, reached through its descriptor
        host = f"/proc/{os.getpid()}/fd/{host_tmp}"
        if config.files_template:
            config = dataclasses.replace(
                config, files_template=_host_path(config.files_template, root, host)
            )
        os.environ["ARPO_DESKTOP_CACHE"] = _host_path(str(homes.cache_dir()), root, host)
    try:
        user = _desktop_user(config, root, host_ns is not None)
    except users.DesktopUserError as e:
        print(f"desktop server: {e}", file=sys.stderr)
        return 2
    desk = Desktop(config, root, mounted, host_ns, host_tmp, user)
    try:
        desk.start()
        asyncio.run(_serve(desk))
    finally:
        desk.stop()
        if own_root:
            if host_tmp is not None:  # the tmpfs would keep its mount point in the root
                homes.unmount(root / "tmp")
            shutil.rmtree(root, ignore_errors=True)
    return 0


def _desktop_user(config: DesktopConfig, root: Path, namespaced: bool) -> users.DesktopUser | None:
    """The user the desktop's programs run as (None: this process's), with what it needs
    made reachable: in the private namespace a /proc that hides other users' processes and
    a view of the server's Python past folders closed to it (`user.open_paths`)."""
    user = users.resolve(config.run_as, config.require_own_user)
    if user is None:
        return None
    os.chmod(root, 0o711)  # its home, bin and run are reached through it
    needed = [*users.runtime_paths(), root]
    if namespaced:
        users.private_proc()
        cache = homes.cache_dir()
        cache.mkdir(parents=True, exist_ok=True)  # the server's, kept in sight for it
        also = [cache, *([Path(config.files_template)] if config.files_template else [])]
        users.open_paths(user, needed, [Path(os.path.abspath(p)) for p in also])
        return user
    closed = sorted({str(b) for p in needed if (b := user.blocker(p)) is not None})
    if closed:
        msg = (
            f"the user {user.name!r} cannot reach the server's Python or the desktop's folder "
            f"(closed: {', '.join(closed)}) and without a private mount namespace nothing "
            "opens them: the desktop's programs run as the server's user"
        )
        if config.require_own_user:
            raise users.DesktopUserError(msg + "; give those folders o+x")
        log.warning("%s", msg)
        return None
    return user


def _host_path(path: str, root: Path, host_tmp: str) -> str:
    """`path` as this process reaches it once /tmp is the desktop's own: a path under the
    host's /tmp (but not in the desktop's root, which is bound into it) through `host_tmp`."""
    p = Path(path).resolve()
    if p.is_relative_to("/tmp") and not p.is_relative_to(root):
        return f"{host_tmp}/{p.relative_to('/tmp')}"
    return path


async def _serve(desk: Desktop) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    server = DesktopServer(desk)
    runner = web.AppRunner(server.make_app(), access_log=None, handle_signals=False)
    await runner.setup()
    cfg = desk.config
    site = web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True)
    await site.start()
    port = runner.addresses[0][1]
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    ready = {
        "event": "ready",
        "url": f"http://{host}:{port}",
        "display": desk.display.name,
        "root": str(desk.root),
        "home": desk.home,
        "pid": os.getpid(),
    }
    print(json.dumps(ready), flush=True)
    # nothing more for whoever started us (who may close the pipe): the rest goes to stderr
    os.dup2(2, 1)
    recorder = asyncio.create_task(_record_tree(desk.root / TREE_FILE))
    try:
        await stop.wait()
    finally:
        recorder.cancel()
        await runner.cleanup()


async def _record_tree(path: Path, every_s: float = 1.0) -> None:
    last: dict[int, int] = {}
    while True:
        tree = await asyncio.to_thread(tree_snapshot, os.getpid())
        if tree != last:
            tmp = path.with_suffix(".tmp")
            # the server's: 0600, out of reach of the desktop's user (`arpo_envs.desktop.user`)
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                f.write(json.dumps(tree))
            os.replace(tmp, path)
            last = tree
        await asyncio.sleep(every_s)


if __name__ == "__main__":
    sys.exit(main())

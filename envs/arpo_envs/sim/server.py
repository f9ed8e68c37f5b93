"""The simulated desktop's HTTP server: the OSWorld VM protocol plus the project's scene endpoints.

    arpo-envs sim -n 8 --base-port 5100     # eight desktops on 5100..5107

| method, path | body | answer |
|---|---|---|
| GET /screenshot | - | PNG of the screen (with the pointer) |
| POST /execute, /setup/execute | {command: list or str, shell} | {status, output, error, returncode} |
| POST /run_python | {code} | {status, message, need_more, output, error, return_code} |
| POST /screen_size | - | {width, height} |
| GET /platform | - | text "Linux" |
| GET /terminal | - | {output: null, status} (no terminal; a liveness ping) |
| GET /cursor_position | - | [x, y] |
| GET /accessibility | - | {AT: xml} |
| POST /reset | {} or {family, seed} | rebuilds the current scene (or loads the given one); uploaded files go |
| POST /setup/upload | multipart file_path, file_data | keeps the file in memory; text "File Uploaded: <n> bytes" |
| POST /file | form or JSON file_path | an uploaded file's bytes; 404 if there is none |
| POST /sim/scene | {family, seed, screen?} | loads a task scene; {status, task_id, instruction} |
| POST /sim/state | {path: "a.b"} | {value} for checkers; 404 if the path does not exist |
| GET /sim/stats | - | per named span (interpret, render_encode, scene, snapshot, fork): count, mean_ms, max_ms; `files`: path -> sha256 of each uploaded file |
| POST /snapshot | {} | saves a copy of the whole desktop (scene, widgets, pointer, files, task); {status, handle} |
| POST /fork | {handle, n} | starts `n` (1..MAX_FORK) child desktops in the saved state; {status, clones: [{url, name}]} |
| POST /release | {handle} | stops the snapshot's children and drops the copy; {status} |

Fork (tree rollouts, `arpo.actor.tree` through `DesktopProvider`): a child is a whole
simulated desktop server of this process on a port of its own (same host, token and
latency distribution; its own latency draws), answering everything above, /snapshot and
/fork included (a tree of forks), and /reset like its parent (back to the start of its
scene). Its state is a deep copy (`DesktopState.copy`, 0.2-0.4 ms): nothing it does is
seen by its parent or its siblings, and its first screenshot is its parent's bytes at
snapshot time. Bounds, each a JSON error: `n` outside 1..MAX_FORK is 400; more than
MAX_CHILDREN live children of one desktop, MAX_CLONES forked desktops in the process, or
MAX_SNAPSHOTS saved states of one desktop is 429; a handle that is unknown here (never
made, released, or expired) is 410 naming it (not 404: the client reads a 404 as "this
server cannot fork"). A snapshot not released within `snapshot_ttl_s` is released by
the server (its children stopped), with a warning in the log. Stopping a desktop stops
its children.

Commands run through `interpreter` (pyautogui code interpreted from its syntax tree,
never executed); like OSWorld's server, /execute answers status "success" whenever
the command was run, with the program's own return code. Answers of /execute and
/screenshot are delayed by the configured latency (see `latency.py`). Errors are
JSON (see `server_common`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import hashlib
import logging
import secrets
import time
import types
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from PIL import Image

from arpo_envs.server_common import (
    RequestError,
    ServerSecurity,
    check_type,
    make_app,
    read_json,
)
from arpo_envs.sim.desktop import Desktop, StatePathError
from arpo_envs.sim.interpreter import ProgramError, RunResult, command_to_code, execute
from arpo_envs.sim.latency import LatencyConfig
from arpo_envs.sim.tasks import FAMILIES, MIN_SCREEN, TaskSpec, load_scene

MAX_FILES = 64
"""Most files a simulated desktop keeps (`/setup/upload`)."""
MAX_FILE_BYTES = 16 << 20
"""Largest file a simulated desktop takes."""
MAX_FORK = 16
"""Most children one `POST /fork` starts."""
MAX_CHILDREN = 64
"""Most live children of one desktop, all its snapshots together (more: 429)."""
MAX_CLONES = 256
"""Most live forked desktops in one process, every level of a tree of forks counted (more:
429). A child holds tens of KB until it draws its screen again, then about 4 MB (its frame
and PNG bands; `benchmarks/bench_fork.py`)."""
MAX_SNAPSHOTS = 64
"""Most saved states one desktop keeps (more: 429). A saved state holds a few MB once its
desktop moved on: the pixels and PNG bands of the frame it showed."""
CHILD_SHUTDOWN_S = 2.0
"""How long a released child waits for requests still running on it before closing them."""

log = logging.getLogger("arpo_envs.sim")


def _failed(e: BaseException) -> RunResult:
    """What `python -c` answers for a program that fails this way (click(1e999, 1), 50k
    unary minus, a lone surrogate): exit code 1 and the error on stderr; never a 500."""
    return RunResult("", f"Traceback (most recent call last):\n{type(e).__name__}: {e}\n", 1)


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated desktop server."""

    width: int = 1280
    """Screen width in pixels."""
    height: int = 720
    """Screen height in pixels."""
    host: str = "127.0.0.1"
    """Address to bind; anything but loopback needs `token`."""
    port: int = 5000
    """TCP port (0: any free port)."""
    token: str | None = None
    """Bearer token every request must carry (None: no auth, loopback only)."""
    draw_cursor: bool = True
    """Draw the mouse pointer into screenshots."""
    sleep_cap_s: float = 0.0
    """time.sleep in actions is waited up to this many seconds per request (0: not waited;
    the simulated widgets have no animations to wait for)."""
    latency: LatencyConfig = field(default_factory=LatencyConfig)
    """Delay before each /execute and /screenshot answer."""
    index: int = 0
    """This desktop's number in a multi-desktop process (picks the slow one, seeds latency)."""
    offload_encode: bool = True
    """Encode screenshots in a worker thread (zlib releases the GIL, so several desktops
    in one process use more than one core)."""
    snapshot_ttl_s: float = 1800.0
    """A snapshot not released within this many seconds is released by the server (its
    children stopped) and logged: a client that died does not leak desktops."""

    def __post_init__(self) -> None:
        if self.width < MIN_SCREEN[0] or self.height < MIN_SCREEN[1]:
            raise ValueError(
                f"screen {self.width}x{self.height} is too small for the task scenes; "
                f"use at least {MIN_SCREEN[0]}x{MIN_SCREEN[1]}"
            )
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.sleep_cap_s < 0:
            raise ValueError(f"sleep_cap_s must be >= 0, got {self.sleep_cap_s}")
        if not self.snapshot_ttl_s > 0:
            raise ValueError(
                f"snapshot_ttl_s must be > 0 seconds, got {self.snapshot_ttl_s} (the default "
                "1800 releases a snapshot a client forgot after 30 minutes)"
            )
        ServerSecurity(self.host, self.token)  # refuses an exposed address without a token


@dataclass(slots=True)
class Span:
    """Count, total and maximum duration of one named stage."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.max_s = max(self.max_s, seconds)

    def summary(self) -> dict[str, float]:
        mean = self.total_s / self.count if self.count else 0.0
        return {"count": self.count, "mean_ms": mean * 1e3, "max_ms": self.max_s * 1e3}


# ---- fork: copies of a desktop's state -----------------------------------------------------

T = TypeVar("T")

_ATOMIC = (
    type(None), bool, int, float, complex, str, bytes, range, type, types.ModuleType,
    types.BuiltinFunctionType, types.CodeType,
)  # fmt: skip


def fork_copy(obj: T, memo: dict[int, Any] | None = None) -> T:
    """A deep copy of `obj` that shares nothing mutable with it, closures included.

    `copy.deepcopy` alone is not enough: it copies functions by reference, and a scene's
    callbacks are closures over its widgets (type_submit's `do_submit` reads its text
    field), so a copy's Submit would read the original's field. Every function reachable
    from `obj` that has a closure or defaults is rebuilt first, with new cells; the cells
    are then filled with copies made with the same memo, so a rebuilt closure sees the
    copy's widgets. PIL images are copied with `Image.copy` (a memcpy, not deepcopy's
    pickle round trip); bytes and strings are shared (immutable). `memo` may map ids of
    objects to what the copy holds instead (`DesktopState.copy` drops a cache this way).
    Walked: dicts, lists, tuples, sets, instance attributes (`__dict__` and slots),
    bound methods, functools.partial, closure cells and defaults.
    """
    memo = {} if memo is None else memo
    rebuilt: list[tuple[types.FunctionType, types.FunctionType]] = []
    seen: set[int] = set()
    stack: list[Any] = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, _ATOMIC) or id(x) in seen:
            continue
        seen.add(id(x))
        if id(x) in memo:
            continue
        if isinstance(x, types.FunctionType):
            if x.__closure__ or x.__defaults__ or x.__kwdefaults__:
                cells = tuple(types.CellType() for _ in x.__closure__ or ())
                fn = types.FunctionType(x.__code__, x.__globals__, x.__name__, None, cells or None)
                fn.__qualname__, fn.__module__ = x.__qualname__, x.__module__
                memo[id(x)] = fn
                rebuilt.append((x, fn))
                for cell in x.__closure__ or ():
                    with contextlib.suppress(ValueError):  # an empty cell
                        stack.append(cell.cell_contents)
                stack += [x.__defaults__, x.__kwdefaults__, x.__dict__]
        elif isinstance(x, Image.Image):
            memo[id(x)] = x.copy()
        elif isinstance(x, dict):
            stack += x.keys()
            stack += x.values()
        elif isinstance(x, (list, tuple, set, frozenset)):
            stack += x
        elif isinstance(x, types.MethodType):
            stack += [x.__self__, x.__func__]
        elif isinstance(x, functools.partial):
            stack += [x.func, x.args, x.keywords]
        else:
            stack += getattr(x, "__dict__", {}).values()
            for cls in type(x).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if name not in ("__dict__", "__weakref__") and hasattr(x, name):
                        stack.append(getattr(x, name))
    out = copy.deepcopy(obj, memo)
    for old, fn in rebuilt:
        for cell, new_cell in zip(old.__closure__ or (), fn.__closure__ or (), strict=True):
            with contextlib.suppress(ValueError):
                new_cell.cell_contents = copy.deepcopy(cell.cell_contents, memo)
        fn.__defaults__ = copy.deepcopy(old.__defaults__, memo)
        fn.__kwdefaults__ = copy.deepcopy(old.__kwdefaults__, memo)
        fn.__dict__.update(copy.deepcopy(old.__dict__, memo))
    return out


@dataclass(slots=True)
class DesktopState:
    """Everything a simulated desktop's answers depend on: what `/snapshot` saves."""

    desk: Desktop
    """The screen: windows, widgets and their callbacks, focus, menu, pointer, held keys,
    clipboard, task results (`state`), the PNG of the last screenshot."""
    task: TaskSpec | None
    """The scene loaded (what /reset rebuilds)."""
    files: dict[str, bytes]
    """What `/setup/upload` put there."""

    def copy(self) -> DesktopState:
        """A deep copy (`fork_copy`), 0.2-0.4 ms for a task scene. The desktop's frame cache
        (the rendered screen, 2.7 MB at 1280x720) is not copied: `Desktop.render` draws it
        again when it is None, and the PNG of the last screenshot is kept (bytes, shared),
        so the copy's first screenshot is the original's bytes without rendering."""
        memo: dict[int, Any] = {}
        frame = getattr(self.desk, "_frame", None)
        if frame is not None:
            memo[id(frame)] = None
        desk, task = fork_copy((self.desk, self.task), memo)
        return DesktopState(desk, task, dict(self.files))


@dataclass(slots=True)
class Child:
    """A desktop forked from a snapshot, served by this process."""

    name: str
    url: str
    server: SimDesktopServer
    runner: web.AppRunner


@dataclass(slots=True)
class Snapshot:
    """A saved state and the children started from it."""

    handle: str
    state: DesktopState
    """Never served: each child gets a copy of it."""
    children: list[Child] = field(default_factory=list)
    forked: int = 0
    """Children started from it so far (numbers their names)."""
    expiry: asyncio.TimerHandle | None = None


class _Clones:
    """The process's count of live forked desktops (`MAX_CLONES`); one event loop touches it.
    A fork adds its whole count when it is allowed, before it starts any child (so forks of
    other desktops at the same time see it); each child's stop takes its one back."""

    live = 0


def _base_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class SimDesktopServer:
    """One simulated desktop and its aiohttp application."""

    def __init__(self, config: SimConfig | None = None, state: DesktopState | None = None):
        """`state`: start in this state (a fork's child; taken, not copied) instead of an
        empty desktop."""
        self.config = config or SimConfig()
        if state is None:
            state = DesktopState(
                Desktop(self.config.width, self.config.height, draw_cursor=self.config.draw_cursor),
                None,
                {},
            )
        self.desk = state.desk
        self.task: TaskSpec | None = state.task
        self.latency = self.config.latency.sampler(self.config.index)
        # Requests of one desktop apply in arrival order; the lock also keeps an action from
        # changing the screen while a worker thread encodes it.
        self._lock = asyncio.Lock()
        # named timing spans of the work done in this server (not the added latency)
        self.spans: dict[str, Span] = {}
        self.files: dict[str, bytes] = state.files
        """The desktop's files: what `/setup/upload` put there (cleared by `/reset`)."""
        self.snapshots: dict[str, Snapshot] = {}
        """Saved states by handle, each with the children forked from it."""
        # Handles released by the server (snapshot_ttl_s), for the 410's message.
        self._expired: OrderedDict[str, None] = OrderedDict()
        # /snapshot, /fork and /release of one desktop run one at a time: a release never
        # overlaps a fork of the same handle, and the counts checked are the counts used.
        self._fork_lock = asyncio.Lock()
        self._expiring: set[asyncio.Task[None]] = set()
        self._stopping = False

    def make_app(self) -> web.Application:
        app = make_app(ServerSecurity(self.config.host, self.config.token))
        r = app.router
        r.add_get("/screenshot", self.screenshot)
        r.add_post("/execute", self.execute)
        r.add_post("/setup/execute", self.execute)
        r.add_post("/run_python", self.run_python)
        r.add_post("/screen_size", self.screen_size)
        r.add_get("/platform", self.platform)
        r.add_get("/terminal", self.terminal)
        r.add_get("/cursor_position", self.cursor_position)
        r.add_get("/accessibility", self.accessibility)
        r.add_post("/reset", self.reset)
        r.add_post("/setup/upload", self.upload)
        r.add_post("/file", self.file)
        r.add_post("/sim/scene", self.scene)
        r.add_post("/sim/state", self.state)
        r.add_get("/sim/stats", self.stats)
        r.add_post("/snapshot", self.snapshot)
        r.add_post("/fork", self.fork)
        r.add_post("/release", self.release)
        app.on_shutdown.append(self._release_all)
        return app

    @contextlib.contextmanager
    def _span(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.spans.setdefault(name, Span()).add(time.perf_counter() - t0)

    async def _delay(self) -> None:
        s = self.latency.seconds()
        if s > 0:
            await asyncio.sleep(s)

    # ---- OSWorld protocol ---------------------------------------------------------------

    async def screenshot(self, request: web.Request) -> web.Response:
        await self._delay()
        async with self._lock:
            png = self.desk.cached_png()
            if png is None:
                with self._span("render_encode"):
                    if self.config.offload_encode:
                        png = await asyncio.to_thread(self.desk.screenshot_png)
                    else:
                        png = self.desk.screenshot_png()
        return web.Response(body=png, content_type="image/png")

    async def _run(self, code: str) -> RunResult:
        async with self._lock:
            with self._span("interpret"):
                try:
                    result = execute(code, self.desk)
                except (OverflowError, RecursionError, ValueError, UnicodeError, MemoryError) as e:
                    result = _failed(e)
        wait = min(result.sleep_s, self.config.sleep_cap_s)
        if wait > 0:
            await asyncio.sleep(wait)
        return result

    async def execute(self, request: web.Request) -> web.Response:
        body = await read_json(request, {"command": (str, list)})
        shell = body.get("shell", False)
        check_type("shell", shell, bool)
        command = body["command"]
        if isinstance(command, list) and not all(isinstance(a, str) for a in command):
            raise RequestError("field 'command' must be a string or a list of strings")
        await self._delay()
        try:
            code = command_to_code(command, shell)
        except ProgramError as e:
            result = RunResult("", f"{e}\n", 1)
        except (OverflowError, RecursionError, ValueError, UnicodeError, MemoryError) as e:
            result = _failed(e)  # e.g. 50k unary minus: too deep to parse
        else:
            result = await self._run(code)
        return web.json_response(
            {
                "status": "success",
                "output": result.output,
                "error": result.error,
                "returncode": result.returncode,
            }
        )

    async def run_python(self, request: web.Request) -> web.Response:
        body = await read_json(request, {"code": str})
        if not body["code"].strip():
            raise RequestError("field 'code' is empty")
        result = await self._run(body["code"])
        message = result.output + (
            ("\n" if result.output else "") + result.error if result.error else ""
        )
        return web.json_response(
            {
                "status": "success" if result.returncode == 0 else "error",
                "message": message,
                "need_more": False,
                "output": result.output,
                "error": result.error,
                "return_code": result.returncode,
            }
        )

    async def screen_size(self, request: web.Request) -> web.Response:
        return web.json_response({"width": self.desk.width, "height": self.desk.height})

    async def platform(self, request: web.Request) -> web.Response:
        return web.Response(text="Linux")

    async def terminal(self, request: web.Request) -> web.Response:
        return web.json_response({"output": None, "status": "success"})

    async def cursor_position(self, request: web.Request) -> web.Response:
        return web.json_response(list(self.desk.cursor))

    async def accessibility(self, request: web.Request) -> web.Response:
        async with self._lock:
            xml = self.desk.accessibility_xml()
        return web.json_response({"AT": xml})

    # ---- the project's endpoints --------------------------------------------------------

    def _load(self, body: dict[str, Any]) -> TaskSpec:
        family, seed = body["family"], body["seed"]
        if family not in FAMILIES:
            raise RequestError(f"unknown task family {family!r}; known: {', '.join(FAMILIES)}")
        screen = body.get("screen")
        if screen is not None and screen != [self.desk.width, self.desk.height]:
            raise RequestError(
                f"the task was generated for a {screen} screen but this desktop is "
                f"{self.desk.width}x{self.desk.height}; start the server with that size or "
                "regenerate the task"
            )
        self.task = load_scene(self.desk, family, seed)
        return self.task

    def _scene_answer(self) -> dict[str, Any]:
        if self.task is None:
            return {"status": "success", "task_id": None, "instruction": None}
        return {
            "status": "success",
            "task_id": self.task.task_id,
            "instruction": self.task.instruction,
        }

    async def scene(self, request: web.Request) -> web.Response:
        body = await read_json(request, {"family": str, "seed": int})
        async with self._lock:
            with self._span("scene"):
                self._load(body)
        return web.json_response(self._scene_answer())

    async def reset(self, request: web.Request) -> web.Response:
        """Back to the start of the current scene (or load `family`/`seed` if given)."""
        body = await read_json(request)
        async with self._lock:
            self.files.clear()
            if "family" in body or "seed" in body:
                for name, kind in (("family", str), ("seed", int)):
                    if name not in body:
                        raise RequestError(f"missing field {name!r} (reset takes both or neither)")
                    check_type(name, body[name], kind)
                self._load(body)
            elif self.task is not None:
                self.task = load_scene(self.desk, self.task.family, self.task.seed)
            else:
                self.desk.clear()
        return web.json_response(self._scene_answer())

    async def state(self, request: web.Request) -> web.Response:
        body = await read_json(request, {"path": str})
        try:
            value = self.desk.lookup(body["path"])
        except StatePathError as e:
            raise RequestError(str(e), status=404) from None
        return web.json_response({"value": value})

    async def stats(self, request: web.Request) -> web.Response:
        """Count and duration of the server's own work per named span, and the sha256 of
        every file uploaded since the last reset."""
        spans = {name: span.summary() for name, span in self.spans.items()}
        files = {p: hashlib.sha256(b).hexdigest() for p, b in self.files.items()}
        return web.json_response({**spans, "files": files})

    async def upload(self, request: web.Request) -> web.Response:
        """OSWorld's `/setup/upload` (multipart `file_path`, `file_data`): the file is kept
        in memory, at most MAX_FILES files of at most MAX_FILE_BYTES bytes."""
        if not request.content_type.startswith("multipart/"):
            raise RequestError("send multipart/form-data with fields file_path and file_data")
        path, data = "", b""
        async for part in await request.multipart():
            if not isinstance(part, aiohttp.BodyPartReader):
                raise RequestError("nested multipart is not accepted")
            raw = bytearray()
            while chunk := await part.read_chunk(1 << 16):
                raw += chunk
                if len(raw) > MAX_FILE_BYTES:
                    raise RequestError(f"a file is at most {MAX_FILE_BYTES} bytes here", 413)
            if part.name == "file_path":
                path = raw.decode("utf-8", "replace")
            elif part.name == "file_data":
                data = bytes(raw)
        if not path:
            raise RequestError("file_path and file_data are required")
        async with self._lock:
            if path not in self.files and len(self.files) >= MAX_FILES:
                raise RequestError(f"at most {MAX_FILES} files on a simulated desktop", 413)
            self.files[path] = data
        return web.Response(text=f"File Uploaded: {len(data)} bytes")

    async def file(self, request: web.Request) -> web.Response:
        """OSWorld's `/file` (form or JSON `file_path`): an uploaded file's bytes, 404 if none."""
        if request.content_type == "application/json":
            path = (await read_json(request, {"file_path": str}))["file_path"]
        else:
            path = str((await request.post()).get("file_path") or "")
        data = self.files.get(path)
        if data is None:
            raise RequestError(f"File not found: {path}", 404)
        return web.Response(body=data, content_type="application/octet-stream")

    # ---- fork ---------------------------------------------------------------------------

    async def snapshot(self, request: web.Request) -> web.Response:
        """Save a copy of the whole desktop; answer its handle."""
        await read_json(request)
        async with self._fork_lock:
            self._check_running()
            if len(self.snapshots) >= MAX_SNAPSHOTS:
                raise RequestError(
                    f"this desktop already keeps {MAX_SNAPSHOTS} snapshots; release some "
                    "(POST /release) before taking more",
                    429,
                )
            async with self._lock:  # no action runs while the state is copied
                with self._span("snapshot"):
                    saved = DesktopState(self.desk, self.task, self.files).copy()
            handle = f"snap-{secrets.token_hex(8)}"
            snap = Snapshot(handle, saved)
            loop = asyncio.get_running_loop()
            snap.expiry = loop.call_later(self.config.snapshot_ttl_s, self._expire, handle)
            self.snapshots[handle] = snap
        return web.json_response({"status": "success", "handle": handle})

    async def fork(self, request: web.Request) -> web.Response:
        """Start `n` child desktops in a snapshot's state; answer their URLs and names."""
        body = await read_json(request, {"handle": str, "n": int})
        n = body["n"]
        if not 1 <= n <= MAX_FORK:
            raise RequestError(f"field 'n' must be in 1..{MAX_FORK}, got {n}")
        async with self._fork_lock:
            self._check_running()
            snap = self._snapshot_of(body["handle"])
            live = sum(len(s.children) for s in self.snapshots.values())
            if live + n > MAX_CHILDREN:
                raise RequestError(
                    f"this desktop has {live} live children; {n} more would pass its bound of "
                    f"{MAX_CHILDREN}: release snapshots (POST /release) first",
                    429,
                )
            if _Clones.live + n > MAX_CLONES:
                raise RequestError(
                    f"this process serves {_Clones.live} forked desktops; {n} more would pass "
                    f"its bound of {MAX_CLONES}: release snapshots (POST /release) first",
                    429,
                )
            host = self.config.host
            if host in ("0.0.0.0", "::", ""):  # bound to every address: answer the one used
                host = request.url.host or "127.0.0.1"
            # Reserved before the first await: the lock above is this desktop's, and the
            # other desktops of the process fork meanwhile; they see the whole count taken.
            _Clones.live += n
            with self._span("fork"):
                made: list[Child] = []
                try:
                    for _ in range(n):
                        made.append(await self._start_child(snap, host))
                except BaseException:
                    _Clones.live -= n - len(made)  # the places no child took
                    await asyncio.gather(*(self._stop_child(c) for c in made))
                    raise
                snap.children += made
        clones = [{"url": c.url, "name": c.name} for c in made]
        return web.json_response({"status": "success", "clones": clones})

    async def release(self, request: web.Request) -> web.Response:
        """Stop a snapshot's children and drop its saved state."""
        body = await read_json(request, {"handle": str})
        async with self._fork_lock:
            snap = self._snapshot_of(body["handle"])
            await self._drop(snap)
        return web.json_response({"status": "success"})

    def _check_running(self) -> None:
        if self._stopping:  # a request that was waiting for the lock when the stop began
            raise RequestError("this desktop is stopping: it takes no snapshot or fork", 503)

    def _snapshot_of(self, handle: str) -> Snapshot:
        snap = self.snapshots.get(handle)
        if snap is not None:
            return snap
        shown = repr(handle[:100]) + ("..." if len(handle) > 100 else "")
        if handle in self._expired:
            raise RequestError(
                f"snapshot {shown} expired: it was not released within "
                f"{self.config.snapshot_ttl_s:g} s, so the server released it (its children "
                "are stopped)",
                410,
            )
        raise RequestError(
            f"unknown snapshot handle {shown}: never made by this desktop or already released",
            410,
        )

    async def _start_child(self, snap: Snapshot, host: str) -> Child:
        """One child server on a free port of `host`, in a copy of `snap`'s state. Its
        place in `_Clones.live` is the caller's (reserved for the whole fork; given back by
        `_stop_child`, or by the caller when this raises)."""
        snap.forked += 1
        name = f"{snap.handle}-{snap.forked}"
        lat = self.config.latency  # same distribution, the child's own draws
        lat = dataclasses.replace(lat, seed=zlib.crc32(f"{lat.seed}:{name}".encode()))
        cfg = dataclasses.replace(self.config, port=0, latency=lat)
        server = SimDesktopServer(cfg, snap.state.copy())
        runner = web.AppRunner(
            server.make_app(),
            access_log=None,
            handle_signals=False,
            shutdown_timeout=CHILD_SHUTDOWN_S,
        )
        try:
            await runner.setup()
            site = web.TCPSite(runner, cfg.host, 0)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        return Child(name, _base_url(host, runner.addresses[0][1]), server, runner)

    async def _stop_child(self, child: Child) -> None:
        """Close the child's port and connections (its own snapshots' children with it)."""
        try:
            await child.runner.cleanup()
        finally:
            _Clones.live -= 1

    async def _drop(self, snap: Snapshot) -> None:
        """Forget `snap` and stop its children (the caller holds `_fork_lock`)."""
        self.snapshots.pop(snap.handle, None)
        if snap.expiry is not None:
            snap.expiry.cancel()
        children, snap.children = snap.children, []
        results = await asyncio.gather(
            *(self._stop_child(c) for c in children), return_exceptions=True
        )
        for child, r in zip(children, results, strict=True):
            if isinstance(r, BaseException):
                log.warning("fork child %s did not stop cleanly: %r", child.name, r)

    def _expire(self, handle: str) -> None:
        """snapshot_ttl_s passed: release the snapshot in a task of its own."""
        task = asyncio.get_running_loop().create_task(self._release_expired(handle))
        self._expiring.add(task)
        task.add_done_callback(self._expired_done)

    def _expired_done(self, task: asyncio.Task[None]) -> None:
        self._expiring.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("releasing an expired snapshot failed", exc_info=task.exception())

    async def _release_expired(self, handle: str) -> None:
        async with self._fork_lock:
            snap = self.snapshots.get(handle)
            if snap is None:
                return
            log.warning(
                "snapshot %s was not released within %g s: releasing it and stopping its %d "
                "children",
                handle,
                self.config.snapshot_ttl_s,
                len(snap.children),
            )
            self._expired[handle] = None
            while len(self._expired) > MAX_SNAPSHOTS:  # the last ones are enough to explain a 410
                self._expired.popitem(last=False)
            await self._drop(snap)

    async def _release_all(self, app: web.Application) -> None:
        """The server stops: so do all its children."""
        self._stopping = True
        for task in list(self._expiring):
            task.cancel()
        async with self._fork_lock:
            for snap in list(self.snapshots.values()):
                await self._drop(snap)


# ---- several desktops in one process ----------------------------------------------------------


async def start_servers(configs: list[SimConfig]) -> tuple[list[web.AppRunner], list[str]]:
    """Start one server per config; returns the runners and the base URLs actually bound."""
    runners: list[web.AppRunner] = []
    urls: list[str] = []
    try:
        for cfg in configs:
            server = SimDesktopServer(cfg)
            runner = web.AppRunner(server.make_app(), access_log=None, handle_signals=False)
            await runner.setup()
            site = web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True)
            await site.start()
            runners.append(runner)
            urls.append(_base_url(cfg.host, runner.addresses[0][1]))
    except BaseException:
        for runner in runners:
            await runner.cleanup()
        raise
    return runners, urls


@contextlib.asynccontextmanager
async def running(configs: list[SimConfig]) -> AsyncIterator[list[str]]:
    """Serve `configs` for the duration of an `async with`; yields the base URLs."""
    runners, urls = await start_servers(configs)
    try:
        yield urls
    finally:
        for runner in runners:
            await runner.cleanup()


async def serve_until(configs: list[SimConfig], stop: asyncio.Event, announce=print) -> None:
    """Serve every config until `stop` is set, then close all of them."""
    t0 = time.perf_counter()
    runners, urls = await start_servers(configs)
    try:
        announce(f"arpo-envs sim: {len(urls)} desktops ready in {time.perf_counter() - t0:.2f} s")
        for i, url in enumerate(urls):
            announce(f"env {i} {url}")
        await stop.wait()
    finally:
        for runner in runners:
            await runner.cleanup()

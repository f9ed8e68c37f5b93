"""A small OSWorld-protocol server for the env tests (a test peer, not an environment).

It answers like OSWorld's VM server (`desktop_env/server/main.py`) on the endpoints the client
uses: commands really run as subprocesses, except `python -c` pyautogui actions, which are only
recorded (there is no display here). Files live in a dict keyed by the VM path. Hooks let a test
make an endpoint slow (`delay`), fail with a status (`fail`) or drop the connection (`drop`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from arpo_envs.procs import free_port

PNG_1X1 = (
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00\x00\x1f"
    b"\x15\xc4\x89\x00\x00\x00\rIDATx\x9cc\xf8\xff\xff?\x00\x05\xfe\x02\xfe\xa7V\xbd\xfa\x00\x00"
    b"\x00\x00IEND\xaeB`\x82"
)


@dataclass
class Peer:
    token: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    windows: set[str] = field(default_factory=set)
    state: dict[str, Any] = field(default_factory=dict)
    screen: tuple[int, int] = (1920, 1080)
    delay: dict[str, float] = field(default_factory=dict)
    fail: dict[str, tuple[int, str]] = field(default_factory=dict)
    drop: set[str] = field(default_factory=set)
    calls: list[tuple[str, Any]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    runner: web.AppRunner | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def recorded(self, path: str) -> list[Any]:
        return [body for p, body in self.calls if p == path]

    async def start(self, port: int | None = None) -> Peer:
        app = web.Application(middlewares=[self._hooks])
        r = app.router
        r.add_get("/screenshot", self._screenshot)
        r.add_post("/execute", self._execute)
        r.add_post("/setup/execute", self._execute)
        r.add_post("/setup/launch", self._launch)
        r.add_post("/setup/upload", self._upload)
        r.add_post("/setup/open_file", self._open_file)
        r.add_post("/setup/activate_window", self._window)
        r.add_post("/setup/close_window", self._window)
        r.add_post("/file", self._file)
        r.add_post("/screen_size", self._screen_size)
        r.add_get("/platform", self._platform)
        r.add_get("/terminal", self._terminal)
        r.add_get("/accessibility", self._accessibility)
        r.add_get("/cursor_position", self._cursor)
        r.add_post("/run_bash_script", self._bash)
        r.add_post("/reset", self._reset)
        r.add_post("/sim/scene", self._sim_scene)
        r.add_post("/sim/state", self._sim_state)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        self.port = port or free_port()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    @web.middleware
    async def _hooks(self, request: web.Request, handler: Any) -> web.StreamResponse:
        path = request.path
        self.counts[path] = self.counts.get(path, 0) + 1
        if (
            self.token is not None
            and request.headers.get("Authorization") != f"Bearer {self.token}"
        ):
            return web.Response(status=401, text="missing or wrong token")
        if path in self.delay:
            await asyncio.sleep(self.delay[path])
        if path in self.drop:
            assert request.transport is not None
            request.transport.close()  # the client sees the connection reset, no reply
            return web.Response(text="never delivered")
        if path in self.fail:
            status, body = self.fail[path]
            return web.Response(status=status, text=body)
        return await handler(request)

    async def _screenshot(self, request: web.Request) -> web.Response:
        return web.Response(body=PNG_1X1, content_type="image/png")

    async def _execute(self, request: web.Request) -> web.Response:
        data = await request.json()
        command, shell = data.get("command"), data.get("shell", False)
        self.calls.append((request.path, data))
        if (
            isinstance(command, list)
            and command[:2] == ["python", "-c"]
            and "pyautogui" in command[2]
        ):
            return web.json_response(
                {"status": "success", "output": "", "error": "", "returncode": 0}
            )
        try:
            if shell:
                proc = await asyncio.create_subprocess_shell(
                    command if isinstance(command, str) else " ".join(command),
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                )
            else:
                argv = command.split() if isinstance(command, str) else command
                proc = await asyncio.create_subprocess_exec(
                    *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
                )
            out, err = await proc.communicate()
        except Exception as e:  # OSWorld's server answers 500 with the message
            return web.json_response({"status": "error", "message": str(e)}, status=500)
        return web.json_response(
            {
                "status": "success",
                "output": out.decode(),
                "error": err.decode(),
                "returncode": proc.returncode,
            }
        )

    async def _launch(self, request: web.Request) -> web.Response:
        self.calls.append((request.path, await request.json()))
        return web.Response(text="launched")

    async def _upload(self, request: web.Request) -> web.Response:
        form = await request.post()
        path = str(form["file_path"])
        self.files[path] = form["file_data"].file.read()  # type: ignore[union-attr]
        self.calls.append((request.path, path))
        return web.Response(text="File Uploaded")

    async def _open_file(self, request: web.Request) -> web.Response:
        path = (await request.json())["path"]
        self.calls.append((request.path, path))
        if path not in self.files:
            return web.Response(status=404, text=f"File not found: {path}")
        self.windows.add(path.rsplit("/", 1)[-1])
        return web.Response(text="File opened successfully")

    async def _window(self, request: web.Request) -> web.Response:
        data = await request.json()
        self.calls.append((request.path, data))
        if data["window_name"] not in self.windows:
            return web.Response(status=404, text="Window not found")
        return web.Response(text="ok")

    async def _file(self, request: web.Request) -> web.Response:
        path = str((await request.post())["file_path"])
        if path not in self.files:
            return web.Response(status=404, text="File not found")
        return web.Response(body=self.files[path])

    async def _screen_size(self, request: web.Request) -> web.Response:
        return web.json_response({"width": self.screen[0], "height": self.screen[1]})

    async def _platform(self, request: web.Request) -> web.Response:
        return web.Response(text="Linux")

    async def _terminal(self, request: web.Request) -> web.Response:
        return web.json_response({"output": None})

    async def _accessibility(self, request: web.Request) -> web.Response:
        return web.json_response({"AT": "<desktop-frame/>"})

    async def _cursor(self, request: web.Request) -> web.Response:
        return web.json_response([12, 34])

    async def _bash(self, request: web.Request) -> web.Response:
        data = await request.json()
        proc = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            data["script"],
            cwd=data.get("working_dir"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await proc.communicate()
        status = "success" if proc.returncode == 0 else "error"
        return web.json_response(
            {"status": status, "output": out.decode(), "error": "", "returncode": proc.returncode}
        )

    async def _reset(self, request: web.Request) -> web.Response:
        self.calls.append((request.path, await request.json()))
        self.files.clear()
        return web.json_response({"status": "success"})

    async def _sim_scene(self, request: web.Request) -> web.Response:
        params = await request.json()
        self.calls.append((request.path, params))
        self.state = {"family": params["family"], "seed": params.get("seed"), "cell": {"A1": 7}}
        return web.json_response({"ok": True})

    async def _sim_state(self, request: web.Request) -> web.Response:
        value: Any = self.state
        for part in (await request.json())["path"].split("."):
            value = value[part]
        return web.json_response({"value": value})  # as the simulated desktop answers

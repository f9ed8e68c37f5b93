"""Async HTTP client for an OSWorld environment server (a VM on port 5000 or the local desktop).

It speaks the protocol of DESIGN.md section 5 (the endpoints of OSWorld's `desktop_env/server`),
plus the local desktop's `POST /reset` and the simulated desktop's `/sim/scene` and `/sim/state`.

    async with EnvClient(ClientConfig(base_url="http://127.0.0.1:5000")) as env:
        png = await env.screenshot()
        out = await env.execute_pyautogui("pyautogui.click(10, 20)")

Failure policy (every call):
- a timeout on every request (`ClientConfig.timeout_s`, overridable per call);
- retries only on transport errors, with capped exponential backoff: a refused connection is
  retried for every request (nothing reached the server); a reset connection or a timeout is
  retried only for idempotent requests (GETs, `/file`, `/screen_size`, `/sim/state`), because
  re-sending an action that may already have run would run it twice;
- an HTTP error status is never retried: it raises `EnvHTTPError` with the status and body.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from typing import Any

import aiohttp

from arpo.errors import EnvError, EnvHTTPError, EnvTimeout, EnvTransportError

# OSWorld's host controller wraps every action like this (desktop_env/controllers/python.py).
PYAUTOGUI_PREFIX = "import pyautogui; import time; pyautogui.FAILSAFE = False; "


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """How to reach one environment server."""

    base_url: str = "http://127.0.0.1:5000"
    """Server root, e.g. `http://10.0.0.5:5000` for an OSWorld VM."""
    token: str | None = None
    """Bearer token sent as `Authorization: Bearer <token>`; None sends no header (OSWorld VMs)."""
    timeout_s: float = 60.0
    """Default total timeout of one request attempt, in seconds."""
    connect_timeout_s: float = 5.0
    """Timeout for establishing the TCP connection, in seconds."""
    execute_timeout_s: float = 120.0
    """Timeout of `/execute` and action calls (OSWorld's controller uses 120 s)."""
    open_file_timeout_s: float = 600.0
    """Timeout of `/setup/open_file`, which waits for the application window."""
    max_retries: int = 5
    """Retries after the first attempt, on transport errors only."""
    backoff_initial_s: float = 0.05
    """Delay before the first retry; doubles on every retry."""
    backoff_max_s: float = 2.0
    """Cap of the retry delay."""

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"ClientConfig.base_url must start with http:// or https://, got {self.base_url!r}"
            )
        for name in ("timeout_s", "connect_timeout_s", "execute_timeout_s", "open_file_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ClientConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.max_retries < 0:
            raise ValueError(f"ClientConfig.max_retries must be >= 0, got {self.max_retries}")
        if self.backoff_initial_s < 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(
                "ClientConfig needs 0 <= backoff_initial_s <= backoff_max_s, got "
                f"{self.backoff_initial_s} and {self.backoff_max_s}"
            )


@dataclass(frozen=True, slots=True)
class ExecResult:
    """Reply of `/execute`, `/run_python` and `/run_bash_script`."""

    status: str
    output: str
    error: str
    returncode: int | None

    @classmethod
    def from_json(cls, data: Any) -> ExecResult:
        if not isinstance(data, dict):
            raise EnvError(f"expected a JSON object from the server, got {type(data).__name__}")
        rc = data.get("returncode", data.get("return_code"))
        return cls(
            status=str(data.get("status", "")),
            output=str(data.get("output") or ""),
            error=str(data.get("error") or ""),
            returncode=int(rc) if rc is not None else None,
        )


class EnvClient:
    """One aiohttp session to one environment server. Use as `async with EnvClient(cfg) as c:`."""

    def __init__(self, config: ClientConfig | None = None) -> None:
        self.config = config or ClientConfig()
        self._base = self.config.base_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EnvClient:
        self._ensure_session()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {}
            if self.config.token:
                headers["Authorization"] = f"Bearer {self.config.token}"
            self._session = aiohttp.ClientSession(headers=headers)
        return self._session

    # ---- transport -------------------------------------------------------------------------

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        data: Any = None,
        timeout: float | None = None,
        idempotent: bool | None = None,
        expect: str = "bytes",
    ) -> Any:
        """One logical call: retries transport errors, maps failures to the project's errors.

        `expect` is "bytes", "text" or "json": how to read a successful body.
        """
        if idempotent is None:
            idempotent = method == "GET"
        total = timeout if timeout is not None else self.config.timeout_s
        client_timeout = aiohttp.ClientTimeout(
            total=total, sock_connect=min(self.config.connect_timeout_s, total)
        )
        url = self._base + path
        attempts = self.config.max_retries + 1
        last_exc: BaseException | None = None
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self._backoff(attempt))
            session = self._ensure_session()
            try:
                body_data = data() if callable(data) else data
                async with session.request(
                    method, url, json=json_body, data=body_data, timeout=client_timeout
                ) as resp:
                    raw = await resp.read()
                    if resp.status >= 400:
                        text = raw.decode("utf-8", "replace")
                        raise EnvHTTPError(
                            f"{method} {path} -> HTTP {resp.status}: {text[:500]}",
                            status=resp.status,
                            body=text,
                        )
                    if expect == "bytes":
                        return raw
                    text = raw.decode("utf-8", "replace")
                    if expect == "text":
                        return text
                    try:
                        return json.loads(text)
                    except json.JSONDecodeError as e:
                        raise EnvError(
                            f"{method} {path}: the server sent a body that is not JSON: {text[:200]!r}"
                        ) from e
            except aiohttp.ClientConnectorError as e:
                # Nothing reached the server: safe to retry any request.
                last_exc = e
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                last_exc = e
                if not idempotent:
                    raise EnvTransportError(
                        f"{method} {path}: connection lost ({e}); not retried because the request "
                        "may already have run on the server"
                    ) from e
            except TimeoutError as e:
                last_exc = e
                if not idempotent:
                    raise EnvTimeout(
                        f"{method} {path}: no reply within {total} s (not retried: the request "
                        "may be running on the server); pass a larger timeout for slow calls"
                    ) from e
            except aiohttp.ClientPayloadError as e:
                last_exc = e
                if not idempotent:
                    raise EnvTransportError(f"{method} {path}: truncated reply ({e})") from e
        if isinstance(last_exc, TimeoutError):
            raise EnvTimeout(
                f"{method} {path}: no reply within {total} s after {attempts} attempts"
            ) from last_exc
        raise EnvTransportError(
            f"{method} {url}: server unreachable after {attempts} attempts ({last_exc}); is the "
            "environment server running and is base_url right?"
        ) from last_exc

    def _backoff(self, attempt: int) -> float:
        delay = min(self.config.backoff_max_s, self.config.backoff_initial_s * 2 ** (attempt - 1))
        return delay * (0.5 + 0.5 * random.random())

    # ---- observation -----------------------------------------------------------------------

    async def screenshot(self, *, timeout: float | None = None) -> bytes:
        """PNG bytes of the whole screen."""
        return await self._request("GET", "/screenshot", timeout=timeout)

    async def accessibility(self, *, timeout: float | None = None) -> str:
        """The accessibility tree as XML text."""
        data = await self._request("GET", "/accessibility", timeout=timeout, expect="json")
        return str(data.get("AT") or "") if isinstance(data, dict) else ""

    async def terminal(self, *, timeout: float | None = None) -> str | None:
        """Text of the focused terminal, or None; also a liveness ping."""
        data = await self._request("GET", "/terminal", timeout=timeout, expect="json")
        return data.get("output") if isinstance(data, dict) else None

    async def platform(self, *, timeout: float | None = None) -> str:
        """Operating system name, e.g. `Linux`."""
        return (await self._request("GET", "/platform", timeout=timeout, expect="text")).strip()

    async def screen_size(self, *, timeout: float | None = None) -> tuple[int, int]:
        """(width, height) of the screen in pixels."""
        data = await self._request(
            "POST", "/screen_size", timeout=timeout, idempotent=True, expect="json"
        )
        return int(data["width"]), int(data["height"])

    async def cursor_position(self, *, timeout: float | None = None) -> tuple[int, int]:
        """(x, y) of the mouse pointer."""
        data = await self._request("GET", "/cursor_position", timeout=timeout, expect="json")
        return int(data[0]), int(data[1])

    async def get_file(self, path: str, *, timeout: float | None = None) -> bytes:
        """Bytes of a file on the environment; a missing file raises EnvHTTPError (404)."""
        return await self._request(
            "POST", "/file", data={"file_path": path}, timeout=timeout, idempotent=True
        )

    # ---- commands --------------------------------------------------------------------------

    async def execute(
        self,
        command: list[str] | str,
        *,
        shell: bool = False,
        setup: bool = False,
        timeout: float | None = None,
    ) -> ExecResult:
        """Run a command and wait for it; `setup=True` uses `/setup/execute` as OSWorld's setup does."""
        path = "/setup/execute" if setup else "/execute"
        data = await self._request(
            "POST",
            path,
            json_body={"command": command, "shell": shell},
            timeout=timeout if timeout is not None else self.config.execute_timeout_s,
            expect="json",
        )
        return ExecResult.from_json(data)

    async def execute_pyautogui(self, code: str, *, timeout: float | None = None) -> ExecResult:
        """Run pyautogui code exactly as OSWorld's host controller sends it; `.output` is what it printed."""
        return await self.execute(
            ["python", "-c", PYAUTOGUI_PREFIX + code], shell=False, timeout=timeout
        )

    async def run_python(self, code: str, *, timeout: float | None = None) -> ExecResult:
        """Run a Python script on newer servers (`/run_python`)."""
        data = await self._request(
            "POST",
            "/run_python",
            json_body={"code": code},
            timeout=timeout if timeout is not None else self.config.execute_timeout_s,
            expect="json",
        )
        return ExecResult.from_json(data)

    async def run_bash_script(
        self,
        script: str,
        *,
        script_timeout: int = 100,
        working_dir: str | None = None,
        timeout: float | None = None,
    ) -> ExecResult:
        """Run a bash script on newer servers (`/run_bash_script`); `script_timeout` is the server's limit."""
        body: dict[str, Any] = {"script": script, "timeout": script_timeout}
        if working_dir is not None:
            body["working_dir"] = working_dir
        data = await self._request(
            "POST",
            "/run_bash_script",
            json_body=body,
            timeout=timeout if timeout is not None else script_timeout + 10.0,
            expect="json",
        )
        return ExecResult.from_json(data)

    # ---- setup -----------------------------------------------------------------------------

    async def launch(
        self, command: list[str] | str, *, shell: bool = False, timeout: float | None = None
    ) -> str:
        """Start a program without waiting for it."""
        return await self._request(
            "POST",
            "/setup/launch",
            json_body={"command": command, "shell": shell},
            timeout=timeout,
            expect="text",
        )

    async def upload(self, path: str, content: bytes, *, timeout: float | None = None) -> str:
        """Write `content` to `path` on the environment (multipart `file_path` + `file_data`)."""

        def form() -> aiohttp.FormData:  # a FormData can be sent once; build one per attempt
            fd = aiohttp.FormData()
            fd.add_field("file_path", path)
            fd.add_field(
                "file_data",
                content,
                filename=path.replace("\\", "/").rsplit("/", 1)[-1] or "file",
                content_type="application/octet-stream",
            )
            return fd

        return await self._request(
            "POST", "/setup/upload", data=form, timeout=timeout, idempotent=True, expect="text"
        )

    async def open_file(self, path: str, *, timeout: float | None = None) -> str:
        """Open a file with its default application and wait for its window."""
        return await self._request(
            "POST",
            "/setup/open_file",
            json_body={"path": path},
            timeout=timeout if timeout is not None else self.config.open_file_timeout_s,
            expect="text",
        )

    async def activate_window(
        self,
        window_name: str,
        *,
        strict: bool = False,
        by_class: bool = False,
        timeout: float | None = None,
    ) -> str:
        return await self._window("/setup/activate_window", window_name, strict, by_class, timeout)

    async def close_window(
        self,
        window_name: str,
        *,
        strict: bool = False,
        by_class: bool = False,
        timeout: float | None = None,
    ) -> str:
        return await self._window("/setup/close_window", window_name, strict, by_class, timeout)

    async def _window(
        self, path: str, window_name: str, strict: bool, by_class: bool, timeout: float | None
    ) -> str:
        """The window endpoints share OSWorld's body {window_name, strict, by_class}."""
        return await self._request(
            "POST",
            path,
            json_body={"window_name": window_name, "strict": strict, "by_class": by_class},
            timeout=timeout,
            expect="text",
        )

    # ---- local desktop and simulated desktop extensions -------------------------------------

    async def reset(
        self, params: dict[str, Any] | None = None, *, timeout: float | None = None
    ) -> Any:
        """`POST /reset` of the local desktop server (not part of OSWorld's VM server); JSON reply."""
        return await self._request(
            "POST", "/reset", json_body=params or {}, timeout=timeout, expect="json"
        )

    async def sim_scene(self, params: dict[str, Any], *, timeout: float | None = None) -> Any:
        """`POST /sim/scene` of the simulated desktop: build the scene described by `params`."""
        return await self._request(
            "POST", "/sim/scene", json_body=params, timeout=timeout, expect="json"
        )

    async def sim_state(self, path: str, *, timeout: float | None = None) -> Any:
        """`POST /sim/state {"path": ...}` of the simulated desktop: one JSON value of its state
        (the server answers `{"value": ...}`)."""
        body = await self._request(
            "POST",
            "/sim/state",
            json_body={"path": path},
            timeout=timeout,
            idempotent=True,
            expect="json",
        )
        if not isinstance(body, dict) or "value" not in body:
            raise EnvError(f"/sim/state answered {body!r:.200} without a 'value' key")
        return body["value"]

    async def wait_ready(self, *, deadline_s: float = 60.0, interval_s: float = 0.5) -> None:
        """Poll `/terminal` until the server answers; raises EnvTimeout after `deadline_s`."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while True:
            try:
                await self._request("GET", "/terminal", timeout=min(10.0, deadline_s))
                return
            except EnvHTTPError:
                return  # it answered; a server without a terminal still is up
            except (EnvTransportError, EnvTimeout) as e:
                if loop.time() + interval_s > end:
                    raise EnvTimeout(f"{self._base} not ready within {deadline_s} s: {e}") from e
            await asyncio.sleep(interval_s)

"""Async HTTP client for an OSWorld environment server (a VM on port 5000 or the local desktop).

It speaks the protocol of docs/concepts/environments.md, 'The protocol' (OSWorld's VM server),
plus the local desktop's `POST /reset` and the simulated desktop's `/sim/scene` and `/sim/state`.

    async with EnvClient(ClientConfig(base_url="http://127.0.0.1:5000")) as env:
        png = await env.screenshot()
        out = await env.execute_pyautogui("pyautogui.click(10, 20)")

Failure policy (every call):
- a total timeout on every request, the answer's body included (`ClientConfig.timeout_s`,
  overridable per call);
- retries only on transport errors, with capped exponential backoff: a refused connection is
  retried for every request (nothing reached the server); a reset connection or a timeout is
  retried only for idempotent requests (GETs, `/file`, `/screen_size`, `/sim/state`), because
  re-sending an action that may already have run would run it twice;
- an HTTP error status is never retried: it raises `EnvHTTPError` with the status and body;
  401, and 403 outside the file endpoints, raise `EnvAuthError`: the server refuses the
  token, which no retry mends;
- an answer that is not a valid one (not HTTP, a malformed status line or header, a body
  that is not UTF-8 or not the JSON expected, JSON nested too deeply, or more bytes than
  the limit of its kind: `max_screenshot_bytes`, `max_file_bytes`, `max_answer_bytes`)
  raises `EnvProtocolError` (`EnvAnswerTooLarge` for the size), never retried: the
  environment is at fault. No other exception leaves this client for anything the server
  sends.
"""

from __future__ import annotations

import asyncio
import json
import random
import reprlib
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError

from arpo.errors import (  # the three Env*Error classes of answers are re-exported here
    EnvAnswerTooLarge,
    EnvAuthError,
    EnvError,
    EnvHTTPError,
    EnvProtocolError,
    EnvTimeout,
    EnvTransportError,
    ResetError,
)

# OSWorld's host controller wraps every action like this (desktop_env/controllers/python.py).
PYAUTOGUI_PREFIX = "import pyautogui; import time; pyautogui.FAILSAFE = False; "

ERROR_BODY_BYTES = 64 << 10
"""Bytes of an error answer's body kept for the message; the rest is not read."""
FILE_ENDPOINTS = frozenset({"/setup/upload", "/file"})
"""Endpoints where a 403 is about a file (the desktop server's answer for a path it may not
read or write), not about the token."""


def auth_failure(exc: BaseException | None) -> EnvAuthError | None:
    """The EnvAuthError `exc` is, or was raised from (a ResetError wrapping one), else None."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, EnvAuthError):
            return exc
        exc, seen = exc.__cause__, seen + 1
    return None


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
    max_screenshot_bytes: int = 64 << 20
    """Largest `/screenshot` answer (64 MiB): a PNG of a 4K screen is 5-30 MB (3840x2160
    RGBA uncompressed is 33 MB); more is refused with EnvAnswerTooLarge."""
    max_file_bytes: int = 256 << 20
    """Largest `/file` answer (256 MiB): the files OSWorld's checkers fetch from the desktop
    are documents and images of at most tens of MB."""
    max_answer_bytes: int = 48 << 20
    """Largest answer of any other endpoint, JSON or text (48 MiB): `/execute` and the other
    command endpoints carry a command's output, which the local desktop caps at 32 MiB of
    JSON (`arpo_envs.desktop.executor.MAX_ANSWER_BYTES`); the rest are a few KB, the
    accessibility tree of a busy OSWorld VM a few MB."""

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
        for name in ("max_screenshot_bytes", "max_file_bytes", "max_answer_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ClientConfig.{name} must be >= 1, got {getattr(self, name)}")
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
        """EnvProtocolError for an answer that is not an object or whose return code is not
        an integer."""
        if not isinstance(data, dict):
            raise EnvProtocolError(
                f"expected a JSON object from the server, got {type(data).__name__}"
            )
        rc = data.get("returncode", data.get("return_code"))
        if rc is not None and (type(rc) is not int or abs(rc) > 1 << 31):
            raise EnvProtocolError(f"the answer's returncode is not an exit code: {brief(rc, 80)}")
        return cls(
            status=text_field(data, "status"),
            output=text_field(data, "output"),
            error=text_field(data, "error"),
            returncode=rc,
        )


def text_field(data: dict[str, Any], key: str) -> str:
    """`data[key]` as text: a string, a number or bool written out, "" when absent or null;
    EnvProtocolError for a list or an object (rendering a deeply nested one would raise
    RecursionError)."""
    value = data.get(key)
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return str(value)
    raise EnvProtocolError(f"the answer's {key!r} is not text: {brief(value)}")


def one_line(text: str, n: int = 200) -> str:
    """One line of at most `n` characters of `text` (an answer's bytes can be anything)."""
    text = " ".join(text[: 4 * n + 16].split())
    return text if len(text) <= n else text[:n] + "..."


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 120, 120


def brief(value: Any, n: int = 200) -> str:
    """A short one-line picture of a value decoded from an answer: its depth and length are
    cut before it is rendered (the repr of deeply nested JSON would raise RecursionError)."""
    return one_line(value if isinstance(value, str) else _REPR.repr(value), n)


async def _read_some(resp: aiohttp.ClientResponse, n: int) -> bytes:
    """At most `n` bytes of the body (an error answer: the rest is not read)."""
    try:
        return await resp.content.read(n)
    except (aiohttp.ClientError, OSError, HttpProcessingError):
        return b""


async def read_limited(resp: aiohttp.ClientResponse, limit: int, what: str) -> bytes:
    """The whole body, refused with EnvAnswerTooLarge as soon as it exceeds `limit` bytes
    (a declared Content-Length over it is refused before anything is read)."""
    if resp.content_length is not None and resp.content_length > limit:
        resp.close()  # the connection is dropped, not drained
        raise EnvAnswerTooLarge(
            f"{what}: the answer declares {resp.content_length} bytes, more than the limit of "
            f"{limit} bytes for this kind of answer (ClientConfig)"
        )
    chunks, size = [], 0
    while True:
        chunk = await resp.content.read(1 << 20)
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            resp.close()
            raise EnvAnswerTooLarge(
                f"{what}: the answer exceeds the limit of {limit} bytes for this kind of "
                "answer (ClientConfig)"
            )
        chunks.append(chunk)
    return b"".join(chunks)


def _decode(raw: bytes, expect: str, what: str) -> Any:
    """The body as `expect` ("bytes", "text" or "json"); EnvProtocolError when it is not
    UTF-8, not JSON, or JSON nested too deeply for Python's parser."""
    if expect == "bytes":
        return raw
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EnvProtocolError(f"{what}: the answer is not UTF-8 text ({e})") from None
    if expect == "text":
        return text
    try:
        return json.loads(text)
    except RecursionError:
        raise EnvProtocolError(f"{what}: the answer is JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, or a number of too many digits
        raise EnvProtocolError(
            f"{what}: the server sent a body that is not JSON ({e}): {brief(text)}"
        ) from None


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
        limit: int | None = None,
    ) -> Any:
        """One logical call: retries transport errors, maps failures to the project's errors.

        `expect` is "bytes", "text" or "json": how to read a successful body. `limit`: most
        bytes of the body read (default `max_answer_bytes`); more is EnvAnswerTooLarge.
        """
        if idempotent is None:
            idempotent = method == "GET"
        total = timeout if timeout is not None else self.config.timeout_s
        limit = limit if limit is not None else self.config.max_answer_bytes
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
                # The total timeout bounds the whole exchange, body included (aiohttp's
                # `total`); the outer one also covers a body read that aiohttp would not.
                async with (
                    asyncio.timeout(total + 1.0),
                    session.request(
                        method, url, json=json_body, data=body_data, timeout=client_timeout
                    ) as resp,
                ):
                    if resp.status >= 400:
                        raw = await _read_some(resp, ERROR_BODY_BYTES)
                        text = raw.decode("utf-8", "replace")
                        kind = EnvHTTPError
                        if resp.status == 401 or (
                            resp.status == 403 and path not in FILE_ENDPOINTS
                        ):
                            kind = EnvAuthError
                        raise kind(
                            f"{method} {path} -> HTTP {resp.status}: {text[:500]}",
                            status=resp.status,
                            body=text,
                        )
                    raw = await read_limited(resp, limit, f"{method} {path}")
                    return _decode(raw, expect, f"{method} {path}")
            except aiohttp.ClientConnectorError as e:
                # Nothing reached the server: safe to retry any request.
                last_exc = e
            except TimeoutError as e:  # aiohttp's own timeouts are TimeoutErrors too
                last_exc = e
                if not idempotent:
                    raise EnvTimeout(
                        f"{method} {path}: no reply within {total} s (not retried: the request "
                        "may be running on the server); pass a larger timeout for slow calls"
                    ) from e
            except aiohttp.ClientResponseError as e:
                # aiohttp's reading of the answer failed: not HTTP, a malformed status line,
                # an oversize header. The server answered, wrongly.
                raise EnvProtocolError(
                    f"{method} {url}: the answer is not valid HTTP ({e.status}: "
                    f"{one_line(e.message)})"
                ) from e
            except (
                aiohttp.ServerDisconnectedError,
                aiohttp.ClientOSError,
                aiohttp.ClientPayloadError,
                aiohttp.ClientConnectionError,
                OSError,
            ) as e:
                last_exc = e
                if not idempotent:
                    raise EnvTransportError(
                        f"{method} {path}: connection lost or reply cut ({one_line(str(e))}); "
                        "not retried because the request may already have run on the server"
                    ) from e
            except (aiohttp.ClientError, HttpProcessingError) as e:
                raise EnvProtocolError(
                    f"{method} {url}: the exchange failed ({type(e).__name__}: {one_line(str(e))})"
                ) from e
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
        """PNG bytes of the whole screen (at most `max_screenshot_bytes`)."""
        return await self._request(
            "GET", "/screenshot", timeout=timeout, limit=self.config.max_screenshot_bytes
        )

    async def accessibility(self, *, timeout: float | None = None) -> str:
        """The accessibility tree as XML text."""
        data = await self._request("GET", "/accessibility", timeout=timeout, expect="json")
        return text_field(data, "AT") if isinstance(data, dict) else ""

    async def terminal(self, *, timeout: float | None = None) -> str | None:
        """Text of the focused terminal, or None; also a liveness ping."""
        data = await self._request("GET", "/terminal", timeout=timeout, expect="json")
        if not isinstance(data, dict) or data.get("output") is None:
            return None
        return text_field(data, "output")

    async def platform(self, *, timeout: float | None = None) -> str:
        """Operating system name, e.g. `Linux`."""
        return (await self._request("GET", "/platform", timeout=timeout, expect="text")).strip()

    async def screen_size(self, *, timeout: float | None = None) -> tuple[int, int]:
        """(width, height) of the screen in pixels."""
        data = await self._request(
            "POST", "/screen_size", timeout=timeout, idempotent=True, expect="json"
        )
        w, h = (data.get(k) for k in ("width", "height")) if isinstance(data, dict) else (0, 0)
        if not (_pixels(w) and _pixels(h)):
            raise EnvProtocolError(f"/screen_size answered {brief(data)}, not a screen size")
        return w, h

    async def cursor_position(self, *, timeout: float | None = None) -> tuple[int, int]:
        """(x, y) of the mouse pointer."""
        data = await self._request("GET", "/cursor_position", timeout=timeout, expect="json")
        if not (isinstance(data, list) and len(data) == 2 and all(map(_coordinate, data))):
            raise EnvProtocolError(f"/cursor_position answered {brief(data)}, not [x, y]")
        return data[0], data[1]

    async def get_file(self, path: str, *, timeout: float | None = None) -> bytes:
        """Bytes of a file on the environment (at most `max_file_bytes`); a missing file
        raises EnvHTTPError (404)."""
        return await self._request(
            "POST",
            "/file",
            data={"file_path": path},
            timeout=timeout,
            idempotent=True,
            limit=self.config.max_file_bytes,
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
    ) -> dict[str, Any]:
        """`POST /reset` of the local or simulated desktop (not part of OSWorld's VM server).

        Both answer a JSON object with `"status": "success"` once the desktop is clean
        (`arpo_envs.desktop.server`, `arpo_envs.sim.server`); any other answer (another
        status, not an object) raises ResetError with the server's message: the desktop is
        not known to be clean."""
        data = await self._request(
            "POST", "/reset", json_body=params or {}, timeout=timeout, expect="json"
        )
        status = data.get("status") if isinstance(data, dict) else None
        if status != "success":
            message = data.get("message") or data.get("error") if isinstance(data, dict) else ""
            raise ResetError(
                f"POST {self._base}/reset answered status {brief(status, 80)!r} instead of "
                "'success'" + (f": {brief(message, 500)}" if message else f" ({brief(data)})")
            )
        return data

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
            raise EnvError(f"/sim/state answered {brief(body)} without a 'value' key")
        return body["value"]

    async def wait_ready(self, *, deadline_s: float = 60.0, interval_s: float = 0.5) -> None:
        """Poll `/terminal` until the server answers HTTP (any status: a server without a
        terminal is still up); raises EnvTimeout after `deadline_s`. A refused token
        (EnvAuthError) is raised at once; an answer that is not valid HTTP counts as no
        answer (the server is not serving)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while True:
            try:
                await self._request("GET", "/terminal", timeout=min(10.0, deadline_s))
                return
            except EnvAuthError:
                raise
            except EnvHTTPError:
                return  # it answered; a server without a terminal still is up
            except EnvError as e:
                if loop.time() + interval_s > end:
                    raise EnvTimeout(f"{self._base} not ready within {deadline_s} s: {e}") from e
            await asyncio.sleep(interval_s)


def _pixels(v: Any) -> bool:
    return type(v) is int and 0 < v <= 1 << 16


def _coordinate(v: Any) -> bool:
    return type(v) is int and abs(v) <= 1 << 20

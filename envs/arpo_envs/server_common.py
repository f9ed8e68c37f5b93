"""What every env server of the project shares: binding rules, auth, JSON errors, request bodies.

A server builds its aiohttp application with `make_app(security)` and adds its
routes; the two middlewares make it behave the same as every other env server:

- auth: with a token set, a request without `Authorization: Bearer <token>` gets
  401 JSON. `check_bind(host, token)` refuses a non-loopback address without a
  token (the OSWorld VM server runs anything it is sent; ours must not be open
  to the network by accident).
- errors: every failure is JSON `{"status": "error", "message": ...}` with a 4xx
  status for the client's mistakes (malformed JSON, missing or mistyped fields,
  unknown endpoint, wrong method) and 500 for an unexpected exception, which is
  logged with its traceback; the server keeps serving either way.

Handlers read bodies with `await read_json(request, {"field": type, ...})`, which
raises `RequestError` (400, naming the field) on anything malformed.

Logs hold no secret (`protect_logs`, called by `make_app`): aiohttp's error for a
malformed request quotes the offending header line, `Authorization: Bearer <token>`
included, and a server's log is a file the desktop's programs can open; such a request
is logged as one line naming the kind of error only, and a server's token is replaced by
`<redacted>` in any record of the process's handlers.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import re
import traceback
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

log = logging.getLogger("arpo_envs.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


class RequestError(Exception):
    """The client sent something the server cannot act on; answered with `status` and JSON."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(frozen=True, slots=True)
class ServerSecurity:
    """How an env server is exposed."""

    host: str = "127.0.0.1"
    """Address to bind. Loopback by default; any other address needs `token`."""
    token: str | None = None
    """Shared secret; when set every request must carry `Authorization: Bearer <token>`."""
    vm_guest: bool = False
    """The server runs inside a VM of the project's fleet, whose only way in is the host's
    port forward bound to 127.0.0.1 (QEMU user-mode networking): binding every address of
    the guest without a token is then allowed, as OSWorld's VM server does."""

    def __post_init__(self) -> None:
        if self.vm_guest and not in_fleet_vm():
            raise ValueError(
                "vm_guest is only for the desktop server inside a VM of the project's fleet "
                "(PID 1 is arpo-guest-init); on any other machine bind 127.0.0.1 or set a token"
            )
        if not self.vm_guest:
            check_bind(self.host, self.token)


def in_fleet_vm() -> bool:
    """True inside a VM of the project's image: its PID 1 is `arpo-guest-init`."""
    try:
        with open("/proc/1/cmdline", "rb") as f:
            return b"arpo-guest-init" in f.read()
    except OSError:
        return False


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and the usual names of localhost (no DNS lookup)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost: treat as exposed


def check_bind(host: str, token: str | None) -> None:
    """Refuse to expose a server that runs actions to the network without a token."""
    if token is not None and not token:
        raise ValueError("token is empty; pass a non-empty secret or leave it unset")
    if not is_loopback(host) and token is None:
        raise ValueError(
            f"refusing to bind {host!r} without a token: this server executes desktop actions "
            "for anyone who can reach it. Bind 127.0.0.1, or set a token (e.g. --token or "
            "ARPO_ENV_TOKEN) and send 'Authorization: Bearer <token>' from the clients"
        )


def error_response(message: str, status: int) -> web.Response:
    return web.json_response({"status": "error", "message": message}, status=status)


def auth_middleware(token: str | None):
    """401 JSON for every request without the right bearer token (no-op without a token)."""
    expected = f"Bearer {token}".encode() if token else b""

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token is not None:
            # Bytes as received: a header that is not UTF-8 arrives with surrogate escapes.
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            # constant-time comparison: the token must not leak through response timing
            if not hmac.compare_digest(given, expected):
                return error_response("missing or wrong 'Authorization: Bearer <token>'", 401)
        return await handler(request)

    return auth


@web.middleware
async def json_error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure into a JSON error response; the server keeps serving."""
    try:
        return await handler(request)
    except RequestError as e:
        return error_response(e.message, e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise  # redirects and the like pass through
        if e.status == 404:
            message = f"unknown endpoint {request.method} {request.path}"
        elif e.status == 405:
            allowed = ", ".join(sorted(getattr(e, "allowed_methods", ()) or ()))
            message = f"method {request.method} not allowed on {request.path}; use {allowed}"
        else:
            message = e.text or e.reason
        return error_response(message, e.status)
    except Exception as e:
        log.exception("unexpected error in %s %s", request.method, request.path)
        return error_response(f"internal error: {type(e).__name__}: {e}", 500)


_AUTH_VALUE = re.compile(
    r"""(authorization['"]?\s*[:=]\s*['"]?)(?:bearer\s+)?[^\s'"\\]+""", re.IGNORECASE
)
"""An Authorization header's value as a log line can show it (a header line, a dict's repr)."""


class RedactSecrets(logging.Filter):
    """Keeps secrets out of log records.

    A malformed request (aiohttp's `HttpProcessingError`, whose message quotes the raw line
    it could not parse, an Authorization header included) becomes one WARNING line naming
    the kind of error, without its bytes or traceback. In any other record, every
    registered secret and the value of any `Authorization:` shown is replaced by
    `<redacted>`, the traceback included (rendered into the message then)."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            head = self._redact(record.getMessage())
            kind = str(exc.message or "").split(":", 1)[0].strip()[:80]
            record.msg = "%s: malformed request refused (%s %s: %s); its bytes are not logged"
            record.args = (head, type(exc).__name__, exc.code, kind)
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            return True
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
        clean = self._redact(text)
        if clean != text:
            record.msg, record.args = clean, ()
            record.exc_info = record.exc_text = None
        return True

    def _redact(self, text: str) -> str:
        for secret in self.secrets:
            for form in {secret, repr(secret.encode())[2:-1], json.dumps(secret)[1:-1]}:
                text = text.replace(form, "<redacted>")
        return _AUTH_VALUE.sub(r"\1<redacted>", text)


REDACT = RedactSecrets()
"""The process's one filter (see `protect_logs`)."""
MIN_REDACTED_LEN = 8
"""Shorter tokens are not searched for in log text (a test's "t" would blank every t of
every line); the malformed-request and Authorization rules still apply to them."""
SERVER_LOGGERS = ("aiohttp.server", "aiohttp.web", "aiohttp.access", "arpo_envs")


def protect_logs(token: str | None) -> None:
    """Keep `token` and malformed requests' bytes out of this process's logs: REDACT on the
    loggers servers write to (aiohttp's and this package's) and on every handler the root
    logger has now (which sees what any logger propagates). Idempotent."""
    if token and len(token) >= MIN_REDACTED_LEN:
        REDACT.secrets.add(token)
    loggers = [logging.getLogger(n) for n in SERVER_LOGGERS]
    loggers += [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)
                if n.startswith(("aiohttp.", "arpo_envs."))]  # fmt: skip
    for target in [*loggers, *logging.getLogger().handlers]:
        if REDACT not in target.filters:
            target.addFilter(REDACT)


def make_app(security: ServerSecurity, **app_kwargs: Any) -> web.Application:
    """An aiohttp application with the shared middlewares (auth first, then JSON errors);
    its token is kept out of the process's logs (`protect_logs`)."""
    protect_logs(security.token)
    return web.Application(
        middlewares=[auth_middleware(security.token), json_error_middleware], **app_kwargs
    )


async def read_json(
    request: web.Request, required: Mapping[str, type | tuple[type, ...]] | None = None
) -> dict[str, Any]:
    """The request's JSON object body; 400 if it is not JSON, not an object or lacks a field.

    `required` maps field names to the accepted type(s); `bool` is not accepted where
    `int` or `float` is asked for (JSON `true` is not a number).
    """
    raw = await request.read()
    if not raw.strip():
        body: Any = {}
    else:
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RequestError(f"malformed JSON body: {e}") from None
        except RecursionError:
            raise RequestError("malformed JSON body: nested too deeply") from None
        except ValueError as e:  # e.g. an integer of more digits than Python converts
            raise RequestError(f"malformed JSON body: {e}") from None
        _check_strings(body)
    if not isinstance(body, dict):
        raise RequestError(f"the JSON body must be an object, got {type(body).__name__}")
    for name, kinds in (required or {}).items():
        if name not in body:
            raise RequestError(f"missing field {name!r}")
        check_type(name, body[name], kinds)
    return body


def _check_strings(body: Any) -> None:
    """400 for a string (value or key) that no command or file name can carry: a lone
    surrogate (not encodable) or a NUL character."""
    stack = [body]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str):
            if "\x00" in v:
                raise RequestError(f"a string in the body contains a NUL character: {v[:60]!r}")
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(
                    f"a string in the body contains a lone surrogate: {v[:60]!r}"
                ) from None


def check_type(name: str, value: Any, kinds: type | tuple[type, ...]) -> None:
    """400 unless `value` has one of `kinds` (a JSON bool is never a number)."""
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    numeric = any(k in (int, float) for k in kinds) and bool not in kinds
    if not isinstance(value, kinds) or (numeric and isinstance(value, bool)):
        names = " or ".join(k.__name__ for k in kinds)
        raise RequestError(f"field {name!r} must be {names}, got {type(value).__name__}")

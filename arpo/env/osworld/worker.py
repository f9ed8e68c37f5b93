"""OSWorld's own setup controller, getters and metrics, run as a worker process.

This file runs inside the evaluator environment (`make osworld-evaluator` creates
`.venv-osworld`), never in the project's: it imports only the standard library and OSWorld's
published package `desktop_env`, and the host side (`arpo.env.osworld.client`) starts it as

    .venv-osworld/bin/python arpo/env/osworld/worker.py          # serve JSON lines
    .venv-osworld/bin/python arpo/env/osworld/worker.py --check  # import everything, print names

Protocol: one JSON object per line on stdin, one reply per line on stdout, in order.

    {"id": 1, "op": "hello"}
        -> {"id": 1, "ok": true, "result": {"version": "1.0.2", "metrics": [...], ...}}
    {"id": 2, "op": "setup", "env": ENV, "task": TASK, "cache_dir": DIR}
        -> {"id": 2, "ok": true, "result": null}
    {"id": 3, "op": "evaluate", "env": ENV, "task": TASK, "cache_dir": DIR, "actions": [...]}
        -> {"id": 3, "ok": true, "result": {"score": 0.5}}
    {"id": 4, "op": "metric", "func": "compare_table", "args": [...], "options": {...}}
        -> {"id": 4, "ok": true, "result": {"score": 1.0}}
    a failure -> {"id": n, "ok": false, "kind": "env" | "eval" | "request", "error": "...",
                  "traceback": "..."}

ENV is `{"url": "http://127.0.0.1:5000", "token": null, "screen": [1920, 1080],
"client_password": "password", "chromium_port": 9222, "vlc_port": 8080}`; TASK is the task
file's JSON. `setup` runs the task's `config` steps with OSWorld's `SetupController`;
`evaluate` runs `DesktopEnv.evaluate` itself (postconfig, infeasible, getters, metrics, `conj`)
on a `DesktopEnv` built without a VM provider and pointed at ENV's URL. DIR is OSWorld's cache
directory (`<DIR>/<task id>/`): the host puts the task's downloads there under OSWorld's cache
names beforehand, so nothing is fetched from the network. `kind` says whose failure it was: the
environment's (it could not be reached), the evaluator's, or a malformed request. A score is a
number in [0, 1] (a float, or an int 0 / 1 as many of OSWorld's metrics return); a metric that
returns anything else (a bool, NaN, 1.5, ...) is an "eval" failure with the reason.

What OSWorld's code prints goes to stderr: the replies use a private copy of stdout.
`easyocr` (it needs torch, which this environment does not install) is a stub whose `Reader`
raises, so the one metric that uses OCR (`compare_image_text`) fails loudly instead of scoring.
"""

from __future__ import annotations

import json
import logging
import numbers
import os
import sys
import tempfile
import traceback
import types
from typing import Any
from urllib.parse import urlsplit

PACKAGE = "desktop-env"


def _stub_easyocr() -> None:
    class Reader:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError(
                "easyocr is not installed in the OSWorld evaluator environment (it needs torch); "
                "metrics that read text by OCR cannot run here"
            )

    mod = types.ModuleType("easyocr")
    mod.Reader = Reader  # type: ignore[attr-defined]
    sys.modules.setdefault("easyocr", mod)


def _import_osworld() -> dict[str, Any]:
    """Import OSWorld's modules the way DesktopEnv does; returns them by role."""
    _stub_easyocr()
    # OSWorld's setup module loads a proxy list at import; give it an empty one.
    no_proxies = os.path.join(tempfile.gettempdir(), "arpo-osworld-no-proxies.json")
    if not os.path.isfile(no_proxies):
        with open(no_proxies, "w") as f:
            f.write("[]")
    os.environ.setdefault("PROXY_CONFIG_FILE", no_proxies)
    import desktop_env.controllers.setup as setup
    import desktop_env.desktop_env as desktop_env
    import desktop_env.evaluators.getters as getters
    import desktop_env.evaluators.metrics as metrics
    import requests

    return {
        "setup": setup,
        "desktop_env": desktop_env,
        "getters": getters,
        "metrics": metrics,
        "requests": requests,
    }


def _names(mods: dict[str, Any]) -> dict[str, Any]:
    from importlib.metadata import version

    metrics, getters = mods["metrics"], mods["getters"]
    controller = mods["setup"].SetupController
    return {
        "package": PACKAGE,
        "version": version(PACKAGE),
        "metrics": sorted(
            n for n in dir(metrics) if not n.startswith("_") and callable(getattr(metrics, n))
        ),
        "getters": sorted(n[4:] for n in dir(getters) if n.startswith("get_")),
        "steps": sorted(
            n[1 : -len("_setup")]
            for n in dir(controller)
            if n.startswith("_") and n.endswith("_setup") and n != "_setup"
        ),
    }


class RequestError(ValueError):
    """The request itself is malformed."""


class Worker:
    """Serves one request at a time; OSWorld's modules are imported once."""

    def __init__(self) -> None:
        self.mods = _import_osworld()
        self.requests = self.mods["requests"]
        self._token: str | None = None
        self._base = ""
        session_request = self.requests.sessions.Session.request
        worker = self

        # OSWorld VMs take no token; a local desktop bound beyond loopback does. Every request
        # OSWorld's code makes goes through Session.request: add the header for the env's URL.
        def request(session: Any, method: str, url: Any, *args: Any, **kwargs: Any) -> Any:
            if worker._token and str(url).startswith(worker._base):
                headers = dict(kwargs.get("headers") or {})
                headers.setdefault("Authorization", f"Bearer {worker._token}")
                kwargs["headers"] = headers
            return session_request(session, method, url, *args, **kwargs)

        self.requests.sessions.Session.request = request

    def handle(self, req: dict[str, Any]) -> Any:
        op = req.get("op")
        if op == "hello":
            return _names(self.mods)
        if op == "metric":
            return {"score": self.metric(req)}
        if op in ("setup", "evaluate"):
            env = self.make_env(req)
            if op == "setup":
                env.setup_controller.setup(env.config, False)
                return None
            env.action_history = list(req.get("actions") or [])
            return {"score": _score(env.evaluate())}
        raise RequestError(f"unknown op {op!r}; use hello, setup, evaluate or metric")

    def metric(self, req: dict[str, Any]) -> float:
        name = req.get("func")
        fn = getattr(self.mods["metrics"], str(name), None)
        if not isinstance(name, str) or name.startswith("_") or not callable(fn):
            raise RequestError(f"OSWorld's package has no metric {name!r}")
        args = req.get("args") or []
        options = req.get("options") or {}
        if not isinstance(args, list) or not isinstance(options, dict):
            raise RequestError("metric: args must be a list and options an object")
        return _score(fn(*args, **options))

    def make_env(self, req: dict[str, Any]) -> Any:
        """A DesktopEnv without a VM provider, pointed at the request's environment."""
        spec, task, cache_dir = req.get("env"), req.get("task"), req.get("cache_dir")
        if not isinstance(spec, dict) or not isinstance(task, dict) or not cache_dir:
            raise RequestError(f"{req.get('op')}: needs env, task and cache_dir")
        url = urlsplit(str(spec.get("url", "")))
        if url.scheme != "http" or not url.hostname or url.path not in ("", "/"):
            raise RequestError(
                f"env url must be http://host:port (OSWorld's controllers speak plain HTTP to "
                f"the server's root), got {spec.get('url')!r}"
            )
        self._base = f"http://{url.hostname}:{url.port or 80}"
        self._token = spec.get("token") or None
        width, height = spec.get("screen") or (1920, 1080)
        de = self.mods["desktop_env"]
        env = de.DesktopEnv.__new__(de.DesktopEnv)
        env.provider_name = "none"
        env.os_type = "Ubuntu"
        env.vm_ip = url.hostname
        env.server_port = url.port or 80
        env.chromium_port = int(spec.get("chromium_port", 9222))
        env.vlc_port = int(spec.get("vlc_port", 8080))
        env.client_password = str(spec.get("client_password", "password"))
        env.screen_width, env.screen_height = int(width), int(height)
        env.cache_dir_base = str(cache_dir)
        env.enable_proxy = False
        env.current_use_proxy = False
        env.is_environment_used = True
        env.require_a11y_tree = False
        env.require_terminal = False
        env.action_history = []
        env.controller = de.PythonController(vm_ip=env.vm_ip, server_port=env.server_port)
        env.setup_controller = de.SetupController(
            vm_ip=env.vm_ip,
            server_port=env.server_port,
            chromium_port=env.chromium_port,
            vlc_port=env.vlc_port,
            cache_dir=env.cache_dir_base,
            client_password=env.client_password,
            screen_width=env.screen_width,
            screen_height=env.screen_height,
        )
        env._set_task_info(task)
        env.setup_controller.reset_cache_dir(env.cache_dir)
        # SetupController.setup returns False when the server did not answer (after 20 tries
        # 5 s apart), and DesktopEnv.evaluate goes on to its getters regardless: an unreachable
        # environment must be an environment failure, not a score.
        controller_setup = env.setup_controller.setup
        base = self._base

        def setup(config: Any, use_proxy: bool = False) -> bool:
            if not controller_setup(config, use_proxy):
                raise ConnectionError(f"OSWorld's setup controller could not reach {base}")
            return True

        env.setup_controller.setup = setup
        return env


def _score(value: Any) -> float:
    """A metric's (or `DesktopEnv.evaluate`'s) result as a score in [0, 1].

    OSWorld's metrics return floats, ints 0 / 1 and numpy numbers; those are kept. A bool
    (Python's or numpy's) is not a score, nor is anything that is not a real number, NaN,
    an infinity, an int too large for a float, or a number outside [0, 1]: each raises, and
    the request fails with kind "eval" and the reason.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"the metric returned {value!r:.200}, not a number")
    try:
        score = float(value)
    except OverflowError:
        raise ValueError(
            f"the metric returned a number too large for a float ({type(value).__name__})"
        ) from None
    if not 0.0 <= score <= 1.0:  # NaN fails this too
        raise ValueError(f"the metric returned {score}, not a score in [0, 1]")
    return score


def _kind(exc: BaseException, requests: Any) -> str:
    if isinstance(exc, RequestError):
        return "request"
    env_errors = (
        ConnectionError,
        requests.exceptions.ConnectionError,
        requests.exceptions.Timeout,
    )
    return "env" if isinstance(exc, env_errors) or isinstance(exc.__cause__, env_errors) else "eval"


def serve() -> int:
    # Replies go to a private copy of stdout; anything else that writes to fd 1 (OSWorld's
    # print calls, child processes) lands on stderr instead.
    out = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    worker = Worker()
    for line in sys.stdin:
        if not line.strip():
            continue
        rid = None
        try:
            req = json.loads(line)
            if not isinstance(req, dict):
                raise RequestError("a request is a JSON object")
            rid = req.get("id")
            reply = {"id": rid, "ok": True, "result": worker.handle(req)}
        except Exception as e:  # every failure is a reply; the loop goes on
            reply = {
                "id": rid,
                "ok": False,
                "kind": "request"
                if isinstance(e, json.JSONDecodeError)
                else _kind(e, worker.requests),
                "error": f"{type(e).__name__}: {e}"[:4000],
                "traceback": traceback.format_exc()[-8000:],
            }
        out.write(json.dumps(reply, default=repr) + "\n")
    return 0


def main(argv: list[str]) -> int:
    if argv[1:] == ["--check"]:
        names = _names(_import_osworld())
        print(
            f"{PACKAGE} {names['version']}: {len(names['metrics'])} metrics, "
            f"{len(names['getters'])} getters, {len(names['steps'])} setup steps import"
        )
        return 0
    if argv[1:]:
        print(__doc__, file=sys.stderr)
        return 2
    return serve()


if __name__ == "__main__":
    sys.exit(main(sys.argv))

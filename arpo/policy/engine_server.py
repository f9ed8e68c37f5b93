"""One policy engine shared by many actors over HTTP (`arpo-engine`), following the learner.

    arpo-engine engine.model=runs/tiny port=8100 \\
        transport.control=tcp://learner:5556 [transport.curve_secret_key=... ...]

Where GPUs sit on other machines than the desktops, or one engine batches the requests of
many actors, the engine runs as a server of its own. Actors reach it with the engine kind
`shared` (`engine_shared.SharedEngine`, `engine.kind=shared engine.base_url=...`).

The server loads one engine (`engine.kind`: transformers or vLLM in process) and follows the
learner itself: every `poll_s` it asks the learner's control link for the newest published
version (a `Heartbeat`, answered by the grant service) and, when it is newer than what it
serves, fetches the weights over the same link (`transport.fetch_weights`, checked against
their SHA-256) and loads them. So the weights cross the network once per server, not once
per actor, and actors never push weights. Each answer names the version that produced every
one of its tokens (the engine's version gate lets a weight load run alone); an actor whose
grant needs a newer version waits until the server reports it.

Routes (JSON; every answer and request carries `schema`, refused when it is not `SCHEMA`):

- `GET|POST /v1/health` -> `{schema, status: "ok", policy_version, learner_version, model}`
- `POST /v1/generate` `{schema, token_ids: [int], images: [base64 PNG], sampling: {temperature,
  top_p, max_new_tokens, seed, stop_token_ids}}` -> `{schema, token_ids, logprobs,
  policy_version}`

Errors are the env servers' JSON (`{"status": "error", "message": ...}`, 4xx naming the field
for a malformed request, 401 without the token, 500 for an engine failure); the server keeps
serving. It binds 127.0.0.1 by default; any other address needs `token` (or the environment
variable ARPO_ENGINE_TOKEN), sent as `Authorization: Bearer <token>`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arpo import wire
from arpo.config import check_range, check_seconds, fail, option
from arpo.errors import EngineError
from arpo.policy.engine import Engine, EngineConfig, SamplingParams
from arpo.policy.engine_shared import SCHEMA
from arpo.transport import TransportConfig

log = logging.getLogger("arpo.engine_server")

TOKEN_ENV = "ARPO_ENGINE_TOKEN"
MAX_PROMPT_TOKENS = 1 << 20
MAX_NEW_TOKENS = 1 << 16


@dataclass
class EngineServerConfig:
    """A shared policy engine: what it serves, where, and how it follows the learner."""

    engine: EngineConfig = option(
        EngineConfig(model="-"),
        "The engine it runs (kind 'hf' or 'vllm'; 'openai' and 'shared' are clients).",
    )
    host: str = option("127.0.0.1", "Address to bind; any other than loopback needs `token`.")
    port: int = option(8100, "Port to bind (0: any free port; the bound one is printed).")
    token: str = option(
        "", f"Bearer token every request must carry (empty: the variable {TOKEN_ENV}, or none)."
    )
    follow_learner: bool = option(
        True, "Fetch each newer version the learner publishes (off: serve the model as loaded)."
    )
    transport: TransportConfig = option(
        TransportConfig(), "The learner's control link (endpoints, CURVE keys)."
    )
    server_id: str = option("engine-0", "Name of this server in the learner's logs.")
    poll_s: float = option(1.0, "How often the learner is asked for a newer version.")
    max_request_mb: int = option(
        256, "Largest request body (the prompt's images, base64) in MiB; larger get 413."
    )

    def validate(self) -> None:
        if self.engine.model in ("", "-"):
            fail("engine.model", "is required: the model folder the server loads")
        if self.engine.kind not in ("hf", "vllm"):
            fail(
                "engine.kind",
                f"is {self.engine.kind!r}; a shared server runs an engine in process: 'hf' or "
                "'vllm' ('openai' and 'shared' are clients of a server)",
            )
        check_range("port", self.port, 0, 65535, "a TCP port")
        check_seconds("poll_s", self.poll_s)
        check_range("max_request_mb", self.max_request_mb, 1, 1 << 16, "MiB")
        if not self.server_id or len(self.server_id) > 64 or not self.server_id.isprintable():
            fail("server_id", "must be 1 to 64 printable characters")


def _sampling(raw: Any) -> SamplingParams:
    """`SamplingParams` from a request's `sampling` object; RequestError naming the field."""
    from arpo_envs.server_common import RequestError, check_type

    if not isinstance(raw, dict):
        raise RequestError("field 'sampling' must be an object")
    known = {"temperature", "top_p", "max_new_tokens", "seed", "stop_token_ids"}
    extra = sorted(set(raw) - known)
    if extra:
        raise RequestError(f"unknown field(s) in 'sampling': {extra}; known: {sorted(known)}")
    t = raw.get("temperature", 1.0)
    p = raw.get("top_p", 1.0)
    n = raw.get("max_new_tokens", 256)
    seed = raw.get("seed")
    stop = raw.get("stop_token_ids", [])
    check_type("sampling.temperature", t, (int, float))
    check_type("sampling.top_p", p, (int, float))
    check_type("sampling.max_new_tokens", n, int)
    check_type("sampling.stop_token_ids", stop, list)
    if seed is not None:
        check_type("sampling.seed", seed, int)
    if not 0.0 <= float(t) <= 100.0:
        raise RequestError(f"sampling.temperature must be in [0, 100], got {t}")
    if not 0.0 < float(p) <= 1.0:
        raise RequestError(f"sampling.top_p must be in (0, 1], got {p}")
    if not 1 <= n <= MAX_NEW_TOKENS:
        raise RequestError(f"sampling.max_new_tokens must be in [1, {MAX_NEW_TOKENS}], got {n}")
    if len(stop) > 64 or not all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        raise RequestError("sampling.stop_token_ids must be a list of at most 64 ints")
    return SamplingParams(
        temperature=float(t),
        top_p=float(p),
        max_new_tokens=n,
        seed=seed,
        stop_token_ids=tuple(stop),
    )


class EngineServer:
    """The HTTP server around one started engine, and its weights follower."""

    def __init__(self, config: EngineServerConfig, engine: Engine | None = None) -> None:
        from arpo.config import validate

        validate(config)
        self.config = config
        self.token = config.token or os.environ.get(TOKEN_ENV, "") or None
        self.engine = engine
        self._owns_engine = engine is None
        self.learner_version = -1
        self.loads = 0
        """Versions loaded from the learner since the start."""
        self.url = ""
        self._runner: Any = None
        self._follower: asyncio.Task | None = None
        self._refused = -1
        """A version the engine could not load (not fetched again)."""
        self._seq = 0
        self._silent_since = 0.0
        self._last_silence_log = 0.0

    async def start(self) -> str:
        """Load the engine, bind, start following the learner; the base URL."""
        from aiohttp import web
        from arpo_envs.server_common import ServerSecurity, make_app

        security = ServerSecurity(host=self.config.host, token=self.token)  # refuses an open bind
        if self.engine is None:
            from arpo.policy.engines import make_engine

            self.engine = make_engine(self.config.engine)
        await self.engine.start()
        app = make_app(security, client_max_size=self.config.max_request_mb << 20)
        app.router.add_route("GET", "/v1/health", self._health)
        app.router.add_route("POST", "/v1/health", self._health)
        app.router.add_post("/v1/generate", self._generate)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        port = self._runner.addresses[0][1]
        host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
        self.url = f"http://{host}:{port}"
        if self.config.follow_learner:
            self._follower = asyncio.create_task(self._follow(), name="engine-follower")
        return self.url

    async def close(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower
            self._follower = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.engine is not None and self._owns_engine:
            await self.engine.close()

    # ---- routes -----------------------------------------------------------------------

    def _check_schema(self, body: dict[str, Any]) -> None:
        from arpo_envs.server_common import RequestError

        if body.get("schema") != SCHEMA:
            raise RequestError(
                f"field 'schema' is {body.get('schema')!r:.40}; this server speaks schema "
                f"{SCHEMA} (client and server of different arpo versions?)"
            )

    async def _health(self, request: Any) -> Any:
        from aiohttp import web

        assert self.engine is not None
        return web.json_response(
            {
                "schema": SCHEMA,
                "status": "ok",
                "policy_version": self.engine.policy_version,
                "learner_version": self.learner_version,
                "model": self.config.engine.model,
            }
        )

    async def _generate(self, request: Any) -> Any:
        from aiohttp import web
        from arpo_envs.server_common import RequestError, read_json

        assert self.engine is not None
        body = await read_json(
            request, {"schema": int, "token_ids": list, "images": list, "sampling": dict}
        )
        self._check_schema(body)
        ids = body["token_ids"]
        if not 1 <= len(ids) <= MAX_PROMPT_TOKENS:
            raise RequestError(f"field 'token_ids' must hold 1 to {MAX_PROMPT_TOKENS} tokens")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise RequestError("field 'token_ids' must be a list of ints >= 0")
        images = []
        for i, im in enumerate(body["images"]):
            if not isinstance(im, str):
                raise RequestError(f"images[{i}] must be a base64 string of a PNG")
            try:
                images.append(base64.b64decode(im, validate=True))
            except (binascii.Error, ValueError):
                raise RequestError(f"images[{i}] is not valid base64") from None
        params = _sampling(body["sampling"])
        try:
            out = await self.engine.generate(ids, images, params)
        except EngineError as e:
            raise RequestError(f"the engine refused the request: {e}") from None
        return web.json_response(
            {
                "schema": SCHEMA,
                "token_ids": [int(t) for t in out.token_ids],
                "logprobs": [float(x) for x in out.logprobs],
                "policy_version": int(out.policy_version),
            }
        )

    # ---- following the learner --------------------------------------------------------

    async def _follow(self) -> None:
        """Every poll_s: ask the learner's newest version; fetch and load a newer one. A
        learner that does not answer is asked again (logged every 30 s); a version the
        engine cannot load is logged and not fetched again; any other failure of a round is
        logged (every 30 s at most) and the next round runs: the server never stops
        following while it serves."""
        from arpo.transport import ActorLink

        c = self.config
        link = ActorLink(c.transport, on_ack=lambda ids: None, actor_id=c.server_id)
        self._refused, self._seq, last_warn = -1, 0, 0.0
        try:
            while True:
                try:
                    loaded = await self._follow_once(link)
                except Exception:
                    loaded = False
                    if time.monotonic() - last_warn > 30.0:
                        last_warn = time.monotonic()
                        log.exception("engine server %s: a round of following the learner "
                                      "failed; trying again", c.server_id)  # fmt: skip
                if not loaded:  # after a load a newer version may be out already: at once
                    await asyncio.sleep(c.poll_s)
        finally:
            await link.close()

    async def _follow_once(self, link: Any) -> bool:
        """One round: the learner's newest version, and the weights when newer than those
        served; True when a version was loaded."""
        from arpo.transport import fetch_weights

        assert self.engine is not None
        c = self.config
        self._seq += 1
        served = self.engine.policy_version
        hb = wire.Heartbeat(c.server_id, "actor", self._seq, served, time.time(), {})
        reply = await link.request(hb, lambda m: isinstance(m, wire.Heartbeat))
        if isinstance(reply, wire.Heartbeat):
            self.learner_version = max(self.learner_version, reply.version)
            self._silent_since = 0.0
        else:
            now = time.monotonic()
            self._silent_since = self._silent_since or now
            if now - self._last_silence_log > 30.0:
                self._last_silence_log = now
                log.warning("engine server %s: the learner at %s has not answered for %.0f s; "
                            "serving v%d", c.server_id, c.transport.control,
                            now - self._silent_since, served)  # fmt: skip
        newest = self.learner_version
        if newest <= served or newest == self._refused:
            return False
        got = await fetch_weights(link)
        if got is None or got[0].version <= served:
            return False
        ann, data = got
        t0 = time.perf_counter()
        try:
            state = await asyncio.to_thread(_load_safetensors, data)
            await self.engine.update_weights(state, ann.version)
        except Exception:
            self._refused = ann.version
            log.exception("engine server %s: policy v%d could not be loaded; still serving "
                          "v%d", c.server_id, ann.version, served)  # fmt: skip
            return False
        self.loads += 1
        log.info("engine server %s: policy v%d loaded (%.1f MB, %.2f s)", c.server_id,
                 ann.version, ann.nbytes / 1e6, time.perf_counter() - t0)  # fmt: skip
        return True


def _load_safetensors(data: bytes | Path) -> dict[str, Any]:
    import safetensors.torch

    if isinstance(data, Path):
        return safetensors.torch.load_file(str(data))
    return safetensors.torch.load(bytes(data))


def main(argv: list[str] | None = None) -> int:
    from arpo.config import describe, load_config
    from arpo.errors import ConfigError
    from arpo.logs import setup_process

    ap = argparse.ArgumentParser(
        prog="arpo-engine", description="Serve one policy engine to many actors over HTTP."
    )
    ap.add_argument("--config", help="TOML file with config fields")
    ap.add_argument("--show-config", action="store_true", help="list every config field and exit")
    ap.add_argument("--log-level", default="INFO", help="level of arpo's logs (default INFO)")
    ap.add_argument("overrides", nargs="*", metavar="field=value", help="override a config field")
    args = ap.parse_args(argv)
    if args.show_config:
        print(describe(EngineServerConfig))
        return 0
    try:
        cfg = load_config(EngineServerConfig, args.config, args.overrides)
        server = EngineServer(cfg)
    except (ConfigError, ValueError) as e:
        print(f"arpo-engine: {e}", file=sys.stderr)
        return 2
    setup_process(args.log_level)

    async def run() -> None:
        import signal

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            url = await server.start()
            print(f"engine server {url} serving v{server.engine.policy_version}", flush=True)  # type: ignore[union-attr]
            await stop.wait()
        finally:
            await server.close()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())

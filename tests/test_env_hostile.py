"""Hostile environments: whatever an environment (or a fleet's control API) answers, its
failure is the environment's, never the task's.

Each test puts a real server on loopback (a raw asyncio socket server for answers that are
not HTTP, an aiohttp one for HTTP that says the wrong thing) beside a real simulated
desktop, and drives it with the real client, provider, runner and actor.

- garbage answers to `/reset` (not HTTP, a bad status line, a 1 MiB header, JSON nested
  100,000 deep, a body that is not UTF-8, an endless body, a reset answered
  `{"status": "error"}`): the environment becomes unhealthy, no task is quarantined (before:
  every task set up against it was quarantined and the environment stayed healthy);
- answers bounded in size (per kind of answer) and time, the fleet's control API's too;
- a fleet control API answering deep or non-UTF-8 JSON: every provider call gives EnvError
  (health a Health), never RecursionError or UnicodeDecodeError;
- a desktop behind a wrong token: retired after one episode, said once, the other desktop
  goes on (before: re-admitted in a loop, hundreds of grants and log lines);
- a malformed request carrying the token: the server's log holds no token.
"""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from arpo_envs.server_common import ServerSecurity
from arpo_envs.server_common import make_app as make_env_app
from arpo_envs.sim.server import SimConfig, start_servers
from arpo_envs.sim.tasks import generate_tasks

from arpo.actor.episode import EpisodeConfig
from arpo.env.client import (
    ClientConfig,
    EnvAnswerTooLarge,
    EnvAuthError,
    EnvClient,
    EnvProtocolError,
)
from arpo.env.environment import Environment, EnvironmentConfig
from arpo.env.provider import FleetLink, FleetVMProvider
from arpo.env.runner import RunnerConfig
from arpo.env.task import Task
from arpo.errors import EnvError, EnvTimeout, ResetError, TaskError
from arpo.record import Status

RUNNER = RunnerConfig(reset_before_setup=True, sleep_scale=0.0, evaluator="own")
RESET = EnvironmentConfig(reset_retries=2, reset_backoff_s=0.01)


def http(status: str, body: bytes, headers: bytes = b"") -> bytes:
    """One raw HTTP/1.1 answer (closed after it)."""
    return (
        f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n".encode()
        + headers
        + b"\r\n"
        + body
    )


JSON = b"Content-Type: application/json\r\n"
GARBAGE = {
    "not_http": b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n",
    "bad_status_line": b"HTTP/1.1 abc Weird\r\nContent-Length: 2\r\n\r\n{}",
    "one_mib_header": http(
        "200 OK", b'{"status": "success"}', b"X-Big: " + b"a" * (1 << 20) + b"\r\n"
    ),
    "json_nested_100k_deep": http("200 OK", b"[" * 100_000 + b"]" * 100_000, JSON),
    "invalid_utf8": http("200 OK", b'{"status": "success", "x": "\xff\xfe"}', JSON),
    "not_json": http("200 OK", b"<html>proxy error</html>", b"Content-Type: text/html\r\n"),
    "json_not_an_object": http("200 OK", b"[1, 2, 3]", JSON),
    "status_error": http("200 OK", b'{"status": "error", "message": "no display"}', JSON),
}
"""Answers to every request (so to /reset too) of a hostile environment."""


@asynccontextmanager
async def raw_server(answer: bytes | Callable[[asyncio.StreamWriter], Any]) -> AsyncIterator[str]:
    """A TCP server on loopback that reads a request's head and writes `answer` (bytes, or a
    coroutine function given the writer), then closes; yields its URL."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            if callable(answer):
                await answer(writer)
            else:
                writer.write(answer)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


@asynccontextmanager
async def aiohttp_server(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def sim_tasks(n: int = 4) -> list[Task]:
    raw = generate_tasks("click_button", n, seed=3)
    return [Task.from_dict(t, domain="sim") for t in raw]


# ---- 1, 2: garbage from /reset is the environment's failure ---------------------------------


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_a_garbage_reset_makes_the_environment_unhealthy_and_blames_no_task(kind: str) -> None:
    async def main() -> None:
        runners, (sim_url,) = await start_servers([SimConfig(port=0)])
        quarantine: dict[str, str] = {}
        try:
            async with raw_server(GARBAGE[kind]) as bad_url:
                bad = Environment(0, bad_url, RUNNER, quarantine=quarantine, config=RESET)
                good = Environment(1, sim_url, RUNNER, quarantine=quarantine, config=RESET)
                try:
                    for task in sim_tasks(4):
                        failed = await bad.prepare(task)
                        assert failed is not None and failed.status == Status.ENV_ERROR, failed
                        assert failed.reason.startswith("reset: "), failed.reason
                        assert not bad.healthy
                        if kind == "status_error":  # the server's own words are kept
                            assert "'error'" in failed.reason and "no display" in failed.reason
                        assert await good.prepare(task) is None  # it sets up
                        assert good.healthy
                finally:
                    await bad.close()
                    await good.close()
        finally:
            for r in runners:
                await r.cleanup()
        assert quarantine == {}, "a task was blamed for the environment's garbage"

    asyncio.run(main())


def test_a_reset_answered_without_success_is_a_reset_error_naming_the_servers_message() -> None:
    answers = {
        b'{"status": "error", "message": "Xvfb died"}': "Xvfb died",
        b'{"status": "busy"}': "'busy'",
        b"{}": "None",
        b'"success"': "None",
    }

    async def main() -> None:
        for body, words in answers.items():
            async with (
                raw_server(http("200 OK", body, JSON)) as url,
                EnvClient(ClientConfig(base_url=url, max_retries=0)) as client,
            ):
                with pytest.raises(ResetError, match="instead of 'success'") as e:
                    await client.reset()
                assert words in str(e.value)

    asyncio.run(main())


# ---- 4: every answer is bounded in size and time ---------------------------------------------


def test_answers_are_bounded_in_size_per_kind_and_in_time() -> None:
    sent = {"bytes": 0}

    async def endless(writer: asyncio.StreamWriter) -> None:
        """A 200 whose chunked body never ends: 1 MiB chunks until the client hangs up."""
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n" % (1 << 20) + b"\0" * (1 << 20) + b"\r\n"
        while sent["bytes"] < 1 << 30:  # a bound for the test itself: 1 GiB
            writer.write(chunk)
            await writer.drain()
            sent["bytes"] += len(chunk)

    async def drip(writer: asyncio.StreamWriter) -> None:
        """A 200 that sends one byte of its body every 0.2 s, forever."""
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
        while True:
            writer.write(b" ")
            await writer.drain()
            await asyncio.sleep(0.2)

    declared = b"HTTP/1.1 200 OK\r\nContent-Length: 1500000000\r\n\r\n" + b"x" * 1000

    async def main() -> None:
        cfg = dict(max_retries=0, max_answer_bytes=1 << 20, max_screenshot_bytes=2 << 20,
                   max_file_bytes=3 << 20)  # fmt: skip
        async with raw_server(endless) as url, EnvClient(ClientConfig(url, **cfg)) as client:
            for call, limit in ((client.reset(), 1 << 20), (client.screenshot(), 2 << 20),
                                (client.get_file("/x"), 3 << 20)):  # fmt: skip
                sent["bytes"] = 0
                with pytest.raises(EnvAnswerTooLarge, match=f"limit of {limit} bytes"):
                    await asyncio.wait_for(call, 20)
                # the client stopped reading: what was sent is the limit plus socket buffers
                assert sent["bytes"] < limit + (32 << 20), sent
        async with raw_server(declared) as url, EnvClient(ClientConfig(url, **cfg)) as client:
            with pytest.raises(EnvAnswerTooLarge, match="declares 1500000000 bytes"):
                await client.screenshot()
        async with raw_server(drip) as url:
            client = EnvClient(ClientConfig(url, max_retries=0, timeout_s=1.0))
            async with client:
                t0 = asyncio.get_running_loop().time()
                with pytest.raises(EnvTimeout):
                    await client.screenshot()
                assert asyncio.get_running_loop().time() - t0 < 5.0

    asyncio.run(main())


def test_client_config_refuses_limits_below_one_byte() -> None:
    with pytest.raises(ValueError, match="max_file_bytes must be >= 1"):
        ClientConfig(max_file_bytes=0)


# ---- 5: the fleet's control API cannot raise anything but EnvError ---------------------------


DEEP = b"[" * 100_000 + b"]" * 100_000
FLEET_ANSWERS: dict[str, tuple[int, bytes]] = {
    "deep_json": (200, DEEP),
    "deep_json_in_an_object": (200, b'{"status": "ok", "x": ' + DEEP + b"}"),
    "non_utf8_json": (200, b'{"status": "\xff\xfe", "ok": true}'),
    "not_json": (200, b"<html>gateway</html>"),
    "json_list": (200, b"[1, 2]"),
    "error_deep_json": (503, DEEP),
    "error_non_utf8": (500, b"\xff\xfe\xfd"),
    "conflict_without_quarantine": (409, b'{"error": "some proxy"}'),
    "huge": (200, b'{"status": "ok", "pad": "' + b"x" * (2 << 20) + b'"}'),
}


@pytest.mark.parametrize("kind", sorted(FLEET_ANSWERS))
def test_a_hostile_fleet_control_api_gives_env_errors_only(kind: str) -> None:
    status, body = FLEET_ANSWERS[kind]

    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=status, body=body, content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)

    async def main() -> None:
        async with aiohttp_server(app) as url:
            link = FleetLink(control=url, token="t")
            env = Environment(
                0, "http://127.0.0.1:9", RUNNER,
                provider=lambda c: FleetVMProvider(c, link, "vm0", timeout_s=5.0),
            )  # fmt: skip
            provider = env.provider
            try:
                with pytest.raises(EnvError) as e:
                    await provider.revert_to_snapshot("task-a")
                assert not isinstance(e.value, TaskError)
                health = await provider.health()
                assert not health.ok and health.reason
                await provider.report("task-a", False, "x")  # logged, never raised
                with pytest.raises(ResetError):  # the environment's fault
                    await env.revert(sim_tasks(1)[0])
            finally:
                await env.close()

    asyncio.run(main())


def test_a_fleet_that_refuses_its_token_is_final() -> None:
    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": "missing or wrong fleet token"}, status=401)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", refuse)

    async def main() -> None:
        async with aiohttp_server(app) as url:
            client = EnvClient(ClientConfig(base_url="http://127.0.0.1:9", max_retries=0))
            provider = FleetVMProvider(client, FleetLink(url, "wrong"), "vm0", timeout_s=5.0)
            try:
                with pytest.raises(EnvAuthError, match="refuses its token"):
                    await provider.revert_to_snapshot("t")
                health = await provider.health()
                assert not health.ok and health.final
            finally:
                await provider.stop()
                await client.close()

    asyncio.run(main())


# ---- 3: a desktop behind a wrong token is retired once ---------------------------------------


def test_a_desktop_behind_a_wrong_token_is_retired_once_and_the_other_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from test_actor import Learner, async_wait_for

    from arpo.actor.actor import Actor
    from arpo.actor.config import ActorConfig
    from arpo.service.grants import GrantConfig

    tasks = generate_tasks("click_button", 2, seed=5)
    lr = Learner(tasks, GrantConfig(group_size=4, groups_per_step=4, max_staleness=0), tmp_path)
    caplog.set_level(logging.INFO)

    async def go() -> tuple[Actor, str]:
        runners, (bad_url, good_url) = await start_servers(
            [SimConfig(port=0, token="the-right-one"), SimConfig(port=0, token="good-token-42")]
        )
        try:
            cfg = ActorConfig(
                envs=[bad_url, good_url],
                env_tokens=["a-wrong-one", "good-token-42"],
                env_pool="sim",
                policy="scripted",
                spool_dir=str(tmp_path / "spool"),
                transport=lr.transport(),
                episode=EpisodeConfig(scroll_clicks=1),
                environment=EnvironmentConfig(reset_retries=2, reset_backoff_s=0.05),
                env_recheck_s=0.1,  # a recheck loop would show within a second
                progress_s=0,
            )
            actor = Actor(cfg)
            run = asyncio.create_task(actor.run())
            await async_wait_for(lambda: actor.stats.by_status.get("ok", 0) >= 6, "6 episodes",
                                 timeout=25)  # fmt: skip
            await asyncio.sleep(1.5)  # 15 recheck periods
            assert not run.done(), "the actor stopped although one desktop serves"
            actor.stop()
            await asyncio.wait_for(run, 30)
        finally:
            for r in runners:
                await r.cleanup()
        return actor, bad_url

    try:
        actor, bad_url = asyncio.run(go())
        on_bad = [t for t in (*lr.ingest.excluded, *lr.drain()) if t.env == bad_url]
    finally:
        lr.close()
    assert actor.failed is False
    assert 1 <= len(on_bad) <= 2, f"{len(on_bad)} episodes burned on the refusing desktop"
    assert all(t.status == Status.ENV_ERROR and "token refused" in t.error for t in on_bad)
    assert "refuses the token" in actor.envs[0].retired and not actor.envs[0].healthy
    assert actor.envs[1].healthy and not actor.envs[1].retired
    said = [r for r in caplog.records if bad_url in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert said[0].levelno == logging.ERROR and "token" in said[0].getMessage()
    assert "wrong" in said[0].getMessage()


# ---- 7: a malformed request carrying the token is not logged with it ------------------------


def test_a_malformed_request_carrying_the_token_leaves_it_out_of_the_servers_log() -> None:
    token = "tok-" + "5ecret" * 4
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logging.getLogger().addHandler(handler)  # as the desktop server's main() configures it
    requests = [
        b"GET /platform HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token.encode()
        + b"\x01\r\n\r\n",
        b"GET /plat form HTTP/1.1\r\nAuthorization: Bearer " + token.encode() + b"\r\n\r\n",
        b"GET /platform HTTP/1.1\r\nAuthorization: Bearer " + token.encode()
        + b"\r\nContent-Length: zz\r\n\r\n",
    ]  # fmt: skip

    async def platform(request: web.Request) -> web.Response:
        return web.Response(text="Linux")

    async def main() -> None:
        app = make_env_app(ServerSecurity("127.0.0.1", token))
        app.router.add_get("/platform", platform)
        async with aiohttp_server(app) as url:
            host, port = url.removeprefix("http://").split(":")
            for raw in requests:
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(raw)
                await writer.drain()
                assert (await reader.read(1 << 16)).startswith(b"HTTP/1.")
                writer.close()

    try:
        asyncio.run(main())
    finally:
        logging.getLogger().removeHandler(handler)
    logged = out.getvalue()
    assert logged.count("malformed request refused") == len(requests), logged
    assert token not in logged and "5ecret" not in logged, logged


def test_json_error_bodies_of_fleet_answers_survive_as_text() -> None:
    """An error answer that is not JSON still names what the fleet said."""

    async def main() -> None:
        body = http("503 Service Unavailable", b"qemu is gone", b"Content-Type: text/plain\r\n")
        async with raw_server(body) as url:
            client = EnvClient(ClientConfig(base_url="http://127.0.0.1:9", max_retries=0))
            provider = FleetVMProvider(client, FleetLink(url, "t"), "vm0", timeout_s=5.0)
            try:
                with pytest.raises(EnvError, match="qemu is gone"):
                    await provider.revert_to_snapshot("t")
            finally:
                await provider.stop()

    asyncio.run(main())


def test_malformed_answers_of_other_endpoints_are_protocol_errors() -> None:
    """Not only /reset: a screen size, a pointer position or an exit code that is not one."""
    nested = b"[" * 900 + b"]" * 900  # parses, but no str() of it would
    answers = [
        ("screen_size", b'{"width": "wide", "height": 720}'),
        ("cursor_position", b'{"x": 1}'),
        ("execute", b'{"status": "success", "returncode": "zero"}'),
        ("execute", b'{"status": "success", "returncode": 0, "output": ' + nested + b"}"),
        ("accessibility", b'{"AT": {"a": ' + nested + b"}}"),
    ]

    async def main() -> None:
        for call, body in answers:
            async with (
                raw_server(http("200 OK", body, JSON)) as url,
                EnvClient(ClientConfig(base_url=url, max_retries=0)) as client,
            ):
                fn = getattr(client, call)
                with pytest.raises(EnvProtocolError):
                    await (fn(["true"]) if call == "execute" else fn())

    asyncio.run(main())

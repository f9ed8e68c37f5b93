"""The OSWorld client against a real aiohttp server on loopback (tests/osworld_fixtures/peer.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
from arpo_envs.procs import free_port
from osworld_fixtures.peer import PNG_1X1, Peer

from arpo.env.client import PYAUTOGUI_PREFIX, ClientConfig, EnvClient
from arpo.errors import EnvError, EnvHTTPError, EnvTimeout, EnvTransportError

FAST = dict(backoff_initial_s=0.02, backoff_max_s=0.1)


def run(coro):
    return asyncio.run(coro)


async def with_peer(body, *, peer: Peer | None = None, **cfg):
    peer = await (peer or Peer()).start()
    try:
        async with EnvClient(ClientConfig(base_url=peer.url, **{**FAST, **cfg})) as client:
            return await body(client, peer)
    finally:
        await peer.stop()


def test_observation_endpoints():
    async def body(c: EnvClient, peer: Peer):
        assert await c.screenshot() == PNG_1X1
        assert await c.platform() == "Linux"
        assert await c.screen_size() == (1920, 1080)
        assert await c.cursor_position() == (12, 34)
        assert await c.accessibility() == "<desktop-frame/>"
        assert await c.terminal() is None

    run(with_peer(body))


def test_execute_returns_what_the_command_printed():
    async def body(c: EnvClient, peer: Peer):
        res = await c.execute(["python3", "-c", "print(6 * 7)"])
        assert (res.status, res.output.strip(), res.returncode) == ("success", "42", 0)
        res = await c.execute("echo $((1 + 2)) && exit 3", shell=True)
        assert (res.output.strip(), res.returncode) == ("3", 3)
        bash = await c.run_bash_script("echo from-bash")
        assert bash.output.strip() == "from-bash" and bash.returncode == 0

    run(with_peer(body))


def test_execute_pyautogui_sends_osworld_command_line():
    async def body(c: EnvClient, peer: Peer):
        res = await c.execute_pyautogui("pyautogui.click(1, 2)")
        assert res.returncode == 0
        (sent,) = peer.recorded("/execute")
        assert sent == {
            "command": [
                "python",
                "-c",
                "import pyautogui; import time; pyautogui.FAILSAFE = False; pyautogui.click(1, 2)",
            ],
            "shell": False,
        }
        assert sent["command"][2] == PYAUTOGUI_PREFIX + "pyautogui.click(1, 2)"

    run(with_peer(body))


def test_setup_endpoints_upload_open_file_windows():
    async def body(c: EnvClient, peer: Peer):
        await c.upload("/home/user/a.txt", b"hello\x00bytes")
        assert peer.files["/home/user/a.txt"] == b"hello\x00bytes"
        assert await c.get_file("/home/user/a.txt") == b"hello\x00bytes"
        await c.open_file("/home/user/a.txt")
        await c.activate_window("a.txt", strict=True)
        assert peer.recorded("/setup/activate_window") == [
            {"window_name": "a.txt", "strict": True, "by_class": False}
        ]
        await c.launch(["gedit"])
        assert peer.recorded("/setup/launch") == [{"command": ["gedit"], "shell": False}]
        with pytest.raises(EnvHTTPError) as ei:
            await c.get_file("/nope")
        assert ei.value.status == 404
        with pytest.raises(EnvHTTPError):
            await c.close_window("no such window")
        assert (await c.reset())["status"] == "success"
        assert peer.files == {}
        await c.sim_scene({"family": "calc", "seed": 3})
        assert await c.sim_state("cell.A1") == 7

    run(with_peer(body))


def test_retries_connection_refused_until_the_server_comes_up():
    port = free_port()

    async def main():
        peer = Peer()
        client = EnvClient(
            ClientConfig(base_url=f"http://127.0.0.1:{port}", max_retries=30, **FAST)
        )
        try:
            # A POST is retried too: a refused connection means nothing reached the server.
            call = asyncio.create_task(client.execute(["echo", "up"]))
            await asyncio.sleep(0.3)
            assert not call.done()
            await peer.start(port)
            res = await asyncio.wait_for(call, 10)
            assert res.output.strip() == "up"
            assert peer.counts["/execute"] == 1
        finally:
            await client.close()
            await peer.stop()

    run(main())


def test_connection_refused_gives_transport_error_after_retries():
    async def main():
        cfg = ClientConfig(base_url=f"http://127.0.0.1:{free_port()}", max_retries=2, **FAST)
        async with EnvClient(cfg) as client:
            with pytest.raises(EnvTransportError, match="3 attempts"):
                await client.screenshot()

    run(main())


def test_http_500_is_not_retried_and_carries_the_body():
    peer = Peer(fail={"/execute": (500, "boom: traceback here")})

    async def body(c: EnvClient, p: Peer):
        with pytest.raises(EnvHTTPError) as ei:
            await c.execute(["true"])
        assert ei.value.status == 500
        assert ei.value.body == "boom: traceback here"
        assert p.counts["/execute"] == 1

    run(with_peer(body, peer=peer))


def test_timeout_of_a_post_is_not_retried():
    peer = Peer(delay={"/execute": 2.0})

    async def body(c: EnvClient, p: Peer):
        t0 = time.perf_counter()
        with pytest.raises(EnvTimeout) as ei:
            await c.execute(["true"], timeout=0.2)
        assert isinstance(ei.value, TimeoutError)
        # well before the peer's answer (2 s): the 0.2 s timeout ended the call, with
        # room for a loaded machine
        assert time.perf_counter() - t0 < 1.5
        assert p.counts["/execute"] == 1

    run(with_peer(body, peer=peer))


def test_timeout_of_a_get_is_retried_then_raises():
    peer = Peer(delay={"/screenshot": 0.6})

    async def body(c: EnvClient, p: Peer):
        with pytest.raises(EnvTimeout):
            await c.screenshot(timeout=0.1)
        assert p.counts["/screenshot"] == 3

    run(with_peer(body, peer=peer, max_retries=2))


def test_dropped_connection_retried_for_get_not_for_action():
    peer = Peer(drop={"/screenshot", "/execute"})

    async def body(c: EnvClient, p: Peer):
        with pytest.raises(EnvTransportError):
            await c.screenshot()
        # 3 attempts; aiohttp itself re-sends a GET once when a pooled keep-alive connection
        # turns out closed, so the server may see up to 6 requests.
        assert 3 <= p.counts["/screenshot"] <= 6
        with pytest.raises(EnvTransportError, match="may already have run"):
            await c.execute_pyautogui("pyautogui.press('a')")
        assert p.counts["/execute"] == 1

    run(with_peer(body, peer=peer, max_retries=2))


def test_bearer_token_is_sent():
    async def body_without(c: EnvClient, p: Peer):
        with pytest.raises(EnvHTTPError) as ei:
            await c.platform()
        assert ei.value.status == 401

    async def body_with(c: EnvClient, p: Peer):
        assert await c.platform() == "Linux"

    run(with_peer(body_without, peer=Peer(token="s3cret")))
    run(with_peer(body_with, peer=Peer(token="s3cret"), token="s3cret"))


def test_non_json_reply_is_an_env_error():
    peer = Peer()

    async def body(c: EnvClient, p: Peer):
        with pytest.raises(EnvError, match="not JSON"):
            await c._request("GET", "/platform", expect="json")

    run(with_peer(body, peer=peer))


def test_config_validation_says_how_to_fix():
    with pytest.raises(ValueError, match="base_url"):
        ClientConfig(base_url="localhost:5000")
    with pytest.raises(ValueError, match="timeout_s"):
        ClientConfig(timeout_s=0)

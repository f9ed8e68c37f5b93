"""The simulated desktop's HTTP server on a real loopback port: protocol, screenshots, auth,
bad input, latency, and the `arpo-envs sim` process."""

from __future__ import annotations

import asyncio
import io
import os
import random
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zlib

import aiohttp
import pytest
from arpo_envs.png import BandPngEncoder, adler32_combine
from arpo_envs.server_common import ServerSecurity, check_bind
from arpo_envs.sim import LatencyConfig, SimConfig
from arpo_envs.sim.server import running
from PIL import Image, ImageDraw

PREFIX = "import pyautogui; import time; pyautogui.FAILSAFE = False; "


def run(coro):
    return asyncio.run(coro)


async def act(s: aiohttp.ClientSession, url: str, code: str) -> dict:
    async with s.post(f"{url}/execute", json={"command": ["python", "-c", PREFIX + code]}) as r:
        assert r.status == 200
        return await r.json()


async def screenshot(s: aiohttp.ClientSession, url: str) -> Image.Image:
    async with s.get(f"{url}/screenshot") as r:
        assert r.status == 200 and r.content_type == "image/png"
        data = await r.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    img = Image.open(io.BytesIO(data))
    img.load()  # decodes every pixel: a corrupt stream raises here
    return img


@pytest.mark.parametrize("size", [(1280, 720), (800, 600)])
def test_screenshots_are_pngs_of_the_screen_size_and_follow_actions(size) -> None:
    async def body() -> None:
        cfg = SimConfig(port=0, width=size[0], height=size[1])
        async with running([cfg]) as (url,), aiohttp.ClientSession() as s:
            async with s.post(f"{url}/sim/scene", json={"family": "type_submit", "seed": 1}) as r:
                assert r.status == 200
            first = await screenshot(s, url)
            assert first.size == size and first.mode == "RGB"
            same = await screenshot(s, url)
            assert same.tobytes() == first.tobytes()
            state = await (await s.post(f"{url}/sim/state", json={"path": "widgets.text"})).json()
            assert state["value"]["value"] == ""
            ax = await (await s.get(f"{url}/accessibility")).json()
            entry = ET.fromstring(ax["AT"]).find(".//entry")
            cp = "{https://accessibility.ubuntu.example.org/ns/component}"
            x, y = (int(v) for v in entry.get(f"{cp}screencoord").strip("()").split(","))
            await act(s, url, f"pyautogui.click({x + 20}, {y + 10}); pyautogui.write('abc')")
            after = await screenshot(s, url)
            assert after.tobytes() != first.tobytes()
            # the typed text changed the pixels inside the field
            box = (x, y, x + 200, y + 30)
            assert after.crop(box).tobytes() != first.crop(box).tobytes()
            pos = await (await s.get(f"{url}/cursor_position")).json()
            assert pos == [x + 20, y + 10]

    run(body())


def test_protocol_endpoints() -> None:
    async def body() -> None:
        async with running([SimConfig(port=0)]) as (url,), aiohttp.ClientSession() as s:
            assert await (await s.post(f"{url}/screen_size")).json() == {
                "width": 1280,
                "height": 720,
            }
            assert await (await s.get(f"{url}/platform")).text() == "Linux"
            assert (await (await s.get(f"{url}/terminal")).json())["output"] is None
            ET.fromstring((await (await s.get(f"{url}/accessibility")).json())["AT"])
            # OSWorld's platform query goes through /execute and reads `output`
            res = await (
                await s.post(
                    f"{url}/execute",
                    json={"command": ["python", "-c", "import platform; print(platform.system())"]},
                )
            ).json()
            assert res == {"status": "success", "output": "Linux\n", "error": "", "returncode": 0}
            res = await (await s.post(f"{url}/setup/execute", json={"command": "ls -l"})).json()
            assert res["returncode"] == 1 and "python -c" in res["error"]
            res = await (await s.post(f"{url}/run_python", json={"code": "print(1 + 1)"})).json()
            assert res["return_code"] == 1 and res["status"] == "error"  # 1 + 1 is not a literal
            res = await (
                await s.post(
                    f"{url}/run_python", json={"code": "import pyautogui\nprint(pyautogui.size())"}
                )
            ).json()
            assert res["output"] == "Size(width=1280, height=720)\n" and res["return_code"] == 0
            await screenshot(s, url)
            stats = await (await s.get(f"{url}/sim/stats")).json()
            assert stats["interpret"]["count"] == 3 and stats["render_encode"]["count"] == 1

    run(body())


def test_bad_input_gets_4xx_json_and_the_server_keeps_serving() -> None:
    async def body() -> None:
        async with running([SimConfig(port=0)]) as (url,), aiohttp.ClientSession() as s:
            cases = [
                ("POST", "/execute", b"{not json", 400),
                ("POST", "/execute", b"[1, 2]", 400),
                ("POST", "/execute", b'{"shell": false}', 400),
                ("POST", "/execute", b'{"command": 5}', 400),
                ("POST", "/execute", b'{"command": ["python", "-c", 1]}', 400),
                ("POST", "/execute", b'{"command": "python -c pass", "shell": "yes"}', 400),
                ("POST", "/run_python", b"{}", 400),
                ("POST", "/sim/scene", b'{"family": "nope", "seed": 1}', 400),
                ("POST", "/sim/scene", b'{"family": "menu_pick", "seed": true}', 400),
                ("POST", "/sim/state", b'{"path": "no.such.thing"}', 404),
                ("POST", "/reset", b'{"family": "menu_pick"}', 400),
                ("GET", "/no/such/endpoint", b"", 404),
                ("POST", "/screenshot", b"", 405),
                ("POST", "/sim/state", b"\xff\xfe", 400),
                ("POST", "/execute", b"[" * 100_000 + b"]" * 100_000, 400),  # nesting
                ("POST", "/execute", b'{"command": ' + b"9" * 5000 + b"}", 400),  # huge int
                ("POST", "/execute", b'{"command": "\\ud800"}', 400),  # lone surrogate
                ("POST", "/execute", b'{"command": ["ls", "a\\u0000b"]}', 400),  # NUL
            ]
            for method, path, data, status in cases:
                async with s.request(method, f"{url}{path}", data=data) as r:
                    assert r.status == status, (path, data, await r.text())
                    body = await r.json()
                    assert body["status"] == "error" and body["message"], body
            # Programs that fail inside the interpreter answer as `python -c` would: exit
            # code 1 and the error on stderr, never a 500.
            for code in ("pyautogui.click(1e999, 1)", "pyautogui.moveTo(" + "-" * 50_000 + "1, 2)"):
                res = await act(s, url, code)
                assert res["returncode"] == 1 and "Error" in res["error"], res
            # still serving, state intact
            res = await act(s, url, "pyautogui.moveTo(3, 4)")
            assert res["returncode"] == 0
            assert await (await s.get(f"{url}/cursor_position")).json() == [3, 4]

    run(body())


def test_unexpected_exception_is_500_json_and_serving_continues(monkeypatch) -> None:
    from arpo_envs.sim.desktop import Desktop

    def broken(self):
        raise RuntimeError("boom")

    async def body() -> None:
        async with running([SimConfig(port=0)]) as (url,), aiohttp.ClientSession() as s:
            monkeypatch.setattr(Desktop, "accessibility_xml", broken)
            async with s.get(f"{url}/accessibility") as r:
                assert r.status == 500
                assert "boom" in (await r.json())["message"]
            assert await (await s.get(f"{url}/platform")).text() == "Linux"

    import logging

    logging.getLogger("arpo_envs.server").disabled = True
    try:
        run(body())
    finally:
        logging.getLogger("arpo_envs.server").disabled = False


def test_auth() -> None:
    with pytest.raises(ValueError, match="without a token"):
        SimConfig(host="0.0.0.0")
    with pytest.raises(ValueError, match="without a token"):
        check_bind("example.org", None)
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        check_bind(host, None)
    ServerSecurity("0.0.0.0", "s3cret")  # exposed with a token: allowed

    async def body() -> None:
        async with (
            running([SimConfig(port=0, token="s3cret")]) as (url,),
            aiohttp.ClientSession() as s,
        ):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                async with s.get(f"{url}/screenshot", headers=headers) as r:
                    assert r.status == 401
                    assert (await r.json())["status"] == "error"
            async with s.get(f"{url}/nothing-here") as r:
                assert r.status == 401  # no probing of endpoints without the token
            async with s.get(f"{url}/platform", headers={"Authorization": "Bearer s3cret"}) as r:
                assert r.status == 200
            # An Authorization header that is not UTF-8: 401 JSON, not a 500 traceback.
            host, port = url.removeprefix("http://").rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /platform HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe"
                         b"\r\nConnection: close\r\n\r\n")  # fmt: skip
            answer = await reader.read()
            writer.close()
            assert answer.startswith(b"HTTP/1.1 401") and b'"status": "error"' in answer, answer

    run(body())


def test_fixed_latency_is_honoured_and_one_env_is_slow() -> None:
    async def timed(s, url) -> tuple[float, float]:
        t0 = time.perf_counter()
        await act(s, url, "pyautogui.moveTo(1, 1)")
        t1 = time.perf_counter()
        await screenshot(s, url)
        return t1 - t0, time.perf_counter() - t1

    async def body() -> None:
        lat = LatencyConfig("fixed", 50, slow_env=1, slow_factor=3)
        cfgs = [SimConfig(port=0, latency=lat, index=i) for i in range(2)]
        async with running(cfgs) as urls, aiohttp.ClientSession() as s:
            ex0, shot0 = await timed(s, urls[0])
            ex1, shot1 = await timed(s, urls[1])
            assert ex0 >= 0.05 and shot0 >= 0.05
            assert ex1 >= 0.15 and shot1 >= 0.15

    run(body())
    with pytest.raises(ValueError, match="lognormal"):
        LatencyConfig.parse("gamma:3")
    ln = LatencyConfig.parse("lognormal:40,0.5").sampler(0)
    draws = sorted(ln.seconds() for _ in range(2001))
    assert 0.03 < draws[1000] < 0.05  # median about 40 ms


def test_png_encoder_matches_pixels_through_partial_updates() -> None:
    rng = random.Random(0)
    enc = BandPngEncoder(band_rows=7)
    img = Image.new("RGB", (203, 101), (10, 20, 30))
    d = ImageDraw.Draw(img)
    for i in range(12):
        x, y = rng.randrange(190), rng.randrange(90)
        d.rectangle(
            (x, y, x + rng.randrange(1, 40), y + rng.randrange(1, 12)),
            fill=tuple(rng.randrange(256) for _ in range(3)),
        )
        back = Image.open(io.BytesIO(enc.encode(img)))
        back.load()
        assert back.tobytes() == img.tobytes()
        assert i == 0 or enc.bands_compressed <= 3  # only the touched bands
    a, b = os.urandom(5000), os.urandom(70000)
    assert adler32_combine(zlib.adler32(a), zlib.adler32(b), len(b)) == zlib.adler32(a + b)


def test_cli_starts_several_desktops_and_stops_on_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "arpo_envs.cli", "sim", "-n", "3", "--base-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        urls = []
        deadline = time.monotonic() + 20
        while len(urls) < 3 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("env "):
                urls.append(line.split()[2])
        assert len(urls) == 3, proc.stderr.read() if proc.poll() is not None else urls

        async def body() -> None:
            async with aiohttp.ClientSession() as s:
                for url in urls:
                    assert await (await s.get(f"{url}/platform")).text() == "Linux"

        run(body())
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err
        assert "stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    bad = subprocess.run(
        [sys.executable, "-m", "arpo_envs.cli", "sim", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=20,
        env={k: v for k, v in os.environ.items() if k != "ARPO_ENV_TOKEN"},
    )
    assert bad.returncode == 2 and "without a token" in bad.stderr

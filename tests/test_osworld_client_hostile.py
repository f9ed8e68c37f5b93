"""The OSWorld worker's client trusts no line it reads.

A stand-in worker (a real subprocess speaking the worker's line protocol, started by the real
client in place of the evaluator environment's python) answers `hello` properly and then
misbehaves once: a reply that is JSON but not an object, a line longer than the reader's
limit, a deeply nested reply, a flood of stderr, an unsolicited extra line, a hang with a
grandchild in its own session. Each is an `OSWorldError` of kind "worker" with the reason and
the request named, the worker is replaced, and the next request is served by a fresh one.
Before: AttributeError, ValueError ("Separator is not found"), RecursionError, a ValueError on
close, and an extra line taken as the answer to the next request.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from arpo.env.osworld import client as C

FAKE = r"""#!{python}
import json, os, subprocess, sys, time
once = os.environ["FAKE_ONCE"]
mode = os.environ["FAKE_MODE"]
def send(obj):
    sys.stdout.write(json.dumps(obj) + "\n"); sys.stdout.flush()
for line in sys.stdin:
    req = json.loads(line)
    if req["op"] == "hello":
        send({{"id": req["id"], "ok": True, "result": {{"package": "fake", "version": "0"}}}})
        if mode == "extra" and os.path.exists(once):
            os.remove(once)
            send({{"id": req["id"], "ok": True, "result": {{"score": 1.0}}}})
        continue
    if not os.path.exists(once):
        send({{"id": req["id"], "ok": True, "result": {{"score": 0.25}}}})
        continue
    os.remove(once)
    if mode == "list":
        send([1, 2, 3])
    elif mode == "long":
        sys.stdout.write("x" * (2 << 20) + "\n"); sys.stdout.flush()
    elif mode == "nested":
        sys.stdout.write("[" * 200000 + "]" * 200000 + "\n"); sys.stdout.flush()
    elif mode == "stderr":
        sys.stderr.write("e" * (8 << 20)); sys.stderr.flush()
        send({{"id": req["id"], "ok": True, "result": {{"score": 0.5}}}})
    elif mode == "hang":
        subprocess.Popen(["setsid", "sleep", "1000"])
        time.sleep(1000)
"""


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    exe = tmp_path / "fake-python"
    exe.write_text(FAKE.format(python=sys.executable))
    exe.chmod(0o755)
    once = tmp_path / "once"
    monkeypatch.setenv("FAKE_ONCE", str(once))
    monkeypatch.setattr(C, "MAX_REPLY_BYTES", 1 << 20)

    def make(mode: str) -> C.OSWorldEvaluator:
        monkeypatch.setenv("FAKE_MODE", mode)
        once.write_text("1")
        return C.OSWorldEvaluator(C.EvaluatorConfig(python=exe, request_timeout_s=3.0))

    return make


TASK = {"id": "task-7", "config": [], "evaluator": {"func": "exact_match"}}


async def _evaluate(ev: C.OSWorldEvaluator) -> float:
    return await ev.evaluate({"host": "127.0.0.1"}, TASK, "/tmp", [])


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("list", "instead of a reply to evaluate of task task-7"),
        ("long", "longer than 1048576 bytes"),
        ("nested", "instead of a reply"),
        ("hang", "gave no answer to evaluate of task task-7 within 3 s"),
    ],
)
def test_a_bad_reply_is_a_worker_error_and_a_fresh_worker_serves_next(fake, mode, reason) -> None:
    async def go() -> None:
        ev = fake(mode)
        try:
            with pytest.raises(C.OSWorldError, match=reason) as e:
                await _evaluate(ev)
            assert e.value.kind == "worker"
            assert await _evaluate(ev) == 0.25
            assert ev.starts == 2
        finally:
            await ev.aclose()

    asyncio.run(go())


def test_a_reply_nobody_asked_for_never_answers_the_next_request(fake) -> None:
    async def go() -> None:
        ev = fake("extra")
        try:
            # The worker answered its start-up hello, then wrote one more line (a score of
            # 1.0 with that id): the next request reads it first and must refuse it.
            with pytest.raises(C.OSWorldError, match="nobody asked for") as e:
                await _evaluate(ev)
            assert e.value.kind == "worker"
            assert await _evaluate(ev) == 0.25
        finally:
            await ev.aclose()

    asyncio.run(go())


def test_a_stderr_flood_neither_blocks_nor_breaks_the_close(fake) -> None:
    async def go() -> None:
        ev = fake("stderr")
        try:
            assert await _evaluate(ev) == 0.5
        finally:
            await ev.aclose()

    asyncio.run(go())


def test_a_killed_worker_leaves_no_grandchild_and_no_folder(fake) -> None:
    async def go() -> None:
        ev = fake("hang")
        await ev.hello()
        (worker,) = ev._all
        marker, cwd = worker.marker, Path(worker._cwd)
        assert cwd.is_dir()
        with pytest.raises(C.OSWorldError):
            await _evaluate(ev)
        await ev.aclose()
        end = time.monotonic() + 10
        while C._marked(marker) and time.monotonic() < end:
            await asyncio.sleep(0.1)
        assert C._marked(marker) == [], "a process of the killed worker survived"
        assert not cwd.exists()

    asyncio.run(go())
    assert os.path.exists("/proc/self")

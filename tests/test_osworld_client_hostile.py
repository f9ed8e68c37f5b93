"""The OSWorld worker's client trusts no line it reads.

A stand-in worker (a real subprocess speaking the worker's line protocol, started by the real
client in place of the evaluator environment's python) answers `hello` properly and then
misbehaves once: a reply that is JSON but not an object, a line longer than the reader's
limit, a deeply nested reply, a flood of stderr, an unsolicited extra line, a hang with a
grandchild in its own session, a score that is not a number in [0, 1] (400 digits, `true`,
NaN, 1.5, a string, ...), a `hello` that is not an object. Each is an `OSWorldError` of kind
"worker" with the reason and the request named, the worker is replaced, and the next request
is served by a fresh one. A failure reply with an error of 600 KB is kept to MAX_ERROR_CHARS.
Before: AttributeError, ValueError ("Separator is not found"), RecursionError, a ValueError on
close, an extra line taken as the answer to the next request, a bare OverflowError for 400
digits, `true` scored 1.0 and 1.5 scored 1.5, a TypeError from `hello`, a reply of up to 64 MiB
read and a worker's error of any length carried in the message.

`worker._score` (the worker's own check of what OSWorld's metric returned) is tested on the
values OSWorld's metrics return (floats, ints 0 / 1, numpy numbers) and on those it must refuse.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from arpo.env.osworld import client as C
from arpo.env.osworld import worker as W

FAKE = r"""#!{python}
import json, os, subprocess, sys, time
once = os.environ["FAKE_ONCE"]
mode = os.environ["FAKE_MODE"]
def send(obj):
    sys.stdout.write(json.dumps(obj) + "\n"); sys.stdout.flush()
hellos = 0
for line in sys.stdin:
    req = json.loads(line)
    if req["op"] == "hello":
        hellos += 1
        if mode == "hello" and hellos == 2 and os.path.exists(once):
            os.remove(once)
            send({{"id": req["id"], "ok": True, "result": [1, 2, 3]}})
            continue
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
    elif mode == "score":  # FAKE_SCORE is written as it is: any JSON text
        sys.stdout.write('{{"id": %s, "ok": true, "result": {{"score": %s}}}}\n'
                         % (json.dumps(req["id"]), os.environ["FAKE_SCORE"]))
        sys.stdout.flush()
    elif mode == "padded":  # a well-formed reply of 2 MiB
        send({{"id": req["id"], "ok": True, "result": {{"score": 0.5, "pad": "x" * (2 << 20)}}}})
    elif mode == "error-flood":  # a well-formed failure whose error is 600 KB
        send({{"id": req["id"], "ok": False, "kind": "eval", "error": "E" * (600 << 10)}})
"""


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    exe = tmp_path / "fake-python"
    exe.write_text(FAKE.format(python=sys.executable))
    exe.chmod(0o755)
    once = tmp_path / "once"
    monkeypatch.setenv("FAKE_ONCE", str(once))

    def make(mode: str, score: str = "") -> C.OSWorldEvaluator:
        monkeypatch.setenv("FAKE_MODE", mode)
        monkeypatch.setenv("FAKE_SCORE", score)
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
        ("padded", "longer than 1048576 bytes"),
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


@pytest.mark.parametrize(
    ("score", "reason"),
    [
        pytest.param(
            "1" + "0" * 400, r"the score 1000.*, not a number in \[0, 1\]", id="400-digits"
        ),
        pytest.param("-" + "9" * 400, r"not a number in \[0, 1\]", id="minus-400-digits"),
        ("true", r"\{'score': True\}, not a score"),
        ("false", "not a score"),
        ("NaN", r"the score nan, not a number in \[0, 1\]"),
        ("Infinity", "the score inf"),
        ("1e400", "the score inf"),
        ("1.5", r"the score 1.5, not a number in \[0, 1\]"),
        ("2", "the score 2, not"),
        ("-0.25", "the score -0.25, not"),
        ('"0.5"', "not a score"),
        ("null", "not a score"),
        ("[0.5]", "not a score"),
        ('{"value": 1}', "not a score"),
    ],
)
def test_a_score_that_is_not_a_number_in_0_1_is_refused_and_the_worker_replaced(
    fake, score: str, reason: str
) -> None:
    async def go() -> None:
        ev = fake("score", score)
        try:
            with pytest.raises(C.OSWorldError, match=reason) as e:
                await ev.metric("exact_match", ["a", {"expected": "a"}])
            assert e.value.kind == "worker"
            assert ev.worker_pids() == []  # killed at once, not left to serve the next request
            assert await _evaluate(ev) == 0.25
            assert ev.starts == 2 and ev.restarts == 1
        finally:
            await ev.aclose()

    asyncio.run(go())


@pytest.mark.parametrize(("score", "want"), [("0", 0.0), ("1", 1.0), ("0.5", 0.5), ("-0.0", 0.0)])
def test_an_int_or_float_score_in_0_1_is_kept(fake, score: str, want: float) -> None:
    """Many of OSWorld's metrics return the ints 0 and 1: they are scores."""

    async def go() -> None:
        ev = fake("score", score)
        try:
            got = await _evaluate(ev)
            assert got == want and type(got) is float
            assert await _evaluate(ev) == 0.25
            assert ev.starts == 1
        finally:
            await ev.aclose()

    asyncio.run(go())


def test_a_worker_error_of_600_kb_is_cut_and_the_worker_kept(fake) -> None:
    async def go() -> None:
        ev = fake("error-flood")
        try:
            with pytest.raises(C.OSWorldError) as e:
                await _evaluate(ev)
            assert e.value.kind == "eval"  # a well-formed failure: OSWorld's, not the worker's
            assert str(e.value) == "E" * C.MAX_ERROR_CHARS
            assert await _evaluate(ev) == 0.25
            assert ev.starts == 1
        finally:
            await ev.aclose()

    asyncio.run(go())


def test_a_hello_that_is_not_an_object_is_a_worker_error(fake) -> None:
    async def go() -> None:
        ev = fake("hello")
        try:
            with pytest.raises(C.OSWorldError, match=r"answered hello with \[1, 2, 3\]") as e:
                await ev.hello()
            assert e.value.kind == "worker"
            assert (await ev.hello())["package"] == "fake"
            assert ev.starts == 2
        finally:
            await ev.aclose()

    asyncio.run(go())


@pytest.mark.parametrize(
    "value",
    [
        0,
        1,
        0.0,
        1.0,
        0.5,
        np.float64(0.25),
        np.float32(0.5),
        np.int64(1),
        np.int8(0),
        Fraction(1, 3),
    ],
)
def test_the_worker_keeps_what_osworlds_metrics_return(value) -> None:
    got = W._score(value)
    assert type(got) is float and got == float(value)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (True, "not a number"),
        (False, "not a number"),
        (np.bool_(True), "not a number"),
        ("1", "not a number"),
        (None, "not a number"),
        ([1.0], "not a number"),
        pytest.param(10**400, "too large for a float", id="int-400-digits"),
        pytest.param(10**5000, "too large for a float", id="int-5000-digits"),
        (math.nan, "nan, not a score in"),
        (math.inf, "inf, not a score in"),
        (1.5, r"1.5, not a score in \[0, 1\]"),
        (-0.1, "-0.1, not a score"),
        (np.float64(1.0000001), "not a score"),
        (2, "2.0, not a score"),
    ],
)
def test_the_worker_refuses_a_metric_result_that_is_no_score(value, reason: str) -> None:
    # The worker's request loop turns these into an "eval" failure with the reason.
    with pytest.raises((TypeError, ValueError), match=reason):
        W._score(value)

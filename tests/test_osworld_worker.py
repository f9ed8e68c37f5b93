"""OSWorld's evaluator worker: its names, its failures (hang, death) and the task runner using it
against a loopback OSWorld-protocol peer with evaluator="osworld" / "auto"."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest
from arpo_envs.tasks.xlsx_writer import write_xlsx
from osworld_fixtures.evaluator import LoopThread, needs_evaluator
from osworld_fixtures.peer import Peer

from arpo.env.client import ClientConfig, EnvClient
from arpo.env.osworld import names
from arpo.env.osworld.client import EvaluatorConfig, OSWorldError, OSWorldEvaluator
from arpo.env.runner import RunnerConfig, TaskRunner
from arpo.env.task import Task
from arpo.errors import EnvError

pytestmark = needs_evaluator
URL = "https://huggingface.co/datasets/xlangai/ubuntu_osworld_file_cache/resolve/main/calc/{}"


@pytest.fixture(scope="module")
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


def test_names_match_the_installed_package(loop):
    async def main():
        ev = OSWorldEvaluator()
        try:
            return await ev.hello()
        finally:
            await ev.aclose()

    hello = loop.run(main())
    assert hello["version"] == names.VERSION
    assert set(hello["metrics"]) == names.METRICS
    assert set(hello["getters"]) == names.GETTERS
    assert set(hello["steps"]) == names.STEPS


def test_hung_or_dead_worker_is_a_worker_error_then_a_fresh_one_serves(loop):
    ok = ["a", {"expected": "a"}]

    async def main():
        ev = OSWorldEvaluator(EvaluatorConfig(request_timeout_s=2))
        try:
            assert await ev.metric("exact_match", ok) == 1.0
            (pid,) = ev.worker_pids()
            os.kill(pid, signal.SIGSTOP)  # hangs: no answer within the timeout
            t0 = time.perf_counter()
            with pytest.raises(OSWorldError, match=r"no answer.*killed") as e:
                await ev.metric("exact_match", ok)
            assert e.value.kind == "worker" and time.perf_counter() - t0 < 10
            assert await ev.metric("exact_match", ok) == 1.0  # a new worker
            (pid2,) = ev.worker_pids()
            assert pid2 != pid
            os.kill(pid2, signal.SIGKILL)
            with pytest.raises(OSWorldError, match="died") as e:
                await ev.metric("exact_match", ok)
            assert e.value.kind == "worker"
            assert await ev.metric("exact_match", ["a", {"expected": "b"}]) == 0.0
            assert ev.restarts == 2
            with pytest.raises(OSWorldError, match="no metric") as e:
                await ev.metric("no_such_metric", [])
            assert e.value.kind == "request"
            with pytest.raises(OSWorldError, match="KeyError") as e:
                await ev.metric("exact_match", ["a", {}])  # OSWorld's code raised
            assert e.value.kind == "eval"
        finally:
            await ev.aclose()

    loop.run(main())


def test_missing_environment_is_a_clear_error(loop):
    ev = OSWorldEvaluator(EvaluatorConfig(python="/nonexistent/bin/python"))
    assert not ev.available
    with pytest.raises(OSWorldError, match="make osworld-evaluator"):
        loop.run(ev.hello())
    with pytest.raises(ValueError, match="make osworld-evaluator"):
        RunnerConfig(evaluator="osworld", osworld_python="/nonexistent/bin/python")


def _calc_task(tid="osw-1"):
    raw = {
        "id": tid,
        "instruction": "x",
        "config": [
            {
                "type": "download",
                "parameters": {
                    "files": [{"url": URL.format("a.xlsx"), "path": "/home/user/a.xlsx"}]
                },
            },
            {
                "type": "execute",
                "parameters": {"command": ["echo", "{SCREEN_WIDTH}x{SCREEN_HEIGHT}"]},
            },
        ],
        "evaluator": {
            "func": ["compare_table", "exact_match"],
            "result": [
                {"type": "vm_file", "path": "/home/user/a.xlsx", "dest": "a.xlsx"},
                {"type": "vm_command_line", "command": ["echo", "hi"]},
            ],
            "expected": [
                {"type": "cloud_file", "path": URL.format("gold.xlsx"), "dest": "gold.xlsx"},
                {"type": "rule", "rules": {"expected": "hi\n"}},
            ],
            "options": [
                {"rules": [{"type": "sheet_data", "sheet_idx0": 0, "sheet_idx1": "EI0"}]},
                {},
            ],
        },
    }
    return Task.from_dict(json.loads(json.dumps(raw)), domain="libreoffice_calc")


def test_runner_sets_up_and_scores_through_the_worker_as_its_own_code_does(loop, tmp_path):
    cache = tmp_path / "cache"
    (cache / "calc").mkdir(parents=True)
    rows = [["name", "n"], ["a", 1], ["b", 2.5]]
    write_xlsx(cache / "calc" / "a.xlsx", {"Sheet1": rows})
    write_xlsx(cache / "calc" / "gold.xlsx", {"Sheet1": rows})
    wrong = tmp_path / "wrong.xlsx"
    write_xlsx(wrong, {"Sheet1": [["name", "n"], ["a", 1], ["b", 2.6]]})
    task = _calc_task()

    async def main(evaluator):
        peer = await Peer().start()
        client = EnvClient(ClientConfig(base_url=peer.url, max_retries=0))
        runner = TaskRunner(client, RunnerConfig(cache_dir=cache, evaluator=evaluator))
        try:
            assert runner.backend(task) == ("own" if evaluator != "osworld" else "osworld")
            await runner.setup(task)
            assert peer.files["/home/user/a.xlsx"] == (cache / "calc" / "a.xlsx").read_bytes()
            assert any("1920x1080" in json.dumps(b) for b in peer.recorded("/setup/execute"))
            good = await runner.evaluate(task, ["DONE"])
            gave_up = await runner.evaluate(task, ["FAIL"])
            peer.files["/home/user/a.xlsx"] = wrong.read_bytes()  # near miss: one cell
            near = await runner.evaluate(task, ["DONE"])
            del peer.files["/home/user/a.xlsx"]  # the agent lost the file
            gone = await runner.evaluate(task, ["DONE"])
            return [(r.status, r.score) for r in (good, gave_up, near, gone)]
        finally:
            await runner.aclose()
            await client.close()
            await peer.stop()

    expected = [("ok", 1.0), ("ok", 0.0), ("ok", 0.0), ("ok", 0.0)]
    assert loop.run(main("osworld")) == expected
    assert loop.run(main("own")) == expected


# Slow (21 s): the worker itself runs in the other tests of this file.
@pytest.mark.slow
def test_runner_worker_failures_are_eval_errors_with_the_reason(loop, tmp_path):
    cache = tmp_path / "cache"
    (cache / "calc").mkdir(parents=True)
    write_xlsx(cache / "calc" / "a.xlsx", {"S": [[1]]})
    write_xlsx(cache / "calc" / "gold.xlsx", {"S": [[1]]})
    task = _calc_task()
    pptx = Task.from_dict(
        {
            "id": "osw-2",
            "instruction": "x",
            "evaluator": {
                "func": "compare_pptx_files",
                "result": {"type": "vm_file", "path": "/home/user/a.pptx", "dest": "a.pptx"},
                "expected": {"type": "rule", "rules": {}},
            },
        }
    )

    async def main():
        peer = await Peer().start()
        client = EnvClient(ClientConfig(base_url=peer.url, max_retries=0))
        cfg = RunnerConfig(cache_dir=cache, evaluator="osworld", osworld_timeout_s=3)
        runner = TaskRunner(client, cfg)
        auto = TaskRunner(client, RunnerConfig(cache_dir=cache), osworld=runner.osworld)
        try:
            await runner.setup(task)
            peer.delay["/file"] = 6  # the getter hangs: the worker is killed at 3 s
            slow = await runner.evaluate(task, ["DONE"])
            peer.delay.clear()
            after = await runner.evaluate(task, ["DONE"])
            assert auto.backend(pptx) == "osworld"  # the project has no compare_pptx_files
            missing = await auto.evaluate(pptx, ["DONE"])
            return slow, after, missing
        finally:
            await runner.aclose()
            await client.close()
            await peer.stop()

    slow, after, missing = loop.run(main())
    assert (slow.status, slow.score) == ("eval_error", 0.0)
    assert "no answer" in slow.error and "3 s" in slow.error
    assert (after.status, after.score) == ("ok", 1.0)
    # OSWorld's compare_pptx_files raises on a file the agent never saved (None): that is the
    # checker failing, an eval_error with OSWorld's exception, not a score of 0.
    assert (missing.status, missing.score) == ("eval_error", 0.0)
    assert missing.error.startswith("OSWorld's evaluator (eval): ")


def test_unrunnable_task_is_a_task_error_naming_both_sides():
    sim = Task.from_dict(
        {
            "id": "s",
            "instruction": "x",
            "config": [{"type": "sim_scene", "parameters": {"family": "calc"}}],
            "evaluator": {"func": "check_play_and_exit", "result": {"type": "rule", "rules": {}}},
        }
    )
    from arpo.env.runner import unsupported

    gaps = unsupported(sim, "auto")
    assert "metric check_play_and_exit" in gaps
    assert "osworld: config step sim_scene" in gaps

    async def main():
        async with EnvClient(ClientConfig(base_url="http://127.0.0.1:9", max_retries=0)) as c:
            runner = TaskRunner(c, RunnerConfig())
            try:
                await runner.setup(sim)
            finally:
                await runner.aclose()

    with pytest.raises(Exception, match=r"check_play_and_exit.*OSWorld's evaluator"):
        asyncio.run(main())


def test_unreachable_environment_is_an_env_error_within_the_probe_timeout(loop, tmp_path):
    """OSWorld's setup controller retries a server that does not answer for ~100 s; the runner
    checks `GET /platform` first and reports env_error within `osworld_probe_timeout_s`."""
    cache = tmp_path / "cache"
    (cache / "calc").mkdir(parents=True)
    write_xlsx(cache / "calc" / "a.xlsx", {"S": [[1]]})
    write_xlsx(cache / "calc" / "gold.xlsx", {"S": [[1]]})
    task = _calc_task()

    async def main():
        peer = await Peer().start()
        client = EnvClient(ClientConfig(base_url=peer.url, max_retries=0))
        cfg = RunnerConfig(cache_dir=cache, evaluator="osworld", osworld_probe_timeout_s=1)
        runner = TaskRunner(client, cfg)
        try:
            await runner.setup(task)
            assert (await runner.evaluate(task, ["DONE"])).status == "ok"
            requests = runner.osworld.requests
            peer.delay["/platform"] = 4  # the server hangs (longer than the probe)
            t0 = time.perf_counter()
            hung = await runner.evaluate(task, ["DONE"])
            hung_s = time.perf_counter() - t0
            with pytest.raises(EnvError, match=r"GET /platform within 1 s"):
                await runner.setup(task)
            peer.delay.clear()
            await peer.stop()  # the server is gone: connection refused
            t0 = time.perf_counter()
            gone = await runner.evaluate(task, ["DONE"])
            gone_s = time.perf_counter() - t0
            with pytest.raises(EnvError):
                await runner.setup(task)
            return hung, hung_s, gone, gone_s, runner.osworld.requests - requests
        finally:
            await runner.aclose()
            await client.close()
            await peer.stop()

    hung, hung_s, gone, gone_s, asked = loop.run(main())
    assert (hung.status, hung.score) == ("env_error", 0.0) and hung_s < 5
    assert "osworld_probe_timeout_s" in hung.error
    assert (gone.status, gone.score) == ("env_error", 0.0) and gone_s < 5
    assert asked == 0  # the worker was never asked to reach an environment that is not there


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_without_the_probe_osworld_waits_for_an_unreachable_server_then_env_error(loop):
    """What the probe saves: OSWorld's setup controller tries a server that does not answer 20
    times, 5 s apart, before giving up; the worker then reports the environment's failure (not
    a score from getters that saw nothing)."""
    task = Task.from_dict(
        {
            "id": "osw-gone",
            "instruction": "x",
            "evaluator": {
                "func": "exact_match",
                "result": {"type": "vm_command_line", "command": ["echo", "hi"]},
                "expected": {"type": "rule", "rules": {"expected": "hi\n"}},
            },
        }
    )

    async def main():
        peer = await Peer().start()
        url = peer.url
        await peer.stop()
        client = EnvClient(ClientConfig(base_url=url, max_retries=0))
        runner = TaskRunner(client, RunnerConfig(evaluator="osworld", osworld_probe_timeout_s=0))
        try:
            t0 = time.perf_counter()
            res = await runner.evaluate(task, ["DONE"])
            return res, time.perf_counter() - t0
        finally:
            await runner.aclose()
            await client.close()

    res, seconds = loop.run(main(), timeout=500)
    assert (res.status, res.score) == ("env_error", 0.0), res
    assert "could not reach" in res.error
    assert 90 < seconds < 400, seconds

"""The task runner against a loopback OSWorld-protocol peer: setup steps, actions, evaluation."""

from __future__ import annotations

import asyncio
import json

import pytest
from arpo_envs.tasks.xlsx_writer import write_xlsx
from osworld_fixtures.peer import Peer

from arpo.env.client import ClientConfig, EnvClient
from arpo.env.environment import Environment
from arpo.env.runner import RunnerConfig, TaskRunner
from arpo.env.task import Task
from arpo.errors import FileCacheMiss, TaskError

URL = "https://huggingface.co/datasets/xlangai/ubuntu_osworld_file_cache/resolve/main/libreoffice_calc/t1/{}"


def task(config=(), evaluator=None, tid="t1"):
    return Task.from_dict(
        {
            "id": tid,
            "instruction": "x",
            "config": list(config),
            "evaluator": evaluator or {"func": "infeasible"},
        },
        domain="libreoffice_calc",
    )


async def with_runner(body, tmp_path, *, peer=None, **cfg):
    peer = await (peer or Peer()).start()
    client = EnvClient(ClientConfig(base_url=peer.url, backoff_initial_s=0.01, max_retries=1))
    runner = TaskRunner(
        client, RunnerConfig(**{"cache_dir": tmp_path / "cache", "until_poll_s": 0.01, **cfg})
    )
    try:
        return await body(runner, peer)
    finally:
        runner.close()
        await client.close()
        await peer.stop()


async def with_env(body, tmp_path, **cfg):
    """`body(env, peer)` on an Environment of a loopback peer (its runner configured by `cfg`)."""
    peer = await Peer().start()
    env = Environment(
        0, peer.url, RunnerConfig(**{"cache_dir": tmp_path / "cache", "until_poll_s": 0.01, **cfg})
    )
    try:
        return await body(env, peer)
    finally:
        await env.close()
        await peer.stop()


def test_unknown_step_raises_task_error_naming_it_before_anything_runs(tmp_path):
    t = task(
        [
            {"type": "launch", "parameters": {"command": ["gedit"]}},
            {"type": "chrome_open_tabs", "parameters": {"urls_to_open": ["https://x"]}},
        ]
    )

    async def body(runner, peer):
        with pytest.raises(TaskError, match=r"config\[1\].*'chrome_open_tabs'"):
            await runner.setup(t)
        assert peer.calls == []
        bad_params = task([{"type": "sleep", "parameters": {"second": 1}}])
        with pytest.raises(TaskError, match=r"sleep.*bad parameters"):
            await runner.setup(bad_params)

    asyncio.run(with_runner(body, tmp_path, evaluator="own"))

    async def reverted(env, peer):  # an environment checks the task before it reverts
        with pytest.raises(TaskError, match=r"config\[1\].*'chrome_open_tabs'"):
            await env.reset(t)
        assert peer.calls == []

    asyncio.run(with_env(reverted, tmp_path, evaluator="own", reset_before_setup=True))


def test_placeholders_are_substituted_in_execute_and_command(tmp_path):
    code = "import pyautogui; pyautogui.click({SCREEN_WIDTH_HALF}, {SCREEN_HEIGHT_HALF}); # {SCREEN_WIDTH}x{SCREEN_HEIGHT}"
    t = task(
        [
            {"type": "execute", "parameters": {"command": ["python", "-c", code]}},
            {
                "type": "command",
                "parameters": {
                    "command": "echo {CLIENT_PASSWORD} {SCREEN_WIDTH}",
                    "shell": True,
                    "stdout": "out.txt",
                },
            },
        ]
    )

    async def body(runner, peer):
        await runner.setup(t)
        first, second = peer.recorded("/setup/execute")
        assert first["command"][2] == "import pyautogui; pyautogui.click(960, 540); # 1920x1080"
        assert second == {
            "command": "echo pw {SCREEN_WIDTH}".replace("{SCREEN_WIDTH}", "1920"),
            "shell": True,
        }
        assert (runner.work_dir / "out.txt").read_text() == "pw 1920\n"

    asyncio.run(with_runner(body, tmp_path, client_password="pw"))

    async def body_configured(runner, peer):
        assert await runner.substitute(["{SCREEN_WIDTH_HALF}x{SCREEN_HEIGHT}"]) == ["640x720"]
        assert peer.counts.get("/screen_size") is None  # configured size: no query

    asyncio.run(with_runner(body_configured, tmp_path, screen_width=1280, screen_height=720))


def test_execute_until_polls_as_osworld(tmp_path):
    counter = tmp_path / "n"
    script = (
        f"n=$(cat {counter} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {counter}; echo tick-$n"
    )
    t = task(
        [
            {
                "type": "execute",
                "parameters": {"command": script, "shell": True, "until": {"stdout": "tick-3"}},
            }
        ]
    )

    async def body(runner, peer):
        await runner.setup(t)
        assert peer.counts["/setup/execute"] == 3

    asyncio.run(with_runner(body, tmp_path))


def test_download_comes_from_the_local_cache(tmp_path):
    cache = tmp_path / "cache"
    (cache / "libreoffice_calc" / "t1").mkdir(parents=True)
    (cache / "libreoffice_calc" / "t1" / "a.xlsx").write_bytes(b"by-layout")
    (cache / "elsewhere.bin").write_bytes(b"by-index")
    (cache / "index.json").write_text(json.dumps({URL.format("b.xlsx"): "elsewhere.bin"}))
    t = task(
        [
            {
                "type": "download",
                "parameters": {
                    "files": [
                        {"url": URL.format("a.xlsx"), "path": "/home/user/a.xlsx"},
                        {"url": URL.format("b.xlsx"), "path": "/home/user/b.xlsx"},
                    ]
                },
            },
            {"type": "open", "parameters": {"path": "/home/user/a.xlsx"}},
            {"type": "activate_window", "parameters": {"window_name": "a.xlsx", "strict": True}},
            {"type": "close_window", "parameters": {"window_name": "gone"}},
            {"type": "sleep", "parameters": {"seconds": 100}},
        ]
    )
    missing = task(
        [
            {
                "type": "download",
                "parameters": {
                    "files": [{"url": URL.format("c.xlsx"), "path": "/home/user/c.xlsx"}]
                },
            }
        ]
    )

    async def body(runner, peer):
        await runner.setup(t)  # the 100 s sleep is scaled to 0
        assert peer.files == {"/home/user/a.xlsx": b"by-layout", "/home/user/b.xlsx": b"by-index"}
        assert peer.recorded("/setup/open_file") == ["/home/user/a.xlsx"]
        with pytest.raises(FileCacheMiss, match=r"c\.xlsx.*index\.json"):
            await runner.setup(missing)
        result = await runner.run(missing, ["DONE"])
        assert result.status == "env_error" and "c.xlsx" in result.error

    asyncio.run(with_runner(body, tmp_path, sleep_scale=0.0))


def test_actions_and_sim_scene_and_reset(tmp_path):
    t = task([{"type": "sim_scene", "parameters": {"family": "calc", "seed": 7, "rows": 3}}])

    async def body(env, peer):
        await env.reset(t)  # the desktop's /reset, then the task's steps
        scene = {"family": "calc", "seed": 7, "rows": 3}
        assert [c for c in peer.calls if c[0] in ("/reset", "/sim/scene")] == [
            ("/reset", {}),
            ("/sim/scene", scene),
        ]
        runner = env.runner
        await runner.setup(t)  # the runner alone runs the steps and reverts nothing
        assert peer.recorded("/reset") == [{}]
        assert peer.recorded("/sim/scene") == [scene, scene]
        res = await runner.act("pyautogui.typewrite('hi')")
        assert res is not None and res.returncode == 0
        assert await runner.act("WAIT") is None
        assert await runner.act("DONE") is None
        assert runner.history == ["pyautogui.typewrite('hi')", "WAIT", "DONE"]
        assert len(peer.recorded("/execute")) == 1

    asyncio.run(with_env(body, tmp_path, reset_before_setup=True, wait_seconds=0.0))


def test_evaluate_vm_file_against_cloud_file_with_compare_table(tmp_path):
    cache = tmp_path / "cache"
    (cache / "libreoffice_calc" / "t1").mkdir(parents=True)
    rows = [["Name", "Score"], ["ann", 3], ["bob", 4]]
    write_xlsx(cache / "libreoffice_calc" / "t1" / "gold.xlsx", {"Sheet1": rows})
    evaluator = {
        "postconfig": [
            {
                "type": "activate_window",
                "parameters": {"window_name": "a.xlsx - LibreOffice Calc", "strict": True},
            },
            {
                "type": "execute",
                "parameters": {
                    "command": ["python", "-c", 'import pyautogui; pyautogui.hotkey("ctrl", "s");']
                },
            },
        ],
        "func": "compare_table",
        "result": {"type": "vm_file", "path": "/home/user/a.xlsx", "dest": "a.xlsx"},
        "expected": {"type": "cloud_file", "path": URL.format("gold.xlsx"), "dest": "gold.xlsx"},
        "options": {"rules": [{"type": "sheet_data", "sheet_idx0": 0, "sheet_idx1": "EI0"}]},
    }
    t = task(evaluator=evaluator)

    async def body(runner, peer):
        await runner.setup(t)
        r = await runner.evaluate()
        assert (r.score, r.status) == (0.0, "ok")  # the agent never saved the file: a real 0
        write_xlsx(tmp_path / "agent.xlsx", {"Sheet1": rows})
        peer.files["/home/user/a.xlsx"] = (tmp_path / "agent.xlsx").read_bytes()
        r = await runner.evaluate()
        assert (r.score, r.status, r.metric_scores) == (1.0, "ok", (1.0,))
        peer.fail["/file"] = (500, "disk on fire")
        r = await runner.evaluate()
        assert r.status == "env_error" and "disk on fire" in r.error

    asyncio.run(with_runner(body, tmp_path))


def test_evaluate_command_line_and_sim_state_getters(tmp_path):
    t = task(
        [{"type": "sim_scene", "parameters": {"family": "calc", "seed": 1}}],
        {
            "func": ["exact_match", "check_include_exclude", "exact_match"],
            "result": [
                {"type": "sim_state", "path": "cell.A1"},
                {"type": "vm_command_line", "command": ["uname", "-s"]},
                {"type": "vm_command_line", "command": ["no-such-binary-here"]},
            ],
            "expected": [
                {"type": "rule", "rules": {"expected": 7}},
                {"type": "rule", "rules": {"include": ["Linux"]}},
                {"type": "rule", "rules": {"expected": None}},
            ],
        },
    )

    async def body(runner, peer):
        r = await runner.run(t, ["pyautogui.click(1, 1)", "DONE", "pyautogui.click(2, 2)"])
        assert (r.score, r.status, r.metric_scores) == (1.0, "ok", (1.0, 1.0, 1.0))
        assert len(peer.recorded("/execute")) == 3  # one action (stopped at DONE), two getters

    asyncio.run(with_runner(body, tmp_path))


def test_getter_transport_failure_is_env_error(tmp_path):
    t = task(
        evaluator={
            "func": "exact_match",
            "result": {"type": "sim_state", "path": "x"},
            "expected": {"type": "rule", "rules": {"expected": 1}},
        }
    )

    async def body(runner, peer):
        await runner.setup(t)
        await peer.stop()
        r = await runner.evaluate()
        assert (r.status, r.score) == ("env_error", 0.0)
        assert "EnvTransportError" in r.error

    asyncio.run(with_runner(body, tmp_path))


def test_actions_of_one_response_are_paused_on_desktops_and_not_on_simulated_ones(tmp_path):
    """`between_actions` waits `action_pause_s` times `sleep_scale`: the desktops the actor and
    the bring-up drive get UI-TARS's 1 s, a simulated desktop (sleep_scale 0) none."""
    import time

    from arpo.actor.config import ActorConfig
    from arpo.env.bringup import EnvSpec
    from arpo.env.runner import DESKTOP_ACTION_PAUSE_S

    async def body(env, peer):
        t0 = time.perf_counter()
        await env.runner.between_actions()
        return time.perf_counter() - t0

    assert asyncio.run(with_env(body, tmp_path, action_pause_s=0.3)) >= 0.3
    assert asyncio.run(with_env(body, tmp_path, action_pause_s=30.0, sleep_scale=0.0)) < 5.0
    assert DESKTOP_ACTION_PAUSE_S == 1.0
    assert ActorConfig().runner.runner_config(reset_before_setup=True).action_pause_s == 1.0
    desktop = EnvSpec("http://127.0.0.1:1", provider="desktop").runner_config()
    assert desktop.action_pause_s == 1.0
    assert EnvSpec("http://127.0.0.1:1", provider="sim").runner_config().sleep_scale == 0.0


def test_the_episode_loop_pauses_between_the_actions_of_one_response(tmp_path):
    """`play` waits `between_actions` between two actions of one response and not before the
    first: a response of two clicks on a simulated desktop, timed at the runner's `act`."""
    import time

    import numpy as np
    from arpo_envs.sim.server import SimConfig, running
    from arpo_envs.sim.tasks import generate_tasks

    from arpo import wire
    from arpo.actor.episode import EpisodeConfig, run_episode
    from arpo.actor.scripted import ByteTokenizer
    from arpo.policy.engine import Completion
    from arpo.record import Status

    answers = [
        "Thought: two clicks.\nAction: click(start_box='(10,10)')\n\nclick(start_box='(20,20)')",
        "Thought: done.\nAction: finished()",
    ]

    class TwoActions:
        tokenizer = ByteTokenizer()
        min_pixels, max_pixels = 28 * 28 * 4, 28 * 28 * 64

        def __init__(self) -> None:
            self.turn = 0

        async def generate(self, token_ids, images=(), params=None):
            text = answers[min(self.turn, 1)]
            self.turn += 1
            ids = np.frombuffer(text.encode(), np.uint8).astype(np.int32)
            return Completion(ids, np.full(len(ids), -0.1, np.float32), text, "stop", 0)

    task = generate_tasks("click_button", 1, seed=1)[0]
    grant = wire.Grant("g/0/1", task["id"], "g", 0, 0, json.dumps(task))

    def acts(pause: float) -> list[tuple[float, str]]:
        async def go():
            async with running([SimConfig(port=0)]) as urls:
                env = Environment(
                    0,
                    urls[0],
                    RunnerConfig(
                        reset_before_setup=True, evaluator="own",
                        action_pause_s=pause, sleep_scale=1.0,
                    ),
                )  # fmt: skip
                times: list[tuple[float, str]] = []
                act = env.runner.act

                async def timed_act(cmd):
                    times.append((time.perf_counter(), cmd))
                    return await act(cmd)

                env.runner.act = timed_act
                try:
                    t0 = time.perf_counter()
                    traj = await run_episode(
                        env, grant, TwoActions(), EpisodeConfig(max_steps=3), actor_id="a"
                    )
                finally:
                    await env.close()
            assert traj is not None and traj.status == Status.OK, traj
            assert traj.steps == 2
            return [(t - t0, c) for t, c in times]

        return asyncio.run(go())

    paused = acts(0.6)
    assert len(paused) == 3 and paused[2][1] == "DONE"
    assert "pyautogui.click(" in paused[0][1] and "pyautogui.click(" in paused[1][1]
    assert paused[0][1] != paused[1][1]  # the response's two clicks, in its order
    assert paused[1][0] - paused[0][0] >= 0.6  # between the two clicks of one response
    unpaused = acts(0.0)
    assert unpaused[1][0] - unpaused[0][0] < 0.5

"""Every task family of the simulated desktop, driven over HTTP exactly as OSWorld's host drives a VM.

The oracle of each task (several seeds per family) is sent through /execute as
`python -c "<OSWorld prefix>; <code>"`; the value its evaluator reads through
/sim/state must then equal the expected value, and must not before.
"""

from __future__ import annotations

import asyncio
import json
import xml.etree.ElementTree as ET

import aiohttp
import pytest
from arpo_envs.cli import main as cli_main
from arpo_envs.sim import FAMILIES, SimConfig, generate_tasks
from arpo_envs.sim.server import running

PREFIX = "import pyautogui; import time; pyautogui.FAILSAFE = False; {command}"
SEEDS_PER_FAMILY = 4
ACTION_SPACE_TASKS = 12


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def evaluate(session: aiohttp.ClientSession, url: str, task: dict) -> bool:
    """OSWorld's exact_match of the task's sim_state result against its rule."""
    ev = task["evaluator"]
    assert ev["func"] == "exact_match" and ev["result"]["type"] == "sim_state"
    value = (await post(session, f"{url}/sim/state", {"path": ev["result"]["path"]}))["value"]
    return value == ev["expected"]["rules"]["expected"]


async def setup(session: aiohttp.ClientSession, url: str, task: dict) -> None:
    (step,) = task["config"]
    assert step["type"] == "sim_scene"
    answer = await post(session, f"{url}/sim/scene", step["parameters"])
    assert answer["task_id"] == task["id"]
    assert answer["instruction"] == task["instruction"]


async def run_oracle(session: aiohttp.ClientSession, url: str, task: dict) -> None:
    for code in task["oracle"]:
        command = ["python", "-c", PREFIX.format(command=code)]
        res = await post(session, f"{url}/execute", {"command": command, "shell": False})
        assert res["status"] == "success" and res["returncode"] == 0, (code, res)
        async with session.get(f"{url}/screenshot") as r:  # the agent looks after every step
            assert r.status == 200


@pytest.mark.parametrize("family", list(FAMILIES))
def test_oracle_solves_every_family_and_doing_nothing_does_not(family: str) -> None:
    tasks = generate_tasks(family, SEEDS_PER_FAMILY, seed=7)

    async def body() -> None:
        async with running([SimConfig(port=0)]) as (url,), aiohttp.ClientSession() as s:
            for task in tasks:
                await setup(s, url, task)
                assert not await evaluate(s, url, task), "solved before any action"
                await run_oracle(s, url, task)
                assert await evaluate(s, url, task), (task["instruction"], task["oracle"])
                # a reset puts the scene back to its start: unsolved again
                await post(s, f"{url}/reset", {})
                assert not await evaluate(s, url, task)

    asyncio.run(body())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_oracle_in_the_agents_action_space_solves_every_family(family: str) -> None:
    """What the warm start learns from: every oracle step turned into the agent's UI-TARS
    actions (`oracle_to_actions`, one scroll action = the reference's 5 wheel clicks) and
    back into the pyautogui code the actor sends (`to_pyautogui`, the default config)."""
    from arpo.actor.scripted import oracle_to_actions
    from arpo.policy.actions import ActionConfig, to_pyautogui

    tasks = generate_tasks(family, ACTION_SPACE_TASKS, seed=11)
    config = ActionConfig()

    async def body() -> None:
        async with running([SimConfig(port=0)]) as (url,), aiohttp.ClientSession() as s:
            for task in tasks:
                await setup(s, url, task)
                sent = []
                for step in task["oracle"]:
                    for action in oracle_to_actions(step, config.scroll_clicks):
                        sent.append(to_pyautogui(action, config))
                        command = ["python", "-c", PREFIX.format(command=sent[-1])]
                        res = await post(s, f"{url}/execute", {"command": command})
                        assert res["returncode"] == 0, (sent[-1], res)
                assert await evaluate(s, url, task), (task["instruction"], task["oracle"], sent)

    asyncio.run(body())


def test_wrong_actions_fail_the_task() -> None:
    """Clicking every button of a click_button scene is not the same as clicking the right one."""
    (task,) = generate_tasks("click_button", 1, seed=3)

    async def body() -> None:
        async with running([SimConfig(port=0)]) as (url,), aiohttp.ClientSession() as s:
            await setup(s, url, task)
            state = await post(s, f"{url}/sim/state", {"path": "widgets"})
            buttons = [w for wid, w in state["value"].items() if wid.startswith("button_")]
            assert len(buttons) >= 4
            async with s.get(f"{url}/accessibility") as r:
                xml = (await r.json())["AT"]
            ns = "{https://accessibility.ubuntu.example.org/ns/component}"
            for el in ET.fromstring(xml).iter("push-button"):
                x, y = (int(v) for v in el.get(f"{ns}screencoord").strip("()").split(","))
                w, h = (int(v) for v in el.get(f"{ns}size").strip("()").split(","))
                code = PREFIX.format(command=f"pyautogui.click({x + w // 2}, {y + h // 2})")
                await post(s, f"{url}/execute", {"command": ["python", "-c", code]})
            assert not await evaluate(s, url, task)
            clicked = (await post(s, f"{url}/sim/state", {"path": "clicked"}))["value"]
            assert len(clicked) == len(buttons)

    asyncio.run(body())


def test_tasks_are_reproducible_osworld_dicts() -> None:
    for family in FAMILIES:
        a = generate_tasks(family, 5, seed=1)
        assert a == generate_tasks(family, 5, seed=1)
        assert len({t["id"] for t in a}) == 5
        for t in a:
            assert set(t) >= {"id", "instruction", "config", "evaluator", "oracle"}
            assert t["evaluator"]["expected"]["type"] == "rule"
            assert t["oracle"] and all(isinstance(c, str) for c in t["oracle"])
    steps = {f: max(len(t["oracle"]) for t in generate_tasks(f, 8)) for f in FAMILIES}
    assert steps["click_button"] == 1 and steps["fill_form"] >= 6


def test_scene_for_another_screen_size_is_refused() -> None:
    (task,) = generate_tasks("menu_pick", 1, seed=0, screen=(1920, 1080))

    async def body() -> None:
        params = task["config"][0]["parameters"]
        async with (
            running([SimConfig(port=0)]) as (url,),
            aiohttp.ClientSession() as s,
            s.post(f"{url}/sim/scene", json=params) as r,
        ):
            assert r.status == 400
            assert "1920" in (await r.json())["message"]

    asyncio.run(body())


def test_sim_tasks_cli_writes_task_files(tmp_path) -> None:
    assert cli_main(["sim-tasks", "--out", str(tmp_path), "-n", "2"]) == 0
    index = json.loads((tmp_path / "test_all.json").read_text())
    assert set(index) == set(FAMILIES)
    for family, ids in index.items():
        assert len(ids) == 2
        for task_id in ids:
            task = json.loads((tmp_path / family / f"{task_id}.json").read_text())
            assert task["id"] == task_id and task["oracle"]

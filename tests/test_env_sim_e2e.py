"""The OSWorld client and task runner against the simulated desktop server, end to end.

One code path for OSWorld VMs and the project's desktops: the runner sets the task
up (`sim_scene`), plays the oracle's pyautogui code through `/execute` exactly as
OSWorld's controller sends it, and evaluates with the `sim_state` getter.
"""

from __future__ import annotations

import asyncio

import pytest
from arpo_envs.sim.server import SimConfig, running
from arpo_envs.sim.tasks import FAMILIES, generate_tasks

from arpo.env.client import ClientConfig, EnvClient
from arpo.env.runner import TaskRunner, unsupported
from arpo.env.task import Task


async def _run_all(families: list[str], per_family: int) -> list[tuple[str, float, str, float]]:
    out = []
    async with (
        running([SimConfig(port=0)]) as urls,
        EnvClient(ClientConfig(base_url=urls[0])) as client,
    ):
        runner = TaskRunner(client)
        try:
            for family in families:
                for raw in generate_tasks(family, per_family, seed=7):
                    task = Task.from_dict(raw, domain=f"sim/{family}")
                    assert unsupported(task) == []
                    oracle = task.extra["oracle"]
                    solved = await runner.run(task, [*oracle, "DONE"])
                    idle = await runner.run(task, ["DONE"])
                    failed = await runner.run(task, [*oracle, "FAIL"])
                    out.append((task.id, solved.score, solved.status, idle.score))
                    assert failed.score == 0.0  # ending with FAIL scores 0 on feasible tasks
        finally:
            runner.close()
    return out


def test_every_sim_family_is_solved_by_its_oracle_through_the_runner() -> None:
    results = asyncio.run(_run_all(sorted(FAMILIES), per_family=2))
    assert len(results) == 2 * len(FAMILIES)
    for tid, score, status, idle in results:
        assert (score, status) == (1.0, "ok"), tid
        assert idle < 1.0, tid


def test_unknown_state_path_is_an_environment_problem_not_a_zero() -> None:
    async def go() -> str:
        raw = generate_tasks("click_button", 1, seed=1)[0]
        raw["evaluator"]["result"]["path"] = "no.such.path"
        task = Task.from_dict(raw, domain="sim")
        async with (
            running([SimConfig(port=0)]) as urls,
            EnvClient(ClientConfig(base_url=urls[0])) as client,
        ):
            runner = TaskRunner(client)
            try:
                return (await runner.run(task, ["DONE"])).status
            finally:
                runner.close()

    assert asyncio.run(go()) in ("env_error", "eval_error")


@pytest.mark.parametrize("family", ["fill_form"])
def test_many_step_family_has_a_long_oracle(family: str) -> None:
    raw = generate_tasks(family, 3, seed=3)
    assert all(len(r["oracle"]) >= 6 for r in raw)

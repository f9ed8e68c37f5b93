"""OSWorld's evaluator end to end on the real local desktop: the local tasks (every one of them
uses steps, getters and metrics OSWorld's package has), played by their oracles and by doing
nothing, set up and scored by OSWorld's code through its worker (`evaluator="osworld"`) and by the
project's own runner (`evaluator="own"`), must end with the same status and score.

The default run plays two tasks (the editor and Calc); `make test-all` plays a third of the
suite a day (tests/day_shard.py). Skipped where the local desktop or the evaluator environment is missing;
`ARPO_DESKTOP_URL=http://127.0.0.1:5000` runs against a desktop that is already up.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from day_shard import sweep_shard
from osworld_fixtures.evaluator import needs_evaluator
from test_local_tasks import desktop_url, suite  # noqa: F401  (desktop_url is a fixture)

from arpo.env import Environment, RunnerConfig
from arpo.env.osworld.client import EvaluatorConfig, OSWorldEvaluator
from arpo.env.task import Task

pytestmark = needs_evaluator

FAST = ("editor-append-line", "calc-set-quantity")
"""A text file compared by compare_text_file and a sheet by compare_table: the two families
most local tasks use."""

Outcome = tuple[str, str, str, float, str]
"""(task id, "oracle" or "noop", status, score, error)."""


async def _play_both(url: str, tasks: list[Task]) -> dict[str, list[Outcome]]:
    """Every task, with its oracle and with no action, once per evaluator; the desktop is reset
    before each run."""
    out: dict[str, list[Outcome]] = {"own": [], "osworld": []}
    pool = OSWorldEvaluator(EvaluatorConfig(workers=1, request_timeout_s=300))
    envs = {
        ev: Environment(0, url, RunnerConfig(reset_before_setup=True, evaluator=ev), osworld=pool)
        for ev in out
    }
    try:
        await envs["own"].client.wait_ready(deadline_s=120)
        for t in tasks:
            for how, actions in (("oracle", [*t.extra["oracle"], "DONE"]), ("noop", ["DONE"])):
                for ev, env in envs.items():
                    res = await env.run(t, actions)
                    env.runner.close()
                    out[ev].append((t.id, how, res.status, res.score, res.error or ""))
    finally:
        for env in envs.values():
            await env.close()
        await pool.aclose()
    return out


def _check_same(url: str, tasks: list[Task]) -> dict[str, list[Outcome]]:
    t0 = time.perf_counter()
    got = asyncio.run(_play_both(url, tasks))
    own, theirs = got["own"], got["osworld"]
    assert len(own) == len(theirs) == 2 * len(tasks)
    differ = [(a, b) for a, b in zip(own, theirs, strict=True) if a[2:4] != b[2:4]]
    assert not differ, f"{len(differ)} of {len(own)} runs score differently: {differ}"
    # The comparison means something: oracles solve, doing nothing does not, both checked.
    assert all(o[2:4] == ("ok", 1.0) for o in own if o[1] == "oracle"), own
    assert all(o[2] == "ok" and o[3] < 1.0 for o in own if o[1] == "noop"), own
    print(
        f"{len(tasks)} tasks, {len(own)} runs per evaluator, all agree "
        f"({time.perf_counter() - t0:.0f} s)"
    )
    return got


def test_osworld_and_own_score_two_local_tasks_alike(desktop_url):  # noqa: F811
    tasks = [t for t in suite() if t.id in FAST]
    assert len(tasks) == len(FAST)
    _check_same(desktop_url, tasks)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_osworld_and_own_score_one_shard_of_the_local_tasks_alike(desktop_url):  # noqa: F811
    """A third of the suite a day (tests/day_shard.py: all 47 tasks take 15 minutes);
    ARPO_OSWORLD_SUITE_SHARD=all for every task."""
    assert len(suite()) == 47
    tasks, _ = sweep_shard(suite(), "ARPO_OSWORLD_SUITE_SHARD")
    _check_same(desktop_url, tasks)

"""The actor's `runner` section: `evaluator=own` / `osworld` decides whose code scores its
episodes, and every environment of the actor shares one bounded pool of OSWorld evaluator
workers. Real parts: the actor, the learner's grant server and ingest on loopback, simulated
desktops over HTTP given as `envs` URLs, OSWorld's worker processes."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from arpo_envs.sim.server import SimConfig, start_servers
from osworld_fixtures.evaluator import needs_evaluator
from test_actor import Learner, learner_factory  # noqa: F401  (learner_factory is a fixture)

from arpo.actor.actor import Actor
from arpo.actor.config import ActorConfig, ActorRunnerConfig
from arpo.config import load_config
from arpo.errors import ConfigError
from arpo.service.grants import GrantConfig

pytestmark = needs_evaluator


def json_task(tid: str, got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    """A task only OSWorld's package can score (`check_direct_json_object`: the project has no
    such metric); the scripted policy clicks once and says DONE."""
    return {
        "id": tid,
        "instruction": "Click the screen.",
        "config": [],
        "evaluator": {
            "func": "check_direct_json_object",
            "result": {"type": "rule", "rules": got},
            "expected": {"type": "rule", "rules": {"expected": want}},
        },
        "oracle": ["pyautogui.click(20, 20)"],
    }


TASKS = [json_task("json-same", {"a": 1}, {"a": 1}), json_task("json-near", {"a": 1}, {"a": 2})]


def worker_pids() -> set[int]:
    """OSWorld evaluator workers among this process's children (read from /proc)."""
    me, out = os.getpid(), set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == me and b"arpo/env/osworld/worker.py" in cmd:
            out.add(int(d.name))
    return out


def run_actor(lr: Learner, tmp: Path, runner: ActorRunnerConfig, episodes: int, envs: int):
    """Run an actor on `envs` simulated desktops given as URLs until `episodes` finished;
    returns it and the most worker processes seen alive at once, and all of them."""
    seen: set[int] = set()
    most = 0

    async def go() -> Actor:
        nonlocal most
        sims, urls = await start_servers([SimConfig(port=0, index=i) for i in range(envs)])
        cfg = ActorConfig(
            envs=urls,
            policy="scripted",
            runner=runner,
            spool_dir=str(tmp / f"spool-{runner.evaluator}"),
            transport=lr.transport(),
            max_episodes=episodes,
            progress_s=0,
        )
        actor = Actor(cfg)
        run = asyncio.create_task(actor.run())
        try:
            while not run.done():
                alive = await asyncio.to_thread(worker_pids)
                seen.update(alive)
                most = max(most, len(alive))
                await asyncio.sleep(0.05)
            await run
        finally:
            for s in sims:
                await s.cleanup()
        return actor

    actor = asyncio.run(go())
    return actor, most, seen


def test_actor_with_osworld_scores_by_osworld_on_a_shared_pool(learner_factory, tmp_path):  # noqa: F811
    lr = learner_factory(TASKS, GrantConfig(group_size=4, groups_per_step=2, max_staleness=0))
    # Four environments, the default pool: min(4, 2) = 2 workers for all of them.
    actor, most, seen = run_actor(lr, tmp_path, ActorRunnerConfig(evaluator="osworld"), 8, 4)
    assert actor.stats.by_status == {"ok": 8} and actor.stats.successes == 4, actor.stats
    scores = sorted((t.task_id, t.checker_score) for t in lr.drain())
    assert scores == [("json-near", 0.0)] * 4 + [("json-same", 1.0)] * 4
    assert actor.osworld is not None and actor.osworld.config.workers == 2
    assert 1 <= most <= 2 and len(seen) == actor.osworld.starts <= 2, (most, seen)
    assert actor.osworld.requests >= 16  # a setup and an evaluation per episode
    assert worker_pids() == set()  # stopped with the actor


def test_actor_with_own_never_asks_osworld(learner_factory, tmp_path, caplog):  # noqa: F811
    lr = learner_factory(TASKS, GrantConfig(group_size=2, groups_per_step=2, max_staleness=0))
    caplog.set_level(logging.WARNING, logger="arpo.actor.episode")
    actor, most, _ = run_actor(lr, tmp_path, ActorRunnerConfig(evaluator="own"), 4, 2)
    # max_episodes stops new episodes; one already running on the other desktop may finish.
    n = actor.stats.by_status.get("eval_error", 0)
    assert set(actor.stats.by_status) == {"eval_error"} and 4 <= n <= 5, actor.stats
    assert lr.stored() == 0 and lr.ingest.stats().get("excluded_eval_error", 0) == n
    assert "metric 'check_direct_json_object' is not implemented" in caplog.text
    assert most == 0 and actor.osworld is not None and actor.osworld.starts == 0


def test_runner_section_is_validated_and_reaches_the_runners():
    def load(*over: str) -> ActorConfig:
        return load_config(ActorConfig, None, ["sim_envs=1", "policy=scripted", *over])

    cfg = load(
        "runner.evaluator=osworld", "runner.osworld_timeout_s=30", "runner.osworld_workers=3"
    )
    rc = cfg.runner.runner_config(reset_before_setup=False)
    assert (rc.evaluator, rc.osworld_timeout_s, rc.reset_before_setup) == ("osworld", 30.0, False)
    ec = cfg.runner.evaluator_config(8)
    assert (ec.workers, ec.request_timeout_s) == (3, 30.0)
    assert load().runner.evaluator_config(1).workers == 1  # min(environments, 2)
    assert load().runner.evaluator_config(5).workers == 2
    for bad, fix in (
        ("runner.evaluator=mine", "one of 'own', 'auto', 'osworld'"),
        ("runner.osworld_timeout_s=0", "is 0.0; must be in (0, 604800] (seconds"),
        ("runner.osworld_probe_timeout_s=-1", "0: no check"),
        ("runner.osworld_workers=-2", "min(environments, 2)"),
    ):
        with pytest.raises(ConfigError, match=r"runner\.") as e:
            load(bad)
        assert fix in str(e.value)
    with pytest.raises(ConfigError, match="make osworld-evaluator"):
        load("runner.evaluator=osworld", "runner.osworld_python=/nonexistent/python")

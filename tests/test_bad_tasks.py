"""One bad task never stops a run: a step nobody can run is refused when the pool loads
(naming the task and the step), and a task whose setup fails at run time on every desktop is
that task's failure (quarantined on the actor, its runs given up), never the actor's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from arpo_envs.sim.tasks import generate_tasks, write_tasks
from conftest import SCRIPTED_ACTOR, ListStore, loopback

from arpo.config import validate
from arpo.env.task import load_pool
from arpo.errors import TaskError
from arpo.pool.collect import CollectConfig, run_collect


def _pool_with(tmp: Path, bad: dict) -> Path:
    root = tmp / "pool"
    write_tasks(root, ["click_button"], n=2, seed=3)
    (root / "broken").mkdir()
    (root / "broken" / f"{bad['id']}.json").write_text(json.dumps(bad))
    return root


def test_a_step_nobody_can_run_is_refused_at_load(tmp_path: Path) -> None:
    bad = generate_tasks("menu_pick", 1, seed=9)[0]
    bad["config"].append({"type": "no_such_step", "parameters": {}})
    with pytest.raises(TaskError, match=rf"task {bad['id']}: config\[1\] .*'no_such_step'"):
        load_pool(_pool_with(tmp_path / "a", bad))
    bad = generate_tasks("menu_pick", 1, seed=9)[0]
    bad["config"][0]["parameters"]["family"] = 5
    with pytest.raises(TaskError, match=rf"task {bad['id']}: config\[0\] is a sim_scene .*5"):
        load_pool(_pool_with(tmp_path / "b", bad))


def test_a_task_whose_setup_fails_everywhere_does_not_stop_the_actor(tmp_path: Path) -> None:
    bad = generate_tasks("menu_pick", 1, seed=9)[0]
    bad["id"] = "scene-nobody-has"
    bad["config"][0]["parameters"]["family"] = "no_such_family"  # refused by every desktop
    root = _pool_with(tmp_path, bad)
    cfg = validate(
        CollectConfig(
            tasks=str(root),
            model="scripted",
            runs_per_task=3,
            max_attempts=2,
            out=str(tmp_path / "collect"),
            transport=loopback(),
            local_actor_args=list(SCRIPTED_ACTOR),
            local_actor_log=str(tmp_path / "actor.log"),
            timeout_s=120,
            progress_s=0,
        )
    )
    result = run_collect(cfg, store=ListStore())
    assert result["complete"] is True
    log = (tmp_path / "actor.log").read_text()
    assert "cannot be set up, quarantined" in log and "scene-nobody-has" in log
    assert "Traceback" not in log  # the actor never died
    c = result["tasks"]["scene-nobody-has"]
    assert (c["runs"], c["successes"], c["unknown"]) == (0, 0, 3)
    good = [t for t in result["tasks"] if t != "scene-nobody-has"]
    assert len(good) == 2 and all(result["tasks"][t]["runs"] == 3 for t in good), result["tasks"]

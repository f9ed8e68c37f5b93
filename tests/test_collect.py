"""`arpo collect` on the real rollout path: grant server + ingest (with its journal) here, a
real `arpo-actor` process with simulated desktops and the scripted policy; one task whose
checker cannot run, so its episodes end in eval_error and are counted but not stored."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import pytest
from arpo_envs.sim.tasks import generate_tasks, write_tasks
from conftest import POOL_FAMILIES, SCRIPTED_ACTOR, ListStore, loopback

from arpo import cli, store_item
from arpo.config import load_config, validate
from arpo.errors import ArpoError, ConfigError
from arpo.pool.collect import CollectConfig, load_outcomes, run_collect
from arpo.record import Trajectory
from arpo.service.journal import list_segments, read_collection, segment_path

FAMILIES = POOL_FAMILIES
LOOPBACK = loopback()
SCRIPTED = SCRIPTED_ACTOR


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """6 simulated tasks in <family>/<id>.json, and one in broken/ whose result getter does
    not exist (its checker fails: eval_error); returns the folder and the broken task's id."""
    root = tmp_path_factory.mktemp("pool")
    write_tasks(root, FAMILIES, n=2, seed=5)
    bad = generate_tasks("menu_pick", 1, seed=9)[0]
    bad["evaluator"]["result"] = {"type": "no_such_getter"}
    (root / "broken").mkdir()
    (root / "broken" / f"{bad['id']}.json").write_text(json.dumps(bad))
    return root, bad["id"]


def _same_turns(a: Trajectory, b: Trajectory) -> bool:
    return len(a.turns) == len(b.turns) and all(
        np.array_equal(x.prompt_ids, y.prompt_ids)
        and np.array_equal(x.response_ids, y.response_ids)
        and np.array_equal(x.logprobs, y.logprobs)
        and x.screenshot == y.screenshot
        and x.action == y.action
        for x, y in zip(a.turns, b.turns, strict=True)
    )


def test_every_ok_episode_is_stored_once_and_outcomes_count_everything(
    pool: tuple[Path, str], tmp_path: Path
) -> None:
    root, broken = pool
    n = 3
    out = tmp_path / "collect"
    cfg = validate(
        CollectConfig(
            tasks=str(root),
            model="unused-by-the-scripted-policy",
            runs_per_task=n,
            max_attempts=2,
            out=str(out),
            transport=LOOPBACK,
            local_actor_args=[*SCRIPTED, "scripted_quit_prob=0.4"],
            timeout_s=120,
            progress_s=0,
        )
    )
    store = ListStore()
    result = run_collect(cfg, store=store)

    received = {
        store_item.from_item(i).trajectory_id: store_item.from_item(i) for _, i in store.items
    }
    assert len(received) == len(store.items) == 6 * n  # every ok run, once
    counts: collections.Counter[str] = collections.Counter()
    collected = list(read_collection(out, counts))
    assert counts["records"] == len(collected) and not counts["torn"] and not counts["corrupt"]
    ids = [t.trajectory_id for t in collected]
    assert len(set(ids)) == len(ids) and set(ids) == set(received)
    for t in collected:
        r = received[t.trajectory_id]
        assert (t.task_id, t.reward, t.checker_score, t.status, t.slot, t.group_id) == (
            r.task_id, r.reward, r.checker_score, r.status, r.slot, r.group_id,
        )  # fmt: skip
        assert _same_turns(t, r) and t.steps > 0
    assert list(read_collection(out / "trajectories")) == collected  # either path

    assert result == load_outcomes(out) == load_outcomes(out / "outcomes.json")
    assert result["complete"] is True and result["stored"] == 6 * n
    assert result["sampling"] == {"temperature": 1.0, "top_p": 1.0}
    assert result["policy"]["model"] == "unused-by-the-scripted-policy"
    by_task = collections.defaultdict(list)
    for t in collected:
        by_task[t.task_id].append(t)
    assert len(result["tasks"]) == 7
    for tid, c in result["tasks"].items():
        trs = c["trajectories"]
        if tid == broken:
            assert c["domain"] == "broken"
            assert (c["runs"], c["successes"], c["env_errors"], c["unknown"]) == (0, 0, 2 * n, n)
            assert len(trs) == 2 * n and not by_task[tid]
            assert all(e["status"] == "eval_error" and not e["stored"] for e in trs)
            continue
        assert c["domain"] in FAMILIES
        mine = by_task[tid]
        assert c["runs"] == n == len(mine) and c["env_errors"] == c["unknown"] == 0
        assert c["successes"] == sum(t.checker_score >= 1.0 for t in mine)
        assert {e["id"] for e in trs} == {t.trajectory_id for t in mine}
        for e in trs:
            t = received[e["id"]]
            assert e["stored"] and e["status"] == "ok" and e["steps"] == t.steps
            assert (e["checker_score"], e["reward"]) == (t.checker_score, t.reward)
            assert e["success"] == (t.checker_score >= 1.0)
    successes = sum(c["successes"] for c in result["tasks"].values())
    assert 0 < successes < 6 * n  # the scripted policy gave up some episodes
    assert sorted(p.name for p in out.iterdir()) == ["actor.log", "outcomes.json", "trajectories"]

    # A torn tail (a crash mid-write) is skipped: every intact record still reads.
    seg = segment_path(out / "trajectories", list_segments(out / "trajectories")[-1])
    with seg.open("ab") as f:
        f.write(b"ARJ1\x05\x00\x00\x00" + b"\xff" * 20)
    counts = collections.Counter()
    assert [t.trajectory_id for t in read_collection(out, counts)] == ids
    assert counts["torn"] == 1

    # The folder is taken now: refused, or replaced with overwrite=true (via the CLI).
    with pytest.raises(ConfigError, match=r"config field out: .*already holds a collection"):
        run_collect(cfg)
    rc = cli.main([
        "collect", f"tasks={str(root)!r}", "model='m'", "runs_per_task=1", f"out={str(out)!r}",
        "overwrite=true", "max_attempts=1", "transport.data='tcp://127.0.0.1:0'",
        "transport.control='tcp://127.0.0.1:0'", f"local_actor_args={json.dumps(SCRIPTED)}",
        "timeout_s=120", "progress_s=0",
    ])  # fmt: skip
    assert rc == 0
    again = list(read_collection(out))
    assert len(again) == 6 and not set(t.trajectory_id for t in again) & set(ids)
    assert load_outcomes(out)["stored"] == 6


def test_bad_configs_name_the_field(pool: tuple[Path, str], tmp_path: Path) -> None:
    root, _ = pool
    base = [f"tasks={str(root)!r}"]
    cases = {
        "model": base,
        "runs_per_task": [*base, "model='m'", "runs_per_task=0"],
        "temperature": [*base, "model='m'", "temperature=-0.5"],
        "local_actor_args": [*base, "model='m'", "local_actor_args=['engine.model=\"x\"']"],
    }
    for field, overrides in cases.items():
        with pytest.raises(ConfigError, match=f"config field {field}:"):
            load_config(CollectConfig, None, overrides)
    ckpts = tmp_path / "checkpoints"
    (ckpts / "ckpt-00000001").mkdir(parents=True)  # no manifest: an unfinished save
    cfg = load_config(CollectConfig, None, [*base, f"model={str(ckpts)!r}"])
    with pytest.raises(ConfigError, match=r"config field model: .*no valid checkpoint"):
        run_collect(cfg)
    with pytest.raises(ArpoError, match="not a collection"):
        list(read_collection(tmp_path / "nowhere"))
    with pytest.raises(ArpoError, match="does not exist"):
        load_outcomes(tmp_path)


def test_a_timeout_writes_incomplete_outcomes(pool: tuple[Path, str], tmp_path: Path) -> None:
    out = tmp_path / "c"
    cfg = validate(CollectConfig(tasks=str(pool[0]), model="m", runs_per_task=2, out=str(out),
                                 transport=LOOPBACK, local_actor=False, timeout_s=0.3,
                                 progress_s=0))  # fmt: skip
    with pytest.raises(ArpoError, match=r"timed out .* 0 of 14 runs"):
        run_collect(cfg)  # no actor connects
    data = load_outcomes(out)
    assert data["complete"] is False and data["stored"] == 0
    assert list(read_collection(out)) == []

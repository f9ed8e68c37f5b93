"""Task selection on the real rollout path: grant server + ingest here, a real `arpo-actor`
process with simulated desktops and the scripted policy (which gives up a share of episodes)."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest
from arpo_envs.sim.tasks import generate_tasks, write_tasks
from conftest import POOL_FAMILIES, loopback

from arpo import cli, store_item, wire
from arpo.buffer import ReplayStore
from arpo.config import load_config, validate
from arpo.env.task import load_selection, load_task_pool
from arpo.errors import ArpoError, ConfigError, TaskError
from arpo.pool.select import (
    SelectConfig,
    SelectionTally,
    format_table,
    run_selection,
)
from arpo.record import Status, Trajectory
from arpo.service.grants import GrantBook, GrantConfig, GrantServer
from arpo.transport import TransportConfig

FAMILIES = POOL_FAMILIES
LOOPBACK = loopback()
ACTOR = ["sim_envs=4", "policy='scripted'", "episode.scroll_clicks=1", "progress_s=0"]


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 simulated tasks as task files (plus the index file write_tasks puts next to them)."""
    root = tmp_path_factory.mktemp("pool")
    write_tasks(root, FAMILIES, n=2, seed=5)
    return root


def test_every_task_gets_n_runs_and_the_counts_match_what_ingest_stored(
    pool: Path, tmp_path: Path
) -> None:
    n = 4
    cfg = validate(
        SelectConfig(
            tasks=str(pool),
            runs_per_task=n,
            min_successes=2,
            max_successes=3,
            out=str(tmp_path / "sel" / "selection.json"),
            transport=LOOPBACK,
            local_actor=True,
            local_actor_args=[*ACTOR, "scripted_quit_prob=0.4"],
            timeout_s=120,
        )
    )
    store = ReplayStore(max_bytes=1 << 30, fresh_capacity=64, seed=0)
    progress: list[tuple[int, int]] = []
    try:
        result = run_selection(cfg, store=store, on_progress=lambda d, t: progress.append((d, t)))
        stored: list[Trajectory] = []
        for t in store.tasks():
            stored += [store_item.from_item(i) for i in store.take_group(t, store.fresh_len(t), 0)]
    finally:
        store.close()

    ids = [t["id"] for t in load_task_pool(pool)]
    assert len(ids) == 6 and list(result["tasks"]) == ids
    by_task = collections.defaultdict(list)
    for tr in stored:
        by_task[tr.task_id].append(tr)
    assert len({tr.trajectory_id for tr in stored}) == len(stored)
    for tid in ids:
        c = result["tasks"][tid]
        assert c["runs"] + c["unknown"] == n
        trs = by_task[tid]
        assert len(trs) == c["runs"]  # one stored ok episode per counted run
        assert sorted(tr.slot for tr in trs) == list(range(n))  # one per slot of one group
        assert len({tr.group_id for tr in trs}) == 1
        assert c["successes"] == sum(tr.checker_score >= 1.0 for tr in trs)
        assert c["success_rate"] == c["successes"] / c["runs"]
        assert all(tr.status == Status.OK for tr in trs)
    successes = sum(c["successes"] for c in result["tasks"].values())
    assert 0 < successes < 6 * n  # the scripted policy gave up some episodes
    assert result["selected"] == [t for t in ids if 2 <= result["tasks"][t]["successes"] <= 3]
    assert progress[-1] == (6 * n, 6 * n) and progress[0][0] <= progress[-1][0]

    out = Path(cfg.out)
    on_disk = json.loads(out.read_text())
    assert on_disk == result and on_disk["complete"] is True
    assert on_disk["runs_per_task"] == n and on_disk["min_successes"] == 2
    assert on_disk["max_successes"] == 3 and on_disk["success_score"] == 1.0
    assert on_disk["created"].endswith("+00:00")
    assert load_selection(out) == result["selected"]
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "selection.json",
        "selection.json.actor.log",
    ]
    assert "select-local" in out.with_name("selection.json.actor.log").read_text()
    table = format_table(result)
    assert all(tid in table for tid in ids)


def _traj(grant: wire.Grant, status: Status, score: float) -> Trajectory:
    return Trajectory(grant.task_id, (), score, reward=score, status=status,
                      group_id=grant.group, slot=grant.slot)  # fmt: skip


def test_environment_errors_are_regranted_then_counted_unknown() -> None:
    tasks = generate_tasks("click_button", 2, seed=1)
    book = GrantBook(tasks, GrantConfig(group_size=2, groups_per_step=2, max_staleness=0,
                                        max_attempts=2, shuffle=False))  # fmt: skip
    tally = SelectionTally(book, [t["id"] for t in tasks], success_score=0.5)
    a0, a1, b0, b1 = book.request("actor", 4)
    assert book.request("actor", 1) == []  # one group per task, nothing more
    assert tally.on_trajectory(_traj(a0, Status.OK, 0.5))
    assert tally.on_trajectory(_traj(a1, Status.ENV_ERROR, 0.0))
    (again,) = book.request("actor", 1)  # the slot is granted again
    assert (again.group, again.slot) == (a1.group, a1.slot)
    assert tally.on_trajectory(_traj(again, Status.EVAL_ERROR, 0.0))  # 2nd attempt: given up
    assert tally.on_trajectory(_traj(b0, Status.OK, 0.4))
    assert tally.on_trajectory(_traj(b1, Status.OK, 1.0))
    assert not tally.on_trajectory(_traj(b1, Status.OK, 1.0))  # a surplus is not counted
    assert tally.done() == 4
    a, b = tasks[0]["id"], tasks[1]["id"]
    assert tally.snapshot() == {
        a: {"runs": 1, "successes": 1, "env_errors": 2, "unknown": 1},
        b: {"runs": 2, "successes": 1, "env_errors": 0, "unknown": 0},
    }


def test_a_timeout_writes_an_incomplete_result_that_load_selection_refuses(
    pool: Path, tmp_path: Path
) -> None:
    out = tmp_path / "sel.json"
    cfg = validate(SelectConfig(tasks=str(pool), runs_per_task=2, out=str(out),
                                transport=LOOPBACK, timeout_s=0.3))  # fmt: skip
    with pytest.raises(ArpoError, match=r"timed out .* 0 of 12 runs"):
        run_selection(cfg)  # no actor connects
    data = json.loads(out.read_text())
    assert data["complete"] is False and data["selected"] == []
    with pytest.raises(ConfigError, match="did not finish"):
        load_selection(out)


def test_an_endpoint_in_use_is_an_error_naming_the_field(pool: Path, tmp_path: Path) -> None:
    first = validate(SelectConfig(tasks=str(pool), out=str(tmp_path / "a.json"),
                                  transport=LOOPBACK, timeout_s=0.2))  # fmt: skip
    book = GrantBook(load_task_pool(pool))
    taken = GrantServer(book, LOOPBACK)
    endpoint = taken.start()
    try:
        first.transport = TransportConfig(data=endpoint, control="tcp://127.0.0.1:0")
        with pytest.raises(ArpoError, match=r"cannot bind transport\.data"):
            run_selection(first)
    finally:
        taken.stop()


def test_a_local_actor_that_exits_is_an_error_with_its_log(pool: Path, tmp_path: Path) -> None:
    cfg = validate(SelectConfig(tasks=str(pool), runs_per_task=2, out=str(tmp_path / "s.json"),
                                transport=LOOPBACK, local_actor=True,
                                local_actor_args=["sim_env=2"], timeout_s=60))  # fmt: skip
    with pytest.raises(ArpoError, match=r"local actor exited \(code 2\)(.|\n)*sim_envs"):
        run_selection(cfg)


def test_bad_configs_name_the_field(pool: Path, tmp_path: Path) -> None:
    base = [f"tasks={str(pool)!r}"]
    cases = {
        "runs_per_task": [*base, "runs_per_task=0"],
        "min_successes": [*base, "runs_per_task=4", "min_successes=5"],
        "max_successes": [*base, "min_successes=2", "max_successes=1"],
        "success_score": [*base, "success_score=0"],
        "local_actor_args": [*base, "local_actor_args=['sim_envs']"],
    }
    for field, overrides in cases.items():
        with pytest.raises(ConfigError, match=f"config field {field}:"):
            load_config(SelectConfig, None, overrides)
    with pytest.raises(ConfigError, match=r"config field tasks: .*does not exist"):
        load_config(SelectConfig, None, [f"tasks={str(tmp_path / 'nowhere')!r}"])
    with pytest.raises(ConfigError, match="config field tasks: is required"):
        load_config(SelectConfig, None, [])
    cmd = [sys.executable, "-m", "arpo.cli", "select-tasks", f"tasks={str(pool)!r}"]
    p = subprocess.run([*cmd, "runs_per_task=0"], capture_output=True, text=True)
    assert p.returncode == 2 and "runs_per_task" in p.stderr


def test_task_pool_forms_and_their_errors(tmp_path: Path) -> None:
    tasks = generate_tasks("click_button", 3, seed=2)
    jl = tmp_path / "pool.jsonl"
    jl.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    js = tmp_path / "pool.json"
    js.write_text(json.dumps(tasks))
    nested = tmp_path / "dir" / "a" / "b"
    nested.mkdir(parents=True)
    for t in tasks:
        (nested / f"{t['id']}.json").write_text(json.dumps(t))
    (tmp_path / "dir" / "test_all.json").write_text(json.dumps({"x": [tasks[0]["id"]]}))
    ids = [t["id"] for t in tasks]
    assert [t["id"] for t in load_task_pool(jl)] == ids
    assert [t["id"] for t in load_task_pool(js)] == ids
    assert sorted(t["id"] for t in load_task_pool(tmp_path / "dir")) == sorted(ids)

    js.write_text(json.dumps([tasks[0], tasks[0]]))
    with pytest.raises(TaskError, match="also in"):
        load_task_pool(js)
    bad = dict(tasks[0])
    del bad["instruction"]
    jl.write_text(json.dumps(bad) + "\n")
    with pytest.raises(TaskError, match=r"pool\.jsonl:1 .*instruction"):
        load_task_pool(jl)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TaskError, match="holds no tasks"):
        load_task_pool(empty)


def test_load_selection_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "none.json"
    with pytest.raises(ConfigError, match=r"none\.json.*does not exist"):
        load_selection(missing)
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match=r"bad\.json.*not readable JSON"):
        load_selection(bad)
    bad.write_text(json.dumps({"selected": [1, 2]}))
    with pytest.raises(ConfigError, match=r"bad\.json.*no 'selected' list"):
        load_selection(bad)
    bad.write_text(json.dumps({"selected": ["a", "b"], "complete": True}))
    assert load_selection(bad) == ["a", "b"]


def test_cli_prints_the_table_and_the_output_path(pool: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "cli.json"
    rc = cli.main([
        "select-tasks", f"tasks={str(pool)!r}", "runs_per_task=1", f"out={str(out)!r}",
        "transport.data='tcp://127.0.0.1:0'", "transport.control='tcp://127.0.0.1:0'",
        "local_actor=true", f"local_actor_args={json.dumps(ACTOR)}", "timeout_s=120",
        "progress_s=0",
    ])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    ids = load_selection(out)
    assert len(ids) == 6  # the scripted policy never gives up here: every task solved
    assert "runs" in text and "successes" in text and str(out) in text
    assert all(f"* {tid}" in text for tid in ids)
    assert "6 of 6 tasks selected" in text


def test_kept_episodes_prefill_the_replay_buffers_with_the_selection_runs_successes(
    pool: Path, tmp_path: Path
) -> None:
    """`trajectories=` keeps every ok episode of the selection; `prefill_replay` puts the
    successes of the training tasks (and nothing else) into their replay buffers."""
    from arpo.learner.groups import ReplayConfig
    from arpo.learner.learner import prefill_replay

    kept = tmp_path / "kept"
    cfg = validate(
        SelectConfig(
            tasks=str(pool),
            runs_per_task=4,
            out=str(tmp_path / "selection.json"),
            trajectories=str(kept),
            transport=LOOPBACK,
            local_actor=True,
            local_actor_args=[*ACTOR, "scripted_quit_prob=0.4"],
            timeout_s=120,
        )
    )
    result = run_selection(cfg)
    assert result["trajectories"] == str(kept)
    ids = list(result["tasks"])
    train = set(ids[:4])  # the last two tasks are not trained on: their successes stay out
    store = ReplayStore(max_bytes=1 << 30, fresh_capacity=64, replay_capacity=2, seed=0)
    try:
        n = prefill_replay(store, str(kept), train, ReplayConfig(capacity=2))
        for tid in ids:
            k = result["tasks"][tid]["successes"]
            if tid not in train:
                assert tid not in store.tasks()
                continue
            assert (store.replay_len(tid) if k else 0) == min(k, 2)
            if k:
                got = [store_item.from_item(i) for i in store.sample(tid, 2, mode="newest")]
                assert all(t.task_id == tid and t.checker_score >= 1.0 for t in got)
                assert all(t.status == Status.OK for t in got)
        assert n == sum(result["tasks"][t]["successes"] for t in train)
        assert 0 < n < 4 * 4  # the scripted policy gave up some episodes: failures skipped
    finally:
        store.close()
    # The folder already holds episodes: a second selection into it is refused.
    with pytest.raises(ConfigError, match="trajectories"):
        run_selection(cfg)
    with pytest.raises(ConfigError, match=r"assemble\.replay\.prefill"):
        prefill_replay(
            ReplayStore(max_bytes=1 << 20), str(tmp_path / "none"), train, ReplayConfig()
        )

"""Grants routed by environment pool, end to end: one real `arpo-actor` process with two
simulated desktops of its own (pool "sim") and, as its URL environment, a simulated desktop
server running as a separate process but labelled as another pool ("other").

The "other" tasks are simulated tasks whose dict says `"pool": "other"`, generated for the
external desktop's screen (1024x768); the in-process desktops are 1280x720 and refuse a scene
made for another screen (and the external one refuses theirs), so a task sent to the wrong
kind of environment cannot succeed. The learner side is the real one (grant server, ingest,
the Rust store); the policy is the scripted one, so every episode should succeed.
"""

from __future__ import annotations

import collections
import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from arpo_envs.sim.tasks import generate_tasks
from conftest import sim_desktop

from arpo import store_item
from arpo.buffer import ReplayStore
from arpo.env.task import task_pool
from arpo.record import Status
from arpo.service.grants import GrantBook, GrantConfig, GrantServer
from arpo.service.ingest import Ingest, IngestConfig
from arpo.transport import TransportConfig


def _wait_for(cond, what: str, proc: subprocess.Popen, log: Path, timeout: float = 180.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(
                f"the actor exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
            )
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-4000:]}")
        time.sleep(0.05)


def test_sim_and_other_pool_tasks_run_only_on_their_own_environments(tmp_path: Path) -> None:
    sim = [t for f in ("click_button", "type_submit") for t in generate_tasks(f, 2, seed=11)]
    other = generate_tasks("click_sequence", 2, seed=12, screen=(1024, 768))
    other += generate_tasks("menu_pick", 1, seed=12, screen=(1024, 768))
    for t in other:
        t["pool"] = "other"
    tasks = {t["id"]: t for t in sim + other}
    assert collections.Counter(task_pool(t) for t in tasks.values()) == {"sim": 4, "other": 3}

    # Version 0 admits 8 groups of 2 (all pools together); both pools ask from the start.
    book = GrantBook(list(tasks.values()), GrantConfig(group_size=2, groups_per_step=8,
                                                       max_staleness=0, retry_s=0.2))  # fmt: skip
    grants = GrantServer(book, TransportConfig(control="tcp://127.0.0.1:0"))
    control = grants.start()
    store = ReplayStore(max_bytes=1 << 30, fresh_capacity=1024, seed=0)
    ingest = Ingest(
        store,
        IngestConfig(seen_log=str(tmp_path / "seen.log")),
        TransportConfig(data="tcp://127.0.0.1:0"),
        version=lambda: grants.version,
        on_trajectory=book.complete,
    )
    data = ingest.start()
    server, url = sim_desktop("--width", "1024", "--height", "768")
    log = tmp_path / "actor.log"
    args = [
        sys.executable, "-m", "arpo.actor.cli", "--log-level", "DEBUG",
        "sim_envs=2", f"envs=[{url!r}]", "env_pool='other'", "policy='scripted'",
        "actor_id='mixed'", f"spool_dir={str(tmp_path / 'spool')!r}",
        f"transport.data={data!r}", f"transport.control={control!r}",
        "episode.scroll_clicks=1", "progress_s=0",
    ]  # fmt: skip
    with log.open("wb") as err:
        actor = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err)
    try:
        stored = lambda: sum(store.fresh_len(t) for t in store.tasks())  # noqa: E731
        _wait_for(lambda: stored() >= 16, "16 stored episodes", actor, log)
        actor.send_signal(signal.SIGTERM)
        assert actor.wait(120) == 0, log.read_text()[-4000:]
        with urllib.request.urlopen(f"{url}/sim/stats", timeout=10) as r:
            external_scenes = json.loads(r.read())["scene"]["count"]
    finally:
        if actor.poll() is None:
            actor.kill()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        assert server.stdout is not None
        server.stdout.close()
        ingest.stop()
        grants.stop()
    trajs = [
        store_item.from_item(i)
        for t in store.tasks()
        for i in store.take_group(t, store.fresh_len(t), 0)
    ]
    store.close()
    text = log.read_text()

    # Every episode succeeded: none was sent to an environment that cannot run it.
    assert len(trajs) == 16 and len({t.trajectory_id for t in trajs}) == 16
    assert all(t.status == Status.OK and t.checker_score == 1.0 for t in trajs)
    assert ingest.stats().get("excluded_env_error", 0) == 0
    assert book.stats().get("regrant_env_error", 0) == 0
    by_pool = collections.Counter(task_pool(tasks[t.task_id]) for t in trajs)
    assert by_pool["sim"] >= 2 and by_pool["other"] >= 2, by_pool
    # The groups filled to their size within one pool.
    groups: dict[str, set[str]] = collections.defaultdict(set)
    for t in trajs:
        groups[t.group_id].add(task_pool(tasks[t.task_id]))
    assert all(len(p) == 1 for p in groups.values())
    assert set(collections.Counter(t.group_id for t in trajs).values()) == {2}

    # Which environment ran each trajectory, from the actor's own log.
    pattern = r"env \d+ \(pool '[^']+', (\S+)\) ran trajectory (\S+) of task"
    ran = {tid: env for env, tid in re.findall(pattern, text)}
    for t in trajs:
        env = ran[t.trajectory_id]
        assert (env == url) == (task_pool(tasks[t.task_id]) == "other"), (env, t.task_id)
    # The external desktop loaded a scene for every "other" episode the actor ran, and only
    # for those (the ones delivered after the store count was reached are in the log too).
    other_run = sum(1 for env in ran.values() if env == url)
    assert external_scenes == other_run >= by_pool["other"]
    assert "2 in pool 'sim'" in text and "1 in pool 'other'" in text

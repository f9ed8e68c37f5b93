"""The local task suite (envs/arpo_envs/tasks): every task file parses, is runnable by the runner,
ships its files and an oracle; on the real local desktop every oracle scores 1 and doing nothing
scores below 1.

The desktop runs are skipped when the local desktop cannot start here (no `arpo-envs up`, no
Xvfb); `ARPO_DESKTOP_URL=http://127.0.0.1:5000` runs them against a desktop that is already up.
The default run plays a subset across the domains; `make test-all` plays a third of the
suite a day (tests/day_shard.py; ARPO_LOCAL_SUITE_SHARD=all for every task).
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from arpo_envs.procs import free_port
from arpo_envs.tasks import OSWORLD_ORACLES, SUITE_DIR, osworld_oracles
from arpo_envs.tasks.generate import write_suite
from day_shard import sweep_shard
from osworld_fixtures.peer import Peer

from arpo.env import (
    ClientConfig,
    EnvClient,
    Environment,
    RunnerConfig,
    TaskRunner,
    load_task,
    load_task_set,
    load_tasks,
    unsupported,
)
from arpo.env.task import Task
from arpo.errors import TaskError

OSWORLD_DIR = Path(
    os.environ.get("ARPO_OSWORLD_DIR", Path(__file__).resolve().parents[2] / "shared" / "osworld")
)
SUBSET = (
    "calc-line-costs",
    "calc-delete-row",
    "editor-check-item",
    "os-run-typed-command",
    "os-move-logs",
    "multi-note-to-sheet",
)
"""One-to-seven-step tasks across the four domains, for the default test run
(`editor-append-line` and `calc-set-quantity` play in tests/test_osworld_local_e2e.py)."""


def suite() -> list[Task]:
    return load_tasks(SUITE_DIR)


# ---- the files -------------------------------------------------------------------------------


def test_every_task_parses_has_an_oracle_and_is_supported():
    tasks = suite()
    assert len(tasks) >= 40
    assert len({t.id for t in tasks}) == len(tasks)
    by_domain: dict[str, int] = {}
    for t in tasks:
        by_domain[t.domain] = by_domain.get(t.domain, 0) + 1
        oracle = t.extra.get("oracle")
        assert isinstance(oracle, list) and oracle, t.id
        assert all(isinstance(a, str) and a not in ("DONE", "FAIL") for a in oracle), t.id
        for action in oracle:  # each action is Python the server can run after its prefix
            ast.parse(action)
        assert unsupported(t) == [], (t.id, unsupported(t))
        assert not any(s.type == "download" for s in t.config), t.id  # offline
        assert t.instruction and not t.is_infeasible
    assert set(by_domain) == {"libreoffice_calc", "text_editor", "os", "multi_apps"}
    assert all(n >= 6 for n in by_domain.values()), by_domain
    lengths = sorted(len(t.extra["oracle"]) for t in tasks)
    assert lengths[0] == 1 and lengths[-1] >= 7  # from one action to many


def test_index_lists_every_task_in_domain_order():
    indexed = load_task_set(SUITE_DIR, "test_all.json")
    assert sorted(t.id for t in indexed) == sorted(t.id for t in suite())


def test_uploaded_files_ship_beside_the_task_files():
    for t in suite():
        folder = Path(t.path).parent
        for step in (*t.config, *t.evaluator.postconfig):
            if step.type == "upload_file":
                for f in step.parameters["files"]:
                    assert (folder / f["local_path"]).is_file(), (t.id, f)
                    assert f["path"].startswith("/home/user/"), (t.id, f)


def test_committed_suite_is_what_the_generator_writes(tmp_path):
    write_suite(tmp_path / "local")
    fresh = {
        p.relative_to(tmp_path / "local"): p.read_bytes()
        for p in (tmp_path / "local").rglob("*")
        if p.is_file()
    }
    shipped = {
        p.relative_to(SUITE_DIR): p.read_bytes() for p in SUITE_DIR.rglob("*") if p.is_file()
    }
    assert fresh.keys() == shipped.keys()
    stale = [str(k) for k in fresh if fresh[k] != shipped[k]]
    assert not stale, f"run `python -m arpo_envs.tasks.generate`: {stale}"


def test_osworld_oracles_name_benchmark_tasks_the_runner_supports():
    oracles = osworld_oracles()
    assert oracles
    for tid, actions in oracles.items():
        found = list((OSWORLD_DIR / "evaluation_examples" / "examples").glob(f"*/{tid}.json"))
        if not found:
            pytest.skip(f"OSWorld task files are not at {OSWORLD_DIR}")
        t = load_task(found[0])
        assert unsupported(t) == [], (tid, unsupported(t))
        assert not any(s.type == "download" for s in (*t.config, *t.evaluator.postconfig)), tid
        assert actions and all(isinstance(a, str) for a in actions)
        assert json.loads(OSWORLD_ORACLES.read_text())[tid]["domain"] == t.domain


# ---- the runner reads upload_file's relative local_path from the task file's folder ----------


def test_upload_file_relative_path_is_read_from_the_task_folder(tmp_path, monkeypatch):
    folder = tmp_path / "tasks" / "calc"
    (folder / "t1").mkdir(parents=True)
    (folder / "t1" / "in.txt").write_bytes(b"shipped")
    raw = {
        "id": "t1",
        "instruction": "x",
        "config": [
            {
                "type": "upload_file",
                "parameters": {"files": [{"local_path": "t1/in.txt", "path": "/home/user/in.txt"}]},
            }
        ],
        "evaluator": {"func": "infeasible"},
    }
    (folder / "t1.json").write_text(json.dumps(raw))
    (tmp_path / "cwd" / "t1").mkdir(parents=True)
    (tmp_path / "cwd" / "t1" / "in.txt").write_bytes(b"from cwd")

    async def main(task: Task) -> bytes:
        peer = await Peer().start()
        client = EnvClient(ClientConfig(base_url=peer.url, max_retries=0))
        runner = TaskRunner(client, RunnerConfig())
        try:
            await runner.setup(task)
            return peer.files["/home/user/in.txt"]
        finally:
            runner.close()
            await client.close()
            await peer.stop()

    # Only the task file's folder: never the working directory, whatever it holds.
    monkeypatch.chdir(tmp_path / "cwd")
    assert asyncio.run(main(load_task(folder / "t1.json"))) == b"shipped"
    no_path = Task.from_dict(raw, domain="calc")  # not read from a file, no content reference
    with pytest.raises(TaskError, match="not read from a file"):
        asyncio.run(main(no_path))


# ---- on the real local desktop ---------------------------------------------------------------


@pytest.fixture(scope="module")
def desktop_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of one real local desktop: $ARPO_DESKTOP_URL, or one started with `arpo-envs up`."""
    if os.environ.get("ARPO_DESKTOP_URL"):
        yield os.environ["ARPO_DESKTOP_URL"]
        return
    try:
        import arpo_envs.desktop.fleet  # noqa: F401  (`arpo-envs up`)
    except ImportError:
        pytest.skip("the local desktop server (arpo_envs.desktop.fleet) is not installed")
    missing = [
        b for b in ("Xvfb", "openbox", "soffice", "mousepad", "xterm") if not shutil.which(b)
    ]
    if missing:
        pytest.skip(f"the local desktop needs {missing} (see the Makefile's desktop packages)")
    port = free_port()
    tmp = tmp_path_factory.mktemp("desktop")
    log = tmp / "up.log"
    with log.open("w") as out:  # a file, not a pipe: `up` may print while nobody reads
        proc = subprocess.Popen(
            [sys.executable, "-m", "arpo_envs.cli", "up", "-n", "1", "--base-port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # its own state file, not the machine-wide one a developer's `up` uses
            env={**os.environ, "ARPO_DESKTOP_STATE": str(tmp / "state.json")},
        )
    url, deadline = None, time.monotonic() + 120
    while url is None and proc.poll() is None and time.monotonic() < deadline:
        m = re.search(r"^env 0 (\S+)", log.read_text(), re.M)
        url = m.group(1) if m else None
        time.sleep(0.2)
    if url is None:
        proc.kill()
        proc.wait()
        pytest.fail("arpo-envs up did not announce a desktop:\n" + log.read_text()[-3000:])
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


async def _play(url: str, tasks: list[Task], oracle: bool) -> list[tuple[str, float, str, str]]:
    """Run each task on the desktop (reset first), with its oracle or with no action at all."""
    out = []
    env = Environment(0, url, RunnerConfig(reset_before_setup=True))
    try:
        await env.client.wait_ready(deadline_s=120)
        for t in tasks:
            actions = [*t.extra["oracle"], "DONE"] if oracle else ["DONE"]
            res = await env.run(t, actions)
            env.runner.close()
            out.append((t.id, res.score, res.status, res.error or ""))
    finally:
        await env.close()
    return out


def _check_oracles(url: str, tasks: list[Task]) -> None:
    results = asyncio.run(_play(url, tasks, oracle=True))
    failed = [r for r in results if r[1] != 1.0]
    assert not failed, f"{len(failed)}/{len(results)} oracles did not score 1: {failed}"


def _check_noop(url: str, tasks: list[Task]) -> None:
    results = asyncio.run(_play(url, tasks, oracle=False))
    solved = [r for r in results if not (r[1] < 1.0 and r[2] == "ok")]
    assert not solved, f"doing nothing scored 1 or did not check: {solved}"


@pytest.mark.slow
def test_oracles_solve_a_subset_on_the_desktop(desktop_url):
    tasks = [t for t in suite() if t.id in SUBSET]
    assert len(tasks) == len(SUBSET)
    _check_oracles(desktop_url, tasks)


def test_doing_nothing_fails_a_subset_on_the_desktop(desktop_url):
    _check_noop(desktop_url, [t for t in suite() if t.id in SUBSET])


LOCAL_SHARD_OFFSET = 1
"""The sweeps below play the shard after the one tests/test_osworld_local_e2e.py plays with
both checkers (which also asserts that oracles solve and doing nothing fails), so that one
day of test-all checks two thirds of the suite on the local desktop."""


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_oracles_solve_one_shard_of_the_tasks_on_the_desktop(desktop_url):
    """One shard a day (tests/day_shard.py; ARPO_LOCAL_SUITE_SHARD=all for every task)."""
    tasks, _ = sweep_shard(suite(), "ARPO_LOCAL_SUITE_SHARD", LOCAL_SHARD_OFFSET)
    _check_oracles(desktop_url, tasks)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_doing_nothing_fails_one_shard_of_the_tasks_on_the_desktop(desktop_url):
    tasks, _ = sweep_shard(suite(), "ARPO_LOCAL_SUITE_SHARD", LOCAL_SHARD_OFFSET)
    _check_noop(desktop_url, tasks)


@pytest.mark.slow
def test_osworld_oracles_solve_their_tasks_on_the_desktop(desktop_url):
    examples = OSWORLD_DIR / "evaluation_examples" / "examples"
    if not examples.is_dir():
        pytest.skip(f"OSWorld task files are not at {OSWORLD_DIR}")
    oracles = osworld_oracles()
    tasks = []
    for tid in oracles:
        t = load_task(next(examples.glob(f"*/{tid}.json")))
        tasks.append(
            Task.from_dict(
                {**json.loads(Path(t.path).read_text()), "oracle": oracles[tid]},
                domain=t.domain,
                path=t.path,
            )
        )
    _check_oracles(desktop_url, tasks)

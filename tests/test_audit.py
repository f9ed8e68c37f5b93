"""`arpo audit-tasks` (arpo.pool.audit): every task set up on a real environment of its pool,
its checker scored on the untouched state and after its oracle; simulated desktops in this
process, and real local desktops (Xvfb + LibreOffice Calc) started and stopped by the command."""

from __future__ import annotations

import asyncio
import copy
import json
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import pytest
from arpo_envs.sim.server import SimConfig, running
from arpo_envs.sim.tasks import generate_tasks, write_tasks

from arpo import cli
from arpo.config import load_config
from arpo.env.runner import RunnerConfig
from arpo.env.task import load_pool
from arpo.env.taskfiles import BlobCache, FileRef, FileSource, TaskFiles, upload_entries
from arpo.pool.audit import VERDICTS, AuditConfig, EnvSpec, audit_tasks, command_line, run_audit

DESKTOP_PROGRAMS = ("Xvfb", "openbox", "soffice", "mousepad", "xterm")
MISSING = [b for b in DESKTOP_PROGRAMS if not shutil.which(b)]


def _write(folder: Path, task: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{task['id']}.json").write_text(json.dumps(task, indent=2))


def _md_rows(md: str) -> dict[str, list[str]]:
    """The task table of a report's Markdown: task id -> its cells."""
    rows = {}
    table = md.split("## Tasks", 1)[1]
    for line in table.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 10 and cells[0] not in ("task", "---"):
            rows[cells[0]] = cells
    return rows


def _agree(report: dict[str, Any], out: Path) -> None:
    """The JSON file is the report, and the Markdown says the same of every task."""
    assert json.loads(out.with_name(out.name + ".json").read_text()) == report
    md = out.with_name(out.name + ".md").read_text()
    assert report["command"] in md.splitlines()[:5]
    rows = _md_rows(md)
    assert set(rows) == {t["task_id"] for t in report["tasks"]}
    for t in report["tasks"]:
        cells = rows[t["task_id"]]
        score = lambda x: "-" if x is None else f"{x:g}"  # noqa: E731
        assert cells[3] == ("ok" if t["setup_ok"] else "failed"), cells
        assert (cells[5], cells[6], cells[8]) == (
            score(t["do_nothing_score"]), score(t["oracle_score"]), t["verdict"],
        )  # fmt: skip
    for v in VERDICTS:
        assert f"| {v} | {report['summary'][v]} |" in md


@pytest.fixture
def sim_pool(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """Generated tasks of two families, plus: a broken task (a scene of an unknown family),
    a lax one (its checker also passes the untouched scene), one of a pool nobody serves.
    Returns the folder and id -> the verdict the audit must give."""
    root = tmp_path / "tasks"
    index = write_tasks(root, ["click_button", "type_submit"], 2, seed=3)
    expect = {tid: "ok" for ids in index.values() for tid in ids}
    base = generate_tasks("click_button", 1, seed=11)[0]

    broken = copy.deepcopy(base)
    broken["id"] = "broken-scene"
    broken["config"][0]["parameters"]["family"] = "no_such_family"
    _write(root / "extra", broken)
    expect["broken-scene"] = "setup_failed"

    # click_button's checker is exact_match of the clicked labels against [label]. A lax
    # version accepts the list of no click as well: the oracle still scores 1, and so
    # does doing nothing.
    lax = copy.deepcopy(base)
    lax["id"] = "lax-checker"
    wanted = base["evaluator"]["expected"]["rules"]["expected"]
    lax["evaluator"]["func"] = "match_in_list"
    lax["evaluator"]["expected"] = {"type": "rule", "rules": {"expected": [wanted, []]}}
    _write(root / "extra", lax)
    expect["lax-checker"] = "do_nothing_scores"

    elsewhere = copy.deepcopy(base)
    elsewhere["id"] = "gpu-pool-task"
    elsewhere["pool"] = "gpu"
    _write(root / "extra", elsewhere)
    expect["gpu-pool-task"] = "setup_failed"
    return root, expect


def test_audit_on_simulated_desktops_names_broken_lax_and_unserved_tasks(
    sim_pool: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    root, expect = sim_pool
    out = tmp_path / "report" / "audit"
    args = ["audit-tasks", f"tasks={root}", f"out={out}", "sim_envs=2"]
    assert cli.main(args) == 1  # strict: a task that is not ok fails the command
    report = json.loads(out.with_name("audit.json").read_text())
    got = {t["task_id"]: t for t in report["tasks"]}
    assert {k: t["verdict"] for k, t in got.items()} == expect  # every task, none skipped

    broken = got["broken-scene"]
    assert not broken["setup_ok"] and broken["do_nothing_score"] is None
    assert "TaskError" in broken["reason"] and "no_such_family" in broken["reason"]
    assert got["gpu-pool-task"]["reason"] == "no environment of pool 'gpu'"
    assert got["gpu-pool-task"]["env"] == ""

    lax = got["lax-checker"]
    assert (lax["setup_ok"], lax["do_nothing_score"], lax["oracle_score"]) == (True, 1.0, 1.0)
    assert "doing nothing scores 1" in lax["reason"]

    for tid, verdict in expect.items():
        if verdict == "ok":
            t = got[tid]
            assert (t["setup_ok"], t["do_nothing_score"], t["oracle_score"]) == (True, 0.0, 1.0)
            assert t["reason"] == "" and t["pool"] == "sim" and t["env"].startswith("http://")
            assert t["domain"] in ("click_button", "type_submit")
    assert report["summary"] == {"tasks": 7, "ok": 4, "setup_failed": 2, "eval_error": 0,
                                 "do_nothing_scores": 1, "oracle_fails": 0}  # fmt: skip
    assert report["environments"] == {"sim": {"simulated desktop": 2}}
    _agree(report, out)
    # the command the report names gives the same configuration back
    words = shlex.split(report["command"])
    assert words[:2] == ["arpo", "audit-tasks"]
    assert load_config(AuditConfig, None, words[2:]) == load_config(AuditConfig, None, args[1:])

    # strict=false: exit 0 with the same findings; checks=false: setups only
    assert cli.main([*args, "strict=false", "checks=false"]) == 0
    report = json.loads(out.with_name("audit.json").read_text())
    got = {t["task_id"]: t for t in report["tasks"]}
    assert got["lax-checker"]["verdict"] == "ok"  # nothing checked, and its setup is fine
    assert got["broken-scene"]["verdict"] == "setup_failed"
    assert all(t["do_nothing_score"] is None and t["oracle_score"] is None for t in got.values())


def test_a_task_of_an_environment_that_cannot_revert_goes_to_another(tmp_path: Path) -> None:
    """A failed revert is the environment's fault: the task runs on a healthy environment of
    its pool and the broken one is retired; with none left the tasks say so."""
    root = tmp_path / "tasks"
    write_tasks(root, ["menu_pick"], 3, seed=1)
    index = TaskFiles()
    pool = load_pool(root, index)
    files = FileSource.local(index, BlobCache(tmp_path / "cache"))
    dead = "http://127.0.0.1:9"  # discard port: connection refused

    async def main() -> tuple[list[Any], list[Any]]:
        async with running([SimConfig(port=0)]) as urls:
            envs = {"sim": [EnvSpec(dead, provider="sim"), EnvSpec(urls[0], provider="sim")]}
            mixed = await audit_tasks(pool, envs, files, checks=True)
        only_dead = await audit_tasks(pool, {"sim": [EnvSpec(dead, provider="sim")]}, files,
                                      checks=False, reset_failures=1)  # fmt: skip
        return mixed, only_dead

    mixed, only_dead = asyncio.run(main())
    assert [a.task_id for a in mixed] == [p.task["id"] for p in pool]  # the pool's order
    assert all(a.verdict == "ok" and a.env != dead for a in mixed), mixed
    assert all(a.verdict == "setup_failed" for a in only_dead)
    assert all("every environment of pool 'sim' was retired" in a.reason for a in only_dead)
    assert "ResetError" in only_dead[0].reason


def test_a_setup_that_hangs_is_cut_by_the_task_timeout(tmp_path: Path) -> None:
    task = generate_tasks("click_button", 1, seed=2)[0]
    task["config"].append({"type": "sleep", "parameters": {"seconds": 60}})

    async def main() -> list[Any]:
        async with running([SimConfig(port=0)]) as urls:
            # setup sleeps are waited here (sleep_scale 1), as on a real desktop
            spec = EnvSpec(urls[0], provider="sim",
                           runner=RunnerConfig(reset_before_setup=True, evaluator="own"))  # fmt: skip
            return await audit_tasks([task], {"sim": [spec]}, None, checks=True,
                                     task_timeout_s=1.0)  # fmt: skip

    [a] = asyncio.run(main())
    assert a.verdict == "setup_failed" and not a.setup_ok
    assert "timeout" in a.reason and "in the setup" in a.reason
    assert a.seconds < 10


def test_config_errors_say_how_to_fix_them(tmp_path: Path) -> None:
    from arpo.errors import ConfigError

    with pytest.raises(ConfigError, match="tasks=envs/arpo_envs/tasks/local"):
        load_config(AuditConfig, None, [])
    # a pool of one task (the pool is loaded when the command starts)
    (tmp_path / "t.json").write_text(json.dumps(generate_tasks("click_button", 1, seed=0)[0]))
    with pytest.raises(ConfigError, match="one per URL"):
        load_config(AuditConfig, None, [f"tasks={tmp_path}", 'env_urls=["http://a:1"]',
                                        'env_tokens=["x", "y"]'])  # fmt: skip
    cfg = load_config(AuditConfig, None, [f"tasks={tmp_path}", "note=a b|c", "task_timeout_s=9"])
    assert (
        command_line(cfg)
        == f"arpo audit-tasks tasks={tmp_path} task_timeout_s=9.0 'note=\"a b|c\"'"
    )


@pytest.mark.skipif(bool(MISSING), reason=f"desktop programs missing: {MISSING} (make sysdeps)")
def test_audit_on_real_local_desktops_fetches_calc_files_by_content(tmp_path: Path) -> None:
    import arpo_envs.tasks as suite

    calc = Path(suite.__file__).parent / "local" / "libreoffice_calc"
    root = tmp_path / "tasks" / "libreoffice_calc"
    ids = ["calc-set-quantity", "calc-header-cost", "calc-sum-quantity"]
    for tid in ids:
        root.mkdir(parents=True, exist_ok=True)
        shutil.copy(calc / f"{tid}.json", root)
        shutil.copytree(calc / tid, root / tid)
    refs = [FileRef.of(f) for p in load_pool(root, TaskFiles()) for f in upload_entries(p.task)]
    shas = {r.sha256 for r in refs if r is not None}
    assert len(shas) >= 3  # every task uploads its workbook (and its checker's gold copy)

    out = tmp_path / "audit"
    cfg = load_config(AuditConfig, None, [f"tasks={root.parent}", f"out={out}",
                                          "local_desktops=2", "task_timeout_s=120"])  # fmt: skip
    report = run_audit(cfg)
    got = {t["task_id"]: t for t in report["tasks"]}
    assert set(got) == set(ids)
    for tid, t in got.items():
        assert (t["verdict"], t["setup_ok"], t["do_nothing_score"], t["oracle_score"]) == (
            "ok", True, 0.0, 1.0,
        ), (tid, t["reason"])  # fmt: skip
        assert t["pool"] == "desktop" and t["domain"] == "libreoffice_calc"
    # Each file came through the file source by content, once; the second setup of a task
    # (the oracle run) finds it in the cache.
    assert report["files"]["fetched"] == len(shas) and report["files"]["refused"] == 0
    assert report["files"]["hits"] > 0
    assert report["environments"] == {"desktop": {"local desktop": 2}}
    _agree(report, out)

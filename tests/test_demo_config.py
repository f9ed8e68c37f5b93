"""`make demo`'s own configuration, shortened: the default task set (the simulated tasks
and the local suite, whose LibreOffice tasks upload their spreadsheets) on two real local
desktops, started from a working folder outside the repository. Every task is set up by
the preflight, and the run trains every iteration (this is what `make demo` runs)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from arpo.learner.metrics import read_metrics
from arpo.policy.tiny import build_tiny_model

REPO = Path(__file__).resolve().parents[1]
MISSING = [b for b in ("Xvfb", "openbox", "soffice", "mousepad", "xterm") if not shutil.which(b)]


@pytest.mark.slow
@pytest.mark.skipif(bool(MISSING), reason=f"desktop programs missing: {MISSING} (make sysdeps)")
def test_the_demo_configuration_sets_up_every_task_and_trains(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    work = tmp_path / "elsewhere"  # not the repository: nothing may depend on its cwd
    work.mkdir()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    before = _desktop_procs(work)
    proc = subprocess.run(
        [sys.executable, "-m", "arpo.cli", "train", "run_dir=run", "local_desktops=2",
         f"model={model}", "learner.iterations=3", "eval_runs_per_task=0",
         "prefill_runs_per_task=0", "progress_s=0"],
        cwd=work, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    run = work / "run"
    summary = json.loads((run / "summary.json").read_text())
    pre = summary["preflight"]
    local = REPO / "envs" / "arpo_envs" / "tasks" / "local"
    n_local = sum(1 for f in local.rglob("*.json") if "evaluator" in json.loads(f.read_text()))
    assert pre["tasks"] == n_local + 8 and pre["left_out"] == {}, pre  # every task set up
    assert summary["tasks_out"] == {}
    calc = json.loads((run / "preflight.json").read_text())["tasks"]
    assert sum(t["task_id"].startswith("calc-") and t["verdict"] == "ok" for t in calc) >= 10
    rows = read_metrics(run / "learner" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    acc = summary["accounting"]
    assert acc["unaccounted"] == 0 and acc["trained_twice"] == 0, acc
    assert set(acc["finished_by_status"]) == {"ok"}, acc  # no setup or environment error
    # the desktops' actor ran real episodes, its task files fetched by content
    assert "actor-1" in {p.name for p in (run / "spool").iterdir()}
    assert any((run / "task-files").rglob("*")), "no task file fetched by the actors"
    # the run stopped everything it started: no process of it is left (its desktops named
    # by what their start announced: other tests may run desktops beside this one)
    started = re.findall(r"desktop: env \d+ \S+ display \S+ pid (\d+)", proc.stderr)
    assert len(started) == 2, proc.stderr[-3000:]
    mine = {int(pid) for pid in started}
    left = {
        (pid, cmd) for pid, cmd in _desktop_procs(work) - before
        if pid in mine or "arpo.actor.cli" in cmd or "arpo.learner.cli" in cmd
        or (cmd.startswith("Xvfb") and not _has_live_server_parent(pid))  # an orphan
    }  # fmt: skip
    assert not left, left


def _desktop_procs(work: Path) -> set[tuple[int, str]]:
    """(pid, command) of every desktop server and Xvfb, and of the actors and learners of
    runs under `work` (not those of other runs on the machine)."""
    out = set()
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if d.name.isdigit() and (
            "arpo_envs.desktop.server" in cmd
            or cmd.startswith("Xvfb")
            or (
                ("arpo.actor.cli" in cmd or "arpo.learner.cli" in cmd)
                and str(work.resolve()) in cmd
            )
        ):
            out.add((int(d.name), cmd[:200]))
    return out


def _has_live_server_parent(pid: int) -> bool:
    """`pid`'s parent is a running desktop server (another test's desktop, not an orphan)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        cmd = Path(f"/proc/{ppid}/cmdline").read_bytes().replace(b"\0", b" ")
    except (OSError, ValueError, IndexError):
        return False
    return b"arpo_envs.desktop.server" in cmd

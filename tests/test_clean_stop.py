"""`arpo train` ends cleanly: the actors stop first (all at once) and hand in what they hold to a
learner that is still there, then the learner; no traceback or ERROR line in any log of a run
that succeeded; every finished trajectory accounted for. SIGTERM to `arpo train` stops all its
children, the local desktops included.

Before: the learner left as soon as it had run its iterations, then each actor in turn waited
10 s for the data link that had gone and 30 s for acknowledgements that could not come, and
unawaited sends logged `Future exception was never retrieved` tracebacks.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from arpo.config import load_config
from arpo.policy.tiny import build_tiny_model
from arpo.train import TrainConfig, TrainRun


def _run_processes(marker: str) -> list[int]:
    """Pids of processes whose command line mentions `marker`."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            out.append(int(d.name))
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_actors_stop_first_and_no_log_holds_an_error(tmp_path: Path, caplog) -> None:
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    cfg = load_config(
        TrainConfig,
        None,
        [
            f"run_dir={str(tmp_path / 'run')!r}",
            f"model={str(model)!r}",
            "sim_tasks_per_family=2",
            "prefill_runs_per_task=0",
            "eval_runs_per_task=0",
            "learner.iterations=3",
            "actors=2",
            "sim_envs_per_actor=2",
            "progress_s=0",
            "restart=false",
        ],
    )
    caplog.set_level(logging.INFO, logger="arpo.train")
    run = TrainRun(cfg)
    run.run()
    lines = [r.getMessage() for r in caplog.records if r.name == "arpo.train"]

    def at(pattern: str) -> int:
        hits = [i for i, m in enumerate(lines) if re.search(pattern, m)]
        assert hits, f"no log line matches {pattern!r}: {lines}"
        return hits[0]

    assert at("finished its iterations: stopping the actors") < at("actors stopped in")
    assert at("actors stopped in") < at("learner stopped")
    for log_file in sorted((tmp_path / "run" / "logs").glob("*.log")):
        text = log_file.read_text(errors="replace")
        assert "Traceback" not in text and " ERROR " not in text, (log_file.name, text[-3000:])
    learner_log = (tmp_path / "run" / "logs" / "learner.log").read_text()
    assert "no more grants" in learner_log
    acc = run.summary["accounting"]
    assert acc["unaccounted"] == 0 and acc["trained_twice"] == 0, acc
    assert acc["finished"] > 0 and acc["in_spool"] == 0, acc


# In `make test-all`: `make test` has the first signal's stop in test_train_signals and a run
# on real desktops that must leave none running in test_demo_config.
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(shutil.which("Xvfb") is None, reason="needs Xvfb (make sysdeps)")
def test_sigterm_stops_every_child_of_arpo_train_desktops_included(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    run_dir = tmp_path / "run"
    err = (tmp_path / "train.log").open("wb")
    p = subprocess.Popen(
        [sys.executable, "-m", "arpo.cli", "train", f"run_dir={str(run_dir)!r}",
         f"model={str(model)!r}", "sim_tasks_per_family=2", "prefill_runs_per_task=0",
         "eval_runs_per_task=0", "learner.iterations=1000", "local_desktops=1",
         "progress_s=0"],
        stdout=subprocess.DEVNULL, stderr=err,
    )  # fmt: skip
    try:
        end = time.monotonic() + 300
        while time.monotonic() < end and not (run_dir / "learner" / "metrics.jsonl").exists():
            assert p.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
            time.sleep(1)
        children = _run_processes(str(run_dir))
        assert len(children) >= 3, children  # learner, actors, the desktop (and its Xvfb)
        p.send_signal(signal.SIGTERM)
        p.wait(240)
        time.sleep(1)
        left = _run_processes(str(run_dir))
        assert left == [], [Path(f"/proc/{q}/cmdline").read_bytes() for q in left]
    finally:
        if p.poll() is None:
            p.kill()
        err.close()

"""`arpo train resume=true`: a run whose `arpo train` was SIGKILLed (its machine, or its Ray
node, lost) is continued from the learner's last checkpoint and journal, and finishes with
every trajectory accounted for across both starts; the processes of the killed start die
with it, so nothing of it writes into the run any more."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from train_configs import small_run

from arpo.config import to_toml
from arpo.learner.metrics import read_metrics


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not running
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _train(config: Path, out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "arpo.train", "--config", str(config), *extra]
    with out.open("ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_a_run_whose_driver_was_killed_is_resumed_and_accounts_for_everything(
    tmp_path: Path,
) -> None:
    from arpo_envs.sim.tasks import write_tasks

    from arpo.policy.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", seed=0)
    write_tasks(tmp_path / "tasks", ["click_button"], 4, seed=0)
    (tmp_path / "tasks" / "test_all.json").unlink()
    cfg = small_run(tmp_path, model, tmp_path / "tasks", iterations=4, max_new_tokens=16,
                    actors=1, sim_envs_per_actor=2, preflight=True)  # fmt: skip
    config = tmp_path / "run.toml"
    config.write_text(to_toml(cfg))
    run = tmp_path / "run"
    out = tmp_path / "train.out"

    # Resuming a run that never started is refused, naming the folder.
    empty = subprocess.run(
        [sys.executable, "-m", "arpo.train", "--config", str(config), "resume=true",
         f"run_dir={tmp_path / 'nothing'}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert empty.returncode != 0 and "holds no checkpoint and no journal" in empty.stderr

    first = _train(config, out)
    metrics = run / "learner" / "metrics.jsonl"
    try:
        end = time.monotonic() + 240
        while not (metrics.exists() and read_metrics(metrics)):
            assert first.poll() is None, out.read_text()[-3000:]
            assert time.monotonic() < end, "no iteration in 240 s"
            time.sleep(0.5)
    finally:
        first.kill()  # SIGKILL: no handler runs, nothing is stopped cleanly
        first.wait(30)
    pids = [int(p) for p in re.findall(r"(?:learner|actor-\d+): pid (\d+)", out.read_text())]
    assert len(pids) >= 2, out.read_text()[-3000:]
    end = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "the killed start's learner or actor runs on"
    steps_before = [r["step"] for r in read_metrics(metrics)]

    second = _train(config, out, "resume=true")
    try:
        code = second.wait(300)
    except subprocess.TimeoutExpired:
        second.kill()
        raise AssertionError(f"resumed run unfinished: {out.read_text()[-3000:]}") from None
    assert code == 0, out.read_text()[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["resumes"] == 1, summary
    text = out.read_text()
    assert "continuing the run" in text and "preflight: setting up" not in text.split(
        "continuing the run")[1], "the resumed start ran the preflight again"  # fmt: skip
    learner_log = (run / "logs" / "learner.log").read_text()
    assert re.search(r"resuming from \S+ \(iteration \d\)", learner_log), learner_log[-2000:]
    rows = read_metrics(metrics)
    assert rows[-1]["step"] == 4 and max(steps_before) < 4, (steps_before, rows)
    acc = summary["accounting"]
    assert acc["unaccounted"] == 0 and acc["trained_twice"] == 0, acc
    assert acc["trained"] >= 4 * 4, acc

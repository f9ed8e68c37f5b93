"""Signals say what they did: the first SIGTERM / SIGINT stops training, evaluates the last
checkpoint and exits 128 + the signal (the run did not finish); a second one stops every
process of the run at once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from arpo_envs.procs import free_port

from arpo.errors import EXIT_STALLED
from arpo.learner.metrics import read_metrics
from arpo.policy.tiny import build_tiny_model
from arpo.train import _descendants


def _start(tmp_path: Path, model: Path) -> tuple[subprocess.Popen, Path]:
    from arpo_envs.sim.tasks import write_tasks

    write_tasks(tmp_path / "tasks", ["click_button"], 2, seed=0)
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "arpo.cli", "train", f"run_dir={run}", f"model={model}",
         f"tasks={tmp_path / 'tasks'}", "warm_start=false", "learner.iterations=500",
         "eval_runs_per_task=2", "eval_warm_start=false", "prefill_runs_per_task=0",
         "prefill_demos_from_turns=0", "sim_envs_per_actor=2", "progress_s=0",
         "learner.assemble.group_size=2", "learner.assemble.groups_per_step=2",
         "learner.checkpoint.every=1", "actor.episode.max_steps=2",
         "actor.episode.max_new_tokens=16"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    return proc, run


def _wait_for_iterations(proc: subprocess.Popen, run: Path, n: int) -> None:
    metrics = run / "learner" / "metrics.jsonl"
    end = time.monotonic() + 400
    while not (metrics.exists() and len(read_metrics(metrics)) >= n):
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.monotonic() < end, "no training iteration in 400 s"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_a_signal_evaluates_the_last_checkpoint_and_exits_non_zero(
    tmp_path: Path, tiny: Path
) -> None:
    proc, run = _start(tmp_path, tiny)
    _wait_for_iterations(proc, run, 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGTERM, err[-4000:]
    assert "stopping: evaluating the last checkpoint; Ctrl-C again stops now" in err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["signal"] == signal.SIGTERM and summary["finished"] is False
    assert summary["checkpoint"] and summary["eval"]  # evaluated what training had reached
    assert (run / "eval" / "eval.md").exists()


@pytest.mark.slow
def test_a_second_signal_stops_everything_at_once(tmp_path: Path, tiny: Path) -> None:
    proc, run = _start(tmp_path, tiny)
    _wait_for_iterations(proc, run, 1)
    children = _descendants(proc.pid)
    assert len(children) >= 2  # the learner and the actor
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert time.monotonic() - t0 < 30
    assert "stopping now" in err
    time.sleep(0.5)
    alive = [p for p in children if Path(f"/proc/{p}").exists()
             and "Z" not in Path(f"/proc/{p}/stat").read_text().split(")")[-1][:3]]  # fmt: skip
    assert not alive, [Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in alive]


# ---- before training: every phase stops what it started, at once ---------------------------


def _alive(pids: list[int]) -> list[str]:
    """The command lines of `pids` still running (zombies are not)."""
    out = []
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().split(")")[-1][:3]
            if "Z" not in state:
                out.append(Path(f"/proc/{p}/cmdline").read_bytes()[:200].decode(errors="replace"))
        except OSError:
            pass
    return out


def _kill_left(pids: list[int]) -> None:
    """What a failing test left running (the processes the defect leaves)."""
    for p in pids:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)


class _Lines:
    """The stderr of a process, read by a thread; `wait_for(text)` until a line holds it."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.text = ""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            with self._lock:
                self.text += line

    def wait_for(self, text: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
        end = time.monotonic() + timeout
        while text not in self.text:
            assert proc.poll() is None, self.text[-4000:]
            assert time.monotonic() < end, f"no {text!r} in {timeout} s: {self.text[-3000:]}"
            time.sleep(0.2)

    def rest(self) -> str:
        self._thread.join(timeout=30)
        return self.text

    def close(self, proc: subprocess.Popen) -> None:
        """Kill `proc` if it still runs; close its pipes once the reader is done."""
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        self._thread.join(timeout=30)
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()


def _train(tmp_path: Path, model: Path, *more: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "arpo.cli", "train", f"run_dir={tmp_path / 'run'}",
         f"model={model}", f"tasks={tmp_path / 'tasks'}", "warm_start=false",
         "learner.iterations=5", "prefill_runs_per_task=0", "prefill_demos_from_turns=0",
         "sim_envs_per_actor=2", "progress_s=0", "learner.assemble.group_size=2",
         "learner.assemble.groups_per_step=2", "actor.episode.max_steps=2",
         "actor.episode.max_new_tokens=16", *more],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.mark.slow
def test_a_signal_during_the_warm_start_evaluation_stops_its_actor_and_says_so(
    tmp_path: Path, tiny: Path
) -> None:
    """SIGTERM to `arpo train` (the process alone, as a supervisor sends it) while the
    starting policy is evaluated: the evaluation's local actor ('eval-local') is stopped,
    nothing of the run is left running, and the exit is 128 + SIGTERM with a line saying
    where the run was stopped."""
    from arpo_envs.sim.tasks import write_tasks

    write_tasks(tmp_path / "tasks", ["click_button"], 2, seed=0)
    proc = _train(tmp_path, tiny, "eval_warm_start=true", "eval_runs_per_task=200")
    lines = _Lines(proc)
    seen: list[int] = []
    try:
        end = time.monotonic() + 300
        while not any("eval-local" in c for c in _alive(seen)):
            assert proc.poll() is None, lines.text[-4000:]
            assert time.monotonic() < end, "the warm start's evaluation did not start"
            seen = _descendants(proc.pid)
            time.sleep(0.3)
        time.sleep(2.0)  # its episodes are running
        seen = _descendants(proc.pid)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        err = lines.rest()
        assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err[-4000:])
        assert time.monotonic() - t0 < 90
        assert "arpo train: stopped by SIGTERM during the starting policy's evaluation" in err
        time.sleep(0.5)
        assert not _alive(seen), _alive(seen)
        assert not (tmp_path / "run" / "learner.toml").exists()  # nothing after it started
    finally:
        lines.close(proc)
        _kill_left(seen)


@pytest.mark.slow
def test_a_signal_during_a_hanging_preflight_stops_it_at_once(tmp_path: Path, tiny: Path) -> None:
    """The preflight's setup of a task hangs (a 10-minute sleep step, waited as on a real
    desktop: the task runs on an environment server of `env_urls`): SIGTERM stops the run
    within seconds, not at the end of the task's bound, with 128 + SIGTERM and a line
    saying so. The bound itself is `preflight_task_timeout_s`: at 2 s the task is left out
    with the timeout as its reason, and with no task left the run stops (exit 3)."""
    from arpo_envs.sim.tasks import generate_tasks
    from test_train_faults import start_sim_server

    (tmp_path / "tasks").mkdir()
    task = generate_tasks("click_button", 1, seed=2)[0]
    task["pool"] = "slow"
    task["config"].append({"type": "sleep", "parameters": {"seconds": 600}})
    (tmp_path / "tasks" / "hangs.json").write_text(json.dumps(task))
    port = free_port()
    server = start_sim_server(port, tmp_path / "sim.log")
    base = ["eval_warm_start=false", "eval_runs_per_task=0", "actors=0",
            f'env_urls=["http://127.0.0.1:{port}"]', "env_pool='slow'"]  # fmt: skip
    try:
        proc = _train(tmp_path, tiny, *base)
        lines = _Lines(proc)
        try:
            lines.wait_for("preflight: setting up each of the 1 tasks", proc)
            time.sleep(3.0)  # in the task's setup, asleep
            seen = _descendants(proc.pid)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
            err = lines.rest()
            assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err[-4000:])
            assert time.monotonic() - t0 < 30
            assert "arpo train: stopped by SIGTERM during the preflight" in err
            assert not _alive(seen), _alive(seen)
            assert not (tmp_path / "run" / "learner.toml").exists()
        finally:
            lines.close(proc)

        proc = _train(tmp_path, tiny, *base, "preflight_task_timeout_s=2")
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == EXIT_STALLED, err[-4000:]
        assert "no task could be set up" in err and "timeout" in err, err[-3000:]
        assert time.monotonic() - t0 < 120
    finally:
        server.kill()
        server.wait()

"""A short training run that survives SIGKILL of its learner, of an actor and of an environment
server, with every trajectory the actors finished accounted for and none trained twice."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from arpo_envs.procs import free_port

pytest.importorskip("torch")
pytest.importorskip("transformers")

from train_configs import small_run

from arpo.actor.spool import read_ledger
from arpo.learner.checkpoint import CheckpointConfig
from arpo.learner.metrics import read_metrics
from arpo.policy.tiny import build_tiny_model
from arpo.train import TrainConfig, TrainRun


def start_sim_server(port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "arpo_envs.cli", "sim", "-n", "1", "--base-port", str(port)]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=out)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"the simulated desktop server did not start: {log.read_text()[-2000:]}")


def wait_for(cond, what: str, timeout: float = 240.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


def fault_run_config(
    tmp_path: Path,
    model: Path,
    port: int,
    *,
    minutes: float = 0,
    iterations: int = 0,
    reset_retries: int = 2,
    max_restarts: int | None = None,
) -> TrainConfig:
    """`arpo train` on the simulated tasks of `tmp_path/tasks`: one actor with 2 simulated
    desktops plus one on the environment server at `port`, small groups, a checkpoint
    every 2 iterations (the fault tests and the soak)."""
    base = TrainConfig()
    return small_run(
        tmp_path, model, tmp_path / "tasks", iterations=iterations,
        checkpoint=CheckpointConfig(every=2, keep=3, verify=False), max_new_tokens=16,
        actor={"shutdown_deadline_s": 30.0},
        environment={"reset_retries": reset_retries, "reset_backoff_s": 0.5},
        actors=1, sim_envs_per_actor=2, env_urls=[f"http://127.0.0.1:{port}"], env_pool="sim",
        minutes=minutes, prefill_runs_per_task=0,
        max_restarts=base.max_restarts if max_restarts is None else max_restarts,
    )  # fmt: skip


def test_training_survives_kills_and_accounts_for_every_trajectory(tmp_path: Path) -> None:
    from arpo_envs.sim.tasks import write_tasks

    model = build_tiny_model(tmp_path / "tiny", seed=0)
    write_tasks(tmp_path / "tasks", ["click_button"], 4, seed=0)
    (tmp_path / "tasks" / "test_all.json").unlink()
    port = free_port()
    server = start_sim_server(port, tmp_path / "server.log")
    cfg = fault_run_config(tmp_path, model, port, iterations=8)
    run = TrainRun(cfg)
    metrics = Path(cfg.run_dir) / "learner" / "metrics.jsonl"
    log: dict[str, object] = {}
    errors: list[BaseException] = []

    def rows() -> list[dict]:
        return read_metrics(metrics) if metrics.exists() else []

    def killer() -> None:
        nonlocal server
        try:
            wait_for(lambda: any(r["step"] >= 2 for r in rows()), "iteration 2")
            n = len(rows())
            os.kill(run.learner.popen.pid, signal.SIGKILL)
            log["learner_killed_after"] = n
            wait_for(lambda: any(r["step"] >= 4 for r in rows()[n:]), "iteration 4 after resume")
            sim_actor = run.procs[0]
            os.kill(sim_actor.popen.pid, signal.SIGKILL)
            ext_ledger = Path(cfg.run_dir) / "spool" / "actor-1"
            log["ext_before"] = len(read_ledger(ext_ledger))
            server.kill()
            server.wait(10)
            time.sleep(3.0)
            server = start_sim_server(port, tmp_path / "server.log")
            log["server_restarted"] = True
        except BaseException as e:  # surfaced by the main thread
            errors.append(e)

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    try:
        result = run.run()
    finally:
        th.join(timeout=60)
        server.kill()
        server.wait(10)
    assert not errors, errors
    print(json.dumps(result, indent=1))
    final = rows()
    assert final[-1]["step"] == 8
    assert run.restarts.get("learner", 0) >= 1 and run.restarts.get("actor-0", 0) >= 1
    acc = result["accounting"]
    assert acc["unaccounted"] == 0, acc
    assert acc["trained_twice"] == 0, acc
    assert final[-1]["data/trained_twice"] == 0
    assert acc["trained"] >= 8 and acc["finished"] >= acc["trained"]
    # The external environment's actor kept collecting after its server came back.
    ext = read_ledger(Path(cfg.run_dir) / "spool" / "actor-1")
    assert len(ext) > log["ext_before"], (len(ext), log)

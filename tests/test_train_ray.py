"""`arpo train cluster.address=...` on a real Ray cluster on this machine: a head and worker
nodes started with `ray start`, each in its own network namespace on a bridge (so ZeroMQ
and Ray cross real interfaces), the run's driver beside the head. A short run places one
actor per node offering `arpo_sim` and accounts for every trajectory; a node whose every
process is SIGKILLed mid-run has its grants issued again and the run finishes, and a node
started mid-run gets an actor that delivers.

Needs root (network namespaces) and the `ray` extra; skipped otherwise."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")

from ray_cluster import RAY_PORT, Cluster, sh
from train_configs import small_run

from arpo.actor.spool import read_ledger
from arpo.config import to_toml
from arpo.learner.metrics import read_metrics

DESKTOP_BINS = [b for b in ("Xvfb", "openbox") if not shutil.which(b)]


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (network namespaces)")
    c = Cluster(nodes=3)
    try:
        yield c
    finally:
        c.close()


def _train(
    c: Cluster,
    tmp_path: Path,
    iterations: int,
    local_desktops: int = 0,
    extra: tuple[str, ...] = (),
    sim_latency: str = "none",
    **cluster: object,
) -> subprocess.Popen:
    """`python -m arpo.train` in the head's namespace against the cluster, in the background;
    with `local_desktops`, the tasks of the local suite's `os` domain too (pool 'desktop')."""
    import arpo_envs.tasks as suite
    from arpo_envs.sim.tasks import write_tasks

    from arpo.policy.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", seed=0)
    write_tasks(tmp_path / "tasks", ["click_button"], 4, seed=0)
    (tmp_path / "tasks" / "test_all.json").unlink(missing_ok=True)
    if local_desktops:
        local = Path(suite.__file__).parent / "local" / "os"
        (tmp_path / "tasks" / "os").mkdir()
        for task in sorted(local.glob("*.json"))[:4]:
            shutil.copy(task, tmp_path / "tasks" / "os" / task.name)
    cfg = small_run(
        tmp_path, model, tmp_path / "tasks", iterations=iterations, max_new_tokens=16,
        prefill_runs_per_task=0, preflight=False, progress_s=5, local_desktops=local_desktops,
        actor={"shutdown_deadline_s": 30.0, "sim_latency": sim_latency},
    )  # fmt: skip
    cfg = replace(
        cfg,
        cluster=replace(cfg.cluster, address=f"{c.ip(0)}:{RAY_PORT}", poll_s=1.0, **cluster),
        learner=replace(cfg.learner, grants=replace(cfg.learner.grants, silent_actor_s=10.0)),
    )
    path = tmp_path / "run.toml"
    path.write_text(to_toml(cfg))
    cmd = ["ip", "netns", "exec", c.spaces[0], sys.executable, "-m", "arpo.train",
           "--config", str(path), *extra]  # fmt: skip
    with (tmp_path / "train.out").open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=c.env())


def _finish(proc: subprocess.Popen, tmp_path: Path, timeout: float) -> dict:
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        raise AssertionError(f"arpo train did not finish in {timeout} s") from None
    text = (tmp_path / "train.out").read_text(errors="replace")
    assert code == 0, text[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    run_id = summary.get("cluster", {}).get("run_id")
    if run_id:  # the folders a lost node's agent could not remove
        shutil.rmtree(Path(tempfile.gettempdir()) / f"arpo-{run_id}", ignore_errors=True)
    return summary


def _wait(cond, what: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.5)


@pytest.mark.skipif(bool(DESKTOP_BINS), reason=f"missing {DESKTOP_BINS} (make sysdeps)")
def test_a_run_places_simulated_and_local_desktops_by_resource_and_accounts_for_everything(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.ray_start(0)  # the head offers no environment: no actor there
    cluster.ray_start(2, desktops=1)  # a real local desktop, started on that node
    # The simulated node joins once the desktop has delivered: its episodes take
    # milliseconds, and had it been there from the start it could run every iteration
    # before the desktop node's actor had started (its ledger then holds nothing).
    # 12 iterations (48 trajectories): the one desktop alone takes about a minute over
    # them, several times what a node takes to join (8 s here).
    proc = _train(cluster, tmp_path, iterations=12, local_desktops=2)
    spools = tmp_path / "run" / "spool"

    def delivered() -> bool:
        return spools.exists() and any(read_ledger(d) for d in spools.glob("node*"))

    try:
        _wait(delivered, "the desktop node's first trajectory", 240)
        cluster.ray_start(1, sim=8)  # at most sim_envs_per_actor (4) of them
    except BaseException:
        proc.kill()
        raise
    summary = _finish(proc, tmp_path, timeout=300)
    assert summary["finished"], summary
    nodes = {n["ip"]: n for n in summary["cluster"]["nodes"]}
    assert set(nodes) == {cluster.ip(1), cluster.ip(2)}, nodes
    assert (nodes[cluster.ip(1)]["envs"], nodes[cluster.ip(1)]["desktops"]) == (4, 0)
    assert (nodes[cluster.ip(2)]["envs"], nodes[cluster.ip(2)]["desktops"]) == (0, 1)
    acc = summary["accounting"]
    assert acc["unaccounted"] == 0 and acc["trained_twice"] == 0, acc
    assert acc["trained"] >= 12 * 4, acc  # 12 iterations of 2 groups of 2
    run = tmp_path / "run"
    for n in nodes.values():  # each node's log and ledger came back to the driver
        assert "actor " + n["actor"] in (run / "logs" / f"{n['actor']}.log").read_text()
        assert read_ledger(run / "spool" / n["actor"]), n
    # The desktop node's episodes ran the local tasks on its own desktop (not the driver's).
    desktop_ids = {json.loads(t.read_text())["id"] for t in (tmp_path / "tasks" / "os").iterdir()}
    ledger = read_ledger(run / "spool" / nodes[cluster.ip(2)]["actor"])
    assert ledger and {task for _, task in ledger.values()} <= desktop_ids, ledger
    learner = (run / "learner.toml").read_text()
    assert f"tcp://{cluster.ip(0)}:" in learner and "curve_secret_key" in learner


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_lost_node_is_replaced_and_nothing_is_lost_or_trained_twice(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.ray_start(0)
    cluster.ray_start(1, sim=2)
    cluster.ray_start(2, sim=2)
    # Steps of 1 s: an environment holds its grant through a whole episode, so the node
    # killed below holds grants (with instant steps it may hold none, and there is nothing
    # to issue again); 30 iterations: long enough for a node to join.
    proc = _train(cluster, tmp_path, iterations=30, sim_latency="fixed:1000")
    metrics = tmp_path / "run" / "learner" / "metrics.jsonl"

    def step() -> int:
        rows = read_metrics(metrics) if metrics.exists() else []
        return rows[-1]["step"] if rows else 0

    spools = tmp_path / "run" / "spool"

    def delivering() -> bool:  # both nodes' actors hold grants and deliver
        found = [d for d in spools.glob("node*") if d.is_dir()] if spools.exists() else []
        return len(found) == 2 and all(len(read_ledger(d)) >= 2 for d in found)

    try:
        _wait(lambda: step() >= 2 and delivering(), "iteration 2, both nodes delivering", 240)
        killed = cluster.kill(1)  # node 1: raylet, workers, its actor and desktops
        assert killed > 0
        cluster.ray_start(3, sim=2)  # a node joins mid-run
    except BaseException:
        proc.kill()
        raise
    summary = _finish(proc, tmp_path, timeout=420)
    print(json.dumps({"cluster": summary["cluster"], "accounting": summary["accounting"]}))
    run = tmp_path / "run"
    assert summary["finished"], summary
    lost = summary["cluster"]["lost"]
    assert [x["ip"] for x in lost] == [cluster.ip(1)], summary["cluster"]
    joined = {x["ip"]: x["actor"] for x in summary["cluster"]["joined"]}
    assert cluster.ip(3) in joined, summary["cluster"]
    assert read_ledger(run / "spool" / joined[cluster.ip(3)]), "the new node delivered nothing"
    learner_log = (run / "logs" / "learner.log").read_text()
    assert f"actor {joined[cluster.ip(1)]} has not been heard from" in learner_log
    acc = summary["accounting"]
    assert acc["unaccounted"] == 0 and acc["trained_twice"] == 0, acc


@pytest.mark.slow
def test_sigterm_stops_every_nodes_actor_and_accounts_for_everything(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.ray_start(0)
    cluster.ray_start(1, sim=2)
    proc = _train(cluster, tmp_path, iterations=50)
    metrics = tmp_path / "run" / "learner" / "metrics.jsonl"
    try:
        _wait(lambda: metrics.exists() and read_metrics(metrics), "iteration 1", 240)
    except BaseException:
        proc.kill()
        raise
    os.kill(proc.pid, signal.SIGTERM)  # `ip netns exec` execs: this is arpo train itself
    code = proc.wait(300)
    assert code == 128 + signal.SIGTERM, (tmp_path / "train.out").read_text()[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    shutil.rmtree(
        Path(tempfile.gettempdir()) / f"arpo-{summary['cluster']['run_id']}", ignore_errors=True
    )
    assert not summary["finished"] and summary["signal"] == signal.SIGTERM
    acc = summary["accounting"]
    assert acc["unaccounted"] == 0 and acc["trained_twice"] == 0, acc
    assert acc["in_spool"] == 0, acc  # the node's actor flushed its spool before it stopped
    node = summary["cluster"]["nodes"][0]
    assert (
        node["lost"] == ""
        and "stopping" in (tmp_path / "run" / "logs" / f"{node['actor']}.log").read_text().lower()
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_whose_driver_was_lost_is_resumed_on_the_cluster(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The driver (and with it the learner) SIGKILLed: Ray ends its job, so the nodes'
    agents go and their actors die with them; `arpo train resume=true` places new actors
    (new ids), counts what the old node held unacknowledged as lost with it, and the
    learner continues from its last checkpoint to the end."""
    cluster.ray_start(0)
    cluster.ray_start(1, sim=2)
    first = _train(cluster, tmp_path, iterations=4)
    metrics = tmp_path / "run" / "learner" / "metrics.jsonl"
    try:
        _wait(lambda: metrics.exists() and read_metrics(metrics), "iteration 1", 240)
    finally:
        first.kill()
        first.wait(30)

    def node_actors() -> list[str]:
        pids = sh("ip", "netns", "pids", cluster.spaces[1]).stdout.split()
        cmds = []
        for pid in pids:
            with contextlib.suppress(OSError):
                cmds.append(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"))
        return [c for c in cmds if "arpo.actor.cli" in c]

    _wait(lambda: not node_actors(), "the lost driver's node actor to stop", 120)
    summary = _finish(_train(cluster, tmp_path, iterations=4, extra=("resume=true",)),
                      tmp_path, timeout=420)  # fmt: skip
    assert summary["finished"] and summary["resumes"] == 1, summary
    actors = [n["actor"] for n in summary["cluster"]["nodes"]]
    assert actors == ["node2"], summary["cluster"]  # node1 was the first start's
    assert (tmp_path / "run" / "spool" / "node1" / "node_lost.json").exists()
    acc = summary["accounting"]
    assert acc["unaccounted"] == 0 and acc["trained_twice"] == 0, acc
    assert read_metrics(metrics)[-1]["step"] == 4


@pytest.mark.slow
def test_gpus_per_actor_places_actors_only_on_nodes_with_gpus_and_hands_them_over(
    cluster: Cluster, tmp_path: Path
) -> None:
    """`cluster.gpus_per_actor=1`: the node without a GPU gets no actor; the one with a GPU
    gets one, and Ray's device for it reaches the agent (and so its actor's engine)."""
    cluster.ray_start(0)
    cluster.ray_start(1, sim=2, gpus=1)
    cluster.ray_start(2, sim=2)  # no GPU: no actor
    summary = _finish(_train(cluster, tmp_path, iterations=2, gpus_per_actor=1.0), tmp_path,
                      timeout=300)  # fmt: skip
    nodes = summary["cluster"]["nodes"]
    assert [(n["ip"], n["gpus"]) for n in nodes] == [(cluster.ip(1), "0")], nodes
    acc = summary["accounting"]
    assert acc["unaccounted"] == 0 and acc["trained_twice"] == 0, acc


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_learner_on_a_node_of_its_own_moves_when_its_node_is_lost(
    cluster: Cluster, tmp_path: Path
) -> None:
    """`cluster.learner_resource`: the learner runs on a node offering it (run_dir is on
    storage it reaches: this machine's disk); its node SIGKILLed mid-run, the run starts it
    again from its last checkpoint on the other such node, re-points the actor, and
    finishes with 0 unaccounted."""
    cluster.ray_start(0)
    cluster.ray_start(1, learner=1)
    cluster.ray_start(2, learner=1)
    cluster.ray_start(3, sim=2)
    proc = _train(cluster, tmp_path, iterations=6, learner_resource="arpo_learner")
    metrics = tmp_path / "run" / "learner" / "metrics.jsonl"
    log = tmp_path / "run" / "logs" / "learner.log"
    try:
        _wait(lambda: metrics.exists() and len(read_metrics(metrics)) >= 2, "iteration 2", 300)
        first = re.findall(r"learner bound to tcp://([0-9.]+):", log.read_text())
        assert len(first) == 1, log.read_text()[-2000:]
        cluster.kill(next(i for i in (1, 2) if cluster.ip(i) == first[0]))
    except BaseException:
        proc.kill()
        raise
    summary = _finish(proc, tmp_path, timeout=600)
    learners = summary["cluster"]["learners"]
    assert len(learners) == 2 and learners[0]["ip"] == first[0], learners
    assert learners[1]["ip"] != first[0] and learners[1]["resumed"], learners
    assert any(x["actor"] == "learner" for x in summary["cluster"]["lost"]), summary["cluster"]
    assert summary["finished"] and read_metrics(metrics)[-1]["step"] == 6
    acc = summary["accounting"]
    assert acc["unaccounted"] == 0 and acc["trained_twice"] == 0, acc


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_lost_learner_node_with_none_to_take_over_stops_the_run_with_code_3(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.ray_start(0)
    cluster.ray_start(1, learner=1)
    cluster.ray_start(2, sim=2)
    proc = _train(cluster, tmp_path, iterations=50, learner_resource="arpo_learner",
                  start_timeout_s=20.0, node_lost_s=10.0)  # fmt: skip
    metrics = tmp_path / "run" / "learner" / "metrics.jsonl"
    try:
        _wait(lambda: metrics.exists() and read_metrics(metrics), "iteration 1", 300)
        cluster.kill(1)
        code = proc.wait(300)
    finally:
        proc.kill()
    out = (tmp_path / "train.out").read_text(errors="replace")
    assert code == 3, out[-3000:]
    assert "arpo_learner" in out and "resume=true" in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_shared_engine_servers_follow_the_learner_and_a_lost_one_is_replaced(
    cluster: Cluster, tmp_path: Path
) -> None:
    """`cluster.engines=shared`: two nodes offering `arpo_engines` each run an `arpo-engine`
    server that loads the learner's weights itself; the sim node's actor samples from one
    of them. That server's node SIGKILLed mid-run, the actor starts again on the other, and
    the run finishes with 0 unaccounted, trained on weights the servers loaded."""
    cluster.ray_start(0)
    cluster.ray_start(1, engines=1)
    cluster.ray_start(2, engines=1)
    cluster.ray_start(3, sim=2)
    proc = _train(cluster, tmp_path, iterations=6, engines="shared")
    metrics = tmp_path / "run" / "learner" / "metrics.jsonl"
    out = tmp_path / "train.out"
    try:
        _wait(lambda: metrics.exists() and len(read_metrics(metrics)) >= 2, "iteration 2", 300)
        servers = re.findall(
            r"shared engine server (engine\d+) at http://([0-9.]+):", out.read_text()
        )
        assert len(servers) == 2, out.read_text()[-3000:]
        used_ip = servers[1 % 2][1]  # the first actor (node1) is dealt the second server
        cluster.kill(next(i for i in (1, 2) if cluster.ip(i) == used_ip))
    except BaseException:
        proc.kill()
        raise
    summary = _finish(proc, tmp_path, timeout=600)
    assert summary["finished"], summary
    engines = {e["engine"]: e for e in summary["cluster"]["engines"]}
    lost = [e for e in engines.values() if e["lost"] and e["lost"] != "stopped"]
    assert [e["ip"] for e in lost] == [used_ip], engines
    acc = summary["accounting"]
    assert acc["unaccounted"] == 0 and acc["trained_twice"] == 0, acc
    assert read_metrics(metrics)[-1]["step"] == 6
    logs = tmp_path / "run" / "logs"
    loaded = [f.name for f in logs.glob("engine*.log") if "policy v" in f.read_text()]
    assert loaded, "no engine server loaded the learner's weights"
    actor_log = (logs / "node1.log").read_text()
    assert "applied" not in actor_log, "the actor loaded weights itself"  # "policy vN applied"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_learner_as_a_torchrun_group_over_two_nodes_trains(
    cluster: Cluster, tmp_path: Path
) -> None:
    """`cluster.learner_nodes=2`: the learner runs as one torchrun group over the two
    nodes offering `arpo_learner` (gloo over their cluster addresses, a static rendezvous
    on rank 0's node, which binds the links); the run trains and accounts for everything."""
    cluster.ray_start(0)
    cluster.ray_start(1, learner=1)
    cluster.ray_start(2, learner=1)
    cluster.ray_start(3, sim=2)
    proc = _train(cluster, tmp_path, iterations=3, learner_resource="arpo_learner",
                  learner_nodes=2)  # fmt: skip
    summary = _finish(proc, tmp_path, timeout=600)
    assert summary["finished"], summary
    learners = summary["cluster"]["learners"]
    assert len(learners) == 1 and sorted(learners[0]["nodes"]) == [cluster.ip(1), cluster.ip(2)]
    logs = tmp_path / "run" / "logs"
    assert "2 rank(s)" in (logs / "learner.log").read_text()
    assert (logs / "learner-node1.log").exists()
    acc = summary["accounting"]
    assert acc["unaccounted"] == 0 and acc["trained_twice"] == 0, acc
    assert read_metrics(tmp_path / "run" / "learner" / "metrics.jsonl")[-1]["step"] == 3

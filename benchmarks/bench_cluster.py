"""Scaling on a Ray cluster: trajectories per second and the learner's wait with 1, 2 and 3
environment nodes, and Ray's own overhead against one machine's processes.

    sudo .venv/bin/python benchmarks/bench_cluster.py                      # the table (~40 min)
    sudo .venv/bin/python benchmarks/bench_cluster.py --minutes 1 --repeats 1 --no-save

Needs root (network namespaces) and the `cluster` extra. Run it alone on the machine.

Each setting is a whole `arpo train` run of the tiny model (the same one, seed 0) on the same
8 `click_button` tasks, `--envs` simulated desktops per environment node, each step of a
simulated desktop taking a drawn latency (`--latency`, default lognormal with a median of
2 s, sigma 0.3: an OSWorld VM's screenshot-action-screenshot round), episodes of at most 3
turns, groups of 4 and 2 groups per iteration (8 trajectories), for `--minutes` of training:

- `one machine`: `arpo train` without Ray: the learner and one actor process with the
  `--envs` desktops, started by the run on this machine over loopback (today's way);
- `Ray, n nodes`: the same config with `cluster.address`: a head (the driver and the
  learner) and n worker nodes offering `arpo_sim: <envs>`, each a network namespace on a
  bridge (`tests/ray_cluster.py`), so the actors' ZeroMQ links cross real interfaces.

Measured over the iterations after the first `--skip`: trained trajectories per second
(the learner's `data/trajectories` over the wall time between their metric records) and
the learner's wait fraction (its `wait` span over that wall time: waiting for a complete
batch). Scaling efficiency at n nodes = (trajectories/s at n) / (n x trajectories/s at 1
node); Ray's overhead = 1 - (Ray, 1 node) / (one machine). Settings alternate within a
repeat, and every figure is the median over `--repeats` (each repeat's value in brackets).

What it can and cannot say: the nodes are namespaces of one 2-core machine, so they add
environments, not processors. With the step latency dominating, the environments are the
bottleneck, as with real VMs, and the table measures whether the system (placement, the
grant and data links, the learner) keeps up as environments are added; it does not
measure a cluster's extra compute. When the machine's cores saturate (the load average in
the header), the efficiency falls for that reason, not Ray's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _machine import run_header

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from ray_cluster import RAY_PORT, Cluster  # noqa: E402


def settings(max_nodes: int) -> list[tuple[str, int]]:
    """(name, worker nodes; 0 = one machine without Ray)."""
    return [("one machine", 0)] + [(f"Ray, {n} node{'s' * (n > 1)}", n)
                                   for n in range(1, max_nodes + 1)]  # fmt: skip


def config(args: argparse.Namespace, run_dir: Path, model: str, tasks: str, address: str) -> str:
    """The run's TOML: the same for every setting but its cluster address."""
    from arpo.config import load_config, to_toml
    from arpo.train import TrainConfig

    cfg = load_config(TrainConfig, None, [
        f"run_dir={str(run_dir)!r}", f"model={model!r}", f"tasks={tasks!r}",
        "warm_start=false", "eval_runs_per_task=0", "prefill_runs_per_task=0",
        "preflight=false", "progress_s=0", "restart=false", f"minutes={args.minutes}",
        "learner.iterations=0", "actors=1", f"sim_envs_per_actor={args.envs}",
        f"actor.sim_latency={args.latency!r}", "actor.episode.max_steps=3",
        "actor.shutdown_deadline_s=30", "learner.assemble.groups_per_step=2",
        *([f"cluster.address={address!r}", "cluster.poll_s=1"] if address else []),
    ])  # fmt: skip
    return to_toml(cfg)


def measure(run_dir: Path, skip: int) -> dict[str, Any]:
    """Trained trajectories per second and the learner's wait fraction after `skip`
    iterations, from the learner's metrics."""
    from arpo.learner.metrics import read_metrics

    rows = read_metrics(run_dir / "learner" / "metrics.jsonl")[skip - 1 :]
    if len(rows) < 3:
        raise RuntimeError(f"{run_dir}: only {len(rows)} iterations after the warm-up")
    a, b, body = rows[0], rows[-1], rows[1:]
    wall = b["wall_s"] - a["wall_s"]
    return {
        "iterations": len(body),
        "wall_s": round(wall, 1),
        "trajectories_per_s": sum(r["data/trajectories"] for r in body) / wall,
        "learner_wait": sum(r.get("time/wait_s", 0.0) for r in body) / wall,
    }


def one_run(args: argparse.Namespace, name: str, nodes: int, rep: int, model: str,
            tasks: str) -> dict[str, Any]:  # fmt: skip
    run_dir = Path(args.out) / f"{name.replace(' ', '').replace(',', '-')}-{rep}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cluster = Cluster(nodes=1 + nodes)
    try:
        address = ""
        if nodes:
            cluster.ray_start(0)
            for i in range(1, nodes + 1):
                cluster.ray_start(i, sim=args.envs)
            address = f"{cluster.ip(0)}:{RAY_PORT}"
        path = run_dir / "run.toml"
        path.write_text(config(args, run_dir / "run", model, tasks, address))
        cmd = ["ip", "netns", "exec", cluster.spaces[0], sys.executable, "-m", "arpo.train",
               "--config", str(path)]  # fmt: skip
        with (run_dir / "train.out").open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=cluster.env())
            try:
                code = proc.wait(args.minutes * 60 + 600)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)
                proc.wait(300)
                raise
        if code != 0:
            tail = (run_dir / "train.out").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name}: arpo train exited with {code}:\n{tail}")
        summary = json.loads((run_dir / "run" / "summary.json").read_text())
        result = {"setting": name, "nodes": nodes, "repeat": rep,
                  **measure(run_dir / "run", args.skip),
                  "unaccounted": summary["accounting"]["unaccounted"]}  # fmt: skip
        if nodes:
            run_id = summary.get("cluster", {}).get("run_id")
            shutil.rmtree(Path(tempfile.gettempdir()) / f"arpo-{run_id}", ignore_errors=True)
        return result
    finally:
        cluster.close()


def table(runs: list[dict[str, Any]], names: list[tuple[str, int]], envs: int) -> tuple[str, dict]:
    """The markdown table and the medians by setting (with efficiency and overhead)."""

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["setting"] == name)

    def each(name: str, key: str, fmt: str) -> str:
        vals = [r[key] for r in runs if r["setting"] == name]
        rest = f" ({', '.join(f'{v:{fmt}}' for v in vals)})" if len(vals) > 1 else ""
        return f"{statistics.median(vals):{fmt}}{rest}"

    one_node = next(n for n, k in names if k == 1)
    base = med(one_node, "trajectories_per_s")
    medians: dict[str, Any] = {}
    lines = ["| setting | environments | trajectories/s | learner wait | vs linear | unaccounted |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, nodes in names:
        if not any(r["setting"] == name for r in runs):
            continue
        tps = med(name, "trajectories_per_s")
        eff = tps / (nodes * base) if nodes else None
        medians[name] = {"trajectories_per_s": tps, "learner_wait": med(name, "learner_wait"),
                         "efficiency": eff}  # fmt: skip
        lines.append(
            f"| {name} | {max(nodes, 1) * envs} | {each(name, 'trajectories_per_s', '.3f')}"
            f" | {each(name, 'learner_wait', '.0%')} | {'' if eff is None else f'{eff:.2f}'} "
            f"| {sum(r['unaccounted'] for r in runs if r['setting'] == name)} |"
        )
    machine = medians.get("one machine", {}).get("trajectories_per_s")
    if machine:
        medians["ray_overhead"] = 1 - base / machine
    return "\n".join(lines), medians


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/bench-cluster", help="Folder of the runs.")
    p.add_argument("--nodes", type=int, default=3, help="Most environment nodes.")
    p.add_argument("--envs", type=int, default=4, help="Simulated desktops per node.")
    p.add_argument("--latency", default="lognormal:2000,0.3", help="Their step latency.")
    p.add_argument("--minutes", type=float, default=2.5, help="Training minutes per run.")
    p.add_argument("--skip", type=int, default=2, help="Warm-up iterations not measured.")
    p.add_argument("--repeats", type=int, default=2, help="Runs per setting (alternating).")
    p.add_argument("--no-save", action="store_true", help="Do not write benchmarks/results.")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        p.error("needs root: each node is a network namespace")
    out = Path(args.out).resolve()
    args.out = str(out)
    out.mkdir(parents=True, exist_ok=True)
    from arpo_envs.sim.tasks import write_tasks

    from arpo.policy.tiny import build_tiny_model

    model = str(build_tiny_model(out / "tiny", seed=0))
    write_tasks(out / "tasks", ["click_button"], 8, seed=0)
    (out / "tasks" / "test_all.json").unlink(missing_ok=True)
    names = settings(args.nodes)
    runs = []
    for rep in range(args.repeats):
        for name, nodes in names:
            r = one_run(args, name, nodes, rep, model, str(out / "tasks"))
            print(json.dumps(r), flush=True)
            runs.append(r)
    md, medians = table(runs, names, args.envs)
    head = run_header()
    eff = medians.get(names[-1][0], {}).get("efficiency")
    text = (
        f"# Scaling on a Ray cluster, {head['date'][:10]}\n\n"
        f"`sudo .venv/bin/python benchmarks/bench_cluster.py` at {head['commit']}, "
        f"{head['date']}, {head['machine']}, load average at the end "
        f"{head['load_average'][0]:.2f}. {args.envs} simulated desktops per node, step latency "
        f"{args.latency} ms, episodes of at most 3 turns, the tiny model; {args.minutes:g} "
        f"minutes of training per run, the first {args.skip} iterations not measured; "
        f"medians over {args.repeats} alternating repeats (each repeat in brackets).\n\n{md}\n\n"
        f"Efficiency at {names[-1][1]} nodes: {eff:.2f} of linear (goal 0.8). Ray's overhead "
        f"on one node against one machine's processes: "
        f"{medians.get('ray_overhead', float('nan')):+.1%} of trajectories/s.\n"
    )
    print(text)
    if not args.no_save:
        stem = ROOT / "benchmarks" / "results" / f"cluster-{head['date'][:10]}"
        stem.with_suffix(".json").write_text(
            json.dumps({**head, "args": vars(args), "runs": runs, "medians": medians}, indent=2)
        )
        stem.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

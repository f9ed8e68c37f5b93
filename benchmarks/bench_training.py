"""Training throughput end to end: trained trajectories per minute and where the time goes.

    .venv/bin/python benchmarks/bench_training.py                    # prefetch off vs on
    .venv/bin/python benchmarks/bench_training.py --repeats 1 --iterations 12   # quicker

Each setting is a whole `arpo train` run on this machine (learner + one actor process
with `--envs` simulated desktops, real ZeroMQ links, the Rust store, weights published
every iteration) from the same warm start on the same `--tasks` simulated tasks, with
the embedded defaults and one change. Settings alternate (A B A B ...) so that drift of
the machine hits both alike. Measured over the iterations after `--skip` warm-up ones:

- trained trajectories per minute (fresh and replayed, the learner's `data/trajectories`
  over the wall time between the iterations' metric records);
- the learner's idle fraction: its `wait` span (waiting for a complete batch; with the
  prefetch, waiting for the prefetch thread) over the wall time;
- the environments' time split from the actors' heartbeats: running episodes, asking
  for grants (the learner's admission window is full), waiting for the policy version
  a grant asks for, as fractions of environment-seconds;
- median seconds per iteration of the learner's spans (step, sequences, forward/backward).

Results go to benchmarks/results/training-<date>.{json,md} with machine, commit and load
average. Run it alone on the machine: every process here competes for the same cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from _earlier import EARLIER_DEFAULTS, earlier_config
from _machine import run_header

ROOT = Path(__file__).resolve().parent.parent
SETTINGS: dict[str, list[str]] = {
    "prefetch off": ["learner.prefetch=false"],
    "prefetch on": ["learner.prefetch=true"],
}
"""Setting name -> `arpo train` overrides."""


def one_run(args: argparse.Namespace, name: str, rep: int, model: str, tasks: str) -> dict:
    from arpo.config import load_config
    from arpo.learner.metrics import read_metrics
    from arpo.train import TrainConfig, TrainRun

    run_dir = Path(args.out) / f"{name.replace(' ', '-')}-{rep}"
    cfg = load_config(
        TrainConfig,
        None,
        [
            *EARLIER_DEFAULTS,
            f"run_dir={str(run_dir)!r}",
            f"model={model!r}",
            f"tasks={tasks!r}",
            "minutes=0",
            "restart=false",
            "progress_s=0",
            "eval_runs_per_task=0",
            f"sim_envs_per_actor={args.envs}",
            f"learner.iterations={args.iterations}",
            *SETTINGS[name],
        ],
    )
    TrainRun(cfg).run()
    rows = read_metrics(run_dir / "learner" / "metrics.jsonl")[args.skip - 1 :]
    a, b = rows[0], rows[-1]
    wall = b["wall_s"] - a["wall_s"]
    body = rows[1:]
    envs = b.get("data/actor_envs") or float(args.envs)

    def env_frac(key: str) -> float:
        return (b.get(key, 0.0) - a.get(key, 0.0)) / (envs * wall)

    def med(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in body)

    return {
        "setting": name,
        "repeat": rep,
        "iterations": len(body),
        "wall_s": wall,
        "trained_per_min": 60.0 * sum(r["data/trajectories"] for r in body) / wall,
        "learner_idle": sum(r.get("time/wait_s", 0.0) for r in body) / wall,
        "env_episode": env_frac("data/actor_episode_s"),
        "env_grant_wait": env_frac("data/actor_grant_wait_s"),
        "env_weight_wait": env_frac("data/actor_weight_wait_s"),
        "iteration_s": wall / len(body),
        "step_s": med("time/step_s"),
        "sequences_s": med("time/sequences_s"),
        "prefetch_sequences_s": med("time/prefetch_sequences_s"),
        "forward_backward_s": med("time/forward_backward_s"),
        "prefetched": sum(r.get("data/prefetched", 0.0) for r in body) / len(body),
    }


COLUMNS = [
    ("trained_per_min", "trained traj/min", ".1f"),
    ("iteration_s", "s/iteration", ".2f"),
    ("learner_idle", "learner idle", ".1%"),
    ("env_episode", "env in episodes", ".1%"),
    ("env_grant_wait", "env asking for grants", ".1%"),
    ("env_weight_wait", "env waiting for weights", ".1%"),
    ("step_s", "step s", ".2f"),
    ("sequences_s", "sequences in step s", ".3f"),
    ("prefetch_sequences_s", "sequences made ahead s", ".3f"),
    ("forward_backward_s", "fwd/bwd s", ".2f"),
    ("prefetched", "batches prefetched", ".0%"),
]


def table(runs: list[dict[str, Any]]) -> str:
    head = "| setting | " + " | ".join(c[1] for c in COLUMNS) + " |"
    lines = [head, "|---|" + "---:|" * len(COLUMNS)]
    for name in SETTINGS:
        mine = [r for r in runs if r["setting"] == name]
        if not mine:
            continue
        cells = []
        for key, _, fmt in COLUMNS:
            vals = [r[key] for r in mine]
            cells.append(
                f"{statistics.median(vals):{fmt}}"
                + (f" ({', '.join(f'{v:{fmt}}' for v in vals)})" if len(vals) > 1 else "")
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/bench-training", help="Folder of the runs.")
    p.add_argument("--iterations", type=int, default=20, help="Learner iterations per run.")
    p.add_argument("--skip", type=int, default=3, help="Warm-up iterations not measured.")
    p.add_argument("--repeats", type=int, default=2, help="Runs per setting (alternating).")
    p.add_argument("--envs", type=int, default=4, help="Simulated desktops of the actor.")
    p.add_argument("--tasks", type=int, default=4, help="click_button tasks in the pool.")
    p.add_argument("--no-save", action="store_true", help="Do not write benchmarks/results.")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    args.out = str(out)
    out.mkdir(parents=True, exist_ok=True)
    from arpo.train import TrainRun

    base = TrainRun(earlier_config(run_dir=str(out / "base"), sim_tasks_per_family=args.tasks))
    base.run_dir.mkdir(parents=True, exist_ok=True)
    model = base.policy()
    tasks = str(Path(base.task_pool()) / "sim")
    runs = []
    for rep in range(args.repeats):
        for name in SETTINGS:
            r = one_run(args, name, rep, model, tasks)
            print(json.dumps(r), flush=True)
            runs.append(r)
    md = table(runs)
    print(md)
    if not args.no_save:
        meta = {**run_header(), "args": vars(args)}
        stem = ROOT / "benchmarks" / "results" / f"training-{str(meta['date'])[:10]}"
        stem.with_suffix(".json").write_text(json.dumps({**meta, "runs": runs}, indent=2))
        stem.with_suffix(".md").write_text(
            f"`benchmarks/bench_training.py` at {meta['commit']}, {meta['date']}, {meta['machine']}, "
            f"load average at the end {meta['load_average'][0]:.2f}. Medians over "
            f"{args.repeats} alternating runs per setting (each run's value in brackets), "
            f"{args.iterations} iterations, the first {args.skip} not measured.\n\n{md}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

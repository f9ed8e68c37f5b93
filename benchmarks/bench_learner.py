"""Learner throughput on the tiny Qwen2.5-VL: tokens/s, trajectories/s, time split by stage.

    python benchmarks/bench_learner.py                  # 3 timed iterations per setting
    python benchmarks/bench_learner.py --quick          # 1 iteration, small batch (smoke test)

The real learner (`arpo.learner.learner.Learner`: ingest and grant sockets bound on
loopback, the Rust store, the assembler, the trainer, weight publishing, checkpoints
every iteration) runs on trajectories shaped like the reference's episodes at the tiny
model's scale: `--turns` turns, each showing a 1920x1080 screenshot (60 image tokens at
the tiny model's pixel bounds) and sampling `--response` tokens, built by the real
prompt builder. The store is filled before the run, so `wait` measures group assembly
itself (taking groups, decoding headers, replay, advantages), not the actors.

Checked before timing: the first iteration's proximal log-probs equal the stored
behaviour log-probs (the trajectories are made on-policy with a teacher-forced pass), so
the importance weights of fresh tokens are 1.

Settings compared side by side in one run: micro-batches of 1 trajectory (the default)
and of 4. Stages (medians over the timed iterations): wait for groups, sequences (PNG
decode + image processor), proximal forward, forward/backward, optimizer, weight
publish, checkpoint. Results go to benchmarks/results/learner-<date>.{json,md} with
date, machine, commit and load average. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
from _machine import cpu_model, run_header

ROOT = Path(__file__).resolve().parent.parent
STAGES = ["wait", "sequences", "proximal_forward", "forward_backward", "optimizer", "publish",
          "checkpoint"]  # fmt: skip


def make_items(trainer, n: int, turns: int, response: int, seed: int):
    """n on-policy trajectories (behaviour log-probs = the model's own, teacher-forced)."""
    from arpo import store_item
    from arpo.learner.batch import build_sequence
    from arpo.synthetic import (
        random_response,
        screenshot_png,
        synthetic_trajectory,
        with_logprobs,
    )

    rng = np.random.default_rng(seed)
    proc = trainer.processor
    shots = [screenshot_png(rng, 1920, 1080) for _ in range(4)]
    out = []
    for i in range(n):
        traj = synthetic_trajectory(
            proc,
            f"benchmark task {i % 7}",
            screenshots=[shots[(i + t) % 4] for t in range(turns)],
            responses=[random_response(rng, proc.tokenizer, response) for _ in range(turns)],
            reward=float(i % 2),
            task_id=f"task-{i // 4}",
        )
        item = store_item.to_item(traj)
        (lp,) = trainer.proximal([build_sequence(item, proc, trainer.image_token_id)])
        out.append(with_logprobs(traj, lp.numpy()))
    return out


def run_setting(model_dir: Path, args, micro: int, trajs) -> dict:
    from arpo import store_item
    from arpo.learner.assemble import AssembleConfig
    from arpo.learner.checkpoint import CheckpointConfig
    from arpo.learner.learner import Learner, LearnerConfig
    from arpo.learner.metrics import MetricsConfig
    from arpo.learner.trainer import TrainerConfig
    from arpo.transport import TransportConfig

    tmp = Path(tempfile.mkdtemp(prefix="bench-learner-"))
    tasks = tmp / "tasks.jsonl"
    ids = sorted({t.task_id for t in trajs})
    tasks.write_text("".join(json.dumps(_task(i)) + "\n" for i in ids))
    iters = args.iterations + 1  # the first is warm-up
    cfg = LearnerConfig(
        run_dir=str(tmp / "run"),
        tasks=str(tasks),
        iterations=iters,
        trainer=TrainerConfig(model=str(model_dir), micro_batch=micro, lr=1e-6),
        assemble=AssembleConfig(group_size=4, groups_per_step=args.groups, max_staleness=100),
        transport=TransportConfig(data="tcp://127.0.0.1:0", control="tcp://127.0.0.1:0"),
        checkpoint=CheckpointConfig(every=1, keep=1, verify=False),
        metrics=MetricsConfig(progress_s=0, tensorboard=False),
    )
    learner = Learner(cfg)
    learner.setup()
    for t in trajs:
        learner.store.put(t.task_id, store_item.to_item(t))
    learner.run()
    rows = learner.history[1:]
    first = learner.history[0]
    if abs(first["losses/weight_fresh_mean"] - 1.0) > 1e-3:
        raise SystemExit(f"check failed: fresh weights {first['losses/weight_fresh_mean']} != 1")
    med = {s: statistics.median(r.get(f"time/{s}_s", 0.0) for r in rows) for s in STAGES}
    total = statistics.median(
        sum(r.get(f"time/{s}_s", 0.0) for s in ("wait", "step", "publish", "checkpoint"))
        for r in rows
    )
    n_traj = statistics.median(r["data/trajectories"] for r in rows)
    tokens = statistics.median(r["data/tokens"] for r in rows)
    return {
        "micro_batch": micro,
        "iterations": len(rows),
        "trajectories_per_iteration": n_traj,
        "tokens_per_iteration": tokens,
        "iteration_s": total,
        "trajectories_per_s": n_traj / total,
        "tokens_per_s": tokens / total,
        "stages_s": med,
    }


def _task(task_id: str) -> dict:
    return {
        "id": task_id,
        "instruction": "benchmark",
        "config": [],
        "evaluator": {"func": "infeasible"},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=3, help="timed iterations per setting")
    ap.add_argument("--groups", type=int, default=4, help="groups of 4 per iteration")
    ap.add_argument("--turns", type=int, default=8, help="turns per trajectory")
    ap.add_argument("--response", type=int, default=40, help="sampled tokens per turn")
    ap.add_argument("--micro", default="1,4", help="micro-batch sizes to compare")
    ap.add_argument("--quick", action="store_true", help="1 iteration, 2 groups, 2 turns")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    if args.quick:
        args.iterations, args.groups, args.turns, args.response, args.micro = 1, 2, 2, 12, "1"

    import torch

    from arpo.learner.trainer import Trainer, TrainerConfig
    from arpo.policy.tiny import build_tiny_model

    torch.set_num_threads(os.cpu_count() or 1)
    load = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="bench-learner-model-"))
    model_dir = build_tiny_model(tmp / "tiny", seed=0)
    maker = Trainer(TrainerConfig(model=str(model_dir)))
    n = 4 * args.groups * (args.iterations + 1)
    trajs = make_items(maker, n, args.turns, args.response, seed=0)
    del maker
    results = [run_setting(model_dir, args, int(m), trajs) for m in args.micro.split(",")]

    header = run_header()
    meta = {
        "date": header["date"],
        "commit": header["commit"],
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "load_before": load,
        "load_average": header["load_average"],
        "args": vars(args),
    }
    lines = [
        f"# Learner throughput ({meta['date']}, commit {meta['commit']})",
        "",
        f"{meta['machine']['cpu']}, {meta['machine']['cores']} cores, load before "
        f"{load[0]:.2f}; tiny Qwen2.5-VL; {args.groups} groups x 4 trajectories per iteration, "
        f"{args.turns} turns x {args.response} sampled tokens, 1920x1080 screenshots; medians "
        f"of {args.iterations} iterations after one warm-up.",
        "",
        "| micro-batch | traj/iter | tokens/iter | iteration s | traj/s | tokens/s | "
        + " | ".join(f"{s} s" for s in STAGES)
        + " |",
        "|---" * (6 + len(STAGES)) + "|",
    ]
    for r in results:
        lines.append(
            f"| {r['micro_batch']} | {r['trajectories_per_iteration']:.0f} | "
            f"{r['tokens_per_iteration']:.0f} | {r['iteration_s']:.2f} | "
            f"{r['trajectories_per_s']:.2f} | {r['tokens_per_s']:.0f} | "
            + " | ".join(f"{r['stages_s'][s]:.3f}" for s in STAGES)
            + " |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.quick:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"learner-{str(meta['date'])[:10]}"
        (out / f"{stem}.json").write_text(json.dumps({**meta, "results": results}, indent=2))
        (out / f"{stem}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

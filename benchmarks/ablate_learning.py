"""Why online RL moves the warm start the way it does: one change at a time, measured.

    .venv/bin/python benchmarks/ablate_learning.py --seeds 100 --out runs/ablate
    .venv/bin/python benchmarks/ablate_learning.py --seeds 100,101 --variants base,lr3e-5
    .venv/bin/python benchmarks/ablate_learning.py --out runs/ablate --report-only

The warm start and the task pool are `arpo train`'s (the tiny Qwen2.5-VL after `arpo sft`
on oracle demonstrations of 16 simulated `click_button` tasks), as in
`experiment_methods.py`. Every variant is `arpo train` from that warm start (learner +
one actor process with `--envs` simulated desktops, the real store and transport) for
`--iterations` iterations with `arpo train`'s embedded learner settings (groups of 4, 4
groups per iteration, lr 1e-4, 1 optimizer step, max staleness 2, ARPO replay, format
reward 0.5, rollout temperature 1.0) and one change (`VARIANTS`), then `arpo eval` of its
final checkpoint (`--eval-runs` episodes per task, temperature 0.6). The KL to the warm
start is tracked in every run (`learner.trainer.track_kl`, no KL term unless the
variant adds one).

Per variant and seed the table gives the final evaluation against the warm start's, and
from the training metrics (first and last third of the iterations): the training success
rate, the parse-failure rate, the entropy, the KL to the warm start, the gradient norm and
the clip fractions. Seeds used here choose settings; report learning results on other
seeds. A finished run or evaluation is not run again (delete its folder to redo it).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _earlier import EARLIER_DEFAULTS, earlier_config
from _runs import final_checkpoint

log = logging.getLogger("ablate")

REFERENCE = ["learner.assemble.norm_std=true", "learner.trainer.loss.replay_w_min=0.0"]
"""The reference's advantage and replay weighting; `arpo train`'s embedded defaults differ
(no std division, replayed successes weighted at least 1: the `drgrpo-floor1` variant)."""

NEW = ["learner.assemble.norm_std=false", "learner.trainer.loss.replay_w_min=1.0"]
"""`arpo train`'s embedded defaults where they differ from the reference."""

_CHANGES: dict[str, list[str]] = {
    "base": [],
    "grpo": ["learner.assemble.replay.enabled=false"],
    "lr3e-5": ["learner.trainer.lr=3e-5"],
    "lr1e-5": ["learner.trainer.lr=1e-5"],
    "lr3e-4": ["learner.trainer.lr=3e-4"],
    "opt4": ["learner.trainer.optimizer_steps=4"],
    "sync": ["learner.assemble.max_staleness=0"],
    "fmt0": ["actor.episode.format_weight=0.0"],
    "positive": ["learner.assemble.advantage_side=positive"],
    "negative": ["learner.assemble.advantage_side=negative"],
    "kl0.1": ["learner.trainer.loss.kl_coef=0.1"],
    "t0.6": ["learner.trainer.temperature=0.6"],
    "t0.6-positive": [
        "learner.trainer.temperature=0.6",
        "learner.assemble.advantage_side=positive",
    ],
    "t0.6-fmt0": ["learner.trainer.temperature=0.6", "actor.episode.format_weight=0.0"],
    "positive-fmt0": [
        "learner.assemble.advantage_side=positive",
        "actor.episode.format_weight=0.0",
    ],
    "positive-lr3e-4": ["learner.assemble.advantage_side=positive", "learner.trainer.lr=3e-4"],
    "drgrpo": ["learner.assemble.norm_std=false"],
    "drgrpo-lr3e-4": ["learner.assemble.norm_std=false", "learner.trainer.lr=3e-4"],
    "drgrpo-floor1": ["learner.assemble.norm_std=false", "learner.trainer.loss.replay_w_min=1.0"],
    "floor1": ["learner.trainer.loss.replay_w_min=1.0"],
    "uncorrected": ["learner.trainer.loss.correct_replay=false"],
    # One change each to the new default (drgrpo-floor1):
    "new-opt4": [*NEW, "learner.trainer.optimizer_steps=4"],
    "new-sync": [*NEW, "learner.assemble.max_staleness=0"],
    "new-kl0.1": [*NEW, "learner.trainer.loss.kl_coef=0.1"],
}
"""Variant name -> its change to the reference setting."""
VARIANTS: dict[str, list[str]] = {name: REFERENCE + ch for name, ch in _CHANGES.items()}
"""Variant name -> `arpo train` overrides (later overrides of a field win)."""

TRACKED = {
    "success": "charts/success_rate",
    "parse_fail": "charts/parse_failure_rate",
    "entropy": "losses/entropy",
    "kl": "losses/loss_kl",
    "grad_norm": "losses/grad_norm",
    "clip_low": "losses/clip_low_frac",
    "clip_high": "losses/clip_high_frac",
    "clip_dual": "losses/clip_dual_frac",
    "stale": "data/dropped_stale",
}
"""Column -> metric tracked per iteration."""


def _eval(policy: str, tasks: str, out: Path, runs: int, envs: int) -> float:
    from arpo.pool.evaluate import EvalConfig, run_eval

    done = out / "eval.json"
    if not done.exists():
        ep = earlier_config().actor.episode
        run_eval(
            EvalConfig(
                model=policy,
                verify=False,
                tasks=tasks,
                runs_per_task=runs,
                temperature=0.6,
                out=str(out),
                grant_timeout_s=120.0,  # a lost grant goes to the actor again (see arpo.train)
                progress_s=0,
                local_actor_args=[
                    f"sim_envs={envs}",
                    f"episode.max_steps={ep.max_steps}",
                    f"episode.max_new_tokens={ep.max_new_tokens}",
                ],
            )
        )
    return float(json.loads(done.read_text())["overall"]["success_rate_episodes"])


def run_variant(args: argparse.Namespace, name: str, seed: int, model: str, tasks: str) -> dict:
    """One `arpo train` run of `name` with `seed`, its final evaluation and its curves."""
    from arpo.config import load_config
    from arpo.learner.metrics import read_metrics
    from arpo.train import TrainConfig, TrainRun

    run_dir = Path(args.out) / "runs" / f"{name}-s{seed}"
    overrides = [
        *EARLIER_DEFAULTS,
        f"run_dir={str(run_dir)!r}",
        f"model={model!r}",
        f"tasks={tasks!r}",
        f"seed={seed}",
        "minutes=0",
        "restart=false",
        "progress_s=30",
        "eval_runs_per_task=0",
        f"sim_envs_per_actor={args.envs}",
        f"learner.iterations={args.iterations}",
        f"sim_tasks_per_family={args.tasks}",
        "learner.trainer.track_kl=true",
        "actor.flush_deadline_s=5.0",
        *VARIANTS[name],
    ]
    summary = run_dir / "summary.json"
    if not summary.exists():
        log.info("%s seed %d -> %s", name, seed, run_dir)
        t0 = time.monotonic()
        TrainRun(load_config(TrainConfig, None, overrides)).run()
        s = json.loads(summary.read_text())
        s["wall_s"] = round(time.monotonic() - t0, 1)
        summary.write_text(json.dumps(s, indent=2))
    rows = read_metrics(run_dir / "learner" / "metrics.jsonl")
    ckpt = final_checkpoint(run_dir)
    final = _eval(str(ckpt / "model"), tasks, run_dir / "eval", args.eval_runs, args.envs)
    curves = {k: [r.get(m) for r in rows] for k, m in TRACKED.items()}
    return {
        "overrides": _CHANGES[name],
        "eval": final,
        "curves": curves,
        "wall_s": json.loads(summary.read_text()).get("wall_s"),
    }


def _third(xs: list[Any], which: str) -> float:
    vals = [x for x in xs if isinstance(x, int | float) and not math.isnan(x)]
    if not vals:
        return math.nan
    n = max(1, len(vals) // 3)
    part = vals[:n] if which == "first" else vals[-n:]
    return statistics.mean(part)


def report(results: dict[str, Any]) -> str:
    warm = results["warm_start"]
    lines = [
        f"Warm start evaluation: {100 * warm:.1f} % ({results['eval_runs']} episodes per "
        f"task x {results.get('tasks', 16)} tasks, temperature 0.6; standard error of one evaluation about "
        f"{100 * math.sqrt(warm * (1 - warm) / (results.get('tasks', 16) * results['eval_runs'])):.1f} "
        "points).",
        "",
        "| variant | change | final eval per seed (%) | mean - warm (pts) | train success "
        "first -> last third, mean of seeds (%) | parse failures first -> last (%) | entropy first -> last "
        "| KL to warm start, last third | grad norm | clip low / high / dual (%) | stale drops |",
        "|---|---|---|---:|---|---|---|---:|---:|---|---:|",
    ]
    for name, per_seed in results["variants"].items():
        if not per_seed:
            continue
        seeds = sorted(per_seed, key=int)
        evals = [per_seed[s]["eval"] for s in seeds]
        curves = [per_seed[s]["curves"] for s in seeds]

        def third(k: str, which: str, curves: list = curves) -> float:
            """The mean over seeds of each seed's first or last third."""
            vals = [_third(c[k], which) for c in curves]
            vals = [v for v in vals if not math.isnan(v)]
            return statistics.mean(vals) if vals else math.nan

        def ft(k: str, scale: float = 100.0, fmt: str = ".1f") -> str:
            a, b = third(k, "first"), third(k, "last")
            return f"{scale * a:{fmt}} -> {scale * b:{fmt}}"

        stale = sum(x or 0 for c in curves for x in c["stale"])
        lines.append(
            f"| {name} | {' '.join(_CHANGES.get(name, [])) or 'the reference settings'} | "
            + ", ".join(f"{100 * e:.1f}" for e in evals)
            + f" | {100 * (statistics.mean(evals) - warm):+.1f} | {ft('success')} | "
            f"{ft('parse_fail')} | {ft('entropy', 1.0, '.3f')} | "
            f"{third('kl', 'last'):.4f} | {third('grad_norm', 'last'):.2f} | "
            f"{100 * third('clip_low', 'last'):.1f} / {100 * third('clip_high', 'last'):.1f} / "
            f"{100 * third('clip_dual', 'last'):.1f} | {stale:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/ablate", help="Output folder.")
    p.add_argument("--seeds", default="100", help="Comma-separated seeds.")
    p.add_argument("--variants", default=",".join(VARIANTS), help="Variants to run.")
    p.add_argument("--iterations", type=int, default=16, help="Learner iterations per run.")
    p.add_argument("--envs", type=int, default=4, help="Simulated desktops of the actor.")
    p.add_argument("--tasks", type=int, default=16, help="click_button tasks in the pool.")
    p.add_argument("--sft-epochs", type=int, default=17, help="Warm start: arpo sft epochs.")
    p.add_argument("--eval-runs", type=int, default=4, help="Evaluation episodes per task.")
    p.add_argument("--report-only", action="store_true", help="The table from results.json.")
    p.add_argument("--save-as", default="", help="Also write benchmarks/results/<name>.{md,json}.")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = Path(args.out).resolve()
    args.out = str(out)
    out.mkdir(parents=True, exist_ok=True)
    res_path = out / "results.json"
    results: dict[str, Any] = (
        json.loads(res_path.read_text()) if res_path.exists() else {"variants": {}}
    )
    if not args.report_only:
        from arpo.train import TrainRun

        bad = sorted(set(args.variants.split(",")) - set(VARIANTS))
        if bad:
            p.error(f"--variants: unknown {bad}; choose from {', '.join(VARIANTS)}")
        base = TrainRun(
            earlier_config(
                run_dir=str(out / "base"),
                sim_tasks_per_family=args.tasks,
                sft_epochs=args.sft_epochs,
            )
        )
        base.run_dir.mkdir(parents=True, exist_ok=True)
        model = base.policy()
        tasks = str(Path(base.task_pool()) / "sim")
        results["eval_runs"] = args.eval_runs
        results["iterations"] = args.iterations
        results["tasks"] = args.tasks
        results["warm_start"] = _eval(
            model, tasks, out / "warm_start_eval", args.eval_runs, args.envs
        )
        for seed in [int(s) for s in args.seeds.split(",") if s]:
            for name in args.variants.split(","):
                r = run_variant(args, name, seed, model, tasks)
                results["variants"].setdefault(name, {})[str(seed)] = r
                res_path.write_text(json.dumps(results, indent=2))
    table = report(results)
    (out / "results.md").write_text(table + "\n")
    print(table)
    if args.save_as:
        dest = Path(__file__).resolve().parent / "results"
        (dest / f"{args.save_as}.md").write_text(table + "\n")
        (dest / f"{args.save_as}.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`make demo` with several seeds: warm start vs trained, per seed, in one table.

    .venv/bin/python benchmarks/demo_runs.py --seeds 1,2,3,4,5 --save-as demo-runs-<date>

Each seed is `arpo train` with exactly the arguments of the Makefile's `DEMO_ARGS` (read
from the Makefile, so this cannot drift from `make demo`) plus `seed=<n>` and its own
run folder: another seed generates other simulated tasks, another warm start (`arpo sft`
on their demonstrations) and another learner / actor sampling. Every run evaluates its
warm start and its final checkpoint with the same protocol (`eval_runs_per_task`
episodes per simulated task at temperature 0.6) and writes both to its summary.json;
this script collects them with the wall time of the whole run. A finished seed is not
run again (delete its folder to redo it).

    .venv/bin/python benchmarks/demo_runs.py --seeds 6,7 --out runs/demo-seeds-90 \
        --extra learner.iterations=90 --eval-at 1.0

`--extra` appends arpo train arguments to the Makefile's (a variant of the demo, named in
the table's header). `--eval-at T` also evaluates each seed's warm start and final
checkpoint at temperature T (the rollouts' is 1.0; the demo's own evaluations use 0.6)
with otherwise the same protocol (`arpo eval`, the run's tasks, `eval_runs_per_task`
episodes per task, arpo train's actor settings), once per seed (kept in the run folder).
The summary gives the mean gain over seeds with its 95 % t-interval. `--paired-with NAME`
compares with another variant's saved results (`benchmarks/results/NAME.json`, the same
seeds): per seed this variant's gain minus that one's (the same tasks and warm start),
their mean and its 95 % t-interval. A run with `prefill_runs_per_task` shows its pre-fill
(successes of the starting policy at the rollout temperature, and in how many tasks).
Per seed it also counts tasks lost (solved by the warm start, 0 after training), tasks
won from 0, and tasks no training episode solved (the per-task counts are in the JSON),
and what the off-policy correction corrected (from the learner's metrics); with several
families of simulated tasks, a table per family (every seed's episodes pooled). With
`--save-as`, a plot (`NAME.png`) shows every seed's warm start and trained policy, beside
the paired variant's, and the paired differences.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _stats import t_interval
from arpo_envs.procs import free_port
from long_tasks import _task_files

ROOT = Path(__file__).resolve().parent.parent


def demo_args() -> list[str]:
    """The Makefile's DEMO_ARGS, without run_dir."""
    m = re.search(r"^DEMO_ARGS \?= (.*)$", (ROOT / "Makefile").read_text(), re.M)
    if not m:
        raise SystemExit("Makefile: no DEMO_ARGS line")
    return [a for a in shlex.split(m.group(1)) if not a.startswith("run_dir=")]


def eval_at(run_dir: Path, base: list[str], temperature: float) -> dict[str, dict]:
    """`arpo eval` of the run's warm start and final checkpoint at `temperature` (cached)."""
    from arpo.learner.checkpoint import latest_checkpoint
    from arpo.train import TrainConfig

    runs = next((a.split("=", 1)[1] for a in base if a.startswith("eval_runs_per_task=")), "16")
    ckpt = latest_checkpoint(run_dir / "learner" / "checkpoints", verify=False)
    out: dict[str, dict] = {}
    for name, policy in (("warm", f"model={str(run_dir / 'sft')!r}"),
                         ("trained", f"checkpoint={str(ckpt)!r}")):  # fmt: skip
        dest = run_dir / f"eval_T{temperature:g}_{name}"
        if not (dest / "eval.json").exists():
            actor = [*TrainConfig().pool_actor_args(), "progress_s=0"]
            cmd = [sys.executable, "-m", "arpo.cli", "eval", policy,
                   f"tasks={str(run_dir / 'tasks' / 'sim')!r}", f"runs_per_task={runs}",
                   f"temperature={temperature}", f"out={str(dest)!r}", "progress_s=0",
                   "grant_timeout_s=120", f"local_actor_args={json.dumps(actor)}",
                   f"transport.data='tcp://127.0.0.1:{free_port()}'",
                   f"transport.control='tcp://127.0.0.1:{free_port()}'"]  # fmt: skip
            print("+", shlex.join(cmd), flush=True)
            with (run_dir / f"eval_T{temperature:g}_{name}.log").open("wb") as log:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=log).returncode
            if rc != 0:
                raise SystemExit(f"{dest}: arpo eval exited {rc}; see {log.name}")
        o = json.loads((dest / "eval.json").read_text())["overall"]
        p, n = o["success_rate_episodes"], o["episodes"]
        out[name] = {"rate": p, "se": math.sqrt(p * (1 - p) / n) if n else math.nan}
    return out


def _per_task(run_dir: Path) -> dict:
    """Per simulated task: successes of the warm start and of the trained policy (of
    `runs`), and whether any training episode succeeded (the task's success rate over its
    last 32 episodes, `tasks/<id>/success_rate`, above 0 in some iteration)."""
    from arpo.learner.metrics import read_metrics

    rows = read_metrics(run_dir / "learner" / "metrics.jsonl")
    # The evaluations' own files (summary.json has `by_task` only since it was added).
    w, t = (json.loads((run_dir / d / "eval.json").read_text())["tasks"]
            for d in ("eval_warm", "eval"))  # fmt: skip
    _, family = _task_files(run_dir / "tasks")
    return {
        k: {
            "warm": w[k]["successes"],
            "trained": t[k]["successes"],
            "runs": w[k]["runs"],
            "trained_ever": any((r.get(f"tasks/{k}/success_rate") or 0) > 0 for r in rows),
            "family": family.get(k, ""),
        }
        for k in w
    }


def _family_lines(rows: list[dict]) -> list[str]:
    """Per family of the simulated tasks (more than one): warm start and trained success
    over every seed's evaluation episodes of that family, the gain, and each seed's gain."""
    fams = sorted({v.get("family", "") for r in rows for v in r["tasks"].values()} - {""})
    if len(fams) < 2:
        return []
    lines = ["", "Per family, every seed's evaluation episodes of its tasks pooled, and each "
             "seed's gain in that family (points):", "",
             "| family | tasks per seed | warm start (%) | trained (%) | gain (points) | "
             "per seed | seeds above the warm start |", "|---|---:|---:|---:|---:|---|---:|"]  # fmt: skip
    for fam in fams:
        per, ws, ts, ns = [], 0, 0, 0
        for r in rows:
            ts_ = [v for v in r["tasks"].values() if v.get("family") == fam]
            n = sum(v["runs"] for v in ts_)
            if not n:
                continue
            w, t = sum(v["warm"] for v in ts_), sum(v["trained"] for v in ts_)
            per.append((r["seed"], 100 * (t - w) / n, len(ts_)))
            ws, ts, ns = ws + w, ts + t, ns + n
        if not ns:
            continue
        cells = ", ".join(f"{g:+.0f}" for _, g, _ in per)
        up = sum(1 for _, g, _ in per if g > 0)
        lines.append(f"| {fam} | {per[0][2]} | {100 * ws / ns:.1f} | {100 * ts / ns:.1f} | "
                     f"{100 * (ts - ws) / ns:+.1f} | {cells} | {up} of {len(per)} |")  # fmt: skip
    return lines


def _drift(run_dir: Path) -> dict:
    """What the importance correction had to correct, averaged over the iterations that had
    the metric: replayed rows, the per-sequence log-ratio sum(pi_prox - mu) of replayed and
    fresh trajectories, the mean weight of replayed tokens and the share truncated at
    w_max, and the staleness of fresh ones (`arpo.learner.loss`, `behaviour_drift`)."""
    from arpo.learner.metrics import read_metrics

    rows = read_metrics(run_dir / "learner" / "metrics.jsonl")

    def mean(key: str) -> float:
        vals = [r[key] for r in rows if isinstance(r.get(key), int | float)
                and not math.isnan(r[key])]  # fmt: skip
        return statistics.fmean(vals) if vals else math.nan

    return {
        "replayed": sum(r.get("replay/hits") or 0 for r in rows),
        "seq_logratio_replay": mean("losses/seq_logratio_replay_mean"),
        "seq_logratio_fresh": mean("losses/seq_logratio_fresh_mean"),
        "weight_replay": mean("losses/weight_replay_mean"),
        "truncated_replay": mean("losses/weight_truncated_replay_frac"),
        "staleness": mean("charts/staleness_mean"),
    }


def _task_cells(tasks: dict) -> str:
    """Lost (warm start > 0 -> 0), won from 0 (0 -> > 0, with the trained range), and tasks
    without a successful training episode."""
    lost = sum(1 for v in tasks.values() if v["warm"] > 0 and v["trained"] == 0)
    zero = [v for v in tasks.values() if v["warm"] == 0]
    won = [v["trained"] for v in zero if v["trained"] > 0]
    rng = f" ({min(won)}-{max(won)})" if won else ""
    never = sum(1 for v in tasks.values() if not v["trained_ever"])
    return f" {lost} | {len(won)} of {len(zero)}{rng} | {never} |"


def plot(path: Path, name: str, rows: list[dict], other: dict | None) -> None:
    """Per seed: the warm start and the trained policy (a line per seed; with `other`, the
    variant it is paired with beside it), and the paired differences of gains."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = [(name, rows)]
    if other is not None:
        variants.insert(0, (other["name"], other["runs"]))
    fig, ax = plt.subplots(1, 2 if other else 1, figsize=(11 if other else 6, 4.2), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, runs) in enumerate(variants):
        x = [2 * i, 2 * i + 1]
        for j, r in enumerate(runs):
            ax[0][0].plot(x, [100 * r["warm"], 100 * r["trained"]], "-o", color=colors[i],
                          alpha=0.7, label=label if j == 0 else None)  # fmt: skip
            ax[0][0].annotate(str(r["seed"]), (x[1], 100 * r["trained"]), fontsize=7,
                              xytext=(4, 0), textcoords="offset points")  # fmt: skip
    ticks = [t for i in range(len(variants)) for t in (2 * i, 2 * i + 1)]
    ax[0][0].set_xticks(ticks, ["warm start", "trained"] * len(variants))
    ax[0][0].set_ylabel("evaluation success (%)")
    ax[0][0].set_title("per seed (number = seed)")
    ax[0][0].legend(fontsize=7)
    ax[0][0].grid(alpha=0.3, axis="y")
    if other is not None:
        theirs = {r["seed"]: r["gain_points"] for r in other["runs"]}
        diffs = [(r["seed"], r["gain_points"] - theirs[r["seed"]]) for r in rows
                 if r["seed"] in theirs]  # fmt: skip
        a = ax[0][1]
        a.scatter(range(len(diffs)), [d for _, d in diffs], color="k", zorder=3)
        a.set_xticks(range(len(diffs)), [f"seed {k}" for k, _ in diffs])
        if len(diffs) > 1:
            m, lo, hi = t_interval([d for _, d in diffs])
            a.axhline(m, color=colors[1], label=f"mean {m:+.1f} (95 % CI {lo:+.1f} to {hi:+.1f})")
            a.axhspan(lo, hi, color=colors[1], alpha=0.15)
        a.axhline(0, color="gray", lw=1)
        a.set_ylabel("difference of gains (points)")
        a.set_title(f"{name}\nminus {other['name']}, paired by seed", fontsize=9)
        a.legend(fontsize=7)
        a.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="1,2,3,4,5", help="Comma-separated seeds.")
    p.add_argument("--out", default="runs/demo-seeds", help="Folder of the runs.")
    p.add_argument("--save-as", default="", help="Also write benchmarks/results/<name>.{md,json}.")
    p.add_argument("--report-only", action="store_true", help="Only collect finished runs.")
    p.add_argument("--extra", nargs="*", default=[], help="arpo train arguments appended.")
    p.add_argument("--eval-at", type=float, default=None, help="Also evaluate at this T.")
    p.add_argument("--paired-with", default="", help="Saved results (NAME) to compare with.")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    base = demo_args() + list(args.extra)
    rows = []
    for seed in [int(s) for s in args.seeds.split(",") if s]:
        run_dir = out / f"seed-{seed}"
        summary = run_dir / "summary.json"
        if not summary.exists() and not args.report_only:
            cmd = [sys.executable, "-m", "arpo.cli", "train", f"run_dir={str(run_dir)!r}",
                   *base, f"seed={seed}"]  # fmt: skip
            print("+", shlex.join(cmd), flush=True)
            t0 = time.monotonic()
            with (out / f"seed-{seed}.log").open("wb") as log:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=log).returncode
            if rc != 0:
                raise SystemExit(f"seed {seed}: arpo train exited {rc}; see {log.name}")
            s = json.loads(summary.read_text())
            s["demo_wall_s"] = round(time.monotonic() - t0, 1)
            summary.write_text(json.dumps(s, indent=2))
        if not summary.exists():
            continue
        s = json.loads(summary.read_text())
        w, t = s["eval_warm_start"], s["eval_trained"]
        rows.append(
            {
                "seed": seed,
                "warm": w["success_rate"],
                "warm_se": w["se"],
                "trained": t["success_rate"],
                "trained_se": t["se"],
                "gain_points": s["eval_gain"]["points"],
                "gain_se_points": s["eval_gain"]["se_points"],
                "episodes": t["episodes"],
                "iterations": s.get("iterations"),
                "wall_s": s.get("demo_wall_s"),
            }
        )
        rows[-1]["tasks"] = _per_task(run_dir)
        rows[-1]["drift"] = _drift(run_dir)
        if "prefill" in s:
            k = s["prefill"]["successes"]
            rows[-1]["prefill"] = {"successes": sum(k.values()),
                                   "tasks": sum(1 for v in k.values() if v), "of": len(k)}  # fmt: skip
        if args.eval_at is not None:
            rows[-1]["eval_at"] = {"temperature": args.eval_at,
                                   **eval_at(run_dir, base, args.eval_at)}  # fmt: skip
    at = f"T={args.eval_at:g}: " if args.eval_at is not None else ""
    pre = any("prefill" in r for r in rows)
    lines = [
        f"`make demo` arguments: `{' '.join(base)}` plus `seed=<n>`.",
        "",
        "| seed | warm start (%) | trained (%) | gain (points) | iterations | wall (min) |"
        + (f" {at}warm start (%) | {at}trained (%) | {at}gain (points) |" if at else "")
        + (" pre-fill: successes (tasks) |" if pre else "")
        + " tasks lost (start > 0 -> 0) | won from 0 (trained range) | no training success |",
        "|---:|---|---|---|---:|---:|"
        + ("---|---|---|" if at else "")
        + ("---|" if pre else "")
        + "---:|---|---:|",
    ]
    for r in rows:
        line = (
            f"| {r['seed']} | {100 * r['warm']:.1f} ± {100 * r['warm_se']:.1f} | "
            f"{100 * r['trained']:.1f} ± {100 * r['trained_se']:.1f} | "
            f"{r['gain_points']:+.1f} ± {r['gain_se_points']:.1f} | {r['iterations']} | "
            f"{(r['wall_s'] or math.nan) / 60:.1f} |"
        )
        if at:
            w, t = r["eval_at"]["warm"], r["eval_at"]["trained"]
            gse = 100 * math.hypot(w["se"], t["se"])
            line += (
                f" {100 * w['rate']:.1f} ± {100 * w['se']:.1f} | "
                f"{100 * t['rate']:.1f} ± {100 * t['se']:.1f} | "
                f"{100 * (t['rate'] - w['rate']):+.1f} ± {gse:.1f} |"
            )
        if pre:
            f = r.get("prefill")
            line += f" {f['successes']} ({f['tasks']} of {f['of']}) |" if f else " - |"
        lines.append(line + _task_cells(r["tasks"]))
    if any(r["drift"]["replayed"] for r in rows):
        lines += [
            "",
            "What the off-policy correction corrected, mean over iterations: replayed rows "
            "in all, per-sequence log-ratio sum(pi_prox - mu) of replayed and of fresh "
            "trajectories, mean importance weight of replayed tokens and the share truncated "
            "at w_max, staleness of fresh trajectories (versions):",
            "",
            "| seed | replayed rows | log-ratio, replayed | log-ratio, fresh | weight, replayed "
            "| truncated, replayed | staleness |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            d = r["drift"]
            lines.append(
                f"| {r['seed']} | {d['replayed']:.0f} | {d['seq_logratio_replay']:+.2f} | "
                f"{d['seq_logratio_fresh']:+.3f} | {d['weight_replay']:.3f} | "
                f"{100 * d['truncated_replay']:.1f} % | {d['staleness']:.2f} |"
            )
    lines += _family_lines(rows)
    if rows:
        gains = [r["gain_points"] for r in rows]
        m, lo, hi = t_interval(gains)
        sd = statistics.stdev(gains) if len(gains) > 1 else math.nan
        lines += [
            "",
            f"Gain over seeds: mean {m:+.1f} points (95 % CI {lo:+.1f} to {hi:+.1f}, standard "
            f"deviation {sd:.1f}), min {min(gains):+.1f}, max {max(gains):+.1f}; seeds with "
            f"at least +15: {sum(g >= 15 for g in gains)} of {len(gains)}.",
        ]
    paired = other = None
    if args.paired_with and rows:
        other = json.loads((ROOT / "benchmarks" / "results" / f"{args.paired_with}.json")
                           .read_text())  # fmt: skip
        other["name"] = args.paired_with
        theirs = {r["seed"]: r["gain_points"] for r in other["runs"]}
        diffs = {r["seed"]: r["gain_points"] - theirs[r["seed"]] for r in rows
                 if r["seed"] in theirs}  # fmt: skip
        if diffs:
            m, lo, hi = t_interval(list(diffs.values()))
            paired = {"with": args.paired_with, "their_args": other["demo_args"],
                      "diff_points": diffs, "mean": m, "ci95": [lo, hi]}  # fmt: skip
            per = ", ".join(f"seed {k}: {v:+.1f}" for k, v in diffs.items())
            lines += [
                "",
                f"Paired with `{args.paired_with}` (`{' '.join(other['demo_args'])}`), this "
                f"variant's gain minus that one's: {per}; mean {m:+.1f} points (95 % CI "
                f"{lo:+.1f} to {hi:+.1f}, n = {len(diffs)}).",
            ]
    md = "\n".join(lines)
    print(md)
    (out / "results.md").write_text(md + "\n")
    if args.save_as:
        dest = ROOT / "benchmarks" / "results"
        (dest / f"{args.save_as}.md").write_text(md + "\n")
        (dest / f"{args.save_as}.json").write_text(
            json.dumps({"demo_args": base, "runs": rows, "paired": paired}, indent=2)
        )
        if rows:
            plot(dest / f"{args.save_as}.png", args.save_as, rows, other)
    return 0


if __name__ == "__main__":
    sys.exit(main())

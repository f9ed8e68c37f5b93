"""Does the warm start keep its format at the rollout temperature? The tiny model and the reader
after the same warm-start recipe, sampled at T=1 and at the evaluation's 0.6.

    python benchmarks/warm_start_format.py --out runs/wsf --save-as warm-start-format-<date>
    python benchmarks/warm_start_format.py --out runs/wsf-dry --demos 4 --tasks 2 --runs 1 \\
        --bases tiny                                                 # a dry run

RL learns only from what the policy samples at the rollout temperature (1, the reference's):
a warm start whose actions stop parsing at T=1 gives it nothing. Per base (`--bases`: the
tiny random Qwen2.5-VL, `arpo-tiny-model` seed 0; the reader, `arpo-reader` with
`--reader-layers`):

1. warm start: `arpo sft` on `--demos` oracle demonstrations of `click_button` (task seed
   100) with the `som` observation, at most `--sft-epochs` epochs or until the mean NLL is
   `--target-nll`, at the base's own learning rate (`arpo train`'s: 1e-3 for the tiny
   model, 5e-5 for the reader); the same demonstrations and stopping rule for both;
2. `arpo eval` of the warm start with `som` on `--tasks` of its demonstrations' tasks and on
   `--tasks` unseen `click_button` tasks (task seed 2000), `--runs` episodes per task, at
   temperature 1 and at 0.6: success, and the share of actions that did not parse (every
   turn whose response is not an action; with `arpo train`'s default, a parse failure ends
   the episode).

Results: benchmarks/results/<save-as>.{json,md} (date, machine, commit). Run it alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from _machine import run_header

ROOT = Path(__file__).resolve().parent.parent
DEMO_TASK_SEED = 100
UNSEEN_TASK_SEED = 2000


def _pool(out: Path, n: int, seed: int) -> Path:
    from arpo_envs.sim.tasks import write_tasks

    if not out.exists():
        write_tasks(out, ["click_button"], n, seed)
        (out / "test_all.json").unlink()
    return out


def warm_start(args: argparse.Namespace, base: str, out: Path) -> tuple[str, dict]:
    from arpo.offline.sft import SFTConfig
    from arpo.offline.sft import run as run_sft
    from arpo.policy.reader import build_reader
    from arpo.policy.tiny import build_tiny_model
    from arpo.train import READER_SFT_LR

    folder = out / base
    if not (folder / "config.json").exists():
        if base == "tiny":
            build_tiny_model(folder, seed=0)
        else:
            build_reader(folder, layers=args.reader_layers, seed=0)
    sft = out / f"sft-{base}"
    done = sft / "summary.json"
    if not done.exists():
        t0 = time.monotonic()
        summary = run_sft(
            SFTConfig(
                model=str(folder), out=str(sft), families=["click_button"], per_family=args.demos,
                task_seed=DEMO_TASK_SEED, epochs=args.sft_epochs, target_nll=args.target_nll,
                observation_type="som", lr=1e-3 if base == "tiny" else READER_SFT_LR,
            )
        )  # fmt: skip
        summary["wall_s"] = round(time.monotonic() - t0, 1)
        done.write_text(json.dumps(summary, indent=2, default=str))
    return str(sft), json.loads(done.read_text())


def evaluate(model: str, tasks: Path, temperature: float, runs: int, out: Path) -> dict:
    from arpo.config import load_config
    from arpo.pool.evaluate import EvalConfig, run_eval
    from arpo.train import TrainConfig

    done = out / "eval.json"
    if not done.exists():
        cfg = load_config(TrainConfig, None, ["actor.episode.observation_type='som'"])
        run_eval(
            EvalConfig(
                model=model, verify=False, tasks=str(tasks), runs_per_task=runs,
                temperature=temperature, out=str(out), progress_s=0,
                local_actor_args=[*cfg.pool_actor_args(), "progress_s=0"],
            )
        )  # fmt: skip
    ov = json.loads(done.read_text())["overall"]
    return {
        "success_rate": ov["success_rate_episodes"],
        "parse_failure_rate": ov["parse_failure_rate"],
        "episodes": ov["episodes"],
        "mean_steps": ov["mean_steps"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/warm-start-format")
    ap.add_argument("--bases", default="tiny,reader")
    ap.add_argument("--reader-layers", type=int, default=30)
    ap.add_argument("--demos", type=int, default=32, help="Demonstrations (click_button tasks).")
    ap.add_argument("--sft-epochs", type=int, default=20)
    ap.add_argument("--target-nll", type=float, default=0.06)
    ap.add_argument("--tasks", type=int, default=16, help="Tasks of each evaluation pool.")
    ap.add_argument("--runs", type=int, default=2, help="Episodes per task.")
    ap.add_argument("--save-as", default="")
    args = ap.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    seen = _pool(out / "seen", args.tasks, DEMO_TASK_SEED)
    unseen = _pool(out / "unseen", args.tasks, UNSEEN_TASK_SEED)
    if {f.stem for f in seen.rglob("*.json")} & {f.stem for f in unseen.rglob("*.json")}:
        raise SystemExit("the unseen tasks overlap the demonstrations' tasks")
    res: dict = {"settings": vars(args), "bases": {}}
    for base in [b for b in args.bases.split(",") if b]:
        model, sft = warm_start(args, base, out)
        row = {"sft": {k: sft.get(k) for k in ("demos", "steps", "nll_before", "nll_after",
                                               "wall_s")}}  # fmt: skip
        for name, pool in (("seen", seen), ("unseen", unseen)):
            for t in (1.0, 0.6):
                row[f"{name}_t{t:g}"] = evaluate(
                    model, pool, t, args.runs, out / f"eval-{base}-{name}-t{t:g}"
                )
        res["bases"][base] = row
        print(base, json.dumps(row), flush=True)
    header = run_header()
    md = [
        f"# Warm start at the rollout temperature, {header['date']}",
        "",
        f"`python benchmarks/warm_start_format.py --bases {args.bases} --reader-layers "
        f"{args.reader_layers} --demos {args.demos} --tasks {args.tasks} --runs {args.runs}` "
        f"(commit {header['commit']}); `som`, {args.tasks} tasks per pool, {args.runs} episodes per task.",
        "",
        "| base | sft steps | NLL after | pool | T | success | actions not parsed | mean steps |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for base, row in res["bases"].items():
        for name in ("seen", "unseen"):
            for t in (1.0, 0.6):
                e = row[f"{name}_t{t:g}"]
                md.append(
                    f"| {base} | {row['sft']['steps']} | {row['sft']['nll_after']:.3f} | {name} | "
                    f"{t:g} | {100 * e['success_rate']:.1f} % | "
                    f"{100 * e['parse_failure_rate']:.1f} % | {e['mean_steps']:.2f} |"
                )
    text = "\n".join(md) + "\n"
    print(text)
    if args.save_as:
        res.update(header)
        dest = ROOT / "benchmarks" / "results"
        (dest / f"{args.save_as}.json").write_text(json.dumps(res, indent=1) + "\n")
        (dest / f"{args.save_as}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The learning experiment: GRPO, ARPO, uncorrected replay and the offline baselines, compared.

    .venv/bin/python benchmarks/experiment_methods.py                      # everything, 3 seeds
    .venv/bin/python benchmarks/experiment_methods.py --seeds 0 --iterations 4   # a quick look
    .venv/bin/python benchmarks/experiment_methods.py --report-only        # tables + plot again

One warm start for every method: the tiny Qwen2.5-VL (`arpo-tiny-model`, seed 0) after
`arpo sft` on the oracle demonstrations of 16 simulated `click_button` tasks (task seed 0),
exactly what `arpo train` builds. Success on those tasks is sparse (about 1 in 5 greedily,
fewer when sampling at temperature 1), so many GRPO groups have no success at all: the
setting where the paper expects replay to help. Then, per seed:

- online (`arpo train`, learner + one actor with `--envs` simulated desktops, up to
  `--staleness` policy versions in flight), `--iterations` iterations of `--groups` groups
  of 4 episodes each, reward = checker score + `--format-weight` x format reward (0.5,
  the reference's, by default):
  - `grpo`:  GRPO, no replay (`learner.assemble.replay.enabled=false`);
  - `arpo`:  replay of stored successes into groups without one, importance-corrected
    (weight exp(pi_prox - mu) of the replayed success's own behaviour log-probs);
  - `arpo_uncorrected`: the same replay as the reference implementation trains it
    (`learner.trainer.loss.correct_replay=false`: the ratio of a replayed success
    starts at 1);
- offline, from at least as many environment episodes (`arpo collect` of the warm start
  at temperature 1, as many episodes per task as the most any online method of that seed
  ran, counting the episodes its actors ran ahead that were never trained on; one
  collection per seed shared by the three methods), then `arpo offline --algo
  dpo|kto|rft` at the online learner's learning rate (1e-4, `--offline-lr`) for
  `--offline-epochs` passes, batches of 8;
- every resulting policy, and the warm start itself, evaluated with `arpo eval` on the
  16 tasks (`--eval-runs` episodes per task, temperature 0.6 as the reference evaluates).

The format reward is on (0.5, the reference's): the replay trigger reads the checker
scores with the population std, as the reference does, so a group without a success is
replayed into even when one of its episodes failed to parse (an earlier version read the
total reward and switched the format reward off to make such groups trigger).

Writes `<out>/results.json`, `<out>/results.md` (the tables the README quotes) and
`<out>/curves.png` (training success rate against iteration, mean and min-max over seeds,
and the final evaluation of every method with one dot per seed). A finished run or
evaluation is not run again (delete its folder to redo it), so an interrupted experiment
continues where it stopped. Runs are sequential; nothing else should run on the machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

log = logging.getLogger("experiment")

ONLINE = ("grpo", "arpo", "arpo_uncorrected")
OFFLINE = ("dpo", "kto", "rft")
GROUP_SIZE = 4
SMOOTH = 4  # iterations per point of the plotted training curves


def _train_config(args: argparse.Namespace, method: str, seed: int, model: str, tasks: str):
    from arpo.train import TrainConfig

    cfg = TrainConfig(
        run_dir=str(Path(args.out) / "runs" / f"{method}-s{seed}"),
        model=model,
        tasks=tasks,
        seed=seed,
        minutes=0,
        restart=False,
        progress_s=30,
        eval_runs_per_task=0,  # evaluated below, like every other method
        sim_envs_per_actor=args.envs,
    )
    la = cfg.learner
    replay = replace(la.assemble.replay, enabled=method != "grpo")
    la = replace(
        la,
        iterations=args.iterations,
        assemble=replace(
            la.assemble,
            group_size=GROUP_SIZE,
            groups_per_step=args.groups,
            max_staleness=args.staleness,
            replay=replay,
        ),
        trainer=replace(
            la.trainer,
            loss=replace(la.trainer.loss, correct_replay=method != "arpo_uncorrected"),
        ),
    )
    # The learner is gone when the actors are stopped: nothing would acknowledge a flush.
    episode = replace(cfg.actor.episode, format_weight=args.format_weight)
    return replace(cfg, learner=la, actor=replace(cfg.actor, episode=episode, flush_deadline_s=5.0))


def _actor_args(args: argparse.Namespace) -> list[str]:
    """The local actor of eval / collect: the episode limits of the online runs' actors."""
    from arpo.train import TrainConfig

    ep = TrainConfig().actor.episode
    return [
        f"sim_envs={args.envs}",
        f"episode.max_steps={ep.max_steps}",
        f"episode.max_new_tokens={ep.max_new_tokens}",
    ]


def _eval(args: argparse.Namespace, policy: str, tasks: str, out: Path, seed: int) -> dict:
    from arpo.learner.evaluate import EvalConfig, run_eval

    done = out / "eval.json"
    if done.exists():
        return json.loads(done.read_text())
    run_eval(
        EvalConfig(
            model=policy,
            verify=False,
            tasks=tasks,
            runs_per_task=args.eval_runs,
            temperature=0.6,
            out=str(out),
            progress_s=0,
            local_actor_args=_actor_args(args),
        )
    )
    return json.loads(done.read_text())


def _rate(ev: dict) -> float:
    return float(ev["overall"]["success_rate_episodes"])


def _online(args, method: str, seed: int, model: str, tasks: str) -> dict[str, Any]:
    from arpo.learner.checkpoint import latest_checkpoint
    from arpo.learner.metrics import read_metrics
    from arpo.train import TrainRun

    cfg = _train_config(args, method, seed, model, tasks)
    run_dir = Path(cfg.run_dir)
    summary = run_dir / "summary.json"
    if not summary.exists():
        log.info("online %s seed %d -> %s", method, seed, run_dir)
        t0 = time.monotonic()
        TrainRun(cfg).run()
        s = json.loads(summary.read_text())
        s["wall_s"] = round(time.monotonic() - t0, 1)
        summary.write_text(json.dumps(s, indent=2))
    s = json.loads(summary.read_text())
    rows = read_metrics(run_dir / "learner" / "metrics.jsonl")
    ckpt = latest_checkpoint(run_dir / "learner" / "checkpoints", verify=False)
    if ckpt is None:
        raise SystemExit(f"{run_dir}: no checkpoint; see {run_dir / 'logs'}")
    ev = _eval(args, str(ckpt / "model"), tasks, run_dir / "eval", seed)
    acc = s.get("accounting", {})
    return {
        "curve": [r.get("charts/success_rate") for r in rows],
        "replay_hits": sum(r.get("replay/hits", 0) for r in rows),
        "triggered": sum(r.get("replay/triggered", 0) for r in rows),
        "groups": sum(r.get("data/groups", 0) for r in rows),
        "weight_replay": [
            r["losses/weight_replay_mean"]
            for r in rows
            if r.get("losses/weight_replay_mean") is not None
        ],
        "version_gap": [
            r["replay/version_gap_mean"]
            for r in rows
            if r.get("replay/version_gap_mean") is not None
        ],
        "staleness": [r.get("charts/staleness_mean") for r in rows],
        "episodes": acc.get("finished"),
        "trained": sum(r.get("charts/episodes", 0) for r in rows),
        "eval": _rate(ev),
        "wall_s": s.get("wall_s"),
    }


def _offline(args, seed: int, model: str, tasks: str, budget: int) -> dict[str, dict[str, Any]]:
    from arpo.learner.collect import CollectConfig, load_outcomes, run_collect
    from arpo.offline.offline import OfflineConfig
    from arpo.offline.offline import run as run_offline

    base = Path(args.out) / "runs" / f"offline-s{seed}"
    data = base / "collect"
    if not (data / "outcomes.json").exists():
        log.info("collect seed %d -> %s", seed, data)
        run_collect(
            CollectConfig(
                model=model,
                verify=False,
                tasks=tasks,
                runs_per_task=-(-budget // 16),
                temperature=1.0,
                out=str(data),
                overwrite=True,
                progress_s=0,
                local_actor_args=_actor_args(args),
            )
        )
    outcomes = load_outcomes(data / "outcomes.json")
    episodes = sum(int(t["runs"]) for t in outcomes["tasks"].values())
    successes = sum(int(t["successes"]) for t in outcomes["tasks"].values())
    out: dict[str, dict[str, Any]] = {}
    for algo in OFFLINE:
        adir = base / algo
        if not (adir / "model" / "config.json").exists():
            log.info("offline %s seed %d -> %s", algo, seed, adir)
            run_offline(
                OfflineConfig(
                    algo=algo,
                    model=model,
                    data=str(data),
                    out=str(adir / "model"),
                    lr=args.offline_lr,
                    epochs=args.offline_epochs,
                    batch_size=8,
                    seed=seed,
                )
            )
        ev = _eval(args, str(adir / "model"), tasks, adir / "eval", seed)
        out[algo] = {"eval": _rate(ev), "episodes": episodes, "successes": successes}
    return out


def _spread(xs: list[float]) -> str:
    if not xs:
        return "-"
    m = statistics.mean(xs)
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{100 * m:.1f} ± {100 * sd:.1f}"


def report(out: Path, results: dict[str, Any]) -> str:
    seeds = results["seeds"]
    lines = [
        f"Warm start (SFT) evaluation: {100 * results['warm_start']:.1f} % "
        f"({results['eval_runs']} episodes per task x 16 tasks, temperature 0.6).",
        "Online: {iterations} iterations x {groups} groups x 4 episodes, max staleness "
        "{staleness}, reward = checker score + {format_weight} x format reward; offline: "
        "lr {offline_lr}, {offline_epochs} epochs. Seeds with results: {done}.".format(
            **{"format_weight": 0.5, **results.get("settings", {})},
            done=", ".join(
                str(s) for s in seeds if any(str(s) in v for v in results["methods"].values())
            ),
        ),
        "",
        "| method | episodes run per seed (trained on) | final success, mean ± sd (%) | per seed (%) | "
        "training success, last third (%) | replay hits / triggered groups |",
        "|---|---|---|---|---|---|",
    ]
    for m in ONLINE + OFFLINE:
        per = [results["methods"][m][str(s)] for s in seeds if str(s) in results["methods"][m]]
        if not per:
            continue
        evals = [p["eval"] for p in per]
        eps = [str(p.get("episodes")) + (f" ({p['trained']:.0f})" if "trained" in p else "")
               for p in per]  # fmt: skip
        if m in ONLINE:
            last = []
            for p in per:
                c = [x for x in p["curve"] if x is not None]
                k = max(1, len(c) // 3)
                last.append(statistics.mean(c[-k:]))
            train = _spread(last)
            hits = (
                f"{sum(p['replay_hits'] for p in per):.0f} / {sum(p['triggered'] for p in per):.0f}"
                if m != "grpo"
                else "- (no replay)"
            )
        else:
            train, hits = "-", "-"
        lines.append(
            f"| {m} | {', '.join(map(str, eps))} | {_spread(evals)} | "
            f"{', '.join(f'{100 * e:.1f}' for e in evals)} | {train} | {hits} |"
        )
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    return text


def plot(out: Path, results: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(1, 2, figsize=(12, 4))
    for m in ONLINE:
        curves = [p["curve"] for p in results["methods"][m].values()]
        if not curves:
            continue
        n = min(len(c) for c in curves)
        a = np.array([[np.nan if x is None else x for x in c[:n]] for c in curves], float)
        # Each point is 16 episodes: a moving mean over `SMOOTH` iterations per seed.
        k = min(SMOOTH, n)
        a = np.array([np.convolve(np.nan_to_num(r), np.ones(k) / k, mode="valid") for r in a])
        it = np.arange(k, n + 1)
        ax[0].plot(it, a.mean(axis=0), label=f"{m} (n={len(curves)})")
        ax[0].fill_between(it, a.min(axis=0), a.max(axis=0), alpha=0.2)
    ax[0].axhline(
        results["warm_start"], color="gray", ls="--", lw=1, label="warm start, eval at T=0.6"
    )
    ax[0].set_xlabel("iteration")
    ax[0].set_ylabel(f"success rate (T=1), mean of {SMOOTH} iterations")
    ax[0].set_title("training episodes (mean and min-max over seeds)")
    ax[0].legend(fontsize=8)
    ax[0].grid(alpha=0.3)
    names = [m for m in ONLINE + OFFLINE if results["methods"][m]]
    for i, m in enumerate(names):
        ys = [p["eval"] for p in results["methods"][m].values()]
        ax[1].bar(i, statistics.mean(ys), alpha=0.5)
        ax[1].scatter([i] * len(ys), ys, color="k", s=12, zorder=3)
    ax[1].axhline(results["warm_start"], color="gray", ls="--", lw=1)
    ax[1].set_xticks(range(len(names)), names, rotation=20)
    ax[1].set_ylabel("evaluation success rate")
    ax[1].set_title("final policy, same environment episodes")
    ax[1].grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path = out / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/experiment", help="Output folder.")
    p.add_argument("--seeds", default="0,1,2", help="Comma-separated seeds.")
    p.add_argument("--methods", default=",".join(ONLINE + OFFLINE), help="Methods to run.")
    p.add_argument("--iterations", type=int, default=16, help="Learner iterations per run.")
    p.add_argument("--groups", type=int, default=4, help="Groups of 4 episodes per iteration.")
    p.add_argument("--staleness", type=int, default=3, help="learner.assemble.max_staleness.")
    p.add_argument("--envs", type=int, default=4, help="Simulated desktops of the actor.")
    p.add_argument(
        "--format-weight",
        type=float,
        default=0.5,
        help="Online reward = checker score + this x format reward (0.5: the reference).",
    )
    p.add_argument("--eval-runs", type=int, default=4, help="Evaluation episodes per task.")
    p.add_argument("--offline-lr", type=float, default=1e-4, help="arpo offline lr.")
    p.add_argument("--offline-epochs", type=int, default=2, help="arpo offline epochs.")
    p.add_argument("--report-only", action="store_true", help="Tables and plot from results.")
    p.add_argument(
        "--save-as",
        default="",
        help="Also copy results.md / .json and curves.png to benchmarks/results/<name>.*.",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = Path(args.out).resolve()
    args.out = str(out)
    out.mkdir(parents=True, exist_ok=True)
    res_path = out / "results.json"
    if args.report_only:
        results = json.loads(res_path.read_text())
        print(report(out, results))
        plot(out, results)
        _save_as(out, args.save_as)
        return 0

    from arpo.train import TrainConfig, TrainRun

    base = TrainRun(TrainConfig(run_dir=str(out / "base")))
    base.run_dir.mkdir(parents=True, exist_ok=True)
    model = base.policy()
    tasks = str(Path(base.task_pool()) / "sim")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    methods = [m for m in args.methods.split(",") if m]
    bad = sorted(set(methods) - set(ONLINE + OFFLINE))
    if bad:
        p.error(f"--methods: unknown {bad}; choose from {', '.join(ONLINE + OFFLINE)}")
    results: dict[str, Any] = (
        json.loads(res_path.read_text()) if res_path.exists() else {"methods": {}}
    )
    results.update(
        seeds=sorted(set(results.get("seeds", [])) | set(seeds)),
        eval_runs=args.eval_runs,
        settings={k: v for k, v in vars(args).items() if k != "report_only"},
    )
    for m in ONLINE + OFFLINE:
        results["methods"].setdefault(m, {})
    results["warm_start"] = _rate(_eval(args, model, tasks, out / "warm_start_eval", 0))

    def save() -> None:
        res_path.write_text(json.dumps(results, indent=2))

    for seed in seeds:
        for m in methods:
            if m in ONLINE:
                results["methods"][m][str(seed)] = _online(args, m, seed, model, tasks)
                save()
        if set(methods) & set(OFFLINE):
            # At least as many episodes as any online method ran with this seed (the
            # online actors also run the episodes of the last iterations' grants that
            # are never trained on); the trained count when no online run exists.
            ran = [results["methods"][m][str(seed)]["episodes"] for m in ONLINE
                   if str(seed) in results["methods"][m]]  # fmt: skip
            budget = max(ran, default=args.iterations * args.groups * GROUP_SIZE)
            for algo, r in _offline(args, seed, model, tasks, budget).items():
                if algo in methods:
                    results["methods"][algo][str(seed)] = r
            save()
    save()
    print(report(out, results))
    print(plot(out, results))
    _save_as(out, args.save_as)
    return 0


def _save_as(out: Path, name: str) -> None:
    if not name:
        return
    import shutil

    dest = Path(__file__).resolve().parent / "results"
    dest.mkdir(parents=True, exist_ok=True)
    for src, ext in (("results.md", "md"), ("results.json", "json"), ("curves.png", "png")):
        shutil.copyfile(out / src, dest / f"{name}.{ext}")
    log.info("copied to %s/%s.{md,json,png}", dest, name)


if __name__ == "__main__":
    sys.exit(main())

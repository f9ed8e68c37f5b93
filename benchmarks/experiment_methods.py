"""The learning experiment: does ARPO's replay help? Paired seeds, task selection, held-out tasks.

    .venv/bin/python benchmarks/experiment_methods.py --out runs/experiment-r2 \\
        --save-as experiment-<date>                                # seeds 1-5, every method
    .venv/bin/python benchmarks/experiment_methods.py --out runs/exp-dry --seeds 7 \\
        --per-family 2 --heldout-per-family 1 --select-runs 2 --iterations 2 --eval-runs 1
                                                                   # a dry run of every step
    .venv/bin/python benchmarks/experiment_methods.py --out runs/experiment-r2 --report-only
    .venv/bin/python benchmarks/experiment_methods.py --recipe train --out runs/exp-long \
        --families fill_form,list_select,click_sequence,type_submit,menu_pick,dialog_confirm \
        --per-family 4 --heldout-per-family 2 --iterations 40 --eval-runs 16 \
        --seeds 17,18,19,20,21 --methods grpo,arpo,arpo_prefill,arpo_uncorrected,rft \
        --save-as experiment-long-<date>                          # long tasks, 15 steps
    # then the forced-staleness pair into the same folder: the same command with
    # --methods ...,arpo_stale,arpo_uncorrected_stale --staleness 4 --step-delay 6

Every step below is skipped when its output exists, so an interrupted experiment
continues where it stopped (delete a run's folder to redo it). Runs are sequential;
nothing else should run on the machine.

1. **Tasks.** `--families` x `--per-family` tasks generated with task seed 0: the
   candidate pool (default: 16 `click_button` tasks, the pool of the earlier experiment
   and of the learning ablation; multi-step families did not learn at this scale:
   `arpo train` on 16 `menu_pick` / `dialog_confirm` tasks, seed 99, went from 14.1 % to
   10.9 % in 24 iterations, docs/results/experiment.md). The same families x
   `--heldout-per-family` tasks with task seed 1000: held-out tasks, never in the warm
   start's demonstrations and never trained on (ids checked disjoint).
2. **Warm start.** The tiny Qwen2.5-VL (`arpo-tiny-model`, seed 0) after `arpo sft` on
   the candidate pool's oracle demonstrations for `--sft-epochs` epochs (17, `arpo
   train`'s default: sparse success), or until their mean NLL is `--sft-target-nll`.
3. **Task selection** as the paper does it: `arpo select-tasks` of the warm start,
   `--select-runs` episodes per candidate task at the rollout temperature 1, keeps the
   tasks with at least one success; the episodes are kept (`trajectories=`) for the
   pre-filled variant. The selected tasks are the training tasks of every method.
4. **Per seed** (paired: one warm start, one selection, one evaluation pool; the seed
   sets the learner's and the actors' random streams), `arpo train` on the training
   tasks with its embedded learner defaults (Dr. GRPO advantages, replay weight floor 1;
   docs/results/diagnosing.md), `--iterations` iterations of `--groups` groups
   x 4 episodes, reward = checker score + `--format-weight` x format reward (0.5, the
   reference's), up to `--staleness` policy versions in flight with `--envs` simulated
   desktops (4: heavy staleness for this learner):
   - `grpo`: replay off;
   - `arpo`: replay of stored successes into groups without one, weight
     clamp(exp(pi_prox - mu), 1, 2) of the replayed success's own behaviour log-probs;
   - `arpo_prefill`: `arpo` with the buffers pre-filled with the selection run's
     successes (`learner.assemble.replay.prefill`; the reference has it commented out);
   - `arpo_uncorrected`: replayed successes trained as the reference does (weight 1:
     `learner.trainer.loss.correct_replay=false`);
   - `arpo_nofloor` (not in the default set): the correction without the floor
     (`replay_w_min=0`, weights in [0, 2]);
   - `arpo_stale`, `arpo_uncorrected_stale` (not in the default set): `arpo` and
     `arpo_uncorrected` under heavy staleness: the learner takes `--step-delay` seconds
     longer per step (`learner.step_delay_s`, a slower learner as with a large model),
     so the actors run ahead to the admission bound and trajectories wait in the store
     for up to `--staleness` versions before they are trained (measured: the drift
     table's staleness columns). A slow weight transfer (`actor.weights_delay_s`) does
     not do it: a grant asks for the learner's version at the time it is issued, and
     the actor waits for those weights before the episode starts.
   Offline, from at least as many environment episodes: one `arpo collect` of the warm
   start per seed on the training tasks at temperature 1 (as many episodes per task as
   the most any online method of that seed ran, counting the episodes its actors ran
   ahead that were never trained on), then `arpo offline --algo dpo|kto|rft` (lr
   `--offline-lr`, KTO `--kto-lr`, `--offline-epochs` passes, batches of 8).
5. **Evaluation.** The warm start and every final policy: one `arpo eval` on the
   training tasks and the held-out tasks together (`--eval-runs` episodes per task,
   temperature 0.6 as the reference evaluates), split by task.

Report (`<out>/results.md`, `results.json`, `curves.png`): success per method and seed on
the training and the held-out tasks; the paired differences (same seed) with their mean
and 95 % t-interval over seeds (GRPO - warm start, ARPO - GRPO, pre-filled - ARPO,
ARPO - uncorrected, RFT - GRPO, ...); the drift under staleness per online method
(staleness mean / max, per-sequence log-ratio pi_prox - mu of fresh and replayed
trajectories, the replay weights); training curves with one line per seed and the final
evaluations with one dot per seed.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from _earlier import earlier_config
from _runs import model_to_evaluate
from _stats import strict_json, t_interval

log = logging.getLogger("experiment")

ONLINE = (
    "grpo",
    "arpo",
    "arpo_prefill",
    "arpo_uncorrected",
    "arpo_nofloor",
    "arpo_stale",
    "arpo_uncorrected_stale",
    "tree_arpo",
    "tree_grpo",
)
OFFLINE = ("dpo", "kto", "rft")
DEFAULT_METHODS = ("grpo", "arpo", "arpo_prefill", "arpo_uncorrected", "dpo", "kto", "rft")
GROUP_SIZE = 4
HELDOUT_TASK_SEED = 1000
SMOOTH = 4  # iterations per point of the plotted training curves
# Paired differences reported, (a, b): a - b per seed.
CONTRASTS = (
    ("grpo", "warm_start"),
    ("arpo", "warm_start"),
    ("arpo", "grpo"),
    ("arpo_prefill", "arpo"),
    ("arpo_prefill", "grpo"),
    ("arpo", "arpo_uncorrected"),
    ("arpo_nofloor", "arpo_uncorrected"),
    ("arpo_stale", "arpo_uncorrected_stale"),
    ("arpo_stale", "arpo"),
    ("rft", "grpo"),
    ("rft", "arpo"),
    ("rft", "arpo_prefill"),
    ("dpo", "warm_start"),
    ("kto", "warm_start"),
    ("rft", "warm_start"),
    ("tree_arpo", "rft"),
    ("tree_arpo", "grpo"),
    ("tree_arpo", "arpo"),
    ("tree_grpo", "grpo"),
    ("tree_arpo", "warm_start"),
)
# ---------------------------------------------------------------------------- set-up


TRAIN_RECIPE = ["actor.episode.max_steps=15"]
"""`--recipe train`: `arpo train`'s defaults with the reference's 15-step budget."""


def _config(args: argparse.Namespace, **fields):
    """The `TrainConfig` of `--recipe`: the earlier experiment's (`earlier`: 4-step episodes,
    48-token responses, 16 tasks per family, this script's `--envs`) or `arpo train`'s
    defaults with 15-step episodes (`train`), with `fields` over it."""
    if args.recipe == "earlier":
        cfg = earlier_config(**{"sim_envs_per_actor": args.envs, **fields})
    else:
        from arpo.config import load_config
        from arpo.train import TrainConfig

        cfg = replace(load_config(TrainConfig, None, TRAIN_RECIPE), **fields)
    episode = replace(cfg.actor.episode, observation_type=args.observation)
    trainer = replace(
        cfg.learner.trainer,
        lr=args.lr or cfg.learner.trainer.lr,
        train_layers=args.train_layers,
    )
    return replace(
        cfg,
        base=args.base if not cfg.model else "tiny",
        reader_layers=args.reader_layers,
        sft_lr=args.sft_lr,
        actor=replace(cfg.actor, episode=episode),
        learner=replace(cfg.learner, trainer=trainer),
    )


def _actor_args(args: argparse.Namespace) -> list[str]:
    """The local actor of eval / collect / select: the online runs' episode limits."""

    return [*_config(args).pool_actor_args(), "progress_s=0"]


def _copy_tasks(ids: list[str], src: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    by_id = {f.stem: f for f in src.rglob("*.json")}
    for tid in ids:
        shutil.copyfile(by_id[tid], dest / f"{tid}.json")


def setup(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Warm start, candidate and held-out tasks, task selection; their paths and ids."""
    from arpo_envs.sim.tasks import write_tasks

    from arpo.pool.select import SelectConfig, run_selection
    from arpo.train import TrainRun

    families = [f for f in args.families.split(",") if f]
    sft = (
        {"sft_epochs": args.sft_epochs, "sft_target_nll": args.sft_target_nll}
        if args.recipe == "earlier"
        else {}
    )
    base = TrainRun(
        _config(
            args,
            run_dir=str(out / "base"),
            sim_families=families,
            sim_tasks_per_family=args.per_family,
            seed=0,
            **sft,
        )
    )
    base.run_dir.mkdir(parents=True, exist_ok=True)
    model = base.policy()
    pool = Path(base.task_pool()) / "sim"
    heldout = out / "heldout"
    if not heldout.exists():
        write_tasks(heldout, families, args.heldout_per_family, HELDOUT_TASK_SEED)
        (heldout / "test_all.json").unlink()
    other = out / "other_family"
    other_families = [f for f in args.other_families.split(",") if f]
    if other_families and not other.exists():
        write_tasks(other, other_families, args.other_per_family or args.heldout_per_family,
                    HELDOUT_TASK_SEED)  # fmt: skip
        (other / "test_all.json").unlink()
    cand = sorted(f.stem for f in pool.rglob("*.json"))
    held = sorted(f.stem for f in heldout.rglob("*.json"))
    if set(cand) & set(held):
        raise SystemExit(f"held-out tasks overlap the candidates: {set(cand) & set(held)}")
    sel_path = out / "selection" / "selection.json"
    if not sel_path.exists():
        log.info("task selection: %d candidates x %d runs", len(cand), args.select_runs)
        shutil.rmtree(out / "selection", ignore_errors=True)
        run_selection(
            SelectConfig(
                tasks=str(pool),
                runs_per_task=args.select_runs,
                out=str(sel_path),
                trajectories=str(out / "selection" / "kept"),
                local_actor=True,
                local_actor_args=[*_actor_args(args), f"engine.model={model!r}"],
                progress_s=0,
            )
        )
    selection = json.loads(sel_path.read_text())
    train = list(selection["selected"])
    if not train:
        raise SystemExit(f"{sel_path}: the warm start solved none of the candidates")
    train_pool = out / "train_tasks"
    eval_pool = out / "eval_tasks"
    others = sorted(f.stem for f in other.rglob("*.json")) if other.exists() else []
    if not eval_pool.exists():
        _copy_tasks(train, pool, train_pool)
        _copy_tasks(train, pool, eval_pool / "train")
        _copy_tasks(held, heldout, eval_pool / "heldout")
        if others:
            _copy_tasks(others, other, eval_pool / "other")
    return {
        "model": model,
        "pool": str(pool),
        "train_pool": str(train_pool),
        "eval_pool": str(eval_pool),
        "selection": str(sel_path),
        "kept": str(out / "selection" / "kept"),
        "candidates": cand,
        "train": train,
        "heldout": held,
        "other": others,
        "select_counts": {t: selection["tasks"][t]["successes"] for t in cand},
    }


# ---------------------------------------------------------------------------- evaluation


def _eval(args: argparse.Namespace, policy: str | Path | None, s: dict[str, Any],
          out: Path) -> dict:  # fmt: skip
    """`arpo eval` of `policy` on training + held-out tasks (read back from `out` when it has
    run: `policy` may then be None); success rates of each part."""
    from arpo.pool.evaluate import EvalConfig, run_eval

    done = out / "eval.json"
    if not done.exists():
        assert policy is not None, f"{out}: nothing evaluated yet and no model given"
        run_eval(
            EvalConfig(
                model=str(policy),
                verify=False,
                tasks=s["eval_pool"],
                runs_per_task=args.eval_runs,
                temperature=0.6,
                out=str(out),
                progress_s=0,
                local_actor_args=_actor_args(args),
            )
        )
    ev = json.loads(done.read_text())

    def rate(ids: list[str]) -> float:
        rows = [ev["tasks"][t] for t in ids]
        runs = sum(r["runs"] for r in rows)
        return sum(r["successes"] for r in rows) / runs if runs else math.nan

    out_ = {"train": rate(s["train"]), "heldout": rate(s["heldout"])}
    if s.get("other"):
        out_["other"] = rate(s["other"])
    pf = ev.get("overall", {}).get("parse_failure_rate")
    if pf is not None:
        out_["parse_failure_rate"] = pf
    return out_


# ---------------------------------------------------------------------------- online


def _train_config(args: argparse.Namespace, method: str, seed: int, s: dict[str, Any]):

    stale = method.endswith("_stale")
    tree = method.startswith("tree_")
    base = method.removesuffix("_stale").removeprefix("tree_")

    cfg = _config(
        args,
        run_dir=str(Path(args.out) / "runs" / f"{method}-s{seed}"),
        model=s["model"],
        tasks=s["pool"],
        seed=seed,
        minutes=0,
        restart=False,
        progress_s=30,
        eval_runs_per_task=0,  # evaluated below, like every other method
        # The pre-fill is the selection's successes (arpo_prefill) or none.
        prefill_runs_per_task=0,
        prefill_demos_from_turns=0,
    )
    la = cfg.learner
    replay = replace(
        la.assemble.replay,
        enabled=base != "grpo",
        prefill=s["kept"] if base == "arpo_prefill" else "",
    )
    loss = replace(
        la.trainer.loss,
        correct_replay=base != "arpo_uncorrected",
        replay_w_min=0.0 if base == "arpo_nofloor" else la.trainer.loss.replay_w_min,
    )
    assemble = replace(la.assemble, group_size=GROUP_SIZE, replay=replay)
    if args.recipe == "earlier":
        assemble = replace(assemble, groups_per_step=args.groups, max_staleness=args.staleness)
    elif stale:  # the staleness bound the slowed learner lets the actors run ahead to
        assemble = replace(assemble, max_staleness=args.staleness)
    grants = la.grants
    if tree:  # every group one tree of GROUP_SIZE leaves, forked on the simulated desktop
        grants = replace(grants, tree_slots=GROUP_SIZE, branch_width=args.branch_width,
                         branch_every=args.branch_every)  # fmt: skip
        assemble = replace(assemble, step_weight=args.step_weight)
    la = replace(
        la,
        selection=s["selection"],
        iterations=args.iterations,
        assemble=assemble,
        grants=grants,
        trainer=replace(la.trainer, loss=loss),
    )
    # The learner is gone when the actors are stopped: nothing would acknowledge a flush.
    episode = cfg.actor.episode
    if args.recipe == "earlier":
        episode = replace(episode, format_weight=args.format_weight)
    if stale:
        la = replace(la, step_delay_s=args.step_delay)
    actor = replace(cfg.actor, episode=episode, flush_deadline_s=5.0)
    return replace(cfg, learner=la, actor=actor)


def _values(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if r.get(key) is not None and not math.isnan(r[key])]


def _mean(xs: list[float]) -> float:
    return statistics.mean(xs) if xs else math.nan


def _online(args, method: str, seed: int, s: dict[str, Any]) -> dict[str, Any]:
    from arpo.learner.metrics import read_metrics
    from arpo.train import TrainRun

    cfg = _train_config(args, method, seed, s)
    run_dir = Path(cfg.run_dir)
    summary = run_dir / "summary.json"
    if not summary.exists():
        log.info("online %s seed %d -> %s", method, seed, run_dir)
        t0 = time.monotonic()
        TrainRun(cfg).run()
        sm = json.loads(summary.read_text())
        sm["wall_s"] = round(time.monotonic() - t0, 1)
        summary.write_text(json.dumps(sm, indent=2))
    sm = json.loads(summary.read_text())
    rows = read_metrics(run_dir / "learner" / "metrics.jsonl")
    ev = _eval(args, model_to_evaluate(run_dir, run_dir / "eval"), s, run_dir / "eval")
    acc = sm.get("accounting", {})
    lr_min = _values(rows, "losses/seq_logratio_replay_min")
    lr_max = _values(rows, "losses/seq_logratio_replay_max")
    fr_min = _values(rows, "losses/seq_logratio_fresh_min")
    fr_max = _values(rows, "losses/seq_logratio_fresh_max")
    successes = sum(
        (r.get("charts/success_rate") or 0.0) * r.get("charts/episodes", 0)
        for r in rows
        if r.get("charts/success_rate") is not None and not math.isnan(r["charts/success_rate"])
    )
    env_steps = max(_values(rows, "charts/env_steps") or [math.nan])
    return {
        "curve": [r.get("charts/success_rate") for r in rows],
        "env_steps": env_steps,
        "train_successes": successes,
        "successes_per_1k_steps": 1000 * successes / env_steps if env_steps else math.nan,
        "successes_per_learner_min": successes / (sm["wall_s"] / 60)
        if sm.get("wall_s")
        else math.nan,
        "parse_fail": [r.get("charts/parse_failure_rate") for r in rows],
        "replay_hits": sum(r.get("replay/hits", 0) for r in rows),
        "triggered": sum(r.get("replay/triggered", 0) for r in rows),
        "prefilled": max((r.get("replay/prefilled", 0) for r in rows), default=0),
        "groups": sum(r.get("data/groups", 0) for r in rows),
        "staleness_mean": _mean(_values(rows, "charts/staleness_mean")),
        "staleness_max": max(_values(rows, "charts/staleness_max") or [math.nan]),
        "dropped_stale": sum(r.get("data/dropped_stale", 0) for r in rows),
        "replay_logratio": [min(lr_min, default=math.nan), max(lr_max, default=math.nan)],
        "fresh_logratio": [min(fr_min, default=math.nan), max(fr_max, default=math.nan)],
        "weight_lowp_replay": [
            min(_values(rows, "losses/weight_lowp_replay_min"), default=math.nan),
            max(_values(rows, "losses/weight_lowp_replay_max"), default=math.nan),
        ],
        # Per run: the mean over iterations of the weight of all replayed tokens (1 when
        # uncorrected) and of the replayed successes' age in policy versions.
        "weight_replay_mean": _mean(_values(rows, "losses/weight_replay_mean")),
        "replay_age_mean": _mean(_values(rows, "replay/version_gap_mean")),
        "episodes": acc.get("finished"),
        "trained": sum(r.get("charts/episodes", 0) for r in rows),
        "eval": ev,
        "wall_s": sm.get("wall_s"),
    }


# ---------------------------------------------------------------------------- offline


def _offline(args, seed: int, s: dict[str, Any], budget: int, algos: list[str]) -> dict:
    from arpo.offline.offline import OfflineConfig
    from arpo.offline.offline import run as run_offline
    from arpo.pool.collect import CollectConfig, load_outcomes, run_collect

    base = Path(args.out) / "runs" / f"offline-s{seed}"
    data = base / "collect"
    if not (data / "outcomes.json").exists():
        log.info("collect seed %d -> %s (%d episodes at least)", seed, data, budget)
        run_collect(
            CollectConfig(
                model=s["model"],
                verify=False,
                tasks=s["train_pool"],
                runs_per_task=-(-budget // len(s["train"])),
                temperature=1.0,
                out=str(data),
                overwrite=True,
                progress_s=0,
                seed=seed,
                local_actor_args=_actor_args(args),
            )
        )
    outcomes = load_outcomes(data / "outcomes.json")
    episodes = sum(int(t["runs"]) for t in outcomes["tasks"].values())
    successes = sum(int(t["successes"]) for t in outcomes["tasks"].values())
    out: dict[str, dict[str, Any]] = {}
    for algo in algos:
        adir = base / algo
        # A method evaluated before needs no model: its folder may have been pruned.
        evaluated = (adir / "eval" / "eval.json").exists()
        if not evaluated and not (adir / "model" / "config.json").exists():
            log.info("offline %s seed %d -> %s", algo, seed, adir)
            run_offline(
                OfflineConfig(
                    algo=algo,
                    model=s["model"],
                    data=str(data),
                    out=str(adir / "model"),
                    lr=args.kto_lr if algo == "kto" else args.offline_lr,
                    epochs=args.offline_epochs,
                    batch_size=8,
                    seed=seed,
                    train_layers=args.train_layers,
                )
            )
        ev = _eval(args, None if evaluated else str(adir / "model"), s, adir / "eval")
        out[algo] = {"eval": ev, "episodes": episodes, "successes": successes}
    return out


# ---------------------------------------------------------------------------- report


def _offline_cost(out: Path, results: dict[str, Any]) -> None:
    """Environment steps and successes of each offline method's collection (its
    trajectories' turns), added to its results where missing."""
    from arpo.offline.data import read_trajectories

    for algo in OFFLINE:
        for seed, r in results["methods"].get(algo, {}).items():
            if "env_steps" in r:
                continue
            folder = out / "runs" / f"offline-s{seed}" / "collect" / "trajectories"
            if not folder.is_dir():
                continue
            steps = sum(t.steps for t in read_trajectories(folder))
            r["env_steps"] = steps
            r["train_successes"] = r.get("successes", math.nan)
            r["successes_per_1k_steps"] = 1000 * r["train_successes"] / steps if steps else math.nan
            r["successes_per_learner_min"] = math.nan


def _pct(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.1f}"


def _per_seed(results: dict[str, Any], method: str, part: str) -> dict[str, float]:
    if method == "warm_start":
        w = results["warm_start"][part]
        return {s: w for s in map(str, results["seeds"])}
    return {k: v["eval"][part] for k, v in results["methods"].get(method, {}).items()}


def contrasts(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Paired differences a - b over the seeds both have, per evaluation part."""
    rows = []
    for a, b in CONTRASTS:
        for part in ("train", "heldout"):
            pa, pb = _per_seed(results, a, part), _per_seed(results, b, part)
            seeds = sorted(set(pa) & set(pb), key=int)
            if len(seeds) < 1 or a == b:
                continue
            d = [pa[s] - pb[s] for s in seeds]
            m, lo, hi = t_interval(d)
            rows.append({"a": a, "b": b, "part": part, "seeds": seeds, "diffs": d,
                         "mean": m, "lo": lo, "hi": hi})  # fmt: skip
    return rows


def _recipe_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What `--recipe train` takes from `arpo train`'s defaults, recorded in results.json
    when the run starts, so a later `--report-only` reports what ran."""
    if args.recipe != "train":
        return {}
    c = _config(args)
    a, ep = c.learner.assemble, c.actor.episode
    return {
        "sft_target_nll": c.sft_target_nll,
        "groups": a.groups_per_step,
        "group_size": a.group_size,
        "staleness": a.max_staleness,
        "envs": c.sim_envs_per_actor,
        "max_new_tokens": ep.max_new_tokens,
        "format_weight": ep.format_weight,
    }


def _online_settings(st: dict[str, Any]) -> str:
    if st.get("recipe", "earlier") == "train":
        r = st["train_recipe"]
        return (
            f"Online: `arpo train`'s defaults with `{' '.join(TRAIN_RECIPE)}`: "
            f"{st['iterations']} iterations (learning rate decayed to 0 over them) x "
            f"{r['groups']} groups x {r['group_size']} episodes, max staleness "
            f"{r['staleness']}, {r['envs']} desktops, responses of at most "
            f"{r['max_new_tokens']} tokens, reward = checker score + {r['format_weight']} x format "
            "reward, no replay pre-fill but the selection's successes (arpo_prefill)."
        )
    return (
        f"Online: {st['iterations']} iterations x {st['groups']} groups x {GROUP_SIZE} "
        f"episodes, max staleness {st['staleness']}, {st['envs']} desktops, reward = checker "
        f"score + {st['format_weight']} x format reward."
    )


def report(out: Path, results: dict[str, Any]) -> str:
    s = results["setup"]
    st = results["settings"]
    w = results["warm_start"]
    seeds = [str(x) for x in results["seeds"]]
    stale = (
        f" The *_stale methods: the learner takes {st['step_delay']} s longer per step"
        f" (max staleness {st['staleness']})."
        if "step_delay" in st and any(m.endswith("_stale") for m in st["methods"].split(","))
        else ""
    )
    lines = [
        f"Tasks: {st['families']} x {st['per_family']} candidates (task seed 0); task "
        f"selection (warm start, {st['select_runs']} runs per task at T=1, >= 1 success) kept "
        f"{len(s['train'])} of {len(s['candidates'])} as training tasks; held-out: "
        f"{len(s['heldout'])} tasks of the same families (task seed {HELDOUT_TASK_SEED}), "
        "never trained on.",
        f"Warm start (SFT to NLL {st.get('train_recipe', st)['sft_target_nll']}) evaluation: "
        "training tasks "
        f"{_pct(w['train'])} %, held-out {_pct(w['heldout'])} % ({st['eval_runs']} episodes "
        "per task at T=0.6; the same protocol for every policy).",
        _online_settings(st)
        + f" Offline: lr {st['offline_lr']} (KTO {st['kto_lr']}), {st['offline_epochs']} "
        f"epochs. Seeds: {', '.join(seeds)}." + stale,
        "",
        "| method | training tasks, mean (%) | per seed | held-out, mean (%) | per seed | "
        "episodes run (trained) | replay hits / triggered | staleness mean / max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in ONLINE + OFFLINE:
        per = {k: v for k, v in results["methods"].get(m, {}).items() if k in seeds}
        if not per:
            continue
        ps = [per[k] for k in sorted(per, key=int)]
        tr = [p["eval"]["train"] for p in ps]
        ho = [p["eval"]["heldout"] for p in ps]
        eps = ", ".join(
            f"{p.get('episodes')}" + (f" ({p['trained']:.0f})" if "trained" in p else "")
            for p in ps
        )
        if m in ONLINE:
            hits = (
                "-"
                if m == "grpo"
                else f"{sum(p['replay_hits'] for p in ps):.0f} / "
                f"{sum(p['triggered'] for p in ps):.0f}"
            )
            stale = (
                f"{statistics.mean(p['staleness_mean'] for p in ps):.2f} / "
                f"{max(p['staleness_max'] for p in ps):.0f}"
            )
        else:
            hits = stale = "-"
        lines.append(
            f"| {m} | {_pct(statistics.mean(tr))} | {', '.join(map(_pct, tr))} | "
            f"{_pct(statistics.mean(ho))} | {', '.join(map(_pct, ho))} | {eps} | {hits} | "
            f"{stale} |"
        )
    lines += [
        "",
        "Paired differences (same seed), points; 95 % t-interval over the seeds:",
        "",
        "(The warm start is one evaluation shared by every seed: its own noise, about 5 "
        "points on the training tasks, is not in the intervals of the `- warm_start` rows.)",
        "",
        "| difference | tasks | mean | 95 % CI | per seed | seeds |",
        "|---|---|---|---|---|---|",
    ]
    for c in contrasts(results):
        c["seeds"] = [x for x in c["seeds"] if x in seeds]
        if not c["seeds"]:
            continue
        lines.append(
            f"| {c['a']} - {c['b']} | {c['part']} | {100 * c['mean']:+.1f} | "
            f"{100 * c['lo']:+.1f} .. {100 * c['hi']:+.1f} | "
            f"{', '.join(f'{100 * d:+.1f}' for d in c['diffs'])} | {len(c['seeds'])} |"
        )
    lines += [
        "",
        "Cost, per seed: environment steps the run's trajectories took (a tree's shared "
        "turns once; the offline methods': their collection's), successes among the "
        "training episodes (at the rollout temperature), successes per 1000 environment "
        "steps and per minute of the run's wall clock (learner and actors together; "
        "an offline method's is not recorded, `-`):",
        "",
        "| method | environment steps | training successes | per 1000 steps | per minute |",
        "|---|---|---|---|---|",
    ]
    for m in ONLINE + OFFLINE:
        ps = [v for k, v in sorted(results["methods"].get(m, {}).items(), key=lambda kv: int(kv[0]))
              if k in seeds and "env_steps" in v]  # fmt: skip
        if not ps:
            continue

        def col(key: str, fmt: str, ps=ps) -> str:
            xs = [p.get(key, math.nan) for p in ps]
            return ", ".join("-" if x is None or math.isnan(x) else format(x, fmt) for x in xs)

        lines.append(
            f"| {m} | {col('env_steps', '.0f')} | {col('train_successes', '.0f')} | "
            f"{col('successes_per_1k_steps', '.0f')} | {col('successes_per_learner_min', '.1f')} |"
        )
    lines += [
        "",
        "Drift of the online runs (over all their iterations and seeds): per-sequence "
        "log-ratio pi_prox - mu of fresh and of replayed trajectories (min .. max), "
        "exp(pi_prox - mu) before truncation on replayed decision tokens (behaviour "
        "probability < 0.9; the uncorrected run computes it but trains with 1), the mean "
        "weight of all replayed tokens and the mean age of replayed successes (policy "
        "versions) per seed, stale drops:",
        "",
        "| method | fresh log-ratio | replayed log-ratio | replay exp(pi_prox - mu), p < 0.9 | "
        "replayed-token weight per seed | replay age per seed | dropped stale | "
        "prefilled successes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in ONLINE:
        ps = [v for k, v in results["methods"].get(m, {}).items() if k in seeds]
        if not ps:
            continue

        def span(key: str, ps=ps) -> str:
            lo = min((p[key][0] for p in ps), default=math.nan)
            hi = max((p[key][1] for p in ps), default=math.nan)
            return "-" if math.isnan(lo) else f"{lo:+.2f} .. {hi:+.2f}"

        def each(key: str, fmt: str, ps=ps) -> str:
            xs = [p.get(key, math.nan) for p in ps]
            return "-" if all(math.isnan(x) for x in xs) else ", ".join(format(x, fmt) for x in xs)

        lines.append(
            f"| {m} | {span('fresh_logratio')} | {span('replay_logratio')} | "
            f"{span('weight_lowp_replay')} | {each('weight_replay_mean', '.3f')} | "
            f"{each('replay_age_mean', '.1f')} | {sum(p['dropped_stale'] for p in ps):.0f} | "
            f"{', '.join(str(int(p['prefilled'])) for p in ps)} |"
        )
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    return text


def plot(out: Path, results: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    seeds = [str(x) for x in results["seeds"]]
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, m in enumerate(ONLINE):
        runs = [v for k, v in results["methods"].get(m, {}).items() if k in seeds]
        for j, p in enumerate(runs):
            c = np.array([np.nan if x is None else x for x in p["curve"]], float)
            k = min(SMOOTH, len(c))
            y = np.convolve(np.nan_to_num(c), np.ones(k) / k, mode="valid")
            ax[0].plot(np.arange(k, len(c) + 1), y, color=colors[i % len(colors)], lw=1,
                       alpha=0.7, label=m if j == 0 else None)  # fmt: skip
    ax[0].set_xlabel("iteration")
    ax[0].set_ylabel(f"training success (T=1), mean of {SMOOTH} iterations")
    ax[0].set_title("training episodes, one line per seed")
    ax[0].legend(fontsize=8)
    ax[0].grid(alpha=0.3)
    names = [m for m in ONLINE + OFFLINE
             if any(k in seeds for k in results["methods"].get(m, {}))]  # fmt: skip
    for a, part in ((ax[1], "train"), (ax[2], "heldout")):
        for i, m in enumerate(names):
            ys = [v["eval"][part] for k, v in results["methods"][m].items() if k in seeds]
            a.bar(i, statistics.mean(ys), alpha=0.5, color=colors[i % len(colors)])
            a.scatter([i] * len(ys), ys, color="k", s=12, zorder=3)
        a.axhline(results["warm_start"][part], color="gray", ls="--", lw=1,
                  label="warm start")  # fmt: skip
        a.set_xticks(range(len(names)), names, rotation=25, fontsize=8)
        a.set_ylabel("evaluation success rate (T=0.6)")
        a.set_title(f"final policy, {'training' if part == 'train' else 'held-out'} tasks "
                    "(dot = seed)")  # fmt: skip
        a.grid(alpha=0.3, axis="y")
        a.legend(fontsize=8)
    fig.tight_layout()
    path = out / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/experiment-r2", help="Output folder.")
    p.add_argument("--seeds", default="1,2,3,4,5", help="Comma-separated seeds (0: selection).")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="Methods to run.")
    p.add_argument(
        "--recipe",
        choices=("earlier", "train"),
        default="earlier",
        help="earlier: the 2026-11-22..24 experiments' settings (4-step episodes; --groups, "
        "--staleness, --envs, --format-weight, --sft-* apply); train: `arpo train`'s defaults "
        "with 15-step episodes (those five options are ignored, but --staleness bounds the "
        "*_stale methods).",
    )
    p.add_argument("--families", default="click_button", help="Task families.")
    p.add_argument("--per-family", type=int, default=16, help="Candidate tasks per family.")
    p.add_argument("--heldout-per-family", type=int, default=8, help="Held-out per family.")
    p.add_argument("--select-runs", type=int, default=8, help="select-tasks runs per task.")
    p.add_argument("--sft-epochs", type=int, default=17, help="Warm-start epochs (at most).")
    p.add_argument(
        "--sft-target-nll", type=float, default=0.0, help="Warm-start target NLL (0: all epochs)."
    )
    p.add_argument("--iterations", type=int, default=24, help="Learner iterations per run.")
    p.add_argument("--groups", type=int, default=4, help="Groups of 4 episodes per iteration.")
    p.add_argument("--staleness", type=int, default=4, help="learner.assemble.max_staleness.")
    p.add_argument("--envs", type=int, default=4, help="Simulated desktops of the actor.")
    p.add_argument(
        "--step-delay",
        type=float,
        default=6.0,
        help="Extra seconds per learner step in the *_stale methods (learner.step_delay_s).",
    )
    p.add_argument(
        "--format-weight",
        type=float,
        default=0.5,
        help="Online reward = checker score + this x format reward (0.5: the reference).",
    )
    p.add_argument("--branch-width", type=int, default=2, help="tree_*: children per fork.")
    p.add_argument("--branch-every", type=int, default=3, help="tree_*: turns between forks.")
    p.add_argument("--step-weight", type=float, default=1.0, help="tree_*: step-level weight.")
    p.add_argument("--eval-runs", type=int, default=12, help="Evaluation episodes per task.")
    p.add_argument("--offline-lr", type=float, default=1e-4, help="arpo offline lr (dpo, rft).")
    p.add_argument("--kto-lr", type=float, default=1e-5, help="arpo offline lr of kto.")
    p.add_argument("--offline-epochs", type=int, default=2, help="arpo offline epochs.")
    p.add_argument(
        "--base",
        choices=("tiny", "reader"),
        default="tiny",
        help="The warm start's base: the tiny random model or the reader (arpo train base=).",
    )
    p.add_argument("--reader-layers", type=int, default=30, help="--base reader: text layers.")
    p.add_argument("--sft-lr", type=float, default=0.0, help="Warm-start lr (0: the base's).")
    p.add_argument(
        "--lr", type=float, default=0.0, help="Online learner lr (0: the recipe's, 1e-4)."
    )
    p.add_argument(
        "--train-layers",
        type=int,
        default=0,
        help="Train only the decoder's last N layers, in the warm start, the online runs and "
        "the offline ones (learner.trainer.train_layers; 0: every weight).",
    )
    p.add_argument(
        "--observation",
        default="screenshot",
        choices=("screenshot", "a11y_tree", "screenshot_a11y_tree", "som"),
        help="actor.episode.observation_type of every run, evaluation and demonstration.",
    )
    p.add_argument(
        "--other-families",
        default="",
        help="Families no run trains on, evaluated beside the held-out tasks (what does not "
        "transfer).",
    )
    p.add_argument(
        "--transfer-json",
        default="",
        help="Also write benchmarks/results/<name>.json in the transfer format (seeds; per "
        "method unseen_warm, unseen_trained, unseen_gain_ci, per_seed).",
    )
    p.add_argument(
        "--other-per-family",
        type=int,
        default=0,
        help="Tasks per --other-families family (0: --heldout-per-family).",
    )
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
    seeds = [int(x) for x in args.seeds.split(",") if x]
    res_path = out / "results.json"
    if args.report_only:
        results = json.loads(res_path.read_text())
        results["seeds"] = seeds
        _offline_cost(out, results)
        print(report(out, results))
        plot(out, results)
        _save_as(out, args.save_as, results)
        _transfer_json(args.transfer_json, results)
        return 0
    methods = [m for m in args.methods.split(",") if m]
    bad = sorted(set(methods) - set(ONLINE + OFFLINE))
    if bad:
        p.error(f"--methods: unknown {bad}; choose from {', '.join(ONLINE + OFFLINE)}")
    results: dict[str, Any] = (
        json.loads(res_path.read_text()) if res_path.exists() else {"methods": {}}
    )

    def save() -> None:
        res_path.write_text(json.dumps(results, indent=2))

    s = setup(args, out)
    results.update(
        setup=s,
        settings={k: v for k, v in vars(args).items() if k not in ("report_only", "seeds")},
    )
    if args.recipe == "train":
        results["settings"]["train_recipe"] = _recipe_settings(args)
    results["seeds"] = seeds
    for m in ONLINE + OFFLINE:
        results["methods"].setdefault(m, {})
    results["warm_start"] = _eval(args, s["model"], s, out / "warm_start_eval")
    save()
    for seed in seeds:
        for m in methods:
            if m in ONLINE:
                results["methods"][m][str(seed)] = _online(args, m, seed, s)
                save()
        algos = [m for m in OFFLINE if m in methods]
        if algos:
            ran = [results["methods"][m][str(seed)]["episodes"] for m in ONLINE
                   if str(seed) in results["methods"][m]]  # fmt: skip
            budget = max(ran, default=args.iterations * args.groups * GROUP_SIZE)
            for algo, r in _offline(args, seed, s, budget, algos).items():
                results["methods"][algo][str(seed)] = r
            save()
    print(report(out, results))
    print(plot(out, results))
    _save_as(out, args.save_as, results)
    _transfer_json(args.transfer_json, results)
    return 0


def transfer_summary(results: dict[str, Any]) -> dict[str, Any]:
    """The transfer format: per method with runs, the unseen (held-out) success of the warm
    start and of the trained policy (means over seeds, fractions), the per-seed paired gain's
    95 % t-interval, and per seed the figures (train / other family too where evaluated)."""
    warm = results.get("warm_start", {})
    seeds = [str(s) for s in results.get("seeds", [])]
    arms: dict[str, Any] = {}
    for m, runs in results.get("methods", {}).items():
        per = {s: runs[s]["eval"] for s in seeds if s in runs and "eval" in runs[s]}
        if not per:
            continue
        gains = [e["heldout"] - warm["heldout"] for e in per.values()]
        _, lo, hi = t_interval(gains)
        arms[m] = {
            "unseen_warm": warm.get("heldout"),
            "unseen_trained": statistics.mean(e["heldout"] for e in per.values()),
            "unseen_gain_ci": [lo, hi],
            "per_seed": {
                s: {
                    "unseen_trained": e["heldout"],
                    "unseen_gain": e["heldout"] - warm["heldout"],
                    **{k: e[k] for k in ("train", "other", "parse_failure_rate") if k in e},
                }
                for s, e in per.items()
            },
        }
    pairs = {}
    for a, b in (("arpo", "grpo"), ("arpo", "rft")):
        if a in arms and b in arms:
            d = [arms[a]["per_seed"][s]["unseen_trained"] - arms[b]["per_seed"][s]["unseen_trained"]
                 for s in arms[a]["per_seed"] if s in arms[b]["per_seed"]]  # fmt: skip
            if d:
                pairs[f"{a}-{b}"] = {"mean": statistics.mean(d), "ci": list(t_interval(d)[1:])}
    return {"seeds": [int(s) for s in seeds], "warm_start": warm, "arms": arms,
            "unseen_differences": pairs, "settings": results.get("settings", {})}  # fmt: skip


def _transfer_json(name: str, results: dict[str, Any]) -> None:
    if not name:
        return
    dest = Path(__file__).resolve().parent / "results" / f"{name}.json"
    dest.write_text(strict_json(transfer_summary(results)))
    log.info("transfer summary -> %s", dest)


def _save_as(out: Path, name: str, results: dict[str, Any]) -> None:
    if not name:
        return
    dest = Path(__file__).resolve().parent / "results"
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(out / "results.md", dest / f"{name}.md")
    shutil.copyfile(out / "curves.png", dest / f"{name}.png")
    keep = {**results, "contrasts": contrasts(results)}
    (dest / f"{name}.json").write_text(strict_json(keep))
    log.info("copied to %s/%s.{md,json,png}", dest, name)


if __name__ == "__main__":
    sys.exit(main())

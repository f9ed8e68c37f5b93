"""Marks from Calc's tree, marks read by OCR, or the screenshot alone: a short run on LibreOffice.

    .venv/bin/python benchmarks/experiment_marks_local.py --out runs/marks-local \\
        --seeds 1,2,3 --save-as marks-local-<date>                   # the reader, 3 arms
    .venv/bin/python benchmarks/experiment_marks_local.py --out runs/marks-dry --base tiny \\
        --arms tree --seeds 1 --train calc-set-quantity --heldout calc-fix-food \\
        --iterations 1 --sft-epochs 1                                 # a dry run of every step
    .venv/bin/python benchmarks/experiment_marks_local.py --out runs/marks-local --report-only

The policy works on the local desktop's LibreOffice Calc tasks (`envs/arpo_envs/tasks/
local/libreoffice_calc`, OSWorld's format, each checked by its own checker). Three arms
differ only in what each turn's prompt shows:

- `tree`: set-of-marks, the marks from Calc's accessibility tree (desktops with
  `--atspi`: LibreOffice's GTK 3 plugin; `actor.episode.marks_source=tree`);
- `ocr`: set-of-marks, the marks read from the screenshot (`marks_source=ocr`; desktops
  without the tree, LibreOffice's X11 plugin);
- `screenshot`: the screenshot alone.

Each arm, from one base policy (`--base`: the reader, SmolLM2-135M-Instruct's text layers
under a small random vision encoder, or the tiny random model):

1. **Warm start**: `arpo sft local_desktops=2` on the oracle demonstrations of the
   training tasks, recorded on real local desktops with that arm's prompts;
2. **evaluated** greedily (temperature 0, one episode per task, `--eval-steps` turns at
   most) on the training tasks and on the held-out ones, which no demonstration and no
   training run holds;
3. **per seed**: `arpo train` on the training tasks (ARPO: replay on, `--iterations`
   iterations of `--groups` groups of 4 episodes, on 2 local desktops, no simulated
   ones; the replay buffers start with the warm start's demonstrations, `arpo train`'s
   default for tasks of 3 turns or more, which every task here is), then the final
   checkpoint evaluated as in 2.

Cost with the reader (2 cores, measured 2026-11-29 on the tree arm): the 6 training
demonstrations are 3 to 4 turns of 4,612 to 6,034 tokens in all (first turn 1,825 to 1,839,
later ones 1,339: the table cut at 1,280 tokens holds Calc's 23 menu rows and cells A1 to
about F5, empty cells included as OSWorld's filter keeps them); recording them, 12 scoring
passes and 2 optimizer steps took 6 minutes (`arpo sft model=runs/marks-local/base/reader-30
out=/tmp/probe tasks=runs/marks-local/tasks/train local_desktops=2 observation_type=som
max_steps=0 max_new_tokens=96 epochs=1 max_optimizer_steps=2 lr=2e-4 batch_size=4
micro_batch=1 train_layers=12`, after a first run of this script made the two folders). A
tighter `--a11y-max-tokens` (512) would cut off the data rows the tasks name.

Measured 2026-12-07 on the tree arm, alone on 2 cores:
- With 4 demonstrations an optimizer step (12 steps in 6 epochs, 23.5 minutes; NLL 2.07 ->
  0.066) the warm start solved 0 of its 6 training tasks and 0 of the 3 held out, every turn
  parsed: it typed the cell and the function its demonstrations used most ("B7", "MAX")
  instead of the instruction's. The mean NLL hides those few tokens.
- With one a step (this script's default: 48 steps in 8 epochs, 32 minutes with recording
  and scoring; NLL 2.07 -> 0.035, the target 0.02 not reached) it solves **4 of 6 training
  tasks and 0 of 3 held out**, every turn parsed. Its greedy evaluation on the 9 tasks took
  6 minutes.
- The OCR arm's warm start took 25 minutes and solves 5 of 6 (0 of 3 held out); the
  screenshot arm's (no table) 3.3 minutes, 5 of 6 (0 of 3).
- A seed's ARPO run: 10 minutes for the screenshot arm (then 2.6 minutes of evaluation);
  for the tree arm 59, 54 and 42 minutes (seeds 1, 2, 3: 8 episodes an iteration of 3 to
  4 turns at the reader's ~13 tokens/s, the learner's steps of 408 to 1,099 s beside them;
  its peak 7.9 GB; seed 3's warm start, made again, 25 minutes), for the OCR arm 33, 38
  and 31 minutes (shorter tables; its learner's peak 9.2 GB; the peaks are VmHWM sampled
  from `/proc` by hand), each then 5 minutes of evaluation: an arm of 3 seeds is about 3
  hours for the tree, 1 hour 55 minutes for OCR. Run one arm per session with
  `--resume-from`, or `--seeds=` for the warm starts alone.

Steps whose output exists are skipped, and so is a seed already in the results file, so an
interrupted run continues (delete a run's folder and its seed in `results.json` to redo
it). A seed records its commit and the warm start it started from (commit and success),
and its gain is over that one: when an arm's warm-start folder is gone (another machine),
its warm start is made again at the current commit for the seeds still to run, and the
report then shows each warm start. An `--out` folder whose results were made with other settings is
refused, naming each one, since its warm starts and seeds would be kept as they are.
`--seeds=` runs only the warm starts and their evaluation. Nothing else should run on the
machine. The arms can run in different sessions, on different machines: `--resume-from
benchmarks/results/<name>.json` takes every arm finished there (its warm start and every
seed asked for) as it is, with the commit and date it ran at, and refuses a file made with
other settings, naming each one; `--arms` then names the arms still to run. The report
(`--save-as`: `benchmarks/results/<name>.md` / `.json`) gives every arm and seed, the mean gain over the
warm start with its 95 % t-interval over seeds, and the share of turns that parsed.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from _runs import model_to_evaluate
from _stats import strict_json, t_interval

from arpo.actor.episode import A11Y_MAX_TOKENS

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("experiment_marks_local")

ARMS = {
    "tree": ("som", "tree"),
    "ocr": ("som", "ocr"),
    "screenshot": ("screenshot", "tree"),
}
"""Arm -> (actor.episode.observation_type, actor.episode.marks_source)."""
TRAIN = "calc-set-quantity,calc-header-cost,calc-sum-quantity,calc-average-math,calc-max-art,calc-clear-travel"
HELDOUT = "calc-fix-food,calc-count-above-70,calc-city-upper"
"""The default split: the suite's Calc tasks whose oracle takes at most 3 steps, 6 to train
on and 3 held out (fixed before any run)."""


def _suite() -> Path:
    import arpo_envs.tasks as suite

    return Path(suite.__file__).parent / "local" / "libreoffice_calc"


def _copy(ids: list[str], dest: Path) -> None:
    """The tasks `ids` of the suite (task file and its folder of files) into `dest`."""
    src = _suite()
    dest.mkdir(parents=True, exist_ok=True)
    for tid in ids:
        if not (src / f"{tid}.json").exists():
            raise SystemExit(f"no local Calc task {tid!r} in {src}")
        shutil.copy(src / f"{tid}.json", dest / f"{tid}.json")
        if (src / tid).is_dir() and not (dest / tid).exists():
            shutil.copytree(src / tid, dest / tid)


def _base(args: argparse.Namespace, out: Path) -> Path:
    if args.base == "tiny":
        from arpo.policy.tiny import build_tiny_model

        path = out / "base" / "tiny"
        if not (path / "config.json").exists():
            build_tiny_model(path, seed=0)
        return path
    from arpo.policy.reader import build_reader

    path = out / "base" / f"reader-{args.reader_layers}"
    if not (path / "config.json").exists():
        build_reader(path, layers=args.reader_layers, seed=0)
    return path


def _warm_start(args: argparse.Namespace, arm: str, base: Path, train: Path, out: Path) -> Path:
    from arpo.offline.sft import SFTConfig, run

    sft = out / arm / "sft"
    if not (sft / "config.json").exists():
        shown, marks = ARMS[arm]
        log.info("%s: warm start -> %s", arm, sft)
        run(SFTConfig(model=str(base), out=str(sft), tasks=str(train), local_desktops=2,
                      observation_type=shown, marks_source=marks, max_steps=0,  # type: ignore[arg-type]
                      max_new_tokens=args.max_new_tokens, epochs=args.sft_epochs,
                      a11y_max_tokens=args.a11y_max_tokens,
                      target_nll=args.sft_target_nll, lr=args.sft_lr, batch_size=args.sft_batch,
                      micro_batch=1, train_layers=args.train_layers))  # fmt: skip
    return sft


def _evaluate(args: argparse.Namespace, arm: str, model: Path | None, pools: dict[str, Path],
              out: Path) -> dict[str, Any]:  # fmt: skip
    """Greedy episodes of `model` on every task of each pool (read back from `out` when they
    have run: `model` may then be None)."""
    from arpo.actor.episode import EpisodeConfig
    from arpo.env.task import load_task_pool
    from arpo.env.taskfiles import TaskFiles
    from arpo.offline.demos import LocalDesktops, evaluate_greedy

    done = out / "eval.json"
    if done.exists():
        return json.loads(done.read_text())
    assert model is not None, f"{out}: nothing evaluated yet and no model given"
    shown, marks = ARMS[arm]
    res: dict[str, Any] = {}
    t0 = time.monotonic()
    for name, pool in pools.items():
        files = TaskFiles()
        tasks = load_task_pool(pool, files)
        res[name] = evaluate_greedy(
            model, tasks, max_steps=args.eval_steps, max_new_tokens=args.max_new_tokens,
            observation_type=shown, marks_source=marks, a11y_max_tokens=args.a11y_max_tokens,
            local=LocalDesktops(2, files, atspi=EpisodeConfig(observation_type=shown,
                                marks_source=marks).needs_tree),  # type: ignore[arg-type]
        )  # fmt: skip
    res["wall_s"] = round(time.monotonic() - t0, 1)
    out.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(res, indent=2))
    return res


def finished_run(run_dir: Path) -> bool:
    """True when `run_dir` holds a run that finished (its summary says so), which is kept;
    otherwise a run that was interrupted or stopped (no summary, or `finished: false`) is
    removed, so that the seed runs again from its start."""
    done = run_dir / "summary.json"
    if done.exists() and json.loads(done.read_text()).get("finished"):
        return True
    if run_dir.exists():
        shutil.rmtree(run_dir)
    return False


def _train(args: argparse.Namespace, arm: str, seed: int, sft: Path, train: Path,
           out: Path) -> Path:  # fmt: skip
    """`arpo train` (ARPO) from the warm start on the training tasks; its run folder."""
    from arpo.config import load_config
    from arpo.train import TrainConfig, TrainRun

    run_dir = out / arm / "runs" / f"s{seed}"
    if finished_run(run_dir):
        return run_dir
    shown, marks = ARMS[arm]
    cfg = load_config(TrainConfig, None, [
        f"run_dir={str(run_dir)!r}", f"model={str(sft)!r}", f"tasks={str(train)!r}",
        "warm_start=false", "actors=0", "local_desktops=2", f"seed={seed}", "minutes=0",
        "restart=false", "eval_runs_per_task=0", "eval_warm_start=false",
        "prefill_runs_per_task=0", "progress_s=60",
        f"learner.iterations={args.iterations}",
        "learner.assemble.group_size=4", f"learner.assemble.groups_per_step={args.groups}",
        f"learner.trainer.lr={args.lr}", f"learner.trainer.train_layers={args.train_layers}",
        # The same gradients; a 5-turn Calc trajectory with the tree is ~7k tokens, and its
        # activations without it took the learner past 18 GB (killed by the OOM killer).
        "learner.trainer.gradient_checkpointing=true",
        f"actor.episode.observation_type={shown!r}", f"actor.episode.marks_source={marks!r}",
        f"actor.episode.max_steps={args.eval_steps}",
        f"actor.episode.max_new_tokens={args.max_new_tokens}",
        f"actor.episode.a11y_max_tokens={args.a11y_max_tokens}",
    ])  # fmt: skip
    log.info("%s seed %d: arpo train -> %s", arm, seed, run_dir)
    t0 = time.monotonic()
    TrainRun(cfg).run()
    sm = json.loads((run_dir / "summary.json").read_text())
    sm["wall_s"] = round(time.monotonic() - t0, 1)
    (run_dir / "summary.json").write_text(json.dumps(sm, indent=2))
    return run_dir


def _rate(ev: dict[str, Any], pool: str) -> float:
    return float(ev[pool]["success_rate"])


def _warm_of(r: dict[str, Any], commit: str | None) -> dict[str, Any] | None:
    """The arm `r`'s warm start as a seed records it: its commit, success rates and share of
    parsed turns."""
    if not r.get("warm"):
        return None
    return {"commit": commit, **{p: _rate(r["warm"], p) for p in ("train", "heldout")},
            "parsed": r["warm"]["train"]["parsed_rate"]}  # fmt: skip


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    """Per arm: the warm start's and each seed's success on train / held-out tasks, the
    gains' means and 95 % t-intervals over seeds. A seed's gain is over the warm start it
    started from (`warm_start`, recorded with it: the arm's warm start is made again when
    its folder is gone, and the new one's evaluation may differ)."""
    out: dict[str, Any] = {}
    for arm, r in results["arms"].items():
        warm = r.get("warm")
        seeds = r.get("seeds", {})
        if not warm:
            continue
        current = _warm_of(r, r.get("warm_commit", r.get("commit")))
        assert current is not None
        row: dict[str, Any] = {"warm": {p: current[p] for p in ("train", "heldout")},
                               "warm_parsed": warm["train"]["parsed_rate"], "seeds": {},
                               "warm_starts": [current]}  # fmt: skip
        ran: dict[str, list[str]] = {}
        for s, ev in seeds.items():
            w = ev.get("warm_start") or current
            if all(w["commit"] != x["commit"] for x in row["warm_starts"]):
                row["warm_starts"].insert(0, w)
            row["seeds"][s] = {p: _rate(ev, p) for p in ("train", "heldout")}
            row["seeds"][s].update(parsed=ev["train"]["parsed_rate"],
                                   wall_s=ev.get("train_wall_s"), warm_commit=w["commit"],
                                   gain={p: _rate(ev, p) - w[p] for p in ("train", "heldout")})  # fmt: skip
            ran.setdefault(ev.get("commit") or r.get("commit", "?"), []).append(s)
        for p in ("train", "heldout"):
            gains = [v["gain"][p] for v in row["seeds"].values()]
            if gains:
                mean, lo, hi = t_interval(gains)
                row[f"{p}_gain"] = {"mean": mean, "ci": [lo, hi]}
        if len(ran) > 1:
            row["ran"] = "; ".join(f"{c} (seed{'s' if len(v) > 1 else ''} {', '.join(sorted(v))})"
                                   for c, v in ran.items()) + f", {r.get('date', '?')}"  # fmt: skip
        else:
            row["ran"] = f"{next(iter(ran), r.get('commit', '?'))}, {r.get('date', '?')}"
        out[arm] = row
    return out


def _pct(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.0f} %"


def _per_step(n: int) -> str:
    return "one demonstration a step" if n == 1 else f"{n} demonstrations a step"


def report(results: dict[str, Any]) -> str:
    st = results["settings"]
    s = summarise(results)
    lines = [
        f"# Marks from the tree, from OCR, or the screenshot alone: LibreOffice Calc, "
        f"{results.get('date', '')}",
        "",
        f"`{results['command']}` (commit {results.get('commit', '?')}): base `{st['base']}`"
        + (f" ({st['reader_layers']} layers, the last {st['train_layers']} trained)"
           if st["base"] == "reader" else "")
        + f"; training tasks {', '.join(st['train'])}; held out {', '.join(st['heldout'])}. "
        f"Warm start: `arpo sft` on the training tasks' oracle demonstrations (local "
        f"desktops, at most {st['sft_epochs']} epochs of {_per_step(st.get('sft_batch', 4))}, "
        f"target NLL {st['sft_target_nll']}); "
        f"ARPO: {st['iterations']} iterations of {st['groups']} groups of 4 on 2 local "
        f"desktops, lr {st['lr']}. Success: greedy, one episode per task, at most "
        f"{st['eval_steps']} turns. Each turn's table is cut to "
        f"{st.get('a11y_max_tokens', A11Y_MAX_TOKENS)} tokens.",
        "",
        "| arm | seed | train | held out | parsed turns |",
        "|---|---|---:|---:|---:|",
    ]  # fmt: skip
    for arm, row in s.items():
        several = len(row["warm_starts"]) > 1
        for w in row["warm_starts"]:
            label = f"warm start ({w['commit']})" if several else "warm start"
            parsed = _pct(w.get("parsed", row["warm_parsed"]))
            lines.append(f"| {arm} | {label} | {_pct(w['train'])} | {_pct(w['heldout'])} | "
                         f"{parsed} |")  # fmt: skip
        for seed, v in sorted(row["seeds"].items()):
            label = f"{seed} (from {v['warm_commit']})" if several else seed
            lines.append(f"| {arm} | {label} | {_pct(v['train'])} | {_pct(v['heldout'])} | "
                         f"{_pct(v['parsed'])} |")  # fmt: skip
    lines += ["", "| arm | seeds | train gain (95 % CI) | held-out gain (95 % CI) | ran at |",
              "|---|---:|---|---|---|"]  # fmt: skip
    for arm, row in s.items():
        cells = []
        for p in ("train", "heldout"):
            g = row.get(f"{p}_gain")
            cells.append("n/a" if not g else f"{100 * g['mean']:+.0f} points "
                         f"({100 * g['ci'][0]:+.0f} to {100 * g['ci'][1]:+.0f})"
                         if not math.isnan(g["ci"][0]) else f"{100 * g['mean']:+.0f} points")  # fmt: skip
        lines.append(f"| {arm} | {len(row['seeds'])} | {cells[0]} | {cells[1]} | {row['ran']} |")
    return "\n".join(lines) + "\n"


_NOT_SETTINGS = ("report_only", "save_as", "resume_from", "train", "heldout", "arms", "seeds",
                 "out")  # fmt: skip
"""Arguments that say what to run or where, not how: a resumed arm need not share them."""


def _other_settings(old: dict[str, Any], settings: dict[str, Any]) -> str:
    """Each setting of `settings` that the results `old` were made with otherwise, named
    ("iterations: 4 there, 2 now"); '' when they agree."""
    theirs = old.get("settings", {})
    return "; ".join(f"{k}: {theirs.get(k)!r} there, {v!r} now" for k, v in settings.items()
                     if k not in _NOT_SETTINGS and theirs.get(k) != v)  # fmt: skip


def finished_arms(path: Path, settings: dict[str, Any], seeds: list[int]) -> dict[str, Any]:
    """The arms of the results file `path` that have their warm start and every seed in
    `seeds`; SystemExit when the file was made with settings other than `settings` (each
    differing one named), since its arms would not compare with the ones run now."""
    if not path.is_file():
        raise SystemExit(f"--resume-from {path}: no such file")
    old = json.loads(path.read_text())
    if diff := _other_settings(old, settings):
        raise SystemExit(f"--resume-from {path} was made with other settings: {diff}. "
                         "Run with its settings, or without it.")  # fmt: skip
    return {arm: r for arm, r in old.get("arms", {}).items()
            if r.get("warm") and all(str(s) in r.get("seeds", {}) for s in seeds)}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/marks-local", help="Output folder.")
    p.add_argument("--arms", default=",".join(ARMS), help="Comma-separated arms.")
    p.add_argument("--seeds", default="1,2,3", help="Comma-separated seeds of the ARPO runs.")
    p.add_argument("--train", default=TRAIN, help="Training task ids (local Calc tasks).")
    p.add_argument("--heldout", default=HELDOUT, help="Held-out task ids (local Calc tasks).")
    p.add_argument("--base", choices=("reader", "tiny"), default="reader", help="Base policy.")
    p.add_argument("--reader-layers", type=int, default=30, help="--base reader: text layers.")
    p.add_argument("--train-layers", type=int, default=12,
                   help="Train only the decoder's last N layers (0: all), warm start and RL.")  # fmt: skip
    p.add_argument("--sft-epochs", type=int, default=8, help="Warm-start epochs (at most).")
    p.add_argument("--sft-target-nll", type=float, default=0.02, help="Warm-start target NLL.")
    p.add_argument("--sft-lr", type=float, default=2e-4, help="Warm-start lr.")
    p.add_argument("--sft-batch", type=int, default=1,
                   help="Warm-start demonstrations per optimizer step.")  # fmt: skip
    p.add_argument("--lr", type=float, default=1e-5, help="ARPO learner lr.")
    p.add_argument("--iterations", type=int, default=4, help="ARPO iterations per run.")
    p.add_argument("--groups", type=int, default=2, help="Groups of 4 episodes per iteration.")
    p.add_argument("--eval-steps", type=int, default=5, help="Turns per episode at most.")
    p.add_argument("--max-new-tokens", type=int, default=96, help="Tokens per response.")
    p.add_argument("--a11y-max-tokens", type=int, default=A11Y_MAX_TOKENS,
                   help="Tokens each turn's table is cut to (warm start, RL and evaluation).")  # fmt: skip
    p.add_argument("--resume-from", default="",
                   help="A results file (--save-as's .json) whose finished arms are kept.")  # fmt: skip
    p.add_argument("--report-only", action="store_true", help="The report from results.json.")
    p.add_argument("--save-as", default="", help="Also write benchmarks/results/<name>.md/.json.")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    res_path = out / "results.json"
    results = json.loads(res_path.read_text()) if args.report_only else run(args, out, res_path)
    text = report(results)
    (out / "results.md").write_text(text)
    print(text)
    if args.save_as:
        dest = ROOT / "benchmarks" / "results"
        (dest / f"{args.save_as}.md").write_text(text)
        keep = {**results, "summary": summarise(results)}
        (dest / f"{args.save_as}.json").write_text(strict_json(keep))
    return 0


def run(args: argparse.Namespace, out: Path, res_path: Path) -> dict[str, Any]:
    import subprocess

    train_ids = [t for t in args.train.split(",") if t]
    held_ids = [t for t in args.heldout.split(",") if t]
    if set(train_ids) & set(held_ids):
        raise SystemExit(f"--train and --heldout share {sorted(set(train_ids) & set(held_ids))}")
    arms = [a for a in args.arms.split(",") if a]
    if bad := sorted(set(arms) - set(ARMS)):
        raise SystemExit(f"--arms: unknown {bad}; choose from {', '.join(ARMS)}")
    seeds = [int(x) for x in args.seeds.split(",") if x]
    pools = {"train": out / "tasks" / "train", "heldout": out / "tasks" / "heldout"}
    _copy(train_ids, pools["train"])
    _copy(held_ids, pools["heldout"])
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    results: dict[str, Any] = (
        json.loads(res_path.read_text()) if res_path.exists() else {"arms": {}}
    )
    settings = {
        **{k: v for k, v in vars(args).items() if k not in _NOT_SETTINGS},
        "train": train_ids,
        "heldout": held_ids,
    }
    if results["arms"] and (diff := _other_settings(results, settings)):
        raise SystemExit(f"{out} holds a run made with other settings ({diff}): its warm "
                         "starts and seeds would be kept as they are. Give another --out, "
                         "or run with its settings.")  # fmt: skip
    if args.resume_from:
        for arm, r in finished_arms(Path(args.resume_from), settings, seeds).items():
            results["arms"][arm] = r
    results.update(
        command="python benchmarks/experiment_marks_local.py " + " ".join(sys.argv[1:]),
        commit=commit,
        date=time.strftime("%Y-%m-%d"),
        settings=settings,
    )

    def save() -> None:
        res_path.write_text(json.dumps(results, indent=2))

    for arm in arms:
        r = results["arms"].setdefault(arm, {"seeds": {}})
        if r.get("warm") and all(str(s) in r["seeds"] for s in seeds):
            log.info("%s: finished (commit %s), kept as it is", arm, r.get("commit", "?"))
            continue
        # The seeds already recorded keep their commit and the warm start they started
        # from: when the warm start's folder is gone it is made again below, at this commit.
        prior = r.get("warm_commit", r.get("commit"))
        for ev in r["seeds"].values():
            ev.setdefault("commit", r.get("commit"))
            ev.setdefault("warm_start", _warm_of(r, prior))
        r.update(commit=commit, date=time.strftime("%Y-%m-%d"))
        fresh = not (out / arm / "warm_eval" / "eval.json").exists()
        sft = _warm_start(args, arm, _base(args, out), pools["train"], out)
        r["warm"] = _evaluate(args, arm, sft, pools, out / arm / "warm_eval")
        r["warm_commit"] = commit if fresh or not prior else prior
        save()
        for seed in seeds:
            if str(seed) in r["seeds"]:
                log.info("%s seed %d: in the results, kept as it is", arm, seed)
                continue
            run_dir = _train(args, arm, seed, sft, pools["train"], out)
            ev = _evaluate(args, arm, model_to_evaluate(run_dir, run_dir / "eval"), pools,
                           run_dir / "eval")  # fmt: skip
            sm = json.loads((run_dir / "summary.json").read_text())
            r["seeds"][str(seed)] = {**ev, "train_wall_s": sm.get("wall_s"),
                                     "accounting": sm.get("accounting"), "commit": commit,
                                     "warm_start": _warm_of(r, r["warm_commit"])}  # fmt: skip
            save()
    return results


if __name__ == "__main__":
    sys.exit(main())

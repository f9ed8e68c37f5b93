"""Long tasks, step by step: where episodes of a warm start (or a trained policy) go wrong.

    python benchmarks/long_tasks.py warm  --out runs/long/ff --families fill_form --tasks 8
    python benchmarks/long_tasks.py probe --out runs/long/ff --temperatures 0.6,1.0 --runs 16
    python benchmarks/long_tasks.py probe --out runs/long/ff --model runs/x/checkpoint --name trained
    python benchmarks/long_tasks.py steps --runs runs/long-pool --names warm,trained

`warm` builds the tiny model (seed 0), writes `--tasks` simulated tasks per family (task seed
`--seed`) to <out>/tasks and warm-starts the model on their oracle demonstrations exactly as
`arpo train` does (its defaults: SFT until NLL 0.06, at most 60 epochs, episodes fitted to
each task). `probe` runs `arpo collect` of a policy (the warm start unless `--model`) at each
temperature, `--runs` episodes per task, and reads every kept trajectory against its task's
oracle:

- success rate (checker score 1), turns per episode, the share of turns that parsed;
- how each episode ended: finished() / FAIL, a response that did not parse, the step limit;
- per oracle step k: the share of episodes whose first k turns all did what the oracle does
  (same action kind; a click within 20 px of the oracle's; the same text typed; the same
  keys), and the kind of the first deviation (parse failure, wrong kind, click off target,
  wrong text, wrong keys, finished early). A step-k curve that falls at one step shows
  which step the policy has not learned; one that falls a little at every step is the
  compounding of per-turn errors that long horizons suffer from.

Results: <out>/probe-<name>.json and .md (every figure above per temperature, and in the
JSON per family: the folder of the task file). `steps` pools the probes of every
`seed-<n>` run folder under `--runs` per family (e.g. an `arpo train` run folder of each
seed of `demo_runs.py`, probed with `--out <run folder>`): a before/after table of success
and steps right.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import logging
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("long_tasks")

CLICK_TOLERANCE_PX = 20


def _commands(code: str) -> list[tuple[str, tuple[Any, ...]]]:
    """(kind, args) of every pyautogui call in `code` (an oracle step or an action)."""
    out: list[tuple[str, tuple[Any, ...]]] = []
    for m in re.finditer(r"pyautogui\.(\w+)\((.*)\)", code):
        kind, raw = m.group(1), m.group(2)
        try:
            node = ast.parse(f"f({raw})", mode="eval").body
            assert isinstance(node, ast.Call)
            args = tuple(ast.literal_eval(a) for a in node.args)
            kw = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
        except (SyntaxError, ValueError, AssertionError):
            args, kw = (), {}
        if kind in ("click", "doubleClick") and kw.get("button", "left") == "left":
            out.append(("click", args[:2]))
        elif kind == "write":
            out.append(("write", (str(args[0]).rstrip("\n") if args else "",)))
        elif kind == "hotkey":
            out.append(("hotkey", tuple(str(a) for a in args)))
        elif kind == "press":
            out.append(("press", tuple(str(a) for a in args)))
        elif kind == "scroll":
            out.append(("scroll", (kw.get("x"), kw.get("y"))))
        else:
            out.append((kind, args))
    return out


def compare(action: str, parsed: bool, step: str | None) -> str:
    """'ok' when the turn's action does what the oracle step does, else the deviation."""
    if not parsed:
        return "parse failure"
    if action in ("DONE", "FAIL", "WAIT"):
        return "finished early" if step is not None else "ok"
    if step is None:
        return "acted after the task was done"
    mine, want = _commands(action), _commands(step)
    if not mine or not want:
        return "wrong kind"
    (k1, a1), (k2, a2) = mine[0], want[0]
    if k1 != k2:
        return "wrong kind"
    if k1 in ("click", "scroll"):
        try:
            far = max(abs(float(a1[0]) - float(a2[0])), abs(float(a1[1]) - float(a2[1])))
        except (TypeError, ValueError, IndexError):
            return "click off target"
        return "ok" if far <= CLICK_TOLERANCE_PX else "click off target"
    if k1 == "write":
        return "ok" if a1 == a2 else "wrong text"
    return "ok" if a1 == a2 else "wrong keys"


def analyse(trajs: list[Any], oracles: dict[str, list[str]]) -> dict[str, Any]:
    ok = [t for t in trajs if t.status.value == "ok"]
    ends: collections.Counter[str] = collections.Counter()
    first_dev: collections.Counter[str] = collections.Counter()
    reached: collections.Counter[int] = collections.Counter()
    longest = max((len(o) for o in oracles.values()), default=0)
    turns = parsed = 0
    for t in ok:
        oracle = oracles.get(t.task_id, [])
        steps = [*oracle, None]  # finished() after the oracle's steps
        last = t.turns[-1] if t.turns else None
        if last is None:
            ends["no turn"] += 1
        elif not last.parsed:
            ends["response did not parse"] += 1
        elif last.action in ("DONE", "FAIL"):
            ends[f"{last.action}"] += 1
        else:
            ends["step limit"] += 1
        k = 0
        for turn, step in zip(t.turns, steps, strict=False):
            verdict = compare(turn.action, turn.parsed, step)
            if verdict != "ok":
                first_dev[verdict] += 1
                break
            k += 1
        else:
            if k < len(steps) and t.checker_score < 1:
                first_dev["stopped (step limit)"] += 1
        reached[min(k, len(oracle))] += 1
        turns += len(t.turns)
        parsed += sum(1 for x in t.turns if x.parsed)
    n = len(ok)
    # share of episodes whose first k oracle steps were all right, k = 1..longest
    prefix = [sum(c for kk, c in reached.items() if kk >= k) / n if n else 0.0
              for k in range(1, longest + 1)]  # fmt: skip
    return {
        "episodes": len(trajs),
        "ok": n,
        "success_rate": sum(t.checker_score >= 1 for t in ok) / n if n else float("nan"),
        "turns_mean": turns / n if n else float("nan"),
        "parsed_rate": parsed / turns if turns else float("nan"),
        "ends": dict(ends),
        "first_deviation": dict(first_dev),
        "steps_right": prefix,
    }


def cmd_warm(args: argparse.Namespace) -> None:
    from arpo_envs.sim.tasks import write_tasks

    from arpo.train import TrainConfig, TrainRun

    out = Path(args.out).resolve()
    run = TrainRun(
        TrainConfig(
            run_dir=str(out),
            sim_families=args.families.split(","),
            sim_tasks_per_family=args.tasks,
            seed=args.seed,
        )
    )
    out.mkdir(parents=True, exist_ok=True)
    model = run.policy()
    write_tasks(out / "tasks", args.families.split(","), args.tasks, args.seed)
    (out / "tasks" / "test_all.json").unlink(missing_ok=True)
    print(json.dumps(json.loads((Path(model) / "offline.json").read_text())["summary"]))


def _task_files(tasks: Path) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Every task file under `tasks` (the index files, without an id, skipped): its oracle
    steps and its family (the folder it is in: `write_tasks` writes <family>/<id>.json)."""
    oracles: dict[str, list[str]] = {}
    family: dict[str, str] = {}
    for f in sorted(tasks.rglob("*.json")):
        task = json.loads(f.read_text())
        if isinstance(task, dict) and "id" in task:
            oracles[task["id"]] = task.get("oracle", [])
            family[task["id"]] = f.parent.name
    return oracles, family


def cmd_steps(args: argparse.Namespace) -> None:
    """Per family, the probes `--names` of every seed folder under `--runs` pooled
    (episodes weighted equally): success and the share of episodes whose first k oracle
    steps were all right, before (the first name) and after (the second)."""
    runs = Path(args.runs).resolve()
    temp = f"{args.temperature:g}"
    pooled: dict[str, dict[str, dict[str, Any]]] = {}
    seeds: dict[str, list[str]] = {}
    for name in args.names.split(","):
        for f in sorted(runs.glob(f"seed-*/probe-{name}.json")):
            seeds.setdefault(name, []).append(f.parent.name.removeprefix("seed-"))
            fams = json.loads(f.read_text())["temperatures"][temp]["families"]
            for fam, r in fams.items():
                acc = pooled.setdefault(fam, {}).setdefault(
                    name, {"ok": 0, "wins": 0.0, "right": collections.Counter()}
                )
                acc["ok"] += r["ok"]
                acc["wins"] += r["success_rate"] * r["ok"] if r["ok"] else 0.0
                for k, share in enumerate(r["steps_right"], start=1):
                    acc["right"][k] += share * r["ok"]
    longest = max((max(a["right"], default=0) for f in pooled.values() for a in f.values()),
                  default=0)  # fmt: skip
    names = args.names.split(",")
    lines = [
        f"# Per-step success before and after training, T={temp}",
        "",
        f"`python benchmarks/long_tasks.py steps --runs {args.runs} --names {args.names} "
        f"--temperature {temp}`",
        "",
        "Seeds: " + "; ".join(f"{n}: {', '.join(seeds.get(n, []))}" for n in names) + ".",
        "Per family, every seed's episodes pooled: success, and the share of episodes whose "
        "first k oracle steps were all right (blank: the family's tasks have fewer steps).",
        "",
        "| family | policy | episodes | success | " + " | ".join(f"k={k}" for k in
                                                          range(1, longest + 1)) + " |",
        "|---|---|---:|---:|" + "---:|" * longest,
    ]  # fmt: skip
    table: dict[str, Any] = {}
    for fam in sorted(pooled):
        for name in names:
            a = pooled[fam].get(name)
            if not a or not a["ok"]:
                continue
            right = [a["right"][k] / a["ok"] for k in range(1, max(a["right"], default=0) + 1)]
            table.setdefault(fam, {})[name] = {"episodes": a["ok"],
                                               "success_rate": a["wins"] / a["ok"],
                                               "steps_right": right}  # fmt: skip
            cells = [f"{100 * x:.0f}" for x in right] + [""] * (longest - len(right))
            lines.append(f"| {fam} | {name} | {a['ok']} | {100 * a['wins'] / a['ok']:.1f} % | "
                         + " | ".join(cells) + " |")  # fmt: skip
    md = "\n".join(lines) + "\n"
    print(md)
    if args.save_as:
        dest = ROOT / "benchmarks" / "results"
        (dest / f"{args.save_as}.md").write_text(md)
        res = {"temperature": args.temperature, "seeds": seeds, "families": table}
        (dest / f"{args.save_as}.json").write_text(json.dumps(res, indent=2))


def cmd_probe(args: argparse.Namespace) -> None:
    from arpo_envs.procs import free_port

    from arpo.offline.data import read_trajectories
    from arpo.pool.collect import CollectConfig, run_collect
    from arpo.train import TrainConfig

    out = Path(args.out).resolve()
    tasks = out / "tasks"
    oracles, family = _task_files(tasks)
    policy = (
        {"checkpoint": args.model} if args.checkpoint else {"model": args.model or str(out / "sft")}
    )
    cfg = TrainConfig(sim_envs_per_actor=args.envs)
    actor_args = [*cfg.pool_actor_args(), "progress_s=0", *args.actor]
    results: dict[str, Any] = {"policy": policy, "runs_per_task": args.runs, "tasks": len(oracles),
                               "actor": actor_args, "temperatures": {}}  # fmt: skip
    for temp in [float(x) for x in args.temperatures.split(",")]:
        dest = out / f"collect-{args.name}-t{temp:g}"
        run_collect(
            CollectConfig(
                **policy,
                tasks=str(tasks),
                runs_per_task=args.runs,
                temperature=temp,
                top_p=1.0,
                out=str(dest),
                overwrite=not args.reuse,
                grant_timeout_s=300.0,
                local_actor_args=actor_args,
                progress_s=0,
                transport=replace(
                    cfg.learner.transport,
                    data=f"tcp://127.0.0.1:{free_port()}",
                    control=f"tcp://127.0.0.1:{free_port()}",
                ),
            )
        )
        trajs = list(read_trajectories(dest))
        results["temperatures"][f"{temp:g}"] = analyse(trajs, oracles)
        results["temperatures"][f"{temp:g}"]["families"] = {
            fam: analyse([t for t in trajs if family.get(t.task_id) == fam],
                         {k: v for k, v in oracles.items() if family[k] == fam})
            for fam in sorted(set(family.values()))
        }  # fmt: skip
        log.info("t=%g: %s", temp, json.dumps(results["temperatures"][f"{temp:g}"]))
    (out / f"probe-{args.name}.json").write_text(json.dumps(results, indent=2))
    (out / f"probe-{args.name}.md").write_text(report(results, " ".join(sys.argv)))
    print(report(results, " ".join(sys.argv)))


def report(res: dict[str, Any], command: str) -> str:
    lines = [f"# Long-task probe: {res['policy']}", "", f"`{command}`", "",
             f"{res['tasks']} tasks, {res['runs_per_task']} episodes each per temperature.", "",
             "| temperature | success | turns | parsed turns | ends | first deviation |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for temp, r in res["temperatures"].items():
        ends = ", ".join(f"{k} {v}" for k, v in sorted(r["ends"].items()))
        dev = ", ".join(f"{k} {v}" for k, v in sorted(r["first_deviation"].items()))
        lines.append(
            f"| {temp} | {100 * r['success_rate']:.1f} % of {r['ok']} | {r['turns_mean']:.1f} | "
            f"{100 * r['parsed_rate']:.1f} % | {ends} | {dev} |"
        )
    lines += ["", "Share of episodes whose first k oracle steps were all right:", "",
              "| temperature | " + " | ".join(f"k={k}" for k in range(1, 1 + max(
                  len(r["steps_right"]) for r in res["temperatures"].values()))) + " |"]  # fmt: skip
    lines.append(
        "|---" * (1 + max(len(r["steps_right"]) for r in res["temperatures"].values())) + "|"
    )
    for temp, r in res["temperatures"].items():
        lines.append(f"| {temp} | " + " | ".join(f"{100 * p:.0f}" for p in r["steps_right"]) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("warm", help="tiny model + tasks + warm start")
    w.add_argument("--out", required=True)
    w.add_argument("--families", default="fill_form")
    w.add_argument("--tasks", type=int, default=8, help="Tasks per family.")
    w.add_argument("--seed", type=int, default=0, help="Task seed.")
    pr = sub.add_parser("probe", help="collect at temperatures and read the episodes")
    pr.add_argument("--out", required=True)
    pr.add_argument("--model", default="", help="Model folder (default: <out>/sft).")
    pr.add_argument("--checkpoint", action="store_true", help="--model is a learner checkpoint.")
    pr.add_argument("--name", default="warm", help="Name of this probe's results.")
    pr.add_argument("--temperatures", default="0.6,1.0")
    pr.add_argument("--runs", type=int, default=16, help="Episodes per task and temperature.")
    pr.add_argument("--envs", type=int, default=4, help="Simulated desktops.")
    pr.add_argument("--actor", nargs="*", default=[], help="More arpo-actor overrides.")
    pr.add_argument("--reuse", action="store_true", help="Read existing collections.")
    st = sub.add_parser("steps", help="per family, probes of several seeds before and after")
    st.add_argument("--runs", required=True, help="Folder of seed-<n> run folders.")
    st.add_argument("--names", default="warm,trained", help="Probe names, before and after.")
    st.add_argument("--temperature", type=float, default=0.6)
    st.add_argument("--save-as", default="", help="Also write benchmarks/results/<name>.{md,json}.")
    args = p.parse_args()
    {"warm": cmd_warm, "probe": cmd_probe, "steps": cmd_steps}[args.cmd](args)


if __name__ == "__main__":
    main()

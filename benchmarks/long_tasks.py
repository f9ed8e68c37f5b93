"""Long tasks, step by step: where episodes of a warm start (or a trained policy) go wrong.

    python benchmarks/long_tasks.py warm  --out runs/long/ff --families fill_form --tasks 8
    python benchmarks/long_tasks.py probe --out runs/long/ff --temperatures 0.6,1.0 --runs 16
    python benchmarks/long_tasks.py probe --out runs/long/ff --model runs/x/checkpoint --name trained

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

Results: <out>/probe-<name>.json and .md (every figure above per temperature).
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


def cmd_probe(args: argparse.Namespace) -> None:
    from arpo_envs.vm.fleet import free_port

    from arpo.offline.data import read_trajectories
    from arpo.pool.collect import CollectConfig, run_collect
    from arpo.train import TrainConfig

    out = Path(args.out).resolve()
    tasks = out / "tasks"
    oracles = {
        json.loads(f.read_text())["id"]: json.loads(f.read_text()).get("oracle", [])
        for f in tasks.rglob("*.json")
    }
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
    args = p.parse_args()
    {"warm": cmd_warm, "probe": cmd_probe}[args.cmd](args)


if __name__ == "__main__":
    main()

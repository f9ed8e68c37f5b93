"""Per domain, how many OSWorld task files the task runner can run end to end.

A task counts as supported when every setup step, postconfig step, getter and metric it needs
is available (`arpo.env.runner.unsupported`) to the evaluator named (RunnerConfig.evaluator):
"own" (the project's code only), "osworld" (OSWorld's published package only) or "auto"
(either):

    python -m arpo.env.coverage ../shared/osworld/evaluation_examples --evaluator own   # 92 / 369
    python -m arpo.env.coverage ../shared/osworld/evaluation_examples                   # auto
    python -m arpo.env.coverage ../shared/osworld/evaluation_examples --gaps   # + what is missing
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from arpo.env.runner import EVALUATORS, unsupported
from arpo.env.task import Task, load_tasks
from arpo.markdown import md_cell


def coverage(
    tasks: list[Task], evaluator: str = "auto"
) -> tuple[dict[str, tuple[int, int]], dict[str, list[str]]]:
    """(domain -> (supported, total), task id -> gaps of each unsupported task)."""
    total: Counter[str] = Counter()
    ok: Counter[str] = Counter()
    gaps: dict[str, list[str]] = {}
    for t in tasks:
        total[t.domain] += 1
        missing = unsupported(t, evaluator)
        if missing:
            gaps[f"{t.domain}/{t.id}"] = missing
        else:
            ok[t.domain] += 1
    return {d: (ok[d], total[d]) for d in sorted(total)}, gaps


def report(per_domain: dict[str, tuple[int, int]]) -> str:
    """A markdown table: domain, supported, total, and the sum."""
    lines = ["| domain | supported | tasks |", "|---|---:|---:|"]
    lines += [f"| {md_cell(d)} | {ok} | {n} |" for d, (ok, n) in per_domain.items()]
    ok_all = sum(ok for ok, _ in per_domain.values())
    n_all = sum(n for _, n in per_domain.values())
    lines.append(f"| **all** | **{ok_all}** | **{n_all}** |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m arpo.env.coverage", description=__doc__)
    ap.add_argument("root", type=Path, help="an evaluation_examples folder (or its examples/)")
    ap.add_argument("--evaluator", choices=EVALUATORS, default="auto", help="whose code runs tasks")
    ap.add_argument("--gaps", action="store_true", help="also list every unsupported task")
    args = ap.parse_args(argv)
    per_domain, gaps = coverage(load_tasks(args.root), args.evaluator)
    print(f"evaluator={args.evaluator}\n")
    print(report(per_domain))
    if args.gaps:
        counts = Counter(g for gs in gaps.values() for g in gs)
        print("\nmissing (tasks):")
        for g, n in counts.most_common():
            print(f"  {n:4d}  {g}")
        print("\nunsupported tasks:")
        for tid, gs in sorted(gaps.items()):
            print(f"  {tid}: {'; '.join(gs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

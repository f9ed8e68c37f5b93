"""The test command's learning check over many seeds: the spread of its healthy numbers and the verdicts on broken learners.

    .venv/bin/python benchmarks/learning_check_spread.py                 # 20 seeds, 5 per sabotage
    .venv/bin/python benchmarks/learning_check_spread.py --runs 3 --sabotage-seeds 0 --no-save

The check is `tests/learning_check.py` (run by `tests/test_learning_check.py` at seed 0):
one seeded run of the whole pipeline on a task the starting policy never solves, judged
on the gain of the oracle response's log-probability and on the importance weights the
learner applied to the replayed success. This runs it on `--runs` seeds (each seed is
another task and other sampling seeds) with a healthy learner, the first seed a second time
(one seed must give the same numbers), and every sabotage of `SABOTAGES` on the first
`--sabotage-seeds` seeds. It exits 1 when a healthy run fails, a sabotaged one passes, or
the repeated seed gives other numbers.

Results go to benchmarks/results/learning-check-spread-<date>.{json,md} with date,
machine, commit and load average. Times are wall seconds on whatever else the machine runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _machine import run_header

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from learning_check import (  # noqa: E402
    ITERATIONS,
    MIN_GAIN,
    MIN_REPLAY_WEIGHT,
    MIN_STEP_GAIN,
    SABOTAGES,
    CheckResult,
    run_check,
    sabotaged,
    start,
)


def row(kind: str, r: CheckResult) -> dict:
    return {
        "kind": kind,
        "seed": r.seed,
        "passed": r.passed,
        "logp_before": r.oracle_logp_before,
        "logp_after": r.oracle_logp_after,
        "gain": r.gain,
        "oracle_logps": r.oracle_logps,
        "step_gains": r.step_gains,
        "replay_weights": r.replay_weights,
        "max_replay_weight": r.max_replay_weight,
        "fresh_successes": r.fresh_successes,
        "seconds": r.seconds,
        "failures": r.failures,
    }


def markdown(meta: dict, rows: list[dict], same: bool) -> str:
    healthy = [r for r in rows if r["kind"] == "healthy"]
    gains = [r["gain"] for r in healthy]
    steps = [g for r in healthy for g in r["step_gains"]]
    weights = [r["max_replay_weight"] for r in healthy]
    lines = [
        "# The learning check over many seeds",
        "",
        f"`{' '.join(['benchmarks/learning_check_spread.py', *meta['argv']])}` at {meta['commit']}, "
        f"{meta['date']}, {meta['machine']}, load average at the end "
        f"{meta['load_average'][0]:.2f} (the machine was shared: the times are inflated).",
        "",
        f"The check (`tests/learning_check.py`, {ITERATIONS} iterations): the oracle "
        f"response's log-prob must gain at least {MIN_GAIN:g} nats, and at least "
        f"{MIN_STEP_GAIN:g} at every step; the replayed "
        f"success's applied weight must equal its recomputed value and reach "
        f"{MIN_REPLAY_WEIGHT:g}.",
        "",
        f"Healthy: {sum(r['passed'] for r in healthy)} of {len(healthy)} runs passed (the "
        f"first seed twice); gain "
        f"min {min(gains):+.1f}, median {statistics.median(gains):+.1f}, max {max(gains):+.1f} "
        f"nats; smallest gain of one step {min(steps):+.1f} nats; largest replayed weight min {min(weights):.3f}, max {max(weights):.3f}; "
        f"seconds per run median {statistics.median(r['seconds'] for r in healthy):.1f}. "
        f"Seed {healthy[0]['seed']} run twice: "
        f"{'the same numbers' if same else 'DIFFERENT numbers'}.",
        "",
        "| run | seed | verdict | log-prob before -> after | gain (nats) | gain per step | "
        "replayed weight applied/recomputed per step | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        w = ", ".join(f"{a:.3f}/{e:.3f}" for a, e in r["replay_weights"])
        verdict = "passed" if r["passed"] else "failed"
        lines.append(
            f"| {r['kind']} | {r['seed']} | {verdict} | {r['logp_before']:.1f} -> "
            f"{r['logp_after']:.1f} | {r['gain']:+.1f} | "
            f"{', '.join(f'{g:+.1f}' for g in r['step_gains'])} | {w} | {r['seconds']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20, help="healthy seeds")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--sabotage-seeds", type=int, default=5, help="seeds per sabotage (0: none)")
    p.add_argument("--no-save", action="store_true", help="print only")
    args = p.parse_args()
    seeds = list(range(args.first_seed, args.first_seed + args.runs))
    rows: list[dict] = []
    bad: list[str] = []
    with tempfile.TemporaryDirectory(prefix="learning-check-") as tmp:
        starts = {}

        def begin(seed: int) -> Path:
            if seed not in starts:
                starts[seed] = start(Path(tmp) / f"start-{seed}", seed=seed)
            return starts[seed]

        def one(kind: str, seed: int) -> CheckResult:
            run_dir = Path(tmp) / f"{kind}-{seed}-{time.monotonic_ns()}"
            with sabotaged(kind):
                r = run_check(begin(seed), run_dir, seed=seed)
            rows.append(row(kind, r))
            print(f"{kind}: {r.report()}", flush=True)
            if r.passed != (kind == "healthy"):
                bad.append(f"{kind} seed {seed}: {'passed' if r.passed else 'failed'}")
            return r

        first = [one("healthy", s) for s in seeds]
        again = one("healthy", seeds[0])
        same = (again.gain, again.replay_weights) == (first[0].gain, first[0].replay_weights)
        if not same:
            bad.append(f"seed {seeds[0]} gave other numbers the second time")
        for name in SABOTAGES:
            for s in seeds[: args.sabotage_seeds]:
                one(name, s)
    meta = {**run_header(), "argv": sys.argv[1:]}
    md = markdown(meta, rows, same)
    print(md)
    if not args.no_save:
        stem = ROOT / "benchmarks" / "results" / f"learning-check-spread-{str(meta['date'])[:10]}"
        stem.with_suffix(".json").write_text(json.dumps({**meta, "runs": rows}, indent=2))
        stem.with_suffix(".md").write_text(md)
    for b in bad:
        print(f"WRONG VERDICT: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

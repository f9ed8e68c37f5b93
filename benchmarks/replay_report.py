"""What a training run did with what its actors collected: stale drops, replay, drift.

    .venv/bin/python benchmarks/replay_report.py runs/demo            # an `arpo train` run
    .venv/bin/python benchmarks/replay_report.py runs/experiment/runs/arpo-s0 --json

Reads `<run>/summary.json` (the accounting of every finished trajectory, written by
`arpo train`) and `<run>/learner/metrics.jsonl`, and prints:

- finished `ok` trajectories and the share dropped as stale (the staleness control's
  target is at most 5 %), trained, replaced by replay, other drops;
- replay: groups that met the trigger, groups that got a success (hits), successes
  admitted to the buffer, buffered successes evicted;
- the drift between the learner and the behaviour policies, from the proximal pass, for
  fresh and replayed trajectories: per-sequence log-ratio sum_t (pi_prox - mu) (min /
  mean / max over the run), the weight exp(pi_prox - mu) over tokens with behaviour
  probability below 0.9, and the truncated fraction; beside them the mean weight over all
  replayed tokens (`losses/weight_replay_mean`), which the format tokens dominate;
- the learner's time waiting for groups (`time/wait_s`) against its step time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any


def _vals(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [
        float(r[key]) for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])
    ]


def summarize(run: Path) -> dict[str, Any]:
    from arpo.learner.metrics import read_metrics

    summary = json.loads((run / "summary.json").read_text())
    acc = summary.get("accounting", {})
    rows = read_metrics(run / "learner" / "metrics.jsonl")
    ok = int(acc.get("finished_by_status", {}).get("ok", 0))
    drops = acc.get("dropped_by_reason", {})
    out: dict[str, Any] = {
        "run": str(run),
        "iterations": len(rows),
        "finished_ok": ok,
        "trained": acc.get("trained"),
        "dropped": drops,
        "stale_fraction": (drops.get("stale", 0) / ok) if ok else math.nan,
        "replay_triggered": sum(_vals(rows, "replay/triggered")),
        "replay_hits": sum(_vals(rows, "replay/hits")),
        "replay_admitted": sum(_vals(rows, "replay/admitted")),
        "replay_evicted": sum(_vals(rows, "replay/evicted")),
        "groups": sum(_vals(rows, "data/groups")),
        "wait_s": sum(_vals(rows, "time/wait_s")),
        "step_s": sum(_vals(rows, "time/step_s")),
    }
    for kind in ("fresh", "replay"):
        lo = _vals(rows, f"losses/seq_logratio_{kind}_min")
        mean = _vals(rows, f"losses/seq_logratio_{kind}_mean")
        hi = _vals(rows, f"losses/seq_logratio_{kind}_max")
        wlo = _vals(rows, f"losses/weight_lowp_{kind}_min")
        wmean = _vals(rows, f"losses/weight_lowp_{kind}_mean")
        whi = _vals(rows, f"losses/weight_lowp_{kind}_max")
        trunc = _vals(rows, f"losses/weight_truncated_{kind}_frac")
        out[kind] = {
            "iterations_with_data": len(mean),
            "seq_logratio_min": min(lo, default=math.nan),
            "seq_logratio_mean": sum(mean) / len(mean) if mean else math.nan,
            "seq_logratio_max": max(hi, default=math.nan),
            "weight_lowp_min": min(wlo, default=math.nan),
            "weight_lowp_mean": sum(wmean) / len(wmean) if wmean else math.nan,
            "weight_lowp_max": max(whi, default=math.nan),
            "truncated_frac_mean": sum(trunc) / len(trunc) if trunc else math.nan,
        }
    wr = _vals(rows, "losses/weight_replay_mean")
    out["replay"]["weight_all_tokens_min"] = min(wr, default=math.nan)
    out["replay"]["weight_all_tokens_max"] = max(wr, default=math.nan)
    return out


def render(s: dict[str, Any]) -> str:
    d = s["dropped"]
    lines = [
        f"run {s['run']}: {s['iterations']} iterations, {s['groups']:.0f} groups",
        f"finished ok {s['finished_ok']}, trained {s['trained']}, dropped {d} "
        f"-> stale {100 * s['stale_fraction']:.1f} % of finished ok",
        f"replay: triggered {s['replay_triggered']:.0f} groups, hits {s['replay_hits']:.0f}, "
        f"admitted {s['replay_admitted']:.0f}, evicted {s['replay_evicted']:.0f}",
        f"learner: waited {s['wait_s']:.1f} s for groups, stepped {s['step_s']:.1f} s",
        "",
        "| data | iterations | seq log-ratio min / mean / max (nats) | weight on p_mu < 0.9 "
        "min / mean / max | truncated |",
        "|---|---:|---|---|---:|",
    ]
    for kind in ("fresh", "replay"):
        k = s[kind]
        lines.append(
            f"| {kind} | {k['iterations_with_data']} | {k['seq_logratio_min']:.2f} / "
            f"{k['seq_logratio_mean']:.2f} / {k['seq_logratio_max']:.2f} | "
            f"{k['weight_lowp_min']:.2f} / {k['weight_lowp_mean']:.2f} / "
            f"{k['weight_lowp_max']:.2f} | {100 * k['truncated_frac_mean']:.1f} % |"
        )
    r = s["replay"]
    lines.append(
        f"\nmean weight over all replayed tokens (losses/weight_replay_mean): "
        f"{r['weight_all_tokens_min']:.2f} .. {r['weight_all_tokens_max']:.2f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="`arpo train` run folders.")
    p.add_argument("--json", action="store_true", help="JSON instead of text.")
    args = p.parse_args(argv)
    for run in args.runs:
        s = summarize(Path(run))
        print(json.dumps(s, indent=2) if args.json else render(s))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

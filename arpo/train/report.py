"""What a finished `arpo train` run reports: where every trajectory went (`account`), the
curves, the evaluations side by side with a verdict, the tasks out of the run, the preflight."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from arpo.markdown import md_cell


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, {} when it is missing or half-written."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def eval_gain(warm: dict[str, Any], trained: dict[str, Any]) -> dict[str, float]:
    """Trained minus warm-start success rate and its standard error (independent
    evaluations of the same tasks with the same protocol)."""
    diff = trained["success_rate"] - warm["success_rate"]
    se = (warm["se"] ** 2 + trained["se"] ** 2) ** 0.5
    return {"points": 100 * diff, "se_points": 100 * se}


def account(run_dir: Path, checkpoint: Path | None) -> dict[str, Any]:
    """Where every trajectory the actors finished went.

    Finished (the actors' spool ledgers, by status) against: trained (the learner's
    `trained.log`, as of the final checkpoint), dropped by the learner with a reason
    (stale, replaced by a replayed success, invalid, ...), still in the store (the final
    checkpoint's snapshot) or in the journal after it (the whole journal when there is no
    checkpoint yet: a resumed learner replays it whole), still in an actor's spool (never
    acknowledged), or kept aside there as refused for good by the learner. Each is read by
    the reader its writer's module keeps beside it. The spool of an actor on a Ray node is
    the driver's copy (`arpo.train.cluster`: its ledger, and its pending ids in `PENDING`);
    when that node was lost (`LOST_MARK`) what it held unacknowledged and the learner never
    got is counted as `lost_with_node`, not as in a spool. `unaccounted` lists `ok` trajectories
    found in none of them; `trained_twice` counts fresh trajectories trained in two
    iterations. Both must be 0."""
    import collections

    from arpo.actor.spool import read_spool
    from arpo.learner.checkpoint import load_checkpoint
    from arpo.learner.learner import TRAINED_LOG, read_trained_log
    from arpo.service.journal import journal_trajectory_ids
    from arpo.train.cluster import LOST_MARK, PENDING

    finished: dict[str, tuple[str, str]] = {}
    in_spool: set[str] = set()
    on_lost_nodes: set[str] = set()
    refused: set[str] = set()
    for d in sorted((run_dir / "spool").glob("*")):
        spool = read_spool(d)
        finished.update(spool.finished)
        copy = read_json_object(d / PENDING)
        pending = spool.pending | set(copy.get("pending") or [])
        if (d / LOST_MARK).exists():
            on_lost_nodes |= pending
        else:
            in_spool |= pending
        refused |= spool.refused | set(copy.get("refused") or [])
    trained: collections.Counter[str] = collections.Counter()
    dropped: dict[str, str] = {}
    for _, tid, what in read_trained_log(run_dir / "learner" / TRAINED_LOG):
        if what == "fresh":
            trained[tid] += 1
        elif what.startswith("dropped_"):
            dropped[tid] = what[len("dropped_") :]
    in_store: set[str] = set()
    in_journal: set[str] = set()
    if checkpoint is not None:
        ck = load_checkpoint(checkpoint, verify=False)
        in_store = ck.stored_trajectory_ids()
        if ck.journal_segment is not None:
            in_journal = journal_trajectory_ids(run_dir / "learner" / "journal", ck.journal_segment)
    elif (run_dir / "learner" / "journal").is_dir():
        # No checkpoint yet (a run stopped before its first): a resumed learner replays the
        # whole journal, so all of it is still the run's.
        in_journal = journal_trajectory_ids(run_dir / "learner" / "journal", 0)
    ok = {tid for tid, (status, _) in finished.items() if status == "ok"}
    learner_has = set(trained) | set(dropped) | in_store | in_journal
    lost_with_node = on_lost_nodes - learner_has
    accounted = learner_has | in_spool | refused | lost_with_node
    unaccounted = sorted(ok - accounted)
    return {
        "finished": len(finished),
        "finished_by_status": dict(collections.Counter(st for st, _ in finished.values())),
        "trained": len(set(trained) & ok),
        "dropped_by_reason": dict(collections.Counter(dropped[t] for t in set(dropped) & ok)),
        "in_store": len(in_store & ok),
        "in_journal": len(in_journal & ok),
        "in_spool": len(in_spool & ok),
        "refused": len(refused & ok),
        "lost_with_node": len(lost_with_node & ok),
        "unaccounted": len(unaccounted),
        "unaccounted_ids": unaccounted[:20],
        # every task out of the run: why, and how many of its trajectories were dropped
        "tasks_out": {
            t: {"reason": r.get("reason", ""), "dropped": r.get("dropped", 0)}
            for t, r in (
                read_json_object(run_dir / "learner" / "tasks_out.json").get("tasks_out") or {}
            ).items()
        },
        "trained_twice": sum(1 for n in trained.values() if n > 1),
    }


def _ema(values: list[float], alpha: float = 0.15) -> list[float]:
    out, m = [], None
    for v in values:
        m = v if m is None else alpha * v + (1 - alpha) * m
        out.append(m)
    return out


def plot_curves(
    rows: list[dict[str, Any]],
    path: Path,
    warm_start: dict[str, Any] | float | None = None,
    eval_temperature: float = 0.6,
    trained: dict[str, Any] | None = None,
    rollout_temperature: float | None = None,
) -> Path:
    """Training success and mean reward against iteration, as a PNG: each training
    iteration's value faint, its exponential moving average (alpha 0.15) solid, labelled
    with the rollout temperature; the warm start's evaluation (`warm_start`: an evaluation
    dict, or a success rate) at iteration 0 and the trained policy's (`trained`) at the last
    iteration as points with 95 % error bars (1.96 standard errors), at `eval_temperature`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    t_roll = "" if rollout_temperature is None else f", T={rollout_temperature:g}"
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    for a, key, label in (
        (ax[0], "charts/success_rate", "success rate"),
        (ax[1], "charts/reward_mean", "mean reward"),
    ):
        pts = [(s, r.get(key)) for s, r in zip(steps, rows, strict=True) if r.get(key) is not None]
        if pts:
            xs, ys = [p[0] for p in pts], [float(p[1]) for p in pts]
            a.plot(xs, ys, color="tab:blue", alpha=0.25, linewidth=0.8,
                   label=f"training episodes{t_roll}")  # fmt: skip
            a.plot(xs, _ema(ys), color="tab:blue", linewidth=2, label="training, smoothed (EMA)")
        if key == "charts/success_rate":
            last = steps[-1] if steps else 1
            for x, ev, name, color in ((0, warm_start, "warm start", "grey"),
                                       (last, trained, "trained", "tab:green")):  # fmt: skip
                if ev is None:
                    continue
                p = ev if isinstance(ev, float | int) else ev.get("success_rate")
                se = 0.0 if isinstance(ev, float | int) else float(ev.get("se") or 0.0)
                if p is None:
                    continue
                a.errorbar([x], [p], yerr=[1.96 * se], fmt="o", color=color, capsize=4,
                           label=f"{name}, evaluated (T={eval_temperature:g}, 95 % CI)")  # fmt: skip
            a.set_ylim(-0.02, 1.02)
        a.legend(fontsize=7, loc="best")
        a.set_xlabel("iteration")
        a.set_ylabel(label)
        a.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def verdict(gain: dict[str, float]) -> str:
    """Whether training helped, in words: the difference and its 95 % interval."""
    lo = gain["points"] - 1.96 * gain["se_points"]
    hi = gain["points"] + 1.96 * gain["se_points"]
    ci = f"{gain['points']:+.1f} points, 95 % CI {lo:+.1f} to {hi:+.1f}"
    if lo > 0:
        return f"Training helped: {ci} (the interval excludes 0)."
    if hi < 0:
        return f"Training made the policy worse: {ci} (the interval excludes 0)."
    return f"No measurable effect: {ci} (the interval includes 0)."


def comparison(out: dict[str, Any]) -> str:
    """The starting and the trained policy's evaluations side by side (Markdown)."""
    w, t = out.get("eval_warm_start"), out.get("eval_trained")
    rows = ["| policy | success rate | standard error | episodes |", "|---|---:|---:|---:|"]
    for name, ev in (("start (warm start)", w), ("trained", t)):
        if ev:
            rows.append(f"| {name} | {100 * ev['success_rate']:.1f} % | "
                        f"{100 * ev['se']:.1f} | {ev['episodes']} |")  # fmt: skip
    g = out.get("eval_gain")
    if g:
        rows.append(f"| trained - start | {g['points']:+.1f} points | {g['se_points']:.1f} | |")
        rows += ["", verdict(g)]
    wt, tt = (w or {}).get("by_task") or {}, (t or {}).get("by_task") or {}
    pre = (out.get("prefill") or {}).get("successes")
    if wt and tt:
        # Per task: a gain overall can hide tasks that were lost while others were learned.
        head, rule = "| task | start | trained | change |", "|---|---:|---:|---:|"
        if pre is not None:
            head, rule = head + " replay pre-fill |", rule + "---:|"
        rows += ["", head, rule]
        for task in sorted(set(wt) | set(tt)):
            a, b = wt.get(task), tt.get(task)
            cells = [f"{x['successes']}/{x['runs']}" if x else "-" for x in (a, b)]
            d = b["successes"] - a["successes"] if a and b and a["runs"] == b["runs"] else None
            line = (f"| {md_cell(task)} | {cells[0]} | {cells[1]} | "
                    f"{'' if d is None else f'{d:+d}'} |")  # fmt: skip
            if pre is not None:
                line += f" {pre.get(task, '-')} |"
            rows.append(line)
    return "\n".join(rows)


def tasks_out_table(tasks_out: dict[str, Any]) -> str:
    """The tasks that were out of the run (left out before it, or left during it), a line
    each with their reason, failures and environments."""
    lines = [f"{len(tasks_out)} task(s) out of the run:", "", "| task | failures | envs | "
             "dropped | reason |", "|---|---|---|---|---|"]  # fmt: skip
    for tid, r in sorted(tasks_out.items()):
        reason = md_cell(r.get("reason", ""), 300)
        lines.append(f"| {md_cell(tid)} | {r.get('failures', 0)} | {r.get('envs', 0)} | "
                     f"{r.get('dropped', 0)} | {reason} |")  # fmt: skip
    return "\n".join(lines)


def preflight_markdown(audits: Sequence[Any], seconds: float) -> str:
    """`<run_dir>/preflight.md`: a line per task of the preflight (`TaskAudit`s), its pool,
    its setup's seconds and why it was left out ("ok" when it was not)."""
    left_out = sum(a.verdict != "ok" for a in audits)
    lines = [f"# Preflight: {len(audits)} tasks set up once, {left_out} left out ({seconds} s)",
             "", "| task | pool | setup s | reason |", "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {md_cell(a.task_id)} | {md_cell(a.pool)} | {a.setup_s:.1f} | "
              f"{md_cell(a.reason, 300) or 'ok'} |" for a in audits]  # fmt: skip
    return "\n".join(lines) + "\n"

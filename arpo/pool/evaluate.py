"""Evaluation: a policy run N times on every task of a set, success rates by task and domain.

The episodes go through the real rollout path (`arpo.pool.rollouts.run_pool`: the same
grant server, ingest, `arpo-actor` processes, environments and policy engine as
training), with the evaluation sampling (temperature 0.6, top_p 1.0; docs/concepts/method.md):

    arpo eval checkpoint=runs/learner/checkpoints/ckpt-00000050 tasks=runs/task_pool \\
        runs_per_task=4 out=runs/eval-50 'local_actor_args=["sim_envs=4"]'
    arpo eval checkpoint=runs/learner/checkpoints tasks=...   # the newest valid checkpoint
    arpo eval model=runs/tiny tasks=... local_actor=false     # actors started elsewhere

    result = run_eval(load_config(EvalConfig, None, ["model=runs/tiny", "tasks=..."]))

The local actor (on by default) gets `engine.model=<the model folder>`,
`episode.temperature` and `episode.top_p` from this config (after `local_actor_args`,
which may not set them). Actors started elsewhere (`local_actor=false`) must be given the
same model and sampling themselves: the report records what this config says.

Output, written atomically when every run is done:

- `<out>/eval.json`:

      {"policy": {"model", "checkpoint", "iteration", "policy_version"},
       "sampling": {"temperature": 0.6, "top_p": 1.0},
       "tasks_source", "runs_per_task", "success_score", "complete", "created", "elapsed_s",
       "overall": {"tasks", "episodes", "successes", "env_errors", "unknown",
                   "success_rate_episodes", "success_rate_tasks"},
       "domains": {"<domain>": {"tasks", <counts and means>}, ...},
       "tasks": {"<id>": {"domain", <counts and means>}, ...}}

  counts and means: runs, successes, success_rate (successes / runs), mean_score
  (checker score), mean_reward, mean_steps (over the runs: `ok` episodes), env_errors
  (episodes that ended in env_error / eval_error / timeout, re-run up to max_attempts)
  and unknown (runs given up after that). A domain sums its tasks' counts, its means
  are over all its runs. `success_rate_episodes` is successes / runs over everything,
  `success_rate_tasks` the mean of the per-task success rates (tasks with runs).
- `<out>/eval.md`: the same as Markdown tables (domains, then tasks), also printed.
- `<out>/actor.log`: the local actor's stderr.

A `timeout_s` that passes first writes both files with `"complete": false` and raises
an `ArpoError`.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arpo.config import option
from arpo.env.task import load_pool
from arpo.env.taskfiles import TaskFiles
from arpo.errors import ArpoError
from arpo.files import write_atomic, write_json_atomic
from arpo.markdown import md_cell
from arpo.pool.rollouts import (
    EpisodeOutcome,
    PolicyPoolConfig,
    PolicySource,
    PoolResult,
    resolve_policy,
    run_command,
    run_pool,
    with_overrides,
)

log = logging.getLogger("arpo.pool.evaluate")


@dataclass
class EvalConfig(PolicyPoolConfig):
    """`arpo eval`: a checkpoint or model run N times per task, success rates reported.

    The shared fields (tasks, transport, local actor, policy, sampling) are
    `PolicyPoolConfig`'s.
    """

    runs_per_task: int = option(4, "Episodes per task.")
    temperature: float = option(0.6, "Sampling temperature (the reference evaluates at 0.6).")
    out: str = option("runs/eval", "Folder of eval.json and eval.md.")


# ---------------------------------------------------------------------------- aggregation


def _zero() -> dict[str, Any]:
    return {"runs": 0, "successes": 0, "env_errors": 0, "unknown": 0,
            "score_sum": 0.0, "reward_sum": 0.0, "steps_sum": 0, "unparsed_sum": 0}  # fmt: skip


def _finish(acc: Mapping[str, Any]) -> dict[str, Any]:
    runs = acc["runs"]

    def mean(x: float) -> float | None:
        return round(x / runs, 6) if runs else None

    return {
        "runs": runs,
        "successes": acc["successes"],
        "success_rate": mean(acc["successes"]),
        "mean_score": mean(acc["score_sum"]),
        "mean_reward": mean(acc["reward_sum"]),
        "mean_steps": mean(acc["steps_sum"]),
        "parse_failure_rate": (
            round(acc["unparsed_sum"] / acc["steps_sum"], 6) if acc["steps_sum"] else None
        ),
        "env_errors": acc["env_errors"],
        "unknown": acc["unknown"],
    }


def summarize(
    counts: Mapping[str, Mapping[str, int]],
    episodes: Iterable[EpisodeOutcome],
    domains: Mapping[str, str],
) -> dict[str, Any]:
    """Per task, per domain and overall numbers from a `PoolResult`'s counts and episodes.

    `domains` maps task id -> domain; tasks keep the order of `counts`, domains the order
    of their first task.
    """
    acc = {tid: _zero() for tid in counts}
    for tid, c in counts.items():
        for k in ("runs", "successes", "env_errors", "unknown"):
            acc[tid][k] = c[k]
    for e in episodes:
        if e.status == "ok" and e.task_id in acc:
            a = acc[e.task_id]
            a["score_sum"] += e.checker_score
            a["reward_sum"] += e.reward
            a["steps_sum"] += e.steps
            a["unparsed_sum"] += e.unparsed
    by_domain: dict[str, dict[str, Any]] = {}
    n_tasks: dict[str, int] = {}
    for tid, a in acc.items():
        d = domains.get(tid, "unknown")
        agg = by_domain.setdefault(d, _zero())
        n_tasks[d] = n_tasks.get(d, 0) + 1
        for k, v in a.items():
            agg[k] += v
    tasks = {tid: {"domain": domains.get(tid, "unknown"), **_finish(a)} for tid, a in acc.items()}
    total = _zero()
    for a in acc.values():
        for k, v in a.items():
            total[k] += v
    rates = [t["success_rate"] for t in tasks.values() if t["success_rate"] is not None]
    return {
        "overall": {
            "tasks": len(tasks),
            "episodes": total["runs"],
            "successes": total["successes"],
            "env_errors": total["env_errors"],
            "unknown": total["unknown"],
            "success_rate_episodes": _finish(total)["success_rate"],
            "success_rate_tasks": round(sum(rates) / len(rates), 6) if rates else None,
            "mean_score": _finish(total)["mean_score"],
            "mean_reward": _finish(total)["mean_reward"],
            "mean_steps": _finish(total)["mean_steps"],
            "parse_failure_rate": _finish(total)["parse_failure_rate"],
        },
        "domains": {d: {"tasks": n_tasks[d], **_finish(a)} for d, a in by_domain.items()},
        "tasks": tasks,
    }


# ---------------------------------------------------------------------------- the report


def _num(x: Any, pct: bool = False) -> str:
    if x is None:
        return "-"
    if pct:
        return f"{100 * x:.1f}%"
    return f"{x:.3f}" if isinstance(x, float) else str(x)


_COLS = ["runs", "successes", "success", "score", "reward", "steps", "env_errors", "unknown"]


def _row(name: str, r: Mapping[str, Any], extra: list[str]) -> str:
    cells = [
        md_cell(name), *map(md_cell, extra), str(r["runs"]), str(r["successes"]),
        _num(r["success_rate"], pct=True),
        _num(r["mean_score"]), _num(r["mean_reward"]), _num(r["mean_steps"]),
        str(r["env_errors"]), str(r["unknown"]),
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def format_markdown(result: Mapping[str, Any]) -> str:
    """The evaluation as Markdown: a header, the domain table, then the task table."""
    pol, smp, ov = result["policy"], result["sampling"], result["overall"]
    lines = ["# Evaluation", ""]
    if pol.get("checkpoint"):
        lines.append(
            f"- checkpoint: `{pol['checkpoint']}` (iteration {_num(pol.get('iteration'))}, "
            f"policy version {_num(pol.get('policy_version'))})"
        )
    lines.append(f"- model: `{pol['model']}`")
    lines.append(
        f"- sampling: temperature {smp['temperature']:g}, top_p {smp['top_p']:g}; "
        f"{result['runs_per_task']} runs per task; success: checker score >= "
        f"{result['success_score']:g}"
    )
    lines.append(
        f"- overall: {ov['successes']} successes in {ov['episodes']} episodes of "
        f"{ov['tasks']} tasks: {_num(ov['success_rate_episodes'], pct=True)} of episodes, "
        f"{_num(ov['success_rate_tasks'], pct=True)} mean over tasks; "
        f"{ov['env_errors']} environment errors, {ov['unknown']} unknown runs; "
        f"{_num(ov.get('parse_failure_rate'), pct=True)} of actions did not parse"
    )
    if not result.get("complete", True):
        lines.append("- **incomplete**: the run timed out before every run finished")
    head = ["runs", "successes", "success rate", "mean score", "mean reward", "mean steps",
            "env errors", "unknown"]  # fmt: skip
    lines += ["", "## By domain", ""]
    lines.append("| domain | tasks | " + " | ".join(head) + " |")
    lines.append("|---" * (len(head) + 2) + "|")
    for d, r in result["domains"].items():
        lines.append(_row(d, r, [str(r["tasks"])]))
    lines += ["", "## By task", ""]
    lines.append("| task | domain | " + " | ".join(head) + " |")
    lines.append("|---" * (len(head) + 2) + "|")
    for tid, r in result["tasks"].items():
        lines.append(_row(tid, r, [r["domain"]]))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- the run


def actor_args(cfg: EvalConfig, policy: PolicySource) -> list[str]:
    """The local actor's overrides: `local_actor_args`, then the model and the sampling."""
    return with_overrides(
        cfg.local_actor_args,
        {
            "engine.model": policy.model,
            "episode.temperature": cfg.temperature,
            "episode.top_p": cfg.top_p,
        },
    )


def run_eval(
    cfg: EvalConfig,
    *,
    store: Any = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Evaluate, write `<out>/eval.json` and `<out>/eval.md`, return the JSON's content.

    `store` receives every `ok` episode as ingest stores it (`store.put(task, item)`); by
    default they are discarded. Raises `ConfigError` for an unusable checkpoint, `TaskError`
    for a bad task set, `ArpoError` on a timeout (after writing the partial result).
    """
    policy = resolve_policy(cfg.checkpoint, cfg.model, verify=cfg.verify)
    files = TaskFiles()
    pool = load_pool(cfg.tasks, files)
    out = Path(cfg.out)
    res: PoolResult = run_pool(
        cfg,
        [p.task for p in pool],
        actor_log=Path(cfg.local_actor_log or out / "actor.log"),
        spool=out / "actor-spool",
        learner_id="eval",
        actor_id="eval-local",
        actor_args=actor_args(cfg, policy),
        store=store,
        on_progress=on_progress,
        files=files,
    )
    result = {
        "policy": policy.to_dict(),
        "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p},
        "tasks_source": cfg.tasks,
        "runs_per_task": cfg.runs_per_task,
        "success_score": cfg.success_score,
        "complete": res.complete,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "elapsed_s": round(res.elapsed_s, 3),
        **summarize(res.counts, res.episodes, {p.task["id"]: p.domain for p in pool}),
    }
    write_json_atomic(out / "eval.json", result)
    write_atomic(out / "eval.md", format_markdown(result))
    if not res.complete:
        raise ArpoError(
            f"evaluation timed out after {cfg.timeout_s:g} s with {res.done} of {res.total} "
            f"runs finished; partial results in {out} (marked incomplete)"
        )
    return result


def main(cfg: EvalConfig) -> int:
    """`arpo eval`: run, print the Markdown report and the output folder; the exit code."""

    def report(result: dict[str, Any]) -> str:
        out = Path(cfg.out)
        written = f"written to {out / 'eval.json'} and {out / 'eval.md'}"
        return f"{format_markdown(result)}\n{written}"

    return run_command("eval", cfg.progress_s,
                       lambda progress: run_eval(cfg, on_progress=progress), report)  # fmt: skip

"""Collection: a policy run N times on every task of a set, every trajectory kept on disk.

The data of offline methods (rejection sampling, DPO/KTO pairs) and of analysis. The
episodes go through the real rollout path (`arpo.pool.rollouts.run_pool`), with the
rollout sampling (temperature 1.0, top_p 1.0: docs/concepts/method.md, 'Reference settings'):

    arpo collect model=runs/tiny tasks=runs/task_pool runs_per_task=8 out=runs/collect-base \\
        'local_actor_args=["sim_envs=4"]'
    arpo collect model=runs/learner/checkpoints tasks=...    # the newest valid checkpoint

    for traj in read_collection("runs/collect-base"):  # arpo.service.journal: Trajectory records
        ...
    outcomes = load_outcomes("runs/collect-base")

The local actor (on by default) gets `engine.model`, `episode.temperature` and
`episode.top_p` from this config, as in `arpo eval`.

Layout of `<out>/`:

- `trajectories/journal-<n:08d>.log`: the ingest's write-ahead journal
  (`arpo.service.journal`), one record per stored trajectory: the wire-encoded message
  (`arpo.wire`, the frames it arrived in) framed as
  `b"ARJ1", n_frames u32, payload u64 | frame lengths u64 | frames | crc32`. Only `ok`
  episodes are stored, each once (a resend of the same trajectory id, or a surplus
  delivery of a slot already filled, is not). A torn tail (a crash mid-write) is skipped
  by the reader.
- `outcomes.json`, written atomically at the end:

      {"policy": {"model", "checkpoint", "iteration", "policy_version"},
       "sampling": {"temperature", "top_p"}, "tasks_source", "runs_per_task",
       "success_score", "complete", "created", "elapsed_s", "stored": <ok episodes>,
       "trajectories": "trajectories",
       "tasks": {"<id>": {"domain", "runs", "successes", "env_errors", "unknown",
                          "trajectories": [{"id", "status", "checker_score", "reward",
                                            "steps", "slot", "success", "stored"}, ...]}}}

  Every counted episode is listed, env_error / eval_error / timeout ones too (those are
  `"stored": false`: they are not in the journal).
- `actor.log`: the local actor's stderr.

An `out` that already holds a collection is refused unless `overwrite=true` (which
deletes its journal and outcomes first). A `timeout_s` that passes first writes
`outcomes.json` with `"complete": false` and raises an `ArpoError`; the trajectories
stored until then stay readable.
"""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arpo.config import check_range, option
from arpo.env.task import load_pool
from arpo.env.taskfiles import TaskFiles
from arpo.errors import ArpoError, ConfigError
from arpo.files import write_json_atomic
from arpo.pool.rollouts import (
    PolicyPoolConfig,
    counts_table,
    resolve_policy,
    run_command,
    run_pool,
    with_overrides,
)
from arpo.service.ingest import IngestConfig
from arpo.service.journal import TRAJECTORIES, list_segments, segment_path

log = logging.getLogger("arpo.pool.collect")

OUTCOMES = "outcomes.json"


@dataclass
class CollectConfig(PolicyPoolConfig):
    """`arpo collect`: a model run N times per task, trajectories and outcomes kept on disk.

    The shared fields (tasks, transport, local actor, policy, sampling) are
    `PolicyPoolConfig`'s.
    """

    runs_per_task: int = option(8, "Episodes per task.")
    temperature: float = option(1.0, "Sampling temperature (rollouts use 1.0).")
    out: str = option("runs/collect", "Folder of the collection (trajectories/, outcomes.json).")
    overwrite: bool = option(False, "Replace a collection already in out.")
    journal_fsync_every: int = option(
        1, "fsync the trajectory journal every this many records (1: before every ack)."
    )
    _policy_field = "model"

    def validate(self) -> None:
        super().validate()
        check_range(
            "journal_fsync_every",
            self.journal_fsync_every,
            1,
            1 << 20,
            "records between fsyncs of the journal; 1: before every ack",
        )


# ---------------------------------------------------------------------------- reading


def load_outcomes(path: str | Path) -> dict[str, Any]:
    """The `outcomes.json` of a collection (its folder, or the file itself).

    Raises `ArpoError` naming the file when it is missing or not an outcomes file.
    """
    p = Path(path)
    if p.is_dir():
        p = p / OUTCOMES
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ArpoError(f"{p} does not exist (run `arpo collect` first)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArpoError(f"{p} is not readable JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("tasks"), dict):
        raise ArpoError(f"{p} has no 'tasks' table (is it the output of `arpo collect`?)")
    return data


# ---------------------------------------------------------------------------- the run


def _prepare_out(cfg: CollectConfig) -> Path:
    out = Path(cfg.out)
    jdir = out / TRAJECTORIES
    if list_segments(jdir) or (out / OUTCOMES).exists():
        if not cfg.overwrite:
            raise ConfigError(
                f"config field out: {cfg.out!r} already holds a collection; choose another "
                "folder or set overwrite=true"
            )
        for n in list_segments(jdir):
            segment_path(jdir, n).unlink()
        (out / OUTCOMES).unlink(missing_ok=True)
    jdir.mkdir(parents=True, exist_ok=True)
    return out


def run_collect(
    cfg: CollectConfig,
    *,
    store: Any = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Collect, write `<out>/trajectories/` and `<out>/outcomes.json`; the outcomes.

    `store` also receives every stored episode (`store.put(task, item)`). Raises
    `ConfigError` for an unusable model / checkpoint or an occupied `out`, `TaskError` for
    a bad task set, `ArpoError` on a timeout (after writing the partial outcomes).
    """
    policy = resolve_policy(cfg.checkpoint, cfg.model, verify=cfg.verify)
    files = TaskFiles()
    pool = load_pool(cfg.tasks, files)
    out = _prepare_out(cfg)
    res = run_pool(
        cfg,
        [p.task for p in pool],
        actor_log=Path(cfg.local_actor_log or out / "actor.log"),
        spool=out / "actor-spool",
        learner_id="collect",
        actor_id="collect-local",
        files=files,
        actor_args=with_overrides(
            cfg.local_actor_args,
            {
                "engine.model": policy.model,
                "episode.temperature": cfg.temperature,
                "episode.top_p": cfg.top_p,
            },
        ),
        ingest_config=IngestConfig(
            journal_dir=str(out / TRAJECTORIES), journal_fsync_every=cfg.journal_fsync_every
        ),
        store=store,
        on_progress=on_progress,
    )
    tasks: dict[str, Any] = {}
    for p in pool:
        tid = p.task["id"]
        tasks[tid] = {"domain": p.domain, **res.counts[tid], "trajectories": []}
    for e in res.episodes:
        tasks[e.task_id]["trajectories"].append(
            {
                "id": e.trajectory_id,
                "status": e.status,
                "checker_score": e.checker_score,
                "reward": e.reward,
                "steps": e.steps,
                "slot": e.slot,
                "success": e.success,
                "stored": e.status == "ok",
            }
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
        "stored": int(res.ingest.get("stored", 0)),
        "trajectories": TRAJECTORIES,
        "tasks": tasks,
    }
    write_json_atomic(out / OUTCOMES, result)
    if not res.complete:
        raise ArpoError(
            f"collection timed out after {cfg.timeout_s:g} s with {res.done} of {res.total} "
            f"runs finished; partial outcomes in {out / OUTCOMES} (marked incomplete)"
        )
    return result


def format_table(result: dict[str, Any]) -> str:
    """A plain-text table of the counts per task."""
    return counts_table(result["tasks"])


def main(cfg: CollectConfig) -> int:
    """`arpo collect`: run, print the counts and the output folder; the exit code."""

    def report(result: dict[str, Any]) -> str:
        where = Path(cfg.out) / TRAJECTORIES
        return f"{format_table(result)}\n{result['stored']} trajectories stored in {where}"

    return run_command("collect", cfg.progress_s,
                       lambda progress: run_collect(cfg, on_progress=progress), report)  # fmt: skip

"""The learner's metrics: named timing spans, a JSONL + TensorBoard logger, a progress line,
per-task success statistics.

    spans, rates = Spans(), Throughput()
    log = MetricsLogger("runs/r1", MetricsConfig(progress_s=10))
    tasks = TaskStats(window=32)
    for it in range(iterations):
        with spans("assemble"):
            batch = ...
        with spans("proximal_forward"):
            ...
        for traj in batch:
            tasks.record(traj.task_id, traj.checker_score >= 1.0, traj.reward)
        rates.add("trajectories", len(batch))
        log.log(it, {"charts/reward_mean": 0.41, **loss_metrics(loss_out), **spans.metrics(),
                     **rates.take(), **tasks.metrics()})
    log.close()
    rows = read_metrics("runs/r1/metrics.jsonl")

What is written:

- `<run_dir>/metrics.jsonl`: one JSON object per `log` call,
  `{"step": ..., "time": unix seconds, "wall_s": seconds since the logger started, **metrics}`,
  appended and flushed at every call (a resumed run appends to the same file). Non-finite
  floats (NaN, inf) are written as `null`; `read_metrics` reads them back as `None`.
- `<run_dir>/tb/`: TensorBoard event files (`torch.utils.tensorboard.SummaryWriter`), one
  scalar per metric at `step` (non-finite values kept as NaN / inf, `None` left out);
  flushed after every call, or at most every `flush_s` seconds.
- stderr: `ProgressLine`, at most every `progress_s` seconds,
  `iter 12 | v12 | reward 0.41 | success 0.38 | 3.2 traj/s | 812 tok/s | staleness 0.6 | replay 2`
  (rewritten in place with a carriage return when stderr is a terminal, one line per update
  otherwise).

Metric names live in fixed namespaces (cleanrl's `charts/` and `losses/`, plus `replay/`,
`data/`, `time/` and `tasks/`); `STANDARD_METRICS` lists the standard names with their
meaning (`markdown_table()` renders it for the README), `loss_metrics` renames the output
of `arpo.learner.loss.arpo_loss` into `losses/`. Names outside this list are accepted as
they are.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import numbers
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from arpo.config import check_seconds, option
from arpo.errors import ArpoError

# ---------------------------------------------------------------------------- metric names

CHARTS: dict[str, str] = {
    "charts/reward_mean": "Mean total reward of the fresh episodes trained on this iteration.",
    "charts/success_rate": "Share of those episodes that succeeded (checker score at threshold).",
    "charts/episodes": "Fresh episodes trained on this iteration.",
    "charts/parse_failure_rate": "Share of those episodes that ended on a response that did not "
    "parse (format reward -1).",
    "charts/steps_per_s": "Environment steps (agent actions) received per second.",
    "charts/trajectories_per_s": "Trajectories received (stored by ingest) per second.",
    "charts/trained_per_s": "Trajectories trained on per second of the iteration.",
    "charts/tokens_per_s": "Tokens through the learner's forward and backward passes per second.",
    "charts/policy_version": "The learner's policy version after this iteration.",
    "charts/staleness_mean": "Mean versions between a trained turn's behaviour policy and the "
    "learner's version.",
    "charts/staleness_max": "Largest such gap in this iteration.",
}
LOSSES: dict[str, str] = {
    "losses/loss": "The optimised loss (policy loss + KL term when enabled), mean over steps.",
    "losses/loss_pg": "The clipped, importance-weighted policy-gradient loss.",
    "losses/loss_kl": "KL estimate (k3) to the reference model (the starting policy unless "
    "trainer.ref_model), with loss.kl_coef > 0 or trainer.track_kl.",
    "losses/entropy": "Mean entropy of the policy over the trained tokens.",
    "losses/grad_norm": "Gradient norm before clipping, mean over the optimizer steps.",
    "losses/grad_norm_max": "Largest gradient norm of the iteration's optimizer steps.",
    "losses/steps_refused": "Optimizer steps refused this iteration: the gradient was not "
    "finite (NaN / inf); the weights stayed as they were.",
    "losses/lr": "Learning rate of this iteration (the mean over its optimizer steps).",
    "losses/clip_low_frac": "Share of tokens clipped below (A < 0, ratio < 1 - eps_low).",
    "losses/clip_high_frac": "Share of tokens clipped above (A > 0, ratio > 1 + eps_high).",
    "losses/clip_dual_frac": "Share of tokens bounded by the dual clip.",
    "losses/ratio_mean": "Mean ratio pi_theta / pi_prox over the trained tokens.",
    "losses/ratio_min": "Smallest ratio.",
    "losses/ratio_max": "Largest ratio.",
    "losses/weight_fresh_mean": "Mean importance weight exp(pi_prox - mu) of fresh tokens.",
    "losses/weight_replay_mean": "Mean importance weight of replayed tokens (mostly format "
    "tokens near probability 1: see the two rows below for the decision tokens).",
    "losses/weight_truncated_frac": "Share of tokens whose weight was truncated at w_max.",
    "losses/weight_ess": "Normalised effective sample size of the weights, in [0, 1].",
    "losses/seq_logratio_<kind>_<mean|min|max>": "Per-trajectory log-ratio sum_t (pi_prox - mu) "
    "over its response tokens, for kind fresh or replay (from the proximal pass; 0 on-policy).",
    "losses/weight_lowp_<kind>_<mean|min|max>": "Weight exp(pi_prox - mu), before truncation, "
    "over the tokens whose behaviour probability is below 0.9 (the decision tokens).",
    "losses/weight_truncated_<kind>_frac": "Share of the kind's tokens whose weight exceeds "
    "w_max (truncated).",
}
REPLAY: dict[str, str] = {
    "replay/hits": "Groups that had a stored success put into them this iteration.",
    "replay/buffer_size": "Successes held in the replay buffer, all tasks.",
    "replay/version_gap_mean": "Mean versions between a replayed success and the learner.",
    "replay/triggered": "Groups that met the replay trigger (no success), replayed into or not.",
    "replay/admitted": "Successes that entered the replay buffer this iteration (whatever "
    "their age: a success too stale to train fresh is still replayed later).",
    "replay/evicted": "Buffered successes evicted because the learner cannot train them.",
}
DATA: dict[str, str] = {
    "data/groups": "Groups trained on this iteration.",
    "data/tokens": "Tokens of the trained sequences (prompts and responses).",
    "data/loss_tokens": "Tokens the loss covers (sampled response tokens).",
    "data/flat_skipped": "Trajectories of the step whose advantage was 0 on every token, "
    "left out of the forward and backward passes (trainer.skip_flat; the update is the same).",
    "data/dropped_stale": "Trajectories dropped because they were too stale.",
    "data/dropped_status": "Trajectories kept out of training by their status (env_error, ...).",
    "data/dropped_invalid": "Trajectories the model cannot be trained on (e.g. a sampled "
    "<|image_pad|> in a response, a token id outside the vocabulary, an unreadable "
    "screenshot), dropped and logged before the group is scored.",
    "data/dropped_sampling": "Trajectories with a turn sampled at another temperature / top_p "
    "than the learner scores (or with none recorded), dropped and logged before scoring.",
    "data/dropped_groups": "Groups left with fewer than assemble.min_group_size trajectories.",
    "data/trajectories": "Trajectories trained on this iteration (fresh and replayed).",
    "data/ingest_<counter>": "Ingest counters since start: stored, duplicates, surplus, "
    "excluded_<status>, messages, bytes, steps, ...",
    "data/ingest_rejected": "Messages ingest rejected (malformed, oversized, unauthenticated).",
    "data/actors": "Actors that have sent a heartbeat.",
    "data/grants_in_flight": "Task grants issued and not yet delivered.",
    "data/prefetched": "1 when this batch was taken and its pixels made while the previous "
    "step trained (`LearnerConfig.prefetch`), else 0.",
    "data/actor_envs": "Environments of the actors, from their last heartbeats.",
    "data/actor_episode_s": "Environment-seconds the actors spent running episodes since they "
    "started (sum over actors, last heartbeats).",
    "data/actor_grant_wait_s": "Environment-seconds the actors spent asking for grants.",
    "data/actor_weight_wait_s": "Environment-seconds the actors spent waiting for the policy "
    "version a grant asked for.",
    "data/actor_files_fetched": "Task files the actors fetched from the learner by sha256 "
    "(`arpo.env.taskfiles`; a file already in an actor's cache is not fetched again).",
    "data/actor_files_refused": "Task files whose received bytes did not have the size or "
    "sha256 their task names: refused, never used or cached (their task's setup fails).",
}
TIME: dict[str, str] = {
    "time/<span>_s": "Wall seconds spent in a named span this iteration (`Spans`): wait "
    "(for groups), step (the whole training step), sequences, proximal_forward, "
    "forward_backward, optimizer (inside the step), publish, checkpoint; prefetch_sequences: "
    "making the batch's sequences ahead (in the prefetch thread, overlapping the step before).",
}
TASKS: dict[str, str] = {
    "tasks/<task_id>/success_rate": "A task's success rate over its last `window` episodes "
    "(`TaskStats`).",
}
STANDARD_METRICS: dict[str, str] = {**CHARTS, **LOSSES, **REPLAY, **DATA, **TIME, **TASKS}
"""Every standard metric name (patterns in angle brackets) -> what it means."""

NAMESPACES = ("charts/", "losses/", "replay/", "data/", "time/", "tasks/")


def loss_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """`arpo.learner.loss.arpo_loss`'s metrics under `losses/`: `a/b` -> `losses/a_b`,
    `loss/total` -> `losses/loss` (the names in `LOSSES`)."""
    return {
        "losses/loss" if k == "loss/total" else "losses/" + k.replace("/", "_"): float(v)
        for k, v in metrics.items()
    }


def markdown_table(names: Mapping[str, str] = STANDARD_METRICS) -> str:
    """The metric names and their meaning as a Markdown table (for the README)."""
    rows = ["| metric | meaning |", "|---|---|"]
    rows += [f"| `{k}` | {v.replace('|', '/')} |" for k, v in names.items()]
    return "\n".join(rows)


# ---------------------------------------------------------------------------- timing spans


class Spans:
    """Named wall-clock timing spans, accumulated per iteration (thread-safe).

    `with spans("name"):` adds the block's wall seconds to `name`; spans may nest (each
    one is measured on its own, so an outer span includes its inner ones) and repeat (they
    add up). `take()` returns the totals since the last `take()` and starts over.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._acc: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self._acc[name] = self._acc.get(name, 0.0) + dt

    def add(self, name: str, seconds: float) -> None:
        """Add a duration measured elsewhere (another process, a callback)."""
        with self._lock:
            self._acc[name] = self._acc.get(name, 0.0) + float(seconds)

    def take(self) -> dict[str, float]:
        """Seconds per span name since the last call; resets them."""
        with self._lock:
            out, self._acc = self._acc, {}
        return out

    def metrics(self) -> dict[str, float]:
        """`take()` as `time/<name>_s` metrics."""
        return {f"time/{k}_s": v for k, v in self.take().items()}


class Throughput:
    """Counts turned into per-second rates over the wall time between two `take()` calls.

    rates = Throughput()
    rates.add("trajectories", len(batch)); rates.add("tokens", n_tokens)
    log.log(it, {**rates.take()})   # {"charts/trajectories_per_s": ..., ...}
    """

    def __init__(self, prefix: str = "charts/", *, clock: Any = time.monotonic) -> None:
        self.prefix = prefix
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: dict[str, float] = {}
        self._since = clock()

    def add(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n

    def take(self) -> dict[str, float]:
        """`<prefix><name>_per_s` for every name added since the last call; starts over."""
        with self._lock:
            now = self._clock()
            dt, self._since = now - self._since, now
            counts, self._counts = self._counts, {}
        return {f"{self.prefix}{k}_per_s": v / dt if dt > 0 else 0.0 for k, v in counts.items()}


# ---------------------------------------------------------------------------- progress line


def _fmt(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "nan"
    return format(v, spec)


class ProgressLine:
    """A one-line summary on stderr, at most every `interval_s` seconds (0: never)."""

    # (metric, label before, label after, format)
    FIELDS: tuple[tuple[str, str, str, str], ...] = (
        ("charts/reward_mean", "reward ", "", ".2f"),
        ("charts/success_rate", "success ", "", ".2f"),
        ("charts/trajectories_per_s", "", " traj/s", ".1f"),
        ("charts/tokens_per_s", "", " tok/s", ".0f"),
        ("charts/staleness_mean", "staleness ", "", ".1f"),
        ("replay/hits", "replay ", "", ".0f"),
    )

    def __init__(
        self,
        interval_s: float,
        stream: TextIO | None = None,
        *,
        clock: Any = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self._stream = stream
        self._clock = clock
        self._last: float | None = None
        self._width = 0

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    @classmethod
    def format(cls, step: int, metrics: Mapping[str, Any]) -> str:
        """`iter 12 | v12 | reward 0.41 | ...`; metrics that are absent are left out."""
        parts = [f"iter {step}"]
        if "charts/policy_version" in metrics:
            parts.append(f"v{_fmt(metrics['charts/policy_version'], '.0f')}")
        for name, before, after, spec in cls.FIELDS:
            if name in metrics:
                parts.append(f"{before}{_fmt(metrics[name], spec)}{after}")
        return " | ".join(parts)

    def update(self, step: int, metrics: Mapping[str, Any], *, force: bool = False) -> bool:
        """Print the line if `interval_s` has passed since the last one; True when printed."""
        if self.interval_s <= 0 and not force:
            return False
        now = self._clock()
        if not force and self._last is not None and now - self._last < self.interval_s:
            return False
        self._last = now
        line = self.format(step, metrics)
        s = self.stream
        if _isatty(s):
            # Rewrite in place; pad so a shorter line hides the end of the longer one.
            s.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            s.write(line + "\n")
        s.flush()
        return True

    def close(self) -> None:
        """End a line that was rewritten in place."""
        if self._width and _isatty(self.stream):
            self.stream.write("\n")
            self.stream.flush()
        self._width = 0


def _isatty(s: TextIO) -> bool:
    try:
        return bool(s.isatty())
    except (AttributeError, ValueError):
        return False


# ---------------------------------------------------------------------------- the logger


@dataclass
class MetricsConfig:
    """Where and how often the learner's metrics are written."""

    tensorboard: bool = option(True, "Write TensorBoard event files to <run_dir>/tb/.")
    jsonl: bool = option(True, "Write one JSON line per iteration to <run_dir>/metrics.jsonl.")
    progress_s: float = option(10.0, "Interval of the progress line on stderr (0: none).")
    flush_s: float = option(
        0.0, "Flush the TensorBoard events at most this often, seconds (0: after every log)."
    )

    def validate(self) -> None:
        check_seconds("progress_s", self.progress_s, zero="0 turns the progress line off")
        check_seconds("flush_s", self.flush_s, zero="0 flushes after every log call")


_RESERVED = ("step", "time", "wall_s")


def _scalar(name: str, v: Any) -> float | int | None:
    """A metric value as a JSON-able number (non-finite floats -> None)."""
    if v is None:
        return None
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        f = float(v)
        return f if math.isfinite(f) else None
    try:  # 0-d tensors and arrays
        f = float(v)
    except (TypeError, ValueError):
        raise ArpoError(
            f"metric {name!r} must be a number, got {type(v).__name__}: {v!r:.80}"
        ) from None
    return f if math.isfinite(f) else None


class MetricsLogger:
    """JSONL + TensorBoard scalars + the progress line, for one run folder (see the module)."""

    def __init__(self, run_dir: str | Path, config: MetricsConfig | None = None) -> None:
        self.config = config or MetricsConfig()
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._start = time.monotonic()
        self._lock = threading.Lock()
        self._file: TextIO | None = None
        if self.config.jsonl:
            self._file = self.path.open("a", encoding="utf-8")
        self._writer: Any = None
        if self.config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # The writer's own thread also flushes every flush_secs.
            self._writer = SummaryWriter(
                str(self.run_dir / "tb"), flush_secs=max(1, round(self.config.flush_s or 120))
            )
        self._last_flush = time.monotonic()
        self.progress = ProgressLine(self.config.progress_s)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Write one iteration's metrics; returns the JSON record written."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise ArpoError(f"step must be an integer, got {step!r}")
        step = int(step)
        record: dict[str, Any] = {
            "step": step,
            "time": time.time(),
            "wall_s": time.monotonic() - self._start,
        }
        for k, v in metrics.items():
            if k in _RESERVED:
                raise ArpoError(f"metric name {k!r} is reserved (step, time, wall_s)")
            record[str(k)] = _scalar(str(k), v)
        with self._lock:
            if self._file is not None:
                self._file.write(json.dumps(record, allow_nan=False) + "\n")
                self._file.flush()
            if self._writer is not None:
                for k, v in metrics.items():
                    if v is not None:
                        self._writer.add_scalar(str(k), float(v), step, walltime=record["time"])
                now = time.monotonic()
                if now - self._last_flush >= self.config.flush_s:
                    self._writer.flush()
                    self._last_flush = now
            self.progress.update(step, record)
        return record

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            self.progress.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (`null` values stay `None`).

    A last line cut short (the writer died mid-line) is skipped; any other line that is not
    a JSON object is an `ArpoError` naming the file and the line.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ArpoError(f"cannot read metrics file {str(p)!r}: {e}") from e
    lines = text.split("\n")
    out: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:  # no newline after it: a partial write
                break
            raise ArpoError(f"{p}: line {i + 1} is not valid JSON: {e}") from None
        if not isinstance(rec, dict):
            raise ArpoError(f"{p}: line {i + 1} is not a JSON object")
        out.append(rec)
    return out


# ---------------------------------------------------------------------------- per-task stats


class _Task:
    __slots__ = ("episodes", "recent", "reward_sum", "successes")

    def __init__(self, window: int) -> None:
        self.episodes = 0
        self.successes = 0
        self.reward_sum = 0.0
        self.recent: collections.deque[tuple[bool, float]] = collections.deque(maxlen=window)


class TaskStats:
    """Per-task success statistics during training (thread-safe; checkpointed as JSON).

    `record(task_id, success, reward)` once per trained episode; `summary()` gives every
    task's totals and its success rate over its last `window` episodes; `metrics()` gives
    that recent rate as `tasks/<task_id>/success_rate`.
    """

    def __init__(self, window: int = 32) -> None:
        if window < 1:
            raise ArpoError(f"TaskStats window must be >= 1, got {window}")
        self.window = window
        self._lock = threading.Lock()
        self._tasks: dict[str, _Task] = {}

    def record(self, task_id: str, success: bool, reward: float) -> None:
        with self._lock:
            t = self._tasks.get(task_id)
            if t is None:
                t = self._tasks[task_id] = _Task(self.window)
            t.episodes += 1
            t.successes += bool(success)
            t.reward_sum += float(reward)
            t.recent.append((bool(success), float(reward)))

    def __len__(self) -> int:
        return len(self._tasks)

    def summary(self) -> dict[str, dict[str, float | int]]:
        """task id -> episodes, successes, success_rate, reward_mean, recent_episodes,
        recent_success_rate, recent_reward_mean."""
        with self._lock:
            out: dict[str, dict[str, float | int]] = {}
            for tid, t in sorted(self._tasks.items()):
                n = len(t.recent)
                out[tid] = {
                    "episodes": t.episodes,
                    "successes": t.successes,
                    "success_rate": t.successes / t.episodes if t.episodes else 0.0,
                    "reward_mean": t.reward_sum / t.episodes if t.episodes else 0.0,
                    "recent_episodes": n,
                    "recent_success_rate": sum(s for s, _ in t.recent) / n if n else 0.0,
                    "recent_reward_mean": sum(r for _, r in t.recent) / n if n else 0.0,
                }
            return out

    def metrics(self) -> dict[str, float]:
        """`tasks/<task_id>/success_rate`: each task's success rate over its last `window`."""
        return {
            f"tasks/{tid}/success_rate": s["recent_success_rate"]
            for tid, s in self.summary().items()
        }

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "window": self.window,
                "tasks": {
                    tid: {
                        "episodes": t.episodes,
                        "successes": t.successes,
                        "reward_sum": t.reward_sum,
                        "recent": [[int(s), r] for s, r in t.recent],
                    }
                    for tid, t in self._tasks.items()
                },
            }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TaskStats:
        try:
            out = cls(int(data["window"]))
            for tid, d in data["tasks"].items():
                t = out._tasks[str(tid)] = _Task(out.window)
                t.episodes = int(d["episodes"])
                t.successes = int(d["successes"])
                t.reward_sum = float(d["reward_sum"])
                t.recent.extend((bool(s), float(r)) for s, r in d["recent"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ArpoError(f"malformed task statistics ({type(e).__name__}: {e})") from None
        return out

    @classmethod
    def from_json(cls, text: str | bytes) -> TaskStats:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ArpoError(f"task statistics are not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ArpoError("task statistics must be a JSON object")
        return cls.from_dict(data)

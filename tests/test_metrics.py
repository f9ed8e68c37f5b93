"""The learner's metrics: real TensorBoard event files read back, JSONL, spans, task stats."""

from __future__ import annotations

import io
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from arpo.config import load_config
from arpo.errors import ArpoError, ConfigError
from arpo.learner.metrics import (
    NAMESPACES,
    STANDARD_METRICS,
    MetricsConfig,
    MetricsLogger,
    ProgressLine,
    Spans,
    TaskStats,
    Throughput,
    loss_metrics,
    markdown_table,
    read_metrics,
)


def test_tensorboard_and_jsonl_hold_every_scalar_at_its_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with MetricsLogger(run, MetricsConfig(progress_s=0)) as log:
        for step in range(3):
            log.log(
                step,
                {
                    "charts/reward_mean": 0.25 * step,
                    "charts/episodes": 8 + step,
                    "losses/policy_loss": -0.5 + step,
                    "tasks/abc-1/success_rate": 1.0 / (step + 1),
                },
            )
        log.log(3, {"losses/kl": float("nan"), "losses/grad_norm": float("inf"), "x": None})

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"charts/reward_mean", "charts/episodes", "losses/policy_loss"} <= tags
    assert "tasks/abc-1/success_rate" in tags
    ev = acc.Scalars("charts/reward_mean")
    assert [e.step for e in ev] == [0, 1, 2]
    assert [e.value for e in ev] == pytest.approx([0.0, 0.25, 0.5])
    assert [e.value for e in acc.Scalars("charts/episodes")] == [8, 9, 10]
    assert [e.value for e in acc.Scalars("tasks/abc-1/success_rate")] == pytest.approx(
        [1.0, 0.5, 1 / 3]
    )
    (kl,) = acc.Scalars("losses/kl")
    assert kl.step == 3 and math.isnan(kl.value)

    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4
    recs = [json.loads(x) for x in lines]  # strict JSON: no NaN / Infinity tokens
    assert "NaN" not in lines[3] and "Infinity" not in lines[3]
    assert recs[3]["losses/kl"] is None and recs[3]["losses/grad_norm"] is None
    assert recs[3]["x"] is None
    assert [r["step"] for r in recs] == [0, 1, 2, 3]
    assert recs[2]["charts/episodes"] == 10 and isinstance(recs[2]["charts/episodes"], int)
    assert all(abs(r["time"] - time.time()) < 60 for r in recs)
    assert recs[0]["wall_s"] <= recs[3]["wall_s"]
    assert read_metrics(run / "metrics.jsonl") == recs


def test_jsonl_is_flushed_each_call_and_a_resumed_run_appends(tmp_path: Path) -> None:
    cfg = MetricsConfig(tensorboard=False, progress_s=0)
    log = MetricsLogger(tmp_path, cfg)
    log.log(0, {"charts/reward_mean": 1})
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["charts/reward_mean"] == 1  # not closed yet
    log.close()
    assert not (tmp_path / "tb").exists()
    with MetricsLogger(tmp_path, cfg) as log2:
        log2.log(1, {"charts/reward_mean": 2})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]


def test_bad_metrics_are_errors_and_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, MetricsConfig(tensorboard=False, progress_s=0)) as log:
        with pytest.raises(ArpoError, match="'charts/x' must be a number"):
            log.log(0, {"charts/x": "high"})
        with pytest.raises(ArpoError, match="reserved"):
            log.log(0, {"step": 1})
        log.log(1, {"a": 1.5})
    p = tmp_path / "metrics.jsonl"
    with p.open("a") as f:
        f.write('{"step": 2, "a"')  # the writer died mid-line
    assert [r["step"] for r in read_metrics(p)] == [1]
    p.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ArpoError, match="line 2"):
        read_metrics(p)
    with pytest.raises(ArpoError, match="cannot read"):
        read_metrics(tmp_path / "absent.jsonl")


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ConfigError, match="progress_s"):
        load_config(MetricsConfig, None, ["progress_s=-1"])
    with pytest.raises(ConfigError, match="flush_s"):
        load_config(MetricsConfig, None, ["flush_s=-2"])


def test_spans_accumulate_nest_and_reset() -> None:
    spans = Spans()
    with spans("step"):
        with spans("forward"):
            time.sleep(0.02)
        with spans("forward"):
            time.sleep(0.02)
        time.sleep(0.01)
    spans.add("remote", 1.5)
    got = spans.take()
    assert set(got) == {"step", "forward", "remote"}
    assert 0.04 <= got["forward"] < got["step"] < 1.0
    assert got["step"] >= 0.05 and got["remote"] == 1.5
    assert spans.take() == {}
    with pytest.raises(RuntimeError), spans("failing"):
        raise RuntimeError("boom")
    m = spans.metrics()
    assert list(m) == ["time/failing_s"] and m["time/failing_s"] >= 0


def test_task_stats_summary_window_and_json_round_trip() -> None:
    ts = TaskStats(window=3)
    for ok in (True, False, False, False):
        ts.record("t1", ok, 1.0 if ok else 0.0)
    ts.record("t2", True, 1.5)
    s = ts.summary()
    assert s["t1"]["episodes"] == 4 and s["t1"]["successes"] == 1
    assert s["t1"]["success_rate"] == 0.25 and s["t1"]["recent_success_rate"] == 0.0
    assert s["t1"]["recent_episodes"] == 3 and s["t1"]["reward_mean"] == 0.25
    assert s["t2"]["success_rate"] == 1.0 and s["t2"]["recent_reward_mean"] == 1.5
    assert ts.metrics() == {"tasks/t1/success_rate": 0.0, "tasks/t2/success_rate": 1.0}

    back = TaskStats.from_json(ts.to_json())
    assert back.window == 3 and back.summary() == s
    back.record("t1", True, 1.0)  # the window keeps sliding after a restore
    assert back.summary()["t1"]["recent_success_rate"] == pytest.approx(1 / 3)
    assert back.summary()["t1"]["episodes"] == 5
    with pytest.raises(ArpoError, match="malformed"):
        TaskStats.from_json('{"window": 3, "tasks": {"t": {"episodes": 1}}}')
    with pytest.raises(ArpoError, match="not valid JSON"):
        TaskStats.from_json("{")


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


METRICS = {
    "charts/policy_version": 12,
    "charts/reward_mean": 0.41,
    "charts/success_rate": 0.375,
    "charts/trajectories_per_s": 3.21,
    "charts/tokens_per_s": 812.4,
    "charts/staleness_mean": 0.6,
    "replay/hits": 2,
}


def test_progress_line_format_and_rate_limit() -> None:
    out, clock = io.StringIO(), FakeClock()
    p = ProgressLine(5.0, out, clock=clock)
    assert p.update(12, METRICS)
    assert out.getvalue() == (
        "iter 12 | v12 | reward 0.41 | success 0.38 | 3.2 traj/s | 812 tok/s | staleness 0.6 "
        "| replay 2\n"
    )
    clock.t += 4.9
    assert not p.update(13, METRICS)  # too soon
    clock.t += 0.2
    assert p.update(14, {"charts/reward_mean": None})
    assert out.getvalue().splitlines()[-1] == "iter 14 | reward nan"
    assert not ProgressLine(0, out).update(1, METRICS)  # 0: off


def test_progress_line_rewrites_in_place_on_a_terminal() -> None:
    out, clock = Tty(), FakeClock()
    p = ProgressLine(1.0, out, clock=clock)
    p.update(1, METRICS)
    clock.t += 2
    p.update(2, {"charts/reward_mean": 0.5})
    p.close()
    text = out.getvalue()
    first = ProgressLine.format(1, METRICS)
    assert text.startswith("\r" + first) and text.endswith("\n") and text.count("\n") == 1
    second = text[len(first) + 1 :]
    assert (
        second.startswith("\riter 2 | reward 0.50") and len(second.rstrip("\n")) == len(first) + 1
    )


def test_logger_prints_the_progress_line_to_stderr(tmp_path: Path, capsys) -> None:
    with MetricsLogger(tmp_path, MetricsConfig(tensorboard=False, progress_s=60)) as log:
        log.log(7, METRICS)
        log.log(8, METRICS)  # within 60 s of the first: not printed
    err = capsys.readouterr().err
    assert err.splitlines() == [ProgressLine.format(7, METRICS)]


def test_loss_metrics_land_in_the_losses_namespace() -> None:
    out = loss_metrics({"loss/total": 0.3, "loss/pg": 0.1, "clip/low_frac": 0.2,
                        "weight/ess": 0.9, "new/x": 1})  # fmt: skip
    assert out == {
        "losses/loss": 0.3,
        "losses/loss_pg": 0.1,
        "losses/clip_low_frac": 0.2,
        "losses/weight_ess": 0.9,
        "losses/new_x": 1.0,
    }
    assert set(out) - {"losses/new_x"} <= set(STANDARD_METRICS)
    assert all(name.startswith(NAMESPACES) for name in STANDARD_METRICS)
    table = markdown_table()
    assert table.count("\n") == len(STANDARD_METRICS) + 1 and "| `charts/reward_mean` |" in table


def test_real_loss_output_is_all_standard_names() -> None:
    import torch

    from arpo.learner.loss import LossConfig, arpo_loss

    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=g)
    mask = torch.ones(3, 5, dtype=torch.bool)
    _, m = arpo_loss(logp, logp.detach() - 0.1, logp.detach(), torch.tensor([1.0, -1.0, 0.5]),
                     mask, torch.tensor([False, False, True]), LossConfig())  # fmt: skip
    names = set(loss_metrics(m)) - {"losses/tokens"}
    assert names and names <= set(STANDARD_METRICS)


def test_throughput_is_counts_over_the_time_between_takes() -> None:
    clock = FakeClock()
    rates = Throughput(clock=clock)
    rates.add("trajectories", 8)
    rates.add("trajectories", 8)
    rates.add("tokens", 4000)
    clock.t += 2.0
    assert rates.take() == {"charts/trajectories_per_s": 8.0, "charts/tokens_per_s": 2000.0}
    clock.t += 1.0
    assert rates.take() == {}


def test_drift_metrics_are_standard_names_and_measure_the_shift() -> None:
    """`behaviour_drift`: every name matches a documented pattern; a replayed trajectory
    whose behaviour log-probs sit 0.5 above the learner's has a per-sequence log-ratio of
    -0.5 per token and weight exp(-0.5) on its low-probability tokens; a fresh on-policy
    one has 0 and 1."""
    import re

    import torch

    from arpo.learner.loss import behaviour_drift

    def pattern(name: str) -> re.Pattern[str]:
        parts = re.split(r"<[^>]+>", name)  # `<kind>` and the like match one name part
        return re.compile("^" + "[a-z_|]+".join(re.escape(p) for p in parts) + "$")

    patterns = [pattern(k) for k in STANDARD_METRICS]
    prox = [torch.tensor([-0.01, -2.0, -3.0]), torch.tensor([-0.02, -1.5, -4.0, -0.05])]
    behav = [prox[0].clone(), prox[1] + 0.5]
    m = behaviour_drift(prox, behav, [False, True], w_max=2.0)
    assert all(any(p.match(k) for p in patterns) for k in m), m
    assert m["losses/seq_logratio_replay_mean"] == pytest.approx(-2.0)
    assert m["losses/seq_logratio_fresh_max"] == pytest.approx(0.0)
    # behaviour probabilities below 0.9: tokens 2 and 3 of the replayed row (-1.0, -3.5)
    assert m["losses/weight_lowp_replay_mean"] == pytest.approx(np.exp(-0.5), rel=1e-6)
    assert m["losses/weight_lowp_fresh_min"] == pytest.approx(1.0)
    assert m["losses/weight_truncated_replay_frac"] == 0.0
    far = behaviour_drift([torch.tensor([-0.1, -5.0])], [torch.tensor([-0.1, -6.0])], [True], 2.0)
    assert far["losses/weight_truncated_replay_frac"] == 0.5  # exp(1) > 2
    assert np.isnan(far["losses/seq_logratio_fresh_mean"])

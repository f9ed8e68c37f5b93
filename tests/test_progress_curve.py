"""A first run explains itself: phases show progress with the time left (a bar on a terminal,
plain lines otherwise), the final table says in words whether training helped, and the curve
holds the smoothed training success and both evaluations."""

from __future__ import annotations

import io
import time
from pathlib import Path

from arpo.progress import Progress
from arpo.train import comparison, plot_curves, verdict


def test_plain_progress_lines_give_the_time_left_and_the_end() -> None:
    out = io.StringIO()
    p = Progress("evaluation", 4, unit="episode", every_s=1e-9, stream=out)
    p.update_to(1)
    time.sleep(0.01)
    p.update_to(2, "reward 0.40")
    p.update_to(4)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("evaluation: 1/4 episodes (25 %)")
    assert "left" in lines[1] and lines[1].endswith("| reward 0.40")
    assert lines[-1].startswith("evaluation: 4/4 episodes (100 %)") and "left" not in lines[-1]


def test_a_terminal_gets_a_bar(tmp_path: Path) -> None:
    out = io.StringIO()
    with Progress("training", 10, unit="iteration", stream=out, bar=True) as p:
        p.update_to(5, "success 0.40")
    text = out.getvalue()
    assert "training" in text and "5/10" in text and "success 0.40" in text


def test_the_verdict_says_whether_the_interval_excludes_0() -> None:
    assert verdict({"points": 28.9, "se_points": 6.0}).startswith("Training helped: +28.9")
    assert verdict({"points": 5.0, "se_points": 6.0}).startswith("No measurable effect")
    assert verdict({"points": -20.0, "se_points": 5.0}).startswith("Training made the policy worse")
    table = comparison(
        {
            "eval_warm_start": {"success_rate": 0.375, "se": 0.043, "episodes": 128},
            "eval_trained": {"success_rate": 0.664, "se": 0.042, "episodes": 128},
            "eval_gain": {"points": 28.9, "se_points": 6.0},
        }
    )
    assert "Training helped: +28.9 points, 95 % CI +17.1 to +40.7" in table


def test_the_curve_is_written(tmp_path: Path) -> None:
    rows = [{"step": i, "charts/success_rate": (i % 3) / 3, "charts/reward_mean": i / 10}
            for i in range(1, 31)]  # fmt: skip
    path = plot_curves(
        rows,
        tmp_path / "curve.png",
        warm_start={"success_rate": 0.3, "se": 0.04},
        trained={"success_rate": 0.6, "se": 0.04},
        rollout_temperature=1.0,
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000

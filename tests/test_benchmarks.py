"""The benchmarks still run and still check correctness before timing (quick modes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("script", "args", "expect"),
    [
        ("bench_wire.py", ["--quick"], "decode is"),
        ("bench_store.py", ["--quick", "--stores", "arpo,dict-ref"], "| sampled traj/s (1w+1r) |"),
        ("bench_learner.py", ["--quick"], "| micro-batch | traj/iter |"),
    ],
)
def test_benchmark_quick_mode_runs(script: str, args: list[str], expect: str) -> None:
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert expect in p.stdout

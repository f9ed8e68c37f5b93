"""The demo of the data path: real ZeroMQ socket, wire codec, Rust store, groups, replay."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from arpo.config import load_config
from arpo.demo import DemoConfig, run


def test_demo_moves_every_trajectory_and_replays(tmp_path: Path) -> None:
    cfg = load_config(
        DemoConfig,
        None,
        [
            f"out={str(tmp_path)!r}",
            "iterations=5",
            "group_size=4",
            "success=[0.0, 0.5]",
            "turns=2",
            "tasks=2",
        ],
    )
    out = run(cfg)
    assert out["trajectories"] == 5 * 2 * 4 and out["rejected"] == 0
    assert out["snapshot_ok"] is True and (tmp_path / "store.snapshot").exists()
    groups = out["groups"]
    assert len(groups) == 10
    for g in groups:
        fresh = np.asarray(g["fresh"])
        replayed = len(g["rewards"]) != len(fresh) or g["rewards"] != g["fresh"]
        # The reference rule: a group with no success gets one when the buffer has one.
        assert replayed == (fresh.max() == 0 and g["buffered"] > 0), g
        if replayed:
            assert max(g["rewards"]) == 1.0 and np.asarray(g["adv"]).std() > 0
    # The task that never succeeds never gets a replay: its buffer stays empty.
    assert all(g["buffered"] == 0 for g in groups if g["task"] == "task-0")


def test_demo_cli_rejects_a_bad_field() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "arpo.cli", "demo", "group_sise=4"], capture_output=True, text=True
    )
    assert p.returncode == 2 and "group_sise" in p.stderr and "group_size" in p.stderr


@pytest.mark.parametrize("override", ["endpoint='tcp://0.0.0.0'", "success=[1.5]"])
def test_demo_config_validation(override: str) -> None:
    from arpo.errors import ConfigError

    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config(DemoConfig, None, [override])

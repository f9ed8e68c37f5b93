"""The replay pre-fill (`assemble.replay.prefill`) given a folder that is not what it should
be: a damaged collection loses only the damaged records, an empty one fills nothing, and
anything that is not a collection is a ConfigError naming the field, before training starts.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from conftest import make_trajectory

from arpo import store_item, wire
from arpo.buffer import ReplayStore
from arpo.errors import ConfigError
from arpo.learner.groups import ReplayConfig
from arpo.learner.learner import prefill_replay
from arpo.service.journal import TRAJECTORIES, Journal, read_segment, segment_path

TASKS = [f"task-{i}" for i in range(4)]


def _collection(root: Path, png_pool: list[bytes], n: int = 12) -> list[str]:
    """An `arpo collect`-style folder of `n` successes, 3 per task; their ids."""
    rng = np.random.default_rng(1)
    j = Journal(root / TRAJECTORIES)
    ids = []
    for i in range(n):
        t = make_trajectory(rng, turns=1, tokens=200, pngs=png_pool, task_id=TASKS[i % 4])
        j.append(wire.encode(t))
        ids.append(t.trajectory_id)
    j.close()
    return ids


def _prefill(path: Path | str, tasks: set[str] | None = None) -> tuple[int, ReplayStore]:
    store = ReplayStore(max_bytes=1 << 28, fresh_capacity=64, replay_capacity=8, seed=0)
    return prefill_replay(store, str(path), tasks or set(TASKS), ReplayConfig(capacity=8)), store


def test_a_damaged_record_costs_that_record_only(tmp_path: Path, png_pool) -> None:
    ids = _collection(tmp_path / "c", png_pool)
    seg = segment_path(tmp_path / "c" / TRAJECTORIES, 0)
    offsets = [r.offset for r in read_segment(seg)]
    data = bytearray(seg.read_bytes())
    data[offsets[5] + 40] ^= 0xFF  # inside record 5's first frame
    data[offsets[9] + 2] ^= 0x10  # record 9's magic
    seg.write_bytes(bytes(data))
    n, store = _prefill(tmp_path / "c")
    try:
        assert n == len(ids) - 2
        got = {
            store_item.from_item(i).trajectory_id
            for t in TASKS
            for i in store.sample(t, 8, mode="newest")
        }
        assert got == set(ids) - {ids[5], ids[9]}
    finally:
        store.close()


def test_a_truncated_collection_keeps_what_is_whole(tmp_path: Path, png_pool) -> None:
    ids = _collection(tmp_path / "c", png_pool)
    seg = segment_path(tmp_path / "c" / TRAJECTORIES, 0)
    offsets = [r.offset for r in read_segment(seg)]
    os.truncate(seg, offsets[7] + 100)  # record 7 torn, 8..11 gone
    n, store = _prefill(tmp_path / "c")
    try:
        assert n == 7
        got = {
            store_item.from_item(i).trajectory_id
            for t in TASKS
            for i in store.sample(t, 8, mode="newest")
        }
        assert got == set(ids[:7])
    finally:
        store.close()


def test_an_empty_collection_and_other_tasks_fill_nothing(tmp_path: Path, png_pool) -> None:
    (tmp_path / "empty" / TRAJECTORIES).mkdir(parents=True)
    n, store = _prefill(tmp_path / "empty")
    store.close()
    assert n == 0
    _collection(tmp_path / "c", png_pool)
    n, store = _prefill(tmp_path / "c", {"another-task"})
    try:
        assert n == 0 and store.tasks() == []
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["missing", "file", "foreign", "trajectories_is_a_file"])
def test_a_folder_that_is_not_a_collection_is_a_config_error(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "x"
    if kind == "file":
        path.write_bytes(os.urandom(1000))
    elif kind == "foreign":  # some other program's folder
        path.mkdir()
        (path / "notes.txt").write_text("not trajectories")
        (path / "00000000.seg").write_bytes(os.urandom(4096))
    elif kind == "trajectories_is_a_file":
        path.mkdir()
        (path / TRAJECTORIES).write_bytes(os.urandom(1000))
    with pytest.raises(ConfigError, match=r"assemble\.replay\.prefill"):
        _prefill(path)

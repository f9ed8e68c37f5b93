"""Every format `arpo train`'s accounting ("0 unaccounted") reads, written by its writer and read
by the reader its module keeps beside it: the spool (`Spool.put`, `set_aside`; `read_spool`),
the learner's `trained.log` (`trained_log_lines`; `read_trained_log`), the ingest journal
(`Journal.append`; `journal_trajectory_ids`) and a checkpoint's store snapshot
(`save_checkpoint`; `Checkpoint.stored_trajectory_ids`). Then `account` on a run folder that
holds one trajectory in each place and one in none: the count names exactly that one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from conftest import make_trajectory
from transformers import Qwen2_5_VLForConditionalGeneration

from arpo import store_item, wire
from arpo.actor.spool import Spool, read_spool
from arpo.buffer import ReplayStore
from arpo.learner.checkpoint import load_checkpoint, save_checkpoint
from arpo.learner.learner import TRAINED_LOG, read_trained_log, trained_log_lines
from arpo.policy.tiny import build_tiny_model
from arpo.record import Status, Trajectory
from arpo.service.ingest import Ingest, IngestConfig
from arpo.service.journal import Journal, journal_trajectory_ids, list_segments
from arpo.train import account
from arpo.transport import TransportConfig


def _traj(tid: str, png_pool: list[bytes], status: Status = Status.OK) -> Trajectory:
    t = make_trajectory(np.random.default_rng(len(tid)), turns=2, tokens=60, pngs=png_pool)
    if status is not Status.OK:
        t = dataclasses.replace(t, checker_score=0.0, reward=0.0, error="env went away")
    return dataclasses.replace(t, trajectory_id=tid, status=status)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(path)


def _checkpoint(root: Path, model, stored: list[Trajectory], journal: Path | None = None) -> Path:
    """A checkpoint whose store holds `stored`; with `journal`, saved as the learner saves it,
    with its ingest (the journal rotated: the checkpoint names its first segment after it)."""
    store = ReplayStore(max_bytes=1 << 26, fresh_capacity=16, seed=0)
    for t in stored:
        store.put(t.task_id, store_item.to_item(t))
    ingest = None
    if journal is not None:
        cfg = IngestConfig(journal_dir=str(journal))
        ingest = Ingest(store, cfg, TransportConfig(data="tcp://127.0.0.1:0"))
    try:
        return save_checkpoint(
            root, 3, model=model, optimizer_state={}, state={}, store=store, ingest=ingest
        )
    finally:
        if ingest is not None:
            ingest.stop()
        store.close()


def test_the_spool_reader_reads_what_the_spool_wrote(tmp_path: Path, png_pool) -> None:
    spool = Spool(tmp_path / "actor-0")
    for tid in ("acked", "pending", "refused"):
        spool.put(_traj(tid, png_pool))
    spool.put(_traj("failed", png_pool, Status.ENV_ERROR))
    assert spool.remove("acked") and spool.remove("failed")
    assert spool.set_aside("refused", "too long")
    got = read_spool(tmp_path / "actor-0")
    task = _traj("x", png_pool).task_id
    assert got.finished == {
        "acked": ("ok", task),
        "pending": ("ok", task),
        "refused": ("ok", task),
        "failed": ("env_error", task),
    }
    assert got.pending == {"pending"} and got.refused == {"refused"}
    assert read_spool(tmp_path / "no-such-spool").finished == {}


def test_the_trained_log_reader_reads_what_the_learner_writes(tmp_path: Path) -> None:
    path = tmp_path / TRAINED_LOG
    path.write_text(
        trained_log_lines(1, [("a", False), ("b", True)], [("c", "stale")])
        + trained_log_lines(2, [("d", False)], [])
        + "3\tcut-by-a-cra"  # a torn last line
    )
    assert read_trained_log(path) == [
        (1, "a", "fresh"),
        (1, "b", "replay"),
        (1, "c", "dropped_stale"),
        (2, "d", "fresh"),
    ]
    assert read_trained_log(tmp_path / "missing.log") == []


def test_the_journal_reader_reads_what_the_journal_wrote(tmp_path: Path, png_pool) -> None:
    journal = Journal(tmp_path)
    journal.append(wire.encode(_traj("first", png_pool)))
    journal.close()
    journal = Journal(tmp_path)  # a new segment, as after a checkpoint's rotation
    journal.append(wire.encode(_traj("second", png_pool)))
    journal.append(wire.encode(_traj("third", png_pool)))
    journal.close()
    segments = list_segments(tmp_path)
    assert len(segments) == 2
    n = segments[1]
    assert journal_trajectory_ids(tmp_path, 0) == {"first", "second", "third"}
    assert journal_trajectory_ids(tmp_path, n) == {"second", "third"}
    assert journal_trajectory_ids(tmp_path / "none", 0) == set()


def test_the_store_reader_reads_what_the_checkpoint_saved(
    tmp_path: Path, png_pool, tiny_model
) -> None:
    stored = [_traj(f"kept-{i}", png_pool) for i in range(3)]
    path = _checkpoint(tmp_path / "ckpt", tiny_model, stored)
    assert load_checkpoint(path, verify=False).stored_trajectory_ids() == {
        "kept-0",
        "kept-1",
        "kept-2",
    }


def test_account_finds_every_trajectory_where_its_writer_put_it(
    tmp_path: Path, png_pool, tiny_model
) -> None:
    run = tmp_path / "run"
    spool = Spool(run / "spool" / "actor-0")
    names = ["trained", "dropped", "stored", "journaled", "pending", "refused", "lost"]
    for tid in names:
        spool.put(_traj(tid, png_pool))
    for tid in ("trained", "dropped", "stored", "journaled", "lost"):
        spool.remove(tid)  # acknowledged by the learner
    spool.set_aside("refused", "invalid")
    (run / "learner").mkdir()
    (run / "learner" / TRAINED_LOG).write_text(
        trained_log_lines(1, [("trained", False)], [("dropped", "stale")])
        + trained_log_lines(2, [("trained", False)], [])
    )
    journal = run / "learner" / "journal"
    ckpt = _checkpoint(
        run / "learner" / "checkpoints", tiny_model, [_traj("stored", png_pool)], journal
    )
    assert load_checkpoint(ckpt, verify=False).journal_segment is not None
    after = Journal(journal)  # what the ingest journals after the checkpoint
    after.append(wire.encode(_traj("journaled", png_pool)))
    after.close()

    out = account(run, ckpt)
    assert out["finished"] == len(names) and out["finished_by_status"] == {"ok": len(names)}
    assert out["trained"] == 1 and out["trained_twice"] == 1
    assert out["dropped_by_reason"] == {"stale": 1}
    assert (out["in_store"], out["in_spool"], out["refused"]) == (1, 1, 1)
    assert out["in_journal"] == 1
    assert out["unaccounted"] == 1 and out["unaccounted_ids"] == ["lost"]


def test_a_run_stopped_before_its_first_checkpoint_has_its_acknowledged_trajectories_in_the_journal(
    tmp_path: Path, png_pool
) -> None:
    """No checkpoint yet: a resumed learner replays the whole journal, so what the learner
    acknowledged and journaled is accounted for, where it counted as unaccounted before
    (a Calc run stopped in its second iteration: 22 of 30)."""
    run = tmp_path / "run"
    spool = Spool(run / "spool" / "actor-0")
    for tid in ("trained", "journaled", "pending", "lost"):
        spool.put(_traj(tid, png_pool))
    for tid in ("trained", "journaled", "lost"):
        spool.remove(tid)
    (run / "learner").mkdir()
    (run / "learner" / TRAINED_LOG).write_text(trained_log_lines(1, [("trained", False)], []))
    journal = Journal(run / "learner" / "journal")
    for tid in ("trained", "journaled"):
        journal.append(wire.encode(_traj(tid, png_pool)))
    journal.close()
    out = account(run, None)
    assert (out["trained"], out["in_journal"], out["in_spool"]) == (1, 2, 1)
    assert out["unaccounted_ids"] == ["lost"]

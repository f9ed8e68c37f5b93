"""The actor's spool: durable files, exact frames back, damaged files set aside, a size limit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from conftest import make_trajectory

from arpo import wire
from arpo.actor.spool import Spool, read_frames
from arpo.record import Trajectory


def _traj(i: int, png_pool: list[bytes]) -> Trajectory:
    return make_trajectory(np.random.default_rng(i), turns=3, tokens=600, pngs=png_pool)


def test_put_frames_remove_roundtrip(tmp_path: Path, png_pool: list[bytes]) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 30)
    trajs = [_traj(i, png_pool) for i in range(5)]
    for t in trajs:
        spool.put(t)
    assert spool.ids() == [t.trajectory_id for t in trajs]  # oldest first
    assert not list(tmp_path.glob("*.tmp"))
    for t in trajs:
        assert spool.load(t.trajectory_id) == t
        frames = spool.frames(t.trajectory_id)
        assert [bytes(f) for f in frames] == [bytes(f) for f in wire.encode(t)]
    assert spool.remove(trajs[0].trajectory_id) and not spool.remove(trajs[0].trajectory_id)
    assert not (tmp_path / f"{trajs[0].trajectory_id}.traj").exists()
    # A new spool over the same folder (the actor restarted) finds the rest, in order.
    again = Spool(tmp_path, max_bytes=1 << 30)
    assert again.ids() == [t.trajectory_id for t in trajs[1:]]
    assert again.bytes_used == sum((tmp_path / f"{i}.traj").stat().st_size for i in again.ids())


def test_crash_leftovers_and_damage_are_never_sent(tmp_path: Path, png_pool: list[bytes]) -> None:
    spool = Spool(tmp_path)
    good, bad = _traj(1, png_pool), _traj(2, png_pool)
    spool.put(good)
    spool.put(bad)
    leftover = tmp_path / f"{'c' * 32}.traj.tmp"  # a crash while the spool wrote it
    leftover.write_bytes(b"ARPOSPL1\x03")
    (tmp_path / "someone-else.tmp").write_bytes(b"not the spool's")
    path = tmp_path / f"{bad.trajectory_id}.traj"
    path.write_bytes(path.read_bytes()[:-100])  # truncated on disk
    spool = Spool(tmp_path)
    assert not leftover.exists()
    assert (tmp_path / "someone-else.tmp").read_bytes() == b"not the spool's"  # not its own
    assert spool.frames(bad.trajectory_id) is None
    assert (tmp_path / "bad" / path.name).exists()
    assert spool.ids() == [good.trajectory_id]
    assert len(read_frames(tmp_path / f"{good.trajectory_id}.traj")) == 5 + 3


def test_full_at_the_size_limit(tmp_path: Path, png_pool: list[bytes]) -> None:
    t = _traj(3, png_pool)
    size = Spool(tmp_path / "probe").put(t)
    spool = Spool(tmp_path / "s", max_bytes=2 * size)
    spool.put(_traj(4, png_pool))
    assert not spool.full
    spool.put(_traj(5, png_pool))
    assert spool.full and len(spool) == 2  # nothing is dropped: the actor stops starting episodes
    spool.remove(spool.ids()[0])
    assert not spool.full


def test_a_renamed_file_is_moved_aside_not_resent_forever(
    tmp_path: Path, png_pool: list[bytes]
) -> None:
    """The learner acknowledges the id inside the file: a file renamed to another id was
    sent again and again; now it is moved to bad/ with the reason and never sent."""
    spool = Spool(tmp_path)
    traj = _traj(7, png_pool)
    spool.put(traj)
    (tmp_path / f"{traj.trajectory_id}.traj").rename(tmp_path / "someone-else.traj")
    again = Spool(tmp_path)
    assert "someone-else" in again.ids()
    assert again.frames("someone-else") is None
    assert (tmp_path / "bad" / "someone-else.traj").exists()
    assert "someone-else" not in again.ids()


def test_a_kill_between_the_file_and_its_ledger_line_loses_no_ledger_entry(
    tmp_path: Path, png_pool: list[bytes]
) -> None:
    """`put` writes the file, then the ledger line: a trajectory killed in between is
    sent on restart, so the ledger must name it or a run's accounting never sees it."""
    from arpo.actor.spool import LEDGER, read_ledger, read_spool, write_frames

    spool = Spool(tmp_path)
    first, second, third = (_traj(i, png_pool) for i in (4, 5, 6))
    spool.put(first)
    write_frames(tmp_path / f"{second.trajectory_id}.traj", wire.encode(second))  # no line
    write_frames(tmp_path / f"{third.trajectory_id}.traj", wire.encode(third))
    with open(tmp_path / LEDGER, "a") as f:  # its line torn by the kill
        f.write(f"{third.trajectory_id}\tok\tta")
    # Read without opening (the run's report): every file is named, with its status.
    seen = read_spool(tmp_path).finished
    assert seen[second.trajectory_id] == (second.status.value, second.task_id)
    assert seen[third.trajectory_id] == (third.status.value, third.task_id)
    # Opened again (the actor restarted): the ledger itself is mended, and a later put's
    # line does not run on from the torn one.
    again = Spool(tmp_path)
    fourth = _traj(7, png_pool)
    again.put(fourth)
    ledger = read_ledger(tmp_path)
    assert set(ledger) == {t.trajectory_id for t in (first, second, third, fourth)}
    assert ledger[third.trajectory_id] == (third.status.value, third.task_id)
    assert (tmp_path / LEDGER).read_text().count("\n") == 4

"""One flipped bit or a zeroed page in the journal loses only the records it touches, and a
path named like a segment that is not a regular file is skipped without being opened.

Before: a flipped bit in a record's length, frame count or magic stopped the reader (2 of 40
records read, 38 acknowledged trajectories lost), a zeroed 4 KiB page lost 30 of 40, a
directory named like a segment raised IsADirectoryError and a FIFO blocked the reader forever.
"""

from __future__ import annotations

import collections
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import make_trajectory

from arpo import wire
from arpo.service.journal import Journal, read_collection, read_segment, segment_path

N = 40


@pytest.fixture
def segment(tmp_path: Path, png_pool: list[bytes]) -> tuple[Path, list, list[int]]:
    rng = np.random.default_rng(0)
    trajs = [make_trajectory(rng, turns=1, tokens=300, png_bytes=2000, pngs=png_pool)
             for _ in range(N)]  # fmt: skip
    j = Journal(tmp_path / "j")
    for t in trajs:
        j.append(wire.encode(t))
    j.close()
    path = segment_path(tmp_path / "j", 0)
    offsets = [r.offset for r in read_segment(path)]
    assert len(offsets) == N
    return path, trajs, offsets


def _ids(path: Path, counts: collections.Counter) -> list[str]:
    return [wire.decode(r.frames).trajectory_id for r in read_segment(path, counts)]


@pytest.mark.parametrize(
    ("where", "what"),
    [(0, "magic"), (4, "frame count"), (8, "payload length"), (16, "first frame length")],
)
def test_a_flipped_bit_in_a_record_header_loses_that_record_only(segment, where, what) -> None:
    path, trajs, offsets = segment
    data = bytearray(path.read_bytes())
    data[offsets[3] + where] ^= 0x04
    path.write_bytes(bytes(data))
    counts: collections.Counter = collections.Counter()
    got = _ids(path, counts)
    want = [t.trajectory_id for i, t in enumerate(trajs) if i != 3]
    assert got == want, (what, len(got))
    assert counts["corrupt"] == 1 and counts["resynced"] == 1
    assert counts["skipped_bytes"] == offsets[4] - offsets[3]


def test_a_zeroed_page_loses_only_the_records_it_touches(segment) -> None:
    path, trajs, offsets = segment
    data = bytearray(path.read_bytes())
    lo = offsets[10] + 100
    data[lo : lo + 4096] = bytes(4096)
    path.write_bytes(bytes(data))
    ends = [*offsets[1:], len(data)]
    touched = {i for i, (a, b) in enumerate(zip(offsets, ends, strict=True))
               if a < lo + 4096 and b > lo}  # fmt: skip
    got = _ids(path, collections.Counter())
    assert got == [t.trajectory_id for i, t in enumerate(trajs) if i not in touched]
    assert len(got) >= N - len(touched) and len(touched) <= 4


def test_paths_named_like_segments_that_are_not_files_are_skipped(segment) -> None:
    path, trajs, _ = segment
    folder = path.parent
    (folder / "journal-00000001.log").mkdir()
    os.mkfifo(folder / "journal-00000002.log")
    got: list = []
    counts: collections.Counter = collections.Counter()

    def read() -> None:
        got.extend(read_collection(folder, counts))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the reader blocked on the FIFO"
    assert [x.trajectory_id for x in got] == [x.trajectory_id for x in trajs]
    assert counts["not_a_file"] == 2

"""The replay store refuses what it cannot hold honestly: a snapshot path that is a FIFO (the
restore would block forever) and items whose offsets point outside their own tokens."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from arpo.buffer import Item, ReplayStore
from arpo.errors import BufferValueError, SnapshotError


def test_restore_refuses_a_fifo_instead_of_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "store.snap"
    os.mkfifo(fifo)
    errors: list[BaseException] = []

    def restore() -> None:
        try:
            ReplayStore.restore(fifo)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=restore, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "restore blocked on a FIFO"
    assert len(errors) == 1 and isinstance(errors[0], SnapshotError), errors
    assert "not a regular file" in str(errors[0])


@pytest.mark.parametrize("offsets", [[-1, 2], [3, 99], [0, 11]])
def test_offsets_outside_the_tokens_are_refused_naming_the_field(offsets) -> None:
    tokens = np.arange(10, dtype=np.int32)
    with pytest.raises(BufferValueError, match=r"offsets\[\d\] = -?\d+ is outside \[0, 10\]"):
        Item(tokens, np.zeros(2, np.float32), np.asarray(offsets, np.int32),
             np.zeros(3, np.float32), 0)  # fmt: skip
    ok = Item(tokens, np.zeros(2, np.float32), np.asarray([4, 6], np.int32),
              np.zeros(3, np.float32), 0)  # fmt: skip
    assert list(ok.offsets) == [4, 6]

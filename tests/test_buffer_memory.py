"""The replay store's memory stays flat over a long insert / take / evict loop."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from arpo.buffer import Item, ReplayStore

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident set size from /proc/self/statm (second field, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


@pytest.mark.timeout(120)
def test_rss_does_not_grow_across_insert_take_evict_loop() -> None:
    blob_len = 100_000
    store = ReplayStore(max_bytes=8 << 20, fresh_capacity=64, replay_capacity=8, seed=0)
    tokens = np.arange(2048, dtype=np.int32)
    logprobs = np.zeros(2048, dtype=np.float32)

    def step(i: int) -> None:
        task = f"task-{i % 16}"
        blob = bytes([i % 256]) * blob_len  # a fresh, fully written object every time
        item = Item(tokens, logprobs, [0], [1.0], i, blobs=(blob,))
        store.put(task, item)
        if i % 4 == 0:
            store.add_success(task, item)
        if i % 7 == 0 and store.fresh_len(task) >= 2:
            store.take_group(task, 2, timeout=0)
        if i % 4 == 0:  # the task that just got a success
            store.sample(task, 2)
        if i % 1000 == 999:
            store.drop_older_than(i - 50)

    for i in range(1_500):  # warm up: the budget is full, allocator pools exist
        step(i)
    gc.collect()
    before = rss_bytes()
    for i in range(1_500, 21_500):  # about 2 GB of blobs flow through an 8 MB budget
        step(i)
    gc.collect()
    after = rss_bytes()
    assert store.bytes_used <= 8 << 20
    stats = store.stats()["total"]
    assert stats["evictions"] > 15_000
    growth = after - before
    assert growth < 24 << 20, f"RSS grew by {growth / 2**20:.1f} MiB"
    store.close()

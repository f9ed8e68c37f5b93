"""The replay store with many tasks: put one item into each of N new tasks, snapshot, restore.

    python benchmarks/bench_store_tasks.py                 # N = 5,000, 20,000, 40,000

Adding a task replaces the store's task map copy-on-write; with a persistent map that costs
O(log n) per new task, so both columns grow linearly with N (a copied hash map made them grow
with N squared: 27 s for 40,000 tasks). Prints one line per N; run it alone.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np

from arpo.buffer import Item, ReplayStore


def main() -> int:
    sizes = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "5000,20000,40000").split(",")]
    for n in sizes:
        store = ReplayStore(max_bytes=1 << 32, fresh_capacity=8, seed=0)

        def item() -> Item:
            return Item(np.arange(8, dtype=np.int32), np.zeros(2, np.float32),
                        np.asarray([4, 4], np.int32), np.zeros(3, np.float32), 0)  # fmt: skip

        t0 = time.perf_counter()
        for i in range(n):
            store.put(f"task-{i}", item())
        put_s = time.perf_counter() - t0
        path = os.path.join(tempfile.mkdtemp(prefix="bench-tasks-"), "store.snap")
        store.snapshot(path)
        t0 = time.perf_counter()
        back = ReplayStore.restore(path)
        restore_s = time.perf_counter() - t0
        assert len(back.tasks()) == n
        print(f"{n} tasks: put {put_s:.2f} s, restore {restore_s:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

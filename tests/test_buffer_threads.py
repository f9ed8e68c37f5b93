"""Threads on the replay store: exactly-once delivery, no deadlock, consistent snapshots.

A pytest timeout here means a deadlock (or a lost wake-up) in the store.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
import pytest

from arpo.buffer import BufferValueError, Item, ReplayStore

WRITERS = 4
PER_WRITER = 5_000
TASKS = [f"task-{i}" for i in range(4)]
GROUP = 4


def make_item(version: int, n: int = 32, blob_len: int = 256) -> Item:
    return Item(
        np.arange(n, dtype=np.int32),
        np.zeros(n, dtype=np.float32),
        np.array([0], dtype=np.int32),
        np.array([float(version % 2)], dtype=np.float32),
        version,
        blobs=(b"\x89PNG" + bytes(blob_len),),
    )


@pytest.mark.timeout(60)
def test_writers_takers_samplers_every_item_taken_exactly_once() -> None:
    store = ReplayStore(max_bytes=1 << 30, fresh_capacity=1 << 20, replay_capacity=16, seed=0)
    put_keys: list[list[int]] = [[] for _ in range(WRITERS)]
    taken: list[list[int]] = [[] for _ in TASKS]
    failures: list[BaseException] = []
    done = threading.Event()

    def guarded(fn):
        def run(*args) -> None:
            try:
                fn(*args)
            except BaseException as e:  # surfaced by the main thread
                failures.append(e)
                done.set()

        return run

    @guarded
    def writer(w: int) -> None:
        for i in range(PER_WRITER):
            task = TASKS[i % len(TASKS)]
            item = make_item(i)
            put_keys[w].append(item.key)
            store.put(task, item)
            if i % 10 == 0:
                store.add_success(task, item, priority=1.0 + i % 3)

    groups_left = [WRITERS * PER_WRITER // len(TASKS) // GROUP for _ in TASKS]
    claim_lock = threading.Lock()
    taken_lock = threading.Lock()

    @guarded
    def taker(t: int) -> None:
        # Two takers per task; each claims a group before waiting for it, so none waits
        # for a group that will never come.
        while not done.is_set():
            with claim_lock:
                if groups_left[t] == 0:
                    return
                groups_left[t] -= 1
            group = store.take_group(TASKS[t], GROUP, timeout=20)
            assert len(group) == GROUP
            with taken_lock:
                taken[t].extend(it.key for it in group)

    @guarded
    def sampler(mode: str) -> None:
        n = 0
        while not done.is_set():
            for task in TASKS:
                if task not in store.tasks():
                    continue
                try:
                    items = store.sample(task, 4, mode=mode, min_version=5)
                except BufferValueError:
                    continue  # no eligible success yet
                assert all(it.version >= 5 for it in items)
                n += 1
        assert n > 0

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(WRITERS)]
    threads += [threading.Thread(target=taker, args=(t % len(TASKS),)) for t in range(8)]
    samplers = [threading.Thread(target=sampler, args=(m,)) for m in ("uniform", "priority")]
    for th in threads + samplers:
        th.start()
    for th in threads:
        th.join()
    done.set()
    for th in samplers:
        th.join()
    if failures:
        raise failures[0]

    all_put = [k for keys in put_keys for k in keys]
    all_taken = [k for keys in taken for k in keys]
    assert len(all_taken) == len(all_put) == WRITERS * PER_WRITER
    assert not [k for k, c in Counter(all_taken).items() if c > 1], "an item was taken twice"
    assert set(all_taken) == set(all_put), "an item was lost"
    # Only the replay residencies remain, counted exactly.
    stats = store.stats()["total"]
    assert stats["fresh"] == 0
    assert store.bytes_used == stats["bytes"] == stats["replay"] * make_item(0).nbytes
    store.close()


@pytest.mark.timeout(60)
def test_snapshot_during_concurrent_inserts_restores_consistent_views(tmp_path) -> None:
    store = ReplayStore(max_bytes=1 << 30, fresh_capacity=1 << 20, replay_capacity=8, seed=0)
    keys: dict[str, list[int]] = {task: [] for task in TASKS}
    stop = threading.Event()

    def writer(task: str) -> None:
        i = 0
        while not stop.is_set():
            item = make_item(i, blob_len=2048)
            keys[task].append(item.key)  # appended before put: a prefix is always known
            store.put(task, item)
            if i % 5 == 0:
                store.add_success(task, item)
            i += 1

    threads = [threading.Thread(target=writer, args=(task,)) for task in TASKS]
    for th in threads:
        th.start()
    try:
        time.sleep(0.05)
        for round_ in range(3):
            path = tmp_path / f"store-{round_}.snap"
            store.snapshot(path)
            restored = ReplayStore.restore(path)
            for task in restored.tasks():
                n = restored.fresh_len(task)
                got = [it.key for it in restored.take_group(task, n, timeout=0)] if n else []
                # Each task's view is one instant of its queue: a prefix of its puts.
                assert got == keys[task][:n]
            restored.close()
    finally:
        stop.set()
        for th in threads:
            th.join()

    # Quiescent: a snapshot restores an identical store.
    path = tmp_path / "final.snap"
    store.snapshot(path)
    restored = ReplayStore.restore(path)
    assert restored.tasks() == store.tasks()
    assert restored.bytes_used == store.bytes_used
    assert restored.stats() == store.stats()
    for task in TASKS:
        live = store.sample(task, 8, mode="newest")
        back = restored.sample(task, 8, mode="newest")
        assert [a.key for a in live] == [b.key for b in back]
        for a, b in zip(live, back, strict=True):
            assert np.array_equal(a.tokens, b.tokens) and a.blobs == b.blobs
            assert a.version == b.version
        n = store.fresh_len(task)
        live_fresh = store.take_group(task, n, timeout=0)
        back_fresh = restored.take_group(task, n, timeout=0)
        assert [a.key for a in live_fresh] == [b.key for b in back_fresh]
    store.close()
    restored.close()


@pytest.mark.timeout(60)
def test_blocked_takers_release_the_gil_and_each_group_goes_to_one_taker() -> None:
    store = ReplayStore(seed=0)
    results: list[list[int]] = []
    lock = threading.Lock()

    def taker() -> None:
        group = store.take_group("t", 2, timeout=30)
        with lock:
            results.append([it.key for it in group])

    takers = [threading.Thread(target=taker) for _ in range(6)]
    for th in takers:
        th.start()
    # While six threads block in take_group, this thread keeps running Python code.
    t0 = time.monotonic()
    spins = 0
    while time.monotonic() - t0 < 0.2:
        spins += 1
    assert spins > 1000
    items = [make_item(i) for i in range(12)]
    for it in items:
        store.put("t", it)
    for th in takers:
        th.join(10)
    assert len(results) == 6
    flat = sorted(k for group in results for k in group)
    assert flat == sorted(it.key for it in items)
    for group in results:  # each group is two consecutive puts, in order
        i = next(j for j, it in enumerate(items) if it.key == group[0])
        assert group == [items[i].key, items[i + 1].key]

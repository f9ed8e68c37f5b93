"""Random operation sequences on the replay store against a pure-Python model of it.

The model covers the deterministic parts: put, take_group (timeout=0), fresh_len,
add_success, replay_len, newest-first sampling with a version filter, bytes_used,
drop_older_than, eviction by per-task capacity and by the global byte budget.
"""

from __future__ import annotations

from collections import deque

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from arpo.buffer import BufferTimeout, BufferValueError, Item, ReplayStore, UnknownTask

MAX_BYTES = 1_500
FRESH_CAP = 4
REPLAY_CAP = 3
TASKS = st.sampled_from(["a", "b", "c"])


class StoreModel:
    """Per task: fresh and replay FIFOs of (seq, item); seq gives the global age."""

    def __init__(self) -> None:
        self.fresh: dict[str, deque[tuple[int, Item]]] = {}
        self.replay: dict[str, deque[tuple[int, Item]]] = {}
        self.seq = 0

    def register(self, task: str) -> None:
        self.fresh.setdefault(task, deque())
        self.replay.setdefault(task, deque())

    def bytes_used(self) -> int:
        return sum(it.nbytes for q in self.queues() for _, it in q)

    def queues(self) -> list[deque[tuple[int, Item]]]:
        return [*self.fresh.values(), *self.replay.values()]

    def insert(self, queue: deque[tuple[int, Item]], item: Item, capacity: int) -> None:
        queue.append((self.seq, item))
        self.seq += 1
        if len(queue) > capacity:
            queue.popleft()
        while self.bytes_used() > MAX_BYTES:
            oldest = min((q for q in self.queues() if q), key=lambda q: q[0][0])
            oldest.popleft()


class StoreMachine(RuleBasedStateMachine):
    items = Bundle("items")

    def __init__(self) -> None:
        super().__init__()
        self.store = ReplayStore(
            max_bytes=MAX_BYTES, fresh_capacity=FRESH_CAP, replay_capacity=REPLAY_CAP, seed=0
        )
        self.model = StoreModel()

    @rule(
        target=items,
        version=st.integers(0, 5),
        n_tokens=st.integers(0, 20),
        blob_sizes=st.lists(st.integers(0, 600), max_size=3),
    )
    def new_item(self, version: int, n_tokens: int, blob_sizes: list[int]) -> Item:
        return Item(
            np.arange(n_tokens, dtype=np.int32),
            np.zeros(n_tokens, dtype=np.float32),
            [0],
            [1.0],
            version,
            blobs=[bytes(n) for n in blob_sizes],
        )

    @rule(task=TASKS, item=items)
    def put(self, task: str, item: Item) -> None:
        if item.nbytes > MAX_BYTES:
            with pytest.raises(BufferValueError, match="max_bytes"):
                self.store.put(task, item)
            return
        self.store.put(task, item)
        self.model.register(task)
        self.model.insert(self.model.fresh[task], item, FRESH_CAP)

    @rule(task=TASKS, item=items, priority=st.floats(0.0, 10.0))
    def add_success(self, task: str, item: Item, priority: float) -> None:
        if item.nbytes > MAX_BYTES:
            with pytest.raises(BufferValueError, match="max_bytes"):
                self.store.add_success(task, item, priority)
            return
        self.store.add_success(task, item, priority)
        self.model.register(task)
        self.model.insert(self.model.replay[task], item, REPLAY_CAP)

    @rule(task=TASKS, n=st.integers(1, FRESH_CAP + 1))
    def take_group(self, task: str, n: int) -> None:
        queue = self.model.fresh.get(task, deque())
        if n > FRESH_CAP:
            with pytest.raises(BufferValueError, match="fresh_capacity"):
                self.store.take_group(task, n, timeout=0)
        elif len(queue) < n:
            with pytest.raises(BufferTimeout, match=f"n={n}"):
                self.store.take_group(task, n, timeout=0)
        else:
            got = self.store.take_group(task, n, timeout=0)
            want = [queue.popleft()[1] for _ in range(n)]
            assert [g.key for g in got] == [w.key for w in want]

    @rule(task=TASKS, k=st.integers(0, 5), min_version=st.none() | st.integers(0, 6))
    def sample_newest(self, task: str, k: int, min_version: int | None) -> None:
        if task not in self.model.replay:
            with pytest.raises(UnknownTask):
                self.store.sample(task, k, mode="newest", min_version=min_version)
            return
        floor = -1 if min_version is None else min_version
        eligible = [it for _, it in self.model.replay[task] if it.version >= floor]
        if not eligible:
            with pytest.raises(BufferValueError, match="min_size"):
                self.store.sample(task, k, mode="newest", min_version=min_version)
            return
        got = self.store.sample(task, k, mode="newest", min_version=min_version)
        assert [g.key for g in got] == [it.key for it in eligible[::-1][:k]]

    @rule(task=TASKS, k=st.integers(1, 4))
    def sample_uniform(self, task: str, k: int) -> None:
        queue = self.model.replay.get(task)
        if not queue:
            return
        keys = {it.key for _, it in queue}
        got = self.store.sample(task, k)
        assert len(got) == k and {g.key for g in got} <= keys

    @rule(min_version=st.integers(0, 6))
    def drop_older_than(self, min_version: int) -> None:
        removed = 0
        for q in self.model.queues():
            kept = [(s, it) for s, it in q if it.version >= min_version]
            removed += len(q) - len(kept)
            q.clear()
            q.extend(kept)
        assert self.store.drop_older_than(min_version) == removed

    @invariant()
    def lengths_bytes_and_tasks_agree(self) -> None:
        assert self.store.bytes_used == self.model.bytes_used()
        assert self.store.tasks() == sorted(self.model.fresh)
        for task in ("a", "b", "c"):
            assert self.store.fresh_len(task) == len(self.model.fresh.get(task, ()))
            if task in self.model.replay:
                assert self.store.replay_len(task) == len(self.model.replay[task])
        stats = self.store.stats()
        assert stats["total"]["bytes"] == self.model.bytes_used()
        for task, s in stats["tasks"].items():
            fresh = [it.key for _, it in self.model.fresh[task]]
            replay = [it.key for _, it in self.model.replay[task]]
            assert (s["fresh"], s["replay"]) == (len(fresh), len(replay))

    def teardown(self) -> None:
        self.store.close()


StoreMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreAgainstModel = StoreMachine.TestCase

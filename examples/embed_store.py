"""The replay store embedded with numpy alone: the example of docs/guides/replay-store.md.

    pip install arpo_buffer-0.1.0-cp311-abi3-*.whl    # the store's wheel; numpy comes with it
    python embed_store.py

An actor's side fills one task's fresh queue, a learner's side takes a whole group, keeps
two successes for replay and samples them by priority; then the store is snapshotted and
restored. It imports numpy and `arpo_buffer`, nothing else: tests/test_store_wheel.py runs
it in a virtualenv holding only those two, from a folder outside the repository. The last
line printed is a JSON summary.
"""

import json
import tempfile
from pathlib import Path

import arpo_buffer
import numpy as np
from arpo_buffer import BufferValueError, Item, ReplayStore

store = ReplayStore(max_bytes=2 << 30, fresh_capacity=64, replay_capacity=8, seed=0)
task = "CartPole-v1/seed=3"
rng = np.random.default_rng(0)
for version in range(8):  # an actor: one finished episode per put
    item = Item(
        rng.integers(0, 2, 50, dtype=np.int32),  # the actions, as tokens
        np.full(50, -0.69, np.float32),  # their behaviour log-probs
        np.array([0, 50], np.int32),  # where each turn starts, and the end
        np.ones(50, np.float32),  # per-step rewards
        version,  # the policy version that acted
        blobs=(np.zeros((50, 4), np.float32).tobytes(),),  # observations, kept by reference
    )
    store.put(task, item)
group = store.take_group(task, 8, timeout=5.0)  # the learner: a whole group at once
for item in group[:2]:
    store.add_success(task, item, priority=float(item.rewards.sum()))
batch = store.sample(task, 4, mode="priority")  # with replacement, by priority
store.update_priorities(task, [batch[0].key], [0.5])
try:
    store.sample(task, 1, min_version=8)  # no success that new: the store says so
except BufferValueError as e:  # a ValueError too
    refused = str(e)

with tempfile.TemporaryDirectory() as tmp:
    store.snapshot(Path(tmp) / "store.snap")
    restored = ReplayStore.restore(Path(tmp) / "store.snap")
newest = store.sample(task, 2, mode="newest")
back = restored.sample(task, 2, mode="newest")

print(
    json.dumps(
        {
            "arpo_buffer": arpo_buffer.__version__,
            "group": [x.version for x in group],
            "replay": store.replay_len(task),
            "sampled": len(batch),
            "refused": refused,
            "restored_same": [x.key for x in newest] == [x.key for x in back]
            and all(np.array_equal(a.tokens, b.tokens) for a, b in zip(newest, back, strict=True)),
            "total": store.stats()["total"],
        }
    )
)

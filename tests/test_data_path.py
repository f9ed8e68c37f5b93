"""The data path on a real socket: actors' links -> the learner's ingest -> the Rust store ->
GRPO groups with the replay of successes -> a store snapshot that restores.

Every piece is the one `arpo train` runs: `arpo.transport.ActorLink` on the actor side,
`arpo.service.ingest.Ingest` (a `RouterServer`) on the learner side, `ReplayStore`, and
`GroupAssembler` with the reference replay rule. Several actors send at once; each owns its
tasks, so a task's episodes arrive in order and every group is one iteration's episodes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path

import numpy as np
from conftest import make_trajectory

from arpo import store_item, wire
from arpo.buffer import ReplayStore
from arpo.learner.assemble import AssembleConfig, GroupAssembler
from arpo.record import Trajectory
from arpo.service.ingest import Ingest, IngestConfig
from arpo.transport import ActorLink, TransportConfig

G = 4
ITERATIONS = 3
SCORES = {
    "never": [[0.0] * G] * ITERATIONS,
    "once": [[1.0] + [0.0] * (G - 1)] + [[0.0] * G] * (ITERATIONS - 1),
    "often": [[1.0, 0.0, 1.0, 0.0]] * ITERATIONS,
}
"""Checker score of each episode, per task and iteration (a group of G)."""
OWNER = {"never": 0, "once": 1, "often": 1}
"""Which actor plays each task (actor 1 interleaves two tasks)."""


def _episodes(png_pool: list[bytes]) -> dict[int, list[Trajectory]]:
    """Each actor's episodes in the order it plays them: iteration by iteration."""
    rng = np.random.default_rng(0)
    plan: dict[int, list[Trajectory]] = {0: [], 1: []}
    for it in range(ITERATIONS):
        for task, scores in SCORES.items():
            for slot, score in enumerate(scores[it]):
                t = make_trajectory(
                    rng, turns=2, tokens=400, pngs=png_pool, task_id=task, version=0
                )
                fields = {f: getattr(t, f) for f in t.__slots__}
                fields.update(
                    checker_score=score, reward=score, group_id=f"{task}/g{it}", slot=slot
                )
                fields.update(actor_id=f"actor-{OWNER[task]}", trajectory_id=f"{task}-{it}-{slot}")
                plan[OWNER[task]].append(Trajectory(**fields))
    return plan


async def _actor(cfg: TransportConfig, name: str, episodes: list[Trajectory]) -> set[str]:
    """Send every episode over the actor's link; return the ids the learner acknowledged."""
    acked: set[str] = set()
    link = ActorLink(cfg, on_ack=acked.update, actor_id=name)
    link.start()
    try:
        for traj in episodes:
            assert await link.send(wire.encode(traj), timeout=30), f"{name}: no room to send"
        async with asyncio.timeout(60):
            while len(acked) < len(episodes):
                await asyncio.sleep(0.01)
    finally:
        await link.close()
    return acked


def test_actors_fill_groups_that_get_replayed_successes_over_a_real_socket(
    tmp_path: Path, png_pool: list[bytes]
) -> None:
    plan = _episodes(png_pool)
    sent = {t.trajectory_id for eps in plan.values() for t in eps}
    store = ReplayStore(max_bytes=1 << 30, fresh_capacity=4096, replay_capacity=8, seed=0)
    tc = TransportConfig(data="tcp://127.0.0.1:0")
    ingest = Ingest(store, IngestConfig(), tc)
    actor_cfg = dataclasses.replace(tc, data=ingest.start(), control=f"ipc://{tmp_path}/unused")

    acked: dict[int, set[str]] = {}
    errors: list[BaseException] = []

    def actors() -> None:
        async def both() -> None:
            results = await asyncio.gather(
                *(_actor(actor_cfg, f"actor-{i}", eps) for i, eps in plan.items())
            )
            acked.update(enumerate(results))

        try:
            asyncio.run(both())
        except BaseException as e:  # surfaced by the test thread
            errors.append(e)

    thread = threading.Thread(target=actors, daemon=True)
    thread.start()
    asm = GroupAssembler(store, AssembleConfig(group_size=G, groups_per_step=1))
    groups: dict[str, list[list]] = {task: [] for task in SCORES}
    dropped: list[tuple[str, str]] = []
    try:
        # Groups are taken while the actors are still sending (take_group waits for a group).
        for _ in range(ITERATIONS * len(SCORES)):
            batch = asm.next_batch(version=0, timeout=60)
            assert batch is not None, f"no group formed; actor errors: {errors}"
            groups[batch.samples[0].task_id].append(batch.samples)
            dropped += batch.dropped
        thread.join(timeout=60)
        assert not errors, errors
    finally:
        stats = ingest.stats()
        ingest.stop()

    # No trajectory lost or doubled: every one acknowledged, stored, and then either trained
    # once as a fresh episode or left out for the replayed success that took its place.
    assert set().union(*acked.values()) == sent
    assert stats["stored"] == len(sent) and stats.get("rejected_total", 0) == 0
    fresh = [s.trajectory_id for gs in groups.values() for g in gs for s in g if not s.is_replay]
    replaced = [f"once-{it}-{G - 1}" for it in range(1, ITERATIONS)]
    assert sorted(dropped) == [(i, "replaced") for i in replaced]
    assert sorted(fresh + replaced) == sorted(sent)

    for task, per_iter in SCORES.items():
        for it, (group, scores) in enumerate(zip(groups[task], per_iter, strict=True)):
            ids = [s.trajectory_id for s in group]
            replayed = [s for s in group if s.is_replay]
            adv = np.asarray([s.advantage for s in group])
            # The reference rule: a group without a success gets one when the task has one stored.
            if task == "once" and it > 0:
                assert [s.trajectory_id for s in replayed] == ["once-0-0"], ids
                assert ids[:-1] == [f"once-{it}-{k}" for k in range(G - 1)]  # replaces the last
                assert adv.std() > 0
            else:
                assert not replayed, ids
                assert ids == [f"{task}-{it}-{k}" for k in range(G)]
            own = [s.checker_score for s in group if not s.is_replay]
            assert own == scores[: len(own)]
    assert store.replay_len("never") == 0
    assert store.replay_len("once") == 1 and store.replay_len("often") == 2 * ITERATIONS

    # The store (the replay buffers) survives a snapshot and restore.
    snap = tmp_path / "store.snapshot"
    store.snapshot(snap)
    restored = ReplayStore.restore(snap)
    try:
        for task in SCORES:
            assert restored.replay_len(task) == store.replay_len(task)
        (item,) = restored.sample("once", 1)
        assert store_item.from_item(item).trajectory_id == "once-0-0"
    finally:
        restored.close()
        store.close()

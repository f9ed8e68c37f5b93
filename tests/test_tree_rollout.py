"""Tree rollouts end to end on real simulated desktops: a grant book hands out a tree grant,
the actor's tree runner forks the desktop at branch points, the leaves fill the group's
slots exactly once, and the learner's assembler trains every shared turn once."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from arpo_envs.sim.server import SimConfig, running
from arpo_envs.sim.tasks import generate_tasks

from arpo import store_item, wire
from arpo.actor.episode import EpisodeConfig
from arpo.actor.scripted import ScriptedPolicy
from arpo.actor.tree import TreeStats, run_tree
from arpo.buffer import ReplayStore
from arpo.env.environment import Environment
from arpo.env.runner import RunnerConfig
from arpo.learner.assemble import AssembleConfig, GroupAssembler
from arpo.learner.learner import EnvSteps
from arpo.record import Status, Trajectory
from arpo.service.grants import GrantBook, GrantConfig


def _book(task: dict, **kw) -> GrantBook:
    cfg = GrantConfig(group_size=4, groups_per_step=1, tree_slots=4, branch_width=2,
                      branch_every=2, shuffle=False, **kw)  # fmt: skip
    cfg.validate()
    return GrantBook([task], cfg)


async def _run(grant: wire.Grant, policy, sim: SimConfig | None = None, on_step=None):
    stats = TreeStats()
    async with running([sim or SimConfig(port=0)]) as urls:
        env = Environment(0, urls[0], RunnerConfig(reset_before_setup=True))
        try:
            results, back = await run_tree(
                env,
                grant,
                policy,
                EpisodeConfig(max_steps=0),
                actor_id="a0",
                stats=stats,
                on_step=on_step,
            )
        finally:
            await env.close()
    return results, back, stats


def _shared_turns_agree(trajs: list[Trajectory]) -> int:
    """Checks that leaves of one tree hold the same turns up to where they parted; the
    number of leaf pairs checked."""
    pairs = 0
    for i, a in enumerate(trajs):
        for b in trajs[i + 1 :]:
            if a.branch is None or b.branch is None or a.branch.tree != b.branch.tree:
                continue
            d = 0
            while d < min(len(a.branch.path), len(b.branch.path)) and (
                a.branch.path[d] == b.branch.path[d]
            ):
                d += 1
            shared = a.branch.steps[d]
            assert a.branch.steps[: d + 1] == b.branch.steps[: d + 1]
            for ta, tb in zip(a.turns[:shared], b.turns[:shared], strict=True):
                assert np.array_equal(ta.response_ids, tb.response_ids)
                assert np.array_equal(ta.prompt_ids, tb.prompt_ids)
                assert ta.screenshot == tb.screenshot
            pairs += 1
    return pairs


def test_a_tree_grant_fills_its_group_once_and_each_shared_turn_trains_once():
    task = generate_tasks("fill_form", 1, seed=3)[0]
    book = _book(task)
    (grant,) = book.request("a0", want=1)
    assert grant.tree is not None and grant.tree.slots == (0, 1, 2, 3)

    # A scripted policy that follows the oracle, with a garbled response now and then (the
    # children of one branch point then differ).
    policy = ScriptedPolicy(garbage_prob=0.12, seed=5)
    ran = []
    results, back, stats = asyncio.run(_run(grant, policy, on_step=lambda: ran.append(1)))

    slots = sorted(s for s, _, _ in results)
    assert slots == [0, 1, 2, 3], "every slot exactly once"
    trajs = [t for _, _, t in results if t is not None]
    for gid, reason in back.items():
        assert book.release(gid, "a0", reason)
    for t in trajs:
        assert book.complete(t)
    assert stats.forks >= 1 and stats.clones >= 2
    ok = [t for t in trajs if t.status == Status.OK]
    assert len(ok) >= 2
    assert _shared_turns_agree(ok) >= 1
    assert all(t.branch is not None for t in ok)
    # The learner counts the environment steps the tree ran, shared turns once.
    steps = EnvSteps()
    assert sum(steps.add(t) for t in trajs) == len(ran) == steps.total
    assert len(ran) < sum(t.steps for t in trajs)

    # The learner's side: the group, taken from a real store, trains each turn once.
    store = ReplayStore(max_bytes=1 << 28, fresh_capacity=64, replay_capacity=8, seed=0)
    for t in ok:
        store.put(t.task_id, store_item.to_item(t))
    asm = GroupAssembler(store, AssembleConfig(group_size=len(ok), groups_per_step=1,
                                               min_group_size=1, norm_std=False))  # fmt: skip
    batch = asm.next_batch(version=0, timeout=5)
    assert batch is not None and len(batch.samples) == len(ok)
    trained: dict[tuple[str, tuple[int, ...], int], int] = {}
    for s in batch.samples:
        assert s.turn_advantages is not None and len(s.turn_advantages) == s.turns
        path, steps = s.branch.path, s.branch.steps
        bounds = [0, *steps, s.turns]
        for turn in range(s.turns):
            depth = max(d for d in range(len(path) + 1) if bounds[d] <= turn)
            node = (s.branch.tree, path[:depth], turn)
            if not np.isnan(s.turn_advantages[turn]):
                trained[node] = trained.get(node, 0) + 1
            else:
                trained.setdefault(node, 0)
    assert set(trained.values()) == {1}, "each turn of the tree is trained exactly once"
    assert batch.counts["data/tree_groups"] == 1


def test_the_local_desktop_cannot_fork_and_the_tree_falls_back_to_plain_episodes():
    """A provider that cannot fork: the first slot runs as a plain episode, the others are
    given back for plain grants; nothing is lost."""
    from arpo.env.provider import StaticProvider

    task = generate_tasks("fill_form", 1, seed=4)[0]
    book = _book(task)
    (grant,) = book.request("a0", want=1)

    async def go():
        async with running([SimConfig(port=0)]) as urls:
            env = Environment(0, urls[0], provider=lambda c: _NoFork(c))
            try:
                return await run_tree(env, grant, ScriptedPolicy(seed=1),
                                      EpisodeConfig(max_steps=0), actor_id="a0")  # fmt: skip
            finally:
                await env.close()

    class _NoFork(StaticProvider):
        kind = "desktop"

        async def revert_to_snapshot(self, task_id: str = "") -> None:
            await self.client.reset()

    results, back = asyncio.run(go())
    assert sorted(s for s, _, _ in results) == [0, 1, 2, 3]
    (first,) = [t for _, _, t in results if t is not None]
    assert first.status == Status.OK and first.checker_score == 1.0 and first.branch is not None
    assert set(back.values()) == {"cannot_fork"} and len(back) == 3
    for gid, reason in back.items():
        assert book.release(gid, "a0", reason)
    again = [g for g in book.request("a1", want=3) if g.group == grant.group]
    assert sorted(g.slot for g in again) == [1, 2, 3] and all(g.tree is None for g in again)


def test_tree_grants_travel_and_a_granted_again_slot_is_plain():
    task = generate_tasks("fill_form", 1, seed=3)[0]
    book = _book(task, max_attempts=3)
    (grant,) = book.request("a0", want=1)
    got = wire.decode(wire.encode(wire.GrantReply(1, (grant,), 0.0)))
    assert got.grants[0] == grant
    assert json.loads(got.grants[0].task_json)["id"] == task["id"]
    # The tree's second slot failed for the environment: it comes back as a plain grant.
    bad = Trajectory(task["id"], (), 0.0, status=Status.ENV_ERROR, group_id=grant.group, slot=1)
    assert book.complete(bad)
    (again,) = book.request("a1", want=1)
    assert again.slot == 1 and again.tree is None


@pytest.mark.parametrize("bad", [{"slots": [0], "grant_ids": ["x"], "width": 2, "every": 1},
                                 {"slots": [0, 0], "grant_ids": ["x", "y"], "width": 2,
                                  "every": 1},
                                 {"slots": [0, 1], "grant_ids": ["x", "y"], "width": 3,
                                  "every": 1}])  # fmt: skip
def test_a_malformed_tree_is_refused_by_the_wire(bad):
    with pytest.raises(wire.WireError):
        wire.TreeSpec.from_json(bad)


def test_a_fork_that_fails_mid_group_is_accounted_for(monkeypatch):
    """The desktop refuses a second fork (its live-children bound, HTTP 429): the slots
    that fork was for are delivered as env_error with the reason, and the grant book
    grants exactly those slots again, as plain episodes."""
    import arpo_envs.sim.server as sim_server

    monkeypatch.setattr(sim_server, "MAX_CHILDREN", 2)
    task = generate_tasks("fill_form", 1, seed=3)[0]
    book = _book(task)
    (grant,) = book.request("a0", want=1)
    results, back, stats = asyncio.run(_run(grant, ScriptedPolicy(garbage_prob=0.12, seed=5)))
    assert sorted(s for s, _, _ in results) == [0, 1, 2, 3] and not back
    failed = [t for _, _, t in results if t.status == Status.ENV_ERROR]
    assert stats.fork_errors >= 1 and failed
    assert all(t.error.startswith("fork: ") and "429" in t.error for t in failed)
    for _, _, t in results:
        assert book.complete(t)
    again = [g for g in book.request("a1", want=4) if g.group == grant.group]
    assert sorted(g.slot for g in again) == sorted(t.slot for t in failed)
    assert all(g.tree is None for g in again)

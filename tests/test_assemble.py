"""Group assembly from the real store: filters with counts, the reference replay rule and its
variants, advantages, waiting for groups."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from arpo import store_item
from arpo.buffer import ReplayStore
from arpo.errors import ConfigError
from arpo.learner.assemble import AssembleConfig, GroupAssembler
from arpo.learner.groups import ReplayConfig, advantages
from arpo.record import Status, Trajectory, Turn

RNG = np.random.default_rng(0)


def traj(task: str, reward: float, version: int = 5, status=Status.OK) -> Trajectory:
    turn = Turn(
        RNG.integers(0, 1000, 12, dtype=np.int32),
        b"\x89PNG\r\n\x1a\n" + bytes(20),
        RNG.integers(0, 1000, 4, dtype=np.int32),
        np.full(4, -1.0, np.float32),
        version,
    )
    return Trajectory(task, (turn,), reward if reward > 0 else 0.0, reward=reward, status=status)


def store() -> ReplayStore:
    return ReplayStore(max_bytes=1 << 28, fresh_capacity=256, replay_capacity=8, seed=0)


def put(s: ReplayStore, t: Trajectory) -> Trajectory:
    s.put(t.task_id, store_item.to_item(t))
    return t


def test_groups_get_advantages_and_successes_enter_replay():
    s = store()
    rewards = [1.0, 0.0, 0.5, 0.0]
    ts = [put(s, traj("a", r)) for r in rewards]
    asm = GroupAssembler(s, AssembleConfig(group_size=4, groups_per_step=1))
    b = asm.next_batch(version=5, timeout=1)
    assert b is not None and b.groups == 1
    assert [x.trajectory_id for x in b.samples] == [t.trajectory_id for t in ts]
    np.testing.assert_allclose([x.advantage for x in b.samples], advantages(rewards), rtol=1e-6)
    assert not any(x.is_replay for x in b.samples)
    # checker score > 0.1: the 1.0 and the 0.5 episodes are now replayable successes
    assert s.replay_len("a") == 2 and b.counts["replay/admitted"] == 2
    assert b.counts["replay/hits"] == 0


def test_stale_and_non_ok_trajectories_are_dropped_and_counted():
    s = store()
    put(s, traj("a", 1.0, version=2))  # 3 versions behind v=5, max_staleness 1: stale
    put(s, traj("a", 0.0, version=4))
    put(s, traj("a", 0.0, version=5, status=Status.ENV_ERROR))
    put(s, traj("a", 1.0, version=5))
    asm = GroupAssembler(s, AssembleConfig(group_size=4, groups_per_step=1, max_staleness=1))
    b = asm.next_batch(version=5, timeout=1)
    assert b.counts["data/dropped_stale"] == 1 and b.counts["data/dropped_status"] == 1
    assert len(b.samples) == 2 and [x.reward for x in b.samples] == [0.0, 1.0]
    assert asm.totals["data/dropped_stale"] == 1
    # A group left below min_group_size is dropped as a whole.
    for v in (1, 1, 1, 5):
        put(s, traj("b", 0.0, version=v))
    put(s, traj("c", 0.0))
    asm2 = GroupAssembler(s, AssembleConfig(group_size=4, groups_per_step=1))
    assert asm2.next_batch(version=5, timeout=0.3) is None
    assert asm2._pending_counts["data/dropped_groups"] == 1


def test_reference_replay_replaces_one_fresh_episode():
    s = store()
    old = traj("a", 1.0, version=1)
    s.add_success("a", store_item.to_item(old))
    fresh = [put(s, traj("a", 0.0)) for _ in range(8)]
    b = GroupAssembler(s, AssembleConfig(group_size=8, groups_per_step=1)).next_batch(5, 1)
    assert len(b.samples) == 8
    assert [x.trajectory_id for x in b.samples[:7]] == [t.trajectory_id for t in fresh[:7]]
    rep = b.samples[7]
    assert rep.is_replay and rep.trajectory_id == old.trajectory_id and rep.version == 1
    # Replayed items keep their own behaviour log-probs.
    np.testing.assert_array_equal(rep.item.logprobs, np.full(4, -1.0, np.float32))
    assert rep.advantage == pytest.approx(advantages([0] * 7 + [1])[7])
    assert b.counts["replay/hits"] == 1 and b.counts["replay/version_gap_mean"] == 4
    assert b.counts["replay/triggered"] == 1


def test_replay_variants_add_k_newest_and_off():
    s = store()
    olds = [traj("a", 1.0, version=v) for v in (1, 2, 3)]
    for o in olds:
        s.add_success("a", store_item.to_item(o))
    for _ in range(4):
        put(s, traj("a", 0.0))
    cfg = AssembleConfig(
        group_size=4, groups_per_step=1, replay=ReplayConfig(mode="add", k=2, pick="newest")
    )
    b = GroupAssembler(s, cfg).next_batch(5, 1)
    assert len(b.samples) == 6
    assert [x.trajectory_id for x in b.samples if x.is_replay] == [
        olds[2].trajectory_id,
        olds[1].trajectory_id,
    ]
    # A group that already has a success is not replayed into; replay off never is.
    put(s, traj("a", 1.0))
    for _ in range(3):
        put(s, traj("a", 0.0))
    b = GroupAssembler(s, AssembleConfig(group_size=4, groups_per_step=1)).next_batch(5, 1)
    assert not any(x.is_replay for x in b.samples)
    for _ in range(4):
        put(s, traj("a", 0.0))
    off = AssembleConfig(group_size=4, groups_per_step=1, replay=ReplayConfig(enabled=False))
    b = GroupAssembler(s, off).next_batch(5, 1)
    assert not any(x.is_replay for x in b.samples) and all(x.advantage == 0 for x in b.samples)


def test_no_success_stored_yet_leaves_the_group_as_it_is():
    s = store()
    for _ in range(4):
        put(s, traj("a", 0.0))
    b = GroupAssembler(s, AssembleConfig(group_size=4, groups_per_step=1)).next_batch(5, 1)
    assert len(b.samples) == 4 and b.counts["replay/hits"] == 0
    assert b.counts["replay/triggered"] == 1


def test_waits_for_enough_groups_across_tasks_and_keeps_partial_progress():
    s = store()
    asm = GroupAssembler(s, AssembleConfig(group_size=2, groups_per_step=3, poll_s=0.01))
    for t in ("a", "b"):
        put(s, traj(t, 1.0))
        put(s, traj(t, 0.0))
    assert asm.next_batch(5, timeout=0.2) is None  # two groups formed, three needed

    def late():
        time.sleep(0.2)
        put(s, traj("c", 1.0))
        put(s, traj("c", 0.0))

    th = threading.Thread(target=late)
    th.start()
    b = asm.next_batch(5, timeout=10)
    th.join()
    assert b.groups == 3 and {x.task_id for x in b.samples} == {"a", "b", "c"}
    assert sorted({x.group for x in b.samples}) == [0, 1, 2]


def test_flush_hands_out_the_groups_of_an_incomplete_batch():
    """At a stop the learner trains what was taken for an incomplete batch: those groups
    are out of the store, so the final checkpoint would not hold them (the soak lost
    acknowledged trajectories that way)."""
    s = store()
    asm = GroupAssembler(s, AssembleConfig(group_size=2, groups_per_step=3, poll_s=0.01))
    stale = put(s, traj("a", 0.0, version=0))
    kept = [put(s, traj(t, r)) for t in ("b", "c") for r in (1.0, 0.0)]
    put(s, traj("a", 1.0))
    assert asm.next_batch(5, timeout=0.2) is None  # "a" is too small once its stale one goes
    b = asm.flush(5)
    assert b is not None and b.groups == 2
    assert {x.trajectory_id for x in b.samples} == {t.trajectory_id for t in kept}
    assert (stale.trajectory_id, "stale") in b.dropped
    assert asm.flush(5) is None


def test_flat_groups_can_be_left_out():
    s = store()
    for _ in range(2):
        put(s, traj("a", 1.0))
    cfg = AssembleConfig(group_size=2, groups_per_step=1, drop_flat_groups=True)
    asm = GroupAssembler(s, cfg)
    assert asm.next_batch(5, timeout=0.2) is None
    assert asm._pending_counts["data/dropped_flat_groups"] == 1


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"replay\.k"):
        GroupAssembler(store(), AssembleConfig(group_size=2, replay=ReplayConfig(k=2)))
    with pytest.raises(ConfigError, match="group_size"):
        GroupAssembler(store(), AssembleConfig(group_size=0))
    with pytest.raises(ConfigError, match="max_staleness"):
        GroupAssembler(store(), replace(AssembleConfig(), max_staleness=-1))


# ---- the reference's replay trigger and order (checker scores, population std) --------


def scored(task: str, checker: float, fmt: float = 0.0, version: int = 5, **kw) -> Trajectory:
    """A trajectory with checker score `checker` and total reward checker + 0.5 * fmt."""
    t = traj(task, 0.0, version=version, **kw)
    return Trajectory(task, t.turns, checker, format_reward=fmt, reward=checker + 0.5 * fmt)


def stored_success(s: ReplayStore, task: str, version: int = 1) -> Trajectory:
    old = scored(task, 1.0, version=version)
    s.add_success(task, store_item.to_item(old))
    return old


@pytest.mark.parametrize(
    "checker, fmt",
    [
        ([0.0] * 8, [0.0] * 7 + [-1.0]),  # one response did not parse: rewards [0]*7 + [-0.5]
        ([0.15] + [0.0] * 7, [0.0] * 8),  # a partial score: population std 0.0496 < 0.05
    ],
    ids=["parse-failure", "partial-score"],
)
def test_reference_trigger_reads_checker_scores_with_population_std(checker, fmt):
    s = store()
    old = stored_success(s, "a")
    for c, f in zip(checker, fmt, strict=True):
        put(s, scored("a", c, f))
    asm = GroupAssembler(s, AssembleConfig(group_size=8, groups_per_step=1))
    b = asm.next_batch(version=5, timeout=1)
    assert b.counts["replay/triggered"] == 1 and b.counts["replay/hits"] == 1
    replayed = [x for x in b.samples if x.is_replay]
    assert [x.trajectory_id for x in replayed] == [old.trajectory_id]
    # Advantages stay on the total rewards: the parse failure is below the other failures.
    rewards = [x.reward for x in b.samples]
    np.testing.assert_allclose([x.advantage for x in b.samples], advantages(rewards), rtol=1e-6)
    # The sample std of [0.15] + [0]*7 is 0.053: a sample-std trigger would not fire.
    assert np.std(checker, ddof=0) < 0.05


def test_a_group_with_a_real_success_is_not_replayed_into():
    s = store()
    stored_success(s, "a")
    for c in [1.0] + [0.0] * 7:
        put(s, scored("a", c))
    b = GroupAssembler(s, AssembleConfig(group_size=8, groups_per_step=1)).next_batch(5, 1)
    assert b.counts.get("replay/triggered", 0) == 0 and b.counts["replay/hits"] == 0


def test_a_stale_success_enters_the_buffer_and_is_replayed_later():
    """A success older than max_staleness is not trained as a fresh episode, but it enters
    its task's buffer, and a later all-failed group of the task gets it as its replay."""
    s = store()
    asm = GroupAssembler(s, AssembleConfig(group_size=4, groups_per_step=1, max_staleness=1))
    stale = put(s, scored("a", 1.0, version=1))  # 4 versions behind v=5
    for _ in range(3):
        put(s, scored("a", 0.0))
    b = asm.next_batch(version=5, timeout=1)
    assert b.counts["data/dropped_stale"] == 1 and b.counts["replay/admitted"] == 1
    assert s.replay_len("a") == 1
    # Its own group did not get it back (the buffer was empty at the pick).
    assert b.counts["replay/triggered"] == 1 and b.counts["replay/hits"] == 0
    assert stale.trajectory_id not in [x.trajectory_id for x in b.samples]
    for _ in range(4):
        put(s, scored("a", 0.0, version=6))
    b2 = asm.next_batch(version=6, timeout=1)
    assert [x.trajectory_id for x in b2.samples if x.is_replay] == [stale.trajectory_id]
    assert b2.samples[-1].version == 1  # replayed with its own behaviour version


def test_a_groups_own_success_is_never_its_replay():
    """A partial success (0.15 > admit 0.1) in an all-failed group: the trigger fires, the
    buffer is empty at the pick, so nothing is replayed; the success enters the buffer after
    the pick, for later groups."""
    s = store()
    asm = GroupAssembler(s, AssembleConfig(group_size=8, groups_per_step=1))
    own = put(s, scored("a", 0.15))
    for _ in range(7):
        put(s, scored("a", 0.0))
    b = asm.next_batch(version=5, timeout=1)
    assert b.counts["replay/triggered"] == 1 and b.counts["replay/hits"] == 0
    assert [x.trajectory_id for x in b.samples].count(own.trajectory_id) == 1
    assert not any(x.is_replay for x in b.samples) and s.replay_len("a") == 1


def test_turns_sampled_with_other_settings_are_refused_with_a_counted_reason(caplog):
    """The learner scores temperature 1.0, top_p 1.0: a trajectory whose turn was sampled at
    0.6, and one from before turns recorded their settings (NaN), are dropped before the
    group is scored; the group's advantages are over what is left."""
    s = store()
    ok = [put(s, scored("a", c)) for c in (1.0, 0.0)]
    t = scored("a", 1.0)
    put(s, replace(t, turns=(replace(t.turns[0], temperature=0.6),)))
    t = scored("a", 0.0)
    put(s, replace(t, turns=(replace(t.turns[0], temperature=np.nan, top_p=np.nan),)))
    asm = GroupAssembler(s, AssembleConfig(group_size=4, groups_per_step=1), sampling=(1.0, 1.0))
    with caplog.at_level("WARNING"):
        b = asm.next_batch(version=5, timeout=1)
    assert b.counts["data/dropped_sampling"] == 2
    assert [x.trajectory_id for x in b.samples] == [x.trajectory_id for x in ok]
    np.testing.assert_allclose([x.advantage for x in b.samples], advantages([1.0, 0.0]))
    assert sorted(why for _, why in b.dropped) == ["sampling", "sampling"]
    assert "sampled at temperature 0.6" in caplog.text
    assert "without recorded sampling settings" in caplog.text


def test_untrainable_records_are_dropped_before_scoring_and_evicted_from_the_buffer():
    """`check` rejects some records: a fresh one is left out before the advantages (the group
    is renormalised over the rest), a buffered success that fails it is evicted from the
    store and another success is replayed instead; a check that raises drops its record."""
    s = store()
    bad_success = stored_success(s, "a", version=1)
    good_success = stored_success(s, "a", version=2)
    bad_ids = {bad_success.trajectory_id}
    fresh = [put(s, scored("a", 0.0)) for _ in range(4)]
    bad_ids.add(fresh[1].trajectory_id)
    boom = fresh[2].trajectory_id

    def check(item, tr):
        if tr.trajectory_id == boom:
            raise ValueError("cannot read it")
        return "bad record" if tr.trajectory_id in bad_ids else None

    asm = GroupAssembler(s, AssembleConfig(group_size=4, groups_per_step=1), check=check)
    for _ in range(20):  # uniform picks: the bad success is hit and evicted sooner or later
        if s.replay_len("a") == 1:
            break
        asm._replay("a", asm._pending_counts)
    assert s.replay_len("a") == 1 and asm._pending_counts["replay/evicted"] == 1
    b = asm.next_batch(version=5, timeout=1)
    assert b.counts["data/dropped_invalid"] == 2
    ids = [x.trajectory_id for x in b.samples]
    assert fresh[1].trajectory_id not in ids and boom not in ids
    assert [x.trajectory_id for x in b.samples if x.is_replay] == [good_success.trajectory_id]
    assert len(b.samples) == 2  # 2 fresh left, one replaced by the replayed success
    np.testing.assert_allclose(
        [x.advantage for x in b.samples], advantages([x.reward for x in b.samples])
    )


def test_groups_are_taken_oldest_first_not_round_robin():
    """The group sampled with the oldest policy is trained first, whatever the task order:
    a group that waited for its last episode is not overtaken by newer ones until stale."""
    s = store()
    for task, version in (("a", 6), ("z", 6), ("m", 4), ("b", 5)):
        for r in (1.0, 0.0):
            put(s, traj(task, r, version=version))
    asm = GroupAssembler(s, AssembleConfig(group_size=2, groups_per_step=1, max_staleness=9))
    order = [asm.next_batch(version=6, timeout=1).samples[0].task_id for _ in range(4)]
    assert order == ["m", "b", "a", "z"]  # by version, then by arrival

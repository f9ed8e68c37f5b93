"""Task grants: groups fill to their size, staleness admission, re-issue, surplus, env faults."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from arpo import wire
from arpo.record import Status, Trajectory
from arpo.service.grants import GrantBook, GrantConfig, GrantServer
from arpo.transport import ActorLink, TransportConfig

TASKS = [{"id": f"t{i}", "instruction": f"task {i}", "evaluator": {"func": "x"}} for i in range(3)]


def _done(g: wire.Grant, status: Status = Status.OK) -> Trajectory:
    return Trajectory(
        task_id=g.task_id, turns=(), checker_score=0.0, status=status, group_id=g.group, slot=g.slot
    )


def test_groups_fill_in_order_and_carry_the_task() -> None:
    book = GrantBook(TASKS, GrantConfig(group_size=4, groups_per_step=2, shuffle=False))
    grants = book.request("a", 3) + book.request("b", 3)
    assert [(g.task_id, g.slot) for g in grants] == [
        ("t0", 0), ("t0", 1), ("t0", 2), ("t0", 3), ("t1", 0), ("t1", 1)
    ]  # fmt: skip
    assert json.loads(grants[0].task_json) == TASKS[0]
    assert len({g.grant_id for g in grants}) == 6 and all(g.version == 0 for g in grants)
    assert all(book.complete(_done(g)) for g in grants)
    assert book.stats()["completed"] == 6


def test_admission_bounds_staleness() -> None:
    cfg = GrantConfig(group_size=2, groups_per_step=2, max_staleness=1, shuffle=False)
    book = GrantBook(TASKS, cfg)
    # Version 0: (0 + 1 + 1) * 2 = 4 groups = 8 episodes may be granted, no more.
    got = book.request("a", 100)
    assert len(got) == 8 and book.request("a", 1) == []
    book.set_version(1)  # the learner consumed two groups and stepped
    more = book.request("a", 100)
    assert len(more) == 4 and all(g.version == 1 for g in more)


def test_expired_grant_is_reissued_and_the_late_one_is_a_surplus() -> None:
    book = GrantBook(TASKS, GrantConfig(group_size=1, groups_per_step=1, max_staleness=0,
                                        grant_timeout_s=10.0))  # fmt: skip
    (g1,) = book.request("dead-actor", 1, now=0.0)
    assert book.request("b", 1, now=5.0) == []  # not expired, admission full
    (g2,) = book.request("b", 1, now=11.0)
    assert (g2.group, g2.slot) == (g1.group, g1.slot) and g2.grant_id != g1.grant_id
    assert book.complete(_done(g2)) is True
    assert book.complete(_done(g1)) is False  # the first attempt arrives late: not stored twice
    assert book.stats()["reissued"] == 1 and book.stats()["surplus"] == 1


def test_environment_faults_regrant_the_slot_up_to_max_attempts() -> None:
    book = GrantBook(TASKS, GrantConfig(group_size=1, groups_per_step=1, max_staleness=0,
                                        max_attempts=2))  # fmt: skip
    (g,) = book.request("a", 1)
    assert book.complete(_done(g, Status.ENV_ERROR))
    (again,) = book.request("a", 1)
    assert (again.group, again.slot) == (g.group, g.slot)
    t = _done(again, Status.EVAL_ERROR)
    object.__setattr__(t, "error", "checker: KeyError: 'x'")
    assert book.complete(t)
    assert book.stats()["abandoned"] == 1
    # The given-up group frees its place (the window of 1 group was full): a new group of
    # another task opens, and the given-up one is listed with its task and last reason.
    (fresh,) = book.request("a", 1)
    assert fresh.group != g.group
    assert book.stats()["groups_given_up"] == 1
    assert list(book.given_up) == [
        {"group": g.group, "task": g.task_id, "reason": "eval_error: checker: KeyError: 'x'"}
    ]


def _setup_error(g: wire.Grant, env: str, error: str = "setup: EnvHTTPError: 404") -> Trajectory:
    return Trajectory(task_id=g.task_id, turns=(), checker_score=0.0, status=Status.SETUP_ERROR,
                      group_id=g.group, slot=g.slot, actor_id="a", env=env, error=error)  # fmt: skip


def test_a_task_whose_setup_fails_on_two_environments_leaves_the_run() -> None:
    book = GrantBook(TASKS, GrantConfig(group_size=2, groups_per_step=1, max_staleness=0,
                                        shuffle=False, max_attempts=5))  # fmt: skip
    given_up: list[str] = []
    book.on_abandon = given_up.append
    g0, g1 = book.request("a", 2)  # the group of t0
    assert book.complete(_setup_error(g0, "http://env-1"))
    assert "t0" not in book.retired  # one environment is not enough evidence
    assert book.complete(_setup_error(g1, "http://env-2", "setup: open failed"))
    assert book.retired["t0"]["envs"] == 2
    assert "open failed" in book.retired["t0"]["reason"]
    assert given_up == ["t0", "t0"]  # both slots of its open group
    assert book.stats()["groups_given_up"] == 1 and book.stats()["groups_open"] == 0
    # t0 is never granted again; the freed place goes to the other tasks.
    grants = book.request("a", 8)
    assert grants and {g.task_id for g in grants} <= {"t1", "t2"}
    assert "t0" in book.waiting_for() and "1 task(s) out of the run" in book.waiting_for()


def test_setup_failures_in_a_row_on_one_environment_retire_the_task() -> None:
    book = GrantBook(TASKS[:1], GrantConfig(group_size=1, groups_per_step=1, max_staleness=0,
                                            retire_after_failures=3, max_attempts=9))  # fmt: skip
    for _ in range(2):
        (g,) = book.request("a", 1)
        book.complete(_setup_error(g, "http://only-env"))
    assert not book.exhausted
    (g,) = book.request("a", 1)
    book.complete(_setup_error(g, "http://only-env"))
    assert book.exhausted and book.request("a", 1) == []  # nothing can be granted any more


def test_a_setup_that_goes_through_resets_the_streak() -> None:
    book = GrantBook(TASKS[:1], GrantConfig(group_size=1, groups_per_step=100,
                                            retire_after_failures=2, retire_after_envs=9))  # fmt: skip
    for _ in range(5):
        (g,) = book.request("a", 1)
        book.complete(_setup_error(g, "http://e"))
        (g,) = book.request("a", 1)
        book.complete(_done(g, Status.ENV_ERROR))  # set up, then a screenshot failed
    assert not book.retired


def _eval_error(g: wire.Grant, error: str = "metric 0 (exact_match): KeyError: 'x'") -> Trajectory:
    return Trajectory(task_id=g.task_id, turns=(), checker_score=0.0, status=Status.EVAL_ERROR,
                      group_id=g.group, slot=g.slot, actor_id="a", env="http://e", error=error)  # fmt: skip


def test_a_task_whose_checker_keeps_raising_leaves_the_run_naming_the_error() -> None:
    """`retire_after_eval_errors` eval_errors in a row retire the task with its checker's
    first error; an episode of it that was scored resets the count; 0 never retires."""
    cfg = GrantConfig(group_size=1, groups_per_step=100, retire_after_eval_errors=3,
                      max_attempts=99, shuffle=False)  # fmt: skip
    book = GrantBook(TASKS[:1], cfg)
    for _ in range(2):
        (g,) = book.request("a", 1)
        book.complete(_eval_error(g))
    (g,) = book.request("a", 1)
    book.complete(_done(g))  # scored: the checker ran
    for i in range(3):
        assert not book.retired
        (g,) = book.request("a", 1)
        book.complete(_eval_error(g, f"KeyError: {i}"))
    reason = book.retired["t0"]["reason"]
    assert reason.startswith("its checker could not run 3 time(s) in a row")
    assert "first: metric 0 (exact_match): KeyError: 'x'" in reason  # the task's first
    assert reason.endswith("last: KeyError: 2")
    assert book.exhausted and book.checker_failures()["t0"]["count"] == 5

    never = GrantBook(TASKS[:1], dataclasses.replace(cfg, retire_after_eval_errors=0))
    for _ in range(10):
        (g,) = never.request("a", 1)
        never.complete(_eval_error(g))
    assert not never.retired and never.checker_failures()["t0"]["first"].endswith("'x'")


def test_unknown_group_is_accepted() -> None:
    book = GrantBook(TASKS)
    t = Trajectory(task_id="t0", turns=(), checker_score=0, group_id="before-restart/g9", slot=0)
    assert book.complete(t) is True


def test_grant_server_over_a_real_socket() -> None:
    tc = TransportConfig(data="tcp://127.0.0.1:1", control="tcp://127.0.0.1:0")
    book = GrantBook(TASKS, GrantConfig(group_size=2, groups_per_step=1, max_staleness=0))
    server = GrantServer(book, tc)
    endpoint = server.start()

    async def go() -> list[wire.Message | None]:
        link = ActorLink(TransportConfig(data=tc.data, control=endpoint), on_ack=print,
                         actor_id="a")  # fmt: skip
        try:
            out = []
            for req in (1, 2, 3):
                out.append(
                    await link.request(
                        wire.GrantRequest("a", req, 1),
                        lambda m, r=req: isinstance(m, wire.GrantReply) and m.req == r,
                        timeout=30,
                    )
                )
            return out
        finally:
            await link.close()

    try:
        r1, r2, r3 = asyncio.run(go())
    finally:
        server.stop()
    assert isinstance(r1, wire.GrantReply) and isinstance(r2, wire.GrantReply)
    assert [g.slot for g in r1.grants + r2.grants] == [0, 1]
    assert isinstance(r3, wire.GrantReply) and r3.grants == () and r3.retry > 0


@pytest.mark.parametrize("field", ["group_size", "groups_per_step", "max_attempts"])
def test_config_rejects_zero(field: str) -> None:
    from arpo.config import load_config
    from arpo.errors import ConfigError

    with pytest.raises(ConfigError, match=field):
        load_config(GrantConfig, None, [f"{field}=0"])


def test_a_resent_trajectory_still_fills_its_slot_and_others_are_surplus() -> None:
    """Ingest books a trajectory before it is journaled and stored; if that fails (a full
    disk) the actor resends the same trajectory, which must not be taken for a surplus."""
    book = GrantBook(TASKS, GrantConfig(group_size=2, groups_per_step=1, shuffle=False))
    g0, g1 = book.request("a", 2)
    first = _done(g0)
    assert book.complete(first)
    assert book.complete(first)  # the same trajectory again: still its slot
    assert not book.complete(_done(g0))  # another trajectory for a filled slot
    assert book.complete(_done(g1))  # the group is finished now
    assert book.complete(first)
    assert not book.complete(_done(g1))
    st = book.stats()
    assert st["redelivered"] == 2 and st["surplus"] == 2 and st["completed"] == 2


# ---------------------------------------------------------------------------- pools

SIM = [{"id": f"s{i}", "snapshot": "arpo-sim", "config": [], "evaluator": {}} for i in range(3)]
SCENE = [{"id": "s3", "config": [{"type": "sim_scene", "parameters": {}}], "evaluator": {}}]
DESK = [
    {"id": f"d{i}", "snapshot": "local_desktop", "config": [{"type": "open"}]} for i in range(2)
]
OSW = [{"id": "o0", "pool": "osworld", "snapshot": "arpo-sim"}]  # its own field wins
MIXED = SIM + DESK + SCENE + OSW


def test_task_pool_reads_the_field_then_the_sim_markers() -> None:
    from arpo.env.task import task_pool
    from arpo.errors import TaskError

    assert [task_pool(t) for t in MIXED] == ["sim"] * 3 + ["desktop"] * 2 + ["sim", "osworld"]
    with pytest.raises(TaskError, match="pool"):
        task_pool({"id": "x", "pool": ""})
    with pytest.raises(ValueError, match="pool"):
        GrantBook([{"id": "x", "pool": 3}])


def test_each_pool_gets_only_its_tasks_and_groups_still_fill() -> None:
    book = GrantBook(MIXED, GrantConfig(group_size=3, groups_per_step=100, shuffle=True))
    assert book.pools == {"sim": 4, "desktop": 2, "osworld": 1}
    pool_of = {"s0": "sim", "s1": "sim", "s2": "sim", "s3": "sim", "d0": "desktop",
               "d1": "desktop", "o0": "osworld"}  # fmt: skip
    got: list[tuple[str, wire.Grant]] = []
    # Interleaved requests of one grant at a time, as episode coroutines ask.
    for _ in range(24):
        for pool in ("sim", "desktop", "sim", "osworld"):
            got += [(pool, g) for g in book.request(f"actor-{pool}", 1, pool=pool)]
    assert len(got) == 96
    for pool, g in got:
        assert pool_of[g.task_id] == pool, (pool, g.task_id)
        assert json.loads(g.task_json)["id"] == g.task_id
    groups: dict[str, list[int]] = {}
    for _, g in got:
        groups.setdefault(g.group, []).append(g.slot)
    assert all(sorted(s) == [0, 1, 2] for s in groups.values())  # every group filled
    # Each pool visits its own tasks round robin: a round covers all of them.
    sim_tasks = [g.task_id for p, g in got if p == "sim" and g.slot == 0]
    assert len(sim_tasks) == 16 and set(sim_tasks[:4]) == {"s0", "s1", "s2", "s3"}
    desk_tasks = [g.task_id for p, g in got if p == "desktop" and g.slot == 0]
    assert set(desk_tasks[:2]) == {"d0", "d1"} and set(desk_tasks[2:4]) == {"d0", "d1"}
    assert {g.task_id for p, g in got if p == "osworld"} == {"o0"}
    assert all(book.complete(_done(g)) for _, g in got)
    assert book.stats()["completed"] == 96 and book.stats()["groups_open"] == 0


def test_open_slots_of_one_pool_are_not_given_to_another() -> None:
    book = GrantBook(MIXED, GrantConfig(group_size=4, groups_per_step=10, shuffle=False))
    (d,) = book.request("a", 1, pool="desktop")  # a desktop group with 3 open slots
    sims = book.request("b", 4, pool="sim")
    assert {g.group for g in sims} != {d.group} and all(g.task_id.startswith("s") for g in sims)
    assert len({g.group for g in sims}) == 1  # one new sim group, filled in one request
    rest = book.request("c", 3, pool="desktop")
    assert {g.group for g in rest} == {d.group} and [g.slot for g in rest] == [1, 2, 3]
    # Pool "" (an actor that names no pool) takes anything, oldest open slots first.
    (o,) = book.request("d", 1, pool="osworld")
    (anything,) = book.request("e", 1)
    assert (anything.group, anything.slot) == (o.group, 1)


def test_admission_is_global_across_pools() -> None:
    cfg = GrantConfig(group_size=2, groups_per_step=1, max_staleness=1, shuffle=False)
    book = GrantBook(MIXED, cfg)  # version 0: (0 + 1 + 1) * 1 = 2 groups in all
    assert len(book.request("a", 2, pool="sim")) == 2
    assert len(book.request("a", 5, pool="desktop")) == 2
    assert book.request("a", 1, pool="desktop") == [] and book.request("a", 1, pool="sim") == []
    book.set_version(1)
    (g,) = book.request("a", 1, pool="osworld")
    assert g.task_id == "o0" and g.version == 1
    assert book.stats()["groups_opened"] == 3


def test_a_pool_without_tasks_gets_nothing_and_one_warning(caplog) -> None:
    book = GrantBook(SIM, GrantConfig(group_size=2))
    with caplog.at_level("WARNING", logger="arpo.service.grants"):
        assert book.request("a", 1, pool="desktop") == []
        assert book.request("b", 3, pool="desktop") == []
    (rec,) = caplog.records
    assert "'desktop'" in rec.getMessage() and "'sim' (3 tasks)" in rec.getMessage()
    assert book.stats()["unknown_pool"] == 2 and book.stats()["groups_opened"] == 0
    assert len(book.request("a", 2, pool="sim")) == 2


def test_grant_server_routes_by_the_request_pool() -> None:
    tc = TransportConfig(data="tcp://127.0.0.1:1", control="tcp://127.0.0.1:0")
    book = GrantBook(MIXED, GrantConfig(group_size=2, groups_per_step=10, retry_s=0.25))
    server = GrantServer(book, tc)
    endpoint = server.start()

    async def go() -> list[wire.Message | None]:
        link = ActorLink(TransportConfig(data=tc.data, control=endpoint), on_ack=print,
                         actor_id="a")  # fmt: skip
        try:
            out = []
            for req, pool in enumerate(["desktop", "sim", "osworld", "nowhere"]):
                out.append(
                    await link.request(
                        wire.GrantRequest("a", req, 2, pool),
                        lambda m, r=req: isinstance(m, wire.GrantReply) and m.req == r,
                        timeout=30,
                    )
                )
            return out
        finally:
            await link.close()

    try:
        desk, sim, osw, nowhere = asyncio.run(go())
    finally:
        server.stop()
    assert {g.task_id for g in desk.grants} <= {"d0", "d1"} and len(desk.grants) == 2
    assert {g.task_id for g in sim.grants} <= {"s0", "s1", "s2", "s3"} and len(sim.grants) == 2
    assert [g.task_id for g in osw.grants] == ["o0", "o0"]
    assert nowhere.grants == () and nowhere.retry == 0.25


def test_an_expired_grant_is_reissued_only_within_its_pool() -> None:
    book = GrantBook(MIXED, GrantConfig(group_size=1, groups_per_step=2, max_staleness=0,
                                        grant_timeout_s=10.0, shuffle=False))  # fmt: skip
    (d,) = book.request("dead-desktop-actor", 1, now=0.0, pool="desktop")
    (s,) = book.request("a", 1, now=20.0, pool="sim")  # a new sim group, not the expired slot
    assert s.task_id.startswith("s") and s.group != d.group
    assert book.request("a", 1, now=21.0, pool="sim") == []  # admission full (2 groups)
    (again,) = book.request("b", 1, now=22.0, pool="desktop")
    assert (again.group, again.slot) == (d.group, d.slot) and again.grant_id != d.grant_id
    assert book.stats()["reissued"] == 1


def test_groups_the_learner_dropped_free_their_places() -> None:
    """A learner that drops groups (too stale) without stepping must still get new ones:
    otherwise admission, counted in versions, would wait forever."""
    cfg = GrantConfig(group_size=1, groups_per_step=2, max_staleness=1, shuffle=False)
    book = GrantBook(TASKS, cfg)
    assert len(book.request("a", 100)) == 4 and book.request("a", 1) == []
    book.set_dropped(3)  # three groups taken out of the store and dropped, version still 0
    assert len(book.request("a", 100)) == 3
    book.set_dropped(2)  # never goes back
    assert book.request("a", 1) == []
    book.set_version(1)  # two groups trained: two more places, and no more
    assert len(book.request("a", 100)) == 2 and book.request("a", 1) == []


def test_task_ids_that_could_forge_ledger_lines_are_refused() -> None:
    with pytest.raises(ValueError, match=r"task id 'a\\tb' contains"):
        GrantBook([{"id": "a\tb", "instruction": "x"}])

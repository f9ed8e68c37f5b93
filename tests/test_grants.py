"""Task grants: groups fill to their size, staleness admission, re-issue, surplus, env faults."""

from __future__ import annotations

import asyncio
import json

import pytest

from arpo import wire
from arpo.learner.grants import GrantBook, GrantConfig, GrantServer
from arpo.record import Status, Trajectory
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
    assert book.complete(_done(again, Status.EVAL_ERROR))
    assert book.request("a", 1) == []  # given up after 2 attempts; admission is full
    assert book.stats()["abandoned"] == 1


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

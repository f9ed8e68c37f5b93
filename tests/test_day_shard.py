"""The daily shards of test-all's long sweeps (tests/day_shard.py) cover every task once."""

from __future__ import annotations

import pytest
from day_shard import SHARDS, day_shard


def test_the_shards_cover_every_task_once_and_every_domain() -> None:
    from arpo_envs.tasks import SUITE_DIR

    from arpo.env import load_tasks

    tasks = load_tasks(SUITE_DIR)
    shards = [day_shard(tasks, "", day)[0] for day in range(SHARDS)]
    ids = [t.id for shard in shards for t in shard]
    assert sorted(ids) == sorted(t.id for t in tasks)  # all of them, each once
    for shard in shards:
        assert {t.domain for t in shard} == {t.domain for t in tasks}
    assert day_shard(tasks, "", 0, offset=1)[0] == shards[1]
    assert day_shard(tasks, "1/3", 0)[0] == shards[1]
    assert len(day_shard(tasks, "all", 0)[0]) == len(tasks)
    with pytest.raises(ValueError, match="ARPO_VM_SUITE_SHARD"):
        day_shard(tasks, "3/3", 0, var="ARPO_VM_SUITE_SHARD")

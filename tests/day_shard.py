"""One shard of a task sweep per day, so that `make test-all` fits its 90 minutes and runs on
consecutive days still play every task.

A sweep over the local suite (on VMs, on the local desktop with the project's checker, or
with OSWorld's evaluator beside it) takes longer than test-all can give it. Each such test
plays one shard: `spec` is `k/n` (shard k of n, from 0) or `all` from the sweep's environment
variable, or empty for shard `(day + offset) % SHARDS` of SHARDS. Shards are dealt round-robin
over the tasks sorted by (domain, id), so each holds every domain. Two sweeps that check the
same tasks in different ways take different offsets, so that one day covers more tasks.
"""

from __future__ import annotations

import os
import time

from arpo.env.task import Task

SHARDS = 3
"""test-all plays a third of each long sweep per day."""


def today() -> int:
    """Days since the epoch (UTC): the day a shard is chosen by."""
    return int(time.time() // 86400)


def day_shard(
    tasks: list[Task], spec: str, day: int, offset: int = 0, var: str = "ARPO_SUITE_SHARD"
) -> tuple[list[Task], str]:
    """The tasks of one shard and its name (`k/n` or `all`). `var` names the environment
    variable `spec` came from, for the error."""
    ordered = sorted(tasks, key=lambda t: (t.domain, t.id))
    if spec == "all":
        return ordered, "all"
    if spec:
        k, _, n = spec.partition("/")
        if not (k.isdigit() and n.isdigit() and 0 <= int(k) < int(n)):
            raise ValueError(f"{var}={spec!r}: give k/n with 0 <= k < n, or all")
        shard, count = int(k), int(n)
    else:
        shard, count = (day + offset) % SHARDS, SHARDS
    return ordered[shard::count], f"{shard}/{count}"


def sweep_shard(tasks: list[Task], var: str, offset: int = 0) -> tuple[list[Task], str]:
    """Today's shard of `tasks`, or the one `var` in the environment names."""
    return day_shard(tasks, os.environ.get(var, ""), today(), offset, var)

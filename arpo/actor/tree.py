"""Tree rollouts: one grant fills several slots of a group from one environment that forks.

    results = await run_tree(env, grant, policy, EpisodeConfig(), actor_id="actor-0")
    for slot, grant_id, traj in results: ...   # traj None: the policy failed, give it back

A tree grant (`wire.Grant.tree`, from `GrantConfig.tree_slots`) holds `s` slots of one
group. The actor sets the task up once and runs one episode, the root, holding all `s`
slots. The branch rule: before turn `k * every` (k = 1, 2, ...), a node still holding
more than one slot saves its environment (`Environment.snapshot`) and forks it
(`Provider.fork`) into c = min(width, its slots) children, each a new environment in
exactly that state; the node's slots are split among them in order, as evenly as
possible (the first ones one more). Each child continues the episode from the same
context (turns, prompt, screen) with its own samples, and branches again by the same
rule. A node with one slot runs to its end and is a leaf: one trajectory filling that
slot, holding every turn from the task's start (`Trajectory.branch` says which turns it
shares with which leaves; the learner trains them once, `arpo.learner.tree`).

Edge cases, each accounted for (every slot gets one trajectory, or its grant is given
back):
- A node that ends (DONE / FAIL, a response that does not parse, the step budget)
  while holding several slots keeps the first; the others become more children of the
  branch point it came from (forked from the same saved state, so they are its
  siblings). A root that ends before its first branch point passes its other slots to a
  new root started from the task's start (saved right after the setup: no second
  setup), the root of another tree of the group (`Branch.tree` "<grant id>#<n>"). When
  the start could not be saved, they are given back (`tree_ended`) and granted again as
  plain episodes.
- An environment that cannot fork (`ForkUnsupported`: the local desktop) runs the grant's
  first slot as a plain episode and gives the others back (`cannot_fork`); the actor
  logs it once per environment. The learner then gets plain groups.
- A fork that fails (an `EnvError`): the node goes on with its first slot; each of its
  other slots is delivered as `env_error` with the reason ("fork: ...") and no turns (it
  ran none of its own), so the learner grants it again (and counts it).
- A step or checker failure of a child is that leaf's `env_error` / `eval_error`; a
  policy failure gives that leaf's grant back; the other leaves go on.
- The saved states and their clones are released when the tree ends, whatever happened.

Setup failures end the whole tree before anything is sampled: the first slot carries the
failure (setup_error or env_error, as `Environment.prepare` decides), the others are given back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from arpo import wire
from arpo.actor.episode import (
    EpisodeConfig,
    EpisodeRun,
    conclude,
    play,
    read_task,
    start_run,
    trajectory,
)
from arpo.env.environment import Environment
from arpo.errors import EnvError, ForkUnsupported
from arpo.record import Branch, Status, Trajectory

log = logging.getLogger("arpo.actor.tree")

Result = tuple[int, str, "Trajectory | None"]
"""(slot, grant id, trajectory); None: give the grant back (`release` says why)."""


@dataclass
class _Fork:
    """A branch point: the saved state (`Environment.snapshot` handle), the run as it was there."""

    handle: str
    base: EpisodeRun
    path: tuple[int, ...]
    steps: tuple[int, ...]
    env: Environment
    """The environment that was saved (its clones' parent)."""
    tree: str = ""
    children: int = 0
    """Children forked so far (the next one's index)."""


@dataclass
class _Node:
    env: Environment
    run: EpisodeRun
    slots: list[int]
    path: tuple[int, ...] = ()
    steps: tuple[int, ...] = ()
    parent: _Fork | None = None
    start: int = 0
    """Turns it had when it started (a child starts at its branch point)."""
    tree: str = ""
    """Its tree's id (`Branch.tree`)."""


@dataclass
class TreeStats:
    forks: int = 0
    clones: int = 0
    fork_s: float = 0.0
    fork_errors: int = 0
    unsupported: int = 0
    released: dict[str, int] = field(default_factory=dict)


def _split(slots: list[int], parts: int) -> list[list[int]]:
    """`slots` in `parts` runs in order, as even as possible (the first ones longer)."""
    q, r = divmod(len(slots), parts)
    out, i = [], 0
    for k in range(parts):
        n = q + (1 if k < r else 0)
        out.append(slots[i : i + n])
        i += n
    return out


async def run_tree(
    env: Environment,
    grant: wire.Grant,
    policy: Any,
    cfg: EpisodeConfig,
    *,
    actor_id: str,
    on_step: Any = None,
    stats: TreeStats | None = None,
) -> tuple[list[Result], dict[str, str]]:
    """Run tree grant `grant` on `env`: a result per slot of `grant.tree`, and the grant ids
    to give back with their reason (`policy_error`, `tree_ended`, `cannot_fork`)."""
    spec = grant.tree
    assert spec is not None, "run_tree needs a tree grant"
    stats = stats if stats is not None else TreeStats()
    gid_of = dict(zip(spec.slots, spec.grant_ids, strict=True))
    results: list[Result] = []
    give_back: dict[str, str] = {}
    t_start = time.perf_counter()

    def leaf(node: _Node | None, slot: int, status: Status, score: float = 0.0,
             error: str = "", run: EpisodeRun | None = None) -> None:  # fmt: skip
        r = run if run is not None else (node.run if node is not None else None)
        timings = dict(r.timings) if r is not None else {}
        timings["total"] = time.perf_counter() - t_start
        branch = None
        if node is not None:
            branch = Branch(node.tree, node.path, node.steps)
        traj = trajectory(
            grant, r.turns if r is not None else (), score, r.fmt if r is not None else 0.0,
            status, cfg, actor_id=actor_id, env=(node.env.url if node else env.url),
            timings=timings, error=error, slot=slot, branch=branch,
        )  # fmt: skip
        results.append((slot, gid_of[slot], traj))

    def back(slots: list[int], reason: str) -> None:
        for sl in slots:
            give_back[gid_of[sl]] = reason
            results.append((sl, gid_of[sl], None))
        stats.released[reason] = stats.released.get(reason, 0) + len(slots)

    task = read_task(grant)
    if isinstance(task, str):
        leaf(None, spec.slots[0], Status.SETUP_ERROR, error=task)
        back(list(spec.slots[1:]), "tree_ended")
        return results, give_back
    t0 = time.perf_counter()
    failed = await env.prepare(task)
    if failed is not None:
        leaf(None, spec.slots[0], failed.status, error=failed.reason)
        back(list(spec.slots[1:]), "tree_ended")
        return results, give_back
    root = _Node(env, start_run(task, grant, policy, cfg), list(spec.slots), tree=grant.grant_id)
    root.run.timings["reset"] = time.perf_counter() - t0
    forks: list[_Fork] = []
    clones: list[Environment] = []
    roots = 1
    # The task's start, saved: slots a root could not use (it ended before its first branch
    # point) start from here as the roots of more trees, without another setup.
    start: _Fork | None = None
    if env.can_fork:
        try:
            start = _Fork(await env.snapshot(), root.run.branch(0), (), (), env)
            forks.append(start)
        except EnvError as e:  # ForkUnsupported included: the first branch point says so
            log.info("grant %s: the start state was not saved (%s)", grant.grant_id, e)

    async def clone_envs(fork: _Fork, n: int) -> list[Environment]:
        t = time.perf_counter()
        out = await fork.env.clones(fork.handle, n, task)
        stats.fork_s += time.perf_counter() - t
        stats.clones += len(out)
        clones.extend(out)
        return out

    async def grow(node: _Node) -> None:
        every = spec.every
        run = node.run
        try:
            while not run.over:
                turns = len(run.turns)
                if len(node.slots) > 1 and turns > node.start and turns % every == 0:
                    await branch(node)
                    return
                nxt = (turns // every + 1) * every if len(node.slots) > 1 else run.budget
                await play(node.env, run, cfg, nxt, grant_id=grant.grant_id, on_step=on_step)
        except EnvError as e:
            log.warning("env %s: step failed, leaf is env_error: %s", node.env.url, e)
            await finish(node, Status.ENV_ERROR, 0.0, f"step: {type(e).__name__}: {e}")
            return
        except Exception:  # the policy failed: its slots go back
            log.exception("grant %s: the policy failed in a tree", grant.grant_id)
            back(node.slots, "policy_error")
            return
        status, score, error = await conclude(node.env, run)
        await finish(node, status, score, error)

    async def finish(node: _Node, status: Status, score: float, error: str) -> None:
        nonlocal roots
        leaf(node, node.slots[0], status, score, error)
        extra = node.slots[1:]
        if not extra:
            return
        if node.parent is None:
            if start is None:
                back(extra, "tree_ended")
                return
            try:
                (ce,) = await clone_envs(start, 1)
            except EnvError as e:
                stats.fork_errors += 1
                log.warning("grant %s: fork of the start failed: %s", grant.grant_id, e)
                for sl in extra:
                    leaf(None, sl, Status.ENV_ERROR, error=f"fork: {type(e).__name__}: {e}")
                return
            roots += 1
            tree = f"{grant.grant_id}#{roots}"
            await grow(_Node(ce, start.base.branch(roots), extra, tree=tree))
            return
        # More children of the branch point it came from: its siblings.
        await spawn(node.parent, [[s] for s in extra] if len(extra) == 1 else
                    _split(extra, min(spec.width, len(extra))))  # fmt: skip

    async def spawn(fork: _Fork, parts: list[list[int]]) -> None:
        try:
            envs = await clone_envs(fork, len(parts))
        except EnvError as e:
            stats.fork_errors += 1
            log.warning("grant %s: fork failed: %s", grant.grant_id, e)
            for part in parts:
                for sl in part:
                    leaf(None, sl, Status.ENV_ERROR, error=f"fork: {type(e).__name__}: {e}")
            return
        kids = []
        for ce, part in zip(envs, parts, strict=True):
            i = fork.children
            fork.children += 1
            kids.append(_Node(ce, fork.base.branch(i), part, (*fork.path, i), fork.steps,
                              fork, len(fork.base.turns), fork.tree))  # fmt: skip
        await asyncio.gather(*(grow(k) for k in kids))

    async def branch(node: _Node) -> None:
        turns = len(node.run.turns)
        try:
            if not node.env.can_fork:
                raise ForkUnsupported(f"{node.env.url}: its provider cannot fork")
            t = time.perf_counter()
            handle = await node.env.snapshot()
            stats.fork_s += time.perf_counter() - t
        except ForkUnsupported as e:
            stats.unsupported += 1
            log.info("grant %s: %s; its slots but one are given back", grant.grant_id, e)
            back(node.slots[1:], "cannot_fork")
            node.slots = node.slots[:1]
            return await grow(node)
        except EnvError as e:
            stats.fork_errors += 1
            log.warning("grant %s: saving %s failed: %s", grant.grant_id, node.env.url, e)
            for sl in node.slots[1:]:
                leaf(None, sl, Status.ENV_ERROR, error=f"fork: {type(e).__name__}: {e}")
            node.slots = node.slots[:1]
            return await grow(node)
        stats.forks += 1
        fork = _Fork(handle, node.run, node.path, (*node.steps, turns), node.env, node.tree)
        forks.append(fork)
        await spawn(fork, _split(node.slots, min(spec.width, len(node.slots))))

    try:
        await grow(root)
    finally:
        # Saved states first: a clone's own saved state is released through its client.
        for f in reversed(forks):
            try:
                await f.env.release(f.handle)
            except EnvError as e:
                log.warning("grant %s: releasing a saved state failed: %s", grant.grant_id, e)
        for ce in clones:
            env.busy_s += ce.busy_s
            await ce.close()
    return results, give_back

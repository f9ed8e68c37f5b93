"""OSWorld's result / expected getters, async, against an `EnvClient`.

A getter turns a getter spec of the task (`{"type": "vm_file", "path": ..., "dest": ...}`) into
the value a metric checks: a local file path, a command's output, a rules dict, a JSON value.
As in OSWorld, a file that does not exist on the environment gives `None` (the metric then
scores 0: the agent did not produce it); any other failure raises.

Implemented: vm_file, cloud_file, cache_file, rule, vm_command_line, vm_command_error,
vm_terminal_output, vm_screen_size, accessibility_tree and the project's sim_state.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from arpo.env.cache import FileCache
from arpo.env.client import EnvClient
from arpo.errors import EnvHTTPError, EvalError


@dataclass(frozen=True, slots=True)
class GetterContext:
    """What a getter may use: the environment, the local file cache, the episode's work dir."""

    client: EnvClient
    cache: FileCache
    work_dir: Path


Getter = Callable[[GetterContext, Mapping[str, Any]], Awaitable[Any]]
GETTERS: dict[str, Getter] = {}


def getter(name: str) -> Callable[[Getter], Getter]:
    def register(fn: Getter) -> Getter:
        GETTERS[name] = fn
        return fn

    return register


def _local_name(dest: str) -> str:
    """A dest is a file name in the work dir; strip any directories so it cannot escape it."""
    name = Path(str(dest)).name
    if not name or name in (".", ".."):
        raise EvalError(f"getter dest {dest!r} is not a file name")
    return name


def _paths_and_dests(spec: Mapping[str, Any], *, time_suffix: bool) -> tuple[list, list, set[int]]:
    if spec.get("multi", False):
        paths, dests = list(spec["path"]), list(spec["dest"])
    else:
        paths, dests = [spec["path"]], [spec["dest"]]
        if time_suffix and spec.get("time_suffix", False):
            stamp = datetime.now().strftime(spec.get("time_format", "%Y_%m_%d"))

            def stamped(p: str) -> str:
                if "." not in p:
                    return p
                head, tail = p.split(".", 1)
                return f"{head}{stamp}.{tail.split('.')[0]}"

            paths, dests = [stamped(p) for p in paths], [stamped(d) for d in dests]
    if len(paths) != len(dests):
        raise EvalError(f"getter has {len(paths)} paths but {len(dests)} dests")
    return paths, dests, set(spec.get("gives", [0]))


def _give(values: list[Any]) -> Any:
    return values[0] if len(values) == 1 else values


@getter("vm_file")
async def get_vm_file(ctx: GetterContext, spec: Mapping[str, Any]) -> Any:
    """Download file(s) from the environment into the work dir; a missing file gives None."""
    paths, dests, gives = _paths_and_dests(spec, time_suffix=True)
    out: list[Any] = []
    for i, (p, d) in enumerate(zip(paths, dests, strict=True)):
        try:
            data = await ctx.client.get_file(p)
        except EnvHTTPError as e:
            if e.status != 404:
                raise
            if i in gives:
                out.append(None)
            continue
        local = ctx.work_dir / _local_name(d)
        await asyncio.to_thread(local.write_bytes, data)
        if i in gives:
            out.append(str(local))
    return _give(out)


@getter("cloud_file")
async def get_cloud_file(ctx: GetterContext, spec: Mapping[str, Any]) -> Any:
    """Reference file(s) by URL, from the local file cache (copied into the work dir)."""
    paths, dests, gives = _paths_and_dests(spec, time_suffix=False)
    out: list[Any] = []
    for i, (url, d) in enumerate(zip(paths, dests, strict=True)):
        src = ctx.cache.lookup(url, _local_name(d))
        local = ctx.work_dir / _local_name(d)
        await asyncio.to_thread(shutil.copyfile, src, local)
        if i in gives:
            out.append(str(local))
    return _give(out)


@getter("cache_file")
async def get_cache_file(ctx: GetterContext, spec: Mapping[str, Any]) -> str:
    """A file written during the episode (an `execute` step's `stdout`), else one from the cache."""
    rel = str(spec["path"])
    local = ctx.work_dir / rel
    if local.is_file():
        return str(local)
    if ctx.cache.root is not None and (ctx.cache.root / rel).is_file():
        return str(ctx.cache.root / rel)
    raise EvalError(
        f"cache_file: {rel!r} is neither in the episode's work dir {ctx.work_dir} nor in the file "
        f"cache {ctx.cache.root}"
    )


@getter("rule")
async def get_rule(ctx: GetterContext, spec: Mapping[str, Any]) -> Any:
    """The spec's `rules`, as is."""
    return spec["rules"]


async def _command(ctx: GetterContext, spec: Mapping[str, Any], field: str) -> str | None:
    try:
        res = await ctx.client.execute(spec["command"], shell=bool(spec.get("shell", False)))
    except EnvHTTPError:
        return None  # OSWorld gives None when the server reports a failure to run the command
    return res.output if field == "output" else res.error


@getter("vm_command_line")
async def get_vm_command_line(ctx: GetterContext, spec: Mapping[str, Any]) -> str | None:
    """What a command run on the environment printed (`/execute` output)."""
    return await _command(ctx, spec, "output")


@getter("vm_command_error")
async def get_vm_command_error(ctx: GetterContext, spec: Mapping[str, Any]) -> str | None:
    """What a command run on the environment wrote to stderr."""
    return await _command(ctx, spec, "error")


@getter("vm_terminal_output")
async def get_vm_terminal_output(ctx: GetterContext, spec: Mapping[str, Any]) -> str | None:
    return await ctx.client.terminal()


@getter("vm_screen_size")
async def get_vm_screen_size(ctx: GetterContext, spec: Mapping[str, Any]) -> dict[str, int]:
    w, h = await ctx.client.screen_size()
    return {"width": w, "height": h}


@getter("accessibility_tree")
async def get_accessibility_tree(ctx: GetterContext, spec: Mapping[str, Any]) -> str:
    return await ctx.client.accessibility()


@getter("sim_state")
async def get_sim_state(ctx: GetterContext, spec: Mapping[str, Any]) -> Any:
    """One JSON value of the simulated desktop's state: `POST /sim/state {"path": ...}`."""
    return await ctx.client.sim_state(str(spec["path"]))

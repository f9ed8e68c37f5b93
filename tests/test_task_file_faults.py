"""Task files under hostile conditions: whatever sits where a task file should be (a FIFO,
`/dev/zero`, a directory), on the learner's side or in an actor's cache, is refused or
replaced without blocking a thread; a local cache fault is the actor host's error, never the
task's; the learner's control link bounds the bytes it queues for file replies, keeps
answering grants, and logs a flood of bad requests briefly while counting all of it."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
from arpo_envs.sim.server import SimConfig, running
from arpo_envs.sim.tasks import generate_tasks

from arpo import wire
from arpo.config import load_config
from arpo.env.environment import Environment
from arpo.env.runner import RunnerConfig
from arpo.env.task import Task
from arpo.env.taskfiles import CHUNK_BYTES, BlobCache, FileRef, FileSource, TaskFiles
from arpo.errors import BlobCacheError, ConfigError, EnvError, TaskError
from arpo.record import Status
from arpo.service.grants import GrantBook, GrantConfig, GrantServer
from arpo.transport import ActorLink, TransportConfig, connect_dealer

GRANT_TASKS = [{"id": f"g{i}", "instruction": "x", "evaluator": {"func": "x"}} for i in range(2)]


def _upload_task(tid: str, names: list[str]) -> dict[str, Any]:
    files = [{"local_path": n, "path": f"/home/user/{n}"} for n in names]
    return {"id": tid, "instruction": "x", "evaluator": {"func": "x"},
            "config": [{"type": "upload_file", "parameters": {"files": files}}]}  # fmt: skip


def _served(folder: Path, files: dict[str, bytes]) -> tuple[TaskFiles, dict[str, FileRef]]:
    """A TaskFiles index serving `files` (name -> bytes) from `folder`, and their refs."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    index = TaskFiles()
    task = index.address(_upload_task("t", list(files)), folder)
    entries = task["config"][0]["parameters"]["files"]
    refs = {e["local_path"]: FileRef.of(e) for e in entries}
    return index, {k: v for k, v in refs.items() if v is not None}


def _in_thread(fn: Callable[[], Any], timeout: float = 10.0) -> Any:
    """fn()'s result, run on a daemon thread; fails the test if it has not returned within
    `timeout` (a thread blocked in open() or reading /dev/zero never does)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still running after {timeout} s (blocked on a file)"
    if "error" in out:
        raise out["error"]
    return out["value"]


def _unblock(fifo: Path) -> None:
    """Open `fifo`'s write end and close it, so a reader stuck in open() gets EOF."""
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "empty_dir", "link_to_a_copy"])
def test_a_cache_entry_that_is_not_a_regular_file_is_replaced_never_opened(
    tmp_path: Path, kind: str
) -> None:
    empty, text = b"", b"the task's notes\n" * 100
    index, refs = _served(tmp_path / "tasks", {"empty.bin": empty, "notes.txt": text})
    name, want = ("empty.bin", empty) if kind in ("fifo", "dev_zero") else ("notes.txt", text)
    ref = refs[name]
    cache = BlobCache(tmp_path / "cache")
    bad = cache.path_of(ref.sha256)
    bad.parent.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(bad)
    elif kind == "dev_zero":
        bad.symlink_to("/dev/zero")
    elif kind == "empty_dir":
        bad.mkdir()
    else:  # a link to a file with the right bytes: still not what `put` writes
        (tmp_path / "copy").write_bytes(want)
        bad.symlink_to(tmp_path / "copy")
    src = FileSource.local(index, cache)
    try:
        got = _in_thread(lambda: asyncio.run(src.path(ref)))
    finally:
        _unblock(bad)
    assert got == bad and got.is_file() and not got.is_symlink()
    assert got.read_bytes() == want
    assert (src.hits, src.fetched, cache.repaired) == (0, 1, 1)
    # the repaired copy is a hit from now on
    assert _in_thread(lambda: asyncio.run(src.path(ref))) == bad and src.hits == 1


def _sim_task_uploading(ref: FileRef) -> Task:
    raw = generate_tasks("click_button", 1, seed=5)[0]
    entry = {"local_path": "notes.txt", "path": "/home/user/notes.txt",
             "sha256": ref.sha256, "size": ref.size}  # fmt: skip
    raw["config"].insert(0, {"type": "upload_file", "parameters": {"files": [entry]}})
    return Task.from_dict(raw, domain="sim")


def test_a_cache_fault_is_the_hosts_error_not_the_tasks(tmp_path: Path) -> None:
    text = b"notes for the desktop\n" * 50
    index, refs = _served(tmp_path / "tasks", {"notes.txt": text})
    ref = refs["notes.txt"]
    cache = BlobCache(tmp_path / "cache")
    src = FileSource.local(index, cache)
    task = _sim_task_uploading(ref)
    # A folder with something in it at the blob's path: not removed (it is not ours to
    # delete), an error naming the path and the fix, of the environment's kind.
    bad = cache.path_of(ref.sha256)
    (bad / "keep").mkdir(parents=True)
    with pytest.raises(BlobCacheError) as e:
        asyncio.run(src.path(ref))
    assert isinstance(e.value, EnvError) and not isinstance(e.value, TaskError)
    assert str(bad) in str(e.value) and "a folder" in str(e.value)
    assert "file_cache_dir" in str(e.value)

    async def main() -> None:
        async with running([SimConfig(port=0)]) as (url,):
            env = Environment(
                0, url, RunnerConfig(reset_before_setup=True, sleep_scale=0.0), files=src
            )
            try:
                failure = await env.prepare(task)
                assert failure is not None and failure.status == Status.ENV_ERROR, failure
                assert "BlobCacheError" in failure.reason and str(bad) in failure.reason
                assert task.id not in env.quarantined and env.healthy
                # repaired by hand: the same task sets up on the same environment
                (bad / "keep").rmdir()
                bad.rmdir()
                assert await env.prepare(task) is None
                assert cache.path_of(ref.sha256).read_bytes() == text
            finally:
                await env.close()

    asyncio.run(main())


def _control(endpoint: str, **kw: Any) -> TransportConfig:
    return TransportConfig(data="tcp://127.0.0.1:1", control=endpoint, **kw)


def test_a_fifo_swapped_in_for_a_task_file_is_refused_and_grants_go_on(tmp_path: Path) -> None:
    index, refs = _served(tmp_path / "tasks", {"empty.bin": b""})
    fifo = tmp_path / "tasks" / "empty.bin"
    fifo.unlink()
    os.mkfifo(fifo)  # after the pool was loaded
    ref = refs["empty.bin"]
    book = GrantBook(GRANT_TASKS, GrantConfig(group_size=2, groups_per_step=1, max_staleness=0))
    server = GrantServer(book, _control("tcp://127.0.0.1:0"), files=index)
    endpoint = server.start()

    async def go() -> tuple[Any, Any]:
        link = ActorLink(_control(endpoint), on_ack=print, actor_id="a")
        try:
            chunk = await link.request(
                wire.FileRequest(ref.sha256, 0),
                lambda m: isinstance(m, wire.FileChunk) and m.sha256 == ref.sha256,
                timeout=5,
            )
            grants = await link.request(
                wire.GrantRequest("a", 1, 1),
                lambda m: isinstance(m, wire.GrantReply) and m.req == 1,
                timeout=5,
            )
            return chunk, grants
        finally:
            await link.close()

    try:
        chunk, grants = asyncio.run(go())
    finally:
        _unblock(fifo)
        server.stop()
    assert isinstance(chunk, wire.FileChunk), "the control link did not answer"
    assert "not a regular file" in chunk.error and not chunk.data
    assert isinstance(grants, wire.GrantReply) and len(grants.grants) == 1
    assert index.refused == 1


def _wait(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_file_replies_to_peers_that_read_nothing_stay_under_the_bound(tmp_path: Path) -> None:
    data = os.urandom(3 * CHUNK_BYTES)
    index, refs = _served(tmp_path / "tasks", {"big.bin": data})
    ref = refs["big.bin"]
    bound = 4 * CHUNK_BYTES
    book = GrantBook(GRANT_TASKS, GrantConfig(group_size=2, groups_per_step=1, max_staleness=0))
    server = GrantServer(
        book, _control("tcp://127.0.0.1:0", max_queued_file_bytes=bound), files=index
    )
    endpoint = server.start()
    ctx = zmq.Context()
    # Six peers that ask for 300 chunks each and read nothing (a small receive side, so the
    # replies stay queued on the learner).
    flood_cfg = _control(endpoint, rcvhwm=1, kernel_buffer_bytes=64 << 10, linger_ms=0)
    peers = [connect_dealer(ctx, endpoint, flood_cfg) for _ in range(6)]
    try:
        for i in range(300):
            for p in peers:
                p.send_multipart(wire.encode(wire.FileRequest(ref.sha256, i % 3)))
        handled = lambda: index.served_chunks + server.rejected["file_busy"]  # noqa: E731
        _wait(lambda: handled() >= 1800, "the learner to handle every request")
        assert server.rejected["file_busy"] > 0
        assert 0 < server.file_queued_bytes <= server.file_queued_peak <= bound

        async def ask() -> tuple[Any, bytes]:
            link = ActorLink(_control(endpoint), on_ack=print, actor_id="a")

            async def fetch(sha: str, index: int) -> Any:
                m = await link.request(
                    wire.FileRequest(sha, index),
                    lambda m: isinstance(m, wire.FileChunk) and m.index == index,
                    timeout=5,
                )
                return None if m is None else (m.data, m.total, m.size, m.error)

            try:
                grants = await link.request(
                    wire.GrantRequest("a", 1, 1),
                    lambda m: isinstance(m, wire.GrantReply) and m.req == 1,
                    timeout=5,
                )
                # the queue is full: the actor is told to wait, and gets the file once the
                # peers that read nothing are gone
                src = FileSource(BlobCache(tmp_path / "cache"), fetch)
                got = asyncio.create_task(src.path(ref))
                await asyncio.sleep(0.5)
                assert not got.done() and src.busy > 0
                for p in peers:
                    p.close(0)
                return grants, (await asyncio.wait_for(got, 30)).read_bytes()
            finally:
                await link.close()

        grants, fetched = asyncio.run(ask())
        assert isinstance(grants, wire.GrantReply) and len(grants.grants) == 1
        assert fetched == data
        # what the departed peers left queued is freed
        _wait(lambda: server.file_queued_bytes == 0, "the queued replies to be freed")
        assert server.file_queued_peak <= bound
    finally:
        for p in peers:
            p.close(0)
        ctx.term()
        server.stop()


def test_the_bound_on_queued_file_replies_holds_at_least_one_chunk() -> None:
    with pytest.raises(ConfigError, match=r"max_queued_file_bytes.*at least 4194304"):
        load_config(TransportConfig, None, [f"max_queued_file_bytes={CHUNK_BYTES - 1}"])
    assert load_config(TransportConfig, None, []).max_queued_file_bytes == 256 << 20


def test_a_flood_of_bad_file_requests_is_counted_whole_and_logged_briefly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    index, _ = _served(tmp_path / "tasks", {"a.txt": b"a"})
    book = GrantBook(GRANT_TASKS, GrantConfig(group_size=2, groups_per_step=1, max_staleness=0))
    server = GrantServer(book, _control("tcp://127.0.0.1:0"), files=index)
    unknown = wire.encode(wire.FileRequest(hashlib.sha256(b"nothing").hexdigest(), 0))
    malformed = [b"\x00not a wire message", b""]
    with caplog.at_level(logging.INFO, logger="arpo.service.grants"):
        for _ in range(3000):
            server.handle(list(unknown))
            server.handle(list(malformed))
    lines = [r for r in caplog.records if r.name == "arpo.service.grants"]
    assert 2 <= len(lines) <= 25, len(lines)
    assert index.refused == 3000 and server.rejected["file_refused"] == 3000
    assert server.rejected["malformed"] == 3000


def test_pool_loading_says_a_fifo_is_not_a_regular_file(tmp_path: Path) -> None:
    folder = tmp_path / "tasks"
    folder.mkdir()
    os.mkfifo(folder / "pipe.bin")
    with pytest.raises(TaskError, match=r"'pipe\.bin' is not a regular file \(a FIFO") as e:
        _in_thread(lambda: TaskFiles().address(_upload_task("t", ["pipe.bin"]), folder))
    assert "in none of" not in str(e.value)
    _unblock(folder / "pipe.bin")


def test_pool_loading_refuses_a_huge_file_before_hashing_it(tmp_path: Path) -> None:
    folder = tmp_path / "tasks"
    folder.mkdir()
    with open(folder / "huge.bin", "wb") as f:
        f.truncate(4 << 30)  # sparse: no disk used
    t0 = time.perf_counter()
    with pytest.raises(TaskError, match=r"'huge.bin' has 4294967296 bytes, above"):
        TaskFiles().address(_upload_task("t", ["huge.bin"]), folder)
    assert time.perf_counter() - t0 < 1.0  # stat, not 4 GiB read and hashed

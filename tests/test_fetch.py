"""`arpo fetch` (`arpo.env.fetch.main`) against an HTTP server of the test's own
on loopback (aiohttp.web on 127.0.0.1, port 0), through the real download path: the files of a
task set land under OSWorld's cache names and FileCache finds them; a URL is fetched once; a
connection dropped mid-body, and a `.part` left from before, are continued with Range; a server
that ignores Range restarts the file cleanly; a 404, a body shorter than announced and a URL
that is not http(s) are reported with their tasks while the other files still arrive; several
downloads run at once, never more than -j; --dry-run downloads nothing.

Then hostile servers, caches and task folders: links, hard links and FIFOs in the cache are
replaced, never followed or opened; a 206 that cannot be checked is never stored; endless,
too large, trickling and slow bodies end at --max-size, --stall and --file-timeout; numbers
out of range, and cache paths that cannot be folders, exit 2 naming them; bad file names,
folders in the way, unreadable task files and index ids that are not plain names fail alone
with their reason, and the command always ends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import threading
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from arpo.cli import main as arpo_cli
from arpo.env import fetch as F
from arpo.env.cache import FileCache
from arpo.env.task import MAX_TASK_DEPTH

BLOBS = {
    "a.txt": b"alpha\n" * 1000,
    "b.bin": bytes(range(256)) * 400,
    "c.bin": b"no range here " * 700,
    "d.bin": b"\x00\x01delta" * 900,
    "e.txt": b"postconfig file\n" * 300,
    "short.bin": b"x" * 100,  # announced as 1000 bytes
}
ANNOUNCED = {"short.bin": 1000}
WAIT_S = 10.0  # longest wait of the server for the client; reached only when something is wrong
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def osworld_name(url: str, name: str) -> str:
    """OSWorld SetupController's cache name, spelled out here rather than taken from fetch."""
    return f"{uuid.uuid5(uuid.NAMESPACE_URL, url)}_{name}"


@dataclass
class Request:
    name: str
    range: str | None
    status: int
    if_range: str | None = None


class Server:
    """Serves BLOBS at /files/<name>; what it saw is in `requests`, `sent` and `drop_offsets`.

    - `drops[name]`: how many of the next GETs of `name` break mid-body: a third of the body is
      sent, then, once the client has it in its `.part` file (`part_of(name)`), the connection
      is closed. (Closing at once could let the client lose bytes it had not read yet, and the
      Range it asks next would depend on timing.)
    - `ignore_range`: names served whole (200) whatever the Range header says.
    - `piece[name]`: a Range is answered with at most that many bytes (a bounded 206).
    - `changes[name]`: the file's new content from its second GET on.
    - `etags`: send an ETag (and honour If-Range: a Range of another version gets it whole).
    - `gate`: each GET waits, before its body, until that many GETs have been in flight at
      once; `peak` is the most in flight at once. A GET is in flight from its arrival until
      its body's last byte, which is sent only after it stops counting, so the client cannot
      start another GET in its place while it still counts. Each GET is then held `hold_s`
      more, for a client that starts too many to show it (a correct client passes whatever
      the timing; the hold only gives an unbounded one time to be caught).
    """

    def __init__(self) -> None:
        self.port = 0
        self.requests: list[Request] = []
        self.sent: Counter[str] = Counter()
        self.drops: dict[str, int] = {}
        self.drop_offsets: list[int] = []
        self.ignore_range = {"c.bin"}
        self.blobs = dict(BLOBS)
        self.piece: dict[str, int] = {}
        self.changes: dict[str, bytes] = {}
        self.etags = False
        self.part_of: Callable[[str], Path] | None = None
        self.gate = 0
        self.in_flight = 0
        self.hold_s = 0.05
        self.peak = 0
        self.errors: list[str] = []

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/files/{name}"

    async def _until(self, what: str, cond: Callable[[], object]) -> None:
        deadline = time.monotonic() + WAIT_S
        while not cond():
            if time.monotonic() > deadline:
                self.errors.append(f"gave up waiting for {what}")
                return
            await asyncio.sleep(0.002)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        rng, if_range = request.headers.get("Range"), request.headers.get("If-Range")
        if name not in self.blobs:
            self.requests.append(Request(name, rng, 404))
            return web.Response(status=404, text="no such file")
        data, size = self.blobs[name], ANNOUNCED.get(name, len(self.blobs[name]))
        if name in self.changes:
            self.blobs[name] = self.changes.pop(name)
        etag = f'"{zlib.crc32(data):08x}"' if self.etags else None
        honour = (
            rng is not None
            and name not in self.ignore_range
            and (if_range is None or if_range == etag)
        )
        start = int(rng.removeprefix("bytes=").split("-")[0]) if honour and rng else 0
        end = min(size, start + self.piece[name]) if honour and name in self.piece else size
        status = 206 if honour else 200
        if honour and start >= size:
            self.requests.append(Request(name, rng, 416, if_range))
            return web.Response(status=416, headers={"Content-Range": f"bytes */{size}"})
        self.requests.append(Request(name, rng, status, if_range))
        if self.gate:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            await self._until(
                f"{self.gate} requests at once", lambda: self.peak >= self.gate or self.errors
            )
        resp = web.StreamResponse(status=status)
        if status == 206:
            resp.headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        if etag:
            resp.headers["ETag"] = etag
        resp.content_length = end - start
        await resp.prepare(request)
        body = data[start:end]
        assert request.transport is not None
        if self.drops.get(name, 0) > 0:
            self.drops[name] -= 1
            cut = max(1, len(body) // 3)
            await resp.write(body[:cut])
            self.sent[name] += cut
            offset = start + cut
            self.drop_offsets.append(offset)
            assert self.part_of is not None
            part = self.part_of(name)
            await self._until(
                f"{part} to hold {offset} bytes",
                lambda: part.exists() and part.stat().st_size == offset,
            )
            request.transport.close()  # the connection drops mid-body
            return resp
        await resp.write(body[:-1])
        if self.gate:
            await asyncio.sleep(self.hold_s)
            self.in_flight -= 1
        await resp.write(body[-1:])
        self.sent[name] += len(body)
        if len(data) < end:
            request.transport.close()  # fewer bytes than announced
            return resp
        await resp.write_eof()
        return resp

    def of(self, name: str) -> list[Request]:
        return [r for r in self.requests if r.name == name]


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    # the downloader honours proxy variables (trust_env); the loopback server is reached direct
    for var in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)


@contextlib.contextmanager
def serving(handle: Handler) -> Iterator[int]:
    """`handle` answering GET /files/{name} on 127.0.0.1, in a thread of its own; the port."""
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_get("/files/{name}", handle)
    runner = web.AppRunner(app)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))

    async def start() -> None:
        await runner.setup()
        await web.SockSite(runner, sock).start()

    loop.run_until_complete(start())
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        yield sock.getsockname()[1]
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        t.join(timeout=10)
        loop.close()


@pytest.fixture
def server() -> Iterator[Server]:
    srv = Server()
    with serving(srv.handle) as port:
        srv.port = port
        yield srv
    assert srv.errors == []


def download(url: str, path: str) -> dict[str, Any]:
    return {"type": "download", "parameters": {"files": [{"url": url, "path": path}]}}


def write_tasks(folder: Path, tasks: dict[str, dict[str, Any]]) -> Path:
    """Task files `<folder>/<id>.json`; each value holds `config`, `postconfig`, `expected`."""
    folder.mkdir()
    for tid, parts in tasks.items():
        evaluator: dict[str, Any] = {
            "func": "compare_text_file",
            "result": {"type": "vm_file", "path": "/home/user/out.txt", "dest": "out.txt"},
        }
        if "expected" in parts:
            evaluator["expected"] = parts["expected"]
        if "postconfig" in parts:
            evaluator["postconfig"] = parts["postconfig"]
        task = {
            "id": tid,
            "instruction": "x",
            "config": parts.get("config", []),
            "evaluator": evaluator,
        }
        (folder / f"{tid}.json").write_text(json.dumps(task))
    return folder


def simple_tasks(tmp: Path, srv: Server, files: dict[str, list[str]]) -> Path:
    """One task per key, downloading each named file to /home/user/<name>."""
    return write_tasks(
        tmp / "tasks",
        {
            tid: {"config": [download(srv.url(n), f"/home/user/{n}") for n in names]}
            for tid, names in files.items()
        },
    )


def run(tasks: Path, cache: Path, *more: str) -> int:
    return F.main(["--tasks", str(tasks), "--cache", str(cache), "--backoff", "0.001", *more])


def report(cache: Path) -> dict[str, Any]:
    return json.loads((cache / F.REPORT).read_text())


def test_a_task_sets_files_land_under_osworlds_names_once(server: Server, tmp_path: Path) -> None:
    u = server.url
    tasks = write_tasks(
        tmp_path / "tasks",
        {
            "t1": {
                "config": [
                    download(u("a.txt"), "/home/user/a.txt"),
                    download(u("b.bin"), "/tmp/b.bin"),
                ],
                "expected": {"type": "cloud_file", "path": u("a.txt"), "dest": "gold.txt"},
            },
            "t2": {
                "config": [
                    download(u("a.txt"), "/home/user/a.txt"),
                    download(u("c.bin"), "/c.bin"),
                ],
                "postconfig": [download(u("e.txt"), "/home/user/e.txt")],
            },
            "t3": {
                "expected": {
                    "type": "cloud_file",
                    "multi": True,
                    "path": [u("d.bin"), u("a.txt")],
                    "dest": ["d.bin", "a_copy.txt"],
                    "gives": [0, 1],
                }
            },
        },
    )
    cache = tmp_path / "cache"
    assert run(tasks, cache, "-j", "3") == 0

    wanted = {  # (blob, name on the VM or dest) -> tasks
        ("a.txt", "a.txt"): ["t1", "t2"],
        ("a.txt", "gold.txt"): ["t1"],
        ("a.txt", "a_copy.txt"): ["t3"],
        ("b.bin", "b.bin"): ["t1"],
        ("c.bin", "c.bin"): ["t2"],
        ("e.txt", "e.txt"): ["t2"],
        ("d.bin", "d.bin"): ["t3"],
    }
    fc = FileCache(cache)
    for blob, name in wanted:
        found = fc.lookup(u(blob), name)
        assert found == cache / osworld_name(u(blob), name)
        assert found.read_bytes() == BLOBS[blob]
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [osworld_name(u(b), n) for b, n in wanted] + [F.REPORT, F.LOCK]
    )
    # every URL once, whole, though a.txt is wanted by three tasks under three names
    assert Counter(r.name for r in server.requests) == dict.fromkeys(
        ["a.txt", "b.bin", "c.bin", "d.bin", "e.txt"], 1
    )
    assert all(r.range is None and r.status == 200 for r in server.requests)
    listed = {(w.url, w.name): w.tasks for w in F.wanted_files(F.load_fetch_tasks(tasks))}
    assert listed == {(u(b), osworld_name(u(b), n)): ts for (b, n), ts in wanted.items()}
    rep = report(cache)
    assert (rep["files"], rep["urls"], rep["tasks"]) == (7, 5, 3)
    assert (rep["downloaded"], rep["linked"], rep["skipped"], rep["failed"]) == (5, 2, 0, [])
    assert rep["bytes"] == sum(len(BLOBS[n]) for n in ("a.txt", "b.bin", "c.bin", "d.bin", "e.txt"))

    assert run(tasks, cache) == 0  # a second run downloads nothing
    assert len(server.requests) == 5
    rep = report(cache)
    assert (rep["downloaded"], rep["linked"], rep["skipped"], rep["bytes"]) == (0, 0, 7, 0)

    gold = cache / osworld_name(u("a.txt"), "gold.txt")
    gold.unlink()  # one name of a cached URL missing: made from the others, not downloaded
    assert run(tasks, cache) == 0
    assert len(server.requests) == 5
    assert gold.read_bytes() == BLOBS["a.txt"]
    assert (report(cache)["linked"], report(cache)["skipped"]) == (1, 6)


def test_a_connection_dropped_mid_body_is_resumed_with_range(
    server: Server, tmp_path: Path
) -> None:
    tasks = simple_tasks(tmp_path, server, {"t1": ["b.bin"]})
    cache = tmp_path / "cache"
    server.part_of = lambda n: cache / f"{osworld_name(server.url(n), n)}.part"
    server.drops = {"b.bin": 2}
    assert run(tasks, cache, "--retries", "2") == 0
    assert (cache / osworld_name(server.url("b.bin"), "b.bin")).read_bytes() == BLOBS["b.bin"]
    first, second = server.drop_offsets
    assert 0 < first < second < len(BLOBS["b.bin"])
    # each try asked for the rest from exactly where the partial file ended
    assert [(r.range, r.status) for r in server.of("b.bin")] == [
        (None, 200),
        (f"bytes={first}-", 206),
        (f"bytes={second}-", 206),
    ]
    assert server.sent["b.bin"] == len(BLOBS["b.bin"])  # no byte sent twice
    assert not list(cache.glob("*.part"))
    assert report(cache)["downloaded"] == 1
    assert report(cache)["bytes"] == len(BLOBS["b.bin"])


def test_a_partial_file_from_before_is_continued(server: Server, tmp_path: Path) -> None:
    tasks = simple_tasks(tmp_path, server, {"t1": ["b.bin"]})
    cache = tmp_path / "cache"
    cache.mkdir()
    name = osworld_name(server.url("b.bin"), "b.bin")
    (cache / f"{name}.part").write_bytes(BLOBS["b.bin"][:1000])
    assert run(tasks, cache) == 0
    assert [(r.range, r.status) for r in server.of("b.bin")] == [("bytes=1000-", 206)]
    assert server.sent["b.bin"] == len(BLOBS["b.bin"]) - 1000
    assert (cache / name).read_bytes() == BLOBS["b.bin"]
    assert not (cache / f"{name}.part").exists()
    assert report(cache)["bytes"] == len(BLOBS["b.bin"]) - 1000


def test_a_whole_partial_file_is_moved_into_place(server: Server, tmp_path: Path) -> None:
    tasks = simple_tasks(tmp_path, server, {"t1": ["b.bin"]})
    cache = tmp_path / "cache"
    cache.mkdir()
    name = osworld_name(server.url("b.bin"), "b.bin")
    (cache / f"{name}.part").write_bytes(BLOBS["b.bin"])  # a run that stopped before the move
    assert run(tasks, cache) == 0
    assert [(r.range, r.status) for r in server.of("b.bin")] == [
        (f"bytes={len(BLOBS['b.bin'])}-", 416)
    ]
    assert (cache / name).read_bytes() == BLOBS["b.bin"]
    assert not (cache / f"{name}.part").exists()


def test_a_server_that_sends_bounded_ranges_is_asked_for_the_rest(
    server: Server, tmp_path: Path
) -> None:
    tasks = simple_tasks(tmp_path, server, {"t1": ["b.bin"]})
    cache = tmp_path / "cache"
    server.part_of = lambda n: cache / f"{osworld_name(server.url(n), n)}.part"
    server.drops = {"b.bin": 1}
    server.piece = {"b.bin": 40_000}
    assert run(tasks, cache, "--retries", "1") == 0  # the pieces are not failed tries
    (cut,) = server.drop_offsets
    assert [r.range for r in server.of("b.bin")] == [
        None,
        f"bytes={cut}-",
        f"bytes={cut + 40_000}-",
    ]
    assert (cache / osworld_name(server.url("b.bin"), "b.bin")).read_bytes() == BLOBS["b.bin"]


@pytest.mark.parametrize("etags", [False, True])
def test_a_file_that_changed_on_the_server_is_started_again(
    server: Server, tmp_path: Path, etags: bool
) -> None:
    tasks = simple_tasks(tmp_path, server, {"t1": ["b.bin"]})
    cache = tmp_path / "cache"
    server.part_of = lambda n: cache / f"{osworld_name(server.url(n), n)}.part"
    server.drops = {"b.bin": 1}
    server.etags = etags
    new = b"version 2 " * 5000  # another size: without an ETag, the size tells
    server.changes = {"b.bin": new}
    assert run(tasks, cache, "--retries", "2") == 0
    assert (cache / osworld_name(server.url("b.bin"), "b.bin")).read_bytes() == new
    (cut,) = server.drop_offsets
    seen = [(r.range, r.status, r.if_range is not None) for r in server.of("b.bin")]
    if etags:  # If-Range: the server sends the new version whole at once
        assert seen == [(None, 200, False), (f"bytes={cut}-", 200, True)]
    else:  # the 206's total differs from the first answer's size: the part is dropped
        assert seen == [(None, 200, False), (f"bytes={cut}-", 206, False), (None, 200, False)]


def test_a_server_that_ignores_range_restarts_the_file_cleanly(
    server: Server, tmp_path: Path
) -> None:
    tasks = simple_tasks(tmp_path, server, {"t1": ["c.bin"]})
    cache = tmp_path / "cache"
    cache.mkdir()
    name = osworld_name(server.url("c.bin"), "c.bin")
    (cache / f"{name}.part").write_bytes(b"\xff" * 1000)  # not even the file's first bytes
    server.part_of = lambda n: cache / f"{osworld_name(server.url(n), n)}.part"
    server.drops = {"c.bin": 1}  # and the first answer breaks off too
    assert run(tasks, cache, "--retries", "1") == 0
    (dropped_at,) = server.drop_offsets
    assert [(r.range, r.status) for r in server.of("c.bin")] == [
        ("bytes=1000-", 200),
        (f"bytes={dropped_at}-", 200),
    ]
    assert (cache / name).read_bytes() == BLOBS["c.bin"]
    assert not (cache / f"{name}.part").exists()


def test_failures_are_reported_with_their_tasks_and_the_rest_still_arrives(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    u = server.url
    tasks = write_tasks(
        tmp_path / "tasks",
        {
            "t1": {
                "config": [
                    download(u("nope.txt"), "/home/user/nope.txt"),
                    download(u("a.txt"), "/a.txt"),
                ]
            },
            "t2": {"config": [download(u("short.bin"), "/home/user/short.bin")]},
            "t3": {
                "config": [download("file:///etc/passwd", "/home/user/passwd")],
                "expected": {
                    "type": "cloud_file",
                    "path": "ftp://127.0.0.1/x.txt",
                    "dest": "x.txt",
                },
            },
            "t4": {"config": [download(u("nope.txt"), "/home/user/nope.txt")]},
        },
    )
    cache = tmp_path / "cache"
    assert run(tasks, cache, "--retries", "2") == 1
    rep = report(cache)
    failed = {f["url"]: f for f in rep["failed"]}
    assert set(failed) == {
        u("nope.txt"),
        u("short.bin"),
        "file:///etc/passwd",
        "ftp://127.0.0.1/x.txt",
    }
    assert failed[u("nope.txt")]["tasks"] == ["t1", "t4"]
    assert "HTTP 404" in failed[u("nope.txt")]["reason"]
    assert failed[u("short.bin")]["tasks"] == ["t2"]
    assert "of 1000 bytes" in failed[u("short.bin")]["reason"]
    assert "after 3 tries" in failed[u("short.bin")]["reason"]
    for url in ("file:///etc/passwd", "ftp://127.0.0.1/x.txt"):
        assert failed[url]["tasks"] == ["t3"]
        assert "not an http(s) URL" in failed[url]["reason"]
    assert rep["failed_tasks"] == ["t1", "t2", "t3", "t4"]
    assert len(server.of("nope.txt")) == 1  # a 404 is final
    assert len(server.of("short.bin")) == 3  # a short body is retried, then given up
    for f in rep["failed"]:
        assert f["name"] == osworld_name(f["url"], f["name"].split("_", 1)[1])
        assert not (cache / f["name"]).exists()  # nothing half-made in the cache
    assert FileCache(cache).lookup(u("a.txt"), "a.txt").read_bytes() == BLOBS["a.txt"]
    assert rep["downloaded"] == 1
    out = capsys.readouterr().out
    assert f"FAILED {u('nope.txt')}: HTTP 404" in out and "(needed by t1, t4)" in out
    assert "(needed by t2)" in out and "(needed by t3)" in out


def test_downloads_run_several_at_a_time_never_more_than_j(server: Server, tmp_path: Path) -> None:
    tasks = simple_tasks(
        tmp_path, server, {"t1": ["a.txt", "b.bin"], "t2": ["c.bin", "d.bin", "e.txt"]}
    )
    server.gate = 2
    assert run(tasks, tmp_path / "cache", "-j", "2") == 0
    assert server.peak == 2
    assert report(tmp_path / "cache")["downloaded"] == 5


def test_dry_run_lists_without_downloading(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tasks = simple_tasks(tmp_path, server, {"t1": ["a.txt", "b.bin"], "t2": ["a.txt"]})
    (tmp_path / "tasks" / "t3.json").write_text(
        json.dumps(
            {
                "id": "t3",
                "instruction": "x",
                "config": [download("file:///etc/hosts", "/home/user/hosts")],
                "evaluator": {"func": "infeasible"},
            }
        )
    )
    cache = tmp_path / "cache"
    assert run(tasks, cache, "--dry-run") == 0
    assert server.requests == []
    assert not cache.exists()
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        f"3 files (3 distinct URLs) needed by 3 of 3 tasks; 0 already in {cache}, 1 refused"
    )
    a = osworld_name(server.url("a.txt"), "a.txt")
    assert f"missing  {a}  {server.url('a.txt')}  (t1, t2)" in out
    assert "REFUSED" in out and "file:///etc/hosts" in out

    cache.mkdir()
    (cache / a).write_bytes(BLOBS["a.txt"])
    # the same `main`, as the `arpo fetch` command
    assert arpo_cli(["fetch", "--tasks", str(tasks), "--cache", str(cache), "--dry-run"]) == 0
    assert f"cached   {a}" in capsys.readouterr().out
    assert server.requests == []
    assert arpo_cli(["fetch", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: arpo fetch ")


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    assert F.main(["--tasks", str(tmp_path / "none"), "--cache", str(tmp_path)]) == 2
    (tmp_path / "t.json").write_text(
        json.dumps({"id": "t", "instruction": "x", "evaluator": {"func": "infeasible"}})
    )
    assert F.main(["--tasks", str(tmp_path / "t.json"), "--cache", str(tmp_path), "-j", "0"]) == 2


def test_the_benchmark_task_set_is_listed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    root = Path(__file__).resolve().parents[2] / "shared" / "osworld" / "evaluation_examples"
    if not (root / "test_all.json").is_file():
        pytest.skip("the benchmark's task files are not beside the repository")
    args = ["--tasks", str(root), "--cache", str(tmp_path / "c"), "--dry-run"]
    assert F.main([*args, "--index", "test_all.json"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    m = re.match(r"(\d+) files \((\d+) distinct URLs\) needed by (\d+) of (\d+) tasks", head)
    assert m is not None, head
    files, urls, needing, total = map(int, m.groups())
    assert total == 369 and 0 < needing < total and 0 < urls <= files
    assert F.main(args) == 0  # the folder searched without the index: the same tasks
    assert capsys.readouterr().out.splitlines()[0] == head


# ---------------------------------------------------------------------------- hostile servers
# Each test below plays one misbehaving server (or cache, or task folder) against the real
# download path, and checks that the command ends, writes nothing outside the cache, and
# fails only the file concerned, with its reason.


class Hostile:
    """A server that misbehaves on purpose: `handlers[name]` answers /files/<name> (404 when
    there is none); every GET is recorded as (name, its Range header)."""

    def __init__(self) -> None:
        self.port = 0
        self.requests: list[tuple[str, str | None]] = []
        self.handlers: dict[str, Handler] = {}

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/files/{name}"

    def of(self, name: str) -> list[str | None]:
        return [rng for n, rng in self.requests if n == name]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        self.requests.append((name, request.headers.get("Range")))
        handler = self.handlers.get(name)
        if handler is None:
            return web.Response(status=404)
        return await handler(request)


@pytest.fixture
def hostile() -> Iterator[Hostile]:
    srv = Hostile()
    with serving(srv.handle) as port:
        srv.port = port
        yield srv


def streaming(piece: bytes, every_s: float, length: int | None = None) -> Handler:
    """A 200 whose body is `piece` every `every_s` seconds, announced as `length` bytes and
    ending there (None: chunked, without end), for WAIT_S at most: a client that works has
    gone long before."""

    async def handle(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        if length is not None:
            resp.content_length = length
        await resp.prepare(request)
        end, sent = time.monotonic() + WAIT_S, 0
        with contextlib.suppress(ConnectionError):  # the client hung up
            while time.monotonic() < end and (length is None or sent < length):
                await resp.write(piece)
                sent += len(piece)
                await asyncio.sleep(every_s)
        return resp

    return handle


def run_bounded(*args: str, limit_s: float = 15.0) -> int:
    """F.main in a thread of its own: its exit code; the test fails if it has not ended within
    `limit_s` (the thread is left behind, blocked)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["rc"] = F.main(["--backoff", "0.001", *args])
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"fetch did not end within {limit_s} s"
    if "error" in box:
        raise box["error"]
    return int(box["rc"])


def test_links_in_the_cache_are_replaced_never_followed(server: Server, tmp_path: Path) -> None:
    tasks = simple_tasks(tmp_path, server, {"t1": ["a.txt", "b.bin", "c.bin"]})
    cache = tmp_path / "cache"
    cache.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    victims = {n: outside / n for n in ("part", "named", "tmp", "hard")}
    for n, v in victims.items():
        v.write_bytes(f"precious {n}\n".encode())
    a, b, c = (osworld_name(server.url(n), n) for n in ("a.txt", "b.bin", "c.bin"))
    (cache / f"{a}.part").symlink_to(victims["part"])  # a download would continue "into" it
    (cache / b).symlink_to(victims["named"])  # "already cached", but a file outside
    (cache / f"{F.REPORT}.tmp").symlink_to(victims["tmp"])
    (cache / F.LOCK).symlink_to(outside / "lock")  # dangling: opening it would make the file
    os.link(victims["hard"], cache / f"{c}.part")  # the same file as one outside
    assert run_bounded("--tasks", str(tasks), "--cache", str(cache)) == 0
    for n, v in victims.items():
        assert v.read_bytes() == f"precious {n}\n".encode()
    assert sorted(p.name for p in outside.iterdir()) == ["hard", "named", "part", "tmp"]
    for name, blob in ((a, "a.txt"), (b, "b.bin"), (c, "c.bin")):
        assert not (cache / name).is_symlink()
        assert (cache / name).read_bytes() == BLOBS[blob]
    assert sorted(p.name for p in cache.iterdir()) == sorted([a, b, c, F.LOCK, F.REPORT])
    assert not any(p.is_symlink() for p in cache.iterdir())
    assert all(r.range is None for r in server.requests)  # nothing "continued" from a link


def test_a_fifo_in_the_cache_is_replaced_never_opened(server: Server, tmp_path: Path) -> None:
    tasks = simple_tasks(tmp_path, server, {"t1": ["d.bin"]})
    cache = tmp_path / "cache"
    cache.mkdir()
    d = osworld_name(server.url("d.bin"), "d.bin")
    fifo = cache / f"{d}.part"
    os.mkfifo(fifo)  # opening it to write would wait for a reader forever
    try:
        assert run_bounded("--tasks", str(tasks), "--cache", str(cache)) == 0
    finally:
        with contextlib.suppress(OSError):  # frees a fetch stuck on the FIFO
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
    assert (cache / d).read_bytes() == BLOBS["d.bin"]
    assert sorted(p.name for p in cache.iterdir()) == sorted([d, F.LOCK, F.REPORT])


@pytest.mark.parametrize("always", [False, True])
def test_a_206_of_unknown_total_is_never_stored(
    hostile: Hostile, tmp_path: Path, always: bool
) -> None:
    blob = bytes(range(256)) * 40

    async def handle(request: web.Request) -> web.StreamResponse:
        rng = request.headers.get("Range")
        if rng is None and not always:
            return web.Response(body=blob)
        start = int(rng.removeprefix("bytes=").split("-")[0]) if rng else 0
        return web.Response(
            status=206, body=b"?" * 100, headers={"Content-Range": f"bytes {start}-{start + 99}/*"}
        )

    hostile.handlers["f.bin"] = handle
    url = hostile.url("f.bin")
    tasks = write_tasks(tmp_path / "tasks", {"t1": {"config": [download(url, "/f.bin")]}})
    cache = tmp_path / "cache"
    cache.mkdir()
    name = osworld_name(url, "f.bin")
    (cache / f"{name}.part").write_bytes(blob[:1000])
    rc = run_bounded("--tasks", str(tasks), "--cache", str(cache))
    # the unprovable 206 is not used: the whole file is asked for, once, without Range
    assert hostile.of("f.bin") == ["bytes=1000-", None]
    if not always:
        assert rc == 0
        assert (cache / name).read_bytes() == blob
    else:
        assert rc == 1
        (failed,) = report(cache)["failed"]
        assert "206" in failed["reason"] and "total the server does not know" in failed["reason"]
        assert not (cache / name).exists()


def test_an_endless_or_too_large_body_stops_at_max_size(hostile: Hostile, tmp_path: Path) -> None:
    hostile.handlers["endless.bin"] = streaming(b"z" * 65536, 0.0)  # chunked, never ends
    hostile.handlers["big.bin"] = streaming(b"z" * 65536, 0.0, length=2 << 20)
    u = hostile.url
    tasks = write_tasks(
        tmp_path / "tasks",
        {"t1": {"config": [download(u("endless.bin"), "/e.bin"), download(u("big.bin"), "/b")]}},
    )
    cache = tmp_path / "cache"
    t0 = time.monotonic()
    assert run_bounded("--tasks", str(tasks), "--cache", str(cache), "--max-size", "1M") == 1
    assert time.monotonic() - t0 < 10
    reasons = {f["url"]: f["reason"] for f in report(cache)["failed"]}
    assert "grew past max_bytes (1048576" in reasons[u("endless.bin")]
    assert "the file has 2097152 bytes, more than max_bytes" in reasons[u("big.bin")]
    assert len(hostile.of("endless.bin")) == len(hostile.of("big.bin")) == 1  # not retried
    assert sorted(p.name for p in cache.iterdir()) == [F.LOCK, F.REPORT]  # no .part left


def test_a_trickle_is_a_stall_and_a_slow_file_runs_out_of_time(
    hostile: Hostile, tmp_path: Path
) -> None:
    hostile.handlers["trickle.bin"] = streaming(b"t", 0.05, length=10**6)  # 20 bytes/s
    hostile.handlers["slow.bin"] = streaming(b"s" * 8192, 0.02, length=10**9)  # steady, long
    u = hostile.url
    tasks = write_tasks(
        tmp_path / "tasks",
        {"t1": {"config": [download(u("trickle.bin"), "/t"), download(u("slow.bin"), "/s")]}},
    )
    cache = tmp_path / "cache"
    t0 = time.monotonic()
    args = ["--tasks", str(tasks), "--cache", str(cache), "--retries", "1", "--max-size", "2G"]
    limits = ["--stall", "0.3", "--stall-bytes", "1K", "--file-timeout", "2"]
    assert run_bounded(*args, *limits) == 1
    assert time.monotonic() - t0 < 8
    reasons = {f["url"]: f["reason"] for f in report(cache)["failed"]}
    assert reasons[u("trickle.bin")].startswith("stalled: ")
    assert "after 2 tries" in reasons[u("trickle.bin")]
    assert len(hostile.of("trickle.bin")) == 2
    assert reasons[u("slow.bin")].startswith("not done within file_timeout_s (2 s")
    part = cache / f"{osworld_name(u('slow.bin'), 's')}.part"
    assert part.stat().st_size > 100_000  # kept, for the next run to continue


def test_numbers_out_of_range_exit_2_naming_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tasks = tmp_path / "t.json"
    tasks.write_text(json.dumps({"id": "t", "instruction": "x", "evaluator": {"func": "x"}}))
    cases = [
        ("--backoff", "inf"),
        ("--backoff", "1e308"),
        ("--backoff", "nan"),
        ("--backoff", "-1"),
        ("-j", "0"),
        ("-j", "100000"),
        ("--retries", "-1"),
        ("--retries", "1000000000"),
        ("--max-size", "0"),
        ("--max-size", "5000T"),
        ("--max-size", "lots"),
        ("--file-timeout", "inf"),
        ("--file-timeout", "0"),
        ("--stall", "1e9"),
        ("--stall-bytes", "0"),
    ]
    for flag, value in cases:
        for more in ([], ["--dry-run"]):
            rc = F.main(["--tasks", str(tasks), "--cache", str(tmp_path / "c"), flag, value, *more])
            err = capsys.readouterr().err
            assert rc == 2, (flag, value)
            assert flag in err, (flag, value, err)
    assert not (tmp_path / "c").exists()
    with pytest.raises(ValueError, match=r"--backoff \(backoff_s\) must be a finite number"):
        F.FetchConfig(backoff_s=float("inf"), backoff_max_s=float("inf"))
    with pytest.raises(ValueError, match="connect_timeout_s"):
        F.FetchConfig(connect_timeout_s=float("nan"))


def test_bad_names_and_folders_in_the_way_fail_alone(server: Server, tmp_path: Path) -> None:
    u = server.url
    long_name = "L" * 250 + ".txt"
    tasks = write_tasks(
        tmp_path / "tasks",
        {
            "t1": {"config": [download(u("a.txt"), f"/home/user/{long_name}")]},
            "t2": {"config": [download(u("b.bin"), "/home/user/b\0.bin")]},
            "t3": {"config": [download("http://[::1/x.bin", "/home/user/x.bin")]},
            "t4": {"config": [download(u("c.bin"), "/home/user/c.bin")]},
            "t5": {"config": [download(u("d.bin"), "/home/user/d.bin")]},
            "t6": {"config": [download(u("e.txt"), "/home/user/e.txt")]},
        },
    )
    cache = tmp_path / "cache"
    cache.mkdir()
    c, d, e = (osworld_name(u(n), n) for n in ("c.bin", "d.bin", "e.txt"))
    (cache / f"{c}.part").mkdir()  # a folder where the download goes
    (cache / d).mkdir()  # a folder where the file goes
    assert run_bounded("--tasks", str(tasks), "--cache", str(cache)) == 1
    failed = {f["tasks"][0]: f["reason"] for f in report(cache)["failed"]}
    assert sorted(failed) == ["t1", "t2", "t3", "t4", "t5"]
    assert "too long for the cache" in failed["t1"]
    assert "NUL" in failed["t2"]
    assert "not a URL" in failed["t3"]
    assert "folder is in the way" in failed["t4"] and f"{c}.part" in failed["t4"]
    assert "folder is in the way" in failed["t5"] and d in failed["t5"]
    assert (cache / e).read_bytes() == BLOBS["e.txt"]
    assert (cache / f"{c}.part").is_dir() and (cache / d).is_dir()  # left alone
    assert [r.name for r in server.requests] == ["e.txt"]  # the others: no request at all


def test_a_cache_path_that_is_not_a_folder_exits_2(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tasks = simple_tasks(tmp_path, server, {"t1": ["a.txt"]})
    a_file = tmp_path / "file"
    a_file.write_text("x")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere" / "cache")
    for cache, says in (
        (a_file, "is a regular file, not a folder"),
        (a_file / "sub", "Not a directory"),
        (dangling, "is a symbolic link to"),
    ):
        for more in ([], ["--dry-run"]):
            assert run(tasks, cache, *more) == 2
            assert says in capsys.readouterr().err
    assert a_file.read_text() == "x"
    assert not (tmp_path / "nowhere").exists()
    assert server.requests == []
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)  # a link to a folder is the operator's choice: used
    assert run(tasks, tmp_path / "link") == 0
    assert (real / osworld_name(server.url("a.txt"), "a.txt")).read_bytes() == BLOBS["a.txt"]


def test_a_fifo_named_json_is_left_out_never_read(server: Server, tmp_path: Path) -> None:
    tasks = simple_tasks(tmp_path, server, {"good": ["a.txt"]})
    fifo = tasks / "fifo.json"
    os.mkfifo(fifo)  # reading it would wait for a writer forever
    cache = tmp_path / "cache"
    try:
        assert run_bounded("--tasks", str(tasks), "--cache", str(cache)) == 1
    finally:
        with contextlib.suppress(OSError):  # frees a fetch stuck on the FIFO
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    rep = report(cache)
    assert (rep["downloaded"], rep["failed"]) == (1, [])
    assert rep["task_files_left_out"] == [
        {"file": str(fifo), "reason": "a FIFO, not a regular file; not read"}
    ]


def test_task_files_that_cannot_be_read_are_left_out_alone(server: Server, tmp_path: Path) -> None:
    tasks = simple_tasks(tmp_path, server, {"good": ["a.txt"]})
    nested = "[" * 100_000 + "]" * 100_000
    (tasks / "deep.json").write_text(f'{{"id": "deep", "instruction": "x", "evaluator": {nested}}}')
    (tasks / "latin1.json").write_bytes(b'{"id": "caf\xe9", "evaluator": {}}')
    # far below any depth a task set has (not deeper: pytest's rmtree recurses per level)
    deep = tasks.joinpath(*["d"] * 40)
    deep.mkdir(parents=True)
    write_tasks(deep / "t", {"nested": {"config": [download(server.url("b.bin"), "/b.bin")]}})
    cache = tmp_path / "cache"
    assert run_bounded("--tasks", str(tasks), "--cache", str(cache)) == 1
    rep = report(cache)
    assert FileCache(cache).lookup(server.url("a.txt"), "a.txt").read_bytes() == BLOBS["a.txt"]
    assert (rep["downloaded"], rep["failed"], rep["tasks"]) == (1, [], 1)
    left = {Path(x["file"]).name: x["reason"] for x in rep["task_files_left_out"]}
    assert sorted(left) == ["d", "deep.json", "latin1.json"]
    assert (
        left["deep.json"] == f"JSON nested too deeply (a task has at most {MAX_TASK_DEPTH} levels)"
    )
    assert left["latin1.json"].startswith("not UTF-8 text")
    assert left["d"].startswith(f"deeper than {F.TASK_FOLDER_DEPTH} folders")
    assert [r.name for r in server.requests] == ["a.txt"]


def test_an_index_names_only_plain_task_files(server: Server, tmp_path: Path) -> None:
    root = tmp_path / "evaluation_examples"
    (root / "examples").mkdir(parents=True)
    write_tasks(
        root / "examples" / "dom", {"good": {"config": [download(server.url("a.txt"), "/a")]}}
    )
    # a task outside the examples folder, which the index must not be able to name
    write_tasks(tmp_path / "secret", {"x": {"config": [download(server.url("b.bin"), "/b")]}})
    (root / "examples" / "dom" / "link.json").symlink_to(tmp_path / "secret" / "x.json")
    index = {"dom": ["good", "../../../secret/x", "link"], "../../secret": ["x"]}
    (root / "index.json").write_text(json.dumps(index))
    cache = tmp_path / "cache"
    assert run(root, cache, "--index", "index.json") == 1
    rep = report(cache)
    assert (rep["downloaded"], rep["tasks"]) == (1, 1)
    left = [x["reason"] for x in rep["task_files_left_out"]]
    assert len(left) == 3
    assert sum("must be plain names" in r for r in left) == 2
    assert sum("leads out of" in r for r in left) == 1
    assert [r.name for r in server.requests] == ["a.txt"]


# ---------------------------------------------------------------------------- one task loader


def test_fetch_refuses_the_task_sets_arpo_train_refuses(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A task given twice (in one list, in two files of a folder, on two lines of a .jsonl)
    and a list holding no task are refused by `arpo fetch` as by `arpo train`: exit 2 before
    anything is downloaded, with the message train's config check gives (naming the id and
    both places); the cache is not touched."""
    from arpo.env.task import pool_problem

    one = {"id": "dup", "instruction": "x", "evaluator": {"func": "infeasible"}}
    other = {"id": "other", "instruction": "y", "evaluator": {"func": "infeasible"}}
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps(one))
    (folder / "b.json").write_text(json.dumps([other, one]))
    sets = {
        "list": (tmp_path / "list.json", json.dumps([one, other, one])),
        "jsonl": (tmp_path / "lines.jsonl", "\n".join(json.dumps(t) for t in (one, other, one))),
        "empty": (tmp_path / "empty.json", "[]"),
        "empty-tasks": (tmp_path / "empty-tasks.json", '{"tasks": []}'),
        "folder": (folder, None),
    }
    for name, (path, text) in sets.items():
        if text is not None:
            path.write_text(text)
        cache = tmp_path / f"cache-{name}"
        code = F.main(["--tasks", str(path), "--cache", str(cache), "--dry-run"])
        err = capsys.readouterr().err
        train = pool_problem(path)
        assert train is not None, name
        assert (code, err) == (2, f"fetch: {train}\n"), name
        assert ("task id dup is also in" in err) == (not name.startswith("empty")), err
        assert not cache.exists()


def test_a_file_the_disk_cannot_hold_is_refused_before_its_body(
    hostile: Hostile, tmp_path: Path
) -> None:
    """The announced size is held against the cache's real free space: a file of more than
    the disk has free (less --keep-free) fails at once, no byte of it written, and the
    file beside it still arrives."""
    cache = tmp_path / "cache"
    cache.mkdir()
    st = os.statvfs(cache)
    free = st.f_bavail * st.f_frsize
    hostile.handlers["huge.bin"] = streaming(b"z" * 65536, 0.0, length=free + (1 << 30))
    hostile.handlers["small.bin"] = streaming(b"s" * 1000, 0.0, length=1000)
    u = hostile.url
    tasks = write_tasks(
        tmp_path / "tasks",
        {
            "t1": {
                "config": [
                    download(u("huge.bin"), "/huge.bin"),
                    download(u("small.bin"), "/small.bin"),
                ]
            }
        },
    )
    assert run_bounded("--tasks", str(tasks), "--cache", str(cache), "--max-size", "1T") == 1
    (failed,) = report(cache)["failed"]
    assert failed["url"] == u("huge.bin")
    assert "not enough disk" in failed["reason"] and "--keep-free" in failed["reason"]
    assert len(hostile.of("huge.bin")) == 1  # not retried
    huge = osworld_name(u("huge.bin"), "huge.bin")
    assert not (cache / f"{huge}.part").exists() or (cache / f"{huge}.part").stat().st_size == 0
    assert (cache / osworld_name(u("small.bin"), "small.bin")).read_bytes() == b"s" * 1000
    # what stays free is the user's to set: asking to keep all of it refuses a small file too
    assert run_bounded(
        "--tasks", str(tasks), "--cache", str(tmp_path / "c2"), "--max-size", "1T",
        "--keep-free", "1T",
    ) == 1  # fmt: skip
    reasons = {f["url"]: f["reason"] for f in report(tmp_path / "c2")["failed"]}
    assert "keep_free_bytes (1099511627776" in reasons[u("small.bin")]


def test_ctrl_c_ends_fetch_with_a_line_not_a_traceback(hostile: Hostile, tmp_path: Path) -> None:
    """SIGINT in the middle of a download: exit code 130, one line on stderr, the bytes
    received kept in the .part for the next run."""
    import signal
    import subprocess
    import sys

    hostile.handlers["slow.bin"] = streaming(b"x" * 4096, 0.05, length=1 << 20)
    url = hostile.url("slow.bin")
    tasks = write_tasks(tmp_path / "tasks", {"t1": {"config": [download(url, "/slow.bin")]}})
    cache = tmp_path / "cache"
    part = cache / f"{osworld_name(url, 'slow.bin')}{F.PART_SUFFIX}"
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    # SIGINT as a terminal delivers it: a test run started in the background (make test &)
    # hands its children SIGINT ignored, and Python then never raises KeyboardInterrupt.
    with subprocess.Popen(
        [sys.executable, "-m", "arpo.env.fetch", "--tasks", str(tasks), "--cache", str(cache)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    ) as proc:
        try:
            deadline = time.monotonic() + 60
            while not (part.exists() and part.stat().st_size > 0):
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "fetch: interrupted" in err
    assert 0 < part.stat().st_size < 1 << 20

"""Task files by content: what an `upload_file` step sends travels with the task, by hash.

A task file names the files its `upload_file` steps send to the desktop by a relative
`local_path` (relative to the task file's folder, or to the pool's root folder). When a
pool is loaded (`arpo.env.task.load_pool`), every such file is found, confined and
hashed, and its entry in the task gains two keys:

    {"local_path": "calc-append-kiwi/market.xlsx", "path": "/home/user/market.xlsx",
     "sha256": "9f2c...", "size": 6123}

A grant carries that JSON, so it names each file by content, never by a path of the
learner's filesystem. The learner serves the bytes over its control link (`FileRequest` /
`FileChunk` in `arpo.wire`, the same keys and loopback default as every other control
message) from a `TaskFiles` index that holds only files it hashed at load; the actor keeps
them in a `BlobCache` (content-addressed, `<root>/<hex[:2]>/<hex>`) and checks the hash
before every use. An actor host therefore needs no task files at all.

Confinement: a `local_path` must be relative, without `..`, and must resolve (symbolic
links followed) to a regular file inside the task file's folder or the pool's root. An
absolute path, a `..`, or a link that leads out is refused when the pool is loaded
(`TaskError` naming the task and the entry); the server checks the confinement again before
it reads a file, so a link swapped in later is refused too.

    files = TaskFiles()
    task = files.address(task_dict, folder=Path("tasks/calc"), root=Path("tasks"))
    cache = BlobCache("~/.cache/arpo/task-files")
    path = cache.get(sha, size)            # None when absent or damaged (it is deleted)
    path = cache.put(sha, data)            # BlobMismatch when data is not what sha says
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from arpo.errors import EnvError, TaskError

log = logging.getLogger("arpo.env.taskfiles")

CHUNK_BYTES = 4 << 20
"""Bytes of one served chunk (a task file of OSWorld is at most tens of MB)."""
MAX_FILE_BYTES = 1 << 30
"""Largest task file served or fetched."""


class BlobMismatch(TaskError):
    """Bytes received for a task file do not have the size or sha256 its task names."""


@dataclass(frozen=True, slots=True)
class FileRef:
    """One task file named by content."""

    sha256: str
    size: int

    @classmethod
    def of(cls, entry: Any) -> FileRef | None:
        """The content reference of an `upload_file` entry, None when it has none; TaskError
        when it has one that is malformed."""
        if not isinstance(entry, dict) or "sha256" not in entry:
            return None
        sha, size = entry.get("sha256"), entry.get("size")
        if not is_sha256(sha) or type(size) is not int or not 0 <= size <= MAX_FILE_BYTES:
            raise TaskError(
                f"upload_file entry {entry!r:.200}: 'sha256' must be 64 lowercase hex digits "
                f"and 'size' an int in [0, {MAX_FILE_BYTES}]"
            )
        return cls(sha, size)


def is_sha256(value: Any) -> bool:
    return (
        isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    )


def upload_entries(task: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every file entry of the task's `upload_file` steps (setup and postconfig)."""
    steps = list(task.get("config") or [])
    ev = task.get("evaluator")
    if isinstance(ev, dict):
        steps += list(ev.get("postconfig") or [])
    for step in steps:
        if not isinstance(step, dict) or step.get("type") != "upload_file":
            continue
        params = step.get("parameters")
        for f in (params.get("files") if isinstance(params, dict) else None) or []:
            if isinstance(f, dict):
                yield f


def confined(local_path: Any, bases: list[Path]) -> Path:
    """The regular file `local_path` names inside one of `bases` (tried in order).

    TaskError for an absolute path, a `..`, an empty path, or a file that resolves out of
    its base (a symbolic link); FileNotFoundError when no base holds it."""
    if not isinstance(local_path, str) or not local_path:
        raise TaskError(f"upload_file: local_path must be a non-empty string, got {local_path!r}")
    rel = PurePosixPath(local_path)
    if rel.is_absolute() or ".." in rel.parts or "\\" in local_path:
        raise TaskError(
            f"upload_file: local_path {local_path!r} must be a relative path inside the task "
            "file's folder or the pool's folder (no absolute path, no '..')"
        )
    for base in bases:
        cand = base / rel
        if not (cand.is_file() or cand.is_symlink()):
            continue
        real = cand.resolve()
        if not real.is_relative_to(base.resolve()):
            raise TaskError(
                f"upload_file: local_path {local_path!r} leads out of {base} (a symbolic "
                "link); refused"
            )
        if not real.is_file():
            continue
        return real
    raise FileNotFoundError(
        f"upload_file: {local_path!r} is in none of {', '.join(str(b) for b in bases)}"
    )


def sha256_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


@dataclass(frozen=True, slots=True)
class _Served:
    path: Path
    base: Path
    size: int


class TaskFiles:
    """The learner's index of the task files it serves: sha256 -> the confined file it
    hashed at load. Thread-safe (the control link's thread reads it)."""

    def __init__(self) -> None:
        self._files: dict[str, _Served] = {}
        self._lock = threading.Lock()
        self.served_chunks = 0
        self.refused = 0
        """Requests for a hash not in the index, or whose file changed or left its folder."""

    def __len__(self) -> int:
        return len(self._files)

    def address(
        self, task: dict[str, Any], folder: Path | None, root: Path | None = None
    ) -> dict[str, Any]:
        """A copy of `task` whose `upload_file` entries carry `sha256` and `size`; each file
        is indexed for serving. Entries that already carry a content reference are kept as
        they are (their bytes must come from another learner or a warm cache).

        Raises TaskError naming the task and the entry when a file is missing, absolute,
        has `..` or leads out of its folder."""
        bases = [b for b in (folder, root) if b is not None]
        bases = list(dict.fromkeys(b.resolve() for b in bases))
        out = copy.deepcopy(task)
        tid = out.get("id", "?")
        for f in upload_entries(out):
            if FileRef.of(f) is not None:
                continue
            local = f.get("local_path")
            try:
                path = confined(local, bases)
            except (TaskError, FileNotFoundError) as e:
                raise TaskError(f"task {tid}: {e}") from None
            sha, size = sha256_file(path)
            if size > MAX_FILE_BYTES:
                raise TaskError(
                    f"task {tid}: upload_file {local!r} has {size} bytes, above the "
                    f"{MAX_FILE_BYTES} a task file may have"
                )
            base = next(b for b in bases if path.is_relative_to(b))
            with self._lock:
                self._files[sha] = _Served(path, base, size)
            f["sha256"], f["size"] = sha, size
        return out

    def chunk(self, sha256: str, index: int) -> tuple[bytes, int, int, str]:
        """(data, total chunks, file size, error) of chunk `index` of the file `sha256`;
        error is "" when served. The file is checked again: still inside its folder, still
        the size it had when hashed (the actor checks the hash of the whole)."""
        with self._lock:
            served = self._files.get(sha256)
        if served is None:
            self.refused += 1
            return b"", 0, 0, "no task file of this learner has that sha256"
        total = max(1, -(-served.size // CHUNK_BYTES))
        if not 0 <= index < total:
            self.refused += 1
            return b"", total, served.size, f"chunk {index} out of range (0..{total - 1})"
        try:
            real = served.path.resolve(strict=True)
            if not real.is_relative_to(served.base) or real.stat().st_size != served.size:
                raise OSError("changed since the pool was loaded (moved, replaced or resized)")
            with open(real, "rb") as f:
                f.seek(index * CHUNK_BYTES)
                data = f.read(CHUNK_BYTES)
        except OSError as e:
            self.refused += 1
            return b"", total, served.size, f"{served.path.name}: {e}"
        self.served_chunks += 1
        return data, total, served.size, ""


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/arpo/task-files`, else `~/.cache/arpo/task-files`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "arpo" / "task-files"


class BlobCache:
    """A content-addressed folder of task files: `<root>/<hex[:2]>/<hex>`. A file is
    written to a unique temporary name and renamed, so concurrent writers (two actors on
    one host) never see half a file."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()

    def path_of(self, sha256: str) -> Path:
        return self.root / sha256[:2] / sha256

    def get(self, sha256: str, size: int) -> Path | None:
        """The cached file when its bytes have `sha256` (checked now); a damaged copy is
        deleted and None returned."""
        p = self.path_of(sha256)
        try:
            if p.stat().st_size == size and sha256_file(p)[0] == sha256:
                return p
        except OSError:
            return None
        p.unlink(missing_ok=True)
        return None

    def put(self, sha256: str, data: bytes | bytearray | memoryview) -> Path:
        """Keep `data` as the file `sha256`; BlobMismatch (nothing written) when it is not."""
        got = hashlib.sha256(data).hexdigest()
        if got != sha256:
            raise BlobMismatch(
                f"task file {sha256[:12]}...: received {len(data)} bytes whose sha256 is "
                f"{got[:12]}...; refused"
            )
        p = self.path_of(sha256)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.parent / f".{sha256[:12]}.{os.getpid()}.{threading.get_ident()}.part"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, p)
        return p


ChunkFetch = Callable[[str, int], Awaitable["tuple[bytes | memoryview, int, int, str] | None"]]
"""(sha256, chunk index) -> (data, total chunks, size, error), or None when nobody answered."""


class FileSource:
    """Where a runner gets the task files a grant names by content: the `BlobCache`
    first (its copy checked against the hash), else chunk by chunk from `fetch` (the
    learner's control link, or a `TaskFiles` index in this process), checked, then
    cached. Concurrent asks for one file fetch it once.

    Counters: `hits` (from the cache), `fetched` (files received whole), `refused`
    (received bytes whose hash or size was wrong: never used, never cached)."""

    def __init__(self, cache: BlobCache, fetch: ChunkFetch) -> None:
        self.cache = cache
        self._fetch = fetch
        self._locks: dict[str, asyncio.Lock] = {}
        self.hits = 0
        self.fetched = 0
        self.refused = 0

    @classmethod
    def local(cls, files: TaskFiles, cache: BlobCache) -> FileSource:
        """A source reading a `TaskFiles` index of this process (audits, tests)."""

        async def fetch(sha: str, index: int) -> tuple[bytes, int, int, str]:
            return await asyncio.to_thread(files.chunk, sha, index)

        return cls(cache, fetch)

    async def path(self, ref: FileRef) -> Path:
        """The local file with `ref`'s bytes. TaskError (BlobMismatch) when what arrives is
        not those bytes or the learner does not serve them; EnvError when it does not
        answer."""
        lock = self._locks.setdefault(ref.sha256, asyncio.Lock())
        async with lock:
            hit = await asyncio.to_thread(self.cache.get, ref.sha256, ref.size)
            if hit is not None:
                self.hits += 1
                return hit
            data = await self._receive(ref)
            try:
                p = await asyncio.to_thread(self.cache.put, ref.sha256, data)
            except BlobMismatch:
                self.refused += 1
                raise
            self.fetched += 1
            return p

    async def _receive(self, ref: FileRef) -> bytearray:
        buf = bytearray()
        index, total = 0, 1
        while index < total:
            got = await self._fetch(ref.sha256, index)
            if got is None:
                raise EnvError(
                    f"task file {ref.sha256[:12]}...: the learner did not answer (chunk {index})"
                )
            data, total, size, error = got
            if error:
                raise TaskError(f"task file {ref.sha256[:12]}... is not served: {error}")
            if size != ref.size or len(buf) + len(data) > ref.size:
                self.refused += 1
                raise BlobMismatch(
                    f"task file {ref.sha256[:12]}...: the task says {ref.size} bytes, the "
                    f"learner serves {size}; refused"
                )
            buf += data
            index += 1
        return buf

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

Only regular files are ever opened, on both sides: a FIFO, a device or a folder where a
task file (or a cached copy) should be is refused or removed without being opened, so no
thread ever blocks in open() or reads `/dev/zero` for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import logging
import os
import random
import stat
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from arpo.errors import BlobCacheError, EnvError, TaskError

log = logging.getLogger("arpo.env.taskfiles")

CHUNK_BYTES = 4 << 20
"""Bytes of one served chunk (a task file of OSWorld is at most tens of MB)."""
MAX_FILE_BYTES = 1 << 30
"""Largest task file served or fetched."""
BUSY = "busy:"
"""How the error of a `FileChunk` starts when the learner defers the request (its queue of
file replies is full): the actor asks again a little later; nothing is wrong with the file."""


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


class NotRegularFile(OSError):
    """A path that must be a regular file is something else (a FIFO, a device, a folder);
    `kind` says what, in words."""

    def __init__(self, path: Path, mode: int) -> None:
        self.kind = file_kind(mode)
        super().__init__(f"{path} is {self.kind}, not a regular file")


def file_kind(mode: int) -> str:
    """What a file of `mode` is, in words ("a FIFO", "a folder", ...), for a message."""
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return f"a file of mode {mode:o}"


def open_regular(path: Path, *, follow_links: bool = True) -> BinaryIO:
    """`path` opened for reading, when it is a regular file; NotRegularFile otherwise.

    Checked before the open (stat: a device is never opened) and again on the open file
    (fstat: nothing swapped in between is read). O_NONBLOCK: opening a FIFO returns at once
    instead of waiting for a writer. `follow_links=False`: a symbolic link is refused too."""
    st = os.stat(path) if follow_links else os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(path, st.st_mode)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(path, st.st_mode)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


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
    odd: list[str] = []  # what sits there instead of a regular file, per base
    for base in bases:
        cand = base / rel
        try:
            cand.lstat()  # anything there, a dangling link included
        except OSError:
            continue
        real = cand.resolve()
        if not real.is_relative_to(base.resolve()):
            raise TaskError(
                f"upload_file: local_path {local_path!r} leads out of {base} (a symbolic "
                "link); refused"
            )
        try:
            mode = real.stat().st_mode
        except OSError:
            continue  # a dangling link
        if not stat.S_ISREG(mode):
            odd.append(f"{file_kind(mode)} in {base}")
            continue
        return real
    if odd:
        raise TaskError(
            f"upload_file: {local_path!r} is not a regular file ({'; '.join(odd)}); an "
            "upload_file step sends a regular file: put the file itself there"
        )
    raise FileNotFoundError(
        f"upload_file: {local_path!r} is in none of {', '.join(str(b) for b in bases)}"
    )


def sha256_file(path: Path, limit: int | None = None) -> tuple[str, int]:
    """(sha256, size) of the regular file `path` (NotRegularFile for anything else). With
    `limit`, at most limit + 1 bytes are read: a size above `limit` means "larger"."""
    h = hashlib.sha256()
    n = 0
    with open_regular(path) as f:
        while chunk := f.read(1 << 20 if limit is None else min(1 << 20, limit + 1 - n)):
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
            try:
                # The size first: a file too large is refused before it is read at all.
                size = path.stat().st_size
                if size <= MAX_FILE_BYTES:
                    sha, size = sha256_file(path, MAX_FILE_BYTES)
            except OSError as e:  # replaced (by a FIFO) since `confined`, unreadable
                raise TaskError(f"task {tid}: upload_file {local!r}: {e}") from None
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

    def extent(self, sha256: str, index: int) -> tuple[int, int, int]:
        """(bytes of chunk `index`, total chunks, file size) of the file `sha256`, as its
        index knows it (nothing is read); (0, 0, 0) when it is not served."""
        with self._lock:
            served = self._files.get(sha256)
        if served is None:
            return 0, 0, 0
        total = max(1, -(-served.size // CHUNK_BYTES))
        nbytes = min(CHUNK_BYTES, served.size - index * CHUNK_BYTES) if index >= 0 else 0
        return max(0, nbytes), total, served.size

    def chunk(self, sha256: str, index: int) -> tuple[bytes, int, int, str]:
        """(data, total chunks, file size, error) of chunk `index` of the file `sha256`;
        error is "" when served. The file is checked again: still inside its folder, still a
        regular file (a FIFO or device swapped in is refused, never opened, so the control
        link's thread never blocks here), still the size it had when hashed (the actor
        checks the hash of the whole). At most the chunk's bytes are read."""
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
            if not real.is_relative_to(served.base):
                raise OSError(f"left {served.base} since the pool was loaded")
            with open_regular(real) as f:
                if os.fstat(f.fileno()).st_size != served.size:
                    raise OSError("changed since the pool was loaded (resized)")
                f.seek(index * CHUNK_BYTES)
                data = f.read(min(CHUNK_BYTES, served.size - index * CHUNK_BYTES))
        except NotRegularFile as e:
            self.refused += 1
            why = (
                f"{served.path.name} is {e.kind}, not a regular file (replaced since the "
                "pool was loaded)"
            )
            return b"", total, served.size, why
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
    one host) never see half a file.

    Only regular files are read (never followed through a link, never a FIFO or device, so
    no read blocks or runs for ever). Anything else at a blob's place (a FIFO, a link, a
    device, an empty folder) or a copy that cannot be read is a fault of this host's cache:
    it is removed (counted in `repaired`, logged) and the file is fetched again. What cannot
    be removed (a folder with files in it) or written raises `BlobCacheError` naming the
    path and the fix: an environment-side error, never the task's."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()
        self.repaired = 0
        """Faulty entries removed (not regular files, unreadable or damaged copies)."""

    def path_of(self, sha256: str) -> Path:
        return self.root / sha256[:2] / sha256

    def get(self, sha256: str, size: int) -> Path | None:
        """The cached file when it is a regular file of `size` bytes whose bytes have
        `sha256` (checked now, reading at most `size` bytes); None when absent. A damaged
        copy is deleted and None returned; a cache fault is removed and None returned, or
        BlobCacheError when it cannot be removed."""
        p = self.path_of(sha256)
        folder = self._folder_fault(p.parent)
        if folder:
            self._remove(p.parent, folder)
            return None
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._error(p, f"cannot be looked at ({e.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            self._remove(p, f"is {file_kind(st.st_mode)}, not a regular file")
            return None
        if st.st_size == size:
            try:
                with open_regular(p, follow_links=False) as f:
                    h = hashlib.sha256()
                    left = size
                    while left and (chunk := f.read(min(1 << 20, left))):
                        h.update(chunk)
                        left -= len(chunk)
                if h.hexdigest() == sha256 and not left:
                    return p
            except OSError as e:  # swapped since the lstat, unreadable (EACCES, EIO)
                self._remove(p, f"cannot be read ({e})")
                return None
        self._remove(p, "holds other bytes than its name says (damaged)")
        return None

    def put(self, sha256: str, data: bytes | bytearray | memoryview) -> Path:
        """Keep `data` as the file `sha256`; BlobMismatch (nothing written) when it is not;
        BlobCacheError when the cache cannot take it (its folder is not writable, a folder
        with files in it sits at the file's place)."""
        got = hashlib.sha256(data).hexdigest()
        if got != sha256:
            raise BlobMismatch(
                f"task file {sha256[:12]}...: received {len(data)} bytes whose sha256 is "
                f"{got[:12]}...; refused"
            )
        p = self.path_of(sha256)
        tmp = p.parent / f".{sha256[:12]}.{os.getpid()}.{threading.get_ident()}.part"
        try:
            folder = self._folder_fault(p.parent)
            if folder:
                self._remove(p.parent, folder)
            p.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()  # left by a writer of this pid and thread that died
            # O_EXCL: a new file, never an existing FIFO or link (open would block or follow)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, p)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise self._error(p, f"cannot be written ({e})") from None
        return p

    @staticmethod
    def _folder_fault(folder: Path) -> str:
        """Why `folder` (a blob's `<hex[:2]>` folder) is not a folder, or ""."""
        try:
            mode = os.lstat(folder).st_mode
        except OSError:
            return ""  # absent (made by `put`), or reported when the file is looked at
        return "" if stat.S_ISDIR(mode) else f"is {file_kind(mode)}, not a folder"

    def _remove(self, path: Path, why: str) -> None:
        """Remove the faulty entry `path` (a file, link, FIFO, device or empty folder; a
        folder's contents are never deleted): BlobCacheError when it cannot be."""
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                os.rmdir(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass  # another actor of this host removed it first
        except OSError as e:
            raise self._error(path, f"{why}, and cannot be removed ({e.strerror})") from None
        self.repaired += 1
        log.warning("task-file cache: %s %s; removed, the file is fetched again", path, why)

    def _error(self, path: Path, why: str) -> BlobCacheError:
        return BlobCacheError(
            f"task-file cache: {path} {why}. This is a fault of this host's cache, not of the "
            f"task: remove {path} by hand, or point the actor's file_cache_dir at another "
            "folder"
        )


ChunkFetch = Callable[[str, int], Awaitable["tuple[bytes | memoryview, int, int, str] | None"]]
"""(sha256, chunk index) -> (data, total chunks, size, error), or None when nobody answered."""


class FileSource:
    """Where a runner gets the task files a grant names by content: the `BlobCache`
    first (its copy checked against the hash), else chunk by chunk from `fetch` (the
    learner's control link, or a `TaskFiles` index in this process), checked, then
    cached. Concurrent asks for one file fetch it once.

    A chunk the learner defers (its error starts with `BUSY`: its queue of file replies
    is full) is asked for again after a capped, jittered backoff, for up to
    `busy_timeout_s` in all; then EnvError (the learner's state, never the task's).

    Counters: `hits` (from the cache), `fetched` (files received whole), `refused`
    (received bytes whose hash or size was wrong: never used, never cached), `busy`
    (chunks the learner deferred)."""

    def __init__(self, cache: BlobCache, fetch: ChunkFetch, busy_timeout_s: float = 120.0) -> None:
        self.cache = cache
        self._fetch = fetch
        self.busy_timeout_s = busy_timeout_s
        self._locks: dict[str, asyncio.Lock] = {}
        self.hits = 0
        self.fetched = 0
        self.refused = 0
        self.busy = 0

    @classmethod
    def local(cls, files: TaskFiles, cache: BlobCache) -> FileSource:
        """A source reading a `TaskFiles` index of this process (audits, tests)."""

        async def fetch(sha: str, index: int) -> tuple[bytes, int, int, str]:
            return await asyncio.to_thread(files.chunk, sha, index)

        return cls(cache, fetch)

    async def path(self, ref: FileRef) -> Path:
        """The local file with `ref`'s bytes. TaskError (BlobMismatch) when what arrives is
        not those bytes or the learner does not serve them; EnvError when it does not
        answer; BlobCacheError (an EnvError) when this host's cache cannot hold it."""
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
        delay, waited = 0.05, 0.0
        while index < total:
            got = await self._fetch(ref.sha256, index)
            if got is None:
                raise EnvError(
                    f"task file {ref.sha256[:12]}...: the learner did not answer (chunk {index})"
                )
            data, total, size, error = got
            if error.startswith(BUSY):
                self.busy += 1
                if waited >= self.busy_timeout_s:
                    raise EnvError(
                        f"task file {ref.sha256[:12]}...: the learner deferred chunk {index} "
                        f"for {waited:.0f} s ({error})"
                    )
                pause = delay * (0.5 + random.random() / 2)
                await asyncio.sleep(pause)
                waited += pause
                delay = min(2.0, delay * 2)
                continue
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

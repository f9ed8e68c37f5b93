"""Download the files OSWorld tasks need into the local file cache (`arpo.env.cache`).

    arpo fetch --tasks shared/osworld/evaluation_examples --index test_all.json \
        --cache osworld_cache -j 4 --retries 5
    arpo fetch --tasks shared/osworld/evaluation_examples --cache osworld_cache \
        --dry-run                                     # list what is needed, download nothing
    python -m arpo.env.fetch --tasks DIR --cache DIR  # the same `main`

`--tasks` is a task file (.json with a task or a list of tasks, .jsonl), a folder searched
for task files (an OSWorld `evaluation_examples` folder works as is), or, with `--index`,
an OSWorld `evaluation_examples` folder and the index file (`test_all.json`) naming the
tasks. `--cache` is the folder the runner reads (`RunnerConfig.cache_dir`).

What a task set needs: every `download` step of a task's setup and of its evaluator's
postconfig (`files: [{url, path}]`), and every `cloud_file` getter (`path` a URL, or a list
of URLs with `multi`; `dest` the file's name). Each file is stored under **OSWorld's own
cache name** `<uuid5(NAMESPACE_URL, url)>_<file name>` (the name of `path` on the VM, or
`dest`), the second name `FileCache.lookup` tries and the one OSWorld's `SetupController`
uses, so the folder serves both.

- A URL is downloaded once, however many tasks and names need it; its other cache names
  are hard links to (or copies of) the downloaded file.
- Several URLs at a time (`FetchConfig.concurrency`), each with retries and capped
  exponential backoff on transport errors, dropped connections, stalls, 408/429 and 5xx
  answers. Other 4xx answers fail at once; a URL that is not http(s), and a file name that
  cannot be a cache name (NUL, longer than the filesystem allows), are refused without a
  request.
- **Resume**: a download in progress is `<cache name>.part`; a later try (or a later run)
  continues it with `Range: bytes=<size>-` (and `If-Range`, with the file's ETag or date
  when an earlier try of the run saw one). A server that answers 200 instead of 206
  restarts the file from its first byte. A 206 is used only when it provably continues the
  file: its Content-Range starts at `<size>`, ends inside a known total (not `*`), and
  gives the file the size an earlier answer gave. One that starts elsewhere, or gives
  another size (the file changed on the server), drops the part and starts again; one that
  cannot be checked (total `*`, a range past the total) is not used: the file is asked for
  again without Range, and fails with the reason if the server still answers so. A 206 of
  a bounded range is followed by a request for the rest at once. (A `.part` from an
  earlier run is trusted to be the first bytes of the same file.)
- **Size check**: the bytes written must equal Content-Length (200) or Content-Range's
  total (206). Only then is the file moved into place, atomically (`os.replace`); a file
  that never reaches its size is a failure of that file and never appears in the cache.
- **Limits**, so that the command always ends and its disk use is bounded: a file larger
  than `--max-size` is refused (before its body when announced, else when it grows past
  it); a file not in place within `--file-timeout` (all its tries and waits) fails; a try
  that receives fewer than `--stall-bytes` in `--stall` seconds is given up and retried.
  The defaults are sized for OSWorld's files (see `FetchConfig`). A run takes at most
  about ceil(URLs / -j) x `--file-timeout`, and holds at most -j x `--max-size` of parts.
- A cache name already in the cache is skipped: a second run downloads nothing.
- The summary (downloaded / linked / skipped / failed, bytes, seconds) goes to stdout and
  `<cache>/fetch-report.json`, which lists every file that could not be had with its URL,
  the reason and the ids of the tasks that need it, and every task file left out with its
  reason. Exit code 1 when any file failed or a task file was left out, 2 for bad
  arguments (every number is checked against a finite range at start), a `--tasks` or
  `--index` that cannot be read, or a cache path that cannot be a folder.

**The cache folder is the only place written**, and nothing in it is trusted to be what its
name says. The folder is opened once and every name in it is used relative to that
descriptor (`dir_fd`), never through a path; names are single components. A symbolic link,
FIFO or other non-regular file where a `.part`, a temporary file, the lock or a cache name
goes is removed and replaced, never followed or opened (`O_NOFOLLOW`, `O_NONBLOCK` and an
fstat check on every open); a folder in such a place fails that one file with the reason.
The cache path itself may be a link to a folder (the operator's choice); one that is a
file or a dangling link stops the command with exit 2.

Task files are read the same careful way (`arpo.env.task.read_task_file`): only regular
files are opened (a FIFO named `*.json` is left out, not waited on), each at most
`TASK_FILE_MAX_BYTES`, folders are searched at most `TASK_FOLDER_DEPTH` deep without
following links to folders, and an index's domains and ids must be plain names (no `/`,
`..` or NUL), so that no file outside the examples folder is read. A task file that cannot be read, parsed (nesting too deep
included) or understood as a task is left out with its reason; the others go on. A file of a
folder holds a task, a list of tasks or {"tasks": [...]}, as in `arpo train`'s pools
(`arpo.env.task.folder_tasks`), and a task set `arpo train` refuses as a whole, a task id
given twice or no task at all, is refused with its message (exit 2).

One fetch per cache folder at a time (`<cache>/.fetch.lock`, advisory). The cache has
nothing but OSWorld's names: `index.json` (FileCache's first lookup) is neither read nor
written here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import re
import stat
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlparse

import aiohttp

from arpo.env.cache import cache_name
from arpo.env.task import (
    PoolIds,
    Task,
    folder_tasks,
    no_tasks,
    parse_task_json,
    read_task_file,
    task_domain,
)
from arpo.env.taskfiles import file_kind
from arpo.errors import TaskError

log = logging.getLogger("arpo.env.fetch")

REPORT = "fetch-report.json"
"""The run's report, in the cache folder."""
LOCK = ".fetch.lock"
"""Held (flock) by the fetch that is filling the cache folder."""
PART_SUFFIX = ".part"
"""A download in progress: `<cache name>.part`, continued by the next try or run."""
TMP_SUFFIX = ".tmp"
"""A file being put in place (a link or copy of another name, the report)."""
NAME_MAX = 255
"""Longest file name, in bytes, of the filesystems the cache lives on (Linux's NAME_MAX):
a cache name with its `.part` suffix must fit."""
TASK_FILE_MAX_BYTES = 16 << 20
"""Largest task or index file read (OSWorld's are a few kB)."""
TASK_FOLDER_DEPTH = 16
"""Deepest folder below `--tasks` searched for task files (OSWorld's are 2 deep)."""
REASON_CHARS = 500
"""Longest reason kept in the report (a task's error can quote a whole JSON value)."""

_KiB, _MiB, _GiB, _TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


@dataclass(frozen=True, slots=True)
class FetchConfig:
    """How the files are downloaded.

    Sizes and times are bounded so that a hostile or broken server cannot fill the disk or
    hold the fetch forever. OSWorld's task files do not record their files' sizes. By their
    names, the 660 URLs of `test_all.json` (all on the `xlangai/ubuntu_osworld_file_cache`
    dataset) are office documents, PDFs, images and scripts (kB to a few MB), and a few
    dozen short video clips and application profiles or projects packed as .tar.gz/.zip
    (expected tens to a few hundred MB). The defaults leave a wide margin above that, and
    stay finite.
    """

    concurrency: int = 4
    """URLs downloaded at once (-j, 1 to 64)."""
    retries: int = 5
    """Tries after the first, per URL, on transport errors, dropped connections, stalls, a
    body shorter than announced, 408, 429 and 5xx answers (--retries, 0 to 100). Other 4xx
    answers are not retried."""
    backoff_s: float = 1.0
    """Delay before the first retry (--backoff, 0 to 600 s); it doubles on each retry, up to
    `backoff_max_s`."""
    backoff_max_s: float = 30.0
    """Cap of the delay between two tries (0 to 3600 s, at least `backoff_s`)."""
    connect_timeout_s: float = 20.0
    """Longest wait for a TCP (and TLS) connection to be set up (0.01 to 600 s)."""
    read_timeout_s: float = 60.0
    """Longest silence of the server, for the answer's headers and between two parts of its
    body (0.01 to 3600 s; `stall_s` when that is shorter)."""
    max_bytes: int = 1 * _GiB
    """Largest file accepted (--max-size, 1 B to 1 TiB; default 1 GiB, several times the
    largest OSWorld file expected). One announced larger is refused before its body is read; one
    that grows larger while it is read is refused there and its part removed (not retried).
    At most `concurrency` parts grow at once, so this also bounds the disk a run can use."""
    file_timeout_s: float = 1800.0
    """Longest time for one URL, all its tries and the waits between them included
    (--file-timeout, 0.01 s to 7 days; default 30 min: 1 GiB at 0.6 MB/s). When it passes the
    file fails; its `.part` is kept for the next run to continue."""
    stall_s: float = 60.0
    """Window of the stall check (--stall, 0.01 to 3600 s): a try that receives fewer than
    `stall_bytes` in this long is given up (and retried), so a server that trickles bytes
    cannot hold a try; total silence this long is a stall too."""
    stall_bytes: int = 64 * _KiB
    """Bytes a try must receive in each `stall_s` window (--stall-bytes, 1 B to 1 GiB; the
    defaults ask for about 1 kB/s, far below any working link)."""
    chunk_bytes: int = 1 * _MiB
    """Largest piece read from the network and written to the `.part` file at once (1 B to
    64 MiB)."""
    keep_free_bytes: int = 256 * _MiB
    """Disk space left free on the cache's file system (--keep-free, 0 B to 1 TiB). A file of
    known size (Content-Length, or the total of a Content-Range) is refused before its body
    when the rest of it, with what the downloads under way still need, would leave less than
    this free."""
    trust_env: bool = True
    """Use HTTP(S)_PROXY / NO_PROXY from the environment, as OSWorld's `requests` does."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name not in _RANGES:
                continue
            flag, low, high = _RANGES[f.name]
            value = getattr(self, f.name)
            kind = int if isinstance(low, int) else (int, float)
            if (
                isinstance(value, bool)
                or not isinstance(value, kind)
                or not (math.isfinite(value) and low <= value <= high)
            ):
                name = f"{flag} ({f.name})" if flag else f.name
                raise ValueError(
                    f"{name} must be a finite {'whole ' if kind is int else ''}number from "
                    f"{_shown(f.name, low)} to {_shown(f.name, high)}, got {value!r}"
                )
        if self.backoff_s > self.backoff_max_s:
            raise ValueError(
                f"need backoff_s <= backoff_max_s, got {self.backoff_s} and "
                f"{self.backoff_max_s}; raise backoff_max_s or lower backoff_s (--backoff)"
            )

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (0 for the first)."""
        return min(self.backoff_max_s, self.backoff_s * 2.0 ** min(retry, 64))


_RANGES: dict[str, tuple[str, int | float, int | float]] = {
    "concurrency": ("-j", 1, 64),
    "retries": ("--retries", 0, 100),
    "backoff_s": ("--backoff", 0.0, 600.0),
    "backoff_max_s": ("", 0.0, 3600.0),
    "connect_timeout_s": ("", 0.01, 600.0),
    "read_timeout_s": ("", 0.01, 3600.0),
    "max_bytes": ("--max-size", 1, _TiB),
    "file_timeout_s": ("--file-timeout", 0.01, 7 * 86400.0),
    "stall_s": ("--stall", 0.01, 3600.0),
    "stall_bytes": ("--stall-bytes", 1, _GiB),
    "chunk_bytes": ("", 1, 64 * _MiB),
    "keep_free_bytes": ("--keep-free", 0, _TiB),
}
"""FetchConfig's numbers: (command-line flag or "", lowest, highest)."""


def _shown(name: str, value: float) -> str:
    """A bound of FetchConfig's field `name`, with its unit."""
    if name.endswith("_bytes"):
        for unit, size in (("TiB", _TiB), ("GiB", _GiB), ("MiB", _MiB), ("KiB", _KiB)):
            if value >= size and value % size == 0:
                return f"{value // size:g} {unit}"
        return f"{value:g} B"
    return f"{value:g} s" if name.endswith("_s") else f"{value:g}"


def _clip(text: str) -> str:
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


def _os_reason(e: BaseException) -> str:
    """An OSError (or the ValueError of a NUL in a name) as a reason: what failed, on what."""
    if isinstance(e, OSError) and e.strerror:
        name = f": {e.filename}" if e.filename is not None else ""
        return f"{e.strerror}{name}"
    return f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------------------- what is needed


@dataclass(slots=True)
class Wanted:
    """One file of the cache: a URL under one of OSWorld's cache names, and who needs it."""

    url: str
    name: str
    """OSWorld's cache name, `<uuid5(NAMESPACE_URL, url)>_<file name>`."""
    tasks: list[str] = field(default_factory=list)
    """Ids of the tasks that need it, in the order they were listed."""
    refused: str = ""
    """Why it is not downloaded at all (not an http(s) URL, no usable file name); "" when it
    can be."""


def _refusal(url: str, file_name: str, name: str) -> str:
    try:
        scheme = urlparse(url).scheme.lower()
    except ValueError as e:  # "http://[::1" and the like
        return f"not a URL ({e}): {url!r:.200}"
    if scheme not in ("http", "https"):
        return f"not an http(s) URL: {url!r:.200}"
    if not file_name or file_name in (".", ".."):
        return "no file name to store it under (the step's path or the getter's dest is empty)"
    if any(ord(c) < 32 or ord(c) == 127 for c in file_name):
        return (
            f"the file name {file_name!r:.200} holds a control character (NUL, newline, ...), "
            "which a cache name may not"
        )
    size = len((name + PART_SUFFIX).encode("utf-8"))
    if size > NAME_MAX:
        return (
            f"the file name is too long for the cache: {len(os.fsencode(file_name))} bytes; "
            f"with OSWorld's prefix and {PART_SUFFIX} it would be {size}, over the "
            f"{NAME_MAX} a file name may have"
        )
    return ""


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeError:
        return False
    return True


def _escaped(s: str) -> str:
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def wanted_files(tasks: Sequence[Task]) -> list[Wanted]:
    """Every file the tasks' setup and postconfig `download` steps and `cloud_file` getters
    need, one entry per cache name (sorted by it), each with the tasks that need it."""
    out: dict[str, Wanted] = {}

    def want(url: Any, dest: Any, task_id: str) -> None:
        url = "" if url is None else str(url)
        dest = "" if dest is None else dest
        file_name = PurePosixPath(dest).name if isinstance(dest, str) else ""
        why = "" if isinstance(dest, str) else f"the path or dest is not a string: {dest!r:.100}"
        if not (_is_text(url) and _is_text(file_name)):
            # a lone surrogate from a JSON "\ud800": kept escaped, never fetched
            url, file_name = _escaped(url), _escaped(file_name)
            why = why or "the URL or the file name is not valid Unicode text"
        name = cache_name(url, file_name)
        w = out.get(name)
        if w is None:
            w = out[name] = Wanted(url, name, refused=why or _refusal(url, file_name, name))
        if task_id not in w.tasks:
            w.tasks.append(task_id)

    for t in tasks:
        for step in (*t.config, *t.evaluator.postconfig):
            if step.type == "download":
                files = step.parameters.get("files")
                for f in files if isinstance(files, list) else []:
                    if isinstance(f, dict):
                        want(f.get("url"), f.get("path"), t.id)
        for spec in (*t.evaluator.result, *t.evaluator.expected):
            if spec is None or spec.type != "cloud_file":
                continue
            paths, dests = spec.params.get("path"), spec.params.get("dest")
            if spec.params.get("multi", False):
                paths = paths if isinstance(paths, list) else [paths]
                dests = dests if isinstance(dests, list) else [dests]
                # OSWorld pairs them with zip: a URL without a dest is never fetched there
                for u, d in zip(paths, dests, strict=False):
                    want(u, d, t.id)
            else:
                want(paths, dests, t.id)
    return sorted(out.values(), key=lambda w: w.name)


# ---------------------------------------------------------------------------- task files


@dataclass(frozen=True, slots=True)
class LeftOut:
    """A task file (or one task of a list) that was not used, and why."""

    where: str
    reason: str


def _reason(e: TaskError, where: str) -> str:
    """The error's message without its leading `<where>: ` (a LeftOut names the file)."""
    text = str(e)
    return _clip(text[len(where) + 2 :] if text.startswith(f"{where}: ") else text)


def _task(raw: Any, where: str, domain: str) -> Task:
    try:
        return Task.from_dict(raw, domain=domain, path=where)
    except RecursionError:  # an error message quoting a deeply nested value
        raise TaskError(f"{where}: a value nested too deeply to read") from None


def _plain_name(value: str) -> bool:
    """A single path component: not empty, no '/', no NUL, not '.' or '..'."""
    return bool(value) and "/" not in value and "\0" not in value and value not in (".", "..")


def _task_files(root: Path, left_out: list[LeftOut]) -> list[Path]:
    """The `*.json` files below `root` that are regular files (or links to them), sorted;
    searched without recursion, at most TASK_FOLDER_DEPTH folders deep, never through a link
    to a folder. What cannot be searched or is not a regular file is left out with why."""
    found: list[Path] = []
    stack: list[tuple[Path, int]] = [(root, 0)]
    while stack:
        folder, depth = stack.pop()
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except (OSError, ValueError) as e:
            left_out.append(LeftOut(str(folder), f"cannot list the folder: {_os_reason(e)}"))
            continue
        for entry in entries:
            path = Path(entry.path)
            try:
                if entry.is_dir(follow_symlinks=False):
                    if depth + 1 > TASK_FOLDER_DEPTH:
                        left_out.append(
                            LeftOut(
                                entry.path,
                                f"deeper than {TASK_FOLDER_DEPTH} folders below {root}; "
                                "not searched",
                            )
                        )
                    else:
                        stack.append((path, depth + 1))
                elif entry.name.endswith(".json"):
                    mode = entry.stat().st_mode  # a link to a file is followed, as when opened
                    if stat.S_ISREG(mode):
                        found.append(path)
                    else:
                        left_out.append(
                            LeftOut(entry.path, f"{file_kind(mode)}, not a regular file; not read")
                        )
            except OSError as err:
                left_out.append(LeftOut(entry.path, _os_reason(err)))
    return sorted(found)


def load_fetch_tasks(
    path: str | Path, index: str | None = None, left_out: list[LeftOut] | None = None
) -> list[Task]:
    """The tasks of `--tasks` (and `--index`): an OSWorld examples folder and its index
    file, a folder searched for task files, or a task file (.json, .jsonl).

    A task file (or a task of a list) that cannot be read or understood is appended to
    `left_out` with its reason and the others are returned; with `left_out` None it raises
    TaskError instead. TaskError in any case for a `--tasks` or `--index` that cannot be
    read at all, and for a task set `arpo train` refuses as a whole (`load_pool`'s checks
    and messages): a task id given twice, a set that holds no task.
    """
    strict = left_out is None
    skipped: list[LeftOut] = [] if left_out is None else left_out
    tasks: list[Task] = []
    ids = PoolIds()

    def one(raw: Any, where: str, domain: str) -> None:
        try:
            task = _task(raw, where, domain)
        except TaskError as e:
            if strict:
                raise
            skipped.append(LeftOut(where, _reason(e, where)))
            return
        ids.add(task.id, where)
        tasks.append(task)

    p = Path(path)
    try:
        is_dir = stat.S_ISDIR(os.stat(p).st_mode)
    except (OSError, ValueError) as e:
        raise TaskError(f"{p}: no such task folder or file ({_os_reason(e)})") from None
    if index is not None:
        for domain, task_file in _indexed(p, index, skipped, strict):
            where = str(task_file)
            try:
                raw = parse_task_json(
                    read_task_file(task_file, max_bytes=TASK_FILE_MAX_BYTES), where
                )
            except TaskError as e:
                if strict:
                    raise
                skipped.append(LeftOut(where, _reason(e, where)))
                continue
            one(raw, where, domain)
    elif is_dir:
        for f in _task_files(p, skipped):
            try:
                raw = parse_task_json(read_task_file(f, max_bytes=TASK_FILE_MAX_BYTES), str(f))
            except TaskError as e:
                if strict:
                    raise
                skipped.append(LeftOut(str(f), _reason(e, str(f))))
                continue
            # As in a folder pool of `arpo train`: a task, a list of tasks or {"tasks": [...]};
            # files that hold none (index files and the like) are skipped.
            for t, where in folder_tasks(raw, str(f)):
                one(t, where, task_domain(t, f.parent.name) if isinstance(t, dict) else "")
        if strict and skipped:
            raise TaskError(f"{skipped[0].where}: {skipped[0].reason}")
    else:
        text = read_task_file(p, max_bytes=TASK_FILE_MAX_BYTES)
        if p.suffix == ".jsonl":
            for i, line in enumerate(text.splitlines()):
                if line.strip():
                    where = f"{p}:{i + 1}"
                    try:
                        raw = parse_task_json(line, where)
                    except TaskError as e:
                        if strict:
                            raise
                        skipped.append(LeftOut(where, _reason(e, where)))
                        continue
                    one(raw, where, task_domain(raw) if isinstance(raw, dict) else "")
        else:
            raw = parse_task_json(text, str(p))
            if isinstance(raw, dict) and isinstance(raw.get("tasks"), list):
                raw = raw["tasks"]
            for i, t in enumerate(raw if isinstance(raw, list) else [raw]):
                where = f"{p}[{i}]" if isinstance(raw, list) else str(p)
                one(t, where, task_domain(t) if isinstance(t, dict) else "")
    if not tasks and not skipped:
        raise no_tasks(p)
    return tasks


def _indexed(
    root: Path, index: str, left_out: list[LeftOut], strict: bool
) -> Iterator[tuple[str, Path]]:
    """(domain, task file) of each task an index file names, in its order. A domain or id
    that is not a plain name (it could lead out of the examples folder), and a task file
    that leads out of it through a link, are left out with the reason."""
    index_path = Path(index) if Path(index).is_absolute() else root / index
    raw = parse_task_json(
        read_task_file(index_path, what="task index", max_bytes=TASK_FILE_MAX_BYTES),
        str(index_path),
    )
    if not isinstance(raw, dict) or not all(
        isinstance(v, list) and all(isinstance(i, str) for i in v) for v in raw.values()
    ):
        raise TaskError(f"{index_path}: an index must map each domain to a list of task ids")
    try:
        ex = root / "examples" if stat.S_ISDIR(os.stat(root / "examples").st_mode) else root
    except (OSError, ValueError):
        ex = root
    for domain, ids in raw.items():
        for tid in ids:
            where = f"{index_path}: {domain}/{tid}"
            if not (_plain_name(domain) and _plain_name(tid)):
                why = (
                    f"domain {domain!r:.100} and task id {tid!r:.100} must be plain names "
                    f"(no '/', '..' or NUL): the task file would be outside {ex}"
                )
            else:
                f = ex / domain / f"{tid}.json"
                try:  # a link in the folder may lead out of it too
                    inside = f.resolve().is_relative_to(ex.resolve())
                    why = f"{f} leads out of {ex} (a symbolic link)"
                except (OSError, RuntimeError) as e:
                    inside, why = False, f"cannot resolve {f}: {e}"
                if inside:
                    yield domain, f
                    continue
            if strict:
                raise TaskError(f"{where}: {why}")
            left_out.append(LeftOut(where, why))


# ---------------------------------------------------------------------------- the cache folder


class CacheUnusable(RuntimeError):
    """The cache path cannot be the cache folder (a file, a dangling link, no permission)."""


class CacheBusy(RuntimeError):
    """Another fetch holds the cache folder's lock."""


def check_cache_path(cache: Path) -> str:
    """Why `cache` cannot be the cache folder ("" when it can, or when it does not exist yet
    and would be made). A link to a folder is fine; a file or a dangling link is not."""
    try:
        st = os.lstat(cache)
    except FileNotFoundError:
        return ""
    except (OSError, ValueError) as e:
        return f"cannot use {cache} as the cache folder: {_os_reason(e)}"
    if stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(cache)
        except (OSError, ValueError) as e:
            try:
                target = os.readlink(cache)
            except OSError:
                target = "?"
            return (
                f"the cache path {cache} is a symbolic link to {target}, which cannot be "
                f"reached ({_os_reason(e)}); make that folder or give another --cache"
            )
    if not stat.S_ISDIR(st.st_mode):
        return f"the cache path {cache} is {file_kind(st.st_mode)}, not a folder; give a folder"
    return ""


class _CacheFolder:
    """The cache folder, held open: every name in it is looked up, opened, replaced and
    removed relative to this descriptor, never through a path, and never through a link.
    Names are single components (cache names hold no '/'), so nothing outside the folder is
    written, even if its path is swapped for a link while the fetch runs.

    Whatever is found under a name is not trusted: a link, FIFO, socket or device where a
    file is to be written is removed first (`clear`), and every open has O_NOFOLLOW and
    O_NONBLOCK and is checked with fstat; a folder in the way is an error of that name."""

    def __init__(self, path: Path) -> None:
        why = check_cache_path(path)
        if why:
            raise CacheUnusable(why)
        try:
            path.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (OSError, ValueError) as e:
            raise CacheUnusable(
                f"cannot make or open the cache folder {path}: {_os_reason(e)}"
            ) from None
        self.path = path
        self.promised = 0
        """Bytes the downloads under way still expect to write (the free-space check's
        share of the disk that is taken but not yet written)."""

    def close(self) -> None:
        os.close(self.fd)

    def free_bytes(self) -> int:
        """Bytes an unprivileged writer may still use on the cache's file system."""
        st = os.fstatvfs(self.fd)
        return st.f_bavail * st.f_frsize

    def mode(self, name: str) -> int | None:
        """lstat's st_mode of `name`, None when there is nothing there."""
        try:
            return os.lstat(name, dir_fd=self.fd).st_mode
        except FileNotFoundError:
            return None

    def is_file(self, name: str) -> bool:
        """A regular file is at `name` (a link to one is not)."""
        mode = self.mode(name)
        return mode is not None and stat.S_ISREG(mode)

    def size(self, name: str) -> int:
        """Size of the file at `name`, to be continued; 0 when there is none. Anything else
        there but a folder is removed, and so is a file with other hard links (it could be
        a file outside the cache: appending would write there)."""
        self.clear(name, keep_file=True)
        try:
            st = os.lstat(name, dir_fd=self.fd)
        except FileNotFoundError:
            return 0
        if st.st_nlink > 1:
            log.warning("%s: has other hard links; starting it again", self.path / name)
            self.unlink(name)
            return 0
        return st.st_size

    def clear(self, name: str, *, keep_file: bool = False) -> None:
        """Remove what is at `name`: a link itself (never its target), a FIFO, a socket, a
        file (unless `keep_file`). A folder there raises IsADirectoryError: it is left alone."""
        mode = self.mode(name)
        if mode is None or (keep_file and stat.S_ISREG(mode)):
            return
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(
                errno.EISDIR, "a folder is in the way in the cache", str(self.path / name)
            )
        if not stat.S_ISREG(mode):
            log.warning("%s: %s in the cache; removing it", self.path / name, file_kind(mode))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def open(self, name: str, flags: int) -> int:
        """A descriptor of the regular file `name` (O_NOFOLLOW, O_NONBLOCK, fstat-checked)."""
        fd = os.open(
            name,
            flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
            0o666,
            dir_fd=self.fd,
        )
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise OSError(errno.EINVAL, f"{file_kind(mode)} swapped in", str(self.path / name))
        return fd

    def open_write(self, name: str, *, append: bool) -> int:
        """`name` opened to write: the file there (checked by `size`) to append to, or a new
        file in place of whatever was there (never truncated in place: it may be a hard link
        to a file outside the cache)."""
        if append:
            fd = self.open(name, os.O_WRONLY | os.O_APPEND)
            if os.fstat(fd).st_nlink == 1:
                return fd
            os.close(fd)
            raise OSError(errno.EMLINK, "another hard link appeared", str(self.path / name))
        self.clear(name)
        return self.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)

    def unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def replace(self, src: str, dst: str) -> None:
        """Move `src` to `dst` atomically; whatever non-folder was at `dst` (a link too) is
        replaced, not followed."""
        if (mode := self.mode(dst)) is not None and stat.S_ISDIR(mode):
            raise IsADirectoryError(
                errno.EISDIR, "a folder is in the way in the cache", str(self.path / dst)
            )
        os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def place(self, src: str, dst: str) -> None:
        """Put a copy of the regular file `src` at `dst` atomically: a hard link, or a copy
        where links fail."""
        tmp = f"{dst}{TMP_SUFFIX}"
        self.clear(tmp)
        try:
            os.link(src, tmp, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)
        except OSError:
            fin = self.open(src, os.O_RDONLY)
            try:
                fout = self.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
                try:
                    while data := os.read(fin, 1 << 20):
                        _write_all(fout, data)
                finally:
                    os.close(fout)
            finally:
                os.close(fin)
        self.replace(tmp, dst)

    def write_atomic(self, name: str, data: bytes) -> None:
        tmp = f"{name}{TMP_SUFFIX}"
        self.clear(tmp)
        fd = self.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)
        self.replace(tmp, name)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


@contextlib.contextmanager
def _cache_lock(folder: _CacheFolder) -> Iterator[None]:
    try:
        folder.clear(LOCK, keep_file=True)
        fd = folder.open(LOCK, os.O_RDWR | os.O_CREAT)
    except OSError as e:
        raise CacheUnusable(f"cannot make the lock {folder.path / LOCK}: {_os_reason(e)}") from e
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CacheBusy(
                f"another fetch is filling {folder.path} ({folder.path / LOCK} is locked); "
                "wait for it"
            ) from None
        yield
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- downloading


class _TryFailed(Exception):
    """One try of one URL did not finish the file; `retry` says whether another may."""

    def __init__(self, reason: str, *, retry: bool, again: bool = False) -> None:
        super().__init__(reason)
        self.retry = retry
        self.again = again
        """Not a failure: ask again at once (the server sent a bounded range, which moved
        the file on; or a 206 that cannot be checked, and the whole file is asked for)."""
        self.received = 0
        """Bytes received in this try (set by _try_once)."""


@dataclass(slots=True)
class _Seen:
    """What earlier tries of this run learnt about the file, to tell a changed one."""

    total: int | None = None
    """Its size."""
    validator: str | None = None
    """Its strong ETag, else its Last-Modified date: sent as If-Range."""
    no_range: bool = False
    """The server answered a Range with a 206 that could not be checked: ask for the whole
    file from now on."""


_RETRY_STATUS = frozenset({408, 429})


def _content_range(value: str) -> tuple[int | None, int | None, int | None]:
    """(first, last, total) of `bytes <first>-<last>/<total>`; None for a `*` part (a 416
    answer's `bytes */<total>`, or a total the server does not know)."""
    try:
        unit, rest = value.strip().split(" ", 1)
        span, total = rest.strip().split("/", 1)
        if unit.lower() != "bytes":
            raise ValueError(unit)
        first = last = None
        if span.strip() != "*":
            a, b = span.split("-", 1)
            first, last = int(a), int(b)
            if first < 0 or last < 0:
                raise ValueError(span)
        size = None if total.strip() == "*" else int(total)
        if size is not None and size < 0:
            raise ValueError(total)
        return first, last, size
    except ValueError:
        raise _TryFailed(f"unreadable Content-Range {value!r:.100}", retry=True) from None


def _partial_problem(
    first: int | None, last: int | None, total: int | None, length: int | None
) -> str:
    """Why a 206's range cannot be placed in the file ("" when it can): its total must be
    known and the range must lie inside it, with as many bytes as Content-Length says."""
    if total is None or first is None or last is None:
        return "a total the server does not know"
    if not first <= last < total:
        return "a range outside the file's size"
    if length is not None and length != last - first + 1:
        return f"a Content-Length of {length} bytes for a range of {last - first + 1}"
    return ""


def _check_room(folder: _CacheFolder, need: int, cfg: FetchConfig) -> None:
    """Refuse (not retried) a body of `need` bytes that the cache's disk cannot take while
    keeping `keep_free_bytes` free beside what the downloads under way still need."""
    if not need:
        return
    try:
        free = folder.free_bytes()
    except OSError as e:
        raise _TryFailed(
            f"cannot read the cache's free space: {_os_reason(e)}", retry=False
        ) from None
    room = free - folder.promised - cfg.keep_free_bytes
    if need > room:
        under_way = (
            f", {folder.promised} promised to downloads under way" if folder.promised else ""
        )
        raise _TryFailed(
            f"not enough disk: the file needs {need} more bytes, the cache's file system "
            f"({folder.path}) has {free} free{under_way}, and keep_free_bytes "
            f"({cfg.keep_free_bytes}, --keep-free) stays free; free some space or use "
            "another --cache",
            retry=False,
        )


async def _try_once(
    session: aiohttp.ClientSession,
    url: str,
    folder: _CacheFolder,
    part: str,
    cfg: FetchConfig,
    seen: _Seen,
) -> tuple[int, int]:
    """One try at `url` into the cache's `part`: continue it (Range) or start it, until the
    body ends.

    Returns (size of the whole file, bytes received in this try) once `part` holds the
    whole file; raises _TryFailed otherwise (its `received` set), leaving in `part` only
    bytes known to be the file's first ones, so that the next try can continue them.
    OSError for trouble with the cache folder (not retried).
    """
    try:
        have = folder.size(part)
    except IsADirectoryError as e:
        raise _TryFailed(_os_reason(e), retry=False) from None
    ranged = bool(have) and not seen.no_range
    headers = {"Accept-Encoding": "identity"}  # the bytes of the file, not a compression of it
    if ranged:
        headers["Range"] = f"bytes={have}-"
        if seen.validator:  # the rest of this version of the file, or all of a newer one
            headers["If-Range"] = seen.validator
    timeout = aiohttp.ClientTimeout(
        total=None,
        sock_connect=cfg.connect_timeout_s,
        sock_read=min(cfg.read_timeout_s, cfg.stall_s),  # silence this long is a stall
    )
    got = start = have  # file size in `part` now, and where this try's bytes begin
    total: int | None = None
    last: int | None = None
    try:
        async with session.get(url, headers=headers, timeout=timeout) as r:
            if r.status == 416 and ranged:
                # nothing left from `have` on: the part is already whole, or is not this file
                _, _, size = _content_range(r.headers.get("Content-Range", "bytes */*"))
                if size == have:
                    return have, 0
                folder.unlink(part)
                raise _TryFailed(
                    f"the partial file ({have} bytes) is not a prefix of the server's "
                    f"({size if size is not None else 'unknown'} bytes); starting again",
                    retry=True,
                )
            if r.status >= 500 or r.status in _RETRY_STATUS:
                raise _TryFailed(f"HTTP {r.status} {r.reason or ''}".strip(), retry=True)
            if r.status >= 300 or r.status not in (200, 206):
                raise _TryFailed(f"HTTP {r.status} {r.reason or ''}".strip(), retry=False)
            encoding = r.headers.get("Content-Encoding", "identity").lower()
            if encoding not in ("identity", ""):
                raise _TryFailed(
                    f"the server sent Content-Encoding {encoding} although identity was asked "
                    "for; what arrives would not be the file's bytes",
                    retry=False,
                )
            if r.status == 206:
                cr = r.headers.get("Content-Range", "")
                first, last, total = _content_range(cr)
                problem = _partial_problem(first, last, total, r.content_length)
                if problem and ranged:
                    # cannot be shown to continue the file: never stored; the whole file next
                    seen.no_range = True
                    raise _TryFailed(
                        f"asked for bytes from {have}, the server sent a 206 with "
                        f"Content-Range {cr!r:.100} ({problem}); asking for the whole file",
                        retry=True,
                        again=True,
                    )
                if problem:
                    raise _TryFailed(
                        f"the server answered a request for the whole file with a 206 of "
                        f"Content-Range {cr!r:.100} ({problem}); cannot tell it is the file",
                        retry=False,
                    )
                assert total is not None and last is not None
                if first != (have if ranged else 0) or (
                    seen.total is not None and total != seen.total
                ):
                    # not the continuation of what is here: start from the first byte again
                    folder.unlink(part)
                    raise _TryFailed(
                        f"asked for bytes from {have if ranged else 0} of "
                        f"{seen.total or '?'}, the server sent {cr!r:.100}; starting again",
                        retry=True,
                    )
                if not ranged:
                    got = start = 0
                limit: int | None = last + 1  # the range's end: a byte past it is not the file
            else:
                # 200: the whole file from its first byte, also when Range was ignored
                if ranged:
                    log.info("%s: the server ignored Range, starting from byte 0 again", url)
                got = start = 0
                total, last = r.content_length, None
                limit = total
            seen.total = total
            etag = r.headers.get("ETag", "")
            seen.validator = (
                etag if etag and not etag.startswith("W/") else r.headers.get("Last-Modified")
            )
            if total is not None and total > cfg.max_bytes:
                raise _TryFailed(
                    f"the file has {total} bytes, more than max_bytes ({cfg.max_bytes}, "
                    "--max-size)",
                    retry=False,
                )
            need = max(0, total - start) if total is not None else 0
            _check_room(folder, need, cfg)
            # Unbuffered, so the .part on disk always holds every byte received: a try or run
            # that dies continues from there. Writes block the event loop for a moment each
            # (one network read, at most chunk_bytes).
            fd = folder.open_write(part, append=bool(start))
            folder.promised += need
            try:
                window_t, window_n = time.monotonic(), 0
                async for chunk in r.content.iter_chunked(cfg.chunk_bytes):
                    if got + len(chunk) > cfg.max_bytes:
                        folder.unlink(part)
                        raise _TryFailed(
                            f"the file grew past max_bytes ({cfg.max_bytes}, --max-size)",
                            retry=False,
                        )
                    if limit is not None and got + len(chunk) > limit:
                        folder.unlink(part)
                        raise _TryFailed(
                            f"the server sent more than the {limit - start} bytes it announced",
                            retry=True,
                        )
                    _write_all(fd, chunk)
                    got += len(chunk)
                    window_n += len(chunk)
                    now = time.monotonic()
                    if now - window_t >= cfg.stall_s:
                        if window_n < cfg.stall_bytes:
                            raise _TryFailed(
                                f"stalled: {window_n} bytes in {now - window_t:.1f} s, fewer "
                                f"than stall_bytes ({cfg.stall_bytes}, --stall-bytes) in "
                                f"stall_s ({cfg.stall_s:g} s, --stall)",
                                retry=True,
                            )
                        window_t, window_n = now, 0
            finally:
                folder.promised -= need
                os.close(fd)
        if total is not None and got != total:
            if last is not None and got == last + 1 < total:
                if seen.no_range:  # the rest could only come as a range, which cannot be used
                    raise _TryFailed(
                        f"the server sends the file in pieces (bytes up to {got} of {total}) "
                        "but answered a Range with a 206 that cannot be checked",
                        retry=False,
                    )
                raise _TryFailed(f"got bytes up to {got} of {total}", retry=True, again=True)
            raise _TryFailed(f"size mismatch: got {got} bytes of {total}", retry=True)
        return got, got - start
    except _TryFailed as e:
        e.received = got - start
        raise
    except aiohttp.ClientPayloadError as e:
        of = f" of {total}" if total is not None else ""
        failed = _TryFailed(f"connection dropped after {got}{of} bytes ({e})", retry=True)
        failed.received = got - start
        raise failed from e
    except aiohttp.InvalidURL as e:  # also a redirect to a URL that is not http(s)
        failed = _TryFailed(f"not a URL that can be fetched: {e}", retry=False)
        failed.received = got - start
        raise failed from e
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
        failed = _TryFailed(f"{type(e).__name__}: {e}".rstrip(": "), retry=True)
        failed.received = got - start
        raise failed from e


@dataclass(slots=True)
class _Progress:
    """One URL's download so far, kept when its time runs out."""

    received: int = 0
    tries: int = 0
    reason: str = ""
    """Why the last try failed."""


@dataclass(slots=True)
class _Outcome:
    wanted: Wanted
    status: str
    """"downloaded", "linked" (placed from another cache name of the same URL), "skipped"
    (already in the cache) or "failed"."""
    reason: str = ""


async def _download(
    session: aiohttp.ClientSession, w: Wanted, folder: _CacheFolder, cfg: FetchConfig
) -> tuple[str, int]:
    """Download `w` into the cache with retries, within file_timeout_s: ("" or why it
    failed, bytes received)."""
    progress = _Progress()
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(cfg.file_timeout_s):
            reason = await _tries(session, w, folder, cfg, progress)
    except TimeoutError:
        last = f"; last failure: {progress.reason}" if progress.reason else ""
        reason = (
            f"not done within file_timeout_s ({cfg.file_timeout_s:g} s, --file-timeout), "
            f"{progress.received} bytes received in {progress.tries} tries{last}"
        )
    except OSError as e:  # the cache folder's trouble (disk full, a folder in the way)
        reason = f"cannot write it in the cache: {_os_reason(e)}"
    if not reason:
        log.info(
            "fetched %s: %d bytes received in this run in %.2f s, try %d",
            w.name,
            progress.received,
            time.monotonic() - t0,
            progress.tries,
        )
    return _clip(reason), progress.received


async def _tries(
    session: aiohttp.ClientSession,
    w: Wanted,
    folder: _CacheFolder,
    cfg: FetchConfig,
    progress: _Progress,
) -> str:
    part = f"{w.name}{PART_SUFFIX}"
    seen = _Seen()
    attempt = 0
    while True:
        progress.tries += 1
        try:
            _, n = await _try_once(session, w.url, folder, part, cfg, seen)
        except _TryFailed as e:
            progress.received += e.received
            progress.reason = str(e)
            if e.again:
                continue  # progress was made, or the whole file is asked for: not a failed try
            left = cfg.retries - attempt if e.retry else 0
            log.info("%s: %s (tries left: %d)", w.url, e, left)
            if not left:
                tries = f" after {attempt + 1} tries" if attempt else ""
                return f"{e}{tries}"
            await asyncio.sleep(cfg.delay(attempt))
            attempt += 1
            continue
        progress.received += n
        folder.replace(part, w.name)
        return ""


async def fetch_url(
    session: aiohttp.ClientSession,
    names: Sequence[Wanted],
    folder: _CacheFolder,
    cfg: FetchConfig,
    sem: asyncio.Semaphore,
) -> tuple[list[_Outcome], int]:
    """Every cache name of one URL in place, with at most one download of it (holding `sem`).

    Returns each name's outcome and the bytes received. Trouble with one name (a folder in
    its way, a failed link) fails that name alone, with its reason.
    """
    out: list[_Outcome] = []
    cached: list[Wanted] = []
    missing: list[Wanted] = []
    for w in names:
        if w.refused:
            out.append(_Outcome(w, "failed", w.refused))
            continue
        try:
            mode = folder.mode(w.name)
        except (OSError, ValueError) as e:
            out.append(_Outcome(w, "failed", _os_reason(e)))
            continue
        if mode is not None and stat.S_ISREG(mode):
            cached.append(w)
            out.append(_Outcome(w, "skipped"))
        elif mode is not None and stat.S_ISDIR(mode):
            why = f"a folder is in the way in the cache: {folder.path / w.name}; move it away"
            out.append(_Outcome(w, "failed", why))
        else:  # nothing, or a link or other non-file: replaced, never followed
            missing.append(w)
    if not missing:
        return out, 0
    received = 0
    if cached:  # another name of this URL is here already: nothing to download
        source = cached[0].name
    else:
        first = missing.pop(0)
        async with sem:
            reason, received = await _download(session, first, folder, cfg)
        if reason:
            return out + [_Outcome(w, "failed", reason) for w in (first, *missing)], received
        out.append(_Outcome(first, "downloaded"))
        source = first.name
    for w in missing:
        try:
            await asyncio.to_thread(folder.place, source, w.name)
        except OSError as e:
            out.append(_Outcome(w, "failed", f"cannot put it in the cache: {_os_reason(e)}"))
        else:
            out.append(_Outcome(w, "linked"))
    return out, received


async def fetch(
    files: Sequence[Wanted],
    cache: Path,
    cfg: FetchConfig,
    left_out: Sequence[LeftOut] = (),
) -> dict[str, Any]:
    """Fetch `files` into `cache`; returns the report, also written to <cache>/fetch-report.json.
    `left_out`: task files not used, listed in the report.

    Raises CacheUnusable when `cache` cannot be the cache folder, CacheBusy when another
    fetch holds it.
    """
    by_url: dict[str, list[Wanted]] = {}
    for w in files:
        by_url.setdefault(w.url, []).append(w)
    sem = asyncio.Semaphore(cfg.concurrency)
    t0 = time.monotonic()
    folder = _CacheFolder(cache)
    try:
        with _cache_lock(folder):
            # auto_decompress off: the bytes stored are the bytes sent, which Content-Length
            # counts
            async with (
                aiohttp.ClientSession(auto_decompress=False, trust_env=cfg.trust_env) as session,
                asyncio.TaskGroup() as tg,
            ):
                jobs = [
                    tg.create_task(fetch_url(session, ws, folder, cfg, sem))
                    for ws in by_url.values()
                ]
            results = [j.result() for j in jobs]
            seconds = time.monotonic() - t0
            outcomes = sorted((o for r in results for o in r[0]), key=lambda o: o.wanted.name)
            failed = [o for o in outcomes if o.status == "failed"]
            received = sum(r[1] for r in results)

            def count(status: str) -> int:
                return sum(o.status == status for o in outcomes)

            report: dict[str, Any] = {
                "cache": str(cache),
                "files": len(outcomes),
                "urls": len(by_url),
                "tasks": len({t for w in files for t in w.tasks}),
                "downloaded": count("downloaded"),
                "linked": count("linked"),
                "skipped": count("skipped"),
                "failed": [
                    {
                        "url": o.wanted.url,
                        "name": o.wanted.name,
                        "reason": o.reason,
                        "tasks": o.wanted.tasks,
                    }
                    for o in failed
                ],
                "failed_tasks": sorted({t for o in failed for t in o.wanted.tasks}),
                "task_files_left_out": [{"file": x.where, "reason": x.reason} for x in left_out],
                "bytes": received,
                "seconds": round(seconds, 3),
                "mb_per_s": round(received / 1e6 / seconds, 3) if seconds > 0 else 0.0,
            }
            text = json.dumps(report, indent=2, ensure_ascii=True) + "\n"
            try:
                folder.write_atomic(REPORT, text.encode("utf-8"))
            except OSError as e:
                raise CacheUnusable(
                    f"cannot write the report {cache / REPORT}: {_os_reason(e)}"
                ) from e
    finally:
        folder.close()
    return report


# ---------------------------------------------------------------------------- command line


def _tasks_list(ids: Sequence[str], n: int = 3) -> str:
    return ", ".join(ids[:n]) + (f" and {len(ids) - n} more" if len(ids) > n else "")


_UNITS = {"": 1, "k": _KiB, "m": _MiB, "g": _GiB, "t": _TiB}


def parse_size(text: str) -> int:
    """Bytes of a size such as `1000`, `64K`, `1.5G` or `2GiB` (binary units: 1K = 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"{text!r:.40} is not a size: give bytes, or a number with K, M, G or T (1K = 1024)"
        )
    return int(float(m[1]) * _UNITS[m[2].lower()])


def _cli_config(args: argparse.Namespace, d: FetchConfig) -> FetchConfig:
    return FetchConfig(
        concurrency=args.concurrency,
        retries=args.retries,
        backoff_s=args.backoff,
        backoff_max_s=max(d.backoff_max_s, args.backoff),  # --backoff is checked first
        max_bytes=args.max_size,
        file_timeout_s=args.file_timeout,
        stall_s=args.stall,
        stall_bytes=args.stall_bytes,
        keep_free_bytes=args.keep_free,
    )


def main(argv: list[str] | None = None, prog: str = "python -m arpo.env.fetch") -> int:
    """`arpo fetch` (and `python -m arpo.env.fetch`); returns the exit code (0 all there, 1 a
    file failed or a task file was left out, 2 bad arguments, tasks or cache path)."""
    d = FetchConfig()
    p = argparse.ArgumentParser(
        prog=prog,
        description="Download the files OSWorld tasks need into the local file cache, under "
        "OSWorld's cache names.",
    )
    p.add_argument(
        "--tasks",
        required=True,
        help="a task file (.json / .jsonl), a folder searched for task files, or with --index "
        "an OSWorld evaluation_examples folder",
    )
    p.add_argument(
        "--index", default=None, help="index file naming the tasks (test_all.json), in --tasks"
    )
    p.add_argument("--cache", required=True, help="the cache folder (RunnerConfig.cache_dir)")
    p.add_argument(
        "-j",
        "--concurrency",
        type=int,
        default=d.concurrency,
        help=f"URLs downloaded at once (1 to 64; default {d.concurrency})",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=d.retries,
        help=f"tries after the first, per URL (0 to 100; default {d.retries})",
    )
    p.add_argument(
        "--backoff",
        type=float,
        default=d.backoff_s,
        help=f"seconds before the first retry, doubling, capped at {d.backoff_max_s:g} s "
        f"(0 to 600; default {d.backoff_s:g})",
    )
    p.add_argument(
        "--max-size",
        type=parse_size,
        default=d.max_bytes,
        metavar="SIZE",
        help="largest file accepted, in bytes or with K/M/G/T (1 B to 1T; default 1G)",
    )
    p.add_argument(
        "--file-timeout",
        type=float,
        default=d.file_timeout_s,
        metavar="SECONDS",
        help="longest time for one file, its retries included; it fails after that, its "
        f".part kept (0.01 to 604800; default {d.file_timeout_s:g})",
    )
    p.add_argument(
        "--stall",
        type=float,
        default=d.stall_s,
        metavar="SECONDS",
        help="a try receiving fewer than --stall-bytes in this long is given up and retried "
        f"(0.01 to 3600; default {d.stall_s:g})",
    )
    p.add_argument(
        "--stall-bytes",
        type=parse_size,
        default=d.stall_bytes,
        metavar="SIZE",
        help="bytes a try must receive in each --stall window (1 B to 1G; default 64K)",
    )
    p.add_argument(
        "--keep-free",
        type=parse_size,
        default=d.keep_free_bytes,
        metavar="SIZE",
        help="disk space left free in the cache's file system; a file of known size that "
        "would leave less is refused before its body (0 to 1T; default 256M)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="list the files, their URLs and tasks; download nothing",
    )
    try:
        args = p.parse_args(argv)
    except SystemExit as e:  # argparse has printed the message (or the help)
        return e.code if isinstance(e.code, int) else 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    left_out: list[LeftOut] = []
    try:
        cfg = _cli_config(args, d)
        tasks = load_fetch_tasks(args.tasks, args.index, left_out)
    except ValueError as e:  # ConfigError and TaskError are ValueErrors
        print(f"fetch: {e}", file=sys.stderr)
        return 2
    cache = Path(args.cache)
    why = check_cache_path(cache)
    if why:
        print(f"fetch: {why}", file=sys.stderr)
        return 2
    files = wanted_files(tasks)
    needing = {t for w in files for t in w.tasks}
    urls = {w.url for w in files}
    head = (
        f"{len(files)} files ({len(urls)} distinct URLs) needed by {len(needing)} of "
        f"{len(tasks)} tasks"
    )
    if left_out:
        head += f" ({len(left_out)} task files left out)"
    if args.dry_run:
        cached = {w.name for w in files if not w.refused and _is_regular(cache / w.name)}
        refused = [w for w in files if w.refused]
        print(f"{head}; {len(cached)} already in {cache}, {len(refused)} refused")
        for w in files:
            state = "cached " if w.name in cached else "REFUSED" if w.refused else "missing"
            why = f"  [{w.refused}]" if w.refused else ""
            print(f"  {state}  {w.name}  {w.url}  ({_tasks_list(w.tasks)}){why}")
        for x in left_out:
            print(f"  LEFT OUT task file {x.where}: {x.reason}")
        return 0
    try:
        report = asyncio.run(fetch(files, cache, cfg, left_out))
    except (CacheBusy, CacheUnusable) as e:
        print(f"fetch: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # asyncio.run has cancelled the downloads; each .part keeps the bytes received
        print(
            f"fetch: interrupted; the files done are in {cache}, and the next run continues "
            "the partial ones (.part) from where they stopped",
            file=sys.stderr,
        )
        return 130
    print(
        f"{head}: {report['downloaded']} downloaded, {report['linked']} linked (same URL), "
        f"{report['skipped']} already cached, {len(report['failed'])} failed; "
        f"{report['bytes'] / 1e6:.1f} MB in {report['seconds']:.1f} s; report in {cache / REPORT}"
    )
    for f in report["failed"]:
        print(f"  FAILED {f['url']}: {f['reason']} (needed by {', '.join(f['tasks'])})")
    for x in left_out:
        print(f"  LEFT OUT task file {x.where}: {x.reason}")
    return 1 if report["failed"] or left_out else 0


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except (OSError, ValueError):
        return False


if __name__ == "__main__":
    sys.exit(main())

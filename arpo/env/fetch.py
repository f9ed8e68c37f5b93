"""Download the files OSWorld tasks need into the local file cache (`arpo.env.cache`).

    python -m arpo.env.fetch --tasks shared/osworld/evaluation_examples --index test_all.json \
        --cache osworld_cache -j 4 --retries 5
    python -m arpo.env.fetch --tasks shared/osworld/evaluation_examples --cache osworld_cache \
        --dry-run                                     # list what is needed, download nothing
    arpo-envs osworld fetch --tasks DIR --cache DIR   # the same `main`, from the envs CLI

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
  exponential backoff on transport errors, dropped connections, 408/429 and 5xx answers.
  Other 4xx answers fail at once; a URL that is not http(s) is refused without a request.
- **Resume**: a download in progress is `<cache name>.part`; a later try (or a later run)
  continues it with `Range: bytes=<size>-` (and `If-Range`, with the file's ETag or date
  when an earlier try of the run saw one). A server that answers 200 instead of 206
  restarts the file from its first byte; a 206 that does not continue at `<size>`, or
  gives the file another size than before (it changed on the server), drops the part and
  starts again. A 206 of a bounded range is followed by a request for the rest at once.
  (A `.part` from an earlier run is trusted to be the first bytes of the same file.)
- **Size check**: the bytes written must equal Content-Length (200) or Content-Range's
  total (206). Only then is the file moved into place, atomically (`os.replace`); a file
  that never reaches its size is a failure of that file and never appears in the cache.
- A cache name already in the cache is skipped: a second run downloads nothing.
- The summary (downloaded / linked / skipped / failed, bytes, seconds) goes to stdout and
  `<cache>/fetch-report.json`, which lists every file that could not be had with its URL,
  the reason and the ids of the tasks that need it. Exit code 1 when any file failed, 2
  for bad arguments or tasks that cannot be read.

One fetch per cache folder at a time (`<cache>/.fetch.lock`, advisory). The cache has
nothing but OSWorld's names: `index.json` (FileCache's first lookup) is neither read nor
written here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlparse

import aiohttp

from arpo.env.cache import cache_name
from arpo.env.task import Task, load_pool, load_task_set

log = logging.getLogger("arpo.env.fetch")

REPORT = "fetch-report.json"
"""The run's report, in the cache folder."""
LOCK = ".fetch.lock"
"""Held (flock) by the fetch that is filling the cache folder."""
PART_SUFFIX = ".part"
"""A download in progress: `<cache name>.part`, continued by the next try or run."""


@dataclass(frozen=True, slots=True)
class FetchConfig:
    """How the files are downloaded."""

    concurrency: int = 4
    """URLs downloaded at once."""
    retries: int = 5
    """Tries after the first, per URL, on transport errors, dropped connections, a body
    shorter than announced, 408, 429 and 5xx answers. Other 4xx answers are not retried."""
    backoff_s: float = 1.0
    """Delay before the first retry; it doubles on each retry, up to `backoff_max_s`."""
    backoff_max_s: float = 30.0
    """Cap of the delay between two tries."""
    connect_timeout_s: float = 20.0
    """Longest wait for a TCP (and TLS) connection to be set up."""
    read_timeout_s: float = 60.0
    """Longest silence of the server, for the answer's headers and between two parts of its
    body. There is no limit on a whole download: a large file on a slow link is fine as long
    as bytes keep coming."""
    max_bytes: int = 8 << 30
    """Largest file accepted (8 GiB). One announced larger is refused before its body is
    read; one that grows larger while it is read is refused there (not retried)."""
    chunk_bytes: int = 1 << 20
    """Largest piece read from the network and written to the `.part` file at once."""
    trust_env: bool = True
    """Use HTTP(S)_PROXY / NO_PROXY from the environment, as OSWorld's `requests` does."""

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1 (-j), got {self.concurrency}")
        if self.retries < 0:
            raise ValueError(f"retries must be 0 or more (--retries), got {self.retries}")
        if not 0 <= self.backoff_s <= self.backoff_max_s:
            raise ValueError(
                f"need 0 <= backoff_s <= backoff_max_s, got {self.backoff_s} and "
                f"{self.backoff_max_s}; raise backoff_max_s or lower backoff_s (--backoff)"
            )
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ValueError(
                f"timeouts must be positive seconds, got connect {self.connect_timeout_s} "
                f"and read {self.read_timeout_s}"
            )
        if self.max_bytes < 1 or self.chunk_bytes < 1:
            raise ValueError("max_bytes and chunk_bytes must be at least 1")

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (0 for the first)."""
        return min(self.backoff_max_s, self.backoff_s * 2.0**retry)


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
    """Why it is not downloaded at all (not an http(s) URL); "" when it can be."""


def _refusal(url: str, file_name: str) -> str:
    if urlparse(url).scheme.lower() not in ("http", "https"):
        return f"not an http(s) URL: {url!r:.200}"
    if not file_name or file_name in (".", ".."):
        return "no file name to store it under (the step's path or the getter's dest is empty)"
    return ""


def wanted_files(tasks: Sequence[Task]) -> list[Wanted]:
    """Every file the tasks' setup and postconfig `download` steps and `cloud_file` getters
    need, one entry per cache name (sorted by it), each with the tasks that need it."""
    out: dict[str, Wanted] = {}

    def want(url: Any, dest: Any, task_id: str) -> None:
        url = "" if url is None else str(url)
        file_name = PurePosixPath(str(dest or "")).name
        name = cache_name(url, file_name)
        w = out.get(name)
        if w is None:
            w = out[name] = Wanted(url, name, refused=_refusal(url, file_name))
        if task_id not in w.tasks:
            w.tasks.append(task_id)

    for t in tasks:
        for step in (*t.config, *t.evaluator.postconfig):
            if step.type == "download":
                for f in step.parameters.get("files") or []:
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


def load_fetch_tasks(path: str | Path, index: str | None = None) -> list[Task]:
    """The tasks of `--tasks` (and `--index`): an OSWorld examples folder and its index
    file, or a task file / folder of task files as `arpo.env.task.load_pool` reads them."""
    if index is not None:
        return load_task_set(path, index)
    return [Task.from_dict(p.task, domain=p.domain, path=p.source) for p in load_pool(path)]


# ---------------------------------------------------------------------------- downloading


class _TryFailed(Exception):
    """One try of one URL did not finish the file; `retry` says whether another may."""

    def __init__(self, reason: str, *, retry: bool, again: bool = False) -> None:
        super().__init__(reason)
        self.retry = retry
        self.again = again
        """Not a failure: the server sent a bounded range; ask for the rest at once."""
        self.received = 0
        """Bytes received in this try (set by _try_once)."""


@dataclass(slots=True)
class _Seen:
    """What earlier tries of this run learnt about the file, to tell a changed one."""

    total: int | None = None
    """Its size."""
    validator: str | None = None
    """Its strong ETag, else its Last-Modified date: sent as If-Range."""


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
        return first, last, None if total.strip() == "*" else int(total)
    except ValueError:
        raise _TryFailed(f"unreadable Content-Range {value!r:.100}", retry=True) from None


async def _try_once(
    session: aiohttp.ClientSession, url: str, part: Path, cfg: FetchConfig, seen: _Seen
) -> tuple[int, int]:
    """One try at `url` into `part`: continue it (Range) or start it, until the body ends.

    Returns (size of the whole file, bytes received in this try) once `part` holds the
    whole file; raises _TryFailed otherwise (its `received` set), leaving in `part` only
    bytes known to be the file's first ones, so that the next try can continue them.
    """
    have = part.stat().st_size if part.exists() else 0
    headers = {"Accept-Encoding": "identity"}  # the bytes of the file, not a compression of it
    if have:
        headers["Range"] = f"bytes={have}-"
        if seen.validator:  # the rest of this version of the file, or all of a newer one
            headers["If-Range"] = seen.validator
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=cfg.connect_timeout_s, sock_read=cfg.read_timeout_s
    )
    got = start = have  # file size in `part` now, and where this try's bytes begin
    total: int | None = None
    last: int | None = None
    try:
        async with session.get(url, headers=headers, timeout=timeout) as r:
            if r.status == 416 and have:
                # nothing left from `have` on: the part is already whole, or is not this file
                _, _, size = _content_range(r.headers.get("Content-Range", "bytes */*"))
                if size == have:
                    return have, 0
                part.unlink()
                raise _TryFailed(
                    f"the partial file ({have} bytes) is not a prefix of the server's "
                    f"({size} bytes); starting again",
                    retry=True,
                )
            if r.status >= 500 or r.status in _RETRY_STATUS:
                raise _TryFailed(f"HTTP {r.status} {r.reason or ''}".strip(), retry=True)
            if r.status >= 300:
                raise _TryFailed(f"HTTP {r.status} {r.reason or ''}".strip(), retry=False)
            encoding = r.headers.get("Content-Encoding", "identity").lower()
            if encoding not in ("identity", ""):
                raise _TryFailed(
                    f"the server sent Content-Encoding {encoding} although identity was asked "
                    "for; what arrives would not be the file's bytes",
                    retry=False,
                )
            if r.status == 206:
                first, last, total = _content_range(r.headers.get("Content-Range", ""))
                if first != have or (seen.total is not None and total != seen.total):
                    # not the continuation of what is here: start from the first byte again
                    part.unlink(missing_ok=True)
                    raise _TryFailed(
                        f"asked for bytes from {have} of {seen.total or '?'}, the server sent "
                        f"{r.headers.get('Content-Range')!r}; starting again",
                        retry=True,
                    )
                mode = "ab"  # total None ("*"): the size is unknown, as for a 200 without length
            else:
                # 200: the whole file from its first byte, also when Range was ignored
                if have:
                    log.info("%s: the server ignored Range, starting from byte 0 again", url)
                got = start = 0
                mode, total, last = "wb", r.content_length, None
            seen.total = total
            etag = r.headers.get("ETag", "")
            seen.validator = (
                etag if etag and not etag.startswith("W/") else r.headers.get("Last-Modified")
            )
            if total is not None and total > cfg.max_bytes:
                raise _TryFailed(
                    f"the file has {total} bytes, more than max_bytes ({cfg.max_bytes})",
                    retry=False,
                )
            # Unbuffered, so the .part on disk always holds every byte received: a try or run
            # that dies continues from there. Writes block the event loop for a moment each
            # (one network read, at most chunk_bytes).
            with open(part, mode, buffering=0) as f:
                async for chunk in r.content.iter_chunked(cfg.chunk_bytes):
                    if got + len(chunk) > cfg.max_bytes:
                        f.close()
                        part.unlink()
                        raise _TryFailed(
                            f"the file grew past max_bytes ({cfg.max_bytes})", retry=False
                        )
                    f.write(chunk)
                    got += len(chunk)
        if total is not None and got != total:
            if last is not None and got == last + 1 < total:
                raise _TryFailed(f"got bytes up to {got} of {total}", retry=True, again=True)
            if got > total:
                part.unlink(missing_ok=True)
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
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
        failed = _TryFailed(f"{type(e).__name__}: {e}".rstrip(": "), retry=True)
        failed.received = got - start
        raise failed from e


def _place(src: Path, dst: Path) -> None:
    """Put a copy of `src` at `dst` atomically: a hard link, or a copy where links fail."""
    tmp = dst.with_name(f"{dst.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


@dataclass(slots=True)
class _Outcome:
    wanted: Wanted
    status: str
    """"downloaded", "linked" (placed from another cache name of the same URL), "skipped"
    (already in the cache) or "failed"."""
    reason: str = ""


async def _download(
    session: aiohttp.ClientSession, w: Wanted, cache: Path, cfg: FetchConfig
) -> tuple[str, int]:
    """Download `w` into the cache with retries: ("" or why it failed, bytes received)."""
    part = cache / f"{w.name}{PART_SUFFIX}"
    received, reason = 0, ""
    seen = _Seen()
    t0 = time.monotonic()
    attempt = 0
    while True:
        try:
            size, n = await _try_once(session, w.url, part, cfg, seen)
        except _TryFailed as e:
            received += e.received
            if e.again and e.received:
                continue  # a bounded range arrived whole: not a failed try
            reason = str(e)
            left = cfg.retries - attempt if e.retry else 0
            log.info("%s: %s (tries left: %d)", w.url, e, left)
            if not left:
                tries = f" after {attempt + 1} tries" if attempt else ""
                return f"{reason}{tries}", received
            await asyncio.sleep(cfg.delay(attempt))
            attempt += 1
            continue
        received += n
        os.replace(part, cache / w.name)
        log.info(
            "fetched %s: %d bytes (%d received in this run) in %.2f s, try %d",
            w.name,
            size,
            received,
            time.monotonic() - t0,
            attempt + 1,
        )
        return "", received


async def fetch_url(
    session: aiohttp.ClientSession,
    names: Sequence[Wanted],
    cache: Path,
    cfg: FetchConfig,
    sem: asyncio.Semaphore,
) -> tuple[list[_Outcome], int]:
    """Every cache name of one URL in place, with at most one download of it (holding `sem`).

    Returns each name's outcome and the bytes received.
    """
    cached = [w for w in names if (cache / w.name).is_file()]
    out = [_Outcome(w, "skipped") for w in cached]
    out += [_Outcome(w, "failed", w.refused) for w in names if w.refused and w not in cached]
    missing = [w for w in names if not w.refused and w not in cached]
    if not missing:
        return out, 0
    received = 0
    if cached:  # another name of this URL is here already: nothing to download
        source = cache / cached[0].name
    else:
        first = missing.pop(0)
        async with sem:
            reason, received = await _download(session, first, cache, cfg)
        if reason:
            return out + [_Outcome(w, "failed", reason) for w in (first, *missing)], received
        out.append(_Outcome(first, "downloaded"))
        source = cache / first.name
    for w in missing:
        await asyncio.to_thread(_place, source, cache / w.name)
        out.append(_Outcome(w, "linked"))
    return out, received


class CacheBusy(RuntimeError):
    """Another fetch holds the cache folder's lock."""


@contextlib.contextmanager
def _cache_lock(cache: Path) -> Iterator[None]:
    with open(cache / LOCK, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CacheBusy(
                f"another fetch is filling {cache} ({cache / LOCK} is locked); wait for it"
            ) from None
        yield


async def fetch(files: Sequence[Wanted], cache: Path, cfg: FetchConfig) -> dict[str, Any]:
    """Fetch `files` into `cache`; returns the report, also written to <cache>/fetch-report.json.

    Raises CacheBusy when another fetch holds the cache folder.
    """
    cache.mkdir(parents=True, exist_ok=True)
    by_url: dict[str, list[Wanted]] = {}
    for w in files:
        by_url.setdefault(w.url, []).append(w)
    sem = asyncio.Semaphore(cfg.concurrency)
    t0 = time.monotonic()
    with _cache_lock(cache):
        # auto_decompress off: the bytes stored are the bytes sent, which Content-Length counts
        async with (
            aiohttp.ClientSession(auto_decompress=False, trust_env=cfg.trust_env) as session,
            asyncio.TaskGroup() as tg,
        ):
            jobs = [
                tg.create_task(fetch_url(session, ws, cache, cfg, sem)) for ws in by_url.values()
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
        "bytes": received,
        "seconds": round(seconds, 3),
        "mb_per_s": round(received / 1e6 / seconds, 3) if seconds > 0 else 0.0,
    }
    tmp = cache / f"{REPORT}.tmp"
    tmp.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, cache / REPORT)
    return report


# ---------------------------------------------------------------------------- command line


def _tasks_list(ids: Sequence[str], n: int = 3) -> str:
    return ", ".join(ids[:n]) + (f" and {len(ids) - n} more" if len(ids) > n else "")


def main(argv: list[str] | None = None) -> int:
    """`python -m arpo.env.fetch`; returns the exit code (0 all there, 1 a file failed, 2
    bad arguments or tasks)."""
    d = FetchConfig()
    p = argparse.ArgumentParser(
        prog="python -m arpo.env.fetch",
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
        help="URLs downloaded at once",
    )
    p.add_argument("--retries", type=int, default=d.retries, help="tries after the first, per URL")
    p.add_argument(
        "--backoff",
        type=float,
        default=d.backoff_s,
        help="seconds before the first retry (doubles, capped at 30 s)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="list the files, their URLs and tasks; download nothing",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        cfg = FetchConfig(
            concurrency=args.concurrency,
            retries=args.retries,
            backoff_s=args.backoff,
            backoff_max_s=max(d.backoff_max_s, args.backoff),
        )
        tasks = load_fetch_tasks(args.tasks, args.index)
    except ValueError as e:  # ConfigError and TaskError are ValueErrors
        print(f"fetch: {e}", file=sys.stderr)
        return 2
    files = wanted_files(tasks)
    cache = Path(args.cache)
    needing = {t for w in files for t in w.tasks}
    urls = {w.url for w in files}
    head = (
        f"{len(files)} files ({len(urls)} distinct URLs) needed by {len(needing)} of "
        f"{len(tasks)} tasks"
    )
    if args.dry_run:
        cached = {w.name for w in files if (cache / w.name).is_file()}
        refused = [w for w in files if w.refused]
        print(f"{head}; {len(cached)} already in {cache}, {len(refused)} refused")
        for w in files:
            state = "cached " if w.name in cached else "REFUSED" if w.refused else "missing"
            why = f"  [{w.refused}]" if w.refused else ""
            print(f"  {state}  {w.name}  {w.url}  ({_tasks_list(w.tasks)}){why}")
        return 0
    try:
        report = asyncio.run(fetch(files, cache, cfg))
    except CacheBusy as e:
        print(f"fetch: {e}", file=sys.stderr)
        return 2
    print(
        f"{head}: {report['downloaded']} downloaded, {report['linked']} linked (same URL), "
        f"{report['skipped']} already cached, {len(report['failed'])} failed; "
        f"{report['bytes'] / 1e6:.1f} MB in {report['seconds']:.1f} s; report in {cache / REPORT}"
    )
    for f in report["failed"]:
        print(f"  FAILED {f['url']}: {f['reason']} (needed by {', '.join(f['tasks'])})")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())

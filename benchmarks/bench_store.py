"""Side-by-side benchmark: the replay store against the stores RL code uses today.

Run it alone on the machine (2 cores: anything in the background distorts it):

    .venv/bin/python benchmarks/bench_store.py              # full run, about 4 minutes
    .venv/bin/python benchmarks/bench_store.py --quick      # 10-second smoke run, writes nothing

The full run writes benchmarks/results/store-<date>.md and .json (date, machine, commit,
versions, every number in the table).

Workload. One trajectory is what a GUI episode leaves in the store: 2,048 int32 token ids,
2,048 float32 behaviour log-probs and 8 incompressible blobs (os.urandom) of 200 kB each,
standing for PNG screenshots: about 1.6 MB. 16 tasks. Every store is filled to capacity
first (default 16 x 80 trajectories, about 2.1 GB), then runs two timed phases, 10 s each:
1 writer + 1 reader thread, and 2 writers + 2 readers. Writers insert trajectories taken
round-robin from a small pre-built pool; readers sample batches of 8 from a random task.

Stores, each in a fresh subprocess so that peak RSS belongs to one store only:

    arpo          arpo.buffer.ReplayStore: add_success to insert, sample(task, 8) uniform
                  to read; blobs are kept by reference, arrays are owned by the store
    dict-copy     dict of deques under one threading.Lock, copying on insert (np.copy of the
                  arrays, bytes(memoryview(b)) of each blob: one copy, the cheapest Python has)
    dict-ref      the same, keeping references
    torchrl-lazy  torchrl ReplayBuffer + LazyTensorStorage, one per task (copies on insert,
                  gathers on sample)
    torchrl-list  torchrl ReplayBuffer + ListStorage, identity collate (keeps references)
    cpprb         cpprb.ReplayBuffer, dict-of-fields API, blobs as a uint8 (8, 200000) field,
                  one per task, each behind its own threading.Lock (cpprb is not thread-safe)

Every peer gets its input already in its own native form (a TensorDict for torchrl-lazy, a
stacked uint8 array for cpprb), built outside the timed loop; the arpo adapter builds a new
`Item` from the pooled arrays and blobs inside the timed loop. Both choices favour the peers.

Assert before timing: each adapter first round-trips a few known trajectories through a
small instance of itself and compares every byte, shape and dtype; after the fill, a
sample from every task is checked against the task id, trajectory id and blob heads that
were inserted. Readers touch what they sample (the length and the last byte of every blob,
tokens[0]) so that a store returning lazy views is charged for reaching its data.

Measured per store and phase: inserts/s and sampled trajectories/s (and the same as GB/s of
trajectory payload; for stores that hand out references, sampled GB/s is payload made
readable, not bytes moved), latency of one sample(8) call including the touch (p50, p99),
CPU use of the process in cores (a Python store pinned at 1.0 core with 4 threads is
GIL-bound), and peak RSS of the subprocess against the payload it holds. The machine's
memcpy bandwidth (numpy copy into touched memory and into fresh pages) is measured in its
own subprocess as the physical limit of any store that copies. For each subprocess the
parent also records how many cores other processes on the machine used meanwhile (from
/proc/stat); the report flags a store whose run was disturbed.
"""

from __future__ import annotations

import argparse
import array
import collections
import concurrent.futures
import dataclasses
import gc
import importlib
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from _machine import cpu_model, run_header

REPO = Path(__file__).resolve().parent.parent
STORES = ("arpo", "dict-copy", "dict-ref", "torchrl-lazy", "torchrl-list", "cpprb")
COPYING_PEERS = ("dict-copy", "torchrl-lazy", "cpprb")
LIBRARY_PEERS = ("torchrl-lazy", "torchrl-list", "cpprb")
PHASES = ((1, 1), (2, 2))  # (writers, readers)


@dataclasses.dataclass
class BenchConfig:
    """Sizes and durations of one benchmark run; every store gets the same."""

    tasks: int = 16
    """Number of task ids; every store keeps a separate buffer per task."""
    per_task: int = 80
    """Trajectories kept per task: the store's capacity, filled before timing."""
    tokens: int = 2048
    """Token ids (int32) and behaviour log-probs (float32) per trajectory."""
    blobs: int = 8
    """Screenshot-like blobs per trajectory."""
    blob_bytes: int = 200_000
    """Size of each blob (os.urandom, incompressible)."""
    seconds: float = 10.0
    """Duration of each timed phase (1 writer + 1 reader, then 2 writers + 2 readers)."""
    batch: int = 8
    """Trajectories per sample call."""
    pool: int = 16
    """Pre-built trajectories the writers insert round-robin during the timed phases."""
    memcpy_mb: int = 256
    """Array size of the memcpy measurement."""
    seed: int = 0
    """Seed of the readers' task choice."""

    def __post_init__(self) -> None:
        for name in ("tasks", "per_task", "tokens", "blobs", "blob_bytes", "batch", "pool"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tokens < 2:
            raise ValueError("tokens must be >= 2: tokens[0] and tokens[1] carry task and id")
        if self.seconds <= 0:
            raise ValueError(f"seconds must be > 0, got {self.seconds}")
        if self.blob_bytes < 8:
            raise ValueError("blob_bytes must be >= 8: the first 8 bytes are checked")

    @property
    def traj_bytes(self) -> int:
        return self.tokens * 8 + self.blobs * self.blob_bytes

    @property
    def payload_bytes(self) -> int:
        return self.traj_bytes * self.tasks * self.per_task


QUICK = BenchConfig(tasks=2, per_task=8, blob_bytes=20_000, seconds=0.5, pool=4, memcpy_mb=32)


# --------------------------------------------------------------------------------------
# Trajectories
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class Traj:
    """A trajectory in the common form every adapter starts from."""

    tokens: np.ndarray  # int32; tokens[0] = task, tokens[1] = trajectory id
    logprobs: np.ndarray  # float32
    blobs: tuple[bytes, ...]


def make_traj(cfg: BenchConfig, task: int, traj_id: int, rng: np.random.Generator) -> Traj:
    tokens = rng.integers(0, 150_000, cfg.tokens, dtype=np.int32)
    tokens[0], tokens[1] = task, traj_id
    logprobs = -rng.random(cfg.tokens, dtype=np.float32)
    blobs = tuple(os.urandom(cfg.blob_bytes) for _ in range(cfg.blobs))
    return Traj(tokens, logprobs, blobs)


def heads(traj: Traj) -> bytes:
    """The first 8 bytes of every blob: cheap fingerprint checked after the fill."""
    return b"".join(b[:8] for b in traj.blobs)


# --------------------------------------------------------------------------------------
# Adapters: one per store, same five operations
# --------------------------------------------------------------------------------------


class Adapter:
    """prepare (untimed) -> insert; sample -> touch (timed) and unpack (checks only)."""

    name: str
    modules: tuple[str, ...] = ()
    """Libraries imported before the RSS baseline is taken, so it excludes them."""

    def __init__(self, cfg: BenchConfig) -> None:
        self.cfg = cfg

    @classmethod
    def load(cls) -> None:
        for m in cls.modules:
            importlib.import_module(m)

    def prepare(self, task: int, traj: Traj) -> Any:
        """The store's native input for `traj`, built outside the timed loop."""
        return traj

    def insert(self, task: int, native: Any) -> None:
        raise NotImplementedError

    def sample(self, task: int, k: int) -> Any:
        raise NotImplementedError

    def touch(self, batch: Any) -> int:
        """Touch what a trainer would reach first; returns a checksum-like int."""
        acc = 0
        for tokens, _logprobs, blobs in self.unpack(batch):
            acc += int(tokens[0])
            for b in blobs:
                acc += len(b) + b[-1]
        return acc

    def unpack(self, batch: Any) -> list[tuple[np.ndarray, np.ndarray, list[Any]]]:
        """(tokens, logprobs, blobs) of every sampled trajectory; blobs support len/[i]."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class ArpoAdapter(Adapter):
    name = "arpo"
    modules = ("arpo.buffer",)

    def __init__(self, cfg: BenchConfig) -> None:
        super().__init__(cfg)
        from arpo.buffer import Item, ReplayStore

        self._item = Item
        self._names = [f"task-{t}" for t in range(cfg.tasks)]  # task ids are strings
        self._offsets = np.array([0, cfg.tokens], dtype=np.int32)
        self._rewards = np.ones(1, dtype=np.float32)
        # The byte budget is not what is measured: leave headroom over the payload.
        self.store = ReplayStore(
            max_bytes=int(cfg.payload_bytes * 1.5) + (256 << 20),
            fresh_capacity=16,
            replay_capacity=cfg.per_task,
            seed=cfg.seed,
        )

    def insert(self, task: int, native: Traj) -> None:
        item = self._item(
            native.tokens, native.logprobs, self._offsets, self._rewards, 0, blobs=native.blobs
        )
        self.store.add_success(self._names[task], item)

    def sample(self, task: int, k: int) -> Any:
        return self.store.sample(self._names[task], k)

    def touch(self, batch: Any) -> int:
        acc = 0
        for item in batch:
            acc += int(item.tokens[0])
            for b in item.blobs:
                acc += len(b) + b[-1]
        return acc

    def unpack(self, batch: Any) -> list[tuple[np.ndarray, np.ndarray, list[Any]]]:
        return [(it.tokens, it.logprobs, list(it.blobs)) for it in batch]

    def close(self) -> None:
        self.store.close()


class DictAdapter(Adapter):
    """dict[task] -> deque(maxlen=per_task) of (tokens, logprobs, blobs), one lock."""

    copy = False

    def __init__(self, cfg: BenchConfig) -> None:
        super().__init__(cfg)
        self.lock = threading.Lock()
        self.data: dict[int, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=cfg.per_task)
        )
        self.rng = random.Random(cfg.seed)

    def insert(self, task: int, native: Traj) -> None:
        if self.copy:  # copy outside the lock, as anyone would
            rec = (
                np.copy(native.tokens),
                np.copy(native.logprobs),
                tuple(bytes(memoryview(b)) for b in native.blobs),
            )
        else:
            rec = (native.tokens, native.logprobs, native.blobs)
        with self.lock:
            self.data[task].append(rec)

    def sample(self, task: int, k: int) -> Any:
        with self.lock:
            d = self.data[task]
            return [d[i] for i in self.rng.choices(range(len(d)), k=k)]

    def touch(self, batch: Any) -> int:
        acc = 0
        for tokens, _logprobs, blobs in batch:
            acc += int(tokens[0])
            for b in blobs:
                acc += len(b) + b[-1]
        return acc

    def unpack(self, batch: Any) -> list[tuple[np.ndarray, np.ndarray, list[Any]]]:
        return [(t, lp, list(bl)) for t, lp, bl in batch]


class DictCopyAdapter(DictAdapter):
    name = "dict-copy"
    copy = True


class DictRefAdapter(DictAdapter):
    name = "dict-ref"
    copy = False


class TorchrlLazyAdapter(Adapter):
    name = "torchrl-lazy"
    modules = ("torch", "tensordict", "torchrl.data")

    def __init__(self, cfg: BenchConfig) -> None:
        super().__init__(cfg)
        import torch
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, ReplayBuffer

        self.torch, self.TensorDict = torch, TensorDict
        self.rbs = [
            ReplayBuffer(storage=LazyTensorStorage(cfg.per_task), batch_size=None)
            for _ in range(cfg.tasks)
        ]

    def prepare(self, task: int, traj: Traj) -> Any:
        blobs = np.frombuffer(b"".join(traj.blobs), dtype=np.uint8).reshape(self.cfg.blobs, -1)
        return self.TensorDict(
            tokens=self.torch.from_numpy(traj.tokens),
            logprobs=self.torch.from_numpy(traj.logprobs),
            blobs=self.torch.from_numpy(blobs.copy()),
            batch_size=[],
        )

    def insert(self, task: int, native: Any) -> None:
        self.rbs[task].add(native)

    def sample(self, task: int, k: int) -> Any:
        return self.rbs[task].sample(k)

    def touch(self, batch: Any) -> int:
        blobs = batch["blobs"]  # (k, n_blobs, blob_bytes), gathered by sample()
        lens = blobs.shape[0] * blobs.shape[1] * blobs.shape[2]
        return int(batch["tokens"][:, 0].sum()) + lens + int(blobs[:, :, -1].sum())

    def unpack(self, batch: Any) -> list[tuple[np.ndarray, np.ndarray, list[Any]]]:
        t, lp, bl = (batch[f].numpy() for f in ("tokens", "logprobs", "blobs"))
        return [(t[i], lp[i], list(bl[i])) for i in range(t.shape[0])]


class TorchrlListAdapter(Adapter):
    name = "torchrl-list"
    modules = ("torch", "torchrl.data")

    def __init__(self, cfg: BenchConfig) -> None:
        super().__init__(cfg)
        from torchrl.data import ListStorage, ReplayBuffer

        # Identity collate: hand out the stored objects; the default collate stacks them.
        self.rbs = [
            ReplayBuffer(storage=ListStorage(cfg.per_task), batch_size=None, collate_fn=_identity)
            for _ in range(cfg.tasks)
        ]

    def prepare(self, task: int, traj: Traj) -> Any:
        return (traj.tokens, traj.logprobs, traj.blobs)

    def insert(self, task: int, native: Any) -> None:
        self.rbs[task].add(native)

    def sample(self, task: int, k: int) -> Any:
        return self.rbs[task].sample(k)

    def touch(self, batch: Any) -> int:
        acc = 0
        for tokens, _logprobs, blobs in batch:
            acc += int(tokens[0])
            for b in blobs:
                acc += len(b) + b[-1]
        return acc

    def unpack(self, batch: Any) -> list[tuple[np.ndarray, np.ndarray, list[Any]]]:
        return [(t, lp, list(bl)) for t, lp, bl in batch]


def _identity(x: Any) -> Any:
    return x


class CpprbAdapter(Adapter):
    name = "cpprb"
    modules = ("cpprb",)

    def __init__(self, cfg: BenchConfig) -> None:
        super().__init__(cfg)
        import cpprb

        env_dict = {
            "tokens": {"shape": cfg.tokens, "dtype": np.int32},
            "logprobs": {"shape": cfg.tokens, "dtype": np.float32},
            "blobs": {"shape": (cfg.blobs, cfg.blob_bytes), "dtype": np.uint8},
        }
        self.rbs = [cpprb.ReplayBuffer(cfg.per_task, env_dict) for _ in range(cfg.tasks)]
        self.locks = [threading.Lock() for _ in range(cfg.tasks)]

    def prepare(self, task: int, traj: Traj) -> Any:
        blobs = np.frombuffer(b"".join(traj.blobs), dtype=np.uint8).reshape(self.cfg.blobs, -1)
        return {"tokens": traj.tokens, "logprobs": traj.logprobs, "blobs": blobs}

    def insert(self, task: int, native: Any) -> None:
        with self.locks[task]:
            self.rbs[task].add(**native)

    def sample(self, task: int, k: int) -> Any:
        with self.locks[task]:
            return self.rbs[task].sample(k)

    def touch(self, batch: Any) -> int:
        blobs = batch["blobs"]
        return int(batch["tokens"][:, 0].sum()) + blobs.size + int(blobs[:, :, -1].sum())

    def unpack(self, batch: Any) -> list[tuple[np.ndarray, np.ndarray, list[Any]]]:
        t, lp, bl = batch["tokens"], batch["logprobs"], batch["blobs"]
        return [(t[i], lp[i], list(bl[i])) for i in range(t.shape[0])]


ADAPTERS: dict[str, type[Adapter]] = {
    a.name: a
    for a in (
        ArpoAdapter,
        DictCopyAdapter,
        DictRefAdapter,
        TorchrlLazyAdapter,
        TorchrlListAdapter,
        CpprbAdapter,
    )
}


# --------------------------------------------------------------------------------------
# Correctness, asserted before anything is timed
# --------------------------------------------------------------------------------------


def _as_bytes(blob: Any) -> bytes:
    """bytes of a blob handed out as bytes or as a uint8 array row."""
    if isinstance(blob, bytes | bytearray | memoryview):
        return bytes(blob)
    return np.ascontiguousarray(blob, dtype=np.uint8).tobytes()


def _same_blob(got: Any, want: bytes) -> bool:
    return len(got) == len(want) and _as_bytes(got) == want


def check_roundtrip(cls: type[Adapter], cfg: BenchConfig) -> None:
    """Round-trip known trajectories through a small instance; compare every byte."""
    small = dataclasses.replace(cfg, tasks=2, per_task=3, blob_bytes=min(cfg.blob_bytes, 4096))
    adapter = cls(small)
    rng = np.random.default_rng(123)
    kept: dict[int, dict[int, Traj]] = {0: {}, 1: {}}
    for i in range(5):  # 5 inserts into capacity 3: the oldest two must be gone
        for task in (0, 1):
            traj = make_traj(small, task, 100 * task + i, rng)
            adapter.insert(task, adapter.prepare(task, traj))
            kept[task][100 * task + i] = traj
    for task in (0, 1):
        seen = set()
        for _ in range(10):
            for tokens, logprobs, blobs in adapter.unpack(adapter.sample(task, 4)):
                assert tokens.dtype == np.int32 and tokens.shape == (small.tokens,), cls.name
                assert logprobs.dtype == np.float32 and logprobs.shape == (small.tokens,)
                tid = int(tokens[1])
                assert int(tokens[0]) == task, f"{cls.name}: sample of task {task} has {tokens[0]}"
                assert tid - 100 * task >= 2, f"{cls.name}: evicted trajectory {tid} sampled"
                want = kept[task][tid]
                assert np.array_equal(tokens, want.tokens), cls.name
                assert np.array_equal(logprobs, want.logprobs), cls.name
                assert len(blobs) == small.blobs, cls.name
                assert all(_same_blob(g, w) for g, w in zip(blobs, want.blobs, strict=True))
                seen.add(tid)
        assert len(seen) == 3, f"{cls.name}: uniform sampling reached {sorted(seen)} of 3 items"
    adapter.close()


def check_filled(adapter: Adapter, cfg: BenchConfig, fingerprints: dict[int, bytes]) -> None:
    """Every task returns its own trajectories with the blob heads that were inserted."""
    for task in range(cfg.tasks):
        batch = adapter.unpack(adapter.sample(task, cfg.batch))
        assert len(batch) == cfg.batch, f"{adapter.name}: sampled {len(batch)} of {cfg.batch}"
        for tokens, _logprobs, blobs in batch:
            assert int(tokens[0]) == task, f"{adapter.name}: task {task} returned {tokens[0]}"
            head = b"".join(_as_bytes(b[:8]) for b in blobs)
            assert head == fingerprints[int(tokens[1])], f"{adapter.name}: blob bytes differ"
            assert all(len(b) == cfg.blob_bytes for b in blobs)


# --------------------------------------------------------------------------------------
# One store, in its own process
# --------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def run_phase(
    adapter: Adapter, cfg: BenchConfig, pool: list[Any], writers: int, readers: int
) -> dict[str, Any]:
    stop = threading.Event()
    start = threading.Barrier(writers + readers + 1)
    inserts = [0] * writers
    sampled = [0] * readers
    # 8 bytes per call (array, not a list of ints): millions of calls stay out of peak RSS.
    latencies = [array.array("q") for _ in range(readers)]
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            n, i = 0, w
            start.wait(timeout=60)
            while not stop.is_set():
                task, native = pool[i % len(pool)]
                adapter.insert(task, native)
                n += 1
                i += writers
            inserts[w] = n
        except BaseException as e:  # surface in the parent thread, never hang
            errors.append(e)
            stop.set()

    def reader(r: int) -> None:
        try:
            rng = random.Random(cfg.seed * 1000 + r)
            lat = latencies[r]
            n = 0
            clock = time.perf_counter_ns
            start.wait(timeout=60)
            while not stop.is_set():
                task = rng.randrange(cfg.tasks)
                t0 = clock()
                batch = adapter.sample(task, cfg.batch)
                adapter.touch(batch)
                lat.append(clock() - t0)
                n += cfg.batch
            sampled[r] = n
        except BaseException as e:
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    threads += [threading.Thread(target=reader, args=(r,)) for r in range(readers)]
    for t in threads:
        t.start()
    start.wait(timeout=60)
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    time.sleep(cfg.seconds)
    stop.set()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    if errors:
        raise errors[0]
    lat_all = np.concatenate([np.frombuffer(x, dtype=np.int64) for x in latencies if x] or [[0]])
    ins, smp = sum(inserts), sum(sampled)
    return {
        "writers": writers,
        "readers": readers,
        "seconds": wall,
        "inserts": ins,
        "sampled": smp,
        "inserts_per_s": ins / wall,
        "sampled_per_s": smp / wall,
        "insert_gb_per_s": ins * cfg.traj_bytes / wall / 1e9,
        "sample_gb_per_s": smp * cfg.traj_bytes / wall / 1e9,
        "sample_p50_ms": float(np.percentile(lat_all, 50)) / 1e6,
        "sample_p99_ms": float(np.percentile(lat_all, 99)) / 1e6,
        "sample_calls": int(sum(len(x) for x in latencies)),
        "cpu_cores": cpu / wall,
    }


def run_store(name: str, cfg: BenchConfig) -> dict[str, Any]:
    cls = ADAPTERS[name]
    t_import = time.perf_counter()
    cls.load()
    t_import = time.perf_counter() - t_import
    check_roundtrip(cls, cfg)

    rng = np.random.default_rng(cfg.seed + 1)
    raw_pool = [
        (i % cfg.tasks, make_traj(cfg, i % cfg.tasks, 1_000_000 + i, rng)) for i in range(cfg.pool)
    ]
    gc.collect()
    baseline_rss = _rss_bytes()  # interpreter + libraries + pool: everything but the store

    adapter = cls(cfg)
    pool = [(task, adapter.prepare(task, traj)) for task, traj in raw_pool]
    del raw_pool
    fingerprints: dict[int, bytes] = {}
    t_fill = t_fill_insert = 0.0
    traj_id = 0
    for _ in range(cfg.per_task):
        for task in range(cfg.tasks):
            t0 = time.perf_counter()
            traj = make_traj(cfg, task, traj_id, rng)  # os.urandom: most of the fill time
            fingerprints[traj_id] = heads(traj)
            t1 = time.perf_counter()
            adapter.insert(task, adapter.prepare(task, traj))
            t2 = time.perf_counter()
            t_fill, t_fill_insert = t_fill + t2 - t0, t_fill_insert + t2 - t1
            traj_id += 1
    del traj
    check_filled(adapter, cfg, fingerprints)
    filled_rss = _rss_bytes()

    phases = [run_phase(adapter, cfg, pool, w, r) for w, r in PHASES]
    extra = {}
    if name == "arpo":
        extra["store_bytes_used"] = int(adapter.store.bytes_used)
        extra["store_stats"] = _jsonable(adapter.store.stats())
    adapter.close()
    return {
        "store": name,
        "import_s": t_import,
        "fill_s": t_fill,
        "fill_inserts_per_s": cfg.tasks * cfg.per_task / t_fill_insert,
        "baseline_rss": baseline_rss,
        "filled_rss": filled_rss,
        "peak_rss": _peak_rss_bytes(),
        "phases": phases,
        **extra,
    }


def _jsonable(x: Any) -> Any:
    try:
        json.dumps(x)
        return x
    except TypeError:
        return repr(x)


def run_memcpy(cfg: BenchConfig) -> dict[str, Any]:
    n = cfg.memcpy_mb << 20
    src = np.frombuffer(os.urandom(n), dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = 0  # touched: page faults paid here, not in the timed copies
    best_touched = best_fresh = best_two = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        best_touched = min(best_touched, time.perf_counter() - t)
        t = time.perf_counter()
        fresh = np.copy(src)  # new mapping: every page is faulted in during the copy
        best_fresh = min(best_fresh, time.perf_counter() - t)
        del fresh
        # Two threads, each copying half (numpy releases the GIL for the copy).
        h = n // 2
        ts = [
            threading.Thread(target=np.copyto, args=(dst[:h], src[:h])),
            threading.Thread(target=np.copyto, args=(dst[h:], src[h:])),
        ]
        t = time.perf_counter()
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        best_two = min(best_two, time.perf_counter() - t)
    return {
        "bytes": n,
        "touched_gb_per_s": n / best_touched / 1e9,
        "fresh_gb_per_s": n / best_fresh / 1e9,
        "touched_2threads_gb_per_s": n / best_two / 1e9,
    }


def child_main(which: str, cfg: BenchConfig, out: Path) -> None:
    result = run_memcpy(cfg) if which == "memcpy" else run_store(which, cfg)
    out.write_text(json.dumps(result))


# --------------------------------------------------------------------------------------
# Parent: run each store in a fresh subprocess, then compare
# --------------------------------------------------------------------------------------


def _machine_busy_seconds() -> float:
    """CPU seconds spent by every process on the machine so far (from /proc/stat)."""
    try:
        vals = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except OSError:
        return float("nan")
    return (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait


def _children_cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def spawn(which: str, cfg: BenchConfig) -> dict[str, Any]:
    """Runs one store (or the memcpy probe) in a fresh interpreter.

    Also records how many cores other processes on the machine used meanwhile: a number
    well above 0 means the run was disturbed and its timings are not to be trusted.
    """
    busy0, own0, t0 = _machine_busy_seconds(), _children_cpu_seconds(), time.perf_counter()
    result = _spawn(which, cfg)
    wall = time.perf_counter() - t0
    other = (_machine_busy_seconds() - busy0) - (_children_cpu_seconds() - own0)
    result["other_cores"] = max(other, 0.0) / wall
    return result


def _spawn(which: str, cfg: BenchConfig) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            __file__,
            "--child",
            which,
            "--child-config",
            json.dumps(dataclasses.asdict(cfg)),
            "--child-out",
            str(out),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
            return {"store": which, "error": "\n".join(tail) or f"exit {proc.returncode}"}
        return json.loads(out.read_text())


def machine_info() -> dict[str, Any]:
    header = run_header()
    commit = str(header["commit"])
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    versions: dict[str, str] = {"python": platform.python_version(), "numpy": np.__version__}
    for mod in ("torch", "torchrl", "tensordict", "cpprb"):
        try:
            from importlib.metadata import version

            versions[mod] = version(mod)
        except Exception:
            versions[mod] = "not installed"
    return {
        "date": header["date"],
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "ram_gib": round(mem / 2**30, 1),
        "kernel": platform.release(),
        "commit": commit.removesuffix("+changes"),
        "dirty": commit.endswith("+changes"),
        "load_average": header["load_average"],
        "versions": versions,
    }


def _fmt(x: float) -> str:
    if x != x:  # nan
        return "-"
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}" if x >= 0.1 else f"{x:.3f}"


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def summarize(
    cfg: BenchConfig, results: dict[str, dict[str, Any]], memcpy: dict[str, Any], quick: bool
) -> tuple[str, dict[str, Any]]:
    """The Markdown report and the verdict on the project's targets."""
    ok = {n: r for n, r in results.items() if "error" not in r}
    names = list(results)
    lines = ["| metric | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]

    def row(label: str, get: Any) -> None:
        cells = []
        for n in names:
            cells.append(_fmt(get(results[n])) if n in ok else "error")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    for p, (w, r) in enumerate(PHASES):
        tag = f"{w}w+{r}r"
        row(f"inserts/s ({tag})", lambda x, p=p: x["phases"][p]["inserts_per_s"])
        row(f"insert GB/s ({tag})", lambda x, p=p: x["phases"][p]["insert_gb_per_s"])
        row(f"sampled traj/s ({tag})", lambda x, p=p: x["phases"][p]["sampled_per_s"])
        row(f"sampled GB/s ({tag})", lambda x, p=p: x["phases"][p]["sample_gb_per_s"])
        row(f"sample p50 ms ({tag})", lambda x, p=p: x["phases"][p]["sample_p50_ms"])
        row(f"sample p99 ms ({tag})", lambda x, p=p: x["phases"][p]["sample_p99_ms"])
        row(f"CPU cores used ({tag})", lambda x, p=p: x["phases"][p]["cpu_cores"])
    payload = cfg.payload_bytes
    row("fill inserts/s (prepare + insert, empty to full)", lambda x: x["fill_inserts_per_s"])
    row("peak RSS GB", lambda x: x["peak_rss"] / 1e9)
    row("peak RSS / payload", lambda x: x["peak_rss"] / payload)
    row(
        "(peak RSS - RSS before the store) / payload",
        lambda x: (x["peak_rss"] - x["baseline_rss"]) / payload,
    )
    row("other processes' CPU during the run (cores)", lambda x: x["other_cores"])
    table = "\n".join(lines)

    verdict: dict[str, Any] = {}
    notes = []
    ratio_md: list[str] = []
    if "arpo" in ok:
        a = ok["arpo"]
        groups = {
            "best peer": [n for n in ok if n != "arpo"],
            "best copying peer": [n for n in ok if n in COPYING_PEERS],
            "best library peer (TorchRL, cpprb)": [n for n in ok if n in LIBRARY_PEERS],
        }
        cols = [(m, p) for m in ("sampled_per_s", "inserts_per_s") for p in range(len(PHASES))]
        heads_ = [
            f"{'sampled' if m == 'sampled_per_s' else 'inserts'} {PHASES[p][0]}w+{PHASES[p][1]}r"
            for m, p in cols
        ]
        ratio_md = ["| arpo vs | " + " | ".join(heads_) + " |", "|---" * (len(cols) + 1) + "|"]
        ratios: dict[str, dict[str, Any]] = {}
        for group, members in groups.items():
            if not members:
                continue
            cells = []
            for (m, p), head in zip(cols, heads_, strict=True):
                best = max(members, key=lambda n, m=m, p=p: ok[n]["phases"][p][m])
                r = _ratio(a["phases"][p][m], ok[best]["phases"][p][m])
                ratios.setdefault(group, {})[head] = {"peer": best, "ratio": r}
                cells.append(f"{r:.2f}x ({best})")
            ratio_md.append(f"| {group} | " + " | ".join(cells) + " |")
        verdict["ratios"] = ratios

        def worst(group: str, metric: str) -> float:
            vals = [v["ratio"] for k, v in ratios.get(group, {}).items() if k.startswith(metric)]
            return min(vals) if vals else float("nan")

        rss_ratio = a["peak_rss"] / payload
        p99 = max(ph["sample_p99_ms"] for ph in a["phases"])
        verdict["targets"] = {
            "sampled traj/s >= 20x best peer": worst("best peer", "sampled") >= 20,
            "inserts/s >= 2x best copying peer": worst("best copying peer", "inserts") >= 2,
            "peak RSS <= 1.2x payload": rss_ratio <= 1.2,
            "p99 sample latency < 1 ms": p99 < 1.0,
        }
        notes.append(f"arpo peak RSS / payload: {rss_ratio:.2f}; worst p99 sample: {p99:.3f} ms")
    gil = [
        n
        for n, r in ok.items()
        if r["phases"][-1]["cpu_cores"] < 1.2 and (os.cpu_count() or 1) >= 2
    ]
    disturbed = [n for n, r in ok.items() if r["other_cores"] > 0.1]
    if disturbed and not quick:
        notes.append(
            "DISTURBED: other processes used > 0.1 core while these ran, so their timings "
            "are not clean: " + ", ".join(disturbed)
        )
    if quick:
        notes.insert(
            0, "QUICK RUN: stores ran at the same time on tiny sizes; numbers are not comparable"
        )
    elif gil:
        notes.append(
            "with 2 writers + 2 readers these processes used < 1.2 of the 2 cores (the Python "
            "threads serialize on the GIL): " + ", ".join(gil)
        )

    lim = memcpy
    mem_line = (
        f"memcpy (numpy, {lim['bytes'] >> 20} MiB): {lim['touched_gb_per_s']:.1f} GB/s into "
        f"touched memory, {lim['touched_2threads_gb_per_s']:.1f} GB/s with 2 threads, "
        f"{lim['fresh_gb_per_s']:.1f} GB/s into fresh pages; a store that copies each "
        f"trajectory once cannot exceed {lim['touched_gb_per_s'] * 1e9 / cfg.traj_bytes:,.0f} "
        "trajectories/s per thread."
    )
    md = [
        table,
        "",
        f"Payload: {cfg.tasks} tasks x {cfg.per_task} trajectories x {cfg.traj_bytes / 1e6:.3f} "
        f"MB = {payload / 1e9:.2f} GB; phases of {cfg.seconds:g} s; batches of {cfg.batch}.",
        "",
        mem_line,
        "",
        *ratio_md,
        "",
        *[f"- {n}" for n in notes],
    ]
    if "targets" in verdict:
        head = "target (quick run: not meaningful)" if quick else "target"
        md += ["", f"| {head} | met |", "|---|---|"]
        md += [f"| {k} | {'yes' if v else 'no'} |" for k, v in verdict["targets"].items()]
    for n, r in results.items():
        if "error" in r:
            md += ["", f"{n} failed:", "```", r["error"], "```"]
    return "\n".join(md), verdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10-second smoke run, writes nothing")
    ap.add_argument("--stores", default=",".join(STORES), help="comma-separated subset")
    ap.add_argument("--out-dir", type=Path, default=None, help="default: benchmarks/results")
    ap.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    for f in dataclasses.fields(BenchConfig):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=None)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-config", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        child_main(args.child, BenchConfig(**json.loads(args.child_config)), args.child_out)
        return

    base = QUICK if args.quick else BenchConfig()
    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(BenchConfig)
        if getattr(args, f.name) is not None
    }
    cfg = dataclasses.replace(base, **overrides)
    stores = [s for s in args.stores.split(",") if s]
    unknown = set(stores) - set(STORES)
    if unknown:
        raise SystemExit(f"unknown store(s) {sorted(unknown)}; choose from {', '.join(STORES)}")

    info = machine_info()
    print(
        f"# store benchmark {info['date']} - {info['cpu']}, {info['cores']} cores, "
        f"{info['ram_gib']} GiB, commit {info['commit']}{' (dirty)' if info['dirty'] else ''}",
        flush=True,
    )
    print(f"payload {cfg.payload_bytes / 1e9:.2f} GB per store; config {cfg}", flush=True)
    t0 = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    if args.quick:  # smoke run: timings are not comparable, so run the children at once
        with concurrent.futures.ThreadPoolExecutor(len(stores) + 1) as ex:
            fut_mem = ex.submit(spawn, "memcpy", cfg)
            futs = {s: ex.submit(spawn, s, cfg) for s in stores}
            memcpy = fut_mem.result()
            results = {s: f.result() for s, f in futs.items()}
    else:
        memcpy = spawn("memcpy", cfg)
        for s in stores:
            print(f"  {s} ...", end="", flush=True)
            results[s] = spawn(s, cfg)
            print(" failed" if "error" in results[s] else " done", flush=True)
    if "error" in memcpy:
        raise SystemExit(f"memcpy measurement failed:\n{memcpy['error']}")
    md, verdict = summarize(cfg, results, memcpy, args.quick)
    print(md)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")

    report = {
        **info,
        "config": dataclasses.asdict(cfg),
        "quick": args.quick,
        "memcpy": memcpy,
        "results": results,
        "verdict": verdict,
    }
    out_dir = args.out_dir or (None if args.quick else REPO / "benchmarks" / "results")
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        stem = out_dir / f"store-{info['date'][:10]}"
        header = (
            f"# Replay store benchmark, {info['date']}\n\n"
            f"Machine: {info['cpu']}, {info['cores']} cores, {info['ram_gib']} GiB RAM, "
            f"Linux {info['kernel']}. Commit {info['commit']}"
            f"{' (uncommitted changes)' if info['dirty'] else ''}. Versions: "
            + ", ".join(f"{k} {v}" for k, v in info["versions"].items())
            + ".\n\nCommand: `"
            + " ".join(["python benchmarks/bench_store.py", *sys.argv[1:]])
            + "`\n\n"
        )
        stem.with_suffix(".md").write_text(header + md + "\n")
        stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {stem}.md and {stem}.json")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if any("error" in r for r in results.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()

"""Trajectories actor -> store over TCP loopback, next to a raw socket moving the same bytes.

    .venv/bin/python benchmarks/bench_transport.py            # full run, writes benchmarks/results/
    .venv/bin/python benchmarks/bench_transport.py --quick    # a few seconds, no results file

Workload: the realistic record of the tests (15 turns, 15 real PNG screenshots of about
90 KB, about 20k tokens, 1.37 MB on the wire), `n` distinct trajectories (distinct ids,
shared PNG buffers). The receiving side runs in its own process (the learner), the
sending side in this one (the actor); each row times first byte sent -> last
acknowledgement received. Rows:

- raw TCP             one socket, the same bytes length-prefixed; the receiver reads them
                      into one reused buffer and answers one byte at the end (no decoding,
                      no store): the physical limit the issue names
- raw TCP, kept       the same, but the receiver reads each message into a buffer of its
                      own and keeps it, as anything that stores the data must (fresh
                      memory: page faults and zeroing of 1.4 MB per trajectory)
- plain ZeroMQ        DEALER -> ROUTER with the same frames (zero-copy both ends), the
                      receiver answers each message with a small ack, at most 32 unacked:
                      the ZeroMQ ceiling of the arpo rows (no decoding, no store)
- arpo transport      ActorLink (DEALER, asyncio) -> Ingest (ROUTER): decode + validate +
                      `store_item.to_item` + `store.put` + an ack per trajectory; at most 32 unacked
- arpo + journal      the same with the learner's write-ahead journal (its default in
                      `arpo-learner`): each trajectory appended and fsynced before its ack
- arpo + spool        the same as `arpo transport` with the actor's spool: write + fsync +
                      rename before the send, delete on the ack

Correctness is checked before the figures are reported: every trajectory is in the store
once, and one taken back out equals the one sent, byte for byte. Rows are interleaved
(one run of each per repeat) and the table gives the median of the repeats.

A second table gives the per-trajectory CPU cost of the codec and store steps in this
process (median over the `n` trajectories): the work the arpo rows add to ZeroMQ's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_wire import machine  # noqa: E402
from conftest import make_png, make_trajectory  # noqa: E402

from arpo import store_item, wire  # noqa: E402
from arpo.record import Trajectory  # noqa: E402


def workload(n: int) -> list[Trajectory]:
    rng = np.random.default_rng(0)
    pngs = [make_png(rng) for _ in range(15)]
    base = make_trajectory(rng, pngs=pngs)
    return [dataclasses.replace(base, trajectory_id=uuid.uuid4().hex) for _ in range(n)]


# ---------------------------------------------------------------------------- learner process


def _learner(q: mp.Queue, done: mp.Event, n: int, journal: str) -> None:
    from arpo.buffer import ReplayStore
    from arpo.service.ingest import Ingest, IngestConfig
    from arpo.transport import TransportConfig

    store = ReplayStore(max_bytes=8 << 30, fresh_capacity=n + 1, seed=0)
    ingest = Ingest(
        store,
        IngestConfig(journal_dir=journal),
        transport=TransportConfig(data="tcp://127.0.0.1:0", rcvhwm=1000),
    )
    q.put(ingest.start())
    done.wait()
    ingest.stop()
    task = store.tasks()[0]
    first = store_item.from_item(store.take_group(task, 1, timeout=0)[0])
    q.put(
        {
            "stored": ingest.stats().get("stored", 0),
            "duplicates": ingest.stats().get("duplicates", 0),
            "first_id": first.trajectory_id,
            "first": b"".join(bytes(f) for f in wire.encode(first)),
        }
    )


def _raw_receiver(q: mp.Queue, total: int, sizes: list[int] | None) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    got = 0
    if sizes is None:  # one reused buffer
        view = memoryview(bytearray(8 << 20))
        while got < total:
            k = conn.recv_into(view)
            if not k:
                break
            got += k
    else:  # every message into a buffer of its own, all kept
        kept = []
        for size in sizes:
            view = memoryview(bytearray(size))
            off = 0
            while off < size:
                k = conn.recv_into(view[off:])
                if not k:
                    raise ConnectionError("sender closed early")
                off += k
            kept.append(view)
            got += size
    conn.sendall(b"k")
    conn.close()
    srv.close()
    q.put(got)


def _zmq_receiver(q: mp.Queue, n: int) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, 1000)
    sock.setsockopt(zmq.SNDBUF, 4 << 20)
    sock.setsockopt(zmq.RCVBUF, 4 << 20)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    q.put(port)
    got = nbytes = 0
    while got < n:
        msg = sock.recv_multipart(copy=False)
        nbytes += sum(len(f) for f in msg[1:])
        got += 1
        sock.send_multipart([msg[0], b"ack"])
    q.put(nbytes)
    sock.close(linger=1000)
    ctx.term()


# ---------------------------------------------------------------------------- senders


def run_zmq(trajs: list[Trajectory]) -> float:
    import zmq

    msgs = [[bytes(f) for f in wire.encode(t)] for t in trajs]
    total = sum(len(x) for m in msgs for x in m)
    mctx = mp.get_context("spawn")
    q = mctx.Queue()
    p = mctx.Process(target=_zmq_receiver, args=(q, len(msgs)))
    p.start()
    port = q.get(timeout=60)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 64)
    sock.setsockopt(zmq.SNDBUF, 4 << 20)
    sock.setsockopt(zmq.RCVBUF, 4 << 20)
    sock.connect(f"tcp://127.0.0.1:{port}")
    window, in_flight, acked = 32, 0, 0
    t0 = time.perf_counter()
    for m in msgs:
        while in_flight >= window:
            sock.recv()
            in_flight -= 1
            acked += 1
        sock.send_multipart(m, copy=False)
        in_flight += 1
    while acked < len(msgs):
        sock.recv()
        acked += 1
    el = time.perf_counter() - t0
    sock.close(linger=0)
    ctx.term()
    assert q.get(timeout=60) == total
    p.join(30)
    return el


def run_raw(trajs: list[Trajectory], keep: bool = False) -> float:
    msgs = []
    for t in trajs:
        frames = [bytes(f) for f in wire.encode(t)]
        head = struct.pack("<I", len(frames)) + b"".join(struct.pack("<Q", len(f)) for f in frames)
        msgs.append([head, *frames])
    total = sum(len(x) for m in msgs for x in m)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    sizes = [sum(len(x) for x in m) for m in msgs] if keep else None
    p = ctx.Process(target=_raw_receiver, args=(q, total, sizes))
    p.start()
    port = q.get(timeout=60)
    s = socket.create_connection(("127.0.0.1", port))
    t0 = time.perf_counter()
    for m in msgs:
        s.sendmsg(m)
    assert s.recv(1) == b"k"
    el = time.perf_counter() - t0
    s.close()
    assert q.get(timeout=60) == total
    p.join(30)
    return el


async def _send_all(endpoint: str, trajs: list[Trajectory], spool_dir: str | None) -> float:
    from arpo.actor.spool import Spool
    from arpo.transport import ActorLink, TransportConfig

    pending: set[str] = set()
    wake = asyncio.Event()
    spool = Spool(spool_dir, max_bytes=1 << 40) if spool_dir else None

    def on_ack(ids: tuple[str, ...]) -> None:
        for i in ids:
            pending.discard(i)
            if spool is not None:
                spool.remove(i)
        wake.set()

    link = ActorLink(
        TransportConfig(data=endpoint, control="tcp://127.0.0.1:1", sndhwm=64),
        on_ack=on_ack,
        actor_id="bench",
    )
    link.start()
    window = 32
    t0 = time.perf_counter()
    for t in trajs:
        while len(pending) >= window:
            wake.clear()
            await wake.wait()
        if spool is not None:
            await asyncio.to_thread(spool.put, t)
            frames = await asyncio.to_thread(spool.frames, t.trajectory_id)
        else:
            frames = wire.encode(t)
        pending.add(t.trajectory_id)
        assert await link.send(frames, timeout=60)
    while pending:
        wake.clear()
        await asyncio.wait_for(wake.wait(), 60)
    el = time.perf_counter() - t0
    await link.close()
    return el


def run_arpo(trajs: list[Trajectory], spool: bool, journal: bool = False) -> float:
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    tmp = ROOT / "runs" if (ROOT / "runs").is_dir() else None
    with (
        tempfile.TemporaryDirectory(dir=tmp) as d,
        tempfile.TemporaryDirectory(dir=tmp) as jd,
    ):
        p = ctx.Process(target=_learner, args=(q, done, len(trajs), jd if journal else ""))
        p.start()
        endpoint = q.get(timeout=120)
        el = asyncio.run(_send_all(endpoint, trajs, d if spool else None))
        assert not list(Path(d).glob("*.traj")), "spool not emptied by the acks"
    done.set()
    res = q.get(timeout=120)
    p.join(60)
    # Correctness before figures: all stored once, and exactly what was sent.
    assert res["stored"] == len(trajs) and res["duplicates"] == 0, res
    sent = next(t for t in trajs if t.trajectory_id == res["first_id"])
    assert res["first"] == b"".join(bytes(f) for f in wire.encode(sent))
    return el


def step_costs(trajs: list[Trajectory]) -> dict[str, tuple[str, float]]:
    """Median milliseconds per trajectory of each codec / store step, in this process."""
    import zmq

    from arpo.buffer import ReplayStore

    def each(f, xs):
        out, ts = [], []
        for x in xs:
            t = time.perf_counter()
            out.append(f(x))
            ts.append(time.perf_counter() - t)
        return out, 1e3 * statistics.median(ts)

    frames, enc = each(wire.encode, trajs)
    received = [[zmq.Frame(bytes(f)) for f in fr] for fr in frames]  # as ingest receives them
    decoded, dec = each(wire.decode, received)
    items, item = each(store_item.to_item, decoded)
    store = ReplayStore(max_bytes=8 << 30, fresh_capacity=len(items) + 1, seed=0)
    _, put = each(lambda it: store.put("task", it), items)
    _, ack = each(lambda t: wire.encode(wire.Ack((t.trajectory_id,))), decoded)
    store.close()
    return {
        "wire.encode (trajectory -> frames)": ("actor", enc),
        "wire.decode (frames -> validated trajectory)": ("learner", dec),
        "store_item.to_item (trajectory -> store item)": ("learner", item),
        "store.put": ("learner", put),
        "wire.encode (ack)": ("learner", ack),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("-n", type=int, default=400, help="trajectories per row")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    n, repeats = (40, 1) if args.quick else (args.n, args.repeats)
    trajs = workload(n)
    nbytes = sum(sum(memoryview(f).nbytes for f in wire.encode(t)) for t in trajs)
    load = os.getloadavg()
    rows: dict[str, list[float]] = {
        "raw TCP": [],
        "raw TCP, kept": [],
        "plain ZeroMQ": [],
        "arpo transport": [],
        "arpo + journal": [],
        "arpo + spool": [],
    }
    for _ in range(repeats):
        rows["raw TCP"].append(run_raw(trajs))
        rows["raw TCP, kept"].append(run_raw(trajs, keep=True))
        rows["plain ZeroMQ"].append(run_zmq(trajs))
        rows["arpo transport"].append(run_arpo(trajs, spool=False))
        rows["arpo + journal"].append(run_arpo(trajs, spool=False, journal=True))
        rows["arpo + spool"].append(run_arpo(trajs, spool=True))
    best = {k: statistics.median(v) for k, v in rows.items()}
    raw = best["raw TCP"]
    kept = best["raw TCP, kept"]
    lines = [
        f"# Transport: {n} realistic trajectories ({nbytes / n / 1e6:.2f} MB each) actor -> store,"
        " TCP loopback",
        "",
        "| path | trajectories/s | GB/s | vs raw | vs raw, kept | vs plain ZeroMQ | runs (s) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for k, el in best.items():
        lines.append(
            f"| {k} | {n / el:,.0f} | {nbytes / el / 1e9:.2f} | {raw / el:.2f} | {kept / el:.2f} | "
            f"{best['plain ZeroMQ'] / el:.2f} | " + ", ".join(f"{x:.3f}" for x in rows[k]) + " |"
        )
    info = machine()
    info["load_before"] = [round(x, 2) for x in load]
    info["load_after"] = info.pop("load_average")
    costs = step_costs(trajs)
    lines += [
        "",
        f"median of {repeats} interleaved runs per row; " + json.dumps(info),
        "",
        "Per-trajectory CPU cost in one process (median over the trajectories):",
        "",
        "| step | side | ms |",
        "|---|---|---:|",
        *(f"| {k} | {side} | {v:.3f} |" for k, (side, v) in costs.items()),
    ]
    text = "\n".join(lines)
    print(text)
    if not args.quick:
        out = ROOT / "benchmarks" / "results"
        out.mkdir(parents=True, exist_ok=True)
        day = info["date"][:10]
        (out / f"transport-{day}.md").write_text(text + "\n")
        (out / f"transport-{day}.json").write_text(
            json.dumps(
                {
                    "machine": info,
                    "n": n,
                    "bytes": nbytes,
                    "seconds": rows,
                    "step_ms": {k: v for k, (_, v) in costs.items()},
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

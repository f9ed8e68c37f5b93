"""Wire-format throughput next to pickle and a raw copy of the same bytes, in one run.

    .venv/bin/python benchmarks/bench_wire.py            # full run, writes benchmarks/results/
    .venv/bin/python benchmarks/bench_wire.py --quick    # a few seconds, no results file

Workload: the realistic record of the tests (15 turns, 15 real PNG screenshots
of about 90 KB, about 20k tokens, 1.37 MB in all). Each contender is checked for
correctness before it is timed. Rows:

- wire.encode          the list of frames ZeroMQ sends (PNG frames are the record's own buffers)
- wire.encode+join     the same frames joined into one bytes object (if a single buffer is needed)
- wire.decode          frames -> Trajectory with numpy views and memoryviews into the frames
- pickle.dumps/loads   protocol 5, in-band (what a naive transport would do)
- copy (fresh pages)   bytes(...) of a buffer of the message's size: allocate + memcpy
- copy (touched)       memcpy into a preallocated, already touched buffer: the physical limit

Run alone on the machine: on 2 cores anything in the background distorts it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import pickle
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from _machine import cpu_model, run_header  # noqa: E402
from conftest import make_png, make_trajectory  # noqa: E402

from arpo import wire  # noqa: E402
from arpo.record import Trajectory  # noqa: E402


def machine() -> dict[str, object]:
    header = run_header()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "date": header["date"],
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "commit": header["commit"],
        "load_average": header["load_average"],
    }


def timeit(fn, *, seconds: float, repeats: int) -> list[float]:
    """Median-friendly timing: `repeats` rounds of about seconds/repeats each; s per call."""
    fn()
    n = 1
    while True:  # calibrate the inner loop to ~1/repeats of the budget
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        el = time.perf_counter() - t0
        if el > seconds / repeats / 4 or n > 1 << 20:
            break
        n *= 2
    inner = max(1, int(n * (seconds / repeats) / max(el, 1e-9)))
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter() - t0) / inner)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seconds", type=float, default=3.0, help="time budget per row")
    ap.add_argument(
        "--repeats", type=int, default=7, help="rounds per row (the median is reported)"
    )
    ap.add_argument("--quick", action="store_true", help="0.3 s per row, no results file")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    if args.quick:
        args.seconds, args.repeats = 0.3, 3

    rng = np.random.default_rng(0)
    pngs = [make_png(rng) for _ in range(15)]
    traj = make_trajectory(rng, pngs=pngs)
    frames = wire.encode(traj)
    size = sum(len(memoryview(f).cast("B")) for f in frames)
    pickled = pickle.dumps(traj, protocol=5)
    joined = b"".join(frames)
    src = np.frombuffer(joined, np.uint8)
    dst = np.empty_like(src)
    dst[:] = 1  # touch every page

    # Assert before timing.
    assert wire.decode(frames) == traj
    assert pickle.loads(pickled) == traj
    assert isinstance(wire.decode(frames), Trajectory)

    rows = [
        ("wire.encode", lambda: wire.encode(traj)),
        ("wire.encode+join", lambda: b"".join(wire.encode(traj))),
        ("wire.decode", lambda: wire.decode(frames)),
        ("pickle.dumps", lambda: pickle.dumps(traj, protocol=5)),
        ("pickle.loads", lambda: pickle.loads(pickled)),
        ("copy (fresh pages)", lambda: bytearray(joined)),
        ("copy (touched)", lambda: np.copyto(dst, src)),
    ]
    results = []
    for name, fn in rows:
        times = timeit(fn, seconds=args.seconds, repeats=args.repeats)
        med = statistics.median(times)
        results.append(
            {"row": name, "median_us": med * 1e6, "records_s": 1 / med, "gb_s": size / med / 1e9}
        )

    by = {r["row"]: r for r in results}
    info = machine()
    lines = [
        f"# Wire format throughput ({info['date']}, commit {info['commit']})",
        "",
        f"Machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB; Python {info['python']}, numpy {info['numpy']}.",
        f"Record: {traj.steps} turns, {traj.num_tokens} tokens, {traj.png_bytes / 1e6:.2f} MB of PNG; message {size / 1e6:.2f} MB in {len(frames)} frames.",
        f"Command: `.venv/bin/python benchmarks/bench_wire.py` (median of {args.repeats} rounds of {args.seconds / args.repeats:.2f} s).",
        "",
        "| row | median µs | records/s | GB/s |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {r['row']} | {r['median_us']:.1f} | {r['records_s']:,.0f} | {r['gb_s']:.2f} |"
        for r in results
    ]
    lines += [
        "",
        f"decode is {by['pickle.loads']['median_us'] / by['wire.decode']['median_us']:.1f}x faster than pickle.loads; "
        f"encode is {by['pickle.dumps']['median_us'] / by['wire.encode']['median_us']:.1f}x faster than pickle.dumps; "
        f"decode takes {by['wire.decode']['median_us'] / by['copy (touched)']['median_us']:.2f}x the time of one memcpy "
        f"of the message into touched memory ({by['wire.decode']['median_us'] / by['copy (fresh pages)']['median_us']:.2f}x into fresh pages).",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.quick:
        args.out.mkdir(parents=True, exist_ok=True)
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M")
        (args.out / f"wire-{stamp}.md").write_text(text + "\n")
        (args.out / f"wire-{stamp}.json").write_text(
            json.dumps({"machine": info, "message_bytes": size, "rows": results}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()

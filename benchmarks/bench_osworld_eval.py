"""Evaluation cost per task: OSWorld's evaluator through its worker vs the project's own runner.

    .venv/bin/python benchmarks/bench_osworld_eval.py           # writes benchmarks/results/
    .venv/bin/python benchmarks/bench_osworld_eval.py --quick   # 3 rounds, no results file

One task (a spreadsheet downloaded in setup; scored by compare_table on the file fetched back
from the environment against a reference from the file cache, and by exact_match on a
command's output), one loopback OSWorld-protocol peer (tests/osworld_fixtures/peer.py). Per
evaluator: setup and evaluate seconds (median of the rounds), the worker's start-up (spawn,
import of OSWorld's modules, first answer) and its resident memory after the rounds.
Correctness first: both must score the task 1.0 before anything is timed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from _machine import run_header  # noqa: E402
from arpo_envs.tasks.xlsx_writer import write_xlsx  # noqa: E402
from osworld_fixtures.peer import Peer  # noqa: E402

from arpo.env.client import ClientConfig, EnvClient  # noqa: E402
from arpo.env.osworld.client import OSWorldEvaluator  # noqa: E402
from arpo.env.runner import RunnerConfig, TaskRunner  # noqa: E402
from arpo.env.task import Task  # noqa: E402

URL = "https://huggingface.co/datasets/xlangai/ubuntu_osworld_file_cache/resolve/main/calc/{}"
TASK = {
    "id": "bench-calc",
    "instruction": "x",
    "config": [
        {
            "type": "download",
            "parameters": {"files": [{"url": URL.format("a.xlsx"), "path": "/home/user/a.xlsx"}]},
        }
    ],
    "evaluator": {
        "func": ["compare_table", "exact_match"],
        "result": [
            {"type": "vm_file", "path": "/home/user/a.xlsx", "dest": "a.xlsx"},
            {"type": "vm_command_line", "command": ["echo", "hi"]},
        ],
        "expected": [
            {"type": "cloud_file", "path": URL.format("gold.xlsx"), "dest": "gold.xlsx"},
            {"type": "rule", "rules": {"expected": "hi\n"}},
        ],
        "options": [{"rules": [{"type": "sheet_data", "sheet_idx0": 0, "sheet_idx1": "EI0"}]}, {}],
    },
}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def measure(evaluator: str, cache: Path, rounds: int) -> dict[str, float]:
    task = Task.from_dict(json.loads(json.dumps(TASK)), domain="libreoffice_calc")
    peer = await Peer().start()
    client = EnvClient(ClientConfig(base_url=peer.url, max_retries=0))
    pool = OSWorldEvaluator()
    runner = TaskRunner(client, RunnerConfig(cache_dir=cache, evaluator=evaluator), osworld=pool)
    out: dict[str, float] = {}
    try:
        if evaluator == "osworld":
            t0 = time.perf_counter()
            await pool.hello()
            out["worker_start_s"] = time.perf_counter() - t0
        setup_s, eval_s = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            await runner.setup(task)
            setup_s.append(time.perf_counter() - t0)
            res = await runner.evaluate(task, ["DONE"])
            eval_s.append(res.seconds)
            if (res.status, res.score) != ("ok", 1.0):
                raise SystemExit(f"{evaluator}: scored {res} (want ok, 1.0); nothing timed")
        out["setup_median_s"] = statistics.median(setup_s)
        out["evaluate_median_s"] = statistics.median(eval_s)
        if evaluator == "osworld":
            out["worker_rss_mib"] = rss_mib(pool.worker_pids()[0])
    finally:
        await runner.aclose()
        await pool.aclose()
        await client.close()
        await peer.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    rounds = 3 if args.quick else args.rounds
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        (cache / "calc").mkdir()
        rows = [["name", "qty"], *[[f"item{i}", i] for i in range(200)]]
        write_xlsx(cache / "calc" / "a.xlsx", {"Sheet1": rows})
        write_xlsx(cache / "calc" / "gold.xlsx", {"Sheet1": rows})
        results = {e: asyncio.run(measure(e, cache, rounds)) for e in ("own", "osworld")}
    header = run_header()
    lines = [
        f"# OSWorld evaluation cost, {header['date']}, commit {header['commit']}",
        "",
        f"Machine: {header['machine']}; {rounds} rounds per evaluator; loopback peer.",
        "",
        "| evaluator | setup median s | evaluate median s | worker start s | worker RSS MiB |",
        "|---|---:|---:|---:|---:|",
    ]
    for e, r in results.items():
        start = f"{r['worker_start_s']:.2f}" if "worker_start_s" in r else "-"
        rss = f"{r['worker_rss_mib']:.0f}" if "worker_rss_mib" in r else "-"
        lines.append(
            f"| {e} | {r['setup_median_s']:.3f} | {r['evaluate_median_s']:.3f} | {start} | {rss} |"
        )
    report = "\n".join(lines)
    print(report)
    if not args.quick:
        out = ROOT / "benchmarks" / "results" / f"osworld-eval-{str(header['date'])[:10]}"
        out.with_suffix(".md").write_text(report + "\n")
        out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Marks read from pixels held against the tree: OCR's som table vs the accessibility tree's.

    python benchmarks/ocr_vs_tree.py                       # 7 families x 3 tasks, every screen
    python benchmarks/ocr_vs_tree.py --tasks 1 --families fill_form,menu_pick   # quick look

On the simulated desktop (`arpo_envs.sim`, 1280x720) every screen has a tree, so every
screen has the truth: for each task family, `--tasks` tasks (`generate_tasks(family, n,
seed=--seed)`), each set up and walked along its oracle, every screen on the way (the first
one and the one after each oracle step) is marked twice, as the actor's `observe` marks it:
from the tree (`a11y.marks`, OSWorld's set-of-marks) and from the pixels (`ocr.read_marks`,
`EpisodeConfig.marks_source = "ocr"`). Then (`ocr.match_marks`):

- recall: of the tree's marks with a label (a name or a text), the share some OCR mark
  finds: its text is the label (case and spaces aside, at least 0.8 alike) and a click at
  its centre, where `click(mark=N)` clicks, lands in the element's box;
- precision: of OCR's marks, the share that find a tree mark that way. The rest are text
  the tree has no mark for (the top bar, window titles) or misreadings;
- the cost of each: seconds per screen for the tree's marks (parsing, filtering) and for
  OCR's (one PP-OCRv4 pass), medians, with `--threads` onnxruntime threads.

The labels most often missed and the OCR texts most often extra are listed per family.
Results: benchmarks/results/ocr-vs-tree-<date>.md (`--out` for another folder) with the
machine, commit and load average. Time it alone on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

from _machine import run_header

ROOT = Path(__file__).resolve().parent.parent


def measure(families: list[str], tasks: int, seed: int, cfg) -> dict[str, dict]:
    """Per family: every screen's match of OCR's marks with the tree's, and the timings."""
    from arpo_envs.sim.server import SimConfig, running
    from arpo_envs.sim.tasks import generate_tasks

    from arpo.env import a11y, ocr
    from arpo.env.environment import Environment
    from arpo.env.runner import RunnerConfig
    from arpo.env.task import Task

    ocr.engine(cfg.threads)  # loaded once, outside the timings
    out: dict[str, dict] = {}

    async def go() -> None:
        async with running([SimConfig(port=0)]) as urls:
            env = Environment(0, urls[0], RunnerConfig(reset_before_setup=True))
            try:
                for family in families:
                    rows = out.setdefault(family, {"matches": [], "tree_s": [], "ocr_s": []})
                    for d in generate_tasks(family, tasks, seed=seed):
                        task = Task.from_dict(d, domain="sim")
                        failed = await env.prepare(task)
                        if failed is not None:
                            raise SystemExit(f"{task.id}: {failed.status}: {failed.reason}")
                        for action in [*d["oracle"], None]:
                            png = await env.client.screenshot()
                            xml = await env.client.accessibility()
                            t0 = time.perf_counter()
                            tree = a11y.marks(xml, png)
                            t1 = time.perf_counter()
                            read = ocr.read_marks(png, cfg)
                            t2 = time.perf_counter()
                            rows["matches"].append(ocr.match_marks(tree, read))
                            rows["tree_s"].append(t1 - t0)
                            rows["ocr_s"].append(t2 - t1)
                            if action is not None:
                                r = await env.timed(env.runner.act(action))
                                if r is None or r.returncode != 0:
                                    raise SystemExit(f"{task.id}: oracle step failed: {r}")
                    m = rows["matches"]
                    print(f"{family}: {len(m)} screens, recall "
                          f"{sum(x.found for x in m)}/{sum(x.tree for x in m)}, precision "
                          f"{sum(x.correct for x in m)}/{sum(x.ocr for x in m)}",
                          file=sys.stderr, flush=True)  # fmt: skip
            finally:
                await env.close()

    asyncio.run(go())
    return out


def _top(items: list[str], n: int = 5) -> str:
    common = collections.Counter(items).most_common(n)
    return ", ".join(f"{t!r} x{k}" for t, k in common) or "-"


def report(res: dict, out: dict[str, dict]) -> str:
    lines = [
        f"# OCR's marks against the tree's on the simulated desktop ({res['date']}, "
        f"{res['machine']}, commit {res['commit']})",
        "",
        f"`{res['command']}`; load average before: {res['load']}. {res['note']}",
        "",
        "Every screen of each task's oracle path (1280x720), marked from the tree "
        "(`a11y.marks`) and from the pixels (`ocr.read_marks`, PP-OCRv4 via "
        f"rapidocr-onnxruntime, {res['threads']} onnxruntime threads). A labelled tree mark "
        "is found when an OCR mark's text is its name or text and the OCR mark's centre lies "
        "in its box; an OCR mark is correct when it finds one (`ocr.match_marks`).",
        "",
        "| family | screens | tree marks (labelled) | found | recall | OCR marks | correct | "
        "precision | tree marks per screen (ms) | OCR per screen (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    all_m = []
    tree_s, ocr_s = [], []
    for family, rows in out.items():
        m = rows["matches"]
        all_m += m
        tree_s += rows["tree_s"]
        ocr_s += rows["ocr_s"]
        t, f = sum(x.tree for x in m), sum(x.found for x in m)
        o, c = sum(x.ocr for x in m), sum(x.correct for x in m)
        lines.append(
            f"| {family} | {len(m)} | {t} | {f} | {f / t:.1%} | {o} | {c} | {c / o:.1%} | "
            f"{1000 * statistics.median(rows['tree_s']):.1f} | "
            f"{statistics.median(rows['ocr_s']):.2f} |"
        )
    t, f = sum(x.tree for x in all_m), sum(x.found for x in all_m)
    o, c = sum(x.ocr for x in all_m), sum(x.correct for x in all_m)
    lines.append(
        f"| **all** | {len(all_m)} | {t} | {f} | {f / t:.1%} | {o} | {c} | {c / o:.1%} | "
        f"{1000 * statistics.median(tree_s):.1f} | {statistics.median(ocr_s):.2f} |"
    )
    worst = min(x.recall for x in all_m)
    lines += [
        "",
        f"Lowest recall of one screen: {worst:.1%}. OCR per screen: min "
        f"{min(ocr_s):.2f} s, max {max(ocr_s):.2f} s.",
        "",
        "| family | labels missed (most often) | OCR texts with no tree mark (most often) |",
        "|---|---|---|",
    ]
    for family, rows in out.items():
        m = rows["matches"]
        missed = [s for x in m for s in x.missed]
        extra = [s for x in m for s in x.extra]
        lines.append(f"| {family} | {_top(missed)} | {_top(extra)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    from arpo_envs.sim.tasks import FAMILIES

    from arpo.env.ocr import OcrConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--families", default=",".join(FAMILIES), help="Simulated task families.")
    p.add_argument("--tasks", type=int, default=3, help="Tasks per family.")
    p.add_argument("--seed", type=int, default=0, help="Seed of generate_tasks.")
    p.add_argument("--threads", type=int, default=OcrConfig().threads,
                   help="onnxruntime threads per OCR pass (OcrConfig.threads).")  # fmt: skip
    p.add_argument("--note", default="", help="A sentence for the report (e.g. a shared machine).")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="Results folder.")
    args = p.parse_args()
    families = [f for f in args.families.split(",") if f]
    bad = [f for f in families if f not in FAMILIES]
    if bad or not families:
        p.error(f"--families: {', '.join(bad) or 'none given'}; choose from {', '.join(FAMILIES)}")
    if args.tasks < 1:
        p.error("--tasks must be >= 1")
    cfg = OcrConfig(threads=args.threads)
    load = [round(x, 2) for x in os.getloadavg()]
    out = measure(families, args.tasks, args.seed, cfg)
    header = run_header()
    date = str(header["date"])[:10]
    res = {
        "date": header["date"],
        "machine": f"{header['machine']}, {platform.platform()}",
        "commit": header["commit"],
        "load": load,
        "command": shlex.join(["python", "benchmarks/ocr_vs_tree.py", *sys.argv[1:]]),
        "threads": args.threads,
        "note": args.note,
    }
    text = report(res, out)
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"ocr-vs-tree-{date}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What LibreOffice Calc's accessibility tree costs per step on a local desktop (`--atspi`).

    .venv/bin/python benchmarks/bench_calc_tree.py             # writes benchmarks/results/
    .venv/bin/python benchmarks/bench_calc_tree.py --quick     # 2 rounds, no results file

One desktop server started with the tree (a session bus, the AT-SPI registry, LibreOffice's
GTK 3 plugin) opens a sheet of 100 rows x 20 columns of filled cells in Calc, as a task's
`open_file` step does. Correctness first: the tree must hold Calc's cells in view with the
sheet's text (A1, and the last row and column in view) before anything is timed. Then,
per screen (the sheet at 100 %, then zoomed out to 50 % so that more cells are in view):
GET /accessibility's seconds (median of the rounds, what an actor waits for per step), the
answer's bytes and nodes (all, and Calc's cells), and the linearised table an agent reads
(`arpo.env.a11y.linearize`: rows, characters, seconds). Each screen is read once more on a
second desktop whose node budget (`--a11y-max-nodes`) is below the tree's size, to show the
bound: the answer stops at the budget and costs less.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from _machine import run_header  # noqa: E402
from test_desktop_common import Desk, start_desk, stop_desk_proc  # noqa: E402

from arpo.env import a11y  # noqa: E402

ROWS, COLS = 100, 20
BUDGET = 1_000
"""The second desktop's node budget: below the tree of one Calc window."""


def open_sheet(desk: Desk) -> None:
    assert desk.post("/reset").status == 200
    lines = "\\n".join(",".join(f"r{r}c{c}" for c in range(COLS)) for r in range(ROWS))
    desk.sh(f"printf '{lines}\\n' > ~/sheet.csv")
    a = desk.post("/setup/open_file", {"path": "/home/user/sheet.csv"}, timeout=120)
    assert a.status == 200, a.body


def read(desk: Desk) -> tuple[float, bytes]:
    t0 = time.perf_counter()
    a = desk.get("/accessibility", timeout=120)
    dt = time.perf_counter() - t0
    assert a.status == 200, a.body
    return dt, a.body


def wait_cells(desk: Desk, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        root = ET.fromstring(json.loads(read(desk)[1])["AT"])
        if root.find(".//table-cell") is not None:
            return
        time.sleep(0.5)
    raise AssertionError(f"Calc's cells did not appear in the tree within {timeout} s")


def check(root: ET.Element) -> list[str]:
    """The names of the cells in the tree, after checking their text is the sheet's."""
    cells = {c.get("name", ""): c.text or "" for c in root.iter("table-cell")}
    assert cells.get("A1") == "r0c0", "cell A1 missing or wrong"
    for name, text in cells.items():
        col = ord(name[0]) - 65 if len(name) > 1 and name[1].isdigit() else None
        row = int(name[1:]) - 1 if col is not None else None
        if col is not None and row < ROWS and col < COLS:
            assert text == f"r{row}c{col}", (name, text)
    return list(cells)


def measure(desk: Desk, rounds: int) -> dict:
    times, body = [], b""
    for _ in range(rounds):
        dt, body = read(desk)
        times.append(dt)
    xml = json.loads(body)["AT"]
    root = ET.fromstring(xml)
    t0 = time.perf_counter()
    table = a11y.linearize(xml)
    lin_s = time.perf_counter() - t0
    return {
        "accessibility_s_median": round(statistics.median(times), 3),
        "accessibility_s_min": round(min(times), 3),
        "answer_bytes": len(body),
        "nodes": sum(1 for _ in root.iter()),
        "cells": len(check(root)) if root.find(".//table-cell") is not None else 0,
        "table_rows": len(table.splitlines()) - 1,
        "table_chars": len(table),
        "linearize_s": round(lin_s, 4),
    }


def zoom_out(desk: Desk) -> None:
    """Calc's zoom to 50 % (Ctrl + wheel on the sheet: 100 -> 90 -> 80 -> ... -> 50)."""
    code = (
        "import pyautogui, time; pyautogui.moveTo(600, 400); pyautogui.keyDown('ctrl')\n"
        "for _ in range(5):\n    pyautogui.scroll(-1); time.sleep(0.3)\n"
        "pyautogui.keyUp('ctrl')"
    )
    assert desk.post("/execute", {"command": ["python", "-c", code]}).status == 200
    time.sleep(2)


def run(rounds: int) -> dict:
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-calc-tree-") as tmp:
        for label, args in (("default budget", []), (f"budget {BUDGET}",
                            ["--a11y-max-nodes", str(BUDGET)])):  # fmt: skip
            desk = start_desk(Path(tmp) / label.replace(" ", "-"), "--atspi", *args)
            try:
                open_sheet(desk)
                if not args:
                    wait_cells(desk)
                else:  # the budget is spent before the cells: wait for the window instead
                    time.sleep(8)
                out[f"{label}, 100 %"] = measure(desk, rounds)
                zoom_out(desk)
                out[f"{label}, 50 %"] = measure(desk, rounds)
            finally:
                stop_desk_proc(desk.proc)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="2 rounds, no results file")
    args = p.parse_args()
    results = run(2 if args.quick else args.rounds)
    header = run_header()
    day = str(header["date"])[:10]
    lines = [
        f"# Calc's accessibility tree per step, {day}, commit {header['commit']}",
        "",
        f"`.venv/bin/python benchmarks/bench_calc_tree.py` on {header['machine']}; a local desktop "
        f"with `--atspi` (LibreOffice {_lo_version()}, GTK 3 plugin, 1280x720), a sheet of "
        f"{ROWS} x {COLS} filled cells open in Calc; median of {args.rounds if not args.quick else 2} "
        "reads of GET /accessibility.",
        "",
        "| screen | GET /accessibility s (median, min) | answer bytes | nodes | cells | "
        "table rows | table chars | linearize s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for k, r in results.items():
        lines.append(
            f"| {k} | {r['accessibility_s_median']}, {r['accessibility_s_min']} | "
            f"{r['answer_bytes']:,} | {r['nodes']:,} | {r['cells']} | {r['table_rows']} | "
            f"{r['table_chars']:,} | {r['linearize_s']} |"
        )
    report = "\n".join(lines)
    print(report)
    if not args.quick:
        out = ROOT / "benchmarks" / "results" / f"calc-tree-{day}"
        out.with_suffix(".md").write_text(report + "\n")
        meta = {**header, "rows": ROWS, "cols": COLS}
        out.with_suffix(".json").write_text(json.dumps({**meta, "results": results}, indent=2))


def _lo_version() -> str:
    from arpo_envs.desktop.home import libreoffice_version

    return libreoffice_version()


if __name__ == "__main__":
    main()

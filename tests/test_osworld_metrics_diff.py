"""Differential tests: the project's metrics and OSWorld's own (desktop-env, through the worker)
score the same generated inputs, near-misses included, and must agree.

Families the project implements (values and rules, text files, tables) are scored by both and
compared case by case. For families only OSWorld's package implements here (Word documents,
presentations, JSON, PDF, images, the OS checks) the inputs are generated with known answers
(identical -> 1, near miss -> 0 or below 1) and OSWorld's score through the worker must be that
answer, which shows those families run offline in the evaluator environment.

Known differences, kept on purpose (the project's metric is stricter about what it can read):
none found so far; `DIFFERENCES` lists any with the reason.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from arpo_envs.tasks.xlsx_writer import write_xlsx
from osworld_fixtures.evaluator import LoopThread, needs_evaluator, write_with_evaluator_libs

from arpo.env.metrics import METRICS
from arpo.env.osworld.client import EvaluatorConfig, OSWorldError, OSWorldEvaluator

pytestmark = needs_evaluator

DIFFERENCES: dict[str, str] = {}
"""case name -> why the project's score differs from OSWorld's (none at present)."""


@pytest.fixture(scope="module")
def osworld():
    """Scores `(func, args, options)` with OSWorld's metric; "error" when it raises."""
    lt = LoopThread()
    ev = OSWorldEvaluator(EvaluatorConfig(request_timeout_s=120))

    def score(func: str, args: list[Any], options: dict[str, Any] | None = None) -> Any:
        async def one() -> Any:
            try:
                return await ev.metric(func, args, options or {})
            except OSWorldError as e:
                if e.kind != "eval":
                    raise
                return "error"

        return lt.run(one())

    yield score
    lt.run(ev.aclose())
    lt.close()


def own(func: str, args: list[Any], options: dict[str, Any] | None = None) -> Any:
    try:
        return float(METRICS[func](*args, **(options or {})))
    except Exception:
        return "error"


def assert_agree(osworld, cases: dict[str, tuple[str, list[Any], dict[str, Any], float]]) -> None:
    """Each case: (metric, args, options, the right score); both sides must give it."""
    got = {}
    for name, (func, args, options, want) in cases.items():
        pair = (own(func, args, options), osworld(func, args, options))
        if name in DIFFERENCES:
            continue
        got[name] = pair if pair != (want, want) else "ok"
    assert got == dict.fromkeys(got, "ok"), {k: v for k, v in got.items() if v != "ok"}


# ---- families both implement -----------------------------------------------------------------


def test_values_and_rules(osworld):
    cases = {
        "exact": ("exact_match", ["7", {"expected": "7"}], {}, 1.0),
        "exact-space": ("exact_match", ["7 ", {"expected": "7"}], {}, 0.0),
        "exact-type": ("exact_match", [7, {"expected": "7"}], {}, 0.0),
        "in-list": ("match_in_list", ["b", {"expected": ["a", "b"]}], {}, 1.0),
        "in-list-miss": ("match_in_list", ["B", {"expected": ["a", "b"]}], {}, 0.0),
        "is-in": ("is_in_list", [["x", "y"], {"expected": "y"}], {}, 1.0),
        "is-in-miss": ("is_in_list", [["x", "yy"], {"expected": "y"}], {}, 0.0),
        "incl": (
            "check_include_exclude",
            ["ab cd", {"include": ["ab"], "exclude": ["x"]}],
            {},
            1.0,
        ),
        "incl-excluded": (
            "check_include_exclude",
            ["ab cd x", {"include": ["ab"], "exclude": ["x"]}],
            {},
            0.0,
        ),
        "incl-none": ("check_include_exclude", [None, {"include": ["ab"]}], {}, 0.0),
        "literal": ("literal_match", ["Hello", "Hello"], {}, 1.0),
        "literal-case": ("literal_match", ["Hello", "hello"], {}, 0.0),
        "literal-ignore-case": ("literal_match", ["Hello", "hello"], {"ignore_case": True}, 1.0),
        "literal-list": ("literal_match", [["a", "B"], ["a", "b"]], {"type": "list"}, 0.0),
        "literal-list-ic": (
            "literal_match",
            [["a", "B"], ["a", "b"]],
            {"type": "list", "ignore_case": True},
            1.0,
        ),
    }
    assert_agree(osworld, cases)


def test_text_files(osworld, tmp_path):
    def f(name: str, text: str) -> str:
        p = tmp_path / name
        p.write_text(text)
        return str(p)

    gold = f("gold.txt", "alpha beta\ngamma\n")
    same = f("same.txt", "alpha beta\ngamma\n")
    spaced = f("spaced.txt", "alpha   beta\n\tgamma \n")
    upper = f("upper.txt", "ALPHA beta\ngamma\n")
    near = f("near.txt", "alpha beta\ngamma.\n")
    log = f("log.txt", "INFO start\nWARN disk 91%\nINFO done\n")
    cases = {
        "text-same": ("compare_text_file", [same, gold], {}, 1.0),
        "text-near": ("compare_text_file", [near, gold], {}, 0.0),
        "text-missing": ("compare_text_file", [None, gold], {}, 0.0),
        "text-blanks": ("compare_text_file", [spaced, gold], {"ignore_blanks": True}, 1.0),
        "text-blanks-off": ("compare_text_file", [spaced, gold], {}, 0.0),
        "text-case": ("compare_text_file", [upper, gold], {"ignore_case": True}, 1.0),
        "diff-same": ("diff_text_file", [same, gold], {}, 1.0),
        "diff-half": ("diff_text_file", [near, gold], {}, 0.5),
        "contains": ("file_contains", [log, {"expected": ["start", "done"]}], {}, 1.0),
        "contains-miss": ("file_contains", [log, {"expected": ["start", "stop"]}], {}, 0.0),
        "contains-none": ("file_contains", [None, {"expected": ["start"]}], {}, 0.0),
        "list": (
            "check_list",
            [log, {"expect": [r"WARN disk \d+%"], "unexpect": ["ERROR"]}],
            {},
            1.0,
        ),
        "list-unexpected": (
            "check_list",
            [log, {"expect": ["start"], "unexpect": ["WARN"]}],
            {},
            0.0,
        ),
        "list-missing": ("check_list", [log, {"expect": ["ERROR"]}], {}, 0.0),
    }
    assert_agree(osworld, cases)


TABLE_ROWS = [["name", "qty", "price"], ["apple", 3, 1.25], ["pear", 10, 0.5], ["fig", 0, 2.0]]


def _write_tables(out: Path) -> None:
    near = [r[:] for r in TABLE_ROWS]
    near[2][2] = 0.51  # one cell off
    write_xlsx(out / "gold.xlsx", {"Sheet1": TABLE_ROWS})
    write_xlsx(out / "same_inline.xlsx", {"Sheet1": TABLE_ROWS}, inline=True)
    write_xlsx(out / "near.xlsx", {"Sheet1": near})
    write_xlsx(out / "renamed.xlsx", {"Data": TABLE_ROWS})
    write_xlsx(out / "two.xlsx", {"Sheet1": TABLE_ROWS, "Sheet2": [["x"]]})
    # The same table written by openpyxl, the library OSWorld reads tables with.
    write_with_evaluator_libs(
        "import openpyxl\n"
        f"rows = {TABLE_ROWS!r}\n"
        "wb = openpyxl.Workbook(); ws = wb.active; ws.title = 'Sheet1'\n"
        "for r in rows: ws.append(r)\n"
        "wb.save(OUT / 'openpyxl.xlsx')\n"
        "ws['C3'] = 0.51; wb.save(OUT / 'openpyxl_near.xlsx')\n",
        out,
    )


def test_tables(osworld, tmp_path):
    _write_tables(tmp_path)
    p = {n: str(tmp_path / f"{n}.xlsx") for n in (
        "gold", "same_inline", "near", "renamed", "two", "openpyxl", "openpyxl_near")}  # fmt: skip
    data = {"rules": [{"type": "sheet_data", "sheet_idx0": 0, "sheet_idx1": "EI0"}]}
    names = {"rules": [{"type": "sheet_name"}]}

    def cell(coord: str, method: str, ref: Any) -> dict[str, Any]:
        rule = {"type": "check_cell", "sheet_idx": 0, "coordinate": coord}
        return {"rules": [{**rule, "props": {"value": {"method": method, "ref": ref}}}]}

    cases = {
        "data-same": ("compare_table", [p["same_inline"], p["gold"]], data, 1.0),
        "data-openpyxl": ("compare_table", [p["openpyxl"], p["gold"]], data, 1.0),
        "data-near": ("compare_table", [p["near"], p["gold"]], data, 0.0),
        "data-openpyxl-near": ("compare_table", [p["openpyxl_near"], p["gold"]], data, 0.0),
        "data-renamed-sheet": ("compare_table", [p["renamed"], p["gold"]], data, 1.0),
        "data-missing": ("compare_table", [None, p["gold"]], data, 0.0),
        "names-same": ("compare_table", [p["openpyxl"], p["gold"]], names, 1.0),
        "names-renamed": ("compare_table", [p["renamed"], p["gold"]], names, 0.0),
        "names-extra-sheet": ("compare_table", [p["two"], p["gold"]], names, 0.0),
        "cell-eq": ("compare_table", [p["gold"]], cell("B3", "eq", 10), 1.0),
        "cell-eq-miss": ("compare_table", [p["gold"]], cell("B3", "eq", 11), 0.0),
        "cell-approx": ("compare_table", [p["near"]], cell("C3", "approx:0.02", 0.5), 1.0),
        "cell-approx-miss": ("compare_table", [p["near"]], cell("C3", "approx:0.001", 0.5), 0.0),
        "cell-re": ("compare_table", [p["openpyxl"]], cell("A4", "re", "^fi"), 1.0),
        "cell-re-miss": ("compare_table", [p["openpyxl"]], cell("A4", "re", "^pe"), 0.0),
    }
    assert_agree(osworld, cases)


# ---- families only OSWorld's package implements here: known answers -------------------------

DOCS = """
import docx, pptx, fitz
from PIL import Image, ImageDraw
def word(name, paras):
    d = docx.Document()
    for t in paras: d.add_paragraph(t)
    d.save(OUT / name)
word('gold.docx', ['Quarterly report', 'Revenue grew by 12 percent.'])
word('same.docx', ['Quarterly report', 'Revenue grew by 12 percent.'])
word('near.docx', ['Quarterly report', 'Revenue grew by 13 percent.'])
def slides(name, title):
    p = pptx.Presentation()
    s = p.slides.add_slide(p.slide_layouts[1])
    s.shapes.title.text = title
    s.placeholders[1].text = 'First point'
    p.save(OUT / name)
slides('gold.pptx', 'Roadmap 2025')
slides('same.pptx', 'Roadmap 2025')
slides('near.pptx', 'Roadmap 2026')
def pdf(name, text, pages=1):
    d = fitz.open()
    for _ in range(pages):
        d.new_page().insert_text((72, 72), text)
    d.save(OUT / name)
pdf('gold.pdf', 'The quick brown fox jumps over the lazy dog')
pdf('same.pdf', 'The quick brown fox jumps over the lazy dog')
pdf('near.pdf', 'A slow green turtle naps under the busy log', pages=2)
img = Image.new('RGB', (160, 120), 'white')
d = ImageDraw.Draw(img)
d.rectangle((20, 20, 80, 90), fill='navy'); d.ellipse((90, 30, 150, 100), fill='orange')
img.save(OUT / 'gold.png'); img.save(OUT / 'same.png')
other = Image.new('RGB', (160, 120), 'black')
ImageDraw.Draw(other).line((0, 0, 160, 120), fill='white', width=9)
other.save(OUT / 'near.png')
"""


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("docs")
    write_with_evaluator_libs(DOCS, out)
    return {p.name: str(p) for p in out.iterdir()}


def _osworld_only(osworld, cases: dict[str, tuple[str, list[Any], dict[str, Any], Any]]) -> None:
    got = {}
    for name, (func, args, options, want) in cases.items():
        assert func not in METRICS, f"{func} is the project's too: compare it in assert_agree"
        score = osworld(func, args, options)
        ok = want(score) if callable(want) else score == want
        if not ok:
            got[name] = score
    assert got == {}


def test_documents_presentations_pdf_images(osworld, documents):
    d = documents
    cases = {
        "docx-same": ("compare_docx_files", [d["same.docx"], d["gold.docx"]], {}, 1.0),
        "docx-near": ("compare_docx_files", [d["near.docx"], d["gold.docx"]], {}, 0.0),
        "docx-missing": ("compare_docx_files", [None, d["gold.docx"]], {}, 0.0),
        "pptx-same": ("compare_pptx_files", [d["same.pptx"], d["gold.pptx"]], {}, 1.0),
        "pptx-near": ("compare_pptx_files", [d["near.pptx"], d["gold.pptx"]], {}, 0.0),
        "pdf-same": ("compare_pdfs", [d["same.pdf"], d["gold.pdf"]], {}, 1.0),
        "pdf-near": ("compare_pdfs", [d["near.pdf"], d["gold.pdf"]], {}, lambda s: s < 0.8),
        "img-same": ("compare_images", [d["same.png"], d["gold.png"]], {}, 1.0),
        "img-near": ("compare_images", [d["near.png"], d["gold.png"]], {}, lambda s: s < 0.1),
        "ssim-same": ("check_structure_sim", [d["same.png"], d["gold.png"]], {}, 1.0),
        "ssim-near": ("check_structure_sim", [d["near.png"], d["gold.png"]], {}, 0.0),
    }
    _osworld_only(osworld, cases)


def test_json_and_os_checks(osworld):
    timedatectl = (
        "               Local time: Thu 2024-01-25 12:56:06 {tz}\n"
        "           Universal time: Thu 2024-01-25 12:56:06 UTC\n"
        "                 RTC time: Thu 2024-01-25 12:56:05\n"
        "                Time zone: {zone}\n"
    )
    utc = timedatectl.format(tz="UTC", zone="Etc/UTC (UTC, +0000)")
    cet = timedatectl.format(tz="CET", zone="Europe/Paris (CET, +0100)")
    apps = "['thunderbird.desktop', 'vim.desktop']"
    cases = {
        "json-same": ("check_direct_json_object", ['{"a": 1, "b": "x"}', {"expected": {"a": 1}}], {}, 1.0),
        "json-near": ("check_direct_json_object", ['{"a": 2}', {"expected": {"a": 1}}], {}, 0.0),
        "json-none": ("check_direct_json_object", [None, {"expected": {"a": 1}}], {}, 0.0),
        "utc": ("is_utc_0", [utc], {}, 1.0),
        "utc-near": ("is_utc_0", [cet], {}, 0.0),
        "fav-apps": ("check_gnome_favorite_apps",
                     [apps, {"expected": ["vim.desktop", "thunderbird.desktop"]}], {}, 1.0),
        "fav-apps-near": ("check_gnome_favorite_apps", [apps, {"expected": ["vim.desktop"]}], {}, 0.0),
        "text-enlarged": ("check_text_enlarged", ["1.5\n"], {}, 1.0),
        "text-not-enlarged": ("check_text_enlarged", ["1.0\n"], {}, 0.0),
    }  # fmt: skip
    _osworld_only(osworld, cases)


def test_every_project_metric_is_compared():
    compared = {
        "exact_match", "match_in_list", "is_in_list", "literal_match", "check_include_exclude",
        "file_contains", "compare_text_file", "diff_text_file", "check_list", "compare_table",
    }  # fmt: skip
    assert set(METRICS) - {"infeasible"} == compared


def test_a_metric_that_raises_is_an_error_not_a_zero(osworld):
    # OSWorld's compare_text_file on an expected file that does not exist: it raises.
    assert osworld("compare_text_file", ["/nonexistent/a", "/nonexistent/b"]) == "error"
    assert asyncio.iscoroutinefunction(OSWorldEvaluator.metric)

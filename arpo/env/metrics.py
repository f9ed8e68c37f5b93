"""OSWorld's checker metrics, reimplemented with the standard library.

Each metric is called the way OSWorld's `DesktopEnv.evaluate` calls it: `metric(result,
expected, **options)` when the task has an expected getter, `metric(result, **options)`
otherwise, and returns a score in [0, 1]. `result` and `expected` are what the getters returned
(a local file path, a command's output, a rules dict, ...). A `None` result (e.g. the file the
agent should have saved does not exist) scores 0, as in OSWorld. An exception means the checker
itself could not run; the runner reports it as `eval_error`, never as a score of 0.

Implemented: exact_match, match_in_list, is_in_list, literal_match, check_include_exclude,
file_contains, compare_text_file, diff_text_file, check_list, compare_table (rules
`sheet_name`, `sheet_data`, `check_cell` on cell values) and `infeasible` (scored by the runner).

Deviations from OSWorld, all on `compare_table`:
- `sheet_data` compares cell values numerically (an int 1 equals a float 1.0); pandas'
  `DataFrame.equals` also compares column dtypes. Dates are compared as their stored serial
  numbers (pandas converts cells with date formats to datetimes on both sides).
- `check_cell` reads booleans as True/False (OSWorld's cell reader returns None for them) and
  supports the `value` property only; style properties raise EvalError (need a style reader).
"""

from __future__ import annotations

import difflib
import functools
import operator
import re
import zipfile
from collections.abc import Callable
from typing import Any
from xml.etree import ElementTree as ET

from arpo.env.xlsx import XlsxBook, sheet_rows
from arpo.errors import EvalError

Metric = Callable[..., float]
METRICS: dict[str, Metric] = {}
TABLE_RULES = ("sheet_name", "sheet_data", "check_cell")
"""The `compare_table` rule types implemented here."""
TABLE_CELL_PROPS = ("value",)
"""The `check_cell` properties implemented here."""


def metric(fn: Metric) -> Metric:
    METRICS[fn.__name__] = fn
    return fn


# ---- values and rules ---------------------------------------------------------------------


@metric
def exact_match(result: Any, rules: dict[str, Any]) -> float:
    """1 if the result equals `rules["expected"]`."""
    return float(result == rules["expected"])


@metric
def match_in_list(result: Any, rules: dict[str, Any]) -> float:
    """1 if the result is one of `rules["expected"]`."""
    return float(result in rules["expected"])


@metric
def is_in_list(result: Any, rules: dict[str, Any]) -> float:
    """1 if `rules["expected"]` is an element (or substring) of the result."""
    return float(rules["expected"] in result)


@metric
def literal_match(result: Any, expected: Any, **options: Any) -> float:
    """String (or list of strings) equality, optionally ignoring case."""
    kind = options.get("type", "str")
    ignore_case = options.get("ignore_case", False)

    def norm(x: Any) -> str:
        return str(x).lower() if ignore_case else str(x)

    if kind == "str":
        return float(norm(result) == norm(expected))
    if kind == "list":
        if not isinstance(result, list | tuple) or not isinstance(expected, list | tuple):
            return 0.0
        return float(
            len(result) == len(expected)
            and [norm(x) for x in result] == [norm(x) for x in expected]
        )
    raise EvalError(f"literal_match: unknown type {kind!r}; use 'str' or 'list'")


@metric
def check_include_exclude(result: Any, rules: dict[str, Any]) -> float:
    """1 if every `include` string is in the result and no `exclude` string is."""
    if result is None:
        return 0.0
    include = rules.get("include", [])
    exclude = rules.get("exclude", [])
    return float(all(s in result for s in include) and all(s not in result for s in exclude))


# ---- text files -----------------------------------------------------------------------------


@metric
def file_contains(file_path: str | None, config: dict[str, Any]) -> float:
    """1 if the text file contains every string of `config["expected"]`; 0 if it cannot be read."""
    if not file_path:
        return 0.0
    try:
        with open(file_path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return 0.0
    return float(all(s in text for s in config["expected"]))


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        return f.read()


@metric
def compare_text_file(actual: str | None, expected: str, **options: Any) -> float:
    """1 if the two text files are equal; options `ignore_blanks` (collapse whitespace) and
    `ignore_case`."""
    if not actual:
        return 0.0
    a, e = _read_text(actual), _read_text(expected)
    if options.get("ignore_blanks", False):
        a = re.sub(r"\s+", " ", re.sub(r"[\t\n]", " ", a).strip())
        e = re.sub(r"\s+", " ", re.sub(r"[\t\n]", " ", e).strip())
    if options.get("ignore_case", False):
        a, e = a.lower(), e.lower()
    return float(a == e)


@metric
def diff_text_file(result: str | None, expected: str) -> float:
    """Similarity ratio of the two files' line sequences."""
    if result is None:
        return 0.0
    a = _read_text(result).splitlines()
    e = _read_text(expected).splitlines()
    return difflib.SequenceMatcher(a=a, b=e).ratio()


@metric
def check_list(result: str | None, rules: dict[str, Any]) -> float:
    """1 if every `expect` regex matches some line of the file and no `unexpect` regex matches any."""
    if result is None:
        return 0.0
    expect = [re.compile(p) for p in rules.get("expect", [])]
    unexpect = [re.compile(p) for p in rules.get("unexpect", [])]
    found = [False] * len(expect)
    for line in _read_text(result).splitlines(keepends=True):
        for i, pat in enumerate(expect):
            found[i] = found[i] or pat.search(line) is not None
        if any(p.search(line) for p in unexpect):
            return 0.0
    return float(all(found))


# ---- spreadsheets ---------------------------------------------------------------------------


def match_value_to_rule(value: Any, rule: dict[str, Any]) -> bool:
    """OSWorld's `{"method": ..., "ref": ...}` rule: re[.FLAG...], eq/ne/lt/le/gt/ge,
    approx:<tolerance>, str_list_eq, str_set_eq."""
    method = rule["method"]
    ref = rule.get("ref")
    if method.startswith("re"):
        flags = functools.reduce(
            operator.or_, (getattr(re, f) for f in method.split(".")[1:]), re.RegexFlag(0)
        )
        return re.search(ref, "" if value is None else str(value), flags) is not None
    if method in ("eq", "ne", "le", "lt", "ge", "gt"):
        try:
            return bool(getattr(operator, method)(value, ref))
        except TypeError:
            return False
    if method.startswith("approx"):
        tol = float(method.split(":")[1])
        try:
            return abs(float(value) - float(ref)) <= tol
        except (TypeError, ValueError):
            return False
    if method == "str_list_eq":
        return isinstance(value, str) and value.split(",") == ref
    if method == "str_set_eq":
        return isinstance(value, str) and set(value.split(",")) == set(ref)
    raise EvalError(f"unknown rule method {method!r}")


def _resolve_sheet(
    idx: int | str, result: XlsxBook, expected: XlsxBook | None
) -> tuple[XlsxBook | None, str]:
    """OSWorld's sheet index: int or "RI<n>" (result, by position), "RN<name>" (result, by
    name), "EI<n>" / "EN<name>" (expected). An out-of-range position gives the name ""."""

    def by_pos(book: XlsxBook | None, pos: str | int) -> str:
        try:
            return book.sheet_names[int(pos)] if book is not None else ""
        except (IndexError, ValueError):
            return ""

    if isinstance(idx, int):
        return result, by_pos(result, idx)
    if idx.startswith("RI"):
        return result, by_pos(result, idx[2:])
    if idx.startswith("RN"):
        return result, idx[2:]
    if idx.startswith("EI"):
        return expected, by_pos(expected, idx[2:])
    if idx.startswith("EN"):
        return expected, idx[2:]
    raise EvalError(f"compare_table: unrecognised sheet index {idx!r}")


def _sheet_table(book: XlsxBook | None, name: str) -> list[list[Any]] | None:
    if book is None or name not in book.sheet_names:
        return None
    return sheet_rows(book.cells(name))


def _round_cell(v: Any, digits: int) -> Any:
    if isinstance(v, float):
        return round(v, digits)
    return v


@metric
def compare_table(result: str | None, expected: str | None = None, **options: Any) -> float:
    """Compare a result .xlsx against an expected one by a list of `rules` (all must pass)."""
    if result is None:
        return 0.0
    try:
        rbook = XlsxBook(result)
    except (OSError, zipfile.BadZipFile, KeyError, ET.ParseError):
        return 0.0  # missing or not an xlsx (e.g. saved in another format): the agent's failure
    ebook = XlsxBook(expected) if expected is not None else None
    for rule in options.get("rules", []):
        kind = rule["type"]
        if kind == "sheet_name":
            ok = ebook is not None and rbook.sheet_names == ebook.sheet_names
        elif kind == "sheet_data":
            digits = int(rule.get("precision", 4))
            t0 = _sheet_table(*_resolve_sheet(rule["sheet_idx0"], rbook, ebook))
            if t0 is None:
                return 0.0
            t1 = _sheet_table(*_resolve_sheet(rule["sheet_idx1"], rbook, ebook))
            if t1 is None:
                return 0.0
            ok = [[_round_cell(v, digits) for v in row] for row in t0] == [
                [_round_cell(v, digits) for v in row] for row in t1
            ]
        elif kind == "check_cell":
            book, name = _resolve_sheet(rule["sheet_idx"], rbook, ebook)
            if book is None or name not in book.sheet_names:
                return 0.0
            ok = True
            for prop, prop_rule in rule["props"].items():
                if prop != "value":
                    raise EvalError(
                        f"compare_table check_cell: cell property {prop!r} is not supported "
                        "(only 'value'); styles need a style reader"
                    )
                ok = ok and match_value_to_rule(book.cell(name, rule["coordinate"]), prop_rule)
        else:
            raise EvalError(
                f"compare_table: rule type {kind!r} is not supported (supported: sheet_name, "
                "sheet_data, check_cell)"
            )
        if not ok:
            return 0.0
    return 1.0


@metric
def infeasible(*args: Any, **kwargs: Any) -> float:
    """Placeholder: an infeasible task is scored by the runner from the last action (FAIL)."""
    raise EvalError(
        "infeasible is scored by the runner from the last action, not called as a metric"
    )

"""Checker metrics against hand-made inputs, the stdlib xlsx reader, and how the runner combines
metrics (conj and/or, infeasible, errors -> eval_error, never a score of 0)."""

from __future__ import annotations

import asyncio

import pytest
from arpo_envs.tasks.xlsx_writer import write_xlsx

from arpo.env.client import ClientConfig, EnvClient
from arpo.env.metrics import (
    METRICS,
    check_include_exclude,
    check_list,
    compare_table,
    compare_text_file,
    diff_text_file,
    exact_match,
    file_contains,
    is_in_list,
    literal_match,
    match_in_list,
    match_value_to_rule,
)
from arpo.env.runner import RunnerConfig, TaskRunner
from arpo.env.task import Task
from arpo.env.xlsx import XlsxBook, split_coordinate
from arpo.errors import EvalError

# ---- simple metrics ---------------------------------------------------------------------------


def test_exact_match_and_lists():
    assert exact_match("a", {"expected": "a"}) == 1.0
    assert exact_match("a ", {"expected": "a"}) == 0.0
    assert exact_match([1, 2], {"expected": [1, 2]}) == 1.0
    assert match_in_list("Bing", {"expected": ["Microsoft Bing", "Bing"]}) == 1.0
    assert match_in_list("Google", {"expected": ["Microsoft Bing", "Bing"]}) == 0.0
    assert is_in_list(["a", "b"], {"expected": "b"}) == 1.0
    assert literal_match("ABC", "abc", ignore_case=True) == 1.0
    assert literal_match(["a"], ["a", "b"], type="list") == 0.0
    with pytest.raises(EvalError):
        literal_match("a", "a", type="dict")


def test_check_include_exclude():
    rules = {"include": ["timedatectl", "UTC"], "exclude": ["error"]}
    assert check_include_exclude("timedatectl: zone UTC", rules) == 1.0
    assert check_include_exclude("timedatectl: zone CET", rules) == 0.0
    assert check_include_exclude("timedatectl UTC error", rules) == 0.0
    assert check_include_exclude(None, rules) == 0.0
    assert check_include_exclude("anything", {}) == 1.0


def test_file_contains_has_osworld_semantics(tmp_path):
    f = tmp_path / "report.txt"
    f.write_text("CPU %user %nice\n%system %idle\n")
    assert file_contains(str(f), {"expected": ["CPU", "%idle"]}) == 1.0
    assert file_contains(str(f), {"expected": ["CPU", "%steal"]}) == 0.0
    assert file_contains(None, {"expected": ["CPU"]}) == 0.0
    assert file_contains(str(tmp_path / "absent.txt"), {"expected": ["CPU"]}) == 0.0


def test_compare_text_file_options(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("Hello  World\n\tagain\n")
    b.write_text("hello world again")
    assert compare_text_file(str(a), str(b)) == 0.0
    assert compare_text_file(str(a), str(b), ignore_blanks=True) == 0.0
    assert compare_text_file(str(a), str(b), ignore_blanks=True, ignore_case=True) == 1.0
    assert compare_text_file(None, str(b)) == 0.0
    b.write_text("Hello  World\n\tagain\n")
    assert compare_text_file(str(a), str(b)) == 1.0
    b.write_text("Hello  World\n")
    assert diff_text_file(str(a), str(b)) == pytest.approx(2 / 3)


def test_check_list_regexes(tmp_path):
    f = tmp_path / "apt.out"
    f.write_text("openjdk-17-jre/stable\nvim/stable\n")
    assert check_list(str(f), {"expect": [r"openjdk-\d+-(jre|jdk)"]}) == 1.0
    assert check_list(str(f), {"expect": [r"openjdk"], "unexpect": [r"^vim"]}) == 0.0
    assert check_list(None, {"expect": []}) == 0.0


def test_rule_methods():
    assert match_value_to_rule(3.04, {"method": "approx:0.1", "ref": 3})
    assert not match_value_to_rule("x", {"method": "approx:0.1", "ref": 3})
    assert match_value_to_rule("Total: 12", {"method": "re", "ref": r"\d+"})
    assert match_value_to_rule("TOTAL", {"method": "re.I", "ref": "total"})
    assert match_value_to_rule(5, {"method": "ge", "ref": 5})
    assert not match_value_to_rule("5", {"method": "lt", "ref": 7})  # str vs int: False, no crash
    assert match_value_to_rule("a,b", {"method": "str_set_eq", "ref": ["b", "a"]})
    with pytest.raises(EvalError, match="unknown rule method"):
        match_value_to_rule(1, {"method": "nearly", "ref": 1})


# ---- xlsx and compare_table -------------------------------------------------------------------


def test_xlsx_reader_reads_shared_inline_numbers_bools_formulas(tmp_path):
    rows = [["Name", "Score", "Pass"], ["ann", 3, True], ["bob", 2.5, ("=B3>3", "FALSE")]]
    for inline in (False, True):
        book = XlsxBook(
            write_xlsx(tmp_path / f"b{inline}.xlsx", {"S1": rows, "Other": [[1]]}, inline=inline)
        )
        assert book.sheet_names == ["S1", "Other"]
        assert book.cell("S1", "A1") == "Name"
        assert book.cell("S1", "B2") == 3 and isinstance(book.cell("S1", "B2"), int)
        assert book.cell("S1", "B3") == 2.5
        assert book.cell("S1", "C2") is True
        assert book.cell("S1", "C3") == "FALSE"
        assert book.cell("S1", "Z9") is None
        assert book.cell("Other", "$A$1") == 1
    assert split_coordinate("AB12") == (12, 28)
    with pytest.raises(KeyError, match="no sheet"):
        book.cells("Nope")


def _table(tmp_path, name, sheets):
    return str(write_xlsx(tmp_path / name, sheets))


def test_compare_table_sheet_data(tmp_path):
    data = [["Item", "Qty"], ["a", 1], [None, None], ["b", 2.00001]]
    gold = _table(tmp_path, "gold.xlsx", {"Sheet1": [["Item", "Qty"], ["a", 1.0], ["b", 2.0]]})
    same = _table(tmp_path, "same.xlsx", {"Sheet1": data})
    rule = {"rules": [{"type": "sheet_data", "sheet_idx0": 0, "sheet_idx1": "EI0"}]}
    # Blank rows are dropped and numbers compared after rounding to 4 digits, as pandas does.
    assert compare_table(same, gold, **rule) == 1.0
    strict = {
        "rules": [{"type": "sheet_data", "sheet_idx0": 0, "sheet_idx1": "EI0", "precision": 6}]
    }
    assert compare_table(same, gold, **strict) == 0.0
    wrong = _table(tmp_path, "wrong.xlsx", {"Sheet1": [["Item", "Qty"], ["a", 1], ["b", 3]]})
    assert compare_table(wrong, gold, **rule) == 0.0
    extra_col = _table(
        tmp_path, "x.xlsx", {"Sheet1": [["Item", "Qty", None, "note"], ["a", 1], ["b", 2]]}
    )
    assert compare_table(extra_col, gold, **rule) == 0.0
    by_name = {
        "rules": [{"type": "sheet_data", "sheet_idx0": "RNSheet1", "sheet_idx1": "ENSheet1"}]
    }
    assert compare_table(same, gold, **by_name) == 1.0
    missing_sheet = {"rules": [{"type": "sheet_data", "sheet_idx0": "RNNope", "sheet_idx1": "EI0"}]}
    assert compare_table(same, gold, **missing_sheet) == 0.0


def test_compare_table_missing_or_broken_result_scores_zero(tmp_path):
    gold = _table(tmp_path, "gold.xlsx", {"Sheet1": [[1]]})
    rule = {"rules": [{"type": "sheet_data", "sheet_idx0": 0, "sheet_idx1": "EI0"}]}
    assert compare_table(None, gold, **rule) == 0.0
    assert compare_table(str(tmp_path / "absent.xlsx"), gold, **rule) == 0.0
    (tmp_path / "text.xlsx").write_text("not a zip")
    assert compare_table(str(tmp_path / "text.xlsx"), gold, **rule) == 0.0


def test_compare_table_check_cell_and_sheet_name(tmp_path):
    result = _table(tmp_path, "r.xlsx", {"Sheet1": [["Total", 10.04]], "Sheet2": [["x"]]})
    gold = _table(tmp_path, "g.xlsx", {"Sheet1": [[1]], "Sheet2": [[2]]})
    approx = {
        "type": "check_cell",
        "sheet_idx": 0,
        "coordinate": "B1",
        "props": {"value": {"method": "approx:0.1", "ref": 10}},
    }
    eq = {
        "type": "check_cell",
        "sheet_idx": "RNSheet1",
        "coordinate": "A1",
        "props": {"value": {"method": "eq", "ref": "Total"}},
    }
    assert compare_table(result, rules=[approx, eq]) == 1.0
    bad = {**eq, "props": {"value": {"method": "eq", "ref": "Sum"}}}
    assert compare_table(result, rules=[approx, bad]) == 0.0
    assert compare_table(result, gold, rules=[{"type": "sheet_name"}]) == 1.0
    other = _table(tmp_path, "o.xlsx", {"Data": [[1]]})
    assert compare_table(other, gold, rules=[{"type": "sheet_name"}]) == 0.0
    style = {**eq, "props": {"font_bold": {"method": "eq", "ref": True}}}
    with pytest.raises(EvalError, match="font_bold"):
        compare_table(result, rules=[style])
    with pytest.raises(EvalError, match="pivot_table"):
        compare_table(result, gold, rules=[{"type": "pivot_table"}])


# ---- combining metrics in the runner ----------------------------------------------------------


def _rule(v):
    return {"type": "rule", "rules": v}


def _eval(evaluator, actions=("DONE",)):
    task = Task.from_dict({"id": "t", "instruction": "x", "evaluator": evaluator})

    async def main():
        # Rule getters never touch the environment: the client points at nothing.
        async with EnvClient(ClientConfig(base_url="http://127.0.0.1:9", max_retries=0)) as c:
            runner = TaskRunner(c, RunnerConfig(evaluator="own"))
            try:
                return await runner.evaluate(task, list(actions))
            finally:
                runner.close()

    return asyncio.run(main())


def _two(conj, first, second):
    return {
        "func": ["exact_match", "exact_match"],
        "conj": conj,
        "result": [_rule(first), _rule(second)],
        "expected": [_rule({"expected": 1}), _rule({"expected": 1})],
    }


def test_conj_and_is_mean_and_short_circuits_on_zero():
    r = _eval(_two("and", 1, 1))
    assert (r.score, r.status, r.metric_scores) == (1.0, "ok", (1.0, 1.0))
    r = _eval(_two("and", 0, 1))
    assert (r.score, r.status, r.metric_scores) == (0.0, "ok", (0.0, None))
    r = _eval(
        {
            "func": ["diff_text_file", "exact_match"],
            "result": [{"type": "rule", "rules": None}, _rule(1)],
            "expected": [None, _rule({"expected": 1})],
        }
    )
    assert r.status == "eval_error"  # diff_text_file(None) needs an expected file


def test_conj_or_is_max_and_short_circuits_on_one():
    r = _eval(_two("or", 0, 1))
    assert (r.score, r.metric_scores) == (1.0, (0.0, 1.0))
    r = _eval(_two("or", 1, 0))
    assert (r.score, r.metric_scores) == (1.0, (1.0, None))
    r = _eval(_two("or", 0, 0))
    assert (r.score, r.status) == (0.0, "ok")


def test_infeasible_scores_one_only_when_the_last_action_is_fail():
    ev = {"func": "infeasible"}
    assert _eval(ev, ["pyautogui.click(1, 1)", "FAIL"]).score == 1.0
    assert _eval(ev, ["FAIL", "DONE"]).score == 0.0
    assert _eval(ev, []).score == 0.0
    # A feasible task the agent gave up on scores 0 without running its metrics.
    r = _eval(_two("and", 1, 1), ["FAIL"])
    assert (r.score, r.status, r.metric_scores) == (0.0, "ok", (None, None))


def test_exception_in_getter_or_metric_is_eval_error_not_zero():
    r = _eval(
        {
            "func": "exact_match",
            "result": {"type": "cache_file", "path": "nope.out"},
            "expected": _rule({"expected": 1}),
        }
    )
    assert (r.status, r.score) == ("eval_error", 0.0)
    assert "nope.out" in r.error
    r = _eval({"func": "exact_match", "result": _rule(1), "expected": _rule({"wrong_key": 1})})
    assert r.status == "eval_error" and "KeyError" in r.error
    r = _eval({"func": "compare_pptx_files", "result": _rule(1)})
    assert r.status == "eval_error" and "compare_pptx_files" in r.error
    r = _eval(
        {
            "func": "exact_match",
            "result": {"type": "open_tabs_info"},
            "expected": _rule({"expected": 1}),
        }
    )
    assert r.status == "eval_error" and "open_tabs_info" in r.error


def test_every_registered_metric_is_exercised():
    tested = {
        "exact_match", "match_in_list", "is_in_list", "literal_match", "check_include_exclude",
        "file_contains", "compare_text_file", "diff_text_file", "check_list", "compare_table",
        "infeasible",
    }  # fmt: skip
    assert set(METRICS) == tested

"""The generated Markdown reports write the values of task files (ids, domains, pools) and of
environments (reasons) as inert text, one cell each: a real `arpo audit-tasks` on simulated
desktops over tasks whose ids, domains and pools hold `|`, newlines, HTML tags and Markdown
links, then `arpo train`'s `preflight.md` of the same findings, `arpo eval`'s tables, train's
final tables and the evaluator coverage table. Every row stays one row of the header's
cells, and no raw `<` or `](` reaches a viewer."""

from __future__ import annotations

import json
import re
from pathlib import Path

from arpo_envs.sim.tasks import generate_tasks

from arpo import cli
from arpo.markdown import md_cell
from arpo.pool.audit import TaskAudit

HOSTILE_IDS = [
    "a|b",
    "<img/src=x/onerror=alert(1)>",
    "[x](javascript:alert(1))",
    "`code`*em*_u_~~s~~",
    "back\\slash|",
    "&lt;entity&gt;",
]
HOSTILE_DOMAINS = [
    "d\n| injected | row | a | b | c | d | e | f | g |",
    "<script>alert(1)</script>",
    "[d](https://evil.example)",
    "x\r\ny\u2028z",
    "![i](http://x/i.png)",
    "plain",
]
HOSTILE_POOL = '<b onmouseover="x">p</b>|[q](javascript:1)\nrow'


def _cells(line: str) -> list[str]:
    """The cells of a table row: split at the pipes no backslash escapes."""
    return re.split(r"(?<!\\)((?:\\\\)*)\|", line)[::2][1:-1]


def assert_inert(md: str, values: list[str], header: str) -> list[str]:
    """The table under `header` keeps one row per value, each with the header's cells; no
    line of the text holds a raw tag or link. Returns the table's value rows."""
    lines = md.splitlines()
    start = lines.index(header)
    width = len(_cells(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        assert len(_cells(line)) == width, line
        rows.append(line)
    for line in lines:
        assert "<" not in line or line.startswith("```"), line
        assert "](" not in line, line
    for v in values:
        assert sum(md_cell(v) in r for r in rows) >= 1, (v, md_cell(v))
    return rows


def hostile_tasks(tmp_path: Path) -> Path:
    tasks = generate_tasks("click_button", len(HOSTILE_IDS), seed=4)
    for t, tid, dom in zip(tasks, HOSTILE_IDS, HOSTILE_DOMAINS, strict=True):
        t["id"], t["domain"] = tid, dom
    tasks[-1]["pool"] = HOSTILE_POOL  # nobody serves it: left out, with the pool in its reason
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps(tasks))
    return path


def test_md_cell_makes_any_value_one_inert_line() -> None:
    assert md_cell("a|b") == "a\\|b"
    assert md_cell("<img src=x onerror=alert(1)>") == "&lt;img src=x onerror=alert\\(1\\)&gt;"
    assert md_cell("[l](javascript:x)") == "\\[l\\]\\(javascript:x\\)"
    assert md_cell("a\nb\r\nc\u2028d\te\x00f") == "a b c d e f"
    assert md_cell("\\|") == "\\\\\\|"
    assert md_cell("x" * 10, 6) == "xxx..."
    assert md_cell("<<<<", 3) == "..."


def test_the_audit_and_preflight_reports_keep_hostile_values_in_their_cells(
    tmp_path: Path,
) -> None:
    from arpo.train import preflight_markdown

    out = tmp_path / "report" / "audit"
    args = ["audit-tasks", f"tasks={hostile_tasks(tmp_path)}", f"out={out}", "sim_envs=1",
            "strict=false", "checks=false"]  # fmt: skip
    assert cli.main(args) == 0
    report = json.loads(out.with_name("audit.json").read_text())
    assert [t["task_id"] for t in report["tasks"]] == HOSTILE_IDS
    assert [t["domain"] for t in report["tasks"]] == HOSTILE_DOMAINS
    md = out.with_name("audit.md").read_text()
    header = (
        "| task | domain | pool | setup | setup s | do-nothing | oracle | s | verdict | reason |"
    )
    rows = assert_inert(md, [*HOSTILE_IDS, *HOSTILE_DOMAINS, HOSTILE_POOL], header)
    assert len(rows) == len(HOSTILE_IDS)
    assert sum(r.split(" | ")[-2] == "ok" for r in rows) == len(HOSTILE_IDS) - 1

    audits = [TaskAudit(**t) for t in report["tasks"]]
    md = preflight_markdown(audits, 1.5)
    rows = assert_inert(md, [*HOSTILE_IDS, HOSTILE_POOL], "| task | pool | setup s | reason |")
    assert len(rows) == len(HOSTILE_IDS)


def test_eval_train_and_coverage_tables_keep_hostile_values_in_their_cells() -> None:
    from arpo.env.coverage import report as coverage_report
    from arpo.pool.evaluate import format_markdown
    from arpo.train import comparison, tasks_out_table

    row = {"runs": 2, "successes": 1, "success_rate": 0.5, "mean_score": 0.5,
           "mean_reward": 0.5, "mean_steps": 3.0, "env_errors": 0, "unknown": 0}  # fmt: skip
    result = {
        "policy": {"model": "m"},
        "sampling": {"temperature": 1.0, "top_p": 1.0},
        "overall": {"successes": 1, "episodes": 2, "tasks": 1, "success_rate_episodes": 0.5,
                    "success_rate_tasks": 0.5, "env_errors": 0, "unknown": 0},
        "runs_per_task": 2,
        "success_score": 1.0,
        "domains": {d: {**row, "tasks": 1} for d in HOSTILE_DOMAINS},
        "tasks": {t: {**row, "domain": d} for t, d in zip(HOSTILE_IDS, HOSTILE_DOMAINS, strict=True)},
    }  # fmt: skip
    md = format_markdown(result)
    head = ("runs | successes | success rate | mean score | mean reward | mean steps | "
            "env errors | unknown |")  # fmt: skip
    assert len(assert_inert(md, HOSTILE_DOMAINS, f"| domain | tasks | {head}")) == 6
    assert len(assert_inert(md, HOSTILE_IDS, f"| task | domain | {head}")) == 6

    by_task = {t: {"successes": 1, "runs": 2} for t in HOSTILE_IDS}
    ev = {"success_rate": 0.5, "se": 0.1, "episodes": 12, "by_task": by_task}
    out = {"eval_warm_start": ev, "eval_trained": ev, "prefill": {"successes": {}}}
    md = comparison(out)
    header = "| task | start | trained | change | replay pre-fill |"
    assert len(assert_inert(md, HOSTILE_IDS, header)) == 6

    md = tasks_out_table(
        {t: {"reason": d} for t, d in zip(HOSTILE_IDS, HOSTILE_DOMAINS, strict=True)}
    )
    header = "| task | failures | envs | dropped | reason |"
    assert len(assert_inert(md, HOSTILE_IDS + HOSTILE_DOMAINS, header)) == 6

    md = coverage_report({d: (1, 2) for d in HOSTILE_DOMAINS})
    assert len(assert_inert(md, HOSTILE_DOMAINS, "| domain | supported | tasks |")) == 7

"""Values written into the generated Markdown reports, escaped so they stay text in one cell.

    f"| {md_cell(task_id)} | {md_cell(domain)} | {md_cell(reason, 300)} |"

Task ids, domains, pools and reasons come from task files and environments, not from this
project: an id holding `|` would split its row, a newline would end it and start rows of its
own, and `<img src=x onerror=...>` or `[x](javascript:...)` would reach a Markdown viewer as
a tag or a link. `md_cell` makes any value one line of inert text: every report that writes
such values into a Markdown file (`arpo audit-tasks`, `arpo eval`, `arpo train`'s
`preflight.md` and final tables, the evaluator coverage table) writes them through it.
"""

from __future__ import annotations

from typing import Any

_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}
"""HTML-escaped: no tag, no entity of the value's own survives."""
_ESCAPED = frozenset("\\`*_[]()|#!~")
"""Backslash-escaped: code spans, emphasis, links and images, table cells, headings,
strikethrough (every one an ASCII punctuation character, which CommonMark lets a backslash
escape)."""


def md_cell(value: Any, limit: int | None = None) -> str:
    """`value` as text for one cell of a Markdown table (or any inline Markdown): whitespace
    runs, line breaks and control characters become one space, `& < > "` HTML entities, the
    characters Markdown reads as syntax are backslash-escaped. With `limit`, the text is cut
    to that many characters (ending in "...") before it is escaped, so no escape is cut."""
    text = " ".join("".join(c if c.isprintable() else " " for c in str(value)).split())
    if limit is not None and len(text) > limit:
        text = text[: max(0, limit - 3)] + "..."
    out = []
    for c in text:
        if c in _ENTITIES:
            out.append(_ENTITIES[c])
        elif c in _ESCAPED:
            out.append("\\" + c)
        else:
            out.append(c)
    return "".join(out)

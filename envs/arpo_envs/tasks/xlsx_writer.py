"""A small stdlib writer of .xlsx workbooks: the local task suite's input and gold sheets.

Writes what LibreOffice Calc opens and what `arpo.env.xlsx` reads back: one worksheet per
sheet, text as shared strings (as Calc writes them), numbers, booleans, and formulas with their
cached values. The output is byte-for-byte reproducible (fixed zip timestamps), so regenerating
the suite does not change files that did not change.

    write_xlsx("sales.xlsx", {"Sheet1": [["Item", "Price"], ["Apple", 1.5]]})
    write_xlsx("totals.xlsx", {"Sheet1": [["Total", ("=SUM(B2:B6)", 12.5)]]})
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape, quoteattr

_NS = "http://schemas.openxmlformats.org/spreadsheetml/2006/main"
_R = "http://schemas.openxmlformats.org/officeDocument/2006/relationships"
_PKG = "http://schemas.openxmlformats.org/package/2006"
_XML = '<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n'
_EPOCH = (2024, 1, 1, 0, 0, 0)

Cell = str | int | float | bool | tuple[str, Any] | None
"""A cell: a value, None (empty) or a formula `("=SUM(A1:A3)", cached value)`."""


def col_letter(col: int) -> str:
    """1 -> "A", 27 -> "AA"."""
    out = ""
    while col:
        col, rem = divmod(col - 1, 26)
        out = chr(65 + rem) + out
    return out


def write_xlsx(
    path: str | Path, sheets: dict[str, list[list[Cell]]], *, inline: bool = False
) -> Path:
    """Write `sheets` (name -> rows of cells, row 1 first) to `path`; returns the path.
    `inline`: text in the cells themselves (inline strings, as some other writers store
    it) rather than in the shared string table."""
    if not sheets:
        raise ValueError("write_xlsx needs at least one sheet")
    shared: list[str] = []
    index: dict[str, int] = {}

    def string_ref(s: str) -> int:
        if s not in index:
            index[s] = len(shared)
            shared.append(s)
        return index[s]

    def cell_xml(ref: str, v: Cell) -> str:
        if v is None:
            return ""
        if isinstance(v, tuple):
            formula, cached = v
            f = f"<f>{escape(formula.removeprefix('='))}</f>"
            if isinstance(cached, str):
                return f'<c r="{ref}" t="str">{f}<v>{escape(cached)}</v></c>'
            return f'<c r="{ref}">{f}<v>{cached!r}</v></c>'
        if isinstance(v, bool):
            return f'<c r="{ref}" t="b"><v>{int(v)}</v></c>'
        if isinstance(v, int | float):
            return f'<c r="{ref}"><v>{v!r}</v></c>'
        if inline:
            return f'<c r="{ref}" t="inlineStr"><is><t>{escape(v)}</t></is></c>'
        return f'<c r="{ref}" t="s"><v>{string_ref(v)}</v></c>'

    worksheets = []
    for rows in sheets.values():
        body = []
        for r, row in enumerate(rows, start=1):
            cells = "".join(cell_xml(f"{col_letter(c)}{r}", v) for c, v in enumerate(row, start=1))
            if cells:
                body.append(f'<row r="{r}">{cells}</row>')
        worksheets.append(
            f'{_XML}<worksheet xmlns="{_NS}"><sheetData>{"".join(body)}</sheetData></worksheet>'
        )
    n = len(sheets)
    workbook = (
        f'{_XML}<workbook xmlns="{_NS}" xmlns:r="{_R}"><sheets>'
        + "".join(
            f'<sheet name={quoteattr(name)} sheetId="{i + 1}" r:id="rId{i + 1}"/>'
            for i, name in enumerate(sheets)
        )
        + "</sheets></workbook>"
    )
    wb_rels = (
        f'{_XML}<Relationships xmlns="{_PKG}/relationships">'
        + "".join(
            f'<Relationship Id="rId{i + 1}" Type="{_R}/worksheet" Target="worksheets/sheet{i + 1}.xml"/>'
            for i in range(n)
        )
        + f'<Relationship Id="rId{n + 1}" Type="{_R}/sharedStrings" Target="sharedStrings.xml"/>'
        + "</Relationships>"
    )
    root_rels = (
        f'{_XML}<Relationships xmlns="{_PKG}/relationships">'
        f'<Relationship Id="rId1" Type="{_R}/officeDocument" Target="xl/workbook.xml"/>'
        "</Relationships>"
    )
    ct = "application/vnd.openxmlformats-officedocument.spreadsheetml"
    content_types = (
        f'{_XML}<Types xmlns="{_PKG}/content-types">'
        '<Default Extension="rels" ContentType="application/vnd.openxmlformats-package.relationships+xml"/>'
        '<Default Extension="xml" ContentType="application/xml"/>'
        f'<Override PartName="/xl/workbook.xml" ContentType="{ct}.sheet.main+xml"/>'
        + "".join(
            f'<Override PartName="/xl/worksheets/sheet{i + 1}.xml" ContentType="{ct}.worksheet+xml"/>'
            for i in range(n)
        )
        + f'<Override PartName="/xl/sharedStrings.xml" ContentType="{ct}.sharedStrings+xml"/>'
        + "</Types>"
    )
    sst = (
        f'{_XML}<sst xmlns="{_NS}" count="{len(shared)}" uniqueCount="{len(shared)}">'
        + "".join(f'<si><t xml:space="preserve">{escape(s)}</t></si>' for s in shared)
        + "</sst>"
    )
    parts = [
        ("[Content_Types].xml", content_types),
        ("_rels/.rels", root_rels),
        ("xl/workbook.xml", workbook),
        ("xl/_rels/workbook.xml.rels", wb_rels),
        *((f"xl/worksheets/sheet{i + 1}.xml", xml) for i, xml in enumerate(worksheets)),
        ("xl/sharedStrings.xml", sst),
    ]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in parts:
            info = zipfile.ZipInfo(name, date_time=_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, text)
    return path

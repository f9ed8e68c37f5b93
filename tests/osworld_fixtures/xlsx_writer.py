"""Write minimal but valid .xlsx files for the tests (no spreadsheet library is installed).

Strings go to the shared string table (as LibreOffice writes them) unless `inline=True`;
numbers, booleans and `("=FORMULA", cached)` formula cells are supported.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

_NS = "http://schemas.openxmlformats.org/spreadsheetml/2006/main"
_R = "http://schemas.openxmlformats.org/officeDocument/2006/relationships"


def col_letter(col: int) -> str:
    out = ""
    while col:
        col, rem = divmod(col - 1, 26)
        out = chr(65 + rem) + out
    return out


def write_xlsx(
    path: str | Path, sheets: dict[str, list[list[Any]]], *, inline: bool = False
) -> Path:
    shared: list[str] = []
    index: dict[str, int] = {}

    def cell_xml(ref: str, v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, tuple):  # (formula, cached value)
            formula, cached = v
            f = f"<f>{escape(formula.lstrip('='))}</f>"
            if isinstance(cached, str):
                return f'<c r="{ref}" t="str">{f}<v>{escape(cached)}</v></c>'
            return f'<c r="{ref}">{f}<v>{cached}</v></c>'
        if isinstance(v, bool):
            return f'<c r="{ref}" t="b"><v>{int(v)}</v></c>'
        if isinstance(v, int | float):
            return f'<c r="{ref}"><v>{v!r}</v></c>'
        if inline:
            return f'<c r="{ref}" t="inlineStr"><is><t>{escape(v)}</t></is></c>'
        if v not in index:
            index[v] = len(shared)
            shared.append(v)
        return f'<c r="{ref}" t="s"><v>{index[v]}</v></c>'

    sheet_xml = []
    for rows in sheets.values():
        body = []
        for r, row in enumerate(rows, start=1):
            cells = "".join(cell_xml(f"{col_letter(c)}{r}", v) for c, v in enumerate(row, start=1))
            body.append(f'<row r="{r}">{cells}</row>')
        sheet_xml.append(
            f'<?xml version="1.0" encoding="UTF-8"?><worksheet xmlns="{_NS}"><sheetData>'
            + "".join(body)
            + "</sheetData></worksheet>"
        )
    names = list(sheets)
    workbook = (
        f'<?xml version="1.0" encoding="UTF-8"?><workbook xmlns="{_NS}" xmlns:r="{_R}"><sheets>'
        + "".join(
            f'<sheet name="{escape(n)}" sheetId="{i + 1}" r:id="rId{i + 1}"/>'
            for i, n in enumerate(names)
        )
        + "</sheets></workbook>"
    )
    rels = (
        '<?xml version="1.0" encoding="UTF-8"?><Relationships '
        'xmlns="http://schemas.openxmlformats.org/package/2006/relationships">'
        + "".join(
            f'<Relationship Id="rId{i + 1}" Type="{_R}/worksheet" '
            f'Target="worksheets/sheet{i + 1}.xml"/>'
            for i in range(len(names))
        )
        + (
            f'<Relationship Id="rIdS" Type="{_R}/sharedStrings" Target="sharedStrings.xml"/>'
            if shared
            else ""
        )
        + "</Relationships>"
    )
    # The package parts every reader expects (openpyxl refuses a file without them).
    ct_main = "application/vnd.openxmlformats-officedocument.spreadsheetml"
    content_types = (
        '<?xml version="1.0" encoding="UTF-8"?><Types '
        'xmlns="http://schemas.openxmlformats.org/package/2006/content-types">'
        '<Default Extension="rels" '
        'ContentType="application/vnd.openxmlformats-package.relationships+xml"/>'
        '<Default Extension="xml" ContentType="application/xml"/>'
        f'<Override PartName="/xl/workbook.xml" ContentType="{ct_main}.sheet.main+xml"/>'
        + "".join(
            f'<Override PartName="/xl/worksheets/sheet{i + 1}.xml" '
            f'ContentType="{ct_main}.worksheet+xml"/>'
            for i in range(len(names))
        )
        + (
            f'<Override PartName="/xl/sharedStrings.xml" ContentType="{ct_main}.sharedStrings+xml"/>'
            if shared
            else ""
        )
        + "</Types>"
    )
    package_rels = (
        '<?xml version="1.0" encoding="UTF-8"?><Relationships '
        'xmlns="http://schemas.openxmlformats.org/package/2006/relationships">'
        f'<Relationship Id="rId1" Type="{_R}/officeDocument" Target="xl/workbook.xml"/>'
        "</Relationships>"
    )
    sst = (
        f'<?xml version="1.0" encoding="UTF-8"?><sst xmlns="{_NS}" count="{len(shared)}" '
        f'uniqueCount="{len(shared)}">'
        + "".join(f"<si><t>{escape(s)}</t></si>" for s in shared)
        + "</sst>"
    )
    path = Path(path)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("[Content_Types].xml", content_types)
        z.writestr("_rels/.rels", package_rels)
        z.writestr("xl/workbook.xml", workbook)
        z.writestr("xl/_rels/workbook.xml.rels", rels)
        for i, xml in enumerate(sheet_xml):
            z.writestr(f"xl/worksheets/sheet{i + 1}.xml", xml)
        if shared:
            z.writestr("xl/sharedStrings.xml", sst)
    return path

"""A small stdlib reader of .xlsx cell values (an .xlsx is a zip of XML parts).

Reads what the checkers need and nothing more: sheet names in workbook order, and the cached
value of every cell (numbers, shared strings, inline strings, formula string results, booleans,
error codes). Styles, charts, merged cells and formulas themselves are not read.

    book = XlsxBook("report.xlsx")
    book.sheet_names            # ["Sheet1", "Data"]
    book.cell("Sheet1", "B3")   # 42 / 3.5 / "text" / True / None
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path, PurePosixPath
from xml.etree import ElementTree as ET

_MAIN = "{http://schemas.openxmlformats.org/spreadsheetml/2006/main}"
_DOC_REL = "{http://schemas.openxmlformats.org/officeDocument/2006/relationships}"
_PKG_REL = "{http://schemas.openxmlformats.org/package/2006/relationships}"
_COORD = re.compile(r"^\$?([A-Za-z]{1,3})\$?([0-9]+)$")

CellValue = str | int | float | bool | None


def split_coordinate(coordinate: str) -> tuple[int, int]:
    """`"B3"` -> (row 3, column 2), both 1-based."""
    m = _COORD.match(coordinate.strip())
    if not m:
        raise ValueError(f"not a cell coordinate: {coordinate!r}")
    col = 0
    for ch in m.group(1).upper():
        col = col * 26 + ord(ch) - ord("A") + 1
    return int(m.group(2)), col


def _number(text: str) -> int | float:
    t = text.strip()
    if re.fullmatch(r"[+-]?[0-9]+", t):
        return int(t)
    return float(t)


class XlsxBook:
    """Cell values of one .xlsx file, read lazily sheet by sheet."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with zipfile.ZipFile(self.path) as z:
            names = set(z.namelist())
            workbook = ET.fromstring(z.read("xl/workbook.xml"))
            rels: dict[str, str] = {}
            if "xl/_rels/workbook.xml.rels" in names:
                for rel in ET.fromstring(z.read("xl/_rels/workbook.xml.rels")):
                    if rel.tag == f"{_PKG_REL}Relationship":
                        rels[rel.get("Id", "")] = rel.get("Target", "")
            self._shared = self._read_shared(z) if "xl/sharedStrings.xml" in names else []
        self._parts: dict[str, str] = {}
        self.sheet_names: list[str] = []
        sheets = workbook.find(f"{_MAIN}sheets")
        for sheet in sheets if sheets is not None else []:
            name = sheet.get("name", "")
            target = rels.get(sheet.get(f"{_DOC_REL}id", ""), "")
            if target.startswith("/"):
                part = target.lstrip("/")
            elif target:
                part = str(PurePosixPath("xl") / target)
            else:
                part = f"xl/worksheets/sheet{sheet.get('sheetId')}.xml"
            self.sheet_names.append(name)
            self._parts[name] = part
        self._cells: dict[str, dict[tuple[int, int], CellValue]] = {}

    @staticmethod
    def _read_shared(z: zipfile.ZipFile) -> list[str]:
        root = ET.fromstring(z.read("xl/sharedStrings.xml"))
        out = []
        for si in root.iter(f"{_MAIN}si"):
            out.append(_text_of(si))
        return out

    def cells(self, sheet: str) -> dict[tuple[int, int], CellValue]:
        """{(row, col): value} of the non-empty cells of `sheet`; KeyError if there is no such sheet."""
        if sheet not in self._parts:
            raise KeyError(f"{self.path.name} has no sheet {sheet!r} (sheets: {self.sheet_names})")
        if sheet not in self._cells:
            with zipfile.ZipFile(self.path) as z:
                root = ET.fromstring(z.read(self._parts[sheet]))
            self._cells[sheet] = self._parse_sheet(root)
        return self._cells[sheet]

    def cell(self, sheet: str, coordinate: str) -> CellValue:
        return self.cells(sheet).get(split_coordinate(coordinate))

    def _parse_sheet(self, root: ET.Element) -> dict[tuple[int, int], CellValue]:
        out: dict[tuple[int, int], CellValue] = {}
        data = root.find(f"{_MAIN}sheetData")
        if data is None:
            return out
        row_no = 0
        for row in data.iter(f"{_MAIN}row"):
            row_no = int(row.get("r", row_no + 1))
            col_no = 0
            for c in row.iter(f"{_MAIN}c"):
                ref = c.get("r")
                col_no = split_coordinate(ref)[1] if ref else col_no + 1
                value = self._cell_value(c)
                if value is not None and value != "":
                    out[(row_no, col_no)] = value
        return out

    def _cell_value(self, c: ET.Element) -> CellValue:
        t = c.get("t", "n")
        if t == "inlineStr":
            is_ = c.find(f"{_MAIN}is")
            return _text_of(is_) if is_ is not None else None
        v = c.find(f"{_MAIN}v")
        if v is None or v.text is None:
            return None
        text = v.text
        if t == "s":
            return self._shared[int(text)]
        if t == "b":
            return text.strip() == "1"
        if t in ("str", "e", "d"):
            return text
        return _number(text)


def _text_of(elem: ET.Element) -> str:
    """Concatenated `<t>` texts of a string item, without phonetic runs (`<rPh>`)."""
    parts = []
    for child in elem:
        if child.tag == f"{_MAIN}t":
            parts.append(child.text or "")
        elif child.tag == f"{_MAIN}r":
            t = child.find(f"{_MAIN}t")
            if t is not None:
                parts.append(t.text or "")
    return "".join(parts)


def sheet_rows(cells: dict[tuple[int, int], CellValue]) -> list[list[CellValue]]:
    """The sheet as a table the way pandas' `read_excel` sees it: blank rows dropped, every row
    padded with None up to the last used column."""
    if not cells:
        return []
    ncols = max(c for _, c in cells)
    rows: dict[int, list[CellValue]] = {}
    for (r, c), v in cells.items():
        rows.setdefault(r, [None] * ncols)[c - 1] = v
    return [rows[r] for r in sorted(rows)]

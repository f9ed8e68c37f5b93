"""LibreOffice Calc's accessibility tree on the local desktop (`--atspi`), held against the screen.

A desktop started with the tree runs LibreOffice with its GTK 3 plugin, so GET
/accessibility gives Calc's widgets in OSWorld's format: the cells in view (row by row,
with their text), the toolbars, the menus, the Name Box, and dialogs. The tests hold it
against what X and the screen say: every box lies on the screen and the Calc window's
nodes inside its window, neighbouring cells abut, a click at a cell's centre selects that
cell (the tree's focused cell and the Name Box then name it), a dialog's button is where
a click presses it, and a desktop's node budget (`a11y_max_nodes`) bounds the answer.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest
from arpo_envs.procs import marked_pids
from test_desktop_atspi import box, require_atspi, tree
from test_desktop_common import Desk, start_desk, stop_desk_proc
from test_desktop_common import wait_until as until

from arpo.env import a11y

ST = "https://accessibility.ubuntu.example.org/ns/state"
CP = "https://accessibility.ubuntu.example.org/ns/component"
ROWS, COLS = 40, 12


def cell_value(r: int, c: int) -> str:
    return f"v{r}x{c}"


@pytest.fixture(scope="module")
def desk(tmp_path_factory) -> Desk:
    require_atspi()
    d = start_desk(tmp_path_factory.mktemp("calc-tree"), "--atspi")
    yield d
    stop_desk_proc(d.proc)
    assert d.proc.returncode == 0
    assert marked_pids(d.root) == [], "processes of the desktop outlived its server"


def open_sheet(desk: Desk) -> None:
    """A sheet of ROWS x COLS filled cells open in Calc (`/setup/open_file`, as tasks do)."""
    assert desk.post("/reset").status == 200
    lines = "\\n".join(",".join(cell_value(r, c) for c in range(COLS)) for r in range(ROWS))
    desk.sh(f"printf '{lines}\\n' > ~/sheet.csv")
    a = desk.post("/setup/open_file", {"path": "/home/user/sheet.csv"})
    assert a.status == 200, a.body


def calc(desk: Desk) -> ET.Element:
    """Calc's application node once its sheet's cells are in the tree."""
    found: list[ET.Element] = []

    def ready() -> bool:
        found[:] = [
            app for app in tree(desk).findall("application")
            if app.find(".//table-cell") is not None
        ]  # fmt: skip
        return bool(found)

    until(ready, timeout=40, interval=0.5)
    return found[0]


def cells(app: ET.Element) -> dict[str, ET.Element]:
    return {c.get("name", ""): c for c in app.iter("table-cell")}


def name_box(app: ET.Element) -> str:
    """The Name Box's text: the first text of the formula bar."""
    bar = next(t for t in app.iter("tool-bar") if t.get("name") == "Formula Tool Bar")
    return next(t for t in bar.iter("text")).text or ""


def inside(
    inner: tuple[int, int, int, int], outer: tuple[int, int, int, int], slack: int = 0
) -> bool:
    """`inner` lies in `outer`, or sticks out by at most `slack` pixels on a side."""
    x, y, w, h = inner
    ox, oy, ow, oh = outer
    return (
        ox - slack <= x and oy - slack <= y
        and x + w <= ox + ow + slack and y + h <= oy + oh + slack
    )  # fmt: skip


def test_calc_tree_holds_what_the_screen_shows(desk: Desk) -> None:
    assert desk.sh("echo $SAL_USE_VCLPLUGIN")["output"].strip() == "gtk3"
    open_sheet(desk)
    app = calc(desk)
    frame = app.find("frame")
    assert frame is not None and "sheet.csv" in frame.get("name", "")
    # where X has Calc's window, and the screen
    info = desk.sh("xwininfo -id $(xdotool getactivewindow)")["output"]
    x = {
        k: int(v)
        for k, v in re.findall(r"(Absolute upper-left [XY]|Width|Height):\s+(-?\d+)", info)
    }
    window = (x["Absolute upper-left X"], x["Absolute upper-left Y"], x["Width"], x["Height"])
    screen = (0, 0, 1280, 720)
    # the frame is the window with the window manager's title bar, and the rest inside it
    assert inside(window, box(frame)) and inside(box(frame), screen), (box(frame), window)
    boxed = [n for n in frame.iter() if n is not frame and n.get(f"{{{CP}}}size")]
    assert len(boxed) > 500, len(boxed)
    # (LibreOffice gives its status bar 4 pixels more height than the window leaves it)
    for n in boxed:
        if n.get(f"{{{ST}}}showing") == "true" and box(n)[2] > 0 and box(n)[3] > 0:
            assert inside(box(n), screen, slack=4), (n.tag, n.get("name"), box(n))
            assert inside(box(n), window, slack=4), (n.tag, n.get("name"), box(n), window)
    # the cells in view, row by row, with the sheet's text, each beside the last
    by_name = cells(app)
    assert by_name["A1"].text == cell_value(0, 0) and by_name["C5"].text == cell_value(4, 2)
    assert [c.get("name") for c in app.iter("table-cell")][:3] == ["A1", "B1", "C1"]
    ax, ay, aw, ah = box(by_name["A1"])
    assert box(by_name["B1"])[:2] == (ax + aw, ay) and box(by_name["A2"])[:2] == (ax, ay + ah)
    sheet = next(app.iter("document-spreadsheet"))
    assert all(inside(box(c), box(sheet)) for c in by_name.values())
    assert name_box(app) == "A1"
    # the toolbar and the menus a model reads in the linearised table
    rows = a11y.linearize(ET.tostring(tree(desk), encoding="unicode")).splitlines()
    assert any(r.startswith("push-button\tSave\t") for r in rows), rows[:40]
    assert any(r.startswith("menu\tFormat\t") for r in rows), rows[:40]
    assert any(r.startswith(f"table-cell\tD7\t{cell_value(6, 3)}\t") for r in rows), rows[:80]
    # a click at a cell's centre selects that cell: the tree's focused cell and the Name Box
    target = by_name["D7"]
    tx, ty, tw, th = box(target)
    desk.act(f"pyautogui.click({tx + tw // 2}, {ty + th // 2})")

    def selected() -> tuple[str, list[str]]:
        now = calc(desk)
        focused = [c.get("name") for c in now.iter("table-cell") if c.get(f"{{{ST}}}focused")]
        return name_box(now), focused

    # (45 s: on a loaded machine Calc redraws and tells AT-SPI late; 15 s once ran out)
    until(lambda: selected() == ("D7", ["D7"]), timeout=45, interval=0.3)


@pytest.mark.slow
def test_a_dialog_is_in_the_tree_where_the_screen_has_it(desk: Desk) -> None:
    """Format Cells (Ctrl+1): its buttons are in the tree, a click at Cancel's centre closes it."""
    open_sheet(desk)
    calc(desk)
    desk.act("pyautogui.hotkey('ctrl', '1')")

    def dialog() -> ET.Element | None:
        for app in tree(desk).findall("application"):
            for d in app.iter("dialog"):
                if d.get("name") == "Format Cells":
                    return d
        return None

    def laid_out() -> dict[str, ET.Element]:
        """The dialog's buttons once they are all in the tree and inside the dialog (it
        grows to its size after it maps: for a moment they lie past its bottom edge)."""
        d = dialog()
        if d is None:
            return {}
        buttons = {b.get("name"): b for b in d.iter("push-button") if b.get(f"{{{ST}}}showing")}
        if not {"OK", "Cancel", "Help", "Reset"} <= set(buttons):
            return {}
        return buttons if all(inside(box(b), box(d)) for b in buttons.values()) else {}

    buttons = until(laid_out, timeout=20, interval=0.5)
    info = desk.sh("xwininfo -id $(xdotool getactivewindow)")["output"]
    assert '"Format Cells"' in info, info
    x = dict(re.findall(r"(Absolute upper-left [XY]|Width|Height):\s+(-?\d+)", info))
    window = tuple(int(x[k]) for k in ("Absolute upper-left X", "Absolute upper-left Y",
                                        "Width", "Height"))  # fmt: skip
    assert all(inside(box(b), window) for b in buttons.values()), (window, buttons)
    cx, cy, cw, ch = box(buttons["Cancel"])
    desk.act(f"pyautogui.click({cx + cw // 2}, {cy + ch // 2})")
    until(lambda: dialog() is None, timeout=15, interval=0.5)


@pytest.mark.slow
def test_the_node_budget_bounds_the_answer(tmp_path) -> None:
    """`--a11y-max-nodes 400`: the answer holds at most that many of Calc's nodes, in
    document order (the cells, last in it, are cut), and the server logs what it left out."""
    require_atspi()
    d = start_desk(tmp_path / "d", "--atspi", "--a11y-max-nodes", "400")
    try:
        open_sheet(d)
        until(
            lambda: any(
                a.get("name") == "soffice" and "sheet.csv" in (a.find("frame") or a).get("name", "")
                for a in tree(d).findall("application")
            ),
            timeout=40,
            interval=0.5,
        )
        app = next(a for a in tree(d).findall("application") if a.get("name") == "soffice")
        assert 300 <= sum(1 for _ in app.iter()) <= 400
        # the menu bar's items come first in the document: the cells are past the budget
        assert app.find(".//menu-item") is not None and app.find(".//table-cell") is None
        assert d.log is not None
        until(lambda: "past the budget of 400 left out" in d.log.read_text())
    finally:
        stop_desk_proc(d.proc)

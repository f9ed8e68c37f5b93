"""`arpo.env.a11y` on small trees with hand-computed answers, and the simulated desktop's tree
held against its screen: every mark's centre is where a click reaches the widget it names.

OSWorld's own code is compared with the module in tests/test_a11y_osworld.py.
"""

from __future__ import annotations

import asyncio
import io
import xml.etree.ElementTree as ET
from typing import Any

import aiohttp
import pytest
from arpo_envs.sim.desktop import Desktop
from arpo_envs.sim.interpreter import execute
from arpo_envs.sim.server import SimConfig, running
from arpo_envs.sim.tasks import FAMILIES, load_scene
from arpo_envs.sim.widgets import Button, Label, ListBox, MenuBar, TextField, Widget, Window
from PIL import Image, ImageChops, ImageDraw

from arpo.env import a11y
from arpo.env.a11y import HEADER, Mark
from arpo.errors import EnvProtocolError

NS = (
    'xmlns:st="https://accessibility.ubuntu.example.org/ns/state" '
    'xmlns:cp="https://accessibility.ubuntu.example.org/ns/component" '
    'xmlns:ua="https://accessibility.ubuntu.example.org/ns/attributes" '
    'xmlns:wa="https://accessibility.windows.example.org/ns/attributes"'
)
ON = 'st:showing="true" st:visible="true" st:enabled="true"'


def at(x: int, y: int, w: int, h: int) -> str:
    return f'cp:screencoord="({x}, {y})" cp:size="({w}, {h})"'


SMALL = f"""<desktop-frame {NS}><application name="app">
<frame name="Win" {ON} {at(0, 0, 400, 300)}>
<push-button name="OK" {ON} {at(10, 20, 31, 15)} ua:class="GtkButton" wa:description="Confirms"/>
<label name="" {ON} {at(10, 40, 100, 20)}>He said "no"</label>
<entry name="Name" st:showing="true" st:visible="true" st:editable="true" {at(10, 70, 200, 24)}/>
<push-button name="Scrolled away" st:visible="true" st:enabled="true" {at(10, 100, 50, 20)}/>
<push-button name="Greyed" st:showing="true" st:visible="true" {at(70, 100, 50, 20)}/>
<push-button name="" {ON} {at(130, 100, 50, 20)}/>
<push-button name="Left of the screen" {ON} {at(-1, 130, 50, 20)}/>
<push-button name="Flat" {ON} {at(60, 130, 50, 0)}/>
<push-button name="Evil" {ON} cp:screencoord="__import__('os').getcwd()" cp:size="(9, 9)"/>
<panel name="Panel" {ON} {at(0, 150, 400, 150)}>
<document-web name="Page" {ON} {at(0, 160, 300, 100)}/>
<list-item name="Row 1" {ON} {at(0, 270, 300, 20)}/>
</panel>
<image name="" image="true" {ON} {at(300, 10, 20, 20)}/>
</frame></application></desktop-frame>"""

SMALL_TABLE = "\n".join(
    [
        HEADER,
        'push-button\tOK\t""\t\tConfirms\t(10, 20)\t(31, 15)',
        'label\t\t"He said ""no"""\t\t\t(10, 40)\t(100, 20)',
        'entry\tName\t""\t\t\t(10, 70)\t(200, 24)',
        'document-web\tPage\t""\t\t\t(0, 160)\t(300, 100)',
        'list-item\tRow 1\t""\t\t\t(0, 270)\t(300, 20)',
    ]
)


# ---- linearize and filter ----------------------------------------------------------------------


def test_linearize_small_tree_by_hand() -> None:
    """Kept: a button, a label by its text, an editable entry that is not enabled, a
    document-* and an *-item; dropped: the frame and panel (tags), not showing, not enabled,
    no name or text, off screen, empty, an unparsable position, and the nameless image."""
    assert a11y.linearize(SMALL) == SMALL_TABLE
    assert [n.get("name") for n in a11y.filter_nodes(a11y.parse(SMALL), check_image=True)] == [
        "OK",
        "",
        "Name",
        "Page",
        "Row 1",
        "",
    ]


def test_windows_platform_reads_its_namespaces_and_skips_showing() -> None:
    tree = (
        '<desktop xmlns:st="https://accessibility.windows.example.org/ns/state" '
        'xmlns:cp="https://accessibility.windows.example.org/ns/component" '
        'xmlns:c="https://accessibility.windows.example.org/ns/class" '
        'xmlns:v="https://accessibility.windows.example.org/ns/value">'
        '<button name="Go" st:visible="true" st:enabled="true" c:class="ButtonWrapper" '
        f"{at(1, 2, 3, 4)}/>"
        '<textbox name="Find" st:visible="true" st:enabled="true" c:class="x.EditWrapper" '
        f'v:value="a&quot;b" {at(5, 6, 7, 8)}/></desktop>'
    )
    assert a11y.linearize(tree, "windows") == "\n".join(
        [
            HEADER,
            'button\tGo\t""\tButtonWrapper\t\t(1, 2)\t(3, 4)',
            'textbox\tFind\t"a""b"\tx.EditWrapper\t\t(5, 6)\t(7, 8)',
        ]
    )
    assert a11y.linearize(tree) == HEADER  # Ubuntu namespaces: nothing there
    assert a11y.linearize(SMALL, "windows") == HEADER
    with pytest.raises(ValueError, match="'ubuntu' or 'windows'"):
        a11y.linearize(SMALL, "macos")


def test_text_cell_quotes_like_osworld() -> None:
    assert a11y.text_cell("") == '""'
    assert a11y.text_cell("plain\ttext") == "plain\ttext"
    assert a11y.text_cell('a "b" c') == '"a ""b"" c"'


def test_parse_gives_elementtrees_tree() -> None:
    """Same tags, attributes, text and tails as `ElementTree.fromstring`, whitespace included."""
    desk = Desktop()
    load_scene(desk, "fill_form", 0)
    for xml in (SMALL, desk.accessibility_xml(), "<a>x<b c='1'/> tail <d>&amp;&#x41;</d></a>"):
        ours, theirs = list(a11y.parse(xml).iter()), list(ET.fromstring(xml).iter())
        assert [(e.tag, e.attrib, e.text, e.tail) for e in ours] == [
            (e.tag, e.attrib, e.text, e.tail) for e in theirs
        ]


# ---- hostile trees -----------------------------------------------------------------------------

LAUGHS = (
    '<?xml version="1.0"?>\n<!DOCTYPE lolz [\n <!ENTITY lol "lol">\n'
    + "".join(
        f' <!ENTITY lol{i} "{("&lol" + (str(i - 1) if i > 1 else "") + ";") * 10}">\n'
        for i in range(1, 10)
    )
    + "]>\n"
    + f'<desktop-frame {NS}><label name="&lol9;" {ON} {at(0, 0, 9, 9)}/></desktop-frame>'
)


def test_billion_laughs_is_refused_at_once() -> None:
    for call in (a11y.linearize, a11y.marks, a11y.parse):
        with pytest.raises(EnvProtocolError, match="DOCTYPE"):
            call(LAUGHS)


@pytest.mark.parametrize(
    ("xml", "reason"),
    [
        ('<!DOCTYPE a [<!ENTITY e SYSTEM "file:///etc/passwd">]><a>&e;</a>', "DOCTYPE"),
        ("<a>&e;</a>", "not well-formed"),
        ("<a><b></a>", "not well-formed"),
        ("", "not well-formed"),
        ("<a>" * 300 + "</a>" * 300, "nested deeper than 256"),
    ],
)
def test_malformed_trees_are_refused(xml: str, reason: str) -> None:
    with pytest.raises(EnvProtocolError, match=reason):
        a11y.linearize(xml)


def test_size_and_node_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(a11y, "MAX_NODES", 10)
    a11y.parse("<a>" + "<b/>" * 9 + "</a>")
    with pytest.raises(EnvProtocolError, match="more than 10 elements"):
        a11y.parse("<a>" + "<b/>" * 10 + "</a>")
    monkeypatch.setattr(a11y, "MAX_XML_CHARS", len(SMALL) - 1)
    with pytest.raises(EnvProtocolError, match="characters, the limit is"):
        a11y.linearize(SMALL)


# ---- trim ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The tiny policy's tokenizer (byte-level BPE with Qwen's pre-tokenizer and added tokens)."""
    from transformers import PreTrainedTokenizerFast

    from arpo.policy.tiny import build_tokenizer

    return PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )


def test_trim_at_the_boundary(tokenizer: Any) -> None:
    ids = tokenizer.encode(SMALL_TABLE, add_special_tokens=False)
    n = len(ids)
    assert n > 20
    assert a11y.trim(SMALL_TABLE, tokenizer, n) is SMALL_TABLE  # fits: unchanged
    assert a11y.trim(SMALL_TABLE, tokenizer, n + 100) is SMALL_TABLE
    cut = a11y.trim(SMALL_TABLE, tokenizer, n - 1)
    assert cut == tokenizer.decode(ids[: n - 1]) + "[...]\n"
    assert SMALL_TABLE.startswith(cut.removesuffix("[...]\n"))
    assert len(tokenizer.encode(cut.removesuffix("[...]\n"), add_special_tokens=False)) == n - 1
    assert a11y.trim(SMALL_TABLE, tokenizer, 1) == tokenizer.decode(ids[:1]) + "[...]\n"
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        a11y.trim(SMALL_TABLE, tokenizer, 0)


# ---- set-of-marks ----------------------------------------------------------------------------


def test_marks_and_their_centres() -> None:
    got = a11y.marks(SMALL)
    assert [(m.index, m.tag, m.name, m.text, m.box) for m in got] == [
        (1, "push-button", "OK", "", (10, 20, 31, 15)),
        (2, "label", "", 'He said "no"', (10, 40, 100, 20)),
        (3, "entry", "Name", "", (10, 70, 200, 24)),
        (4, "document-web", "Page", "", (0, 160, 300, 100)),
        (5, "list-item", "Row 1", "", (0, 270, 300, 20)),
        (6, "image", "", "", (300, 10, 20, 20)),
    ]
    assert got[0].center == (25, 27)  # x + w // 2, y + h // 2
    assert Mark(1, "x", "", "", (0, 0, 1, 1)).center == (0, 0)
    assert a11y.mark_table(got[:2]) == "\n".join(
        ["index\ttag\tname\ttext", '1\tpush-button\tOK\t""', '2\tlabel\t\t"He said ""no"""']
    )


GREY = (200, 200, 200)
THREE = (
    f"<desktop-frame {NS}>"
    f'<push-button name="A" {ON} {at(10, 10, 40, 20)}/>'  # has content
    f'<push-button name="B" {ON} {at(50, 30, 20, 20)}/>'  # blank, but A's box reaches (50, 30)
    f'<push-button name="C" {ON} {at(120, 10, 30, 30)}/>'  # blank
    "</desktop-frame>"
)


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _three_screen() -> bytes:
    image = Image.new("RGB", (200, 100), GREY)
    ImageDraw.Draw(image).rectangle((20, 14, 40, 24), fill=(0, 0, 200))
    return _png(image)


def test_single_colour_boxes_get_no_mark_unless_a_mark_reaches_them() -> None:
    png = _three_screen()
    assert [m.name for m in a11y.marks(THREE)] == ["A", "B", "C"]
    tagged = a11y.marks(THREE, png)
    assert [(m.index, m.name) for m in tagged] == [(1, "A"), (2, "B")]


def test_draw_marks_on_a_copy() -> None:
    png = _three_screen()
    found = a11y.marks(THREE, png)
    out = Image.open(io.BytesIO(a11y.draw_marks(png, found))).convert("RGB")
    before = Image.open(io.BytesIO(png)).convert("RGB")
    assert _png(before) == _png(Image.open(io.BytesIO(png)).convert("RGB"))  # input untouched
    for corner in ((10, 10), (50, 10), (50, 30), (70, 30), (70, 50)):  # corners without labels
        assert out.getpixel(corner) == (255, 0, 0), corner
    label = [out.getpixel((x, y))[0] for x in range(10, 17) for y in range(22, 31)]
    assert label.count(0) > 20 and max(label) > 230  # "1" in white on black, bottom-left
    changed = ImageChops.difference(out, before).getbbox()
    assert changed is not None and changed[2] <= 71 and changed[3] <= 51  # C left alone
    som = a11y.set_of_marks(THREE, png)
    assert list(som.marks) == found and som.table == a11y.mark_table(found)
    assert (
        ImageChops.difference(Image.open(io.BytesIO(som.screenshot)).convert("RGB"), out).getbbox()
        is None
    )


def test_bad_screenshots_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(EnvProtocolError, match="not a readable image"):
        a11y.draw_marks(b"not a png", [])
    monkeypatch.setattr(a11y, "MAX_SCREENSHOT_PIXELS", 100)
    with pytest.raises(EnvProtocolError, match="more than 100 pixels"):
        a11y.marks(THREE, _three_screen())


# ---- the simulated desktop's tree against its screen ------------------------------------------

PREFIX = "import pyautogui; import time; pyautogui.FAILSAFE = False; "
SEED = 11
STATES = [(family, 0) for family in FAMILIES] + [
    ("menu_pick", 1),  # a menu open
    ("dialog_confirm", 1),  # a modal dialog up
    ("list_select", 1),  # the list scrolled
]
"""(family, oracle steps run from the fresh scene of seed SEED) of every state checked."""


def _state(family: str, steps: int) -> tuple[Desktop, list[str]]:
    desk = Desktop()
    actions = load_scene(desk, family, SEED).oracle[:steps]
    for code in actions:
        assert execute(PREFIX + code, desk).returncode == 0
    return desk, actions


def _reached(desk: Desktop, mark: Mark) -> tuple[Widget, str | None]:
    """What a click at the mark's centre reaches by the desktop's own routing (the widget and
    the menu path or list row it picks); asserts the mark says what the screen shows there."""
    x, y = mark.center
    if desk.menu is not None:
        bar, index = desk.menu
        item = bar.item_at(index, x, y)
        if item is not None:
            assert (mark.tag, mark.name) == ("menu-item", bar.menus[index].items[item])
            return bar, f"{bar.menus[index].title} > {mark.name}"
    win, w = desk.widget_at(x, y)
    assert w is not None, mark
    modal = desk.modal()
    assert modal is None or win is modal, f"{mark} is under a modal dialog"
    if isinstance(w, MenuBar):
        i = w.title_at(x, y)
        assert i is not None and (mark.tag, mark.name) == ("menu", w.menus[i].title), mark
        return w, mark.name
    if isinstance(w, ListBox):
        row = w.top + (y - w.y - 1) // w.row_h
        assert (mark.tag, mark.name) == ("list-item", w.items[row]), mark
        return w, mark.name
    assert (mark.tag, mark.name) == (w.role, w.label), mark
    shown = w.value if isinstance(w, TextField) else w.label if isinstance(w, Label) else ""
    assert mark.text == shown, mark
    return w, None


def _check_click(
    mark: Mark, w: Widget, picked: str | None, before: dict[str, Any], after: dict[str, Any]
) -> None:
    """The state change a click on `mark` must make."""
    b, a = dict(before), dict(after)
    b.pop("cursor")
    a.pop("cursor")
    if b["menu_open"] is not None and mark.tag not in ("menu", "menu-item"):
        assert a == {**b, "menu_open": None}, mark  # an open menu takes the click and closes
        return
    if mark.tag == "push-button":  # pressed, unless the press closed its window
        if w.wid in a["widgets"]:
            assert a["widgets"][w.wid]["presses"] == b["widgets"][w.wid]["presses"] + 1, mark
        else:
            assert w.wid in b["widgets"] and a["windows"] != b["windows"], mark
    elif mark.tag == "entry":
        assert a["focus"] == w.wid != b["focus"], mark
    elif mark.tag == "check-box":
        assert a["widgets"][w.wid]["checked"] is not b["widgets"][w.wid]["checked"], mark
    elif mark.tag == "list-item":
        assert a["widgets"][w.wid]["selected"] == picked, mark
    elif mark.tag == "menu":  # opens; with a menu open, hovering there already switched to
        # it and the click closes it, as in GTK
        assert a["menu_open"] == (picked if b["menu_open"] is None else None), mark
    elif mark.tag == "menu-item":
        assert (a["picked"], a["menu_open"]) == ([*b["picked"], picked], None), mark
    else:
        assert mark.tag == "label" and a == b, mark  # static text: nothing happens


def test_sim_marks_name_what_is_under_them_and_clicks_there_activate_it() -> None:
    """For every state: the tree the server serves is the desktop's; OSWorld's set-of-marks
    tags every node the filter keeps (none is a blank area); each mark's centre reaches, by
    the desktop's hit testing, the widget (menu title, menu item, list row) it names, with the
    text it shows; and a click there through the server's /execute changes the state as that
    widget does."""
    checked: dict[str, int] = {}

    async def body() -> None:
        async with running([SimConfig(port=0)]) as (url,), aiohttp.ClientSession() as s:

            async def post(path: str, payload: dict[str, Any]) -> Any:
                async with s.post(f"{url}{path}", json=payload) as r:
                    assert r.status == 200, await r.text()
                    return await r.json()

            async def reset(family: str, actions: list[str]) -> None:
                await post("/sim/scene", {"family": family, "seed": SEED})
                for code in actions:
                    res = await post("/execute", {"command": ["python", "-c", PREFIX + code]})
                    assert res["returncode"] == 0, res

            for family, steps in STATES:
                desk, actions = _state(family, steps)
                xml = desk.accessibility_xml()
                await reset(family, actions)
                async with s.get(f"{url}/accessibility") as r:
                    assert (await r.json())["AT"] == xml
                found = a11y.marks(xml, desk.screenshot_png())
                assert found and found == a11y.marks(xml), family
                for mark in found:
                    w, picked = _reached(desk, mark)
                    await reset(family, actions)
                    before = (await post("/sim/state", {"path": ""}))["value"]
                    x, y = mark.center
                    click = ["python", "-c", f"{PREFIX}pyautogui.click({x}, {y})"]
                    assert (await post("/execute", {"command": click}))["returncode"] == 0
                    after = (await post("/sim/state", {"path": ""}))["value"]
                    _check_click(mark, w, picked, before, after)
                checked[f"{family}/{steps}"] = len(found)

    asyncio.run(body())
    assert len(checked) == len(STATES)
    assert checked["dialog_confirm/1"] == 3, checked  # the dialog's text, Cancel, OK only
    assert checked["list_select/1"] >= 15, checked


def test_sim_covered_widgets_are_not_showing() -> None:
    """A button under another window, or under an open menu, is in the tree but not showing,
    so it gets no mark: a click at its centre would reach what covers it."""
    desk = Desktop(640, 480)
    back = Window("back", 20, 40, 300, 200, "Back")
    back.children += [
        Button("hidden", 200, 120, 80, 30, "Hidden"),
        Button("seen", 40, 120, 80, 30, "Seen"),
    ]
    front = Window("front", 180, 100, 300, 200, "Front")
    front.children.append(Button("top", 300, 200, 80, 30, "Top"))
    desk.add_window(back)
    desk.add_window(front)
    root = a11y.parse(desk.accessibility_xml())
    st = "{https://accessibility.ubuntu.example.org/ns/state}showing"
    assert {e.get("name"): e.get(st) for e in root.iter("push-button")} == {
        "Hidden": "false",
        "Seen": "true",
        "Top": "true",
    }
    assert [m.name for m in a11y.marks(desk.accessibility_xml())] == ["Seen", "Top"]
    assert desk.widget_at(240, 135)[0] is front  # "Hidden"'s centre belongs to the front window

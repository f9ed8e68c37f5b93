"""Differential test: `arpo.env.a11y` and OSWorld's own code give the same observations.

OSWorld's functions run unchanged in the evaluator environment (.venv-osworld, `make
osworld-evaluator`), whose desktop-env 1.0.2 package ships `mm_agents`: from
mm_agents/agent.py `linearize_accessibility_tree` and `tag_screenshot` (which calls
mm_agents/accessibility_tree_wrap/heuristic_retrieve.py `filter_nodes` and
`draw_bounding_boxes`). agent.py imports the SDK of every model it can call at module level
(openai, groq, dashscope, google.generativeai, tiktoken, backoff), none of which that
environment has; the script below puts empty modules in their place before the import, and
the functions compared never touch them.

For every tree (each task family's scene of the simulated desktop, and the states after a
first action: a menu open, a dialog up, a list scrolled, a field holding quotes; a
hand-written tree in the shape of the Ubuntu VM server's AT-SPI dump, compact and indented;
a hand-written Windows tree; a real local desktop's AT-SPI tree with mousepad and its menu
open, `--atspi`), both sides give the linearised table; for the Ubuntu trees,
with a screenshot, also the set-of-marks: the marks' boxes, the mark table and the tagged
screenshot, compared pixel for pixel. Not compared: `trim` (OSWorld counts tiktoken tokens,
the project the policy's own, see the module's deviation 3) and the set-of-marks of the
Windows tree (OSWorld's `tag_screenshot` reads Ubuntu positions there, deviation 4).
"""

from __future__ import annotations

import base64
import io
import json
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from arpo_envs.a11y import NS
from arpo_envs.sim.desktop import Desktop
from arpo_envs.sim.interpreter import execute
from arpo_envs.sim.tasks import FAMILIES, load_scene
from osworld_fixtures.evaluator import PYTHON, needs_evaluator
from PIL import Image, ImageChops, ImageDraw
from test_desktop_atspi import box, mousepad, require_atspi, tree
from test_desktop_common import running_desk
from test_desktop_common import wait_until as until

from arpo.env import a11y

pytestmark = needs_evaluator

OSWORLD_SIDE = r"""
import base64, json, sys, types

class Placeholder(types.ModuleType):
    # any attribute is an exception class: agent.py names SDK exceptions at class definition
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (Exception,), {})

for name in ("backoff", "dashscope", "google.generativeai", "openai", "tiktoken", "groq"):
    sys.modules[name] = Placeholder(name)
sys.modules["backoff"].on_exception = lambda *args, **kwargs: (lambda f: f)

from mm_agents.agent import linearize_accessibility_tree, tag_screenshot

answers = []
for case in json.load(sys.stdin):
    answer = {"table": linearize_accessibility_tree(case["xml"], platform=case["platform"])}
    if case["png"] is not None:
        png = base64.b64decode(case["png"])
        marks, _nodes, tagged, table = tag_screenshot(png, case["xml"], case["platform"])
        answer.update(marks=marks, mark_table=table, tagged=base64.b64encode(tagged).decode())
    answers.append(answer)
json.dump(answers, sys.stdout)
"""

UBUNTU_NS = (
    'xmlns:st="https://accessibility.ubuntu.example.org/ns/state" '
    'xmlns:attr="https://accessibility.ubuntu.example.org/ns/attributes" '
    'xmlns:cp="https://accessibility.ubuntu.example.org/ns/component" '
    'xmlns:doc="https://accessibility.ubuntu.example.org/ns/document" '
    'xmlns:docattr="https://accessibility.ubuntu.example.org/ns/document/attributes" '
    'xmlns:txt="https://accessibility.ubuntu.example.org/ns/text" '
    'xmlns:val="https://accessibility.ubuntu.example.org/ns/value" '
    'xmlns:act="https://accessibility.ubuntu.example.org/ns/action"'
)
ON = 'st:enabled="true" st:sensitive="true" st:showing="true" st:visible="true"'

# The Ubuntu VM server's dump of GNOME Shell and a gedit window: every state it lists is
# "true" (absent ones are false), boxes only on showing nodes, text from the Text interface,
# the toolkit's attributes under attr:, values under val:, actions under act:.
UBUNTU_TREE = f"""\
<desktop-frame {UBUNTU_NS} name="main" {ON} cp:screencoord="(0, 0)" cp:size="(1920, 1080)">
  <application name="gnome-shell" attr:toolkit="GNOME Shell" attr:version="42.9">
    <window name="" {ON} cp:screencoord="(0, 0)" cp:size="(1920, 1080)">
      <panel name="Top Bar" {ON} cp:screencoord="(0, 0)" cp:size="(1920, 32)">
        <push-button name="Activities" {ON} st:focusable="true" cp:screencoord="(0, 0)" cp:size="(115, 32)" act:click_desc="" act:click_kb=""/>
        <menu name="System" {ON} st:focusable="true" cp:screencoord="(1795, 0)" cp:size="(125, 32)"/>
        <label name="" {ON} cp:screencoord="(902, 6)" cp:size="(116, 20)">Sep 21  09:41</label>
      </panel>
    </window>
  </application>
  <application name="gedit" attr:toolkit="GTK" attr:version="3.24.33">
    <frame name="notes.txt (~/Desktop) - gedit" st:active="true" {ON} st:resizable="true" cp:screencoord="(70, 64)" cp:size="(1850, 1016)">
      <filler name="" {ON} cp:screencoord="(70, 64)" cp:size="(1850, 1016)">
        <panel name="" {ON} cp:screencoord="(70, 64)" cp:size="(1850, 46)">
          <push-button name="Open" {ON} st:focusable="true" cp:screencoord="(76, 70)" cp:size="(88, 34)" act:click_desc="Clicks the button" act:click_kb=""/>
          <toggle-button name="Main menu" st:checkable="true" st:showing="true" st:visible="true" st:focusable="true" cp:screencoord="(1830, 70)" cp:size="(34, 34)"/>
          <push-button name="Save" {ON} st:focusable="true" cp:screencoord="(1740, 70)" cp:size="(70, 34)"/>
          <push-button name="Print" st:showing="true" st:visible="true" cp:screencoord="(1660, 70)" cp:size="(70, 34)"/>
        </panel>
        <page-tab-list name="" {ON} cp:screencoord="(70, 110)" cp:size="(1850, 34)">
          <page-tab name="notes.txt" {ON} st:selectable="true" st:selected="true" cp:screencoord="(70, 110)" cp:size="(200, 34)"/>
        </page-tab-list>
        <scroll-pane name="" {ON} cp:screencoord="(70, 144)" cp:size="(1850, 880)">
          <text name="" {ON} st:editable="true" st:focusable="true" st:focused="true" st:multi-line="true" cp:screencoord="(70, 144)" cp:size="(1836, 880)" attr:text-input-purpose="free-form">Shopping list:
- "fresh" bread
- milk\t2 l</text>
          <scroll-bar name="" {ON} cp:screencoord="(1906, 144)" cp:size="(14, 880)" val:value="0.0" val:min="0.0" val:max="100.0" val:step="1.0"/>
        </scroll-pane>
        <label name="Ln 3, Col 12" {ON} cp:screencoord="(1500, 1030)" cp:size="(96, 20)">Ln 3, Col 12</label>
        <combo-box name="Plain Text" {ON} st:expandable="true" cp:screencoord="(1610, 1026)" cp:size="(110, 28)">
          <menu name="" st:enabled="true" st:sensitive="true" st:visible="true">
            <menu-item name="Markdown" st:enabled="true" st:selectable="true"/>
          </menu>
        </combo-box>
        <check-box name="Wrap text" st:checkable="true" st:checked="true" st:showing="true" st:visible="true" cp:screencoord="(1730, 1028)" cp:size="(110, 24)"/>
        <push-button name="Offscreen" {ON} cp:screencoord="(-200, 40)" cp:size="(60, 30)"/>
        <push-button name="Flat" {ON} cp:screencoord="(300, 40)" cp:size="(60, 0)"/>
        <image name="" image="true" {ON} cp:screencoord="(84, 1030)" cp:size="(16, 16)"/>
        <icon name="Trash" {ON} cp:screencoord="(100, 1030)" cp:size="(16, 16)"/>
        <entry name="Search" {ON} st:editable="true" st:focusable="true" st:single-line="true" attr:placeholder-text="Find" cp:screencoord="(200, 1026)" cp:size="(240, 28)">needle "x"</entry>
        <section name="" {ON} cp:screencoord="(460, 1026)" cp:size="(300, 28)">
          <heading name="Getting started" {ON} cp:screencoord="(460, 1026)" cp:size="(150, 28)">Getting started</heading>
          <link name="Read the docs" {ON} st:focusable="true" cp:screencoord="(620, 1026)" cp:size="(140, 28)"/>
        </section>
        <document-web name="Café — help" {ON} cp:screencoord="(780, 1026)" cp:size="(200, 28)"/>
        <paragraph name="" {ON} cp:screencoord="(990, 1026)" cp:size="(200, 28)">Say "hi" to &lt;everyone&gt; &amp; more</paragraph>
        <table-cell name="A1" {ON} cp:screencoord="(1200, 1026)" cp:size="(80, 28)">42</table-cell>
        <terminal name="Terminal" {ON} cp:screencoord="(1290, 1026)" cp:size="(100, 28)">user@ubuntu:~$ ls</terminal>
        <slider name="Zoom" {ON} cp:screencoord="(1400, 1026)" cp:size="(90, 28)" val:value="100.0"/>
      </filler>
    </frame>
  </application>
</desktop-frame>
"""

# pywinauto-style tree of OSWorld's Windows server: tags are class names, classes under class:.
WINDOWS_TREE = """\
<desktop xmlns:st="https://accessibility.windows.example.org/ns/state"
 xmlns:attr="https://accessibility.windows.example.org/ns/attributes"
 xmlns:cp="https://accessibility.windows.example.org/ns/component"
 xmlns:val="https://accessibility.windows.example.org/ns/value"
 xmlns:class="https://accessibility.windows.example.org/ns/class" name="Desktop">
<window name="Notepad" st:visible="true" st:enabled="true" cp:screencoord="(0, 0)" cp:size="(800, 600)"><edit-textbox name="Text editor" class:class="uia_controls.EditWrapper" val:value="typed &quot;text&quot;" st:visible="true" st:enabled="true" st:editable="true" cp:screencoord="(0, 40)" cp:size="(800, 500)"/><button name="Close" class:class="ButtonWrapper" attr:description="Closes the window" st:visible="true" st:enabled="true" cp:screencoord="(760, 0)" cp:size="(40, 30)"/><button name="Hidden" st:visible="false" st:enabled="true" cp:screencoord="(700, 0)" cp:size="(40, 30)"/><listitem name="Row" st:visible="true" st:enabled="true" st:showing="false" cp:screencoord="(0, 550)" cp:size="(200, 20)"/></window>
</desktop>
"""


def _compact(xml: str) -> str:
    """The same tree without the whitespace between elements, as the VM server sends it."""
    root = ET.fromstring(xml)
    for el in root.iter():
        if el.text is not None and not el.text.strip():
            el.text = None
        el.tail = None
    return ET.tostring(root, encoding="unicode")


def _ubuntu_screenshot() -> bytes:
    """A 1920x1080 screen under UBUNTU_TREE: content inside most boxes; the Save button's and
    the Trash icon's areas blank, and the Trash icon touching a box drawn before it."""
    image = Image.new("RGB", (1920, 1080), (240, 240, 240))
    d = ImageDraw.Draw(image)
    root = ET.fromstring(UBUNTU_TREE)
    for node in a11y.filter_nodes(root, check_image=True):
        x, y, w, h = a11y.box_of(node) or (0, 0, 0, 0)
        if node.get("name") in ("Save", "Trash"):
            continue
        d.rectangle((x + 2, y + 2, x + w - 3, y + h - 3), outline=(90, 90, 90))
        d.text((x + 4, y + 4), node.get("name") or (node.text or "")[:10], fill=(0, 0, 0))
    return _png(image)


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _sim_state(family: str, seed: int, actions: list[str]) -> tuple[str, bytes]:
    desk = Desktop()
    load_scene(desk, family, seed)
    for code in actions:
        assert execute(f"import pyautogui; {code}", desk).returncode == 0, code
    return desk.accessibility_xml(), desk.screenshot_png()


def _local_atspi_state(root: Path) -> tuple[str, bytes]:
    """A real local desktop's AT-SPI tree and screenshot (`--atspi`): mousepad on a file
    whose text has quotes and a tab, its Edit menu open."""
    require_atspi()
    with running_desk(root, "--atspi") as desk:
        desk.sh("printf 'say \"hi\"\\tthere\\n' > ~/quoted.txt")
        assert desk.post("/setup/open_file", {"path": "/home/user/quoted.txt"}).status == 200
        menu = next(m for m in mousepad(desk).iter("menu") if m.get("name") == "Edit")
        x, y, w, h = box(menu)
        desk.act(f"pyautogui.click({x + w // 2}, {y + h // 2})")
        until(lambda: "menu-item" in ET.tostring(tree(desk), encoding="unicode"))
        until(
            lambda: any(
                i.get(f"{{{NS['st']}}}showing") == "true"
                for i in tree(desk).iter("menu-item")
            )
        )  # fmt: skip
        return desk.get("/accessibility").json()["AT"], desk.get("/screenshot").body


def _first_action(family: str, seed: int) -> list[str]:
    """The first action of the oracle of (family, seed)."""
    return load_scene(Desktop(), family, seed).oracle[:1]


def _cases() -> dict[str, dict[str, Any]]:
    cases: dict[str, dict[str, Any]] = {}
    states = {f"sim-{family}": (family, 3, []) for family in FAMILIES}
    states["sim-menu-open"] = ("menu_pick", 5, _first_action("menu_pick", 5))
    states["sim-dialog-up"] = ("dialog_confirm", 2, _first_action("dialog_confirm", 2))
    states["sim-list-scrolled"] = ("list_select", 4, _first_action("list_select", 4))
    typing = [*_first_action("type_submit", 6), "pyautogui.write('say \"hi\" now')"]
    states["sim-quoted-text"] = ("type_submit", 6, typing)
    for name, (family, seed, actions) in states.items():
        xml, png = _sim_state(family, seed, actions)
        cases[name] = {"xml": xml, "png": png}
    shot = _ubuntu_screenshot()
    cases["ubuntu-indented"] = {"xml": UBUNTU_TREE, "png": shot}
    cases["ubuntu-compact"] = {"xml": _compact(UBUNTU_TREE), "png": shot}
    cases["windows"] = {"xml": WINDOWS_TREE, "png": None, "platform": "windows"}
    return cases


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Case name -> (the case, OSWorld's answer for it); one OSWorld process for all."""
    cases = _cases()
    xml, png = _local_atspi_state(tmp_path_factory.mktemp("atspi"))
    cases["local-atspi"] = {"xml": xml, "png": png}
    sent = [
        {
            "xml": c["xml"],
            "platform": c.get("platform", "ubuntu"),
            "png": base64.b64encode(c["png"]).decode() if c["png"] is not None else None,
        }
        for c in cases.values()
    ]
    assert PYTHON is not None
    run = subprocess.run(
        [str(PYTHON), "-c", OSWORLD_SIDE],
        input=json.dumps(sent),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, (
        "OSWorld's linearisation did not run in the evaluator environment (is mm_agents "
        f"installed there?):\n{run.stderr[-3000:]}"
    )
    answers = json.loads(run.stdout)
    return dict(zip(cases, zip(cases.values(), answers, strict=True), strict=True))


def test_tables_equal_osworlds(both) -> None:
    differ = {
        name: (a11y.linearize(case["xml"], case.get("platform", "ubuntu")), theirs["table"])
        for name, (case, theirs) in both.items()
    }
    differ = {k: v for k, v in differ.items() if v[0] != v[1]}
    assert not differ, differ


def test_set_of_marks_equals_osworlds(both) -> None:
    compared = 0
    for name, (case, theirs) in both.items():
        if case["png"] is None:
            continue
        som = a11y.set_of_marks(case["xml"], case["png"])
        assert [list(m.box) for m in som.marks] == theirs["marks"], name
        assert som.table == theirs["mark_table"], name
        ours = Image.open(io.BytesIO(som.screenshot)).convert("RGB")
        tagged = Image.open(io.BytesIO(base64.b64decode(theirs["tagged"]))).convert("RGB")
        assert ImageChops.difference(ours, tagged).getbbox() is None, f"{name}: pixels differ"
        compared += 1
    assert compared == len(both) - 1


def test_the_cases_exercise_the_rules(both) -> None:
    """The trees reach every rule: kept and dropped tags, states, boxes, quoting, the
    single-colour skip and the mark drawn over a blank box (so equality above means much)."""
    table = both["ubuntu-compact"][1]["table"]
    assert "\nsection\t" not in table  # compact: a nameless container has no text
    assert "\nsection\t\t\n" in both["ubuntu-indented"][1]["table"]  # indented: whitespace text
    for dropped in ("Print", "Offscreen", "Flat", "page-tab", "Markdown", "scroll-bar"):
        assert dropped not in table, dropped
    for kept in ("toggle-button\tMain menu", "check-box\tWrap text", "document-web\tCafé"):
        assert kept in table, kept
    assert '"Say ""hi"" to <everyone> & more"' in table
    som = a11y.set_of_marks(both["ubuntu-compact"][0]["xml"], both["ubuntu-compact"][0]["png"])
    names = [m.name for m in som.marks]
    assert "Save" not in names and "" in names  # blank button skipped, nameless image tagged
    assert "Trash" in names, "the Trash icon is blank but touches the image's mark"
    windows = both["windows"][1]["table"]
    assert '\t"typed ""text"""\t' in windows and "Closes the window" in windows
    assert "sim-dialog-up" in both and "Cancel" in both["sim-dialog-up"][1]["mark_table"]
    local = both["local-atspi"][1]["table"]
    assert "menu\tEdit\t" in local and "menu-item\tSelect All" in local, local
    assert '\t"say ""hi""\tthere' in local, local
    quoted = both["sim-quoted-text"][1]["table"]
    assert '\t"say ""hi"" now"\t' in quoted

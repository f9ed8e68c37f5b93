"""Task families of the simulated desktop: scenes generated from a seed, OSWorld-schema tasks, oracles.

A family builds a scene on a `Desktop` from a seeded RNG (window position, labels,
targets all vary with the seed) and returns the task: its instruction, the state
path its checker reads, the expected value, and an oracle, the list of pyautogui
code strings (one agent action each) that solves it, computed from the widgets'
geometry.

| family | steps | the agent must |
|---|---|---|
| click_button | 1 | click the button with a given label among 4-9 |
| click_sequence | 2-4 | click several buttons in a given order |
| type_submit | 3 | type a text into a field and submit it (enter) |
| menu_pick | 2 | open a menu of the menu bar and pick an item |
| dialog_confirm | 2 | start an action and confirm its modal dialog |
| list_select | 2-3 | scroll a list to an item, select it, press Open |
| fill_form | 6-13 | fill 2-4 fields (some pre-filled: select all first), set a check box, submit |

A task is an OSWorld task dict; its setup is one step of the project's own type
`sim_scene` (POST /sim/scene with these parameters), its evaluator is OSWorld's
`exact_match` of a `sim_state` result (POST /sim/state) against a rule. Project
extension: the task files written by `write_tasks` carry the oracle under the key
"oracle" (OSWorld ignores unknown keys); the oracle is valid for the screen size in
the scene parameters ("screen"), which /sim/scene checks.

    tasks = generate_tasks("fill_form", n=16, seed=0)
    arpo-envs sim-tasks --out /tmp/sim_tasks -n 16
"""

from __future__ import annotations

import json
import math
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arpo_envs.sim.desktop import Desktop
from arpo_envs.sim.widgets import (
    Button,
    Checkbox,
    Label,
    ListBox,
    Menu,
    MenuBar,
    TextField,
    Theme,
    Widget,
    Window,
)

TASK_NAMESPACE = uuid.UUID("5f0c6a9e-2b1d-4c57-9a43-0d6e1f7b8a21")
MIN_SCREEN = (640, 480)
AGENT_SCROLL_CLICKS = 5
"""Wheel clicks of one scroll action of the agent's action space (UI-TARS `scroll` has a
direction, no amount; the reference sends 5 clicks): oracle scrolls are multiples of it."""

BUTTON_WORDS = [
    "Save",
    "Open",
    "Close",
    "Export",
    "Print",
    "Share",
    "Refresh",
    "Delete",
    "Rename",
    "Upload",
    "Download",
    "Archive",
    "Settings",
    "Help",
    "Send",
    "Undo",
    "Redo",
    "Copy",
    "Paste",
    "Import",
    "Sync",
    "Publish",
    "Preview",
    "Search",
    "Filter",
    "Sort",
    "Merge",
    "Split",
    "Lock",
    "Unlock",
    "Connect",
    "Restart",
    "Backup",
    "Restore",
    "Approve",
    "Reject",
]
MENUS = {
    "File": ["New", "Open...", "Open Recent", "Save", "Save As...", "Export", "Print...", "Close"],
    "Edit": ["Undo", "Redo", "Cut", "Copy", "Paste", "Select All", "Find...", "Replace..."],
    "View": ["Zoom In", "Zoom Out", "Full Screen", "Sidebar", "Status Bar", "Rulers"],
    "Insert": ["Image...", "Table...", "Chart", "Link...", "Page Break", "Comment"],
    "Format": ["Bold", "Italic", "Underline", "Align Left", "Align Center", "Bullets"],
    "Tools": ["Spelling", "Word Count", "Macros", "Options...", "Extensions"],
    "Help": ["Documentation", "Shortcuts", "Report a Bug", "About"],
}
FIRST = [
    "Alice",
    "Bruno",
    "Chen",
    "Dana",
    "Emeka",
    "Farah",
    "Goran",
    "Hana",
    "Ivan",
    "Jun",
    "Kira",
    "Luis",
    "Mei",
    "Nadia",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tariq",
]
LAST = [
    "Smith",
    "Okafor",
    "Novak",
    "Tanaka",
    "Garcia",
    "Mueller",
    "Haddad",
    "Kowalski",
    "Silva",
    "Nguyen",
    "Rossi",
    "Larsen",
    "Ito",
    "Moreau",
    "Patel",
    "Berg",
]
CITIES = [
    "Lisbon",
    "Nairobi",
    "Osaka",
    "Quito",
    "Tallinn",
    "Hobart",
    "Lyon",
    "Pune",
    "Bergen",
    "Cusco",
    "Dakar",
    "Graz",
    "Krakow",
    "Leeds",
    "Malmo",
    "Porto",
]
COMPANIES = ["Acme", "Globex", "Initech", "Umbrella", "Hooli", "Vandelay", "Stark", "Wayne"]
ADJECTIVES = [
    "quiet",
    "amber",
    "rapid",
    "hidden",
    "silver",
    "early",
    "bright",
    "northern",
    "gentle",
    "frozen",
    "lucky",
    "hollow",
]
NOUNS = [
    "harbor",
    "report",
    "garden",
    "ticket",
    "meadow",
    "invoice",
    "lantern",
    "summit",
    "budget",
    "signal",
    "canvas",
    "orbit",
]
PROJECTS = ["Apollo", "Borealis", "Cobalt", "Delta", "Ember", "Falcon", "Granite", "Helix"]
ACTIONS = ["Delete", "Archive", "Reset", "Publish", "Duplicate", "Export"]
EXTENSIONS = [".txt", ".csv", ".pdf", ".png", ".odt", ".xlsx", ".md"]


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """What a family returns for one seed."""

    family: str
    seed: int
    instruction: str
    path: str
    """Dotted path under /sim/state whose value the checker compares."""
    expected: Any
    oracle: list[str]
    """pyautogui code strings, one agent action each, that solve the task from a fresh scene."""
    screen: tuple[int, int]

    @property
    def task_id(self) -> str:
        w, h = self.screen
        return str(uuid.uuid5(TASK_NAMESPACE, f"{self.family}/{self.seed}/{w}x{h}"))

    def to_task(self, with_oracle: bool = True) -> dict[str, Any]:
        """The OSWorld task dict (plus the project's "oracle" key when `with_oracle`)."""
        task: dict[str, Any] = {
            "id": self.task_id,
            "snapshot": "arpo-sim",
            "instruction": self.instruction,
            "source": "arpo-sim",
            "config": [
                {
                    "type": "sim_scene",
                    "parameters": {
                        "family": self.family,
                        "seed": self.seed,
                        "screen": list(self.screen),
                    },
                }
            ],
            "trajectory": "trajectories/",
            "related_apps": ["arpo-sim"],
            "evaluator": {
                "func": "exact_match",
                "result": {"type": "sim_state", "path": self.path},
                "expected": {"type": "rule", "rules": {"expected": self.expected}},
            },
        }
        if with_oracle:
            task["oracle"] = list(self.oracle)
        return task


# ---- oracle code -----------------------------------------------------------------------------


def _click(p: Widget | tuple[int, int], double: bool = False) -> str:
    x, y = p.center if isinstance(p, Widget) else p
    return f"pyautogui.{'doubleClick' if double else 'click'}({x}, {y})"


def _write(text: str) -> str:
    return f"pyautogui.write({text!r})"


# ---- layout helpers --------------------------------------------------------------------------


def _window(desk: Desktop, rng: random.Random, wid: str, title: str, w: int, h: int) -> Window:
    """A window of w x h (shrunk to the screen) at a random position below the top panel."""
    w = min(w, desk.width - 20)
    h = min(h, desk.height - Theme.panel_h - 20)
    x = rng.randint(10, desk.width - w - 10)
    y = rng.randint(Theme.panel_h + 10, desk.height - h - 10)
    return Window(wid, x, y, w, h, title)


def _record(key: str, value: Any) -> Callable[[Desktop, Widget], None]:
    def append(desk: Desktop, _w: Widget) -> None:
        desk.state[key].append(value)

    return append


def _button_grid(desk: Desktop, rng: random.Random, labels: list[str], title: str) -> Window:
    cols = 3 if len(labels) <= 6 else 4
    rows = math.ceil(len(labels) / cols)
    bw, bh, gap = 124, 34, 14
    win = _window(
        desk,
        rng,
        "win",
        title,
        cols * (bw + gap) + 2 * 24 - gap,
        Theme.title_h + 56 + rows * (bh + gap) + 10,
    )
    win.children.append(Label("caption", win.x + 24, win.body_y + 12, win.w - 48, 24, "Actions:"))
    for i, label in enumerate(labels):
        r, c = divmod(i, cols)
        bx = win.x + 24 + c * (bw + gap)
        by = win.body_y + 48 + r * (bh + gap)
        win.children.append(
            Button(f"button_{i}", bx, by, bw, bh, label, on_press=_record("clicked", label))
        )
    return win


# ---- families --------------------------------------------------------------------------------


def _click_button(desk: Desktop, rng: random.Random) -> tuple[str, str, Any, list[str]]:
    labels = rng.sample(BUTTON_WORDS, rng.randint(4, 9))
    target = rng.randrange(len(labels))
    win = _button_grid(desk, rng, labels, rng.choice(["Toolbox", "Actions", "Quick tasks"]))
    desk.state["clicked"] = []
    desk.add_window(win)
    instruction = f"Click the button labelled '{labels[target]}'."
    return instruction, "clicked", [labels[target]], [_click(win.children[1 + target])]


def _click_sequence(desk: Desktop, rng: random.Random) -> tuple[str, str, Any, list[str]]:
    labels = rng.sample(BUTTON_WORDS, rng.randint(5, 9))
    order = rng.sample(range(len(labels)), rng.randint(2, 4))
    win = _button_grid(desk, rng, labels, "Control panel")
    desk.state["clicked"] = []
    desk.add_window(win)
    names = [labels[i] for i in order]
    listed = ", ".join(f"'{n}'" for n in names[:-1]) + f" and then '{names[-1]}'"
    instruction = f"Click the buttons {listed}, in this order, each once."
    return instruction, "clicked", names, [_click(win.children[1 + i]) for i in order]


def _phrase(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        return f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
    if kind == 1:
        return f"{rng.choice(NOUNS)}-{rng.randint(10, 999)}"
    return f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} {rng.randint(2, 99)}"


def _type_submit(desk: Desktop, rng: random.Random) -> tuple[str, str, Any, list[str]]:
    title, prompt, name = rng.choice(
        [
            ("Search", "Search for:", "Search"),
            ("Rename item", "New name:", "Name"),
            ("New tag", "Tag:", "Tag"),
            ("Quick note", "Note:", "Note"),
        ]
    )
    text = _phrase(rng)
    win = _window(desk, rng, "win", title, 460, Theme.title_h + 130)
    field = TextField("text", win.x + 24, win.body_y + 50, win.w - 48, 32, name)
    submit = Button(
        "submit", win.x + win.w - 24 - 110, win.body_y + 94, 110, 32, "Submit", primary=True
    )

    def do_submit(d: Desktop, _w: Widget) -> None:
        d.state["submitted"] = {"text": field.value, "count": d.state["submissions"] + 1}
        d.state["submissions"] += 1

    field.on_enter = do_submit
    submit.on_press = do_submit
    win.children += [Label("prompt", win.x + 24, win.body_y + 14, 300, 24, prompt), field, submit]
    desk.state["submitted"] = None
    desk.state["submissions"] = 0
    desk.add_window(win)
    instruction = f"Type '{text}' into the {name.lower()} field and submit it."
    return (
        instruction,
        "submitted.text",
        text,
        [_click(field), _write(text), "pyautogui.press('enter')"],
    )


def _menu_pick(desk: Desktop, rng: random.Random) -> tuple[str, str, Any, list[str]]:
    titles = [
        "File",
        "Edit",
        *rng.sample(["View", "Insert", "Format", "Tools"], rng.randint(1, 3)),
        "Help",
    ]
    menus = [Menu(t, rng.sample(MENUS[t], min(len(MENUS[t]), rng.randint(4, 7)))) for t in titles]
    doc = f"{rng.choice(NOUNS)}_{rng.randint(1, 99)}.odt"
    win = _window(desk, rng, "win", f"{doc} - Writer", 640, 380)

    def pick(d: Desktop, choice: str) -> None:
        d.state["picked"].append(choice)

    bar = MenuBar(
        "menubar", win.x + 1, win.body_y + 1, win.w - 2, 28, "", menus=menus, on_pick=pick
    )
    win.children += [bar, Label("body", win.x + 30, win.body_y + 60, 400, 24, f"Editing {doc}")]
    m = rng.randrange(len(menus))
    item = rng.randrange(len(menus[m].items))
    choice = f"{menus[m].title} > {menus[m].items[item]}"
    desk.state["picked"] = []
    desk.add_window(win)
    tx, ty, tw, th = bar.title_boxes()[m]
    oracle = [_click((tx + tw // 2, ty + th // 2)), _click(bar.item_center(m, item))]
    return f"Choose {choice} from the menu bar.", "picked", [choice], oracle


def _dialog_geometry(desk: Desktop) -> tuple[int, int, int, int]:
    w, h = 400, Theme.title_h + 120
    return (desk.width - w) // 2, (desk.height - h) // 2, w, h


def _dialog_confirm(desk: Desktop, rng: random.Random) -> tuple[str, str, Any, list[str]]:
    project = rng.choice(PROJECTS)
    actions = rng.sample(ACTIONS, 3)
    target = rng.randrange(3)
    win = _window(desk, rng, "win", "Projects", 470, Theme.title_h + 150)
    win.children.append(Label("name", win.x + 24, win.body_y + 16, 400, 24, f"Project: {project}"))
    dx, dy, dw, dh = _dialog_geometry(desk)
    ok_box = (dx + dw - 24 - 96, dy + dh - 52, 96, 32)
    cancel_box = (ok_box[0] - 12 - 96, ok_box[1], 96, 32)

    def open_dialog(action: str) -> Callable[[Desktop, Widget], None]:
        def on_press(d: Desktop, _w: Widget) -> None:
            dialog = Window("dialog", dx, dy, dw, dh, f"{action} project?", modal=True)

            def close(result: str) -> Callable[[Desktop, Widget], None]:
                def done(d2: Desktop, _w2: Widget) -> None:
                    d2.state[result].append(action)
                    d2.close_window(dialog)

                return done

            ok = Button("dialog_ok", *ok_box, "OK", on_press=close("confirmed"), primary=True)
            cancel = Button("dialog_cancel", *cancel_box, "Cancel", on_press=close("cancelled"))
            question = f"{action} '{project}'? This cannot be undone."
            dialog.children += [
                Label("dialog_text", dx + 24, dy + Theme.title_h + 18, dw - 48, 24, question),
                cancel,
                ok,
            ]
            dialog.default, dialog.on_cancel = ok, close("cancelled")
            d.add_window(dialog, focus=ok)

        return on_press

    for i, action in enumerate(actions):
        win.children.append(
            Button(
                f"action_{i}",
                win.x + 24 + i * 140,
                win.body_y + 70,
                126,
                34,
                f"{action}...",
                on_press=open_dialog(action),
            )
        )
    desk.state["confirmed"], desk.state["cancelled"] = [], []
    desk.add_window(win)
    action = actions[target]
    oracle = [_click(win.children[1 + target]), _click((ok_box[0] + 48, ok_box[1] + 16))]
    instruction = f"{action} the project '{project}' and confirm when asked."
    return instruction, "confirmed", [action], oracle


def _list_select(desk: Desktop, rng: random.Random) -> tuple[str, str, Any, list[str]]:
    n = rng.randint(20, 60)
    names = sorted(
        {
            f"{rng.choice(ADJECTIVES)}_{rng.choice(NOUNS)}_{rng.randint(1, 99)}{rng.choice(EXTENSIONS)}"
            for _ in range(n)
        }
    )
    rows = rng.randint(15, 18)
    win = _window(desk, rng, "win", "Open file", 440, Theme.title_h + rows * 26 + 112)
    rows = min(rows, (win.h - Theme.title_h - 112) // 26)  # the window shrinks to the screen
    # One scroll action of the agent moves at most a screenful of rows, so every item can
    # be scrolled into view by whole actions.
    lst = ListBox(
        "files",
        win.x + 20,
        win.body_y + 44,
        win.w - 40,
        rows * 26 + 2,
        "Files",
        items=names,
        rows_per_click=max(1, rows // AGENT_SCROLL_CLICKS),
    )
    open_btn = Button(
        "open", win.x + win.w - 20 - 100, lst.y + lst.h + 14, 100, 32, "Open", primary=True
    )
    cancel = Button("cancel", open_btn.x - 12 - 100, open_btn.y, 100, 32, "Cancel")

    def do_open(d: Desktop, _w: Widget) -> None:
        if lst.selected is not None:
            d.state["opened"] = lst.items[lst.selected]

    lst.on_open = do_open
    open_btn.on_press = do_open
    win.children += [
        Label("hint", win.x + 20, win.body_y + 10, 300, 24, "Choose a file:"),
        lst,
        cancel,
        open_btn,
    ]
    desk.state["opened"] = None
    desk.add_window(win)
    # mostly below the first screenful, so the agent has to scroll
    t = (
        rng.randrange(len(names))
        if rng.random() < 0.25
        else rng.randrange(min(rows, len(names) - 1), len(names))
    )
    oracle: list[str] = []
    if t >= lst.visible_rows:
        # Whole scroll actions of the agent (AGENT_SCROLL_CLICKS wheel clicks each): the
        # oracle's scroll is one the agent can make, and its click lands where the row is.
        per_action = AGENT_SCROLL_CLICKS * lst.rows_per_click  # <= lst.visible_rows
        actions = math.ceil((t - lst.visible_rows + 1) / per_action)
        clicks = actions * AGENT_SCROLL_CLICKS
        oracle.append(f"pyautogui.scroll({-clicks}, x={lst.center[0]}, y={lst.center[1]})")
        top = min(actions * per_action, lst.max_top)
    else:
        top = 0
    row = (lst.x + (lst.w - lst.bar_w) // 2, lst.y + 1 + (t - top) * lst.row_h + lst.row_h // 2)
    oracle += [_click(row), _click(open_btn)]
    return f"Open the file '{names[t]}' from the list.", "opened", names[t], oracle


FORM_FIELDS = {
    "name": ("Full name", lambda r: f"{r.choice(FIRST)} {r.choice(LAST)}"),
    "email": ("Email", lambda r: f"{r.choice(FIRST).lower()}.{r.randint(1, 99)}@example.org"),
    "city": ("City", lambda r: r.choice(CITIES)),
    "phone": ("Phone", lambda r: f"+1 555 {r.randint(100, 999)} {r.randint(1000, 9999)}"),
    "company": ("Company", lambda r: r.choice(COMPANIES)),
    "zip": ("Zip code", lambda r: f"{r.randint(10000, 99999)}"),
}
CHECKBOXES = {
    "newsletter": "Subscribe to the newsletter",
    "terms": "I accept the terms",
    "remember": "Remember me on this computer",
}


def _fill_form(desk: Desktop, rng: random.Random) -> tuple[str, str, Any, list[str]]:
    keys = rng.sample(list(FORM_FIELDS), rng.randint(2, 4))
    box_key = rng.choice(list(CHECKBOXES))
    title = rng.choice(["Sign up", "Shipping details", "Contact", "New account"])
    row_h = 46
    win = _window(desk, rng, "win", title, 520, Theme.title_h + 24 + len(keys) * row_h + 110)
    values = {k: FORM_FIELDS[k][1](rng) for k in keys}
    fields: list[TextField] = []
    for i, k in enumerate(keys):
        label, _ = FORM_FIELDS[k]
        y = win.body_y + 20 + i * row_h
        prefill = FORM_FIELDS[k][1](rng) if rng.random() < 0.35 else ""
        win.children.append(Label(f"label_{k}", win.x + 24, y, 120, 32, f"{label}:"))
        fields.append(TextField(k, win.x + 150, y, win.w - 174, 32, label, value=prefill))
        win.children.append(fields[-1])
    by = win.body_y + 20 + len(keys) * row_h
    box = Checkbox(
        box_key, win.x + 150, by, 320, 28, CHECKBOXES[box_key], checked=rng.random() < 0.5
    )
    want_checked = rng.random() < 0.5
    submit = Button("submit", win.x + win.w - 24 - 110, by + 46, 110, 32, "Submit", primary=True)

    def do_submit(d: Desktop, _w: Widget) -> None:
        d.state["submitted"] = {**{f.wid: f.value for f in fields}, box_key: box.checked}

    submit.on_press = do_submit
    for f in fields:
        f.on_enter = do_submit
    win.children += [box, submit]
    desk.state["submitted"] = None
    desk.add_window(win)
    oracle: list[str] = []
    for f in fields:
        oracle.append(_click(f))
        if f.value:
            oracle.append("pyautogui.hotkey('ctrl', 'a')")
        oracle.append(_write(values[f.wid]))
    if box.checked != want_checked:
        oracle.append(_click((box.x + 11, box.center[1])))
    oracle.append(_click(submit))
    parts = "; ".join(f"{FORM_FIELDS[k][0]}: '{values[k]}'" for k in keys)
    state = "checked" if want_checked else "unchecked"
    instruction = (
        f"Fill in the '{title}' form with {parts}. Make sure '{CHECKBOXES[box_key]}' is "
        f"{state}, then press Submit."
    )
    return instruction, "submitted", {**values, box_key: want_checked}, oracle


FAMILIES: dict[str, Callable[[Desktop, random.Random], tuple[str, str, Any, list[str]]]] = {
    "click_button": _click_button,
    "click_sequence": _click_sequence,
    "type_submit": _type_submit,
    "menu_pick": _menu_pick,
    "dialog_confirm": _dialog_confirm,
    "list_select": _list_select,
    "fill_form": _fill_form,
}


def load_scene(desk: Desktop, family: str, seed: int) -> TaskSpec:
    """Clear `desk`, build the scene of (family, seed) on it, and return its task."""
    if family not in FAMILIES:
        raise ValueError(f"unknown task family {family!r}; known: {', '.join(FAMILIES)}")
    if desk.width < MIN_SCREEN[0] or desk.height < MIN_SCREEN[1]:
        raise ValueError(
            f"the task scenes need a screen of at least {MIN_SCREEN[0]}x{MIN_SCREEN[1]}"
        )
    desk.clear()
    desk.scene = {"family": family, "seed": seed}
    rng = random.Random(f"{family}:{seed}")
    instruction, path, expected, oracle = FAMILIES[family](desk, rng)
    return TaskSpec(family, seed, instruction, path, expected, oracle, (desk.width, desk.height))


def generate_tasks(
    family: str, n: int, seed: int = 0, screen: tuple[int, int] = (1280, 720)
) -> list[dict[str, Any]]:
    """`n` OSWorld-schema task dicts of `family` (each with its "oracle"), reproducible from `seed`."""
    if family not in FAMILIES:
        raise ValueError(f"unknown task family {family!r}; known: {', '.join(FAMILIES)}")
    rng = random.Random(f"tasks:{family}:{seed}")
    seeds: list[int] = []
    while len(seeds) < n:
        s = rng.randrange(2**31)
        if s not in seeds:
            seeds.append(s)
    desk = Desktop(*screen)
    return [load_scene(desk, family, s).to_task() for s in seeds]


def write_tasks(
    out: Path, families: list[str], n: int, seed: int = 0, screen: tuple[int, int] = (1280, 720)
) -> dict[str, list[str]]:
    """Write `out/<family>/<id>.json` for every task and `out/test_all.json` (family -> ids)."""
    index: dict[str, list[str]] = {}
    for family in families:
        (out / family).mkdir(parents=True, exist_ok=True)
        tasks = generate_tasks(family, n, seed, screen)
        for task in tasks:
            (out / family / f"{task['id']}.json").write_text(
                json.dumps(task, indent=2, ensure_ascii=False)
            )
        index[family] = [t["id"] for t in tasks]
    (out / "test_all.json").write_text(json.dumps(index, indent=2))
    return index

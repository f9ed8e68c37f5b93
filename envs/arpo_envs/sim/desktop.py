"""The simulated desktop: windows, focus, menus, mouse and keyboard, drawn with Pillow.

`Desktop` is the whole screen of one environment. Input arrives as the low-level
events pyautogui would produce (`move`, `mouse_down`/`mouse_up`, `click`, `scroll`,
`key_down`/`key_up`, `press`) and is routed like a window system does: an open
menu takes the next click, a modal dialog blocks the windows below it, a click
raises its window and focuses the widget under it, keys go to the focused widget
and fall back to the desktop's bindings (tab cycles focus, enter presses a
dialog's default button, escape closes a menu or cancels a dialog).

Every visible change calls `touch()`, which bumps `version`; `screenshot_png()`
renders only when the version or the cursor moved since the last frame and
re-compresses only the bands of the image that changed (see `arpo_envs.png`).

Task results live in `state`, a JSON-like dict the scene's callbacks fill in;
`lookup("a.b")` reads it (together with every widget's state under `widgets.<id>`)
for checkers.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Any

from PIL import Image, ImageDraw

from arpo_envs.a11y import NS
from arpo_envs.png import BandPngEncoder
from arpo_envs.sim.widgets import ListBox, MenuBar, Theme, Widget, Window, font

# Key names as pyautogui spells them, folded to one name per key.
KEY_ALIASES = {
    "return": "enter",
    "\n": "enter",
    "\r": "enter",
    "esc": "escape",
    "del": "delete",
    "\b": "backspace",
    "\t": "tab",
    " ": "space",
    "ctrlleft": "ctrl",
    "ctrlright": "ctrl",
    "control": "ctrl",
    "shiftleft": "shift",
    "shiftright": "shift",
    "altleft": "alt",
    "altright": "alt",
    "option": "alt",
    "optionleft": "alt",
    "optionright": "alt",
    "command": "meta",
    "win": "meta",
    "winleft": "meta",
    "winright": "meta",
    "super": "meta",
    "pgup": "pageup",
    "pgdn": "pagedown",
    "prior": "pageup",
    "next": "pagedown",
}
MODIFIERS = frozenset({"ctrl", "shift", "alt", "meta"})
NAMED_KEYS = (
    frozenset(
        {"enter", "escape", "delete", "backspace", "tab", "space", "up", "down", "left", "right"}
        | {"home", "end", "pageup", "pagedown", "insert", "capslock", "numlock", "printscreen"}
        | {f"f{i}" for i in range(1, 25)}
    )
    | MODIFIERS
)


def normalize_key(key: str) -> str | None:
    """The canonical name of a pyautogui key, or None for a name pyautogui would ignore."""
    if len(key) == 1 and key not in KEY_ALIASES:
        return key if key.isprintable() else None
    name = KEY_ALIASES.get(key.lower() if len(key) > 1 else key, key.lower())
    return name if name in NAMED_KEYS or len(name) == 1 else None


def _cursor_sprite() -> Image.Image:
    """A 12x19 arrow pointer (black with a white outline), hot spot at its top-left pixel."""
    sprite = Image.new("RGBA", (12, 19), (0, 0, 0, 0))
    d = ImageDraw.Draw(sprite)
    arrow = [(0, 0), (0, 16), (4, 12), (7, 18), (9, 17), (6, 11), (11, 11)]
    d.polygon(arrow, fill=(0, 0, 0, 255), outline=(255, 255, 255, 255))
    return sprite


_CURSOR = _cursor_sprite()


class StatePathError(LookupError):
    """`lookup` found nothing at the path."""


class Desktop:
    """One simulated screen of `width` x `height` pixels."""

    def __init__(self, width: int = 1280, height: int = 720, *, draw_cursor: bool = True):
        self.width = width
        self.height = height
        self.draw_cursor = draw_cursor
        self.encoder = BandPngEncoder()
        self.clear()

    # ---- scene ---------------------------------------------------------------------------

    def clear(self) -> None:
        """An empty desktop: no windows, no focus, cursor in the middle, nothing recorded."""
        self.windows: list[Window] = []
        self.widgets: dict[str, Widget] = {}
        self.focus: Widget | None = None
        self.menu: tuple[MenuBar, int] | None = None
        self.cursor = (self.width // 2, self.height // 2)
        self.mods: set[str] = set()
        self._press: tuple[str, Widget | None] | None = None
        self.clipboard = ""
        self.state: dict[str, Any] = {}
        self.scene: dict[str, Any] = {}
        self.version = getattr(self, "version", 0) + 1
        self._frame: Image.Image | None = None
        self._frame_version = -1
        self._png_key: tuple[Any, ...] | None = None
        self._png = b""

    def touch(self) -> None:
        """Record a visible change (the next screenshot redraws)."""
        self.version += 1

    def add_window(self, win: Window, focus: Widget | None = None) -> Window:
        """Put `win` on top; register its widgets by id; focus `focus` (or nothing)."""
        for w in [win, *win.children]:
            if w.wid in self.widgets and self.widgets[w.wid] is not w:
                raise ValueError(f"duplicate widget id {w.wid!r} in the scene")
            self.widgets[w.wid] = w
        self.windows.append(win)
        self.focus = focus
        self.menu = None
        self.touch()
        return win

    def close_window(self, win: Window) -> None:
        if win not in self.windows:
            return
        self.windows.remove(win)
        for w in [win, *win.children]:
            self.widgets.pop(w.wid, None)
        if self.focus is not None and (self.focus is win or self.focus in win.children):
            self.focus = None
        if self.menu is not None and self.menu[0] in win.children:
            self.menu = None
        self.touch()

    def modal(self) -> Window | None:
        for win in reversed(self.windows):
            if win.modal:
                return win
        return None

    def active_window(self) -> Window | None:
        return self.modal() or (self.windows[-1] if self.windows else None)

    def window_at(self, x: int, y: int) -> Window | None:
        for win in reversed(self.windows):
            if win.contains(x, y):
                return win
        return None

    def widget_at(self, x: int, y: int) -> tuple[Window | None, Widget | None]:
        win = self.window_at(x, y)
        return win, (win.child_at(x, y) if win is not None else None)

    def set_focus(self, w: Widget | None) -> None:
        if w is not self.focus:
            self.focus = w
            self.touch()

    def open_menu(self, bar: MenuBar, index: int) -> None:
        self.menu = None if self.menu == (bar, index) else (bar, index)
        self.touch()

    # ---- mouse ---------------------------------------------------------------------------

    def move(self, x: float, y: float) -> None:
        """Move the pointer (clamped to the screen, like X does)."""
        nx = min(max(int(x), 0), self.width - 1)
        ny = min(max(int(y), 0), self.height - 1)
        if (nx, ny) == self.cursor:
            return
        self.cursor = (nx, ny)
        if self.menu is not None:  # hovering highlights items and switches between menus
            bar, index = self.menu
            other = bar.title_at(nx, ny)
            if other is not None and other != index:
                self.menu = (bar, other)
            self.touch()

    def _target(self, x: int, y: int) -> Widget | None:
        """What a press at (x, y) lands on (for matching a press with its release)."""
        if self.menu is not None:
            return self.menu[0]
        return self.widget_at(x, y)[1]

    def mouse_down(self, button: str, x: float, y: float) -> None:
        self.move(x, y)
        self._press = (button, self._target(*self.cursor))

    def mouse_up(self, button: str, x: float, y: float) -> None:
        """A release over what was pressed is a click; a release elsewhere ends a drag."""
        self.move(x, y)
        press, self._press = self._press, None
        if press is not None and press[0] == button and press[1] is self._target(*self.cursor):
            self.click(*self.cursor, button=button)

    def click(self, x: float, y: float, button: str = "left", count: int = 1) -> None:
        """Press and release at (x, y); `count` is 2 for the second click of a double-click."""
        self.move(x, y)
        x, y = self.cursor
        if button != "left":
            return  # the simulated widgets have no context menus
        if self.menu is not None:
            bar, index = self.menu
            item = bar.item_at(index, x, y)
            if item is not None:
                self.menu = None
                self.touch()
                if bar.on_pick is not None:
                    menu = bar.menus[index]
                    bar.on_pick(self, f"{menu.title} > {menu.items[item]}")
                return
            title = bar.title_at(x, y)
            if title is not None:
                self.open_menu(bar, title)
                return
            self.menu = None  # a click outside an open menu only closes it
            self.touch()
            return
        win = self.window_at(x, y)
        if win is None:
            return
        modal = self.modal()
        if modal is not None and win is not modal:
            return  # the dialog blocks the windows below it
        if win is not self.windows[-1]:
            self.windows.remove(win)
            self.windows.append(win)
            self.touch()
        w = win.child_at(x, y)
        if w is None:
            return
        if w.focusable:
            self.set_focus(w)
        w.click(self, x, y, count)

    def scroll(self, clicks: int, x: float | None = None, y: float | None = None) -> None:
        """Turn the wheel `clicks` notches (positive: up) over the widget under the pointer."""
        if x is not None and y is not None:
            self.move(x, y)
        if self.menu is not None or clicks == 0:
            return
        win, w = self.widget_at(*self.cursor)
        modal = self.modal()
        if w is not None and (modal is None or win is modal):
            w.scroll(self, clicks)

    # ---- keyboard ------------------------------------------------------------------------

    def key_down(self, key: str) -> None:
        name = normalize_key(key)
        if name is None:
            return  # pyautogui ignores key names it does not know
        if name in MODIFIERS:
            self.mods.add(name)
            return
        self._key(name, key if len(key) == 1 else None)

    def key_up(self, key: str) -> None:
        name = normalize_key(key)
        if name in MODIFIERS:
            self.mods.discard(name)

    def press(self, key: str) -> None:
        self.key_down(key)
        self.key_up(key)

    def _key(self, name: str, char: str | None) -> None:
        mods = frozenset(self.mods)
        if self.menu is not None:
            if name == "escape":
                self.menu = None
                self.touch()
            return
        shortcut = name.lower() if len(name) == 1 else name
        w = self.focus
        if w is not None and w.key(self, shortcut, mods):
            return
        typed = " " if name == "space" else char if char is not None and len(name) == 1 else None
        if typed is not None and not mods & {"ctrl", "alt", "meta"}:
            if "shift" in mods:
                typed = typed.upper()
            if w is not None:
                w.text(self, typed)
            return
        active = self.active_window()
        if active is None:
            return
        if name == "tab":
            order = [c for c in active.children if c.focusable]
            if order:
                i = order.index(w) if w in order else -1
                step = -1 if "shift" in mods else 1
                self.set_focus(order[(i + step) % len(order)])
        elif name == "enter" and active.default is not None and not mods:
            active.default.press(self)
        elif name == "escape" and active.on_cancel is not None:
            active.on_cancel(self, active)

    def type_text(self, text: str) -> None:
        """pyautogui.write: one press per character."""
        for ch in text:
            self.press(ch)

    # ---- output --------------------------------------------------------------------------

    def render(self) -> Image.Image:
        """The screen without the pointer (cached until the next `touch`)."""
        if self._frame is not None and self._frame_version == self.version:
            return self._frame
        t = Theme
        im = Image.new("RGB", (self.width, self.height), t.desktop)
        d = ImageDraw.Draw(im)
        d.rectangle((0, 0, self.width - 1, t.panel_h - 1), fill=t.panel)
        d.text((14, t.panel_h / 2), "Activities", font=font(), fill=t.panel_text, anchor="lm")
        d.text(
            (self.width / 2, t.panel_h / 2),
            "Thu 09:41",
            font=font(),
            fill=t.panel_text,
            anchor="mm",
        )
        active = self.active_window()
        open_bar, open_index = self.menu if self.menu is not None else (None, None)
        for win in self.windows:
            win.draw_frame(d, active=win is active)
            for c in win.children:
                if isinstance(c, MenuBar):
                    c.draw(d, False, open_index if c is open_bar else None)
                else:
                    c.draw(d, c is self.focus)
        if open_bar is not None and open_index is not None:
            open_bar.draw_dropdown(d, open_index, self.cursor)
        self._frame, self._frame_version = im, self.version
        return im

    def cached_png(self) -> bytes | None:
        """The last screenshot if nothing changed since (no rendering needed), else None."""
        key = (self.version, self.cursor if self.draw_cursor else None)
        return self._png if key == self._png_key else None

    def screenshot_png(self) -> bytes:
        """PNG bytes of the screen with the pointer; cached while nothing changes."""
        key = (self.version, self.cursor if self.draw_cursor else None)
        if key == self._png_key:
            return self._png
        frame = self.render()
        if not self.draw_cursor:
            self._png = self.encoder.encode(frame)
        else:
            # draw the pointer into the cached frame and take it out again after encoding:
            # cheaper than copying the whole frame
            x, y = self.cursor
            under = frame.crop((x, y, x + _CURSOR.width, y + _CURSOR.height))
            frame.paste(_CURSOR, (x, y), _CURSOR)
            try:
                self._png = self.encoder.encode(frame)
            finally:
                frame.paste(under, (x, y))
        self._png_key = key
        return self._png

    def accessibility_xml(self) -> str:
        """The widget tree as XML in the shape of OSWorld's Ubuntu tree (`desktop-frame` root).

        Every node has a `name`, its role as tag, its box (`cp:screencoord`, `cp:size`) and
        its states (`st:`); entries and labels carry their text. The states say what a click
        does, so the nodes OSWorld's filter keeps (`arpo.env.a11y`) are those a click at
        their centre reaches (while a menu is open, a click outside it only closes it):
        - `showing` is false for a node whose centre is under a window above its own or
          under the open menu (a real AT-SPI tree has no occlusion; the simulated screen
          says what it draws);
        - the widgets of the windows below a modal dialog are not `enabled` (they take no
          input, as if insensitive);
        - an open menu's drop-down is an unnamed popup (tag `menu`) holding its items; its
          title in the menu bar is `expanded` and `selected`;
        - list rows scrolled out of view are not `showing` (box x, -1, w, 0).
        """
        st, cp = NS["st"], NS["cp"]  # OSWorld's, so its tree tools read ours

        def node(
            parent: ET.Element,
            role: str,
            name: str,
            box: tuple[int, int, int, int],
            states: dict[str, str],
            text: str | None = None,
        ) -> ET.Element:
            el = ET.SubElement(parent, role, {"name": name})
            el.set(f"{{{cp}}}screencoord", f"({box[0]}, {box[1]})")
            el.set(f"{{{cp}}}size", f"({box[2]}, {box[3]})")
            for k, v in states.items():
                el.set(f"{{{st}}}{k}", v)
            if text:
                el.text = text
            return el

        # what is drawn over the windows' nodes: the windows above theirs, then an open menu
        popup = None
        if self.menu is not None:
            popup = Widget("menu-popup", *self.menu[0].dropdown_box(self.menu[1]))

        def states(
            box: tuple[int, int, int, int], above: list[Widget], enabled: bool = True
        ) -> dict[str, str]:
            """`showing` unless the centre of `box` is under one of `above`; `enabled` as given."""
            cx, cy = box[0] + box[2] // 2, box[1] + box[3] // 2
            showing = not any(w.contains(cx, cy) for w in above)
            on = str(enabled).lower()
            return {
                "showing": str(showing).lower(),
                "visible": "true",
                "enabled": on,
                "sensitive": on,
            }

        root = ET.Element("desktop-frame")
        app = ET.SubElement(root, "application", {"name": "arpo-sim"})
        active = self.active_window()
        modal = self.modal()
        for level, win in enumerate(self.windows):
            above: list[Widget] = [*self.windows[level + 1 :], *([popup] if popup else [])]
            live = modal is None or win is modal  # a modal dialog blocks every other window
            role, extra, _ = win.a11y()
            frame_states = {"showing": "true", "visible": "true", "enabled": "true"}
            frame_states["active"] = str(win is active).lower()
            frame = node(app, role, win.label, win.box, frame_states)
            for c in win.children:
                role, extra, text = c.a11y()
                flags = states(c.box, above, live)
                if c.focusable:
                    flags["focusable"] = "true"
                    flags["focused"] = str(c is self.focus).lower()
                flags.update(extra)
                el = node(frame, role, c.label, c.box, flags, text)
                if isinstance(c, MenuBar):
                    opened = self.menu[1] if self.menu is not None and self.menu[0] is c else None
                    for i, (box, m) in enumerate(zip(c.title_boxes(), c.menus, strict=True)):
                        title = {**states(box, above, live), "expandable": "true"}
                        if i == opened:
                            title.update(expanded="true", selected="true")
                        node(el, "menu", m.title, box, title)
                elif isinstance(c, ListBox):
                    for i, item in enumerate(c.items):
                        row = c.row_box(i)
                        rst = states(row, above, live) if row else {"showing": "false"}
                        rst.update(visible="true", enabled=str(live).lower())
                        if c.selected == i:
                            rst["selected"] = "true"
                        node(el, "list-item", item, row or (c.x, -1, c.w, 0), rst)
        if self.menu is not None and popup is not None:
            bar, index = self.menu
            el = node(app, "menu", "", popup.box, states(popup.box, []))
            for j, item in enumerate(bar.menus[index].items):
                cy = bar.item_center(index, j)[1]
                box = (popup.x, cy - bar.item_h // 2, popup.w, bar.item_h)
                node(el, "menu-item", item, box, states(box, []))
        return ET.tostring(root, encoding="unicode")

    def state_tree(self) -> dict[str, Any]:
        """Everything a checker may read: the task's results plus the live widget states."""
        return {
            **self.state,
            "scene": dict(self.scene),
            "focus": self.focus.wid if self.focus is not None else None,
            "cursor": list(self.cursor),
            "clipboard": self.clipboard,
            "menu_open": self.menu[0].menus[self.menu[1]].title if self.menu else None,
            "windows": [w.label for w in self.windows],
            "widgets": {wid: w.state() for wid, w in self.widgets.items()},
        }

    def lookup(self, path: str) -> Any:
        """The value at dotted `path` ("submitted.text", "widgets.name.value", "clicked.0").

        Walking through a None yields None (a result not produced yet); a name that does not
        exist raises StatePathError.
        """
        value: Any = self.state_tree()
        for i, part in enumerate(path.split(".") if path else []):
            if value is None:
                return None
            if isinstance(value, dict) and part in value:
                value = value[part]
            elif (
                isinstance(value, list)
                and part.lstrip("-").isdigit()
                and -len(value) <= int(part) < len(value)
            ):
                value = value[int(part)]
            else:
                where = ".".join(path.split(".")[:i]) or "the root"
                keys = sorted(value) if isinstance(value, dict) else f"a {type(value).__name__}"
                raise StatePathError(f"no state at {path!r}: {part!r} is not in {where} ({keys})")
        return value

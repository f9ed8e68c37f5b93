"""The widgets of the simulated desktop: geometry, drawing, and how each reacts to input.

Every widget is a rectangle in screen coordinates with an id unique in its scene.
It draws itself with Pillow, reports its state for checkers (`state()`) and its
accessibility node (`a11y()`), and reacts to the input the desktop routes to it:
`click` (with the click count of a multi-click), `key` (a pyautogui key name with
the held modifiers), `text` (one typed character) and `scroll`. Reactions that
matter to a task (a button pressed, a form submitted, a menu item picked) call the
callback the scene builder attached; the desktop owns focus, menus and windows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from PIL import ImageDraw, ImageFont

from arpo_envs.sim.host import WidgetHost

Color = tuple[int, int, int]


class Theme:
    """Colours and metrics of the simulated desktop (a light GTK-like look)."""

    desktop: Color = (48, 63, 84)
    panel: Color = (28, 28, 30)
    panel_text: Color = (235, 235, 235)
    window: Color = (246, 246, 246)
    window_border: Color = (150, 150, 150)
    shadow: Color = (30, 40, 55)
    title_active: Color = (222, 222, 226)
    title_inactive: Color = (238, 238, 238)
    text: Color = (30, 30, 30)
    text_dim: Color = (120, 120, 120)
    button: Color = (232, 232, 234)
    button_border: Color = (160, 160, 165)
    accent: Color = (53, 132, 228)
    accent_text: Color = (255, 255, 255)
    field: Color = (255, 255, 255)
    field_border: Color = (175, 175, 180)
    list_alt: Color = (248, 248, 250)
    menu: Color = (252, 252, 252)
    font_size: int = 14
    title_h: int = 30
    panel_h: int = 28


@functools.lru_cache(maxsize=8)
def font(size: int = Theme.font_size) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """Pillow's bundled font at `size` (the same glyphs on every machine)."""
    return ImageFont.load_default(size=size)


def text_width(s: str, size: int = Theme.font_size) -> float:
    return font(size).getlength(s)


def draw_text_centered(
    d: ImageDraw.ImageDraw, box: tuple[int, int, int, int], s: str, color: Color
) -> None:
    x, y, w, h = box
    d.text((x + w / 2, y + h / 2), s, font=font(), fill=color, anchor="mm")


Callback = Callable[[Any, "Widget"], None]
"""A scene's reaction to a widget: called with the desktop (the widget's host) and the widget."""


@dataclass(eq=False)
class Widget:
    """A rectangle on screen with an id; the base of every control."""

    wid: str
    x: int
    y: int
    w: int
    h: int
    label: str = ""

    role: ClassVar[str] = "panel"
    focusable: ClassVar[bool] = False

    def contains(self, px: int, py: int) -> bool:
        return self.x <= px < self.x + self.w and self.y <= py < self.y + self.h

    @property
    def center(self) -> tuple[int, int]:
        return self.x + self.w // 2, self.y + self.h // 2

    @property
    def box(self) -> tuple[int, int, int, int]:
        return self.x, self.y, self.w, self.h

    def draw(self, d: ImageDraw.ImageDraw, focused: bool) -> None:
        pass

    def click(self, desk: WidgetHost, px: int, py: int, count: int) -> None:
        pass

    def key(self, desk: WidgetHost, key: str, mods: frozenset[str]) -> bool:
        """Handle a key press; False lets the desktop try its own bindings."""
        return False

    def text(self, desk: WidgetHost, ch: str) -> None:
        pass

    def scroll(self, desk: WidgetHost, clicks: int) -> bool:
        return False

    def state(self) -> dict[str, Any]:
        return {"label": self.label}

    def a11y(self) -> tuple[str, dict[str, str], str | None]:
        """(role, extra attributes, text) of the accessibility node."""
        return self.role, {}, None


@dataclass(eq=False)
class Label(Widget):
    """Static text."""

    size: int = Theme.font_size
    color: Color = Theme.text
    role: ClassVar[str] = "label"

    def draw(self, d: ImageDraw.ImageDraw, focused: bool) -> None:
        d.text(
            (self.x, self.y + self.h / 2),
            self.label,
            font=font(self.size),
            fill=self.color,
            anchor="lm",
        )

    def a11y(self) -> tuple[str, dict[str, str], str | None]:
        return self.role, {}, self.label  # a GTK label's text is its label


@dataclass(eq=False)
class Button(Widget):
    """A push button; a click (or space/enter while focused) calls `on_press`."""

    on_press: Callback | None = None
    primary: bool = False
    presses: int = 0
    role: ClassVar[str] = "push-button"
    focusable: ClassVar[bool] = True

    def press(self, desk: WidgetHost) -> None:
        self.presses += 1
        desk.touch()
        if self.on_press is not None:
            self.on_press(desk, self)

    def click(self, desk: WidgetHost, px: int, py: int, count: int) -> None:
        self.press(desk)

    def key(self, desk: WidgetHost, key: str, mods: frozenset[str]) -> bool:
        if key in ("space", "enter") and not mods:
            self.press(desk)
            return True
        return False

    def draw(self, d: ImageDraw.ImageDraw, focused: bool) -> None:
        t = Theme
        fill, fg = (t.accent, t.accent_text) if self.primary else (t.button, t.text)
        box = (self.x, self.y, self.x + self.w - 1, self.y + self.h - 1)
        d.rounded_rectangle(box, radius=5, fill=fill, outline=t.button_border)
        if focused:
            d.rounded_rectangle(
                (self.x + 2, self.y + 2, self.x + self.w - 3, self.y + self.h - 3),
                radius=4,
                outline=t.accent if not self.primary else t.accent_text,
            )
        draw_text_centered(d, self.box, self.label, fg)

    def state(self) -> dict[str, Any]:
        return {"label": self.label, "presses": self.presses}


@dataclass(eq=False)
class TextField(Widget):
    """A one-line text entry with a caret and select-all; enter calls `on_enter`.

    `label` is the accessible name (drawn as a placeholder while empty).
    """

    value: str = ""
    caret: int = 0
    selected_all: bool = False
    on_enter: Callback | None = None
    role: ClassVar[str] = "entry"
    focusable: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.caret = len(self.value)

    def _caret_from_x(self, px: int) -> int:
        rel = px - (self.x + 8)
        for i in range(len(self.value) + 1):
            if text_width(self.value[:i]) >= rel:
                return i
        return len(self.value)

    def click(self, desk: WidgetHost, px: int, py: int, count: int) -> None:
        if count >= 2:
            self.selected_all = bool(self.value)  # word and line selection: the whole field
            self.caret = len(self.value)
        else:
            self.selected_all = False
            self.caret = self._caret_from_x(px)
        desk.touch()

    def _replace_selection(self, s: str) -> None:
        if self.selected_all:
            self.value, self.caret, self.selected_all = "", 0, False
        self.value = self.value[: self.caret] + s + self.value[self.caret :]
        self.caret += len(s)

    def text(self, desk: WidgetHost, ch: str) -> None:
        self._replace_selection(ch)
        desk.touch()

    def key(self, desk: WidgetHost, key: str, mods: frozenset[str]) -> bool:
        if "ctrl" in mods:
            if key == "a":
                self.selected_all = bool(self.value)
                self.caret = len(self.value)
            elif key in ("c", "x") and self.selected_all:
                desk.clipboard = self.value
                if key == "x":
                    self._replace_selection("")
            elif key == "v":
                self._replace_selection(desk.clipboard)
            else:
                return False
            desk.touch()
            return True
        if key == "enter":
            if self.on_enter is not None:
                self.on_enter(desk, self)
            return self.on_enter is not None
        if key == "backspace":
            if self.selected_all:
                self._replace_selection("")
            elif self.caret > 0:
                self.value = self.value[: self.caret - 1] + self.value[self.caret :]
                self.caret -= 1
        elif key == "delete":
            if self.selected_all:
                self._replace_selection("")
            else:
                self.value = self.value[: self.caret] + self.value[self.caret + 1 :]
        elif key in ("left", "home"):
            self.caret = 0 if key == "home" or self.selected_all else max(0, self.caret - 1)
            self.selected_all = False
        elif key in ("right", "end"):
            end = key == "end" or self.selected_all
            self.caret = len(self.value) if end else min(len(self.value), self.caret + 1)
            self.selected_all = False
        else:
            return False
        desk.touch()
        return True

    def draw(self, d: ImageDraw.ImageDraw, focused: bool) -> None:
        t = Theme
        box = (self.x, self.y, self.x + self.w - 1, self.y + self.h - 1)
        d.rounded_rectangle(
            box,
            radius=4,
            fill=t.field,
            outline=t.accent if focused else t.field_border,
            width=2 if focused else 1,
        )
        tx, ty = self.x + 8, self.y + self.h / 2
        if not self.value and not focused:
            d.text((tx, ty), self.label, font=font(), fill=t.text_dim, anchor="lm")
            return
        shown, offset = self.value, 0
        while shown and text_width(shown) > self.w - 16:  # keep the end of long text visible
            shown, offset = shown[1:], offset + 1
        if self.selected_all and shown:
            wsel = text_width(shown)
            d.rectangle((tx - 1, self.y + 6, tx + wsel + 1, self.y + self.h - 7), fill=t.accent)
            d.text((tx, ty), shown, font=font(), fill=t.accent_text, anchor="lm")
        else:
            d.text((tx, ty), shown, font=font(), fill=t.text, anchor="lm")
        if focused and not self.selected_all:
            cx = tx + text_width(shown[: max(0, self.caret - offset)])
            d.line((cx, self.y + 7, cx, self.y + self.h - 8), fill=t.text, width=1)

    def state(self) -> dict[str, Any]:
        return {"label": self.label, "value": self.value, "selected_all": self.selected_all}

    def a11y(self) -> tuple[str, dict[str, str], str | None]:
        return self.role, {"editable": "true"}, self.value


@dataclass(eq=False)
class Checkbox(Widget):
    """A check box with its label; a click on the box or the label toggles it."""

    checked: bool = False
    on_toggle: Callback | None = None
    role: ClassVar[str] = "check-box"
    focusable: ClassVar[bool] = True

    def toggle(self, desk: WidgetHost) -> None:
        self.checked = not self.checked
        desk.touch()
        if self.on_toggle is not None:
            self.on_toggle(desk, self)

    def click(self, desk: WidgetHost, px: int, py: int, count: int) -> None:
        self.toggle(desk)

    def key(self, desk: WidgetHost, key: str, mods: frozenset[str]) -> bool:
        if key == "space" and not mods:
            self.toggle(desk)
            return True
        return False

    def draw(self, d: ImageDraw.ImageDraw, focused: bool) -> None:
        t = Theme
        s = 18
        bx, by = self.x + 2, self.y + (self.h - s) // 2
        d.rounded_rectangle(
            (bx, by, bx + s, by + s),
            radius=3,
            fill=t.accent if self.checked else t.field,
            outline=t.accent if (self.checked or focused) else t.field_border,
            width=2 if focused else 1,
        )
        if self.checked:
            d.line((bx + 4, by + 9, bx + 8, by + 13, bx + 14, by + 5), fill=t.accent_text, width=2)
        d.text((bx + s + 8, self.y + self.h / 2), self.label, font=font(), fill=t.text, anchor="lm")

    def state(self) -> dict[str, Any]:
        return {"label": self.label, "checked": self.checked}

    def a11y(self) -> tuple[str, dict[str, str], str | None]:
        return self.role, {"checkable": "true", "checked": str(self.checked).lower()}, None


@dataclass(eq=False)
class ListBox(Widget):
    """A scrollable list: click selects, double-click (or enter) opens via `on_open`.

    The wheel scrolls `rows_per_click` rows per click (positive clicks scroll up,
    as in pyautogui); a click on the scroll bar track pages up or down.
    """

    items: list[str] = field(default_factory=list)
    row_h: int = 26
    top: int = 0
    selected: int | None = None
    rows_per_click: int = 3
    on_open: Callback | None = None
    role: ClassVar[str] = "list"
    focusable: ClassVar[bool] = True
    bar_w: ClassVar[int] = 12

    @property
    def visible_rows(self) -> int:
        return max(1, (self.h - 2) // self.row_h)

    @property
    def max_top(self) -> int:
        return max(0, len(self.items) - self.visible_rows)

    def row_center(self, index: int) -> tuple[int, int] | None:
        """Screen point of row `index` at the current scroll position, None if not visible."""
        if not self.top <= index < self.top + self.visible_rows:
            return None
        return self.x + (self.w - self.bar_w) // 2, self.y + 1 + (
            index - self.top
        ) * self.row_h + self.row_h // 2

    def row_box(self, index: int) -> tuple[int, int, int, int] | None:
        """Screen box (x, y, w, h) of row `index` as drawn, the scroll bar left out; None if
        the row is scrolled out of view."""
        if not self.top <= index < self.top + self.visible_rows:
            return None
        return (
            self.x + 1,
            self.y + 1 + (index - self.top) * self.row_h,
            self.w - self.bar_w - 2,
            self.row_h,
        )

    def _set_top(self, top: int) -> None:
        self.top = max(0, min(self.max_top, top))

    def click(self, desk: WidgetHost, px: int, py: int, count: int) -> None:
        if px >= self.x + self.w - self.bar_w:  # scroll bar track: page up or down
            thumb_y, thumb_h = self._thumb()
            if py < thumb_y:
                self._set_top(self.top - self.visible_rows)
            elif py >= thumb_y + thumb_h:
                self._set_top(self.top + self.visible_rows)
            desk.touch()
            return
        index = self.top + (py - self.y - 1) // self.row_h
        if 0 <= index < len(self.items):
            self.selected = index
            if count >= 2 and self.on_open is not None:
                self.on_open(desk, self)
        desk.touch()

    def scroll(self, desk: WidgetHost, clicks: int) -> bool:
        self._set_top(self.top - clicks * self.rows_per_click)
        desk.touch()
        return True

    def key(self, desk: WidgetHost, key: str, mods: frozenset[str]) -> bool:
        n = len(self.items)
        if key in ("up", "down", "home", "end", "pageup", "pagedown") and n:
            cur = -1 if self.selected is None else self.selected
            step = {
                "up": -1,
                "down": 1,
                "pageup": -self.visible_rows,
                "pagedown": self.visible_rows,
            }
            new = 0 if key == "home" else n - 1 if key == "end" else cur + step[key]
            self.selected = max(0, min(n - 1, new))
            if self.selected < self.top:
                self._set_top(self.selected)
            elif self.selected >= self.top + self.visible_rows:
                self._set_top(self.selected - self.visible_rows + 1)
        elif key == "enter" and self.selected is not None and self.on_open is not None:
            self.on_open(desk, self)
        else:
            return False
        desk.touch()
        return True

    def _thumb(self) -> tuple[int, int]:
        track = self.h - 2
        if len(self.items) <= self.visible_rows:
            return self.y + 1, track
        h = max(20, track * self.visible_rows // len(self.items))
        y = self.y + 1 + (track - h) * self.top // max(1, self.max_top)
        return y, h

    def draw(self, d: ImageDraw.ImageDraw, focused: bool) -> None:
        t = Theme
        d.rectangle(
            (self.x, self.y, self.x + self.w - 1, self.y + self.h - 1),
            fill=t.field,
            outline=t.accent if focused else t.field_border,
        )
        for r in range(self.visible_rows):
            i = self.top + r
            if i >= len(self.items):
                break
            ry = self.y + 1 + r * self.row_h
            x1 = self.x + self.w - self.bar_w - 2
            if i == self.selected:
                d.rectangle((self.x + 1, ry, x1, ry + self.row_h - 1), fill=t.accent)
            elif i % 2:
                d.rectangle((self.x + 1, ry, x1, ry + self.row_h - 1), fill=t.list_alt)
            fg = t.accent_text if i == self.selected else t.text
            d.text(
                (self.x + 10, ry + self.row_h / 2), self.items[i], font=font(), fill=fg, anchor="lm"
            )
        bx = self.x + self.w - self.bar_w - 1
        d.rectangle(
            (bx, self.y + 1, self.x + self.w - 2, self.y + self.h - 2), fill=(235, 235, 238)
        )
        ty, th = self._thumb()
        d.rounded_rectangle(
            (bx + 2, ty + 1, self.x + self.w - 4, ty + th - 2), radius=3, fill=(160, 160, 168)
        )

    def state(self) -> dict[str, Any]:
        sel = None if self.selected is None else self.items[self.selected]
        return {"label": self.label, "selected": sel, "top": self.top, "items": len(self.items)}


@dataclass(eq=False)
class Menu:
    """One menu of a menu bar: a title and its items."""

    title: str
    items: list[str]


@dataclass(eq=False)
class MenuBar(Widget):
    """A window's menu bar. A click on a title opens its drop-down (drawn by the desktop on top
    of everything); a click on an item calls `on_pick(desk, "Title > Item")`.
    """

    menus: list[Menu] = field(default_factory=list)
    on_pick: Callable[[Any, str], None] | None = None
    item_h: ClassVar[int] = 28
    pad: ClassVar[int] = 14
    role: ClassVar[str] = "menu-bar"

    def title_boxes(self) -> list[tuple[int, int, int, int]]:
        boxes, x = [], self.x + 4
        for m in self.menus:
            w = int(text_width(m.title)) + 2 * self.pad
            boxes.append((x, self.y, w, self.h))
            x += w
        return boxes

    def dropdown_box(self, index: int) -> tuple[int, int, int, int]:
        tx, _, _, _ = self.title_boxes()[index]
        items = self.menus[index].items
        w = max(160, int(max(text_width(s) for s in items)) + 3 * self.pad)
        return tx, self.y + self.h, w, len(items) * self.item_h + 8

    def item_center(self, index: int, item: int) -> tuple[int, int]:
        x, y, w, _ = self.dropdown_box(index)
        return x + w // 2, y + 4 + item * self.item_h + self.item_h // 2

    def title_at(self, px: int, py: int) -> int | None:
        for i, (x, y, w, h) in enumerate(self.title_boxes()):
            if x <= px < x + w and y <= py < y + h:
                return i
        return None

    def item_at(self, index: int, px: int, py: int) -> int | None:
        x, y, w, h = self.dropdown_box(index)
        if not (x <= px < x + w and y + 4 <= py < y + h - 4):
            return None
        item = (py - y - 4) // self.item_h
        return item if 0 <= item < len(self.menus[index].items) else None

    def click(self, desk: WidgetHost, px: int, py: int, count: int) -> None:
        i = self.title_at(px, py)
        if i is not None:
            desk.open_menu(self, i)

    def draw(self, d: ImageDraw.ImageDraw, focused: bool, open_index: int | None = None) -> None:
        t = Theme
        d.rectangle(
            (self.x, self.y, self.x + self.w - 1, self.y + self.h - 1), fill=(240, 240, 242)
        )
        d.line(
            (self.x, self.y + self.h - 1, self.x + self.w - 1, self.y + self.h - 1),
            fill=(215, 215, 220),
        )
        for i, (x, y, w, h) in enumerate(self.title_boxes()):
            if i == open_index:
                d.rectangle((x, y + 2, x + w - 1, y + h - 3), fill=t.accent)
            fg = t.accent_text if i == open_index else t.text
            draw_text_centered(d, (x, y, w, h), self.menus[i].title, fg)

    def draw_dropdown(self, d: ImageDraw.ImageDraw, index: int, hover: tuple[int, int]) -> None:
        t = Theme
        x, y, w, h = self.dropdown_box(index)
        d.rectangle((x + 3, y + 3, x + w + 2, y + h + 2), fill=(120, 120, 125))
        d.rectangle((x, y, x + w - 1, y + h - 1), fill=t.menu, outline=t.window_border)
        hovered = self.item_at(index, *hover)
        for j, item in enumerate(self.menus[index].items):
            iy = y + 4 + j * self.item_h
            if j == hovered:
                d.rectangle((x + 2, iy, x + w - 3, iy + self.item_h - 1), fill=t.accent)
            fg = t.accent_text if j == hovered else t.text
            d.text((x + self.pad, iy + self.item_h / 2), item, font=font(), fill=fg, anchor="lm")

    def state(self) -> dict[str, Any]:
        return {"menus": [m.title for m in self.menus]}


@dataclass(eq=False)
class Window(Widget):
    """A top-level window with a title bar; `modal` windows (dialogs) block the others."""

    children: list[Widget] = field(default_factory=list)
    modal: bool = False
    default: Button | None = None
    """Pressed by enter when no focused widget takes the key (a dialog's OK)."""
    on_cancel: Callback | None = None
    """Called on escape (a dialog's Cancel)."""
    role: ClassVar[str] = "frame"

    @property
    def body_y(self) -> int:
        return self.y + Theme.title_h

    def child_at(self, px: int, py: int) -> Widget | None:
        for c in reversed(self.children):
            if c.contains(px, py):
                return c
        return None

    def draw_frame(self, d: ImageDraw.ImageDraw, active: bool) -> None:
        t = Theme
        x0, y0, x1, y1 = self.x, self.y, self.x + self.w - 1, self.y + self.h - 1
        d.rectangle((x0 + 4, y0 + 5, x1 + 5, y1 + 6), fill=t.shadow)
        d.rectangle((x0, y0, x1, y1), fill=t.window, outline=t.window_border)
        d.rectangle(
            (x0 + 1, y0 + 1, x1 - 1, y0 + t.title_h - 1),
            fill=t.title_active if active else t.title_inactive,
        )
        d.line((x0, y0 + t.title_h, x1, y0 + t.title_h), fill=(205, 205, 210))
        draw_text_centered(
            d, (self.x, self.y, self.w, t.title_h), self.label, t.text if active else t.text_dim
        )

    def state(self) -> dict[str, Any]:
        return {"title": self.label, "modal": self.modal}

    def a11y(self) -> tuple[str, dict[str, str], str | None]:
        return ("dialog" if self.modal else "frame"), {}, None

"""UI-TARS-1.5's action grammar: parse model responses, translate them to pyautogui code, and
write actions back as the text the model would emit.

A response looks like

    Thought: The Save button is at the top left; I click it.
    Action: click(start_box='<|box_start|>(110,62)<|box_end|>')

(`Reflection: ... Action_Summary: ...` instead of `Thought:` in some checkpoints; the thought
may be absent; several actions are separated by blank lines). Coordinates are in the frame of
the image the model saw, i.e. the screenshot after Qwen2.5-VL's smart resize (1920x1080 ->
1932x1092): UI-TARS-1.5 emits absolute pixels of that image, older UI-TARS relative 0-1000.
`Frame` makes the mapping to the screen explicit.

    frame = Frame.for_screen(1920, 1080)           # image 1932x1092 -> screen 1920x1080
    r = parse_response(text, frame)                # raises ActionParseError only
    r.commands  # ("import pyautogui\\nimport time\\npyautogui.click(109, 61, button='left')",)
    r.action    # what Turn.action records: the code, or WAIT / DONE / FAIL
    parse_response("Action: click(mark=2)", frame, marks={2: Point(640, 360)})
    try_parse_response(text, frame)                # never raises; .parsed False + .error

Set-of-marks (OSWorld's `som` observation: numbered marks drawn on the screenshot, a table
of them in the prompt): a pointer action may name a mark instead of a position,
`click(mark=3)` (also `left_double`, `right_single`, `hover`; `mark=tag_3`, OSWorld's
variable name, is the same). The turn's marks (index -> the centre of the mark's box, in
screen pixels) are given to the parser, which resolves the mark there, so the action runs
as `pyautogui.click(<centre>)`; the typed action keeps the mark (`Click.mark`). A mark the
turn does not have, or a mark on a turn that shows none, is a parse failure saying so.
OSWorld's som agents write `pyautogui.click(tag_3)` in Python; this grammar is UI-TARS's.

Translation to code follows OSWorld's UI-TARS agent as ARPO runs it (click ->
`pyautogui.click(x, y, button='left')`, type -> `pyautogui.write` with a trailing newline
pressed as Enter, scroll -> 5 clicks, drag -> `moveTo` + `dragTo`, wait -> WAIT, finished ->
DONE, call_user -> FAIL). Every string that reaches the code is written with `ascii()`, so
the generated program is plain ASCII and nothing a response contains can leave its literal.

Deviations from the reference parsers (UI-TARS `action_parser.py`, OSWorld `uitars_agent`,
ARPO's copy of it), each deliberate:

- A hand-written scanner instead of `ast.parse` on a string patched with regexes: it accepts
  what the reference accepts (escaped and unescaped quotes inside `content`, raw newlines,
  `<point>`, box tokens, 2- and 4-number boxes) and returns `ActionParseError` with a reason
  for everything else instead of `AssertionError`/`SyntaxError`/printing.
- Unknown action names, unknown or missing arguments, and scroll directions other than
  up/down/left/right are parse failures (format reward -1). The reference turns unknown names
  into a comment (a no-op step with reward 0) and crashes on missing boxes.
- Left/right scrolls become `pyautogui.hscroll` (the reference emits nothing for them).
- Screen coordinates are rounded to whole pixels and clamped to the screen; the reference
  passes 3-decimal floats that pyautogui truncates and does not clamp.
- Text that pyautogui cannot type (non-ASCII) goes through the clipboard (`ActionConfig.typing
  = "auto"`); ARPO types everything with `pyautogui.write`, which drops such characters.
- Actions before a terminal one still run: `click(...)` then `finished()` gives
  `(click code, "DONE")`; the reference drops the click. `ParsedResponse.action` (the one
  string a Turn records) is the terminal token then.
- `press` is `pyautogui.press` (UI-TARS' upstream parser maps it to `keyDown`).
- A call cut short (no closing parenthesis, e.g. at the token limit) is a parse failure; the
  upstream parser appends the missing ')'.
- Hotkey key names are lowercased and `arrowleft` etc. become pyautogui's `left`; key names
  are not checked against pyautogui's list (pyautogui ignores unknown names, as before).
- Code carries no docstring with the thought (the reference prepends one); the thought is in
  `ParsedResponse.thought` and in the recorded response tokens.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from arpo.errors import ActionParseError

WAIT = "WAIT"
DONE = "DONE"
FAIL = "FAIL"
SPECIAL_TOKENS = frozenset({WAIT, DONE, FAIL})
"""The non-code actions OSWorld's environment understands."""

IMAGE_FACTOR = 28
"""Qwen2.5-VL's image side granularity: 14-pixel patches merged 2x2."""
MIN_PIXELS = 4 * 28 * 28
"""Smallest image area (pixels) the ARPO reference lets the processor produce (3136)."""
MAX_PIXELS = 2700 * 28 * 28
"""Largest image area the ARPO reference lets the processor produce (2116800): 1920x1080
screenshots are shown to the model as 1932x1092."""
RELATIVE_SCALE = 1000
"""Coordinate range of the relative convention (UI-TARS-1.0, Qwen2-VL)."""
MAX_RESPONSE_CHARS = 65_536
"""Longer responses are rejected before parsing (a 1k-token response is ~4k characters)."""

_MAX_ASPECT = 200


def smart_resize(
    *,
    width: int,
    height: int,
    factor: int = IMAGE_FACTOR,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> tuple[int, int]:
    """Qwen2.5-VL's image resize rule with the ARPO reference's budget as defaults: the
    (width, height) the model sees for a screenshot (`arpo.policy.family.qwen_smart_resize`,
    the one copy of the rule; other families' rules are `arpo.policy.family.ImageRule`'s)."""
    from arpo.policy.family import qwen_smart_resize

    return qwen_smart_resize(width, height, factor, min_pixels, max_pixels)


@dataclass(frozen=True, slots=True)
class Point:
    """A position on the screen, in screen pixels."""

    x: float
    y: float

    def __post_init__(self) -> None:
        for v in (self.x, self.y):
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"Point coordinates must be finite numbers, got {self!r}")


@dataclass(frozen=True, slots=True)
class Frame:
    """How the model's coordinates map to the screen.

    UI-TARS-1.5 answers in pixels of the image it was shown (`image_w` x `image_h`, the
    screenshot after smart resize); with `relative=True` it answers in 0-1000 of the screen
    (the older UI-TARS convention) and the image size is not used for coordinates.
    """

    image_w: int
    """Width of the image the model saw (after smart resize)."""
    image_h: int
    """Height of the image the model saw."""
    screen_w: int
    """Width of the screen the actions run on."""
    screen_h: int
    """Height of the screen."""
    relative: bool = False
    """Coordinates are 0-1000 relative to the screen instead of image pixels."""

    def __post_init__(self) -> None:
        for name in ("image_w", "image_h", "screen_w", "screen_h"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"Frame.{name} must be a positive int, got {v!r}")
        if not isinstance(self.relative, bool):
            raise ValueError(f"Frame.relative must be a bool, got {self.relative!r}")

    @classmethod
    def for_screen(
        cls,
        screen_w: int,
        screen_h: int,
        *,
        relative: bool = False,
        min_pixels: int = MIN_PIXELS,
        max_pixels: int = MAX_PIXELS,
    ) -> Frame:
        """The frame of a screenshot of this screen shown to Qwen2.5-VL unchanged but for the
        processor's smart resize (what the ARPO reference does)."""
        w, h = smart_resize(
            width=screen_w, height=screen_h, min_pixels=min_pixels, max_pixels=max_pixels
        )
        return cls(w, h, screen_w, screen_h, relative)

    @classmethod
    def shown(cls, screen_w: int, screen_h: int, rule: Any) -> Frame:
        """The frame of a screenshot of this screen shown by a model family's image rule
        (`arpo.policy.family.ImageRule`): coordinates in pixels of the image it sees."""
        w, h = rule.shown_size(screen_w, screen_h)
        return cls(int(w), int(h), screen_w, screen_h)

    @property
    def model_w(self) -> int:
        """Width of the coordinate range the model answers in."""
        return RELATIVE_SCALE if self.relative else self.image_w

    @property
    def model_h(self) -> int:
        """Height of the coordinate range the model answers in."""
        return RELATIVE_SCALE if self.relative else self.image_h

    def to_screen(self, x: float, y: float) -> Point:
        """Model coordinates -> screen pixels, clamped to the screen."""
        sx = x * self.screen_w / self.model_w
        sy = y * self.screen_h / self.model_h
        return Point(
            min(max(sx, 0.0), float(self.screen_w - 1)), min(max(sy, 0.0), float(self.screen_h - 1))
        )

    def to_model(self, p: Point) -> tuple[int, int]:
        """Screen pixels -> the integer coordinates the model would write."""
        mx = round(p.x * self.model_w / self.screen_w)
        my = round(p.y * self.model_h / self.screen_h)
        return min(max(mx, 0), self.model_w - 1), min(max(my, 0), self.model_h - 1)


# ---- typed actions -------------------------------------------------------------------------

DIRECTIONS = ("up", "down", "left", "right")


def _check_mark(action: object) -> None:
    mark = action.mark  # type: ignore[attr-defined]
    if mark is not None and (type(mark) is not int or mark < 1):
        raise ValueError(f"{type(action).__name__}.mark must be an int >= 1 or None, got {mark!r}")


@dataclass(frozen=True, slots=True)
class Click:
    """Left click (`click`, also `left_single`)."""

    point: Point
    mark: int | None = None
    """The set-of-marks mark it named (`click(mark=3)`), resolved to `point`; None: a click
    at coordinates."""

    def __post_init__(self) -> None:
        _check_mark(self)


@dataclass(frozen=True, slots=True)
class LeftDouble:
    """Left double click (`left_double`)."""

    point: Point
    mark: int | None = None
    """The mark it named, resolved to `point` (see `Click.mark`)."""

    def __post_init__(self) -> None:
        _check_mark(self)


@dataclass(frozen=True, slots=True)
class RightSingle:
    """Right click (`right_single`)."""

    point: Point
    mark: int | None = None
    """The mark it named, resolved to `point` (see `Click.mark`)."""

    def __post_init__(self) -> None:
        _check_mark(self)


@dataclass(frozen=True, slots=True)
class Hover:
    """Move the pointer without clicking (`hover`)."""

    point: Point
    mark: int | None = None
    """The mark it named, resolved to `point` (see `Click.mark`)."""

    def __post_init__(self) -> None:
        _check_mark(self)


@dataclass(frozen=True, slots=True)
class Drag:
    """Press at `start`, move to `end`, release (`drag`, also `select`)."""

    start: Point
    end: Point


@dataclass(frozen=True, slots=True)
class Hotkey:
    """Press keys together (`hotkey(key='ctrl c')`): pyautogui key names, in order."""

    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Press:
    """Press and release one key (`press(key='enter')`)."""

    key: str


@dataclass(frozen=True, slots=True)
class KeyDown:
    """Hold a key down (`keydown(key='shift')`)."""

    key: str


@dataclass(frozen=True, slots=True)
class KeyUp:
    """Release a held key (`keyup(key='shift')`, also `release`)."""

    key: str


@dataclass(frozen=True, slots=True)
class Type:
    """Type text (`type(content='...')`); trailing newlines mean "then press Enter"."""

    content: str


@dataclass(frozen=True, slots=True)
class Scroll:
    """Scroll 'up', 'down', 'left' or 'right', at `point` or where the pointer is."""

    direction: str
    point: Point | None = None

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise ValueError(
                f"Scroll.direction must be one of {DIRECTIONS}, got {self.direction!r}"
            )


@dataclass(frozen=True, slots=True)
class Wait:
    """Wait and look again (`wait()`): the WAIT token."""


@dataclass(frozen=True, slots=True)
class Finished:
    """The task is done (`finished(content='...')`): the DONE token."""

    content: str = ""


@dataclass(frozen=True, slots=True)
class CallUser:
    """Ask the user for help / declare the task infeasible (`call_user()`): the FAIL token."""


Action = (
    Click
    | LeftDouble
    | RightSingle
    | Hover
    | Drag
    | Hotkey
    | Press
    | KeyDown
    | KeyUp
    | Type
    | Scroll
    | Wait
    | Finished
    | CallUser
)

# ---- translation to pyautogui ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ActionConfig:
    """How actions become pyautogui code. Defaults reproduce the ARPO reference."""

    scroll_clicks: int = 5
    """Wheel clicks per scroll action."""
    typing: Literal["auto", "write", "clipboard"] = "auto"
    """`write`: pyautogui.write (ASCII only); `clipboard`: pyperclip.copy + ctrl+v;
    `auto`: write when pyautogui can type every character, else the clipboard."""
    write_interval: float = 0.1
    """Seconds between keystrokes of pyautogui.write (the reference's 0.1)."""
    type_settle: float = 0.5
    """Seconds to sleep after typing, before a trailing Enter."""
    drag_duration: float = 1.0
    """Seconds the pointer takes from drag start to drag end."""
    imports: bool = True
    """Start every command with the imports it uses, so it runs with or without OSWorld's
    `import pyautogui; import time` prefix."""

    def __post_init__(self) -> None:
        if isinstance(self.scroll_clicks, bool) or not isinstance(self.scroll_clicks, int):
            raise ValueError(
                f"ActionConfig.scroll_clicks must be an int, got {self.scroll_clicks!r}"
            )
        if self.scroll_clicks <= 0:
            raise ValueError(
                f"ActionConfig.scroll_clicks must be > 0 (the sign comes from the direction), "
                f"got {self.scroll_clicks}"
            )
        if self.typing not in ("auto", "write", "clipboard"):
            raise ValueError(
                f"ActionConfig.typing must be 'auto', 'write' or 'clipboard', got {self.typing!r}"
            )
        for name in ("write_interval", "type_settle", "drag_duration"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < 60:
                raise ValueError(f"ActionConfig.{name} must be a number of seconds in [0, 60)")


_DEFAULT_CONFIG = ActionConfig()
# Characters pyautogui.write can type on every platform: printable ASCII, newline, tab.
_WRITABLE = frozenset(chr(c) for c in range(32, 127)) | {"\n", "\t"}


def _px(v: float) -> int:
    return math.floor(v + 0.5)


def _xy(p: Point) -> str:
    return f"{_px(p.x)}, {_px(p.y)}"


def _num(v: float) -> str:
    return repr(float(v))


def to_pyautogui(action: Action, config: ActionConfig | None = None) -> str:
    """The pyautogui program for one action, or WAIT / DONE / FAIL for the terminal ones."""
    c = config or _DEFAULT_CONFIG
    modules = ["pyautogui", "time"]
    lines: list[str]
    match action:
        case Click(p):
            lines = [f"pyautogui.click({_xy(p)}, button='left')"]
        case LeftDouble(p):
            lines = [f"pyautogui.doubleClick({_xy(p)}, button='left')"]
        case RightSingle(p):
            lines = [f"pyautogui.click({_xy(p)}, button='right')"]
        case Hover(p):
            lines = [f"pyautogui.moveTo({_xy(p)})"]
        case Drag(start, end):
            lines = [
                f"pyautogui.moveTo({_xy(start)})",
                f"pyautogui.dragTo({_xy(end)}, duration={_num(c.drag_duration)})",
            ]
        case Hotkey(keys):
            lines = [f"pyautogui.hotkey({', '.join(ascii(k) for k in keys)})"]
        case Press(key):
            lines = [f"pyautogui.press({key!a})"]
        case KeyDown(key):
            lines = [f"pyautogui.keyDown({key!a})"]
        case KeyUp(key):
            lines = [f"pyautogui.keyUp({key!a})"]
        case Type(content):
            text = content.rstrip("\n")
            lines = []
            if text:
                clip = c.typing == "clipboard" or (
                    c.typing == "auto" and not set(text) <= _WRITABLE
                )
                if clip:
                    modules.append("pyperclip")
                    lines += [f"pyperclip.copy({text!a})", "pyautogui.hotkey('ctrl', 'v')"]
                else:
                    lines.append(f"pyautogui.write({text!a}, interval={_num(c.write_interval)})")
            lines.append(f"time.sleep({_num(c.type_settle)})")
            if text != content:
                lines.append("pyautogui.press('enter')")
        case Scroll(direction, p):
            sign = 1 if direction in ("up", "right") else -1
            func = "scroll" if direction in ("up", "down") else "hscroll"
            at = "" if p is None else f", x={_px(p.x)}, y={_px(p.y)}"
            lines = [f"pyautogui.{func}({sign * c.scroll_clicks}{at})"]
        case Wait():
            return WAIT
        case Finished():
            return DONE
        case CallUser():
            return FAIL
        case _:
            raise TypeError(f"not an action: {action!r}")
    if c.imports:
        lines = [f"import {m}" for m in modules] + lines
    return "\n".join(lines)


# ---- text the model emits -------------------------------------------------------------------

CoordStyle = Literal["box", "plain", "point"]
"""How `format_action` writes a position: `box` is `'<|box_start|>(x,y)<|box_end|>'` (the
tokens UI-TARS-1.5 samples), `plain` is `'(x,y)'` (its text with special tokens skipped),
`point` is `'<point>x y</point>'` with `point=` / `start_point=` / `end_point=` keys."""


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace("'", "\\'").replace('"', '\\"').replace("\n", "\\n")


def _coord(p: Point, frame: Frame, style: CoordStyle) -> str:
    x, y = frame.to_model(p)
    if style == "point":
        return f"<point>{x} {y}</point>"
    if style == "plain":
        return f"({x},{y})"
    return f"<|box_start|>({x},{y})<|box_end|>"


def format_action(action: Action, frame: Frame, *, coords: CoordStyle = "box") -> str:
    """The text UI-TARS would emit for `action` (screen coordinates mapped into `frame`)."""
    if coords not in ("box", "plain", "point"):
        raise ValueError(f"coords must be 'box', 'plain' or 'point', got {coords!r}")
    start_key, end_key = (
        ("start_point", "end_point") if coords == "point" else ("start_box", "end_box")
    )
    one_key = "point" if coords == "point" else "start_box"

    def at(p: Point, mark: int | None = None) -> str:
        return f"mark={mark}" if mark is not None else f"{one_key}='{_coord(p, frame, coords)}'"

    match action:
        case Click(p, mark):
            return f"click({at(p, mark)})"
        case LeftDouble(p, mark):
            return f"left_double({at(p, mark)})"
        case RightSingle(p, mark):
            return f"right_single({at(p, mark)})"
        case Hover(p, mark):
            return f"hover({at(p, mark)})"
        case Drag(start, end):
            return (
                f"drag({start_key}='{_coord(start, frame, coords)}', "
                f"{end_key}='{_coord(end, frame, coords)}')"
            )
        case Hotkey(keys):
            return f"hotkey(key='{_escape(' '.join(keys))}')"
        case Press(key):
            return f"press(key='{_escape(key)}')"
        case KeyDown(key):
            return f"keydown(key='{_escape(key)}')"
        case KeyUp(key):
            return f"keyup(key='{_escape(key)}')"
        case Type(content):
            return f"type(content='{_escape(content)}')"
        case Scroll(direction, p):
            where = "" if p is None else f"{at(p)}, "
            return f"scroll({where}direction='{direction}')"
        case Wait():
            return "wait()"
        case Finished(content):
            return f"finished(content='{_escape(content)}')" if content else "finished()"
        case CallUser():
            return "call_user()"
    raise TypeError(f"not an action: {action!r}")


def format_response(
    thought: str,
    actions: tuple[Action, ...] | list[Action],
    frame: Frame,
    *,
    coords: CoordStyle = "box",
) -> str:
    """A whole response: `Thought: ...\\nAction: a1\\n\\na2` (no `Thought:` line if empty)."""
    if not actions:
        raise ValueError("a response needs at least one action")
    body = "\n\n".join(format_action(a, frame, coords=coords) for a in actions)
    thought = thought.strip()
    return f"Thought: {thought}\nAction: {body}" if thought else f"Action: {body}"


# ---- parsing ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ParsedResponse:
    """A model response taken apart: its thought, typed actions and the commands to execute."""

    text: str
    """The response as given."""
    thought: str = ""
    """The `Thought:` (or `Action_Summary:`) text; empty if the response has none."""
    reflection: str = ""
    """The `Reflection:` text of the reflection format; usually empty."""
    actions: tuple[Action, ...] = ()
    """Every action of the response, in order."""
    commands: tuple[str, ...] = ()
    """What to send to the environment, in order: pyautogui programs, ending with at most one
    WAIT / DONE / FAIL token (actions after a terminal action are not executed)."""
    parsed: bool = True
    """False when the response could not be parsed (then `error` says why)."""
    error: str = ""
    """Why parsing failed; empty when it succeeded."""

    @property
    def action(self) -> str:
        """The single string a Turn records: the terminal token if there is one, else all the
        code (commands joined by newlines); empty when not parsed."""
        if not self.commands:
            return ""
        if self.commands[-1] in SPECIAL_TOKENS:
            return self.commands[-1]
        return "\n".join(self.commands)

    @property
    def format_reward(self) -> float:
        """0 for a parsed response, -1 otherwise (the reference's format reward)."""
        return 0.0 if self.parsed else -1.0


@dataclass(frozen=True, slots=True)
class _Arg:
    key: str | None
    value: str


@dataclass(frozen=True, slots=True)
class _Call:
    name: str
    args: tuple[_Arg, ...] = field(default=())


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_WS = re.compile(r"\s*")
_BARE = re.compile(r"[^\s,()'\"=\\]+")
_STRINGS = {
    "'": re.compile(r"'([^'\\]*(?:\\.[^'\\]*)*)'", re.S),
    '"': re.compile(r'"([^"\\]*(?:\\.[^"\\]*)*)"', re.S),
}
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"'}
_ESCAPE = re.compile(r"\\(.)", re.S)


def _unescape(s: str) -> str:
    """Python-style escapes UI-TARS uses (\\n \\t \\' \\" \\\\); other backslashes stay."""
    if "\\" not in s:
        return s
    return _ESCAPE.sub(lambda m: _ESCAPES.get(m.group(1), m.group(0)), s)


def _skip(s: str, i: int = 0) -> int:
    """Index of the first non-space character at or after i."""
    m = _WS.match(s, i)
    return i if m is None else m.end()


def _where(s: str, i: int) -> str:
    snippet = s[i : i + 24]
    return f"at {snippet!r}" if snippet else "at the end"


def _scan_call(s: str, i: int) -> tuple[_Call, int]:
    """One `name(key='value', ...)` starting at s[i] (no leading space); returns the end."""
    m = _IDENT.match(s, i)
    if m is None:
        raise ActionParseError(f"expected an action name {_where(s, i)}")
    name = m.group()
    i = _skip(s, m.end())
    if s[i : i + 1] != "(":
        raise ActionParseError(f"expected '(' after {name!r} {_where(s, i)}")
    i = _skip(s, i + 1)
    args: list[_Arg] = []
    if s[i : i + 1] == ")":
        return _Call(name), i + 1
    while True:
        key = None
        m = _IDENT.match(s, i)
        if m is not None:
            j = _skip(s, m.end())
            if s[j : j + 1] == "=":
                key = m.group()
                i = _skip(s, j + 1)
        quote = s[i : i + 1]
        if quote in _STRINGS:
            m = _STRINGS[quote].match(s, i)
            if m is None:
                raise ActionParseError(f"unterminated string in {name}() {_where(s, i)}")
            value = _unescape(m.group(1))
        else:
            m = _BARE.match(s, i)
            if m is None:
                raise ActionParseError(f"expected an argument value in {name}() {_where(s, i)}")
            value = m.group()
        args.append(_Arg(key, value))
        i = _skip(s, m.end())
        c = s[i : i + 1]
        if c == ")":
            return _Call(name, tuple(args)), i + 1
        if c != ",":
            raise ActionParseError(f"expected ',' or ')' in {name}() {_where(s, i)}")
        i = _skip(s, i + 1)
        if s[i : i + 1] == ")":  # trailing comma
            return _Call(name, tuple(args)), i + 1


def _scan_calls(section: str) -> list[_Call]:
    """Calls separated by whitespace containing a newline; nothing else may follow."""
    calls = []
    i = _skip(section)
    while i < len(section):
        call, i = _scan_call(section, i)
        calls.append(call)
        j = _skip(section, i)
        if j < len(section) and "\n" not in section[i:j]:
            raise ActionParseError(
                f"expected a new line after {call.name}(...) {_where(section, i)}"
            )
        i = j
    return calls


# Free-text actions whose content may hold unescaped quotes, as the reference tolerates.
_LENIENT = re.compile(r"\s*(type|finished|call_user)\s*\(\s*content\s*=\s*(['\"])")


def _lenient_call(chunk: str) -> _Call | None:
    """`type(content='It's here')`: the value runs to the last quote before the final ')'."""
    m = _LENIENT.match(chunk)
    if m is None:
        return None
    body = chunk[m.end() :].rstrip()
    if not body.endswith(")"):
        return None
    body = body[:-1].rstrip()
    if not body.endswith(m.group(2)):
        return None
    inner = body[:-1]
    if _ACTION_LINE.search(inner):  # a degenerate repetition, not text to type
        return None
    return _Call(m.group(1), (_Arg("content", _unescape(inner)),))


def _chunks(section: str) -> list[str]:
    """Split at blank lines that are followed by an action name and '('."""
    starts = [0]
    for m in _CHUNK_START.finditer(section):
        # m starts a line, so section[m.start() - 1] is "\n"; a blank line needs one more.
        j = m.start() - 2
        while j >= 0 and section[j] in " \t":
            j -= 1
        if j >= 0 and section[j] == "\n":
            starts.append(m.start())
    return [section[a:b] for a, b in zip(starts, [*starts[1:], len(section)], strict=True)]


def _scan_section(section: str) -> list[_Call]:
    try:
        return _scan_calls(section)
    except ActionParseError as strict_error:
        calls = []
        for chunk in _chunks(section):
            try:
                calls += _scan_calls(chunk)
            except ActionParseError:
                call = _lenient_call(chunk)
                if call is None:
                    raise strict_error from None
                calls.append(call)
        return calls


# ---- calls -> typed actions ------------------------------------------------------------------

_POINTER: dict[str, type[Click | LeftDouble | RightSingle | Hover]] = {
    "click": Click,
    "left_double": LeftDouble,
    "right_single": RightSingle,
    "hover": Hover,
}
_KEYS: dict[str, type[Press | KeyDown | KeyUp]] = {
    "press": Press,
    "keydown": KeyDown,
    "keyup": KeyUp,
}
_NAME_ALIASES = {"left_single": "click", "select": "drag", "release": "keyup"}
# name -> (allowed keys in positional order, required keys)
_SPECS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    # start_box or mark, one of them (`_target`)
    "click": (("start_box", "mark"), frozenset()),
    "left_double": (("start_box", "mark"), frozenset()),
    "right_single": (("start_box", "mark"), frozenset()),
    "hover": (("start_box", "mark"), frozenset()),
    "drag": (("start_box", "end_box"), frozenset({"start_box", "end_box"})),
    "hotkey": (("key",), frozenset({"key"})),
    "press": (("key",), frozenset({"key"})),
    "keydown": (("key",), frozenset({"key"})),
    "keyup": (("key",), frozenset({"key"})),
    "type": (("content",), frozenset({"content"})),
    "scroll": (("start_box", "direction"), frozenset({"direction"})),
    "wait": ((), frozenset()),
    "finished": (("content",), frozenset()),
    "call_user": (("content",), frozenset()),
}
_KEY_ALIASES = {
    "point": "start_box",
    "start_point": "start_box",
    "end_point": "end_box",
    "hotkey": "key",
    "keys": "key",
}
_KEY_NAME_ALIASES = {
    "arrowleft": "left",
    "arrowright": "right",
    "arrowup": "up",
    "arrowdown": "down",
    "control": "ctrl",
}
_CHUNK_START = re.compile(
    r"^[ \t]*(?:"
    + "|".join(sorted({*_SPECS, *_NAME_ALIASES}, key=len, reverse=True))
    + r")[ \t]*\(",
    re.M,
)
_NUMBER = r"[+-]?(?:\d{1,12}(?:\.\d{0,12})?|\.\d{1,12})"
_MAX_COORD_CHARS = 120
_TAGGED = re.compile(
    rf"<(point|bbox)>\s*({_NUMBER})\s+({_NUMBER})(?:\s+({_NUMBER})\s+({_NUMBER}))?\s*</\1>"
)
_TUPLE = re.compile(
    rf"[(\[]?\s*({_NUMBER})\s*[,\s]\s*({_NUMBER})(?:\s*[,\s]\s*({_NUMBER})\s*[,\s]\s*({_NUMBER}))?\s*[)\]]?"
)


def _coords(value: str, frame: Frame, what: str) -> Point:
    v = value.replace("<|box_start|>", "").replace("<|box_end|>", "").strip()
    # The length bound keeps the regexes linear (no long runs of spaces to backtrack over).
    m = (_TAGGED.fullmatch(v) or _TUPLE.fullmatch(v)) if len(v) <= _MAX_COORD_CHARS else None
    if m is None:
        raise ActionParseError(
            f"{what} is not a point '(x,y)' or box '(x1,y1,x2,y2)': {value[:40]!r}"
        )
    nums = [float(g) for g in m.groups() if g is not None and g not in ("point", "bbox")]
    if len(nums) == 4:
        x, y = (nums[0] + nums[2]) / 2, (nums[1] + nums[3]) / 2
    else:
        x, y = nums
    return frame.to_screen(x, y)


Marks = Mapping[int, Point]
"""A turn's set-of-marks: mark index (1-based, as drawn) -> the screen point it stands for."""
_MARK = re.compile(r"\s*(?:tag_)?(\d{1,9})\s*")


def _target(name: str, kw: dict[str, str], frame: Frame, marks: Marks | None) -> Point | int:
    """Where a pointer action points: its start_box, or the mark it names (the mark's index;
    `_to_action` resolves it)."""
    if ("start_box" in kw) == ("mark" in kw):
        if "mark" in kw:
            raise ActionParseError(f"{name}() takes start_box or mark, not both")
        raise ActionParseError(f"{name}() is missing start_box (or mark)")
    if "start_box" in kw:
        return _coords(kw["start_box"], frame, f"{name}() start_box")
    m = _MARK.fullmatch(kw["mark"])
    if m is None:
        raise ActionParseError(f"{name}() mark must be a mark's number, got {kw['mark'][:40]!r}")
    index = int(m.group(1))
    if not marks:
        raise ActionParseError(
            f"{name}(mark={index}) names a mark, but this screen shows no marks (marks come "
            "with the som observation)"
        )
    if index not in marks:
        raise ActionParseError(
            f"{name}(mark={index}): there is no mark {index} on this screen (its marks are "
            f"{min(marks)}..{max(marks)})"
        )
    return index


def _key_name(k: str) -> str:
    if len(k) > 1:
        k = k.lower()
        k = _KEY_NAME_ALIASES.get(k, k)
    return k


def _hotkey_keys(value: str) -> tuple[str, ...]:
    parts = value.split()
    if len(parts) == 1 and "+" in parts[0] and parts[0] != "+":
        parts = [p for p in parts[0].split("+") if p] or ["+"]
    # A hotkey names keys, not characters: 'ctrl S' is ctrl+s, as the prompt asks for lowercase.
    return tuple(_key_name(p.lower()) for p in parts)


def _to_action(call: _Call, frame: Frame, marks: Marks | None = None) -> Action:
    name = _NAME_ALIASES.get(call.name, call.name)
    if name not in _SPECS:
        raise ActionParseError(f"unknown action {call.name!r}")
    order, required = _SPECS[name]
    kw: dict[str, str] = {}
    for pos, arg in enumerate(call.args):
        if arg.key is None:
            if pos >= len(order) or any(a.key is not None for a in call.args[:pos]):
                raise ActionParseError(f"{call.name}() got an unexpected positional argument")
            key = order[pos]
        else:
            key = _KEY_ALIASES.get(arg.key, arg.key)
            if key not in order:
                raise ActionParseError(f"{call.name}() got an unknown argument {arg.key!r}")
        if key in kw:
            raise ActionParseError(f"{call.name}() got {key!r} twice")
        kw[key] = arg.value
    missing = required - kw.keys()
    if missing:
        raise ActionParseError(f"{call.name}() is missing {', '.join(sorted(missing))}")

    if name in _POINTER:
        where = _target(call.name, kw, frame, marks)
        if isinstance(where, Point):
            return _POINTER[name](where)
        return _POINTER[name](marks[where], where)  # type: ignore[index]  # checked
    if name == "drag":
        return Drag(
            _coords(kw["start_box"], frame, f"{call.name}() start_box"),
            _coords(kw["end_box"], frame, f"{call.name}() end_box"),
        )
    if name == "hotkey":
        keys = _hotkey_keys(kw["key"])
        if not keys:
            raise ActionParseError("hotkey() needs at least one key")
        return Hotkey(keys)
    if name in _KEYS:
        key = kw["key"].strip()
        if not key or len(key.split()) != 1:
            raise ActionParseError(f"{call.name}() needs exactly one key, got {kw['key'][:40]!r}")
        return _KEYS[name](_key_name(key))
    if name == "type":
        return Type(kw["content"])
    if name == "scroll":
        direction = kw["direction"].strip().lower()
        if direction not in DIRECTIONS:
            raise ActionParseError(
                f"scroll() direction must be up, down, left or right, got {kw['direction'][:40]!r}"
            )
        box = kw.get("start_box", "").strip()
        return Scroll(direction, _coords(box, frame, "scroll() start_box") if box else None)
    if name == "wait":
        return Wait()
    if name == "finished":
        return Finished(kw.get("content", ""))
    return CallUser()


def parse_action(text: str, frame: Frame, *, marks: Marks | None = None) -> Action:
    """One action call, e.g. `click(start_box='(10,20)')`, mapped into screen coordinates
    (`click(mark=3)`: the point of mark 3 in `marks`)."""
    if not isinstance(text, str):
        raise ActionParseError(f"an action must be a str, got {type(text).__name__}")
    calls = _scan_section(text.strip())
    if len(calls) != 1:
        raise ActionParseError(f"expected one action, got {len(calls)}")
    return _to_action(calls[0], frame, marks)


# ---- responses -------------------------------------------------------------------------------

_TRAILERS = ("<|im_end|>", "<|endoftext|>", "[EOS]")
_ACTION_LINE = re.compile(r"^[ \t]*Action:", re.M)
_MAX_CANDIDATES = 8


def _split_head(head: str) -> tuple[str, str]:
    """(thought, reflection) from the text before `Action:`."""
    h = head.strip()
    if h.startswith("```"):
        h = h[3:].strip()
    if h.startswith("Reflection:") and "Action_Summary:" in h:
        reflection, _, thought = h[len("Reflection:") :].partition("Action_Summary:")
        return thought.strip(), reflection.strip()
    if h.startswith("Action_Summary:"):
        return h[len("Action_Summary:") :].strip(), ""
    _, label, after = h.partition("Thought:")
    return (after.strip() if label else h), ""


def _clean_section(section: str) -> str:
    s = section.strip()
    if s.endswith("```"):
        s = s[:-3].rstrip()
    return s


def _commands(actions: tuple[Action, ...], config: ActionConfig) -> tuple[str, ...]:
    out = []
    for a in actions:
        out.append(to_pyautogui(a, config))
        if out[-1] in SPECIAL_TOKENS:
            break
    return tuple(out)


def parse_response(
    text: str, frame: Frame, *, config: ActionConfig | None = None, marks: Marks | None = None
) -> ParsedResponse:
    """Parse a UI-TARS response; raises ActionParseError (only) when it is not well formed.
    `marks`: the turn's set-of-marks (`click(mark=N)` points there); None: it has none."""
    if not isinstance(text, str):
        raise ActionParseError(f"a response must be a str, got {type(text).__name__}")
    if len(text) > MAX_RESPONSE_CHARS:
        raise ActionParseError(f"response of {len(text)} characters exceeds {MAX_RESPONSE_CHARS}")
    body = text.strip()
    stripped = True
    while stripped:
        stripped = False
        for t in _TRAILERS:
            if body.endswith(t):
                body, stripped = body[: -len(t)].rstrip(), True
    # `Action:` at a line start first, then anywhere; the first that parses wins.
    line_starts = [m.end() for m in _ACTION_LINE.finditer(body)]
    anywhere = [m.end() for m in re.finditer("Action:", body) if m.end() not in line_starts]
    candidates = (line_starts + anywhere)[:_MAX_CANDIDATES]
    if not candidates:
        raise ActionParseError("no 'Action:' in the response")
    first_error: ActionParseError | None = None
    for end in candidates:
        try:
            calls = _scan_section(_clean_section(body[end:]))
            if not calls:
                raise ActionParseError("nothing after 'Action:'")
            actions = tuple(_to_action(c, frame, marks) for c in calls)
        except ActionParseError as e:
            first_error = first_error or e
            continue
        thought, reflection = _split_head(body[: end - len("Action:")])
        return ParsedResponse(
            text=text,
            thought=thought,
            reflection=reflection,
            actions=actions,
            commands=_commands(actions, config or _DEFAULT_CONFIG),
        )
    assert first_error is not None
    raise first_error


def try_parse_response(
    text: str, frame: Frame, *, config: ActionConfig | None = None, marks: Marks | None = None
) -> ParsedResponse:
    """Like `parse_response`, but a malformed response gives `parsed=False` and the reason in
    `error` (no actions, no commands, format reward -1) instead of an exception."""
    try:
        return parse_response(text, frame, config=config, marks=marks)
    except ActionParseError as e:
        return ParsedResponse(
            text=text if isinstance(text, str) else "", parsed=False, error=str(e)
        )

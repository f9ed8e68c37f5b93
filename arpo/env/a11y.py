"""The accessibility tree as OSWorld's agents see it: the linearised table and the set-of-marks.

OSWorld's harness offers an agent four observation types (`observation_type` in its run.py):
`screenshot`, `a11y_tree`, `screenshot_a11y_tree` and `som`. The last three are built from the
XML every environment here serves at GET /accessibility ({"AT": xml}): OSWorld VMs, the local
desktop and the simulated one. This module builds them, matching OSWorld's own code (its
mm_agents/agent.py `linearize_accessibility_tree`, `tag_screenshot`, `trim_accessibility_tree`
and `parse_code_from_som_string`; mm_agents/accessibility_tree_wrap/heuristic_retrieve.py
`judge_node`, `filter_nodes` and `draw_bounding_boxes`), which tests/test_a11y_osworld.py runs
side by side with this module on the same trees (`pytest tests/test_a11y_osworld.py`, after
`make osworld-evaluator`).

    table = linearize(xml)                          # a11y_tree, screenshot_a11y_tree
    table = trim(table, tokenizer, max_tokens=10_000)
    som = set_of_marks(xml, png)                    # som: som.screenshot, som.table, som.marks
    x, y = som.marks[0].center                      # where OSWorld's `tag_1` points

Which nodes count (`filter_nodes`), OSWorld's rules:
- the tag starts with "document", ends with one of `KEEP_SUFFIXES` ("button", "item", "label",
  "menu", ...) or is one of `KEEP_TAGS` ("entry", "check-box", "paragraph", ...);
- states (the `st:` namespace, value "true"): visible, and on Ubuntu also showing; and one of
  enabled, editable, expandable, checkable;
- a non-empty `name` attribute or non-empty text (for marks also an `image="true"` attribute);
- a box on screen: `cp:screencoord` "(x, y)" with x, y >= 0 and `cp:size` "(w, h)" with
  w, h > 0.
Nodes are taken in document order.

The table (`linearize`): the header `tag, name, text, class, description, position (top-left
x&y), size (w&h)` and one tab-separated row per node, joined by newlines. Nothing is escaped
(a text holding newlines spans several lines, as in OSWorld) but the text cell is quoted: a
node's text (or, for a Windows "EditWrapper" node without text, its value), wrapped in double
quotes with inner quotes doubled when it contains one, `""` when empty.
OSWorld reads the class and description cells from the *Windows* attributes namespace even on
Ubuntu (its `attributes_ns_ubuntu` holds the Windows URI), so on Ubuntu trees those two cells
are always empty; matched here on purpose, since the table is what OSWorld's agents see.

Truncation (`trim`): OSWorld cuts the table to `a11y_tree_max_tokens` tokens (10,000 by
default) and appends "[...]\\n" when it cut; a table within the budget is returned unchanged.

Set-of-marks (`marks`, `draw_marks`, `set_of_marks`): the nodes above (images included), each
drawn on a copy of the screenshot as a red box with its 1-based index in white on black at its
bottom-left corner; a node whose box is a single colour on the screenshot (as annotated so far,
since OSWorld decides while drawing) gets no mark and no index. The mark table has the header
`index, tag, name, text`. A mark stands for the centre of its box, `(x + w // 2, y + h // 2)`,
as OSWorld's `tag_<index>` variables do.

Deviations from OSWorld's code:
1. Parsing is bounded and defused: at most `MAX_XML_CHARS` characters, `MAX_DEPTH` levels and
   `MAX_NODES` elements, and a DOCTYPE is refused (a DTD declares the entities of "billion
   laughs" expansion); OSWorld parses with an unbounded `ElementTree.fromstring`. Refusals
   raise `EnvProtocolError`: the environment sent a tree no real one is.
2. Positions and sizes are parsed as two integers, never `eval`ed: a value that is not
   "(int, int)" drops its node, where OSWorld runs it as Python (a malformed value fails the
   whole observation there). Every server here and OSWorld's write "(x, y)".
3. `trim` counts tokens with the policy's own tokenizer (its `encode` / `decode`), not
   tiktoken's gpt-4 encoding: the budget is in the tokens the policy reads.
4. Marks read positions from the platform's own component namespace; OSWorld's
   `tag_screenshot` always reads the Ubuntu one, so on Windows it tags nothing.
5. `draw_marks` draws on RGB or RGBA copies (another mode is converted to RGB first) of a
   screenshot of at most `MAX_SCREENSHOT_PIXELS`; the label font is OSWorld's choice (Arial
   15 when installed, else Pillow's default font).
"""

from __future__ import annotations

import functools
import io
import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol
from xml.parsers import expat

from PIL import Image, ImageDraw, ImageFont

from arpo.errors import EnvProtocolError

HEADER = "tag\tname\ttext\tclass\tdescription\tposition (top-left x&y)\tsize (w&h)"
"""First line of the linearised table (OSWorld's, verbatim)."""
MARK_HEADER = "index\ttag\tname\ttext"
"""First line of the set-of-marks table (OSWorld's, verbatim)."""
ELLIPSIS = "[...]\n"
"""What `trim` appends to a table it cut (OSWorld's marker)."""

MAX_XML_CHARS = 32 << 20
"""Longest tree parsed (32 Mi characters): a busy OSWorld VM's tree is a few MB."""
MAX_DEPTH = 256
"""Deepest element nesting parsed: OSWorld's VM server stops descending at depth 50."""
MAX_NODES = 200_000
"""Most elements parsed: a LibreOffice Calc window shows a few thousand cells."""
MAX_SCREENSHOT_PIXELS = 7680 * 4320
"""Largest screenshot `draw_marks` opens (8K); OSWorld's screens are 1920x1080."""

NAMESPACES = {
    "ubuntu": {
        "state": "https://accessibility.ubuntu.example.org/ns/state",
        "component": "https://accessibility.ubuntu.example.org/ns/component",
        "value": "https://accessibility.ubuntu.example.org/ns/value",
    },
    "windows": {
        "state": "https://accessibility.windows.example.org/ns/state",
        "component": "https://accessibility.windows.example.org/ns/component",
        "value": "https://accessibility.windows.example.org/ns/value",
    },
}
"""The namespaces of OSWorld's trees that the filter and the table read, per platform."""
WINDOWS_ATTRIBUTES_NS = "https://accessibility.windows.example.org/ns/attributes"
"""Where OSWorld reads the class (Ubuntu) and description (both platforms) cells."""
WINDOWS_CLASS_NS = "https://accessibility.windows.example.org/ns/class"
"""Where OSWorld reads the class cell on Windows, and the "EditWrapper" class on both."""

KEEP_SUFFIXES = (
    "item",
    "button",
    "heading",
    "label",
    "scrollbar",
    "searchbox",
    "textbox",
    "link",
    "tabelement",
    "textfield",
    "textarea",
    "menu",
)
"""A tag ending with one of these is kept (OSWorld's `judge_node`)."""
KEEP_TAGS = frozenset(
    {
        "alert",
        "canvas",
        "check-box",
        "combo-box",
        "entry",
        "icon",
        "image",
        "paragraph",
        "scroll-bar",
        "section",
        "slider",
        "static",
        "table-cell",
        "terminal",
        "text",
        # Windows (pywinauto class names)
        "netuiribbontab",
        "start",
        "trayclockwclass",
        "traydummysearchcontrol",
        "uiimage",
        "uiproperty",
        "uiribboncommandbar",
    }
)
"""Tags kept as they are (OSWorld's `judge_node`); a tag starting with "document" is kept too."""

_PAIR = re.compile(r"\s*\(\s*([+-]?\d+)\s*,\s*([+-]?\d+)\s*\)\s*")

Box = tuple[int, int, int, int]
"""x, y, width, height in screen pixels."""


@dataclass(frozen=True, slots=True)
class Mark:
    """One numbered box of the set-of-marks."""

    index: int
    """1-based, as drawn on the screenshot and listed in the mark table (OSWorld's `tag_<index>`)."""
    tag: str
    """The node's tag (its role: "push-button", "entry", "menu-item", ...)."""
    name: str
    """The node's `name` attribute ("" when it has none)."""
    text: str
    """The node's text ("" when it has none), unquoted."""
    box: Box
    """x, y, width, height of the node on screen."""

    @property
    def center(self) -> tuple[int, int]:
        """The screen point the mark stands for: the centre of its box, as OSWorld computes it."""
        x, y, w, h = self.box
        return x + w // 2, y + h // 2


@dataclass(frozen=True, slots=True)
class SetOfMarks:
    """The `som` observation: the tagged screenshot, its table and the marks."""

    marks: tuple[Mark, ...]
    screenshot: bytes
    """PNG of the screenshot with the marks drawn."""
    table: str
    """`mark_table(marks)`."""


class Tokenizer(Protocol):
    """What `trim` needs of a tokenizer (a transformers tokenizer has both)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


# ---- parsing ---------------------------------------------------------------------------------


def _qualified(name: str) -> str:
    """Expat's "uri}local" as ElementTree spells it: "{uri}local"."""
    return "{" + name if "}" in name else name


def parse(xml: str) -> ET.Element:
    """The tree of an /accessibility answer, as `ElementTree.fromstring` gives it, parsed safely.

    Raises EnvProtocolError for a tree over `MAX_XML_CHARS`, `MAX_DEPTH` or `MAX_NODES`, one
    with a DOCTYPE (entity declarations live there), and anything that is not well-formed XML.
    """
    if not isinstance(xml, str):
        raise EnvProtocolError(f"the accessibility tree must be XML text, got {type(xml).__name__}")
    if len(xml) > MAX_XML_CHARS:
        raise EnvProtocolError(
            f"accessibility tree refused: {len(xml)} characters, the limit is {MAX_XML_CHARS}"
        )
    builder = ET.TreeBuilder()
    depth = nodes = 0

    def start(name: str, attrs: list[str]) -> None:
        nonlocal depth, nodes
        depth += 1
        nodes += 1
        if depth > MAX_DEPTH:
            raise EnvProtocolError(f"accessibility tree refused: nested deeper than {MAX_DEPTH}")
        if nodes > MAX_NODES:
            raise EnvProtocolError(f"accessibility tree refused: more than {MAX_NODES} elements")
        attrib = {_qualified(attrs[i]): attrs[i + 1] for i in range(0, len(attrs), 2)}
        builder.start(_qualified(name), attrib)

    def end(name: str) -> None:
        nonlocal depth
        depth -= 1
        builder.end(_qualified(name))

    def doctype(*_args: object) -> None:
        raise EnvProtocolError(
            "accessibility tree refused: it has a DOCTYPE (a DTD can declare entities that "
            "expand without bound); OSWorld's and the project's servers never send one"
        )

    p = expat.ParserCreate(namespace_separator="}")
    p.buffer_text = True
    p.ordered_attributes = True
    p.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
    p.StartElementHandler = start
    p.EndElementHandler = end
    p.CharacterDataHandler = builder.data
    p.StartDoctypeDeclHandler = doctype
    try:
        p.Parse(xml, True)
    except expat.ExpatError as e:
        raise EnvProtocolError(f"the accessibility tree is not well-formed XML: {e}") from None
    return builder.close()


# ---- which nodes count -------------------------------------------------------------------------


def _namespaces(platform: str) -> dict[str, str]:
    if platform not in NAMESPACES:
        raise ValueError(f"platform must be 'ubuntu' or 'windows', got {platform!r}")
    return NAMESPACES[platform]


def _pair(value: str | None) -> tuple[int, int] | None:
    m = _PAIR.fullmatch(value) if value is not None else None
    return (int(m.group(1)), int(m.group(2))) if m else None


def box_of(node: ET.Element, platform: str = "ubuntu") -> Box | None:
    """The node's on-screen box (x, y, w, h), or None without a valid one (OSWorld's rule:
    x, y >= 0 and w, h > 0)."""
    cp = _namespaces(platform)["component"]
    pos = _pair(node.get(f"{{{cp}}}screencoord"))
    size = _pair(node.get(f"{{{cp}}}size"))
    if pos is None or size is None or min(pos) < 0 or min(size) <= 0:
        return None
    return (*pos, *size)


def keeps(node: ET.Element, platform: str = "ubuntu", check_image: bool = False) -> bool:
    """Whether OSWorld's filter keeps `node` (see the module docstring for the rules)."""
    tag = node.tag
    if not isinstance(tag, str) or not (
        tag.startswith("document") or tag.endswith(KEEP_SUFFIXES) or tag in KEEP_TAGS
    ):
        return False
    st = _namespaces(platform)["state"]

    def on(state: str) -> bool:
        return node.get(f"{{{st}}}{state}", "false") == "true"

    if not on("visible") or (platform == "ubuntu" and not on("showing")):
        return False
    if not (on("enabled") or on("editable") or on("expandable") or on("checkable")):
        return False
    if not (node.get("name") or node.text or (check_image and node.get("image") == "true")):
        return False
    return box_of(node, platform) is not None


def filter_nodes(
    root: ET.Element, platform: str = "ubuntu", check_image: bool = False
) -> list[ET.Element]:
    """The nodes of the tree under (and including) `root` that OSWorld keeps, in document order."""
    _namespaces(platform)
    return [node for node in root.iter() if keeps(node, platform, check_image)]


# ---- the table -------------------------------------------------------------------------------


def node_text(node: ET.Element, platform: str = "ubuntu") -> str:
    """The node's text as OSWorld reads it: its text, else a Windows "EditWrapper"'s value."""
    if node.text:
        return node.text
    if node.get(f"{{{WINDOWS_CLASS_NS}}}class", "").endswith("EditWrapper"):
        return node.get(f"{{{_namespaces(platform)['value']}}}value") or ""
    return ""


def text_cell(text: str) -> str:
    """A text as the tables show it: `""` when empty, quoted (inner quotes doubled) when it
    holds a double quote, else as it is."""
    if not text:
        return '""'
    return '"' + text.replace('"', '""') + '"' if '"' in text else text


def linearize(xml: str, platform: str = "ubuntu") -> str:
    """OSWorld's linearised accessibility table of the tree `xml` (header and one row per node).

    Raises EnvProtocolError for a tree `parse` refuses, ValueError for an unknown platform.
    """
    ns = _namespaces(platform)
    cp = ns["component"]
    class_attr = f"{{{WINDOWS_ATTRIBUTES_NS if platform == 'ubuntu' else WINDOWS_CLASS_NS}}}class"
    rows = [HEADER]
    for node in filter_nodes(parse(xml), platform):
        rows.append(
            "\t".join(
                (
                    node.tag,
                    node.get("name", ""),
                    text_cell(node_text(node, platform)),
                    node.get(class_attr, ""),
                    node.get(f"{{{WINDOWS_ATTRIBUTES_NS}}}description", ""),
                    node.get(f"{{{cp}}}screencoord", ""),
                    node.get(f"{{{cp}}}size", ""),
                )
            )
        )
    return "\n".join(rows)


def trim(table: str, tokenizer: Tokenizer, max_tokens: int) -> str:
    """`table` cut to its first `max_tokens` tokens plus "[...]\\n" when it is longer; unchanged
    when it fits. Tokens are the policy tokenizer's (deviation 3). The cut may split a
    character that spans several byte-level tokens, as OSWorld's does."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    ids = list(tokenizer.encode(table, add_special_tokens=False))
    if len(ids) <= max_tokens:
        return table
    return tokenizer.decode(ids[:max_tokens]) + ELLIPSIS


# ---- set-of-marks ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _label_font() -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """OSWorld's label font: Arial 15 if the system has it, else Pillow's default."""
    try:
        return ImageFont.truetype("arial.ttf", 15)
    except OSError:
        return ImageFont.load_default()


def _open_screenshot(png: bytes) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(png))
        if image.width * image.height > MAX_SCREENSHOT_PIXELS:
            raise EnvProtocolError(
                f"screenshot refused: {image.width}x{image.height} is more than "
                f"{MAX_SCREENSHOT_PIXELS} pixels"
            )
        image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise EnvProtocolError(f"the screenshot is not a readable image: {e}") from None
    return image if image.mode in ("RGB", "RGBA") else image.convert("RGB")


def _draw(draw: ImageDraw.ImageDraw, mark: Mark) -> None:
    """Mark `mark` as OSWorld does: a red box, its index in white on black at bottom-left."""
    x, y, w, h = mark.box
    draw.rectangle([(x, y), (x + w, y + h)], outline="red", width=1)
    font, label, at = _label_font(), str(mark.index), (x, y + h)
    draw.rectangle(draw.textbbox(at, label, font=font, anchor="lb"), fill="black")
    draw.text(at, label, font=font, anchor="lb", fill="white")


def _one_colour(image: Image.Image, box: Box) -> bool:
    """Whether the box is a single colour on `image` (every band's min equals its max)."""
    x, y, w, h = box
    extrema = image.crop((x, y, x + w, y + h)).getextrema()
    return all(lo == hi for lo, hi in extrema)  # type: ignore[misc]  # RGB(A): one pair per band


def _tag(xml: str, image: Image.Image | None, platform: str) -> list[Mark]:
    """The marks of `xml`; with `image`, drawn onto it as they are chosen (a box of one colour
    on the image as drawn so far gets no mark, as in OSWorld)."""
    draw = ImageDraw.Draw(image) if image is not None else None
    out: list[Mark] = []
    for node in filter_nodes(parse(xml), platform, check_image=True):
        box = box_of(node, platform)
        if box is None or (image is not None and _one_colour(image, box)):
            continue
        mark = Mark(len(out) + 1, node.tag, node.get("name", ""), node_text(node, platform), box)
        if draw is not None:
            _draw(draw, mark)
        out.append(mark)
    return out


def marks(xml: str, screenshot: bytes | None = None, platform: str = "ubuntu") -> list[Mark]:
    """The marks OSWorld's `som` observation tags, numbered from 1.

    Without `screenshot`, every node the filter keeps (images included); with it, only those
    whose box is not a single colour on the screenshot as annotated so far (OSWorld's rule).
    """
    _namespaces(platform)
    image = _open_screenshot(screenshot) if screenshot is not None else None
    return _tag(xml, image, platform)


def draw_marks(png: bytes, marks: Sequence[Mark]) -> bytes:
    """A PNG copy of the screenshot `png` with `marks` drawn on it (the original is untouched).

    Cost: a PNG decode and encode of the whole screen (tens of ms at 1920x1080).
    """
    image = _open_screenshot(png)
    draw = ImageDraw.Draw(image)
    for mark in marks:
        _draw(draw, mark)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def mark_table(marks: Sequence[Mark]) -> str:
    """The table OSWorld's `som` observation gives with the tagged screenshot."""
    rows = [MARK_HEADER]
    rows += [f"{m.index}\t{m.tag}\t{m.name}\t{text_cell(m.text)}" for m in marks]
    return "\n".join(rows)


def set_of_marks(xml: str, screenshot: bytes, platform: str = "ubuntu") -> SetOfMarks:
    """The whole `som` observation in one pass: marks chosen and drawn on a copy of `screenshot`."""
    _namespaces(platform)
    image = _open_screenshot(screenshot)
    found = _tag(xml, image, platform)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return SetOfMarks(tuple(found), out.getvalue(), mark_table(found))

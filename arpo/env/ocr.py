"""Marks read from pixels: the set-of-marks table built from a screenshot with OCR.

Where a screen has no accessibility tree (LibreOffice on its X11 plugin, an application
without accessibility, an OSWorld VM whose tree is thin) the `som` observation can still
give the model numbered marks: the text on the screen, read with PP-OCRv4 (PyPI's
`rapidocr-onnxruntime`, which ships the detection and recognition models as ONNX files and
runs them on onnxruntime, on the CPU).

    cfg = OcrConfig()
    found = read_marks(png, cfg)                 # list[a11y.Mark], numbered from 1
    som = set_of_marks(png, cfg)                 # a11y.SetOfMarks: marked PNG, table, marks
    som = await read_set_of_marks(png, cfg)      # the same, off the event loop, in timeout_s

What a mark is here: the detector finds text lines, the recogniser reads each with a box per
character (`return_word_box=True`), and a line is split into elements wherever two
consecutive characters are further apart than `split_gap` times the line's height (a menu
bar read as one line becomes one element per menu; the space between two words of a
label, about a third of the height, does not split it). Each element is one row of the
same table the tree makes (`a11y.mark_table`): tag "text", the text read as its name, an
empty text cell; its box is the union of its characters' boxes, and `click(mark=N)` clicks
its centre, exactly as with the tree. Elements are in the detector's reading order (top to
bottom, left to right). Text read with a confidence under `min_score` is dropped.

The turn's message is som's, word for word (OSWorld's sentence, which names the
accessibility tree): a policy reads OCR's table as it reads the tree's.

Cost: one PP-OCRv4 pass per screenshot, a median 1.8 s (0.5 to 5 s) for a 1280x720 screen
with two threads on a shared 2-core machine, against 2 to 12 ms for the tree's marks
(benchmarks/ocr_vs_tree.py; benchmarks/bench_long_context.py has it beside the other
observation types, its `som_ocr` rows). How the table compares with the tree's on the
simulated desktop: benchmarks/ocr_vs_tree.py (`match_marks` below is its scoring).

The engine is loaded once per process, on first use (about 0.5 s, 15 MB of models), and
runs one screenshot at a time on a thread of its own (`read_set_of_marks`), onnxruntime
spreading each pass over `threads` cores.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import difflib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from arpo.config import check_on_build, check_range, check_seconds, option
from arpo.env import a11y
from arpo.errors import EnvTimeout

OCR_TAG = "text"
"""The tag of every mark read from pixels (OCR sees text, not roles)."""
MAX_THREADS = 256
"""Most onnxruntime threads one OCR pass may use."""


@dataclass
class OcrConfig:
    """How the som table is read from a screenshot when the marks come from OCR."""

    timeout_s: float = option(
        30.0,
        "Longest wait for one screenshot's marks, queueing behind other screenshots of the "
        "same actor process included (a pass takes 0.5 to 5 s for 1280x720 on two cores). "
        "Past it the turn's observation fails and the episode is env_error (not trained "
        "on); the pass already started still runs to its end (> 0, at most a week).",
    )
    min_score: float = option(
        0.5,
        "Text read with a lower recognition confidence is dropped (0..1; rapidocr's own "
        "default, 0.5).",
    )
    split_gap: float = option(
        0.8,
        "A text line is split into two elements where two consecutive characters are more "
        "than this many line heights apart (> 0; a space between words is about 0.3, "
        "menus in a bar are 1 or more apart).",
    )
    threads: int = option(
        2,
        "onnxruntime threads per OCR pass (1..MAX_THREADS). The engine is made once per "
        "process with the first value it is asked for.",
    )

    def __post_init__(self) -> None:
        check_on_build(self)

    def validate(self) -> None:
        check_seconds("timeout_s", self.timeout_s, "one screenshot's OCR")
        check_range("min_score", self.min_score, 0, 1, "a recognition confidence")
        check_range("split_gap", self.split_gap, 0, 100, "line heights", lo_open=True)
        check_range("threads", self.threads, 1, MAX_THREADS, "onnxruntime threads")


# ---- the engine, once per process ---------------------------------------------------------

_lock = threading.Lock()
_engine: Any = None
_executor: concurrent.futures.ThreadPoolExecutor | None = None


def engine(threads: int = 2) -> Any:
    """The process's OCR engine (rapidocr's `RapidOCR`), made on the first call with
    `threads` onnxruntime threads and kept; later calls return it whatever they ask."""
    global _engine
    with _lock:
        if _engine is None:
            try:
                from rapidocr_onnxruntime import RapidOCR
            except ImportError as e:
                raise ImportError(
                    "marks read from pixels need rapidocr-onnxruntime: install the actor "
                    "extra (pip install -e '.[actor]', or `make setup`)"
                ) from e
            _engine = RapidOCR(intra_op_num_threads=threads, inter_op_num_threads=1)
        return _engine


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread OCR passes run on (one screenshot at a time per process)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="arpo-ocr")
        return _executor


# ---- reading ------------------------------------------------------------------------------


def _rect(points: Sequence[Sequence[float]], size: tuple[int, int]) -> a11y.Box | None:
    """The axis-aligned box (x, y, w, h) around `points`, inside the screen; None if empty."""
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    x0, y0 = max(0, int(min(xs))), max(0, int(min(ys)))
    x1, y1 = min(size[0], round(max(xs))), min(size[1], round(max(ys)))
    return (x0, y0, x1 - x0, y1 - y0) if x1 > x0 and y1 > y0 else None


def _split(line: Any, split_gap: float, size: tuple[int, int]) -> list[tuple[str, a11y.Box]]:
    """The elements of one line rapidocr read: [quad, text, score, char_quads, chars, ...].
    Split where consecutive characters are more than `split_gap` line heights apart; the
    whole line as one element when its characters do not line up with its text."""
    quad, text = line[0], str(line[1]).strip()
    whole = _rect(quad, size)
    if not text or whole is None:
        return []
    chars = list(line[4]) if len(line) > 4 and line[4] else []
    quads = list(line[3]) if len(line) > 3 and line[3] else []
    if len(chars) != len(quads) or "".join(chars).replace(" ", "") != text.replace(" ", ""):
        return [(text, whole)]
    height = whole[3]
    out: list[tuple[str, a11y.Box | None]] = []
    word: list[tuple[str, Any]] = []
    last_right: float | None = None
    for ch, q in zip(chars, quads, strict=True):
        if ch.isspace():
            if word:
                word.append((" ", None))
            continue
        left = min(p[0] for p in q)
        if last_right is not None and left - last_right > split_gap * height and word:
            out.append(_element(word, size))
            word = []
        word.append((ch, q))
        last_right = max(p[0] for p in q)
    if word:
        out.append(_element(word, size))
    return [(t, b) for t, b in out if t and b is not None]


def _element(word: list[tuple[str, Any]], size: tuple[int, int]) -> tuple[str, a11y.Box | None]:
    """One element of a line: its characters' text and the box round their boxes."""
    text = "".join(c for c, _ in word).strip()
    points = [p for _, q in word if q is not None for p in q]
    return text, _rect(points, size)


def read_marks(png: bytes, cfg: OcrConfig | None = None) -> list[a11y.Mark]:
    """The text elements of the screenshot `png`, as marks numbered from 1 (module doc).
    CPU work of about a second: call it off the event loop (`read_set_of_marks`).
    EnvProtocolError for a screenshot that is not a readable image or is over
    `a11y.MAX_SCREENSHOT_PIXELS`."""
    cfg = cfg or OcrConfig()
    image = a11y._open_screenshot(png).convert("RGB")
    # rapidocr stores the call's thresholds on the engine: every call passes the same ones
    # (its defaults, no score filter), so calls from several threads agree; min_score is
    # applied here.
    result, _ = engine(cfg.threads)(
        image, return_word_box=True, text_score=0.0, box_thresh=0.5, unclip_ratio=1.6
    )
    found: list[a11y.Mark] = []
    for line in result or []:
        if float(line[2]) < cfg.min_score:
            continue
        for text, box in _split(line, cfg.split_gap, image.size):
            found.append(a11y.Mark(len(found) + 1, OCR_TAG, text, "", box))
    return found


def set_of_marks(png: bytes, cfg: OcrConfig | None = None) -> a11y.SetOfMarks:
    """The whole `som` observation from pixels: the marks read, drawn on a copy of `png`
    as `a11y.draw_marks` draws the tree's, and their table."""
    found = read_marks(png, cfg)
    return a11y.SetOfMarks(tuple(found), a11y.draw_marks(png, found), a11y.mark_table(found))


async def read_set_of_marks(png: bytes, cfg: OcrConfig | None = None) -> a11y.SetOfMarks:
    """`set_of_marks` on the process's OCR thread, bounded by `cfg.timeout_s` (waiting for
    the thread included). EnvTimeout past it, naming the field to change."""
    cfg = cfg or OcrConfig()
    future = asyncio.get_running_loop().run_in_executor(_pool(), set_of_marks, png, cfg)
    try:
        return await asyncio.wait_for(future, cfg.timeout_s)
    except TimeoutError:
        raise EnvTimeout(
            f"reading the screen's marks with OCR took more than {cfg.timeout_s} s "
            "(episode.ocr.timeout_s): raise it, give the pass more cores (episode.ocr.threads), "
            "or run fewer environments per actor process"
        ) from None


# ---- held against the tree -----------------------------------------------------------------


def normalise(text: str) -> str:
    """A label as `match_marks` compares it: case folded, without whitespace (OCR drops
    and adds spaces)."""
    return "".join(text.casefold().split())


def same_text(read: str, label: str, min_ratio: float = 0.8) -> bool:
    """Whether OCR's `read` is the label `label`: equal once normalised, or at least
    `min_ratio` alike (difflib's ratio: one misread character in a ten-letter label)."""
    a, b = normalise(read), normalise(label)
    if not a or not b:
        return False
    return a == b or difflib.SequenceMatcher(None, a, b).ratio() >= min_ratio


def _inside(point: tuple[int, int], box: a11y.Box) -> bool:
    x, y = point
    bx, by, bw, bh = box
    return bx <= x < bx + bw and by <= y < by + bh


def _labels(mark: a11y.Mark) -> list[str]:
    return [t for t in (mark.name, mark.text) if t.strip()]


@dataclass(frozen=True, slots=True)
class MarkMatch:
    """How an OCR table compares with the tree's on one screen (`match_marks`)."""

    tree: int
    """Tree marks with a label (name or text): the elements OCR could find."""
    found: int
    """Of those, the ones some OCR mark finds: its text is the element's name or text
    (`same_text`) and its centre (where `click(mark=N)` clicks) lies in the element's box."""
    ocr: int
    """OCR marks."""
    correct: int
    """Of those, the ones that find some tree mark (the same test)."""
    missed: tuple[str, ...]
    """The labels of the tree marks not found."""
    extra: tuple[str, ...]
    """The texts of the OCR marks that find no tree mark."""

    @property
    def recall(self) -> float:
        return self.found / self.tree if self.tree else 1.0

    @property
    def precision(self) -> float:
        return self.correct / self.ocr if self.ocr else 1.0


def match_marks(tree: Sequence[a11y.Mark], ocr: Sequence[a11y.Mark]) -> MarkMatch:
    """Hold the OCR marks `ocr` against the tree's marks `tree` of the same screen: an OCR
    mark finds a tree mark when its text is the element's name or text (`same_text`) and
    a click at its centre lands in the element's box."""
    labelled = [m for m in tree if _labels(m)]

    def finds(o: a11y.Mark, t: a11y.Mark) -> bool:
        return _inside(o.center, t.box) and any(same_text(o.name, lab) for lab in _labels(t))

    found = [t for t in labelled if any(finds(o, t) for o in ocr)]
    correct = [o for o in ocr if any(finds(o, t) for t in labelled)]
    return MarkMatch(
        tree=len(labelled),
        found=len(found),
        ocr=len(ocr),
        correct=len(correct),
        missed=tuple(_labels(t)[0] for t in labelled if t not in found),
        extra=tuple(o.name for o in ocr if o not in correct),
    )

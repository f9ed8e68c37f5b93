"""A scripted policy: replays a task's oracle as UI-TARS text, behind the engine interface.

It exists for tests and benchmarks of the actor and the transport (it is never a policy
to train): the actor drives it exactly like a real engine (`arpo.policy.engine.Engine`):
token ids + screenshots in, a `Completion` with sampled token ids, log-probs, text and
policy version out; `update_weights(weights, version)` switches the version it reports.

- Episodes: `policy.episode(task)` returns the per-episode view the actor calls
  `generate` on (the real engines return themselves); the scripted view answers step k
  with the oracle's k-th pyautogui action written as UI-TARS text
  (`Thought: ...\\nAction: click(start_box='<|box_start|>(x,y)<|box_end|>')`, coordinates
  in the frame of the screenshot it was shown), then `finished()`.
- Observations: the actor shows it each turn's observation (`observe`, `arpo.actor.episode.
  Observation`); it answers in that turn's coordinate frame (screen pixels with a table,
  so it needs no screenshot for `a11y_tree`), and with set-of-marks it names the mark of
  the element a click targets (`click(mark=N)`: the smallest mark box holding the oracle's
  point), clicking at coordinates only where no mark holds it.
- Mistakes, to give rewards some spread: with `quit_prob` an episode says `finished()`
  half-way (score 0), with `garbage_prob` a response is not in the action format
  (format reward -1).
- Tokens: a byte-level tokenizer (`ByteTokenizer`: one id per UTF-8 byte, Qwen's special
  tokens above 255), so prompts are built by the real `arpo.policy.prompt.EpisodePrompt`
  with realistic image-token counts; log-probs are drawn from a fixed seed.
- Inference cost, for rollout benchmarks: requests are served in batches like a real
  engine (`batch_wait_ms` to gather, at most `max_batch` together); a batch of n takes
  `base_ms + per_request_ms * n` (0 by default).
"""

from __future__ import annotations

import ast
import asyncio
import copy
import math
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from arpo.errors import EngineError
from arpo.policy import actions as A
from arpo.policy.engine import Completion, SamplingParams
from arpo.policy.prompt import image_size
from arpo.policy.tiny import QWEN_SPECIAL_TOKENS

# Qwen's special tokens, in their order (the same list the tiny model's tokenizer carries).
_SPECIAL = QWEN_SPECIAL_TOKENS


class ByteTokenizer:
    """One id per UTF-8 byte; Qwen's special tokens get ids 256.. (enough for EpisodePrompt)."""

    unk_token_id = -1

    def __init__(self) -> None:
        self._ids = {t: 256 + i for i, t in enumerate(_SPECIAL)}
        self._toks = {i: t for t, i in self._ids.items()}

    def convert_tokens_to_ids(self, token: str) -> int:
        return self._ids.get(token, -1)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out: list[int] = []
        rest = text
        while rest:
            i = rest.find("<|")
            j = rest.find("|>", i) if i >= 0 else -1
            tok = rest[i : j + 2] if j >= 0 else ""
            if i >= 0 and tok in self._ids:
                out += list(rest[:i].encode("utf-8"))
                out.append(self._ids[tok])
                rest = rest[j + 2 :]
            else:
                out += list(rest.encode("utf-8"))
                break
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        parts: list[str] = []
        raw = bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                raw.append(i)
                continue
            parts.append(raw.decode("utf-8", "replace"))
            raw = bytearray()
            if not skip_special_tokens:
                parts.append(self._toks.get(i, ""))
        parts.append(raw.decode("utf-8", "replace"))
        return "".join(parts)


def oracle_to_actions(code: str, scroll_clicks: int = 5) -> list[A.Action]:
    """The UI-TARS actions doing what one line of oracle pyautogui code does.

    `time.sleep(...)` between the calls (the local suite's oracles pause for LibreOffice)
    is dropped: UI-TARS has no timed pause (`wait()` is a turn of its own, 5 s). On a
    desktop the runner waits `RunnerConfig.action_pause_s` between the actions of one
    response instead, for a demonstration and a policy's response alike. A demonstration
    recorded from such a line is kept only where its checker still scores 1
    (`arpo.offline.demos.record_demos`)."""
    try:
        tree = ast.parse(code.strip())
    except SyntaxError as e:
        raise EngineError(f"oracle step is not Python: {code!r:.100}: {e}") from None
    out: list[A.Action] = []
    for stmt in tree.body:
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
            raise EngineError(f"oracle step {code!r:.100} is not a pyautogui call")
        name = call.func.attr
        if (
            name == "sleep"
            and isinstance(call.func.value, ast.Name)
            and call.func.value.id == "time"
        ):
            continue
        args = [ast.literal_eval(a) for a in call.args]
        kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}
        if name == "click" and len(args) >= 2:
            out.append(A.Click(A.Point(args[0], args[1])))
        elif name == "doubleClick" and len(args) >= 2:
            out.append(A.LeftDouble(A.Point(args[0], args[1])))
        elif name == "rightClick" and len(args) >= 2:
            out.append(A.RightSingle(A.Point(args[0], args[1])))
        elif name in ("write", "typewrite") and args:
            out.append(A.Type(str(args[0])))
        elif name == "press" and args:
            out.append(A.Press(str(args[0])))
        elif name == "hotkey":
            out.append(A.Hotkey(tuple(str(a) for a in args)))
        elif name == "scroll" and args:
            n = int(args[0])
            at = A.Point(kw["x"], kw["y"]) if "x" in kw and "y" in kw else None
            direction = "up" if n > 0 else "down"
            out += [A.Scroll(direction, at)] * max(1, math.ceil(abs(n) / scroll_clicks))
        else:
            raise EngineError(f"oracle step {code!r:.100}: no UI-TARS action for {name}")
    return out


@dataclass
class _Pending:
    future: asyncio.Future
    n_tokens: int


@dataclass
class ScriptedPolicy:
    """The engine-shaped scripted policy (see the module docstring)."""

    quit_prob: float = 0.0
    """Probability that an episode ends with finished() half-way through its oracle."""
    garbage_prob: float = 0.0
    """Probability that a response is not in the action format."""
    error_prob: float = 0.0
    """Probability that a call fails with EngineError (an engine fault: the episode is
    abandoned and its grant given back)."""
    scroll_clicks: int = 5
    """Wheel clicks per scroll action of the actor's ActionConfig (oracle scrolls are split)."""
    min_pixels: int = A.MIN_PIXELS
    """Image budget of the Qwen2.5-VL-shaped prompts it answers (`image_rule`)."""
    max_pixels: int = A.MAX_PIXELS
    base_ms: float = 0.0
    """Fixed cost of one batched inference call."""
    per_request_ms: float = 0.0
    """Added cost per request in the batch."""
    batch_wait_ms: float = 5.0
    max_batch: int = 64
    seed: int = 0
    tokenizer: ByteTokenizer = field(default_factory=ByteTokenizer)
    policy_version: int = 0
    stats: dict[str, float] = field(default_factory=lambda: {"batches": 0, "requests": 0})

    @property
    def image_rule(self) -> Any:
        """Qwen2.5-VL's image rule with this policy's budget (`min_pixels`, `max_pixels`)."""
        from arpo.policy.family import ImageRule

        return ImageRule("grid", A.IMAGE_FACTOR, self.min_pixels, self.max_pixels)

    def __post_init__(self) -> None:
        self._queue: asyncio.Queue[_Pending] | None = None
        self._loop_task: asyncio.Task | None = None
        self._episodes = 0

    async def start(self) -> None:
        if self._loop_task is None and (self.base_ms or self.per_request_ms):
            self._queue = asyncio.Queue()
            self._loop_task = asyncio.create_task(self._batcher(), name="scripted-batcher")

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None

    async def __aenter__(self) -> ScriptedPolicy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def update_weights(self, weights: Any, version: int) -> None:
        self.policy_version = version

    def episode(self, task: Any) -> _ScriptedEpisode:
        oracle = list(task.extra.get("oracle") or [])
        self._episodes += 1
        rng = random.Random(f"{self.seed}:{task.id}:{self._episodes}")
        return _ScriptedEpisode(self, oracle, rng)

    async def _cost(self) -> None:
        """Wait for this request's batch to be served (the inference cost model)."""
        if self._queue is None:
            return
        fut = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(fut, 0))
        await fut

    async def _batcher(self) -> None:
        assert self._queue is not None
        while True:
            batch = [await self._queue.get()]
            await asyncio.sleep(self.batch_wait_ms / 1000)
            while len(batch) < self.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            await asyncio.sleep((self.base_ms + self.per_request_ms * len(batch)) / 1000)
            self.stats["batches"] += 1
            self.stats["requests"] += len(batch)
            for p in batch:
                if not p.future.done():
                    p.future.set_result(None)


def turn_frame(seen: Any, images: Sequence[Any], rule: Any, who: str) -> A.Frame:
    """The coordinate frame a scripted answer is written in: the shown observation's
    (`arpo.actor.episode.Observation.frame`), else the last screenshot's as UI-TARS sees it.
    EngineError (naming `who`) when it was shown neither."""
    if seen is not None:
        return seen.frame
    if images:
        w, h = image_size(images[-1])
        return A.Frame.shown(w, h, rule)
    raise EngineError(f"{who} needs the screenshot or the observation (`observe`) to click")


def by_mark(action: A.Action, marks: Sequence[Any] | None) -> A.Action:
    """`action` as set-of-marks shows it: a pointer action at a point some mark's box holds
    becomes the same action on the smallest such mark (`click(mark=N)`, at the mark's
    centre); anything else (no marks, no mark holds the point, not a pointer action) is
    returned as it is."""
    if not marks or not isinstance(action, A.Click | A.LeftDouble | A.RightSingle | A.Hover):
        return action
    p = action.point
    holding = [
        m for m in marks
        if m.box[0] <= p.x < m.box[0] + m.box[2] and m.box[1] <= p.y < m.box[1] + m.box[3]
    ]  # fmt: skip
    if not holding:
        return action
    m = min(holding, key=lambda m: m.box[2] * m.box[3])
    return type(action)(A.Point(*m.center), m.index)


class _ScriptedEpisode:
    def __init__(self, policy: ScriptedPolicy, oracle: list[str], rng: random.Random):
        self.policy = policy
        self.oracle = oracle
        self.rng = rng
        self.step = 0
        self.quit_at = len(oracle) // 2 if rng.random() < policy.quit_prob else None
        self.seen: Any = None
        """The last observation the actor showed (None: it shows none; the frame is then
        the screenshot's)."""

    def observe(self, observation: Any) -> None:
        """The turn's observation (`arpo.actor.episode.Observation`): its frame and marks."""
        self.seen = observation

    def branch(self, child: int) -> _ScriptedEpisode:
        """A copy for fork child `child`: same plan and step, its own random stream."""
        twin = copy.copy(self)
        twin.rng = random.Random(f"{self.rng.random()}:{child}")
        return twin

    def _text(self, frame: A.Frame) -> str:
        k = self.step
        self.step += 1
        if self.rng.random() < self.policy.garbage_prob:
            return "I am not sure what to do here."
        if k >= len(self.oracle) or (self.quit_at is not None and k >= self.quit_at):
            return A.format_response("The task is complete.", [A.Finished()], frame)
        acts = oracle_to_actions(self.oracle[k], self.policy.scroll_clicks)
        acts = [by_mark(a, getattr(self.seen, "marks", None)) for a in acts]
        return A.format_response(f"Step {k + 1} of the plan.", acts, frame)

    async def generate(
        self,
        token_ids: Sequence[int] | np.ndarray,
        images: Sequence[Any] = (),
        params: SamplingParams | None = None,
    ) -> Completion:
        p = self.policy
        frame = turn_frame(self.seen, images, p.image_rule, "the scripted policy")
        version = p.policy_version
        await p._cost()
        if p.error_prob and self.rng.random() < p.error_prob:
            raise EngineError("injected engine fault (scripted error_prob)")
        text = self._text(frame)
        tok = p.tokenizer
        ids = [*tok.encode(text), tok.convert_tokens_to_ids("<|im_end|>")]
        seed = zlib.crc32(text.encode()) ^ len(token_ids)
        lps = -np.random.default_rng(seed).exponential(0.3, len(ids)).astype(np.float32)
        return Completion(np.asarray(ids, np.int32), lps, text, "stop", version)

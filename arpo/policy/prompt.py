"""UI-TARS-1.5 prompts at token level: built once per turn, never re-tokenised.

The conversation (the ARPO reference's, see `prompt_text`), rendered by Qwen2-VL's
chat template:

    <|im_start|>system\\n{SYSTEM_MESSAGE}<|im_end|>\\n
    <|im_start|>user\\n{computer_use_prompt(instruction)}<|im_end|>\\n
    <|im_start|>user\\n<|vision_start|><|image_pad|>*n0<|vision_end|><|im_end|>\\n      turn 0
    <|im_start|>assistant\\n{response 0 ... <|im_end|>}
    \\n<|im_start|>user\\n<|vision_start|><|image_pad|>*n1<|vision_end|><|im_end|>\\n    turn 1
    <|im_start|>assistant\\n{response 1 ... <|im_end|>}
    ...

`EpisodePrompt` keeps the token ids of every piece. `add_screenshot` returns the
ids this turn appends (turn 0: system + instruction + image message + assistant
header; later turns: the "\\n" that closes the previous assistant message, the
image message and the assistant header); `add_response` appends the sampled ids
as they are (the engine returns them ending in <|im_end|> when the model stopped;
otherwise "<|im_end|>\\n" is prepended to the next turn's ids). These are the
`Turn.prompt_ids` / `Turn.response_ids` of the record, so a trajectory's
`sequence()` is `model_input()` + the last response, token for token.

Observation types (`observation`, OSWorld's `observation_type`): with `screenshot` a turn's
user message is the image alone, as above. With a table it starts with the text
`prompt_text.observation_text` gives (OSWorld's sentence around the accessibility table, or
the som mark table), tokenised here once, and holds the image after it when the type has
one (`screenshot_a11y_tree`, `som`) or no image (`a11y_tree`):

    <|im_start|>user\\n{text}<|vision_start|><|image_pad|>*n<|vision_end|><|im_end|>\\n
    <|im_start|>user\\n{text}<|im_end|>\\n                                      a11y_tree

`add_observation(image, table)` starts such a turn (`add_screenshot(image)` is the
screenshot-only form). The ids are what the model reads and what the record keeps, so the
learner trains on the table's tokens exactly as sampled.

Model families (`arpo.policy.family`): the layout above is the Qwen families' (Qwen2.5-VL,
Qwen3-VL). SmolVLM's chat writes `<|im_start|>` once, then `System: ...`, `User: ...`,
`User:<image block>` and `Assistant:` messages, each ending in `<end_of_utterance>\n`; its
image block is `<fake_token_around_image><global-img><image>*n<fake_token_around_image>`.
`EpisodePrompt.from_processor` takes the family and image rule from the processor.

Image placeholders: n = the family's `ImageRule.tokens` for the screenshot (Qwen2.5-VL:
(h / 28) * (w / 28) after `smart_resize`, factor 28 = patch 14 x merge 2, within the
processor's min / max pixels; Qwen3-VL the same with 32; SmolVLM a fixed count). The engine
gets the original screenshot and its image processor resizes it the same way, so the counts
agree (the engines check).

Equality with the chat template: the ids equal `processor.apply_chat_template(...)`
for the same conversation whenever each response's ids are the tokenizer's own
encoding of its text (tests/test_policy_prompt.py). They differ, by design,
only where sampled ids are not the canonical encoding of their decoded text
(the model sampled "ab" as "a" + "b", or ids that decode to invalid UTF-8): the
template path would decode and re-encode, and the trained tokens would no
longer be the sampled ones.

History window (`history_images`, default 15 = the reference's all-screenshots-kept
over its 15-step episodes): when more observations than that have been shown, the
oldest observation messages (screenshot and / or table) leave the context, as in
OSWorld's UI-TARS agent (its `history_n`): the assistant messages of those turns stay,
their observations go.
The context is then no longer a prefix of the previous one, so `model_input()`
re-assembles it from the kept pieces (still no tokenisation: header ids + for each
turn, its image message if within the window, the assistant header, the sampled
ids, the closing ids). Each turn's `prompt_ids` are still what it appended to the
full history; a trainer that wants to score a turn with exactly the context it was
sampled under must rebuild that turn's windowed context with `context_for_turn(t)`.
With the reference settings (15 images, 15 steps) the window never drops anything.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from arpo.errors import EngineError
from arpo.policy.actions import IMAGE_FACTOR
from arpo.policy.family import FAMILIES, Family, ImageRule, family_for_processor
from arpo.policy.prompt_text import observation_text
from arpo.record import OBSERVATION_TYPES


def image_size(image: Any) -> tuple[int, int]:
    """(width, height) of a PIL image or encoded image bytes, without decoding pixels."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.size
    with Image.open(io.BytesIO(bytes(image))) as im:
        return im.size


def image_rule(processor: Any) -> ImageRule:
    """The image rule of a loaded processor (`AutoProcessor` of a model folder), by its family."""
    return family_for_processor(processor).image_rule(processor)


def pixel_bounds(processor: Any) -> tuple[int, int]:
    """(min_pixels, max_pixels) of a Qwen-family processor (EngineError for another family:
    use `image_rule`)."""
    rule = image_rule(processor)
    if rule.kind != "grid":
        raise EngineError(f"a {family_for_processor(processor).name} processor has no pixel bounds")
    return rule.min_pixels, rule.max_pixels


def _system_and_task(instruction: str, prompt_kwargs: dict[str, Any]) -> tuple[str, str]:
    from arpo.policy import prompt_text

    return prompt_text.SYSTEM_MESSAGE, prompt_text.computer_use_prompt(instruction, **prompt_kwargs)


@dataclass
class _TurnPieces:
    image: Any
    """The screenshot shown (None: a turn without one, `a11y_tree`)."""
    image_msg: list[int]
    """The ids of the turn's whole observation message (text and / or image)."""
    text: str = ""
    response: list[int] = field(default_factory=list)
    closed: bool = False


VISION_TOKENS = tuple(dict.fromkeys(t for f in FAMILIES.values() for t in f.vision_tokens))
"""Tokens no response may hold, of every family (`Family.vision_tokens`): they stand for
pixels the next prompt would have to supply. A tokenizer holds only its own family's."""
FORBIDDEN_LOGIT_BIAS = -100.0
"""The logit bias an engine that takes no mask (vLLM, an OpenAI-compatible server) gets for
them: the tokens' probability is then below e^-100 of what it was, and the log-probs of
everything else match the learner's masked distribution to within that."""


def forbidden_token_ids(tokenizer: Any) -> list[int]:
    """The ids of VISION_TOKENS in `tokenizer` (names it does not have are left out): masked
    (logit -inf) by every engine before sampling and by the learner when scoring, so no
    response can hold one and the behaviour log-probs stay those of the masked distribution."""
    unk = getattr(tokenizer, "unk_token_id", None)
    out = []
    for name in VISION_TOKENS:
        i = tokenizer.convert_tokens_to_ids(name)
        if isinstance(i, int) and i >= 0 and i != unk:
            out.append(int(i))
    return sorted(set(out))


class EpisodePrompt:
    """The token ids of one episode's conversation, built incrementally (see module doc)."""

    def __init__(
        self,
        tokenizer: Any,
        instruction: str,
        *,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        rule: ImageRule | None = None,
        family: Family | str = "qwen2_5_vl",
        history_images: int = 15,
        system: str | None = None,
        task_text: str | None = None,
        prompt_kwargs: dict[str, Any] | None = None,
        observation_type: str = "screenshot",
    ) -> None:
        if history_images < 1:
            raise ValueError(f"history_images must be >= 1, got {history_images}")
        if observation_type not in OBSERVATION_TYPES:
            raise ValueError(
                f"observation_type must be one of {', '.join(OBSERVATION_TYPES)}, got "
                f"{observation_type!r}"
            )
        self.tokenizer = tokenizer
        self.family = FAMILIES[family] if isinstance(family, str) else family
        """The model family whose chat and image blocks the ids follow."""
        if rule is None:
            if min_pixels is None or max_pixels is None:
                raise ValueError(
                    "give the image rule (rule=image_rule(processor)) or min / max pixels"
                )
            rule = ImageRule("grid", IMAGE_FACTOR, int(min_pixels), int(max_pixels))
        self.rule = rule
        """How a screenshot is shown (`arpo.policy.family.ImageRule`)."""
        self.history_images = history_images
        self.observation_type = observation_type
        """What each turn shows (`arpo.record.OBSERVATION_TYPES`)."""
        sys_text, task = _system_and_task(
            instruction, {"observation_type": observation_type, **(prompt_kwargs or {})}
        )
        self.system = sys_text if system is None else system
        self.task_text = task if task_text is None else task_text

        chat = self.family.chat(tokenizer)
        self.chat = chat
        self.end_id = chat.end
        """The end-of-message token (<|im_end|>, SmolVLM's <end_of_utterance>)."""
        self.image_pad = tokenizer.convert_tokens_to_ids(self.family.image_token)
        """The image placeholder token."""
        self._nl = list(chat.sep)
        self._user = list(chat.user_open)
        self._assistant = list(chat.assistant_open)
        lead = chat.text_lead
        if chat.system_joined:
            system = [*chat.system_open[:1], *self._encode(f"system\n{self.system}")]
        else:
            system = [*chat.system_open, *self._encode(lead + self.system)]
        self.header = [
            *chat.begin,
            *system,
            self.end_id,
            *self._nl,
            *self._user,
            *self._encode(lead + self.task_text),
            self.end_id,
            *self._nl,
        ]
        self._turns: list[_TurnPieces] = []
        self.turn_prompt_ids: list[np.ndarray] = []
        """The ids each turn appended (Turn.prompt_ids)."""

    @classmethod
    def from_processor(cls, processor: Any, instruction: str, **kwargs: Any) -> EpisodePrompt:
        """Use the tokenizer, family and image rule of a loaded `AutoProcessor`."""
        fam = family_for_processor(processor)
        return cls(
            processor.tokenizer, instruction, rule=fam.image_rule(processor), family=fam, **kwargs
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def image_tokens(self, image: Any) -> int:
        """Number of image placeholder tokens the model gives this screenshot."""
        w, h = image_size(image)
        try:
            return self.rule.tokens(w, h)
        except ValueError as e:
            raise EngineError(str(e)) from None

    def _closing(self, t: int) -> list[int]:
        """Ids that end turn t's assistant message (before the next message starts)."""
        return list(self._nl) if self._turns[t].closed else [self.end_id, *self._nl]

    @property
    def turns(self) -> int:
        return len(self._turns)

    def branch(self) -> EpisodePrompt:
        """A copy that goes on on its own (a forked episode): finished turns are shared,
        never changed again; new turns go to the copy only."""
        if self._turns and not self._turns[-1].response:
            raise EngineError("branch() between turns only: the current turn has no response")
        twin = copy.copy(self)
        twin._turns = list(self._turns)
        twin.turn_prompt_ids = list(self.turn_prompt_ids)
        return twin

    def add_screenshot(self, image: Any) -> np.ndarray:
        """Start a turn showing `image` (PNG bytes or PIL); returns the ids it appends."""
        return self.add_observation(image)

    def add_observation(self, image: Any = None, table: str | None = None) -> np.ndarray:
        """Start a turn showing `image` (PNG bytes or PIL; for som the marked screenshot)
        and / or `table` (the trimmed accessibility table, or the som mark table), as this
        prompt's observation type shows them; returns the ids it appends. EngineError when
        the pieces do not match the type (a11y_tree: a table and no image; screenshot: an
        image and no table; the others both)."""
        if self._turns and not self._turns[-1].response:
            raise EngineError("add_response() must follow add_observation() before the next turn")
        wants_image = self.observation_type != "a11y_tree"
        wants_table = self.observation_type != "screenshot"
        if (image is not None) != wants_image or (table is not None) != wants_table:
            shows = {"screenshot": "a screenshot alone", "a11y_tree": "a table alone"}
            raise EngineError(
                f"a {self.observation_type} turn shows "
                f"{shows.get(self.observation_type, 'a screenshot and a table')}; got "
                f"{'a' if image is not None else 'no'} screenshot and "
                f"{'a' if table is not None else 'no'} table"
            )
        text = observation_text(self.observation_type, table) if table is not None else ""
        msg = [*self._user, *(self._encode(self.chat.text_lead + text) if text else [])]
        if image is not None:
            msg += self.family.image_block(self.tokenizer, self.image_tokens(image))
        msg += [self.end_id, *self._nl]
        prefix = list(self.header) if not self._turns else self._closing(len(self._turns) - 1)
        self._turns.append(_TurnPieces(image, msg, text=text))
        ids = np.asarray(prefix + msg + self._assistant, dtype=np.int32)
        self.turn_prompt_ids.append(ids)
        return ids

    def add_response(self, response_ids: Sequence[int] | np.ndarray) -> None:
        """Record the sampled ids of the current turn, exactly as sampled."""
        if not self._turns or self._turns[-1].response:
            raise EngineError("add_response() needs a turn started by add_observation()")
        ids = [int(t) for t in np.asarray(response_ids).reshape(-1)]
        if not ids:
            raise EngineError("a response needs at least one token")
        self._turns[-1].response = ids
        self._turns[-1].closed = ids[-1] == self.end_id

    def context_for_turn(self, t: int) -> tuple[np.ndarray, list[Any]]:
        """The exact model input of turn t (ids ending in the assistant header, images)."""
        if not 0 <= t < len(self._turns):
            raise IndexError(f"turn {t} does not exist ({len(self._turns)} turns)")
        first_kept = max(0, t + 1 - self.history_images)
        ids = list(self.header)
        images = []
        for j in range(t + 1):
            if j > 0:
                ids += self._closing(j - 1)
            if j >= first_kept:
                ids += self._turns[j].image_msg
                if self._turns[j].image is not None:
                    images.append(self._turns[j].image)
            ids += self._assistant
            if j < t:
                ids += self._turns[j].response
        return np.asarray(ids, dtype=np.int32), images

    def model_input(self) -> tuple[np.ndarray, list[Any]]:
        """The model input of the current turn: (token ids, screenshots in order)."""
        if not self._turns:
            raise EngineError("add_observation() first: the model always sees an observation")
        return self.context_for_turn(len(self._turns) - 1)

    def messages(self, texts: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """The same conversation as chat messages (for `apply_chat_template`); `texts` are the
        responses' texts (default: decoded from the ids, special tokens kept, <|im_end|> cut)."""
        msgs: list[dict[str, Any]] = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": [{"type": "text", "text": self.task_text}]},
        ]
        t_last = len(self._turns) - 1
        first_kept = max(0, t_last + 1 - self.history_images)
        for j, turn in enumerate(self._turns):
            if j >= first_kept:
                content: list[dict[str, Any]] = []
                if turn.text:
                    content.append({"type": "text", "text": turn.text})
                if turn.image is not None:
                    content.append({"type": "image"})
                msgs.append({"role": "user", "content": content})
            if turn.response:
                if texts is not None:
                    text = texts[j]
                else:
                    body = turn.response[:-1] if turn.closed else turn.response
                    text = self.tokenizer.decode(body, skip_special_tokens=False)
                msgs.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
        return msgs

"""Model families: the few places where the vision-language models the policy runs differ.

Everything else (engines, prompts, the learner's batch and scoring, checkpoints, `arpo sft`,
the offline baselines) loads a model folder through transformers' auto classes
(`AutoModelForImageTextToText`, `AutoProcessor`) and asks this module, by the folder's
`model_type`, for what is family-specific:

| family | model_type | chat | image block | image rule | positions |
|---|---|---|---|---|---|
| `qwen2_5_vl` (UI-TARS-1.5) | `qwen2_5_vl` | ChatML: `<\\|im_start\\|>role\\n ... <\\|im_end\\|>\\n` | `<\\|vision_start\\|><\\|image_pad\\|>*n<\\|vision_end\\|>` | `smart_resize`, sides x28 (patch 14, merge 2), area in [min, max] pixels; n = area / 28^2 | multimodal rotary (t, h, w), `get_rope_index` |
| `qwen3_vl` (EvoCUA, GUI-Owl-1.5, Holo3) | `qwen3_vl` | as Qwen2.5-VL | as Qwen2.5-VL | as Qwen2.5-VL with sides x32 (patch 16, merge 2) | interleaved multimodal rotary, `get_rope_index` |
| `smolvlm` (SmolVLM, the reader) | `smolvlm`, `idefics3` | `<\\|im_start\\|>` once, then `Role: ... <end_of_utterance>\\n` | `<fake_token_around_image><global-img><image>*n<fake_token_around_image>` | image splitting off: the screenshot squashed to a square of the processor's `max_image_size`; n fixed (`image_seq_len`) | one position per token (Llama) |

The image rule is the one place that says what size the model sees a screenshot at
(`ImageRule.shown_size`, always (width, height)) and how many placeholder tokens it costs
(`ImageRule.tokens`): the actor builds prompts and maps coordinates with it and the learner
checks stored trajectories with it, so both sides agree by construction; the processor's own
output is then checked against it (`encode_images`).

Qwen3.5 (`qwen3_5`) is not a family here: its text model mixes linear-attention layers whose
recurrent state the engine's prefix cache and left-padded batches do not handle. A folder of
any other `model_type` is refused at start (`family_for_config`), naming it and the supported
ones.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from arpo.errors import ConfigError, EngineError

log = logging.getLogger(__name__)

_MAX_ASPECT = 200


def qwen_smart_resize(
    width: int, height: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen-VL's resize rule, (width, height) in and out: both sides multiples of `factor`,
    the area within [min_pixels, max_pixels], the aspect ratio kept as well as possible
    (transformers' `smart_resize` of Qwen2-VL's image processor, in this project's axis
    order). ValueError for a non-positive side or an aspect ratio over 200."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    if max(width, height) / min(width, height) > _MAX_ASPECT:
        raise ValueError(
            f"aspect ratio of {width}x{height} exceeds {_MAX_ASPECT}; Qwen-VL processors reject it"
        )
    w = max(factor, round(width / factor) * factor)
    h = max(factor, round(height / factor) * factor)
    if w * h > max_pixels:
        beta = math.sqrt(width * height / max_pixels)
        w = max(factor, math.floor(width / beta / factor) * factor)
        h = max(factor, math.floor(height / beta / factor) * factor)
    elif w * h < min_pixels:
        beta = math.sqrt(min_pixels / (width * height))
        w = math.ceil(width * beta / factor) * factor
        h = math.ceil(height * beta / factor) * factor
    return w, h


@dataclass(frozen=True, slots=True)
class ImageRule:
    """How a model shows a screenshot: the size it sees and the placeholder tokens it costs."""

    kind: str
    """`grid` (Qwen: resized to a grid of `factor`-pixel cells) or `square` (SmolVLM without
    image splitting: squashed to an `edge` x `edge` square)."""
    factor: int = 28
    """grid: side granularity in pixels (patch size x spatial merge)."""
    min_pixels: int = 0
    """grid: smallest area the processor produces."""
    max_pixels: int = 0
    """grid: largest area the processor produces."""
    edge: int = 0
    """square: side of the square the encoder sees."""
    square_tokens: int = 0
    """square: <image> tokens per screenshot."""

    def shown_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) of the image the model sees for a `width` x `height` screenshot
        (the frame UI-TARS-style coordinates are answered in)."""
        if self.kind == "square":
            if width <= 0 or height <= 0:
                raise ValueError(f"image size must be positive, got {width}x{height}")
            return self.edge, self.edge
        return qwen_smart_resize(width, height, self.factor, self.min_pixels, self.max_pixels)

    def tokens(self, width: int, height: int) -> int:
        """Image placeholder tokens of one `width` x `height` screenshot."""
        if self.kind == "square":
            self.shown_size(width, height)
            return self.square_tokens
        w, h = self.shown_size(width, height)
        return (w // self.factor) * (h // self.factor)

    def describe(self) -> str:
        """The budget in words, for logs and errors."""
        if self.kind == "square":
            return f"a {self.edge}x{self.edge} square, {self.square_tokens} tokens"
        return f"min_pixels={self.min_pixels} max_pixels={self.max_pixels} (x{self.factor})"


@dataclass(frozen=True, slots=True)
class Chat:
    """Token ids of a family's chat pieces for one tokenizer (what `EpisodePrompt` joins)."""

    begin: tuple[int, ...]
    """Ids once at the very start of a conversation (SmolVLM's <|im_start|>)."""
    system_open: tuple[int, ...]
    """Ids that open the system message, before its text."""
    user_open: tuple[int, ...]
    """Ids that open a user message."""
    assistant_open: tuple[int, ...]
    """Ids that open the assistant's message: the end of every prompt."""
    end: int
    """The end-of-message token: the one a response stops on."""
    sep: tuple[int, ...]
    """Ids after a message's end token ("\\n")."""
    text_lead: str
    """Text put before a message's text (SmolVLM's template writes "User: text")."""
    system_joined: bool
    """The system role's name and text are encoded as one string (Qwen: "system\\n{text}")."""


@dataclass(frozen=True)
class Family:
    """What differs for one model family (module docstring's table)."""

    name: str
    model_types: tuple[str, ...]
    end_token: str
    """Ends every message; the default stop token."""
    image_token: str
    """The placeholder each image token position holds (config.image_token_id)."""
    vision_tokens: tuple[str, ...]
    """Tokens no response may hold: they stand for pixels (masked when sampling and scoring)."""

    # -- chat --------------------------------------------------------------------------

    def chat(self, tokenizer: Any) -> Chat:
        def enc(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        end = token_id(tokenizer, self.end_token)
        if self.name == "smolvlm":
            return Chat(
                begin=(token_id(tokenizer, "<|im_start|>"),),
                system_open=enc("System:"),
                user_open=enc("User:"),
                assistant_open=enc("Assistant:"),
                end=end,
                sep=enc("\n"),
                text_lead=" ",
                system_joined=False,
            )
        start = token_id(tokenizer, "<|im_start|>")
        return Chat(
            begin=(),
            system_open=(start, *enc("system\n")),
            user_open=(start, *enc("user\n")),
            assistant_open=(start, *enc("assistant\n")),
            end=end,
            sep=enc("\n"),
            text_lead="",
            system_joined=True,
        )

    def response_lead(self) -> str:
        """Text a response starts with when the chat template renders it (SmolVLM's
        "Assistant: text"): demonstrations are encoded with it."""
        return " " if self.name == "smolvlm" else ""

    def image_block(self, tokenizer: Any, n: int) -> list[int]:
        """The ids that show one image of `n` placeholder tokens."""
        pad = token_id(tokenizer, self.image_token)
        if self.name == "smolvlm":
            fake = token_id(tokenizer, "<fake_token_around_image>")
            glob = token_id(tokenizer, "<global-img>")
            return [fake, glob, *([pad] * n), fake]
        return [
            token_id(tokenizer, "<|vision_start|>"),
            *([pad] * n),
            token_id(tokenizer, "<|vision_end|>"),
        ]

    def placeholder_prompt(self, tokenizer: Any, ids: Sequence[int]) -> list[int]:
        """The ids as a vLLM token prompt holds images: one placeholder per image, which
        vLLM's own processor expands (Qwen: a run of <|image_pad|> becomes one; SmolVLM: a
        whole block <fake_token_around_image><global-img><image>*n<fake_token_around_image>
        becomes one <image>). The length vLLM reports back is checked against `ids`'."""
        pad = token_id(tokenizer, self.image_token)
        out: list[int] = []
        if self.name != "smolvlm":
            for t in ids:
                if t == pad and out and out[-1] == pad:
                    continue
                out.append(t)
            return out
        fake = token_id(tokenizer, "<fake_token_around_image>")
        glob = token_id(tokenizer, "<global-img>")
        i, n = 0, len(ids)
        while i < n:
            if ids[i] == fake and i + 2 < n and ids[i + 1] == glob and ids[i + 2] == pad:
                j = i + 2
                while j < n and ids[j] == pad:
                    j += 1
                if j < n and ids[j] == fake:
                    out.append(pad)
                    i = j + 1
                    continue
            out.append(int(ids[i]))
            i += 1
        return out

    # -- images ------------------------------------------------------------------------

    def image_rule(self, processor: Any) -> ImageRule:
        """The rule of a loaded processor (or its image processor)."""
        ip = getattr(processor, "image_processor", processor)
        if self.name == "smolvlm":
            if getattr(ip, "do_image_splitting", False):
                raise EngineError(
                    "the SmolVLM processor splits images into tiles (do_image_splitting=true); "
                    "this project shows each screenshot as one square: save the processor "
                    "with do_image_splitting=false"
                )
            edge = _get(getattr(ip, "max_image_size", None), "longest_edge")
            n = getattr(processor, "image_seq_len", None)
            if not edge or not n:
                raise EngineError(
                    "the SmolVLM processor has no max_image_size['longest_edge'] or "
                    "image_seq_len (load it with AutoProcessor from the model folder)"
                )
            return ImageRule("square", edge=int(edge), square_tokens=int(n))
        size = getattr(ip, "size", None) or {}
        lo = _get(size, "shortest_edge") or getattr(ip, "min_pixels", None)
        hi = _get(size, "longest_edge") or getattr(ip, "max_pixels", None)
        patch, merge = getattr(ip, "patch_size", None), getattr(ip, "merge_size", None)
        if not lo or not hi or not patch or not merge:
            raise EngineError(
                f"the image processor has no min / max pixels or patch / merge size "
                f"(not a {self.name} processor?)"
            )
        return ImageRule(
            "grid", factor=int(patch) * int(merge), min_pixels=int(lo), max_pixels=int(hi)
        )

    def encode_images(
        self, processor: Any, images: Sequence[Any]
    ) -> tuple[dict[str, Any], list[int], list[Any]]:
        """Pixels of `images` (PIL) for the model: (model kwargs on CPU, placeholder tokens per
        image, per-image position data for `positions`: Qwen's `image_grid_thw` rows, SmolVLM
        None). Kwargs of several calls concatenate along dim 0 (`concat_images`)."""
        ip = processor.image_processor
        if self.name == "smolvlm":
            enc = ip(images=[[im] for im in images], return_tensors="pt")
            kwargs = {"pixel_values": enc["pixel_values"]}
            if "pixel_attention_mask" in enc:
                kwargs["pixel_attention_mask"] = enc["pixel_attention_mask"]
            n = int(processor.image_seq_len)
            return kwargs, [n] * len(images), [None] * len(images)
        enc = ip(images=list(images), return_tensors="pt")
        grid = enc["image_grid_thw"]
        merge = int(ip.merge_size) ** 2
        counts = [int(g.prod()) // merge for g in grid]
        return {"pixel_values": enc["pixel_values"], "image_grid_thw": grid}, counts, list(grid)

    # -- positions ---------------------------------------------------------------------

    @property
    def rotary_axes(self) -> int:
        """Rows of position ids per token: 3 (t, h, w) for the Qwen families, 1 otherwise."""
        return 1 if self.name == "smolvlm" else 3

    def positions(
        self, model: Any, ids: Any, attention_mask: Any, image_meta: Sequence[Any]
    ) -> Any:
        """Position ids [axes, B, T] of right-padded or unpadded `ids` [B, T] whose images'
        position data (`encode_images`' third value, in order over the batch) is `image_meta`."""
        import torch

        if self.rotary_axes == 1:
            pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            return pos[None]
        grid = torch.stack(list(image_meta)).to(ids.device) if len(image_meta) else None
        image_id = int(model.config.image_token_id)
        pos, _ = unwrap_vl(model).get_rope_index(
            ids,
            mm_token_type_ids=(ids == image_id).int(),
            image_grid_thw=grid,
            attention_mask=attention_mask,
        )
        return pos

    def model_positions(self, pos: Any) -> Any:
        """Position ids as the model's forward takes them: [3, B, T] for the Qwen families,
        [B, T] for one axis."""
        return pos[0] if self.rotary_axes == 1 else pos


def concat_images(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One set of image kwargs from several `encode_images` results (dim 0)."""
    import torch

    parts = [p for p in parts if p]
    if not parts:
        return {}
    keys = parts[0].keys()
    if any(p.keys() != keys for p in parts):
        raise EngineError("image inputs of different shapes cannot be batched together")
    # Qwen: patches and grid rows; SmolVLM: [images, 1, C, H, W] and its pixel mask.
    return {k: torch.cat([p[k] for p in parts]) for k in keys}


def unwrap_vl(model: Any) -> Any:
    """The inner vision-language model that owns `get_rope_index` (model.model)."""
    inner = getattr(model, "model", model)
    if not hasattr(inner, "get_rope_index"):
        raise EngineError(f"{type(model).__name__} has no get_rope_index")
    return inner


def _get(size: Any, key: str) -> Any:
    if size is None:
        return None
    if isinstance(size, dict):
        return size.get(key)
    return getattr(size, key, None)


def token_id(tokenizer: Any, name: str) -> int:
    """The id of an added token; EngineError when the tokenizer lacks it."""
    i = tokenizer.convert_tokens_to_ids(name)
    if (
        i is None
        or (not isinstance(i, int))
        or i < 0
        or i == getattr(tokenizer, "unk_token_id", -1)
    ):
        raise EngineError(f"the tokenizer has no {name} token (not the model's own tokenizer?)")
    return int(i)


_QWEN_VISION = (
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("qwen2_5_vl", ("qwen2_5_vl",), "<|im_end|>", "<|image_pad|>", _QWEN_VISION),
        Family("qwen3_vl", ("qwen3_vl",), "<|im_end|>", "<|image_pad|>", _QWEN_VISION),
        Family(
            "smolvlm",
            ("smolvlm", "idefics3"),
            "<end_of_utterance>",
            "<image>",
            ("<image>", "<fake_token_around_image>", "<global-img>", "<video>"),
        ),
    )
}
"""Every supported family by name."""

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(t for f in FAMILIES.values() for t in f.model_types)


def stop_ids(family: Family, tokenizer: Any, generation_config: Any = None) -> tuple[int, ...]:
    """The tokens a response stops on: the family's end-of-message token, then every other
    end token the model's generation config names (`eos_token_id`, one id or a list), as
    transformers' `generate` and vLLM stop on them too. The reader names two: SmolVLM's
    <end_of_utterance> and the <|im_end|> its pre-trained decoder ends ChatML turns with."""
    ids = [family.chat(tokenizer).end]
    eos = getattr(generation_config, "eos_token_id", None)
    for i in [eos] if isinstance(eos, int) else list(eos or ()):
        if int(i) not in ids:
            ids.append(int(i))
    return tuple(ids)


def family_for_model_type(model_type: str) -> Family:
    """The family of a config's `model_type`; ValueError naming the supported ones."""
    for f in FAMILIES.values():
        if model_type in f.model_types:
            return f
    raise ValueError(
        f"model_type {model_type!r} is not a supported model family; supported: "
        f"{', '.join(SUPPORTED_MODEL_TYPES)} (arpo.policy.family)"
    )


def family_for_config(config: Any) -> Family:
    """The family of a loaded config (or a model, whose `.config` is used)."""
    config = getattr(config, "config", config)
    return family_for_model_type(str(getattr(config, "model_type", "")))


_PROCESSOR_FAMILIES = {
    "Qwen2_5_VLProcessor": "qwen2_5_vl",
    "Qwen2VLProcessor": "qwen2_5_vl",
    "Qwen3VLProcessor": "qwen3_vl",
    "SmolVLMProcessor": "smolvlm",
    "Idefics3Processor": "smolvlm",
    "Qwen2VLImageProcessor": "qwen2_5_vl",
    "Qwen2VLImageProcessorFast": "qwen2_5_vl",
    "SmolVLMImageProcessor": "smolvlm",
    "SmolVLMImageProcessorFast": "smolvlm",
    "Idefics3ImageProcessor": "smolvlm",
    "Idefics3ImageProcessorFast": "smolvlm",
}


def family_for_processor(processor: Any) -> Family:
    """The family of a loaded processor, by its class (a Qwen2-VL image processor of patch 16
    is Qwen3-VL's)."""
    name = type(processor).__name__
    fam = _PROCESSOR_FAMILIES.get(name)
    if fam is None:
        raise EngineError(
            f"{name} is not the processor of a supported model family "
            f"({', '.join(FAMILIES)}); load the model folder's processor with AutoProcessor"
        )
    ip = getattr(processor, "image_processor", processor)
    if fam == "qwen2_5_vl" and getattr(ip, "patch_size", 14) == 16:
        fam = "qwen3_vl"
    return FAMILIES[fam]


def model_type_of_folder(folder: Any) -> str:
    """`model_type` of a model folder's config.json, without loading the model; ValueError
    when the folder has none."""
    import json
    from pathlib import Path

    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{str(folder)!r} has no config.json: not a model folder") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{str(path)!r} cannot be read: {e}") from None
    mt = cfg.get("model_type") if isinstance(cfg, dict) else None
    if not isinstance(mt, str):
        raise ValueError(f"{str(path)!r} has no model_type")
    return mt


def check_folder(folder: Any) -> Family:
    """The family of a model folder, read from its config; ValueError naming the folder's
    model_type and the supported ones when this project cannot run it."""
    return family_for_model_type(model_type_of_folder(folder))


def load_model(path: Any, dtype: Any = None) -> Any:
    """A model folder's model through the auto class (`AutoModelForImageTextToText`), after
    its family is checked (`check_folder`)."""
    from transformers import AutoModelForImageTextToText

    check_folder(path)
    return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)


TRAIN_LAYERS_DOC = (
    "Train only the text decoder's last N layers and its final norm; the layers below, the "
    "embeddings, the output head and the vision encoder stay frozen (0: every weight). A "
    "step then costs the forward of every layer and the backward of N of them "
    "(docs/guides/own-model.md, 'The reader')."
)
"""The documentation of every config's `train_layers` (learner, warm start, offline)."""


def freeze_below(model: Any, layers: int) -> None:
    """`train_top_layers` for a trainer built from a config's `train_layers`: logs the
    share trained, and a ConfigError naming `train_layers` when the model has too few."""
    if layers <= 0:
        return
    try:
        trained, total = train_top_layers(model, layers)
    except ValueError as e:
        raise ConfigError(f"train_layers: {e}") from e
    log.info("train_layers=%d: %.1f M of %.1f M parameters trained", layers, trained / 1e6,
             total / 1e6)  # fmt: skip


def train_top_layers(model: Any, layers: int) -> tuple[int, int]:
    """Leave only the text decoder's last `layers` layers and its final norm trainable
    (`requires_grad`); the embeddings, the output head, the vision encoder, its connector
    and every lower layer are frozen. Backward then stops at the lowest trained layer, so a
    step costs the forward of every layer and the backward of `layers` of them. 0 leaves
    every weight as it was. (trainable, total) parameter counts; ValueError when the
    decoder has fewer layers, or none that this can find."""
    total = sum(p.numel() for p in model.parameters())
    if layers <= 0:
        return sum(p.numel() for p in model.parameters() if p.requires_grad), total
    decoder = model.get_decoder()
    blocks = getattr(decoder, "layers", None)
    if blocks is None:
        raise ValueError(f"{type(model).__name__}: its text decoder has no `layers` to train")
    if layers > len(blocks):
        raise ValueError(
            f"train_layers={layers}, but {type(model).__name__}'s text decoder has "
            f"{len(blocks)} layers: give at most {len(blocks)}, or 0 to train every weight"
        )
    model.requires_grad_(False)
    for block in list(blocks)[-layers:]:
        block.requires_grad_(True)
    norm = getattr(decoder, "norm", None)
    if norm is not None:
        norm.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad), total

"""Tiny vision-language models with random weights, built offline, for tests, benchmarks and
the demo: one per model family the policy layer runs (`arpo.policy.family`).

    arpo-tiny-model --out runs/tiny --seed 0                       # Qwen2.5-VL (the default)
    arpo-tiny-model --out runs/tiny-q3 --family qwen3_vl
    arpo-tiny-model --out runs/tiny-smol --family smolvlm
    python -m arpo.policy.tiny --out runs/tiny --seed 0

The other families' folders are built the same way from their own config classes:
`qwen3_vl` a `Qwen3VLConfig` (2 text layers of width 256, interleaved multimodal rotary
positions; a 2-block vision tower of patch 16 with one deepstack layer) with
`Qwen3VLProcessor`; `smolvlm` a `SmolVLMConfig` (a 2-layer Llama text model of width 256;
a 2-layer SigLIP-style encoder on 128-pixel squares, patch 16, pixel shuffle 2: 16 image
tokens per screenshot) with `SmolVLMProcessor`, image splitting off, and SmolVLM's chat
template and image tokens (<fake_token_around_image>, <global-img>, <image>,
<end_of_utterance>). Everything below that names Qwen2.5-VL is the default family's.

The folder it writes is an ordinary transformers checkpoint of the Qwen2.5-VL
architecture (UI-TARS-1.5-7B's), so everything else loads it the way it loads the
real model: `AutoProcessor.from_pretrained(dir)` and
`Qwen2_5_VLForConditionalGeneration.from_pretrained(dir)`, and vLLM serves it.

- model: `Qwen2_5_VLForConditionalGeneration` from a `Qwen2_5_VLConfig` with a
  2-layer text model (hidden 256, 4 query / 2 key-value heads, multimodal rotary
  positions) and a 2-block vision tower (hidden 128, patch 14, spatial merge 2,
  windowed attention with one full-attention block), about 2.6 M parameters,
  float32;
- tokenizer: byte-level BPE trained here with the `tokenizers` library on a small
  generated corpus (UI-TARS style thoughts and actions, English words), with
  Qwen2's pre-tokenizer regex and NFC normaliser, followed by Qwen's 22 added
  tokens in Qwen's order (<|endoftext|>, <|im_start|>, <|im_end|>, ...,
  <|vision_start|>, <|vision_end|>, <|vision_pad|>, <|image_pad|>, ...). Their ids
  are small (the vocabulary is about 1,000 tokens, Qwen's is 151,665) and the
  config's image / video / vision start / end ids point at them;
- Qwen2-VL's chat template (the one Qwen2.5-VL and UI-TARS-1.5 ship);
- `Qwen2VLImageProcessor` with the given min / max pixels (defaults keep a
  1920x1080 screenshot at 60 image tokens, where UI-TARS-1.5 uses thousands).

Deterministic for a seed: the same seed gives byte-identical weight files; the
tokenizer is the same for every seed (so weights of one seed load into another).
Building takes about a second.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

# Qwen2's pre-tokenizer split pattern (tokenizer.json of every Qwen2 / Qwen2.5 model).
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2.5's added tokens in their order (151643.. in the real vocabulary); the
# first 14 are special (never split, skipped when decoding with skip_special_tokens).
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
QWEN_ADDED_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)

# Qwen2-VL's chat template, as shipped by Qwen2.5-VL and UI-TARS-1.5.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The tokens SmolVLM's tokenizer adds for its chat and images (SmolVLM-256M-Instruct's names).
SMOLVLM_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<end_of_utterance>",
    "<fake_token_around_image>",
    "<global-img>",
    "<image>",
)
# SmolVLM's chat template (transformers' SmolVLMProcessor default, as SmolVLM-256M-Instruct
# ships it): "<|im_start|>" once, then "Role: text<end_of_utterance>\n" per message.
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "smolvlm")
"""The families `arpo-tiny-model --family` builds (those `arpo.policy.family` runs)."""
SMOLVLM_TINY_EDGE = 128
"""Side of the square the tiny SmolVLM's encoder sees (patch 16, shuffle 2: 16 tokens)."""

# Default pixel bounds of the tiny model's image processor: a 1920x1080 screen
# becomes 280x168 (10x6 = 60 image tokens). UI-TARS-1.5 uses 100*28*28 .. 16384*28*28.
TINY_MIN_PIXELS = 4 * 28 * 28
TINY_MAX_PIXELS = 64 * 28 * 28

_WORDS = [
    "the",
    "a",
    "to",
    "of",
    "and",
    "in",
    "on",
    "click",
    "double",
    "right",
    "drag",
    "type",
    "scroll",
    "wait",
    "finished",
    "call",
    "user",
    "button",
    "menu",
    "file",
    "edit",
    "view",
    "insert",
    "format",
    "tools",
    "window",
    "help",
    "open",
    "save",
    "close",
    "cancel",
    "ok",
    "cell",
    "column",
    "row",
    "sheet",
    "table",
    "chart",
    "text",
    "box",
    "field",
    "search",
    "bar",
    "address",
    "tab",
    "page",
    "icon",
    "start",
    "end",
    "left",
    "right",
    "up",
    "down",
    "top",
    "bottom",
    "center",
    "select",
    "copy",
    "paste",
    "delete",
    "undo",
    "redo",
    "I",
    "need",
    "want",
    "should",
    "will",
    "can",
    "first",
    "then",
    "next",
    "now",
    "find",
    "see",
    "it",
    "this",
    "that",
    "there",
    "here",
    "task",
    "done",
    "complete",
    "screen",
    "desktop",
    "terminal",
    "editor",
    "calc",
    "document",
    "name",
    "value",
    "number",
    "enter",
    "press",
    "key",
    "ctrl",
    "alt",
    "shift",
    "hotkey",
    "space",
    "return",
    "backspace",
    "escape",
    "thought",
    "action",
]


def _corpus(seed: int, lines: int = 3000) -> list[str]:
    """Generated text shaped like UI-TARS turns, for training the tiny BPE."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        thought = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16)))
        x, y = rng.randint(0, 1919), rng.randint(0, 1079)
        kind = rng.randrange(6)
        if kind == 0:
            action = f"click(start_box='({x},{y})')"
        elif kind == 1:
            action = f"type(content='{' '.join(rng.choice(_WORDS) for _ in range(3))}')"
        elif kind == 2:
            action = f"hotkey(key='ctrl {rng.choice('acsvxz')}')"
        elif kind == 3:
            action = f"scroll(start_box='({x},{y})', direction='{rng.choice(['up', 'down'])}')"
        elif kind == 4:
            action = f"drag(start_box='({x},{y})', end_box='({y},{x})')"
        else:
            action = "finished(content='done')"
        out.append(f"Thought: {thought.capitalize()}.\nAction: {action}")
    return out


def build_tokenizer(vocab_size: int = 1000, family: str = "qwen2_5_vl"):
    """A byte-level BPE tokenizer (tokenizers.Tokenizer) with the family's added tokens at the
    end (Qwen's for the Qwen families, `SMOLVLM_SPECIAL_TOKENS` for smolvlm).

    Always trained on the same corpus, so checkpoints of every seed share one
    vocabulary and weights of one can be loaded into another."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_corpus(0), trainer=trainer)
    if family == "smolvlm":
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in SMOLVLM_SPECIAL_TOKENS]
        )
        return tok
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS]
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_ADDED_TOKENS])
    return tok


def _fast_tokenizer(family: str, chat_template: str, eos: str):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(family=family),
        bos_token=None,
        eos_token=eos,
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def smolvlm_processor(tokenizer, edge: int, image_seq_len: int, chat_template: str | None = None):
    """A `SmolVLMProcessor` around `tokenizer` (which must hold `SMOLVLM_SPECIAL_TOKENS`'
    image and chat tokens): image splitting off, so every screenshot is one square of side
    `edge` and `image_seq_len` <image> tokens (`arpo.policy.family`'s smolvlm rule)."""
    from transformers import SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor

    template = chat_template or SMOLVLM_CHAT_TEMPLATE
    tokenizer.chat_template = template
    for name, tok in (
        ("fake_image_token", "<fake_token_around_image>"),
        ("image_token", "<image>"),
        ("global_image_token", "<global-img>"),
        ("end_of_utterance_token", "<end_of_utterance>"),
    ):
        setattr(tokenizer, name, tok)
    image_processor = SmolVLMImageProcessor(
        do_image_splitting=False,
        size={"longest_edge": edge},
        max_image_size={"longest_edge": edge},
    )
    video_processor = SmolVLMVideoProcessor(
        size={"longest_edge": edge}, max_image_size={"longest_edge": edge}
    )
    return SmolVLMProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        image_seq_len=image_seq_len,
        chat_template=template,
    )


def build_processor(
    min_pixels: int = TINY_MIN_PIXELS,
    max_pixels: int = TINY_MAX_PIXELS,
    family: str = "qwen2_5_vl",
):
    """The tiny model's processor (tokenizer + image processor + chat template) of a family:
    `Qwen2_5_VLProcessor`, `Qwen3VLProcessor` (the same pixel bounds, patch 16) or
    `SmolVLMProcessor` (a square of `SMOLVLM_TINY_EDGE`; the pixel bounds are not used)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    if family == "smolvlm":
        tokenizer = _fast_tokenizer(family, SMOLVLM_CHAT_TEMPLATE, "<end_of_utterance>")
        return smolvlm_processor(tokenizer, SMOLVLM_TINY_EDGE, _smolvlm_seq_len())
    tokenizer = _fast_tokenizer(family, QWEN2_VL_CHAT_TEMPLATE, "<|im_end|>")
    if family == "qwen3_vl":
        from transformers import Qwen3VLProcessor, Qwen3VLVideoProcessor

        size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
        return Qwen3VLProcessor(
            image_processor=Qwen2VLImageProcessor(size=size, patch_size=16, merge_size=2),
            tokenizer=tokenizer,
            video_processor=Qwen3VLVideoProcessor(size=size, patch_size=16, merge_size=2),
            chat_template=QWEN2_VL_CHAT_TEMPLATE,
        )
    if family != "qwen2_5_vl":
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    image_processor = Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels)
    video_processor = Qwen2VLVideoProcessor(min_pixels=min_pixels, max_pixels=max_pixels)
    return Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )


def _text_sizes(vocab: int, ids: dict[str, int], bos: str, eos: str) -> dict:
    return dict(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        bos_token_id=ids[bos],
        eos_token_id=ids[eos],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
        dtype="float32",
    )


def _qwen_vision_ids(ids: dict[str, int]) -> dict:
    """The Qwen families' config fields naming their vision tokens (and the shared dtype)."""
    return dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        dtype="float32",
    )


def tiny_config(tokenizer):
    """The `Qwen2_5_VLConfig` of the tiny model; token ids are taken from `tokenizer`."""
    from transformers import Qwen2_5_VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    text = _text_sizes(len(tokenizer), ids, "<|endoftext|>", "<|im_end|>")
    # head_dim 64: the multimodal rotary sections (t, h, w) split its 32 frequencies.
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 1_000_000.0,
        "mrope_section": [8, 12, 12],
    }
    vision = dict(
        depth=2,
        hidden_size=128,
        intermediate_size=256,
        num_heads=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        out_hidden_size=256,
        fullatt_block_indexes=[1],
    )
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **_qwen_vision_ids(ids))


def _smolvlm_seq_len(edge: int = SMOLVLM_TINY_EDGE, patch: int = 16, scale: int = 2) -> int:
    return (edge // patch) ** 2 // scale**2


def tiny_qwen3_vl_config(tokenizer):
    """The `Qwen3VLConfig` of the tiny Qwen3-VL; token ids are taken from `tokenizer`."""
    from transformers import Qwen3VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    text = _text_sizes(len(tokenizer), ids, "<|endoftext|>", "<|im_end|>")
    text.update(
        head_dim=64,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": [8, 12, 12],
            "mrope_interleaved": True,
        },
    )
    vision = dict(
        depth=2,
        hidden_size=128,
        intermediate_size=256,
        num_heads=2,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=256,
        num_position_embeddings=256,
        deepstack_visual_indexes=[0],
    )
    return Qwen3VLConfig(text_config=text, vision_config=vision, **_qwen_vision_ids(ids))


def tiny_smolvlm_config(tokenizer, edge: int = SMOLVLM_TINY_EDGE):
    """The `SmolVLMConfig` of the tiny SmolVLM; token ids are taken from `tokenizer`."""
    from transformers import SmolVLMConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SMOLVLM_SPECIAL_TOKENS}
    text = _text_sizes(len(tokenizer), ids, "<|im_start|>", "<end_of_utterance>")
    text.update(
        model_type="llama",
        head_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 100_000.0},
    )
    vision = dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=edge,
        patch_size=16,
    )
    return SmolVLMConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<image>"],
        scale_factor=2,
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
        dtype="float32",
    )


def build_tiny_model(
    out: str | Path,
    seed: int = 0,
    *,
    min_pixels: int = TINY_MIN_PIXELS,
    max_pixels: int = TINY_MAX_PIXELS,
    init_std: float = 0.05,
    family: str = "qwen2_5_vl",
) -> Path:
    """Build a tiny model of `family` (default Qwen2.5-VL) with random weights and save model
    + processor to `out`.

    `init_std` is the standard deviation of the random weights; 0.05 (above
    Qwen's 0.02) makes the next-token distribution peaked enough that greedy
    decoding is not decided by float rounding, which parity tests need.
    """
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    processor = build_processor(min_pixels, max_pixels, family)
    make_config = {
        "qwen2_5_vl": tiny_config,
        "qwen3_vl": tiny_qwen3_vl_config,
        "smolvlm": tiny_smolvlm_config,
    }[family]
    config = make_config(processor.tokenizer)
    config.text_config.initializer_range = init_std
    config.vision_config.initializer_range = init_std
    config.initializer_range = init_std
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=config.text_config.bos_token_id,
        eos_token_id=config.text_config.eos_token_id,
        pad_token_id=config.text_config.pad_token_id,
    )
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="arpo-tiny-model",
        description="Build a tiny random vision-language model (Qwen2.5-VL by default) into a folder.",
    )
    ap.add_argument("--out", required=True, help="folder to write the checkpoint to")
    ap.add_argument("--family", default="qwen2_5_vl", choices=FAMILIES, help="model family")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    ap.add_argument("--min-pixels", type=int, default=TINY_MIN_PIXELS)
    ap.add_argument("--max-pixels", type=int, default=TINY_MAX_PIXELS)
    args = ap.parse_args(argv)
    path = build_tiny_model(
        args.out,
        args.seed,
        min_pixels=args.min_pixels,
        max_pixels=args.max_pixels,
        family=args.family,
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

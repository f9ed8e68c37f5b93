"""vLLM engines for real: in process (AsyncLLM, CPU build) and the OpenAI server over HTTP.

Both are checked against the transformers model: greedy tokens equal, log-probs of
sampled tokens equal a teacher-forced transformers pass, weights pushed without a
restart (state dict and folder) are served at once, and after the same weights
are pushed to every engine, greedy decoding agrees everywhere.
"""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import time
import urllib.request

import numpy as np
import pytest
from arpo_envs.procs import free_port

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from arpo.policy.engine import EngineConfig, SamplingParams  # noqa: E402
from arpo.policy.engine_openai import server_command  # noqa: E402
from arpo.policy.engine_vllm import vllm_available  # noqa: E402
from arpo.policy.engines import make_engine  # noqa: E402
from arpo.policy.prompt import EpisodePrompt  # noqa: E402
from arpo.policy.tiny import build_tiny_model  # noqa: E402

_reason = vllm_available()
pytestmark = [
    pytest.mark.skipif(_reason is not None, reason=_reason or ""),
    # vLLM and its dependencies warn about their own deprecated calls.
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

# float32 on CPU, different kernels (vLLM's attention / GEMMs vs transformers'):
# measured differences are about 5e-6.
LOGPROB_TOL = 1e-4


def png(w: int, h: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.fixture(scope="module")
def prompts(tiny_dir):
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_dir)
    im_end = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    for n in (1, 3):
        ep = EpisodePrompt.from_processor(proc, f"task with {n} screenshots")
        for i in range(n):
            ep.add_screenshot(png(1920 if i % 2 == 0 else 640, 1080 if i % 2 == 0 else 480, i))
            if i < n - 1:
                ep.add_response([*proc.tokenizer.encode(f"Thought: step {i}"), im_end])
        out.append(ep.model_input())
    return out


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def hf(tiny_dir, loop):
    engine = make_engine(EngineConfig(kind="hf", model=str(tiny_dir)))
    loop.run_until_complete(engine.start())
    yield engine
    loop.run_until_complete(engine.close())


@pytest.fixture(scope="module")
def vllm_engine(tiny_dir, loop):
    engine = make_engine(
        EngineConfig(kind="vllm", model=str(tiny_dir), max_model_len=4096, max_concurrency=16)
    )
    loop.run_until_complete(engine.start())
    yield engine
    loop.run_until_complete(engine.close())


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "vllm-server.log"
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            server_command(str(tiny_dir), port, max_model_len=4096),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 150
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"vLLM server did not start:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def http(tiny_dir, server, loop):
    engine = make_engine(EngineConfig(kind="openai", model=str(tiny_dir), base_url=server))
    loop.run_until_complete(engine.start())
    yield engine
    loop.run_until_complete(engine.close())


def teacher_forced(model, ids, images, out_ids, params: SamplingParams) -> np.ndarray:
    from transformers import AutoProcessor

    from arpo.policy.engine import process_logits, to_pil
    from arpo.policy.prompt import forbidden_token_ids

    proc = AutoProcessor.from_pretrained(model.name_or_path)
    full = torch.tensor([ids.tolist() + out_ids.tolist()])
    enc = proc.image_processor(images=[to_pil(i) for i in images], return_tensors="pt")
    with torch.no_grad():
        logits = model(
            input_ids=full,
            pixel_values=enc["pixel_values"],
            image_grid_thw=enc["image_grid_thw"],
            mm_token_type_ids=(full == model.config.image_token_id).int(),
        ).logits[0]
    n = len(out_ids)
    # vLLM samples with the vision tokens biased away (FORBIDDEN_LOGIT_BIAS): the masked
    # distribution, to within e^-100.
    masked = torch.tensor(forbidden_token_ids(proc.tokenizer), dtype=torch.long)
    lp = process_logits(
        logits[len(ids) - 1 : -1],
        torch.full((n,), params.temperature),
        torch.full((n,), params.top_p),
        masked,
    )
    return lp.gather(1, torch.as_tensor(out_ids, dtype=torch.long)[:, None])[:, 0].numpy()


# The OpenAI-compatible server (a vLLM server started for the module, 50 s) runs in
# `make test-all`; the default run compares the in-process engine.
@pytest.fixture(params=["vllm", pytest.param("openai", marks=pytest.mark.slow)])
def engine(request):
    return request.getfixturevalue("vllm_engine" if request.param == "vllm" else "http")


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)


def test_greedy_tokens_and_logprobs_equal_transformers(engine, hf, prompts, loop):
    async def run():
        outs = []
        for ids, images in prompts:
            a, b = await asyncio.gather(
                engine.generate(ids, images, GREEDY), hf.generate(ids, images, GREEDY)
            )
            outs.append((a, b))
        return outs

    for a, b in loop.run_until_complete(run()):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=LOGPROB_TOL, rtol=0)
        assert a.text == b.text and a.finish_reason == b.finish_reason


def test_sampled_logprobs_are_the_processed_distribution(engine, hf, prompts, loop):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=20, seed=11)
    ids, images = prompts[1]
    out = loop.run_until_complete(engine.generate(ids, images, params))
    tf = teacher_forced(hf.model, ids, images, out.token_ids, params)
    np.testing.assert_allclose(out.logprobs, tf, atol=LOGPROB_TOL, rtol=0)


def test_stop_token_ends_and_is_returned(engine, prompts, loop):
    ids, images = prompts[0]
    greedy = loop.run_until_complete(engine.generate(ids, images, GREEDY)).token_ids.tolist()
    stop = greedy[5]
    first = greedy.index(stop)
    p = SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=(stop,))
    out = loop.run_until_complete(engine.generate(ids, images, p))
    assert out.token_ids.tolist() == greedy[: first + 1]
    assert out.finish_reason == "stop" and len(out.logprobs) == first + 1


def test_many_concurrent_requests_with_images(engine, prompts, loop):
    async def run():
        return await asyncio.gather(
            *[
                engine.generate(*prompts[i % 2], SamplingParams(max_new_tokens=16, seed=i))
                for i in range(12)
            ]
        )

    outs = loop.run_until_complete(run())
    assert all(1 <= len(o.token_ids) <= 16 and np.all(o.logprobs <= 0) for o in outs)
    assert len({tuple(o.token_ids.tolist()) for o in outs}) > 1


def test_same_weights_pushed_everywhere_give_same_greedy_tokens(
    vllm_engine, http, hf, prompts, tiny_dir, loop, tmp_path
):
    """Parity: state dict (version 1) then a folder (version 2) pushed to every engine."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    g = torch.Generator().manual_seed(0)
    base = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_dir).state_dict()
    state = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    folder = build_tiny_model(tmp_path / "seed9", seed=9)
    engines = [hf, vllm_engine, http]

    async def run(weights, version):
        await asyncio.gather(*[e.update_weights(weights, version) for e in engines])
        results = []
        for ids, images in prompts:
            outs = await asyncio.gather(*[e.generate(ids, images, GREEDY) for e in engines])
            results.append(outs)
        return results

    before = loop.run_until_complete(hf.generate(*prompts[0], GREEDY)).token_ids.tolist()
    for weights, version in ((state, 1), (folder, 2)):
        for outs in loop.run_until_complete(run(weights, version)):
            ref = outs[0]
            assert all(o.policy_version == version for o in outs)
            for o in outs[1:]:
                assert o.token_ids.tolist() == ref.token_ids.tolist()
                np.testing.assert_allclose(o.logprobs, ref.logprobs, atol=LOGPROB_TOL, rtol=0)
        assert outs[0].token_ids.tolist() != before

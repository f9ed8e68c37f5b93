"""The transformers engine: exact log-probs, batching of concurrent requests, live weight updates."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from arpo.errors import EngineError  # noqa: E402
from arpo.policy.engine import EngineConfig, SamplingParams, process_logits  # noqa: E402
from arpo.policy.engines import make_engine  # noqa: E402
from arpo.policy.prompt import EpisodePrompt, forbidden_token_ids  # noqa: E402
from arpo.policy.tiny import build_tiny_model  # noqa: E402

# Float32 on CPU: batched KV-cache decoding vs one teacher-forced pass differ by
# summation order only.
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def png(w: int, h: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def prompt(tiny_dir, n_images: int, seed: int = 0):
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_dir)
    ep = EpisodePrompt.from_processor(proc, f"task {seed}")
    im_end = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for i in range(n_images):
        ep.add_screenshot(png(1920 if i % 2 == 0 else 800, 1080 if i % 2 == 0 else 600, seed + i))
        if i < n_images - 1:
            ep.add_response([*proc.tokenizer.encode(f"Thought: step {i}"), im_end])
    ids, images = ep.model_input()
    return proc, ids, images


def teacher_forced(model, proc, ids, images, out_ids, params: SamplingParams) -> np.ndarray:
    """Log-probs of `out_ids` from one forward pass over prompt + response."""
    from arpo.policy.engine import to_pil

    full = torch.tensor([ids.tolist() + out_ids.tolist()])
    enc = proc.image_processor(images=[to_pil(i) for i in images], return_tensors="pt")
    with torch.no_grad():
        logits = model(
            input_ids=full,
            pixel_values=enc["pixel_values"],
            image_grid_thw=enc["image_grid_thw"],
            mm_token_type_ids=(full == model.config.image_token_id).int(),
        ).logits[0]
    resp = logits[len(ids) - 1 : -1]
    n = len(out_ids)
    # The engine samples from the distribution with the vision tokens masked.
    masked = torch.tensor(forbidden_token_ids(proc.tokenizer), dtype=torch.long)
    lp = process_logits(
        resp, torch.full((n,), params.temperature), torch.full((n,), params.top_p), masked
    )
    return lp.gather(1, torch.as_tensor(out_ids, dtype=torch.long)[:, None])[:, 0].numpy()


def test_logprobs_equal_teacher_forced_pass_in_a_batch(tiny_dir):
    params = [
        SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=24, seed=1),
        SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=17, seed=2),
        SamplingParams(temperature=0.0, max_new_tokens=12),
        SamplingParams(temperature=1.3, top_p=0.5, max_new_tokens=20, seed=4),
    ]
    prompts = [prompt(tiny_dir, n, seed=n) for n in (1, 3, 2, 1)]

    async def run():
        cfg = EngineConfig(kind="hf", model=str(tiny_dir), batch_wait_ms=50)
        async with make_engine(cfg) as engine:
            outs = await asyncio.gather(
                *[
                    engine.generate(ids, images, p)
                    for (_, ids, images), p in zip(prompts, params, strict=True)
                ]
            )
            return engine, outs

    engine, outs = asyncio.run(run())
    assert engine.stats["batches"] == 1 and engine.stats["requests"] == 4
    model = _model(tiny_dir)
    for (proc, ids, images), p, out in zip(prompts, params, outs, strict=True):
        assert out.token_ids.dtype == np.int32 and out.logprobs.dtype == np.float32
        assert 1 <= len(out.token_ids) <= p.max_new_tokens
        assert out.finish_reason == (
            "stop" if len(out.token_ids) < p.max_new_tokens else "length"
        ) or (out.token_ids[-1] == proc.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        tf = teacher_forced(model, proc, ids, images, out.token_ids, p)
        np.testing.assert_allclose(out.logprobs, tf, atol=LOGPROB_TOL, rtol=0)
        assert np.all(out.logprobs <= 0)
        if p.temperature == 0:
            assert out.token_ids.tolist() == _greedy_hf(model, proc, ids, images, p).tolist()


def _model(tiny_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_dir).eval()


def _greedy_hf(model, proc, ids, images, p):
    from arpo.policy.engine import to_pil

    enc = proc.image_processor(images=[to_pil(i) for i in images], return_tensors="pt")
    inp = torch.tensor([ids.tolist()])
    out = model.generate(
        input_ids=inp,
        attention_mask=torch.ones_like(inp),
        pixel_values=enc["pixel_values"],
        image_grid_thw=enc["image_grid_thw"],
        mm_token_type_ids=(inp == model.config.image_token_id).int(),
        max_new_tokens=p.max_new_tokens,
        do_sample=False,
        eos_token_id=proc.tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    return out[0, len(ids) :]


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_dir):
    _, ids, images = prompt(tiny_dir, 1)
    p = SamplingParams(temperature=1.0, max_new_tokens=16, seed=7)

    async def run():
        async with make_engine(EngineConfig(kind="hf", model=str(tiny_dir))) as engine:
            alone = await engine.generate(ids, images, p)
            crowd = await asyncio.gather(
                *[
                    engine.generate(ids, images, SamplingParams(max_new_tokens=16, seed=s))
                    for s in (1, 2)
                ],
                engine.generate(ids, images, p),
            )
            return alone, crowd[-1]

    alone, in_batch = asyncio.run(run())
    assert alone.token_ids.tolist() == in_batch.token_ids.tolist()
    np.testing.assert_allclose(alone.logprobs, in_batch.logprobs, atol=LOGPROB_TOL)


def test_weight_updates_from_memory_and_folder_change_outputs_and_version(tiny_dir, tmp_path):
    _, ids, images = prompt(tiny_dir, 1)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    other = build_tiny_model(tmp_path / "other", seed=5)
    model = _model(tiny_dir)
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}

    async def run():
        async with make_engine(EngineConfig(kind="hf", model=str(tiny_dir))) as engine:
            before = await engine.generate(ids, images, greedy)
            # Requests in flight finish on the old version; later ones see the new one.
            pending = [asyncio.create_task(engine.generate(ids, images, greedy)) for _ in range(3)]
            await asyncio.sleep(0)
            await engine.update_weights(state, version=1)
            after_mem = await engine.generate(ids, images, greedy)
            done = await asyncio.gather(*pending)
            await engine.update_weights(other, version=2)
            after_dir = await engine.generate(ids, images, greedy)
            with pytest.raises(EngineError):
                await engine.update_weights(tmp_path / "missing", version=3)
            return before, after_mem, after_dir, done, engine.policy_version

    before, after_mem, after_dir, done, version = asyncio.run(run())
    assert (before.policy_version, after_mem.policy_version, after_dir.policy_version) == (0, 1, 2)
    assert version == 2
    assert all(
        d.policy_version == 0 and d.token_ids.tolist() == before.token_ids.tolist() for d in done
    )
    assert not np.allclose(before.logprobs[:1], after_mem.logprobs[:1])
    # The folder update serves exactly the other checkpoint.
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(other)
    expect = _greedy_hf(_model(other), proc, ids, images, greedy)
    assert after_dir.token_ids.tolist() == expect.tolist()


def test_prompt_with_wrong_image_token_count_fails_that_request_only(tiny_dir):
    proc, ids, images = prompt(tiny_dir, 1)
    pad = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    first = ids.tolist().index(pad)
    short = ids.tolist()[:first] + ids.tolist()[first + 3 :]

    async def run():
        async with make_engine(EngineConfig(kind="hf", model=str(tiny_dir))) as engine:
            with pytest.raises(EngineError, match="image tokens"):
                await engine.generate(short, images)
            ok = await engine.generate(ids, images, SamplingParams(max_new_tokens=3))
            return ok

    assert len(asyncio.run(run()).token_ids) >= 1


def test_sampling_params_validate():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def _episode_turns(tiny_dir, shots, responses):
    """(ids, images) of each turn of one episode showing `shots` with `responses` between."""
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_dir)
    ep = EpisodePrompt.from_processor(proc, "fill the form")
    turns = []
    for i, shot in enumerate(shots):
        ep.add_screenshot(shot)
        turns.append(ep.model_input())
        if i < len(responses):
            ep.add_response(responses[i])
    return proc, turns


def test_prefix_cache_reuses_earlier_turns_and_scores_as_a_full_prefill(tiny_dir):
    """Turn t + 1 of an episode reuses the keys and values of turn t's prompt and response;
    its log-probs equal a teacher-forced pass over the whole prompt, its greedy tokens
    those of an engine without the cache. A screenshot with other pixels (same size, so the
    same token ids) is never reused, and new weights clear the cache."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    shots = [png(640, 400, 20 + i) for i in range(4)]

    async def episode(engine, shots):
        """Sample turn by turn; each response goes into the next turn's prompt."""
        from transformers import AutoProcessor

        proc = AutoProcessor.from_pretrained(tiny_dir)
        ep = EpisodePrompt.from_processor(proc, "fill the form")
        outs = []
        for shot in shots:
            ep.add_screenshot(shot)
            ids, images = ep.model_input()
            out = await engine.generate(ids, images, greedy)
            outs.append((ids, images, out))
            ep.add_response(out.token_ids)
        return outs

    async def run(cache_tokens):
        cfg = EngineConfig(kind="hf", model=str(tiny_dir), prefix_cache_tokens=cache_tokens)
        async with make_engine(cfg) as engine:
            outs = await episode(engine, shots)
            hits = dict(engine.stats)
            # Same ids, other pixels in the second screenshot: reuse stops before it.
            other = [shots[0], png(640, 400, 99), *shots[2:]]
            mixed = await episode(engine, other)
            after_mixed = dict(engine.stats)
            model = _model(tiny_dir)
            state = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
            await engine.update_weights(state, version=1)
            ids, images, _ = outs[-1]
            fresh = await engine.generate(ids, images, greedy)
            return outs, mixed, hits, after_mixed, dict(engine.stats), fresh, state

    outs, mixed, hits, after_mixed, last, fresh, state = asyncio.run(run(32768))
    plain, *_ = asyncio.run(run(0))
    model = _model(tiny_dir)
    proc = None
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_dir)
    for (ids, images, out), (_, _, ref) in zip(outs, plain, strict=True):
        assert out.token_ids.tolist() == ref.token_ids.tolist()
        tf = teacher_forced(model, proc, ids, images, out.token_ids, greedy)
        np.testing.assert_allclose(out.logprobs, tf, atol=LOGPROB_TOL, rtol=0)
    # Every turn after the first reused the previous turn's prompt and response (less the
    # response's last token, never fed to the model).
    expect = sum(len(outs[i][0]) + len(outs[i][2].token_ids) - 1 for i in range(3))
    assert hits["prefix_hits"] == 3 and hits["prefix_tokens"] == expect, hits
    # The other-pixels episode: turn 1 reuses all but the last token of the first turn's
    # prompt, turn 2 stops before the changed screenshot's image block, turns 3 and 4
    # reuse this episode's own earlier turns.
    pad = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ids2 = outs[1][0].tolist()
    second_block = [i for i, t in enumerate(ids2) if t == pad and ids2[i - 1] != pad][1]
    reused = after_mixed["prefix_tokens"] - hits["prefix_tokens"]
    own = sum(len(mixed[i][0]) + len(mixed[i][2].token_ids) - 1 for i in (1, 2))
    assert reused == len(outs[0][0]) - 1 + second_block + own, (reused, second_block)
    for ids, images, out in mixed:
        tf = teacher_forced(model, proc, ids, images, out.token_ids, greedy)
        np.testing.assert_allclose(out.logprobs, tf, atol=LOGPROB_TOL, rtol=0)
    # New weights: nothing reused, and the answer is the new model's.
    assert last["prefix_hits"] == after_mixed["prefix_hits"], last
    model.load_state_dict(state)
    ids, images, _ = outs[-1]
    tf = teacher_forced(model, proc, ids, images, fresh.token_ids, greedy)
    np.testing.assert_allclose(fresh.logprobs, tf, atol=LOGPROB_TOL, rtol=0)


def test_a_batch_that_reuse_would_make_wider_runs_prefilled_whole(tiny_dir):
    """A row reusing a long prefix batched with a longer row that reuses only the system
    prompt would be laid out C + S wide, near twice the longest prompt: the batch runs
    prefilled whole (`prefix_dropped` counts both matches, no hit), every row's log-probs
    still equal a full teacher-forced pass, and the entry that the first row's prompt
    extends is still replaced by the new one, as when it is reused."""
    from transformers import AutoProcessor

    params = [SamplingParams(temperature=1.0, max_new_tokens=8, seed=s) for s in range(2)]
    proc = AutoProcessor.from_pretrained(tiny_dir)
    text = proc.tokenizer("the form has a field for every name and a button " * 500).input_ids
    _, b = _episode_turns(tiny_dir, [png(640, 400, 43), png(640, 400, 44)], [text[:4500]])

    async def run():
        cfg = EngineConfig(kind="hf", model=str(tiny_dir), batch_wait_ms=200)
        async with make_engine(cfg) as engine:
            ep = EpisodePrompt.from_processor(proc, "fill the form")
            ep.add_screenshot(png(640, 400, 40))
            ep.add_response(text[:3000])
            ep.add_screenshot(png(640, 400, 41))
            out = await engine.generate(*ep.model_input(), params[0])  # kept: 3,700 tokens
            (first,) = engine._prefixes
            ep.add_response(out.token_ids)
            ep.add_screenshot(png(640, 400, 42))
            a = ep.model_input()  # starts with the whole kept entry
            before = dict(engine.stats)
            outs = await asyncio.gather(
                *[engine.generate(*turn, p) for turn, p in zip((a, b[1]), params, strict=True)]
            )
            return a, outs, before, dict(engine.stats), first, list(engine._prefixes)

    a, outs, before, after, first, kept = asyncio.run(run())
    assert after["batches"] == before["batches"] + 1
    assert after["prefix_dropped"] - before["prefix_dropped"] == 2, after
    assert after["prefix_hits"] == before["prefix_hits"], after
    assert first not in kept and len(kept) == 2, (first, kept)
    model = _model(tiny_dir)
    for (ids, images), p, out in zip((a, b[1]), params, outs, strict=True):
        tf = teacher_forced(model, proc, ids, images, out.token_ids, p)
        np.testing.assert_allclose(out.logprobs, tf, atol=LOGPROB_TOL, rtol=0)


def test_prefix_cache_in_a_batch_of_hits_and_misses_and_within_its_budget(tiny_dir):
    """One batch mixing rows that reuse prefixes of different lengths with rows that reuse
    nothing: every row's log-probs equal a full teacher-forced pass. The kept tokens never
    exceed `prefix_cache_tokens`."""
    params = [SamplingParams(temperature=1.0, max_new_tokens=12, seed=s) for s in range(4)]
    r = [[5, 6, 7], [8, 9]]

    async def run():
        cfg = EngineConfig(kind="hf", model=str(tiny_dir), batch_wait_ms=200)
        async with make_engine(cfg) as engine:
            _, long_ep = _episode_turns(tiny_dir, [png(640, 400, 1), png(640, 400, 2)], r)
            _, short_ep = _episode_turns(tiny_dir, [png(800, 600, 3)], r)
            # Keep turn 1 of the first episode only.
            await engine.generate(*long_ep[0], params[0])
            before = dict(engine.stats)
            _, unrelated = _episode_turns(tiny_dir, [png(320, 200, 4)], r)
            batch = [long_ep[1], short_ep[0], unrelated[0], long_ep[0]]
            outs = await asyncio.gather(
                *[engine.generate(ids, im, p) for (ids, im), p in zip(batch, params, strict=True)]
            )
            return batch, outs, before, dict(engine.stats)

    batch, outs, before, after = asyncio.run(run())
    assert after["batches"] == before["batches"] + 1
    # Rows 0 and 3 reuse the kept turn; rows 1 and 2 share only the system prompt's tokens
    # with it (reused up to their first image block).
    assert after["prefix_hits"] - before["prefix_hits"] == 4, after
    model = _model(tiny_dir)
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_dir)
    for (ids, images), p, out in zip(batch, params, outs, strict=True):
        tf = teacher_forced(model, proc, ids, images, out.token_ids, p)
        np.testing.assert_allclose(out.logprobs, tf, atol=LOGPROB_TOL, rtol=0)

    async def small():
        cfg = EngineConfig(kind="hf", model=str(tiny_dir), prefix_cache_tokens=1500)
        async with make_engine(cfg) as engine:
            for seed in range(4):
                _, ep = _episode_turns(tiny_dir, [png(640, 400, 10 + seed)], r)
                await engine.generate(*ep[0], params[0])
                assert 0 < engine._prefix_total <= 1500, engine._prefix_total
                assert engine._prefix_total == sum(len(e.ids) for e in engine._prefixes.values())
            return len(engine._prefixes)

    assert asyncio.run(small()) < 4


def test_a_response_stops_on_every_end_token_the_generation_config_names(tiny_dir, tmp_path):
    """A model folder whose generation config names a second end token (the reader names
    SmolLM2's <|im_end|> beside <end_of_utterance>) stops there too, as transformers'
    `generate` would: greedy decoding's third token, named an end, ends the response."""
    import shutil

    from transformers import GenerationConfig

    _, ids, images = prompt(tiny_dir, 1)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)

    async def sample(folder):
        async with make_engine(EngineConfig(kind="hf", model=str(folder))) as engine:
            return await engine.generate(ids, images, greedy)

    free = asyncio.run(sample(tiny_dir))
    assert len(free.token_ids) == 8 and free.finish_reason == "length"
    third = int(free.token_ids[2])
    folder = tmp_path / "two-ends"
    shutil.copytree(tiny_dir, folder)
    gen = GenerationConfig.from_pretrained(folder)
    gen.eos_token_id = [gen.eos_token_id if isinstance(gen.eos_token_id, int)
                        else gen.eos_token_id[0], third]  # fmt: skip
    gen.save_pretrained(folder)
    stopped = asyncio.run(sample(folder))
    assert stopped.token_ids.tolist() == free.token_ids[:3].tolist()
    assert stopped.finish_reason == "stop"

"""The OpenAI-compatible engine trusts no answer of its server.

A real aiohttp server on loopback speaks the tokens endpoint (`POST /inference/v1/generate`)
to the real `OpenAIEngine` and answers what no sampler could have given: a vision token the
logit bias forbids (a server that ignored it), a token id beyond the model's vocabulary or of
2^40, a positive, NaN or infinite log-prob, ids and log-probs of different lengths, missing
fields, more tokens than asked for, a body that is not JSON or nests without end, an answer
larger than its tokens can need. Each is an `EngineError` with the reason (not an `EnvError`:
the actor then abandons the episode and gives the grant back, it records no trajectory), and
the same engine then serves a good answer. Before: the vision token, the ids beyond the
vocabulary and the bad log-probs became a completion, 2^40 raised a bare OverflowError, a deep
nesting a bare RecursionError, and the body was read whatever its size.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from arpo.errors import EngineError, EnvError
from arpo.policy.engine import EngineConfig, SamplingParams
from arpo.policy.engine_openai import OpenAIEngine, answer_limit

PROMPT = [1, 2, 3]
PARAMS = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4)
PAD_ROWS = 64
"""The model config's vocabulary is the tokenizer's plus this many rows, as Qwen pads it."""


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> dict[str, Any]:
    """A model folder with the tiny model's tokenizer and config (no weights: the server
    samples, the engine only tokenises and checks)."""
    from transformers import PreTrainedTokenizerFast

    from arpo.policy.tiny import build_tokenizer, tiny_config

    out = tmp_path_factory.mktemp("model")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    tok.save_pretrained(out)
    config = tiny_config(tok)
    config.text_config.vocab_size = len(tok) + PAD_ROWS
    config.save_pretrained(out)
    return {
        "dir": out,
        "vocab": len(tok) + PAD_ROWS,
        "tokenizer_len": len(tok),
        "image_pad": tok.convert_tokens_to_ids("<|image_pad|>"),
        "vision_end": tok.convert_tokens_to_ids("<|vision_end|>"),
        "im_end": tok.convert_tokens_to_ids("<|im_end|>"),
    }


def answer(ids: list[int], lps: list[Any], **extra: Any) -> dict[str, Any]:
    return {
        "prompt_token_ids": PROMPT,
        "choices": [
            {
                "token_ids": ids,
                "logprobs": {"content": [{"token": "t", "logprob": lp} for lp in lps]},
            }
        ],
        **extra,
    }


def raw(obj: Any) -> bytes:
    return json.dumps(obj).encode()


class Server:
    """A loopback server whose next generate answer is `bad` once, then a good one."""

    def __init__(self, bad: Callable[[web.Request], Any], good: bytes) -> None:
        self.bad: Callable[[web.Request], Any] | None = bad
        self.good = good
        self.requests = 0

    async def generate(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.requests += 1
        bad, self.bad = self.bad, None
        if bad is None:
            return web.Response(body=self.good, content_type="application/json")
        out = bad(request)
        if inspect.isawaitable(out):
            out = await out
        if isinstance(out, web.StreamResponse):
            return out
        return web.Response(body=out, content_type="application/json")

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/inference/v1/generate", self.generate)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        await self.runner.cleanup()


def run_case(model: dict[str, Any], bad: Callable[[web.Request], Any]) -> tuple[Exception, Server]:
    """The error the engine raised on the bad answer, after checking a good one follows."""
    good = raw(answer([11, model["im_end"]], [-0.5, -0.25]))

    async def go() -> tuple[Exception, Server]:
        server = Server(bad, good)
        url = await server.start()
        try:
            cfg = EngineConfig(kind="openai", model=str(model["dir"]), base_url=url)
            async with OpenAIEngine(cfg) as engine:
                with pytest.raises(EngineError) as e:
                    await engine.generate(np.array(PROMPT), [], PARAMS)
                out = await engine.generate(np.array(PROMPT), [], PARAMS)
            assert out.token_ids.tolist() == [11, model["im_end"]]
            assert out.finish_reason == "stop" and out.logprobs.tolist() == [-0.5, -0.25]
            return e.value, server
        finally:
            await server.stop()

    return asyncio.run(asyncio.wait_for(go(), 60))


def const(body: bytes) -> Callable[[web.Request], bytes]:
    return lambda _request: body


# name -> (the bad answer given the model, what the error must say)
CASES: dict[str, tuple[Callable[[dict[str, Any]], bytes], str]] = {
    "image-pad-sampled": (
        lambda m: raw(answer([11, m["image_pad"]], [-0.5, -0.1])),
        r"token 1 is the vision token \d+, which the logit bias forbids",
    ),
    "vision-end-sampled": (
        lambda m: raw(answer([m["vision_end"]], [-0.1])),
        "which the logit bias forbids",
    ),
    "id-at-vocab-size": (
        lambda m: raw(answer([m["vocab"]], [-0.5])),
        r"token id 0 is \d+, outside the vocabulary \[0, \d+\)",
    ),
    "id-2^40": (lambda m: raw(answer([2**40], [-0.5])), "1099511627776, outside the vocabulary"),
    "id-negative": (lambda m: raw(answer([-1], [-0.5])), "outside the vocabulary"),
    "id-400-digits": (lambda m: raw(answer([10**400], [-0.5])), "outside the vocabulary"),
    "id-float": (lambda m: raw(answer([11.0], [-0.5])), "token id 0 is 11.0, not an int"),
    "id-string": (lambda m: raw(answer(["11"], [-0.5])), "not an int"),
    "id-bool": (lambda m: raw(answer([True], [-0.5])), "not an int"),
    "logprob-positive": (
        lambda m: raw(answer([11], [0.5])),
        r"log-prob 0 is 0.5, not a finite number <= 0",
    ),
    "logprob-nan": (
        lambda m: (
            b'{"choices": [{"token_ids": [11], "logprobs": {"content": [{"logprob": NaN}]}}]}'
        ),
        "is nan, not a finite",
    ),
    "logprob-minus-inf": (
        lambda m: (
            b'{"choices": [{"token_ids": [11], "logprobs": {"content": [{"logprob": -Infinity}]}}]}'
        ),
        "is -inf",
    ),
    "logprob-1e400": (
        lambda m: (
            b'{"choices": [{"token_ids": [11], "logprobs": {"content": [{"logprob": -1e400}]}}]}'
        ),
        "is -inf",
    ),
    "logprob-huge-int": (lambda m: raw(answer([11], [-(10**400)])), "not a finite number"),
    "logprob-string": (lambda m: raw(answer([11], ["-0.5"])), "log-prob 0 is .*, not a number"),
    "logprob-missing": (
        lambda m: raw({"choices": [{"token_ids": [11], "logprobs": {"content": [{}]}}]}),
        "not a number",
    ),
    "lengths-differ": (lambda m: raw(answer([11, 12], [-0.5])), "2 token ids but 1 log-probs"),
    "too-many-tokens": (lambda m: raw(answer([11] * 5, [-0.5] * 5)), "5 tokens sampled"),
    "no-logprobs": (
        lambda m: raw({"choices": [{"token_ids": [11]}]}),
        "logprobs.content is missing",
    ),
    "no-token-ids": (
        lambda m: raw({"choices": [{"logprobs": {"content": []}}]}),
        "token_ids is None, not a list",
    ),
    "no-choices": (lambda m: raw({"choices": []}), r"no choices\[0\]"),
    "not-an-object": (lambda m: raw([1, 2, 3]), "not a JSON object but list"),
    "prompt-ids-not-a-list": (
        lambda m: raw(answer([11], [-0.5], prompt_token_ids=7)),
        "prompt_token_ids is int",
    ),
    "prompt-expanded-otherwise": (
        lambda m: raw(answer([11], [-0.5], prompt_token_ids=[1, 2])),
        "expanded the prompt to 2 tokens, not 3",
    ),
    "not-json": (lambda m: b"<html>hello</html>", "not JSON"),
    "nested-without-end": (lambda m: b"[" * 200_000 + b"]" * 200_000, "not JSON"),
    "padded-past-the-limit": (
        lambda m: raw(
            answer([11], [-0.5], pad="x" * answer_limit(len(PROMPT), PARAMS.max_new_tokens))
        ),
        r"answered \d+ bytes, more than the \d+ allowed",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_an_impossible_answer_is_an_engine_error_with_the_reason(model, name: str) -> None:
    make, reason = CASES[name]
    err, server = run_case(model, const(make(model)))
    # An EngineError, never an EnvError: `run_episode` abandons the episode on it and the
    # actor gives the grant back; an EnvError would record an env_error trajectory instead.
    assert isinstance(err, EngineError) and not isinstance(err, EnvError)
    assert re.search(reason, str(err)), str(err)
    assert server.requests == 2  # refused at once, not retried


def test_an_endless_answer_is_read_no_further_than_its_limit(model) -> None:
    """A chunked answer with no length that never ends: the engine stops reading at the
    limit and refuses it (before: it read until the server stopped)."""
    limit = answer_limit(len(PROMPT), PARAMS.max_new_tokens)
    sent = [0]

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        chunk = b" " * (1 << 16)
        try:
            while sent[0] < 16 * limit:  # a bound for the test itself
                await resp.write(chunk)
                sent[0] += len(chunk)
        except (ConnectionError, RuntimeError):
            pass  # the client hung up
        return resp

    err, _ = run_case(model, endless)
    assert re.search(rf"more than the {limit} bytes allowed", str(err)), str(err)
    assert sent[0] < 16 * limit, "the engine read the whole endless answer"


def test_an_id_in_the_models_padded_rows_is_kept(model) -> None:
    """Ids past the tokenizer but inside the config's vocabulary (Qwen pads its output layer)
    can be sampled, and the learner can score them: not an error."""
    pad_id = model["tokenizer_len"] + PAD_ROWS - 1

    async def go() -> Any:
        server = Server(const(raw(answer([pad_id, 11], [-9.0, -0.5]))), b"")
        url = await server.start()
        try:
            cfg = EngineConfig(kind="openai", model=str(model["dir"]), base_url=url)
            async with OpenAIEngine(cfg) as engine:
                return await engine.generate(np.array(PROMPT), [], PARAMS)
        finally:
            await server.stop()

    out = asyncio.run(asyncio.wait_for(go(), 60))
    assert out.token_ids.tolist() == [pad_id, 11] and out.finish_reason == "length"

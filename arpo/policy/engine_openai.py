"""A vLLM OpenAI-compatible server over HTTP behind the `Engine` interface.

Token-in / token-out needs an endpoint that takes prompt token ids with images
and returns sampled ids with their log-probs. OpenAI's own completions API takes
no images, and chat completions re-render and re-tokenise the conversation, so
this client uses the tokens endpoint the vLLM OpenAI server serves beside the
OpenAI routes: `POST /inference/v1/generate` with `token_ids`, `content_parts`
(the screenshots as `image_url` data URLs) and vLLM `sampling_params`; it answers
`choices[0].token_ids` and `choices[0].logprobs.content[i].logprob`.

Start the server with the scale-out routes, the processed log-probs mode and the
development routes (weight reload, cache reset):

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server \\
        --model MODEL --host 127.0.0.1 --port 8000 --enable-scale-out \\
        --logprobs-mode processed_logprobs [--dtype float32 --enforce-eager]

(`server_command()` builds this command.)

- Image placeholders: as for the in-process engine, each image block is
  sent as one token and the server expands it; the expanded prompt length it
  reports (`return_token_ids`) is checked against ours.
- Weights: a folder is loaded in place by `POST /collective_rpc`
  {"method": "reload_weights", "kwargs": {"weights_path": ...}} (the folder must
  be readable by the server); a state dict is first written as safetensors to
  `EngineConfig.weights_dir` (a folder both sides see). The prefix, encoder and
  multimodal caches are then reset (`/reset_prefix_cache`, `/reset_encoder_cache`,
  `/reset_mm_cache`).
- Transport errors and 5xx answers are retried with capped backoff; 4xx are not.
- The server is not trusted: reading stops, and the answer is refused, once it is
  larger than its tokens can need (`answer_limit`); a generate answer must be one the
  sampler could have given (`parse_generate_answer`): as many log-probs as token ids,
  at most `max_new_tokens` of them, every id an int inside the model's vocabulary (its
  config's `vocab_size`) and none of the vision tokens the logit bias forbids (a server
  that ignored the bias), every log-prob a finite number <= 0. Anything else is an `EngineError` naming what was
  wrong, so the actor abandons the episode (and gives its grant back) instead of
  recording a trajectory no policy produced.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from arpo.errors import EngineError
from arpo.policy.engine import (
    Engine,
    EngineConfig,
    SamplingParams,
    to_png,
)
from arpo.policy.family import family_for_config
from arpo.policy.prompt import FORBIDDEN_LOGIT_BIAS, forbidden_token_ids

RETRIES = 4
ANSWER_BASE_BYTES = 1 << 20
"""Bytes any answer may take besides its tokens' share: the JSON around them, an error page."""
ANSWER_BYTES_PER_PROMPT_TOKEN = 16
"""Share of each prompt token: its id echoed in `prompt_token_ids` (at most 7 bytes + ", ")."""
ANSWER_BYTES_PER_NEW_TOKEN = 4096
"""Share of each sampled token: its id and its log-prob entry (`token`, `logprob`, `bytes`;
a long token's text JSON-escaped and its bytes listed take about 1 KiB)."""


def answer_limit(prompt_tokens: int = 0, max_new_tokens: int = 0) -> int:
    """Most bytes an answer to a request of `prompt_tokens` and `max_new_tokens` may take."""
    return (
        ANSWER_BASE_BYTES
        + ANSWER_BYTES_PER_PROMPT_TOKEN * prompt_tokens
        + ANSWER_BYTES_PER_NEW_TOKEN * max_new_tokens
    )


def _is_number(x: Any) -> bool:
    """A JSON number (a bool is not one)."""
    return isinstance(x, int | float) and not isinstance(x, bool)


def parse_generate_answer(
    out: Any,
    *,
    prompt_len: int,
    max_new_tokens: int,
    vocab_size: int,
    forbidden: frozenset[int] = frozenset(),
) -> tuple[list[int], list[float]]:
    """The sampled ids and log-probs of a `/inference/v1/generate` answer, checked.

    Raises `EngineError` with the reason when the answer is not one the server's sampler
    could have given: missing fields, ids and log-probs of different lengths, more than
    `max_new_tokens` tokens, an id that is not an int in [0, vocab_size) or is `forbidden`,
    a log-prob that is not a finite number <= 0, an expanded prompt of another length.
    """

    def bad(why: str) -> EngineError:
        return EngineError(f"the server's answer is impossible: {why}")

    if not isinstance(out, dict):
        raise bad(f"not a JSON object but {type(out).__name__}")
    choices = out.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise bad(f"no choices[0] object (choices: {str(choices)[:100]})")
    choice = choices[0]
    token_ids = choice.get("token_ids")
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(token_ids, list):
        raise bad(f"choices[0].token_ids is {str(token_ids)[:100]}, not a list")
    if not isinstance(content, list):
        raise bad(f"choices[0].logprobs.content is missing (logprobs: {str(logprobs)[:100]})")
    if len(token_ids) != len(content):
        raise bad(f"{len(token_ids)} token ids but {len(content)} log-probs")
    if len(token_ids) > max_new_tokens:
        raise bad(f"{len(token_ids)} tokens sampled, max_new_tokens is {max_new_tokens}")
    for i, t in enumerate(token_ids):
        if not isinstance(t, int) or isinstance(t, bool):
            raise bad(f"token id {i} is {str(t)[:40]}, not an int")
        if not 0 <= t < vocab_size:
            raise bad(f"token id {i} is {str(t)[:40]}, outside the vocabulary [0, {vocab_size})")
        if t in forbidden:
            raise bad(
                f"token {i} is the vision token {t}, which the logit bias forbids "
                "(does the server ignore `logit_bias`?)"
            )
    lps = []
    for i, c in enumerate(content):
        lp = c.get("logprob") if isinstance(c, dict) else None
        if not _is_number(lp):
            raise bad(f"log-prob {i} is {str(c)[:60]}, not a number")
        try:
            v = float(lp)
        except OverflowError:  # an int beyond float range
            v = math.inf
        if not math.isfinite(v) or v > 0:
            raise bad(f"log-prob {i} is {str(lp)[:40]}, not a finite number <= 0")
        lps.append(v)
    expanded = out.get("prompt_token_ids")
    if expanded is not None:
        if not isinstance(expanded, list):
            raise bad(f"prompt_token_ids is {type(expanded).__name__}, not a list")
        if len(expanded) != prompt_len:
            raise EngineError(
                f"the server expanded the prompt to {len(expanded)} tokens, not {prompt_len}: "
                "the image token counts disagree (same model folder and min / max pixels?)"
            )
    return list(token_ids), lps


def server_command(
    model: str, port: int, *, dtype: str = "float32", max_model_len: int = 32768
) -> list[str]:
    """The command line that starts a vLLM server this engine can use."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--enable-scale-out",
        "--logprobs-mode",
        "processed_logprobs",
    ]


class OpenAIEngine(Engine):
    """HTTP client of a vLLM OpenAI-compatible server (tokens endpoint)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._session: Any = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.base_url = config.base_url.rstrip("/")
        self._vocab_size = 0
        self._forbidden_set: frozenset[int] = frozenset()

    async def start(self) -> None:
        if self._session is not None:
            return
        import aiohttp
        from transformers import AutoConfig, AutoTokenizer

        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        self._session = aiohttp.ClientSession(
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_s),
        )
        self._tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.config.model)
        model_config = await asyncio.to_thread(AutoConfig.from_pretrained, self.config.model)
        try:
            self._family = family_for_config(model_config)
        except ValueError as e:
            raise EngineError(str(e)) from None
        self._stop_default = (self._family.chat(self._tokenizer).end,)
        self._forbidden = forbidden_token_ids(self._tokenizer)
        self._forbidden_set = frozenset(self._forbidden)
        # The ids the served model can sample are the rows of its output layer (the config's
        # vocab_size, which may exceed the tokenizer's length: Qwen pads it).
        vocab = getattr(model_config.get_text_config(), "vocab_size", None)
        self._vocab_size = int(vocab) if vocab else len(self._tokenizer)
        self._ensure_async()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    async def _post(
        self, path: str, body: dict[str, Any] | None = None, limit: int = ANSWER_BASE_BYTES
    ) -> Any:
        """POST `body` as JSON; the answer's JSON (None when empty), at most `limit` bytes."""
        import aiohttp

        if self._session is None:
            raise EngineError("the engine is not started (use `async with` or `await start()`)")
        delay = 0.2
        # Serialised once; sent from a file-like object, so that a body of several
        # screenshots is streamed rather than handed to the event loop as one bytes object.
        payload = json.dumps(body or {}).encode()
        headers = {"Content-Type": "application/json"}
        for attempt in range(RETRIES + 1):
            try:
                async with self._session.post(
                    self.base_url + path, data=io.BytesIO(payload), headers=headers
                ) as resp:
                    raw = await _read_bounded(resp, limit, path)
                    text = raw.decode("utf-8", "replace") if resp.status >= 400 else ""
                    if resp.status >= 500 and attempt < RETRIES:
                        raise ConnectionError(f"HTTP {resp.status}: {text[:200]}")
                    if resp.status >= 400:
                        raise EngineError(f"POST {path} answered HTTP {resp.status}: {text[:500]}")
                    if not raw.strip():
                        return None
                    try:
                        return json.loads(raw)
                    except (ValueError, RecursionError) as e:
                        raise EngineError(
                            f"POST {path} answered {raw[:200]!r}, not JSON: {str(e)[:200]}"
                        ) from None
            except (
                aiohttp.ClientConnectionError,
                aiohttp.ClientPayloadError,  # the body was cut short or garbled in transit
                ConnectionError,
                TimeoutError,
            ) as e:
                if attempt == RETRIES:
                    raise EngineError(f"POST {path} to {self.base_url} failed: {e!r}") from e
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
            except aiohttp.ClientError as e:  # a malformed HTTP answer: not retried
                raise EngineError(f"POST {path} to {self.base_url} failed: {e!r}") from e
        raise AssertionError("unreachable")

    async def _generate(
        self, ids: list[int], images: list[Any], params: SamplingParams
    ) -> tuple[Sequence[int], Sequence[float]]:
        parts = []
        if images:
            pngs = await asyncio.to_thread(lambda: [to_png(im) for im in images])
            parts = [
                {
                    "type": "image_url",
                    "url": "data:image/png;base64," + base64.b64encode(p).decode(),
                }
                for p in pngs
            ]
        sp: dict[str, Any] = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_new_tokens,
            "stop_token_ids": list(params.stop_token_ids),
            "logprobs": 0,
        }
        if self._forbidden:
            sp["logit_bias"] = {str(i): FORBIDDEN_LOGIT_BIAS for i in self._forbidden}
        if params.seed is not None:
            sp["seed"] = params.seed
        body: dict[str, Any] = {
            "token_ids": self._family.placeholder_prompt(self._tokenizer, ids) if images else ids,
            "sampling_params": sp,
            "return_token_ids": True,
        }
        if parts:
            body["content_parts"] = parts
        limit = answer_limit(len(ids), params.max_new_tokens)
        out = await self._post("/inference/v1/generate", body, limit)
        return parse_generate_answer(
            out,
            prompt_len=len(ids),
            max_new_tokens=params.max_new_tokens,
            vocab_size=self._vocab_size,
            forbidden=self._forbidden_set,
        )

    async def _load_folder(self, path: Path) -> None:
        await self._post(
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(path.resolve())}},
        )
        for route in ("/reset_prefix_cache", "/reset_encoder_cache", "/reset_mm_cache"):
            await self._post(route)

    async def _load_state_dict(self, state: Mapping[str, Any]) -> None:
        from arpo.policy.engine_vllm import save_state_dict

        if self.config.weights_dir:
            folder = Path(self.config.weights_dir)
        else:
            if self._tmp is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="arpo-openai-weights-")
            folder = Path(self._tmp.name)
        await asyncio.to_thread(save_state_dict, state, folder / "current")
        await self._load_folder(folder / "current")


async def _read_bounded(resp: Any, limit: int, path: str) -> bytes:
    """The body of `resp`, refused (EngineError) as soon as it is longer than `limit` bytes."""
    declared = resp.content_length
    if declared is not None and declared > limit:
        raise EngineError(f"POST {path} answered {declared} bytes, more than the {limit} allowed")
    body = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > limit:
            raise EngineError(f"POST {path} answered more than the {limit} bytes allowed")
    return bytes(body)

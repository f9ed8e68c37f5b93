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

- Image placeholders: as for the in-process engine, each <|image_pad|> run is
  sent as one token and the server expands it; the expanded prompt length it
  reports (`return_token_ids`) is checked against ours.
- Weights: a folder is loaded in place by `POST /collective_rpc`
  {"method": "reload_weights", "kwargs": {"weights_path": ...}} (the folder must
  be readable by the server); a state dict is first written as safetensors to
  `EngineConfig.weights_dir` (a folder both sides see). The prefix, encoder and
  multimodal caches are then reset (`/reset_prefix_cache`, `/reset_encoder_cache`,
  `/reset_mm_cache`).
- Transport errors and 5xx answers are retried with capped backoff; 4xx are not.
"""

from __future__ import annotations

import asyncio
import base64
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
    collapse_image_pads,
    to_png,
)
from arpo.policy.prompt import FORBIDDEN_LOGIT_BIAS, forbidden_token_ids

RETRIES = 4


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

    async def start(self) -> None:
        if self._session is not None:
            return
        import aiohttp
        from transformers import AutoTokenizer

        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        self._session = aiohttp.ClientSession(
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_s),
        )
        self._tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.config.model)
        self._stop_default = (int(self._tokenizer.convert_tokens_to_ids("<|im_end|>")),)
        self._image_pad = int(self._tokenizer.convert_tokens_to_ids("<|image_pad|>"))
        self._forbidden = forbidden_token_ids(self._tokenizer)
        self._ensure_async()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    async def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        import aiohttp

        if self._session is None:
            raise EngineError("the engine is not started (use `async with` or `await start()`)")
        delay = 0.2
        for attempt in range(RETRIES + 1):
            try:
                async with self._session.post(self.base_url + path, json=body or {}) as resp:
                    text = await resp.text()
                    if resp.status >= 500 and attempt < RETRIES:
                        raise ConnectionError(f"HTTP {resp.status}: {text[:200]}")
                    if resp.status >= 400:
                        raise EngineError(f"POST {path} answered HTTP {resp.status}: {text[:500]}")
                    if not text:
                        return None
                    return await resp.json(content_type=None)
            except (aiohttp.ClientConnectionError, ConnectionError, TimeoutError) as e:
                if attempt == RETRIES:
                    raise EngineError(f"POST {path} to {self.base_url} failed: {e!r}") from e
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
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
            "token_ids": collapse_image_pads(ids, self._image_pad) if images else ids,
            "sampling_params": sp,
            "return_token_ids": True,
        }
        if parts:
            body["content_parts"] = parts
        out = await self._post("/inference/v1/generate", body)
        try:
            prompt_len = len(out.get("prompt_token_ids") or ids)
            choice = out["choices"][0]
            token_ids = [int(t) for t in choice["token_ids"]]
            lps = [float(c["logprob"]) for c in choice["logprobs"]["content"]]
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise EngineError(f"unexpected answer from the server: {str(out)[:300]}") from e
        if prompt_len != len(ids):
            raise EngineError(
                f"the server expanded the prompt to {prompt_len} tokens, not {len(ids)}: the "
                "image token counts disagree (same model folder and min / max pixels?)"
            )
        return token_ids, lps

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

"""The client of a shared `arpo-engine` server (`engine_server.py`): `engine.kind=shared`.

The server follows the learner's weights itself, so this engine takes none
(`follows_learner`; `update_weights` is refused): the actor learns the version the server
serves from each answer (`policy_version`, the version that produced every token of it) and,
when a grant needs a newer one, from `refresh_version()` until the server has loaded it.

The prompt is built here, with the tokenizer and processor saved in `engine.model` (a folder
the actor can read, as for the `openai` engine), and sent as token ids with the images as
base64 PNG. The answer is held to what the sampler could have given (`parse_generate_answer`,
shared with the `openai` engine): as many log-probs as ids, at most `max_new_tokens`, every id
inside the vocabulary and none the logit bias forbids, every log-prob finite and <= 0;
anything else or a body of another `schema` is an `EngineError`, and the actor abandons the
episode and gives its grant back. Each turn is stamped with the version its answer names, so
a server restarted without the learner's weights yields turns of an old version, which the
learner's staleness bound leaves out.
Transport errors and 5xx answers are retried with capped backoff (`OpenAIEngine._post`).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from arpo.errors import EngineError
from arpo.policy.engine import SamplingParams, to_png
from arpo.policy.engine_openai import OpenAIEngine, answer_limit, parse_generate_answer

SCHEMA = 1
"""Version of the shared engine's request and answer bodies (this client's and
`engine_server.py`'s); a peer speaking another is refused, naming it."""


class SharedEngine(OpenAIEngine):
    """HTTP client of an `arpo-engine` server."""

    follows_learner = True
    """The server loads the learner's weights; the actor does not fetch or push any."""

    async def refresh_version(self) -> int:
        """Ask the server which version it serves now; the version known here after."""
        out = await self._post("/v1/health")
        self._check_schema(out, "/v1/health")
        v = out.get("policy_version")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise EngineError(f"/v1/health answered policy_version {v!r:.40}, not an int >= 0")
        self._version = max(self._version, v)
        return self._version

    @staticmethod
    def _check_schema(out: Any, path: str) -> None:
        if not isinstance(out, dict) or out.get("schema") != SCHEMA:
            got = out.get("schema") if isinstance(out, dict) else type(out).__name__
            raise EngineError(
                f"POST {path} answered schema {got!r:.40}, not {SCHEMA}: the engine server "
                "runs another arpo version"
            )

    async def _generate_versioned(
        self, ids: list[int], images: list[Any], params: SamplingParams
    ) -> tuple[Sequence[int], Sequence[float], int]:
        pngs = await asyncio.to_thread(lambda: [to_png(im) for im in images])
        body = {
            "schema": SCHEMA,
            "token_ids": ids,
            "images": [base64.b64encode(p).decode() for p in pngs],
            "sampling": {
                "temperature": params.temperature,
                "top_p": params.top_p,
                "max_new_tokens": params.max_new_tokens,
                "seed": params.seed,
                "stop_token_ids": list(params.stop_token_ids),
            },
        }
        out = await self._post("/v1/generate", body, answer_limit(0, params.max_new_tokens))
        self._check_schema(out, "/v1/generate")
        version = out.get("policy_version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise EngineError(f"/v1/generate answered policy_version {version!r:.40}")
        self._version = max(self._version, version)
        token_ids, lps = parse_generate_answer(
            {"choices": [{"token_ids": out.get("token_ids"), "logprobs": {"content": [
                {"logprob": x} for x in (out.get("logprobs") or [])]}}]},
            prompt_len=len(ids),
            max_new_tokens=params.max_new_tokens,
            vocab_size=self._vocab_size,
            forbidden=self._forbidden_set,
        )  # fmt: skip
        return token_ids, lps, version

    async def _generate(
        self, ids: list[int], images: list[Any], params: SamplingParams
    ) -> tuple[Sequence[int], Sequence[float]]:
        out_ids, lps, _ = await self._generate_versioned(ids, images, params)
        return out_ids, lps

    async def _load_folder(self, path: Path) -> None:
        raise EngineError("a shared engine server loads the learner's weights itself")

    async def _load_state_dict(self, state: Mapping[str, Any]) -> None:
        raise EngineError("a shared engine server loads the learner's weights itself")

"""The policy engine interface: token ids + images in, sampled token ids + log-probs out.

Every engine (transformers `engine_hf.py`, vLLM in process `engine_vllm.py`, an
OpenAI-compatible vLLM server over HTTP `engine_openai.py`, a shared `arpo-engine` server
over HTTP `engine_shared.py`) implements `Engine`;
`arpo.policy.engines.make_engine` builds the one a config names:

    async with make_engine(EngineConfig(kind="hf", model="runs/tiny")) as engine:
        out = await engine.generate(prompt_ids, [png_bytes], SamplingParams(temperature=1.0))
        out.token_ids, out.logprobs, out.text, out.policy_version
        await engine.update_weights(model.state_dict(), version=1)   # or a folder

Contract shared by all engines:

- The prompt is token ids (the image placeholders already expanded to the right
  number of <|image_pad|> tokens, as `arpo.policy.prompt` builds them) plus the
  images in order (PIL images or PNG bytes). Nothing is re-tokenised.
- `token_ids` are the sampled ids; when generation stopped on a stop token
  (<|im_end|> by default) that token is the last id and has a log-prob of its own
  (it is the model's decision to end the turn, and it is trained on).
- `logprobs[i]` is the log-probability of `token_ids[i]` under the distribution
  the token was sampled from: log_softmax over the vocabulary of logits / T with
  the tokens outside the top-p nucleus removed (vLLM's `logprobs_mode=
  "processed_logprobs"`; the nucleus is vLLM's: tokens sorted by probability,
  a token is dropped when the cumulative probability below it is <= 1 - top_p).
  Greedy decoding (temperature 0) reports log_softmax(logits), i.e. temperature 1,
  no nucleus, as vLLM does. With the rollout settings (T = 1, top_p = 1) this is
  the model's own log-probability, the behaviour log-prob the loss needs.
- `text` is decoded locally from `token_ids` (the stop token left out, special
  tokens skipped), so it is the same function of the ids for every engine.
- Weights are replaced without a restart, from a state dict in memory or a
  checkpoint folder; `update_weights` waits for the requests in flight, then no
  request starts until the new weights are in place, so every completion was
  produced by exactly one version, the `policy_version` it reports. A shared server
  (`engine_shared.py`) loads the learner's weights itself: its client does not take
  weights (`follows_learner`), and reports the version the server names per answer.
- Concurrency is bounded (`EngineConfig.max_concurrency` requests in flight);
  further calls wait their turn.
"""

from __future__ import annotations

import abc
import asyncio
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from arpo.config import check_range, check_seconds, fail, option
from arpo.errors import EngineError

if TYPE_CHECKING:
    import torch
    from PIL import Image


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one response."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the most probable tokens whose total probability reaches top_p."""
    max_new_tokens: int = 256
    """At most this many tokens are sampled (the stop token included)."""
    seed: int | None = None
    """Seed of this request's sampler; None draws one (results then differ run to run)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the response; empty means the model family's end-of-message token
    (<|im_end|>, SmolVLM's <end_of_utterance>)."""

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass(frozen=True, slots=True)
class Completion:
    """One sampled response."""

    token_ids: np.ndarray
    """Sampled token ids (int32), the stop token included when finish_reason is 'stop'."""
    logprobs: np.ndarray
    """Log-prob (float32) of each sampled token under the sampling distribution (see module doc)."""
    text: str
    """The response decoded from token_ids, without the stop token and special tokens."""
    finish_reason: Literal["stop", "length"]
    """'stop' when a stop token ended the response, 'length' when max_new_tokens did."""
    policy_version: int
    """Version of the weights that produced every token of this response."""


@dataclass
class EngineConfig:
    """Which policy engine to run and how."""

    kind: Literal["hf", "vllm", "openai", "shared"] = option(
        "hf",
        "Engine: 'hf' (transformers), 'vllm' (vLLM in process), 'openai' (vLLM server), "
        "'shared' (an `arpo-engine` server that follows the learner).",
    )
    model: str = option("", "Model folder or hub id (UI-TARS-1.5-7B, or the tiny test model).")
    dtype: Literal["float32", "bfloat16", "float16"] = option(
        "float32", "Weights and activations dtype; bf16 on CPU needs AMX (see vllm_install.py)."
    )
    device: str = option("cpu", "Torch device of the transformers engine ('cpu', 'cuda', ...).")
    max_concurrency: int = option(64, "Requests in flight at once; further calls wait.")
    max_batch_size: int = option(16, "transformers engine: most requests decoded together.")
    batch_wait_ms: float = option(
        5.0, "transformers engine: how long the first request waits for others to join its batch."
    )
    prefix_cache_tokens: int = option(
        32768,
        "transformers engine: tokens of keys and values kept across requests, so the next "
        "turn of an episode prefills only its new tokens (0: off; memory per token is "
        "2 x layers x kv heads x head dim x dtype size). Gains most when it holds the "
        "episodes sampled at once x their longest prompt.",
    )
    max_model_len: int = option(32768, "vLLM: longest prompt + response in tokens.")
    max_images: int = option(16, "vLLM: most images in one prompt (the reference keeps 15).")
    kv_cache_gib: int = option(1, "vLLM on CPU: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_utilization: float = option(0.85, "vLLM on GPU: share of GPU memory it may use.")
    enforce_eager: bool = option(True, "vLLM: no CUDA graphs / compilation (fast start).")
    base_url: str = option(
        "http://127.0.0.1:8000", "openai and shared engines: the server's address."
    )
    api_key: str = option(
        "", "openai and shared engines: bearer token, if the server was started with one."
    )
    request_timeout_s: float = option(
        600.0, "openai and shared engines: timeout of one HTTP request."
    )
    weights_dir: str = option(
        "", "openai engine: folder shared with the server where in-memory weights are written."
    )

    def validate(self) -> None:
        if not self.model:
            fail("model", "is required: a model folder or hub id")
        if self.max_concurrency < 1:
            fail("max_concurrency", "must be >= 1")
        if self.max_batch_size < 1:
            fail("max_batch_size", "must be >= 1")
        check_range("batch_wait_ms", self.batch_wait_ms, 0.0, 60_000.0, "milliseconds")
        check_seconds("request_timeout_s", self.request_timeout_s)
        for name in ("max_model_len", "kv_cache_gib"):
            if getattr(self, name) < 1:
                fail(name, "must be >= 1")
        check_range("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0,
                    "fraction of the GPU's memory vLLM may take", lo_open=True)  # fmt: skip
        if self.prefix_cache_tokens < 0:
            fail("prefix_cache_tokens", "must be >= 0 (0 turns the prefix cache off)")
        if self.max_images < 1:
            fail("max_images", "must be >= 1")
        if self.kind in ("openai", "shared") and not self.base_url.startswith(
            ("http://", "https://")
        ):
            fail("base_url", "must start with http:// or https://")


def to_pil(image: Any) -> Image.Image:
    """A PIL RGB image from a PIL image or encoded bytes (PNG, JPEG)."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB") if image.mode != "RGB" else image
    if isinstance(image, bytes | bytearray | memoryview):
        img = Image.open(io.BytesIO(bytes(image)))
        img.load()
        return img.convert("RGB")
    raise EngineError(f"an image must be a PIL image or PNG bytes, got {type(image).__name__}")


def to_png(image: Any) -> bytes:
    """PNG bytes of a PIL image; bytes are returned as they are."""
    if isinstance(image, bytes | bytearray | memoryview):
        return bytes(image)
    buf = io.BytesIO()
    to_pil(image).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def process_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    forbidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probs of the sampling distribution for rows of float32 logits (B, V).

    `forbidden` ids (`arpo.policy.prompt.forbidden_token_ids`) get logit -inf first, in
    every row: they can never be sampled, and the others' log-probs are the masked
    distribution's (as the learner scores them).

    Matches vLLM's `processed_logprobs`: rows with temperature 0 (greedy) get
    log_softmax(logits); the others log_softmax(logits / T) after vLLM's top-p
    mask (sort ascending, drop a token when the cumulative probability up to and
    including it is <= 1 - top_p, always keep the most probable token).
    """
    import torch

    logits = logits.float()
    if forbidden is not None and forbidden.numel():
        logits = logits.index_fill(-1, forbidden.to(logits.device), float("-inf"))
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).to(logits)
    scaled = logits / t.unsqueeze(1)
    needs_p = (top_p < 1.0) & ~greedy
    if bool(needs_p.any()):
        sorted_logits, idx = scaled.sort(dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p.to(logits)).unsqueeze(1)
        drop[:, -1] = False
        drop &= needs_p.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = scaled.scatter(-1, idx, sorted_logits)
    return scaled.log_softmax(dim=-1)


class _VersionGate:
    """Lets requests run concurrently and weight updates run alone.

    Requests enter while no update is pending; an update waits until the requests
    in flight have finished, and requests arriving meanwhile wait for the update.
    """

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._active = 0
        self._updating = False

    async def enter(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._updating)
            self._active += 1

    async def leave(self) -> None:
        async with self._cond:
            self._active -= 1
            self._cond.notify_all()

    async def begin_update(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._updating)
            self._updating = True
            await self._cond.wait_for(lambda: self._active == 0)

    async def end_update(self) -> None:
        async with self._cond:
            self._updating = False
            self._cond.notify_all()


class Engine(abc.ABC):
    """A policy engine; see the module docstring for the contract."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._version = 0
        self._gate: _VersionGate | None = None
        self._slots: asyncio.Semaphore | None = None
        self._tokenizer: Any = None
        self._stop_default: tuple[int, ...] = ()

    @property
    def policy_version(self) -> int:
        """Version of the weights currently served."""
        return self._version

    def _ensure_async(self) -> None:
        if self._gate is None:
            self._gate = _VersionGate()
            self._slots = asyncio.Semaphore(self.config.max_concurrency)

    async def generate(
        self,
        token_ids: Sequence[int] | np.ndarray,
        images: Sequence[Image.Image | bytes] = (),
        params: SamplingParams | None = None,
    ) -> Completion:
        """Sample one response to the prompt `token_ids` showing `images` (PIL or PNG bytes)."""
        self._ensure_async()
        assert self._gate is not None and self._slots is not None
        params = params or SamplingParams()
        if not params.stop_token_ids:
            params = _with_stop(params, self._stop_default)
        ids = [int(t) for t in np.asarray(token_ids).reshape(-1)]
        if not ids:
            raise EngineError("the prompt has no tokens")
        async with self._slots:
            await self._gate.enter()
            try:
                out_ids, out_lps, version = await self._generate_versioned(
                    ids, list(images), params
                )
            finally:
                await self._gate.leave()
        return self._completion(out_ids, out_lps, params, version)

    async def _generate_versioned(
        self, ids: list[int], images: list[Any], params: SamplingParams
    ) -> tuple[Sequence[int], Sequence[float], int]:
        """Sampled ids, their log-probs and the version that produced them: the one served
        when the request entered (a weight update waits for it to leave). An engine whose
        weights change elsewhere (a shared server) reports the version its server names."""
        version = self._version
        out_ids, out_lps = await self._generate(ids, images, params)
        return out_ids, out_lps, version

    async def update_weights(
        self, weights: Mapping[str, torch.Tensor] | str | Path, version: int
    ) -> None:
        """Serve new weights (a state dict or a checkpoint folder) as `version`."""
        self._ensure_async()
        assert self._gate is not None
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise EngineError(f"version must be an int >= 0, got {version!r}")
        await self._gate.begin_update()
        try:
            if isinstance(weights, str | Path):
                path = Path(weights)
                if not path.is_dir():
                    raise EngineError(f"weights folder {str(path)!r} does not exist")
                await self._load_folder(path)
            elif isinstance(weights, Mapping):
                await self._load_state_dict(weights)
            else:
                raise EngineError(
                    f"weights must be a state dict or a folder, got {type(weights).__name__}"
                )
            self._version = version
        finally:
            await self._gate.end_update()

    def _completion(
        self, ids: Sequence[int], lps: Sequence[float], params: SamplingParams, version: int
    ) -> Completion:
        ids_a = np.asarray(ids, dtype=np.int32)
        lps_a = np.asarray(lps, dtype=np.float32)
        if len(ids_a) != len(lps_a):
            raise EngineError(f"engine returned {len(ids_a)} tokens but {len(lps_a)} log-probs")
        stopped = bool(len(ids_a)) and int(ids_a[-1]) in params.stop_token_ids
        body = ids_a[:-1] if stopped else ids_a
        text = self._tokenizer.decode(body.tolist(), skip_special_tokens=True)
        return Completion(ids_a, lps_a, text, "stop" if stopped else "length", version)

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model (or connect to the server)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the model or the connection; idempotent."""

    @abc.abstractmethod
    async def _generate(
        self, ids: list[int], images: list[Any], params: SamplingParams
    ) -> tuple[Sequence[int], Sequence[float]]:
        """Sampled ids and their processed log-probs."""

    @abc.abstractmethod
    async def _load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    @abc.abstractmethod
    async def _load_folder(self, path: Path) -> None: ...


def _with_stop(params: SamplingParams, stop: tuple[int, ...]) -> SamplingParams:
    return SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        max_new_tokens=params.max_new_tokens,
        seed=params.seed,
        stop_token_ids=stop,
    )

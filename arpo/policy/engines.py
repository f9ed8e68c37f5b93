"""Pick the policy engine a config names: the one module that knows every engine.

    async with make_engine(EngineConfig(kind="hf", model="runs/tiny")) as engine:
        out = await engine.generate(prompt_ids, [png_bytes], SamplingParams(temperature=1.0))

The engines (`engine_hf.py`, `engine_vllm.py`, `engine_openai.py`, `engine_shared.py`)
import the interface they implement from `engine.py`; this module sits above them, so
the imports run one way. Each engine is imported only when it is chosen: vLLM and the
HTTP client stay unloaded for a transformers run.
"""

from __future__ import annotations

from arpo.config import validate
from arpo.policy.engine import Engine, EngineConfig


def make_engine(config: EngineConfig) -> Engine:
    """The engine named by `config.kind` (not started: use `async with` or `await start()`)."""
    validate(config)
    if config.kind == "hf":
        from arpo.policy.engine_hf import HFEngine

        return HFEngine(config)
    if config.kind == "vllm":
        from arpo.policy.engine_vllm import VLLMEngine

        return VLLMEngine(config)
    if config.kind == "shared":
        from arpo.policy.engine_shared import SharedEngine

        return SharedEngine(config)
    from arpo.policy.engine_openai import OpenAIEngine

    return OpenAIEngine(config)

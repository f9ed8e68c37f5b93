"""The transformers policy engine (CPU or GPU): batched sampling with exact log-probs.

Requests from many episodes arrive concurrently; a background task collects them
into batches (the first request waits up to `batch_wait_ms` for others, at most
`max_batch_size` together) and runs each batch in a worker thread so the event
loop stays free. A batch is left-padded, prefilled once (images encoded by the
vision tower, multimodal rotary positions from `get_rope_index`), then decoded
token by token with a KV cache. Each row samples with its own temperature, top-p,
stop tokens and `torch.Generator` (seeded by the request's seed).

The log-prob of a sampled token is read from the same logits the token was drawn
from, processed as `engine.process_logits` says; a teacher-forced forward pass
over prompt + response gives the same numbers (float32: within 1e-4, see
tests/test_policy_engine_hf.py).

Weights are replaced between batches: `load_state_dict` from memory, or the
safetensors files of a checkpoint folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arpo.errors import EngineError
from arpo.policy.engine import Engine, EngineConfig, SamplingParams, process_logits, to_pil
from arpo.policy.prompt import forbidden_token_ids


@dataclass
class _Request:
    ids: list[int]
    images: list[Any]
    params: SamplingParams
    future: asyncio.Future = field(repr=False)


class HFEngine(Engine):
    """transformers `Qwen2_5_VLForConditionalGeneration` behind the `Engine` interface."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.model: Any = None
        self.processor: Any = None
        self._queue: asyncio.Queue[_Request] | None = None
        self._loop_task: asyncio.Task | None = None
        self._rng_seed = int(time.time_ns() & 0x7FFF_FFFF)
        self.stats = {"batches": 0, "requests": 0, "tokens": 0, "decode_s": 0.0}
        """Counters: batches run, requests served, tokens sampled, seconds spent in batches."""

    async def start(self) -> None:
        if self.model is not None:
            return
        await asyncio.to_thread(self._load)
        self._queue = asyncio.Queue()
        self._ensure_async()
        self._loop_task = asyncio.create_task(self._batch_loop(), name="hf-engine-batcher")

    def _load(self) -> None:
        import torch
        from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

        dtype = getattr(torch, self.config.dtype)
        self.processor = AutoProcessor.from_pretrained(self.config.model)
        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            self.config.model, dtype=dtype
        ).to(self.config.device)
        self.model.eval()
        self._tokenizer = self.processor.tokenizer
        self._forbidden = torch.tensor(forbidden_token_ids(self._tokenizer), dtype=torch.long)
        self._stop_default = (int(self._tokenizer.convert_tokens_to_ids("<|im_end|>")),)
        self.image_token_id = int(self.model.config.image_token_id)

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        if self._queue is not None:
            while not self._queue.empty():
                req = self._queue.get_nowait()
                if not req.future.done():
                    req.future.set_exception(EngineError("the engine was closed"))
        self.model = None

    async def _generate(
        self, ids: list[int], images: list[Any], params: SamplingParams
    ) -> tuple[Sequence[int], Sequence[float]]:
        if self._queue is None or self._loop_task is None:
            raise EngineError("the engine is not started (use `async with` or `await start()`)")
        if self._loop_task.done():
            raise EngineError("the engine's batch loop has died") from self._loop_task.exception()
        fut = asyncio.get_running_loop().create_future()
        await self._queue.put(_Request(ids, images, params, fut))
        return await fut

    async def _batch_loop(self) -> None:
        assert self._queue is not None
        wait = self.config.batch_wait_ms / 1000
        while True:
            batch = [await self._queue.get()]
            deadline = time.monotonic() + wait
            while len(batch) < self.config.max_batch_size:
                left = deadline - time.monotonic()
                try:
                    batch.append(
                        self._queue.get_nowait()
                        if left <= 0
                        else await asyncio.wait_for(self._queue.get(), left)
                    )
                except (TimeoutError, asyncio.QueueEmpty):
                    break
            t0 = time.perf_counter()
            try:
                results = await asyncio.to_thread(self._run_batch, batch)
            except Exception as e:  # a bad request fails its batch, never the loop
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(
                            e
                            if isinstance(e, EngineError)
                            else EngineError(f"generation failed: {e!r}")
                        )
                continue
            self.stats["batches"] += 1
            self.stats["requests"] += len(batch)
            self.stats["decode_s"] += time.perf_counter() - t0
            for r, res in zip(batch, results, strict=True):
                self.stats["tokens"] += len(res[0])
                if not r.future.done():
                    r.future.set_result(res)

    # -- the batch, in a worker thread -------------------------------------------------

    def _prepare(self, reqs: Sequence[_Request]) -> dict[str, Any]:
        """Left-padded ids, attention mask, pixels and 3-D rotary positions of a batch."""
        import torch

        images = [to_pil(im) for r in reqs for im in r.images]
        pixel_values = grid = None
        per_image_tokens: list[int] = []
        if images:
            enc = self.processor.image_processor(images=images, return_tensors="pt")
            pixel_values = enc["pixel_values"].to(self.config.device, self.model.dtype)
            grid = enc["image_grid_thw"].to(self.config.device)
            merge = self.processor.image_processor.merge_size**2
            per_image_tokens = [int(g.prod()) // merge for g in enc["image_grid_thw"]]
        k = 0
        for r in reqs:
            want = sum(per_image_tokens[k : k + len(r.images)])
            k += len(r.images)
            have = sum(1 for t in r.ids if t == self.image_token_id)
            if have != want:
                raise EngineError(
                    f"the prompt has {have} image tokens but its {len(r.images)} image(s) need "
                    f"{want}: build prompts with arpo.policy.prompt (same min/max pixels as the "
                    "model's processor)"
                )
        pad = int(self._tokenizer.pad_token_id or 0)
        length = max(len(r.ids) for r in reqs)
        ids = torch.full((len(reqs), length), pad, dtype=torch.long)
        mask = torch.zeros((len(reqs), length), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, length - len(r.ids) :] = torch.tensor(r.ids)
            mask[i, length - len(r.ids) :] = 1
        ids, mask = ids.to(self.config.device), mask.to(self.config.device)
        mm_types = (ids == self.image_token_id).int()
        position_ids, _ = self.model.model.get_rope_index(
            ids, mm_token_type_ids=mm_types, image_grid_thw=grid, attention_mask=mask
        )
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": position_ids,
            "pixel_values": pixel_values,
            "image_grid_thw": grid,
        }

    def _run_batch(self, reqs: Sequence[_Request]) -> list[tuple[list[int], list[float]]]:
        import torch
        from transformers import DynamicCache

        dev = self.config.device
        with torch.inference_mode():
            inputs = self._prepare(reqs)
            n = len(reqs)
            temps = torch.tensor([r.params.temperature for r in reqs], device=dev)
            top_p = torch.tensor([r.params.top_p for r in reqs], device=dev)
            gens = []
            for r in reqs:
                g = torch.Generator(device=dev)
                if r.params.seed is not None:
                    g.manual_seed(r.params.seed)
                else:
                    self._rng_seed = (self._rng_seed * 6364136223846793005 + 1) % 2**63
                    g.manual_seed(self._rng_seed)
                gens.append(g)
            budget = [r.params.max_new_tokens for r in reqs]
            stops = [set(r.params.stop_token_ids) for r in reqs]
            out_ids: list[list[int]] = [[] for _ in reqs]
            out_lps: list[list[float]] = [[] for _ in reqs]
            done = [False] * n
            next_pos = inputs["position_ids"][:, :, -1].max(dim=0).values + 1  # (B,)
            mask = inputs["attention_mask"]
            cache = DynamicCache(config=self.model.config)
            out = self.model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
            while True:
                logprobs = process_logits(out.logits[:, -1, :], temps, top_p, self._forbidden)
                step = torch.empty(n, dtype=torch.long, device=dev)
                for i in range(n):
                    if done[i]:
                        step[i] = int(self._tokenizer.pad_token_id or 0)
                        continue
                    if reqs[i].params.temperature <= 0:
                        tok = int(logprobs[i].argmax())
                    else:
                        tok = int(torch.multinomial(logprobs[i].exp(), 1, generator=gens[i]))
                    step[i] = tok
                    out_ids[i].append(tok)
                    out_lps[i].append(float(logprobs[i, tok]))
                    if tok in stops[i] or len(out_ids[i]) >= budget[i]:
                        done[i] = True
                if all(done):
                    break
                mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=dev)], dim=1)
                pos = next_pos.view(1, n, 1).expand(3, n, 1)
                next_pos = next_pos + 1
                out = self.model(
                    input_ids=step.view(n, 1),
                    attention_mask=mask,
                    position_ids=pos,
                    past_key_values=cache,
                    use_cache=True,
                )
        return list(zip(out_ids, out_lps, strict=True))

    # -- weights -----------------------------------------------------------------------

    async def _load_state_dict(self, state: Mapping[str, Any]) -> None:
        await asyncio.to_thread(self._apply_state_dict, state)

    def _apply_state_dict(self, state: Mapping[str, Any]) -> None:
        import torch

        with torch.no_grad():
            try:
                missing, unexpected = self.model.load_state_dict(dict(state), strict=False)
            except RuntimeError as e:  # shape mismatches
                raise EngineError(f"weights do not fit the model: {e}") from None
        if unexpected:
            raise EngineError(f"weights have names the model does not: {sorted(unexpected)[:5]}")
        if missing:
            raise EngineError(f"weights are missing parameters: {sorted(missing)[:5]}")

    async def _load_folder(self, path: Path) -> None:
        await asyncio.to_thread(self._apply_folder, path)

    def _apply_folder(self, path: Path) -> None:
        # from_pretrained maps the checkpoint's key names (which may be the original
        # Qwen2.5-VL layout) onto the model's; its state dict then loads in place.
        import torch
        from transformers import Qwen2_5_VLForConditionalGeneration

        if not any(path.glob("*.safetensors")):
            raise EngineError(f"no .safetensors files in {str(path)!r}")
        fresh = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            path, dtype=getattr(torch, self.config.dtype)
        )
        self._apply_state_dict(fresh.state_dict())

"""An episode driven by an engine that keeps no processor in the actor (the OpenAI-compatible
server's client; vLLM's too): the prompt is built with the processor saved with the model,
and the episode runs and is scored, instead of the episode being abandoned at its first
turn."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from aiohttp import web

from arpo import wire
from arpo.actor.episode import EpisodeConfig, run_episode
from arpo.env.environment import Environment
from arpo.env.runner import RunnerConfig
from arpo.policy.engine import EngineConfig
from arpo.policy.tiny import build_tiny_model
from arpo.record import Status


def test_an_openai_engine_runs_an_episode_on_a_simulated_desktop(tmp_path: Path) -> None:
    import json

    from arpo_envs.sim.server import SimConfig, start_servers
    from arpo_envs.sim.tasks import generate_tasks
    from transformers import AutoTokenizer

    from arpo.policy.engine_openai import OpenAIEngine

    model = build_tiny_model(tmp_path / "tiny", seed=0)
    tok = AutoTokenizer.from_pretrained(model)
    answer = [
        *tok.encode("Thought: done.\nAction: finished()"),
        tok.convert_tokens_to_ids("<|im_end|>"),
    ]
    prompts: list[list[int]] = []

    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(model)
    image_pad = tok.convert_tokens_to_ids("<|image_pad|>")

    def expand(ids: list[int], parts: list[dict]) -> list[int]:
        """What a vLLM server does: each image's one placeholder -> its image tokens."""
        import base64
        import io

        from PIL import Image

        counts = []
        for p in parts:
            png = base64.b64decode(p["url"].split(",", 1)[1])
            grid = proc.image_processor(images=[Image.open(io.BytesIO(png))])["image_grid_thw"]
            counts.append(int(grid[0].prod()) // 4)
        out: list[int] = []
        for t in ids:
            out += [image_pad] * counts.pop(0) if t == image_pad else [t]
        return out

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        body["token_ids"] = expand(body["token_ids"], body.get("content_parts", []))
        prompts.append(body["token_ids"])
        lps = [{"logprob": -0.1} for _ in answer]
        return web.json_response({"prompt_token_ids": body["token_ids"],
                                  "choices": [{"token_ids": answer, "logprobs": {"content": lps}}]})  # fmt: skip

    async def run() -> object:
        app = web.Application()
        app.router.add_post("/inference/v1/generate", generate)
        api = web.AppRunner(app)
        await api.setup()
        site = web.TCPSite(api, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        sims, (url,) = await start_servers([SimConfig(port=0)])
        task = generate_tasks("click_button", 1, seed=1)[0]
        grant = wire.Grant("g/0/1", task["id"], "g", 0, 0, json.dumps(task))
        env = Environment(0, url, RunnerConfig(reset_before_setup=True, sleep_scale=0.0,
                                               evaluator="own"))  # fmt: skip
        cfg = EngineConfig(kind="openai", model=str(model), base_url=f"http://127.0.0.1:{port}")
        try:
            async with OpenAIEngine(cfg) as engine:
                return await run_episode(env, grant, engine, EpisodeConfig(max_steps=3),
                                         actor_id="a")  # fmt: skip
        finally:
            await env.close()
            for r in sims:
                await r.cleanup()
            await api.cleanup()

    traj = asyncio.run(run())
    assert traj is not None, "the episode was abandoned"
    assert traj.status == Status.OK and traj.steps == 1 and traj.turns[0].action == "DONE"
    assert prompts and prompts[0].count(image_pad) > 0  # the screenshot went into the prompt
    assert list(traj.turns[0].response_ids) == answer

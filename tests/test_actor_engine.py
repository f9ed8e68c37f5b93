"""The actor with the real policy engine: the tiny Qwen2.5-VL through transformers.

Random weights do not solve tasks (their responses rarely parse: format reward -1),
but everything else is the production path: the processor's tokenizer and image
bounds build the prompt, the engine samples token ids + log-probs, the record carries
them, and a weights push from the learner (a safetensors stream over the control link)
reaches the engine between requests and shows in the per-turn policy versions.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_actor import Learner, async_wait_for, sim_tasks

from arpo.actor.actor import Actor
from arpo.actor.config import ActorConfig
from arpo.actor.episode import EpisodeConfig
from arpo.policy.engine import EngineConfig
from arpo.policy.tiny import build_tiny_model
from arpo.record import Status
from arpo.service.grants import GrantConfig


def _state_dict_stream(folder: Path) -> bytes:
    """What a learner publishes: its model's state dict as one safetensors stream."""
    import safetensors.torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder)
    return safetensors.torch.save(
        {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    )


def test_actor_runs_the_tiny_model_and_applies_pushed_weights(tmp_path: Path) -> None:
    tiny = build_tiny_model(tmp_path / "tiny", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=5)
    stream = _state_dict_stream(other)
    lr = Learner(
        sim_tasks(per_family=1, families=["click_button", "type_submit"]),
        GrantConfig(group_size=2, groups_per_step=2, max_staleness=4),
        tmp_path,
    )
    try:
        cfg = ActorConfig(
            sim_envs=2,
            policy="engine",
            engine=EngineConfig(kind="hf", model=str(tiny), max_batch_size=4),
            spool_dir=str(tmp_path / "spool"),
            transport=lr.transport(heartbeat_s=0.2),
            episode=EpisodeConfig(max_steps=3, max_new_tokens=16),
            progress_s=0,
        )

        async def go() -> Actor:
            actor = Actor(cfg)
            run = asyncio.create_task(actor.run())
            alive = lambda: not run.done()  # noqa: E731  (a failed actor fails the test at once)
            await async_wait_for(lambda: lr.stored() >= 2 or not alive(), "version 0", 600)
            await asyncio.to_thread(lr.grants.publish_weights, 1, stream)
            await async_wait_for(lambda: actor.version == 1 or not alive(), "the weights", 600)
            n = lr.stored()
            await async_wait_for(lambda: lr.stored() >= n + 2 or not alive(), "version 1", 600)
            assert alive() and not actor.failed
            actor.stop()
            await asyncio.wait_for(run, 600)
            return actor

        actor = asyncio.run(go())
        trajs = lr.drain()
    finally:
        lr.close()
    assert not actor.failed and actor.stats.episodes >= 4
    vocab = 2000
    for tr in trajs:
        assert tr.status == Status.OK and 1 <= tr.steps <= 3
        for t in tr.turns:
            assert 0 < len(t.response_ids) <= 16 and int(t.response_ids.max()) < vocab
            assert np.isfinite(t.logprobs).all() and (t.logprobs <= 0).all()
        if tr.format_reward == -1.0:
            assert not tr.turns[-1].parsed and tr.reward == tr.checker_score - 0.5
    versions = {t.policy_version for tr in trajs for t in tr.turns}
    assert versions == {0, 1}

"""The actor with the real policy engine: the tiny Qwen2.5-VL through transformers.

Random weights do not solve tasks (their responses rarely parse: format reward -1),
but everything else is the production path: the processor's tokenizer and image
bounds build the prompt, the engine samples token ids + log-probs, the record carries
them, and a weights push from the learner (a safetensors stream over the control link)
reaches the engine between requests and shows in the per-turn policy versions.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

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


class _StrayPlaceholderFirst:
    """The real engine, except that each episode's first response (one screenshot in the
    prompt) is a parseable click with an <|image_pad|> token in its thought, as a weakly
    trained policy samples now and then. Later turns go to the engine unchanged."""

    def __init__(self, engine: Any, tokenizer: Any) -> None:
        self.engine = engine
        self.pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        enc = lambda t: tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
        self.ids = np.asarray(
            [*enc("Thought: the "), self.pad, *enc(" button.\nAction: click(start_box='(5,5)')"),
             tokenizer.convert_tokens_to_ids("<|im_end|>")],
            np.int32,
        )  # fmt: skip
        self.text = tokenizer.decode(self.ids[:-1].tolist(), skip_special_tokens=True)

    @property
    def processor(self) -> Any:  # the engine's, once started
        return self.engine.processor

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate(self, ids: Any, images: Any, params: Any) -> Any:
        comp = await self.engine.generate(ids, images, params)
        if len(images) > 1:
            return comp
        lp = np.full(len(self.ids), -1.0, np.float32)
        return replace(comp, token_ids=self.ids, logprobs=lp, text=self.text, finish_reason="stop")


def test_a_sampled_image_placeholder_ends_the_episode_as_a_parse_failure(tmp_path: Path) -> None:
    """A parseable response holding <|image_pad|>: the next prompt could not hold it
    without a screenshot (the engine refuses that prompt, and the episode was abandoned,
    its grant held until the learner's re-issue timeout). The episode now ends at that
    turn as on an unparsable response and is delivered."""
    from transformers import AutoTokenizer

    from arpo.policy.engines import make_engine

    tiny = build_tiny_model(tmp_path / "tiny", seed=0)
    tok = AutoTokenizer.from_pretrained(tiny)
    lr = Learner(
        sim_tasks(per_family=1, families=["click_button", "type_submit"]),
        GrantConfig(group_size=2, groups_per_step=2, max_staleness=0),
        tmp_path,
    )
    try:
        engine_cfg = EngineConfig(kind="hf", model=str(tiny), max_batch_size=4)
        cfg = ActorConfig(
            sim_envs=2,
            policy="engine",
            engine=engine_cfg,
            spool_dir=str(tmp_path / "spool"),
            transport=lr.transport(heartbeat_s=0.2),
            episode=EpisodeConfig(max_steps=3, max_new_tokens=8),
            max_episodes=4,
            shutdown_deadline_s=5,
            progress_s=0,
        )
        policy = _StrayPlaceholderFirst(make_engine(engine_cfg), tok)
        actor = Actor(cfg, policy=policy)
        asyncio.run(asyncio.wait_for(actor.run(), 600))
        trajs = lr.drain()
    finally:
        lr.close()
    assert not actor.failed and actor.stats.abandoned == 0
    assert len(trajs) == 4 and len({t.trajectory_id for t in trajs}) == 4
    for tr in trajs:
        assert tr.status == Status.OK and tr.steps == 1
        assert tr.format_reward == -1.0 and not tr.turns[0].parsed
        assert tr.turns[0].response_ids.tolist() == policy.ids.tolist()

"""The shared policy engine (`arpo-engine`, arpo/policy/engine_server.py) and its client
(`engine.kind=shared`, arpo/policy/engine_shared.py): the tiny Qwen2.5-VL through
transformers behind a real HTTP server, the learner's real control link (a `GrantServer`
publishing weights over ZeroMQ), real actors on simulated desktops.

- Greedy tokens and log-probs through the server equal the in-process engine's.
- Two actors share one server: it loads the learner's new weights once, both actors'
  turns carry the versions the server names, and neither actor fetches weights itself.
- Bad requests get 4xx naming the field and the server keeps serving; without the token
  401; a non-loopback bind without a token is refused.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_actor import Learner, async_wait_for, sim_tasks
from test_actor_engine import _state_dict_stream
from test_policy_engine_hf import prompt

from arpo.actor.actor import Actor
from arpo.actor.config import ActorConfig
from arpo.actor.episode import EpisodeConfig
from arpo.errors import ConfigError
from arpo.policy.engine import EngineConfig, SamplingParams
from arpo.policy.engine_server import EngineServer, EngineServerConfig
from arpo.policy.engine_shared import SCHEMA
from arpo.policy.engines import make_engine
from arpo.policy.tiny import build_tiny_model
from arpo.service.grants import GrantConfig


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", seed=0)


def _server(model: Path, **kw: Any) -> EngineServer:
    engine = EngineConfig(kind="hf", model=str(model), max_batch_size=4)
    return EngineServer(EngineServerConfig(engine=engine, port=0, **kw))


def test_greedy_tokens_and_logprobs_through_the_server_equal_the_engines(tiny: Path) -> None:
    _, ids, images = prompt(tiny, 2)  # two screenshots travel as PNG
    params = SamplingParams(temperature=0.0, max_new_tokens=12)

    async def go() -> tuple[Any, Any, int]:
        server = _server(tiny, follow_learner=False)
        url = await server.start()
        try:
            async with make_engine(EngineConfig(kind="shared", model=str(tiny), base_url=url)) as c:
                remote = await c.generate(ids, images, params)
                version = await c.refresh_version()
        finally:
            await server.close()
        async with make_engine(EngineConfig(kind="hf", model=str(tiny))) as local_engine:
            local = await local_engine.generate(ids, images, params)
        return remote, local, version

    remote, local, version = asyncio.run(go())
    assert len(remote.token_ids) > 0
    assert remote.token_ids.tolist() == local.token_ids.tolist()
    np.testing.assert_allclose(remote.logprobs, local.logprobs, rtol=1e-5, atol=1e-5)
    assert remote.text == local.text and remote.policy_version == 0 and version == 0


def test_two_actors_share_one_server_that_loads_each_version_once(tmp_path: Path) -> None:
    tiny = build_tiny_model(tmp_path / "tiny", seed=0)
    stream = _state_dict_stream(build_tiny_model(tmp_path / "other", seed=5))
    lr = Learner(
        sim_tasks(per_family=1, families=["click_button", "type_submit"]),
        GrantConfig(group_size=2, groups_per_step=2, max_staleness=4),
        tmp_path,
    )
    try:

        async def go() -> tuple[list[Actor], EngineServer]:
            server = _server(tiny, transport=lr.transport(heartbeat_s=0.2), poll_s=0.2)
            url = await server.start()
            actors = [
                Actor(
                    ActorConfig(
                        actor_id=f"actor-{i}",
                        sim_envs=1,
                        policy="engine",
                        engine=EngineConfig(kind="shared", model=str(tiny), base_url=url),
                        spool_dir=str(tmp_path / f"spool-{i}"),
                        transport=lr.transport(heartbeat_s=0.2),
                        episode=EpisodeConfig(max_steps=2, max_new_tokens=12),
                        progress_s=0,
                    )
                )
                for i in range(2)
            ]
            runs = [asyncio.create_task(a.run()) for a in actors]
            alive = lambda: not any(r.done() for r in runs)  # noqa: E731
            try:
                await async_wait_for(lambda: lr.stored() >= 2 or not alive(), "v0 episodes", 300)
                requests_before = lr.grants.weight_requests
                await asyncio.to_thread(lr.grants.publish_weights, 1, stream)
                await async_wait_for(
                    lambda: server.engine.policy_version == 1 or not alive(), "the load", 300
                )
                n = lr.stored()
                await async_wait_for(lambda: lr.stored() >= n + 4 or not alive(), "v1", 300)
                assert alive(), [r.exception() for r in runs if r.done()]
                # one announcement and one chunk per weights fetch: the server's only
                assert lr.grants.weight_requests - requests_before <= 4
            finally:
                for a in actors:
                    a.stop()
                await asyncio.wait_for(asyncio.gather(*runs), 300)
                await server.close()
            return actors, server

        actors, server = asyncio.run(go())
        trajs = lr.drain()
    finally:
        lr.close()
    assert server.loads == 1 and not any(a.failed for a in actors)
    by_actor = {tr.actor_id for tr in trajs}
    assert by_actor == {"actor-0", "actor-1"}
    versions = {t.policy_version for tr in trajs for t in tr.turns}
    assert versions == {0, 1}
    assert all(a.version == 1 for a in actors)


def test_bad_requests_name_the_field_and_the_server_keeps_serving(tiny: Path) -> None:
    import aiohttp

    async def go() -> list[tuple[int, str]]:
        server = _server(tiny, follow_learner=False, token="s3cret-token")
        url = await server.start()
        good = {"schema": SCHEMA, "token_ids": [1, 2, 3], "images": [],
                "sampling": {"temperature": 0.0, "max_new_tokens": 2}}  # fmt: skip
        bodies: list[Any] = [
            {**good, "schema": SCHEMA + 1},
            {**good, "token_ids": ["a"]},
            {**good, "images": ["not base64!"]},
            {**good, "sampling": {"temperature": -1}},
            {**good, "sampling": {"top_k": 3}},
            {k: v for k, v in good.items() if k != "sampling"},
            "[1, 2",
        ]
        out = []
        auth = {"Authorization": "Bearer s3cret-token"}
        try:
            async with aiohttp.ClientSession() as s:
                for b in bodies:
                    data = b if isinstance(b, str) else json.dumps(b)
                    async with s.post(url + "/v1/generate", data=data, headers=auth) as r:
                        out.append((r.status, (await r.json())["message"]))
                async with s.post(url + "/v1/generate", data=json.dumps(good)) as r:
                    out.append((r.status, (await r.json())["message"]))
                async with s.post(url + "/v1/generate", data=json.dumps(good), headers=auth) as r:
                    body = await r.json()
                    out.append((r.status, str(body.get("policy_version"))))
        finally:
            await server.close()
        return out

    out = asyncio.run(go())
    assert [s for s, _ in out] == [400] * 7 + [401, 200], out
    for (_, message), word in zip(
        out,
        ["schema", "token_ids", "images[0]", "temperature", "top_k", "sampling", "JSON"],
        strict=False,
    ):
        assert word in message, (word, message)
    assert out[-1][1] == "0"


def test_an_open_bind_without_a_token_is_refused_and_the_config_names_bad_fields(
    tiny: Path,
) -> None:
    with pytest.raises(ValueError, match="without a token"):
        asyncio.run(_server(tiny, host="0.0.0.0", follow_learner=False).start())
    from arpo.config import validate

    for field, cfg in (
        ("engine.kind", EngineServerConfig(engine=EngineConfig(kind="shared", model="m"))),
        ("engine.model", EngineServerConfig()),
        ("poll_s", EngineServerConfig(engine=EngineConfig(model="m"), poll_s=-1)),
    ):
        with pytest.raises(ConfigError, match=field):
            validate(cfg)


def test_arpo_train_refuses_shared_servers_of_an_engine_that_is_a_client() -> None:
    from dataclasses import replace

    from arpo.config import validate
    from arpo.train.config import TrainConfig

    base = TrainConfig(run_dir="x")
    cfg = replace(base, cluster=replace(base.cluster, address="auto", engines="shared"))
    validate(cfg)  # the default transformers engine runs in a server
    for kind in ("openai", "shared"):
        bad = replace(cfg, actor=replace(cfg.actor, engine=replace(cfg.actor.engine, kind=kind)))
        with pytest.raises(ConfigError, match=r"actor\.engine\.kind"):
            validate(bad)

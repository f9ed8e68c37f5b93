"""Every model family the policy layer runs (Qwen2.5-VL, Qwen3-VL, SmolVLM), with its tiny model:
the actor's image rule and the processor agree, the engine's behaviour log-probs equal the
learner's token for token at policy version 0 (batched episodes, prefix cache on), SFT moves
the weights, and a folder of another family is refused naming its model_type."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from arpo import store_item, wire  # noqa: E402
from arpo.learner.batch import build_sequence, check_item  # noqa: E402
from arpo.learner.trainer import Trainer, TrainerConfig  # noqa: E402
from arpo.policy.engine import EngineConfig, SamplingParams  # noqa: E402
from arpo.policy.engines import make_engine  # noqa: E402
from arpo.policy.family import (  # noqa: E402
    FAMILIES,
    SUPPORTED_MODEL_TYPES,
    check_folder,
    family_for_processor,
)
from arpo.policy.prompt import EpisodePrompt, image_rule  # noqa: E402
from arpo.policy.tiny import build_tiny_model  # noqa: E402
from arpo.record import Trajectory, Turn  # noqa: E402
from arpo.synthetic import screenshot_png  # noqa: E402

FAMILY_NAMES = list(FAMILIES)


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family_dir(request, tmp_path_factory):
    return request.param, build_tiny_model(
        tmp_path_factory.mktemp(request.param) / "m", seed=0, family=request.param
    )


def test_the_folder_names_its_family_and_the_image_rule_matches_the_processor(family_dir):
    """The actor's rule (`ImageRule.tokens`) gives the image-token count the learner's
    processor gives, for every screen size, in (width, height) order on both sides."""
    from PIL import Image
    from transformers import AutoProcessor

    name, folder = family_dir
    assert check_folder(folder).name == name
    proc = AutoProcessor.from_pretrained(folder)
    fam = family_for_processor(proc)
    assert fam.name == name
    rule = image_rule(proc)
    sizes = [(1920, 1080), (1280, 720), (640, 480), (300, 200), (1000, 1000), (800, 1280)]
    images = [Image.new("RGB", s, (i * 40, 0, 0)) for i, s in enumerate(sizes)]
    _, counts, _ = fam.encode_images(proc, images)
    assert counts == [rule.tokens(w, h) for w, h in sizes]
    if rule.kind == "grid":
        grid = proc.image_processor(images=images, return_tensors="pt")["image_grid_thw"]
        shown = [rule.shown_size(w, h) for w, h in sizes]
        patch = proc.image_processor.patch_size
        assert [(int(g[2]) * patch, int(g[1]) * patch) for g in grid] == shown


def _episodes(folder, proc, n_episodes=2, turns=3):
    """`n_episodes` concurrent episodes sampled by the transformers engine (batched,
    prefix cache on), stored through the wire codec."""
    rng = np.random.default_rng(3)
    sizes = ((640, 360), (400, 300), (1920, 1080))

    async def run():
        cfg = EngineConfig(kind="hf", model=str(folder), batch_wait_ms=50, prefix_cache_tokens=8192)
        async with make_engine(cfg) as engine:

            async def one(e):
                ep = EpisodePrompt.from_processor(proc, f"open the settings {e}")
                out = []
                for t in range(turns):
                    png = screenshot_png(rng, *sizes[(t + e) % len(sizes)])
                    ids = ep.add_screenshot(png)
                    ctx, images = ep.model_input()
                    c = await engine.generate(
                        ctx,
                        images,
                        SamplingParams(temperature=1.0, max_new_tokens=10, seed=t + 7 * e),
                    )
                    ep.add_response(c.token_ids)
                    out.append(Turn(ids, png, c.token_ids, c.logprobs, 0, "WAIT"))
                return Trajectory(f"t{e}", tuple(out), 0.0)

            trajs = await asyncio.gather(*(one(e) for e in range(n_episodes)))
            return trajs, dict(engine.stats)

    return asyncio.run(run())


def test_behaviour_logprobs_equal_the_learners_at_version_0(family_dir):
    _, folder = family_dir
    trainer = Trainer(TrainerConfig(model=str(folder), lr=1e-3))
    proc = trainer.processor
    trajs, stats = _episodes(folder, proc)
    assert stats["batches"] < stats["requests"], "the episodes were never batched together"
    assert stats["prefix_hits"] > 0, "no turn reused the previous turn's cache"
    vocab = len(proc.tokenizer)
    seqs = []
    for traj in trajs:
        item = store_item.to_item(wire.decode(wire.encode(traj)))
        assert check_item(item, proc, trainer.image_token_id, vocab) is None
        seqs.append((build_sequence(item, proc, trainer.image_token_id, traj.trajectory_id), item))
    # Scored together (one right-padded micro-batch) and each alone.
    together = trainer.proximal([s for s, _ in seqs])
    for (seq, item), lp in zip(seqs, together, strict=True):
        np.testing.assert_allclose(lp.numpy(), item.logprobs, atol=1e-4, rtol=0)
        (alone,) = trainer.proximal([seq])
        np.testing.assert_allclose(alone.numpy(), item.logprobs, atol=1e-4, rtol=0)


def test_a_folder_of_another_family_is_refused_naming_its_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava_next"}))
    with pytest.raises(ValueError, match="llava_next") as e:
        check_folder(tmp_path)
    for t in SUPPORTED_MODEL_TYPES:
        assert t in str(e.value)
    with pytest.raises(ValueError, match=r"no config\.json"):
        check_folder(tmp_path / "missing")


# The two runs below cost a minute each; the default run keeps SmolVLM's (the family that
# differs most: its chat, image block and positions), `make test-all` runs Qwen3-VL's too.
# Qwen2.5-VL's: tests/test_sft.py, tests/test_demo_config.py, tests/test_policy_engine_vllm.py.
HEAVY = [pytest.param("qwen3_vl", marks=pytest.mark.slow), "smolvlm"]
# vLLM against the learner per family (40 s each) runs in `make test-all`; the default run
# holds Qwen2.5-VL's (tests/test_policy_engine_vllm.py).
VLLM_FAMILIES = [pytest.param(n, marks=pytest.mark.slow) for n in ("qwen3_vl", "smolvlm")]


@pytest.mark.parametrize("name", HEAVY)
def test_sft_then_a_short_arpo_train_with_each_family(name, tmp_path):
    """`arpo sft` on oracle demonstrations lowers the NLL, then `arpo train` from its folder
    runs real actor and learner processes for 2 iterations: every trajectory accounted for,
    the policy version advanced, the weights it published differ from the warm start's."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    from arpo.learner.metrics import read_metrics

    folder = build_tiny_model(tmp_path / "tiny", seed=0, family=name)
    sft = tmp_path / "sft"
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "arpo.cli", *a], cwd=tmp_path, capture_output=True, text=True,
        timeout=600, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
    )  # fmt: skip
    p = run("sft", f"model={folder}", f"out={sft}", 'families=["click_button"]', "per_family=3",
            "task_seed=5", "epochs=4", "batch_size=3", "micro_batch=3", "lr=1e-3", "n_envs=2")  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["nll_after"] < summary["nll_before"], summary
    assert check_folder(sft).name == name
    p = run("train", "run_dir=run", f"model={sft}", "learner.iterations=2",
            "eval_runs_per_task=0", "prefill_runs_per_task=0", "progress_s=0")  # fmt: skip
    assert p.returncode == 0, p.stderr[-6000:]
    out = json.loads((tmp_path / "run" / "summary.json").read_text())
    acc = out["accounting"]
    assert acc["unaccounted"] == 0 and acc["trained_twice"] == 0 and acc["trained"] > 0, acc
    rows = read_metrics(tmp_path / "run" / "learner" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["charts/policy_version"] >= 2
    ckpts = sorted((tmp_path / "run" / "learner" / "checkpoints").glob("ckpt-*"))
    assert ckpts and check_folder(ckpts[-1] / "model").name == name
    before = {}
    for f in sft.glob("*.safetensors"):
        before.update(load_file(f))
    after = {}
    for f in (ckpts[-1] / "model").glob("*.safetensors"):
        after.update(load_file(f))
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before), "training changed nothing"


def test_arpo_train_refuses_a_model_of_another_family_at_start(tmp_path):
    import subprocess
    import sys

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llava_next"}))
    p = subprocess.run(
        [sys.executable, "-m", "arpo.cli", "train", "run_dir=run", f"model={folder}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "llava_next" in p.stderr and "qwen3_vl" in p.stderr and "model" in p.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


def _vllm_episode(folder, proc):
    from arpo.synthetic import screenshot_png

    rng = np.random.default_rng(0)

    async def run():
        cfg = EngineConfig(kind="vllm", model=str(folder), dtype="float32", max_model_len=4096)
        async with make_engine(cfg) as engine:
            ep = EpisodePrompt.from_processor(proc, "open the settings")
            turns = []
            for t, (w, h) in enumerate([(640, 360), (1920, 1080)]):
                png = screenshot_png(rng, w, h)
                ids = ep.add_screenshot(png)
                ctx, images = ep.model_input()
                c = await engine.generate(
                    ctx, images, SamplingParams(temperature=1.0, max_new_tokens=12, seed=t)
                )
                ep.add_response(c.token_ids)
                turns.append(Turn(ids, png, c.token_ids, c.logprobs, 0, "WAIT"))
            return Trajectory("v", tuple(turns), 0.0)

    return asyncio.run(run())


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("name", VLLM_FAMILIES)
def test_vllm_behaviour_logprobs_equal_the_learners(name, tmp_path):
    """vLLM's CPU build serves the family from the same folder; the token prompt's image
    blocks go as vLLM's placeholders (`Family.placeholder_prompt`) and the log-probs of what
    it sampled equal the learner's (Qwen2.5-VL: tests/test_policy_engine_vllm.py)."""
    from arpo.policy.engine_vllm import vllm_available

    if (why := vllm_available()) is not None:
        pytest.skip(why)
    folder = build_tiny_model(tmp_path / "tiny", seed=0, family=name)
    trainer = Trainer(TrainerConfig(model=str(folder)))
    proc = trainer.processor
    traj = _vllm_episode(folder, proc)
    item = store_item.to_item(wire.decode(wire.encode(traj)))
    (lp,) = trainer.proximal([build_sequence(item, proc, trainer.image_token_id)])
    np.testing.assert_allclose(lp.numpy(), item.logprobs, atol=1e-4, rtol=0)


def test_the_shared_engine_serves_each_family_as_the_engine_in_process(family_dir):
    """An `arpo-engine` server (transformers) and its client (`engine.kind=shared`) give
    each family's greedy tokens and log-probs exactly as the engine in process does, for a
    prompt with a screenshot built by the family's own prompt rules."""
    from transformers import AutoProcessor

    from arpo.policy.engine_server import EngineServer, EngineServerConfig

    name, folder = family_dir
    proc = AutoProcessor.from_pretrained(folder)
    ep = EpisodePrompt.from_processor(proc, "open the settings")
    ep.add_screenshot(screenshot_png(np.random.default_rng(5), 640, 360))
    ids, images = ep.model_input()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)

    async def run():
        engine = EngineConfig(kind="hf", model=str(folder))
        server = EngineServer(EngineServerConfig(engine=engine, port=0, follow_learner=False))
        url = await server.start()
        try:
            client = EngineConfig(kind="shared", model=str(folder), base_url=url)
            async with make_engine(client) as shared:
                remote = await shared.generate(ids, images, greedy)
        finally:
            await server.close()
        async with make_engine(engine) as local:
            return remote, await local.generate(ids, images, greedy)

    remote, local = asyncio.run(run())
    assert len(remote.token_ids) > 0, name
    assert remote.token_ids.tolist() == local.token_ids.tolist(), name
    np.testing.assert_allclose(remote.logprobs, local.logprobs, rtol=1e-5, atol=1e-5)


def test_train_layers_trains_only_the_decoders_last_layers(family_dir):
    """`learner.trainer.train_layers=1`: a learner step moves the text decoder's last layer
    and final norm, and no other weight (embeddings, head, vision encoder, lower layers);
    more layers than the decoder has is a ConfigError naming the field."""
    from arpo.config import ConfigError
    from arpo.learner.assemble import Sample
    from arpo.synthetic import random_response, synthetic_trajectory, with_logprobs

    _, folder = family_dir
    # With activation checkpointing too: the frozen layers' output needs no gradient, and a
    # re-entrant checkpoint would then give the trained layer's weights none.
    trainer = Trainer(
        TrainerConfig(model=str(folder), lr=1e-2, train_layers=1, gradient_checkpointing=True)
    )
    decoder = trainer.base_model.get_decoder()
    last = len(decoder.layers) - 1
    trained = {n for n, p in trainer.base_model.named_parameters() if p.requires_grad}
    assert trained and all(f"layers.{last}." in n or ".norm." in n for n in trained), trained
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == len(trained)
    before = {n: p.detach().clone() for n, p in trainer.base_model.named_parameters()}
    proc, rng, samples = trainer.processor, np.random.default_rng(5), []
    for reward, adv in ((1.0, 1.0), (0.0, -1.0)):
        traj = synthetic_trajectory(
            proc, "open the settings", screenshots=[screenshot_png(rng, 320, 200)],
            responses=[random_response(rng, proc.tokenizer, 8)], reward=reward, task_id="t",
        )  # fmt: skip
        item = store_item.to_item(traj)
        (lp,) = trainer.proximal([build_sequence(item, proc, trainer.image_token_id)])
        item = store_item.to_item(with_logprobs(traj, lp.numpy()))
        samples.append(Sample(item, "t", traj.trajectory_id, reward, reward, 0, adv, False, 0))
    trainer.step(samples)
    moved = {n for n, p in trainer.base_model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and moved <= trained, moved - trained
    assert any(f"layers.{last}." in n for n in moved)
    with pytest.raises(ConfigError, match="train_layers"):
        Trainer(TrainerConfig(model=str(folder), train_layers=last + 2))

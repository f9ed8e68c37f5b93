"""The learner process end to end: real sockets, a real actor process driving simulated desktops
with the tiny model, weights published back to it, checkpoints and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from arpo import store_item  # noqa: E402
from arpo.errors import ConfigError  # noqa: E402
from arpo.learner.assemble import AssembleConfig  # noqa: E402
from arpo.learner.checkpoint import CheckpointConfig, list_checkpoints  # noqa: E402
from arpo.learner.learner import Learner, LearnerConfig  # noqa: E402
from arpo.learner.metrics import MetricsConfig, read_metrics  # noqa: E402
from arpo.learner.trainer import TrainerConfig  # noqa: E402
from arpo.policy.tiny import build_tiny_model  # noqa: E402
from arpo.synthetic import random_response, screenshot_png, synthetic_trajectory  # noqa: E402
from arpo.transport import TransportConfig  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.fixture(scope="module")
def sim_tasks_file(tmp_path_factory) -> Path:
    from arpo_envs.sim.tasks import generate_tasks

    tasks = generate_tasks("click_button", 2, seed=3) + generate_tasks("menu_pick", 2, seed=3)
    p = tmp_path_factory.mktemp("tasks") / "tasks.json"
    p.write_text(json.dumps(tasks))
    return p


def config(tmp_path, tiny_dir, tasks, **kw) -> LearnerConfig:
    base = dict(
        run_dir=str(tmp_path / "run"),
        tasks=str(tasks),
        trainer=TrainerConfig(model=str(tiny_dir), lr=1e-4, micro_batch=2),
        assemble=AssembleConfig(group_size=2, groups_per_step=2, max_staleness=1),
        transport=TransportConfig(data="tcp://127.0.0.1:0", control="tcp://127.0.0.1:0"),
        checkpoint=CheckpointConfig(every=1, keep=3),
        metrics=MetricsConfig(progress_s=0),
    )
    base.update(kw)
    return LearnerConfig(**base)


def actor_args(learner: Learner, tiny_dir: Path, tmp_path: Path, *extra: str) -> list[str]:
    """An `arpo-actor` command: 2 simulated desktops, the tiny model, the learner's links."""
    return [
        sys.executable, "-m", "arpo.actor.cli", "sim_envs=2", "policy='engine'",
        f"engine.model={str(tiny_dir)!r}", "episode.max_steps=2", "episode.max_new_tokens=16",
        f"spool_dir={str(tmp_path / 'spool')!r}", "progress_s=0", *extra,
        f"transport.data={learner.ingest.endpoint!r}",
        f"transport.control={learner.grants.endpoint!r}",
    ]  # fmt: skip


def put_groups(learner: Learner, n_groups: int, seed: int) -> None:
    """Complete groups straight into the learner's store (mixed rewards: no replay)."""
    rng = np.random.default_rng(seed)
    proc = learner.trainer.processor
    for g in range(n_groups):
        for r in (1.0, 0.0):
            traj = synthetic_trajectory(
                proc,
                "do it",
                screenshots=[screenshot_png(rng, 320, 200)],
                responses=[random_response(rng, proc.tokenizer, 8 + g)],
                logprobs=[np.full(8 + g, -3.0, np.float32)],
                reward=r,
                task_id="fixed",
            )
            learner.store.put("fixed", store_item.to_item(traj))


def test_resume_gives_the_same_next_step_and_skips_a_corrupt_checkpoint(
    tmp_path, tiny_dir, sim_tasks_file
):
    cfg = config(tmp_path, tiny_dir, sim_tasks_file, iterations=3,
                 assemble=AssembleConfig(group_size=2, groups_per_step=1, max_staleness=9))  # fmt: skip
    a = Learner(cfg)
    a.setup()
    put_groups(a, 3, seed=1)
    saved: list[int] = []
    save = a.save_checkpoint
    a.save_checkpoint = lambda: saved.append(a.iteration) or save()  # type: ignore[method-assign]
    a.run()
    assert a.iteration == 3 and a.version == 3
    assert [int(p.name[5:]) for p in list_checkpoints(cfg.run_dir + "/checkpoints")] == [1, 2, 3]
    assert saved == [1, 2, 3]  # the last iteration's checkpoint is not written again at the end
    uninterrupted = a.history[2]

    # Resume from iteration 2 (checkpoint 3 removed): the third step is the same.
    import shutil

    shutil.rmtree(Path(cfg.run_dir) / "checkpoints" / "ckpt-00000003")
    b = Learner(config(tmp_path, tiny_dir, sim_tasks_file, iterations=3, resume=True,
                       assemble=AssembleConfig(group_size=2, groups_per_step=1, max_staleness=9)))  # fmt: skip
    b.setup()
    assert b.iteration == 2 and b.version == 2
    b.run()
    assert b.iteration == 3
    for k in ("losses/loss", "losses/grad_norm", "losses/ratio_mean", "data/tokens"):
        assert b.history[0][k] == pytest.approx(uninterrupted[k], rel=1e-5, abs=1e-7), k

    # A corrupt newest checkpoint (a flipped byte in the weights) is skipped: resume from 2.
    weights = next((Path(cfg.run_dir) / "checkpoints" / "ckpt-00000003" / "model").glob(
        "*.safetensors"))  # fmt: skip
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    c = Learner(config(tmp_path, tiny_dir, sim_tasks_file, iterations=2, resume=True))
    c.setup()
    try:
        assert c.iteration == 2
    finally:
        c.close()
    rows = read_metrics(Path(cfg.run_dir) / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 3]

    # Every complete checkpoint corrupt: --resume fails, naming them and how to start
    # fresh on purpose, and leaves the run as it was (no silent restart at iteration 0).
    for ck in list_checkpoints(Path(cfg.run_dir) / "checkpoints"):
        w = next((ck / "model").glob("*.safetensors"))
        data = bytearray(w.read_bytes())
        data[len(data) // 3] ^= 0xFF
        w.write_bytes(bytes(data))
    ledger = (Path(cfg.run_dir) / "trained.log").read_bytes()
    d = Learner(config(tmp_path, tiny_dir, sim_tasks_file, iterations=2, resume=True))
    with pytest.raises(
        ConfigError,
        match=r"none of the 3 complete checkpoint\(s\).*"
        r"ckpt-00000002, ckpt-00000003.*without --resume",
    ):
        d.setup()
    assert (Path(cfg.run_dir) / "trained.log").read_bytes() == ledger


def test_learner_trains_with_a_real_actor_that_applies_published_weights(
    tmp_path, tiny_dir, sim_tasks_file
):
    """The tiny model (random weights) acting on simulated desktops through a real actor
    process; the learner runs 3 iterations, publishing each version; later trajectories were
    sampled with published versions; metrics and checkpoints are on disk; SIGTERM to the
    actor ends it cleanly."""
    cfg = config(
        tmp_path, tiny_dir, sim_tasks_file, iterations=3, checkpoint=CheckpointConfig(every=0)
    )
    learner = Learner(cfg)
    learner.setup()
    versions: list[tuple[int, int]] = []
    complete = learner.ingest._on_trajectory

    def observe(traj):
        versions.append((traj.min_version, learner.version))
        return complete(traj)

    learner.ingest._on_trajectory = observe
    actor_log = tmp_path / "actor.log"
    args = actor_args(learner, tiny_dir, tmp_path)
    with actor_log.open("wb") as out:
        actor = subprocess.Popen(args, stdout=out, stderr=out, env={**os.environ})
    try:
        t0 = time.monotonic()
        learner.run()
        assert time.monotonic() - t0 < 240
    finally:
        actor.send_signal(signal.SIGTERM)
        rc = actor.wait(timeout=120)
    log_text = actor_log.read_text()
    assert rc == 0, log_text[-3000:]
    assert learner.version == 3
    rows = read_metrics(Path(cfg.run_dir) / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["data/groups"] == 2 and r["charts/episodes"] >= 2
        assert r["time/step_s"] > 0 and r["time/publish_s"] >= 0
        assert r["charts/reward_mean"] is not None
    # Batches 2 and 3 were taken and their pixels made while the step before trained
    # (no checkpoint in between), and their steps used those sequences.
    assert [r["data/prefetched"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["time/prefetch_sequences_s"] > 0 for r in rows)
    assert all(r["time/sequences_s"] < r["time/prefetch_sequences_s"] for r in rows[1:])
    assert rows[-1]["data/trained_twice"] == 0
    # The actor's time split arrives with its heartbeats: 2 environments, busy in episodes.
    assert rows[-1]["data/actor_envs"] == 2 and rows[-1]["data/actor_episode_s"] > 0
    # Every trajectory was sampled by a version the learner had published, and the actor
    # moved on to published versions after the first update.
    assert all(0 <= v <= at for v, at in versions)
    assert max(v for v, _ in versions) >= 1, versions
    assert (Path(cfg.run_dir) / "tb").is_dir()
    assert len(list((Path(cfg.run_dir) / "weights").glob("*.safetensors"))) == 2
    assert list_checkpoints(Path(cfg.run_dir) / "checkpoints")


# Slow (28 s): the learner with a real actor applying published weights runs in
# test_learner_trains_with_a_real_actor_that_applies_published_weights.
@pytest.mark.slow
def test_no_episode_starts_with_weights_older_than_its_grant(tmp_path, tiny_dir, sim_tasks_file):
    """Staleness control end to end: a real actor process whose weight transfer is slowed
    down (1 s per version) and a synchronous learner (max_staleness 0). Every grant carries
    the learner's version as its minimum; the actor fetches those weights before it starts
    the episode, so no trajectory is older than its grant and none is dropped as stale."""
    cfg = config(tmp_path, tiny_dir, sim_tasks_file, iterations=4,
                 assemble=AssembleConfig(group_size=2, groups_per_step=2, max_staleness=0))  # fmt: skip
    learner = Learner(cfg)
    learner.setup()
    book = learner.grants.book
    issued: dict[tuple[str, int], list[int]] = {}
    request = book.request

    def recording_request(*a, **kw):
        grants = request(*a, **kw)
        for g in grants:
            assert g.min_version == g.version and g.temperature == 1.0 and g.top_p == 1.0
            issued.setdefault((g.group, g.slot), []).append(g.min_version)
        return grants

    book.request = recording_request
    seen: list[tuple[str, int, int]] = []
    complete = learner.ingest._on_trajectory

    def observe(traj):
        seen.append((traj.group_id, traj.slot, traj.min_version))
        return complete(traj)

    learner.ingest._on_trajectory = observe
    actor_log = tmp_path / "actor.log"
    args = actor_args(learner, tiny_dir, tmp_path, "weights_delay_s=1.0")
    with actor_log.open("wb") as out:
        actor = subprocess.Popen(args, stdout=out, stderr=out, env={**os.environ})
    try:
        learner.run()
    finally:
        actor.send_signal(signal.SIGTERM)
        rc = actor.wait(timeout=120)
    log_text = actor_log.read_text()
    assert rc == 0, log_text[-3000:]
    assert learner.version == 4
    assert learner.assembler.totals["data/dropped_stale"] == 0
    assert seen and all(v >= min(issued[(g, s)]) for g, s, v in seen), (seen, issued)
    assert max(v for *_, v in seen) >= 3  # the actor followed the learner's versions
    import re

    waits = re.search(r"(\d+) grants waited for newer policy weights", log_text)
    assert waits and int(waits.group(1)) >= 3, log_text[-3000:]


@pytest.mark.slow
def test_a_slow_learner_trains_trajectories_up_to_the_staleness_bound(
    tmp_path, tiny_dir, sim_tasks_file
):
    """A learner slower than its actor (here as a large model's is, `step_delay_s` on each
    step; the tiny model's actor is faster anyway): the actor runs ahead to the admission
    bound, and the trained trajectories are as stale as max_staleness allows, never staler.
    The experiment's heavy-staleness arms run this way."""
    cfg = config(tmp_path, tiny_dir, sim_tasks_file, iterations=5, step_delay_s=1.0,
                 assemble=AssembleConfig(group_size=2, groups_per_step=2, max_staleness=2))  # fmt: skip
    learner = Learner(cfg)
    learner.setup()
    actor_log = tmp_path / "actor.log"
    with actor_log.open("wb") as out:
        actor = subprocess.Popen(
            actor_args(learner, tiny_dir, tmp_path), stdout=out, stderr=out, env={**os.environ}
        )
    try:
        learner.run()
    finally:
        actor.send_signal(signal.SIGTERM)
        rc = actor.wait(timeout=120)
    assert rc == 0, actor_log.read_text()[-3000:]
    rows = read_metrics(Path(cfg.run_dir) / "metrics.jsonl")
    assert len(rows) == 5 and all(r["time/step_s"] >= 1.0 for r in rows)
    assert max(r["charts/staleness_max"] for r in rows) == 2
    assert rows[-1]["charts/staleness_mean"] >= 1.5, [r["charts/staleness_mean"] for r in rows]


def test_config_errors_name_the_field(tmp_path, tiny_dir, sim_tasks_file):
    with pytest.raises(ConfigError, match="tasks"):
        Learner(LearnerConfig(trainer=TrainerConfig(model=str(tiny_dir))))
    with pytest.raises(ConfigError, match=r"grants\.group_size"):
        from arpo.service.grants import GrantConfig

        Learner(config(tmp_path, tiny_dir, sim_tasks_file, grants=GrantConfig(group_size=3)))
    with pytest.raises(ConfigError, match=r"grants\.temperature.*trainer\.temperature"):
        Learner(config(tmp_path, tiny_dir, sim_tasks_file, grants=GrantConfig(temperature=0.6)))
    # A nucleus cannot be scored exactly by the learner: refused at start, naming the
    # field and what the actors then do.
    with pytest.raises(ConfigError, match=r"trainer\.top_p.*set trainer\.top_p = 1\.0"):
        Learner(config(tmp_path, tiny_dir, sim_tasks_file,
                       trainer=TrainerConfig(model=str(tiny_dir), top_p=0.9)))  # fmt: skip
    # The learner owns the rollout sampling: `arpo train` refuses an actor that would sample
    # otherwise, naming both fields.
    from dataclasses import replace

    from arpo.config import validate
    from arpo.train import TrainConfig

    base = TrainConfig()
    hot = replace(base.actor, episode=replace(base.actor.episode, temperature=0.6))
    with pytest.raises(
        ConfigError, match=r"actor\.episode\.temperature.*learner\.trainer\.temperature"
    ):
        validate(replace(base, actor=hot))
    same = replace(base.learner, trainer=replace(base.learner.trainer, temperature=0.6))
    assert validate(replace(base, actor=hot, learner=same)).learner.trainer.temperature == 0.6
    sel = tmp_path / "sel.json"
    sel.write_text(json.dumps({"selected": ["nope"], "complete": True, "tasks": {}}))
    learner = Learner(config(tmp_path, tiny_dir, sim_tasks_file, selection=str(sel)))
    with pytest.raises(ConfigError, match="selection"):
        learner.setup()


@pytest.mark.slow
def test_arpo_learner_under_torchrun_trains_with_a_real_actor(tmp_path, tiny_dir, sim_tasks_file):
    """`torchrun --nproc_per_node 2 -m arpo.learner.cli` (gloo, FSDP2): rank 0 binds the
    endpoints, a real actor fills groups, both ranks train, rank 0 writes metrics and a
    checkpoint that a single-process learner resumes from."""
    from arpo_envs.procs import free_ports

    data, control = (f"tcp://127.0.0.1:{p}" for p in free_ports(2))
    run = tmp_path / "run"
    learner_args = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "arpo.learner.cli", f"run_dir={str(run)!r}", f"tasks={str(sim_tasks_file)!r}",
        f"trainer.model={str(tiny_dir)!r}", "iterations=2", "assemble.group_size=2",
        "assemble.groups_per_step=2", "checkpoint.every=1", "metrics.progress_s=0",
        "dist.backend='gloo'", f"transport.data={data!r}", f"transport.control={control!r}",
    ]  # fmt: skip
    actor_args = [
        sys.executable, "-m", "arpo.actor.cli", "sim_envs=2", "policy='engine'",
        f"engine.model={str(tiny_dir)!r}", "episode.max_steps=2", "episode.max_new_tokens=16",
        f"spool_dir={str(tmp_path / 'spool')!r}", "progress_s=0",
        f"transport.data={data!r}", f"transport.control={control!r}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with (tmp_path / "learner.log").open("wb") as lo, (tmp_path / "actor.log").open("wb") as ao:
        learner = subprocess.Popen(learner_args, stdout=lo, stderr=lo, env=env)
        actor = subprocess.Popen(actor_args, stdout=ao, stderr=ao, env=env)
        try:
            rc = learner.wait(timeout=400)
        finally:
            actor.send_signal(signal.SIGTERM)
            actor.wait(timeout=120)
            if learner.poll() is None:
                learner.kill()
    assert rc == 0, (tmp_path / "learner.log").read_text()[-5000:]
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["data/groups"] == 2 for r in rows)
    # A single process resumes from the 2-rank checkpoint (full weights and optimizer state).
    b = Learner(config(tmp_path, tiny_dir, sim_tasks_file, resume=True, iterations=2))
    b.setup()
    try:
        assert b.iteration == 2 and b.version == 2
    finally:
        b.close()


def test_a_trajectory_the_model_cannot_take_is_dropped_not_fatal(
    tmp_path, tiny_dir, sim_tasks_file
):
    """Records the model cannot take are dropped before scoring, counted, and never stop
    the learner: a response that sampled <|image_pad|> (a random policy does: no pixels
    for it), token ids outside the vocabulary (2e9, -7: an engine with a larger vocabulary,
    or an attacker), a PNG whose data is corrupt (a flipped byte: its chunk CRC fails) and
    a truncated PNG. The learner trains on the rest."""
    cfg = config(tmp_path, tiny_dir, sim_tasks_file, iterations=1,
                 assemble=AssembleConfig(group_size=7, groups_per_step=1, max_staleness=9))  # fmt: skip
    learner = Learner(cfg)
    learner.setup()
    rng = np.random.default_rng(5)
    proc = learner.trainer.processor
    pad = learner.trainer.image_token_id
    for r, bad in ((1.0, ""), (0.0, "pad"), (0.0, ""), (0.0, "huge"), (0.0, "negative"),
                   (0.0, "flipped"), (0.0, "truncated")):  # fmt: skip
        resp = random_response(rng, proc.tokenizer, 8)
        resp[2] = {"pad": pad, "huge": 2_000_000_000, "negative": -7}.get(bad, resp[2])
        png = screenshot_png(rng, 320, 200)
        if bad == "flipped":
            png = png[:300] + bytes([png[300] ^ 0xFF]) + png[301:]
        elif bad == "truncated":
            png = png[: len(png) // 2]
        traj = synthetic_trajectory(proc, "do it", screenshots=[png], responses=[resp],
                                    reward=r, task_id="fixed")  # fmt: skip
        learner.store.put("fixed", store_item.to_item(traj))
    learner.run()
    assert learner.iteration == 1
    row = read_metrics(Path(cfg.run_dir) / "metrics.jsonl")[-1]
    assert row["data/dropped_invalid"] == 5 and row["data/trajectories"] == 2
    assert row["data/loss_tokens"] == 16  # the two good trajectories' 8 + 8 response tokens


def test_resume_falls_back_whatever_finds_the_damage(tmp_path, tiny_dir, sim_tasks_file):
    """A store snapshot that fails its own checksum under a manifest rewritten to match
    (verification on), and a damaged safetensors header with verify=false (sizes only):
    both stopped --resume with SnapshotError; each now falls back to the checkpoint before."""
    import hashlib
    import json as _json

    from arpo.learner.checkpoint import CheckpointConfig as CC

    groups = AssembleConfig(group_size=2, groups_per_step=1, max_staleness=9)
    cfg = config(tmp_path, tiny_dir, sim_tasks_file, iterations=2, assemble=groups)
    a = Learner(cfg)
    a.setup()
    put_groups(a, 2, seed=3)
    a.run()
    a.close()
    newest = Path(cfg.run_dir) / "checkpoints" / "ckpt-00000002"

    def rewrite_manifest(rel: str) -> None:
        man = newest / "MANIFEST.json"
        m = _json.loads(man.read_text())
        f = newest / rel
        m["files"][rel] = {
            "size": f.stat().st_size,
            "sha256": hashlib.sha256(f.read_bytes()).hexdigest(),
        }
        man.write_text(_json.dumps(m))

    snap = newest / "store.snap"
    data = bytearray(snap.read_bytes())
    data[len(data) // 2] ^= 0x01
    snap.write_bytes(bytes(data))
    rewrite_manifest("store.snap")
    b = Learner(config(tmp_path, tiny_dir, sim_tasks_file, iterations=2, resume=True))
    b.setup()
    try:
        assert b.iteration == 1
    finally:
        b.close()

    snap.write_bytes(bytes(data[: len(data) // 2]))  # truncated too, manifest to match
    rewrite_manifest("store.snap")
    weights = next((newest / "model").glob("*.safetensors"))
    w = bytearray(weights.read_bytes())
    w[8:24] = b"{{{{{{{{{{{{{{{{"  # the JSON header
    weights.write_bytes(bytes(w))
    c = Learner(
        config(tmp_path, tiny_dir, sim_tasks_file, iterations=2, resume=True,
               checkpoint=CC(every=1, keep=3, verify=False))
    )  # fmt: skip
    c.setup()
    try:
        assert c.iteration == 1
    finally:
        c.close()

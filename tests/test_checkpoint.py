"""Learner checkpoints with the tiny Qwen2.5-VL, a real AdamW, a real replay store and ingest.

Round trip of every part; `keep`; corrupted, truncated and unfinished checkpoints skipped
in favour of the previous one; a writer killed with SIGKILL mid-save; resume of the store
and the ingest journal so that the acknowledged trajectories come back exactly once.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq
from conftest import make_trajectory
from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

from arpo import store_item, wire
from arpo.buffer import ReplayStore
from arpo.config import validate
from arpo.errors import ConfigError, SnapshotError
from arpo.learner.checkpoint import (
    CheckpointConfig,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
    verify_checkpoint,
)
from arpo.policy.tiny import build_tiny_model
from arpo.service.ingest import Ingest, IngestConfig
from arpo.service.journal import list_segments
from arpo.transport import TransportConfig, connect_dealer

TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.fixture(scope="module")
def trained(tiny_dir: Path):
    """The tiny model after one AdamW step, its optimizer and a scheduler."""
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=10)
    loss = sum((p.float() ** 2).sum() for p in model.parameters())
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    return model, opt, sched


def _items(store: ReplayStore) -> list[str]:
    """Trajectory ids of the fresh items of every task (taken out), sorted."""
    ids = []
    for task in store.tasks():
        n = store.fresh_len(task)
        if n:
            ids += [store_item.from_item(it).trajectory_id for it in store.take_group(task, n, 0)]
    return sorted(ids)


def _save(root: Path, it: int, model, opt, **kw) -> Path:
    return save_checkpoint(
        root, it, model=model, optimizer_state=opt.state_dict(), state={"it": it}, **kw
    )


def test_round_trip(tmp_path: Path, tiny_dir: Path, trained, png_pool: list[bytes]) -> None:
    model, opt, sched = trained
    processor = AutoProcessor.from_pretrained(tiny_dir)
    store = ReplayStore(max_bytes=1 << 30, fresh_capacity=16, seed=0)
    trajs = [
        make_trajectory(np.random.default_rng(i), turns=3, tokens=600, pngs=png_pool)
        for i in range(3)
    ]
    for t in trajs:
        store.put(t.task_id, store_item.to_item(t))
    store.add_success(trajs[0].task_id, store_item.to_item(trajs[0]), priority=2.0)
    seen_log = tmp_path / "seen.log"
    seen_log.write_text("".join(t.trajectory_id + "\n" for t in trajs))
    state = {"version": 7, "tasks": {"task-a": {"success": 0.25, "n": 4}}, "replay_hits": 3}

    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    path = save_checkpoint(
        tmp_path / "ckpt",
        12,
        model=model,
        processor=processor,
        optimizer_state=opt.state_dict(),
        scheduler_state=sched.state_dict(),
        state=state,
        store=store,
        seen_log=seen_log,
    )
    expected = (torch.rand(4), random.random(), np.random.rand(3))
    assert path == tmp_path / "ckpt" / "ckpt-00000012"
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["ckpt-00000012"]  # no leftovers
    manifest = json.loads((path / "MANIFEST.json").read_text())
    assert {"state.json", "trainer.pt", "store.snap", "seen.log", "model/config.json"} <= set(
        manifest["files"]
    )
    assert any(f.endswith(".safetensors") for f in manifest["files"])

    ckpt = load_checkpoint(path)
    assert ckpt.iteration == 12 and ckpt.state == state and ckpt.journal_segment is None
    assert latest_checkpoint(tmp_path / "ckpt") == path

    # The generators continue exactly where they were at the save.
    torch.rand(10), random.random(), np.random.rand(5)
    restore_rng(ckpt.trainer["rng"])
    again = (torch.rand(4), random.random(), np.random.rand(3))
    assert torch.equal(expected[0], again[0]) and expected[1] == again[1]
    np.testing.assert_array_equal(expected[2], again[2])

    # The model loads with from_pretrained and has the trained weights.
    loaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt.model_dir)
    want = model.state_dict()
    got = loaded.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert AutoProcessor.from_pretrained(ckpt.model_dir).tokenizer.get_vocab() == (
        processor.tokenizer.get_vocab()
    )

    # The optimizer and scheduler continue from the same state.
    opt2 = torch.optim.AdamW(loaded.parameters(), lr=1e-3, weight_decay=0.01)
    sched2 = torch.optim.lr_scheduler.LinearLR(opt2, start_factor=0.5, total_iters=10)
    opt2.load_state_dict(ckpt.trainer["optimizer"])
    sched2.load_state_dict(ckpt.trainer["scheduler"])
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for k, st in s1["state"].items():
        for name, v in st.items():
            assert torch.equal(v, s2["state"][k][name]), (k, name)
    assert sched2.state_dict() == sched.state_dict()

    # The store comes back with the same items in both roles; the seen log is a copy.
    restored = ReplayStore.restore(ckpt.store_path)
    assert restored.stats()["total"]["items"] == store.stats()["total"]["items"]
    (success,) = restored.sample(trajs[0].task_id, 1, mode="newest")
    assert store_item.from_item(success) == trajs[0]
    assert _items(restored) == sorted(t.trajectory_id for t in trajs)
    assert ckpt.seen_log is not None and ckpt.seen_log.read_bytes() == seen_log.read_bytes()
    dest = tmp_path / "live" / "seen.log"
    assert ckpt.restore_seen_log(dest) and not ckpt.restore_seen_log(dest)  # live log wins

    # A full state dict handed in (as from FSDP shards) is what gets saved.
    shifted = {k: v + 1.0 for k, v in want.items()}
    p2 = _save(tmp_path / "ckpt", 13, model, opt, model_state=shifted)
    got = Qwen2_5_VLForConditionalGeneration.from_pretrained(p2 / "model").state_dict()
    assert all(torch.equal(shifted[k], got[k]) for k in shifted)
    store.close()
    restored.close()


def test_keep_and_invalid_checkpoints_fall_back(
    tmp_path: Path, trained, caplog: pytest.LogCaptureFixture
) -> None:
    model, opt, _ = trained
    root = tmp_path / "ckpt"
    for it in (1, 2, 3, 4):
        _save(root, it, model, opt, keep=3)
    assert [p.name for p in list_checkpoints(root)] == [f"ckpt-0000000{i}" for i in (2, 3, 4)]
    newest, previous = root / "ckpt-00000004", root / "ckpt-00000003"
    backup = tmp_path / "backup"
    shutil.copytree(newest, backup)

    def broken(what: str) -> None:
        shutil.rmtree(newest)
        shutil.copytree(backup, newest)
        weights = next((newest / "model").glob("*.safetensors"))
        if what == "truncated":
            with weights.open("r+b") as f:
                f.truncate(weights.stat().st_size - 10)
        elif what == "flipped":
            data = bytearray((newest / "trainer.pt").read_bytes())
            data[len(data) // 2] ^= 0x01
            (newest / "trainer.pt").write_bytes(bytes(data))
        elif what == "no manifest":
            (newest / "MANIFEST.json").unlink()
        elif what == "bad manifest":
            (newest / "MANIFEST.json").write_text('{"files": ')
        elif what == "missing file":
            (newest / "state.json").unlink()
        elif what == "escaping path":
            manifest = json.loads((newest / "MANIFEST.json").read_text())
            manifest["files"]["../ckpt-00000003/state.json"] = {"size": 1, "sha256": ""}
            (newest / "MANIFEST.json").write_text(json.dumps(manifest))

    reasons = {
        "truncated": "bytes, the manifest says",
        "flipped": "sha256 differs",
        "no manifest": "not completed",
        "bad manifest": "unreadable",
        "missing file": "state.json: missing",
        "escaping path": "outside the folder",
    }
    for what, reason in reasons.items():
        broken(what)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="arpo.learner.checkpoint"):
            assert latest_checkpoint(root) == previous, what
        assert reason in caplog.text and "ckpt-00000004" in caplog.text, (what, caplog.text)
        with pytest.raises(SnapshotError, match=reason):
            verify_checkpoint(newest)
    # Without hashing a flipped byte goes unseen (sizes only): the documented trade-off.
    broken("flipped")
    assert latest_checkpoint(root, verify=False) == newest
    assert latest_checkpoint(root) == previous
    assert load_checkpoint(previous).state == {"it": 3}

    # Nothing valid at all: None.
    for p in list_checkpoints(root):
        (p / "MANIFEST.json").unlink()
    assert latest_checkpoint(root) is None and latest_checkpoint(tmp_path / "nothing") is None


_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration
    from arpo.learner.checkpoint import save_checkpoint

    root = Path(sys.argv[1])
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(sys.argv[2])
    opt = torch.optim.AdamW(model.parameters())
    save_checkpoint(root, 1, model=model, optimizer_state=opt.state_dict(), state={"it": 1})

    def hang(*args, **kwargs):  # the writer stalls half-way through checkpoint 2
        (root / "hanging").touch()
        time.sleep(600)

    torch.save = hang
    save_checkpoint(root, 2, model=model, optimizer_state=opt.state_dict(), state={"it": 2})
    """
)


def test_writer_killed_mid_save_leaves_the_previous_checkpoint(
    tmp_path: Path, tiny_dir: Path, trained
) -> None:
    root = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(root), str(tiny_dir)], stderr=subprocess.PIPE
    )
    try:
        end = time.monotonic() + TIMEOUT_S
        while not (root / "hanging").exists():
            assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
            assert time.monotonic() < end, "the writer never reached checkpoint 2"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=TIMEOUT_S)
    leftover = root / f".tmp-ckpt-00000002-{proc.pid}"
    assert (leftover / "model" / "config.json").exists()  # it died mid-write
    assert list_checkpoints(root) == [root / "ckpt-00000001"]
    assert latest_checkpoint(root) == root / "ckpt-00000001"
    assert load_checkpoint(root / "ckpt-00000001").state == {"it": 1}

    model, opt, _ = trained
    path = _save(root, 2, model, opt)
    assert not leftover.exists()  # the next save cleans up after the dead writer
    assert latest_checkpoint(root) == path and len(list_checkpoints(root)) == 2


def _deliver(sock: zmq.Socket, trajs) -> None:
    for t in trajs:
        sock.send_multipart(wire.encode(t))
    for _ in trajs:
        assert sock.poll(int(TIMEOUT_S * 1000)), "no ack"
        assert isinstance(wire.decode(sock.recv_multipart()), wire.Ack)


def test_resume_store_seen_ids_and_journal(tmp_path: Path, trained, png_pool: list[bytes]) -> None:
    """Checkpoint with a live ingest, more deliveries, crash, resume: all 10 back, once."""
    model, opt, _ = trained
    root = tmp_path / "ckpt"
    trajs = [
        make_trajectory(
            np.random.default_rng(50 + i), turns=3, tokens=600, pngs=png_pool, task_id=f"t{i % 2}"
        )
        for i in range(10)
    ]
    cfg = IngestConfig(seen_log=str(tmp_path / "seen.log"), journal_dir=str(tmp_path / "j"))
    tc = TransportConfig(data="tcp://127.0.0.1:0")
    ctx = zmq.Context()
    store = ReplayStore(max_bytes=1 << 30, fresh_capacity=64, seed=0)
    ingest = Ingest(store, cfg, tc)
    sock = connect_dealer(ctx, ingest.start(), tc)
    try:
        _deliver(sock, trajs[:6])
        path = _save(root, 1, model, opt, ingest=ingest, keep=2)
        _deliver(sock, trajs[6:])
    finally:
        sock.close(0)
        ingest.stop()  # then dropped without a snapshot: the crash
    del store, ingest
    (tmp_path / "seen.log").unlink()  # and the live seen log is lost too

    ckpt = load_checkpoint(latest_checkpoint(root))
    assert ckpt.path == path and ckpt.journal_segment == 1 and ckpt.seen_log is not None
    store = ReplayStore.restore(ckpt.store_path)
    assert ckpt.restore_seen_log(cfg.seen_log)
    ingest = Ingest(store, cfg, tc)
    assert all(t.trajectory_id in ingest.seen for t in trajs[:6])
    assert ingest.replay_journal(ckpt.journal_segment)["replayed"] == 4
    assert all(t.trajectory_id in ingest.seen for t in trajs)

    # The next checkpoints prune the journal below the oldest kept checkpoint's segment.
    assert list_segments(cfg.journal_dir) == [1, 2]  # the first save pruned segment 0
    p2 = _save(root, 2, model, opt, ingest=ingest, keep=2)
    assert load_checkpoint(p2).journal_segment == 3
    assert list_segments(cfg.journal_dir) == [1, 2, 3]  # ckpt 1 still needs segment 1
    _save(root, 3, model, opt, ingest=ingest, keep=2)
    assert list_segments(cfg.journal_dir) == [3, 4]
    ingest.stop()
    assert _items(store) == sorted(t.trajectory_id for t in trajs)
    store.close()
    ctx.term()


def test_config() -> None:
    cfg = validate(CheckpointConfig(every=5))
    assert [i for i in range(12) if cfg.due(i)] == [5, 10] and cfg.due(7, final=True)
    assert not CheckpointConfig(every=0).due(10)
    for bad in ({"keep": 0}, {"every": -1}, {"dir": ""}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            validate(CheckpointConfig(**bad))

"""Task files travel by content: an actor that cannot see the task folder at all (its own
mount namespace hides it, another working directory) trains on tasks with `upload_file`
steps, the files fetched from the learner by sha256; bytes that do not match their hash
are refused and counted, and their task leaves the run."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from arpo_envs.procs import free_port

pytest.importorskip("torch")
pytest.importorskip("transformers")

from arpo.env.task import load_pool
from arpo.env.taskfiles import BlobCache, FileSource, TaskFiles
from arpo.errors import TaskError
from arpo.learner.metrics import read_metrics
from arpo.policy.tiny import build_tiny_model


def _can_hide_folders() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         "mount -t tmpfs none /mnt"], capture_output=True,
    )  # fmt: skip
    return probe.returncode == 0


def _tasks_with_files(root: Path, n: int) -> dict[str, Path]:
    """`n` simulated tasks whose setup first uploads a file that sits beside the task file."""
    from arpo_envs.sim.tasks import generate_tasks

    files = {}
    for i, t in enumerate(generate_tasks("click_button", n, seed=5)):
        folder = root / "click_button"
        (folder / t["id"]).mkdir(parents=True)
        f = folder / t["id"] / "notes.txt"
        f.write_bytes(f"notes of task {i}: {os.urandom(8).hex()}\n".encode() * (50 + i))
        t["config"].insert(0, {"type": "upload_file", "parameters": {"files": [
            {"local_path": f"{t['id']}/notes.txt", "path": "/home/user/notes.txt"}]}})  # fmt: skip
        (folder / f"{t['id']}.json").write_text(json.dumps(t))
        files[t["id"]] = f
    return files


def test_a_pool_names_its_files_by_content_and_refuses_paths_that_escape(
    tmp_path: Path,
) -> None:
    files = _tasks_with_files(tmp_path / "tasks", 2)
    index = TaskFiles()
    pool = load_pool(tmp_path / "tasks", index)
    for p in pool:
        (entry,) = p.task["config"][0]["parameters"]["files"]
        want = hashlib.sha256(files[p.task["id"]].read_bytes()).hexdigest()
        assert entry["sha256"] == want and entry["size"] == files[p.task["id"]].stat().st_size
        assert not Path(entry["local_path"]).is_absolute()  # no host path in the grant
    assert len(index) == 2
    # served in chunks, checked on arrival, cached by hash
    import asyncio

    src = FileSource.local(index, BlobCache(tmp_path / "cache"))
    (e0,) = pool[0].task["config"][0]["parameters"]["files"]
    from arpo.env.taskfiles import FileRef

    got = asyncio.run(src.path(FileRef(e0["sha256"], e0["size"])))
    assert got.read_bytes() == files[pool[0].task["id"]].read_bytes()
    assert got.parent.parent == tmp_path / "cache" and src.fetched == 1
    # Escapes are refused when the pool is loaded, naming the task and the path.
    outside = tmp_path / "secret.txt"
    outside.write_text("not for the desktop")
    (tmp_path / "tasks" / "click_button" / pool[1].task["id"] / "link.txt").symlink_to(outside)
    for bad in ("../secret.txt", str(outside), f"{pool[1].task['id']}/link.txt"):
        raw = json.loads(Path(pool[1].source).read_text())
        raw["config"][0]["parameters"]["files"][0]["local_path"] = bad
        Path(pool[1].source).write_text(json.dumps(raw))
        with pytest.raises(TaskError, match=pool[1].task["id"]) as e:
            load_pool(tmp_path / "tasks", TaskFiles())
        assert "relative path" in str(e.value) or "leads out" in str(e.value)


@pytest.mark.slow
@pytest.mark.skipif(not _can_hide_folders(), reason="needs unshare --mount (root)")
def test_an_actor_that_cannot_see_the_task_folder_trains_on_upload_tasks(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    files = _tasks_with_files(tasks, 3)
    tampered_id = sorted(files)[0]
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    data, control = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    learner_log = tmp_path / "learner.log"
    learner_cmd = [
        sys.executable, "-m", "arpo.learner.cli", f"trainer.model={model}", f"tasks={tasks}",
        f"run_dir={tmp_path / 'learner'}", "iterations=3", "assemble.group_size=2",
        "assemble.groups_per_step=2", "assemble.max_staleness=3", "stall_s=120",
        f"transport.data={data}", f"transport.control={control}",
    ]  # fmt: skip
    with learner_log.open("wb") as out:
        learner = subprocess.Popen(learner_cmd, stdout=out, stderr=out)
    actor = None
    try:
        end = time.monotonic() + 180
        while "learner up" not in learner_log.read_text():
            assert learner.poll() is None and time.monotonic() < end, learner_log.read_text()
            time.sleep(0.2)
        # The learner hashed the files at load: one of them now changes (same size), so
        # the bytes it serves for that task no longer have the sha256 its grants name.
        f = files[tampered_id]
        f.write_bytes(bytes(b ^ 0x20 for b in f.read_bytes()))
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        cache = tmp_path / "actor-cache"
        actor_cmd = " ".join([
            sys.executable, "-m", "arpo.actor.cli", "actor_id=far-actor", "sim_envs=2",
            f"engine.model={model}", f"transport.data={data}",
            f"transport.control={control}", f"spool_dir={tmp_path / 'spool'}",
            f"file_cache_dir={cache}", "episode.max_steps=2", "episode.max_new_tokens=16",
            "environment.reset_backoff_s=0.2",
        ])  # fmt: skip
        # The task folder is an empty tmpfs for the actor; its working directory elsewhere.
        script = (f"mount -t tmpfs none {tasks} && test -z \"$(ls -A {tasks})\" && "
                  f"cd {elsewhere} && exec {actor_cmd}")  # fmt: skip
        actor_log = tmp_path / "actor.log"
        with actor_log.open("wb") as out:
            actor = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                stdout=out, stderr=out,
            )  # fmt: skip
        assert learner.wait(600) == 0, learner_log.read_text()[-4000:]
    finally:
        if actor is not None and actor.poll() is None:
            actor.send_signal(signal.SIGTERM)
            try:
                actor.wait(60)
            except subprocess.TimeoutExpired:
                actor.kill()
        if learner.poll() is None:
            learner.kill()
    rows = read_metrics(tmp_path / "learner" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    alog = actor_log.read_text()
    # Every untouched file came over the link, checked, into the actor's own cache.
    for tid, f in files.items():
        if tid == tampered_id:
            continue
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        assert BlobCache(cache).get(sha, f.stat().st_size) is not None, (tid, alog[-3000:])
    # The changed file was refused, counted, and its task left the run with the reason.
    assert "refused" in alog and "sha256" in alog
    status = json.loads((tmp_path / "learner" / "tasks_out.json").read_text())
    assert list(status["tasks_out"]) == [tampered_id], status
    assert "sha256" in status["tasks_out"][tampered_id]["reason"]
    trained = (tmp_path / "learner" / "trained.log").read_text()
    assert tampered_id not in trained and trained

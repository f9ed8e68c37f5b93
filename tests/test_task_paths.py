"""A task's paths never reach outside its folders on either evaluator path: an `upload_file`
with an absolute or `..` local_path is refused before anything is sent, a relative one is
read from the task file's folder only (never the actor's working directory), and a getter
whose `dest` is not a plain file name is refused before OSWorld's code writes it
(eval_error)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from arpo.env.client import ClientConfig, EnvClient
from arpo.env.runner import RunnerConfig, TaskRunner
from arpo.env.task import Task
from arpo.errors import FileCacheMiss, TaskError


def _task(config: list, evaluator: dict | None = None, path: str | None = None) -> Task:
    raw = {"id": "t", "instruction": "x", "config": config,
           "evaluator": evaluator or {"func": "infeasible"}}  # fmt: skip
    return Task.from_dict(raw, path=path, domain="d")


def _runner() -> TaskRunner:
    # nothing listens there: a refused path must fail before any request is made
    return TaskRunner(EnvClient(ClientConfig(base_url="http://127.0.0.1:9", max_retries=0)))


@pytest.mark.parametrize("local", ["/etc/passwd", "../../etc/passwd", "a/../../x"])
def test_upload_of_a_host_path_is_refused(local: str, tmp_path: Path) -> None:
    step = {
        "type": "upload_file",
        "parameters": {"files": [{"local_path": local, "path": "/tmp/x"}]},
    }
    runner = _runner()
    runner._task_dir = tmp_path
    with pytest.raises(TaskError, match="relative path inside"):
        asyncio.run(runner.run_steps([_task([step]).config[0]], task_id="t", phase="config"))


def test_a_symlink_out_of_the_task_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "sneaky").symlink_to("/etc/hostname")
    runner = _runner()
    runner._task_dir = tmp_path
    with pytest.raises(TaskError, match="leads out of"):
        runner.upload_source("sneaky")


def test_upload_reads_the_task_folder_only_never_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a relative local_path was tried in the actor's working directory first, so a
    task could hand any file under it (keys, configs) to the desktop."""
    cwd, folder = tmp_path / "actor-cwd", tmp_path / "tasks"
    (cwd / "secrets").mkdir(parents=True)
    (cwd / "secrets" / "key.pem").write_bytes(b"private")
    (folder / "t").mkdir(parents=True)
    (folder / "t" / "in.txt").write_bytes(b"shipped")
    monkeypatch.chdir(cwd)
    runner = _runner()
    runner._task_dir = folder
    assert runner.upload_source("t/in.txt") == (folder / "t" / "in.txt").resolve()
    with pytest.raises(FileCacheMiss, match="not in the task file's folder"):
        runner.upload_source("secrets/key.pem")  # it is in the cwd, and stays there
    step = {
        "type": "upload_file",
        "parameters": {"files": [{"local_path": "secrets/key.pem", "path": "/tmp/x"}]},
    }
    with pytest.raises(FileCacheMiss):  # nothing sent: nothing listens at the runner's URL
        asyncio.run(runner.run_steps([_task([step]).config[0]], task_id="t", phase="config"))


def test_a_task_without_a_folder_or_a_content_reference_is_a_task_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "in.txt").write_bytes(b"in the cwd")
    monkeypatch.chdir(tmp_path)
    runner = _runner()
    assert runner._task_dir is None  # a task built in memory (Task.from_dict, no path)
    with pytest.raises(TaskError, match="not read from a file"):
        runner.upload_source("in.txt")
    entry = {"local_path": "in.txt", "path": "/tmp/x"}
    with pytest.raises(TaskError, match="sha256"):
        asyncio.run(runner.upload_path(entry))


def test_osworld_getter_dest_outside_the_cache_is_eval_error(tmp_path: Path) -> None:
    ev = {
        "func": "exact_match",
        "result": {"type": "vm_file", "path": "/etc/hostname", "dest": "../../../tmp/pwned"},
        "expected": {"type": "rule", "rules": {"expected": "x"}},
    }
    task = _task([], ev)

    async def main() -> tuple[str, float, str | None]:
        runner = TaskRunner(
            EnvClient(ClientConfig(base_url="http://127.0.0.1:9", max_retries=0)),
            RunnerConfig(evaluator="own", osworld_probe_timeout_s=0, work_root=tmp_path),
        )
        try:
            return await runner._evaluate_osworld(task, [])
        finally:
            runner.close()

    status, score, error = asyncio.run(main())
    assert (status, score) == ("eval_error", 0.0)
    assert error is not None and "plain file name" in error
    assert not Path("/tmp/pwned").exists()

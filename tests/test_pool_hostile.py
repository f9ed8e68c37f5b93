"""Hostile task pools (`arpo.env.task.load_pool`): every problem is a `TaskError` naming the
file (and the task id), raised at once: a task nested too deeply, a FIFO named *.json (never
opened for a blocking read), a task larger than a grant carries, an id longer than the wire
takes or holding whitespace, a file that is not UTF-8. A folder pool loads the lists of tasks
beside its task files, as a .json pool does, instead of silently skipping them.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from arpo_envs.sim.tasks import generate_tasks

from arpo import cli
from arpo.env.task import (
    MAX_TASK_DEPTH,
    MAX_TASK_ID_BYTES,
    MAX_TASK_JSON_BYTES,
    load_pool,
    pool_problem,
)
from arpo.errors import TaskError
from arpo.wire import MAX_ID_BYTES, MAX_STR_BYTES


def tasks(n: int, seed: int = 5) -> list[dict]:
    return generate_tasks("click_button", n, seed=seed)


def folder_with(tmp_path: Path, **files: object) -> Path:
    """A folder pool: one good task file, plus `files` (name -> JSON value, or bytes/str)."""
    root = tmp_path / "pool"
    root.mkdir()
    (root / "good.json").write_text(json.dumps(tasks(1, seed=99)[0]))
    for name, content in files.items():
        path = root / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif isinstance(content, str):
            path.write_text(content)
        else:
            path.write_text(json.dumps(content))
    return root


def refused(pool: Path) -> str:
    with pytest.raises(TaskError) as e:
        load_pool(pool)
    return str(e.value)


def within(seconds: float, fn, *args):
    """fn(*args) in a thread; fails the test (instead of hanging it) past `seconds`."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # handed to the test below
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn.__name__} blocked for more than {seconds} s"
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["value"]


def test_limits_are_the_wire_s() -> None:
    assert MAX_TASK_JSON_BYTES == MAX_STR_BYTES == 1 << 20
    assert MAX_TASK_ID_BYTES == MAX_ID_BYTES == 1024


def test_a_deeply_nested_task_is_refused_naming_the_file(tmp_path: Path) -> None:
    deep = '{"id": "deep", "instruction": "x", "evaluator": ' + "[" * 100_000 + "]" * 100_000 + "}"
    root = folder_with(tmp_path, **{"d__deep.json": deep})
    message = refused(root)  # the parser's RecursionError, as a TaskError
    assert (
        message
        == f"{root / 'd' / 'deep.json'}: JSON nested too deeply (a task has at most {MAX_TASK_DEPTH} levels)"
    )
    # Deeper than MAX_TASK_DEPTH but within the parser's reach: refused before any walker.
    task = tasks(1)[0]
    task["extra"] = json.loads("[" * 200 + "]" * 200)
    (root / "d" / "deep.json").write_text(json.dumps(task))
    assert refused(root) == (
        f"{root / 'd' / 'deep.json'} (id {task['id']!r}): a task nested 201 levels deep; at most 64"
    )
    task["extra"] = json.loads("[" * 50 + "]" * 50)  # OSWorld's deepest task has 10 levels
    (root / "d" / "deep.json").write_text(json.dumps(task))
    assert len(load_pool(root)) == 2


def test_a_fifo_named_json_is_refused_not_waited_on(tmp_path: Path) -> None:
    root = folder_with(tmp_path)
    os.mkfifo(root / "fifo.json")  # reading it would wait for a writer forever
    message = within(10, pool_problem, root)
    assert message.startswith(f"{root / 'fifo.json'}: not a regular file"), message
    assert within(10, pool_problem, root / "fifo.json").startswith(f"{root / 'fifo.json'}: ")


def test_a_task_larger_than_a_grant_carries_is_refused_naming_it(tmp_path: Path) -> None:
    big = tasks(1)[0]
    big["notes"] = "x" * MAX_TASK_JSON_BYTES  # one task of just over 1 MiB as JSON
    root = folder_with(tmp_path, **{"big.json": big})
    message = refused(root)
    assert message.startswith(f"{root / 'big.json'}: task {big['id']} is "), message
    assert f"a grant carries at most {MAX_TASK_JSON_BYTES}" in message
    big["notes"] = "x" * (MAX_TASK_JSON_BYTES - 4096)  # just under: accepted
    (root / "big.json").write_text(json.dumps(big))
    assert {p.task["id"] for p in load_pool(root)} >= {big["id"]}
    # The same bound for a .json list and a .jsonl pool.
    big["notes"] = "é" * (MAX_TASK_JSON_BYTES // 2 + 1)  # counted in UTF-8 bytes
    jl = tmp_path / "pool.jsonl"
    jl.write_text(json.dumps(tasks(1)[0]) + "\n" + json.dumps(big, ensure_ascii=False) + "\n")
    assert refused(jl).startswith(f"{jl}:2: task {big['id']} is ")


@pytest.mark.parametrize(
    "tid, why",
    [
        ("a" * 2000, "is 2000 bytes long; task ids have at most 1024 bytes"),
        ("é" * 513, "is 1026 bytes long"),
        ("task 7", "contains ' '"),
        ("task\n7", "contains '\\n'"),
        ("task\t7", "contains '\\t'"),
        ("task\x007", "contains '\\x00'"),
        ("task\u20287", "contains '\\u2028'"),
        (" task7", "contains ' '"),
    ],
    ids=["2000-chars", "1026-bytes", "space", "newline", "tab", "nul", "line-sep", "lead-space"],
)
def test_a_task_id_the_wire_or_a_ledger_cannot_take_is_refused(
    tmp_path: Path, tid: str, why: str
) -> None:
    task = tasks(1)[0]
    task["id"] = tid
    root = folder_with(tmp_path, **{"bad.json": task})
    message = refused(root)
    assert message.startswith(f"{root / 'bad.json'}: task id {tid[:60]!r}"), message
    assert why in message, message
    ok = "a" * MAX_TASK_ID_BYTES  # exactly the bound: accepted
    task["id"] = ok
    (root / "bad.json").write_text(json.dumps(task))
    assert ok in {p.task["id"] for p in load_pool(root)}


def test_a_folder_pool_loads_the_lists_of_tasks_beside_its_task_files(tmp_path: Path) -> None:
    """One task file and a list of two: three tasks (a .json pool loads lists, so a folder of
    them does too); index files and lists of ids are still skipped."""
    one, *two = tasks(3)
    root = folder_with(
        tmp_path,
        **{
            "a__one.json": one,
            "a__list.json": two,
            "b__wrapped.json": {"tasks": tasks(1, seed=7)},
            "test_all.json": {"a": [one["id"]]},
            "ids.json": [one["id"], two[0]["id"]],
        },
    )
    pool = load_pool(root)
    by_id = {p.task["id"]: p for p in pool}
    assert len(pool) == 5 and {one["id"], two[0]["id"], two[1]["id"]} <= set(by_id)
    assert by_id[two[1]["id"]].source == f"{root / 'a' / 'list.json'}[1]"
    assert by_id[two[1]["id"]].domain == "a"
    # A list whose items are not all tasks is refused, naming the item.
    (root / "a" / "list.json").write_text(json.dumps([two[0], "not a task"]))
    assert refused(root).startswith(f"{root / 'a' / 'list.json'}[1]: a task must be a JSON object")
    # A task file that lost its evaluator is refused, not skipped.
    broken = dict(one)
    del broken["evaluator"]
    (root / "a" / "list.json").write_text(json.dumps(two))
    (root / "a" / "one.json").write_text(json.dumps(broken))
    assert refused(root) == f"{root / 'a' / 'one.json'} (id {one['id']}): missing 'evaluator'"


def test_other_problems_name_the_file(tmp_path: Path) -> None:
    task = tasks(1)[0]
    root = folder_with(tmp_path, **{"x__latin1.json": json.dumps(task).encode() + b" \xe9"})
    assert refused(root).startswith(f"{root / 'x' / 'latin1.json'}: not UTF-8")
    (root / "x" / "latin1.json").write_text('{"id": 1' + "0" * 5000 + "}")  # int too long
    assert refused(root).startswith(f"{root / 'x' / 'latin1.json'}: not valid JSON")
    (root / "x" / "latin1.json").unlink()
    (root / "x" / "dir.json").mkdir()  # a folder named *.json is a folder
    assert len(load_pool(root)) == 1
    assert (
        refused(tmp_path / "nothing")
        == f"{tmp_path / 'nothing'}: does not exist (a task pool is a folder of task JSON files, "
        "a .json or a .jsonl file)"
    )


def test_the_pool_commands_refuse_the_pool_on_their_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    task = tasks(1)[0]
    task["id"] = "a\nb"
    root = folder_with(tmp_path, **{"bad.json": task})
    policy = {"eval": ["model='m'"], "collect": ["model='m'"]}
    for command in ("eval", "collect", "select-tasks", "audit-tasks"):
        rc = cli.main([command, f"tasks={str(root)!r}", *policy.get(command, [])])
        err = capsys.readouterr().err
        assert rc == 2, (command, err)
        want = f"arpo {command}: config field tasks: {root / 'bad.json'}: task id 'a\\nb' contains"
        assert want in err, err

"""OSWorld task files, parsed into the project's frozen task type.

A task file (`evaluation_examples/examples/<domain>/<id>.json`) holds `id`, `instruction`,
`config` (setup steps), `evaluator` and a few descriptive keys. The schema is OSWorld's; this
module validates its shape and normalises the evaluator so that single and list forms look the
same (`funcs`, `result`, `expected` and `options` are tuples of equal length). Keys this module
does not know are kept in `extra` rather than rejected, because the benchmark grows new ones.

    tasks = load_tasks("shared/osworld/evaluation_examples")          # all files, by domain
    tasks = load_task_set("shared/osworld/evaluation_examples", "test_all.json")  # index order
    pool = load_pool("runs/task_pool")      # a folder / .json / .jsonl of task dicts, with domains
    keep = load_selection("runs/selection.json")      # the ids `arpo select-tasks` kept
    task_pool(task_dict)   # "sim", "desktop" or the task's own "pool": where it can run

JSON values inside steps, getters and options are kept as parsed (dicts and lists): treat them
as read-only.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arpo.env.taskfiles import TaskFiles, file_kind
from arpo.errors import ConfigError, TaskError
from arpo.record import ident_problem
from arpo.wire import MAX_ID_BYTES, MAX_STR_BYTES

_KNOWN_TASK_KEYS = frozenset(
    {
        "id",
        "snapshot",
        "instruction",
        "source",
        "config",
        "related_apps",
        "evaluator",
        "trajectory",
        "proxy",
        "fixed_ip",
        "possibility_of_env_change",
    }
)
_KNOWN_EVALUATOR_KEYS = frozenset({"func", "conj", "result", "expected", "options", "postconfig"})


@dataclass(frozen=True, slots=True)
class Step:
    """One setup or postconfig step: `{"type": ..., "parameters": {...}}`."""

    type: str
    parameters: Mapping[str, Any]

    @classmethod
    def parse(cls, raw: Any, where: str) -> Step:
        if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
            raise TaskError(f"{where}: a step must be an object with a string 'type', got {raw!r}")
        params = raw.get("parameters", {})
        if not isinstance(params, dict):
            raise TaskError(f"{where}: step {raw['type']!r} has non-object parameters {params!r}")
        return cls(type=raw["type"], parameters=params)


@dataclass(frozen=True, slots=True)
class GetterSpec:
    """A result or expected getter: `type` plus its own keys (`path`, `rules`, ...) in `params`."""

    type: str
    params: Mapping[str, Any]

    @classmethod
    def parse(cls, raw: Any, where: str) -> GetterSpec | None:
        if raw is None or raw == {}:
            return None
        if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
            raise TaskError(
                f"{where}: a getter must be an object with a string 'type', got {raw!r}"
            )
        return cls(type=raw["type"], params={k: v for k, v in raw.items() if k != "type"})


@dataclass(frozen=True, slots=True)
class Evaluator:
    """The checker of a task, normalised: one entry per metric in every tuple."""

    funcs: tuple[str, ...]
    """Metric names, e.g. ("compare_table",)."""
    func_is_list: bool
    """Whether the file gave `func` as a list (OSWorld then averages with `conj`)."""
    conj: str
    """How several metrics combine: "and" (mean, 0 if any is 0) or "or" (max, 1 if any is 1)."""
    result: tuple[GetterSpec | None, ...]
    """Getter of the state to check, per metric (None when the file has none, as for infeasible)."""
    expected: tuple[GetterSpec | None, ...]
    """Getter of the reference, per metric (None: the metric is called without one)."""
    options: tuple[Mapping[str, Any], ...]
    """Keyword options of each metric."""
    postconfig: tuple[Step, ...]
    """Steps run before the getters (save the document, close the app, ...)."""
    has_expected: bool
    """Whether the file has an `expected` key at all."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Evaluator keys not listed above (kept, not interpreted)."""

    @property
    def is_infeasible(self) -> bool:
        return not self.func_is_list and self.funcs == ("infeasible",)

    @classmethod
    def parse(cls, raw: Any, where: str) -> Evaluator:
        if not isinstance(raw, dict):
            raise TaskError(f"{where}: 'evaluator' must be an object, got {type(raw).__name__}")
        func = raw.get("func")
        if isinstance(func, str):
            funcs, is_list = (func,), False
        elif isinstance(func, list) and func and all(isinstance(f, str) for f in func):
            funcs, is_list = tuple(func), True
        else:
            raise TaskError(
                f"{where}: evaluator.func must be a string or a list of strings, got {func!r}"
            )
        n = len(funcs)
        conj = raw.get("conj", "and")
        if conj not in ("and", "or"):
            raise TaskError(f"{where}: evaluator.conj must be 'and' or 'or', got {conj!r}")

        def per_metric(key: str, parse_one: Any, empty: Any) -> tuple[Any, ...]:
            value = raw.get(key)
            if value is None or (isinstance(value, list | dict) and len(value) == 0):
                return (empty,) * n
            if is_list:
                if not isinstance(value, list) or len(value) != n:
                    raise TaskError(
                        f"{where}: evaluator.func lists {n} metrics, so evaluator.{key} must be a "
                        f"list of {n} entries (null for none), got {value!r:.200}"
                    )
                return tuple(
                    parse_one(v, f"{where}: evaluator.{key}[{i}]") for i, v in enumerate(value)
                )
            if isinstance(value, list):
                raise TaskError(
                    f"{where}: evaluator.func is one metric but evaluator.{key} is a list"
                )
            return (parse_one(value, f"{where}: evaluator.{key}"),)

        def parse_options(v: Any, w: str) -> Mapping[str, Any]:
            if v is None:
                return {}
            if not isinstance(v, dict):
                raise TaskError(f"{w}: options must be an object, got {v!r}")
            return v

        postconfig_raw = raw.get("postconfig", [])
        if not isinstance(postconfig_raw, list):
            raise TaskError(f"{where}: evaluator.postconfig must be a list of steps")
        return cls(
            funcs=funcs,
            func_is_list=is_list,
            conj=conj,
            result=per_metric("result", GetterSpec.parse, None),
            expected=per_metric("expected", GetterSpec.parse, None),
            options=per_metric("options", parse_options, {}),
            postconfig=tuple(
                Step.parse(s, f"{where}: evaluator.postconfig[{i}]")
                for i, s in enumerate(postconfig_raw)
            ),
            has_expected=bool(raw.get("expected")),
            extra={k: v for k, v in raw.items() if k not in _KNOWN_EVALUATOR_KEYS},
        )


@dataclass(frozen=True, slots=True)
class Task:
    """One OSWorld task."""

    id: str
    """Task uuid."""
    domain: str
    """Folder name under `examples/` (chrome, libreoffice_calc, ...); "" when unknown."""
    instruction: str
    """What the agent is asked to do."""
    evaluator: Evaluator
    """How the outcome is checked."""
    config: tuple[Step, ...] = ()
    """Setup steps run before the episode."""
    snapshot: str = ""
    """Name of the VM snapshot the task starts from."""
    source: str = ""
    """Where the task comes from (a URL, usually)."""
    related_apps: tuple[str, ...] = ()
    trajectory: str | None = None
    proxy: bool = False
    """Whether the task needs OSWorld's proxy (web tasks that are rate limited)."""
    fixed_ip: bool = False
    possibility_of_env_change: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Top-level keys not listed above (e.g. `hint`), kept as parsed."""
    path: str | None = None
    """File the task was read from."""
    raw: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    """The task's JSON as parsed (read-only), for evaluators that take it as is (OSWorld's)."""

    @property
    def is_infeasible(self) -> bool:
        return self.evaluator.is_infeasible

    @classmethod
    def from_dict(cls, raw: Any, *, domain: str = "", path: str | None = None) -> Task:
        where = path or "task"
        if not isinstance(raw, dict):
            raise TaskError(f"{where}: a task must be a JSON object, got {type(raw).__name__}")
        tid = raw.get("id")
        if not isinstance(tid, str) or not tid:
            raise TaskError(f"{where}: missing or empty string 'id'")
        if problem := task_id_problem(tid):
            shown = repr(tid[:60]) + ("..." if len(tid) > 60 else "")
            raise TaskError(f"{where}: task id {shown} {problem}")
        where = f"{path or 'task'} (id {tid})"
        instruction = raw.get("instruction")
        if not isinstance(instruction, str):
            raise TaskError(f"{where}: 'instruction' must be a string")
        if "evaluator" not in raw:
            raise TaskError(f"{where}: missing 'evaluator'")
        config_raw = raw.get("config", [])
        if not isinstance(config_raw, list):
            raise TaskError(f"{where}: 'config' must be a list of steps")
        apps = raw.get("related_apps", [])
        if not isinstance(apps, list) or not all(isinstance(a, str) for a in apps):
            raise TaskError(f"{where}: 'related_apps' must be a list of strings")
        return cls(
            id=tid,
            domain=domain,
            instruction=instruction,
            evaluator=Evaluator.parse(raw["evaluator"], where),
            config=tuple(Step.parse(s, f"{where}: config[{i}]") for i, s in enumerate(config_raw)),
            snapshot=str(raw.get("snapshot") or ""),
            source=str(raw.get("source") or ""),
            related_apps=tuple(apps),
            trajectory=raw.get("trajectory"),
            proxy=bool(raw.get("proxy", False)),
            fixed_ip=bool(raw.get("fixed_ip", False)),
            possibility_of_env_change=raw.get("possibility_of_env_change"),
            extra={k: v for k, v in raw.items() if k not in _KNOWN_TASK_KEYS},
            path=path,
            raw=raw,
        )


def load_task(path: str | Path, domain: str | None = None) -> Task:
    """Read one task file; the domain defaults to the name of its folder."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise TaskError(f"{p}: cannot read task file: {e}") from e
    except json.JSONDecodeError as e:
        raise TaskError(f"{p}: not valid JSON: {e}") from e
    return Task.from_dict(raw, domain=p.parent.name if domain is None else domain, path=str(p))


def _examples_dir(root: str | Path) -> Path:
    root = Path(root)
    return root / "examples" if (root / "examples").is_dir() else root


def load_tasks(root: str | Path) -> list[Task]:
    """All tasks under `root` (an `evaluation_examples` folder or its `examples/`), by domain and id."""
    ex = _examples_dir(root)
    if not ex.is_dir():
        raise TaskError(f"{ex}: not a directory of task folders")
    return [load_task(f) for f in sorted(ex.glob("*/*.json"))]


def load_index(path: str | Path) -> dict[str, list[str]]:
    """An index file such as `test_all.json`: domain -> task ids."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise TaskError(f"{p}: cannot read task index: {e}") from e
    if not isinstance(raw, dict) or not all(
        isinstance(v, list) and all(isinstance(i, str) for i in v) for v in raw.values()
    ):
        raise TaskError(f"{p}: an index must map each domain to a list of task ids")
    return {str(k): list(v) for k, v in raw.items()}


def load_task_set(root: str | Path, index: str = "test_all.json") -> list[Task]:
    """The tasks an index file names, in its order; `index` is relative to `root` or absolute."""
    root = Path(root)
    index_path = Path(index) if Path(index).is_absolute() else root / index
    ex = _examples_dir(root)
    tasks = []
    for domain, ids in load_index(index_path).items():
        for tid in ids:
            f = ex / domain / f"{tid}.json"
            if not f.is_file():
                raise TaskError(
                    f"{index_path}: task {domain}/{tid} is listed but {f} does not exist"
                )
            tasks.append(load_task(f, domain))
    return tasks


# ---------------------------------------------------------------------------- task pools
# The task set of a run (`arpo train`, `arpo-learner`, the pool runs of `arpo.pool`).


@dataclass(frozen=True)
class PoolTask:
    """One task of a pool: the task dict as read, where it came from, and its domain."""

    task: dict[str, Any]
    source: str
    """The file the task was read from, with `:<line>` for a .jsonl file and `[<index>]`
    for a task of a list."""
    domain: str


def task_domain(task: Mapping[str, Any], folder: str = "") -> str:
    """The domain of a task: its "domain" field, else `folder`, else its id's prefix."""
    d = task.get("domain")
    if isinstance(d, str) and d:
        return d
    if folder:
        return folder
    tid = str(task.get("id", ""))
    return tid.split("-", 1)[0] if "-" in tid and tid.split("-", 1)[0] else "unknown"


MAX_TASK_ID_BYTES = MAX_ID_BYTES
"""Longest task id (UTF-8 bytes): the wire's bound on an id in a grant or a record."""
MAX_TASK_JSON_BYTES = MAX_STR_BYTES
"""Largest task, as the JSON a grant carries (UTF-8 bytes, its files named by content): the
wire's bound on a string (1 MiB). OSWorld's largest task is 13 KB; large data belongs in
files its `upload_file` steps send."""
MAX_TASK_DEPTH = 64
"""Deepest nesting of objects and lists in a task (OSWorld's deepest is 10 levels): deeper
JSON is refused before code that walks it recursively meets it."""
MAX_POOL_FILE_BYTES = 1 << 30
"""Largest file of a pool (a task, a list of tasks or a .jsonl file), read whole."""


def task_id_problem(tid: str) -> str | None:
    """Why `tid` cannot be a task id, or None: it crosses the wire in every grant and record
    and is written one a line into ledgers (`arpo.record.ident_problem`)."""
    n = len(tid.encode("utf-8", "surrogatepass"))
    if n > MAX_TASK_ID_BYTES:
        return f"is {n} bytes long; task ids have at most {MAX_TASK_ID_BYTES} bytes"
    return ident_problem(tid)


def read_task_file(
    path: Path, *, what: str = "task file", max_bytes: int = MAX_POOL_FILE_BYTES
) -> str:
    """The text of `path` (a task file, a pool file or an index), in UTF-8, if it is a
    regular file (a link to one is followed) of at most `max_bytes`. The open does not
    block and fstat is checked before any read, so a FIFO, a socket or a device named
    *.json is refused, never waited on. Raises TaskError naming the file and the reason;
    `what` names the file's role in it. Pools and `arpo fetch` read their files here."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise TaskError(f"{path}: cannot open the {what}: {why}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TaskError(
                f"{path}: not a regular file ({file_kind(st.st_mode)}); only regular files "
                f"are read as a {what}"
            )
        if st.st_size > max_bytes:
            raise TaskError(f"{path}: {st.st_size} bytes; a {what} has at most {max_bytes}")
        try:
            data = f.read(max_bytes + 1)
        except OSError as e:
            raise TaskError(f"{path}: cannot read the {what}: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise TaskError(f"{path}: grew past {max_bytes} bytes while it was read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TaskError(f"{path}: not UTF-8 text ({e}); task files are UTF-8 JSON") from None


def parse_task_json(text: str, where: str) -> Any:
    """The JSON value of `text` (read from `where`); TaskError naming `where` when it is not
    JSON or is nested too deeply for the parser."""
    try:
        return json.loads(text)
    except RecursionError:
        raise TaskError(
            f"{where}: JSON nested too deeply (a task has at most {MAX_TASK_DEPTH} levels)"
        ) from None
    except ValueError as e:  # JSONDecodeError, or an integer of more than 4300 digits
        raise TaskError(f"{where}: not valid JSON: {e}") from None


def _depth(value: Any) -> int:
    """Levels of nested objects and lists in `value` (1 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if isinstance(v, dict):
            stack.extend((c, d + 1) for c in v.values())
        elif isinstance(v, list):
            stack.extend((c, d + 1) for c in v)
    return deepest


def _is_task(raw: Any) -> bool:
    """A JSON value that claims to be a task: an object with an evaluator, or with an id and
    an instruction (it must then be a whole task: `Task.from_dict` says what is missing)."""
    return isinstance(raw, dict) and ("evaluator" in raw or ("id" in raw and "instruction" in raw))


def folder_tasks(raw: Any, where: str) -> list[tuple[Any, str]]:
    """The tasks of one JSON file of a folder pool, each with where it is (the file, and
    `[i]` for the i-th of a list): a task, a list of tasks, or an object whose "tasks" is
    one; none for a file that holds no task object (an index such as test_all.json, a list
    of ids, settings)."""
    if _is_task(raw):
        return [(raw, where)]
    items = raw.get("tasks") if isinstance(raw, dict) else raw
    if isinstance(items, list) and any(isinstance(t, dict) for t in items):
        return [(t, f"{where}[{i}]") for i, t in enumerate(items)]
    return []


def load_pool(path: str | Path, files: TaskFiles | None = None) -> list[PoolTask]:
    """The tasks of a pool, each checked as an OSWorld task, its files named by content.

    A pool is a folder searched recursively for JSON files, a .json file with a task or a
    list of tasks, or a .jsonl file with one task per line. In a folder, a file may hold a
    task, a list of tasks or {"tasks": [...]}, as a .json pool does (every task of a list
    is loaded); files that hold no task, such as index files (test_all.json), are skipped.
    A task's domain is its "domain" field if it has one, else the name of the folder its
    file is in when the pool is a folder (OSWorld's `examples/<domain>/<id>.json` and the
    simulated tasks' `<family>/<id>.json`), else the task id's part before the first '-',
    else "unknown".

    Every file an `upload_file` step sends (a `local_path` relative to the task file's
    folder or the pool's folder) is hashed and named in the task by `sha256` and `size`
    (`arpo.env.taskfiles`): a grant then carries no path of this filesystem, and the
    learner serves the bytes from `files` (a `TaskFiles` index; None: not kept).

    Raises `TaskError` naming the file (and the task id) for: a file that is not a regular
    file (a FIFO named *.json is refused, never waited on), not UTF-8 or not JSON; a task
    nested deeper than MAX_TASK_DEPTH, larger than MAX_TASK_JSON_BYTES as a grant carries
    it, or malformed; a task id longer than MAX_TASK_ID_BYTES, holding whitespace or
    control characters, or given twice; an `upload_file` whose file is missing, absolute,
    has `..` or leads out of its folder.
    """
    files = files if files is not None else TaskFiles()
    p = Path(path)
    found: list[tuple[Any, str, str, Path]] = []  # task, where, folder, its file
    if p.is_dir():
        for f in sorted(p.rglob("*.json")):
            if f.is_dir():
                continue  # a folder named *.json: rglob lists what is inside it
            raw = parse_task_json(read_task_file(f), str(f))
            found += [(t, w, f.parent.name, f) for t, w in folder_tasks(raw, str(f))]
    elif p.exists():
        text = read_task_file(p)
        if p.suffix == ".jsonl":
            found = [
                (parse_task_json(line, f"{p}:{i + 1}"), f"{p}:{i + 1}", "", p)
                for i, line in enumerate(text.splitlines())
                if line.strip()
            ]
        else:
            raw = parse_task_json(text, str(p))
            if isinstance(raw, dict) and isinstance(raw.get("tasks"), list):
                raw = raw["tasks"]
            if isinstance(raw, dict):
                found = [(raw, str(p), "", p)]
            elif isinstance(raw, list):
                found = [(t, f"{p}[{i}]", "", p) for i, t in enumerate(raw)]
            else:
                raise TaskError(f"{p}: expected a task object or a list of tasks")
    else:
        raise TaskError(
            f"{p}: does not exist (a task pool is a folder of task JSON files, a .json or a "
            ".jsonl file)"
        )
    root = p if p.is_dir() else p.parent
    pool: list[PoolTask] = []
    ids = PoolIds()
    for raw, where, folder, src in found:
        if (depth := _depth(raw)) > MAX_TASK_DEPTH:
            tid = raw.get("id") if isinstance(raw, dict) else None
            named = f" (id {tid[:60]!r})" if isinstance(tid, str) else ""
            raise TaskError(
                f"{where}{named}: a task nested {depth} levels deep; at most {MAX_TASK_DEPTH}"
            )
        task = Task.from_dict(raw, path=where)  # TaskError names the file and the id
        try:
            raw = files.address(raw, src.parent, root)
        except TaskError as e:
            raise TaskError(f"{where}: {e}") from None
        except OSError as e:
            raise TaskError(f"{where}: task {task.id}: cannot read an upload_file: {e}") from None
        size = len(json.dumps(raw, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        if size > MAX_TASK_JSON_BYTES:
            raise TaskError(
                f"{where}: task {task.id} is {size} bytes of JSON; a grant carries at most "
                f"{MAX_TASK_JSON_BYTES} (arpo.wire.MAX_STR_BYTES): put large data in files "
                "its upload_file steps send"
            )
        check_steps(task, where)
        ids.add(task.id, where)
        pool.append(PoolTask(raw, where, task_domain(raw, folder)))
    if not pool:
        raise no_tasks(p)
    return pool


class PoolIds:
    """The task ids of a pool being loaded, each with where it is: a second task of one id
    is refused (`load_pool` and `arpo fetch` alike)."""

    def __init__(self) -> None:
        self.where_of: dict[str, str] = {}

    def add(self, task_id: str, where: str) -> None:
        """Note the task `task_id` found at `where`; TaskError naming both places when the
        pool already has a task of that id."""
        if task_id in self.where_of:
            raise TaskError(f"{where}: task id {task_id} is also in {self.where_of[task_id]}")
        self.where_of[task_id] = where


def no_tasks(path: str | Path) -> TaskError:
    """The error of a pool that holds no task (`[]`, an empty folder)."""
    return TaskError(f"{path}: holds no tasks (JSON objects with 'id' and 'evaluator')")


def pool_problem(path: str | Path) -> str | None:
    """Why the task pool at `path` cannot be loaded (`load_pool`'s error, naming the file
    and the task), or None: what the configs that name a pool check when a command starts."""
    try:
        load_pool(path)
    except TaskError as e:
        return str(e)
    return None


STEP_TYPES = (
    "download",
    "upload_file",
    "open",
    "launch",
    "execute",
    "command",
    "sleep",
    "activate_window",
    "close_window",
    "sim_scene",
)
"""Step types this project's runner runs (arpo.env.runner)."""

OSWORLD_STEPS = frozenset(
    {
        "act",
        "activate_window",
        "change_wallpaper",
        "chrome_close_tabs",
        "chrome_open_tabs",
        "close_window",
        "command",
        "download",
        "execute",
        "execute_with_verification",
        "googledrive",
        "launch",
        "login",
        "open",
        "proxy",
        "replay",
        "sleep",
        "tidy_desktop",
        "update_browse_history",
        "upload_file",
    }
)
"""Setup / postconfig step types (`SetupController._<type>_setup`)."""
"""Step types OSWorld's setup controller runs (`SetupController._<type>_setup`)."""


def check_steps(task: Task, where: str = "") -> None:
    """Refuse a task whose setup or postconfig holds a step nobody can run (neither this
    project's runner nor OSWorld's setup controller knows its type) or a `sim_scene` step
    without a string family: such a task fails on every environment, so it is refused when
    the pool is loaded, naming the task and the step, instead of failing in every episode."""
    where = where or task.path or task.id
    for phase, steps in (
        ("config", task.config),
        ("evaluator.postconfig", task.evaluator.postconfig),
    ):
        for i, step in enumerate(steps):
            if step.type not in STEP_TYPES and step.type not in OSWORLD_STEPS:
                raise TaskError(
                    f"{where}: task {task.id}: {phase}[{i}] has the step type {step.type!r}, "
                    f"which no runner knows (this project's: {', '.join(STEP_TYPES)}; and "
                    "OSWorld's setup steps)"
                )
            if step.type == SIM_SCENE_STEP and not isinstance(step.parameters.get("family"), str):
                raise TaskError(
                    f"{where}: task {task.id}: {phase}[{i}] is a sim_scene step whose 'family' "
                    f"is not a string ({step.parameters.get('family')!r:.80}); give a family "
                    "name such as 'click_button'"
                )


def load_task_pool(path: str | Path, files: TaskFiles | None = None) -> list[dict[str, Any]]:
    """The task dicts of a pool (`load_pool` without sources and domains)."""
    return [p.task for p in load_pool(path, files)]


def load_selection(path: str | Path) -> list[str]:
    """The selected task ids of a result of `arpo select-tasks` (`arpo.pool.select`).

    Raises `ConfigError` naming the file when it is missing, not JSON, not a selection
    result, or from a run that did not finish.
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"task selection file {str(p)!r} does not exist (run `arpo select-tasks` first)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"task selection file {str(p)!r} is not readable JSON: {e}") from None
    sel = data.get("selected") if isinstance(data, dict) else None
    if not isinstance(sel, list) or not all(isinstance(t, str) and t for t in sel):
        raise ConfigError(
            f"task selection file {str(p)!r} has no 'selected' list of task ids "
            "(is it the output of `arpo select-tasks`?)"
        )
    if data.get("complete") is False:
        raise ConfigError(
            f"task selection file {str(p)!r} is from a run that did not finish "
            "(complete: false); run `arpo select-tasks` again"
        )
    return list(sel)


# ---------------------------------------------------------------------------- where a task runs


SIM_SNAPSHOT = "arpo-sim"
"""The `snapshot` of the simulated desktop's tasks (`arpo_envs.sim.tasks`)."""
SIM_SCENE_STEP = "sim_scene"
"""The setup step that loads a simulated desktop's scene."""


def task_pool(task: Mapping[str, Any]) -> str:
    """The kind of environment a task dict runs on ("pool"), which grants are routed by.

    The task's own `"pool"` field when present; else "sim" for a simulated desktop's task
    (snapshot "arpo-sim" or a `sim_scene` setup step); else "desktop" (an OSWorld VM or a
    real local desktop).

        task_pool({"id": "t", "pool": "osworld"})   # "osworld"
        task_pool(generate_tasks("click_button", 1)[0])   # "sim"
    """
    pool = task.get("pool")
    if pool is not None:
        if not isinstance(pool, str) or not pool or len(pool) > 1024:
            raise TaskError(
                f"task {task.get('id')!r}: 'pool' must be a non-empty string of at most "
                f"1024 characters, got {pool!r:.80}"
            )
        return pool
    if task.get("snapshot") == SIM_SNAPSHOT:
        return "sim"
    steps = task.get("config")
    if isinstance(steps, list) and any(
        isinstance(s, Mapping) and s.get("type") == SIM_SCENE_STEP for s in steps
    ):
        return "sim"
    return "desktop"

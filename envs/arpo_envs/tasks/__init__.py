"""The local task suite: OSWorld-schema tasks for the real local desktop, each with an oracle.

44 tasks over LibreOffice Calc, Mousepad, xterm and files, and pairs of them, from one action to
ten; every one runs offline (setup files ship beside the task files) and carries its oracle, the
pyautogui actions that solve it, under the task key "oracle". `generate.py` writes them;
`osworld_oracles.json` holds oracles for those of the benchmark's own tasks that run offline on
the local desktop, keyed by task id.

    from arpo_envs.tasks import SUITE_DIR, task_files, osworld_oracles
    # with arpo:  arpo.env.load_tasks(SUITE_DIR)  /  load_task_set(SUITE_DIR, "test_all.json")
"""

from __future__ import annotations

import json
from pathlib import Path

SUITE_DIR = Path(__file__).resolve().parent / "local"
"""Root of the suite: `<domain>/<id>.json`, `<domain>/<id>/<files>`, `test_all.json`."""
OSWORLD_ORACLES = Path(__file__).resolve().parent / "osworld_oracles.json"


def task_files() -> list[Path]:
    """Every task file of the suite, by domain and id."""
    return sorted(SUITE_DIR.glob("*/*.json"))


def osworld_oracles() -> dict[str, list[str]]:
    """Benchmark task id -> oracle actions, for the OSWorld tasks that run on the local desktop."""
    raw = json.loads(OSWORLD_ORACLES.read_text(encoding="utf-8"))
    return {k: v["oracle"] for k, v in raw.items() if not k.startswith("_")}

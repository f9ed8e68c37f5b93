"""Durable file writes shared by the store snapshots' neighbours: checkpoints, the ingest
journal, the actor's spool, published weights and reports.

    write_atomic(path, b"...")             # tmp file + fsync + rename + fsync of the folder
    write_json_atomic(path, {"a": 1})      # the same for a JSON document
    fsync_dir(path.parent)                 # make a rename or a new file in a folder durable
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def fsync_dir(path: str | Path) -> None:
    """fsync a folder, so that names created or renamed in it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | Path, data: bytes | str) -> None:
    """Write `data` to a tmp file next to `path`, fsync it, rename it over `path`, fsync
    the folder: readers see the old file or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    with open(tmp, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json_atomic(path: str | Path, data: Any, indent: int = 2) -> None:
    """`write_atomic` of a JSON document (with a final newline)."""
    write_atomic(path, json.dumps(data, indent=indent) + "\n")

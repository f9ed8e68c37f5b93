"""OSWorld's evaluator for the tests: skip markers, a loop thread that keeps one worker alive for
a whole module, and files written by the evaluator environment's own libraries."""

from __future__ import annotations

import asyncio
import subprocess
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from arpo.env.osworld.client import find_python

T = TypeVar("T")
PYTHON = find_python()
needs_evaluator = pytest.mark.skipif(
    PYTHON is None,
    reason="OSWorld's evaluator environment (.venv-osworld) is not installed: run "
    "`make osworld-evaluator` (make test does), or set $ARPO_OSWORLD_PYTHON",
)


class LoopThread:
    """An event loop in a thread, so one worker serves every test of a module."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 300) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


def write_with_evaluator_libs(script: str, out_dir: Path) -> None:
    """Run `script` under the evaluator environment's python (openpyxl, python-docx,
    python-pptx, PyMuPDF, Pillow) with `OUT` bound to `out_dir`, to write test inputs."""
    assert PYTHON is not None
    code = f"from pathlib import Path\nOUT = Path({str(out_dir)!r})\n" + script
    subprocess.run([str(PYTHON), "-c", code], check=True, timeout=120, capture_output=True)

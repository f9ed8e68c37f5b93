"""Logging set-up shared by the long-running processes (`arpo-learner`, `arpo-actor`)."""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys


def setup_process(level: str = "INFO") -> None:
    """Timestamped logs to stderr, arpo's loggers at `level`; `kill -USR1 <pid>` prints
    every thread's stack to stderr (a hung process explains itself)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("arpo").setLevel(level.upper())

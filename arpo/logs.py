"""Logging set-up shared by the long-running processes (`arpo-learner`, `arpo-actor`), and
`LogLimiter`, which bounds the lines a peer's messages can make them write."""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
import threading
import time


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


class LogLimiter:
    """Log lines that a peer can cause, bounded: per `reason`, the first `burst` lines, then
    at most one line per `interval_s` that says how many were left out since the last one.
    A flood of bad requests writes a few lines; whoever logs still counts every one.
    Reasons are the caller's fixed names (never text from a peer), so the table stays small.
    Thread-safe.

        limiter = LogLimiter(log)
        limiter.log(logging.WARNING, "file_refused", "chunk %d refused: %s", index, why)
    """

    def __init__(self, logger: logging.Logger, burst: int = 10, interval_s: float = 10.0):
        self.logger = logger
        self.burst = burst
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._seen: dict[str, list[float]] = {}  # reason -> [lines, last line's time, left out]

    def log(self, level: int, reason: str, msg: str, *args: object) -> bool:
        """Log `msg % args` unless `reason` has used up its lines; True when logged."""
        now = time.monotonic()
        with self._lock:
            seen = self._seen.setdefault(reason, [0, 0.0, 0])
            lines, last, left_out = seen
            if lines >= self.burst and now - last < self.interval_s:
                seen[2] += 1
                return False
            seen[:] = [lines + 1, now, 0]
        if lines >= self.burst:
            msg += f" ({int(left_out)} more like it in the last {now - last:.0f} s not logged)"
        elif lines == self.burst - 1:
            msg += f" (further ones: one line per {self.interval_s:.0f} s)"
        self.logger.log(level, msg, *args)
        return True

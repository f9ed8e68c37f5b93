"""Progress of a long phase with an estimate of the time left: a tqdm bar on a terminal, plain
lines otherwise (logs, CI).

    with Progress("evaluation", total=128, unit="episode") as p:
        p.update_to(12)                       # 12 of 128 done
        p.update_to(40, "reward 0.41")        # with a note

On a terminal (the stream is a TTY) the bar redraws in place with tqdm's rate and ETA. Anywhere
else a line `evaluation: 40/128 episodes (31 %), 2.0/s, about 44 s left | reward 0.41` is written
at most every `every_s` seconds, and once at the end.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def _eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
    if seconds >= 60:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds} s"


class Progress:
    """A phase of `total` units (see the module docstring)."""

    def __init__(
        self,
        desc: str,
        total: int,
        *,
        unit: str = "it",
        every_s: float = 10.0,
        stream: TextIO | None = None,
        bar: bool | None = None,
    ) -> None:
        self.desc, self.total, self.unit, self.every_s = desc, max(0, int(total)), unit, every_s
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", lambda: False)()
        self.done = 0
        self._t0 = time.monotonic()
        self._last = 0.0
        self._bar: Any = None
        if (isatty if bar is None else bar) and every_s > 0:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=desc, unit=unit, file=self.stream,
                             dynamic_ncols=True)  # fmt: skip

    def line(self, note: str = "") -> str:
        """The plain progress line of now."""
        elapsed = time.monotonic() - self._t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        pct = f" ({100 * self.done / self.total:.0f} %)" if self.total else ""
        text = f"{self.desc}: {self.done}/{self.total} {self.unit}s{pct}"
        if rate > 0:
            text += f", {rate:.2f}/s"
            if self.total and self.done < self.total:
                text += f", about {_eta((self.total - self.done) / rate)} left"
        return text + (f" | {note}" if note else "")

    def update_to(self, done: int, note: str = "") -> None:
        done = max(self.done, int(done))
        if self._bar is not None:
            self._bar.update(done - self.done)
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self.done = done
            return
        self.done = done
        now = time.monotonic()
        final = self.total and done >= self.total
        if self.every_s > 0 and (now - self._last >= self.every_s or final):
            self._last = now
            print(self.line(note), file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

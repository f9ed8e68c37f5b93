"""What every benchmark records about the machine it ran on."""

from __future__ import annotations

from pathlib import Path


def cpu_model() -> str:
    """The processor's model name from /proc/cpuinfo ("unknown" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"

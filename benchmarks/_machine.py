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


def run_header() -> dict[str, object]:
    """What a results file says about its run: date and time, the machine (host, cores,
    processor), the repository's commit (with `+changes` when the tree differs from it)
    and the load average when called (call it at the end: a busy machine shows there)."""
    import datetime as dt
    import os
    import platform
    import subprocess

    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        except OSError:
            return ""
        return out.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "+changes"
    return {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.node()}, {os.cpu_count()} cores, {cpu_model()}",
        "commit": commit,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }

"""The Debian mirror this machine's apt already uses, for the backports source line.

    python3 scripts/debian_mirror.py            # prints e.g. http://deb.debian.org/debian

Reads /etc/apt/sources.list and /etc/apt/sources.list.d/ (one-line `deb URI SUITE ...` and
deb822 `.sources` stanzas with `Types`, `URIs`, `Suites`) and prints the first URI that
serves the release's main suite (`bookworm`, or the codename given as the first argument),
so a machine behind a local mirror or a proxy gets backports from where its apt can reach.
Falls back to http://deb.debian.org/debian when none is found. Standard library only: it
runs before the project's virtualenv exists (the Makefile's `sysdeps`).
"""

from __future__ import annotations

import sys
from pathlib import Path

FALLBACK = "http://deb.debian.org/debian"


def _one_line(text: str) -> list[tuple[str, list[str]]]:
    out = []
    for line in text.splitlines():
        parts = line.split("#", 1)[0].split()
        if len(parts) >= 3 and parts[0] == "deb":
            rest = parts[1:]
            if rest[0].startswith("["):  # options: [arch=amd64 signed-by=...]
                while rest and not rest[0].endswith("]"):
                    rest = rest[1:]
                rest = rest[1:]
            if len(rest) >= 2:
                out.append((rest[0], [rest[1]]))
    return out


def _deb822(text: str) -> list[tuple[str, list[str]]]:
    out = []
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            key, _, value = line.partition(":")
            fields[key.strip().lower()] = value.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled") == "no":
            continue
        suites = fields.get("suites", "").split()
        out += [(uri, suites) for uri in fields.get("uris", "").split()]
    return out


def mirror(codename: str = "bookworm", root: Path = Path("/etc/apt")) -> str:
    """The URI of the first enabled source serving `codename`, else FALLBACK."""
    files = [root / "sources.list"]
    d = root / "sources.list.d"
    if d.is_dir():
        files += sorted(p for p in d.iterdir() if p.suffix in (".list", ".sources"))
    for f in files:
        try:
            text = f.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        entries = _deb822(text) if f.suffix == ".sources" else _one_line(text)
        for uri, suites in entries:
            if codename in suites and "security" not in uri:
                return uri.rstrip("/")
    return FALLBACK


if __name__ == "__main__":
    print(mirror(*sys.argv[1:2]))

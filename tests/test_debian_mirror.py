"""The backports source line uses the mirror of the machine's own apt sources."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import debian_mirror


def test_the_mirror_comes_from_the_machines_sources(tmp_path: Path) -> None:
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    assert debian_mirror.mirror("bookworm", apt) == debian_mirror.FALLBACK  # none found
    (apt / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.local:3142/debian-security\nSuites: bookworm-security\n"
        "Components: main\n\nTypes: deb\n# a proxy\nURIs: http://mirror.local:3142/debian/\n"
        "Suites: bookworm bookworm-updates\nComponents: main\n"
    )
    assert debian_mirror.mirror("bookworm", apt) == "http://mirror.local:3142/debian"
    (apt / "sources.list").write_text(
        "# deb http://commented.out/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] https://apt.example/debian bookworm main\n"
    )
    assert debian_mirror.mirror("bookworm", apt) == "https://apt.example/debian"
    assert debian_mirror.mirror("trixie", apt) == debian_mirror.FALLBACK

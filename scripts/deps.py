"""Print the requirements of the project and of the named extras, one per line.

Used by the Makefile to install dependencies without building the project itself:

    python scripts/deps.py train,dev | xargs pip install

The packages built from this repository (`LOCAL`: the replay store's wheel, which `make build`
builds from rust_buffer/ and installs) are left out: they are not on PyPI.
"""

import re
import sys
import tomllib
from pathlib import Path

LOCAL = {"arpo-buffer"}
"""Requirements built from this repository, by name."""


def name(requirement: str) -> str:
    """The distribution name of a requirement line (`"arpo-buffer==0.1.0"` -> `"arpo-buffer"`)."""
    return re.split(r"[\s\[<>=!~;@]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def main() -> None:
    project = tomllib.loads(Path(__file__).parent.parent.joinpath("pyproject.toml").read_text())
    project = project["project"]
    extras = [e for e in (sys.argv[1] if len(sys.argv) > 1 else "").split(",") if e]
    reqs = list(project["dependencies"])
    for extra in extras:
        if extra not in project["optional-dependencies"]:
            known = ", ".join(sorted(project["optional-dependencies"]))
            sys.exit(f"unknown extra {extra!r}; known extras: {known}")
        reqs += project["optional-dependencies"][extra]
    print("\n".join(r for r in dict.fromkeys(reqs) if name(r) not in LOCAL))


if __name__ == "__main__":
    main()

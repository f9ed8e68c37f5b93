"""Print the requirements of the project and of the named extras, one per line.

Used by the Makefile to install dependencies without building the project itself
(the Rust extension is built afterwards by `maturin develop --release`):

    python scripts/deps.py train,dev | xargs pip install
"""

import sys
import tomllib
from pathlib import Path


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
    print("\n".join(dict.fromkeys(reqs)))


if __name__ == "__main__":
    main()

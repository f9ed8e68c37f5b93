"""The repository layout page, `docs/reference/layout.md`, generated from the source tree.

    python scripts/layout_page.py           # rewrite the page (also `make docs`)
    python scripts/layout_page.py --check   # exit 1 when the committed page is not current

Every module of `arpo/` and `envs/arpo_envs/`, every source file of the Rust crates and every
script of `scripts/`, `benchmarks/` and `examples/` is listed with the first sentence of its
docstring (a Rust file's `//!` comment, a shell script's first comment), one table per folder
under the first sentence of the package's own docstring. The files are read as text, nothing
is imported, so the page can be made without the project's dependencies. A file without a
docstring stops the script naming it: its first sentence is what the page says about it.

The prose around the tables (`INTRO`, `FOLDERS`) is written here by hand.
`tests/test_layout.py` fails when the committed page differs from what this script gives, so
a module added, renamed or removed without running it fails the test suite.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference" / "layout.md"

INTRO = """\
# Layout of the repository

One folder per part of the system, one file per job: the tables below name every module
with the first sentence of its docstring, so a file's name and that sentence say where a
thing lives. This page is generated from the source tree by `scripts/layout_page.py`
(`make docs` runs it); `tests/test_layout.py` fails when a module is missing from it. To
change what a row says, change the module's docstring and run the script.
"""

FOLDERS = [
    ("arpo/", "the trainer: `arpo`, `arpo-learner`, `arpo-actor` (the `arpo` package below)"),
    ("envs/", "`arpo-envs`, a package of its own (`arpo_envs`, no torch, imports nothing of "
     "`arpo`): the local desktop server (Xvfb + openbox + LibreOffice Calc, mousepad, xterm), "
     "the simulated desktop, QEMU VMs of the test image (`vm/`), the local task suite"),
    ("rust_buffer/", "the replay store, a wheel of its own (`arpo-buffer`: the Python module "
     "`arpo_buffer`, numpy its only dependency, nothing of `arpo`): a pure-Rust core crate "
     "(no pyo3; its own tests and benchmark), the one crate that knows Python "
     "(`arpo_buffer._native`, built by maturin) and the package's Python part"),
    ("benchmarks/", "side-by-side benchmarks and experiments; their recorded results, with "
     "command, machine and commit, in `benchmarks/results/`"),
    ("examples/", "the replay store embedded in other programs: with numpy alone, and in "
     "another RL loop"),
    ("tests/", "the test suite (`make test`; `make test-all` adds the slow tests)"),
    ("docs/", "this site (MkDocs, `mkdocs.yml`); the reference pages are generated from the "
     "code"),
    ("scripts/", "helpers of the Makefile and of the documentation"),
    (".ci/", "the CI entry point: `make test`"),
]  # fmt: skip
"""Top-level folders, in the order shown: (path, what it holds)."""

PACKAGES = ["arpo", "envs/arpo_envs", "rust_buffer/python/arpo_buffer"]
"""Python packages: every module of every sub-package is listed."""
CRATES = ["rust_buffer/core", "rust_buffer/python"]
"""Rust crates: every file of `src/` is listed."""
SCRIPTS = ["scripts", "benchmarks", "examples"]
"""Folders of scripts: every `*.py` and `*.sh` directly in them is listed."""


class MissingDoc(Exception):
    """A listed file has no docstring (or `//!` / `#` header) to describe it."""


def first_sentence(text: str) -> str:
    """The first sentence of the first paragraph of `text`, on one line."""
    para = " ".join(text.strip().split("\n\n")[0].split())
    m = re.match(r"(.+?[.!?])(?=\s|$)", para)
    return (m[1] if m else para).rstrip(":")


def describe(path: Path) -> str:
    """What `path` says about itself, in one sentence; MissingDoc when it says nothing."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        doc = ast.get_docstring(ast.parse(text, str(path)))
    else:
        prefix = "//!" if path.suffix == ".rs" else "#"
        lines = [ln for ln in text.splitlines() if not ln.startswith("#!")]
        head = []
        for ln in lines:
            if not ln.startswith(prefix) or ln.strip() == prefix:
                break
            head.append(ln[len(prefix) :].strip())
        doc = " ".join(head)
    if not doc or not doc.strip():
        rel = path.relative_to(ROOT)
        how = "a module docstring" if path.suffix == ".py" else "a header comment"
        raise MissingDoc(f"{rel}: give it {how} whose first sentence says what it is for")
    return first_sentence(doc)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(rows: list[tuple[str, str]], head: str) -> list[str]:
    out = [f"| {head} | what |", "|---|---|"]
    out += [f"| `{name}` | {_cell(what)} |" for name, what in rows]
    return [*out, ""]


def _packages(root: Path) -> list[Path]:
    """The package folders under `root` (itself included), in tree order."""
    found = [p.parent for p in root.rglob("__init__.py") if "__pycache__" not in p.parts]
    return sorted(found, key=lambda p: p.relative_to(ROOT).parts)


def page() -> str:
    """The whole page, as `docs/reference/layout.md` holds it."""
    lines = [INTRO, "## Top-level folders", ""]
    lines += _table(FOLDERS, "folder")
    lines += ["## Python packages", ""]
    for top in PACKAGES:
        for pkg in _packages(ROOT / top):
            rel = pkg.relative_to(ROOT).as_posix()
            lines += [f"### `{rel}/`", "", describe(pkg / "__init__.py"), ""]
            modules = sorted(p for p in pkg.glob("*.py") if p.name != "__init__.py")
            rows = [(p.name, describe(p)) for p in modules]
            subs = sorted(p for p in pkg.iterdir() if (p / "__init__.py").is_file())
            rows += [(f"{p.name}/", describe(p / "__init__.py")) for p in subs]
            if rows:
                lines += _table(rows, "module")
    lines += ["## Rust crates", ""]
    for crate in CRATES:
        src = ROOT / crate / "src"
        lines += [f"### `{crate}/src/`", ""]
        lines += _table([(p.name, describe(p)) for p in sorted(src.glob("*.rs"))], "file")
    lines += ["## Scripts", ""]
    for folder in SCRIPTS:
        files = sorted(p for p in (ROOT / folder).iterdir() if p.suffix in (".py", ".sh"))
        lines += [f"### `{folder}/`", ""]
        lines += _table([(p.name, describe(p)) for p in files], "file")
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str]) -> int:
    try:
        text = page()
    except MissingDoc as e:
        print(f"layout_page: {e}", file=sys.stderr)
        return 2
    if argv == ["--check"]:
        if PAGE.read_text(encoding="utf-8") != text:
            print(
                f"layout_page: {PAGE.relative_to(ROOT)} is not current; run "
                "`python scripts/layout_page.py`",
                file=sys.stderr,
            )
            return 1
        return 0
    if argv:
        print("usage: python scripts/layout_page.py [--check]", file=sys.stderr)
        return 2
    PAGE.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

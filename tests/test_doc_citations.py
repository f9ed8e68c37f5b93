"""Every document the code and the docs cite is in the repository.

A clone has only what is committed: a docstring, comment or page that points the reader at
a document must point at a file of the repository (and, where it names a section, at a
heading of that file). This test scans the sources and the documentation for:

- citations of a design document kept outside the repository (`DESIGN`, `DESIGN.md`,
  a `.md` file under `shared/`): the repository holds its own design, under docs/;
- repository paths of pages, `docs/....md`: the file must exist (a page that the docs
  build generates, such as the configuration and metrics references, exists only in the
  built site, so a path citation must name a committed page or the generator);
- Markdown links to `.md` files: relative to the linking file; inside docs/ a link may
  also reach a page the build generates (`scripts/docs_hooks.py`, `on_files`);
- a cited section, `docs/x.md, 'Title'` or `README "Title"`: a heading of that page (of
  the top-level README.md for a bare README) must start with the title.

No docs build is needed: this runs in a fraction of a second.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCAN_DIRS = ("arpo", "envs", "benchmarks", "scripts", "tests", "docs", "examples", "rust_buffer")
SCAN_FILES = ("README.md", "Makefile", "mkdocs.yml", "pyproject.toml", ".ci/run")
SUFFIXES = {".py", ".pyi", ".md", ".toml", ".yml", ".yaml", ".rs", ".sh", ".txt", ".cfg"}
SKIP_DIRS = {"__pycache__", "target", ".venv", "node_modules", ".pytest_cache", "site"}
MAX_BYTES = 2_000_000

FORBIDDEN = re.compile(r"\bDESIGN\b|(?<![\w.-])shared/[\w./-]*\.md\b")
DOC_PATH = re.compile(r"(?<![\w/.-])(docs/[\w./-]*?\.md)\b")
MD_LINK = re.compile(r"\]\(\s*<?([^)\s>#]+?\.md)(?:#[^)\s>]*)?>?(?:\s+\"[^\"]*\")?\s*\)")
DOC_SECTION = re.compile(r"(?<![\w/.-])(docs/[\w./-]*?\.md),\s+['\"]([A-Z`][^'\"\n]*)['\"]")
README_SECTION = re.compile(r"\bREADME(?:\.md)?(?:'s)?,?\s+\"([A-Z`][^\"\n]*)\"")


def _sources() -> list[Path]:
    me = Path(__file__).resolve()
    out: list[Path] = []
    for name in SCAN_FILES:
        p = ROOT / name
        if p.is_file():
            out.append(p)
    for d in SCAN_DIRS:
        for p in sorted((ROOT / d).rglob("*")):
            rel = p.relative_to(ROOT).parts
            if any(part in SKIP_DIRS or part.startswith(".") for part in rel[:-1]):
                continue
            ok = p.is_file() and p.suffix in SUFFIXES and p.resolve() != me
            if ok and p.stat().st_size <= MAX_BYTES:
                out.append(p)
    return out


def generated_pages() -> set[str]:
    """Pages (relative to docs/) that `scripts/docs_hooks.py` adds at build time."""
    text = (ROOT / "scripts" / "docs_hooks.py").read_text(encoding="utf-8")
    body = text[text.index("def on_files(") :]
    pages = set(re.findall(r"\"([\w/.-]+\.md)\"\s*:", body))
    assert pages, "no generated page found in scripts/docs_hooks.py's on_files"
    if "results/files/" in body:  # every results file is copied there
        pages |= {f"results/files/{p.name}" for p in (ROOT / "benchmarks" / "results").glob("*.md")}
    return pages


def _norm(title: str) -> str:
    return " ".join(title.replace("`", "").replace("*", "").split()).strip().lower()


def headings(page: Path) -> list[str]:
    """The Markdown headings of a page, code blocks left out."""
    out: list[str] = []
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            out.append(_norm(m.group(1)))
    return out


def _has_section(page: Path, title: str) -> bool:
    want = _norm(title.rstrip(".,;:"))
    return any(h.startswith(want) for h in headings(page))


def citation_problems() -> list[str]:
    generated = generated_pages()
    problems: list[str] = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        in_docs = rel.startswith("docs/")
        for n, line in enumerate(text.splitlines(), 1):
            where = f"{rel}:{n}"
            if m := FORBIDDEN.search(line):
                problems.append(
                    f"{where}: cites {m.group(0)!r}, a document outside the repository "
                    "(cite the page under docs/ that says it)"
                )
            for m in DOC_PATH.finditer(line):
                cited = m.group(1)
                if not (ROOT / cited).is_file():
                    why = (
                        "a page the docs build generates (it is not in a clone): cite its "
                        "source or a committed page"
                        if cited.removeprefix("docs/") in generated
                        else "no such file"
                    )
                    problems.append(f"{where}: cites {cited}: {why}")
            for m in DOC_SECTION.finditer(line):
                cited, title = m.group(1), m.group(2)
                if (ROOT / cited).is_file() and not _has_section(ROOT / cited, title):
                    problems.append(f"{where}: {cited} has no section {title!r}")
            for m in README_SECTION.finditer(line):
                if not _has_section(ROOT / "README.md", m.group(1)):
                    problems.append(
                        f"{where}: README.md has no section {m.group(1)!r} (it moved under docs/?)"
                    )
            if path.suffix != ".md":
                continue
            for m in MD_LINK.finditer(line):
                target = m.group(1)
                if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
                    continue  # a URL or an absolute path: not a repository page
                resolved = (path.parent / target).resolve()
                if resolved.is_file():
                    continue
                if in_docs:
                    try:
                        site_rel = resolved.relative_to(ROOT / "docs").as_posix()
                    except ValueError:
                        site_rel = ""
                    if site_rel in generated:
                        continue
                problems.append(f"{where}: links {target}, which does not exist")
    return problems


def test_every_cited_document_is_in_the_repository() -> None:
    problems = citation_problems()
    assert not problems, "\n".join(problems)


def test_the_scan_sees_the_generated_pages_and_the_sources() -> None:
    generated = generated_pages()
    assert {"reference/config.md", "reference/metrics.md"} <= generated
    names = {p.relative_to(ROOT).as_posix() for p in _sources()}
    assert {"README.md", "arpo/learner/loss.py", "docs/concepts/index.md"} <= names


def test_the_patterns_catch_what_they_are_for() -> None:
    assert FORBIDDEN.search("(DESIGN section 4)") and FORBIDDEN.search("see `shared/DESIGN.md`")
    assert not FORBIDDEN.search("load_tasks('shared/osworld/evaluation_examples')")
    assert not FORBIDDEN.search("the design of the store")
    assert DOC_PATH.findall("see docs/concepts/learner.md.") == ["docs/concepts/learner.md"]
    assert not DOC_PATH.findall("https://github.com/x/y/blob/main/docs/a.md")
    assert DOC_SECTION.findall("(docs/guides/own-model.md, 'The reader')") == [
        ("docs/guides/own-model.md", "The reader")
    ]
    assert README_SECTION.findall('README "Diagnosing online learning"') == [
        "Diagnosing online learning"
    ]
    assert MD_LINK.findall("[m](../reference/metrics.md#top) [u](https://x.org/a.md)") == [
        "../reference/metrics.md",
        "https://x.org/a.md",
    ]

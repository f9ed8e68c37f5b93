"""The house's layout: every dependency among arpo/ and envs/arpo_envs/ modules runs one way,
the environment package imports nothing of the trainer, and the layout page lists every module.

Read from the source with `ast`, nothing imported. Every import statement counts, wherever it
is: at the top, inside a function (a lazy import is still a dependency) and under
`if TYPE_CHECKING:` (a type-only circle still means neither module can be read alone).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (ROOT / "arpo", ROOT / "envs" / "arpo_envs")


def _modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the two packages."""
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted(pkg.rglob("*.py")):
            parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a name inside a module maps to that module)."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        names: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                names += [f"{base}.{a.name}" for a in node.names]
        graph[mod] = {t for n in names if (t := resolve(n)) is not None and t != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_every_kind_of_import() -> None:
    g = import_graph()
    assert {"arpo.policy.engine_hf", "arpo.policy.engine_vllm"} <= g["arpo.policy.engines"]
    assert "arpo.policy.engine" in g["arpo.policy.engine_hf"]
    assert "arpo_envs.sim.widgets" in g["arpo_envs.sim.desktop"]
    assert "arpo_envs.sim.host" in g["arpo_envs.sim.widgets"]
    # the checker itself finds a circle, including a lazy or type-only edge
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles_among_project_modules() -> None:
    found = cycles(import_graph())
    assert not found, (
        "modules that import each other (directly or around a circle); move what they share "
        f"into a module below them or the factory into one above: {found}"
    )


# (importer, imported, allowed, why): no module of the package `importer` imports a module of
# the package `imported`, except the modules in `allowed`.
ONE_WAY = [
    ("arpo.service", "arpo.learner", (), "the services serve the learner and the pool runs"),
    ("arpo.service", "arpo.pool", (), "the services serve the learner and the pool runs"),
    ("arpo.learner", "arpo.pool", (), "training reads task pools, selections and collections "
     "through arpo.env.task and arpo.service.journal, not through the runs that write them"),
    ("arpo.pool", "arpo.learner", ("arpo.learner.checkpoint",),
     "a pool run reads the checkpoints it evaluates, and nothing of training"),
]  # fmt: skip


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_services_the_learner_and_the_pool_runs_import_one_way() -> None:
    g = import_graph()
    # the rules see what they are about
    assert {"arpo.service.grants", "arpo.service.ingest", "arpo.service.journal"} <= g[
        "arpo.learner.learner"
    ]
    assert {"arpo.service.grants", "arpo.service.ingest"} <= g["arpo.pool.rollouts"]
    assert "arpo.learner.checkpoint" in g["arpo.pool.rollouts"]
    broken = [
        f"{mod} imports {dep} ({why})"
        for importer, imported, allowed, why in ONE_WAY
        for mod, deps in sorted(g.items())
        if _inside(mod, importer)
        for dep in sorted(deps)
        if _inside(dep, imported) and dep not in allowed
    ]
    assert not broken, broken


# (importer, imported, why): no module of the environment kind `importer` imports a module of
# the kind `imported`. What two kinds share lies below both, in arpo_envs' top-level modules.
KINDS_APART = [
    ("arpo_envs.sim", "arpo_envs.desktop", "the simulated desktop runs without X or the desktop "
     "extra; what it shares with the local desktop is in arpo_envs.png and arpo_envs.a11y"),
    ("arpo_envs.desktop", "arpo_envs.sim", "the local desktop is no client of the simulated one; "
     "what it shares with it is in arpo_envs.png and arpo_envs.a11y"),
    ("arpo_envs.sim", "arpo_envs.vm", "the simulated desktop knows no VMs"),
    ("arpo_envs.vm", "arpo_envs.sim", "the VM fleet runs real desktops, never simulated ones"),
]  # fmt: skip


def crossings(graph: dict[str, set[str]]) -> list[str]:
    """Every import of one environment kind by another that KINDS_APART forbids."""
    return [
        f"{mod} imports {dep} ({why})"
        for importer, imported, why in KINDS_APART
        for mod, deps in sorted(graph.items())
        if _inside(mod, importer)
        for dep in sorted(deps)
        if _inside(dep, imported)
    ]


def test_the_environment_kinds_import_nothing_of_each_other() -> None:
    g = import_graph()
    # the rule sees what the kinds share below them, and an import of one kind by another
    assert {"arpo_envs.a11y", "arpo_envs.png"} <= g["arpo_envs.sim.desktop"]
    assert "arpo_envs.png" in g["arpo_envs.desktop.screen"]
    assert "arpo_envs.a11y" in g["arpo_envs.desktop.windows"]
    crossed = {"arpo_envs.sim.desktop": {"arpo_envs.desktop.atspi", "arpo_envs.a11y"}}
    assert crossings(crossed) == [
        "arpo_envs.sim.desktop imports arpo_envs.desktop.atspi (" + KINDS_APART[0][2] + ")"
    ]
    broken = crossings(g)
    assert not broken, broken


def arpo_imports(source: str, filename: str = "<source>") -> list[str]:
    """Every import of the trainer package `arpo` in `source` ("line N: what"), wherever it is:
    at the top, inside a function, under `if TYPE_CHECKING:`, or by name through
    `importlib.import_module` / `__import__`. `arpo_envs` is another package and not counted."""

    def is_arpo(name: str) -> bool:
        return name == "arpo" or name.startswith("arpo.")

    found = []
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if called in ("import_module", "__import__") and isinstance(first, ast.Constant):
                names = [first.value] if isinstance(first.value, str) else []
        found += [f"line {node.lineno}: {n}" for n in names if is_arpo(n)]
    return found


def test_the_checker_sees_lazy_and_indirect_imports_of_arpo() -> None:
    source = (
        "import arpo_envs.sim\nfrom arpo_envs import cli\nfrom . import arpo\n"
        "def f():\n    from arpo.env.fetch import main\n"
        "if TYPE_CHECKING:\n    import arpo.wire\n"
        "importlib.import_module('arpo.record')\n"
    )
    assert arpo_imports(source) == [
        "line 5: arpo.env.fetch",
        "line 7: arpo.wire",
        "line 8: arpo.record",
    ]


def test_the_environment_package_imports_nothing_of_arpo() -> None:
    """`envs/arpo_envs` is installed on environment hosts without the trainer: none of its
    modules may import `arpo`, not even lazily (`arpo` importing `arpo_envs` is fine)."""
    pkg = ROOT / "envs" / "arpo_envs"
    found = [
        f"{path.relative_to(ROOT)} {hit}"
        for path in sorted(pkg.rglob("*.py"))
        for hit in arpo_imports(path.read_text(), str(path))
    ]
    assert len(list(pkg.rglob("*.py"))) > 20  # the walk sees the package
    assert not found, (
        "envs/arpo_envs imports the trainer package; move the code that needs arpo to arpo/ "
        f"(its command to arpo/cli.py) or what both need into arpo_envs: {found}"
    )


def _layout_page() -> Any:
    spec = importlib.util.spec_from_file_location(
        "layout_page", ROOT / "scripts" / "layout_page.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_layout_page_is_the_generated_one() -> None:
    gen = _layout_page()
    text = gen.page()
    for mod, path in sorted(_modules().items()):
        folder = path.parent.relative_to(ROOT).as_posix()
        name = path.name if path.name != "__init__.py" else f"{path.parent.name}/"
        section = text.split(f"### `{folder}/`", 1)
        assert len(section) == 2, f"{mod}: no section for {folder}/ on the layout page"
        if path.name != "__init__.py":
            assert f"| `{name}` |" in section[1].split("\n### ", 1)[0], f"{mod} is not listed"
    assert gen.PAGE.read_text(encoding="utf-8") == text, (
        "docs/reference/layout.md is not what scripts/layout_page.py gives (a module added, "
        "renamed or removed, or a docstring changed): run `python scripts/layout_page.py`"
    )


def test_a_module_without_a_docstring_stops_the_layout_page(tmp_path: Path) -> None:
    gen = _layout_page()
    (tmp_path / "described.py").write_text('"""What it is for. More after."""\n')
    (tmp_path / "bare.py").write_text("X = 1\n")
    gen.ROOT = tmp_path
    assert gen.describe(tmp_path / "described.py") == "What it is for."
    with pytest.raises(gen.MissingDoc, match=r"bare\.py: give it a module docstring"):
        gen.describe(tmp_path / "bare.py")

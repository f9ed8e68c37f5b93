"""The house's import graph: every dependency among arpo/ and envs/arpo_envs/ modules runs one way.

Read from the source with `ast`, nothing imported. Every import statement counts, wherever it
is: at the top, inside a function (a lazy import is still a dependency) and under
`if TYPE_CHECKING:` (a type-only circle still means neither module can be read alone).
"""

from __future__ import annotations

import ast
from pathlib import Path

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

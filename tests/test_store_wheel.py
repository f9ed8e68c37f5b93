"""The replay store stands alone: its wheel installs into a virtualenv that holds only numpy
and runs the embedding example from a folder outside the repository; its sources import
nothing of arpo; the guide shows the example that runs here.

The wheel is built here with the Makefile's command (`maturin build --release -m
rust_buffer/python/Cargo.toml`, into a temporary folder): after `make setup` cargo has
nothing left to compile, so this is packaging only (about a second), and the wheel tested is
always the one the sources give. The virtualenv gets numpy from PyPI, pinned to the version
of this interpreter (pip's cache makes it a few seconds): about 10 s in all.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
STORE = ROOT / "rust_buffer"
PACKAGE = STORE / "python" / "arpo_buffer"
EXAMPLE = ROOT / "examples" / "embed_store.py"
GUIDE = ROOT / "docs" / "guides" / "replay-store.md"


def _run(cmd: list[str | Path], **kw: Any) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))}: exit {proc.returncode}\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
    return proc


def _clean_env() -> dict[str, str]:
    """This environment without what would point a child at .venv or the repository."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    manifest = STORE / "python" / "Cargo.toml"
    cmd = [sys.executable, "-m", "maturin", "build", "--release", "-q", "-m", manifest, "-o", out]
    _run(cmd, cwd=ROOT, timeout=900)
    (built,) = out.glob("arpo_buffer-*.whl")
    return built


def test_the_wheel_alone_runs_the_embedding_example(wheel: Path, tmp_path: Path) -> None:
    venv, run = tmp_path / "venv", tmp_path / "run"
    assert ROOT not in run.parents, "the example must run outside the repository"
    _run([sys.executable, "-m", "venv", venv], timeout=120)
    py = venv / "bin" / "python"
    env = _clean_env()
    _run(
        [py, "-m", "pip", "install", "-q", wheel, f"numpy=={np.__version__}"], env=env, timeout=300
    )

    freeze = _run([py, "-m", "pip", "freeze", "--all"], env=env, timeout=60).stdout.splitlines()
    installed = {re.split("[=@ ]", x, maxsplit=1)[0].lower().replace("_", "-") for x in freeze}
    assert installed - {"pip", "setuptools", "wheel"} == {"arpo-buffer", "numpy"}, freeze

    run.mkdir()
    shutil.copy(EXAMPLE, run)
    # -I: no PYTHON* variables, no user site, no script folder on sys.path
    where = _run(
        [py, "-I", "-c", "import importlib.util as u, arpo_buffer as b; "
         "print(u.find_spec('arpo')); print(b.__file__)"],
        cwd=run, env=env, timeout=60,
    ).stdout.split()  # fmt: skip
    assert where[0] == "None", "arpo is importable in the store's virtualenv"
    assert Path(where[1]).is_relative_to(venv), where

    proc = _run([py, "-I", "-W", "error", EXAMPLE.name], cwd=run, env=env, timeout=60)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    version = tomllib.loads((ROOT / "Cargo.toml").read_text())["workspace"]["package"]["version"]
    assert out["arpo_buffer"] == version
    assert out["group"] == list(range(8))  # the whole group, oldest first
    assert (out["replay"], out["sampled"]) == (2, 4)
    assert "version >= 8" in out["refused"]
    assert out["restored_same"]
    total = out["total"]
    assert (total["inserts"], total["takes"], total["fresh"], total["replay"]) == (10, 8, 0, 2)
    assert total["samples"] == 4 + 2  # the priority sample and the newest-first read-back


def test_the_store_sources_import_nothing_of_arpo() -> None:
    """Neither the package's Python (its modules and stubs) nor the binding's Rust (which
    imports the exception classes by name) may reach for `arpo`."""
    found = []
    files = sorted(PACKAGE.rglob("*.py")) + sorted(PACKAGE.rglob("*.pyi"))
    assert {p.name for p in files} >= {"__init__.py", "_errors.py", "_native.pyi"}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] == "arpo"]
    rust = sorted(STORE.rglob("*.rs"))
    assert any(p.name == "errors.rs" for p in rust)
    for path in rust:
        for m in re.finditer(r'"arpo[."]', path.read_text()):
            found.append(f"{path.name}: {m[0]}")
    assert not found, f"the replay store's package imports arpo: {found}"


def test_arpo_requires_the_store_of_this_repository() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    version = tomllib.loads((ROOT / "Cargo.toml").read_text())["workspace"]["package"]["version"]
    assert f"arpo-buffer=={version}" in project["dependencies"]
    store = tomllib.loads((STORE / "python" / "pyproject.toml").read_text())["project"]
    assert [re.split("[<>=!~ ]", d)[0] for d in store["dependencies"]] == ["numpy"]


def test_the_guide_shows_the_example_that_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    assert blocks and blocks[0] in EXAMPLE.read_text(), (
        "the first python block of docs/guides/replay-store.md is not in examples/embed_store.py"
    )


def test_arpo_reexports_the_store_and_its_exception_classes(tmp_path: Path) -> None:
    """`arpo.buffer` and `arpo.errors` hand out the package's very classes (so every
    `except` in arpo catches what the store raises), and the commands' `ERRORS` holds them."""
    import arpo_buffer

    import arpo.buffer
    import arpo.errors

    names = ["BufferError", "BufferValueError", "BufferTimeout", "BufferClosed"]
    for name in [*names, "UnknownTask", "SnapshotError"]:
        cls = getattr(arpo_buffer, name)
        assert getattr(arpo.buffer, name) is cls and getattr(arpo.errors, name) is cls, name
    assert arpo.buffer.ReplayStore is arpo_buffer.ReplayStore
    assert arpo.buffer.Item is arpo_buffer.Item
    with pytest.raises(arpo.errors.ERRORS) as exc:
        arpo.buffer.ReplayStore.restore(tmp_path / "missing.snap")
    assert isinstance(exc.value, arpo.errors.SnapshotError)
    assert type(exc.value).__module__ == "arpo_buffer._errors"

"""The documentation site builds in strict mode (a broken link or a missing page fails), and its
reference pages, generated from the code, hold every config field and every metric."""

from __future__ import annotations

import html as html_lib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("mkdocs")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    p = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-5000:]
    assert "WARNING" not in p.stderr, p.stderr[-5000:]
    return out


def _text(site: Path, page: str) -> str:
    html = (site / page / "index.html").read_text(encoding="utf-8")
    return html_lib.unescape(html.replace("<code>", "").replace("</code>", ""))


def test_every_config_field_is_on_the_generated_reference(site: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import docs_hooks
    finally:
        sys.path.pop(0)
    page = _text(site, "reference/config")
    for _, ref in docs_hooks.CONFIGS:
        fields = docs_hooks.config_fields(docs_hooks._load(ref))
        assert fields, ref
        for name, _, _, doc in fields:
            assert name in page, (ref, name)
            assert doc.strip(), f"{ref}: field {name} has no documentation"


def test_every_metric_and_message_kind_is_on_the_reference(site: Path) -> None:
    from arpo import wire
    from arpo.learner.metrics import STANDARD_METRICS

    metrics = _text(site, "reference/metrics")
    for name in STANDARD_METRICS:
        assert name in metrics, name
    wire_page = _text(site, "reference/wire")
    for k in (k for k in vars(wire) if k.startswith("KIND_")):
        assert k in wire_page, k
    cli = _text(site, "reference/cli")
    assert "arpo train" in cli and "arpo-envs" in cli


def test_every_fleet_record_and_field_is_on_the_generated_reference(site: Path) -> None:
    from arpo_envs import fleet_records

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import docs_hooks
    finally:
        sys.path.pop(0)
    page = " ".join(re.sub(r"<[^>]+>", " ", _text(site, "reference/fleet")).split())
    assert f"records version {fleet_records.VERSION}" in page
    for cls in (*fleet_records.MESSAGES, *fleet_records.PARTS):
        assert cls.__name__ in page, cls
        for name, tname, doc in docs_hooks.record_fields(cls):
            assert doc.strip(), f"{cls.__name__}.{name} has no documentation"
            assert f"{name} {tname}" in page, (cls, name)  # its row


def test_the_readme_is_a_front_door(site: Path) -> None:
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) < 250, len(lines)
    first_screen = "\n".join(lines[:40])
    assert "make demo" in first_screen and "make test" in first_screen
    assert "own-model" in first_screen and "docs/" in first_screen
    # .ci/run calls exactly the README's test command
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert shutil.which("make")

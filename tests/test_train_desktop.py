"""A short training run on real local desktops only (Xvfb + openbox + LibreOffice Calc, mousepad,
xterm): the real environment path end to end, as a smoke test (slow: `make test-all`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from train_configs import small_run

from arpo.learner.metrics import read_metrics
from arpo.policy.tiny import build_tiny_model
from arpo.train import TrainRun

MISSING = [b for b in ("Xvfb", "openbox", "soffice", "mousepad", "xterm") if not shutil.which(b)]


@pytest.mark.slow
@pytest.mark.skipif(bool(MISSING), reason=f"desktop programs missing: {MISSING} (make sysdeps)")
def test_training_run_on_real_local_desktops(tmp_path: Path) -> None:
    import json

    import arpo_envs.tasks as suite

    local = Path(suite.__file__).parent / "local"
    tasks = tmp_path / "tasks"
    for domain in ("text_editor", "os"):
        shutil.copytree(local / domain, tasks / domain)
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    cfg = small_run(tmp_path, model, tasks, actors=0, local_desktops=2, minutes=0)
    result = TrainRun(cfg).run()
    print(json.dumps(result, indent=1))
    rows = read_metrics(Path(cfg.run_dir) / "learner" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["data/groups"] == 2 for r in rows)
    acc = result["accounting"]
    assert acc["unaccounted"] == 0 and acc["trained_twice"] == 0
    assert acc["finished_by_status"].get("ok", 0) >= 8
    assert result["checkpoint"] and Path(result["plot"]).exists()

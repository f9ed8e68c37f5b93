"""Resume with `checkpoint.verify = false` after a digit flipped in the newest checkpoint's
model config or processor config: the learner resumes from the checkpoint before and logs
why, whatever finds the damage (the sha256 of the small files, which `verify = false` still
checks, or the config, processor and weight shapes loaded before the model itself).

Two real checkpoints of the tiny Qwen2.5-VL written by a real learner (no training step
needed: `Learner.save_checkpoint` at iterations 1 and 2).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
from arpo_envs.sim.tasks import generate_tasks

from arpo.learner.assemble import AssembleConfig
from arpo.learner.checkpoint import CheckpointConfig, check_model_dir, verify_checkpoint
from arpo.learner.learner import Learner, LearnerConfig
from arpo.learner.metrics import MetricsConfig
from arpo.learner.trainer import TrainerConfig
from arpo.policy.tiny import build_tiny_model
from arpo.transport import TransportConfig


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(run folder holding ckpt-00000001 and ckpt-00000002, task pool)."""
    root = tmp_path_factory.mktemp("fallback")
    tiny = build_tiny_model(root / "tiny", seed=0)
    pool = root / "tasks.json"
    pool.write_text(json.dumps(generate_tasks("click_button", 2, seed=3)))
    learner = Learner(config(root / "run", tiny, pool, resume=False))
    learner.setup()
    try:
        for it in (1, 2):
            learner.iteration = learner.version = it
            learner.save_checkpoint()
    finally:
        learner.close()
    return root, pool


def config(run: Path, tiny: Path, pool: Path, *, resume: bool) -> LearnerConfig:
    return LearnerConfig(
        run_dir=str(run),
        tasks=str(pool),
        resume=resume,
        trainer=TrainerConfig(model=str(tiny), lr=1e-4),
        assemble=AssembleConfig(group_size=2, groups_per_step=1, max_staleness=1),
        transport=TransportConfig(data="tcp://127.0.0.1:0", control="tcp://127.0.0.1:0"),
        checkpoint=CheckpointConfig(every=1, keep=3, verify=False),
        metrics=MetricsConfig(progress_s=0, tensorboard=False),
    )


def flip(path: Path, old: str, new: str) -> None:
    """Replace one digit of a JSON file (one occurrence, same size)."""
    text = path.read_text()
    assert text.count(old) == 1 and len(old) == len(new), (path, old)
    path.write_text(text.replace(old, new))


def match_manifest(ckpt: Path, rel: str) -> None:
    """Rewrite the manifest entry of `rel` to the damaged file (what no hash can then see)."""
    man = ckpt / "MANIFEST.json"
    m = json.loads(man.read_text())
    data = (ckpt / rel).read_bytes()
    m["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    man.write_text(json.dumps(m))


@pytest.mark.parametrize(
    "rel, old, new, manifest, reason",
    [
        # num_hidden_layers 2 -> 3: transformers' strict config check refuses it
        # (StrictDataclassClassValidationError stopped the resume before).
        (
            "model/config.json",
            '"num_hidden_layers": 2',
            '"num_hidden_layers": 3',
            False,
            "sha256 differs from the manifest",
        ),
        (
            "model/config.json",
            '"num_hidden_layers": 2',
            '"num_hidden_layers": 3',
            True,
            "StrictDataclassClassValidationError",
        ),
        # a shape the weights do not have: the config loads, the weights would not
        (
            "model/config.json",
            '"intermediate_size": 512',
            '"intermediate_size": 612',
            True,
            "do not have the shapes config.json describes",
        ),
        # a flipped digit in the processor's config
        (
            "model/processor_config.json",
            "Qwen2VLImageProcessor",
            "Qwen3VLImageProcessor",
            True,
            "the processor does not load",
        ),
        # a digit that loads without an error as another model: only its hash can tell
        (
            "model/config.json",
            '"rms_norm_eps": 1e-05',
            '"rms_norm_eps": 1e-06',
            False,
            "sha256 differs from the manifest",
        ),
    ],
    ids=["layers-hash", "layers-config", "shapes", "processor", "silent-eps"],
)
def test_a_flipped_digit_in_the_newest_config_falls_back_to_the_one_before(
    tmp_path: Path,
    checkpoints: tuple[Path, Path],
    caplog: pytest.LogCaptureFixture,
    rel: str,
    old: str,
    new: str,
    manifest: bool,
    reason: str,
) -> None:
    src, pool = checkpoints
    run = tmp_path / "run"
    shutil.copytree(src / "run", run)
    newest = run / "checkpoints" / "ckpt-00000002"
    flip(newest / rel, old, new)
    if manifest:
        match_manifest(newest, rel)
        verify_checkpoint(newest, hashes=True)  # the manifest alone cannot tell any more
    learner = Learner(config(run, src / "tiny", pool, resume=True))
    with caplog.at_level(logging.WARNING, logger="arpo.learner"):
        learner.setup()
    try:
        assert learner.iteration == 1 and learner.version == 1
    finally:
        learner.close()
    warning = next(r.getMessage() for r in caplog.records if "ckpt-00000002" in r.getMessage())
    assert "does not load" in warning and "trying the one before" in warning, warning
    assert reason in warning, warning


def test_check_model_dir_passes_an_intact_model(checkpoints: tuple[Path, Path]) -> None:
    src, _ = checkpoints
    check_model_dir(src / "run" / "checkpoints" / "ckpt-00000002" / "model")
    check_model_dir(src / "tiny")

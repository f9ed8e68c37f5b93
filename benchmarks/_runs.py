"""What the experiment scripts read of a finished `arpo train` run."""

from __future__ import annotations

from pathlib import Path


def final_checkpoint(run_dir: Path) -> Path:
    """The last checkpoint of the run's learner (not re-hashed: the run just wrote it);
    SystemExit naming the run's logs when it wrote none."""
    from arpo.learner.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run_dir / "learner" / "checkpoints", verify=False)
    if ckpt is None:
        raise SystemExit(f"{run_dir}: no checkpoint; see {run_dir / 'logs'}")
    return ckpt


def model_to_evaluate(run_dir: Path, eval_dir: Path) -> Path | None:
    """The final checkpoint's model folder, or None when `eval_dir` holds a finished
    evaluation (`eval.json`): the evaluation is read back, and the run's checkpoints may have
    been deleted to free the disk."""
    if (eval_dir / "eval.json").exists():
        return None
    return final_checkpoint(run_dir) / "model"

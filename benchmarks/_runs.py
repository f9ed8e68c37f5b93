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

"""GRPO groups and ARPO's replay of successes.

Group advantage (docs/concepts/method.md): A_i = (R_i - mean_g R) / (std_g R + eps), with
eps = 1e-6 and the sample standard deviation (Bessel-corrected, as `torch.std` in
the reference's verl code; 0 for a group of one); `norm_std=False` drops the
division (Dr. GRPO).

Replay (the reference's rule, the default here): a group whose **checker scores**
have population std (`np.std`, ddof 0) < 0.05 and mean < 0.2 (every episode
failed) gets one success of the same task, picked uniformly from that task's
replay buffer, in place of one fresh episode. The trigger reads the checker
scores, not the total reward: a group of failures in which one response did not
parse (rewards [0]*7 + [-0.5], checker scores all 0) is replayed into, and so is
a group with one partial score ([0.15] + [0]*7: population std 0.0496). The
advantages are still computed on the total rewards. Successes with checker score
> 0.1 enter the per-task buffer (capacity 8, FIFO, kept by the replay store)
after the pick, so a group never gets its own success back as its replay.
Variants: add instead of replace, k successes, newest first, and buffers pre-filled
with the successes of the task-selection run (`prefill`; the reference has this step
commented out).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from arpo.config import check_range, fail, option


@dataclass
class ReplayConfig:
    """When and how past successes are put into a group."""

    enabled: bool = option(True, "Replay stored successes into groups that have none.")
    std_below: float = option(
        0.05, "Trigger only when the population std of the group's checker scores is below this."
    )
    mean_below: float = option(
        0.2, "Trigger only when the mean of the group's checker scores is below this."
    )
    admit_score_above: float = option(
        0.1, "Checker score above which an episode enters the buffer."
    )
    capacity: int = option(8, "Successes kept per task (FIFO).")
    k: int = option(1, "Successes put into a triggered group.")
    mode: Literal["replace", "add"] = option(
        "replace", "'replace' swaps out fresh episodes (the reference); 'add' appends."
    )
    pick: Literal["uniform", "newest"] = option(
        "uniform", "How successes are picked from the buffer."
    )
    prefill: str = option(
        "",
        "Successes to start the buffers with: a folder of kept episodes (the `trajectories` "
        "of `arpo select-tasks`, or an `arpo collect` folder); those of the training tasks "
        "with checker score > admit_score_above enter their task's buffer before the first "
        "step (a fresh start only: a resume restores the buffers of its checkpoint). "
        "'' = start empty (the reference).",
    )

    def admits(self, status: str, checker_score: float) -> bool:
        """Whether an episode enters its task's buffer: `ok` and checker score above
        `admit_score_above` (the assembler's rule, and the pre-fill's)."""
        return status == "ok" and checker_score > self.admit_score_above

    def validate(self) -> None:
        if self.capacity < 1:
            fail("capacity", "must be at least 1")
        for name in ("std_below", "mean_below", "admit_score_above"):
            check_range(name, getattr(self, name), 0.0, 1.0, "a checker score or its spread")
        if self.k < 1:
            fail("k", "must be at least 1 (disable replay with enabled = false)")
        if self.prefill and not Path(self.prefill).is_dir():
            fail(
                "prefill",
                f"{self.prefill!r} is not a folder; give the `trajectories` folder of an "
                "`arpo collect` or `arpo select-tasks` run",
            )


def advantages(
    rewards: Sequence[float] | np.ndarray, *, norm_std: bool = True, eps: float = 1e-6
) -> np.ndarray:
    """Group-relative advantages of one group's rewards (float32)."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.size == 0:
        return np.zeros(0, np.float32)
    a = r - r.mean()
    if norm_std:
        a = a / ((r.std(ddof=1) if r.size > 1 else 0.0) + eps)
    return a.astype(np.float32)


def needs_replay(checker_scores: Sequence[float] | np.ndarray, cfg: ReplayConfig) -> bool:
    """The reference trigger: every episode of the group failed, read from the checker
    scores (not the total rewards) with the population std, as `np.std` does."""
    r = np.asarray(checker_scores, dtype=np.float64)
    return bool(
        cfg.enabled and r.size and r.std(ddof=0) < cfg.std_below and r.mean() < cfg.mean_below
    )

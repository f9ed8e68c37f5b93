"""The learner's training step (`arpo.learner.trainer.Trainer.step`) on one process or under
torchrun; tests/test_trainer_dist.py compares what rank 0 writes.

    python tests/trainer_dist_worker.py --model M --out OUT.pt
    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        tests/trainer_dist_worker.py --model M --out OUT.pt --strategy fsdp2

The batch: 6 trajectories of two groups with real prompts (one or two 1920x1080-shaped
screenshots each), random responses, behaviour log-probs 0.3 below the model's own (so
the importance weights are not 1), one replayed success; 2 optimizer steps of 3
trajectories, micro-batches of 2 (so one rank of two runs a zero-scaled repeat).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from arpo import store_item
from arpo.learner.assemble import Sample
from arpo.learner.batch import build_sequence
from arpo.learner.distributed import DistConfig, init_distributed, shutdown
from arpo.learner.groups import advantages
from arpo.learner.trainer import Trainer, TrainerConfig
from arpo.synthetic import (
    random_response,
    screenshot_png,
    synthetic_trajectory,
    with_logprobs,
)

# The third group is flat (advantage 0): skipped, on one rank all of its mini-batch share.
REWARDS = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]


def make_samples(maker: Trainer) -> list[Sample]:
    rng = np.random.default_rng(0)
    proc = maker.processor
    out = []
    for i, r in enumerate(REWARDS):
        turns = 1 + i % 2
        traj = synthetic_trajectory(
            proc,
            f"task {i // 3}",
            screenshots=[screenshot_png(rng, 320 + 40 * t, 180) for t in range(turns)],
            responses=[random_response(rng, proc.tokenizer, 5 + 2 * i + t) for t in range(turns)],
            reward=r,
            task_id=f"t{i // 3}",
        )
        item = store_item.to_item(traj)
        (lp,) = maker.proximal([build_sequence(item, proc, maker.image_token_id)])
        traj = with_logprobs(traj, lp.numpy() - 0.3)
        out.append(Sample(store_item.to_item(traj), traj.task_id, traj.trajectory_id, r, r, 0, 0.0,
                          i == 5, i // 3))  # fmt: skip
    for g in range(len(REWARDS) // 3):
        adv = advantages(REWARDS[3 * g : 3 * g + 3])
        for k in range(3):
            out[3 * g + k].advantage = float(adv[k])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--strategy", default="fsdp2")
    args = ap.parse_args()
    cfg = TrainerConfig(model=args.model, lr=1e-5, micro_batch=2, optimizer_steps=2)
    samples = make_samples(Trainer(cfg))  # the same on every rank (deterministic)
    info = init_distributed(DistConfig(strategy=args.strategy, backend="gloo"))
    trainer = Trainer(cfg, info)
    metrics = trainer.step(samples)
    state = trainer.state_dict()
    optim = trainer.optimizer_state()
    if info.is_main:
        torch.save({"metrics": metrics, "state": state, "optim_keys": sorted(optim["state"])},
                   args.out)  # fmt: skip
    shutdown(info)


if __name__ == "__main__":
    main()

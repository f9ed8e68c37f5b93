"""Embedding the replay store in a small Gymnasium + PyTorch loop.

    .venv/bin/python examples/embed_gymnasium.py            # about 20 s on 2 CPU cores
    .venv/bin/python examples/embed_gymnasium.py --quick    # about 5 s, what the test runs

CartPole-v1 trained the way ARPO trains a GUI agent, scaled down to seconds:

- A task is a fixed initial state (a reset seed), as an OSWorld task is a fixed desktop
  setup. Every iteration runs a group of G episodes per task with the current policy and
  `put`s each finished episode into the store under its task; the learner `take_group`s G
  episodes per task.
- Advantage of episode i: A_i = (R_i - mean_g R) / (std_g R + 1e-6), R = steps survived /
  max_steps; every action of the episode gets A_i.
- Replay of successes: an episode that survives max_steps is a success; it goes to the
  task's replay buffer (`add_success`, priority = R). When a group has no success and the
  task's buffer has one, a success drawn by priority (`sample(..., mode="priority")`)
  replaces the worst episode of the group; its priority is then halved
  (`update_priorities`) so that other successes get their turn.
- Loss: PPO clip around the behaviour log-probs stored with each episode,
  min(r A, clip(r, 1 - 0.2, 1 + 0.3) A) with r = exp(log pi(a|s) - mu), token (step) mean per
  episode, mean over episodes; 2 optimizer steps per iteration. A replayed success
  produced by an older policy is weighted by its true ratio, not by 1.
- At the end the store is snapshotted to disk, restored into a new store, and the
  restored buffer is checked against the live one.

What an episode looks like in the store: actions as `tokens` (int32), behaviour log-probs as
`logprobs`, per-step rewards as `rewards`, `offsets` = [0, T], the policy version that
produced it as `version`, the float32 observations as one blob (kept by reference, never
copied), and the reset seed as JSON `metadata`.

This file imports nothing of arpo: the store's own wheel (`arpo_buffer`, numpy its only
dependency) is all an RL project needs to embed it (docs/guides/replay-store.md). The last line printed is a JSON summary (read by
tests/test_example_embed.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from arpo_buffer import Item, ReplayStore
from torch import nn


@dataclasses.dataclass
class Config:
    """Everything the run depends on; `--quick` shrinks it to a smoke run."""

    env_id: str = "CartPole-v1"
    """Gymnasium environment id; it is also the prefix of every task id."""
    task_seeds: tuple[int, ...] = (1, 2, 3, 4)
    """One task per reset seed: the fixed initial state of the task."""
    group_size: int = 8
    """Episodes per task and iteration (G)."""
    iterations: int = 40
    """Learner iterations; each one takes a group per task and does `updates_per_iter` steps."""
    updates_per_iter: int = 2
    """Optimizer steps per iteration on the same batch (the ratio moves away from 1)."""
    max_steps: int = 500
    """Episode length cap; surviving to it is a success."""
    lr: float = 1e-2
    """Adam learning rate."""
    clip_low: float = 0.2
    """PPO ratio clip below 1."""
    clip_high: float = 0.3
    """PPO ratio clip above 1."""
    replay_capacity: int = 8
    """Successes kept per task (ARPO's reference value)."""
    eval_episodes: int = 10
    """Greedy evaluation episodes at the end, and random-policy episodes on the same seeds."""
    seed: int = 0
    """Seed of torch (weights, action sampling)."""

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(
                f"group_size must be >= 2 for a group advantage, got {self.group_size}"
            )
        if not self.task_seeds:
            raise ValueError("task_seeds is empty: give at least one reset seed, e.g. (1,)")
        if self.iterations < 1 or self.updates_per_iter < 1:
            raise ValueError("iterations and updates_per_iter must be >= 1")

    def task(self, seed: int) -> str:
        return f"{self.env_id}/seed={seed}"


QUICK = dict(iterations=15, max_steps=100, eval_episodes=5)


class Policy(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, 64), nn.Tanh(), nn.Linear(64, n_actions))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.net(obs), dim=-1)


def run_group(
    envs: list[gym.Env], policy: Policy, seed: int, gen: torch.Generator
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """G episodes from the same initial state, stepped in lock-step with one batched forward.

    Returns per episode (observations [T, obs_dim] float32, actions [T] int32, log-probs [T]).
    """
    obs = [env.reset(seed=seed)[0] for env in envs]
    trace: list[tuple[list, list, list]] = [([], [], []) for _ in envs]
    alive = list(range(len(envs)))
    with torch.no_grad():
        while alive:
            batch = torch.as_tensor(np.stack([obs[i] for i in alive]), dtype=torch.float32)
            logp = policy(batch)
            actions = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
            chosen = logp.gather(1, actions[:, None]).squeeze(1)
            still = []
            for j, i in enumerate(alive):
                a = int(actions[j])
                trace[i][0].append(obs[i])
                trace[i][1].append(a)
                trace[i][2].append(float(chosen[j]))
                obs[i], _, terminated, truncated, _ = envs[i].step(a)
                if not (terminated or truncated):
                    still.append(i)
            alive = still
    return [
        (np.asarray(o, np.float32), np.asarray(a, np.int32), np.asarray(lp, np.float32))
        for o, a, lp in trace
    ]


def to_item(obs: np.ndarray, actions: np.ndarray, logprobs: np.ndarray, version: int, seed: int):
    t = len(actions)
    return Item(
        actions,
        logprobs,
        np.array([0, t], np.int32),
        np.ones(t, np.float32),
        version,
        blobs=(obs.tobytes(),),
        metadata=json.dumps({"seed": seed}).encode(),
    )


def episode_return(item: Item, max_steps: int) -> float:
    return float(np.sum(item.rewards)) / max_steps


def loss_fn(policy: Policy, items: list[Item], adv: np.ndarray, cfg: Config) -> torch.Tensor:
    """PPO clip around the stored behaviour log-probs; step mean per episode, then mean."""
    lengths = [len(it.tokens) for it in items]
    obs = torch.from_numpy(
        np.concatenate([np.frombuffer(it.blobs[0], np.float32) for it in items]).reshape(-1, 4)
    )
    actions = torch.from_numpy(np.concatenate([it.tokens for it in items]).astype(np.int64))
    mu = torch.from_numpy(np.concatenate([it.logprobs for it in items]))
    a = torch.from_numpy(np.repeat(adv.astype(np.float32), lengths))
    logp = policy(obs).gather(1, actions[:, None]).squeeze(1)
    ratio = torch.exp(logp - mu)
    per_step = torch.minimum(ratio * a, ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * a)
    episode = torch.arange(len(items)).repeat_interleave(torch.tensor(lengths))
    per_episode = torch.zeros(len(items)).index_add_(0, episode, per_step) / torch.tensor(lengths)
    return -per_episode.mean()


def evaluate(policy: Policy | None, cfg: Config, episodes: int) -> float:
    """Mean return on seeds 1000.. with the greedy policy, or uniformly random actions."""
    env = gym.make(cfg.env_id, max_episode_steps=cfg.max_steps)
    rng = np.random.default_rng(cfg.seed)
    total = 0.0
    for e in range(episodes):
        obs, _ = env.reset(seed=1000 + e)
        done = False
        while not done:
            if policy is None:
                action = int(rng.integers(env.action_space.n))
            else:
                with torch.no_grad():
                    action = int(policy(torch.as_tensor(obs)[None]).argmax())
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
    env.close()
    return total / episodes


def main(cfg: Config) -> dict:
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)  # tiny model: threads cost more than they give
    gen = torch.Generator().manual_seed(cfg.seed)
    envs = [gym.make(cfg.env_id, max_episode_steps=cfg.max_steps) for _ in range(cfg.group_size)]
    policy = Policy(envs[0].observation_space.shape[0], envs[0].action_space.n)
    initial = [p.detach().clone() for p in policy.parameters()]
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)

    store = ReplayStore(
        max_bytes=256 << 20,
        fresh_capacity=4 * cfg.group_size,
        replay_capacity=cfg.replay_capacity,
        seed=cfg.seed,
    )
    puts = successes_added = replay_hits = updates = steps = 0
    priority: dict[int, float] = {}  # the store's sampling weights, mirrored to halve them
    t0 = time.perf_counter()
    for it in range(cfg.iterations):
        # Actor side: one group per task, every finished episode into the fresh queue.
        for seed in cfg.task_seeds:
            for obs, actions, logprobs in run_group(envs, policy, seed, gen):
                store.put(cfg.task(seed), to_item(obs, actions, logprobs, it, seed))
                puts += 1
                steps += len(actions)

        # Learner side: take each task's group, admit successes, replay when none succeeded.
        batch: list[Item] = []
        advantages: list[np.ndarray] = []
        for seed in cfg.task_seeds:
            task = cfg.task(seed)
            group = store.take_group(task, cfg.group_size, timeout=5.0)
            returns = np.array([episode_return(x, cfg.max_steps) for x in group])
            for x, r in zip(group, returns, strict=True):
                if r >= 1.0:
                    priority[x.key] = float(r)
                    store.add_success(task, x, priority=priority[x.key])
                    successes_added += 1
            # sample() raises BufferValueError when the task's replay buffer is empty.
            if returns.max() < 1.0 and store.replay_len(task) > 0:
                (success,) = store.sample(task, 1, mode="priority")
                worst = int(returns.argmin())
                group[worst], returns[worst] = success, episode_return(success, cfg.max_steps)
                priority[success.key] = 0.5 * priority.get(success.key, 1.0)
                store.update_priorities(task, [success.key], [priority[success.key]])
                replay_hits += 1
            batch += group
            advantages.append((returns - returns.mean()) / (returns.std() + 1e-6))
        adv = np.concatenate(advantages)

        for _ in range(cfg.updates_per_iter):
            loss = loss_fn(policy, batch, adv, cfg)
            opt.zero_grad()
            loss.backward()
            opt.step()
            updates += 1

        mean_r = np.mean([episode_return(x, cfg.max_steps) for x in batch]) * cfg.max_steps
        if it % 5 == 0 or it == cfg.iterations - 1:
            sps = steps / (time.perf_counter() - t0)
            print(
                f"iter {it:3d}  charts/mean_return {mean_r:6.1f}  losses/policy {loss.item():+.4f}"
                f"  replay/hits {replay_hits}  replay/successes {successes_added}  SPS {sps:,.0f}",
                flush=True,
            )
    for env in envs:
        env.close()

    # Checkpoint the store with the model and restore it, as a resumed run would.
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "store.snap"
        store.snapshot(path)
        restored = ReplayStore.restore(path)
        restored_check = {}
        for task in store.tasks():
            n = store.replay_len(task)
            live = store.sample(task, n, mode="newest") if n else []
            back = restored.sample(task, n, mode="newest") if n else []
            same = restored.replay_len(task) == n and all(
                (a.key, a.version, a.blobs, a.metadata) == (b.key, b.version, b.blobs, b.metadata)
                and np.array_equal(a.tokens, b.tokens)
                and np.array_equal(a.logprobs, b.logprobs)
                and np.array_equal(a.rewards, b.rewards)
                for a, b in zip(live, back, strict=True)
            )
            restored_check[task] = {"items": len(back), "identical": same}
        restored.close()
    stats = store.stats()
    store.close()

    change = sum(
        float((p.detach() - q).abs().sum())
        for p, q in zip(policy.parameters(), initial, strict=True)
    )
    summary = {
        "updates": updates,
        "episodes": puts,
        "env_steps": steps,
        "successes_added": successes_added,
        "replay_hits": replay_hits,
        "param_change_l1": change,
        "eval_return": evaluate(policy, cfg, cfg.eval_episodes),
        "random_return": evaluate(None, cfg, cfg.eval_episodes),
        "restored": restored_check,
        "store_stats": stats if isinstance(stats, dict) else repr(stats),
        "seconds": time.perf_counter() - t0,
    }
    return summary


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="CartPole with arpo_buffer as the replay store")
    ap.add_argument("--quick", action="store_true", help="smoke run of a few seconds")
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    overrides = dict(QUICK) if args.quick else {}
    if args.iterations is not None:
        overrides["iterations"] = args.iterations
    summary = main(Config(seed=args.seed, **overrides))
    print(json.dumps(summary, default=str))

"""The learning check: a short, seeded, serial run of the whole ARPO pipeline, and its verdict.

    result = run_check(start(tmp / "start", seed=0), tmp / "run", seed=0)   # -> CheckResult
    assert result.passed, result.report()

What runs, in one process and in a fixed order (the asynchronous system run serially):

- the policy is the tiny Qwen2.5-VL (`arpo-tiny-model`, seed 0, no warm start), and the task
  one simulated `click_button` task (task seed = the check's seed). The policy never solves
  it: every fresh episode ends on a response that does not parse (reward -0.5, checker
  score 0), so every fresh group is flat and ARPO's replay of a success is the only signal;
- the task's replay buffer starts with its oracle demonstration, recorded through the
  episode loop and scored by the starting policy at the rollout temperature (`record_demos`
  + `score_demos`, as `arpo train`'s `prefill_demos`), put in by the learner's own
  `prefill_replay`;
- every iteration, one group of `GROUP` episodes played by the actor's episode loop
  (`run_episode`) on a simulated desktop served in this process, sampled by the transformers
  engine (`HFEngine`) at temperature 1.0. Every request carries its own seed (from the
  check's seed, the iteration, the slot and the turn), and the engine decodes one request at
  a time without its prefix cache, so one seed gives the same episodes, the same batches and
  the same numbers on every run of one commit on one machine;
- the records go into the Rust replay store (`ReplayStore.put`); the group assembler
  (`GroupAssembler`: filters, the replay trigger on checker scores, the pick, advantages)
  takes the group and puts the buffered success in place of one fresh episode; the trainer
  runs the ARPO step (`Trainer.step`: `arpo_loss`, AdamW), and the engine serves the new
  weights as the next version (`update_weights`, as an actor applies published weights);
- the learner settings are `arpo train`'s (lr 1e-4, one optimizer step per iteration, Dr.
  GRPO advantages, replayed successes weighted at least 1: `loss.replay_w_min = 1`), with
  one micro-batch per step (the gradient is the same for any micro-batch: test_trainer).

Why the outcome is not a coin toss: the verdict reads exact quantities, not a handful of
sampled evaluation episodes, and the run is deterministic for a seed. What it asks for lies
far from both the healthy runs and the broken ones: over 20 seeds
(`benchmarks/learning_check_spread.py`, benchmarks/results/learning-check-spread-*.md)
every healthy run passed: the gain read +74 to +101 nats (median +95), at least +13.7 at
every step, and the replayed weight reached 1.81 to 1.96. On 5 seeds each, every broken
learner failed: the sign flipped -93 to -106 nats; a learning rate of 0 and replay never
triggered +0.0; no update after the first step +21 to +32 then +0.0 at each later step;
replayed tokens weighted 1 gained as a healthy learner (+83 to +97) but applied 1.000
where 1.61 to 1.79 was due at the second step. The same seed gave the same numbers twice.

The verdict (`CheckResult.passed`) needs all of:

1. `gain`: the log-probability the policy gives the task's oracle response (a success the
   checker scores 1; teacher-forced, the learner's own scoring) rises by at least `MIN_GAIN`
   nats over the run, and by at least `MIN_STEP_GAIN` at every step. Fails with the
   advantage's sign flipped (it falls), a learning rate of 0 and replay never triggered (it
   stays where it was: the fresh groups are flat, their advantages 0), and a learner that
   stops updating after its first step;
2. `replay`: every step trained the replayed success;
3. `weights`: at every step, the mean importance weight the learner applied to the
   replayed success's tokens (`losses/weight_replay_mean`; one replayed trajectory per
   step, one micro-batch, so the mean is over its tokens) equals clamp(exp(pi_prox - mu),
   replay_w_min, w_max) computed here from the stored behaviour log-probs mu and a
   teacher-forced pass of the policy before the step, within `WEIGHT_TOL`, and at some step
   it is at least `MIN_REPLAY_WEIGHT` (the policy has moved towards the success since the
   starting policy scored it, so the weight is not 1). Fails when replayed tokens are
   weighted 1, whatever the outcome.

What it does not check: the success rate (no fresh episode succeeds in so few iterations;
the success-rate runs are tests/test_learning.py's, in `make test-all`), and learning from
groups that mix successes and failures without replay (the sign of that gradient is
test_loss's and test_trainer's).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

GROUP = 4
"""Episodes per group (`arpo train`'s group size)."""
ITERATIONS = 4
"""Learner iterations of one run (one group each)."""
MAX_NEW_TOKENS = 48
"""Longest response sampled (the oracle's responses are shorter)."""
MIN_GAIN = 20.0
"""Nats the oracle response's log-probability must gain (see the module docstring)."""
MIN_STEP_GAIN = 1.0
"""Nats the oracle response's log-probability must gain at every step."""
MIN_REPLAY_WEIGHT = 1.5
"""The replayed success's mean weight must reach this at some step."""
WEIGHT_TOL = 1e-3
"""Largest difference between the applied and the recomputed mean weight (float32
log-probs of one sequence scored alone or in a padded batch differ by about 1e-6)."""


@dataclass
class CheckResult:
    """What one run measured, and its verdict."""

    seed: int
    oracle_logps: list[float]
    """The oracle response's log-probability before each step, and after the last."""
    replay_weights: list[tuple[float, float]]
    """Per step that trained a replayed success: (applied, recomputed) mean weight."""
    fresh_successes: list[int]
    """Per iteration, the successes among the group's fresh episodes."""
    seconds: float
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def oracle_logp_before(self) -> float:
        return self.oracle_logps[0]

    @property
    def oracle_logp_after(self) -> float:
        return self.oracle_logps[-1]

    @property
    def gain(self) -> float:
        return self.oracle_logp_after - self.oracle_logp_before

    @property
    def step_gains(self) -> list[float]:
        return [b - a for a, b in zip(self.oracle_logps, self.oracle_logps[1:], strict=False)]

    @property
    def max_replay_weight(self) -> float:
        return max((e for _, e in self.replay_weights), default=math.nan)

    def report(self) -> str:
        w = ", ".join(f"{a:.3f}/{e:.3f}" for a, e in self.replay_weights)
        verdict = "passed" if self.passed else "FAILED: " + "; ".join(self.failures)
        return (
            f"seed {self.seed}: oracle log-prob {self.oracle_logp_before:.1f} -> "
            f"{self.oracle_logp_after:.1f} ({self.gain:+.1f} nats, needs >= {MIN_GAIN:g}; per "
            f"step {', '.join(f'{g:+.1f}' for g in self.step_gains)}); "
            f"replayed weight applied/recomputed per step [{w}]; fresh successes per "
            f"iteration {self.fresh_successes}; {self.seconds:.1f} s: {verdict}"
        )


def task_for(seed: int) -> dict[str, Any]:
    """The check's task: the first `click_button` task of task seed `seed`."""
    from arpo.offline.demos import sim_task_pool

    (task,) = sim_task_pool(["click_button"], 1, seed=seed)
    return task


def start(out: Path, seed: int = 0) -> Path:
    """The starting policy (the tiny model, seed 0, in `out/model`) and the task's oracle
    demonstration (`out/demo`, recorded through the episode loop, unscored)."""
    from arpo.offline.data import write_trajectories
    from arpo.offline.demos import record_demos
    from arpo.policy.tiny import build_tiny_model

    out = Path(out)
    tiny = build_tiny_model(out / "model", seed=0)
    demos, report = record_demos([task_for(seed)], str(tiny), n_envs=1, max_steps=2)
    assert len(demos) == 1, report
    write_trajectories(out / "demo", demos)
    return out


SABOTAGES = {
    "sign_flipped": "the group advantages negated (`assemble.advantages`)",
    "lr_zero": "a learning rate of 0 (the scheduler's factor `trainer.lr_factor` is 0)",
    "replay_never_triggered": "the replay trigger never fires (`assemble.needs_replay`)",
    "stops_after_first": "no update after the first optimizer step (`trainer.lr_factor` "
    "is 0 from the second step on)",
    "replay_weights_one": "replayed tokens weighted 1 (`trainer.arpo_loss` called with "
    "correct_replay = false: their behaviour log-probs replaced by the proximal ones)",
}
"""The broken learners the check must fail, by name: what each changes, and where."""


@contextlib.contextmanager
def sabotaged(name: str) -> Iterator[None]:
    """The learner broken as `SABOTAGES[name]` says, by replacing the one function the
    learner calls (restored on exit); '' or 'healthy' changes nothing."""
    from arpo.learner import assemble, trainer

    if name in ("", "healthy"):
        yield
        return
    if name not in SABOTAGES:
        raise ValueError(f"unknown sabotage {name!r}: one of {sorted(SABOTAGES)}")
    advantages, needs_replay = assemble.advantages, assemble.needs_replay
    lr_factor, arpo_loss = trainer.lr_factor, trainer.arpo_loss

    def flipped(*args: Any, **kw: Any) -> Any:
        return -advantages(*args, **kw)

    def weight_one(*args: Any, **kw: Any) -> Any:
        cfg = dataclasses.replace(args[6], correct_replay=False)
        return arpo_loss(*args[:6], cfg, *args[7:], **kw)

    patch = {
        "sign_flipped": (assemble, "advantages", flipped),
        "lr_zero": (trainer, "lr_factor", lambda config, step: 0.0),
        "stops_after_first": (trainer, "lr_factor", lambda config, step: float(step == 0)),
        "replay_never_triggered": (assemble, "needs_replay", lambda scores, cfg: False),
        "replay_weights_one": (trainer, "arpo_loss", weight_one),
    }[name]
    module, attr, fn = patch
    setattr(module, attr, fn)
    try:
        yield
    finally:
        assemble.advantages, assemble.needs_replay = advantages, needs_replay
        trainer.lr_factor, trainer.arpo_loss = lr_factor, arpo_loss


def _seed_of(*parts: object) -> int:
    """A sampling seed in [0, 2**31) from `parts` (the same on every run and machine)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFF_FFFF


class SeededPolicy:
    """The engine behind the episode loop, each request seeded by (check seed, iteration,
    slot, turn); `episode(task)` is one episode's view of it (the loop asks for one per
    episode), `processor` the engine's (the loop builds prompts with it)."""

    def __init__(self, engine: Any, seed: int) -> None:
        self.engine = engine
        self.processor = engine.processor
        self.seed = seed
        self.iteration = 0
        self.slot = 0

    def episode(self, task: Any) -> _SeededEpisode:
        return _SeededEpisode(self.engine, (self.seed, self.iteration, self.slot))


class _SeededEpisode:
    def __init__(self, engine: Any, key: tuple[int, ...]) -> None:
        self.engine = engine
        self.key = key
        self.turn = 0

    async def generate(self, token_ids: Any, images: Any = (), params: Any = None) -> Any:
        seeded = replace(params, seed=_seed_of(*self.key, self.turn))
        self.turn += 1
        return await self.engine.generate(token_ids, images, seeded)


def _logp(trainer: Any, traj: Any) -> float:
    """The log-probability of `traj`'s response tokens under the trainer's policy."""
    from arpo import store_item
    from arpo.learner.batch import build_sequence

    seq = build_sequence(store_item.to_item(traj), trainer.processor, trainer.image_token_id)
    (lp,) = trainer.proximal([seq])
    return float(lp.double().sum())


def _recomputed_replay_weight(trainer: Any, batch: Any) -> float | None:
    """clamp(exp(pi_prox - mu), replay_w_min, w_max) averaged over the tokens of the batch's
    replayed trajectories (None: none), pi_prox from a teacher-forced pass before the step
    and mu the behaviour log-probs stored in the record."""
    import torch

    from arpo.learner.batch import build_sequence

    rows = [s for s in batch.samples if s.is_replay]
    if not rows:
        return None
    seqs = [build_sequence(s.item, trainer.processor, trainer.image_token_id) for s in rows]
    loss = trainer.config.loss
    ws = [
        torch.exp(p.double() - torch.as_tensor(s.behaviour_logp).double())
        .clamp(max=loss.w_max)
        .clamp(min=loss.replay_w_min)
        for p, s in zip(trainer.proximal(seqs), seqs, strict=True)
    ]
    return float(torch.cat(ws).mean())


def run_check(
    start_dir: Path, run_dir: Path, seed: int = 0, *, iterations: int = ITERATIONS
) -> CheckResult:
    """One seeded run of the pipeline from `start_dir` (`start`) and its verdict (see the
    module docstring); `run_dir` holds the pre-fill collection."""
    t0 = time.perf_counter()
    res = asyncio.run(_run(Path(start_dir), Path(run_dir), seed, iterations))
    res.seconds = time.perf_counter() - t0
    if not res.gain >= MIN_GAIN:
        res.failures.append(
            f"the oracle response's log-prob moved {res.gain:+.2f} nats (needs >= {MIN_GAIN:g})"
        )
    stalled = [i + 1 for i, g in enumerate(res.step_gains) if not g >= MIN_STEP_GAIN]
    if stalled:
        res.failures.append(
            f"step(s) {stalled} raised the oracle response's log-prob by less than "
            f"{MIN_STEP_GAIN:g} nat"
        )
    if len(res.replay_weights) != iterations:
        res.failures.append(
            f"{len(res.replay_weights)} of {iterations} steps trained a replayed success"
        )
    off = [(a, e) for a, e in res.replay_weights if not abs(a - e) <= WEIGHT_TOL]
    if off:
        res.failures.append(
            f"the learner weighted the replayed success's tokens {off[0][0]:.4f} on average "
            f"where clamp(exp(pi_prox - mu)) gives {off[0][1]:.4f} ({len(off)} steps)"
        )
    if not res.max_replay_weight >= MIN_REPLAY_WEIGHT:
        res.failures.append(
            f"no step weighted the replayed success at >= {MIN_REPLAY_WEIGHT:g} (largest "
            f"{res.max_replay_weight:.3f}): the policy never moved towards it"
        )
    return res


async def _run(start_dir: Path, run_dir: Path, seed: int, iterations: int) -> CheckResult:
    import safetensors.torch
    from arpo_envs.sim.server import SimConfig, running

    from arpo import store_item, wire
    from arpo.actor.episode import EpisodeConfig, run_episode
    from arpo.buffer import ReplayStore
    from arpo.env.environment import Environment, EnvironmentConfig
    from arpo.env.runner import RunnerConfig
    from arpo.learner.assemble import AssembleConfig, GroupAssembler
    from arpo.learner.batch import check_item
    from arpo.learner.groups import ReplayConfig
    from arpo.learner.learner import prefill_replay
    from arpo.learner.loss import LossConfig
    from arpo.learner.trainer import Trainer, TrainerConfig
    from arpo.offline.data import read_trajectories, write_trajectories
    from arpo.offline.demos import score_demos
    from arpo.policy.engine import EngineConfig
    from arpo.policy.engine_hf import HFEngine
    from arpo.record import Status

    model = str(start_dir / "model")
    task = task_for(seed)
    task_id = str(task["id"])
    trainer = Trainer(
        TrainerConfig(
            model=model, lr=1e-4, micro_batch=GROUP, optimizer_steps=1, seed=seed,
            loss=LossConfig(replay_w_min=1.0),
        )
    )  # fmt: skip
    (oracle,) = score_demos(list(read_trajectories(start_dir / "demo")), model, temperature=1.0)
    logps = [_logp(trainer, oracle)]

    store = ReplayStore(replay_capacity=8, seed=seed)
    replay = ReplayConfig()
    write_trajectories(run_dir / "prefill", [oracle])
    assert prefill_replay(store, str(run_dir / "prefill"), {task_id}, replay) == 1
    vocab = int(trainer.base_model.get_input_embeddings().num_embeddings)
    assembler = GroupAssembler(
        store,
        AssembleConfig(group_size=GROUP, groups_per_step=1, max_staleness=0, norm_std=False,
                       replay=replay),
        sampling=(1.0, 1.0),
        check=lambda item, traj: check_item(item, trainer.processor, trainer.image_token_id,
                                            vocab),
    )  # fmt: skip
    episode = EpisodeConfig(max_steps=2, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS)
    weights: list[tuple[float, float]] = []
    wins: list[int] = []
    engine = HFEngine(EngineConfig(model=model, max_batch_size=1, prefix_cache_tokens=0))
    async with engine, running([SimConfig(port=0)]) as urls:
        env = Environment(0, urls[0], RunnerConfig(sleep_scale=0.0, wait_seconds=0.0),
                          config=EnvironmentConfig(reset_retries=2))  # fmt: skip
        policy = SeededPolicy(engine, seed)
        try:
            for it in range(iterations):
                policy.iteration = it
                won = 0
                for slot in range(GROUP):
                    policy.slot = slot
                    grant = wire.Grant(
                        grant_id=uuid.uuid4().hex, task_id=task_id, group=f"{task_id}-{it}",
                        slot=slot, version=it, task_json=json.dumps(task), temperature=1.0,
                        top_p=1.0,
                    )  # fmt: skip
                    traj = await run_episode(env, grant, policy, episode, actor_id="check")
                    assert traj is not None and traj.status == Status.OK, traj
                    won += int(traj.checker_score >= 1.0)
                    store.put(task_id, store_item.to_item(traj))
                wins.append(won)
                batch = assembler.next_batch(version=it, timeout=10.0)
                assert batch is not None, "the store gave no group"
                expected = _recomputed_replay_weight(trainer, batch)
                m = trainer.step(batch)
                if expected is not None:
                    weights.append((m["losses/weight_replay_mean"], expected))
                state = safetensors.torch.load(trainer.weights_bytes())
                await engine.update_weights(state, it + 1)
                logps.append(_logp(trainer, oracle))
        finally:
            await env.close()
    return CheckResult(seed, logps, weights, wins, 0.0)

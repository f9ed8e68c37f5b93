"""The smallest end-to-end run of the data path: actors -> ZeroMQ -> store -> GRPO groups.

    make demo                                   # or: .venv/bin/arpo demo [field=value ...]
    .venv/bin/arpo demo iterations=10 actors=8  # overrides are config fields (see --help)

Synthetic actors (threads) play episodes of synthetic tasks with a fixed success
probability per task, build real trajectory records (PNG screenshots, token ids,
behaviour log-probs), and stream them over a real ZeroMQ socket in the wire
format to the learner's ingest (`arpo.learner.ingest`), which validates them, puts
them into the Rust replay store keyed by task and acknowledges them. The learner
side then takes complete groups, applies ARPO's replay of successes to groups
without one, computes group advantages, and at the end snapshots the store and
restores it. Part 7 replaces this with the real training run.
"""

from __future__ import annotations

import io
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zmq

from arpo import wire
from arpo.buffer import ReplayStore
from arpo.config import fail, option
from arpo.learner.groups import ReplayConfig, advantages, needs_replay
from arpo.learner.ingest import Ingest, IngestConfig
from arpo.record import Status, Trajectory, Turn
from arpo.transport import TransportConfig


@dataclass
class DemoConfig:
    """Settings of `arpo demo`."""

    tasks: int = option(4, "Number of synthetic tasks.")
    success: list[float] = option(
        doc="Success probability of each task (cycled over the tasks); 0 makes replay visible.",
        factory=lambda: [0.0, 0.12, 0.35, 0.6],
    )
    group_size: int = option(8, "Episodes per task per iteration (GRPO group size G).")
    iterations: int = option(6, "Iterations; each takes one group of every task.")
    actors: int = option(4, "Actor threads sending trajectories.")
    turns: int = option(5, "Turns per synthetic episode.")
    endpoint: str = option("tcp://127.0.0.1", "Where the learner binds (a random port is picked).")
    out: Path = option(Path("runs/demo"), "Output folder for the store snapshot.")
    seed: int = option(0, "Random seed.")
    replay: ReplayConfig = option(ReplayConfig(), "Replay of successes.")

    def validate(self) -> None:
        if self.tasks < 1:
            fail("tasks", "must be at least 1")
        if self.group_size < 2:
            fail("group_size", "must be at least 2 (GRPO compares episodes within a group)")
        if not self.success or any(not 0.0 <= p <= 1.0 for p in self.success):
            fail("success", "must be a non-empty list of probabilities in [0, 1]")
        if self.actors < 1:
            fail("actors", "must be at least 1")
        if not self.endpoint.startswith(("tcp://127.", "tcp://localhost", "ipc://")):
            fail(
                "endpoint",
                "the demo binds to loopback only: use tcp://127.0.0.1 or ipc://PATH",
            )


def _screenshot(rng: np.random.Generator, step: int) -> bytes:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (320, 200), tuple(int(c) for c in rng.integers(180, 255, 3)))
    d = ImageDraw.Draw(img)
    for _ in range(6):
        x, y = int(rng.integers(0, 280)), int(rng.integers(0, 170))
        d.rectangle(
            (x, y, x + 40, y + 20),
            outline=(0, 0, 0),
            fill=tuple(int(c) for c in rng.integers(0, 255, 3)),
        )
    d.text((10, 10), f"step {step}", fill=(0, 0, 0))
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def _episode(
    rng: np.random.Generator,
    task: str,
    p: float,
    grant: tuple[str, int],
    cfg: DemoConfig,
    actor: str,
) -> Trajectory:
    group, slot = grant
    turns = []
    for step in range(cfg.turns):
        n_resp = int(rng.integers(8, 40))
        turns.append(
            Turn(
                prompt_ids=rng.integers(0, 150_000, int(rng.integers(60, 120)), dtype=np.int32),
                screenshot=_screenshot(rng, step),
                response_ids=rng.integers(0, 150_000, n_resp, dtype=np.int32),
                logprobs=(-rng.exponential(0.7, n_resp)).astype(np.float32),
                policy_version=0,
                action="DONE" if step == cfg.turns - 1 else f"pyautogui.click({step * 30}, 40)",
            )
        )
    score = float(rng.random() < p)
    return Trajectory(
        task_id=task,
        turns=tuple(turns),
        checker_score=score,
        reward=score,
        status=Status.OK,
        group_id=group,
        slot=slot,
        actor_id=actor,
        timings={"total": 0.0},
    )


def run(cfg: DemoConfig) -> dict[str, object]:
    tasks = [f"task-{i}" for i in range(cfg.tasks)]
    probs = {t: cfg.success[i % len(cfg.success)] for i, t in enumerate(tasks)}
    grants: queue.Queue[tuple[str, str, int] | None] = queue.Queue()
    for it in range(cfg.iterations):
        for t in tasks:
            for s in range(cfg.group_size):
                grants.put((t, f"{t}/g{it}", s))
    for _ in range(cfg.actors):
        grants.put(None)

    store = ReplayStore(
        max_bytes=1 << 30, fresh_capacity=4096, replay_capacity=cfg.replay.capacity, seed=cfg.seed
    )
    # The learner's real ingest (decode, validate, drop duplicates, store, acknowledge).
    port = ":0" if cfg.endpoint.startswith("tcp") else ""
    ingest = Ingest(store, IngestConfig(), TransportConfig(data=cfg.endpoint + port))
    addr = ingest.start()
    ctx = zmq.Context()
    errors: list[BaseException] = []

    def actor(i: int) -> None:
        rng = np.random.default_rng([cfg.seed, i])
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDHWM, 64)
        sock.setsockopt(zmq.LINGER, 5000)
        sock.connect(addr)
        sent = acked = 0
        try:
            while (g := grants.get()) is not None:
                task, group, slot = g
                traj = _episode(rng, task, probs[task], (group, slot), cfg, f"actor-{i}")
                sock.send_multipart(wire.encode(traj), copy=False)
                sent += 1
                while sock.poll(0):
                    acked += len(wire.decode(sock.recv_multipart()).ids)
            while acked < sent:  # every trajectory is in the store once its ack is back
                if not sock.poll(60_000):
                    raise TimeoutError(f"actor-{i}: {sent - acked} trajectories never acknowledged")
                acked += len(wire.decode(sock.recv_multipart()).ids)
        except BaseException as e:  # surfaced by the main thread
            errors.append(e)
        finally:
            sock.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=actor, args=(i,), daemon=True) for i in range(cfg.actors)]
    for th in threads:
        th.start()

    print(
        f"arpo demo: {cfg.actors} actors -> {addr} -> replay store; {len(tasks)} tasks x G={cfg.group_size}"
    )
    print(f"{'iter':>4} {'task':<8} {'p':>5} {'mean R':>7} {'replay':>7} {'buffer':>6}  advantages")
    replay_hits = 0
    groups: list[dict[str, object]] = []
    for it in range(cfg.iterations):
        for t in tasks:
            items = store.take_group(t, cfg.group_size, timeout=120.0)
            group = fresh = [wire.from_item(x) for x in items]
            rewards = [tr.reward for tr in group]
            fresh_rewards, buffered = list(rewards), store.replay_len(t)
            used = "-"
            scores = [tr.checker_score for tr in group]
            if needs_replay(scores, cfg.replay) and store.replay_len(t) > 0:
                mode = "newest" if cfg.replay.pick == "newest" else "uniform"
                picked = [wire.from_item(x) for x in store.sample(t, cfg.replay.k, mode=mode)]
                group = (
                    group[: len(group) - cfg.replay.k] + picked
                    if cfg.replay.mode == "replace"
                    else group + picked
                )
                rewards = [tr.reward for tr in group]
                used = f"+{len(picked)}"
                replay_hits += 1
            for item, tr in zip(items, fresh, strict=True):
                if tr.checker_score > cfg.replay.admit_score_above:
                    store.add_success(t, item)  # after the pick; the same stored item
            adv = advantages(rewards)
            groups.append(
                {
                    "task": t,
                    "fresh": fresh_rewards,
                    "buffered": buffered,
                    "rewards": rewards,
                    "adv": adv,
                }
            )
            print(
                f"{it:>4} {t:<8} {probs[t]:>5.2f} {np.mean(rewards):>7.3f} {used:>7} {store.replay_len(t):>6}  "
                + " ".join(f"{a:+.2f}" for a in adv)
            )
    elapsed = time.perf_counter() - t0
    for th in threads:
        th.join(timeout=10)
    if errors:
        raise errors[0]

    cfg.out.mkdir(parents=True, exist_ok=True)
    snap = cfg.out / "store.snapshot"
    store.snapshot(snap)
    restored = ReplayStore.restore(snap)
    same = all(restored.replay_len(t) == store.replay_len(t) for t in tasks)
    stats = ingest.stats()
    ingest.stop()
    ctx.term()
    received = {
        "n": stats.get("stored", 0),
        "bytes": stats.get("bytes", 0),
        "bad": stats.get("rejected_total", 0),
    }
    summary = {
        "trajectories": received["n"],
        "rejected": received["bad"],
        "mb": received["bytes"] / 1e6,
        "seconds": elapsed,
        "replay_hits": replay_hits,
        "snapshot_ok": same,
        "groups": groups,
    }
    print(
        f"received {received['n']} trajectories ({received['bytes'] / 1e6:.1f} MB) in {elapsed:.1f} s "
        f"({received['n'] / elapsed:.0f}/s), {received['bad']} rejected, {replay_hits} groups got a replayed success; "
        f"store snapshot {snap} ({snap.stat().st_size / 1e6:.1f} MB) restored {'identically' if same else 'WITH DIFFERENCES'}"
    )
    store.close()
    restored.close()
    return summary

"""Rollout throughput: the asynchronous actor against a lock-step rollout, same desktops, same engine.

    .venv/bin/python benchmarks/bench_rollout.py            # full run, writes benchmarks/results/
    .venv/bin/python benchmarks/bench_rollout.py --quick    # one short setting, no results file

Both modes drive the same 8 simulated desktops (one server process, OSWorld protocol
over HTTP) whose /execute and /screenshot answers are delayed by a lognormal latency
(median `--median-ms`, shape sigma) with one environment `--slow-factor` times slower,
and the same engine: the scripted policy (task oracles as UI-TARS text) with a batched
inference cost model (a batch of n requests takes base_ms + per_request_ms * n; requests
arriving within 5 ms share a batch), so neither mode gets inference for free.

- lock-step (the reference's rollout): every turn waits for all environments' screenshots,
  then makes one batched inference call for all of them, then waits for all actions;
  a round of episodes ends when the slowest episode ends, then all are evaluated together.
- async (`arpo.actor.Actor`): one coroutine per environment, each episode at its own pace;
  inference requests batch as they come; trajectories go through the spool and the
  transport to a learner's ingest and store (so the async figure pays for delivery too).

Figures per latency spread: episodes/s, steps/s, environment idle fraction (1 - time
environments spent serving requests / (environments x wall time)), and the speed-up.
Correctness first: every episode of both modes must succeed (the oracle solves each task).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_wire import machine  # noqa: E402

from arpo.actor.actor import Actor  # noqa: E402
from arpo.actor.config import ActorConfig  # noqa: E402
from arpo.actor.episode import EpisodeConfig, _prompt_for  # noqa: E402
from arpo.actor.scripted import ScriptedPolicy  # noqa: E402
from arpo.env.environment import Environment  # noqa: E402
from arpo.env.runner import RunnerConfig  # noqa: E402
from arpo.env.task import Task  # noqa: E402
from arpo.policy import actions as A  # noqa: E402
from arpo.policy.engine import SamplingParams  # noqa: E402
from arpo.policy.prompt import image_size  # noqa: E402

N_ENVS = 8


def start_desktops(median_ms: float, sigma: float, slow_factor: float) -> tuple[Any, list[str]]:
    cmd = [sys.executable, "-m", "arpo_envs.cli", "sim", "-n", str(N_ENVS), "--base-port", "0"]
    cmd += ["--latency", f"lognormal:{median_ms},{sigma}", "--slow-env", "3"]
    cmd += ["--slow-factor", str(slow_factor)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    urls = []
    while len(urls) < N_ENVS:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the simulated desktops did not start")
        if line.startswith("env "):
            urls.append(line.split()[2])
    return proc, urls


def make_policy(args: argparse.Namespace) -> ScriptedPolicy:
    return ScriptedPolicy(scroll_clicks=1, base_ms=args.base_ms, per_request_ms=args.per_request_ms)


def all_tasks() -> list[dict[str, Any]]:
    from arpo_envs.sim.tasks import FAMILIES, generate_tasks

    return [t for f in FAMILIES for t in generate_tasks(f, 4, seed=5)]


# ---------------------------------------------------------------------------- lock-step


async def lockstep(urls: list[str], args: argparse.Namespace, duration: float) -> dict[str, float]:
    tasks = [Task.from_dict(t, domain="sim") for t in all_tasks()]
    rng = random.Random(0)
    policy = make_policy(args)
    await policy.start()
    cfg = EpisodeConfig(scroll_clicks=1)
    runner = RunnerConfig(reset_before_setup=True, sleep_scale=0.0)
    envs = [Environment(i, u, runner) for i, u in enumerate(urls)]
    params = SamplingParams()
    action_cfg = A.ActionConfig(scroll_clicks=1)
    episodes = steps = failures = 0
    t0 = time.perf_counter()
    busy0 = sum(e.busy_s for e in envs)
    while time.perf_counter() - t0 < duration:
        round_tasks = [rng.choice(tasks) for _ in envs]
        errs = await asyncio.gather(*(e.prepare(t) for e, t in zip(envs, round_tasks, strict=True)))
        assert not any(errs), errs
        eps = [policy.episode(t) for t in round_tasks]
        prompts = [_prompt_for(policy, t.instruction, cfg) for t in round_tasks]
        done = [False] * len(envs)
        for _ in range(cfg.max_steps):
            active = [i for i in range(len(envs)) if not done[i]]
            if not active:
                break
            pngs = await asyncio.gather(
                *(envs[i].timed(envs[i].client.screenshot()) for i in active)
            )
            inputs = []
            for i, png in zip(active, pngs, strict=True):
                prompts[i][0].add_screenshot(png)
                inputs.append(prompts[i][0].model_input())
            # One batched inference call for every environment (they share one engine batch).
            comps = await asyncio.gather(
                *(
                    eps[i].generate(ids, imgs, params)
                    for i, (ids, imgs) in zip(active, inputs, strict=True)
                )
            )
            acts = []
            for i, png, comp in zip(active, pngs, comps, strict=True):
                w, h = image_size(png)
                frame = A.Frame.shown(w, h, prompts[i][1])
                parsed = A.try_parse_response(comp.text, frame, config=action_cfg)
                prompts[i][0].add_response(comp.token_ids)
                steps += 1
                if not parsed.parsed:
                    done[i] = True
                    continue
                acts.append((i, parsed.commands))
                if parsed.commands[-1] in (A.DONE, A.FAIL):
                    done[i] = True

            async def run(i: int, cmds: tuple[str, ...]) -> None:
                for c in cmds:
                    await envs[i].timed(envs[i].runner.act(c))

            await asyncio.gather(*(run(i, c) for i, c in acts))
        results = await asyncio.gather(
            *(e.evaluate(t) for e, t in zip(envs, round_tasks, strict=True))
        )
        episodes += len(results)
        failures += sum(r.score != 1.0 or r.status != "ok" for r in results)
    wall = time.perf_counter() - t0
    busy = sum(e.busy_s for e in envs) - busy0
    for e in envs:
        await e.close()
    await policy.close()
    assert failures == 0, f"lock-step: {failures} episodes failed"
    return {
        "episodes": episodes,
        "wall_s": wall,
        "episodes_per_s": episodes / wall,
        "steps_per_s": steps / wall,
        "env_idle": 1 - busy / (len(urls) * wall),
        "batches": policy.stats["batches"],
        "mean_batch": policy.stats["requests"] / max(1, policy.stats["batches"]),
    }


# ---------------------------------------------------------------------------- async actor


async def asynchronous(
    urls: list[str], args: argparse.Namespace, duration: float
) -> dict[str, float]:
    from arpo.buffer import ReplayStore
    from arpo.service.grants import GrantBook, GrantConfig, GrantServer
    from arpo.service.ingest import Ingest
    from arpo.transport import TransportConfig

    store = ReplayStore(max_bytes=8 << 30, fresh_capacity=100_000, seed=0)
    book = GrantBook(all_tasks(), GrantConfig(group_size=1, groups_per_step=100_000))
    grants = GrantServer(book, TransportConfig(control="tcp://127.0.0.1:0"))
    control = grants.start()
    ingest = Ingest(
        store, transport=TransportConfig(data="tcp://127.0.0.1:0"), on_trajectory=book.complete
    )
    data = ingest.start()
    policy = make_policy(args)
    with tempfile.TemporaryDirectory() as spool:
        cfg = ActorConfig(
            envs=urls,
            env_pool="sim",  # simulated desktop servers: they take the simulated tasks
            policy="scripted",
            spool_dir=spool,
            transport=TransportConfig(data=data, control=control),
            episode=EpisodeConfig(scroll_clicks=1),
            progress_s=0,
        )
        actor = Actor(cfg, policy=policy)
        run = asyncio.create_task(actor.run())
        while not actor.envs:
            await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)  # warm up: every environment in its first episode
        e0, s0, b0 = actor.stats.episodes, actor.stats.steps, sum(e.busy_s for e in actor.envs)
        t0 = time.perf_counter()
        await asyncio.sleep(duration)
        wall = time.perf_counter() - t0
        episodes, steps = actor.stats.episodes - e0, actor.stats.steps - s0
        busy = sum(e.busy_s for e in actor.envs) - b0
        actor.stop()
        await asyncio.wait_for(run, 120)
    st = dict(actor.stats.by_status)
    ingest.stop()
    grants.stop()
    stored = ingest.stats().get("stored", 0)
    store.close()
    assert st == {"ok": actor.stats.episodes} and actor.stats.successes == actor.stats.episodes, st
    assert stored == actor.stats.episodes, (stored, actor.stats.episodes)
    return {
        "episodes": episodes,
        "wall_s": wall,
        "episodes_per_s": episodes / wall,
        "steps_per_s": steps / wall,
        "env_idle": 1 - busy / (len(urls) * wall),
        "batches": policy.stats["batches"],
        "mean_batch": policy.stats["requests"] / max(1, policy.stats["batches"]),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--seconds", type=float, default=20.0, help="measured time per mode and setting"
    )
    ap.add_argument("--median-ms", type=float, default=60.0)
    ap.add_argument("--sigmas", default="0.25,0.75,1.25", help="lognormal shapes to compare")
    ap.add_argument("--slow-factor", type=float, default=3.0)
    ap.add_argument("--base-ms", type=float, default=30.0, help="engine: fixed cost of a batch")
    ap.add_argument("--per-request-ms", type=float, default=4.0, help="engine: cost per request")
    args = ap.parse_args()
    sigmas = [0.75] if args.quick else [float(s) for s in args.sigmas.split(",")]
    seconds = 5.0 if args.quick else args.seconds
    load = os.getloadavg()
    rows = []
    for sigma in sigmas:
        proc, urls = start_desktops(args.median_ms, sigma, args.slow_factor)
        try:
            lock = asyncio.run(lockstep(urls, args, seconds))
            asyn = asyncio.run(asynchronous(urls, args, seconds))
        finally:
            proc.terminate()
            proc.wait(30)
            proc.stdout.close()
        rows.append({"sigma": sigma, "lockstep": lock, "async": asyn})
        print(
            f"sigma {sigma}: lock-step {lock['episodes_per_s']:.2f} ep/s, async {asyn['episodes_per_s']:.2f} ep/s",
            flush=True,
        )
    lines = [
        f"# Rollout: async actor vs lock-step, {N_ENVS} simulated desktops, lognormal step latency "
        f"(median {args.median_ms:.0f} ms, env 3 x{args.slow_factor:g}), batched engine "
        f"({args.base_ms:g} ms + {args.per_request_ms:g} ms/request)",
        "",
        "| sigma | lock-step ep/s | async ep/s | speed-up | lock-step steps/s | async steps/s "
        "| env idle lock-step | env idle async | mean batch lock-step / async |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lk, an = r["lockstep"], r["async"]
        lines.append(
            f"| {r['sigma']:g} | {lk['episodes_per_s']:.2f} | {an['episodes_per_s']:.2f} | "
            f"{an['episodes_per_s'] / lk['episodes_per_s']:.2f}x | {lk['steps_per_s']:.1f} | "
            f"{an['steps_per_s']:.1f} | {lk['env_idle']:.0%} | {an['env_idle']:.0%} | "
            f"{lk['mean_batch']:.1f} / {an['mean_batch']:.1f} |"
        )
    info = machine()
    info["load_before"] = [round(x, 2) for x in load]
    info["load_after"] = info.pop("load_average")
    lines += ["", f"{seconds:g} s measured per mode and setting; " + json.dumps(info)]
    text = "\n".join(lines)
    print(text)
    if not args.quick:
        out = ROOT / "benchmarks" / "results"
        out.mkdir(parents=True, exist_ok=True)
        day = info["date"][:10]
        (out / f"rollout-{day}.md").write_text(text + "\n")
        (out / f"rollout-{day}.json").write_text(
            json.dumps({"machine": info, "args": vars(args), "rows": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

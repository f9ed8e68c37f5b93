"""What a long episode costs per turn: tokens, sampling time, learner time and memory at 1-15 turns.

    python benchmarks/bench_long_context.py                  # turns 1, 3, 6, 10, 15
    python benchmarks/bench_long_context.py --turns 1,15 --repeats 1

Every turn of an episode shows the model the whole episode so far (the reference keeps all
screenshots: `episode.history_images` = 15), so turn k's prompt holds k screenshots and
k - 1 responses. For each episode length k, in a fresh process (so the peak memory is that
length's): the tiny Qwen2.5-VL built from its config, k screenshots of 1280x720 (the
simulated desktop's size; random blocks, so the PNGs are desktop-like) and k responses of
`--response` tokens put together by the real prompt builder (`arpo.synthetic`), then

- tokens: the prompt of turn k (what the engine reads to sample it), its image tokens, and
  the whole episode's training sequence (what the learner reads once);
- sampling: the transformers engine (`HFEngine`) sampling `--response` tokens at turn k
  with the whole prompt, the prefix cache off (as a first turn is: nothing to reuse);
- whole episodes: `--episodes` episodes of k turns sampled at once, turn by turn as the actor
  does (each response goes into the next turn's prompt), with the engine's prefix cache off
  (every turn prefills the whole episode so far) and on (`prefix_cache_tokens`, the default:
  only the new screenshot and tokens are prefilled): turns per second both ways, and
  trajectories per CPU minute (one episode's sampling plus its learner step, as on this
  machine where actor and learner share the cores);
- learning: the trainer's proximal pass (forward) and one full step (forward, backward,
  AdamW) on the k-turn episode, micro-batch 1;
- the process's peak resident memory (ru_maxrss) after all of it.

Medians of `--repeats`. Results: benchmarks/results/long-context-<date>.{json,md} with the
machine, commit and load average. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _machine import cpu_model

ROOT = Path(__file__).resolve().parent.parent


def one_length(model_dir: str, turns: int, response: int, repeats: int, episodes: int) -> dict:
    import torch

    from arpo import store_item
    from arpo.learner.assemble import Sample
    from arpo.learner.batch import build_sequence
    from arpo.learner.trainer import Trainer, TrainerConfig
    from arpo.policy.engine import EngineConfig, SamplingParams
    from arpo.policy.engine_hf import HFEngine
    from arpo.policy.prompt import EpisodePrompt, pixel_bounds
    from arpo.synthetic import random_response, screenshot_png, synthetic_trajectory

    torch.manual_seed(0)
    rng = np.random.default_rng(turns)
    trainer = Trainer(TrainerConfig(model=model_dir, micro_batch=1, lr=1e-6))
    proc = trainer.processor
    shots = [screenshot_png(rng, 1280, 720) for _ in range(turns)]
    resps = [random_response(rng, proc.tokenizer, response) for _ in range(turns)]
    traj = synthetic_trajectory(proc, "fill in the form", screenshots=shots, responses=resps)
    item = store_item.to_item(traj)
    seq = build_sequence(item, proc, trainer.image_token_id)

    lo, hi = pixel_bounds(proc)
    prompt = EpisodePrompt(proc.tokenizer, "fill in the form", min_pixels=lo, max_pixels=hi,
                           history_images=15)  # fmt: skip
    for k in range(turns):
        prompt.add_screenshot(shots[k])
        if k < turns - 1:
            prompt.add_response(resps[k])
    ids, images = prompt.model_input()

    async def sample() -> float:
        # No prefix cache: the repeats would reuse the whole prompt of the warm-up.
        engine = HFEngine(EngineConfig(model=model_dir, device="cpu", max_batch_size=1,
                                       prefix_cache_tokens=0))  # fmt: skip
        params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=response)
        async with engine:
            await engine.generate(ids, images, params)  # warm-up
            out = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                await engine.generate(ids, images, params)
                out.append(time.perf_counter() - t0)
        return statistics.median(out)

    sample_s = asyncio.run(sample())
    ep_shots = [shots] + [
        [screenshot_png(rng, 1280, 720) for _ in range(turns)] for _ in range(episodes - 1)
    ]

    async def whole_episodes(cache_tokens: int) -> tuple[float, dict]:
        engine = HFEngine(EngineConfig(model=model_dir, device="cpu", max_batch_size=episodes,
                                       prefix_cache_tokens=cache_tokens))  # fmt: skip

        async def one(e: int) -> None:
            ep = EpisodePrompt(proc.tokenizer, "fill in the form", min_pixels=lo, max_pixels=hi,
                               history_images=15)  # fmt: skip
            for k in range(turns):
                ep.add_screenshot(ep_shots[e][k])
                p = SamplingParams(temperature=1.0, max_new_tokens=response, seed=100 * e + k)
                out = await engine.generate(*ep.model_input(), p)
                ep.add_response(out.token_ids)

        async with engine:
            await engine.generate(ids, images, SamplingParams(max_new_tokens=2))  # warm-up
            engine.clear_prefix_cache()
            t0 = time.perf_counter()
            await asyncio.gather(*[one(e) for e in range(episodes)])
            return time.perf_counter() - t0, dict(engine.stats)

    times: dict[int, list[float]] = {0: [], 32768: []}
    stats: dict[int, dict] = {}
    for _ in range(repeats):  # off and on alternate, so drift in the machine hits both
        for c in times:
            t, stats[c] = asyncio.run(whole_episodes(c))
            times[c].append(t)
    ep_s = {c: statistics.median(v) for c, v in times.items()}
    reused = stats[32768]
    fwd, step = [], []

    def sample_of(i: int) -> Sample:
        return Sample(item=item, task_id="t", trajectory_id=f"x{i}", reward=1.0,
                      checker_score=1.0, version=0, advantage=1.0, is_replay=False, group=0)  # fmt: skip

    trainer.proximal([seq])  # warm-up
    trainer.step([sample_of(-1)])  # warm-up: AdamW's state is made on the first step
    for _ in range(repeats):
        t0 = time.perf_counter()
        trainer.proximal([seq])
        fwd.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        trainer.step([sample_of(_)])
        step.append(time.perf_counter() - t0)
    image_tokens = int((np.asarray(ids) == prompt.image_pad).sum())
    step_s = statistics.median(step)
    return {
        "turns": turns,
        "prompt_tokens_last_turn": len(ids),
        "image_tokens_last_turn": image_tokens,
        "episode_sequence_tokens": len(seq.input_ids),
        "response_tokens_per_turn": response,
        "sample_s_last_turn": sample_s,
        "proximal_s": statistics.median(fwd),
        "step_s": step_s,
        "episodes": episodes,
        "episodes_s_no_cache": ep_s[0],
        "episodes_s_prefix_cache": ep_s[32768],
        "turns_per_s_no_cache": episodes * turns / ep_s[0],
        "turns_per_s_prefix_cache": episodes * turns / ep_s[32768],
        "prompt_tokens_read": reused["prompt_tokens"],
        "prompt_tokens_reused": reused["prefix_tokens"],
        "trajectories_per_cpu_min_no_cache": 60 / (ep_s[0] / episodes + step_s),
        "trajectories_per_cpu_min_prefix_cache": 60 / (ep_s[32768] / episodes + step_s),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def report(res: dict) -> str:
    lines = [
        f"# Long episodes, per turn ({res['date']}, {res['machine']}, commit {res['commit']})",
        "",
        f"`{res['command']}`; load average before: {res['load']}",
        "",
        "| turns | prompt of the last turn (tokens) | of which image | episode sequence "
        "(tokens) | sampling the last turn (s) | learner forward (s) | learner step (s) | "
        "peak RSS (MiB) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['turns']} | {r['prompt_tokens_last_turn']} | {r['image_tokens_last_turn']} | "
            f"{r['episode_sequence_tokens']} | {r['sample_s_last_turn']:.2f} | "
            f"{r['proximal_s']:.2f} | {r['step_s']:.2f} | {r['peak_rss_mib']:.0f} |"
        )
    if "episodes" in res["rows"][0]:
        lines += [
            "",
            f"Whole episodes, {res['rows'][0]['episodes']} sampled at once turn by turn "
            "(`--response` tokens per turn), the transformers engine's prefix cache off and on; "
            "trajectories per CPU minute = 60 / (an episode's share of the sampling time + "
            "its learner step):",
            "",
            "| turns | prompt tokens read | of which reused | sampling, no cache (s) | "
            "with prefix cache (s) | turns/s, no cache | turns/s, prefix cache | ratio | "
            "trajectories per CPU min, no cache | prefix cache |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in res["rows"]:
            lines.append(
                f"| {r['turns']} | {r['prompt_tokens_read']} | {r['prompt_tokens_reused']} | "
                f"{r['episodes_s_no_cache']:.2f} | {r['episodes_s_prefix_cache']:.2f} | "
                f"{r['turns_per_s_no_cache']:.1f} | {r['turns_per_s_prefix_cache']:.1f} | "
                f"{r['turns_per_s_prefix_cache'] / r['turns_per_s_no_cache']:.2f} | "
                f"{r['trajectories_per_cpu_min_no_cache']:.1f} | "
                f"{r['trajectories_per_cpu_min_prefix_cache']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--turns", default="1,3,6,10,15")
    p.add_argument("--response", type=int, default=33, help="Tokens per response (the oracle's).")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--episodes", type=int, default=4, help="Episodes sampled at once.")
    p.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--model", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_length(args.model, args.one, args.response, args.repeats,
                                    args.episodes)))  # fmt: skip
        return 0
    from arpo.policy.tiny import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-long-"))
    model = str(build_tiny_model(tmp / "tiny", seed=0))
    load = os.getloadavg()
    rows = []
    for k in [int(x) for x in args.turns.split(",")]:
        out = subprocess.run(
            [sys.executable, __file__, "--one", str(k), "--model", model,
             "--response", str(args.response), "--repeats", str(args.repeats),
             "--episodes", str(args.episodes)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    date = dt.date.today().isoformat()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    res = {
        "date": date,
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.platform()}",
        "commit": commit,
        "load": [round(x, 2) for x in load],
        "command": " ".join(["python", "benchmarks/bench_long_context.py", *sys.argv[1:]]),
        "rows": rows,
    }
    out_dir = ROOT / "benchmarks" / "results"
    (out_dir / f"long-context-{date}.json").write_text(json.dumps(res, indent=2))
    (out_dir / f"long-context-{date}.md").write_text(report(res))
    print(report(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

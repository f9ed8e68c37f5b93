"""What each observation type costs per turn of a long episode: tokens, sampling, learning, memory.

    python benchmarks/bench_long_context.py        # 5 observations x 1, 5, 15 turns x 2 families
    python benchmarks/bench_long_context.py --observation-types screenshot,som --turns 1,15 --repeats 1
    python benchmarks/bench_long_context.py --turns 1,2 --repeats 1 --episodes 1 \\
        --observation-types a11y_tree,som --tasks click_button --out /tmp/lc     # smoke run
    python benchmarks/bench_long_context.py --max-pixels 12544,50176,200704,802816 \\
        --observation-types screenshot,som --tasks click_button --turns 1,5 \\
        --save-as long-context-pixels                                  # the image budget
    python benchmarks/bench_long_context.py --observation-types som,som_ocr --turns 1,5 \\
        --save-as long-context-ocr                       # som's marks from the tree vs OCR

The observation types are OSWorld's run.py's (`EpisodeConfig.observation_type`):
`screenshot`, `a11y_tree` (the accessibility tree linearised to a table, no image),
`screenshot_a11y_tree` (both), `som` (the screenshot with numbered marks and the mark table).
`som_ocr` is `som` with its marks read from the screenshot by OCR instead of the tree
(`EpisodeConfig.marks_source = "ocr"`, `arpo.env.ocr`): the same prompt layout, another table.

The observations are real ones, captured once in this process from a simulated desktop
(`arpo_envs.sim`, 1280x720). For each `--tasks` family, episode e walks the tasks
`generate_tasks(family, n, seed=e)`: it sets a task up (`Environment.prepare`), observes,
runs the task's next oracle step, observes, ... and goes on with the family's next task
once the oracle is done, so turn i shows a screen of a real episode of that family
(list_select's tables are the simulated desktop's largest, about 1,000 of the tiny model's
tokens; click_button's about 300). Every screen is observed in each type by the actor's own
`arpo.actor.episode.observe`, so the PNG (som: with the marks drawn) and the table
(linearised, or the mark table; cut to `--a11y-max-tokens`, `EpisodeConfig`'s default) are
exactly what an actor's prompt gets. The time `observe` takes per screen is each type's
cost before the model sees anything (the screenshot and tree requests to the desktop, the
table, the marks: for `som_ocr` one OCR pass, with `OcrConfig`'s threads).

Every turn of an episode shows the whole episode so far (`history_images` = 15), so turn
k's prompt holds k observations and k - 1 responses. For each (family, type, episode length
k), in a fresh process (so the peak memory is that row's): the tiny Qwen2.5-VL built from
its config, the k observations of episode 0 and k responses of `--response` random tokens
put together by the real prompt builder (`EpisodePrompt(..., observation_type=type)`), then

- tokens: per turn, what a turn's observation adds to the prompt (the actor's
  `Turn.prompt_ids`, without the first turn's system prompt and instruction), of which the
  table (as `a11y.trim` counts it: the table's share) and the image; the system prompt and
  instruction; the prompt of turn k (what the engine reads to sample it); the whole
  episode's training sequence (what the learner reads once);
- sampling: the transformers engine (`HFEngine`) sampling `--response` tokens at turn k
  with the whole prompt, the prefix cache off (as a first turn is: nothing to reuse);
- whole episodes: `--episodes` episodes of k turns (episode e on its own tasks' screens)
  sampled at once, turn by turn as the actor does (each response goes into the next turn's
  prompt), with the engine's prefix cache off (every turn prefills the whole episode so
  far) and on (`prefix_cache_tokens`, the engine's default or `--prefix-cache-tokens`:
  only the new observation and tokens are prefilled while the episodes' prefixes fit in
  it): turns per second both ways, and trajectories per CPU minute (one episode's
  sampling plus its learner step, as on this machine where actor and learner share the
  cores);
- learning: the trainer's proximal pass (forward) and one full step (forward, backward,
  AdamW) on the k-turn episode, micro-batch 1;
- the process's peak resident memory (ru_maxrss) after all of it.

Before timing, each row checks the episode: the learner accepts it (`check_item`: its image
tokens are the processor's), its prompt shows k images (none for a11y_tree) and a table
only for the types that have one. Token counts are the tiny model's: a 1280x720 screenshot
is 60 image tokens (UI-TARS-1.5 spends thousands) and its byte-level BPE has about 800
tokens, so a table costs more tokens than Qwen's tokenizer would make of it (the JSON has
the tables' characters per turn too).

The image budget (`--max-pixels`, a list): the processor's `max_pixels` that the tiny model
is built with (`arpo-tiny-model --max-pixels`, `arpo train`'s `tiny_max_pixels`); each budget
is a model of its own, its screens observed with it (a 1280x720 screenshot is resized to fit
the budget in 28x28 units, one image token each), and the rows say which. The default is
the tiny model's (`TINY_MAX_PIXELS`).

Medians of `--repeats`. Results: benchmarks/results/<save-as>-<date>.{json,md} (`--save-as`
defaults to long-context-obs; `--out` for another folder) with the machine, commit and load
average. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
from _machine import run_header

from arpo.record import OBSERVATION_TYPES

KINDS = (*OBSERVATION_TYPES, "som_ocr")
"""The rows' observations: OSWorld's types, and som with OCR's marks."""
ROOT = Path(__file__).resolve().parent.parent
TASKS = "list_select,click_button"
"""Default task families: the simulated desktop's largest accessibility tree, and a small one."""


def observation_type(kind: str) -> str:
    """The observation type of a row's `kind` (som_ocr is som)."""
    return "som" if kind == "som_ocr" else kind


def episode_config(kind: str, a11y_max_tokens: int):
    """The actor's episode config that observes `kind`."""
    from arpo.actor.episode import EpisodeConfig

    return EpisodeConfig(observation_type=observation_type(kind), a11y_max_tokens=a11y_max_tokens,
                         marks_source="ocr" if kind == "som_ocr" else "tree")  # fmt: skip


def capture(model_dir: str, family: str, kinds: list[str], episodes: int, turns: int,
            a11y_max_tokens: int, path: Path) -> None:  # fmt: skip
    """Observe `episodes` episodes of `turns` turns of `family` on a simulated desktop in each
    type of `kinds` (as the module doc says) and write them to `path`: msgpack of
    {"instructions": [one per episode], "observations": {type: [episode][turn] =
    [screenshot PNG or None, table or None]}, "observe_s": {type: [seconds per screen]}},
    the pieces `EpisodePrompt.add_observation` takes and what `observe` took."""
    import msgpack
    from arpo_envs.sim.server import SimConfig, running
    from arpo_envs.sim.tasks import generate_tasks
    from transformers import AutoProcessor

    from arpo import wire
    from arpo.actor.episode import EpisodeConfig, observe, start_run
    from arpo.env.environment import Environment
    from arpo.env.runner import RunnerConfig
    from arpo.env.task import Task

    # What `start_run` reads of a transformers-engine policy: its processor (tokenizer for
    # the cut, pixel bounds for the frame).
    policy = types.SimpleNamespace(processor=AutoProcessor.from_pretrained(model_dir))
    cfgs: dict[str, EpisodeConfig] = {k: episode_config(k, a11y_max_tokens) for k in kinds}
    if "som_ocr" in kinds:
        from arpo.env import ocr

        ocr.engine(cfgs["som_ocr"].ocr.threads)  # loaded once per process, outside the timings
    out: dict = {"instructions": [], "observations": {k: [] for k in kinds},
                 "observe_s": {k: [] for k in kinds}}  # fmt: skip

    async def episode(env: Environment, seed: int) -> None:
        seen: dict[str, list] = {k: [] for k in kinds}
        for d in generate_tasks(family, turns, seed=seed):  # >= 2 screens a task: enough
            task = Task.from_dict(d, domain="sim")
            failed = await env.prepare(task)
            if failed is not None:
                raise RuntimeError(f"{family} task {task.id}: {failed.status}: {failed.reason}")
            if not seen[kinds[0]]:
                out["instructions"].append(task.instruction)
            grant = wire.Grant("bench/0/0", task.id, "bench", 0, 0, json.dumps(d))
            for step, action in enumerate([*d["oracle"], None]):
                for k, cfg in cfgs.items():
                    t0 = time.perf_counter()
                    obs = await observe(env, start_run(task, grant, policy, cfg), cfg)
                    out["observe_s"][k].append(time.perf_counter() - t0)
                    seen[k].append([obs.screenshot, obs.table])
                if len(seen[kinds[0]]) == turns:
                    for k in kinds:
                        out["observations"][k].append(seen[k])
                    return
                if action is not None:
                    r = await env.timed(env.runner.act(action))
                    assert r is not None and r.returncode == 0, (task.id, step, r)
        raise AssertionError("unreachable: every task gives at least two screens")

    async def go() -> None:
        async with running([SimConfig(port=0)]) as urls:
            env = Environment(0, urls[0], RunnerConfig(reset_before_setup=True))
            try:
                for e in range(episodes):
                    await episode(env, e)
            finally:
                await env.close()

    asyncio.run(go())
    path.write_bytes(msgpack.packb(out, use_bin_type=True))


def one_length(model_dir: str, obs_file: str, kind: str, turns: int, response: int, repeats: int,
               episodes: int, cache_tokens: int = 0) -> dict:  # fmt: skip
    import msgpack
    import torch

    from arpo import store_item
    from arpo.actor.episode import EpisodeConfig
    from arpo.env import a11y
    from arpo.learner.assemble import Sample
    from arpo.learner.batch import build_sequence, check_item
    from arpo.learner.trainer import Trainer, TrainerConfig
    from arpo.policy.engine import EngineConfig, SamplingParams
    from arpo.policy.engine_hf import HFEngine
    from arpo.policy.prompt import EpisodePrompt, pixel_bounds
    from arpo.record import Status, Trajectory, Turn
    from arpo.synthetic import random_response

    torch.manual_seed(0)
    rng = np.random.default_rng(turns)
    data = msgpack.unpackb(Path(obs_file).read_bytes(), raw=False)
    instructions = data["instructions"]
    shown = [ep[:turns] for ep in data["observations"][kind][:episodes]]
    assert len(shown) == episodes and all(len(ep) == turns for ep in shown)
    trainer = Trainer(TrainerConfig(model=model_dir, micro_batch=1, lr=1e-6))
    proc = trainer.processor
    tok = proc.tokenizer
    lo, hi = pixel_bounds(proc)
    history = EpisodeConfig().history_images

    shown_as = observation_type(kind)
    source = "ocr" if kind == "som_ocr" else ("tree" if kind == "som" else "")

    def new_prompt(e: int) -> EpisodePrompt:
        return EpisodePrompt(tok, instructions[e], min_pixels=lo, max_pixels=hi,
                             history_images=history, observation_type=shown_as)  # fmt: skip

    resps = [random_response(rng, tok, response) for _ in range(turns)]
    prompt = new_prompt(0)
    for k in range(turns):
        prompt.add_observation(*shown[0][k])
        if k < turns - 1:
            prompt.add_response(resps[k])
    ids, images = prompt.model_input()
    added = [len(t) for t in prompt.turn_prompt_ids]
    added[0] -= len(prompt.header)  # the system prompt and instruction, once an episode
    image_pad = prompt.image_pad
    image_tok = [int((t == image_pad).sum()) for t in prompt.turn_prompt_ids]
    tables = [table or "" for _, table in shown[0]]
    table_tok = [len(tok.encode(t, add_special_tokens=False)) if t else 0 for t in tables]

    turn_records = [
        Turn(prompt.turn_prompt_ids[k], shown[0][k][0] or b"", resps[k],
             np.zeros(len(resps[k]), np.float32), 0, "WAIT", True, marks_source=source)
        for k in range(turns)
    ]  # fmt: skip
    traj = Trajectory("bench", tuple(turn_records), 1.0, reward=1.0, status=Status.OK,
                      group_id="bench", observation_type=shown_as)  # fmt: skip
    item = store_item.to_item(traj)
    # Correct before timed: the learner takes the episode, the prompt shows what the type shows.
    assert check_item(item, proc, trainer.image_token_id, vocab_size=len(tok)) is None
    assert len(images) == (0 if kind == "a11y_tree" else turns), (kind, len(images))
    text = tok.decode(ids.tolist())
    header = a11y.MARK_HEADER if shown_as == "som" else a11y.HEADER
    assert (header in text) == (kind != "screenshot") and all(tables) == (kind != "screenshot")
    seq = build_sequence(item, proc, trainer.image_token_id)

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
    cache_on = cache_tokens or EngineConfig(model=model_dir).prefix_cache_tokens

    async def whole_episodes(cache_tokens: int) -> tuple[float, dict]:
        engine = HFEngine(EngineConfig(model=model_dir, device="cpu", max_batch_size=episodes,
                                       prefix_cache_tokens=cache_tokens))  # fmt: skip

        async def one(e: int) -> None:
            ep = new_prompt(e)
            for k in range(turns):
                ep.add_observation(*shown[e][k])
                p = SamplingParams(temperature=1.0, max_new_tokens=response, seed=100 * e + k)
                out = await engine.generate(*ep.model_input(), p)
                ep.add_response(out.token_ids)

        async with engine:
            await engine.generate(ids, images, SamplingParams(max_new_tokens=2))  # warm-up
            engine.clear_prefix_cache()
            before = dict(engine.stats)
            t0 = time.perf_counter()
            await asyncio.gather(*[one(e) for e in range(episodes)])
            took = time.perf_counter() - t0
            return took, {k: v - before[k] for k, v in engine.stats.items()}  # not the warm-up's

    times: dict[int, list[float]] = {0: [], cache_on: []}
    stats: dict[int, dict] = {}
    for _ in range(repeats):  # off and on alternate, so drift in the machine hits both
        for c in times:
            t, stats[c] = asyncio.run(whole_episodes(c))
            times[c].append(t)
    ep_s = {c: statistics.median(v) for c, v in times.items()}
    reused = stats[cache_on]
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
    step_s = statistics.median(step)
    return {
        "observation": kind,
        "turns": turns,
        "system_prompt_tokens": len(prompt.header),
        "turn_tokens": statistics.mean(added),
        "table_tokens_per_turn": statistics.mean(table_tok),
        "table_share": sum(table_tok) / sum(added),
        "image_tokens_per_turn": statistics.mean(image_tok),
        "table_chars_per_turn": statistics.mean(len(t) for t in tables),
        "tables_cut": sum(t.endswith(a11y.ELLIPSIS) for t in tables),
        "prompt_tokens_last_turn": len(ids),
        "image_tokens_last_turn": int((ids == image_pad).sum()),
        "table_tokens_last_turn": sum(table_tok[-history:]),
        "episode_sequence_tokens": len(seq.input_ids),
        "response_tokens_per_turn": response,
        "sample_s_last_turn": sample_s,
        "proximal_s": statistics.median(fwd),
        "step_s": step_s,
        "episodes": episodes,
        "prefix_cache_tokens": cache_on,
        "episodes_s_no_cache": ep_s[0],
        "episodes_s_prefix_cache": ep_s[cache_on],
        "turns_per_s_no_cache": episodes * turns / ep_s[0],
        "turns_per_s_prefix_cache": episodes * turns / ep_s[cache_on],
        "prompt_tokens_read": reused["prompt_tokens"],
        "prompt_tokens_reused": reused["prefix_tokens"],
        "trajectories_per_cpu_min_no_cache": 60 / (ep_s[0] / episodes + step_s),
        "trajectories_per_cpu_min_prefix_cache": 60 / (ep_s[cache_on] / episodes + step_s),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def report(res: dict) -> str:
    rows = res["rows"]
    lines = [
        f"# Observation types in long episodes, per turn ({res['date']}, {res['machine']}, "
        f"commit {res['commit']})",
        "",
        f"`{res['command']}`; load average before: {res['load']}",
        "",
        "Real observations of the simulated desktop (1280x720), each type built by the "
        f"actor's `observe`, tables cut to {res['a11y_max_tokens']} tokens; "
        f"{res['response']}-token responses. Tokens are the tiny model's (60 image tokens a "
        "1280x720 screenshot at its default budget; a byte-level BPE of about 800 tokens). Tokens per turn: what a turn's "
        "observation adds to the prompt; the first turn also has the system prompt and "
        "instruction.",
        "",
        "| task | max pixels | observation | turns | observing (s per screen) | "
        "system + instruction (tokens) | tokens per turn | "
        "of which table | table share | of which image | tables cut | prompt of the last "
        "turn | episode sequence | sampling the last turn (s) | learner forward (s) | "
        "learner step (s) | peak RSS (MiB) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['task']} | {r['max_pixels']} | {r['observation']} | {r['turns']} | "
            f"{r['observe_s_per_screen']:.3f} | "
            f"{r['system_prompt_tokens']} | "
            f"{r['turn_tokens']:.0f} | {r['table_tokens_per_turn']:.0f} | "
            f"{r['table_share']:.0%} | {r['image_tokens_per_turn']:.0f} | "
            f"{r['tables_cut']}/{r['turns']} | {r['prompt_tokens_last_turn']} | "
            f"{r['episode_sequence_tokens']} | {r['sample_s_last_turn']:.2f} | "
            f"{r['proximal_s']:.2f} | {r['step_s']:.2f} | {r['peak_rss_mib']:.0f} |"
        )
    lines += [
        "",
        f"Whole episodes, {rows[0]['episodes']} sampled at once turn by turn, the transformers "
        "engine's prefix cache off and on (`prefix_cache_tokens` = "
        f"{rows[0]['prefix_cache_tokens']}); trajectories per CPU minute = 60 / (an "
        "episode's share of the sampling time + its learner step):",
        "",
        "| task | max pixels | observation | turns | prompt tokens read | of which reused | sampling, no "
        "cache (s) | with prefix cache (s) | turns/s, no cache | turns/s, prefix cache | "
        "ratio | trajectories per CPU min, no cache | prefix cache |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['task']} | {r['max_pixels']} | {r['observation']} | {r['turns']} | "
            f"{r['prompt_tokens_read']} | "
            f"{r['prompt_tokens_reused']} | {r['episodes_s_no_cache']:.2f} | "
            f"{r['episodes_s_prefix_cache']:.2f} | {r['turns_per_s_no_cache']:.1f} | "
            f"{r['turns_per_s_prefix_cache']:.1f} | "
            f"{r['turns_per_s_prefix_cache'] / r['turns_per_s_no_cache']:.2f} | "
            f"{r['trajectories_per_cpu_min_no_cache']:.1f} | "
            f"{r['trajectories_per_cpu_min_prefix_cache']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def measure(args: argparse.Namespace, model: str, tmp: Path, families: list[str],
            kinds: list[str], lengths: list[int], max_pixels: int) -> list[dict]:  # fmt: skip
    """Observe each family's screens once with `model` (built with `max_pixels`), then
    measure every (family, type, length) in a process of its own; the rows in that order."""
    rows = []
    for family in families:
        t0 = time.perf_counter()
        obs = tmp / f"{family}-{max_pixels}.msgpack"
        capture(model, family, kinds, args.episodes, max(lengths), args.a11y_max_tokens, obs)
        import msgpack

        observe_s = msgpack.unpackb(obs.read_bytes(), raw=False)["observe_s"]
        print(f"{family}: {args.episodes} x {max(lengths)} screens observed in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)  # fmt: skip
        for kind in kinds:
            for k in lengths:
                out = subprocess.run(
                    [sys.executable, __file__, "--one", str(k), "--kind", kind, "--obs", str(obs),
                     "--model", model, "--response", str(args.response),
                     "--repeats", str(args.repeats), "--episodes", str(args.episodes),
                     "--prefix-cache-tokens", str(args.prefix_cache_tokens)],
                    capture_output=True, text=True,
                )  # fmt: skip
                if out.returncode != 0:
                    sys.stderr.write(out.stderr[-4000:])
                    raise SystemExit(f"{family} {kind} {k} turns: exit {out.returncode}")
                row = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append({"task": family, "max_pixels": max_pixels, **row,
                             "observe_s_per_screen": statistics.median(observe_s[kind])})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    return rows


def _names(value: str, known: list[str], what: str, p: argparse.ArgumentParser) -> list[str]:
    names = [x for x in value.split(",") if x]
    bad = [x for x in names if x not in known]
    if bad or not names:
        p.error(f"{what}: {', '.join(bad) or 'none given'}; choose from {', '.join(known)}")
    return names


def main() -> int:
    from arpo.actor.episode import EpisodeConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--observation-types", default=",".join(KINDS),
                   help="OSWorld's types, and som_ocr (som with OCR's marks).")  # fmt: skip
    p.add_argument("--tasks", default=TASKS, help="Simulated desktop task families.")
    p.add_argument("--turns", default="1,5,15", help="Episode lengths.")
    p.add_argument("--response", type=int, default=33, help="Tokens per response (the oracle's).")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--episodes", type=int, default=4, help="Episodes sampled at once.")
    p.add_argument("--a11y-max-tokens", type=int, default=EpisodeConfig().a11y_max_tokens,
                   help="Tokens each table is cut to (EpisodeConfig's default).")  # fmt: skip
    p.add_argument("--max-pixels", default="",
                   help="Image budgets (processor max_pixels), comma separated; '' = the tiny "
                   "model's default.")  # fmt: skip
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="Results folder.")
    p.add_argument(
        "--save-as", default="long-context-obs", help="Results file name before the date."
    )
    p.add_argument("--prefix-cache-tokens", type=int, default=0,
                   help="The prefix cache's budget when on (0: the engine's default).")  # fmt: skip
    p.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--kind", default="", help=argparse.SUPPRESS)
    p.add_argument("--obs", default="", help=argparse.SUPPRESS)
    p.add_argument("--model", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_length(args.model, args.obs, args.kind, args.one, args.response,
                                    args.repeats, args.episodes,
                                    args.prefix_cache_tokens)))  # fmt: skip
        return 0
    from arpo_envs.sim.tasks import FAMILIES

    kinds = _names(args.observation_types, list(KINDS), "--observation-types", p)
    families = _names(args.tasks, list(FAMILIES), "--tasks", p)
    lengths = [int(x) for x in args.turns.split(",")]
    if min(lengths) < 1 or args.repeats < 1 or args.episodes < 1 or args.response < 1:
        p.error("--turns, --repeats, --episodes and --response must be >= 1")
    if args.prefix_cache_tokens < 0:
        p.error("--prefix-cache-tokens must be >= 0 (0: the engine's default)")
    from arpo.policy.tiny import TINY_MAX_PIXELS, TINY_MIN_PIXELS, build_tiny_model

    budgets = [int(x) for x in args.max_pixels.split(",") if x] or [TINY_MAX_PIXELS]
    if min(budgets) < TINY_MIN_PIXELS:
        p.error(f"--max-pixels: each budget must be >= the tiny model's min_pixels "
                f"{TINY_MIN_PIXELS}")  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="bench-long-"))
    load = os.getloadavg()
    rows = []
    try:
        for px in budgets:
            model = str(build_tiny_model(tmp / f"tiny-{px}", seed=0, max_pixels=px))
            rows += measure(args, model, tmp, families, kinds, lengths, px)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    header = run_header()
    date = str(header["date"])[:10]
    res = {
        "date": header["date"],
        "machine": f"{header['machine']}, {platform.platform()}",
        "commit": header["commit"],
        "load": [round(x, 2) for x in load],
        "load_average": header["load_average"],
        "command": " ".join(["python", "benchmarks/bench_long_context.py", *sys.argv[1:]]),
        "a11y_max_tokens": args.a11y_max_tokens,
        "response": args.response,
        "rows": rows,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.save_as}-{date}.json").write_text(json.dumps(res, indent=2))
    (out_dir / f"{args.save_as}-{date}.md").write_text(report(res))
    print(report(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

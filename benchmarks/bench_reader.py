"""What the reader costs next to the tiny model, measured in one run: sampling, a learner step,
memory, and turns per second at the `som` prompt's length.

    python benchmarks/bench_reader.py                          # tiny, reader at 8, 16, 30 layers
    python benchmarks/bench_reader.py --layers 8,30 --save-as reader-cost-<date>
    python benchmarks/bench_reader.py --layers 30 --train-layers 6,12 # partial training
    python benchmarks/bench_reader.py --quick                  # smoke test (make test-all)

Each model runs in a process of its own (so its peak memory is its own), one after another,
on the same prompts: a `click_button`-shaped `som` turn (the instruction, the mark table of
`--rows` buttons in the som table's format, and a 1920x1080 screenshot), built by the real
prompt builder for each model's own tokenizer and image rule, so each model reads the prompt
it would be given. Per model:

- load: seconds to load the folder into the transformers engine, resident memory after;
- sampling: the transformers engine (`arpo.policy.engine_hf`), temperature 1, `--new`
  tokens forced (no stop token): tokens/s of one request, and of `--batch` requests at once;
- turns/s: one turn = prefill of the som prompt + `--response` sampled tokens (a UI-TARS
  answer naming a mark is about 25 tokens), alone and `--batch` at once;
- learner step: `Trainer.step` on `--batch` on-policy trajectories of one som turn each
  (proximal pass, forward, backward, AdamW), seconds per trajectory; with `--train-layers
  N,...` also the same step training only the decoder's last N layers;
- peak memory: the process's maximum resident set.

Checked before timing: the learner's log-probs of what the engine sampled equal the engine's
(to 1e-4), so both ran the same model on the same prompt.
Results: benchmarks/results/<save-as>.{json,md} with date, machine and commit. Run it alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _machine import cpu_model, run_header

ROOT = Path(__file__).resolve().parent.parent
INSTRUCTION = "Click the 'Restore' button."


def _table(rows: int) -> str:
    from arpo_envs.sim.tasks import BUTTON_WORDS

    words = list(BUTTON_WORDS)[:rows]
    lines = ["index\ttag\tname\ttext"]
    lines += [f"{i + 1}\tpush-button\t{w}\t" for i, w in enumerate(words)]
    return "\n".join(lines)


def _rss_mib(field: str = "VmRSS") -> float:
    """This process's resident memory (VmRSS) or its peak since exec (VmHWM; getrusage's
    maxrss would carry the parent's over exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    return 0.0


def measure(folder: str, args: argparse.Namespace) -> dict:
    """One model's figures (run in a child process)."""
    import torch

    from arpo.learner.trainer import Trainer, TrainerConfig
    from arpo.policy.engine import EngineConfig, SamplingParams
    from arpo.policy.engines import make_engine
    from arpo.policy.prompt import EpisodePrompt
    from arpo.record import Trajectory, Turn
    from arpo.synthetic import screenshot_png

    torch.set_num_threads(os.cpu_count() or 1)
    rng = np.random.default_rng(0)
    png = screenshot_png(rng, 1920, 1080)
    table = _table(args.rows)
    out: dict = {"model": folder}

    async def sample():
        t0 = time.perf_counter()
        cfg = EngineConfig(kind="hf", model=folder, prefix_cache_tokens=0, batch_wait_ms=20)
        async with make_engine(cfg) as engine:
            out["load_s"] = round(time.perf_counter() - t0, 2)
            out["rss_after_load_mib"] = round(_rss_mib(), 1)
            proc = engine.processor
            never = len(proc.tokenizer) + 10  # no stop token: exactly max_new_tokens
            prompts = []
            for _ in range(args.batch):
                ep = EpisodePrompt.from_processor(proc, INSTRUCTION, observation_type="som")
                ids = ep.add_observation(png, table)
                prompts.append((ep, ids))
            out["prompt_tokens"] = len(prompts[0][1])

            async def gen(i, n, seed):
                ep, _ = prompts[i]
                ctx, images = ep.model_input()
                p = SamplingParams(temperature=1.0, max_new_tokens=n, seed=seed,
                                   stop_token_ids=(never,))  # fmt: skip
                return await engine.generate(ctx, images, p)

            await gen(0, 4, 0)  # warm-up
            tok1, tokb, turn1, turnb = [], [], [], []
            for r in range(args.repeats):
                t = time.perf_counter()
                c = await gen(0, args.new, r)
                tok1.append(len(c.token_ids) / (time.perf_counter() - t))
                t = time.perf_counter()
                cs = await asyncio.gather(*(gen(i, args.new, r) for i in range(args.batch)))
                tokb.append(sum(len(c.token_ids) for c in cs) / (time.perf_counter() - t))
                t = time.perf_counter()
                await gen(0, args.response, r)
                turn1.append(1 / (time.perf_counter() - t))
                t = time.perf_counter()
                await asyncio.gather(*(gen(i, args.response, r) for i in range(args.batch)))
                turnb.append(args.batch / (time.perf_counter() - t))
            out["tokens_per_s_1"] = round(statistics.median(tok1), 1)
            out[f"tokens_per_s_{args.batch}"] = round(statistics.median(tokb), 1)
            out["turns_per_s_1"] = round(statistics.median(turn1), 3)
            out[f"turns_per_s_{args.batch}"] = round(statistics.median(turnb), 3)
            trajs = []
            for i in range(args.batch):
                ep, ids = prompts[i]
                c = await gen(i, args.response, 100 + i)
                turn = Turn(ids, png, c.token_ids, c.logprobs, 0, "WAIT")
                trajs.append(Trajectory("t", (turn,), float(i % 2), reward=float(i % 2)))
            return trajs

    trajs = asyncio.run(sample())
    trainer = Trainer(TrainerConfig(model=folder, lr=1e-6, micro_batch=1))
    out.update(learner_steps(trainer, trajs, args.repeats))
    out["params_m"] = round(sum(p.numel() for p in trainer.base_model.parameters()) / 1e6, 1)
    layers = len(trainer.base_model.get_decoder().layers)
    for n in [int(x) for x in args.train_layers.split(",") if x]:
        if 0 < n < layers:  # the same step training the last n layers only
            part = Trainer(TrainerConfig(model=folder, lr=1e-6, micro_batch=1, train_layers=n))
            step = learner_steps(part, trajs, args.repeats)["learner_s_per_trajectory"]
            out[f"learner_s_per_trajectory_last{n}"] = step
    out["peak_rss_mib"] = round(_rss_mib("VmHWM"), 1)
    return out


def learner_steps(trainer, trajs, repeats: int) -> dict:
    """The median seconds per trajectory of `trainer.step` on `trajs` (after a warm-up),
    once the learner's log-probs are checked against the engine's."""
    from arpo import store_item
    from arpo.learner.assemble import Sample
    from arpo.learner.batch import build_sequence

    proc = trainer.processor
    samples = []
    for i, traj in enumerate(trajs):
        item = store_item.to_item(traj)
        (lp,) = trainer.proximal([build_sequence(item, proc, trainer.image_token_id)])
        diff = float(np.abs(lp.numpy() - item.logprobs).max())
        if diff > 1e-4:
            raise SystemExit(f"check failed: learner and engine log-probs differ by {diff}")
        samples.append(Sample(item, "t", traj.trajectory_id, traj.reward, traj.reward, 0,
                              1.0 if i % 2 else -1.0, False, 0))  # fmt: skip
    trainer.step(samples)  # warm-up
    steps = []
    for _ in range(repeats):
        t = time.perf_counter()
        trainer.step(samples)
        steps.append((time.perf_counter() - t) / len(samples))
    return {"learner_s_per_trajectory": round(statistics.median(steps), 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", default="8,16,30", help="Reader text layers to measure.")
    ap.add_argument("--rows", type=int, default=9, help="Buttons in the mark table.")
    ap.add_argument("--new", type=int, default=64, help="Tokens sampled for tokens/s.")
    ap.add_argument("--response", type=int, default=25, help="Tokens of one turn's answer.")
    ap.add_argument("--batch", type=int, default=4, help="Requests at once; trajectories per step.")
    ap.add_argument("--repeats", type=int, default=3, help="Timed repeats (medians reported).")
    ap.add_argument(
        "--train-layers",
        default="",
        help="Also time the learner step training only the decoder's last N layers, for each "
        "N in this comma-separated list (learner.trainer.train_layers).",
    )
    ap.add_argument("--quick", action="store_true", help="2 reader layers, 1 repeat (smoke).")
    ap.add_argument("--save-as", default="", help="Write benchmarks/results/<name>.{json,md}.")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args)))
        return 0
    if args.quick:
        args.layers, args.repeats, args.new = "2", 1, 16
    from arpo.policy.reader import build_reader
    from arpo.policy.tiny import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-reader-"))
    models = {"tiny (Qwen2.5-VL, random)": build_tiny_model(tmp / "tiny", seed=0)}
    for n in [int(x) for x in args.layers.split(",") if x]:
        models[f"reader, {n} layers"] = build_reader(tmp / f"reader-{n}", layers=n)
    rows = []
    for name, folder in models.items():
        cmd = [sys.executable, __file__, "--child", str(folder), "--rows", str(args.rows),
               "--new", str(args.new), "--response", str(args.response),
               "--batch", str(args.batch), "--repeats", str(args.repeats),
               "--train-layers", args.train_layers]  # fmt: skip
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if p.returncode:
            raise SystemExit(f"{name}: {p.stderr[-3000:]}")
        row = json.loads(p.stdout.strip().splitlines()[-1])
        row["name"] = name
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]
    for r in rows:
        r["step_x_tiny"] = round(
            r["learner_s_per_trajectory"] / base["learner_s_per_trajectory"], 1
        )
        r["turn_x_tiny"] = round(base["turns_per_s_1"] / r["turns_per_s_1"], 1)
    b = args.batch
    header = run_header()
    md = [
        f"# Reader cost, {header['date']}",
        "",
        f"`python benchmarks/bench_reader.py --layers {args.layers}"
        + (f" --train-layers {args.train_layers}" if args.train_layers else "")
        + f"` on {header['machine']}, "
        f"commit {header['commit']}; medians of {args.repeats} repeats; "
        f"a `som` turn of {args.rows} marks and a 1920x1080 screenshot; answers of "
        f"{args.response} tokens; {b} requests / trajectories at once.",
        "",
        f"| model | params (M) | prompt tokens | tokens/s (1) | tokens/s ({b}) | turns/s (1) | "
        f"turns/s ({b}) | learner s / trajectory | x tiny (step) | x tiny (turn) | "
        "RSS after load (MiB) | peak RSS (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        md.append(
            f"| {r['name']} | {r['params_m']} | {r['prompt_tokens']} | {r['tokens_per_s_1']} | "
            f"{r[f'tokens_per_s_{b}']} | {r['turns_per_s_1']} | {r[f'turns_per_s_{b}']} | "
            f"{r['learner_s_per_trajectory']} | {r['step_x_tiny']} | {r['turn_x_tiny']} | "
            f"{r['rss_after_load_mib']} | {r['peak_rss_mib']} |"
        )
    partial = sorted({k for r in rows for k in r if k.startswith("learner_s_per_trajectory_last")},
                     key=lambda k: int(k.rsplit("last", 1)[1]))  # fmt: skip
    if partial:
        md += ["", "Learner seconds per trajectory when only the decoder's last N layers train "
               "(`learner.trainer.train_layers`), the rest frozen:", "",
               "| model | every weight | " + " | ".join(f"last {k.rsplit('last', 1)[1]}"
                                                     for k in partial) + " |",
               "|---|---:|" + "---:|" * len(partial)]  # fmt: skip
        for r in rows:
            if any(k in r for k in partial):
                md.append(f"| {r['name']} | {r['learner_s_per_trajectory']} | "
                          + " | ".join(str(r.get(k, "")) for k in partial) + " |")  # fmt: skip
    text = "\n".join(md) + "\n"
    print(text)
    if args.save_as:
        res = ROOT / "benchmarks" / "results"
        meta = {**header, "cpu": cpu_model(), "args": vars(args), "rows": rows}
        (res / f"{args.save_as}.json").write_text(json.dumps(meta, indent=1) + "\n")
        (res / f"{args.save_as}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The policy layer on a GPU, in one short prepared run: behaviour log-probs equal the learner's
for each family's tiny model (and the reader, when its folder is given), with tokens/s and a
learner step measured.

    python scripts/gpu_check.py --out $OUT/gpu-check.json                 # device cuda
    python scripts/gpu_check.py --device cpu --out /tmp/gpu-check.json    # the same on CPU
    python scripts/gpu_check.py --reader runs/reader-8 --out ...          # and the reader

Needs torch and transformers (the GPU machine has both, no network): the tiny models are
built there from their configs; the reader's folder must travel with the tree (build it
here with `arpo-reader --out runs/reader-8 --layers 8`; the GGUF wheel is not needed on the
GPU machine). Per model: a 2-turn episode of 2 concurrent requests sampled by the
transformers engine on the device at temperature 1, the learner (`Trainer`, same device)
scoring the stored ids; the largest difference of log-probs (float32: under 1e-4 passes),
tokens/s of the sampling, seconds per learner step on those trajectories. Exits 1 when a
check fails. Budget: well under 8 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def check(folder: Path, device: str) -> dict:
    import numpy as np
    import torch

    from arpo import store_item, wire
    from arpo.learner.assemble import Sample
    from arpo.learner.batch import build_sequence
    from arpo.learner.trainer import Trainer, TrainerConfig
    from arpo.policy.engine import EngineConfig, SamplingParams
    from arpo.policy.engines import make_engine
    from arpo.policy.family import check_folder
    from arpo.policy.prompt import EpisodePrompt
    from arpo.record import Trajectory, Turn
    from arpo.synthetic import screenshot_png

    rng = np.random.default_rng(0)
    shots = [screenshot_png(rng, 1280, 720), screenshot_png(rng, 1920, 1080)]
    out: dict = {"family": check_folder(folder).name}

    async def sample():
        cfg = EngineConfig(kind="hf", model=str(folder), device=device, batch_wait_ms=50)
        async with make_engine(cfg) as engine:
            proc = engine.processor

            async def one(e: int):
                ep = EpisodePrompt.from_processor(proc, f"open the settings {e}")
                turns = []
                for t, png in enumerate(shots):
                    ids = ep.add_screenshot(png)
                    ctx, images = ep.model_input()
                    c = await engine.generate(
                        ctx, images, SamplingParams(temperature=1.0, max_new_tokens=24, seed=t + e)
                    )
                    ep.add_response(c.token_ids)
                    turns.append(Turn(ids, png, c.token_ids, c.logprobs, 0, "WAIT"))
                return Trajectory("t", tuple(turns), float(e % 2), reward=float(e % 2))

            t0 = time.perf_counter()
            trajs = await asyncio.gather(*(one(e) for e in range(2)))
            n = sum(len(t.response_ids) for tr in trajs for t in tr.turns)
            out["sampling_tokens_per_s"] = round(n / (time.perf_counter() - t0), 1)
            return trajs

    trajs = asyncio.run(sample())
    trainer = Trainer(TrainerConfig(model=str(folder), device=device, lr=1e-6))
    proc = trainer.processor
    worst, samples = 0.0, []
    for i, traj in enumerate(trajs):
        item = store_item.to_item(wire.decode(wire.encode(traj)))
        (lp,) = trainer.proximal([build_sequence(item, proc, trainer.image_token_id)])
        worst = max(worst, float(np.abs(lp.cpu().numpy() - item.logprobs).max()))
        samples.append(Sample(item, "t", traj.trajectory_id, traj.reward, traj.reward, 0,
                              1.0 if i else -1.0, False, 0))  # fmt: skip
    out["max_logprob_diff"] = worst
    out["ok"] = worst < 1e-4
    trainer.step(samples)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    trainer.step(samples)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    out["learner_step_s"] = round(time.perf_counter() - t0, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reader", default="", help="A reader folder (arpo-reader) to check too.")
    ap.add_argument("--out", required=True, help="JSON file of the results.")
    args = ap.parse_args(argv)
    import platform

    import torch
    import transformers

    from arpo.policy.tiny import FAMILIES, build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    models = {f"tiny-{f}": build_tiny_model(tmp / f, seed=0, family=f) for f in FAMILIES}
    if args.reader:
        models["reader"] = Path(args.reader)
    res = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name(0)
        if args.device.startswith("cuda")
        else platform.processor(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "models": {},
    }
    for name, folder in models.items():
        t0 = time.perf_counter()
        res["models"][name] = {
            **check(folder, args.device),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(name, json.dumps(res["models"][name]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0 if all(m["ok"] for m in res["models"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

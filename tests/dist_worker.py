"""One ARPO training run of the tiny Qwen2.5-VL, on one process or under torchrun.

tests/test_distributed.py runs this script as a real subprocess, once as a single
process and once under torchrun with 2 ranks (gloo, FSDP2 or DDP), and compares what
rank 0 writes:

    python tests/dist_worker.py --model M --out OUT --steps 2
    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        tests/dist_worker.py --model M --out OUT --strategy fsdp2 --steps 2

Each step: rank 0 builds a batch of 4 trajectories (token ids with one PNG screenshot
each, pixels made by the model's image processor as the HF engine makes them, and
made-up advantages and proximal / behaviour log-prob offsets) and broadcasts it; each
rank takes its share, runs one micro-batch per trajectory through
`arpo.learner.loss.arpo_loss`, scaled by `loss_scale`, then clips the gradient at 1.0 and
takes one AdamW step (lr 1e-3). After step k rank 0 writes OUT/step{k}.pt with the full
weights, the full optimizer state, the gradient norm before clipping, the clipped full
gradient and the metrics.
`--init FILE` starts from such a file (weights and optimizer state).
"""

from __future__ import annotations

import argparse
import io
import math
import sys
from pathlib import Path

import numpy as np
import torch

from arpo.learner.distributed import (
    DistConfig,
    all_reduce_mean,
    broadcast_object,
    clip_grad_norm,
    full_state_dict,
    global_count,
    grad_sync,
    init_distributed,
    load_full_state_dict,
    load_optimizer_state,
    loss_scale,
    max_count,
    optimizer_state,
    shard_batch,
    shutdown,
    unwrap,
    wrap_model,
)
from arpo.learner.loss import LossConfig, arpo_loss

BATCH = 4
IMAGE_SIZES = [(120, 90), (200, 150), (96, 160), (150, 150)]
RESPONSE_LEN = [7, 12, 5, 9]
ADVANTAGES = [1.0, -0.5, 0.7, -1.2]


def make_batch(processor, seed: int = 0) -> list[dict]:
    """4 trajectories: text, one screenshot (vision placeholders), text, response tokens."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    tok = processor.tokenizer
    special = {tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens}
    special |= set(tok.get_added_vocab().values())
    plain = [i for i in range(len(tok)) if i not in special]
    merge = processor.image_processor.merge_size**2
    ids_of = tok.convert_tokens_to_ids
    items = []
    for i in range(BATCH):
        w, h = IMAGE_SIZES[i]
        pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        grid = processor.image_processor(images=[Image.fromarray(pixels)], return_tensors="pt")[
            "image_grid_thw"
        ]
        n_img = int(grid.prod()) // merge
        head = [ids_of("<|im_start|>"), *rng.choice(plain, 6 + i)]
        vision = [ids_of("<|vision_start|>")] + [ids_of("<|image_pad|>")] * n_img
        vision += [ids_of("<|vision_end|>"), ids_of("<|im_end|>"), ids_of("<|im_start|>")]
        response = [*rng.choice(plain, RESPONSE_LEN[i] - 1), ids_of("<|im_end|>")]
        ids = [int(x) for x in head + vision + response]
        items.append(
            {
                "ids": ids,
                "png": buf.getvalue(),
                "resp_start": len(ids) - len(response),
                "prox_offset": rng.uniform(-0.4, 0.4, len(response)).tolist(),
                "behav_offset": rng.uniform(-0.5, 0.5, len(response)).tolist(),
                "advantage": ADVANTAGES[i],
                "is_replay": i == 2,
            }
        )
    return items


def micro_loss(model, base, processor, item: dict, loss_cfg: LossConfig):
    """arpo_loss of one trajectory (mean over its response tokens) and its metrics."""
    from PIL import Image

    image = Image.open(io.BytesIO(item["png"])).convert("RGB")
    enc = processor.image_processor(images=[image], return_tensors="pt")
    ids = torch.tensor([item["ids"]], dtype=torch.long)
    mask = torch.ones_like(ids)
    grid = enc["image_grid_thw"]
    image_id = base.config.image_token_id
    position_ids, _ = base.model.get_rope_index(
        ids, mm_token_type_ids=(ids == image_id).int(), image_grid_thw=grid, attention_mask=mask
    )
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=position_ids,
        pixel_values=enc["pixel_values"].to(torch.float32),
        image_grid_thw=grid,
    )
    logp_all = torch.log_softmax(out.logits[0, :-1].float(), dim=-1)
    tok_logp = logp_all.gather(-1, ids[0, 1:, None])[:, 0]
    logp = tok_logp[item["resp_start"] - 1 :][None]
    prox = logp.detach() + torch.tensor(item["prox_offset"])[None]
    behav = prox + torch.tensor(item["behav_offset"])[None]
    return arpo_loss(
        logp,
        prox,
        behav,
        torch.tensor([item["advantage"]]),
        torch.ones_like(logp, dtype=torch.bool),
        torch.tensor([item["is_replay"]]),
        loss_cfg,
    )


def _mark(rank: int, stage: str) -> None:
    """Print `rank R: <stage>` to stderr at once, so that the log of a run whose rank died
    shows how far each rank got."""
    print(f"rank {rank}: {stage}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--strategy", default="fsdp2")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--agg", default="seq-mean-token-mean")
    ap.add_argument("--sync-last-only", action="store_true")
    ap.add_argument("--init", default=None)
    args = ap.parse_args(argv)

    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    # A collective that waits 120 s fails (the test then has the ranks' output) instead of
    # holding the test for the default 30 minutes.
    info = init_distributed(DistConfig(backend="gloo", strategy=args.strategy, timeout_s=120.0))
    _mark(info.rank, "joined")
    processor = AutoProcessor.from_pretrained(args.model)
    base = Qwen2_5_VLForConditionalGeneration.from_pretrained(args.model, dtype=torch.float32)
    base.train()
    model = wrap_model(base, info.config, info)
    _mark(info.rank, "wrapped")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    if args.init:
        saved = torch.load(args.init, weights_only=False) if info.is_main else None
        load_full_state_dict(model, saved["state"] if saved else None, info)
        load_optimizer_state(model, opt, saved["optim"] if saved else None, info)
    loss_cfg = LossConfig(agg=args.agg)
    out = Path(args.out)

    for step in range(1, args.steps + 1):
        batch = broadcast_object(make_batch(processor) if info.is_main else None, info)
        mine = shard_batch(batch, info)
        if args.agg == "token-mean":
            units = [len(it["ids"]) - it["resp_start"] for it in mine]
        else:
            units = [1 for _ in mine]
        n_global = global_count(sum(units), info)
        n_micro = max_count(len(mine), info)
        total = 0.0
        metrics_sum: dict[str, float] = {}
        for i in range(n_micro):
            # A rank with fewer items repeats its first one at scale 0: same collectives.
            item, unit = (mine[i], units[i]) if i < len(mine) else (mine[0], 0)
            loss, metrics = micro_loss(model, base, processor, item, loss_cfg)
            scaled = loss * loss_scale(unit, n_global, info)
            sync = (i == n_micro - 1) or not args.sync_last_only
            with grad_sync(model, sync):
                scaled.backward()
            total += float(scaled.detach())
            for k in ("clip/low_frac", "clip/high_frac", "tokens"):
                metrics_sum[k] = metrics_sum.get(k, 0.0) + metrics[k] / n_micro
        norm = clip_grad_norm(model, 1.0, info)
        grads = {}
        for name, p in unwrap(model).named_parameters():
            g = p.grad
            if g is not None and hasattr(g, "full_tensor"):
                g = g.full_tensor()  # a collective: every rank gathers every shard
            if g is not None:
                grads[name] = g.detach().to("cpu", copy=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        reduced = all_reduce_mean({"loss": total, **metrics_sum}, info)
        state = full_state_dict(model, info)
        optim = optimizer_state(model, opt, info)
        if info.is_main:
            out.mkdir(parents=True, exist_ok=True)
            torch.save(
                {
                    "state": state,
                    "optim": optim,
                    "grad_norm": norm,
                    "grads": grads,
                    "metrics": reduced,
                    "world_size": info.world_size,
                    "keys": list(unwrap(model).state_dict().keys()),
                },
                out / f"step{step}.pt",
            )
        # Every rank's norm must be the same full-gradient norm.
        norms = broadcast_object(norm, info)
        if norms != norm:
            raise AssertionError(f"rank {info.rank} grad norm {norm} != rank 0's {norms}")
        _mark(info.rank, f"step {step} done")
    # Metric means over ranks: a rank's NaN is left out of the mean.
    means = all_reduce_mean(
        {
            "rank": float(info.rank),
            "not_rank0": math.nan if info.is_main else 1.0,
            "none": math.nan,
        },
        info,
    )
    if info.is_main:
        torch.save(means, out / "means.pt")
    shutdown(info)
    _mark(info.rank, "left the group")
    return 0


if __name__ == "__main__":
    sys.exit(main())

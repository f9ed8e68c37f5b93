"""Can the tiny model learn to read a table? A probe of the skill the transfer experiment needs.

    python benchmarks/probe_table_lookup.py --names labels --steps 1200 --save-as probe-lookup-<date>
    python benchmarks/probe_table_lookup.py --names single --steps 1200

The `som` observation turns a `click_button` task into a lookup: the instruction names a
label, the table lists the marks with their names, the answer is the number of the row
whose name is the label. This trains the text part of the tiny model (`arpo-tiny-model`
seed 0, random weights) on that lookup alone, with nothing else in the sequence and a
dense signal: each sequence is a table in the som table's format (`index\\ttag\\tname\\t
text`, 4 to 9 rows, random tags) followed by one line per row, in random order,
`"<name>" is mark <n>`, and the loss is on each `<n>` (up to 9 answers per sequence
where a `click_button` demonstration gives one). Every `--eval-every` steps: the share of
answers right (greedy, teacher-forced) on 256 fresh sequences. Without reading: a row at
random scores 0.17 on average over 4-9 rows, a row at random among those not yet asked
0.40 (H_n / n); reading the table scores 1.

`--names labels`: names are the simulated desktop's button labels (`BUTTON_WORDS`, 1 to 6
tokens each in the tiny tokenizer, 3.9 on average, the case of the experiment);
`--names single`: names are words the tiny tokenizer holds as one token (the case of a
real model's vocabulary, where "Save" or "Restore" is one token).

The question quotes the name with `"`: with `'`, the tokenizer's contraction rule (`'s`, `'t`,
`'d`, `'m`, ...) splits 53 of the 185 one-token names (`'sheet'` is `'`, `s`, `heet`), so the
question would not hold the token the table has (the runs before 2026-11-28 09:00 had that).

`--layers N`: the same model with N text layers instead of 2 (a content match that then
copies the row's number needs a layer to move the number beside the name and one to match;
the question's name sits four tokens before the answer, which takes a third hop).

Reported: the curve (steps, loss, accuracy, seconds). AdamW, `--lr`, batch `--batch`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

TAGS = ["push-button", "label", "text", "menu-item", "check-box", "link"]


def name_pool(kind: str, tok) -> list[str]:
    from arpo_envs.sim.tasks import BUTTON_WORDS

    if kind == "labels":
        return list(BUTTON_WORDS)
    words = []
    for piece, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
        w = piece.lstrip("Ġ")
        if w == piece and w.isalpha() and len(w) >= 3 and len(tok(w).input_ids) == 1:
            words.append(w)
    return sorted(set(words))


def sample(rng: random.Random, names: list[str]) -> tuple[str, list[tuple[str, str]]]:
    chosen = rng.sample(names, rng.randint(4, 9))
    rows = "\n".join(f'{i + 1}\t{rng.choice(TAGS)}\t{w}\t""' for i, w in enumerate(chosen))
    order = rng.sample(range(len(chosen)), len(chosen))
    return f"index\ttag\tname\ttext\n{rows}\n", [
        (f'"{chosen[i]}" is mark ', f"{i + 1}") for i in order
    ]


def batch(rng: random.Random, names: list[str], tok, size: int):
    import torch

    ids, labels = [], []
    for _ in range(size):
        table, qs = sample(rng, names)
        s = tok(table).input_ids
        lab = [-100] * len(s)
        for q, a in qs:
            qi, ai = tok(q).input_ids, tok(a + "\n").input_ids
            s += qi + ai
            lab += [-100] * len(qi) + [ai[0]] + [-100] * (len(ai) - 1)
        ids.append(s)
        labels.append(lab)
    n = max(map(len, ids))
    x = torch.zeros(size, n, dtype=torch.long)
    mask = torch.zeros(size, n, dtype=torch.long)
    y = torch.full((size, n), -100)
    for i, (s, lab) in enumerate(zip(ids, labels, strict=True)):
        x[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        y[i, : len(s)] = torch.tensor(lab)
    return x, mask, y


def accuracy(model, names, tok, n: int = 256, size: int = 32) -> float:
    import torch

    rng = random.Random(999)
    right = total = 0
    model.eval()
    with torch.no_grad():
        for _ in range(n // size):
            x, mask, y = batch(rng, names, tok, size)
            pred = model(input_ids=x, attention_mask=mask).logits[:, :-1].argmax(-1)
            tgt = y[:, 1:]
            keep = tgt != -100
            right += int(((pred == tgt) & keep).sum())
            total += int(keep.sum())
    model.train()
    return right / total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--names", choices=["labels", "single"], default="labels")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--layers",
        type=int,
        default=0,
        help="Text layers of the model (0: the tiny model's own, 2).",
    )
    p.add_argument("--save-as", default="", help="Write benchmarks/results/<name>.json.")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from arpo.policy.tiny import build_tiny_model

    torch.manual_seed(args.seed)
    folder = build_tiny_model(Path(tempfile.mkdtemp(prefix="probe-tiny-")) / "m", seed=0)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    if args.layers:  # the same model with more text layers, fresh weights of the same init
        from transformers import Qwen2_5_VLForConditionalGeneration

        config = model.config
        config.text_config.num_hidden_layers = args.layers
        config.text_config.layer_types = ["full_attention"] * args.layers
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    names = name_pool(args.names, tok)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng = random.Random(args.seed)
    rows = [{"step": 0, "loss": None, "accuracy": accuracy(model, names, tok), "s": 0.0}]
    print(json.dumps(rows[-1]), flush=True)
    t0 = time.monotonic()
    for step in range(1, args.steps + 1):
        x, mask, y = batch(rng, names, tok, args.batch)
        loss = model(input_ids=x, attention_mask=mask, labels=y).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.eval_every == 0:
            rows.append({
                "step": step, "loss": round(float(loss), 4),
                "accuracy": round(accuracy(model, names, tok), 4),
                "s": round(time.monotonic() - t0, 1),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    out = {"settings": vars(args), "names": len(names), "curve": rows}
    if args.save_as:
        dest = Path(__file__).resolve().parent / "results" / f"{args.save_as}.json"
        dest.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

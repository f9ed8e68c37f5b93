"""Can the tiny model learn to read a table? A probe of the skill the transfer experiment needs.

    python benchmarks/probe_table_lookup.py --names labels --steps 1200 --save-as probe-lookup-<date>
    python benchmarks/probe_table_lookup.py --names single --steps 1200
    python benchmarks/probe_table_lookup.py --model reader --lr 5e-5 --batch 4 --steps 150 \
        --eval-every 50 --eval-n 128 --save-as probe-lookup-reader30-<date>   # --reader-layers 8

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

`--train-layers N` (reader): only the decoder's last N layers and its final norm are
trained (`arpo.policy.family.train_top_layers`, the policy's `train_layers`), the rest frozen.

`--model reader`: the same probe on the reader's text decoder (`arpo.policy.reader`: SmolVLM
around the pre-trained SmolLM2-135M-Instruct, needs `make reader-weights`), built into a
temporary folder with its first `--reader-layers` text layers (30, all of them, by default)
and loaded with `AutoModelForImageTextToText` as the policy loads it; the sequences hold no
image, so the model runs its text decoder (`model.model.text_model` + the tied `lm_head`)
alone, and only those weights are trained (the random vision encoder and connector are
frozen). Names and sequences are tokenized by the reader's tokenizer (SmolLM2's): the 36
button labels are 1 to 3 tokens there (1.4 on average), `--names single` picks from SmolLM2's
one-token words. Its default `--lr` is 5e-5 (2e-3 for the tiny model).

Reported: the curve (steps, loss, accuracy, seconds). AdamW, `--lr`, batch `--batch`; accuracy
on `--eval-n` sequences (256 by default), the same ones at every evaluation, none of them
trained on (a separate random stream).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
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


def answer_logits(model, x, mask, y):
    """(logits, targets) at the answer positions only: the output head runs on the ~6 answer
    positions of a sequence instead of all ~160 (for the reader's 49k-token vocabulary that
    head cost more than its 30 layers). The same loss and argmax as the full logits."""
    hidden = model.model(input_ids=x, attention_mask=mask).last_hidden_state[:, :-1]
    tgt = y[:, 1:]
    keep = tgt != -100
    return model.lm_head(hidden[keep]), tgt[keep]


def accuracy(model, names, tok, n: int = 256, size: int = 32) -> float:
    import torch

    size = min(size, n)
    rng = random.Random(999)
    right = total = 0
    model.eval()
    with torch.no_grad():
        for _ in range(n // size):
            x, mask, y = batch(rng, names, tok, size)
            logits, tgt = answer_logits(model, x, mask, y)
            right += int((logits.argmax(-1) == tgt).sum())
            total += len(tgt)
    model.train()
    return right / total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--names", choices=["labels", "single"], default="labels")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--model", choices=["tiny", "reader"], default="tiny")
    p.add_argument(
        "--reader-layers",
        type=int,
        default=30,
        help="With --model reader: keep the first N of SmolLM2's 30 text layers.",
    )
    p.add_argument("--lr", type=float, default=None, help="2e-3 (tiny) / 5e-5 (reader).")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-n", type=int, default=256, help="Sequences per evaluation.")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--layers",
        type=int,
        default=0,
        help="Text layers of the model (0: the tiny model's own, 2).",
    )
    p.add_argument(
        "--train-layers",
        type=int,
        default=0,
        help="--model reader: train only the decoder's last N layers and final norm, as "
        "the policy's train_layers does (0: the whole text decoder and the tied head).",
    )
    p.add_argument("--save-as", default="", help="Write benchmarks/results/<name>.json.")
    args = p.parse_args(argv)
    if args.lr is None:
        args.lr = 5e-5 if args.model == "reader" else 2e-3
    if args.train_layers and args.model != "reader":
        p.error("--train-layers applies to --model reader")
    if args.model == "reader" and args.layers:
        p.error("--layers is the tiny model's; the reader takes --reader-layers")

    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    torch.manual_seed(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix=f"probe-{args.model}-")) / "m"
    if args.model == "reader":
        from arpo.policy.reader import build_reader

        folder = build_reader(tmp, layers=args.reader_layers, seed=0)
    else:
        from arpo.policy.tiny import build_tiny_model

        folder = build_tiny_model(tmp, seed=0)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    shutil.rmtree(tmp.parent)  # loaded: the reader's folder is 548 MB
    if args.model == "reader":  # text only: the vision encoder and connector stay as built
        for part in (model.model.vision_model, model.model.connector):
            part.requires_grad_(False)
        if args.train_layers:
            from arpo.policy.family import train_top_layers

            train_top_layers(model, args.train_layers)
    if args.layers:  # the same model with more text layers, fresh weights of the same init
        from transformers import Qwen2_5_VLForConditionalGeneration

        config = model.config
        config.text_config.num_hidden_layers = args.layers
        config.text_config.layer_types = ["full_attention"] * args.layers
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    names = name_pool(args.names, tok)
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    rng = random.Random(args.seed)
    rows = [
        {"step": 0, "loss": None, "accuracy": accuracy(model, names, tok, args.eval_n), "s": 0.0}
    ]
    print(json.dumps(rows[-1]), flush=True)
    t0 = time.monotonic()
    for step in range(1, args.steps + 1):
        x, mask, y = batch(rng, names, tok, args.batch)
        logits, tgt = answer_logits(model, x, mask, y)
        loss = torch.nn.functional.cross_entropy(logits, tgt)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % args.eval_every == 0:
            rows.append({
                "step": step, "loss": round(float(loss.detach()), 4),
                "accuracy": round(accuracy(model, names, tok, args.eval_n), 4),
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

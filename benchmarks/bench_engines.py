"""Policy engines side by side on the tiny Qwen2.5-VL: tokens/s and weight-update latency.

    python benchmarks/bench_engines.py                       # hf, vllm, openai, shared
    python benchmarks/bench_engines.py --engines hf,shared --tokens 64

For every engine, in one run and one after the other (run it alone on the
machine: 2 cores, anything in the background distorts it):

1. start it (the OpenAI engine starts a vLLM server on 127.0.0.1 first; the shared
   engine an `arpo-engine` server of the transformers engine, not following a learner:
   what sampling through the shared server costs over the engine in process);
2. check before timing: greedy decoding of the benchmark prompt gives the
   transformers engine's tokens;
3. tokens/s for 1 request and for N concurrent requests (default 8 and 16),
   each prompt showing `--images` 1920x1080 screenshots (60 image tokens each at
   the tiny model's pixel bounds), sampling at temperature 1 up to `--tokens`
   new tokens (the random model rarely stops early; the tokens actually sampled
   are counted);
4. weight-update latency: a state dict from memory and a checkpoint folder,
   median of 3, until the engine serves the new version (not for the shared engine,
   which takes weights only from the learner it follows).

Results go to benchmarks/results/engines-<date>.{json,md} with date, machine,
commit and the load average seen before the run.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
from _machine import cpu_model, run_header
from arpo_envs.procs import free_port

ROOT = Path(__file__).resolve().parent.parent


def png(w: int, h: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, (h // 8, w // 8, 3), dtype=np.uint8)
    img = Image.fromarray(base).resize((w, h), Image.NEAREST)
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def build_prompt(model_dir: Path, n_images: int):
    from transformers import AutoProcessor

    from arpo.policy.prompt import EpisodePrompt

    proc = AutoProcessor.from_pretrained(model_dir)
    im_end = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ep = EpisodePrompt.from_processor(proc, "Make the title row bold and save the sheet.")
    for i in range(n_images):
        ep.add_screenshot(png(1920, 1080, i))
        if i < n_images - 1:
            text = (
                f"Thought: step {i} of the plan.\nAction: click(start_box='({100 + i},{200 + i})')"
            )
            ep.add_response([*proc.tokenizer.encode(text), im_end])
    return ep.model_input()


def machine() -> dict:
    cpu = cpu_model()
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory": mem,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def start_shared(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """An `arpo-engine` server of the transformers engine on 127.0.0.1, not following a
    learner; (process, base URL)."""
    import re

    args = [sys.executable, "-m", "arpo.policy.engine_server", f"engine.model={model_dir}",
            "engine.max_concurrency=32", "port=0", "follow_learner=false"]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not (m := re.search(r"^engine server (\S+) serving", log.read_text(), re.M)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the shared engine server did not start; see {log}")
        time.sleep(0.2)
    return proc, m.group(1)


def start_server(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    from arpo.policy.engine_openai import server_command

    port = free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            server_command(str(model_dir), port, max_model_len=8192),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 300
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"vLLM server did not start; see {log}") from None
            time.sleep(0.5)


async def bench_engine(kind: str, model_dir: Path, other_dir: Path, args, reference, work: Path):
    import torch

    from arpo.policy.engine import EngineConfig, SamplingParams
    from arpo.policy.engines import make_engine

    ids, images = args.prompt
    server = None
    cfg = EngineConfig(kind=kind, model=str(model_dir), max_model_len=8192, max_concurrency=32)
    t0 = time.perf_counter()
    if kind == "openai":
        server, url = start_server(model_dir, work / "vllm-server.log")
        cfg.base_url = url
    if kind == "shared":
        server, url = start_shared(model_dir, work / "shared-server.log")
        cfg.base_url = url
    engine = make_engine(cfg)
    await engine.start()
    start_s = time.perf_counter() - t0
    out: dict = {"engine": kind, "start_s": round(start_s, 2)}
    try:
        greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
        first = await engine.generate(ids, images, greedy)  # also the warm-up
        got = first.token_ids.tolist()
        if reference is not None and got != reference:
            raise SystemExit(
                f"{kind}: greedy tokens differ from transformers: {got} vs {reference}"
            )
        await engine.generate(ids, images, SamplingParams(max_new_tokens=8, seed=0))

        async def run(n: int, reps: int) -> float:
            rates = []
            for _ in range(reps):
                t = time.perf_counter()
                outs = await asyncio.gather(
                    *[
                        engine.generate(
                            ids,
                            images,
                            SamplingParams(max_new_tokens=args.tokens),
                        )
                        for _ in range(n)
                    ]
                )
                rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t))
            return statistics.median(rates)

        out["tokens_per_s"] = {"1": round(await run(1, 3), 1)}
        for n in args.concurrency:
            out["tokens_per_s"][str(n)] = round(await run(n, 2), 1)

        if kind == "shared":
            out["update_note"] = "the shared engine takes weights only from the learner"
            return out, got
        from arpo.policy.family import load_model

        base = load_model(model_dir).state_dict()
        g = torch.Generator().manual_seed(1)
        state = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in base.items()}
        times_mem, times_dir = [], []
        version = 0
        for _ in range(3):
            version += 1
            t = time.perf_counter()
            await engine.update_weights(state, version)
            await engine.generate(ids, images, SamplingParams(max_new_tokens=1))
            times_mem.append(time.perf_counter() - t)
            version += 1
            t = time.perf_counter()
            await engine.update_weights(other_dir, version)
            await engine.generate(ids, images, SamplingParams(max_new_tokens=1))
            times_dir.append(time.perf_counter() - t)
        out["update_state_dict_s"] = round(statistics.median(times_mem), 3)
        out["update_folder_s"] = round(statistics.median(times_dir), 3)
        out["update_note"] = "until the first 1-token request on the new version has returned"
        return out, got
    finally:
        await engine.close()
        if server is not None:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="hf,vllm,openai,shared")
    ap.add_argument("--tokens", type=int, default=128, help="max new tokens per request")
    ap.add_argument("--concurrency", default="8,16", help="concurrent request counts")
    ap.add_argument("--images", type=int, default=3, help="screenshots in each prompt")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    kinds = [k for k in args.engines.split(",") if k]

    from arpo.policy.engine_vllm import vllm_available
    from arpo.policy.tiny import build_tiny_model

    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="arpo-bench-engines-"))
    model_dir = build_tiny_model(work / "tiny", seed=0)
    other_dir = build_tiny_model(work / "tiny-seed1", seed=1)
    args.prompt = build_prompt(model_dir, args.images)
    results, skipped = [], {}
    reference = None
    for kind in ["hf", *[k for k in kinds if k != "hf"]]:
        if kind in ("vllm", "openai") and (reason := vllm_available()):
            skipped[kind] = reason
            continue
        res, got = asyncio.run(bench_engine(kind, model_dir, other_dir, args, reference, work))
        if kind == "hf":
            reference = got
            if "hf" not in kinds:
                continue
        results.append(res)
        print(json.dumps(res), flush=True)

    header = run_header()
    date = str(header["date"])[:10]
    report = {
        "date": header["date"],
        "commit": header["commit"],
        "machine": machine(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": header["load_average"],
        "model": "tiny Qwen2.5-VL (arpo.policy.tiny, 2.5 M parameters, float32)",
        "prompt_tokens": len(args.prompt[0]),
        "images_per_prompt": args.images,
        "max_new_tokens": args.tokens,
        "results": results,
        "skipped": skipped,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"engines-{date}.json").write_text(json.dumps(report, indent=2) + "\n")
    cols = ["1", *[str(c) for c in args.concurrency]]
    lines = [
        f"# Policy engines, {report['date']} (commit {report['commit']})",
        "",
        f"Machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, "
        f"{report['machine']['memory']}. Load average before / after: "
        f"{report['load_average_before']} / {report['load_average_after']}.",
        f"Model: {report['model']}; prompt {report['prompt_tokens']} tokens with "
        f"{args.images} screenshots; temperature 1, up to {args.tokens} new tokens.",
        "",
        "| engine | start s | "
        + " | ".join(f"tokens/s x{c}" for c in cols)
        + " | update state dict s | update folder s |",
        "|---|---|" + "---|" * len(cols) + "---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['engine']} | {r['start_s']} | "
            + " | ".join(str(r["tokens_per_s"][c]) for c in cols)
            + f" | {r.get('update_state_dict_s', 'n/a')} | {r.get('update_folder_s', 'n/a')} |"
        )
    if max(load_before) >= 1.0 or max(report["load_average_after"]) >= 2.0:
        lines.append(
            "\nThe machine was busy during this run (load average of 1 or more before, "
            "or of 2 or more after, on 2 cores): other processes took CPU time, so the "
            "figures are lower bounds and their ratios are noisy."
        )
    for k, why in skipped.items():
        lines.append(f"\n{k} skipped: {why}")
    (out_dir / f"engines-{date}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

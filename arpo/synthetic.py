"""Trajectories built without environments: real prompts, chosen responses, for tests and benchmarks.

    traj = synthetic_trajectory(processor, "Open the file", screenshots=[png, png],
                                responses=[ids0, ids1], reward=1.0, version=3)
    item = arpo.store_item.to_item(traj)

The prompt ids come from the real prompt builder (`arpo.policy.prompt.EpisodePrompt`
with the processor's min / max pixels), so image-token counts, chat markers and the
sequence layout are exactly what an actor records; the responses are whatever ids the
caller gives (e.g. random ids ending in <|im_end|>). Behaviour log-probs default to 0
and can be filled in later with `with_logprobs` (e.g. a teacher-forced pass of the
model, which makes the trajectory on-policy for that model).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from arpo.policy.prompt import EpisodePrompt
from arpo.record import Status, Trajectory, Turn


def screenshot_png(rng: np.random.Generator, width: int = 320, height: int = 200) -> bytes:
    """A PNG of random coloured blocks (compressible, like a desktop)."""
    from PIL import Image

    blocks = rng.integers(0, 256, size=(height // 20 + 1, width // 20 + 1, 3), dtype=np.uint8)
    pixels = np.repeat(np.repeat(blocks, 20, axis=0), 20, axis=1)[:height, :width]
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def random_response(rng: np.random.Generator, tokenizer: Any, length: int) -> np.ndarray:
    """`length` ids: random ordinary tokens (no added token such as <|image_pad|>), then
    <|im_end|>."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder) | {im_end}
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    body = rng.choice(vocab, size=max(0, length - 1))
    return np.asarray([*body, im_end], dtype=np.int32)


def synthetic_trajectory(
    processor: Any,
    instruction: str,
    *,
    screenshots: Sequence[bytes],
    responses: Sequence[Sequence[int] | np.ndarray],
    logprobs: Sequence[Sequence[float] | np.ndarray] | None = None,
    reward: float = 0.0,
    checker_score: float | None = None,
    version: int = 0,
    versions: Sequence[int] | None = None,
    task_id: str = "task",
    status: Status = Status.OK,
    **kwargs: Any,
) -> Trajectory:
    """A trajectory whose prompts are built by the real prompt builder."""
    if len(screenshots) != len(responses):
        raise ValueError("one screenshot per response")
    prompt = EpisodePrompt.from_processor(processor, instruction)
    turns = []
    for i, (png, resp) in enumerate(zip(screenshots, responses, strict=True)):
        ids = prompt.add_screenshot(png)
        prompt.add_response(resp)
        lp = (
            np.asarray(logprobs[i], dtype=np.float32)
            if logprobs is not None
            else np.zeros(len(resp), np.float32)
        )
        v = versions[i] if versions is not None else version
        turns.append(Turn(ids, png, np.asarray(resp, np.int32), lp, v, "WAIT", True))
    score = (1.0 if reward > 0.5 else 0.0) if checker_score is None else checker_score
    return Trajectory(
        task_id, tuple(turns), score, reward=reward, status=status, group_id=task_id, **kwargs
    )


def with_logprobs(traj: Trajectory, logprobs: np.ndarray) -> Trajectory:
    """The same trajectory with its response tokens' behaviour log-probs replaced
    (`logprobs` in sequence order, one per response token)."""
    turns, pos = [], 0
    for t in traj.turns:
        n = len(t.response_ids)
        turns.append(replace(t, logprobs=np.asarray(logprobs[pos : pos + n], dtype=np.float32)))
        pos += n
    if pos != len(logprobs):
        raise ValueError(f"{len(logprobs)} log-probs for {pos} response tokens")
    return replace(traj, turns=tuple(turns))

"""Token-level prompts: incremental ids equal the chat template's, records concatenate exactly."""

from __future__ import annotations

import io

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from arpo.policy.family import qwen_smart_resize
from arpo.policy.prompt import EpisodePrompt
from arpo.policy.tiny import build_tiny_model
from arpo.record import Trajectory, Turn


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny") / "m"))


def png(w: int, h: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


RESPONSES = [
    "Thought: open the file menu first.\nAction: click(start_box='(12,40)')",
    "Thought: then type the name.\nAction: type(content='report.xlsx\\n')",
    "Thought: done.\nAction: finished(content='ok')",
    "Thought: check.\nAction: wait()",
]


def run_episode(processor, turns: int, history: int):
    ep = EpisodePrompt.from_processor(processor, "Save the sheet", history_images=history)
    tok = processor.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    shots = [png(1920, 1080, i) if i % 2 == 0 else png(640, 480, i) for i in range(turns)]
    records = []
    for t in range(turns):
        prompt_ids = ep.add_screenshot(shots[t])
        ids, images = ep.model_input()
        resp = [*tok.encode(RESPONSES[t % len(RESPONSES)], add_special_tokens=False), im_end]
        ep.add_response(resp)
        records.append((prompt_ids, np.asarray(resp, np.int32), ids, images))
    return ep, shots, records


def template_ids(processor, messages, images):
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(processor(text=[text], images=images or None)["input_ids"][0])


@pytest.mark.parametrize("turns", [1, 3])
def test_incremental_ids_equal_chat_template(processor, turns):
    ep, shots, records = run_episode(processor, turns, history=15)
    for t, (_, _, _ids, images) in enumerate(records):
        assert [bytes(i) for i in images] == shots[: t + 1]
    # The conversation before the last response equals the template rendering of it.
    ids, images = ep.model_input()
    msgs = ep.messages()[:-1]  # without the last assistant message
    assert ids.tolist() == template_ids(processor, msgs, [_pil(s) for s in images])


def _pil(b):
    from PIL import Image

    return Image.open(io.BytesIO(b))


def test_record_concatenates_to_the_model_input(processor):
    ep, shots, records = run_episode(processor, 4, history=15)
    turns = [
        Turn(p, s, r, np.zeros(len(r), np.float32), policy_version=0)
        for (p, r, _, _), s in zip(records, shots, strict=True)
    ]
    traj = Trajectory(task_id="t", turns=tuple(turns), checker_score=0.0)
    seq, mask, _ = traj.sequence()
    last_input, _ = ep.model_input()
    assert seq.tolist() == last_input.tolist() + records[-1][1].tolist()
    # Every turn's model input is a prefix of the training sequence (all images kept).
    for t, (_, _, ids, _) in enumerate(records):
        assert seq[: len(ids)].tolist() == ids.tolist(), t
    assert mask.sum() == sum(len(r[1]) for r in records)


def test_history_window_drops_oldest_images_and_keeps_responses(processor):
    ep, shots, _ = run_episode(processor, 4, history=2)
    ids, images = ep.model_input()
    assert [bytes(i) for i in images] == shots[2:]
    msgs = ep.messages()[:-1]
    assert sum(1 for m in msgs if m["role"] == "assistant") == 3
    assert ids.tolist() == template_ids(processor, msgs, [_pil(s) for s in images])


def test_unterminated_response_is_closed_in_the_next_turn(processor):
    ep = EpisodePrompt.from_processor(processor, "x")
    tok = processor.tokenizer
    ep.add_screenshot(png(200, 100, 0))
    ep.add_response(tok.encode("Thought: cut", add_special_tokens=False))
    nxt = ep.add_screenshot(png(200, 100, 1))
    assert nxt[0] == tok.convert_tokens_to_ids("<|im_end|>")


def test_smart_resize_and_token_count_match_the_processor(processor):
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as hf_resize

    for h, w in [(1080, 1920), (480, 640), (100, 3000), (28, 28), (2160, 3840)]:
        # The project's rule is (width, height) in and out; Qwen's helper (height, width).
        assert qwen_smart_resize(w, h, 28, 3136, 50176)[::-1] == hf_resize(h, w, 28, 3136, 50176)
        assert qwen_smart_resize(w, h, 28, 100 * 784, 16384 * 784)[::-1] == hf_resize(
            h, w, 28, 100 * 784, 16384 * 784
        )
    ep = EpisodePrompt.from_processor(processor, "x")
    for w, h in [(1920, 1080), (640, 480), (300, 200)]:
        grid = processor.image_processor(images=[_pil(png(w, h, 0))])["image_grid_thw"][0]
        assert ep.image_tokens(png(w, h, 0)) == int(grid.prod()) // 4

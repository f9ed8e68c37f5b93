"""Marks read from pixels (`arpo.env.ocr`), with the real PP-OCRv4 models on real screens.

The simulated desktop's scenes are read by OCR and held against the desktop's own
accessibility tree: the OCR table finds the tree's labelled elements (text and a click at
the mark's centre on the element). A som episode whose marks come from OCR clicks by mark
and is scored 1 by the desktop's checker, and its record says so. A screen whose tree gives
no mark gets OCR's marks with `marks_source = "auto"`. The benchmark that measures recall
and precision on every family's scenes is benchmarks/ocr_vs_tree.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from arpo_envs.sim.desktop import Desktop
from arpo_envs.sim.server import SimConfig, running
from arpo_envs.sim.tasks import generate_tasks, load_scene
from PIL import Image, ImageDraw, ImageFont

from arpo import store_item, wire
from arpo.actor.episode import EpisodeConfig, observe, run_episode, start_run
from arpo.actor.scripted import ScriptedPolicy
from arpo.config import load_config
from arpo.env import a11y, ocr
from arpo.env.environment import Environment
from arpo.env.runner import RunnerConfig
from arpo.env.task import Task
from arpo.errors import ConfigError, EnvTimeout
from arpo.policy.prompt_text import observation_text
from arpo.record import Status

RECALL_FLOOR = 0.9
"""Least share of a scene's labelled tree marks OCR must find: benchmarks/ocr_vs_tree.py
measured 1.0 on every family's scenes (benchmarks/results/ocr-vs-tree-2026-11-28.md)."""
PRECISION_FLOOR = 0.6
"""Least share of OCR marks that must find a tree mark: the rest are text the tree has no
mark for (the top bar's "Activities" and clock, window titles), 0.6 to 0.9 a scene."""


def _png(image: Image.Image) -> bytes:
    import io

    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("family", ["fill_form", "menu_pick"])
def test_ocr_finds_the_trees_elements_on_simulated_scenes(family):
    desk = Desktop(1280, 720)
    load_scene(desk, family, 3)
    png = desk.screenshot_png()
    tree = a11y.marks(desk.accessibility_xml(), png)
    som = ocr.set_of_marks(png)
    m = ocr.match_marks(tree, som.marks)
    assert m.tree >= 7 and m.recall >= RECALL_FLOOR, (m.missed, m.extra)
    assert m.precision >= PRECISION_FLOOR, m.extra
    # The same table and drawing as the tree's marks: header, one row a mark, marks drawn.
    assert som.table.splitlines()[0] == a11y.MARK_HEADER
    assert len(som.table.splitlines()) == len(som.marks) + 1
    assert [m.index for m in som.marks] == list(range(1, len(som.marks) + 1))
    assert all(m.tag == ocr.OCR_TAG and m.name and m.text == "" for m in som.marks)
    assert som.screenshot == a11y.draw_marks(png, som.marks) != png


def test_a_line_read_as_one_is_split_into_elements_at_wide_gaps():
    """A menu bar drawn as one line of text with wide gaps between its words: one mark per
    word, each box on its word; the words of one label (a normal space) stay together."""
    image = Image.new("RGB", (640, 120), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=20)
    words = ["Documents", "Downloads", "Music"]
    boxes, x = {}, 20
    for w in words:
        draw.text((x, 20), w, fill="black", font=font)
        boxes[w] = draw.textbbox((x, 20), w, font=font)
        x = boxes[w][2] + 40
    draw.text((20, 70), "Save as copy", fill="black", font=font)
    read = ocr.read_marks(_png(image))
    names = [m.name for m in read]
    assert names[:3] == words and ocr.normalise(names[3]) == "saveascopy", names
    for w, m in zip(words, read, strict=False):
        cx, cy = m.center
        x0, y0, x1, y1 = boxes[w]
        assert x0 <= cx <= x1 and y0 - 4 <= cy <= y1 + 4, (w, m.box, boxes[w])


async def _first_screen(env: Environment, task: dict) -> bytes:
    """The screenshot the episode's first turn will see (the desktop is deterministic: the
    same task set up again shows the same screen)."""
    assert await env.prepare(Task.from_dict(task, domain="sim")) is None
    return await env.client.screenshot()


def test_a_som_episode_from_ocr_clicks_by_mark_and_records_its_source():
    """The scripted oracle clicks by OCR's marks (each click at a mark's centre) and the
    checker scores the episode 1; every turn records "ocr", the first prompt holds the OCR
    table of the first screen token for token, and the replay store item the learner
    trains from holds those same tokens."""
    task = generate_tasks("click_button", 1, seed=1)[0]
    policy = ScriptedPolicy()
    cfg = EpisodeConfig(max_steps=0, observation_type="som", marks_source="ocr")
    grant = wire.Grant("g/0/1", task["id"], "g", 0, 0, json.dumps(task))

    async def go():
        async with running([SimConfig(port=0)]) as urls:
            env = Environment(0, urls[0], RunnerConfig(reset_before_setup=True))
            try:
                png = await _first_screen(env, task)
                traj = await run_episode(env, grant, policy, cfg, actor_id="a0")
            finally:
                await env.close()
        return traj, png

    traj, png = asyncio.run(go())
    assert traj.status == Status.OK and traj.checker_score == 1.0, traj.error
    assert traj.observation_type == "som" and [t.marks_source for t in traj.turns] == ["ocr"] * len(
        traj.turns
    )
    tok = policy.tokenizer
    said = [tok.decode(t.response_ids.tolist()) for t in traj.turns]
    clicks = [s for s in said if "click(" in s]
    assert clicks and all("click(mark=" in s for s in clicks), said
    som = ocr.set_of_marks(png)
    n = int(clicks[0].split("click(mark=")[1].split(")")[0])
    x, y = {m.index: m for m in som.marks}[n].center
    assert traj.turns[0].action.endswith(f"pyautogui.click({x}, {y}, button='left')")
    assert bytes(traj.turns[0].screenshot) == som.screenshot
    table = a11y.trim(som.table, tok, cfg.a11y_max_tokens)
    part = tok.encode(observation_text("som", table), add_special_tokens=False)
    item = store_item.to_item(traj)
    tokens = item.tokens[: len(traj.turns[0].prompt_ids)].tolist()
    assert any(tokens[i : i + len(part)] == part for i in range(len(tokens) - len(part) + 1))
    back = wire.decode(wire.encode(traj))
    assert back == traj and back.turns[0].marks_source == "ocr"
    assert store_item.from_item(item) == traj


def test_auto_reads_pixels_only_where_the_tree_gives_no_mark():
    """'auto' takes the tree's marks on a scene and OCR's on the bare desktop, whose tree
    has no element with a mark (the top bar's text is drawn, not in the tree)."""
    task = Task.from_dict(generate_tasks("dialog_confirm", 1, seed=2)[0], domain="sim")
    cfg = EpisodeConfig(observation_type="som", marks_source="auto")
    grant = wire.Grant("g/0/1", task.id, "g", 0, 0, "{}")

    async def go():
        async with running([SimConfig(port=0)]) as urls:
            env = Environment(0, urls[0], RunnerConfig(reset_before_setup=True))
            try:
                await env.client.reset()
                bare = await observe(env, start_run(task, grant, ScriptedPolicy(), cfg), cfg)
                assert await env.prepare(task) is None
                scene = await observe(env, start_run(task, grant, ScriptedPolicy(), cfg), cfg)
            finally:
                await env.close()
        return bare, scene

    bare, scene = asyncio.run(go())
    assert scene.marks_source == "tree" and scene.marks and scene.marks[0].tag != ocr.OCR_TAG
    assert bare.marks_source == "ocr" and bare.marks
    assert "Activities" in {m.name for m in bare.marks}


def test_a_pass_over_its_time_bound_fails_the_observation_naming_the_field():
    png = Desktop(1280, 720).screenshot_png()
    with pytest.raises(EnvTimeout, match=r"episode\.ocr\.timeout_s"):
        asyncio.run(ocr.read_set_of_marks(png, ocr.OcrConfig(timeout_s=0.001)))


def test_config_refuses_ocr_marks_without_som_and_bad_ocr_fields():
    with pytest.raises(ConfigError, match=r"marks_source.*only the som observation has marks"):
        load_config(EpisodeConfig, None, ["marks_source=ocr"])
    with pytest.raises(ConfigError, match=r"config field ocr\.timeout_s"):
        load_config(EpisodeConfig, None, ["observation_type=som", "ocr.timeout_s=0"])
    with pytest.raises(ValueError, match="split_gap"):
        ocr.OcrConfig(split_gap=0)
    with pytest.raises(ValueError, match="min_score"):
        ocr.OcrConfig(min_score=1.5)
    cfg = load_config(EpisodeConfig, None, ["observation_type=som", "marks_source=auto"])
    assert cfg.marks_source == "auto" and cfg.ocr.timeout_s == 30.0


@pytest.mark.slow  # a tiny model's processor and an OCR pass a turn: make test-all
def test_oracle_demonstrations_with_ocr_marks_click_by_them(tmp_path):
    """`record_demos` with OCR's marks: every demonstration is scored 1, each turn records
    "ocr" and every click names a mark."""
    from transformers import AutoProcessor

    from arpo.offline.demos import record_demos
    from arpo.policy.tiny import build_tiny_model

    processor = AutoProcessor.from_pretrained(build_tiny_model(tmp_path / "m"))
    tasks = generate_tasks("click_button", 2, seed=5)
    demos, report = record_demos(tasks, processor, n_envs=1, max_steps=0,
                                 observation_type="som", marks_source="ocr")  # fmt: skip
    assert report["kept"] == 2 and len(demos) == 2, report
    for d in demos:
        assert d.checker_score == 1.0 and {t.marks_source for t in d.turns} == {"ocr"}
        said = [processor.tokenizer.decode(t.response_ids) for t in d.turns]
        clicks = [r for r in said if "click(" in r]
        assert clicks and all("click(mark=" in r for r in clicks), said

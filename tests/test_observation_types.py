"""OSWorld's observation types in the actor, end to end on a real simulated desktop.

Each type (`EpisodeConfig.observation_type`) runs a whole episode of a simulated task with
the scripted oracle, tokenised by the tiny model's own tokenizer: the prompt ids hold the
table's tokens exactly, the PNGs are what the model saw (the marked screenshot for som,
none for a11y_tree), the record says which type it was and survives the wire and the
replay store, and the learner's `build_sequence` with the tiny model's processor accepts
it. A som episode clicks by mark and the desktop's checker scores it 1; a mark the screen
does not have is a parse failure.
"""

from __future__ import annotations

import asyncio
import json

import msgpack
import numpy as np
import pytest
from arpo_envs.sim.server import SimConfig, running
from arpo_envs.sim.tasks import generate_tasks

from arpo import store_item, wire
from arpo.actor.episode import EpisodeConfig, run_episode
from arpo.actor.scripted import ScriptedPolicy
from arpo.config import validate
from arpo.env import a11y
from arpo.env.environment import Environment
from arpo.env.runner import RunnerConfig
from arpo.env.task import Task
from arpo.errors import ConfigError, EngineError, RecordError, WireError
from arpo.learner.batch import build_sequence, check_item
from arpo.policy import actions as A
from arpo.policy.engine import Completion
from arpo.policy.prompt import EpisodePrompt, pixel_bounds
from arpo.policy.prompt_text import computer_use_prompt, observation_text
from arpo.policy.tiny import build_tiny_model
from arpo.record import OBSERVATION_TYPES, Status, Trajectory

TYPES = list(OBSERVATION_TYPES)


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny") / "m"))


def _grant(task: dict) -> wire.Grant:
    return wire.Grant("g/0/1", task["id"], "g", 0, 0, json.dumps(task))


async def _first_observation(env: Environment, task: dict) -> tuple[bytes, str]:
    """The screenshot and tree the episode's first turn will see (the desktop is
    deterministic: the same task set up again shows the same screen)."""
    assert await env.prepare(Task.from_dict(task, domain="sim")) is None
    return await env.client.screenshot(), await env.client.accessibility()


def _run(task: dict, policy, cfg: EpisodeConfig) -> tuple[Trajectory, bytes, str]:
    async def go():
        async with running([SimConfig(port=0)]) as urls:
            env = Environment(0, urls[0], RunnerConfig(reset_before_setup=True))
            try:
                png, xml = await _first_observation(env, task)
                traj = await run_episode(env, _grant(task), policy, cfg, actor_id="a0")
            finally:
                await env.close()
        return traj, png, xml

    return asyncio.run(go())


def _contains(ids: np.ndarray, part: list[int]) -> bool:
    n = len(part)
    return any(ids[i : i + n].tolist() == part for i in range(len(ids) - n + 1))


@pytest.mark.parametrize("kind", TYPES)
def test_each_observation_type_through_a_simulated_desktop(processor, kind):
    task = generate_tasks("fill_form", 1, seed=4)[0]
    lo, hi = pixel_bounds(processor)
    tok = processor.tokenizer
    policy = ScriptedPolicy(tokenizer=tok, min_pixels=lo, max_pixels=hi)
    cfg = EpisodeConfig(max_steps=0, observation_type=kind)
    cfg.validate()
    traj, png, xml = _run(task, policy, cfg)

    assert traj.status == Status.OK and traj.checker_score == 1.0, traj.error
    assert traj.observation_type == kind and traj.format_reward == 0.0
    assert all(t.parsed for t in traj.turns)
    first = traj.turns[0]

    # The first turn's prompt holds the table's tokens, exactly as the prompt tokenised them.
    if kind == "screenshot":
        assert a11y.HEADER not in tok.decode(first.prompt_ids.tolist())
    else:
        if kind == "som":
            som = a11y.set_of_marks(xml, png)
            table = som.table
            assert bytes(first.screenshot) == som.screenshot != png  # the marked one
        else:
            table = a11y.linearize(xml)
        table = a11y.trim(table, tok, cfg.a11y_max_tokens)
        text = observation_text(kind, table)
        assert _contains(first.prompt_ids, tok.encode(text, add_special_tokens=False))
        for t in traj.turns[1:]:
            header = a11y.MARK_HEADER if kind == "som" else a11y.HEADER
            assert header in tok.decode(t.prompt_ids.tolist())
    if kind == "a11y_tree":
        assert all(len(t.screenshot) == 0 for t in traj.turns)
    else:
        assert all(len(t.screenshot) > 0 for t in traj.turns)
    if kind == "screenshot_a11y_tree":
        assert bytes(first.screenshot) == png

    # The record round-trips the wire and the replay store, observation type included.
    back = wire.decode(wire.encode(traj))
    assert back == traj and back.observation_type == kind
    item = store_item.to_item(traj)
    assert store_item.from_item(item) == traj

    # The learner accepts it: image tokens agree with the tiny model's processor.
    image_pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert check_item(item, processor, image_pad, vocab_size=len(tok)) is None
    seq = build_sequence(item, processor, image_pad, traj.trajectory_id)
    if kind == "a11y_tree":
        assert not seq.pixels and int((seq.input_ids == image_pad).sum()) == 0
    else:
        assert seq.pixels and len(seq.image_meta) == traj.steps
    assert len(seq.targets) == sum(len(t.response_ids) for t in traj.turns)


def test_a_som_episode_clicks_by_mark_and_scores_one():
    # Two clicks on buttons in order: both by mark, resolved to the marks' centres.
    task = generate_tasks("click_sequence", 1, seed=7)[0]
    traj, png, xml = _run(
        task, ScriptedPolicy(), EpisodeConfig(max_steps=0, observation_type="som")
    )
    assert traj.status == Status.OK and traj.checker_score == 1.0
    tok = ScriptedPolicy().tokenizer
    texts = [tok.decode(t.response_ids.tolist()) for t in traj.turns]
    clicks = [t for t in texts if "click(" in t]
    assert clicks and all("click(mark=" in t for t in clicks)
    # The first click runs at its mark's centre, in screen pixels.
    marks = {m.index: m for m in a11y.set_of_marks(xml, png).marks}
    n = int(texts[0].split("click(mark=")[1].split(")")[0])
    x, y = marks[n].center
    assert traj.turns[0].action.endswith(f"pyautogui.click({x}, {y}, button='left')")


def test_a_som_tree_rollout_forks_with_its_observation_type():
    """Forked episodes (`EpisodeRun.branch`) go on showing marks and clicking by them."""
    from arpo.actor.tree import run_tree
    from arpo.service.grants import GrantBook, GrantConfig

    task = generate_tasks("fill_form", 1, seed=3)[0]
    gc = GrantConfig(group_size=4, groups_per_step=1, tree_slots=4, branch_width=2,
                     branch_every=2, shuffle=False)  # fmt: skip
    gc.validate()
    (grant,) = GrantBook([task], gc).request("a0", want=1)
    cfg = EpisodeConfig(max_steps=0, observation_type="som")

    async def go():
        async with running([SimConfig(port=0)]) as urls:
            env = Environment(0, urls[0], RunnerConfig(reset_before_setup=True))
            try:
                return await run_tree(env, grant, ScriptedPolicy(seed=5), cfg, actor_id="a0")
            finally:
                await env.close()

    results, back = asyncio.run(go())
    trajs = [t for _, _, t in results if t is not None]
    assert not back and len(trajs) == 4
    tok = ScriptedPolicy().tokenizer
    for t in trajs:
        assert t.status == Status.OK and t.checker_score == 1.0 and t.observation_type == "som"
        assert t.branch is not None
        last = tok.decode(t.turns[-2].response_ids.tolist())
        assert "click(mark=" in last  # the submit button, after the last fork
        assert wire.decode(wire.encode(t)) == t


class _MarkPolicy:
    """A hand-made policy answering one fixed response (no oracle)."""

    def __init__(self, text: str) -> None:
        self.tokenizer = ScriptedPolicy().tokenizer
        self.min_pixels, self.max_pixels = A.MIN_PIXELS, A.MAX_PIXELS
        self.text = text

    async def generate(self, token_ids, images=(), params=None) -> Completion:
        ids = [
            *self.tokenizer.encode(self.text),
            self.tokenizer.convert_tokens_to_ids("<|im_end|>"),
        ]
        return Completion(np.asarray(ids, np.int32), np.full(len(ids), -0.1, np.float32),
                          self.text, "stop", 0)  # fmt: skip


@pytest.mark.parametrize("kind", ["som", "screenshot"])
def test_a_mark_the_screen_does_not_have_is_a_parse_failure(kind):
    task = generate_tasks("click_button", 1, seed=1)[0]
    policy = _MarkPolicy("Thought: the last one.\nAction: click(mark=999)")
    traj, png, xml = _run(task, policy, EpisodeConfig(max_steps=0, observation_type=kind))
    assert traj.steps == 1 and not traj.turns[0].parsed and traj.format_reward == -1.0
    assert traj.turns[0].action == "" and traj.checker_score == 0.0
    # The reason, as the parser gives it.
    marks = {m.index: A.Point(*m.center) for m in a11y.set_of_marks(xml, png).marks}
    frame = A.Frame(1280, 720, 1280, 720)
    r = A.try_parse_response(policy.text, frame, marks=marks if kind == "som" else None)
    assert not r.parsed
    assert ("no mark 999 on this screen" if kind == "som" else "shows no marks") in r.error


def test_a_table_over_its_budget_is_cut_with_osworlds_marker(processor):
    task = generate_tasks("list_select", 1, seed=2)[0]
    lo, hi = pixel_bounds(processor)
    tok = processor.tokenizer
    cfg = EpisodeConfig(max_steps=0, observation_type="a11y_tree", a11y_max_tokens=64)
    policy = ScriptedPolicy(tokenizer=tok, min_pixels=lo, max_pixels=hi)
    traj, _, xml = _run(task, policy, cfg)
    assert traj.status == Status.OK and traj.checker_score == 1.0  # no image needed
    cut = a11y.trim(a11y.linearize(xml), tok, 64)
    assert cut.endswith(a11y.ELLIPSIS)
    part = tok.encode(observation_text("a11y_tree", cut), add_special_tokens=False)
    assert _contains(traj.turns[0].prompt_ids, part)


@pytest.mark.parametrize("kind", ["a11y_tree", "screenshot_a11y_tree", "som"])
def test_prompt_ids_equal_the_chat_template(processor, kind):
    """The turn messages with a table are what Qwen2-VL's chat template renders."""
    from PIL import Image

    img = Image.new("RGB", (320, 200), (30, 90, 160))
    image = None if kind == "a11y_tree" else img
    lo, hi = pixel_bounds(processor)
    ep = EpisodePrompt(processor.tokenizer, "Click OK.", min_pixels=lo, max_pixels=hi,
                       observation_type=kind)  # fmt: skip
    table = 'tag\tname\ntable-cell\tA1 "x"\npush-button\tOK'
    ep.add_observation(image, table)
    ep.add_response(processor.tokenizer.encode("Action: wait()<|im_end|>"))
    ep.add_observation(image, table + "\nlabel\tDone")
    ids, images = ep.model_input()
    text = processor.apply_chat_template(ep.messages(), add_generation_prompt=True, tokenize=False)
    want = processor(text=[text], images=images or None)["input_ids"][0]
    assert ids.tolist() == list(want)
    assert len(images) == (0 if kind == "a11y_tree" else 2)


def test_prompt_refuses_pieces_that_do_not_match_its_type():
    tok = ScriptedPolicy().tokenizer
    for kind, image, table in [
        ("a11y_tree", b"png", "t"),
        ("a11y_tree", None, None),
        ("som", None, "t"),
        ("screenshot", None, "t"),
    ]:
        ep = EpisodePrompt(tok, "x", min_pixels=A.MIN_PIXELS, max_pixels=A.MAX_PIXELS,
                           observation_type=kind)  # fmt: skip
        with pytest.raises(EngineError, match=f"a {kind} turn shows"):
            ep.add_observation(image, table)


def test_the_screenshot_prompt_is_the_references_and_the_others_say_what_they_show():
    assert computer_use_prompt("x") == computer_use_prompt("x", observation_type="screenshot")
    assert "action history, with screenshots. You need" in computer_use_prompt("x")
    assert "click(mark=N)" in computer_use_prompt("x", observation_type="som")
    assert "click(mark=N)" not in computer_use_prompt("x", observation_type="a11y_tree")
    assert "screen pixels" in computer_use_prompt("x", observation_type="a11y_tree")
    assert "screen pixels" not in computer_use_prompt("x")


def test_config_and_record_refuse_unknown_types():
    with pytest.raises(ConfigError, match="observation_type"):
        validate(EpisodeConfig(observation_type="video"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="a11y_max_tokens"):
        validate(EpisodeConfig(a11y_max_tokens=0))
    with pytest.raises(RecordError, match="observation"):
        Trajectory("t", (), 0.0, observation_type="video")


def _header_frames(traj: Trajectory, edit) -> list:
    frames = wire.encode(traj)
    header = msgpack.unpackb(frames[1], raw=False)
    edit(header)
    return [frames[0], msgpack.packb(header, use_bin_type=True), *frames[2:]]


def test_old_records_decode_as_screenshot_and_a_bad_type_is_refused():
    from arpo.record import Turn

    png = a11y.draw_marks(_tiny_png(), [])
    turn = Turn(np.arange(5, dtype=np.int32), png, np.arange(3, dtype=np.int32),
                np.full(3, -0.5, np.float32), 0)  # fmt: skip
    traj = Trajectory("t", (turn,), 1.0, observation_type="som")
    assert wire.decode(wire.encode(traj)).observation_type == "som"
    old = wire.decode(_header_frames(traj, lambda h: h.pop("obs")))
    assert old.observation_type == "screenshot"
    with pytest.raises(WireError, match="observation"):
        wire.decode(_header_frames(traj, lambda h: h.update(obs="video")))
    with pytest.raises(WireError, match="obs"):
        wire.decode(_header_frames(traj, lambda h: h.update(obs=3)))


def _tiny_png() -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("kind", ["a11y_tree", "som"])
def test_oracle_demonstrations_show_the_type_and_som_ones_click_by_mark(processor, kind):
    """`record_demos` (the warm start's data) records through the episode path with the
    observation type: a11y_tree demonstrations hold no screenshot and click at screen
    pixels read from the table's frame; som ones name the mark of every button they click.
    Every one is scored 1 by the desktop's checker."""
    from arpo.offline.demos import record_demos

    tasks = generate_tasks("click_sequence", 3, seed=11)
    demos, report = record_demos(tasks, processor, n_envs=2, observation_type=kind)
    assert report["kept"] == 3 and len(demos) == 3, report
    for d in demos:
        assert d.observation_type == kind and d.checker_score == 1.0
        said = [processor.tokenizer.decode(t.response_ids) for t in d.turns]
        clicks = [r for r in said if "click(" in r]
        assert len(clicks) >= 2, said
        if kind == "som":
            assert all("click(mark=" in r for r in clicks), clicks
            assert all(t.screenshot for t in d.turns)
        else:
            assert all("click(start_box=" in r for r in clicks), clicks
            assert not any(t.screenshot for t in d.turns)


def test_arpo_train_refuses_a_warm_start_made_for_another_observation_type(tmp_path):
    """A run folder's warm start learned to read one observation type; a run that shows
    the policy another one stops with the field to change, instead of training a policy
    on prompts it never saw."""
    import json as _json

    from arpo.config import load_config
    from arpo.errors import ArpoError
    from arpo.policy.tiny import build_tiny_model
    from arpo.train import TrainConfig, TrainRun

    sft = tmp_path / "run" / "sft"
    sft.mkdir(parents=True)
    (sft / "config.json").write_text("{}")
    (sft / "offline.json").write_text(_json.dumps({"sft": {"observation_type": "screenshot"}}))
    build_tiny_model(tmp_path / "run" / "tiny", seed=0)
    cfg = load_config(
        TrainConfig,
        None,
        [f"run_dir={str(tmp_path / 'run')!r}", "actor.episode.observation_type='som'"],
    )
    with pytest.raises(ArpoError, match="observation_type is 'som', the warm start's 'screenshot'"):
        TrainRun(cfg).policy()
    same = load_config(TrainConfig, None, [f"run_dir={str(tmp_path / 'run')!r}"])
    assert TrainRun(same).policy() == str(sft)
    # The table budget and the context window are part of the prompt too (a warm start
    # saved before they were recorded had the defaults).
    for field, value in (("a11y_max_tokens", 640), ("history_images", 3)):
        other = load_config(
            TrainConfig,
            None,
            [f"run_dir={str(tmp_path / 'run')!r}", f"actor.episode.{field}={value}"],
        )
        with pytest.raises(ArpoError, match=rf"{field} is {value}, the warm start's"):
            TrainRun(other).policy()
    (sft / "offline.json").write_text(
        _json.dumps({"sft": {"observation_type": "screenshot", "a11y_max_tokens": 640}})
    )
    cut = load_config(
        TrainConfig,
        None,
        [f"run_dir={str(tmp_path / 'run')!r}", "actor.episode.a11y_max_tokens=640"],
    )
    assert TrainRun(cut).policy() == str(sft)


def test_arpo_train_builds_the_tiny_model_with_its_image_budget(tmp_path):
    """`tiny_max_pixels` is the tiny model's processor budget: the saved processor has it
    (the actor and the learner read it there), a 1280x720 screenshot costs as many image
    tokens as it allows, a run folder built with another budget is refused, and the field
    is refused beside a model of one's own."""
    from PIL import Image
    from transformers import AutoProcessor

    from arpo.config import ConfigError, load_config
    from arpo.errors import ArpoError
    from arpo.policy.prompt import EpisodePrompt, pixel_bounds
    from arpo.train import TrainConfig, TrainRun

    def run(*args: str) -> TrainRun:
        over = [f"run_dir={str(tmp_path / 'run')!r}", "warm_start=false", *args]
        return TrainRun(load_config(TrainConfig, None, over))

    tiny = run("tiny_max_pixels=200704").policy()
    processor = AutoProcessor.from_pretrained(tiny)
    assert pixel_bounds(processor)[1] == 200704
    prompt = EpisodePrompt.from_processor(processor, "click")
    assert prompt.image_tokens(Image.new("RGB", (1280, 720))) == 252  # 60 at the default
    with pytest.raises(ArpoError, match="tiny_max_pixels"):
        run().policy()
    with pytest.raises(ConfigError, match="tiny_max_pixels"):
        load_config(TrainConfig, None, ["model='/some/model'", "tiny_max_pixels=200704"])


def test_oracle_demonstrations_cut_their_tables_as_the_actors_do(processor):
    """`record_demos` cuts each prompt's table to `a11y_max_tokens` (the actors'
    episode.a11y_max_tokens), so a warm start learns on the tables RL will show; a bound
    the actors refuse is refused here, naming the field."""
    from arpo.offline.demos import record_demos

    tasks = generate_tasks("click_sequence", 1, seed=11)
    tok = processor.tokenizer
    cut, _ = record_demos(tasks, processor, n_envs=1, observation_type="a11y_tree",
                          a11y_max_tokens=24)  # fmt: skip
    whole, _ = record_demos(tasks, processor, n_envs=1, observation_type="a11y_tree")
    assert len(cut) == len(whole) == 1 and cut[0].checker_score == 1.0
    short = tok.decode(cut[0].turns[0].prompt_ids.tolist())
    full = tok.decode(whole[0].turns[0].prompt_ids.tolist())
    assert a11y.ELLIPSIS.strip() in short and a11y.ELLIPSIS.strip() not in full
    assert len(cut[0].turns[0].prompt_ids) < len(whole[0].turns[0].prompt_ids)
    with pytest.raises(ConfigError, match="a11y_max_tokens"):
        record_demos(tasks, processor, n_envs=1, a11y_max_tokens=0)
    with pytest.raises(ConfigError, match="history_images"):
        record_demos(tasks, processor, n_envs=1, history_images=0)

"""Oracle demonstrations through the real episode path, and the SFT warm start on the tiny model.

Demonstrations are recorded on simulated desktops served in process (HTTP on loopback) by
the actor's own episode loop; the tests check that the stored response ids are the model
tokenizer's encoding of the UI-TARS text, that replaying exactly those ids solves the task
again, and that `arpo sft` lowers the NLL of the demonstrations and saves a loadable model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoProcessor

from arpo.actor.episode import EpisodeConfig
from arpo.cli import main as cli_main
from arpo.config import load_config
from arpo.errors import ArpoError, ConfigError
from arpo.offline.data import read_trajectories, write_trajectories
from arpo.offline.demos import (
    DEMO_THOUGHT,
    DONE_THOUGHT,
    OraclePolicy,
    evaluate_greedy,
    record_demos,
    run_on_sim,
    sim_task_pool,
)
from arpo.offline.sft import SFTConfig, run
from arpo.policy import actions as A
from arpo.policy.engine import Completion
from arpo.policy.prompt import pixel_bounds
from arpo.policy.tiny import build_tiny_model
from arpo.record import Status, Trajectory


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.fixture(scope="module")
def processor(tiny: Path):
    return AutoProcessor.from_pretrained(tiny)


@pytest.fixture(scope="module")
def tasks() -> list[dict]:
    return sim_task_pool(["click_button", "menu_pick"], per_family=2, seed=3)


@pytest.fixture(scope="module")
def demos(tasks, processor) -> list[Trajectory]:
    kept, report = record_demos(tasks, processor, n_envs=2)
    assert report["tasks"] == report["kept"] == 4 and report["dropped"] == {}
    assert report["longest_episode"] == 3  # menu_pick: two clicks and finished()
    assert report["longest_response"] == max(len(t.response_ids) for d in kept for t in d.turns)
    return kept


def test_the_step_budget_fits_the_task_up_to_the_references_15() -> None:
    from arpo.actor.episode import MAX_STEPS, step_budget

    one, many = {"oracle": ["a"]}, {"oracle": ["a"] * 13}
    assert step_budget(one, 0) == 4 and step_budget(many, 0) == MAX_STEPS == 15
    assert step_budget({"id": "no-oracle"}, 0) == 15 and step_budget(many, 6) == 6


def test_dropped_demonstrations_are_reported_with_the_field_to_change(processor) -> None:
    """A step budget or a response budget too small for the oracles drops their
    demonstrations, each reason counted with its tasks; when nothing is left the error names
    the field (and arpo train's name for it) and the value that would do."""
    forms = sim_task_pool(["fill_form"], per_family=2, seed=1)
    clicks = sim_task_pool(["click_button"], per_family=1, seed=1)
    kept, report = record_demos([*forms, *clicks], processor, n_envs=2, max_steps=4)
    assert len(kept) == report["kept"] == 1 and report["oracle_too_long"] == 2
    assert sorted(report["dropped"]["oracle_too_long"]) == sorted(t["id"] for t in forms)
    need = max(len(t["oracle"]) for t in forms) + 1
    with pytest.raises(
        ArpoError, match=rf"max_steps to at least {need}.*actor\.episode\.max_steps"
    ):
        record_demos(forms, processor, n_envs=2, max_steps=4)
    with pytest.raises(ArpoError, match=r"response_too_long: 2.*actor\.episode\.max_new_tokens"):
        record_demos(forms, processor, n_envs=2, max_steps=0, max_new_tokens=8)
    kept, report = record_demos(forms, processor, n_envs=2, max_steps=0, max_new_tokens=64)
    assert report["kept"] == 2 and report["longest_episode"] == need


class _Replay:
    """Engine-shaped: answers each turn with the stored response ids of a demonstration."""

    def __init__(self, processor, by_task: dict[str, Trajectory]) -> None:
        self.processor = processor
        self.by_task = by_task

    def episode(self, task):
        turns = iter(self.by_task[task.id].turns)
        tok = self.processor.tokenizer

        class View:
            async def generate(self, token_ids, images=(), params=None):
                t = next(turns)
                ids = np.asarray(t.response_ids)
                text = tok.decode(ids[:-1].tolist(), skip_special_tokens=True)
                return Completion(ids, np.zeros(len(ids), np.float32), text, "stop", 0)

        return View()


def test_demos_hold_the_model_tokenizers_ids_of_ui_tars_text(demos, tasks, processor) -> None:
    tok = processor.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    lo, hi = pixel_bounds(processor)
    frame = A.Frame.for_screen(1280, 720, min_pixels=lo, max_pixels=hi)
    for demo, task in zip(demos, tasks, strict=True):
        assert demo.task_id == task["id"] and demo.status == Status.OK
        assert demo.checker_score == 1.0 and demo.steps == len(task["oracle"]) + 1
        for k, turn in enumerate(demo.turns):
            assert turn.parsed and int(turn.response_ids[-1]) == im_end
            assert not turn.logprobs.any()  # nobody sampled them
            text = tok.decode(turn.response_ids[:-1].tolist())
            if k < len(task["oracle"]):
                assert text.startswith(f"Thought: {DEMO_THOUGHT}\nAction: click(start_box=")
                # the click lands where the oracle clicks, up to the image frame's rounding
                x, y = map(int, task["oracle"][k].split("(")[1].rstrip(")").split(","))
                hit = re.search(r"pyautogui\.click\(([\d.]+), ([\d.]+)", turn.action)
                assert hit, turn.action
                ax, ay = float(hit.group(1)), float(hit.group(2))
                assert abs(ax - x) <= 1280 / frame.image_w and abs(ay - y) <= 720 / frame.image_h
            else:
                assert text == f"Thought: {DONE_THOUGHT}\nAction: finished()"
                assert turn.action == "DONE"
            # the stored ids are the tokenizer's own encoding of that text
            assert tok.encode(text, add_special_tokens=False) == turn.response_ids[:-1].tolist()


def test_stored_ids_replay_to_checker_score_one(demos, tasks, processor, tmp_path) -> None:
    write_trajectories(tmp_path / "demos", demos)
    back = list(read_trajectories(tmp_path / "demos"))
    assert back == demos
    import asyncio

    policy = _Replay(processor, {d.task_id: d for d in back})
    cfg = EpisodeConfig(max_steps=15, temperature=0.0)
    replays = asyncio.run(run_on_sim(tasks, policy, cfg, n_envs=2))
    for replay, demo in zip(replays, demos, strict=True):
        assert replay is not None and replay.status == Status.OK
        assert replay.checker_score == 1.0
        # the same prompts: screenshots and prompt ids are what the demo recorded
        for a, b in zip(replay.turns, demo.turns, strict=True):
            assert np.array_equal(a.prompt_ids, b.prompt_ids)
            assert np.array_equal(a.response_ids, b.response_ids)


def test_arpo_sft_records_trains_and_lowers_the_nll(tiny: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "sft"
    rc = cli_main(["sft", f"model={tiny}", f"out={out}", 'families=["click_button"]',
                   "per_family=3", "task_seed=5", "epochs=6", "batch_size=3", "micro_batch=3",
                   "lr=1e-3", "n_envs=2"])  # fmt: skip
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("arpo sft: 3 demonstrations, final loss ")
    summary = json.loads(lines[-1])
    assert summary["demos"] == 3 and summary["steps"] == 6
    assert summary["nll_after"] < 0.4 * summary["nll_before"]
    assert len(list(read_trajectories(out / "demos"))) == 3
    from transformers import Qwen2_5_VLForConditionalGeneration

    assert Qwen2_5_VLForConditionalGeneration.from_pretrained(out) is not None
    assert AutoProcessor.from_pretrained(out) is not None


def test_arpo_sft_stops_at_the_target_nll(tiny: Path, tmp_path: Path, capsys) -> None:
    """With target_nll, SFT stops after the first epoch whose demonstrations' mean NLL is
    at most the target (here well before the 40 epochs allowed), and reports that NLL."""
    out = tmp_path / "sft"
    rc = cli_main(["sft", f"model={tiny}", f"out={out}", 'families=["click_button"]',
                   "per_family=3", "task_seed=5", "epochs=40", "batch_size=3", "micro_batch=3",
                   "lr=1e-3", "n_envs=2", "target_nll=1.0"])  # fmt: skip
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["nll_before"] > 1.0 >= summary["nll_after"]
    assert 1 <= summary["steps"] < 40


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("per_family=0", "per_family"),
        ("max_steps=1", "max_steps"),
        ("out=''", "out"),
        ("target_nll=-1", "target_nll"),
        ("marks_source=ocr", "marks_source"),  # the screenshot shows no marks
        ("local_desktops=1", "local_desktops"),  # no task pool: local tasks come from one
        ("local_desktops=-1", "local_desktops"),
        ("a11y_max_tokens=0", "a11y_max_tokens"),  # the actors' bounds
        ("history_images=0", "history_images"),
    ],
)
def test_sft_config_errors_name_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        load_config(SFTConfig, None, ["model=m", "out=o", override])


@pytest.mark.slow
def test_sft_model_emits_parsable_actions_more_often_than_the_random_one(
    tiny: Path, tmp_path: Path
) -> None:
    tasks = sim_task_pool(["click_button"], per_family=8, seed=11)
    out = tmp_path / "sft"
    run(SFTConfig(model=str(tiny), out=str(out), families=["click_button"], per_family=8,
                  task_seed=11, epochs=25, batch_size=8, micro_batch=4, lr=1e-3, n_envs=2))  # fmt: skip
    base = evaluate_greedy(tiny, tasks, max_steps=2)
    tuned = evaluate_greedy(out, tasks, max_steps=2)
    assert base["parsed_rate"] < tuned["parsed_rate"]


class _Stammering(OraclePolicy):
    """The oracle, but its first response of every episode is text that does not parse."""

    def episode(self, task):
        inner = super().episode(task)
        first = {"done": False}
        policy = self

        class _Ep:
            async def generate(self, token_ids, images=(), params=None):
                if not first["done"]:
                    first["done"] = True
                    body = list(
                        policy.tokenizer.encode("umm, not an action", add_special_tokens=False)
                    )
                    ids = np.asarray([*body, policy.end_id], dtype=np.int32)
                    return Completion(ids, np.zeros(len(ids), np.float32), "umm, not an action",
                                      "stop", 0)  # fmt: skip
                return await inner.generate(token_ids, images, params)

        return _Ep()


@pytest.mark.parametrize("mode", ["end", "continue"])
def test_a_parse_failure_ends_the_episode_or_costs_only_its_turn(tasks, processor, mode) -> None:
    """`on_parse_failure = "end"` (the reference) ends the episode on the unparsable response;
    "continue" executes nothing for it, keeps it in the context as sampled and goes on: the
    oracle then solves the task, with the format reward -1 still counted."""
    import asyncio

    cfg = EpisodeConfig(max_steps=0, temperature=0.0, on_parse_failure=mode)
    trajs = asyncio.run(run_on_sim(tasks, _Stammering(processor), cfg, n_envs=2))
    for task, t in zip(tasks, trajs, strict=True):
        assert t is not None and t.status == Status.OK and t.format_reward == -1.0
        assert not t.turns[0].parsed
        if mode == "end":
            assert len(t.turns) == 1 and t.checker_score == 0.0
        else:
            assert len(t.turns) == len(task["oracle"]) + 2 and t.checker_score == 1.0
            assert all(x.parsed for x in t.turns[1:])
            # the sequence the learner trains holds the unparsed response where it was sampled
            ids, mask, _ = t.sequence()
            p0, r0 = len(t.turns[0].prompt_ids), t.turns[0].response_ids
            assert np.array_equal(ids[p0 : p0 + len(r0)], r0) and mask[p0 : p0 + len(r0)].all()
            assert len(ids) == t.num_tokens


def test_demonstrations_scored_by_a_model_are_replayable_at_its_settings(demos, tiny) -> None:
    """`score_demos`: the warm start's log-probs of each demonstrated token at the rollout
    temperature, and that temperature on every turn, so the learner's sampling check
    accepts them for replay (a demonstration recorded at temperature 0 is refused)."""
    from arpo.learner.assemble import sampling_mismatch
    from arpo.offline.demos import score_demos

    scored = score_demos(demos[:2], tiny, temperature=1.0)
    for d, s in zip(demos[:2], scored, strict=True):
        assert sampling_mismatch(d, 1.0, 1.0) is not None  # as recorded: temperature 0
        assert sampling_mismatch(s, 1.0, 1.0) is None
        assert [t.response_ids.tolist() for t in s.turns] == [
            t.response_ids.tolist() for t in d.turns
        ]
        lps = np.concatenate([t.logprobs for t in s.turns])
        assert np.isfinite(lps).all() and (lps <= 0).all() and lps.sum() < -1.0
        assert s.checker_score == 1.0 and s.trajectory_id != d.trajectory_id


def test_a_warm_start_on_tree_marks_is_not_reused_for_a_run_on_ocr_marks(tmp_path: Path) -> None:
    """`arpo train` keeps its warm start in run_dir/sft; a run whose marks come from OCR
    refuses one made on tree marks (its prompts differ), naming both."""
    from arpo.train import TrainConfig, TrainRun

    sft = tmp_path / "run" / "sft"
    sft.mkdir(parents=True)
    (sft / "config.json").write_text("{}")
    (sft / "offline.json").write_text(
        json.dumps({"sft": {"observation_type": "som", "marks_source": "tree"}})
    )
    cfg = load_config(TrainConfig, None, [f"run_dir={str(tmp_path / 'run')!r}",
                      "actor.episode.observation_type=som", "actor.episode.marks_source=ocr"])  # fmt: skip
    with pytest.raises(ArpoError, match=r"marks_source is 'ocr', the warm start's 'tree'"):
        TrainRun(cfg).policy()


@pytest.mark.slow
def test_arpo_sft_records_local_tasks_on_a_real_desktop_and_shows_calcs_tree(
    tiny: Path, processor, tmp_path: Path, capsys, caplog
) -> None:
    """`arpo sft local_desktops=1` on two Calc tasks of the local suite: a real desktop
    started for the recording (LibreOffice with its tree, set-of-marks from it), each oracle
    played as UI-TARS text (its pauses dropped) and scored 1 by the task's own checker; the
    prompts show Calc's marks; the desktop is stopped afterwards."""
    import logging
    import shutil

    import arpo_envs.tasks as suite
    from test_desktop_atspi import require_atspi

    require_atspi()
    caplog.set_level(logging.INFO, logger="arpo.env.bringup")
    calc = Path(suite.__file__).parent / "local" / "libreoffice_calc"
    pool = tmp_path / "tasks"
    for tid in ("calc-set-quantity", "calc-fix-food"):
        shutil.copytree(calc / tid, pool / tid)
        shutil.copy(calc / f"{tid}.json", pool / f"{tid}.json")
    out = tmp_path / "sft"
    rc = cli_main(["sft", f"model={tiny}", f"out={out}", f"tasks={pool}", "local_desktops=1",
                   "observation_type=som", "max_steps=0", "epochs=2", "batch_size=2",
                   "micro_batch=2", "lr=1e-3"])  # fmt: skip
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["demos"] == 2 and summary["record_kept"] == 2, summary
    assert summary["nll_after"] < summary["nll_before"]
    demos = list(read_trajectories(out / "demos"))
    assert sorted(d.task_id for d in demos) == ["calc-fix-food", "calc-set-quantity"]
    for d in demos:
        assert d.checker_score == 1.0 and d.status == Status.OK
        prompt = processor.tokenizer.decode(d.turns[0].prompt_ids)
        assert "\ttable-cell\tA1\t" in prompt, prompt[-3000:]  # a mark of Calc's own tree
        answer = processor.tokenizer.decode(d.turns[0].response_ids)
        assert "hotkey(" in answer and "sleep" not in answer, answer
    started = [int(m) for m in re.findall(r"desktop: env 0 \S+ display \S+ pid (\d+)", caplog.text)]
    assert len(started) == 1, caplog.text
    assert not Path(f"/proc/{started[0]}").exists(), "the desktop outlived the recording"


def test_an_oracles_pauses_are_dropped_from_its_ui_tars_text() -> None:
    """The local suite's oracles pause between keystrokes (`time.sleep`); UI-TARS has no
    timed pause, so the demonstration's actions are the calls around them. Any other call
    without a UI-TARS action is still refused."""
    from arpo.actor.scripted import oracle_to_actions
    from arpo.errors import EngineError

    code = "pyautogui.hotkey('ctrl', 's'); time.sleep(1.0); pyautogui.press('enter')"
    assert oracle_to_actions(code) == [A.Hotkey(("ctrl", "s")), A.Press("enter")]
    with pytest.raises(EngineError, match="no UI-TARS action for sleep"):
        oracle_to_actions("pyautogui.sleep(1.0)")

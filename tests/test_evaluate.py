"""`arpo eval` on the real rollout path: grant server + ingest here, a real `arpo-actor`
process with simulated desktops, driven by the scripted policy or by the tiny Qwen2.5-VL
loaded from a real learner checkpoint."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from arpo_envs.sim.tasks import generate_tasks, write_tasks
from conftest import POOL_FAMILIES, SCRIPTED_ACTOR, ListStore, loopback

from arpo import cli, store_item
from arpo.config import load_config, validate
from arpo.env.task import load_pool, task_domain
from arpo.errors import ArpoError, ConfigError
from arpo.learner.batch import build_sequence, collate, token_logprobs
from arpo.learner.checkpoint import save_checkpoint
from arpo.markdown import md_cell
from arpo.policy.prompt import forbidden_token_ids
from arpo.policy.tiny import build_tiny_model
from arpo.pool.evaluate import EvalConfig, run_eval
from arpo.record import Status

FAMILIES = POOL_FAMILIES
LOOPBACK = loopback()
SCRIPTED = SCRIPTED_ACTOR


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 simulated tasks in <family>/<id>.json (plus write_tasks' index file)."""
    root = tmp_path_factory.mktemp("pool")
    write_tasks(root, FAMILIES, n=2, seed=5)
    return root


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def test_scripted_eval_counts_match_ingest_and_domains_sum_their_tasks(
    pool: Path, tiny_dir: Path, tmp_path: Path
) -> None:
    n = 3
    out = tmp_path / "eval"
    cfg = validate(
        EvalConfig(
            tasks=str(pool),
            model=str(tiny_dir),
            runs_per_task=n,
            out=str(out),
            transport=LOOPBACK,
            local_actor_args=[*SCRIPTED, "scripted_quit_prob=0.4"],
            timeout_s=120,
            progress_s=0,
        )
    )
    store = ListStore()
    result = run_eval(cfg, store=store)

    received = collections.defaultdict(list)
    for task, item in store.items:
        received[task].append(item)
    pool_tasks = load_pool(pool)
    ids = [p.task["id"] for p in pool_tasks]
    domain_of = {p.task["id"]: p.domain for p in pool_tasks}
    assert sorted(set(domain_of.values())) == sorted(FAMILIES)  # the folder names
    assert list(result["tasks"]) == ids
    for tid in ids:
        r = result["tasks"][tid]
        assert r["runs"] == n and r["unknown"] == 0 and r["env_errors"] == 0
        assert r["domain"] == domain_of[tid]
        items = received[tid]
        assert len(items) == n
        trajs = [store_item.from_item(i) for i in items]
        assert all(t.status == Status.OK for t in trajs)
        assert r["successes"] == sum(t.checker_score >= 1.0 for t in trajs)
        assert r["success_rate"] == pytest.approx(r["successes"] / n)
        assert r["mean_score"] == pytest.approx(sum(t.checker_score for t in trajs) / n)
        assert r["mean_reward"] == pytest.approx(sum(t.reward for t in trajs) / n)
        assert r["mean_steps"] == pytest.approx(sum(t.steps for t in trajs) / n)
    successes = sum(r["successes"] for r in result["tasks"].values())
    assert 0 < successes < 6 * n  # the scripted policy gave up some episodes

    assert list(result["domains"]) == list(dict.fromkeys(domain_of[t] for t in ids))
    for d, agg in result["domains"].items():
        mine = [result["tasks"][t] for t in ids if domain_of[t] == d]
        assert agg["tasks"] == len(mine) == 2
        for k in ("runs", "successes", "env_errors", "unknown"):
            assert agg[k] == sum(t[k] for t in mine)
        assert agg["success_rate"] == pytest.approx(agg["successes"] / agg["runs"])
        for k in ("mean_score", "mean_reward", "mean_steps"):
            assert agg[k] == pytest.approx(sum(t[k] for t in mine) / 2)
    ov = result["overall"]
    assert ov["tasks"] == 6 and ov["episodes"] == 6 * n and ov["successes"] == successes
    assert ov["success_rate_episodes"] == pytest.approx(successes / (6 * n))
    rates = [r["success_rate"] for r in result["tasks"].values()]
    assert ov["success_rate_tasks"] == pytest.approx(sum(rates) / 6)
    assert result["policy"] == {
        "model": str(tiny_dir), "checkpoint": None, "iteration": None, "policy_version": None,
    }  # fmt: skip
    assert result["sampling"] == {"temperature": 0.6, "top_p": 1.0}
    assert result["complete"] is True and result["runs_per_task"] == n

    assert json.loads((out / "eval.json").read_text()) == result
    md = (out / "eval.md").read_text()
    assert all(md_cell(tid) in md for tid in ids)
    assert all(f"| {md_cell(f)} | 2 |" in md for f in FAMILIES)  # click\_button: escaped
    assert md.index("## By domain") < md.index("## By task")
    assert sorted(p.name for p in out.iterdir()) == ["actor.log", "eval.json", "eval.md"]


def test_engine_eval_of_a_checkpoint_samples_from_its_model_at_the_eval_temperature(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """The tiny model saved as a learner checkpoint; the checkpoints folder is given, so the
    newest checkpoint is used. The stored behaviour log-probs are those of that model at
    temperature 0.6 (recomputed here by teacher forcing), not at 1.0."""
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_dir)
    processor = AutoProcessor.from_pretrained(tiny_dir)
    ckpts = tmp_path / "checkpoints"
    for it, version in ((3, 2), (7, 5)):
        save_checkpoint(ckpts, it, model=model, processor=processor, optimizer_state={},
                        state={"version": version})  # fmt: skip
    tasks = tmp_path / "tasks"
    write_tasks(tasks, ["click_button"], n=2, seed=1)
    out = tmp_path / "eval"
    store = ListStore()
    cfg = load_config(EvalConfig, None, [
        f"checkpoint={str(ckpts)!r}", f"tasks={str(tasks)!r}", "runs_per_task=1",
        f"out={str(out)!r}", "timeout_s=180", "progress_s=0",
        "transport.data='tcp://127.0.0.1:0'", "transport.control='tcp://127.0.0.1:0'",
        "local_actor_args=['sim_envs=2', 'policy=\"engine\"', 'episode.max_steps=2', "
        "'episode.max_new_tokens=12', 'progress_s=0']",
    ])  # fmt: skip
    result = run_eval(cfg, store=store)
    ckpt = ckpts / "ckpt-00000007"
    assert result["policy"] == {"model": str(ckpt / "model"), "checkpoint": str(ckpt),
                                "iteration": 7, "policy_version": 5}  # fmt: skip
    assert result["sampling"] == {"temperature": 0.6, "top_p": 1.0}
    assert result["overall"]["episodes"] == 2 and len(result["tasks"]) == 2
    assert all(r["runs"] == 1 for r in result["tasks"].values())
    assert "ckpt-00000007" in (out / "eval.md").read_text()

    assert len(store.items) == 2
    image_token = model.config.image_token_id
    pad = processor.tokenizer.pad_token_id or 0
    for _, item in store.items:
        seq = build_sequence(item, processor, image_token)
        assert len(seq.targets) > 0
        mb = collate([seq], model, pad)
        # the engine samples with the vision tokens masked; the learner scores the same
        masked = torch.tensor(forbidden_token_ids(processor.tokenizer), dtype=torch.long)
        with torch.no_grad():
            at_06, _ = token_logprobs(model, mb, temperature=0.6, forbidden=masked)
            at_10, _ = token_logprobs(model, mb, temperature=1.0, forbidden=masked)
        behaviour = torch.tensor(np.array(item.logprobs))
        assert torch.allclose(at_06[0], behaviour, atol=2e-3)
        assert (at_10[0] - behaviour).abs().max() > 1e-2


def test_bad_configs_name_the_field(pool: Path, tiny_dir: Path, tmp_path: Path) -> None:
    base = [f"tasks={str(pool)!r}"]
    model = f"model={str(tiny_dir)!r}"
    cases = {
        "checkpoint": base,
        "runs_per_task": [*base, model, "runs_per_task=0"],
        "model": [*base, model, f"checkpoint={str(tmp_path)!r}"],
        "temperature": [*base, model, "temperature=-1"],
        "top_p": [*base, model, "top_p=0"],
        "local_actor_args": [*base, model, "local_actor_args=['episode.temperature=1.0']"],
    }
    for field, overrides in cases.items():
        with pytest.raises(ConfigError, match=f"config field {field}:"):
            load_config(EvalConfig, None, overrides)
    with pytest.raises(ConfigError, match=r"config field checkpoint: .*does not exist"):
        load_config(EvalConfig, None, [*base, f"checkpoint={str(tmp_path / 'gone')!r}"])
    empty = tmp_path / "no-checkpoints"
    empty.mkdir()
    cfg = load_config(EvalConfig, None, [*base, f"checkpoint={str(empty)!r}"])
    with pytest.raises(ConfigError, match=r"config field checkpoint: .*no valid checkpoint"):
        run_eval(cfg)
    cmd = [sys.executable, "-m", "arpo.cli", "eval", f"tasks={str(pool)!r}"]
    p = subprocess.run([*cmd, model, "runs_per_task=0"], capture_output=True, text=True)
    assert p.returncode == 2 and "runs_per_task" in p.stderr
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 2 and "config field checkpoint" in p.stderr


def test_cli_prints_the_report(pool: Path, tiny_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "cli"
    rc = cli.main([
        "eval", f"tasks={str(pool)!r}", f"model={str(tiny_dir)!r}", "runs_per_task=1",
        f"out={str(out)!r}", "transport.data='tcp://127.0.0.1:0'",
        "transport.control='tcp://127.0.0.1:0'", f"local_actor_args={json.dumps(SCRIPTED)}",
        "timeout_s=120", "progress_s=0",
    ])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert text.startswith("# Evaluation") and str(out / "eval.json") in text
    assert "6 successes in 6 episodes" in text  # the scripted policy never gives up here
    assert all(tid in text for tid in json.loads((out / "eval.json").read_text())["tasks"])


def test_task_domains_from_field_folder_or_id(tmp_path: Path) -> None:
    tasks = generate_tasks("click_button", 3, seed=2)
    for domain, t in zip(["chrome", "os"], tasks[:2], strict=True):  # examples/<domain>/<id>
        (tmp_path / "examples" / domain).mkdir(parents=True)
        (tmp_path / "examples" / domain / f"{t['id']}.json").write_text(json.dumps(t))
    by_id = {p.task["id"]: p.domain for p in load_pool(tmp_path / "examples")}
    assert by_id == {tasks[0]["id"]: "chrome", tasks[1]["id"]: "os"}
    assert {p.domain for p in load_pool(tmp_path / "examples" / "os")} == {"os"}
    tasks[0]["domain"] = "from-field"
    tasks[1]["id"] = "calc-0001"
    jl = tmp_path / "pool.jsonl"
    jl.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    got = load_pool(jl)
    assert [p.domain for p in got] == ["from-field", "calc", tasks[2]["id"].split("-")[0]]
    assert [p.source for p in got] == [f"{jl}:1", f"{jl}:2", f"{jl}:3"]
    assert [p.task for p in got] == tasks  # the dicts as read, nothing added
    assert task_domain({"id": "nodash"}) == "unknown"
    assert task_domain({"id": "a-b"}, folder="os") == "os"
    assert task_domain({"id": "a-b", "domain": "gimp"}, folder="os") == "gimp"


def test_a_timeout_writes_an_incomplete_report(pool: Path, tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    cfg = validate(EvalConfig(tasks=str(pool), model=str(tiny_dir), runs_per_task=2,
                              out=str(out), transport=LOOPBACK, local_actor=False,
                              timeout_s=0.3, progress_s=0))  # fmt: skip
    with pytest.raises(ArpoError, match=r"timed out .* 0 of 12 runs"):
        run_eval(cfg)  # no actor connects
    data = json.loads((out / "eval.json").read_text())
    assert data["complete"] is False and data["overall"]["episodes"] == 0
    assert "incomplete" in (out / "eval.md").read_text()


def test_the_share_of_actions_that_did_not_parse_is_reported_per_turn() -> None:
    from arpo.pool.evaluate import format_markdown, summarize
    from arpo.pool.rollouts import EpisodeOutcome

    counts = {"a": {"runs": 2, "successes": 1, "env_errors": 0, "unknown": 0},
              "b": {"runs": 1, "successes": 0, "env_errors": 1, "unknown": 0}}  # fmt: skip
    eps = [
        EpisodeOutcome("1", "a", "ok", 1.0, 1.0, 3, 0, True, False, 0),
        EpisodeOutcome("2", "a", "ok", 0.0, -0.5, 4, 1, False, False, 3),
        EpisodeOutcome("3", "b", "ok", 0.0, -0.5, 1, 0, False, False, 1),
        EpisodeOutcome("4", "b", "env_error", 0.0, 0.0, 5, 1, False, False, 5),  # not counted
    ]
    out = summarize(counts, eps, {"a": "d", "b": "d"})
    assert out["tasks"]["a"]["parse_failure_rate"] == pytest.approx(3 / 7)
    assert out["tasks"]["b"]["parse_failure_rate"] == 1.0
    assert out["overall"]["parse_failure_rate"] == pytest.approx(4 / 8)
    res = {**out, "policy": {"model": "m"}, "runs_per_task": 2, "success_score": 1.0,
           "sampling": {"temperature": 1.0, "top_p": 1.0}}  # fmt: skip
    assert "50.0% of actions did not parse" in format_markdown(res)

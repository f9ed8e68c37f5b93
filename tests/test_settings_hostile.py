"""Settings that cannot work are refused when a command starts, naming the field and the
allowed range, with the same message from `arpo train`, `arpo-actor`, `arpo-learner` and the
pool commands: each field is checked where it is declared. A pool `arpo train` cannot load
(duplicate ids, a file that is not UTF-8, a missing folder) is refused on its own output,
exit 2, before any process starts. No model, no environment: every test here is a config check.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from arpo_envs.fleet_records import VMFleetState, dumps
from arpo_envs.sim.tasks import generate_tasks

from arpo import cli
from arpo.actor.config import ActorConfig
from arpo.config import MAX_SECONDS, load_config
from arpo.errors import ConfigError
from arpo.learner.learner import MIN_STORE_BYTES, LearnerConfig
from arpo.pool.evaluate import EvalConfig
from arpo.service.grants import GrantBook, GrantConfig
from arpo.train import TrainConfig


def refusal(cls: type, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(cls, None, overrides)
    return str(e.value)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("pool") / "tasks.json"
    p.write_text(json.dumps(generate_tasks("click_button", 2, seed=1)))
    return p


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder that looks like a Hugging Face model of a supported family to a config check
    (never loaded)."""
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    return d


def learner_args(pool: Path, model: Path) -> list[str]:
    return [f"tasks={str(pool)!r}", f"trainer.model={str(model)!r}"]


ACTOR = ["sim_envs=1", "policy='scripted'"]
NO_POOL = "does not exist (a task pool is a folder of task JSON files, a .json or a .jsonl file)"

# ---- the probe's findings: accepted before, each refused naming the field and its range ----

TRAIN = [
    ("learner.trainer.lr=1e300", "learner.trainer.lr", "(0, 1]"),
    ("actor.episode.step_timeout_s=0", "actor.episode.step_timeout_s", "(0, 604800]"),
    ("actor.episode.step_timeout_s=-1", "actor.episode.step_timeout_s", "(0, 604800]"),
    ("actor.environment.reset_backoff_s=-1", "actor.environment.reset_backoff_s", "[0, 30]"),
    ("actor.environment.reset_backoff_s=1e300", "actor.environment.reset_backoff_s", "[0, 30]"),
    ("actor.episode.scroll_clicks=-5", "actor.episode.scroll_clicks", "[1, 100]"),
    ("actor.episode.scroll_clicks=1000000000", "actor.episode.scroll_clicks", "[1, 100]"),
    ("actor.episode.format_weight=1e308", "actor.episode.format_weight", "[0, 100]"),
    ("eval_temperature=-1", "eval_temperature", "[0, 100]"),
    ("sft_target_nll=-1", "sft_target_nll", "[0, 100]"),
    ("progress_s=-1", "progress_s", "[0, 604800]"),
    ("tasks='/nonexistent'", "tasks", f"/nonexistent: {NO_POOL}"),
    ("model='/nonexistent'", "model", "does not exist and is not a Hugging Face hub id"),
    ("vm_fleet='/etc/hostname'", "vm_fleet", "is not a fleet state file"),
    ('env_urls=["ftp://x"]', "env_urls", "must be http://HOST[:PORT]"),
    ("learner.store_max_bytes=1000", "learner.store_max_bytes", f"[{MIN_STORE_BYTES}, "),
]


@pytest.mark.parametrize("override, field, allowed", TRAIN, ids=[t[0][:40] for t in TRAIN])
def test_arpo_train_refuses_what_the_probe_found(override: str, field: str, allowed: str) -> None:
    message = refusal(TrainConfig, [override])
    assert message.startswith(f"config field {field}: "), message
    assert allowed in message, message


ACTOR_FOUND = [
    ("sim_envs=1000000", "sim_envs", "[0, 1024]"),
    ("max_episodes=-1", "max_episodes", ">= 0"),
    ("runner.osworld_workers=100000", "runner.osworld_workers", "[0, 64]"),
    ("episode.step_timeout_s=0", "episode.step_timeout_s", "(0, 604800]"),
    ("environment.reset_backoff_s=1e300", "environment.reset_backoff_s", "[0, 30]"),
    ("episode.scroll_clicks=-1", "episode.scroll_clicks", "[1, 100]"),
    ("progress_s=-1", "progress_s", "[0, 604800]"),
    (f"actor_id='{'a' * 2000}'", "actor_id", "at most 1024 bytes"),
    ('actor_id="actor\\n0"', "actor_id", "contains '\\n'"),
    ('actor_id="actor 0"', "actor_id", "without whitespace"),
]


@pytest.mark.parametrize("override, field, allowed", ACTOR_FOUND, ids=[a[1] for a in ACTOR_FOUND])
def test_arpo_actor_refuses_what_the_probe_found(override: str, field: str, allowed: str) -> None:
    message = refusal(ActorConfig, [*ACTOR, override])
    assert message.startswith(f"config field {field}: "), message
    assert allowed in message, message


def test_the_store_budget_has_a_documented_floor(pool: Path, model: Path) -> None:
    """Below one realistic trajectory the store refuses everything: 64 MiB at least."""
    base = learner_args(pool, model)
    message = refusal(LearnerConfig, [*base, "store_max_bytes=1000"])
    assert "config field store_max_bytes: is 1000; must be in [67108864, " in message
    assert "64 MiB" in message
    cfg = load_config(LearnerConfig, None, [*base, f"store_max_bytes={MIN_STORE_BYTES}"])
    assert cfg.store_max_bytes == MIN_STORE_BYTES == 64 << 20
    assert LearnerConfig().store_max_bytes >= MIN_STORE_BYTES
    assert TrainConfig().learner.store_max_bytes >= MIN_STORE_BYTES


# ---- one field, one message: checked where it is declared --------------------------------

SAME = [
    # (train override, actor override)
    ("actor.episode.step_timeout_s=0", "episode.step_timeout_s=0"),
    ("actor.environment.reset_backoff_s=31", "environment.reset_backoff_s=31"),
    ("actor.episode.scroll_clicks=101", "episode.scroll_clicks=101"),
    ("actor.episode.format_weight=-0.5", "episode.format_weight=-0.5"),
    ("actor.environment.reset_retries=1000", "environment.reset_retries=1000"),
    ("actor.progress_s=1e300", "progress_s=1e300"),
    ("actor.max_episodes=-1", "max_episodes=-1"),
    ("actor.runner.osworld_workers=65", "runner.osworld_workers=65"),
    ("actor.runner.osworld_timeout_s=0", "runner.osworld_timeout_s=0"),
    ("actor.shutdown_deadline_s=-1", "shutdown_deadline_s=-1"),
    ("actor.env_recheck_s=1e9", "env_recheck_s=1e9"),
    ("actor.scripted_quit_prob=1.5", "scripted_quit_prob=1.5"),
    ('actor.actor_id="a\\tb"', 'actor_id="a\\tb"'),
]


@pytest.mark.parametrize("train, actor", SAME, ids=[s[1] for s in SAME])
def test_arpo_train_and_arpo_actor_refuse_with_the_same_message(train: str, actor: str) -> None:
    from_train = refusal(TrainConfig, [train])
    from_actor = refusal(ActorConfig, [*ACTOR, actor])
    assert from_train == from_actor.replace("config field ", "config field actor.", 1)
    assert re.search(r"must be (in [\[(][\d.]+, [\d.]+\]|>= 0)|contains '", from_actor), from_actor


def test_arpo_train_arpo_learner_and_arpo_eval_refuse_a_pool_alike(
    tmp_path: Path, pool: Path, model: Path
) -> None:
    missing = tmp_path / "no-such-folder"
    want = f"config field tasks: {missing}: {NO_POOL}"
    assert refusal(TrainConfig, [f"tasks={str(missing)!r}"]) == want
    assert (
        refusal(LearnerConfig, [f"tasks={str(missing)!r}", f"trainer.model={str(model)!r}"]) == want
    )
    assert refusal(EvalConfig, [f"tasks={str(missing)!r}", "model='m'"]) == want
    for cls, base in ((LearnerConfig, learner_args(pool, model)), (TrainConfig, [])):
        prefix = "learner." if cls is TrainConfig else ""
        message = refusal(cls, [*base, f"{prefix}trainer.lr=2.0"])
        assert message.startswith(f"config field {prefix}trainer.lr: is 2.0; must be in (0, 1]")


# ---- beyond the probe: every numeric field of these configs -------------------------------

BEYOND = [
    (TrainConfig, "minutes=1e300", "minutes"),
    (TrainConfig, "max_restarts=1000000", "max_restarts"),
    (TrainConfig, "eval_temperature=1e9", "eval_temperature"),
    (TrainConfig, "prefill_demos_from_turns=1000000", "prefill_demos_from_turns"),
    (TrainConfig, 'env_urls=["http://"]', "env_urls"),
    (TrainConfig, 'env_urls=["http://h:99999"]', "env_urls"),
    (TrainConfig, 'env_urls=["http://h:1/a b"]', "env_urls"),
    (TrainConfig, "vm_pool=''", "vm_pool"),
    (TrainConfig, "run_dir='/etc/hostname'", "run_dir"),
    (TrainConfig, "local_tasks='/nonexistent'", "local_tasks"),
    (TrainConfig, "actor.episode.temperature=1e9", "actor.episode.temperature"),
    (TrainConfig, "actor.episode.history_images=100000", "actor.episode.history_images"),
    (TrainConfig, "learner.trainer.lr=0", "learner.trainer.lr"),
    (TrainConfig, "learner.trainer.temperature=1e300", "learner.trainer.temperature"),
    (TrainConfig, "learner.trainer.weight_decay=5", "learner.trainer.weight_decay"),
    (TrainConfig, "learner.trainer.adam_eps=0", "learner.trainer.adam_eps"),
    (TrainConfig, "learner.trainer.epochs=1000000", "learner.trainer.epochs"),
    (TrainConfig, "learner.trainer.micro_batch=1000000000", "learner.trainer.micro_batch"),
    (TrainConfig, "learner.trainer.device='gpu'", "learner.trainer.device"),
    (TrainConfig, "learner.trainer.ref_model='/nonexistent'", "learner.trainer.ref_model"),
    (TrainConfig, "learner.success_score=0", "learner.success_score"),
    (TrainConfig, "learner.success_score=2", "learner.success_score"),
    (TrainConfig, "learner.wait_log_s=0", "learner.wait_log_s"),
    (TrainConfig, "learner.stall_s=1e300", "learner.stall_s"),
    (TrainConfig, "learner.step_delay_s=-1", "learner.step_delay_s"),
    (TrainConfig, "learner.publish_keep=100000", "learner.publish_keep"),
    (TrainConfig, "learner.store_fresh_capacity=1000000000", "learner.store_fresh_capacity"),
    (TrainConfig, "learner.checkpoint.keep=100000", "learner.checkpoint.keep"),
    (TrainConfig, "learner.checkpoint.dir='/etc/hostname'", "learner.checkpoint.dir"),
    (ActorConfig, 'envs=["ftp://x"]', "envs"),
    (ActorConfig, 'envs=["http://h:1"]\nenv_token="a b"', "env_token"),
    (ActorConfig, "vm_count=-1", "vm_count"),
    (ActorConfig, "sim_latency='fixed:-5'", "sim_latency"),
    (ActorConfig, "sim_latency='sometimes'", "sim_latency"),
    (ActorConfig, "sim_slow_env=5", "sim_slow_env"),
    (ActorConfig, "sim_slow_factor=0", "sim_slow_factor"),
    (ActorConfig, "scripted_error_prob=-0.1", "scripted_error_prob"),
    (ActorConfig, "max_unacked=1000000", "max_unacked"),
    (ActorConfig, "weights_delay_s=1e300", "weights_delay_s"),
    (ActorConfig, "flush_deadline_s=1e300", "flush_deadline_s"),
    (ActorConfig, "spool_dir='/etc/hostname'", "spool_dir"),
    (ActorConfig, "runner.osworld_probe_timeout_s=-1", "runner.osworld_probe_timeout_s"),
    (ActorConfig, "runner.osworld_timeout_s=1e300", "runner.osworld_timeout_s"),
    (ActorConfig, "runner.action_pause_s=-1", "runner.action_pause_s"),
    (EvalConfig, "runs_per_task=1000000000", "runs_per_task"),
    (EvalConfig, "temperature=-1", "temperature"),
    (EvalConfig, "grant_timeout_s=0", "grant_timeout_s"),
    (EvalConfig, "timeout_s=1e300", "timeout_s"),
    (EvalConfig, "progress_s=-1", "progress_s"),
    (EvalConfig, "max_attempts=1000000", "max_attempts"),
    (EvalConfig, "model='/nonexistent'", "model"),
    (ActorConfig, "transport.request_timeout_s=1e300", "transport.request_timeout_s"),
    (ActorConfig, "transport.linger_ms=-1", "transport.linger_ms"),
    (ActorConfig, "transport.reconnect_ivl_ms=-5", "transport.reconnect_ivl_ms"),
    (ActorConfig, "engine.request_timeout_s=1e300", "engine.request_timeout_s"),
    (ActorConfig, "engine.max_model_len=-1", "engine.max_model_len"),
    (ActorConfig, "engine.gpu_memory_utilization=-0.5", "engine.gpu_memory_utilization"),
    (EvalConfig, "transport.ack_timeout_s=0", "transport.ack_timeout_s"),
]


@pytest.mark.parametrize(
    "cls, override, field", BEYOND, ids=[f"{c.__name__}-{o[:40]}" for c, o, _ in BEYOND]
)
def test_every_numeric_field_is_bounded(
    cls: type, override: str, field: str, pool: Path, tmp_path: Path
) -> None:
    base = {ActorConfig: ACTOR, EvalConfig: [f"tasks={str(pool)!r}", "model='m'"]}.get(cls, [])
    overrides = [*base, *override.split("\n")]
    if cls is EvalConfig and override.startswith("model="):
        overrides.remove("model='m'")
    message = refusal(cls, overrides)
    assert message.startswith(f"config field {field}: "), message


def test_the_defaults_and_the_edges_of_every_range_are_accepted(
    tmp_path: Path, pool: Path, model: Path
) -> None:
    load_config(TrainConfig)
    load_config(ActorConfig, None, ACTOR)
    fleet = tmp_path / "fleet.json"
    state = VMFleetState(pid=1, ready=True, dir=str(tmp_path), control="http://127.0.0.1:1",
                         token="t", accel="tcg", accel_reason="", vms=(), clones=(),
                         ram_dir="")  # fmt: skip
    fleet.write_text(dumps(state))
    edges = [
        "actor.episode.step_timeout_s=604800", "actor.environment.reset_backoff_s=30",
        "actor.environment.reset_backoff_s=0", "actor.episode.scroll_clicks=100",
        "actor.episode.format_weight=0", "actor.environment.reset_retries=20",
        "progress_s=0", f"progress_s={MAX_SECONDS}", "eval_temperature=0",
        "sft_target_nll=0", "learner.trainer.lr=1.0", f"tasks={str(pool)!r}",
        f"model={str(model)!r}", 'env_urls=["https://[::1]:5000", "http://10.0.0.5:5000/"]',
        "minutes=525600", "learner.store_max_bytes=67108864", "learner.trainer.device='cuda:1'",
    ]  # fmt: skip
    cfg = load_config(TrainConfig, None, edges)
    assert cfg.actor.environment.reset_backoff_s == 0 and cfg.model == str(model)
    load_config(TrainConfig, None, [f"vm_fleet={str(fleet)!r}"])
    load_config(TrainConfig, None, ["model='Qwen/Qwen2.5-VL-3B-Instruct'"])  # a hub id
    actor = load_config(
        ActorConfig,
        None,
        [*ACTOR, "sim_envs=1024", "runner.osworld_workers=64", "actor_id='host-1234'",
         "sim_latency='lognormal:40,0.6'", "sim_slow_env=1023", f"vm_fleet={str(fleet)!r}",
         'envs=["http://127.0.0.1:5000"]', 'env_token="x-Y_z.0~"'],
    )  # fmt: skip
    assert actor.sim_envs == 1024
    load_config(LearnerConfig, None, [*learner_args(pool, model), "trainer.model='gpt2'"])


# ---- a pool arpo train cannot load: exit 2 on its own output, before anything starts ------


def _train(tmp_path: Path, tasks: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    run_dir = tmp_path / "run"
    rc = cli.main(["train", f"tasks={str(tasks)!r}", f"run_dir={str(run_dir)!r}"])
    assert not run_dir.exists()  # nothing started: no run folder, no learner log
    return rc, capsys.readouterr().err


def test_arpo_train_refuses_a_pool_with_a_duplicate_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "tasks"
    folder.mkdir()
    task = generate_tasks("click_button", 1, seed=4)[0]
    (folder / "a.json").write_text(json.dumps(task))
    (folder / "b.json").write_text(json.dumps(task))
    rc, err = _train(tmp_path, folder, capsys)
    assert rc == 2
    assert f"arpo train: config field tasks: {folder / 'b.json'}: task id {task['id']}" in err
    assert f"is also in {folder / 'a.json'}" in err and "learner" not in err


def test_arpo_train_refuses_a_task_file_that_is_not_utf8(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "tasks"
    folder.mkdir()
    task = generate_tasks("click_button", 1, seed=4)[0]
    task["instruction"] = "Cliquez sur le bouton élevé"
    (folder / "latin1.json").write_bytes(json.dumps(task, ensure_ascii=False).encode("latin-1"))
    rc, err = _train(tmp_path, folder, capsys)
    assert rc == 2 and f"config field tasks: {folder / 'latin1.json'}: not UTF-8" in err, err


def test_arpo_train_refuses_a_task_folder_that_does_not_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, err = _train(tmp_path, tmp_path / "typo", capsys)
    assert rc == 2
    assert err.strip() == f"arpo train: config field tasks: {tmp_path / 'typo'}: {NO_POOL}"


def test_train_run_refuses_the_pool_before_it_starts_anything(tmp_path: Path) -> None:
    """A config built in code goes through the same check (TrainRun validates it)."""
    from arpo.train import TrainRun

    with pytest.raises(ConfigError, match=r"config field tasks: .*does not exist \(a task pool"):
        TrainRun(TrainConfig(tasks=str(tmp_path / "typo"), run_dir=str(tmp_path / "run")))
    assert not (tmp_path / "run").exists()


LEARNER_BEYOND = [
    "trainer.loss.eps_high=1e300", "trainer.loss.kl_coef=-1", "trainer.loss.w_max=1e300",
    "assemble.replay.std_below=-1", "assemble.replay.admit_score_above=2",
    "assemble.poll_s=1e300", "metrics.progress_s=1e300", "metrics.flush_s=-1",
    "ingest.excluded_keep=-1", "ingest.sender_expiry_s=1e300", "grants.grant_timeout_s=1e300",
    "dist.timeout_s=1e300",
]  # fmt: skip


@pytest.mark.parametrize("override", LEARNER_BEYOND)
def test_the_learners_parts_bound_their_fields(override: str, pool: Path, model: Path) -> None:
    message = refusal(LearnerConfig, [*learner_args(pool, model), override])
    assert message.startswith(f"config field {override.split('=')[0]}: "), message


# ---- tree grants are checked against the group the learner assembles ----------------------


def test_tree_slots_are_checked_against_the_assembled_group_size() -> None:
    """`learner.grants.group_size` is taken from `learner.assemble.group_size`, so a tree of
    more slots than the configured group is refused, and one as large as it is accepted
    (whatever `GrantConfig.group_size`'s own default is)."""
    message = refusal(TrainConfig, ["learner.assemble.group_size=2", "learner.grants.tree_slots=4"])
    assert message.startswith("config field learner.grants.tree_slots: is 4; "), message
    assert "[0, 2]" in message and "assemble.group_size" in message, message
    cfg = load_config(
        TrainConfig,
        None,
        ["learner.assemble.group_size=16", "learner.assemble.groups_per_step=2",
         "learner.grants.tree_slots=16"],
    )  # fmt: skip
    assert cfg.learner.grants.tree_slots == 16


# ---- a config built in code checks itself -------------------------------------------------


def test_configs_built_in_code_check_themselves_naming_the_field() -> None:
    """An `Actor` built in code gets its settings from config objects made without
    `load_config`: they refuse a bad value when they are built."""
    from arpo.actor.episode import EpisodeConfig
    from arpo.env.environment import EnvironmentConfig

    with pytest.raises(ValueError, match=r"reset_backoff_s: is 1e\+300; must be in \[0, 30\]"):
        EnvironmentConfig(reset_backoff_s=1e300)
    with pytest.raises(ValueError, match=r"reset_retries"):
        EnvironmentConfig(reset_retries=0)
    with pytest.raises(ValueError, match=r"step_timeout_s"):
        EpisodeConfig(step_timeout_s=float("inf"))
    with pytest.raises(ValueError, match=r"ActorConfig.shutdown_deadline_s: is 1e\+300"):
        ActorConfig(shutdown_deadline_s=1e300)
    with pytest.raises(ValueError, match=r"ActorConfig.scripted_quit_prob"):
        ActorConfig(sim_envs=1, policy="scripted", scripted_quit_prob=2.0)
    with pytest.raises(ValueError, match=r"GrantConfig.tree_slots: is 100; must be in \[0, 64\]"):
        GrantConfig(tree_slots=100)
    with pytest.raises(ValueError, match=r"tree_slots: is 4; must be in \[0, 2\]"):
        GrantBook([{"id": "t"}], GrantConfig(group_size=2, tree_slots=4))
    assert EnvironmentConfig(reset_backoff_s=30).reset_backoff_s == 30
    assert GrantConfig(group_size=16, tree_slots=16).tree_slots == 16


def test_the_first_reset_delay_is_capped_too() -> None:
    """The delays between tries of reset + setup double from `reset_backoff_s`, each at most
    RESET_BACKOFF_CAP_S: the first as well as the doubled ones, so a first delay set past the
    cap (after the config was built) cannot hold a grant for the episode's deadline."""
    from arpo.env.environment import RESET_BACKOFF_CAP_S, reset_delays

    assert list(reset_delays(1.0, 4)) == [1.0, 2.0, 4.0]
    assert list(reset_delays(20.0, 3)) == [20.0, RESET_BACKOFF_CAP_S]
    assert list(reset_delays(1e300, 3)) == [RESET_BACKOFF_CAP_S, RESET_BACKOFF_CAP_S]
    assert list(reset_delays(0.0, 3)) == [0.0, 0.0]

"""The config system: loading, overrides, and every error path names the field."""

from __future__ import annotations

import enum
import json
import re
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import pytest

from arpo.config import describe, fail, field_docs, load_config, option, to_dict, validate
from arpo.errors import ConfigError


class Mode(enum.Enum):
    FAST = "fast"
    SAFE = "safe"


@dataclass
class Optim:
    lr: float = option(1e-6, "Learning rate.")
    betas: tuple[float, float] = option((0.9, 0.999), "AdamW betas.")

    def validate(self) -> None:
        if self.lr <= 0:
            fail("lr", "must be > 0; try 1e-6")


@dataclass
class Cfg:
    name: str = option("run", "Run name.")
    group_size: int = option(8, "Episodes per group.")
    tasks_per_iter: int = option(16, "Tasks per iteration.")
    use_replay: bool = option(True, "Replay successes.")
    agg: Literal["seq-mean-token-mean", "token-mean"] = option(
        "seq-mean-token-mean", "Aggregation."
    )
    mode: Mode = option(Mode.FAST, "A mode.")
    out: Path = option(Path("runs"), "Output folder.")
    tasks: list[str] = option(doc="Task ids.", factory=list)
    max_staleness: int | None = option(None, "Versions in flight; None for unbounded.")
    optim: Optim = option(Optim(), "Optimiser settings.")

    def validate(self) -> None:
        if self.group_size < 2:
            fail("group_size", "must be at least 2 (GRPO compares episodes within a group)")
        if self.use_replay and self.group_size < 3:
            fail("use_replay", "needs group_size >= 3 so a replayed success leaves fresh episodes")


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.toml"
    p.write_text(text)
    return p


def test_defaults_file_and_overrides(tmp_path: Path) -> None:
    assert load_config(Cfg) == Cfg()
    p = write(
        tmp_path,
        'name = "x"\ngroup_size = 4\ntasks = ["a", "b"]\nmode = "safe"\n[optim]\nlr = 1\nbetas = [0.5, 0.6]\n',
    )
    cfg = load_config(Cfg, p, ["optim.lr=3e-6", "name=bare-word", "max_staleness=2", "out=/tmp/o"])
    assert cfg.name == "bare-word" and cfg.group_size == 4 and cfg.tasks == ["a", "b"]
    assert cfg.mode is Mode.SAFE and cfg.out == Path("/tmp/o") and cfg.max_staleness == 2
    assert cfg.optim.lr == 3e-6 and cfg.optim.betas == (0.5, 0.6)
    assert isinstance(load_config(Cfg, p).optim.lr, float)  # int in TOML becomes a float
    # round trip through plain data
    assert load_config(Cfg, None, []) == validate(Cfg())
    assert to_dict(cfg)["mode"] == "safe"


def test_every_field_is_documented() -> None:
    docs = field_docs(Cfg)
    assert docs["optim.lr"] == "Learning rate." and all(docs.values())
    text = describe(Cfg)
    assert "optim.betas" in text and "Episodes per group." in text
    with pytest.raises(TypeError, match="documentation"):
        option(1)


@pytest.mark.parametrize(
    ("toml", "overrides", "message"),
    [
        ("group_sise = 4", [], "unknown config field 'group_sise'; did you mean 'group_size'"),
        ("[optim]\nlrr = 1e-6", [], "unknown config field 'optim.lrr'; did you mean 'optim.lr'"),
        ("", ["optim.lrr=1"], "unknown config field 'optim.lrr'"),
        ("", ["nosuch.lr=1"], "unknown config field 'nosuch'"),
        ("group_size = 'eight'", [], "config field 'group_size' must be an integer, got 'eight'"),
        ("group_size = 8.5", [], "config field 'group_size' must be an integer"),
        ("group_size = true", [], "config field 'group_size' must be an integer"),
        ("use_replay = 1", [], "config field 'use_replay' must be true or false"),
        ("name = 3", [], "config field 'name' must be a string"),
        (
            "agg = 'mean'",
            [],
            "config field 'agg' must be one of 'seq-mean-token-mean', 'token-mean'",
        ),
        ("mode = 'slow'", [], "config field 'mode' must be one of 'fast', 'safe'"),
        ("tasks = 'a'", [], "config field 'tasks' must be a list"),
        ("tasks = ['a', 2]", [], "config field 'tasks[1]' must be a string"),
        ("[optim]\nbetas = [0.9]", [], "config field 'optim.betas' must be a list of 2 items"),
        ("optim = 3", [], "optim: expected a table of fields"),
        ("max_staleness = 'x'", [], "config field 'max_staleness' must be"),
        ("", ["group_size=abc"], "config field 'group_size': cannot parse 'abc' as a int"),
        ("", ["group_size"], "is not of the form field=value"),
        ("", ["=3"], "has an empty field name"),
        ("", ["optim=3"], "override of 'optim': it is a table"),
        ("", ["name.x=3"], "'name' is a str, not a table"),
        ("group_size = 1", [], "config field group_size: must be at least 2"),
        ("group_size = 2", [], "config field use_replay: needs group_size >= 3"),
        ("[optim]\nlr = -1", [], "config field optim.lr: must be > 0"),
        ("group_size = ", [], "is not valid TOML"),
    ],
)
def test_errors_name_the_field(
    tmp_path: Path, toml: str, overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(Cfg, write(tmp_path, toml), overrides)
    assert message in str(e.value), str(e.value)


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Cfg, tmp_path / "nope.toml")


def test_to_toml_round_trips_nested_configs(tmp_path) -> None:
    from arpo_envs.sim.tasks import generate_tasks

    from arpo.actor.config import ActorConfig
    from arpo.config import to_toml
    from arpo.learner.learner import LearnerConfig

    pool = tmp_path / "tasks.json"  # the learner loads its pool when it starts
    pool.write_text(json.dumps(generate_tasks("click_button", 1, seed=0)))
    for cfg in (
        load_config(
            LearnerConfig,
            None,
            [
                'trainer.model="m"',
                f"tasks={str(pool)!r}",
                "trainer.lr=3e-06",
                'assemble.replay.mode="add"',
            ],
        ),
        load_config(
            ActorConfig,
            None,
            ["sim_envs=3", 'policy="scripted"', 'envs=["http://h:1", "http://h:2"]'],
        ),
    ):
        p = tmp_path / "c.toml"
        p.write_text(to_toml(cfg))
        assert load_config(type(cfg), p) == cfg


def test_nested_overrides_change_the_declared_default_not_the_class_default(tmp_path) -> None:
    """`arpo train learner.trainer.lr=3e-5` keeps the rest of train's embedded learner
    (groups of 4, lr 1e-4 replaced, the model set by train), from a file as from an
    override: a nested table is laid over the field's declared default."""
    from arpo.train import TrainConfig

    base = TrainConfig()
    c = load_config(TrainConfig, None, ["learner.trainer.lr=3e-5"])
    assert c.learner.trainer.lr == 3e-5 and base.learner.trainer.lr != 3e-5
    assert c.learner.assemble.group_size == base.learner.assemble.group_size == 4
    assert c.learner.trainer.model == base.learner.trainer.model
    f = tmp_path / "run.toml"
    f.write_text("[actor.episode]\nformat_weight = 0.0\n")
    c = load_config(TrainConfig, f)
    assert c.actor.episode.format_weight == 0.0
    assert c.actor.episode.max_steps == base.actor.episode.max_steps == 0
    assert c.actor.sim_envs == base.actor.sim_envs


def test_the_arpo_command_exits_2_naming_the_field_and_the_fix() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "arpo.cli", "train", "minuts=1"], capture_output=True, text=True
    )
    assert p.returncode == 2 and "'minuts'" in p.stderr and "'minutes'" in p.stderr, p.stderr


def test_the_replay_prefill_of_arpo_train_yields_to_a_named_one() -> None:
    """`prefill_runs_per_task` (16 by default) is checked; successes named by
    `learner.assemble.replay.prefill` are used instead of a pre-fill collection, so the
    default does not refuse them."""
    from arpo.train import TrainConfig

    with pytest.raises(ConfigError, match=r"prefill_runs_per_task.*must be >= 0"):
        load_config(TrainConfig, None, ["prefill_runs_per_task=-1"])
    c = load_config(TrainConfig, None, ["learner.assemble.replay.prefill='/'"])
    assert c.prefill_runs_per_task == TrainConfig().prefill_runs_per_task == 16
    assert load_config(TrainConfig, None, ["prefill_runs_per_task=4"]).prefill_runs_per_task == 4


# ---- values that are not finite or not sane are refused at start, naming the field ----------


@pytest.mark.parametrize(
    "override, field",
    [
        ("learner.trainer.lr=inf", "learner.trainer.lr"),
        ("learner.trainer.temperature=nan", "learner.trainer.temperature"),
        ("seed=-1", "seed"),
        ("learner.grants.grant_timeout_s=nan", "learner.grants.grant_timeout_s"),
        ("learner.grants.retry_s=1e300", "learner.grants.retry_s"),
        ("learner.grants.retry_s=-1", "learner.grants.retry_s"),
        ("learner.store_max_bytes=-1", "learner.store_max_bytes"),
        ("minutes=nan", "minutes"),
        ("sim_tasks_per_family=0", "sim_tasks_per_family"),
        ("actor.episode.max_new_tokens=-1", "actor.episode.max_new_tokens"),
        ("learner.assemble.replay.prefill='/no/such/folder'", "learner.assemble.replay.prefill"),
        ("sim_families=['no_such_family']", "sim_families"),
        ("learner.iterations=99999999999999999999", "learner.iterations"),
        # absurd sizes: a few zeros too many would start 100,000 processes or never end
        ("actors=100000", "actors"),
        ("sim_envs_per_actor=1000000", "sim_envs_per_actor"),
        ("local_desktops=500", "local_desktops"),
        ("vms=300", "vms"),
        ("sim_tasks_per_family=1000000000", "sim_tasks_per_family"),
        ("eval_runs_per_task=1000000000", "eval_runs_per_task"),
        ("prefill_runs_per_task=100000000", "prefill_runs_per_task"),
        ("sft_epochs=100000000", "sft_epochs"),
        ("learner.assemble.groups_per_step=100000000", "learner.assemble.groups_per_step"),
        ("actor.episode.max_new_tokens=1000000000", "actor.episode.max_new_tokens"),
        ("actor.episode.max_steps=100000000", "actor.episode.max_steps"),
    ],
)
def test_train_refuses_insane_values_naming_the_field(override: str, field: str) -> None:
    from arpo.train import TrainConfig

    with pytest.raises(ConfigError, match=re.escape(field)):
        load_config(TrainConfig, overrides=[override])


def test_train_refuses_more_vm_memory_than_the_machine_has(monkeypatch) -> None:
    import arpo.env.bringup as B
    from arpo.pool.audit import AuditConfig
    from arpo.train import TrainConfig

    monkeypatch.setattr(B, "memory_total", lambda: 4 * 2**30)
    with pytest.raises(ConfigError, match=r"vms: 4 VMs of 1536 MB need 6.0 GiB; .* has 4.0 GiB"):
        load_config(TrainConfig, overrides=["vms=4"])
    assert load_config(TrainConfig, overrides=["vms=2"]).vms == 2
    # the same section, the same check, in `arpo audit-tasks`
    with pytest.raises(ConfigError, match=r"vms: 4 VMs of 1536 MB need 6.0 GiB"):
        load_config(AuditConfig, overrides=["tasks=envs/arpo_envs/tasks/local", "vms=4"])


def test_train_and_the_audit_share_one_environments_section(tmp_path) -> None:
    """`arpo train` and `arpo audit-tasks` declare their environments once (`arpo.env.bringup.
    EnvironmentsConfig`), under the same names and checks; `arpo train`'s earlier name of
    the env_urls servers' pool is refused naming the field it became, from an override as
    from a file."""
    import dataclasses

    from arpo.env.bringup import EnvironmentsConfig
    from arpo.pool.audit import AuditConfig
    from arpo.train import TrainConfig

    section = {f.name for f in dataclasses.fields(EnvironmentsConfig)}
    assert {"local_desktops", "vms", "vm_fleet", "vm_pool", "env_urls", "env_pool"} <= section
    for cls in (TrainConfig, AuditConfig):
        assert section <= {f.name for f in dataclasses.fields(cls)}
    audit = ["tasks=envs/arpo_envs/tasks/local"]
    for cls, base in ((TrainConfig, []), (AuditConfig, audit)):
        with pytest.raises(ConfigError, match=r"'env_urls_pool' in override .* renamed 'env_pool'"):
            load_config(cls, None, [*base, "env_urls_pool=osworld"])
        with pytest.raises(ConfigError, match=r"env_tokens: 1 tokens for 0 env_urls"):
            load_config(cls, None, [*base, 'env_tokens=["t"]'])
        with pytest.raises(ConfigError, match=r"vm_fleet: give vms=N .* not both"):
            load_config(cls, None, [*base, "vms=1", f"vm_fleet={tmp_path}"])
        got = load_config(cls, None, [*base, "env_pool=osworld"])
        assert got.env_pool == "osworld"
    old = tmp_path / "old.toml"
    old.write_text('env_urls_pool = "osworld"\n')
    with pytest.raises(ConfigError, match=r"'env_urls_pool' was renamed 'env_pool'"):
        load_config(TrainConfig, old)


def test_an_evaluation_shows_the_policy_what_its_run_shows_it() -> None:
    """`arpo train`'s evaluations and pre-fill run a local actor with `pool_actor_args`:
    every episode field the run set (here where the marks come from and how many screenshots
    stay in the context) reaches that actor, and the sampling stays the pool's."""
    from arpo.actor.config import ActorConfig
    from arpo.train import TrainConfig

    run = load_config(TrainConfig, None, ["actor.episode.observation_type=som",
                      "actor.episode.marks_source=ocr", "actor.episode.history_images=2",
                      "actor.episode.ocr.threads=2"])  # fmt: skip
    args = run.pool_actor_args()
    assert not [a for a in args if a.startswith(("episode.temperature", "episode.top_p"))]
    actor = load_config(ActorConfig, None, [*args, "engine.model=m"])
    assert actor.episode == replace(run.actor.episode, temperature=actor.episode.temperature,
                                    top_p=actor.episode.top_p)  # fmt: skip
    assert (actor.episode.marks_source, actor.episode.history_images) == ("ocr", 2)
    assert actor.episode.ocr.threads == 2

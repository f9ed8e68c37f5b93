"""Offline baselines on the tiny Qwen2.5-VL: one DPO / KTO / RFT step moves the log-probs the
right way, the reference stays frozen, pairing gaps are counted, config errors name the field,
and `arpo offline` runs end to end on a trajectory folder."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoProcessor

from arpo.cli import main as cli_main
from arpo.config import load_config
from arpo.errors import ArpoError, ConfigError
from arpo.offline.data import (
    dpo_pairs,
    read_trajectories,
    split_outcomes,
    write_trajectories,
)
from arpo.offline.offline import OfflineConfig, OfflineTrainer
from arpo.policy.tiny import build_tiny_model
from arpo.record import Status, Trajectory
from arpo.synthetic import random_response, screenshot_png, synthetic_trajectory

LR = 1e-4  # the tiny random model needs a large rate to move measurably in one step


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.fixture(scope="module")
def processor(tiny: Path):
    return AutoProcessor.from_pretrained(tiny)


def _traj(processor, rng: np.random.Generator, task: str, score: float, turns: int = 2,
          status: Status = Status.OK) -> Trajectory:  # fmt: skip
    return synthetic_trajectory(
        processor,
        f"Do task {task}",
        screenshots=[screenshot_png(rng, 160, 120) for _ in range(turns)],
        responses=[random_response(rng, processor.tokenizer, 8) for _ in range(turns)],
        reward=score,
        checker_score=score,
        task_id=task,
        status=status,
    )


def _cfg(tiny: Path, **kw) -> OfflineConfig:
    base = dict(model=str(tiny), lr=LR, batch_size=8, micro_batch=2, weight_decay=0.0)
    return OfflineConfig(**{**base, **kw})


def test_dpo_step_raises_the_chosen_over_the_rejected(tiny: Path, processor) -> None:
    rng = np.random.default_rng(0)
    good, bad = _traj(processor, rng, "t", 1.0), _traj(processor, rng, "t", 0.0)
    tr = OfflineTrainer(_cfg(tiny, algo="dpo"))
    before = tr.logps([good, bad])
    # at the start the policy is the reference: the implicit rewards are 0
    assert torch.allclose(before, tr.ref_logps([good, bad]), atol=1e-4)
    m = tr.step_dpo([(good, bad)])
    after = tr.logps([good, bad])
    assert m["loss/dpo"] == pytest.approx(np.log(2), abs=1e-4)
    assert (after[0] - after[1]) - (before[0] - before[1]) > 0.05
    m2 = tr.step_dpo([(good, bad)])
    assert m2["rewards/margin"] > 0 and m2["loss/dpo"] < m["loss/dpo"]


def test_reference_model_is_frozen(tiny: Path, processor) -> None:
    rng = np.random.default_rng(1)
    good, bad = _traj(processor, rng, "t", 1.0), _traj(processor, rng, "t", 0.0)
    tr = OfflineTrainer(_cfg(tiny, algo="dpo"))
    assert tr.ref_model is not None
    ref0 = copy.deepcopy(tr.ref_model.state_dict())
    pol0 = copy.deepcopy(tr.model.state_dict())
    assert all(not p.requires_grad for p in tr.ref_model.parameters())
    tr.step_dpo([(good, bad)])
    tr.step_dpo([(good, bad)])
    ref1, pol1 = tr.ref_model.state_dict(), tr.model.state_dict()
    assert all(torch.equal(ref0[k], ref1[k]) for k in ref0)
    assert any(not torch.equal(pol0[k], pol1[k]) for k in pol0)
    assert all(p.grad is None for p in tr.ref_model.parameters())


def test_kto_step_raises_desirable_and_lowers_undesirable(tiny: Path, processor) -> None:
    rng = np.random.default_rng(2)
    good, bad = _traj(processor, rng, "a", 1.0), _traj(processor, rng, "b", 0.0)
    tr = OfflineTrainer(_cfg(tiny, algo="kto", micro_batch=1))
    before = tr.logps([good, bad])
    m = tr.step_kto([good, bad], [True, False])
    after = tr.logps([good, bad])
    assert m["kl"] == 0.0  # policy == reference at the start
    assert after[0] > before[0] + 0.02
    assert after[1] < before[1] - 0.02


def test_kto_balance_weighs_sparse_successes_like_the_failures(tiny: Path, processor) -> None:
    rng = np.random.default_rng(4)
    trajs = [_traj(processor, rng, "t", 1.0, turns=1)]
    trajs += [_traj(processor, rng, "t", 0.0, turns=1) for _ in range(3)]
    out = split_outcomes(trajs, 1.0)
    balanced = OfflineTrainer(_cfg(tiny, algo="kto", kto_lambda_d=0.5))
    units, report = balanced.units(out)
    assert len(units) == 4
    assert balanced.kto_lambda_d == pytest.approx(0.5 * 3 / 1)  # lambda_d n_d == lambda_u n_u
    assert report["kto_lambda_d"] == pytest.approx(1.5)
    plain = OfflineTrainer(_cfg(tiny, algo="kto", kto_lambda_d=0.5, kto_balance=False))
    plain.units(out)
    assert plain.kto_lambda_d == 0.5
    # The weight reaches the loss: one step moves the success's log-prob further when balanced.
    good = trajs[:1]
    moved = []
    for tr in (balanced, plain):
        before = tr.logps(good)[0]
        tr.step_kto(trajs, [True, False, False, False])
        moved.append(float(tr.logps(good)[0] - before))
    assert moved[0] > moved[1]


def test_rft_step_raises_the_success_and_ignores_failures(tiny: Path, processor) -> None:
    rng = np.random.default_rng(3)
    good, bad = _traj(processor, rng, "t", 1.0), _traj(processor, rng, "t", 0.0)
    tr = OfflineTrainer(_cfg(tiny, algo="rft", max_optimizer_steps=1))
    assert tr.ref_model is None
    before = tr.logps([good])
    history = tr.train([good, bad])
    assert len(history) == 1 and history[0]["tokens"] == sum(
        len(t.response_ids) for t in good.turns
    )
    assert tr.logps([good])[0] > before[0] + 0.05
    assert tr.report["successes"] == 1 and tr.report["failures"] == 1


def test_micro_batches_accumulate_the_same_gradient(tiny: Path, processor) -> None:
    rng = np.random.default_rng(4)
    trajs = [_traj(processor, rng, f"t{i % 2}", float(i % 2)) for i in range(4)]
    grads = []
    for micro in (1, 4):
        tr = OfflineTrainer(_cfg(tiny, algo="kto", micro_batch=micro, lr=1e-12))
        tr.step_kto(trajs, [t.checker_score == 1.0 for t in trajs])
        grads.append(torch.cat([p.grad.flatten() for p in tr.model.parameters()
                                if p.grad is not None]))  # fmt: skip
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-7)


def test_pairing_counts_tasks_without_a_pair(tiny: Path, processor) -> None:
    rng = np.random.default_rng(5)
    trajs = [
        _traj(processor, rng, "both", 1.0, 1),
        _traj(processor, rng, "both", 1.0, 1),
        _traj(processor, rng, "both", 0.0, 1),
        _traj(processor, rng, "only_success", 1.0, 1),
        _traj(processor, rng, "only_failure", 0.0, 1),
        _traj(processor, rng, "both", 1.0, 1, status=Status.ENV_ERROR),
    ]
    out = split_outcomes(trajs)
    assert out.excluded["env_error"] == 1
    pairs, rep = dpo_pairs(out, mode="all")
    assert rep == {"tasks": 3, "tasks_paired": 1, "tasks_without_success": 1,
                   "tasks_without_failure": 1, "pairs": 2}  # fmt: skip
    assert all(c.task_id == r.task_id == "both" for c, r in pairs)
    one, _ = dpo_pairs(out, mode="one-to-one")
    assert len(one) == 1

    # a failure that sampled <|image_pad|> cannot be trained on: left out and counted
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    odd = _traj(processor, rng, "both", 0.0, 1)
    odd.turns[0].response_ids[0] = pad
    tr = OfflineTrainer(_cfg(tiny, algo="dpo", micro_batch=2))
    history = tr.train([*trajs, odd])  # not fatal: the paired task trains
    assert len(history) == 1 and tr.report["tasks_without_success"] == 1
    assert tr.report["excluded_unusable"] == 1 and tr.report["pairs"] == 2
    with pytest.raises(ArpoError, match="no \\(success, failure\\) pair"):
        tr.train([t for t in trajs if t.task_id != "both"])


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("beta=0", "beta"),
        ("algo=ppo", "algo"),
        ("label_smoothing=0.5", "label_smoothing"),
        ("micro_batch=0", "micro_batch"),
        ("pairing=random", "pairing"),
    ],
)
def test_config_errors_name_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        load_config(OfflineConfig, None, ["model=m", override])


def test_the_old_names_of_the_optimizer_step_bound_name_the_new_one(tmp_path: Path) -> None:
    """`max_steps` is an episode's turns: the offline methods' and `arpo sft`'s bound on
    optimizer steps is `max_optimizer_steps`, and a config giving an old name is told so."""
    from arpo.offline.sft import SFTConfig

    new = "'max_optimizer_steps'"
    with pytest.raises(ConfigError, match=rf"'max_steps' in override .* was renamed {new}"):
        load_config(OfflineConfig, None, ["model=m", "max_steps=5"])
    old = tmp_path / "old.toml"
    old.write_text('model = "m"\nmax_steps = 5\n')
    with pytest.raises(ConfigError, match=rf"'max_steps' was renamed {new}"):
        load_config(OfflineConfig, old)
    with pytest.raises(ConfigError, match=rf"'max_steps_train' in override .* renamed {new}"):
        load_config(SFTConfig, None, ["max_steps_train=5"])
    assert (
        load_config(OfflineConfig, None, ["model=m", "max_optimizer_steps=5"]).max_optimizer_steps
        == 5
    )
    assert SFTConfig(max_steps=5).max_steps == 5  # the turns of its demonstrations


def test_arpo_offline_cli_end_to_end(tiny: Path, processor, tmp_path: Path, capsys) -> None:
    rng = np.random.default_rng(6)
    trajs = [_traj(processor, rng, f"t{i % 2}", float(i < 2), 1) for i in range(4)]
    assert write_trajectories(tmp_path / "data", trajs) == 4
    back = list(read_trajectories(tmp_path / "data"))
    assert [t.trajectory_id for t in back] == [t.trajectory_id for t in trajs]
    assert back[0] == trajs[0]
    out = tmp_path / "dpo"
    rc = cli_main(["offline", "--algo", "dpo", f"data={tmp_path / 'data'}", f"model={tiny}",
                   f"out={out}", "lr=1e-4", "micro_batch=2"])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "arpo offline dpo: 1 steps" in text
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(out)
    assert model is not None and (out / "offline.json").exists()
    assert cli_main(["offline", "--algo", "dpo", f"model={tiny}", "beta=-1"]) == 2
    assert "beta" in capsys.readouterr().err


def test_rft_with_train_layers_moves_only_the_last_layer(tiny: Path, processor) -> None:
    """`train_layers=1` (also `arpo sft`'s, which passes it on): the step raises the
    success's log-prob through the decoder's last layer and final norm alone."""
    from arpo.offline.sft import SFTConfig

    assert SFTConfig(model=str(tiny), out="x", families=["click_button"],
                     train_layers=1).offline_config().train_layers == 1  # fmt: skip
    rng = np.random.default_rng(8)
    good = _traj(processor, rng, "t", 1.0)
    tr = OfflineTrainer(_cfg(tiny, algo="rft", max_optimizer_steps=1, lr=1e-2, train_layers=1))
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    lp0 = tr.logps([good])[0]
    tr.train([good])
    assert tr.logps([good])[0] > lp0
    moved = {n for n, p in tr.model.named_parameters() if not torch.equal(p, before[n])}
    last = len(tr.model.get_decoder().layers) - 1
    assert moved and all(f"layers.{last}." in n or ".norm." in n for n in moved), moved
    with pytest.raises(ConfigError, match="train_layers"):
        OfflineTrainer(_cfg(tiny, algo="rft", train_layers=-1))

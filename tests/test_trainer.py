"""The training step on the tiny Qwen2.5-VL (the engine's log-probs equal the learner's for every
family: tests/test_model_families.py): updates that move
the policy the right way, replay weights, micro-batching that does not change the gradient."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from arpo import store_item  # noqa: E402
from arpo.buffer import ReplayStore  # noqa: E402
from arpo.errors import ConfigError, RecordError  # noqa: E402
from arpo.learner.assemble import AssembleConfig, GroupAssembler, Sample  # noqa: E402
from arpo.learner.batch import build_sequence, response_positions  # noqa: E402
from arpo.learner.groups import advantages  # noqa: E402
from arpo.learner.loss import LossConfig, arpo_loss  # noqa: E402
from arpo.learner.trainer import Trainer, TrainerConfig  # noqa: E402
from arpo.policy.tiny import build_tiny_model  # noqa: E402
from arpo.synthetic import (  # noqa: E402
    random_response,
    screenshot_png,
    synthetic_trajectory,
    with_logprobs,
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.fixture(scope="module")
def base_trainer(tiny_dir):
    return Trainer(TrainerConfig(model=str(tiny_dir), lr=1e-3))


def fresh_trainer(base: Trainer, **kw) -> Trainer:
    """A trainer with the base's weights and a new optimizer (cheaper than loading)."""
    t = copy.copy(base)
    t.config = TrainerConfig(**{**base.config.__dict__, **kw})
    t.base_model = t.model = copy.deepcopy(base.base_model)
    t.optimizer = torch.optim.AdamW(
        t.model.parameters(), lr=t.config.lr, weight_decay=t.config.weight_decay
    )
    t.scheduler = torch.optim.lr_scheduler.LambdaLR(t.optimizer, lambda s: 1.0)
    return t


def make_samples(trainer: Trainer, rewards, *, seed=0, turns=2, replay=(), shift=0.0):
    """Trajectories with real prompts and random responses, on-policy for `trainer`'s
    current weights (behaviour log-probs from a teacher-forced pass) plus `shift`."""
    rng = np.random.default_rng(seed)
    proc = trainer.processor
    out = []
    for i, r in enumerate(rewards):
        traj = synthetic_trajectory(
            proc,
            f"task {seed}",
            screenshots=[screenshot_png(rng, 300 + 40 * t, 200) for t in range(turns)],
            responses=[random_response(rng, proc.tokenizer, 6 + 3 * t + i) for t in range(turns)],
            reward=float(r),
            task_id=f"t{seed}",
        )
        item = store_item.to_item(traj)
        (lp,) = trainer.proximal([build_sequence(item, proc, trainer.image_token_id)])
        traj = with_logprobs(traj, lp.numpy() + shift)
        out.append(
            Sample(
                store_item.to_item(traj),
                traj.task_id,
                traj.trajectory_id,
                float(r),
                float(r),
                0,
                0.0,
                i in replay,
                0,
            )
        )
    for s, a in zip(out, advantages(rewards), strict=True):
        s.advantage = float(a)
    return out


def params_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.base_model.named_parameters()}


def test_response_positions_and_sequence_errors(base_trainer):
    assert response_positions(np.array([3, 2, 4, 1])).tolist() == [3, 4, 9]
    with pytest.raises(RecordError, match="pairs"):
        response_positions(np.array([3, 2, 4]))
    (s,) = make_samples(base_trainer, [1.0], turns=1)
    proc = base_trainer.processor
    bad = s.item.tokens.copy()
    bad[bad == base_trainer.image_token_id] = 5  # image tokens gone
    from arpo.buffer import Item

    item = Item(bad, s.item.logprobs, s.item.offsets, s.item.rewards, 0, s.item.blobs)
    with pytest.raises(RecordError, match="image tokens"):
        build_sequence(item, proc, base_trainer.image_token_id, "x")


def test_step_changes_parameters_and_reports_metrics(base_trainer):
    t = fresh_trainer(base_trainer)
    before = params_of(t)
    m = t.step(make_samples(t, [1, 0, 0, 1]))
    after = params_of(t)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) > 0.9 * len(before)
    # The vision tower is trained too (pixels come from the stored PNGs).
    assert any(k.startswith("model.visual") for k in changed)
    # On-policy data: the proximal policy equals the behaviour policy, weights are 1.
    assert m["losses/weight_fresh_mean"] == pytest.approx(1.0, abs=1e-4)
    assert m["losses/ratio_mean"] > 0 and np.isfinite(m["losses/grad_norm"])
    for k in ("time/proximal_forward_s", "time/forward_backward_s", "time/optimizer_s"):
        assert m[k] > 0
    assert t.optimizer_steps_done == 2


def test_learning_rate_warms_up_then_decays_linearly(tiny_dir):
    """`lr_warmup_steps` then `lr_decay_steps` to `lr_min_ratio` x lr, per optimizer step
    of real training steps (2 optimizer steps each), as the metrics report it."""
    t = Trainer(TrainerConfig(model=str(tiny_dir), lr=1e-3, lr_warmup_steps=2,
                              lr_decay_steps=4, lr_min_ratio=0.1))  # fmt: skip
    # Rates of the 8 optimizer steps: 5e-4, 1e-3 | 1e-3, 7.75e-4, 5.5e-4, 3.25e-4 | 1e-4, 1e-4;
    # each training step reports the mean of its two.
    seen = [t.step(make_samples(t, [1, 0], seed=i, turns=1))["losses/lr"] for i in range(4)]
    assert seen == pytest.approx([7.5e-4, 8.875e-4, 4.375e-4, 1e-4])
    assert t.scheduler.get_last_lr()[0] == pytest.approx(1e-4)
    with pytest.raises(ConfigError, match="lr_min_ratio"):
        Trainer(TrainerConfig(model=str(tiny_dir), lr_decay_steps=4, lr_min_ratio=1.5))


def test_repeated_steps_lower_the_surrogate_loss_on_a_fixed_batch(base_trainer):
    """PPO's surrogate against the fixed behaviour policy falls step after step, and the
    log-probs of positive-advantage trajectories rise while negative ones fall."""
    t = fresh_trainer(base_trainer, lr=3e-4, optimizer_steps=1)
    samples = make_samples(t, [1, 0, 1, 0], seed=5)
    seqs = t.sequences(samples)
    mu = [torch.tensor(np.array(s.item.logprobs)) for s in samples]
    adv = torch.tensor([s.advantage for s in samples])

    def surrogate():
        lp = t.proximal(seqs)
        n = max(len(x) for x in lp)
        pad = lambda xs: torch.stack([torch.nn.functional.pad(x, (0, n - len(x))) for x in xs])  # noqa: E731
        mask = torch.stack([torch.arange(n) < len(x) for x in lp])
        loss, _ = arpo_loss(pad(lp), pad(mu), pad(mu), adv, mask, torch.zeros(4, dtype=bool),
                            LossConfig())  # fmt: skip
        return float(loss), [float(x.mean()) for x in lp]

    l0, lp0 = surrogate()
    losses = [l0]
    for _ in range(3):
        t.step(samples)
        losses.append(surrogate()[0])
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    _, lp3 = surrogate()
    assert lp3[0] > lp0[0] and lp3[2] > lp0[2]  # advantage > 0
    assert lp3[1] < lp0[1] and lp3[3] < lp0[3]  # advantage < 0


def test_micro_batching_does_not_change_the_gradient(base_trainer):
    """Gradient accumulation over micro-batches of 1, 3 and 6 trajectories gives the
    gradient of the whole mini-batch (float32: up to summation order)."""
    samples = make_samples(base_trainer, [1, 0, 0, 0, 1, 0], seed=7)
    grads = []
    for micro in (1, 3, 6):
        t = fresh_trainer(base_trainer, micro_batch=micro, optimizer_steps=1)
        t.step(samples)
        grads.append({k: p.grad.clone() for k, p in t.base_model.named_parameters()})
    scale = max(float(g.abs().max()) for g in grads[0].values())
    for other in grads[1:]:
        for k, g in grads[0].items():
            torch.testing.assert_close(other[k], g, atol=1e-5 * scale, rtol=1e-4)


def test_fused_proximal_pass_gives_the_same_step(base_trainer):
    """`fuse_proximal` (the first mini-batch's pi_prox from its own forward pass) trains the
    same step as a separate proximal pass over the whole batch, with fewer passes: the
    gradients of both optimizer steps and the drift metrics agree; off-policy data (shift)
    so that pi_prox matters.

    The gradients are compared as the optimizer receives them, before Adam's normalisation:
    after it, a gradient near 0 whose float32 sum came out in another order moves its
    parameter by up to lr in either direction (a flaky comparison: 1 of 32,768 parameters
    once differed by 3.9e-5). Before it, the two paths agree to float32 summation noise."""
    samples = make_samples(base_trainer, [1, 0, 0, 1, 0, 0], seed=11, shift=0.3)
    out, scored, grads = {}, {}, {}
    for fuse in (True, False):
        t = fresh_trainer(base_trainer, micro_batch=2, optimizer_steps=2, fuse_proximal=fuse)
        calls: list[int] = []
        proximal = t.proximal
        t.proximal = lambda seqs, *a, _p=proximal, _c=calls, **kw: (
            _c.append(len(seqs)) or _p(seqs, *a, **kw)
        )
        seen: list[dict[str, torch.Tensor]] = []

        def record(opt, args, kwargs, _seen=seen, _t=t):  # before each optimizer step
            _seen.append(
                {k: v.grad.detach().clone() for k, v in _t.base_model.named_parameters()
                 if v.grad is not None}
            )  # fmt: skip

        t.optimizer.register_step_pre_hook(record)
        m = t.step(samples)
        out[fuse], scored[fuse], grads[fuse] = m, sum(calls), seen
    m1, m0 = out[True], out[False]
    assert len(grads[True]) == len(grads[False]) == 2  # both optimizer steps
    for g1, g0 in zip(grads[True], grads[False], strict=True):
        assert g1.keys() == g0.keys() and g1
        for k in g0:
            scale = float(g0[k].abs().max()) + 1e-12
            torch.testing.assert_close(g1[k], g0[k], rtol=1e-3, atol=1e-4 * scale)
    for k in ("losses/loss", "losses/seq_logratio_fresh_mean", "losses/weight_fresh_mean"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-4, abs=1e-6), k
    assert (scored[True], scored[False]) == (3, 6)  # the first mini-batch needs no pass


def test_flat_groups_are_not_forwarded_and_the_update_is_the_same(base_trainer):
    """A group whose episodes all succeeded has advantage 0 on every token: with
    `skip_flat` its 4 trajectories are not forwarded, yet both optimizer steps get the
    gradients of the full batch (the second mini-batch, all flat, a zero gradient on the
    same parameters, so AdamW still steps), and the loss is the same."""
    batch = make_samples(base_trainer, [1, 0, 0, 1], seed=3, shift=0.2)
    batch += make_samples(base_trainer, [1, 1, 1, 1], seed=4, shift=0.2)
    assert all(s.advantage == 0 for s in batch[4:]) and batch[0].advantage > 0
    out, rows, grads, steps = {}, {}, {}, {}
    for skip in (True, False):
        t = fresh_trainer(base_trainer, micro_batch=2, optimizer_steps=2, skip_flat=skip)
        forwarded: list[int] = []
        logprobs = t._logprobs
        t._logprobs = lambda model, seqs, *a, _l=logprobs, _f=forwarded, **kw: (
            _f.append(len(seqs)) or _l(model, seqs, *a, **kw)
        )
        seen: list[dict[str, torch.Tensor]] = []
        t.optimizer.register_step_pre_hook(
            lambda opt, args, kwargs, _seen=seen, _t=t: _seen.append(
                {k: v.grad.detach().clone() for k, v in _t.base_model.named_parameters()
                 if v.grad is not None}
            )
        )  # fmt: skip
        out[skip], rows[skip], grads[skip] = t.step(batch), sum(forwarded), seen
        steps[skip] = t.optimizer_steps_done
    assert steps == {True: 2, False: 2}
    assert out[True]["data/flat_skipped"] == 4 and out[False]["data/flat_skipped"] == 0
    # Skipped: the first mini-batch's 4 rows, then one zero-scaled pass of 1 row. Not
    # skipped: the second mini-batch's proximal pass (4 rows), then all 8 with gradient.
    assert (rows[True], rows[False]) == (5, 12)
    for g1, g0 in zip(grads[True], grads[False], strict=True):
        assert g1.keys() == g0.keys() and g1
        for k in g0:
            scale = float(g0[k].abs().max()) + 1e-12
            torch.testing.assert_close(g1[k], g0[k], rtol=1e-3, atol=1e-4 * scale)
    assert any(float(g.abs().max()) > 0 for g in grads[True][0].values())
    assert all(float(g.abs().max()) == 0 for g in grads[True][1].values())
    assert out[True]["losses/loss"] == pytest.approx(out[False]["losses/loss"], abs=1e-6)


def test_replayed_success_gets_its_importance_weight_and_advantage(base_trainer, tmp_path):
    """Four failed fresh episodes + one stored success (behaviour log-probs 0.5 above the
    current policy's, i.e. an older policy liked it more): the assembler replaces one fresh
    episode by the success; its advantage is (1 - 0.25) / std; the loss weights its
    tokens by exp(pi_prox - mu) = exp(-0.5)."""
    t = fresh_trainer(base_trainer)
    fails = make_samples(t, [0, 0, 0, 0], seed=9)
    (success,) = make_samples(t, [1.0], seed=10, shift=0.5)
    store = ReplayStore(max_bytes=1 << 30, fresh_capacity=64, replay_capacity=8, seed=0)
    task = fails[0].task_id
    old = store_item.from_item(success.item)
    store.add_success(task, store_item.to_item(old))
    for s in fails:
        store.put(task, s.item)
    asm = GroupAssembler(store, AssembleConfig(group_size=4, groups_per_step=1))
    batch = asm.next_batch(version=0, timeout=5)
    assert batch is not None and len(batch.samples) == 4
    replayed = [s for s in batch.samples if s.is_replay]
    assert len(replayed) == 1 and replayed[0].trajectory_id == old.trajectory_id
    std = np.std([0, 0, 0, 1], ddof=1)
    assert replayed[0].advantage == pytest.approx(0.75 / (std + 1e-6), rel=1e-5)
    assert all(s.advantage == pytest.approx(-0.25 / (std + 1e-6), rel=1e-5)
               for s in batch.samples if not s.is_replay)  # fmt: skip
    assert batch.counts["replay/hits"] == 1
    m = t.step(batch)
    assert m["losses/weight_replay_mean"] == pytest.approx(np.exp(-0.5), rel=1e-3)
    assert m["losses/weight_fresh_mean"] == pytest.approx(1.0, abs=1e-4)
    # The drift metrics, from the proximal pass: the replayed success's per-sequence
    # log-ratio is -0.5 per response token; fresh trajectories are on-policy (0).
    n_resp = len(replayed[0].item.logprobs)
    for k in ("mean", "min", "max"):
        assert m[f"losses/seq_logratio_replay_{k}"] == pytest.approx(-0.5 * n_resp, rel=1e-3)
        assert m[f"losses/seq_logratio_fresh_{k}"] == pytest.approx(0.0, abs=1e-3)
    lp = np.asarray(replayed[0].item.logprobs)
    if (np.exp(lp) < 0.9).any():  # random responses: nearly every token is unlikely
        assert m["losses/weight_lowp_replay_mean"] == pytest.approx(np.exp(-0.5), rel=1e-3)
    assert m["losses/weight_truncated_replay_frac"] == 0.0
    # The reference's uncorrected replay scores it with weight 1.
    t2 = fresh_trainer(base_trainer, loss=LossConfig(correct_replay=False))
    m2 = t2.step(batch)
    assert m2["losses/weight_replay_mean"] == pytest.approx(1.0, abs=1e-4)


def test_weights_bytes_load_into_a_fresh_model(base_trainer, tiny_dir):
    from safetensors.torch import load
    from transformers import Qwen2_5_VLForConditionalGeneration

    t = fresh_trainer(base_trainer)
    t.step(make_samples(t, [1, 0], seed=11, turns=1))
    state = load(t.weights_bytes())
    fresh = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_dir)
    fresh.load_state_dict(state, strict=True)
    for k, v in t.base_model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)


def test_config_errors_name_the_field(tiny_dir):
    with pytest.raises(ConfigError, match="micro_batch"):
        Trainer(TrainerConfig(model=str(tiny_dir), micro_batch=0))
    with pytest.raises(ConfigError, match="model"):
        Trainer(TrainerConfig())
    with pytest.raises(ConfigError, match="eps_low"):
        Trainer(TrainerConfig(model=str(tiny_dir), loss=LossConfig(eps_low=1.5)))


def test_a_step_whose_gradient_is_not_finite_is_refused(base_trainer):
    """A NaN advantage (a data bug) makes the gradient NaN: the optimizer step is refused
    and counted, the weights stay as they were (never NaN, so never checkpointed so), and
    the next, sane step trains as usual."""
    t = fresh_trainer(base_trainer, micro_batch=4, optimizer_steps=1)
    bad = make_samples(t, [1, 0, 0, 1], seed=21)
    bad[0].advantage = float("nan")
    before = params_of(t)
    m = t.step(bad)
    assert m["losses/steps_refused"] == 1.0 and t.nonfinite_steps == 1
    after = params_of(t)
    assert all(torch.equal(before[k], after[k]) for k in before)
    m2 = t.step(make_samples(t, [1, 0, 0, 1], seed=22))
    assert m2["losses/steps_refused"] == 0.0
    trained = params_of(t)
    assert any(not torch.equal(after[k], trained[k]) for k in after)
    assert all(torch.isfinite(v).all() for v in trained.values())

"""The learner on more than one process: torchrun + FSDP2 (or DDP), rank 0 doing the I/O.

Every rank runs the same training step on its share of the batch; rank 0 alone talks
to actors, reads and writes files and publishes weights. tests/dist_worker.py is a
complete example (the tiny Qwen2.5-VL, the ARPO loss, AdamW), runnable as one process
or under torchrun (`arpo-tiny-model --out runs/tiny` builds the model):

    python tests/dist_worker.py --model runs/tiny --out /tmp/one --steps 2
    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        tests/dist_worker.py --model runs/tiny --out /tmp/two --steps 2

    info = init_distributed(DistConfig())          # world 1 without torchrun: no group
    model = wrap_model(model, info.config, info)   # FSDP2 per decoder layer / vision block
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    batch = broadcast_object(batch if info.is_main else None, info)   # rank 0 decides
    mine = shard_batch(batch, info)                # contiguous, as even as possible
    n_global = global_count(len(mine), info)       # trajectories of the whole batch
    n_micro = max_count(len(mine), info)           # every rank runs as many micro-batches
    for i in range(n_micro):
        item, m = (mine[i], 1) if i < len(mine) else (mine[0], 0)   # a repeat counts 0
        loss, metrics = arpo_loss(...)             # mean over the micro-batch's trajectories
        with grad_sync(model, i == n_micro - 1):   # reduce once, on the last micro-batch
            (loss * loss_scale(m, n_global, info)).backward()
    norm = clip_grad_norm(model, 1.0, info)        # the norm of the full (unsharded) gradient
    opt.step(); opt.zero_grad()
    metrics = all_reduce_mean(metrics, info)
    state = full_state_dict(model, info)           # CPU tensors on rank 0, None elsewhere
    shutdown(info)

Exact gradient accumulation across ranks and micro-batches. The single-process step
minimises L = (1/B) sum_i l_i over the B trajectories of the batch
(`seq-mean-token-mean`: l_i is trajectory i's token mean), or L = (1/T) sum_t l_t over
its T tokens (`token-mean`). FSDP2 and DDP average gradients over the W ranks, and
backward calls add into .grad. So a micro-batch of m trajectories (or m tokens) whose
loss is the mean over them is scaled by

    loss_scale(m, N, info) = m * W / N,     N = global_count(n_local, info)

where N is the batch's B (trajectories with at least one response token, as
`arpo.learner.loss.aggregate` counts them) or T (tokens), summed over ranks with one
all-reduce. Then the averaged, accumulated gradient is
(1/W) sum_ranks sum_micro (m W / N) grad(mean of micro) = (1/N) sum grad l = grad L,
the single-process gradient, whatever the split. The reported loss of the step is the
sum over ranks of the scaled micro-batch losses divided by W (`all_reduce_mean` of the
per-rank sums gives it).

Rules the training step must keep, or a collective hangs:

- Every rank runs the same number of forward/backward passes: `max_count` gives the
  count; a rank with fewer items repeats one of its items with its loss scaled by 0.
- With FSDP2 the vision blocks are sharded too, so every micro-batch on every rank must
  run the vision tower (have at least one image), or none may. ARPO trajectories
  always have screenshots.
- rank 0 alone reads and writes files; `full_state_dict` and `optimizer_state` are
  collectives that every rank calls, and they return the result on rank 0 only.

FSDP2 on CPU runs with the gloo backend in torch 2.13 (DTensor on CPU tensors):
`fully_shard`, `clip_grad_norm_` on DTensor parameters and the full state dicts of
torch.distributed.checkpoint all work; tests/test_distributed.py checks that two ranks
give the single-process weights and gradient norm. Mixed precision (`param_dtype`
bfloat16, gradients reduced in float32) is for GPUs only.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from arpo.config import check_seconds, fail, option, validate
from arpo.errors import ArpoError, ConfigError

T = TypeVar("T")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class DistConfig:
    """How the learner spreads over processes (torchrun sets the ranks)."""

    backend: str = option("auto", "'auto' (nccl with CUDA, else gloo), 'gloo' or 'nccl'.")
    strategy: str = option(
        "fsdp2",
        "'fsdp2' (torch.distributed.fsdp.fully_shard per decoder layer / vision block, then "
        "the root), 'ddp' (a full replica per rank, gradients all-reduced), or 'none' "
        "(no wrapping: only for world size 1).",
    )
    reshard_after_forward: bool = option(
        True,
        "FSDP2: free the gathered parameters of each layer after its forward (less memory, "
        "one more all-gather in backward); false keeps them until backward.",
    )
    param_dtype: str = option(
        "float32",
        "FSDP2 mixed precision: dtype of the gathered parameters for compute ('float32', "
        "'bfloat16' or 'float16'; anything but float32 only on CUDA); the sharded master "
        "weights and the optimizer stay float32.",
    )
    reduce_dtype: str = option(
        "float32", "FSDP2 mixed precision: dtype in which gradients are reduced across ranks."
    )
    ddp_find_unused: bool = option(
        False,
        "DDP: look for parameters that got no gradient in a step (needed when a step may "
        "skip part of the model, e.g. a batch without images skips the vision tower; costs "
        "a graph walk per step).",
    )
    timeout_s: float = option(
        1800.0,
        "Timeout of every collective in seconds; a rank that waits longer fails instead of "
        "hanging (rank 0 may be busy with checkpoints: keep it generous).",
    )

    def validate(self) -> None:
        if self.backend not in ("auto", "gloo", "nccl"):
            fail("backend", "must be 'auto', 'gloo' or 'nccl'")
        if self.strategy not in ("fsdp2", "ddp", "none"):
            fail("strategy", "must be 'fsdp2', 'ddp' or 'none'")
        if self.param_dtype not in _DTYPES:
            fail("param_dtype", "must be 'float32', 'bfloat16' or 'float16'")
        if self.reduce_dtype not in _DTYPES:
            fail("reduce_dtype", "must be 'float32', 'bfloat16' or 'float16'")
        check_seconds("timeout_s", self.timeout_s)


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: its rank among `world_size` and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    is_main: bool
    config: DistConfig = field(default_factory=DistConfig, compare=False)
    """The configuration it was made with (what `wrap_model(model, info.config, info)` takes)."""

    @property
    def distributed(self) -> bool:
        """True when a process group is up (torchrun, or a group made before)."""
        return dist.is_available() and dist.is_initialized()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def init_distributed(cfg: DistConfig) -> DistInfo:
    """Join the process group that torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT); without torchrun (no WORLD_SIZE) run as a single
    process with no group. A group that is already up is reused."""
    validate(cfg)
    cuda = torch.cuda.is_available()
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = _env_int("LOCAL_RANK", rank)
    else:
        world = _env_int("WORLD_SIZE", 1)
        rank = _env_int("RANK", 0)
        local = _env_int("LOCAL_RANK", 0)
        if not 0 <= rank < world:
            raise ConfigError(f"RANK={rank} is outside WORLD_SIZE={world}: launch with torchrun")
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise ConfigError("config field backend: 'nccl' needs CUDA; use 'gloo' (or 'auto') on CPU")
    device = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        if not dist.is_available():
            raise ArpoError("torch was built without torch.distributed; run a single process")
        dist.init_process_group(
            backend=backend,
            timeout=timedelta(seconds=cfg.timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return DistInfo(
        rank=rank, world_size=world, local_rank=local, device=device, is_main=rank == 0, config=cfg
    )


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: Qwen2.5-VL's text decoder layers and vision
    blocks (and any other model's `layers` / `blocks` module lists)."""
    found: list[nn.Module] = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "blocks"):
            found.extend(mod)
    return found


def wrap_model(model: nn.Module, cfg: DistConfig, info: DistInfo) -> nn.Module:
    """Shard (FSDP2) or replicate (DDP) `model` over the ranks; unchanged with one process.

    FSDP2 shards in place (the returned module is `model`, its parameters become DTensors,
    its state-dict names stay the same); DDP returns a wrapper whose `.module` is `model`.
    Build the optimizer from the returned module's parameters afterwards."""
    validate(cfg)
    model.to(info.device)
    if info.world_size == 1 or cfg.strategy == "none":
        if info.world_size > 1:
            raise ConfigError(
                f"config field strategy: 'none' runs {info.world_size} unsynchronised "
                "replicas; use 'fsdp2' or 'ddp' under torchrun"
            )
        return model
    if cfg.strategy == "fsdp2" and cfg.param_dtype != "float32" and info.device.type != "cuda":
        raise ConfigError(
            f"config field param_dtype: {cfg.param_dtype!r} is for GPUs; use 'float32' on CPU"
        )
    if not info.distributed:
        raise ArpoError("wrap_model needs init_distributed() first (no process group is up)")
    if cfg.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [info.device.index] if info.device.type == "cuda" else None
        return DistributedDataParallel(
            model, device_ids=ids, find_unused_parameters=cfg.ddp_find_unused
        )

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    param_dtype = _DTYPES[cfg.param_dtype]
    mp = MixedPrecisionPolicy(
        param_dtype=None if param_dtype == torch.float32 else param_dtype,
        reduce_dtype=_DTYPES[cfg.reduce_dtype],
    )
    blocks = _blocks(model)
    if not blocks:
        raise ArpoError(
            f"{type(model).__name__} has no `layers` / `blocks` module list to shard; "
            "use strategy 'ddp'"
        )
    for block in blocks:
        fully_shard(block, reshard_after_forward=cfg.reshard_after_forward, mp_policy=mp)
    # The root holds the rest (embeddings, final norm, lm_head, the vision merger); it is
    # gathered for the whole forward anyway, so it is not resharded after it.
    fully_shard(model, reshard_after_forward=False, mp_policy=mp)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The module whose state-dict names are the checkpoint's (DDP's `.module`)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


@contextlib.contextmanager
def grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Backward passes inside reduce gradients across ranks only if `enabled`.

    Enable it on the last micro-batch of a step (earlier ones then accumulate local,
    unsharded gradients: fewer collectives, more memory), or on every micro-batch (the
    default without this context: FSDP2 reduce-scatters each backward into the sharded
    gradient, DDP all-reduces each). The result is the same gradient either way."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif isinstance(model, DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
    else:
        yield


def _state_options(info: DistInfo, **kw: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=info.distributed, **kw)


def full_state_dict(model: nn.Module, info: DistInfo) -> dict[str, torch.Tensor] | None:
    """The full, unsharded weights as CPU tensors on rank 0 (None on other ranks), named
    as the unwrapped model's `state_dict()`, so `save_pretrained(state_dict=...)` and the
    policy engines load them. A collective: every rank calls it."""
    if not info.distributed:
        base = unwrap(model)
        return {k: v.detach().to("cpu", copy=True) for k, v in base.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=_state_options(info))
    return state if info.is_main else None


def load_full_state_dict(
    model: nn.Module, state: dict[str, torch.Tensor] | None, info: DistInfo
) -> None:
    """Load full weights held by rank 0 (others pass None) into the (wrapped) model on
    every rank; strict: every name must match. A collective: every rank calls it."""
    if not info.distributed:
        if state is None:
            raise ArpoError("load_full_state_dict: a single process needs the state dict")
        unwrap(model).load_state_dict(state, strict=True)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    if info.is_main and state is None:
        raise ArpoError("load_full_state_dict: rank 0 must pass the state dict")
    set_model_state_dict(
        model,
        state if info.is_main else {},
        options=_state_options(info, broadcast_from_rank0=True),
    )


def optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo
) -> dict[str, Any] | None:
    """The full (unsharded) optimizer state on rank 0 (None elsewhere), keyed by parameter
    name, loadable by `load_optimizer_state` into a run with any world size and strategy.
    A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer, options=_state_options(info))
    return state if info.is_main else None


def load_optimizer_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any] | None,
    info: DistInfo,
) -> None:
    """Load a full optimizer state held by rank 0 (others pass None) into this run's
    optimizer; each rank keeps its shard. A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if info.is_main and state is None:
        raise ArpoError("load_optimizer_state: rank 0 must pass the optimizer state")
    if not info.distributed:
        set_optimizer_state_dict(model, optimizer, state, options=_state_options(info))
        return
    set_optimizer_state_dict(
        model,
        optimizer,
        state if info.is_main else {},
        options=_state_options(info, broadcast_from_rank0=True),
    )


def clip_grad_norm(model: nn.Module, max_norm: float, info: DistInfo) -> float:
    """Clip the gradient to `max_norm` (L2) and return its norm before clipping: the norm
    of the full gradient, the same on every rank (FSDP2's sharded gradients are DTensors
    whose norm is reduced across ranks). This is a sync point."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


def broadcast_object(obj: T | None, info: DistInfo, src: int = 0) -> T:
    """`obj` of rank `src` on every rank (pickled by torch.distributed; for the learner's
    own ranks only, never on the actors' wire). Other ranks pass anything (None)."""
    if not info.distributed:
        return obj  # type: ignore[return-value]
    box = [obj if info.rank == src else None]
    dist.broadcast_object_list(box, src=src, device=_comm_device(info))
    return box[0]  # type: ignore[return-value]


def _comm_device(info: DistInfo) -> torch.device:
    return info.device if dist.get_backend() == "nccl" else torch.device("cpu")


def _all_reduce(values: list[float], info: DistInfo, op: Any) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device(info))
    dist.all_reduce(t, op=op)
    return t.tolist()


def global_count(n_local: int | float, info: DistInfo) -> float:
    """The sum of `n_local` over ranks (trajectories or tokens of the whole batch): the N
    of `loss_scale`. One all-reduce."""
    if not info.distributed:
        return float(n_local)
    return _all_reduce([float(n_local)], info, dist.ReduceOp.SUM)[0]


def max_count(n_local: int, info: DistInfo) -> int:
    """The largest `n_local` over ranks: the number of micro-batches every rank must run."""
    if not info.distributed:
        return int(n_local)
    return int(_all_reduce([float(n_local)], info, dist.ReduceOp.MAX)[0])


def loss_scale(n_micro: int | float, n_global: int | float, info: DistInfo) -> float:
    """The factor m * W / N for a micro-batch loss that is the mean over its `n_micro`
    trajectories (or tokens) when the batch has `n_global` of them over all W ranks, so
    that the rank-averaged, accumulated gradient is the single-process one. 0 when the
    batch is empty."""
    if n_global <= 0:
        return 0.0
    return float(n_micro) * info.world_size / float(n_global)


def all_reduce_mean(values: dict[str, float], info: DistInfo) -> dict[str, float]:
    """The mean over ranks of each metric; a rank whose value is NaN (nothing to measure,
    e.g. no replayed rows) is left out of that metric's mean (NaN if every rank is). Every
    rank must pass the same names."""
    if not info.distributed:
        return dict(values)
    keys = sorted(values)
    gathered: list[Any] = [None] * info.world_size
    dist.all_gather_object(gathered, keys)
    if any(g != keys for g in gathered):
        raise ArpoError(f"all_reduce_mean: ranks report different metric names: {gathered}")
    vals = [float(values[k]) for k in keys]
    sums = [0.0 if math.isnan(v) else v for v in vals]
    counts = [0.0 if math.isnan(v) else 1.0 for v in vals]
    out = _all_reduce(sums + counts, info, dist.ReduceOp.SUM)
    n = len(keys)
    return {k: (out[i] / out[n + i] if out[n + i] else math.nan) for i, k in enumerate(keys)}


def shard_batch(items: Sequence[T], info: DistInfo) -> list[T]:
    """This rank's contiguous share of `items`; shares differ in size by at most one
    (the first len(items) % W ranks take one more)."""
    n, w, r = len(items), info.world_size, info.rank
    base, extra = divmod(n, w)
    start = r * base + min(r, extra)
    return list(items[start : start + base + (1 if r < extra else 0)])


def barrier(info: DistInfo) -> None:
    """Wait until every rank gets here (no-op for a single process)."""
    if info.distributed:
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[info.device.index])
        else:
            dist.barrier()


def shutdown(info: DistInfo) -> None:
    """Leave the process group (no-op for a single process), after every rank got here.

    The barrier first: a DDP rank that destroyed the group and exited while another was
    still finishing its last collective left that one hanging at exit (seen with gloo)."""
    if info.distributed:
        barrier(info)
        dist.destroy_process_group()

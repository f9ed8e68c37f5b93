"""The learner process: ingest, task grants, group assembly, the ARPO step, weights, checkpoints.

    arpo-learner trainer.model=runs/tiny tasks=envs/arpo_envs/tasks/local iterations=50
    arpo-learner --config learner.toml --resume           # continue from the last checkpoint

One iteration (each stage is a named timing span, logged as `time/<span>_s`):

    wait        GroupAssembler.next_batch: `groups_per_step` complete groups from the store
                (status, sampling-settings and trainability checks, successes noted for
                replay, staleness filter, replay into failed groups, successes into the
                buffer, advantages). With `prefetch` (the default) this and the batch's
                pixels are done in a second thread while the previous step trains, for
                the version the batch will train at; the span is then the wait for that
                thread. No prefetch across a checkpoint: its store snapshot must hold
                every trajectory not yet trained.
    step        Trainer.step: proximal pass, then the optimizer steps (its own spans:
                sequences, proximal_forward, forward_backward, optimizer)
    publish     the new weights as version v + 1: a safetensors stream served in chunks on
                the control link, and the same bytes as a file under `publish_dir` that
                actors sharing the filesystem read directly
    checkpoint  every `checkpoint.every` iterations and at the end: model, optimizer,
                scheduler, RNG, policy version, task statistics, store snapshot, seen-id
                log, ingest journal segment (`arpo.learner.checkpoint`)

Meanwhile two server threads run: the ingest (data link: trajectories in, acks out;
journaled before each ack) and the grant server (control link: grants, weights,
heartbeats). Actors (`arpo-actor`) anywhere connect to `transport.data` and
`transport.control`.

Set-up of a fresh start puts the successes of a kept collection into the replay buffers
when `assemble.replay.prefill` names one (`prefill_replay`: the task-selection run's
successes, as the paper's pipeline can; `replay/prefilled` in every metrics row).

Resume (`resume = true`): the newest valid checkpoint's model, optimizer, scheduler,
RNG states, version and task statistics are loaded; the store is restored from its
snapshot and the ingest journal since that snapshot is replayed into it, so every
trajectory acknowledged before a crash is there exactly once (trained on before the
crash but after the checkpoint means trained on again, by the model of the checkpoint,
which never saw it). Grants issued before the crash are unknown to the new grant book:
their trajectories are accepted as they come.

Distributed (torchrun): rank 0 owns the sockets, the store, the assembler, metrics and
checkpoints; every rank holds a shard of the model (FSDP2) and trains on its share of
each batch, which rank 0 broadcasts (`arpo.learner.distributed`).
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from arpo import store_item
from arpo.config import (
    SET_BY_TRAIN,
    check_range,
    check_seconds,
    fail,
    folder_problem,
    option,
    validate,
)
from arpo.env.task import load_selection, load_task_pool, pool_problem
from arpo.env.taskfiles import TaskFiles
from arpo.errors import ERRORS, ConfigError, RunStalled, SnapshotError
from arpo.files import write_atomic
from arpo.learner import distributed as D
from arpo.learner.assemble import AssembleConfig, Batch, GroupAssembler, Sample
from arpo.learner.batch import check_item
from arpo.learner.checkpoint import (
    CheckpointConfig,
    list_checkpoints,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from arpo.learner.distributed import DistConfig
from arpo.learner.groups import ReplayConfig
from arpo.learner.metrics import MetricsConfig, MetricsLogger, ProgressLine, Spans, TaskStats
from arpo.learner.trainer import Trainer, TrainerConfig
from arpo.service.grants import GrantBook, GrantConfig, GrantServer
from arpo.service.ingest import Ingest, IngestConfig
from arpo.service.journal import TRAJECTORIES, list_segments, read_collection
from arpo.transport import TransportConfig

log = logging.getLogger("arpo.learner")

_DEFAULT_CKPT_DIR = CheckpointConfig().dir

MIN_STORE_BYTES = 64 << 20
"""Smallest replay-store budget the learner accepts (`store_max_bytes`). A 15-turn
trajectory of 1920x1080 PNG screenshots is about 1.5 MB, so 64 MiB holds some forty: a
few groups. Below one trajectory the store refuses everything it is sent."""
MAX_STORE_BYTES = 1 << 50
"""Largest replay-store budget accepted (1 PiB): more is a typo, not memory."""


TRAINED_LOG = "trained.log"
"""The learner's ledger of what it trained, in its run folder: one line per trajectory of
every iteration's batch, `<iteration>\t<trajectory id>\t<fresh|replay|dropped_<reason>>`
(`trained_log_lines` writes them, `read_trained_log` reads them)."""


def trained_log_lines(
    iteration: int, samples: Sequence[tuple[str, bool]], dropped: Sequence[tuple[str, str]]
) -> str:
    """The `trained.log` lines of one iteration: each trained sample (trajectory id, whether
    it is a replayed one), then each dropped trajectory with its reason."""
    lines = [f"{iteration}\t{tid}\t{'replay' if replay else 'fresh'}" for tid, replay in samples]
    lines += [f"{iteration}\t{tid}\tdropped_{why}" for tid, why in dropped]
    return "".join(x + "\n" for x in lines)


def read_trained_log(path: str | Path) -> list[tuple[int, str, str]]:
    """The lines of a `trained.log` as (iteration, trajectory id, outcome): outcome is
    "fresh", "replay" or "dropped_<reason>"; a torn line is skipped, a missing file is []."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) == 3 and parts[0].isdigit():
            out.append((int(parts[0]), parts[1], parts[2]))
    return out


def _check_model_files(model_dir: Path) -> None:
    """Parse every safetensors header of a checkpoint's model (cheap; catches a damaged
    header or a truncated file whatever the manifest says) and its config.json."""
    from safetensors import safe_open

    json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SnapshotError(f"{model_dir}: no safetensors weights")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                sl = st.get_slice(name)
                sl.get_shape()


@dataclass
class LearnerConfig:
    """The learner process. Paths left empty are placed under `run_dir`."""

    run_dir: str = option("runs/learner", "Folder of this run: metrics, checkpoints, journal.")
    tasks: str = option(
        "", "Task pool: a folder of task JSON files (searched recursively), a JSON list or JSONL."
    )
    selection: str = option(
        "", "Task selection file written by `arpo select-tasks`: train on its selected tasks."
    )
    iterations: int = option(0, "Training iterations to run (0: until stopped).")
    max_env_steps: int = option(
        0,
        "Also stop once the delivered trajectories hold this many environment steps (a "
        "tree's shared turns counted once, as its environment ran them; `charts/env_steps`), "
        "to compare methods at the same environment cost. 0: no such bound.",
    )
    hold_after_iterations: bool = option(
        False,
        "After `iterations` and their checkpoint, issue no more grants but keep storing and "
        "acknowledging what the actors still deliver until stopped (SIGTERM): `arpo train` "
        "stops its actors first, so they hand in what they hold to a learner that is there, "
        "then stops the learner. False: leave at once.",
    )
    resume: bool = option(False, "Continue from the newest valid checkpoint in checkpoint.dir.")
    success_score: float = option(1.0, "Checker score at which an episode counts as a success.")
    publish_dir: str = option(
        "",
        "Folder for published weight files actors on this filesystem read ('' = run_dir/"
        "weights, '-' = none: chunks over the control link only).",
    )
    publish_keep: int = option(2, "Published weight files kept.")
    wait_log_s: float = option(30.0, "Log a line while waiting this long for groups.")
    stall_s: float = option(
        300.0,
        "Stop with an error (exit code 3) when no episode has filled a grant's slot for this "
        "many seconds while the learner waits for groups, naming the tasks that left the "
        "run and why; the run stops at once when every task has left. 0: never.",
    )
    left_out: str = option(
        "",
        "JSON file {task id: reason} of tasks to leave out of the run (`arpo train`'s "
        "preflight writes it): they are never granted and are listed with their reason in "
        "`tasks_out.json`, as tasks that leave during the run are.",
    )
    prefetch: bool = option(
        True,
        "Take the next batch out of the store and make its pixels while the current step "
        "trains (not before a checkpoint or the last step; see Learner._may_prefetch).",
    )
    step_delay_s: float = option(
        0.0,
        "Extra seconds after each step before its weights are published: a slower learner "
        "(as with a large model), so the actors run ahead up to the staleness bound; for "
        "staleness experiments and tests, 0 in real runs.",
    )
    store_max_bytes: int = option(8 << 30, "Byte budget of the replay store.")
    store_fresh_capacity: int = option(
        1024, "Fresh trajectories kept per task before the oldest are evicted."
    )
    seed: int = option(0, "Seed of the store's sampling (replay picks).")
    trainer: TrainerConfig = option(TrainerConfig(), "The model and the optimisation step.")
    assemble: AssembleConfig = option(AssembleConfig(), "Groups, staleness filter and replay.")
    grants: GrantConfig = option(
        GrantConfig(),
        "Task grants; group_size, groups_per_step and max_staleness are taken from assemble, "
        "temperature and top_p from trainer.",
    )
    ingest: IngestConfig = option(
        IngestConfig(), "The receiving side (seen_log and journal_dir default to run_dir)."
    )
    transport: TransportConfig = option(TransportConfig(), "Endpoints and keys of the links.")
    checkpoint: CheckpointConfig = option(
        CheckpointConfig(), "Checkpoints (dir defaults to run_dir/checkpoints)."
    )
    metrics: MetricsConfig = option(MetricsConfig(), "Metrics files and the progress line.")
    dist: DistConfig = option(
        DistConfig(), "Under torchrun: backend and sharding (FSDP2 by default)."
    )

    def validate(self) -> None:
        if not self.run_dir:
            fail("run_dir", "must name a folder")
        if problem := folder_problem(self.run_dir):
            fail("run_dir", problem)
        if not self.tasks:
            fail("tasks", "give the task pool (a folder of task JSON files, or a JSON/JSONL file)")
        if self.tasks != SET_BY_TRAIN and (problem := pool_problem(self.tasks)):
            fail("tasks", problem)
        for name in ("selection", "left_out"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                fail(name, f"{path!r} is not a file")
        if self.iterations < 0:
            fail("iterations", "must be >= 0 (0: until stopped)")
        if self.max_env_steps < 0:
            fail("max_env_steps", "must be >= 0 (0: no bound)")
        check_range(
            "success_score", self.success_score, 0, 1, "checker scores are in [0, 1]", lo_open=True
        )
        check_range("publish_keep", self.publish_keep, 1, 1000, "published weight files kept")
        if self.publish_dir not in ("", "-") and (problem := folder_problem(self.publish_dir)):
            fail("publish_dir", problem)
        check_seconds("wait_log_s", self.wait_log_s, "between lines while waiting for groups")
        check_range(
            "store_max_bytes",
            self.store_max_bytes,
            MIN_STORE_BYTES,
            MAX_STORE_BYTES,
            "bytes of the replay store: at least MIN_STORE_BYTES (64 MiB), some forty "
            "15-turn trajectories of full-HD screenshots; e.g. 8 GiB",
        )
        check_range("seed", self.seed, 0, 2**63 - 1, "the store's sampling seed")
        check_seconds("step_delay_s", self.step_delay_s, zero="0 in real runs")
        check_seconds("stall_s", self.stall_s, zero="0: never stop for a stall")
        if self.store_fresh_capacity < self.assemble.group_size:
            fail("store_fresh_capacity", "must be at least assemble.group_size")
        check_range(
            "store_fresh_capacity",
            self.store_fresh_capacity,
            1,
            1 << 24,
            "fresh trajectories kept per task",
        )
        if self.grants.tree_slots:
            self.grants.check_tree_slots(
                self.assemble.group_size, "assemble.group_size", "grants.tree_slots"
            )
        default = GrantConfig()
        for name, owner in (
            ("group_size", "assemble"),
            ("groups_per_step", "assemble"),
            ("max_staleness", "assemble"),
            ("temperature", "trainer"),
            ("top_p", "trainer"),
        ):
            g, a = getattr(self.grants, name), getattr(getattr(self, owner), name)
            if g != getattr(default, name) and g != a:
                fail(
                    f"grants.{name}",
                    f"is {g} but {owner}.{name} is {a}: set {owner}.{name} only "
                    "(the learner gives it to the grants)",
                )


def resolved(cfg: LearnerConfig) -> LearnerConfig:
    """The config with empty paths placed under run_dir and the grant settings synced."""
    run = Path(cfg.run_dir)
    ingest = replace(
        cfg.ingest,
        seen_log=cfg.ingest.seen_log or str(run / "seen.log"),
        journal_dir=cfg.ingest.journal_dir or str(run / "journal"),
    )
    ckpt = cfg.checkpoint
    if ckpt.dir == _DEFAULT_CKPT_DIR:
        ckpt = replace(ckpt, dir=str(run / "checkpoints"))
    a = cfg.assemble
    grants = replace(
        cfg.grants,
        group_size=a.group_size,
        groups_per_step=a.groups_per_step,
        max_staleness=a.max_staleness,
        sampling=True,
        temperature=cfg.trainer.temperature,
        top_p=cfg.trainer.top_p,
    )
    publish = cfg.publish_dir or str(run / "weights")
    return replace(cfg, ingest=ingest, checkpoint=ckpt, grants=grants, publish_dir=publish)


def prefill_replay(store: Any, path: str, tasks: set[str], replay: ReplayConfig) -> int:
    """Put the successes kept in `path` (a collection: `arpo select-tasks`'s `trajectories`
    or an `arpo collect` folder) of the tasks in `tasks` into their replay buffers, in the
    order they were kept (FIFO: beyond `replay.capacity` a task keeps its newest); the count.

    A success is an `ok` episode with checker score > `replay.admit_score_above`, the
    assembler's admission rule (`ReplayConfig.admits`). Episodes of other tasks are
    skipped; records that do not decode are skipped by `read_collection` (logged). A picked
    success the learner cannot train (other sampling settings, a bad record) is evicted at
    its first pick, as any.
    Raises `ConfigError` naming the field when `path` is not a collection: missing, a file,
    a folder with neither `trajectories/` nor a journal segment, or segments of which no
    record is readable. An empty collection fills nothing.
    """
    counts: collections.Counter[str] = collections.Counter()
    kept: collections.Counter[str] = collections.Counter()
    fix = "give the `trajectories` folder of `arpo select-tasks` or an `arpo collect` output folder"
    root = Path(path)
    if root.is_dir() and not (root / TRAJECTORIES).is_dir() and not list_segments(root):
        raise ConfigError(
            f"config field assemble.replay.prefill: {path} is not a collection (no "
            f"{TRAJECTORIES}/ folder and no journal segment in it); {fix}"
        )
    try:
        for traj in read_collection(path, counts):
            if traj.task_id not in tasks:
                counts["other_task"] += 1
            elif not replay.admits(traj.status, traj.checker_score):
                counts["not_success"] += 1
            else:
                store.add_success(traj.task_id, store_item.to_item(traj))
                kept[traj.task_id] += 1
    except ERRORS as e:  # a record that does not read, or an item the store refuses
        raise ConfigError(f"config field assemble.replay.prefill: {e} ({fix})") from None
    damaged = {k: counts[k] for k in ("corrupt", "torn", "malformed") if counts[k]}
    if damaged and not counts["records"]:
        raise ConfigError(
            f"config field assemble.replay.prefill: {path} holds no readable record "
            f"(skipped: {damaged}): not a collection of this project, or a destroyed one; {fix}"
        )
    n = sum(kept.values())
    log.info(
        "replay prefill from %s: %d successes of %d tasks (of %d training tasks); skipped %s",
        path, n, len(kept), len(tasks), dict(counts),
    )  # fmt: skip
    return n


class Learner:
    """Owns every learner component; `run()` is the loop (see the module docstring)."""

    def __init__(self, config: LearnerConfig) -> None:
        self.config = resolved(validate(config))
        self.info = D.init_distributed(self.config.dist)
        """This process's rank; rank 0 owns sockets, store, files (the others follow it)."""
        self._stop = threading.Event()
        self.spans = Spans()
        self.iteration = 0
        self.env_steps = EnvSteps()
        """Environment steps of the trajectories delivered (`max_env_steps`)."""
        self._spent_logged = False
        self.version = 0
        self.task_stats = TaskStats()
        self.last_checkpoint: Path | None = None
        self._checkpointed_at = -1
        """The iteration of the newest checkpoint this process wrote (-1: none)."""
        self.trainer: Trainer | None = None
        self.store: Any = None
        self.ingest: Ingest | None = None
        self.grants: GrantServer | None = None
        self.metrics: MetricsLogger | None = None
        self.assembler: GroupAssembler | None = None
        self._published: list[Path] = []
        self._rate_mark: tuple[float, float, float] | None = None
        self.prefilled = 0
        """Successes put into the replay buffers at a fresh start (`replay.prefill`)."""
        self.history: list[dict[str, float]] = []
        """Every iteration's metrics (also in metrics.jsonl)."""
        self.files = TaskFiles()
        """The task files the pool's tasks name by content, served to the actors."""
        self._purged: collections.Counter[str] = collections.Counter()
        """Fresh trajectories of tasks out of the run taken out of the store, per task."""
        self._status_at = 0.0

    # ---- set-up ------------------------------------------------------------------------

    def _new_store(self) -> Any:
        from arpo.buffer import ReplayStore

        cfg = self.config
        return ReplayStore(
            max_bytes=cfg.store_max_bytes,
            fresh_capacity=cfg.store_fresh_capacity,
            replay_capacity=cfg.assemble.replay.capacity,
            seed=cfg.seed,
        )

    def _usable_checkpoint(self) -> tuple[Any, Any]:
        """(checkpoint, restored store) of the newest checkpoint that loads whole, trying
        older ones after any failure (logged): the manifest's sizes and sha256 (of the
        small files only with `checkpoint.verify` off), state.json and trainer.pt, the
        model's safetensors headers, its config and processor and the weights' shapes
        against that config (`check_model_dir`), and the store snapshot's own checksum all
        run in both modes. (None, None) when none loads. `verify=false` skips only the
        sha256 of the bulk files: a bit flipped inside a tensor's data then goes unseen."""
        from arpo.buffer import ReplayStore
        from arpo.learner.checkpoint import check_model_dir

        cfg = self.config
        for path in reversed(list_checkpoints(cfg.checkpoint.dir)):
            try:
                ckpt = load_checkpoint(path, verify=cfg.checkpoint.verify)
                _check_model_files(ckpt.model_dir)
                check_model_dir(ckpt.model_dir)
                store = None
                if ckpt.store_path is not None:
                    store = ReplayStore.restore(
                        ckpt.store_path,
                        max_bytes=cfg.store_max_bytes,
                        fresh_capacity=cfg.store_fresh_capacity,
                        replay_capacity=cfg.assemble.replay.capacity,
                        seed=cfg.seed,
                    )
                return ckpt, store
            except Exception as e:  # whatever finds the damage, the one before is tried
                log.warning(
                    "checkpoint %s does not load (%s: %s); trying the one before",
                    path.name,
                    type(e).__name__,
                    e,
                )
        return None, None

    def _tasks(self) -> list[dict[str, Any]]:
        cfg = self.config
        tasks = load_task_pool(cfg.tasks, self.files)
        if cfg.selection:
            keep = set(load_selection(cfg.selection))
            missing = keep - {t["id"] for t in tasks}
            if missing:
                raise ConfigError(
                    f"config field selection: {len(missing)} selected task(s) are not in the "
                    f"pool {cfg.tasks!r}, e.g. {sorted(missing)[0]!r}"
                )
            tasks = [t for t in tasks if t["id"] in keep]
        if not tasks:
            raise ConfigError(
                f"config field tasks: no tasks to train on in {cfg.tasks!r}"
                + (f" after the selection {cfg.selection!r}" if cfg.selection else "")
            )
        return tasks

    def setup(self) -> None:
        """Load (or resume) everything and start the two server threads."""
        import torch

        cfg, info = self.config, self.info
        run = Path(cfg.run_dir)
        tasks: list[dict[str, Any]] = []
        ckpt = None
        if info.is_main:
            run.mkdir(parents=True, exist_ok=True)
            tasks = self._tasks()
            restored = None
            if cfg.resume:
                ckpt, restored = self._usable_checkpoint()
                path = ckpt.path if ckpt is not None else None
                complete = list_checkpoints(cfg.checkpoint.dir)
                if path is None and complete:
                    # Starting fresh would train from the base model, empty the store and
                    # cut trained.log: never do that silently.
                    raise ConfigError(
                        f"resume: none of the {len(complete)} complete checkpoint(s) in "
                        f"{cfg.checkpoint.dir} verifies ({', '.join(p.name for p in complete)}; "
                        "the log says why). Restore one, or start fresh on purpose: move "
                        "them away (and the run's journal and trained.log) or give another "
                        "run_dir, and run without --resume"
                    )
                if path is None:
                    log.warning("resume: no checkpoint in %s yet; starting fresh (the journal "
                                "is replayed)", cfg.checkpoint.dir)  # fmt: skip
                else:
                    assert ckpt is not None
                    log.info("resuming from %s (iteration %d)", path, ckpt.iteration)
        self._load_trainer(ckpt)
        if not info.is_main:
            self.trainer.weights_bytes()  # the first publish is a collective
            return
        if ckpt is not None:
            restore_rng(ckpt.trainer["rng"])
            self.iteration = ckpt.iteration
            self.version = int(ckpt.state["version"])
            self.task_stats = TaskStats.from_dict(ckpt.state.get("tasks", {}))
            self.env_steps.total = int(ckpt.state.get("env_steps", 0))
            store = restored if restored is not None else self._new_store()
            ckpt.restore_seen_log(cfg.ingest.seen_log)
        else:
            torch.manual_seed(cfg.seed)
            store = self._new_store()
        self.store = store
        if ckpt is None and cfg.assemble.replay.prefill:
            self.prefilled = prefill_replay(
                store, cfg.assemble.replay.prefill, {t["id"] for t in tasks}, cfg.assemble.replay
            )
        book = GrantBook(tasks, cfg.grants)
        book.set_version(self.version)
        for tid, why in self._left_out(ckpt).items():
            book.retire(tid, why)
        # Groups of earlier versions count as opened, so admission allows the usual
        # (max_staleness + 1) * groups_per_step groups in flight after a resume too.
        book.opened = self.version * cfg.grants.groups_per_step
        self.grants = GrantServer(book, cfg.transport, files=self.files)
        self.ingest = Ingest(
            store,
            cfg.ingest,
            cfg.transport,
            version=lambda: self.version,
            on_trajectory=self._on_trajectory(book),
        )
        self.ingest.on_actor_heartbeat = book.seen  # a silent actor's grants go to others
        if ckpt is not None and ckpt.journal_segment is not None:
            counts = self.ingest.replay_journal(ckpt.journal_segment)
            log.info("resume: journal replayed into the store: %s", counts)
        elif cfg.resume and ckpt is None:
            # A crash before the first checkpoint: everything acknowledged is in the journal.
            counts = self.ingest.replay_journal(0)
            log.info("resume without a checkpoint: the whole journal replayed: %s", counts)
        self._open_ledger(ckpt.iteration if ckpt is not None else 0)
        t = self.trainer
        vocab = int(t.base_model.get_input_embeddings().num_embeddings)
        self.assembler = GroupAssembler(
            store,
            cfg.assemble,
            sampling=(cfg.trainer.temperature, cfg.trainer.top_p),
            check=lambda item, traj: check_item(item, t.processor, t.image_token_id, vocab),
        )
        self.metrics = MetricsLogger(run, cfg.metrics)
        self.progress = ProgressLine(cfg.metrics.progress_s)
        self._publish()
        self.ingest.start()
        self.grants.start()
        self._rates()
        log.info(
            "learner up: data %s, control %s, %d tasks (by pool: %s; %d task files served "
            "by content), version %d, %d rank(s)",
            self.ingest.endpoint,
            self.grants.endpoint,
            len(tasks),
            book.pools,
            len(self.files),
            self.version,
            self.info.world_size,
        )
        self._check_progress()

    def _left_out(self, ckpt: Any) -> dict[str, str]:
        """Tasks to retire at start: `left_out`'s, and those that had left the run before the
        checkpoint resumed from."""
        out: dict[str, str] = {}
        if self.config.left_out:
            p = Path(self.config.left_out)
            try:
                raw = json.loads(p.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ConfigError(f"config field left_out: {p} is not readable JSON: {e}") from None
            if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
                raise ConfigError(f"config field left_out: {p} must map task ids to reasons")
            out.update({str(k): f"left out before the run: {v}" for k, v in raw.items()})
        if ckpt is not None:
            for tid, r in (ckpt.state.get("tasks_out") or {}).items():
                out.setdefault(tid, str(r.get("reason", "left the run before the resume")))
        return out

    def _load_trainer(self, ckpt: Any) -> None:
        """The trainer, with the checkpoint's weights, optimizer and scheduler on resume.

        One process: the model loads from the checkpoint's folder. Under torchrun every rank
        builds the base model (`trainer.model` must exist on every node) and rank 0 sends
        the checkpoint's weights and optimizer state to the others (collectives)."""
        cfg, info = self.config, self.info
        resume = ckpt is not None
        if info.distributed:
            resume = D.broadcast_object(resume, info)
        tcfg = cfg.trainer
        if resume and not info.distributed:
            # The reference model stays the starting policy, not the checkpoint.
            tcfg = replace(tcfg, model=str(ckpt.model_dir), ref_model=tcfg.ref_model or tcfg.model)
        self.trainer = Trainer(tcfg, info)
        if not resume:
            return
        t = self.trainer
        if info.distributed:
            state = None
            if info.is_main:
                from arpo.policy.family import load_model

                state = load_model(ckpt.model_dir, t.base_model.dtype).state_dict()
            D.load_full_state_dict(t.model, state, info)
        t.load_optimizer_state(ckpt.trainer["optimizer"] if info.is_main else None)
        extra = None
        if info.is_main:
            extra = (ckpt.trainer.get("scheduler"), int(ckpt.state.get("optimizer_steps", 0)))
        if info.distributed:
            extra = D.broadcast_object(extra, info)
        sched, steps = extra
        if sched is not None:
            t.scheduler.load_state_dict(sched)
        t.optimizer_steps_done = steps

    def follow(self) -> None:
        """A rank other than 0: run the collectives rank 0 announces until it stops."""
        assert self.trainer is not None
        while True:
            cmd = D.broadcast_object(None, self.info)
            if cmd[0] == "step":
                self.trainer.step(_unpack(cmd[1]))
                self.trainer.weights_bytes()  # rank 0 publishes
                if cmd[2]:
                    self._checkpoint_collectives()
            elif cmd[0] == "checkpoint":
                self._checkpoint_collectives()
            elif cmd[0] == "stop":
                return
            else:
                raise RuntimeError(f"unknown learner command {cmd[0]!r} from rank 0")

    def _announce(self, *cmd: Any) -> None:
        if self.info.distributed:
            D.broadcast_object(cmd, self.info)

    def _checkpoint_collectives(self) -> tuple[Any, Any]:
        """The full weights and optimizer state (rank 0; None on the others)."""
        assert self.trainer is not None
        return self.trainer.state_dict(), self.trainer.optimizer_state()

    def _on_trajectory(self, book: GrantBook):
        """Book the trajectory's grant slot, and store it even when the book calls it a
        surplus (its slot was filled by a re-issued grant): groups are formed per task
        from the store, so an extra good episode of the task is data, not a duplicate."""

        def on(traj: Any) -> bool:
            book.complete(traj)
            self.env_steps.add(traj)
            return True

        return on

    # ---- the loop ----------------------------------------------------------------------

    def stop(self) -> None:
        """Finish the current iteration (and the batch already taken for the next one, if
        the prefetch took it), checkpoint, and leave `run()`."""
        self._stop.set()

    def run(self) -> dict[str, float]:
        """Iterate until `iterations` are done or `stop()`; returns the last metrics."""
        if self.trainer is None:
            self.setup()
        if not self.info.is_main:
            try:
                self.follow()
            finally:
                D.shutdown(self.info)
            return {}
        cfg = self.config
        last: dict[str, float] = {}
        pool = ThreadPoolExecutor(1, thread_name_prefix="arpo-prefetch") if cfg.prefetch else None
        try:
            try:
                last = self._loop(pool)
            except RunStalled:
                self._write_tasks_out()
                if self.iteration > 0 and self._checkpointed_at != self.iteration:
                    self._announce("checkpoint")
                    self.save_checkpoint()
                raise
            if self.iteration > 0:
                trained = self._finish_partial_batch()
                # The last iteration's own checkpoint already holds everything when the
                # stop found no groups taken for an incomplete batch.
                if trained or self._checkpointed_at != self.iteration:
                    self._announce("checkpoint")
                    self.save_checkpoint()
            if cfg.hold_after_iterations and not self._stop.is_set():
                self.grants.book.close()
                log.info(
                    "finished its iterations (%d): no more grants; storing what the actors "
                    "still deliver until stopped", self.iteration,
                )  # fmt: skip
                self._stop.wait()
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            self._announce("stop")
            self.close()
            D.shutdown(self.info)
        return last

    def _loop(self, pool: ThreadPoolExecutor | None) -> dict[str, float]:
        """The iterations (see `run`); the last metrics."""
        cfg = self.config
        last: dict[str, float] = {}
        waited = 0.0
        ahead: Future[Batch | None] | None = None
        try:
            while ahead is not None or not (
                self._stop.is_set()
                or (cfg.iterations and self.iteration >= cfg.iterations)
                or self._spent()
            ):
                t0 = time.perf_counter()
                with self.spans("wait"):
                    if ahead is not None:
                        batch, ahead = ahead.result(), None
                    else:
                        batch = self._next_batch(self.version)
                self.grants.book.set_dropped(self.assembler.dropped_groups)
                if batch is None:
                    waited += time.perf_counter() - t0
                    if waited >= cfg.wait_log_s:
                        log.info("waiting for groups: %s", self._ingest_summary())
                        waited = 0.0
                    self._check_progress()
                    continue
                waited = 0.0
                if pool is not None and self._may_prefetch():
                    # Scored for the version it will train at (this step's + 1).
                    ahead = pool.submit(self._next_batch, self.version + 1, True)
                last = self._iterate(batch) or last
        finally:
            if ahead is not None:
                ahead.cancel()
        return last

    def _spent(self) -> bool:
        """The environment-step budget (`max_env_steps`) is used up."""
        spent = bool(self.config.max_env_steps) and (
            self.env_steps.total >= self.config.max_env_steps
        )
        if spent and not self._spent_logged:
            self._spent_logged = True
            log.info("environment-step budget reached: %d steps delivered (max_env_steps %d)",
                     self.env_steps.total, self.config.max_env_steps)  # fmt: skip
        return spent

    def _finish_partial_batch(self) -> bool:
        """At a stop: train the groups the assembler took for an incomplete batch (and
        record its drops). They are out of the store, so the final checkpoint would not
        hold them, and its journal segment is past them: they would be lost. Whether
        there was such a batch."""
        batch = self.assembler.flush(self.version)
        if batch is None:
            return False
        if batch.samples:
            log.info("stop: training the %d group(s) of an incomplete batch", batch.groups)
            self._iterate(batch)
        else:
            self._record(batch)
        return True

    def _may_prefetch(self) -> bool:
        """Whether the next batch may be taken out of the store while this step trains:
        not when this step is the last or ends with a checkpoint, whose store snapshot must
        hold every trajectory not yet trained. (A stop asked for during the step trains the
        batch already taken before the final checkpoint.)"""
        cfg = self.config
        after = self.iteration + 1
        return not (
            self._stop.is_set()
            or (cfg.iterations and after >= cfg.iterations)
            or self._spent()
            or cfg.checkpoint.due(after)
        )

    def _next_batch(self, version: int, ahead: bool = False) -> Batch | None:
        """The assembler's next batch for `version` (None after a second without one);
        with `prefetch`, its training sequences (token tensors, pixels from the PNGs) are
        made here too. `ahead`: run in the prefetch thread while a step trains, waiting
        until the batch is complete or the learner stops, so that it is ready when the
        next step starts."""
        batch = self.assembler.next_batch(version, timeout=1.0)
        waited = 0.0
        while ahead and batch is None and not self._stop.is_set():
            waited += 1.0
            if waited >= self.config.wait_log_s:
                log.info("waiting for groups: %s", self._ingest_summary())
                waited = 0.0
            self._check_progress(housekeeping=False)  # this thread only checks for a stall
            batch = self.assembler.next_batch(version, timeout=1.0)
        if batch is not None and self.config.prefetch:
            assert self.trainer is not None
            t0 = time.perf_counter()
            try:
                batch.sequences = self.trainer.sequences(batch.samples)
            except Exception as e:  # the step makes them again and reports it as before
                log.warning("prefetch of a batch's sequences failed (%s); the step retries", e)
                batch.sequences = None
            batch.counts["time/prefetch_sequences_s"] = time.perf_counter() - t0
            batch.counts["data/prefetched"] = float(ahead)
        return batch

    def _iterate(self, batch: Batch) -> dict[str, float]:
        cfg = self.config
        assert self.trainer is not None and self.metrics is not None
        t_start = time.perf_counter()
        ckpt_due = cfg.checkpoint.due(self.iteration + 1)
        self._announce("step", _pack(batch.samples), ckpt_due)
        with self.spans("step"):
            m = self.trainer.step(batch)
            if cfg.step_delay_s:
                time.sleep(cfg.step_delay_s)
        self.version += 1
        self.iteration += 1
        with self.spans("publish"):
            self._publish()
        self._record(batch)
        fresh = [s for s in batch.samples if not s.is_replay]
        for s in fresh:
            self.task_stats.record(s.task_id, s.checker_score >= cfg.success_score, s.reward)
        spans = self.spans.take()
        step_s = time.perf_counter() - t_start
        out: dict[str, float] = {
            "charts/reward_mean": float(np.mean([s.reward for s in fresh])) if fresh else math.nan,
            "charts/success_rate": (
                float(np.mean([s.checker_score >= cfg.success_score for s in fresh]))
                if fresh
                else math.nan
            ),
            "charts/episodes": float(len(fresh)),
            "charts/env_steps": float(self.env_steps.total),
            "charts/parse_failure_rate": (
                float(np.mean([float(s.item.rewards[2]) < 0 for s in fresh])) if fresh else math.nan
            ),
            "charts/policy_version": float(self.version),
            "charts/trained_per_s": len(batch.samples) / step_s if step_s else math.nan,
            "charts/tokens_per_s": m["data/tokens"] / step_s if step_s else math.nan,
            "charts/staleness_mean": batch.counts.get("data/staleness_mean", math.nan),
            "charts/staleness_max": batch.counts.get("data/staleness_max", math.nan),
            "replay/buffer_size": float(self.store.stats()["total"]["replay"]),
            "replay/prefilled": float(self.prefilled),
        }
        out.update({k: float(v) for k, v in batch.counts.items() if not k.startswith("data/stal")})
        out.update(m)
        out.update({f"time/{k}_s": v for k, v in spans.items()})
        out.update(self._ingest_metrics())
        out.update(self._rates())
        out.update(self.task_stats.metrics())
        out["data/trained_total"] = float(len(self.trained))
        out["data/trained_twice"] = float(sum(1 for n in self.trained.values() if n > 1))
        if ckpt_due:
            t0 = time.perf_counter()
            self.save_checkpoint()
            out["time/checkpoint_s"] = time.perf_counter() - t0
        self.metrics.log(self.iteration, out)
        self._check_progress(stall=False)
        self.progress.update(self.iteration, out)
        self.history.append(out)
        return out

    # ---- the ledger of what was trained ------------------------------------------------

    def _open_ledger(self, keep_through: int) -> None:
        """`trained.log`: `<iteration>\t<trajectory id>\t<fresh|replay|dropped_<reason>>` per
        line. On a resume from checkpoint k the lines of later iterations go (the model that
        trained on them was lost with the crash; the resumed run trains them again)."""
        self.ledger = Path(self.config.run_dir) / TRAINED_LOG
        kept = [r for r in read_trained_log(self.ledger) if r[0] <= keep_through]
        write_atomic(self.ledger, "".join(f"{it}\t{tid}\t{what}\n" for it, tid, what in kept))
        self.trained = collections.Counter(tid for _, tid, what in kept if what == "fresh")

    def _record(self, batch: Batch, iteration: int | None = None) -> None:
        it = self.iteration if iteration is None else iteration
        text = trained_log_lines(
            it, [(s.trajectory_id, s.is_replay) for s in batch.samples], batch.dropped
        )
        with open(self.ledger, "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        self.trained.update(s.trajectory_id for s in batch.samples if not s.is_replay)

    def _ingest_metrics(self) -> dict[str, float]:
        assert self.ingest is not None and self.grants is not None
        st = self.ingest.stats()
        out = {
            f"data/ingest_{k}": float(v)
            for k, v in st.items()
            if isinstance(v, int | float) and k != "actors"
        }
        out["data/ingest_rejected"] = float(sum(st["rejected"].values()))
        out["data/actors"] = float(st["actors"])
        out["data/grants_in_flight"] = float(self.grants.book.stats()["in_flight"])
        keys = ("envs", "episode_s", "grant_wait_s", "weight_wait_s", "files_fetched",
                "files_refused")  # fmt: skip
        out.update({f"data/actor_{k}": v for k, v in self.ingest.actor_totals(keys).items()})
        return out

    def _rates(self) -> dict[str, float]:
        """Trajectories and environment steps received per second since the last call."""
        assert self.ingest is not None
        st = self.ingest.stats()
        now = time.monotonic()
        stored, steps = float(st.get("stored", 0)), float(st.get("steps", 0))
        prev = self._rate_mark
        self._rate_mark = (now, stored, steps)
        if prev is None or now <= prev[0]:
            return {}
        dt = now - prev[0]
        return {
            "charts/trajectories_per_s": (stored - prev[1]) / dt,
            "charts/steps_per_s": (steps - prev[2]) / dt,
        }

    def _ingest_summary(self) -> str:
        assert self.ingest is not None and self.grants is not None
        st = self.ingest.stats()
        return (
            f"stored {st.get('stored', 0)}, actors {st['actors']}, "
            f"grants {self.grants.book.stats()}, store tasks {len(self.store.tasks())}; "
            f"{self.grants.book.waiting_for()}"
        )

    # ---- progress: tasks out of the run, stalls ----------------------------------------

    def _check_progress(self, stall: bool = True, housekeeping: bool = True) -> None:
        """Take the fresh trajectories of tasks out of the run out of the store (ledger:
        `dropped_task_out`), write `tasks_out.json` (every task out of the run and every
        given-up group, for `arpo train`'s progress line and report), and with `stall`
        raise RunStalled when every task has left the run or no episode has filled a slot
        for `stall_s` seconds. `housekeeping` (the main thread only): the purge and the file."""
        book = self.grants.book
        now = time.monotonic()
        if housekeeping:
            self._purge_tasks_out()
        if housekeeping and (now - self._status_at >= 2.0 or not stall):
            self._status_at = now
            self._write_tasks_out()
        if not stall or book.closed:
            return
        why = ""
        if book.exhausted:
            why = f"every one of the {len(book.retired)} tasks has left the run"
        elif self.config.stall_s and now - book.last_progress > self.config.stall_s:
            why = (
                f"no episode has filled a grant's slot for {now - book.last_progress:.0f} s "
                f"(stall_s = {self.config.stall_s:g})"
            )
        if why:
            if housekeeping:
                self._write_tasks_out()
            names = "; ".join(f"{t}: {r['reason']}" for t, r in list(book.retired.items())[:20])
            more = len(book.retired) - 20
            # Checkers that raised, of tasks still in the run (a task that left for it says
            # so above): an eval_error fills no slot, so they can be why nothing progresses.
            raised = {t: f for t, f in book.checker_failures().items() if t not in book.retired}
            checkers = "; ".join(
                f"{t}: {f['count']} eval_error(s), first: {f['first']}"
                + (f", last: {f['last']}" if f["last"] != f["first"] else "")
                for t, f in list(raised.items())[:20]
            )
            if len(raised) > 20:
                checkers += f"; and {len(raised) - 20} more"
            raise RunStalled(
                f"the run cannot go on: {why}. Tasks out of the run ({len(book.retired)}): "
                + (names or "none")
                + (f"; and {more} more (tasks_out.json)" if more > 0 else "")
                + (
                    f". Tasks whose checker could not run ({len(raised)}): {checkers}"
                    if raised
                    else ""
                )
                + f". Given-up groups: {book.given_up_groups}. Grants: {book.stats()}"
            )

    def _write_tasks_out(self) -> None:
        write_atomic(
            Path(self.config.run_dir) / "tasks_out.json",
            json.dumps(self.tasks_out(), indent=1, sort_keys=True),
        )

    def _purge_tasks_out(self) -> None:
        book = self.grants.book
        for tid in list(book.retired):
            try:
                n = self.store.fresh_len(tid)
            except Exception:  # a task the store never saw
                continue
            if not n:
                continue
            items = self.store.take_group(tid, n, timeout=0)
            ids = [store_item.from_item(i).trajectory_id for i in items]
            self._purged[tid] += len(ids)
            self._record(Batch([], 0, dropped=[(x, "task_out") for x in ids]))

    def tasks_out(self) -> dict[str, Any]:
        """Every task out of the run ({reason, failures, envs, dropped}) and the latest
        given-up groups."""
        book = self.grants.book
        return {
            "tasks_out": {
                t: {**r, "dropped": self._purged.get(t, 0)} for t, r in book.retired.items()
            },
            "groups_given_up": book.given_up_groups,
            "given_up": list(book.given_up),
            "waiting_for": book.waiting_for(),
            "iteration": self.iteration,
        }

    # ---- weights and checkpoints -------------------------------------------------------

    def _publish(self) -> None:
        assert self.trainer is not None and self.grants is not None
        data = self.trainer.weights_bytes()
        assert data is not None  # rank 0
        path = ""
        if self.config.publish_dir != "-":
            d = Path(self.config.publish_dir)
            d.mkdir(parents=True, exist_ok=True)
            p = d / f"v{self.version:08d}.safetensors"
            write_atomic(p, data)
            path = str(p.resolve())
            self._published.append(p)
            while len(self._published) > self.config.publish_keep:
                self._published.pop(0).unlink(missing_ok=True)
        self.grants.publish_weights(self.version, data, path)

    def save_checkpoint(self) -> Path:
        """A checkpoint of everything now (between iterations)."""
        assert self.trainer is not None
        cfg = self.config
        t = self.trainer
        state = {
            "version": self.version,
            "tasks": self.task_stats.to_dict(),
            "optimizer_steps": t.optimizer_steps_done,
            "assembler_totals": dict(self.assembler.totals),
            "tasks_out": dict(self.grants.book.retired),
            "env_steps": self.env_steps.total,
        }
        model_state, optim_state = self._checkpoint_collectives()
        self.last_checkpoint = save_checkpoint(
            cfg.checkpoint.dir,
            self.iteration,
            model=t.base_model,
            model_state=model_state,
            processor=t.processor,
            optimizer_state=optim_state,
            scheduler_state=t.scheduler.state_dict(),
            state=state,
            ingest=self.ingest,
            keep=cfg.checkpoint.keep,
        )
        self._checkpointed_at = self.iteration
        log.info("checkpoint %s", self.last_checkpoint)
        return self.last_checkpoint

    def close(self) -> None:
        for part in (self.grants, self.ingest):
            if part is not None:
                part.stop()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.store is not None and not self.store.closed:
            self.store.close()


class EnvSteps:
    """Environment steps of delivered trajectories: their turns, a tree's shared turns
    counted once (its environment ran them once; `arpo.record.Branch`)."""

    MAX_NODES = 1 << 17
    """Tree nodes remembered (the oldest are forgotten: a tree's leaves arrive together)."""

    def __init__(self) -> None:
        self.total = 0
        self._seen: collections.OrderedDict[tuple[str, tuple[int, ...]], None] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()

    def add(self, traj: Any) -> int:
        """Count `traj`; the steps it added."""
        b = traj.branch
        if b is None:
            n = traj.steps
        else:
            bounds = [0, *b.steps, traj.steps]
            n = traj.steps - b.steps[-1] if b.steps else traj.steps
            with self._lock:
                for d in range(len(b.path)):
                    key = (b.tree, b.path[:d])
                    if key not in self._seen:
                        self._seen[key] = None
                        n += bounds[d + 1] - bounds[d]
                        if len(self._seen) > self.MAX_NODES:
                            self._seen.popitem(last=False)
        with self._lock:
            self.total += n
        return n


def _pack(samples: list[Sample]) -> list[tuple[Any, ...]]:
    """Samples as plain data for `broadcast_object` (store items are not picklable; blobs
    may be zmq.Frames or memoryviews, which are not either: they go as bytes)."""
    out = []
    for s in samples:
        it = s.item
        out.append((
            np.array(it.tokens), np.array(it.logprobs), np.array(it.offsets),
            np.array(it.rewards), it.version, tuple(bytes(b) for b in it.blobs),
            bytes(it.metadata),
            s.task_id, s.trajectory_id, s.reward, s.checker_score, s.version, s.advantage,
            s.is_replay, s.group, s.branch, s.turns, s.turn_advantages,
        ))  # fmt: skip
    return out


def _unpack(rows: list[tuple[Any, ...]]) -> list[Sample]:
    from arpo.buffer import Item

    return [
        Sample(Item(r[0], r[1], r[2], r[3], r[4], blobs=r[5], metadata=r[6]), *r[7:]) for r in rows
    ]


def run_learner(cfg: LearnerConfig) -> dict[str, float]:
    """Run until done or SIGTERM / SIGINT (which finish the iteration and checkpoint).
    RunStalled when the run can make no progress (its checkpoint written first)."""
    learner = Learner(cfg)

    def on_signal(signum: int, frame: Any) -> None:
        log.info("signal %d: stopping after this iteration", signum)
        learner.stop()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    return learner.run()


__all__ = ["Learner", "LearnerConfig", "run_learner"]

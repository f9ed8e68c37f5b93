"""Learner checkpoints: model, optimizer, RNG, replay store, seen ids and counters, atomically.

    cfg = CheckpointConfig(dir="runs/checkpoints", every=10, keep=3)
    if cfg.due(iteration):
        save_checkpoint(
            cfg.dir, iteration, model=model, processor=processor,
            optimizer_state=optimizer.state_dict(), scheduler_state=scheduler.state_dict(),
            state={"version": version, "tasks": task_stats}, ingest=ingest, keep=cfg.keep,
        )

    # resume
    path = latest_checkpoint(cfg.dir, verify=cfg.verify)     # None: start from scratch
    ckpt = load_checkpoint(path, verify=cfg.verify)
    model = AutoModelForImageTextToText.from_pretrained(ckpt.model_dir)
    optimizer.load_state_dict(ckpt.trainer["optimizer"])
    restore_rng(ckpt.trainer["rng"])
    store = ReplayStore.restore(ckpt.store_path)
    ckpt.restore_seen_log(ingest_config.seen_log)      # only when the live log is gone
    ingest = Ingest(store, ingest_config, transport)
    ingest.replay_journal(ckpt.journal_segment)        # what was acknowledged after it
    ingest.start()

A checkpoint is the folder `<dir>/ckpt-<iteration:08d>/`:

- `model/`: `model.save_pretrained` (safetensors; `model_state` replaces the model's own
  state dict, e.g. a full state gathered from FSDP shards) and `processor.save_pretrained`,
  so `from_pretrained(model_dir)` loads it;
- `trainer.pt`: `{"optimizer", "scheduler", "rng"}` with torch.save (loaded with
  `weights_only=True`); `rng` holds the states of python `random`, numpy's global
  generator, torch's CPU generator and every CUDA device's;
- `state.json`: `{"format", "iteration", "journal_segment", "saved_at", "state"}`, where
  `state` is the caller's JSON-able dict (policy version, task statistics, counters);
- `store.snap`: the replay store's snapshot (optional);
- `seen.log`: a copy of the ingest's seen-id log (optional);
- `MANIFEST.json`, written last: format, iteration, journal segment and every other
  file's relative path, size and sha256.

Writing: everything goes into `<dir>/.tmp-ckpt-<iteration>-<pid>/`, every file is fsynced
(and hashed in the same pass), the manifest is written and fsynced, the folder renamed
to its final name and `<dir>` fsynced. Then the oldest complete checkpoints beyond
`keep` are deleted, and so are leftovers of writers that died (`.tmp-*` folders whose
process is gone). A crash at any point leaves the previous checkpoints as they were.

With `ingest`, the store snapshot is taken with the ingest paused right after it rotates
its journal (`arpo.service.ingest`): the snapshot holds exactly the journal segments
below `journal_segment`, and segments below the oldest kept checkpoint's are pruned
after the save, so any kept checkpoint can still be resumed from (with its journal).
The pause lasts as long as the snapshot (about 0.2 s for a 200 MB store on the project
machine); the model and optimizer are written before it, while trajectories flow.

Validity: a checkpoint is valid iff its MANIFEST parses and every listed file exists
with the listed size and sha256. `verify=False` skips the sha256 of the bulk files only
(BULK_SUFFIXES: weights, trainer.pt, store.snap, seen.log, where the time goes): much
faster for a large model, blind to flipped bytes in those; the small files that say how to
read them (the model's and processor's configs, the tokenizer, state.json) are hashed
either way. `latest_checkpoint` returns the newest valid one; it skips an invalid one with
a logged warning that says why. `check_model_dir` loads the model's config and processor
and checks the weights' shapes against them, for a resume that must not stop on them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from arpo_envs.procs import alive

from arpo.config import check_range, fail, option
from arpo.errors import SnapshotError
from arpo.files import fsync_dir as _fsync_dir

if TYPE_CHECKING:
    from arpo.service.ingest import Ingest

log = logging.getLogger("arpo.learner.checkpoint")

CHECKPOINT_FORMAT = 1
MANIFEST = "MANIFEST.json"
_NAME = re.compile(r"^ckpt-(\d{8,})$")
_TMP = re.compile(r"^\.tmp-.*-(\d+)$")
_CHUNK = 8 << 20
BULK_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".snap", ".log")
"""Files whose sha256 `verify=False` skips (weights, optimizer state, the store snapshot, the
seen-id log). Every other file is hashed in both modes: it is small, and a digit flipped in
a model's config.json mostly loads without an error as another model (76 of 110 one-digit
flips of the tiny model's config.json did), so only its hash can tell."""


@dataclass
class CheckpointConfig:
    """Where and how often the learner checkpoints, and how many it keeps."""

    dir: str = option("runs/checkpoints", "Folder of the checkpoints (ckpt-<iteration>/).")
    every: int = option(10, "Checkpoint every this many iterations (0: only at the end).")
    keep: int = option(3, "Newest complete checkpoints kept; older ones are deleted.")
    verify: bool = option(
        True,
        "Check the sha256 of every file when loading. False skips it for the bulk files "
        "(weights, trainer.pt, store.snap, seen.log: faster on a large model) and still "
        "hashes the configs, tokenizer and state; the loaders' own checks (state, "
        "safetensors headers, model config and processor, the store's checksum) still run "
        "and a damaged checkpoint still falls back to the one before, but a bit flipped "
        "inside the model's weights goes unseen.",
    )

    def validate(self) -> None:
        if not self.dir:
            fail("dir", "must name a folder (e.g. runs/checkpoints)")
        if Path(self.dir).exists() and not Path(self.dir).is_dir():
            fail("dir", f"{self.dir!r} exists and is not a folder")
        check_range("every", self.every, 0, 1 << 31, "iterations; 0: only at the end of the run")
        check_range("keep", self.keep, 1, 1000, "the newest checkpoint is always kept")

    def due(self, iteration: int, *, final: bool = False) -> bool:
        """True when a checkpoint is due after `iteration` (always at the end of the run)."""
        return final or (self.every > 0 and iteration > 0 and iteration % self.every == 0)


@dataclass(frozen=True)
class Checkpoint:
    """A loaded (and verified) checkpoint."""

    path: Path
    iteration: int
    state: dict[str, Any]
    """The caller's dict given to `save_checkpoint`."""
    trainer: dict[str, Any]
    """`{"optimizer": ..., "scheduler": ... or None, "rng": ...}`."""
    model_dir: Path
    store_path: Path | None
    seen_log: Path | None
    journal_segment: int | None
    """The first ingest journal segment not in `store_path` (None: saved without ingest)."""
    manifest: dict[str, Any]

    def restore_seen_log(self, dest: str | Path) -> bool:
        """Copy the checkpoint's seen-id log to `dest` unless a live log is already there.

        The live log holds everything the checkpoint's copy holds and more, so it wins;
        the copy is for a learner that moved hosts. Returns True when it copied.
        """
        dest = Path(dest)
        if self.seen_log is None or not str(dest) or dest.exists():
            return False
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.seen_log, dest)
        return True

    def stored_trajectory_ids(self) -> set[str]:
        """Ids of the fresh trajectories in the checkpoint's store snapshot (`store.snap`,
        written by `save_checkpoint`), read from a copy restored here; empty without one."""
        if self.store_path is None:
            return set()
        from arpo import store_item
        from arpo.buffer import ReplayStore

        out: set[str] = set()
        store = ReplayStore.restore(self.store_path)
        try:
            for task in store.tasks():
                if n := store.fresh_len(task):
                    out |= {store_item.from_item(i).trajectory_id
                            for i in store.take_group(task, n, timeout=0)}  # fmt: skip
        finally:
            store.close()
        return out


# ---------------------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    """The states of python `random`, numpy's global generator, torch CPU and CUDA."""
    name, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [name, [int(k) for k in key], int(pos), int(has_gauss), float(gauss)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(rng: dict[str, Any]) -> None:
    """Set every generator `rng_state()` saved (CUDA only when saved and available)."""
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    name, key, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


# ---------------------------------------------------------------------------- files


def _hash_and_sync(path: Path) -> str:
    """sha256 of the file, fsynced in the same pass."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
        os.fsync(f.fileno())
    return h.hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: Path, data: Any) -> None:
    with path.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _remove_leftovers(root: Path) -> None:
    """Delete `.tmp-*` folders of writers that are gone (a crash mid-save or mid-delete)."""
    for entry in root.iterdir():
        m = _TMP.match(entry.name)
        if m is None or not entry.is_dir():
            continue
        pid = int(m.group(1))
        if pid != os.getpid() and alive(pid):
            continue  # another live process is writing it
        log.info("checkpoint: removing the leftover %s", entry)
        shutil.rmtree(entry, ignore_errors=True)


def _discard(path: Path) -> None:
    """Delete a checkpoint folder: renamed away first, so it never looks half-deleted."""
    trash = path.with_name(f".tmp-del-{path.name}-{os.getpid()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _iteration(path: Path) -> int | None:
    m = _NAME.match(path.name)
    return int(m.group(1)) if m else None


def _checkpoint_dirs(root: str | Path) -> list[Path]:
    """Every `ckpt-*` folder, complete or not, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(it, p) for p in root.iterdir() if (it := _iteration(p)) is not None and p.is_dir()]
    return [p for _, p in sorted(found)]


# ---------------------------------------------------------------------------- saving


def save_checkpoint(
    root: str | Path,
    iteration: int,
    *,
    model: Any,
    model_state: dict[str, Any] | None = None,
    processor: Any = None,
    optimizer_state: dict[str, Any],
    scheduler_state: dict[str, Any] | None = None,
    state: dict[str, Any],
    store: Any = None,
    seen_log: str | Path | None = None,
    ingest: Ingest | None = None,
    keep: int | None = 3,
) -> Path:
    """Write checkpoint `iteration` under `root` atomically; returns its folder.

    `model` is saved with `save_pretrained` (its config, and `model_state` as the weights
    when given); `processor` (optional) next to it. `state` must be JSON-able. With
    `ingest`, the store is snapshotted under `ingest.paused()` right after
    `ingest.rotate_journal()` (the segment is recorded), its seen-id log is copied at the
    same moment, and after the save the journal is pruned below the oldest kept
    checkpoint's segment; `store` defaults to `ingest.store`, `seen_log` to the ingest's.
    `keep` newest complete checkpoints are kept (None: all); the new one always is.
    A checkpoint of the same iteration is replaced.
    """
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 or None, got {keep}")
    state_text = json.dumps(state)  # fails here, before anything is written, if not JSON-able
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(root)
    if ingest is not None:
        store = ingest.store if store is None else store
        if seen_log is None and ingest.config.seen_log:
            seen_log = ingest.config.seen_log
    tmp = root / f".tmp-ckpt-{iteration:08d}-{os.getpid()}"
    final = root / f"ckpt-{iteration:08d}"
    started = time.monotonic()
    try:
        tmp.mkdir()
        model.save_pretrained(tmp / "model", state_dict=model_state)
        if processor is not None:
            processor.save_pretrained(tmp / "model")
        torch.save(
            {"optimizer": optimizer_state, "scheduler": scheduler_state, "rng": rng_state()},
            tmp / "trainer.pt",
        )
        segment = None
        with ingest.paused() if ingest is not None else contextlib.nullcontext():
            paused = time.monotonic()
            if ingest is not None:
                segment = ingest.rotate_journal() if ingest.journal is not None else None
            if store is not None:
                store.snapshot(tmp / "store.snap")
            if seen_log is not None and Path(seen_log).exists():
                shutil.copyfile(seen_log, tmp / "seen.log")
            paused = time.monotonic() - paused
        _write_json(
            tmp / "state.json",
            {
                "format": CHECKPOINT_FORMAT,
                "iteration": iteration,
                "journal_segment": segment,
                "saved_at": time.time(),
                "state": json.loads(state_text),
            },
        )
        files: dict[str, dict[str, Any]] = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            rel = path.relative_to(tmp).as_posix()
            files[rel] = {"size": path.stat().st_size, "sha256": _hash_and_sync(path)}
        for d in sorted({p.parent for p in tmp.rglob("*")}, key=lambda p: -len(p.parts)):
            _fsync_dir(d)
        _write_json(
            tmp / MANIFEST,
            {
                "format": CHECKPOINT_FORMAT,
                "iteration": iteration,
                "journal_segment": segment,
                "files": files,
            },
        )
        _fsync_dir(tmp)
        if final.exists():
            _discard(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f["size"] for f in files.values())
    log.info(
        "checkpoint %s: %.1f MB in %.2f s (ingest paused %.3f s)",
        final,
        size / 1e6,
        time.monotonic() - started,
        paused,
    )
    if keep is not None:
        others = [p for p in list_checkpoints(root) if p != final]  # oldest first
        for old in others[: max(0, len(others) - (keep - 1))]:
            log.info("checkpoint: deleting %s (keep=%d)", old, keep)
            _discard(old)
        _fsync_dir(root)
    if ingest is not None and ingest.journal is not None:
        floor = journal_floor(root)
        if floor is not None:
            ingest.prune_journal(floor)
    return final


def journal_floor(root: str | Path) -> int | None:
    """The lowest journal segment any complete checkpoint under `root` needs (None: none do)."""
    segments = []
    for p in list_checkpoints(root):
        try:
            seg = json.loads((p / MANIFEST).read_text()).get("journal_segment")
        except (OSError, ValueError):
            continue
        if isinstance(seg, int):
            segments.append(seg)
    return min(segments) if segments else None


# ---------------------------------------------------------------------------- loading


def list_checkpoints(root: str | Path) -> list[Path]:
    """The complete checkpoints under `root` (those with a MANIFEST), oldest first."""
    return [p for p in _checkpoint_dirs(root) if (p / MANIFEST).is_file()]


def verify_checkpoint(path: str | Path, *, hashes: bool = True) -> dict[str, Any]:
    """Check a checkpoint folder against its manifest; returns the manifest.

    Raises `SnapshotError` naming the file and what is wrong (no manifest: an incomplete
    write; a file missing, of the wrong size, or with the wrong sha256: checked for every
    file when `hashes`, else for every file but the bulk ones, BULK_SUFFIXES).
    """
    path = Path(path)
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SnapshotError(
            f"{manifest_path}: missing (the checkpoint was not completed)"
        ) from None
    except (OSError, ValueError) as e:
        raise SnapshotError(f"{manifest_path}: unreadable ({e})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise SnapshotError(f"{manifest_path}: not a checkpoint manifest")
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise SnapshotError(
            f"{manifest_path}: format {manifest.get('format')!r} is not supported "
            f"(this version reads {CHECKPOINT_FORMAT})"
        )
    it = _iteration(path)
    if it is not None and manifest.get("iteration") != it:
        raise SnapshotError(
            f"{manifest_path}: iteration {manifest.get('iteration')!r} does not match the "
            f"folder name {path.name}"
        )
    files = manifest["files"]
    for required in ("state.json", "trainer.pt", "model/config.json"):
        if required not in files:
            raise SnapshotError(f"{path / required}: not listed in the manifest")
    for rel, meta in files.items():
        if not isinstance(rel, str) or rel.startswith("/") or ".." in rel.split("/"):
            raise SnapshotError(f"{manifest_path}: lists a path outside the folder: {rel!r}")
        if not isinstance(meta, dict):
            raise SnapshotError(f"{manifest_path}: entry {rel!r} is not a table")
        f = path / rel
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            raise SnapshotError(f"{f}: missing") from None
        if size != meta.get("size"):
            raise SnapshotError(f"{f}: {size} bytes, the manifest says {meta.get('size')}")
        if (hashes or not rel.endswith(BULK_SUFFIXES)) and _sha256(f) != meta.get("sha256"):
            raise SnapshotError(f"{f}: sha256 differs from the manifest (corrupted)")
    return manifest


def check_model_dir(model_dir: str | Path) -> None:
    """Load what `from_pretrained` reads besides the weights' data: the model's config (with
    transformers' own validation), the processor (tokenizer, image processor, chat
    template), and the shape of every parameter the config implies against the safetensors
    headers (as a multiset: the files may name tensors the way an older transformers did).
    The model is built on the meta device, so no weight is read or allocated.

    Raises `SnapshotError` naming the folder and what does not load: a checkpoint whose
    config a flipped digit made invalid, or describe other shapes, is then skipped for the
    one before instead of stopping the resume."""
    import collections

    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    d = Path(model_dir)
    try:
        config = AutoConfig.from_pretrained(d)
    except Exception as e:  # transformers raises many kinds (strict dataclass checks among them)
        raise SnapshotError(
            f"{d / 'config.json'}: the model config does not load: {type(e).__name__}: {e}"
        ) from e
    try:
        AutoProcessor.from_pretrained(d)
    except Exception as e:
        raise SnapshotError(f"{d}: the processor does not load: {type(e).__name__}: {e}") from e
    try:
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config)
    except Exception as e:
        raise SnapshotError(
            f"{d / 'config.json'}: no model can be built from it: {type(e).__name__}: {e}"
        ) from e
    want = collections.Counter(tuple(p.shape) for p in model.parameters())
    have: collections.Counter[tuple[int, ...]] = collections.Counter()
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                have[tuple(st.get_slice(name).get_shape())] += 1
    if want != have:
        missing, extra = sorted((want - have).elements()), sorted((have - want).elements())
        raise SnapshotError(
            f"{d}: the weights do not have the shapes config.json describes (wanted and "
            f"missing: {missing[:3]}{'...' if len(missing) > 3 else ''}; present and not "
            f"wanted: {extra[:3]}{'...' if len(extra) > 3 else ''})"
        )


def latest_checkpoint(root: str | Path, verify: bool = True) -> Path | None:
    """The newest valid checkpoint under `root`, or None; invalid ones are skipped (logged)."""
    for path in reversed(_checkpoint_dirs(root)):
        try:
            verify_checkpoint(path, hashes=verify)
        except SnapshotError as e:
            log.warning("checkpoint %s is not usable, trying the one before: %s", path.name, e)
            continue
        return path
    return None


def load_checkpoint(path: str | Path, verify: bool = True) -> Checkpoint:
    """Verify and load a checkpoint folder (the model itself is loaded by the caller)."""
    path = Path(path)
    manifest = verify_checkpoint(path, hashes=verify)
    try:
        meta = json.loads((path / "state.json").read_text(encoding="utf-8"))
        trainer = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # passed the size check: a corrupt file (verify=False) or a bug
        raise SnapshotError(f"{path}: cannot read state.json or trainer.pt: {e}") from e
    files = manifest["files"]
    return Checkpoint(
        path=path,
        iteration=int(meta["iteration"]),
        state=meta["state"],
        trainer=trainer,
        model_dir=path / "model",
        store_path=path / "store.snap" if "store.snap" in files else None,
        seen_log=path / "seen.log" if "seen.log" in files else None,
        journal_segment=meta.get("journal_segment"),
        manifest=manifest,
    )

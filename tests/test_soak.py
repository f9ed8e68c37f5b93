"""The soak: `arpo train` for a long time under every fault at once, nothing lost, nothing poisoned.

    make test-all                                                     # 30 minutes
    ARPO_SOAK_MINUTES=4 .venv/bin/python -m pytest -q -m slow tests/test_soak.py -s

A real training run (learner, one actor on simulated desktops, one on an external
simulated-desktop server) while, at the same time:

- a second "actor" (a thread of this test speaking the wire protocol on its own socket)
  sends a mix of valid trajectories and poisoned ones: malformed messages (garbage, an id
  with a newline, NaN log-probs, a wrong magic) that ingest must reject, and well-formed
  records the model cannot take (token ids 2e9 and -7, <|image_pad|> sampled, a PNG with a
  flipped byte, a truncated PNG) that the learner must drop at assembly;
- the external environment server is SIGKILLed every few minutes and started again;
- the learner is SIGKILLed twice (`arpo train` resumes it from its checkpoint and journal);
- each actor is SIGKILLed once (`arpo train` restarts it; its spool resends what was not
  acknowledged).

At the end: every valid finished trajectory (of the real actors and of the test's actor)
was trained exactly once or is accounted for (dropped with a reason, in the store or
journal, in a spool); no poisoned record was trained, each malformed message was counted
as rejected by the learner that received it and each well-formed poisoned record was
dropped as invalid (or still waits in the store); the learner's resident memory did not
grow over its longest life, nor an actor's. Every kill comes in the run's first seventh,
so that longest life spans at least 70 % of a 30-minute soak (`make test-all`).

With `ARPO_SOAK_RESULTS=<folder>` (`make soak`) the figures (iterations, kills, the
accounting, the poisoned messages, each process's memory over time and its slope) are
written to `<folder>/soak-<date>.json` and `.md`.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import struct
import threading
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import zmq
from arpo_envs.procs import free_port
from test_train_faults import fault_run_config, start_sim_server, wait_for

from arpo import store_item, wire
from arpo.actor.spool import LEDGER
from arpo.buffer import ReplayStore
from arpo.config import load_config
from arpo.learner.checkpoint import load_checkpoint
from arpo.learner.learner import LearnerConfig
from arpo.learner.metrics import read_metrics
from arpo.policy.tiny import build_tiny_model
from arpo.service.journal import list_segments, read_segment, segment_path
from arpo.synthetic import random_response, screenshot_png, synthetic_trajectory
from arpo.train import TrainRun
from arpo.transport import connect_dealer

MINUTES = float(os.environ.get("ARPO_SOAK_MINUTES", "30"))
"""Length of the training run (the faults are spread over it)."""
RESULTS = os.environ.get("ARPO_SOAK_RESULTS", "")
"""Folder for the results file (empty: none)."""
WARMUP_S = 60.0
"""Memory samples of a process's first minute are left out of its slope."""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(MINUTES * 60) + 1200)]

SYNTHETIC_TASK = "soak-synthetic"
MALFORMED = ("garbage", "id_newline", "nan_logprobs", "bad_magic")
UNTRAINABLE = ("huge_id", "negative_id", "image_pad", "flipped_png", "truncated_png")


class PoisonActor(threading.Thread):
    """Sends valid and poisoned trajectories to the learner on its own ZeroMQ socket.

    Valid ones it writes, once acknowledged, to a spool ledger of its own
    (`spool/poison-actor/finished.log`), so the run's accounting covers them like the
    real actors' ones. Malformed messages are sent between two heartbeats: the learner's
    `rejected_total` counter in its replies must have grown by exactly their number
    (unless the learner was restarted between the two)."""

    def __init__(self, run_dir: Path, model_dir: Path) -> None:
        super().__init__(daemon=True, name="poison-actor")
        self.run_dir = run_dir
        self.model_dir = model_dir
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.valid_acked: set[str] = set()
        self.untrainable_acked: dict[str, str] = {}
        self.malformed_sent = 0
        self.malformed_counted = 0
        self.malformed_uncounted: list[int] = []
        """Rounds whose count could not be checked: the learner restarted in between."""
        self.miscounted: list[tuple[int, int]] = []
        self._pending: dict[str, tuple[str, list, float]] = {}
        self._seq = 0
        self._hb: wire.Heartbeat | None = None
        self._ledger = run_dir / "spool" / "poison-actor"

    # ---- the socket ------------------------------------------------------------------

    def _read(self, timeout_s: float) -> None:
        """Handle what arrives for `timeout_s` (acks, heartbeats)."""
        end = time.monotonic() + timeout_s
        while (left := end - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000)):
                return
            msg = wire.decode(self.sock.recv_multipart())
            if isinstance(msg, wire.Heartbeat):
                self._hb = msg
            elif isinstance(msg, wire.Ack):
                for tid in msg.ids:
                    self._acked(tid)

    def _acked(self, tid: str) -> None:
        entry = self._pending.pop(tid, None)
        if entry is None:
            return
        kind = entry[0]
        if kind == "valid":
            self.valid_acked.add(tid)
            with open(self._ledger / LEDGER, "a", encoding="utf-8") as f:
                f.write(f"{tid}\tok\t{SYNTHETIC_TASK}\n")
        else:
            self.untrainable_acked[tid] = kind

    def _heartbeat(self) -> wire.Heartbeat | None:
        """The learner's answer to one heartbeat (None: no answer in 3 s)."""
        self._seq += 1
        self._hb = None
        hb = wire.Heartbeat("poison-actor", "actor", self._seq, 0, time.time(), {})
        self.sock.send_multipart(wire.encode(hb))
        end = time.monotonic() + 3.0
        while self._hb is None and time.monotonic() < end:
            self._read(0.1)
        return self._hb

    # ---- what it sends ---------------------------------------------------------------

    def _trajectory(self, version: int, poison: str = ""):
        tok = self.processor.tokenizer
        resp = random_response(self.rng, tok, 8)
        png = screenshot_png(self.rng, 320, 200)
        if poison == "huge_id":
            resp[2] = 2_000_000_000
        elif poison == "negative_id":
            resp[2] = -7
        elif poison == "image_pad":
            resp[2] = tok.convert_tokens_to_ids("<|image_pad|>")
        elif poison == "flipped_png":
            png = png[:300] + bytes([png[300] ^ 0xFF]) + png[301:]
        elif poison == "truncated_png":
            png = png[: len(png) // 2]
        reward = float(self.rng.integers(0, 2))
        return synthetic_trajectory(self.processor, "click the button", screenshots=[png],
                                    responses=[resp], reward=reward, version=version,
                                    task_id=SYNTHETIC_TASK)  # fmt: skip

    def _malformed(self, kind: str, version: int) -> list:
        frames = [bytes(f) for f in wire.encode(self._trajectory(version))]
        if kind == "garbage":
            return [os.urandom(8), os.urandom(200)]
        if kind == "bad_magic":
            frames[0] = b"XXXX" + frames[0][4:]
        elif kind == "nan_logprobs":
            frames[4] = struct.pack("<f", float("nan")) * (len(frames[4]) // 4)
        elif kind == "id_newline":  # the id's last character replaced in the header
            tid = wire.decode(frames).trajectory_id.encode()
            assert tid in frames[1], "the id is not where the header keeps it"
            frames[1] = frames[1].replace(tid, tid[:-1] + b"\n")
        return frames

    def _send(self, tid: str, kind: str, frames: list) -> None:
        self._pending[tid] = (kind, frames, time.monotonic())
        self.sock.send_multipart(frames)

    def _round(self, n: int) -> None:
        hb = self._heartbeat()
        if hb is None:  # the learner is down: resend later
            time.sleep(1.0)
            return
        version = hb.version
        for tid, (kind, frames, sent) in list(self._pending.items()):
            if time.monotonic() - sent > 10.0:  # not acknowledged: the learner restarted
                self._send(tid, kind, frames)
        valid = self._trajectory(version)
        self._send(valid.trajectory_id, "valid", wire.encode(valid))
        kind = UNTRAINABLE[n % len(UNTRAINABLE)]
        bad = self._trajectory(version, kind)
        self._send(bad.trajectory_id, kind, wire.encode(bad))
        self._read(0.5)
        before = self._heartbeat()
        if before is None:
            return
        k = 1 + n % 3
        for i in range(k):
            self.sock.send_multipart(self._malformed(MALFORMED[(n + i) % len(MALFORMED)], version))
        self.malformed_sent += k
        after = self._heartbeat()
        if after is None or after.seq <= before.seq:  # another learner answered
            self.malformed_uncounted.append(k)
            return
        got = int(after.stats.get("rejected_total", 0)) - int(before.stats.get("rejected_total", 0))
        if got == k:
            self.malformed_counted += k
        else:
            self.miscounted.append((k, got))

    def run(self) -> None:
        try:
            from transformers import AutoProcessor

            self.processor = AutoProcessor.from_pretrained(self.model_dir)
            self.rng = np.random.default_rng(7)
            self._ledger.mkdir(parents=True, exist_ok=True)
            toml = self.run_dir / "learner.toml"
            wait_for(toml.exists, "the learner's config")
            cfg = load_config(LearnerConfig, toml)
            self.ctx = zmq.Context()
            self.sock = connect_dealer(self.ctx, cfg.transport.data, cfg.transport)
            n = 0
            while not self.stop.is_set():
                self._round(n)
                n += 1
                self.stop.wait(1.0)
            # what is still unacknowledged gets its chance, as an actor's spool would
            end = time.monotonic() + 30
            while self._pending and time.monotonic() < end:
                for tid, (kind, frames, _) in list(self._pending.items()):
                    self._send(tid, kind, frames)
                self._read(2.0)
        except BaseException as e:  # surfaced by the test
            self.error = e
        finally:
            if hasattr(self, "ctx"):
                self.ctx.destroy(linger=0)


def _pending_ids(run_dir: Path, checkpoint: str | None) -> set[str]:
    """Trajectory ids still in the final checkpoint's store or in the journal after it."""
    if checkpoint is None:
        return set()
    ck = load_checkpoint(Path(checkpoint), verify=False)
    out: set[str] = set()
    if ck.store_path is not None:
        store = ReplayStore.restore(ck.store_path)
        for task in store.tasks():
            if n := store.fresh_len(task):
                out |= {
                    store_item.from_item(i).trajectory_id
                    for i in store.take_group(task, n, timeout=0)
                }
        store.close()
    journal = run_dir / "learner" / "journal"
    for seg in list_segments(journal):
        if ck.journal_segment is not None and seg >= ck.journal_segment:
            out |= {wire.decode(r.frames).trajectory_id
                    for r in read_segment(segment_path(journal, seg))}  # fmt: skip
    return out


def _rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def test_soak_training_under_faults_and_poison(tmp_path: Path) -> None:
    from arpo_envs.sim.tasks import write_tasks

    seconds = MINUTES * 60
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    write_tasks(tmp_path / "tasks", ["click_button"], 4, seed=0)
    (tmp_path / "tasks" / "test_all.json").unlink()
    _add_broken_task(tmp_path / "tasks" / "click_button")
    port = free_port()
    server = start_sim_server(port, tmp_path / "server.log")
    garbage = GarbageResetServer()
    cfg = fault_run_config(tmp_path, model, port, minutes=MINUTES, reset_retries=3, max_restarts=20)
    cfg = replace(cfg, env_urls=[*cfg.env_urls, garbage.url])
    run = TrainRun(cfg)
    run_dir = Path(cfg.run_dir)
    metrics = run_dir / "learner" / "metrics.jsonl"
    poison = PoisonActor(run_dir, model)
    errors: list[BaseException] = []
    events: dict[str, list] = {"learner_killed": [], "server_killed": [], "actor_killed": []}
    memory: dict[tuple[str, int], list[tuple[float, int]]] = {}
    """(process name, pid) -> (monotonic time, resident kB) every 5 s."""
    done = threading.Event()

    def rows() -> list[dict]:
        return read_metrics(metrics) if metrics.exists() else []

    def chaos() -> None:
        nonlocal server
        try:
            wait_for(lambda: len(rows()) >= 1, "the first iteration", timeout=600)
            t0 = time.monotonic()
            # Every process is killed in the run's first fifth, so that its last life (the
            # one whose memory is judged) spans most of the run: about 24 of 30 minutes.
            learner_at = [seconds / 15, seconds / 8]
            actor_at = [(seconds / 10, 0), (seconds / 7, 1)]  # (when, which actor)
            server_every = max(45.0, seconds / 7)
            next_server = t0 + server_every
            while not done.wait(1.0):
                now = time.monotonic() - t0
                if learner_at and now >= learner_at[0] and len(rows()) > 0:
                    learner_at.pop(0)
                    n = len(rows())
                    os.kill(run.learner.popen.pid, signal.SIGKILL)
                    events["learner_killed"].append((round(now), n))
                if actor_at and now >= actor_at[0][0]:
                    proc = run.procs[actor_at.pop(0)[1] % len(run.procs)]
                    if proc.popen is not None and proc.popen.poll() is None:
                        os.kill(proc.popen.pid, signal.SIGKILL)
                        events["actor_killed"].append((round(now), proc.name))
                if time.monotonic() >= next_server and now < seconds - 30:
                    server.kill()
                    server.wait(10)
                    events["server_killed"].append(round(now))
                    done.wait(3.0)
                    server = start_sim_server(port, tmp_path / "server.log")
                    next_server = time.monotonic() + server_every
        except BaseException as e:
            errors.append(e)

    def sample_memory() -> None:
        while not done.wait(5.0):
            for proc in [run.learner, *run.procs]:
                p = proc.popen if proc is not None else None
                if p is not None and p.poll() is None and (kb := _rss_kb(p.pid)):
                    memory.setdefault((proc.name, p.pid), []).append((time.monotonic(), kb))

    threads = [threading.Thread(target=f, daemon=True) for f in (chaos, sample_memory)]
    for th in threads:
        th.start()
    poison.start()
    try:
        result = run.run()
    finally:
        poison.stop.set()
        done.set()
        for th in threads:
            th.join(timeout=60)
        poison.join(timeout=120)
        server.kill()
        server.wait(10)
        garbage.close()
    assert not errors, errors
    assert poison.error is None, poison.error
    acc = result["accounting"]
    report = {
        "minutes": MINUTES,
        "iterations": len(rows()),
        "restarts": result["restarts"],
        "events": events,
        "accounting": acc,
        "poison": {
            "valid_acked": len(poison.valid_acked),
            "untrainable_acked": len(poison.untrainable_acked),
            "malformed_sent": poison.malformed_sent,
            "malformed_counted": poison.malformed_counted,
            "malformed_uncounted_rounds": poison.malformed_uncounted,
            "miscounted": poison.miscounted,
        },
        "memory": _memory_report(memory),
        "broken": {
            "garbage_env": garbage.url,
            "garbage_resets_answered": garbage.resets,
            "stored_by_env": _stored_by_env(run_dir),
            "preflight_left_out": (result.get("preflight") or {}).get("left_out", {}),
            "tasks_out": result.get("tasks_out", {}),
        },
    }
    print(json.dumps(report, indent=1))
    (tmp_path / "soak.json").write_text(json.dumps(report, indent=1))
    if RESULTS:
        _write_results(Path(RESULTS), report)

    # The faults happened.
    assert len(events["learner_killed"]) == 2 and run.restarts.get("learner", 0) >= 2
    assert len(events["server_killed"]) >= 2
    assert (
        len(events["actor_killed"]) == 2
        and sum(run.restarts.get(p.name, 0) for p in run.procs) >= 2
    ), (events, run.restarts)

    # The broken task was left out with its reason, no good task was blamed for the broken
    # environment, and that environment was set aside (its resets failed, nothing of it
    # was trained) while the others kept working.
    broken = report["broken"]
    assert list(broken["preflight_left_out"]) == [BROKEN_TASK], broken
    assert set(broken["tasks_out"]) == {BROKEN_TASK}, broken
    assert broken["garbage_resets_answered"] > 0
    assert broken["stored_by_env"].get(garbage.url, 0) == 0, broken
    assert broken["stored_by_env"].get(cfg.env_urls[0], 0) > 0, broken  # the others worked

    # Every valid finished trajectory: trained exactly once or accounted for.
    assert acc["unaccounted"] == 0, acc
    assert acc["trained_twice"] == 0, acc
    assert acc["trained"] > 0
    assert poison.valid_acked and poison.valid_acked <= set(_ledger_ids(run_dir))

    # Every poisoned one rejected: malformed messages counted by the learner that got them,
    # untrainable records dropped as invalid (or still waiting for a group), none trained.
    assert poison.miscounted == [], poison.miscounted
    assert poison.malformed_counted > 0
    assert poison.malformed_counted + sum(poison.malformed_uncounted) == poison.malformed_sent
    outcome = _trained_log(run_dir)
    pending = _pending_ids(run_dir, result["checkpoint"])
    for tid, kind in poison.untrainable_acked.items():
        got = outcome.get(tid, set())
        assert not got & {"fresh", "replay"}, (tid, kind, got)
        assert "dropped_invalid" in got or tid in pending, (tid, kind, got)
    dropped = sum("dropped_invalid" in outcome.get(t, set()) for t in poison.untrainable_acked)
    print(f"untrainable records: {len(poison.untrainable_acked)} acknowledged, {dropped} "
          f"dropped as invalid, {len(set(poison.untrainable_acked) & pending)} still stored")  # fmt: skip
    assert dropped >= 0.8 * len(poison.untrainable_acked) > 0

    # The learner's and each actor's memory is flat over its longest life (after its first
    # minute): the median of the last fifth of the samples within 15 % (or 150 MB) of the
    # first fifth's. In a soak of 15 minutes or more, that life spans at least 70 % of the
    # run (the kills come early; a short soak spends a larger share starting up).
    names = {name for name, _ in memory}
    assert "learner" in names and len(names) == 1 + len(run.procs), names
    for name in names:
        life = max((s for (n, _), s in memory.items() if n == name), key=len)
        if MINUTES >= 15:
            assert life[-1][0] - life[0][0] >= 0.7 * seconds, (name, life[-1][0] - life[0][0])
        settled = [kb for t, kb in life if t - life[0][0] >= WARMUP_S]
        if len(settled) >= 10:
            k = max(3, len(settled) // 5)
            early, late = statistics.median(settled[:k]), statistics.median(settled[-k:])
            assert late - early < max(0.15 * early, 150 * 1024), (name, early, late)


BROKEN_TASK = "soak-broken-setup"
"""A task whose setup downloads a file no cache holds: it can never be set up."""


def _add_broken_task(folder: Path) -> None:
    from arpo_envs.sim.tasks import generate_tasks

    task = generate_tasks("click_button", 1, seed=99)[0]
    task["id"] = BROKEN_TASK
    task["config"].insert(0, {"type": "download", "parameters": {"files": [
        {"url": "https://files.invalid/soak/missing.xlsx", "path": "/home/user/x.xlsx"}]}})  # fmt: skip
    (folder / f"{BROKEN_TASK}.json").write_text(json.dumps(task))


class GarbageResetServer:
    """A desktop that answers everything as a healthy server would, except `/reset`: deeply
    nested JSON for the whole soak (a broken environment, not a broken task)."""

    def __init__(self) -> None:
        import asyncio

        from aiohttp import web

        self.resets = 0
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def reset(request: web.Request) -> web.Response:
            self.resets += 1
            return web.Response(text="[" * 100_000 + "]" * 100_000,
                                content_type="application/json")  # fmt: skip

        async def ok(request: web.Request) -> web.Response:
            return web.Response(text="Linux")

        async def start() -> None:
            app = web.Application()
            app.router.add_post("/reset", reset)
            app.router.add_get("/platform", ok)
            app.router.add_get("/terminal", ok)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            ready.set()

        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(start(), self._loop)
        assert ready.wait(30)

    def close(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def _stored_by_env(run_dir: Path) -> dict[str, int]:
    """Trajectories the learner stored (its journal: `ok` ones), by the environment that ran
    them."""
    import collections

    out: collections.Counter[str] = collections.Counter()
    journal = run_dir / "learner" / "journal"
    for seg in list_segments(journal):
        for rec in read_segment(segment_path(journal, seg)):
            out[wire.decode(rec.frames).env] += 1
    return dict(out)


def _slope_mb_per_hour(samples: list[tuple[float, int]]) -> float | None:
    """Least-squares slope of resident memory over time, MB per hour (None: < 10 samples)."""
    if len(samples) < 10:
        return None
    t = np.array([x for x, _ in samples]) / 3600.0
    mb = np.array([kb for _, kb in samples]) / 1024.0
    return float(np.polyfit(t - t[0], mb, 1)[0])


def _memory_report(memory: dict[tuple[str, int], list[tuple[float, int]]]) -> list[dict]:
    """One entry per process life: name, pid, minutes alive, resident MB at the start, after
    the warm-up and at the end, 12 samples over time, and the slope after the warm-up."""
    out = []
    for (name, pid), s in sorted(memory.items(), key=lambda kv: kv[1][0][0]):
        settled = [(t, kb) for t, kb in s if t - s[0][0] >= WARMUP_S]
        out.append({
            "process": name,
            "pid": pid,
            "minutes": round((s[-1][0] - s[0][0]) / 60, 1),
            "start_mb": round(s[0][1] / 1024),
            "warm_mb": round(settled[0][1] / 1024) if settled else None,
            "end_mb": round(s[-1][1] / 1024),
            "mb_over_time": [round(kb / 1024) for _, kb in s[:: max(1, len(s) // 12)]],
            "slope_mb_per_hour": (round(v, 1) if (v := _slope_mb_per_hour(settled)) is not None
                                  else None),
        })  # fmt: skip
    return out


def _write_results(folder: Path, report: dict) -> None:
    """`soak-<date>.json` and a readable `soak-<date>.md` in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"soak-{date.today().isoformat()}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    acc, poison, ev = report["accounting"], report["poison"], report["events"]
    lines = [
        f"# Soak: {report['minutes']:g} minutes of `arpo train` under faults",
        "",
        f"Command: `make soak` (`ARPO_SOAK_MINUTES={report['minutes']:g} "
        "ARPO_SOAK_RESULTS=benchmarks/results pytest -m slow tests/test_soak.py`). One learner, one actor on 2 simulated desktops, "
        "one actor on an external simulated-desktop server, a thread sending valid, malformed "
        "and untrainable records; the tiny random model on CPU.",
        "",
        f"- iterations: {report['iterations']}; restarts: {report['restarts']}",
        f"- learner SIGKILLed at (s, iteration): {ev['learner_killed']}",
        f"- actors SIGKILLed at (s, actor): {ev['actor_killed']}",
        f"- environment server SIGKILLed at (s): {ev['server_killed']}",
        "",
        "## Accounting of finished trajectories",
        "",
        "| figure | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in acc.items()],
        "",
        "## Poisoned messages",
        "",
        "| figure | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in poison.items()],
        "",
        "## A broken environment and a task that cannot be set up",
        "",
        f"One more environment answered every `/reset` with JSON nested 100,000 deep for the "
        f"whole soak ({report['broken']['garbage_resets_answered']} resets answered); one task "
        "downloads a file no cache holds.",
        "",
        f"- left out by the preflight: {report['broken']['preflight_left_out']}",
        f"- out of the run at the end: {list(report['broken']['tasks_out'])}",
        f"- trajectories stored, by environment: {report['broken']['stored_by_env']}",
        "",
        "## Resident memory of each process life (MB)",
        "",
        f"The slope is a least-squares fit after each life's first {WARMUP_S:g} s.",
        "",
        "| process | pid | minutes | start | after warm-up | end | slope MB/h | over time |",
        "|---|---|---|---|---|---|---|---|",
        *[f"| {m['process']} | {m['pid']} | {m['minutes']} | {m['start_mb']} | {m['warm_mb']} "
          f"| {m['end_mb']} | {m['slope_mb_per_hour']} | {m['mb_over_time']} |"
          for m in report["memory"]],
        "",
    ]  # fmt: skip
    stem.with_suffix(".md").write_text("\n".join(lines))


def _ledger_ids(run_dir: Path) -> list[str]:
    path = run_dir / "spool" / "poison-actor" / LEDGER
    return [line.split("\t")[0] for line in path.read_text().splitlines()]


def _trained_log(run_dir: Path) -> dict[str, set[str]]:
    """Trajectory id -> every outcome `trained.log` gives it (fresh, replay, dropped_*)."""
    out: dict[str, set[str]] = {}
    for line in (run_dir / "learner" / "trained.log").read_text().splitlines():
        parts = line.split("\t")
        if len(parts) == 3:
            out.setdefault(parts[1], set()).add(parts[2])
    return out

"""The supervision of an `arpo train` run: `TrainRun` builds the starting policy and the task
pool, starts the environments, the learner and the actors, watches them (restarting what
dies), stops them cleanly on the iterations, the wall-clock budget or a signal, and evaluates
the result (the package docstring has the stages); `main` is the command."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from arpo_envs.procs import free_port

from arpo.actor.episode import PROMPT_FIELDS
from arpo.config import to_toml, validate
from arpo.env.bringup import DESKTOP_POOL, Bringup, EnvSpec
from arpo.errors import EXIT_STALLED, ArpoError, RunStalled
from arpo.learner.checkpoint import latest_checkpoint
from arpo.learner.metrics import read_metrics
from arpo.train.config import READER_SFT_LR, TrainConfig
from arpo.train.node import die_with_parent, learner_command
from arpo.train.report import (
    account,
    comparison,
    eval_gain,
    plot_curves,
    preflight_markdown,
    read_json_object,
    tasks_out_table,
)

log = logging.getLogger("arpo.train")

RESUME_FILE = "resume.json"
"""In run_dir: what `resume` reuses of the run's earlier starts (the starting policy's
evaluation, the pre-fill, the preflight's left-out tasks) and when each start began."""


@dataclass
class _Proc:
    name: str
    args: list[str]
    log: Path
    popen: subprocess.Popen | None = None
    restarts: int = 0
    extra_on_restart: list[str] = field(default_factory=list)
    signalled: bool = False

    def start(self, restarted: bool = False) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        args = self.args + (self.extra_on_restart if restarted else [])
        with self.log.open("ab") as out:  # SIGKILLed when `arpo train` dies (`resume`)
            self.popen = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGKILL),
            )  # fmt: skip
        log.info("%s: pid %d, log %s", self.name, self.popen.pid, self.log)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def returncode(self) -> int | None:
        """Its exit code once it exited (None: never started, or running)."""
        return self.popen.returncode if self.popen is not None else None

    def terminate(self) -> None:
        """Ask the process to stop (SIGTERM, once); `stop` then waits for it."""
        if self.popen is not None and self.popen.poll() is None and not self.signalled:
            self.popen.send_signal(signal.SIGTERM)
            self.signalled = True

    def stop(self, timeout: float) -> int | None:
        p = self.popen
        if p is None:
            return None
        if p.poll() is None:
            self.terminate()
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s: SIGKILL", self.name, timeout)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
        return p.returncode


def _node_transport(base: Any, data: str, control: str) -> Any:
    """The links of a process the run starts on a Ray node (an actor, an engine server):
    the learner's endpoints, and the CURVE key files its agent writes in the node's folder."""
    return replace(base, data=data, control=control,
                   curve_secret_key="@NODE@/keys/actor.key_secret",
                   curve_server_key="@NODE@/keys/learner.key")  # fmt: skip


def _learner_error(log_path: Path) -> str:
    """Why the learner stopped: its last 'arpo-learner: ...' line, from its log, without
    the "the run cannot go on: " its message starts with (the caller says that once)."""
    try:
        lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return f"see {log_path}"
    for line in reversed(lines):
        if line.startswith("arpo-learner: "):
            return line[len("arpo-learner: ") :].removeprefix("the run cannot go on: ")
    return f"see {log_path}"


@dataclass
class _RemoteLearner:
    """The learner on a Ray node (`cluster.learner_resource`), with `_Proc`'s interface:
    `start` places it (again, with --resume, on any node offering the resource when its node
    was lost) and, when its address changed, re-points every node's actor (`repoint`)."""

    placement: Any
    log: Path
    on_moved: Any
    """Called with (data, control) when a start bound the learner to a new address."""
    procs: int = 1
    """Ranks on each of its nodes (`learner_procs`)."""
    name: str = "learner"
    restarts: int = 0
    popen: None = None
    data: str = ""
    control: str = ""
    _code: int | None = None
    _alive: bool = False
    _checked: float = 0.0

    def start(self, restarted: bool = False) -> None:
        out = self.placement.start_learner(resume=restarted, procs=self.procs)
        self._alive, self._code, self._checked = True, None, time.monotonic()
        moved = (out["data"], out["control"]) != (self.data, self.control)
        self.data, self.control = out["data"], out["control"]
        if moved and restarted:
            self.on_moved(self.data, self.control)

    def alive(self) -> bool:
        if self._alive and time.monotonic() - self._checked >= self.placement.config.poll_s:
            self._checked = time.monotonic()
            self._alive, self._code, why = self.placement.learner_code()
            if not self._alive:
                log.warning("the learner on its node stopped: %s", why)
        return self._alive

    def returncode(self) -> int | None:
        return self._code

    def terminate(self) -> None:
        pass  # `stop` asks it to stop; its agent is not called twice at once

    def stop(self, timeout: float) -> int | None:
        self._alive = False
        return self.placement.stop_learner(timeout)


class RunInterrupted(ArpoError):
    """A signal stopped `arpo train` before training (or in its final evaluation): what
    the phase had started is stopped; `main` exits 128 + the signal."""

    def __init__(self, signum: int, phase: str) -> None:
        name = signal.Signals(signum).name
        done = (
            "training had finished; the evaluation did not"
            if phase == "the final evaluation"
            else "nothing was trained"
        )
        super().__init__(
            f"stopped by {name} during {phase}: every process the run had started is "
            f"stopped; {done}"
        )
        self.signum, self.phase = signum, phase


def _say(line: str) -> None:
    """`line` to stderr from a signal handler: one write(2), never `print` (the main thread
    may be inside a write to stderr, which `print` would re-enter)."""
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode("utf-8", "replace"))


def _running(pid: int) -> bool:
    """`pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += children.get(p, [])
    return out


def long_tasks(pool: str | Path, turns: int) -> set[str]:
    """Ids of the tasks under `pool` whose oracle needs at least `turns` turns (its steps
    and the final DONE); tasks without an oracle are not counted."""
    out: set[str] = set()
    for f in Path(pool).rglob("*.json"):
        try:
            task = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        oracle = task.get("oracle") if isinstance(task, dict) else None
        if isinstance(oracle, list) and oracle and len(oracle) + 1 >= turns:
            out.add(str(task.get("id")))
    return out


class TrainRun:
    """The processes of one run and their supervision (see the module docstring)."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = validate(config)
        self.run_dir = Path(self.config.run_dir).resolve()
        self.procs: list[_Proc] = []
        self.learner: _Proc | _RemoteLearner | None = None
        self.envs = Bringup(self.run_dir)
        """The run's local desktops and VM fleet (`arpo.env.bringup`), stopped by `_shutdown`."""
        self.restarts: dict[str, int] = {}
        self.summary: dict[str, Any] = {}
        self.warm_eval: dict[str, Any] | None = None
        """The starting policy's evaluation (with `eval_warm_start`)."""
        self.prefill: dict[str, Any] | None = None
        """The pre-fill collection's folder and its successes (with `prefill_runs_per_task`)."""
        self.placement: Any = None
        """With cluster.address: the Ray placement of the nodes' actors (`arpo.train.cluster`)."""
        self.keys: dict[str, str] = {}
        """With cluster.address: the learner's CURVE fields (its links bind beyond loopback)."""

    # ---- preparation -------------------------------------------------------------------

    def policy(self) -> str:
        cfg = self.config
        if cfg.model:
            return cfg.model
        from arpo.policy.tiny import TINY_MAX_PIXELS, build_tiny_model

        tiny = self.run_dir / "tiny"
        budget = cfg.tiny_max_pixels or TINY_MAX_PIXELS
        if cfg.base == "reader":
            from arpo.policy.reader import build_reader

            tiny = self.run_dir / f"reader-{cfg.reader_layers}"
            if not (tiny / "config.json").exists():
                build_reader(tiny, layers=cfg.reader_layers, seed=cfg.seed)
        elif not (tiny / "config.json").exists():
            build_tiny_model(tiny, seed=cfg.seed, max_pixels=budget)
        else:
            made = _tiny_max_pixels(tiny)
            if made != budget:
                raise ArpoError(
                    f"{tiny} was built with an image budget of {made} pixels, and this run "
                    f"asks for {budget} (tiny_max_pixels): give another run_dir, or remove "
                    "that folder (and its warm start, sft/) to build it again"
                )
        if not cfg.warm_start:
            return str(tiny)
        sft_dir = self.run_dir / ("sft" if cfg.base == "tiny" else f"sft-{tiny.name}")
        ep = cfg.actor.episode
        shown = ep.observation_type
        if (sft_dir / "config.json").exists():
            made = _warm_start_observation(sft_dir)
            wanted = {k: getattr(ep, k) for k in PROMPT_FIELDS}
            if differ := [k for k, v in wanted.items() if made[k] != v]:
                raise ArpoError(
                    f"{sft_dir} is a warm start on other prompts than this run shows the policy: "
                    + ", ".join(f"actor.episode.{k} is {wanted[k]!r}, the warm start's "
                                f"{made[k]!r}" for k in differ)
                    + "; give another run_dir, or remove that folder to warm-start again"
                )  # fmt: skip
        else:
            from arpo.offline.sft import SFTConfig
            from arpo.offline.sft import run as run_sft

            log.info("warm start: arpo sft on oracle demonstrations -> %s", sft_dir)
            run_sft(
                SFTConfig(
                    model=str(tiny),
                    out=str(sft_dir),
                    # The tasks RL trains on: the tiny model learns the tasks it was shown
                    # (it does not generalise to new ones), so the warm start succeeds
                    # sometimes on exactly these.
                    families=list(cfg.sim_families),
                    per_family=cfg.sim_tasks_per_family,
                    task_seed=cfg.seed,
                    epochs=cfg.sft_epochs,
                    target_nll=cfg.sft_target_nll,
                    max_steps=cfg.actor.episode.max_steps,
                    max_new_tokens=cfg.actor.episode.max_new_tokens,
                    observation_type=shown,
                    marks_source=ep.marks_source,
                    a11y_max_tokens=ep.a11y_max_tokens,
                    history_images=ep.history_images,
                    lr=cfg.sft_lr or (1e-3 if cfg.base == "tiny" else READER_SFT_LR),
                    # The weights the learner trains, and no others.
                    train_layers=cfg.learner.trainer.train_layers,
                )
            )
        return str(sft_dir)

    def task_pool(self) -> str:
        cfg = self.config
        if cfg.tasks:
            return cfg.tasks
        from arpo_envs.sim.tasks import write_tasks

        out = self.run_dir / "tasks"
        write_tasks(out / "sim", list(cfg.sim_families), cfg.sim_tasks_per_family, cfg.seed)
        (out / "sim" / "test_all.json").unlink(missing_ok=True)
        if cfg.local_desktops or cfg.vms:
            import shutil

            src = Path(cfg.local_tasks) if cfg.local_tasks else _local_suite()
            shutil.copytree(src, out / "desktop", dirs_exist_ok=True)
        return str(out)

    # ---- processes ---------------------------------------------------------------------

    def _learner_proc(
        self, model: str, tasks: str, data: str, control: str, left_out: dict[str, str]
    ) -> _Proc:
        cfg = self.config
        assemble = cfg.learner.assemble
        if self.prefill is not None:
            replay = replace(assemble.replay, prefill=self.prefill["trajectories"])
            assemble = replace(assemble, replay=replay)
        trainer = replace(cfg.learner.trainer, model=model)
        if cfg.decay_lr and cfg.minutes == 0 and not trainer.lr_decay_steps:
            steps = cfg.learner.iterations * trainer.optimizer_steps * trainer.epochs
            trainer = replace(trainer, lr_decay_steps=steps)
        lc = replace(
            cfg.learner,
            hold_after_iterations=True,  # _shutdown stops the actors first, then the learner
            run_dir=str(self.run_dir / "learner"),
            tasks=tasks,
            left_out=str(self._write_left_out(left_out)) if left_out else "",
            seed=cfg.seed,
            trainer=trainer,
            assemble=assemble,
            transport=replace(cfg.learner.transport, data=data, control=control, **self.keys),
        )
        validate(lc)
        path = self.run_dir / "learner.toml"
        path.write_text(to_toml(lc))
        args = learner_command(path, cfg.learner_procs)
        return _Proc("learner", args, self.run_dir / "logs" / "learner.log",
                     extra_on_restart=["--resume"])  # fmt: skip

    def _write_left_out(self, left_out: dict[str, str]) -> Path:
        path = self.run_dir / "left_out.json"
        path.write_text(json.dumps(left_out, indent=1, sort_keys=True))
        return path

    def _actor_proc(self, i: int, model: str, data: str, control: str, **kw: Any) -> _Proc:
        cfg = self.config
        keys = self.run_dir / "keys"
        curve = (
            {"curve_secret_key": str(keys / "actor.key_secret"),
             "curve_server_key": str(keys / "learner.key")} if self.keys else {}
        )  # fmt: skip
        ac = replace(
            cfg.actor,
            actor_id=f"actor-{i}",
            engine=replace(cfg.actor.engine, model=model),
            transport=replace(cfg.actor.transport, data=data, control=control, **curve),
            spool_dir=str(self.run_dir / "spool" / f"actor-{i}"),
            file_cache_dir=cfg.actor.file_cache_dir or str(self.run_dir / "task-files"),
            **kw,
        )
        validate(ac)
        path = self.run_dir / f"actor-{i}.toml"
        # It may hold the desktops' bearer tokens (env_tokens): readable by this user only.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(to_toml(ac))
        path.chmod(0o600)
        args = [sys.executable, "-m", "arpo.actor.cli", "--config", str(path)]
        return _Proc(f"actor-{i}", args, self.run_dir / "logs" / f"actor-{i}.log")

    def _node_toml(self, model: str, data: str, control: str) -> Any:
        """`make_toml(actor_id, envs)` for the nodes' actors (`arpo.train.cluster`): this
        run's actor template with `envs` simulated desktops, its folders in the node's
        folder (@NODE@), its model @MODEL@, its CURVE keys those the agent writes there.
        The agent of a node with local desktops writes their URLs and tokens in."""
        cfg = self.config

        def make(actor_id: str, envs: int) -> str:
            engine = replace(cfg.actor.engine, model=model)
            if cfg.cluster.engines == "shared":  # one of the run's engine servers
                engine = replace(engine, kind="shared", base_url=self.placement.engine_url(
                    actor_id), api_key=self.placement.engine_token)  # fmt: skip
            ac = replace(
                cfg.actor,
                actor_id=actor_id,
                envs=[],
                sim_envs=envs,
                engine=engine,
                transport=_node_transport(cfg.actor.transport, data, control),
                spool_dir="@NODE@/spool",
                file_cache_dir="@NODE@/task-files",
            )  # fmt: skip
            validate(replace(ac, sim_envs=max(envs, 1)))  # a desktops-only node's come later
            return to_toml(replace(ac, engine=replace(ac.engine, model="@MODEL@")))

        return make

    def _engine_toml(self, data: str, control: str) -> str:
        """The config of the run's shared engine servers (cluster.engines='shared'): the
        actors' engine (transformers or vLLM) run in process, following the
        learner at `data` / `control` with the actors' CURVE keys; its node folder @NODE@,
        its model @MODEL@, its address and token given when it starts."""
        from arpo.policy.engine_server import EngineServerConfig

        cfg = EngineServerConfig(  # TrainConfig checked that the engine runs in process
            engine=replace(self.config.actor.engine, model="@MODEL@"),
            transport=_node_transport(self.config.actor.transport, data, control),
        )
        validate(replace(cfg, engine=replace(cfg.engine, model="m")))
        return to_toml(cfg)

    def _join_cluster(self, model: str) -> tuple[str, str, Any]:
        """Join the Ray cluster (cluster.address), make the run's CURVE keys; the learner's
        data and control endpoints on the driver's cluster address, and `_node_toml`."""
        from arpo.train.cluster import Placement

        handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        cfg = self.config
        self.placement = Placement(
            cfg.cluster, self.run_dir, cfg.sim_envs_per_actor if cfg.actors else 0,
            desktops=cfg.local_desktops,
            atspi=self._desktop_trees(),
            vms=cfg.vms,
        )  # fmt: skip
        for s, h in handlers.items():  # the run's own handlers, whatever Ray installed
            signal.signal(s, h)
        host = self.placement.bind_host()
        self.keys, self._node_keys = self.placement.make_keys()
        if cfg.cluster.learner_resource:  # its node checks that it sees this run_dir
            from arpo.train.node import MARKER_FILE

            (self.run_dir / MARKER_FILE).write_text(os.urandom(16).hex())
        data, control = f"tcp://{host}:{free_port()}", f"tcp://{host}:{free_port()}"
        log.info("Ray cluster %s: the learner binds %s and %s (CURVE keys in %s)",
                 self.config.cluster.address, data, control, self.run_dir / "keys")  # fmt: skip
        return data, control, self._node_toml(model, data, control)

    def _vm_fleet(self) -> str:
        """The run's own fleet (vms > 0), in <run_dir>/vms: its state file."""
        return str(self.envs.start_vms(self.config.vms, self.run_dir / "vms"))

    def _desktop_trees(self) -> bool:
        """Local desktops serve their apps' AT-SPI trees: the observation type shows one
        (set-of-marks whose marks are read from pixels alone needs none)."""
        return self.config.actor.episode.needs_tree

    def _desktops(self) -> list[EnvSpec]:
        """The run's local desktops, each with its own bearer token (`_desktop_trees`)."""
        return self.envs.start_desktops(self.config.local_desktops, atspi=self._desktop_trees())

    # ---- the run -----------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """The whole run (module docstring). Signals are handled from its first line: the
        first SIGTERM / SIGINT before training (policy, evaluation, pre-fill, desktops,
        preflight, starting the processes) or in the final evaluation raises
        `RunInterrupted` where the run is, which stops what that phase started, then every
        process of the run (`_stop_descendants`); during training it stops the learner and
        the actors and evaluates the last checkpoint. A second signal kills everything."""
        stop = {"flag": False}

        def on_signal(signum: int, frame: Any) -> None:
            name = signal.Signals(signum).name
            if stop["flag"]:
                _say(f"arpo train: {name} again: stopping now")
                self._kill_everything()
                os._exit(128 + signum)
            stop["flag"] = True
            self.signalled = signum
            if self._phase is not None:
                _say(f"arpo train: {name}: stopping {self._phase} and everything it started; "
                     f"{name} again stops now")  # fmt: skip
                raise RunInterrupted(signum, self._phase)
            _say("arpo train: stopping: evaluating the last checkpoint; Ctrl-C again stops now")
            log.info("signal %d: stopping the run", signum)

        self._phase = "building the starting policy"
        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._run(stop)
        except RunInterrupted:
            self._phase = None
            self._stop_descendants(grace_s=30.0)
            raise
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _resumed(self) -> dict[str, Any]:
        """With `resume`: what the run's earlier starts left (RESUME_FILE: the starting
        policy's evaluation, the pre-fill, the preflight's left-out tasks) and the record
        of this start; ArpoError when run_dir holds nothing to continue."""
        learner = self.run_dir / "learner"
        if not (learner / "checkpoints").is_dir() and not (learner / "journal").is_dir():
            raise ArpoError(
                f"resume=true: {learner} holds no checkpoint and no journal, so there is no "
                "run to continue there; give the run_dir of the run, or leave resume unset "
                "to start one"
            )
        state = read_json_object(self.run_dir / RESUME_FILE)
        starts = [*state.get("starts", []), {"at": time.time(), "pid": os.getpid()}]
        self.warm_eval = state.get("warm_eval")
        self.prefill = state.get("prefill")
        left_out = state.get("left_out")
        self.resumes = len(starts) - 1
        log.info("resume=true: continuing the run in %s (start %d); the learner resumes "
                 "from its last checkpoint and journal", self.run_dir, len(starts))  # fmt: skip
        # The nodes of the earlier starts went with their driver: what their spools held
        # unacknowledged is lost with them (their agents and actors died with the driver).
        from arpo.train.cluster import LOST_MARK, mark_lost

        for spool in sorted((self.run_dir / "spool").glob("node*")):
            if spool.is_dir() and not (spool / LOST_MARK).exists():
                mark_lost(self.run_dir, spool.name, {"actor": spool.name, "why": "its driver "
                          "(an earlier start of arpo train) was lost", "at": time.time()})  # fmt: skip
        self._save_resume_state(starts=starts, left_out=left_out)
        return {"left_out": left_out, "nodes": len(list((self.run_dir / "spool").glob("node*")))}

    def _save_resume_state(self, **changed: Any) -> None:
        """Keep what a later `resume` reuses in RESUME_FILE (written whole, then renamed)."""
        path = self.run_dir / RESUME_FILE
        state = {**read_json_object(path), "warm_eval": self.warm_eval, "prefill": self.prefill}
        state.update(changed)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(path)

    def _run(self, stop: dict[str, bool]) -> dict[str, Any]:
        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        resumed = self._resumed() if cfg.resume else None
        if resumed is None:
            self._save_resume_state(starts=[{"at": time.time(), "pid": os.getpid()}],
                                    left_out=None)  # fmt: skip
        model = self.policy()  # phase "building the starting policy", set by `run`
        self._phase = "writing the task pool"
        tasks = self.task_pool()
        if resumed is not None:
            pass  # the earlier start's evaluation and pre-fill (RESUME_FILE)
        elif cfg.eval_warm_start and cfg.eval_runs_per_task and cfg.sim_envs_per_actor:
            self._phase = "the starting policy's evaluation"
            log.info("evaluating the starting policy (the same protocol as the final one)")
            self.warm_eval = self._evaluate(tasks, {"model": model}, self.run_dir / "eval_warm")
            self._save_resume_state()
        self._phase = "the replay pre-fill"
        if resumed is not None:
            pass
        elif cfg.learner.assemble.replay.prefill:
            log.info(
                "replay pre-fill: the successes in %s (learner.assemble.replay.prefill); no "
                "pre-fill collection", cfg.learner.assemble.replay.prefill,
            )  # fmt: skip
        elif cfg.prefill_runs_per_task and cfg.actors and cfg.sim_envs_per_actor:
            self.prefill = self._prefill(model, tasks)
        elif cfg.prefill_runs_per_task:
            log.info("replay pre-fill skipped: the run has no simulated desktops to run it on")
        if (cfg.prefill_demos or cfg.prefill_demos_from_turns) and not (
            cfg.learner.assemble.replay.prefill or resumed is not None
        ):
            self.prefill = self._prefill_demos(model, self.prefill, tasks)
        self._save_resume_state()
        data = f"tcp://127.0.0.1:{free_port()}"
        control = f"tcp://127.0.0.1:{free_port()}"
        node_toml = None
        try:
            if cfg.cluster.address:
                self._phase = "joining the Ray cluster"
                data, control, node_toml = self._join_cluster(model)
                if resumed is not None:  # new actor ids: node<k> after the earlier starts'
                    self.placement.placed = resumed["nodes"]
            self._phase = "starting the local desktops"
            # In a cluster run local_desktops are started on the nodes offering them.
            desktops = self._desktops() if cfg.local_desktops and not node_toml else None
            self._phase = "starting the VMs"  # in a cluster run on the nodes offering them
            fleet = self._vm_fleet() if cfg.vms and not node_toml else cfg.vm_fleet
            self._phase = "the preflight"
            if resumed is not None and resumed["left_out"] is not None:
                left_out = resumed["left_out"]  # the first start's preflight
            else:
                left_out = self._preflight(tasks, desktops, fleet) if cfg.preflight else {}
                self._save_resume_state(left_out=left_out)
            self._phase = "starting the learner and the actors"
            self.learner = self._learner_proc(model, tasks, data, control, left_out)
            if cfg.cluster.learner_resource:  # on a node offering it, not on the driver

                def moved(data: str, control: str) -> None:
                    shared = cfg.cluster.engines == "shared"
                    self.placement.repoint(self._node_toml(model, data, control),
                                           self._engine_toml(data, control) if shared else "")  # fmt: skip

                self.learner = _RemoteLearner(self.placement, self.learner.log, moved,
                                              procs=cfg.learner_procs)  # fmt: skip
            for i in range(0 if node_toml else cfg.actors):
                if cfg.sim_envs_per_actor:
                    self.procs.append(self._actor_proc(i, model, data, control, envs=[],
                                      sim_envs=cfg.sim_envs_per_actor))  # fmt: skip
            if desktops is not None:
                urls, tokens = [e.url for e in desktops], [e.token for e in desktops]
                self.procs.append(self._actor_proc(len(self.procs), model, data, control,
                                                   envs=urls, env_tokens=tokens,
                                                   sim_envs=0))  # fmt: skip
            if fleet:
                self.procs.append(self._actor_proc(len(self.procs), model, data, control,
                                                   envs=[], sim_envs=0, vm_fleet=fleet,
                                                   vm_pool=cfg.vm_pool))  # fmt: skip
            if cfg.env_urls:
                self.procs.append(self._actor_proc(len(self.procs), model, data, control,
                                                   envs=list(cfg.env_urls), sim_envs=0,
                                                   env_tokens=list(cfg.env_tokens),
                                                   env_pool=cfg.env_pool))  # fmt: skip
            self.learner.start(restarted=resumed is not None)  # --resume
            engine_toml = ""
            if isinstance(self.learner, _RemoteLearner):  # the actors connect to its node
                data, control = self.learner.data, self.learner.control
                node_toml = self._node_toml(model, data, control)
            if node_toml is not None and cfg.cluster.engines == "shared":
                engine_toml = self._engine_toml(data, control)
            for p in self.procs:
                p.start()
            if node_toml is not None:
                self._phase = "placing the actors on the Ray cluster's nodes"
                self.placement.start(node_toml, self._node_keys, model, engine_toml)
            self._phase = None  # training: a signal stops it and the last checkpoint is evaluated
            self._supervise(stop)
        finally:
            self._shutdown()
        return self._results(tasks)

    def _stop_descendants(self, grace_s: float) -> None:
        """Every process of the run still running after an interrupted phase cleaned up
        (what it did not know it had started): SIGTERM, then SIGKILL after `grace_s`."""
        left = _descendants(os.getpid())
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + grace_s
        while left and time.monotonic() < end:
            time.sleep(0.2)
            left = [p for p in left if _running(p)]
        for pid in left:
            log.warning("pid %d did not stop within %.0f s of SIGTERM: SIGKILL", pid, grace_s)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    _phase: str | None = None
    """What the run is doing when it is not training (a signal then raises RunInterrupted
    there); None while it trains."""
    signalled: int | None = None
    """The signal that stopped the run (None: it was not stopped by one)."""
    resumes: int = 0
    """Earlier starts of this run that this one continues (`resume`)."""
    preflight_report: dict[str, Any] | None = None
    """The preflight's outcome: its report files and the tasks it left out."""
    stalled: str | None = None
    """Why the learner could not go on (it exited with EXIT_STALLED), or None."""

    def _kill_everything(self) -> None:
        """A second signal: every process of the run killed at once (SIGKILL to the process
        groups of the learner, the actors and every other descendant: a pool run's actor,
        the desktops), the desktops' and VMs' state files swept."""
        for p in [*self.procs, *([self.learner] if self.learner else [])]:
            if p.popen is not None and p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.popen.pid, signal.SIGKILL)
        own = os.getpgrp()  # a pool run's actor is in this process's group: not the group
        for pid in _descendants(os.getpid()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if (group := os.getpgid(pid)) != own:
                    os.killpg(group, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.envs.stop(now=True)

    def _preflight(self, tasks: str, desktops: list[EnvSpec] | None, fleet: str) -> dict[str, str]:
        """Every task set up once on an environment of its pool, no agent
        (`arpo.pool.audit`); the tasks that failed -> why, written to
        <run_dir>/preflight.{json,md} and <run_dir>/left_out.json (the learner's
        `left_out`). RunStalled when `preflight_fatal` and a task failed, or when every
        task failed."""
        import asyncio

        from arpo.env.task import load_pool
        from arpo.env.taskfiles import BlobCache, FileSource, TaskFiles
        from arpo.pool.audit import audit_tasks, summarize

        cfg = self.config
        index = TaskFiles()
        pool = load_pool(tasks, index)
        if self.placement is not None and (cfg.local_desktops or cfg.vms):
            from arpo.env.task import task_pool

            on_nodes = [t for t in pool if task_pool(t.task) == DESKTOP_POOL]
            pool = [t for t in pool if task_pool(t.task) != DESKTOP_POOL]
            log.info("preflight: the %d tasks of pool %r are not set up beforehand: their "
                     "desktops and VMs run on the cluster's nodes", len(on_nodes),
                     DESKTOP_POOL)  # fmt: skip
        runner = cfg.actor.runner.runner_config(reset_before_setup=cfg.actor.reset_before_setup)
        specs: dict[str, list[EnvSpec]] = {}
        if desktops is not None:
            specs[DESKTOP_POOL] = [replace(e, runner=runner) for e in desktops]
        if fleet:
            specs.setdefault(cfg.vm_pool, []).extend(EnvSpec.fleet_vms(fleet, runner))
        kind = "desktop" if cfg.actor.reset_before_setup else "static"
        specs.setdefault(cfg.env_pool, []).extend(
            cfg.url_specs(kind, runner, token=cfg.actor.env_token)
        )
        sims = min(4, cfg.actors * cfg.sim_envs_per_actor)
        t0 = time.monotonic()

        async def run() -> list[Any]:
            runners: list[Any] = []
            if sims:
                from arpo_envs.sim.server import SimConfig, start_servers

                runners, urls = await start_servers([SimConfig(port=0) for _ in range(sims)])
                specs.setdefault(cfg.actor.sim_pool, []).extend(
                    EnvSpec(u, provider="sim") for u in urls
                )
            try:
                source = FileSource.local(index, BlobCache(self.run_dir / "preflight-files"))
                return await audit_tasks(pool, specs, source, checks=False,
                                         task_timeout_s=cfg.preflight_task_timeout_s)  # fmt: skip
            finally:
                for r in runners:
                    await r.cleanup()

        log.info("preflight: setting up each of the %d tasks once on an environment of its "
                 "pool", len(pool))  # fmt: skip
        audits = asyncio.run(run())
        left_out = {a.task_id: a.reason for a in audits if a.verdict != "ok"}
        report = {
            "seconds": round(time.monotonic() - t0, 1),
            "summary": summarize(audits),
            "left_out": left_out,
            "tasks": [a.to_dict() for a in audits],
        }
        (self.run_dir / "preflight.json").write_text(json.dumps(report, indent=1))
        (self.run_dir / "preflight.md").write_text(preflight_markdown(audits, report["seconds"]))
        self.preflight_report = {
            "tasks": len(audits),
            "left_out": left_out,
            "seconds": report["seconds"],
            "report": str(self.run_dir / "preflight.md"),
        }
        log.info("preflight: %d of %d tasks set up in %.0f s on %s; %d left out%s", len(audits)
                 - len(left_out), len(audits), report["seconds"],
                 ", ".join(f"{len(v)} of pool {p!r}" for p, v in specs.items()), len(left_out),
                 "".join(f"\n  {t}: {r}" for t, r in list(left_out.items())[:20]))  # fmt: skip
        for t, r in left_out.items():
            print(f"arpo train: preflight: task {t} left out: {r}", file=sys.stderr)
        if left_out and (cfg.preflight_fatal or len(left_out) == len(audits)):
            why = ("preflight_fatal is set" if len(left_out) < len(audits)
                   else "no task could be set up")  # fmt: skip
            raise RunStalled(
                f"the preflight left out {len(left_out)} of {len(audits)} tasks and {why}: "
                + "; ".join(f"{t}: {r}" for t, r in list(left_out.items())[:20])
                + f" (all of them: {self.run_dir / 'preflight.md'})"
            )
        return left_out

    def _supervise(self, stop: dict[str, bool]) -> None:
        cfg = self.config
        assert self.learner is not None
        start = time.monotonic()
        last_progress = last_check = 0.0
        metrics = self.run_dir / "learner" / "metrics.jsonl"
        status = self.run_dir / "learner" / "tasks_out.json"
        from arpo.learner.metrics import ProgressLine
        from arpo.progress import Progress

        # Training with an estimate of the time left when the iterations bound the run;
        # a line saying what the run waits for when no iteration has finished for a while.
        bar = (
            Progress("training", cfg.learner.iterations, unit="iteration", every_s=cfg.progress_s)
            if cfg.learner.iterations and cfg.progress_s
            else None
        )
        step, step_at = -1, time.monotonic()
        told_out: set[str] = set()
        last_tick = 0.0
        while not stop["flag"]:
            time.sleep(0.5)
            if self.placement is not None and time.monotonic() - last_tick >= cfg.cluster.poll_s:
                last_tick = time.monotonic()
                self.placement.tick()
            if cfg.minutes and time.monotonic() - start > cfg.minutes * 60:
                log.info("time budget of %.1f min used: stopping", cfg.minutes)
                break
            if not self.learner.alive():
                code = self.learner.returncode()
                if code == 0:
                    log.info("the learner finished its iterations")
                    break
                if code == EXIT_STALLED:
                    self.stalled = _learner_error(self.learner.log)
                    print(f"arpo train: the run cannot go on: {self.stalled}", file=sys.stderr)
                    break
                self._restart(self.learner, f"the learner exited with code {code}")
            elif cfg.learner.iterations and time.monotonic() - last_check >= 1.0:
                last_check = time.monotonic()
                rows = read_metrics(metrics) if metrics.exists() else []
                if rows and rows[-1]["step"] >= cfg.learner.iterations:
                    log.info("the learner finished its iterations: stopping the actors, then it")
                    break
            for p in self.procs:
                if not p.alive():
                    self._restart(p, f"{p.name} exited with code {p.popen.returncode}")
            if not cfg.progress_s or time.monotonic() - last_progress < cfg.progress_s:
                continue
            last_progress = time.monotonic()
            rows = read_metrics(metrics) if metrics.exists() else []
            waiting = read_json_object(status)
            for tid, r in (waiting.get("tasks_out") or {}).items():
                if tid not in told_out:
                    told_out.add(tid)
                    print(f"arpo train: task {tid} is out of the run: {r.get('reason')}",
                          file=sys.stderr)  # fmt: skip
            if rows and rows[-1]["step"] != step:
                step, step_at = rows[-1]["step"], time.monotonic()
            stuck = time.monotonic() - step_at
            if (rows or waiting) and stuck > max(3 * cfg.progress_s, 30.0) and waiting:
                print(f"[{time.monotonic() - start:5.0f} s] training: {max(step, 0)}/"
                      f"{cfg.learner.iterations or '?'} iterations; waiting {stuck:.0f} s for "
                      f"groups: {waiting.get('waiting_for', '?')}", file=sys.stderr)  # fmt: skip
            elif rows and bar is not None:
                bar.update_to(rows[-1]["step"], ProgressLine.format(rows[-1]["step"], rows[-1]))
            elif rows:
                print(ProgressLine.format(rows[-1]["step"], rows[-1]), file=sys.stderr)
            else:
                elapsed = time.monotonic() - start
                print(f"[{elapsed:5.0f} s] waiting for the first iteration ...",
                      file=sys.stderr)  # fmt: skip
        if bar is not None:
            bar.close()

    def _pool_progress(self, desc: str) -> tuple[Any, Any]:
        """(on_progress callback for a pool run, close): a bar with the time left on a
        terminal, plain lines every `progress_s` otherwise (none when it is 0)."""
        from arpo.progress import Progress

        holder: dict[str, Progress] = {}

        def on_progress(done: int, total: int) -> None:
            if "p" not in holder:
                holder["p"] = Progress(desc, total, unit="episode", every_s=self.config.progress_s)
            holder["p"].update_to(done)

        def close() -> None:
            if "p" in holder:
                holder["p"].close()

        return on_progress, close

    def _pool_fields(self, tasks: str) -> dict[str, Any]:
        """The fields an evaluation or the pre-fill collection of this run shares: the
        simulated tasks of the pool, this run's actor limits, free loopback ports."""
        cfg = self.config
        return {
            "tasks": str(Path(tasks) / "sim") if (Path(tasks) / "sim").is_dir() else tasks,
            # Simulated episodes take seconds: a grant not delivered in 2 minutes is lost
            # (once seen: one of 128 grants of an evaluation never ran) and goes to the
            # actor again instead of stalling the run for the default 30 min.
            "grant_timeout_s": 120.0,
            "local_actor_args": cfg.pool_actor_args(),
            "progress_s": 0,
            "transport": replace(
                cfg.learner.transport,
                data=f"tcp://127.0.0.1:{free_port()}",
                control=f"tcp://127.0.0.1:{free_port()}",
            ),
        }

    def _prefill(self, model: str, tasks: str) -> dict[str, Any]:
        """`arpo collect` of the starting policy on the simulated tasks at the rollout
        sampling settings (`learner.trainer.temperature`, `top_p`, so the learner can
        train the kept episodes), `prefill_runs_per_task` per task, into <run_dir>/prefill
        (replacing what is there); the folder and the successes per task."""
        from arpo.pool.collect import CollectConfig, run_collect

        cfg = self.config
        out = self.run_dir / "prefill"
        log.info(
            "replay pre-fill: the starting policy, %d runs per simulated task at "
            "temperature %g -> %s", cfg.prefill_runs_per_task,
            cfg.learner.trainer.temperature, out,
        )  # fmt: skip
        on_progress, close = self._pool_progress("replay pre-fill")
        try:
            res = run_collect(
                CollectConfig(
                    model=model,
                    **self._pool_fields(tasks),
                    runs_per_task=cfg.prefill_runs_per_task,
                    temperature=cfg.learner.trainer.temperature,
                    top_p=cfg.learner.trainer.top_p,
                    out=str(out),
                    overwrite=True,
                ),
                on_progress=on_progress,
            )
        finally:
            close()
        by_task = {t: int(r.get("successes") or 0) for t, r in res["tasks"].items()}
        log.info(
            "replay pre-fill: %d successes in %d of %d tasks",
            sum(by_task.values()), sum(1 for k in by_task.values() if k), len(by_task),
        )  # fmt: skip
        return {"trajectories": str(out), "successes": by_task}

    def _prefill_demos(
        self, model: str, prefill: dict[str, Any] | None, tasks: str
    ) -> dict[str, Any] | None:
        """The warm start's demonstrations (<model>/demos, written by `arpo sft`) scored by
        `model` at the rollout sampling settings, with the pre-fill collection's
        trajectories, in <run_dir>/prefill-replay: what the learner's buffers start with.
        All of them with `prefill_demos`; else those of the pool's multi-step tasks
        (`prefill_demos_from_turns`)."""
        import shutil

        from arpo.offline.data import read_trajectories, write_trajectories
        from arpo.offline.demos import score_demos

        cfg = self.config
        src = Path(model) / "demos"
        if not src.is_dir():
            log.info("replay pre-fill of demonstrations skipped: %s has no demos folder", model)
            return prefill
        demos = list(read_trajectories(src))
        if not cfg.prefill_demos:
            long = long_tasks(tasks, cfg.prefill_demos_from_turns)
            demos = [d for d in demos if d.task_id in long]
            if not demos:
                return prefill
            log.info(
                "replay pre-fill: the demonstrations of %d multi-step task(s) (oracle + DONE >= %d "
                "turns; prefill_demos_from_turns)", len(long), cfg.prefill_demos_from_turns,
            )  # fmt: skip
        scored = score_demos(
            demos, model, temperature=cfg.learner.trainer.temperature,
            top_p=cfg.learner.trainer.top_p,
        )  # fmt: skip
        out = self.run_dir / "prefill-replay"
        shutil.rmtree(out, ignore_errors=True)
        collected = list(read_trajectories(prefill["trajectories"])) if prefill else []
        write_trajectories(out, [*collected, *scored])
        successes = dict(prefill["successes"]) if prefill else {}
        for d in scored:
            successes[d.task_id] = successes.get(d.task_id, 0) + 1
        log.info(
            "replay pre-fill: %d oracle demonstrations scored by the starting policy at "
            "temperature %g, with %d collected trajectories -> %s",
            len(scored), cfg.learner.trainer.temperature, len(collected), out,
        )  # fmt: skip
        return {"trajectories": str(out), "successes": successes, "demos": len(scored)}

    def _evaluate(self, tasks: str, policy: dict[str, str], out: Path) -> dict[str, Any]:
        """`arpo eval` of `policy` ({"checkpoint": ...} or {"model": ...}) on the simulated
        tasks of the pool, `eval_runs_per_task` episodes per task at `eval_temperature`;
        the success rate over episodes and its standard error."""
        from arpo.pool.evaluate import EvalConfig, run_eval

        cfg = self.config
        on_progress, close = self._pool_progress(f"evaluation ({out.name})")
        try:
            ev = run_eval(
                EvalConfig(
                    **policy,
                    **self._pool_fields(tasks),
                    runs_per_task=cfg.eval_runs_per_task,
                    temperature=cfg.eval_temperature,
                    out=str(out),
                ),
                on_progress=on_progress,
            )
        finally:
            close()
        overall = ev.get("overall", {})
        p = float(overall.get("success_rate_episodes") or 0.0)
        n = int(overall.get("episodes") or 0)
        return {
            "success_rate": p,
            "episodes": n,
            "se": (p * (1 - p) / n) ** 0.5 if n else float("nan"),
            "mean_steps": float(overall.get("mean_steps") or 0.0),
            "report": str(out / "eval.md"),
            "by_task": {
                t: {"successes": int(r.get("successes") or 0), "runs": int(r.get("runs") or 0)}
                for t, r in ev.get("tasks", {}).items()
            },
        }

    def _restart(self, p: _Proc, why: str) -> None:
        if not self.config.restart or p.restarts >= self.config.max_restarts:
            raise ArpoError(f"{why}; see {p.log}")
        p.restarts += 1
        self.restarts[p.name] = p.restarts
        log.warning("%s: starting it again (%d of %d)", why, p.restarts, self.config.max_restarts)
        p.start(restarted=True)

    def _shutdown(self) -> None:
        # Actors first, all at once: they finish or abandon their episodes and flush their
        # spools to the learner while it still runs (it holds after its iterations: no new
        # grants, every delivery acknowledged); then the learner checkpoints what it holds.
        t0 = time.monotonic()
        for p in self.procs:
            p.terminate()
        if self.placement is not None:
            try:
                self.placement.stop(timeout=180)
            except Exception as e:  # the learner is stopped whatever happened to Ray
                log.error("stopping the nodes' actors failed: %s", e)
        for p in self.procs:
            p.stop(timeout=180)
        if self.procs:
            log.info("actors stopped in %.1f s", time.monotonic() - t0)
        if self.learner is not None:
            code = self.learner.stop(timeout=600)
            log.info("learner stopped (code %s)", code)
        if self.placement is not None:
            with contextlib.suppress(Exception):
                self.placement.close()
        self.envs.stop()

    # ---- results -----------------------------------------------------------------------

    def _results(self, tasks: str) -> dict[str, Any]:
        cfg = self.config
        learner_dir = self.run_dir / "learner"
        metrics = learner_dir / "metrics.jsonl"
        rows = read_metrics(metrics) if metrics.exists() else []
        ckpt = latest_checkpoint(learner_dir / "checkpoints", verify=False)
        finished = bool(cfg.learner.iterations and rows
                        and rows[-1]["step"] >= cfg.learner.iterations)  # fmt: skip
        out: dict[str, Any] = {
            "metrics": str(metrics),
            "iterations": len(rows),
            "finished": finished,
            "checkpoint": str(ckpt) if ckpt else None,
            "restarts": dict(self.restarts),
        }
        if self.stalled is not None:
            out["stalled"] = self.stalled
        if self.signalled is not None:
            out["signal"] = self.signalled
        if self.preflight_report is not None:
            out["preflight"] = self.preflight_report
        status = read_json_object(learner_dir / "tasks_out.json")
        out["tasks_out"] = status.get("tasks_out", {})
        out["groups_given_up"] = status.get("groups_given_up", 0)
        if self.warm_eval is not None:
            out["eval_warm_start"] = self.warm_eval
        if self.prefill is not None:
            out["prefill"] = self.prefill
        if self.stalled is not None:
            log.info("no final evaluation: the run stopped before its end (%s)", self.stalled)
        elif ckpt is not None and cfg.eval_runs_per_task and cfg.sim_envs_per_actor:
            # After a signal stopped training a second one kills everything; else the
            # first one stops this evaluation (RunInterrupted).
            self._phase = "the final evaluation" if self.signalled is None else None
            ev = self._evaluate(tasks, {"checkpoint": str(ckpt)}, self.run_dir / "eval")
            self._phase = None
            out["eval"] = str(self.run_dir / "eval" / "eval.md")
            out["eval_success_rate"] = ev["success_rate"]
            out["eval_trained"] = ev
            if self.warm_eval is not None:
                out["eval_gain"] = eval_gain(self.warm_eval, ev)
        if rows:
            out["plot"] = str(plot_curves(
                rows, self.run_dir / "curve.png", warm_start=self.warm_eval,
                eval_temperature=cfg.eval_temperature, trained=out.get("eval_trained"),
                rollout_temperature=cfg.learner.trainer.temperature,
            ))  # fmt: skip
        if self.placement is not None:
            out["cluster"] = self.placement.summary()
        if self.resumes:
            out["resumes"] = self.resumes
        out["accounting"] = account(self.run_dir, ckpt)
        (self.run_dir / "summary.json").write_text(json.dumps(out, indent=2))
        self.summary = out
        return out


def _tiny_max_pixels(model: Path) -> int:
    """The `max_pixels` a saved tiny model's processor was built with."""
    from transformers import AutoProcessor

    from arpo.policy.prompt import pixel_bounds

    return int(pixel_bounds(AutoProcessor.from_pretrained(str(model)))[1])


def _warm_start_observation(sft_dir: Path) -> dict[str, Any]:
    """What the prompts of the warm start in `sft_dir` showed (`arpo sft`'s saved config:
    observation_type, marks_source, a11y_max_tokens, history_images; each field's default
    for one saved before the field existed)."""
    from arpo.offline.sft import SFTConfig

    try:
        info = json.loads((sft_dir / "offline.json").read_text())
    except (OSError, ValueError):
        info = {}
    sft = info.get("sft") or {}
    default = SFTConfig()
    return {k: sft.get(k, getattr(default, k)) for k in PROMPT_FIELDS}


def _local_suite() -> Path:
    import arpo_envs.tasks as t

    return Path(t.__file__).parent / "local"


def main(cfg: TrainConfig) -> int:
    """Run; the exit code: 0 when training finished (or its wall-clock budget ran out),
    EXIT_STALLED (3) when it could not go on, 128 + the signal's number when a signal
    stopped it before its end."""
    try:
        out = TrainRun(cfg).run()
    except RunStalled as e:
        print(f"arpo train: {e}", file=sys.stderr)
        return EXIT_STALLED
    except RunInterrupted as e:
        print(f"arpo train: {e}", file=sys.stderr)
        return 128 + e.signum
    print(json.dumps(out, indent=2))
    if out.get("eval"):
        print(Path(out["eval"]).read_text())
    if out.get("eval_trained"):
        print(comparison(out))
    if out.get("tasks_out"):
        print(tasks_out_table(out["tasks_out"]))
    if out.get("stalled"):
        # Why was said when the learner stopped (`_supervise`), once.
        print(f"arpo train: stopped before its end (details: {cfg.run_dir}/learner/"
              f"tasks_out.json; the last checkpoint: {out.get('checkpoint')})",
              file=sys.stderr)  # fmt: skip
        return EXIT_STALLED
    if out.get("signal") is not None and not out.get("finished"):
        return 128 + int(out["signal"])
    return 0

"""The configuration of `arpo-actor` and its `runner` section (every field documented)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from arpo.actor.episode import EpisodeConfig
from arpo.config import (
    check_on_build,
    check_range,
    check_seconds,
    fail,
    folder_problem,
    option,
    url_problem,
)
from arpo.env.bringup import fleet_problem, token_problem
from arpo.env.environment import EnvironmentConfig
from arpo.env.osworld.client import EvaluatorConfig, find_python
from arpo.env.runner import DESKTOP_ACTION_PAUSE_S, RunnerConfig
from arpo.policy.engine import EngineConfig
from arpo.record import ident_problem
from arpo.transport import TransportConfig
from arpo.wire import MAX_ACK_IDS, MAX_ID_BYTES


def default_actor_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class ActorRunnerConfig:
    """How the task runners of the `envs` URLs set up and score tasks (arpo.env.runner), and
    the OSWorld evaluator workers they share. Simulated desktops always use the project's own
    code: their scene steps and checks exist only there."""

    evaluator: Literal["own", "auto", "osworld"] = option(
        "auto",
        "Who sets up and scores tasks: 'own' (this project's steps, getters and metrics only), "
        "'osworld' (OSWorld's published code through its worker, always: benchmark scores "
        "exactly) or 'auto' (own where it has everything a task needs, OSWorld's otherwise).",
    )
    osworld_python: str = option(
        "",
        "Python of OSWorld's evaluator environment ('': $ARPO_OSWORLD_PYTHON, else the "
        "repository's .venv-osworld made by `make osworld-evaluator`).",
    )
    osworld_timeout_s: float = option(
        600.0, "Bound on one OSWorld setup or evaluation; a worker that overruns it is killed."
    )
    osworld_probe_timeout_s: float = option(
        10.0,
        "Before each OSWorld setup or evaluation the environment must answer GET /platform "
        "within this, else the episode is env_error at once (OSWorld's code retries an "
        "unreachable server for about 100 s); 0: no check.",
    )
    osworld_workers: int = option(
        0,
        "OSWorld evaluator worker processes shared by all environments of this actor, about "
        "240 MiB and 2.5 s of start-up each, started when a task first needs one "
        "(0: min(environments, 2); at most MAX_OSWORLD_WORKERS).",
    )
    cache_dir: str = option(
        "", "Local file cache for `download` steps and `cloud_file` getters ('': none)."
    )
    action_pause_s: float = option(
        DESKTOP_ACTION_PAUSE_S,
        "Pause between two actions of one response, for the application to react (a dialog "
        "opens, a focus moves; UI-TARS's own converter waits 1 s); 0: none. Simulated "
        "desktops never wait.",
    )

    def validate(self) -> None:
        if self.evaluator == "osworld" and find_python(self.osworld_python or None) is None:
            fail(
                "evaluator",
                "'osworld' needs OSWorld's evaluator environment: run `make osworld-evaluator`, "
                "or set runner.osworld_python (or $ARPO_OSWORLD_PYTHON) to its python "
                f"(not found: {self.osworld_python or '.venv-osworld/bin/python'})",
            )
        check_seconds(
            "osworld_timeout_s", self.osworld_timeout_s, "one OSWorld setup or evaluation"
        )
        check_seconds(
            "osworld_probe_timeout_s",
            self.osworld_probe_timeout_s,
            "GET /platform before each OSWorld call",
            zero="0: no check",
        )
        check_range(
            "osworld_workers",
            self.osworld_workers,
            0,
            MAX_OSWORLD_WORKERS,
            "OSWorld evaluator processes of about 240 MiB; 0: min(environments, 2)",
        )
        if problem := folder_problem(self.cache_dir):
            fail("cache_dir", problem)
        check_seconds(
            "action_pause_s", self.action_pause_s, "between a response's actions", zero="0: none"
        )

    def runner_config(self, *, reset_before_setup: bool) -> RunnerConfig:
        """The RunnerConfig of an `envs` URL's runner."""
        return RunnerConfig(
            cache_dir=Path(self.cache_dir) if self.cache_dir else None,
            reset_before_setup=reset_before_setup,
            evaluator=self.evaluator,
            osworld_python=self.osworld_python or None,
            osworld_timeout_s=self.osworld_timeout_s,
            osworld_probe_timeout_s=self.osworld_probe_timeout_s,
            action_pause_s=self.action_pause_s,
        )

    def evaluator_config(self, environments: int) -> EvaluatorConfig:
        """The OSWorld worker pool shared by `environments` runners."""
        workers = self.osworld_workers or max(1, min(environments, 2))
        return EvaluatorConfig(
            python=self.osworld_python or None,
            workers=workers,
            request_timeout_s=self.osworld_timeout_s,
        )


@dataclass
class ActorConfig:
    """One actor process: its environments, its policy, its spool, its links to the learner."""

    actor_id: str = option(
        "",
        "Name of this actor in records and logs (default: host-pid): printable characters "
        "without whitespace, at most 1024 bytes.",
    )
    envs: list[str] = option(
        doc="Environment servers (OSWorld VMs or local desktops), e.g. http://10.0.0.5:5000.",
        factory=list,
    )
    env_token: str = option("", "Bearer token for the environment servers (local desktops).")
    env_tokens: list[str] = option(
        doc="Bearer token of each `envs` URL, in order (`arpo-envs up --tokens --tokens-file "
        "F` gives every desktop its own and writes them to F); empty = env_token for all.",
        factory=list,
    )
    env_pool: str = option(
        "desktop",
        "Pool of the `envs` URLs: they are granted only tasks of this pool "
        "(see arpo.env.task.task_pool; e.g. 'osworld' for tasks labelled so).",
    )
    vm_fleet: str = option(
        "",
        "State file of a VM fleet (`arpo-envs vm up`: <dir>/fleet.json): its VMs are driven "
        "too, each reverted to its snapshot before every episode ('' = none).",
    )
    vm_count: int = option(0, "VMs of vm_fleet to drive (0: all of them).")
    vm_pool: str = option("desktop", "Pool of the fleet's VMs: they get only its tasks.")
    sim_envs: int = option(
        0, "Also start this many simulated desktops in this process (0..MAX_SIM_ENVS)."
    )
    sim_pool: str = option("sim", "Pool of the simulated desktops: they get only its tasks.")
    sim_latency: str = option(
        "none", "Simulated desktops' step latency: none, fixed:<ms>, lognormal:<ms>[,<sigma>]."
    )
    sim_slow_env: int = option(-1, "Index of one slow simulated desktop (-1: none).")
    sim_slow_factor: float = option(1.0, "Latency multiplier of the slow simulated desktop.")
    reset_before_setup: bool = option(
        True,
        "POST /reset before each task's setup on the `envs` URLs and simulated desktops "
        "(local desktops). False for servers that have no /reset (an OSWorld VM you run "
        "yourself: nothing reverts it, which is logged); the fleet's VMs (vm_fleet) are "
        "reverted to their snapshot whatever this says.",
    )
    policy: Literal["engine", "scripted"] = option(
        "engine", "'engine': the policy engine below; 'scripted': replay task oracles (tests)."
    )
    engine: EngineConfig = option(EngineConfig(model="-"), "The policy engine.")
    scripted_quit_prob: float = option(0.0, "Scripted policy: share of episodes given up early.")
    scripted_garbage_prob: float = option(0.0, "Scripted policy: share of unparsable responses.")
    scripted_error_prob: float = option(
        0.0, "Scripted policy: share of calls that fail like an engine fault (tests)."
    )
    episode: EpisodeConfig = option(EpisodeConfig(), "How episodes run.")
    environment: EnvironmentConfig = option(
        EnvironmentConfig(),
        "How every environment is reverted and set up before an episode (the tries, their "
        "backoff).",
    )
    runner: ActorRunnerConfig = option(
        ActorRunnerConfig(), "How tasks are set up and scored on the `envs` URLs."
    )
    transport: TransportConfig = option(TransportConfig(), "Links to the learner.")
    spool_dir: str = option("runs/actor-spool", "Folder of trajectories not yet acknowledged.")
    spool_max_bytes: int = option(
        2 << 30, "Spool size limit; when reached no new episode starts (nothing is dropped)."
    )
    file_cache_dir: str = option(
        "",
        "Content-addressed cache of the task files grants name by sha256 (fetched from the "
        "learner, checked before every use); '' = $XDG_CACHE_HOME/arpo/task-files or "
        "~/.cache/arpo/task-files.",
    )
    max_unacked: int = option(32, "Trajectories sent and not yet acknowledged, at most.")
    shutdown_deadline_s: float = option(
        60.0, "On SIGTERM / Ctrl-C, in-flight episodes get this long to finish."
    )
    flush_deadline_s: float = option(
        30.0, "Then the spool gets this long to be acknowledged (the rest stays on disk)."
    )
    env_recheck_s: float = option(
        2.0,
        "An environment unhealthy after `environment.reset_retries` failed resets is asked this "
        "often whether it answers again, and rejoins when it does (a desktop restarted); 0: "
        "it is retired for good and the actor stops when none is left. Fleet VMs wait for "
        "their replacement instead.",
    )
    max_episodes: int = option(0, "Stop after this many finished episodes (0: run until stopped).")
    progress_s: float = option(5.0, "Interval of the progress line (0: none).")
    weights_dir: str = option(
        "", "Where weights fetched over the network are written when the engine loads folders."
    )
    weights_delay_s: float = option(
        0.0,
        "Extra seconds before each new policy version is applied (a slow weight transfer, "
        "for tests of the staleness control; 0 in real runs).",
    )

    def __post_init__(self) -> None:
        # Built in code (an `Actor(ActorConfig(...))` of a test or an embedding program),
        # the fields that need nothing but themselves are checked at once; `validate` (run
        # by `load_config` and `arpo.config.validate`) checks the rest too: the
        # environments, URLs, tokens, folders and the engine's model.
        check_on_build(self, self._check_values)

    def _check_values(self) -> None:
        """The checks of the numbers, durations and probabilities (their defaults pass)."""
        check_range(
            "sim_envs", self.sim_envs, 0, MAX_SIM_ENVS, "simulated desktops started in this process"
        )
        check_range("vm_count", self.vm_count, 0, MAX_ENVS, "0: every VM of the fleet")
        check_range(
            "sim_slow_factor", self.sim_slow_factor, 0, 1000, "latency multiplier", lo_open=True
        )
        for name in ("scripted_quit_prob", "scripted_garbage_prob", "scripted_error_prob"):
            check_range(name, getattr(self, name), 0, 1, "a probability")
        if self.spool_max_bytes < 1:
            fail("spool_max_bytes", "must be >= 1")
        check_seconds(
            "env_recheck_s",
            self.env_recheck_s,
            "between checks of an unhealthy environment",
            zero="0: it retires",
        )
        check_range(
            "max_unacked",
            self.max_unacked,
            1,
            MAX_ACK_IDS,
            "trajectories in flight; one acknowledgement holds at most this many ids",
        )
        check_seconds("weights_delay_s", self.weights_delay_s, zero="0 in real runs")
        check_seconds("shutdown_deadline_s", self.shutdown_deadline_s, zero="0: none")
        check_seconds("flush_deadline_s", self.flush_deadline_s, zero="0: none")
        if self.max_episodes < 0:
            fail("max_episodes", f"is {self.max_episodes}; must be >= 0 (0: run until stopped)")
        check_seconds("progress_s", self.progress_s, "between progress lines", zero="0: none")

    def validate(self) -> None:
        if self.actor_id:
            if len(self.actor_id.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
                fail(
                    "actor_id",
                    f"is {len(self.actor_id)} characters; give at most "
                    f"{MAX_ID_BYTES} bytes (it names every trajectory of this actor)",
                )
            if why := ident_problem(self.actor_id):
                fail("actor_id", f"{why} (it is written into ledgers, one id a line)")
        if not self.envs and self.sim_envs < 1 and not self.vm_fleet:
            fail(
                "envs",
                "give environment URLs, vm_fleet=<fleet.json>, or sim_envs=N to start "
                "simulated desktops",
            )
        if self.vm_fleet and (problem := fleet_problem(self.vm_fleet)):
            fail("vm_fleet", problem)
        if len(self.envs) > MAX_ENVS:
            fail("envs", f"lists {len(self.envs)} URLs; one actor drives at most {MAX_ENVS}")
        for u in self.envs:
            if problem := url_problem(u):
                fail("envs", problem)
        if self.env_tokens and len(self.env_tokens) != len(self.envs):
            fail(
                "env_tokens",
                f"{len(self.env_tokens)} tokens for {len(self.envs)} `envs` URLs: "
                "give one per URL, in the same order, or none",
            )
        for name, tokens in (("env_token", [self.env_token]), ("env_tokens", self.env_tokens)):
            for t in tokens:
                if problem := token_problem(t):
                    fail(name, problem)
        if self.sim_envs:
            from arpo_envs.sim.latency import LatencyConfig

            try:
                LatencyConfig.parse(self.sim_latency)
            except ValueError as e:
                fail("sim_latency", str(e))
        if self.sim_slow_env != -1:
            check_range(
                "sim_slow_env",
                self.sim_slow_env,
                0,
                max(0, self.sim_envs - 1),
                "index of a simulated desktop of this actor; -1: none",
            )
        for name in ("env_pool", "sim_pool", "vm_pool"):
            pool = getattr(self, name)
            if not pool or len(pool) > 1024:
                fail(name, "must be a pool name of 1..1024 characters (e.g. 'desktop', 'sim')")
        if self.policy == "engine" and self.engine.model in ("", "-"):
            fail("engine.model", "is required with policy='engine' (or use policy='scripted')")
        if not self.spool_dir:
            fail("spool_dir", "must name a folder (trajectories not yet acknowledged)")
        for name in ("spool_dir", "file_cache_dir", "weights_dir"):
            if problem := folder_problem(getattr(self, name)):
                fail(name, problem)
        self._check_values()


MAX_ENVS = 1024
"""Most environments one actor drives of each kind (`envs` URLs, fleet VMs): `arpo train`
allows as many simulated desktops per actor; spread more over several actors."""
MAX_SIM_ENVS = 1024
"""Most simulated desktops one actor starts in its own process (as `arpo train`'s
`sim_envs_per_actor`): each is a web server and a renderer sharing this process's cores."""
MAX_OSWORLD_WORKERS = 64
"""Most OSWorld evaluator workers of one actor: about 240 MiB each, so 64 take 15 GiB; more
than its environments never run at once."""

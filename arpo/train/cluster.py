"""`arpo train` on a Ray cluster: one actor with its environments on every node that holds
them, placed by Ray and supervised from the driver; nodes that join get one too.

    ray start --head --node-ip-address=10.0.0.1                                 # driver's host
    ray start --address=10.0.0.1:6379 --resources='{"arpo_sim": 8}'             # sim nodes
    ray start --address=10.0.0.1:6379 --resources='{"arpo_desktops": 4}'        # desktop nodes
    ray start --address=10.0.0.1:6379 --resources='{"arpo_vms": 4}'             # VM nodes
    arpo train cluster.address=auto local_desktops=4 vms=4                      # on the head

What it does (`Placement`):

- Nodes say what they hold with Ray resources: `arpo_sim: N` (`cluster.sim_resource`) runs
  up to min(N, `sim_envs_per_actor`) simulated desktops there, `arpo_desktops: N`
  (`cluster.desktop_resource`) up to min(N, `local_desktops`) real local desktops (Xvfb,
  openbox, LibreOffice...: the node needs `make sysdeps`), `arpo_vms: N`
  (`cluster.vm_resource`) up to min(N, `vms`) QEMU VMs of the test image (the node needs
  QEMU and builds or reuses the image). In a cluster run `local_desktops` and `vms` are
  numbers per node: the driver starts none of its own. Every alive node offering any gets
  one `NodeAgent` (`arpo.train.node`), a Ray actor pinned to that node
  (`NodeAffinitySchedulingStrategy`, not soft), which starts the node's desktops and VMs
  and one `arpo-actor` driving them all as subprocesses in a folder of that node (no
  shared disk: the spool, the task-file cache and the keys live there), starts them again
  when the actor exits (`max_restarts`), and stops them with SIGTERM.
- The run waits (at most `start_timeout_s`) until a node offers each kind the run asks for
  (simulated desktops when `sim_envs_per_actor` > 0, local desktops when `local_desktops`
  > 0, VMs when `vms` > 0), and says which resource no node offers when none does.
- The preflight (the tasks set up once before training) runs on the driver's own
  simulated desktops; the tasks of the local desktops and VMs (pool 'desktop') are not
  preflighted in a cluster run (their environments are on the nodes), so a broken one
  leaves the run during training instead (`learner.tasks_out`).
- The learner runs on the driver, or with `cluster.learner_resource` on a node offering
  that resource (a `LearnerAgent` there starts `arpo-learner` against `<run_dir>/
  learner.toml`, bound to that node's address; `run_dir` must be on storage that node
  reaches at the same path, which a marker file checks). Its data and control links bind to
  that machine's cluster address (Ray's node IP, or `cluster.bind_host` on the driver) with
  CURVE keys the run makes in `<run_dir>/keys` (one learner pair, one actor pair every
  actor of the run shares); the agents receive the actor's secret key and the learner's
  public key as arguments (over Ray's own channel) and write them, readable by the user
  only, into their node's folder.
- The driver polls every agent every `cluster.poll_s`: the new bytes of its actor's log
  go to `<run_dir>/logs/<actor id>.log`, the new lines of its spool ledger and the ids
  still pending to `<run_dir>/spool/<actor id>/` (the run's accounting reads them there).
  It also lists the cluster's nodes: a node that joined gets an agent and an actor (the
  agent's start is answered by a later poll: the driver never waits for one node).
- A node lost (its agent's call fails, or stays unanswered `cluster.node_lost_s`): the
  driver marks its spool copy lost (`LOST_MARK`). The learner, on its own, issues that
  actor's grants again `learner.grants.silent_actor_s` after its last heartbeat. What the
  node had delivered and had acknowledged is in the store; what it held unacknowledged is
  counted as `lost_with_node` by the accounting, never trained. A node Ray still lists as
  alive `node_lost_s` after its agent was lost gets a new agent (a new actor id).
- The learner's node lost: with `learner_resource`, the driver starts the learner again
  from its last checkpoint and journal on another node offering it (or the same one, come
  back) and re-points every node's actor to its new address (each starts again; its spool
  resends what was not acknowledged), or stops with exit code 3 naming the resource when
  none can take it within `start_timeout_s`. Without it the learner's node is the driver's,
  lost with the run: `arpo train ... resume=true` on a machine that reaches `run_dir`
  continues it (`arpo.train.supervise`).
- The model: a folder of at most `cluster.ship_model_mb` is sent to every node through
  Ray's object store (put once) and unpacked in its folder; a larger one (or a hub name)
  is used by its name, so it must be on storage every node reaches.

- GPUs: with `cluster.gpus_per_actor` > 0 only nodes with that many GPUs get an actor,
  and Ray reserves them for its agent (CUDA_VISIBLE_DEVICES), which its actor and policy
  engine inherit (`actor.engine.device=cuda`).

- Shared engines (`cluster.engines=shared`): one `arpo-engine` server
  (`arpo.policy.engine_server`, started by an `EngineAgent`) on every node offering
  `cluster.engine_resource` (with `cluster.gpus_per_engine` GPUs), started before the
  actors, bound to its node's cluster address with a bearer token the run makes. It follows
  the learner's weights over the control link with the actors' CURVE keys, so each version
  crosses the network once per server. Every node's actor samples from one of them
  (`engine.kind=shared`, dealt in turn). A server lost (its agent failed, silent for
  `node_lost_s`, or exited) is placed again where a node offers the resource, and every
  actor starts again on a live one; with none within `start_timeout_s` the run stops and
  names the resource. A node that joins offering the resource gets a server, which actors
  placed from then on use.

- A learner over nodes (`cluster.learner_nodes` > 1, with `learner_resource`): one
  torchrun group (`learner_procs` ranks on each node) with a static rendezvous on rank 0's
  node, which binds the links; gloo speaks over the interface holding each node's cluster
  address. One node of it lost or exited: the whole group starts again from the last
  checkpoint, as a lost learner node does.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arpo.config import check_range, check_seconds, fail, option
from arpo.errors import ArpoError

log = logging.getLogger("arpo.train.cluster")

LOST_MARK = "node_lost.json"
"""In `<run_dir>/spool/<actor id>/`: the actor's node was lost; what its last copy of the
spool lists as pending was lost with the node (`arpo.train.report.account`)."""
PENDING = "pending.json"
"""In `<run_dir>/spool/<actor id>/` of a node's actor: the ids its spool held unacknowledged
and set aside as refused, at the last poll (the node's spool files stay on the node)."""


@dataclass
class ClusterConfig:
    """Where `arpo train` places its actors: this machine ('' address) or a Ray cluster."""

    address: str = option(
        "",
        "Ray cluster to place the actors on: 'auto' (the cluster this machine joined with "
        "`ray start`), host:6379 (its head) or ray://host:10001 (Ray Client); '' runs every "
        "process on this machine (no Ray).",
    )
    sim_resource: str = option(
        "arpo_sim",
        "Ray resource that marks a node for simulated desktops: a node started with "
        "--resources='{\"arpo_sim\": N}' runs one actor with min(N, sim_envs_per_actor) "
        "simulated desktops.",
    )
    desktop_resource: str = option(
        "arpo_desktops",
        "Ray resource that marks a node for real local desktops: a node started with "
        "--resources='{\"arpo_desktops\": N}' runs min(N, local_desktops) of them (`arpo-envs "
        "up` there) and one actor driving them.",
    )
    vm_resource: str = option(
        "arpo_vms",
        "Ray resource that marks a node for QEMU VMs: a node started with "
        "--resources='{\"arpo_vms\": N}' runs min(N, vms) VMs of the test image (`arpo-envs "
        "vm up` there) and one actor driving them.",
    )
    learner_resource: str = option(
        "",
        "Ray resource of the nodes that may run the learner (e.g. 'arpo_learner' on GPU "
        "nodes): the run starts it on one of them and, when that node is lost, again from "
        "its last checkpoint on another (or the same, come back), re-pointing every actor; "
        "exit code 3 when none is there within start_timeout_s. run_dir must be on storage "
        "those nodes reach at the same path. '' = the learner runs on the driver.",
    )
    learner_nodes: int = option(
        1,
        "With learner_resource: nodes offering it that together run the learner as one "
        "torchrun group (learner_procs ranks on each; rank 0's node binds the links, the "
        "group talks over the nodes' cluster addresses). One of them lost: the whole group "
        "starts again from the last checkpoint on nodes offering the resource.",
    )
    bind_host: str = option(
        "",
        "Address the learner's links bind to on the driver ('' = the driver's Ray node IP); "
        "never 0.0.0.0: the actors connect to it.",
    )
    poll_s: float = option(
        2.0, "Interval of the driver's polls: agents (logs, spool ledgers) and the node list."
    )
    node_lost_s: float = option(
        60.0,
        "A node whose agent has not answered a poll this long is taken as lost (Ray usually "
        "says so sooner: the call fails when its node dies).",
    )
    start_timeout_s: float = option(
        300.0,
        "Longest wait for the first node with sim_resource, and for an agent to start its "
        "actor; the run stops and says so after it.",
    )
    ship_model_mb: int = option(
        2048,
        "A model folder of at most this many MiB is sent to every node through Ray's "
        "object store and unpacked there (the nodes need no copy); a larger one is loaded "
        "by its path on every node, so it must be on storage they all reach (or a hub "
        "name). 0: never sent.",
    )
    max_restarts: int = option(5, "Restarts of one node's actor process at most.")
    engines: str = option(
        "actor",
        "Where the policy engines run: 'actor' (each node's actor runs its own, "
        "actor.engine) or 'shared' (one `arpo-engine` server on every node offering "
        "engine_resource, following the learner's weights itself; every node's actor samples "
        "from one of them, dealt in turn).",
    )
    engine_resource: str = option(
        "arpo_engines",
        "Ray resource that marks a node for a shared engine server (engines='shared'): a "
        "node started with --resources='{\"arpo_engines\": 1}' runs one.",
    )
    gpus_per_engine: float = option(
        0.0,
        "GPUs Ray reserves for each shared engine server (engines='shared'; its engine then "
        "runs on them with actor.engine.device=cuda). 0: none.",
    )
    gpus_per_actor: float = option(
        0.0,
        "GPUs Ray reserves for each node's actor (its policy engine: actor.engine.device="
        "cuda): only nodes with that many GPUs (`ray start --num-gpus`) get an actor, and Ray "
        "gives it those devices (CUDA_VISIBLE_DEVICES). 0: none (engines on CPU).",
    )

    def validate(self) -> None:
        a = self.address
        if a and a != "auto" and not (a.startswith("ray://") or ":" in a):
            fail("address", f"{a!r}: give 'auto', host:port of the head, or ray://host:port")
        if self.engines not in ("actor", "shared"):
            fail("engines", f"{self.engines!r}: 'actor' or 'shared'")
        if self.engines == "shared" and not self.address:
            fail("engines", "'shared' places engine servers on Ray nodes: give cluster.address")
        for name in ("sim_resource", "desktop_resource", "vm_resource", "engine_resource"):
            value = getattr(self, name)
            if not value or not value.replace("_", "").isalnum():
                fail(name, f"{value!r}: a Ray resource name (letters, digits, _)")
        if self.learner_resource and not self.learner_resource.replace("_", "").isalnum():
            fail("learner_resource", f"{self.learner_resource!r}: a Ray resource name or ''")
        check_range("learner_nodes", self.learner_nodes, 1, 1024, "nodes of the learner")
        if self.learner_nodes > 1 and not self.learner_resource:
            fail("learner_nodes", "spreads the learner over nodes offering learner_resource: "
                 "give cluster.learner_resource")  # fmt: skip
        if self.learner_resource and not self.address:
            fail("learner_resource", "places the learner on a Ray node: give cluster.address")
        names = [self.sim_resource, self.desktop_resource, self.vm_resource, self.engine_resource]
        if len(set(names)) < 4:
            fail("engine_resource", f"sim, desktop, VM and engine resources need four names, "
                 f"got {names}")  # fmt: skip
        if self.bind_host in ("0.0.0.0", "::", "*"):
            fail("bind_host", "must be the driver's address on the cluster network, not any")
        check_seconds("poll_s", self.poll_s, "between polls of the agents")
        check_seconds("node_lost_s", self.node_lost_s, "unanswered polls before a node is lost")
        check_seconds("start_timeout_s", self.start_timeout_s, "for the first node and actor")
        check_range("ship_model_mb", self.ship_model_mb, 0, 1 << 20, "MiB; 0: never ship")
        check_range("max_restarts", self.max_restarts, 0, 1000, "restarts per node's actor")
        check_range("gpus_per_actor", self.gpus_per_actor, 0, 64, "GPUs per node's actor")
        check_range("gpus_per_engine", self.gpus_per_engine, 0, 64, "GPUs per engine server")


# ---------------------------------------------------------------------------- on the driver


@dataclass
class _Node:
    """One agent the driver placed, and what it knows of it."""

    node_id: str
    ip: str
    actor_id: str
    envs: int
    """Simulated desktops of its actor."""
    handle: Any
    desktops: int = 0
    """Local desktops of its actor (started on its node)."""
    vms: int = 0
    """VMs of its actor (started on its node)."""
    gpus: str = ""
    """The devices Ray gave its agent (CUDA_VISIBLE_DEVICES, '' for none), from its polls."""
    pending_call: Any = None
    last_answer: float = field(default_factory=time.monotonic)
    restarts: int = 0
    lost: str = ""
    """Why the node was taken as lost ('' while it runs)."""
    lost_at: float = 0.0
    starting: bool = False
    """Its agent is being created and starting the actor (`pending_call` is that start)."""
    stopped: bool = False


@dataclass
class _Engine:
    """One shared engine server the driver placed (cluster.engines='shared')."""

    engine_id: str
    node_id: str
    ip: str
    url: str
    handle: Any
    pending_call: Any = None
    last_answer: float = field(default_factory=time.monotonic)
    lost: str = ""
    lost_at: float = 0.0


def keep_poll(run_dir: Path, actor_id: str, answer: dict[str, Any]) -> None:
    """What a `NodeAgent.poll` brought back, into the run folder: the log's new bytes
    appended to `<run_dir>/logs/<actor_id>.log`, the ledger's new lines to the copy of the
    spool, `<run_dir>/spool/<actor_id>/`, and the ids pending and refused in `PENDING`."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if answer["log"]:
        with (logs / f"{actor_id}.log").open("ab") as f:
            f.write(answer["log"])
    spool = run_dir / "spool" / actor_id
    spool.mkdir(parents=True, exist_ok=True)
    if answer["ledger"]:
        from arpo.actor.spool import LEDGER

        with (spool / LEDGER).open("ab") as f:
            f.write(answer["ledger"])
    tmp = spool / (PENDING + ".tmp")
    tmp.write_text(json.dumps({"pending": answer["pending"], "refused": answer["refused"]}))
    tmp.replace(spool / PENDING)


def mark_lost(run_dir: Path, actor_id: str, record: dict[str, Any]) -> None:
    """Mark the copy of `actor_id`'s spool as that of a lost node (`LOST_MARK`, holding
    `record`: which node, why, when)."""
    spool = run_dir / "spool" / actor_id
    spool.mkdir(parents=True, exist_ok=True)
    (spool / LOST_MARK).write_text(json.dumps(record, indent=1))


def model_tar(folder: Path, limit_mb: int) -> bytes | None:
    """The model folder as an uncompressed tar (for nodes that do not see it), or None when
    it is not a folder or larger than `limit_mb` MiB."""
    if not folder.is_dir():
        return None
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    if size > limit_mb << 20:
        return None
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in sorted(folder.iterdir()):
            if p.name != "demos":
                tar.add(p, arcname=p.name)
    return buf.getvalue()


class Placement:
    """The driver's side: Ray connection, one `NodeAgent` per node offering the run's resources,
    their polls, node losses and joins (module docstring)."""

    def __init__(
        self,
        config: ClusterConfig,
        run_dir: Path,
        sim_envs: int,
        desktops: int = 0,
        atspi: bool = False,
        vms: int = 0,
    ) -> None:
        try:
            import ray
        except ImportError as e:
            raise ArpoError(
                f"cluster.address is set but Ray is not installed ({e}): install the "
                "`cluster` extra (pip install 'arpo[cluster]'; make setup does), or leave "
                "cluster.address empty to run on this machine"
            ) from e

        self.config = config
        self.run_dir = run_dir
        self.sim_envs = sim_envs
        """Most simulated desktops of one node's actor (0: the run has none)."""
        self.desktops = desktops
        """Most local desktops of one node (0: the run has none)."""
        self.atspi = atspi
        """The local desktops serve their apps' accessibility trees."""
        self.vms = vms
        """Most VMs of one node (0: the run has none)."""
        self.nodes: dict[str, _Node] = {}
        """Ray node id -> its agent (a lost one stays, marked, until the node gets another)."""
        self.replaced: list[_Node] = []
        """Lost agents of nodes that Ray still lists as alive, each replaced by a new one."""
        self.placed = 0
        self.lost: list[dict[str, Any]] = []
        """Every node taken as lost: node, actor, why, when (seconds into the run)."""
        self.joined: list[dict[str, Any]] = []
        """Every node given an agent: node, ip, actor, envs, when."""
        self.t0 = time.monotonic()
        self._last_list = 0.0
        self.learner_agents: list[Any] = []
        """Every node's agent of the learner (`learner_nodes` of them; rank 0's first)."""
        self._learner_polls: list[Any] | None = None
        """The polls of the learner's agents in flight (`learner_code`)."""
        self._learner_heard = time.monotonic()
        """When they last all answered (or the learner started)."""
        self.learner_node = ""
        self.learners: list[dict[str, Any]] = []
        """Every start of the learner on a node: where, when, its endpoints."""
        self.engines: list[_Engine] = []
        """With engines='shared': every engine server placed (a lost one stays, marked)."""
        self.engine_token = os.urandom(24).hex()
        """The bearer token of this run's engine servers (their actors send it)."""
        self.engine_toml = ""
        try:
            ray.init(
                address=config.address, logging_level=logging.WARNING, log_to_driver=False,
                include_dashboard=False if not config.address.startswith("ray://") else None,
            )  # fmt: skip
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ArpoError(
                f"cannot join the Ray cluster at {config.address!r} (cluster.address): {e}; "
                "start one with `ray start --head` (docs/guides/scaling.md)"
            ) from e
        self.ray = ray
        self.run_id = f"{os.getpid()}-{os.urandom(3).hex()}"
        from arpo.train.node import NodeAgent

        self._agent_cls = ray.remote(num_cpus=0, max_restarts=0)(NodeAgent)

    def bind_host(self) -> str:
        """The driver's address on the cluster network (where the learner binds)."""
        if self.config.bind_host:
            return self.config.bind_host
        return str(self.ray.util.get_node_ip_address())

    def make_keys(self) -> tuple[dict[str, str], dict[str, bytes]]:
        """CURVE keys in `<run_dir>/keys`: (the learner's transport fields, the files every
        node's actor gets: the actor's secret and the learner's public certificate)."""
        from arpo.transport import create_keys

        keys = self.run_dir / "keys"
        shutil.rmtree(keys, ignore_errors=True)
        keys.mkdir(parents=True, mode=0o700)
        _, learner_secret = create_keys(keys, "learner")
        actor_public, actor_secret = create_keys(keys, "actor")
        (keys / "authorized").mkdir(mode=0o700)
        shutil.copy(actor_public, keys / "authorized" / actor_public.name)
        learner = {
            "curve_secret_key": str(learner_secret),
            "curve_authorized": str(keys / "authorized"),
        }
        files = {
            "actor.key_secret": actor_secret.read_bytes(),
            "learner.key": (keys / "learner.key").read_bytes(),
        }
        return learner, files

    def start(
        self,
        make_toml: Callable[[str, int], str],
        keys: dict[str, bytes],
        model: str,
        engine_toml: str = "",
    ) -> None:
        """Place an agent on every node offering the run's resources and wait until, for
        each kind of environment the run asks for, one node's actor has started (the
        others' starts are answered by later `tick`s); ArpoError naming the resource no
        node offers within `start_timeout_s`. `make_toml(actor_id, sim_envs)`: the actor's
        config, its node folder written @NODE@ and its model @MODEL@. With engines='shared'
        the engine servers (`engine_toml`, an `EngineServerConfig`) start first."""
        self.make_toml, self.keys, self.model = make_toml, keys, model
        tar = model_tar(Path(model), self.config.ship_model_mb)
        self.model_ref = self.ray.put(tar) if tar is not None else None
        if self.config.engines == "shared":
            self.engine_toml = engine_toml
            self._place_engines(wait=True)
        end = time.monotonic() + self.config.start_timeout_s
        while time.monotonic() < end and self.missing():
            self.tick(list_every=min(self.config.poll_s, 2.0))
            time.sleep(0.2)
        if missing := self.missing():
            raise ArpoError(
                f"no node of the Ray cluster offers {' or '.join(map(repr, missing))} with its "
                f"actor started after {self.config.start_timeout_s:.0f} s (cluster."
                f"start_timeout_s): start such nodes with `ray start --address=... "
                f"--resources='{{\"{missing[0]}\": 4}}'`; the actors' logs are in "
                f"{self.run_dir / 'logs'}"
            )

    def missing(self) -> list[str]:
        """The resources of the kinds the run asks for that no started node offers yet."""
        have = {k for j in self.joined for k, n in j["kinds"].items() if n}
        want = {self.config.sim_resource: self.sim_envs,
                self.config.desktop_resource: self.desktops,
                self.config.vm_resource: self.vms}  # fmt: skip
        return [r for r, n in want.items() if n and r not in have]

    def _place_new(self) -> int:
        """An agent on every alive node with `sim_resource` that has none; how many placed."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._last_list = time.monotonic()
        placed = 0
        for n in self.ray.nodes():
            offers = n.get("Resources") or {}
            sims = min(int(offers.get(self.config.sim_resource, 0)), self.sim_envs)
            desktops = min(int(offers.get(self.config.desktop_resource, 0)), self.desktops)
            vms = min(int(offers.get(self.config.vm_resource, 0)), self.vms)
            old = self.nodes.get(n["NodeID"])
            gpus = self.config.gpus_per_actor
            if not n.get("Alive") or sims + desktops + vms < 1 or offers.get("GPU", 0) < gpus:
                continue
            if old is not None:
                # A node Ray still lists as alive node_lost_s after its agent was lost (a
                # call failed, not the node) gets a new agent and a new actor id.
                if not old.lost or time.monotonic() - old.lost_at < self.config.node_lost_s:
                    continue
                self.replaced.append(self.nodes.pop(n["NodeID"]))
            self.placed += 1
            actor_id = f"node{self.placed}"
            handle = self._agent_cls.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
                name=f"arpo-{self.run_id}-{actor_id}",
                num_gpus=gpus,  # Ray sets the agent's CUDA_VISIBLE_DEVICES; its actor inherits
            ).remote(
                actor_id, self.make_toml(actor_id, sims), self.keys, self.model,
                self.model_ref, self.run_id, desktops=desktops, vms=vms, atspi=self.atspi,
                start_timeout_s=self.config.start_timeout_s,
            )  # fmt: skip
            node = _Node(n["NodeID"], n.get("NodeManagerAddress", "?"), actor_id, sims, handle,
                         desktops=desktops, vms=vms)  # fmt: skip
            node.pending_call, node.starting = handle.start.remote(), True  # `tick` answers
            self.nodes[n["NodeID"]] = node
            placed += 1
        return placed

    # ---- shared engine servers (engines='shared') ---------------------------------------

    def _place_engines(self, wait: bool) -> int:
        """An `EngineAgent` on every alive node offering `engine_resource` that runs no live
        one, each started before the next (a server loads its model); how many started.
        With `wait`, until at least one serves: ArpoError naming the resource after
        `start_timeout_s`."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from arpo.train.node import EngineAgent

        cls = self.ray.remote(num_cpus=0, max_restarts=0)(EngineAgent)
        end = time.monotonic() + self.config.start_timeout_s
        started, tried = 0, []
        while True:
            now = time.monotonic()
            # A node whose server was lost less than node_lost_s ago may still be listed
            # alive while it is gone: it gets no new server until then.
            have = {e.node_id for e in self.engines if not e.lost or (
                e.lost != "stopped" and now - e.lost_at < self.config.node_lost_s)}  # fmt: skip
            for n in self.ray.nodes():
                offers = n.get("Resources") or {}
                if (not n.get("Alive") or n["NodeID"] in have
                        or offers.get(self.config.engine_resource, 0) < 1
                        or offers.get("GPU", 0) < self.config.gpus_per_engine):  # fmt: skip
                    continue
                ip = n.get("NodeManagerAddress", "?")
                engine_id = f"engine{len(self.engines) + 1}"
                agent = cls.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
                    name=f"arpo-{self.run_id}-{engine_id}",
                    num_gpus=self.config.gpus_per_engine,
                ).remote(engine_id, self.engine_toml, self.keys, self.model, self.model_ref,
                         self.run_id, self.engine_token, self.config.start_timeout_s)  # fmt: skip
                try:
                    out = self.ray.get(
                        agent.start.remote(ip), timeout=self.config.start_timeout_s + 60
                    )
                except Exception as e:
                    tried.append(f"{ip}: {type(e).__name__}: {str(e).splitlines()[-1][:300]}")
                    with contextlib.suppress(Exception):
                        self.ray.kill(agent, no_restart=True)
                    continue
                self.engines.append(_Engine(engine_id, n["NodeID"], ip, out["url"], agent))
                self.joined.append({"node": n["NodeID"], "ip": ip, "engine": engine_id,
                                    "url": out["url"], "kinds": {},
                                    "at_s": round(time.monotonic() - self.t0, 1)})  # fmt: skip
                log.info("node %s (%s): shared engine server %s at %s, pid %d", ip,
                         n["NodeID"][:12], engine_id, out["url"], out["pid"])  # fmt: skip
                started += 1
            if not wait or any(not e.lost for e in self.engines):
                return started
            if time.monotonic() > end:
                raise ArpoError(
                    f"no node of the Ray cluster offering {self.config.engine_resource!r} "
                    f"(cluster.engine_resource) runs a shared engine server after "
                    f"{self.config.start_timeout_s:.0f} s (cluster.start_timeout_s)"
                    + (f"; tried: {'; '.join(tried[-3:])}" if tried else "")
                    + "; start one with `ray start --address=... --resources='{\""
                    + self.config.engine_resource
                    + "\": 1}'`, or set cluster.engines=actor"
                )
            time.sleep(1.0)

    def engine_url(self, actor_id: str) -> str:
        """The engine server `actor_id`'s actor samples from: the live ones dealt in turn by
        the actor's number ('' before any serves)."""
        live = [e for e in self.engines if not e.lost]
        if not live:
            return ""
        digits = "".join(ch for ch in actor_id if ch.isdigit())
        return live[int(digits or 0) % len(live)].url

    def _tick_engines(self, now: float) -> None:
        """Collect the engine servers' polls (their logs to `<run_dir>/logs/`); a server
        whose agent failed, went silent `node_lost_s` or exited is lost: the servers are
        placed again where nodes offer them (ArpoError naming the resource when none serves
        within `start_timeout_s`) and every node's actor starts again on a live one."""
        lost = False
        for e in self.engines:
            if e.lost:
                continue
            if e.pending_call is None:
                e.pending_call = e.handle.poll.remote()
                continue
            ready, _ = self.ray.wait([e.pending_call], timeout=0)
            why = ""
            if not ready:
                if now - e.last_answer > self.config.node_lost_s:
                    why = f"no answer for {now - e.last_answer:.0f} s (cluster.node_lost_s)"
            else:
                try:
                    answer = self.ray.get(e.pending_call)
                except Exception as exc:
                    why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                else:
                    e.pending_call, e.last_answer = None, now
                    self._keep_engine_log(e, answer)
                    if not answer["alive"]:
                        why = f"it exited with code {answer['code']}"
            if why:
                e.lost, e.lost_at, lost = why, now, True
                self.lost.append({"node": e.node_id, "ip": e.ip, "engine": e.engine_id,
                                  "why": why[:500],
                                  "at_s": round(now - self.t0, 1)})  # fmt: skip
                log.warning("engine server %s on node %s is lost: %s", e.engine_id, e.ip, why)
                with contextlib.suppress(Exception):
                    self.ray.kill(e.handle, no_restart=True)
        if lost:
            self._place_engines(wait=True)
            self.repoint(self.make_toml, why="a live engine server")

    def _keep_engine_log(self, e: _Engine, answer: dict[str, Any]) -> None:
        if answer.get("log"):
            logs = self.run_dir / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            with (logs / f"{e.engine_id}.log").open("ab") as f:
                f.write(answer["log"])

    def _stop_engines(self, timeout: float) -> None:
        for e in self.engines:
            if e.lost:
                continue
            try:
                self._keep_engine_log(e, self.ray.get(e.handle.stop.remote(timeout),
                                                      timeout=timeout + 60))  # fmt: skip
                self.ray.get(e.handle.remove.remote(), timeout=60)
            except Exception as exc:
                log.warning("stopping engine server %s failed: %s", e.engine_id, exc)
            with contextlib.suppress(Exception):
                self.ray.kill(e.handle, no_restart=True)
            e.lost = "stopped"

    def _started(self, node: _Node, pid: int) -> None:
        node.starting = False
        when = round(time.monotonic() - self.t0, 1)
        kinds = {self.config.sim_resource: node.envs, self.config.desktop_resource: node.desktops,
                 self.config.vm_resource: node.vms}  # fmt: skip
        self.joined.append({"node": node.node_id, "ip": node.ip, "actor": node.actor_id,
                            "envs": node.envs, "desktops": node.desktops, "vms": node.vms,
                            "kinds": kinds,
                            "at_s": when})  # fmt: skip
        log.info("node %s (%s): actor %s with %d simulated and %d local desktops and %d VMs, "
                 "pid %d, log %s", node.ip, node.node_id[:12], node.actor_id, node.envs,
                 node.desktops, node.vms, pid, self.run_dir / "logs" / f"{node.actor_id}.log")  # fmt: skip

    def _lose(self, node: _Node, why: str) -> None:
        node.lost, node.lost_at = why, time.monotonic()
        when = round(time.monotonic() - self.t0, 1)
        self.lost.append({"node": node.node_id, "ip": node.ip, "actor": node.actor_id,
                          "why": why[:500], "at_s": when})  # fmt: skip
        mark_lost(self.run_dir, node.actor_id, self.lost[-1])
        log.warning("node %s (actor %s) is lost: %s; its grants go to the other actors",
                    node.ip, node.actor_id, why)  # fmt: skip
        with contextlib.suppress(Exception):
            self.ray.kill(node.handle, no_restart=True)

    def _keep(self, node: _Node, answer: dict[str, Any]) -> None:
        node.gpus = str(answer.get("gpus", ""))
        keep_poll(self.run_dir, node.actor_id, answer)

    def tick(self, list_every: float | None = None) -> None:
        """One round (every `poll_s`): collect the answers of the agents (their actors
        started, their polls), start exited actors again, take unanswering nodes as lost,
        and every `list_every` (`poll_s`) seconds place agents on nodes that joined. Never
        waits for an agent."""
        now = time.monotonic()
        for node in list(self.nodes.values()):
            if node.lost or node.stopped:
                continue
            if node.pending_call is None:
                node.pending_call = node.handle.poll.remote()
                continue
            ready, _ = self.ray.wait([node.pending_call], timeout=0)
            if not ready:
                limit = self.config.start_timeout_s if node.starting else self.config.node_lost_s
                if now - node.last_answer > limit:
                    self._lose(node, f"no answer for {now - node.last_answer:.0f} s (cluster."
                               f"{'start_timeout_s' if node.starting else 'node_lost_s'})")  # fmt: skip
                continue
            try:
                answer = self.ray.get(node.pending_call)
            except Exception as e:  # the agent or its node died
                what = "its agent did not start the actor: " if node.starting else ""
                self._lose(node, f"{what}{type(e).__name__}: {str(e).splitlines()[0][:300]}")
                continue
            node.pending_call, node.last_answer = None, now
            if node.starting:
                self._started(node, int(answer))
                continue
            if isinstance(answer, int):  # the pid of an actor started again
                log.info("actor %s (node %s): pid %d", node.actor_id, node.ip, answer)
                continue
            self._keep(node, answer)
            if not answer["alive"]:
                if node.restarts >= self.config.max_restarts:
                    raise ArpoError(
                        f"the actor of node {node.ip} ({node.actor_id}) exited with code "
                        f"{answer['code']} {node.restarts + 1} times; see "
                        f"{self.run_dir / 'logs' / node.actor_id}.log"
                    )
                node.restarts += 1
                log.warning("actor %s (node %s) exited with code %s: starting it again "
                            "(%d of %d)", node.actor_id, node.ip, answer["code"],
                            node.restarts, self.config.max_restarts)  # fmt: skip
                node.pending_call = node.handle.start.remote()  # answered by a later tick
        if self.engines:
            self._tick_engines(now)
        if now - self._last_list >= (self.config.poll_s if list_every is None else list_every):
            self._place_new()
            if self.config.engines == "shared":  # a node offering engines joined
                self._place_engines(wait=False)

    # ---- the learner on a node (cluster.learner_resource) -------------------------------

    def start_learner(self, resume: bool, procs: int = 1) -> dict[str, Any]:
        """Start the learner on `learner_nodes` alive nodes offering `learner_resource`
        (waiting up to `start_timeout_s` for them): one process, or a torchrun group of
        `procs` ranks per node whose rank 0 binds the links; its endpoints {"data",
        "control", "pid", "host", "ip", "nodes"}. RunStalled naming the resource when not
        enough nodes come, or when none could start it."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from arpo.errors import RunStalled
        from arpo.train.node import MARKER_FILE, LearnerAgent

        self._kill_learner()
        marker = (self.run_dir / MARKER_FILE).read_text()
        cls = self.ray.remote(num_cpus=0, max_restarts=0)(LearnerAgent)
        res, want = self.config.learner_resource, self.config.learner_nodes
        end = time.monotonic() + self.config.start_timeout_s
        tried: list[str] = []
        failed: set[str] = set()
        """Nodes where a start failed (one lost may still be listed alive): tried last."""
        while time.monotonic() < end:
            offering = [n for n in self.ray.nodes()
                        if n.get("Alive") and (n.get("Resources") or {}).get(res, 0) >= 1]  # fmt: skip
            if len(offering) < want:
                time.sleep(1.0)
                continue
            chosen = sorted(offering, key=lambda n: n["NodeID"] in failed)[:want]
            ips = [n.get("NodeManagerAddress", "?") for n in chosen]
            agents = [
                cls.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
                ).remote(str(self.run_dir), marker)
                for n in chosen
            ]
            try:
                ports = self.ray.get(agents[0].ports.remote(ips[0]), timeout=120)
                calls = [a.start.remote(ip, resume, procs=procs, nnodes=want, node_rank=i,
                                        ports=ports)
                         for i, (a, ip) in enumerate(zip(agents, ips, strict=True))]  # fmt: skip
                outs = self.ray.get(calls, timeout=120)
            except Exception as e:  # a node died, or it cannot reach run_dir
                tried.append(f"{', '.join(ips)}: {type(e).__name__}: "
                             f"{str(e).splitlines()[-1][:300]}")  # fmt: skip
                failed.update(n["NodeID"] for n in chosen)
                for a in agents:
                    with contextlib.suppress(Exception):
                        self.ray.kill(a, no_restart=True)
                time.sleep(1.0)
                continue
            self.learner_agents, self._learner_heard = agents, time.monotonic()
            self.learner_node = chosen[0]["NodeID"]
            out = {**outs[0], "ip": ips[0], "nodes": ips}
            self.learners.append({**out, "at_s": round(time.monotonic() - self.t0, 1),
                                  "resumed": resume})  # fmt: skip
            log.info("the learner runs on node %s (%s), pid %d, bound to %s%s", ips[0],
                     out["host"], out["pid"], out["data"],
                     f"; its torchrun group spans {', '.join(ips)}" if want > 1 else "")  # fmt: skip
            return out
        have = len([n for n in self.ray.nodes() if n.get("Alive")
                    and (n.get("Resources") or {}).get(res, 0) >= 1])  # fmt: skip
        raise RunStalled(
            f"{have} node(s) of the Ray cluster offer {res!r} (cluster.learner_resource); "
            f"the learner needs {want} (cluster.learner_nodes) and did not start within "
            f"{self.config.start_timeout_s:.0f} s (cluster.start_timeout_s)"
            + (f"; tried: {'; '.join(tried[-5:])}" if tried else "")
            + "; start one with `ray start --address=... --resources="
            f"'{{\"{res}\": 1}}'` and run again with resume=true"
        )

    def _kill_learner(self) -> None:
        for agent in self.learner_agents:
            with contextlib.suppress(Exception):
                self.ray.kill(agent, no_restart=True)
        self.learner_agents = []
        self._learner_polls, self._learner_heard = None, time.monotonic()

    def learner_code(self) -> tuple[bool, int | None, str]:
        """(alive, exit code, why not alive) of the learner on its node(s); a node of it
        lost (its agent gone, or silent for `node_lost_s`) is (False, None, why); a rank's
        node whose processes exited while rank 0 runs is (False, its code, why)."""
        if not self.learner_agents:
            return False, None, "not started"
        # Never waits: the polls in flight are collected when all have answered; until then
        # the learner counts as running, unless they are older than node_lost_s.
        now = time.monotonic()
        if self._learner_polls is None:
            self._learner_polls = [a.poll.remote() for a in self.learner_agents]
        polls = self._learner_polls
        ready, _ = self.ray.wait(polls, num_returns=len(polls), timeout=0)
        try:
            if len(ready) < len(polls):
                if now - self._learner_heard <= self.config.node_lost_s:
                    return True, None, ""
                raise TimeoutError(f"no answer for {now - self._learner_heard:.0f} s "
                                   "(cluster.node_lost_s)")  # fmt: skip
            codes = self.ray.get(polls)
            self._learner_polls, self._learner_heard = None, now
        except Exception as e:
            why = f"its node was lost ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
            self.lost.append({"node": self.learner_node, "actor": "learner", "why": why,
                              "at_s": round(time.monotonic() - self.t0, 1)})  # fmt: skip
            self._kill_learner()
            return False, None, why
        if codes[0] is not None:
            return False, codes[0], f"it exited with code {codes[0]}"
        for rank, code in enumerate(codes[1:], 1):
            if code is not None:
                return False, code, f"its node {rank} of the torchrun group exited with {code}"
        return True, None, ""

    def stop_learner(self, timeout: float, now: bool = False) -> int | None:
        """SIGTERM to the learner on every node of it (it checkpoints and exits), rank 0's
        exit code; with `now`, the agents killed at once (the learner dies with them)."""
        agents = self.learner_agents
        if not agents:
            return None
        try:
            if now:
                return None
            codes = self.ray.get([a.stop.remote(timeout) for a in agents], timeout=timeout + 60)
            return codes[0]
        except Exception as e:
            log.error("stopping the learner on its node failed: %s", e)
            return None
        finally:
            self._kill_learner()

    def repoint(
        self,
        make_toml: Callable[[str, int], str],
        engine_toml: str = "",
        why: str = "the learner's new address",
    ) -> None:
        """The learner (or an engine server) moved: every node's actor gets `make_toml`'s
        config (the new endpoints) and starts again (its spool resends what was not
        acknowledged); nodes placed later get it too. Answers in flight are kept first.
        With `engine_toml` (the learner moved) the engine servers start again on it."""
        self.make_toml = make_toml
        if engine_toml and self.config.engines == "shared":
            self.engine_toml = engine_toml
            self._stop_engines(30.0)
            self._place_engines(wait=True)
        for node in self.nodes.values():
            if node.lost or node.stopped:
                continue
            if node.pending_call is not None:
                try:
                    answer = self.ray.get(node.pending_call, timeout=self.config.node_lost_s)
                except Exception as e:
                    self._lose(node, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
                    continue
                if isinstance(answer, dict):
                    self._keep(node, answer)
                elif node.starting:
                    self._started(node, int(answer))
            node.handle.reconfigure.remote(make_toml(node.actor_id, node.envs))
            node.pending_call = node.handle.start.remote()  # after the reconfigure: in order
            node.last_answer = time.monotonic()
        log.info("every node's actor starts again against %s", why)

    def stop(self, timeout: float) -> None:
        """Every agent stops its actor (all at once), the last polls are kept, the agents
        remove their folders and go (`close` then leaves the cluster)."""
        for n in self.nodes.values():
            if n.starting and not n.lost:  # never started: nothing to bring back
                n.stopped = True
                with contextlib.suppress(Exception):
                    self.ray.kill(n.handle, no_restart=True)
        live = [n for n in self.nodes.values() if not n.lost and not n.stopped]
        calls = {n.node_id: n.handle.stop.remote(timeout) for n in live}
        for n in live:
            try:
                if n.pending_call is not None:  # a poll in flight: its bytes are kept too
                    answer = self.ray.get(n.pending_call, timeout=timeout + 60)
                    if isinstance(answer, dict):
                        self._keep(n, answer)
                self._keep(n, self.ray.get(calls[n.node_id], timeout=timeout + 60))
                while True:  # whatever the last poll left (MAX_CHUNK at a time)
                    more = self.ray.get(n.handle.poll.remote(), timeout=60)
                    self._keep(n, more)
                    if not more["log"] and not more["ledger"]:
                        break
                self.ray.get(n.handle.remove.remote(), timeout=60)
            except Exception as e:  # a node lost during the stop
                self._lose(n, f"lost while stopping: {e}")
            n.stopped = True
            with contextlib.suppress(Exception):
                self.ray.kill(n.handle, no_restart=True)
        self._stop_engines(timeout)  # after the actors: their last episodes sample from them

    def close(self) -> None:
        """Leave the cluster (after `stop` and `stop_learner`)."""
        self.ray.shutdown()

    def summary(self) -> dict[str, Any]:
        """For summary.json: the nodes placed, lost and restarted."""
        return {
            "address": self.config.address,
            "run_id": self.run_id,
            "nodes": [{"node": n.node_id, "ip": n.ip, "actor": n.actor_id, "envs": n.envs,
                       "desktops": n.desktops, "vms": n.vms, "gpus": n.gpus,
                       "restarts": n.restarts,
                       "lost": n.lost}
                      for n in [*self.replaced, *self.nodes.values()]],
            "joined": self.joined,
            "lost": self.lost,
            **({"engines": [{"engine": e.engine_id, "node": e.node_id, "ip": e.ip,
                             "url": e.url, "lost": e.lost} for e in self.engines]}
               if self.engines else {}),
            **({"learners": self.learners} if self.learners else {}),
        }  # fmt: skip

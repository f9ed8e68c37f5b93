"""What `arpo train` runs on each node of a Ray cluster: `NodeAgent`, one per node.

    agent = NodeAgent("node1", actor_toml, keys, model, None, run_id, desktops=2)
    agent.start()      # the node's desktops (if any), then `arpo-actor`; its pid
    agent.poll()       # the actor's state, new log bytes, new spool-ledger lines, pending ids
    agent.stop(30)     # SIGTERM (the actor flushes its spool), then the desktops go down
    agent.remove()     # the node's folder

The driver (`arpo.train.cluster.Placement`) wraps it with `ray.remote` and pins it to its
node; here it is plain Python, so it is tested and read without Ray. Everything it starts
lives in a folder of its node (`<tmp>/arpo-<run id>/<actor id>`, mode 0700): the actor's
config, the CURVE keys the driver handed over, the spool, the task-file cache, the model
when the driver shipped it, and the desktops' state and token files. No shared disk.

- **Simulated desktops** run inside the actor (`sim_envs` of its config).
- **Real local desktops** (`desktops` > 0): `arpo-envs up -n N --tokens` runs in the
  foreground as a child of the agent, each desktop with its own bearer token written to a
  0600 file in the node's folder; once they answer, the agent writes their URLs and tokens
  into the actor's config and starts the actor. The desktops serve loopback only: their
  actor is on the same node.
- **VMs** (`vms` > 0): `arpo-envs vm up -n N --dir <node folder>/vms` in the foreground;
  once its state file says ready, the actor's `vm_fleet` names it (each VM reverted to its
  snapshot before every episode, as on one machine).
- Every child gets a parent-death signal (`prctl(PR_SET_PDEATHSIG)`): when the agent dies
  with its node's Ray processes, the actor is killed and the fleets' `up` are sent SIGTERM,
  which stops every desktop and VM as `arpo-envs down` does. A node lost leaves nothing
  running.
- A desktop that dies takes its fleet's `up` with it; the next `poll` then stops the actor
  too and reports it exited, and the driver's `start` brings the fleets up again (new
  ports, new tokens).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from arpo.errors import ArpoError

MAX_CHUNK = 4 << 20
"""Most bytes of one log or ledger a poll brings back (the rest comes with the next)."""
MARKER_FILE = "cluster-marker"
"""In run_dir: a random token the driver writes; a learner node must read the same there."""
TOKENS_FILE = "desktop-tokens.json"
"""In the node's `keys/` folder: URL -> bearer token of each desktop (`arpo-envs up`)."""


def _prctl() -> Any:
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: no parent-death signal
        return None


_PRCTL = _prctl()
"""libc's prctl, looked up once here: the child calls it between fork and exec, where
loading a library could wait on a lock another thread of the parent held."""


def die_with_parent(sig: int) -> Any:
    """For `preexec_fn`: the child gets `sig` when the process (the thread) that started it
    dies: an agent with its node, `arpo train` killed. None where there is no prctl."""
    if _PRCTL is None:
        return None

    def set_it() -> None:
        _PRCTL(1, sig)  # PR_SET_PDEATHSIG

    return set_it


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def node_folder(
    run_id: str, name: str, keys: dict[str, bytes], model: str, model_tar: bytes | None
) -> tuple[Path, Path, str]:
    """A process's folder on this node (`<tmp>/arpo-<run id>/<name>`, mode 0700) with its
    CURVE key files in `keys/` (0600) and the model unpacked from `model_tar` when the
    driver shipped it: (folder, key folder, the model's path on this node)."""
    folder = Path(tempfile.gettempdir()) / f"arpo-{run_id}" / name
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    keydir = folder / "keys"
    keydir.mkdir(exist_ok=True, mode=0o700)
    for key, data in keys.items():
        _write_private(keydir / key, data)
    if model_tar is not None:
        model = str(folder / "model")
        with tarfile.open(fileobj=io.BytesIO(model_tar)) as tar:
            tar.extractall(model, filter="data")
    return folder, keydir, model


def _fill(template: str, folder: Path, model: str) -> bytes:
    """A config template with this node's folder (@NODE@) and model path (@MODEL@)."""
    escaped = model.replace("\\", "\\\\").replace('"', '\\"')
    return template.replace("@NODE@", str(folder)).replace("@MODEL@", escaped).encode()


def _stop(p: subprocess.Popen | None, timeout: float) -> int | None:
    """SIGTERM to a child, SIGKILL to its process group after `timeout`; its exit code."""
    if p is None:
        return None
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)
    return p.returncode


class NodeAgent:
    """One node's actor process and the desktops it drives (module docstring)."""

    def __init__(
        self,
        actor_id: str,
        config_toml: str,
        keys: dict[str, bytes],
        model: str,
        model_tar: bytes | None,
        run_id: str,
        *,
        desktops: int = 0,
        vms: int = 0,
        atspi: bool = False,
        start_timeout_s: float = 300.0,
    ) -> None:
        self.actor_id = actor_id
        self.desktops = desktops
        """Real local desktops this node's actor drives (0: none)."""
        self.vms = vms
        """QEMU VMs (a fleet of the test image) this node's actor drives (0: none)."""
        self.atspi = atspi
        """Start them with their apps' accessibility trees (`arpo-envs up --atspi`)."""
        self.start_timeout_s = start_timeout_s
        self.folder, self.keydir, self.model = node_folder(run_id, actor_id, keys, model, model_tar)
        self.config = self.folder / "actor.toml"
        self._write_config(config_toml)
        self.log = self.folder / "actor.log"
        self.spool = self.folder / "spool"
        self.popen: subprocess.Popen | None = None
        self.fleets: dict[str, subprocess.Popen] = {}
        """The foreground `arpo-envs up` / `arpo-envs vm up` of its desktops / VMs."""
        self.offsets = {"log": 0, "ledger": 0}
        self.starts = 0

    def _write_config(self, config_toml: str) -> None:
        _write_private(self.config, _fill(config_toml, self.folder, self.model))

    def reconfigure(self, config_toml: str) -> None:
        """A new actor config (the learner moved to another node): written as at the start,
        with the running desktops' URLs and tokens; the next `start` runs the actor on it."""
        self._write_config(config_toml)
        if self._kinds() and self._fleets_alive():
            self._patch_envs()

    def node(self) -> dict[str, Any]:
        """Where this agent runs: its host name, pid and folder."""
        import socket

        return {"host": socket.gethostname(), "pid": os.getpid(), "folder": str(self.folder)}

    # ---- the desktops and VMs ------------------------------------------------------------

    def _kinds(self) -> dict[str, int]:
        """Each environment fleet this node runs -> how many ('desktops', 'vms')."""
        return {k: n for k, n in (("desktops", self.desktops), ("vms", self.vms)) if n}

    def _fleet_cmd(self, kind: str) -> list[str]:
        cli = [sys.executable, "-m", "arpo_envs.cli"]
        if kind == "vms":  # the fleet's folder (state file, overlays, snapshots) is the node's
            return [*cli, "vm", "up", "-n", str(self.vms), "--dir", str(self.folder / "vms")]
        return [*cli, "up", "-n", str(self.desktops), "--base-port", "0", "--tokens",
                "--tokens-file", str(self.keydir / TOKENS_FILE),
                "--state", str(self.folder / "desktops.json"),
                *(["--atspi"] if self.atspi else [])]  # fmt: skip

    def _fleet_ready(self, kind: str) -> bool:
        if kind == "desktops":  # `up` writes the tokens once every desktop answers
            return (self.keydir / TOKENS_FILE).exists()
        from arpo_envs.fleet_records import VMFleetState, load

        try:
            return load(self.folder / "vms" / "fleet.json", VMFleetState).ready
        except (OSError, ValueError):
            return False

    def _fleet_up(self, kind: str) -> None:
        """Start one fleet (again) in the foreground, wait until it is ready and write where
        it is into the actor's config; ArpoError naming its log when it is not in time."""
        self._fleet_down(kind)
        if kind == "desktops":
            (self.keydir / TOKENS_FILE).unlink(missing_ok=True)
        with (self.folder / f"{kind}.log").open("ab") as out:
            proc = subprocess.Popen(
                self._fleet_cmd(kind), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM),
            )  # fmt: skip
        self.fleets[kind] = proc
        end = time.monotonic() + self.start_timeout_s
        while not self._fleet_ready(kind):
            if proc.poll() is not None or time.monotonic() > end:
                why = (f"exited with code {proc.returncode}" if proc.poll() is not None
                       else f"were not ready in {self.start_timeout_s:.0f} s")  # fmt: skip
                self._fleet_down(kind)
                tail = (self.folder / f"{kind}.log").read_text(errors="replace")[-1500:]
                raise ArpoError(
                    f"the {self._kinds()[kind]} {kind} of {self.actor_id} {why}: {tail}"
                )
            time.sleep(0.2)
        self._patch_envs()

    def _fleets_alive(self) -> bool:
        return all(
            (p := self.fleets.get(k)) is not None and p.poll() is None for k in self._kinds()
        )

    def _patch_envs(self) -> None:
        """Write the running fleets into the actor's config: the desktops' URLs and tokens
        (`TOKENS_FILE`), the VM fleet's state file."""
        import tomllib

        from arpo.actor.config import ActorConfig
        from arpo.config import from_dict, to_toml

        data = tomllib.loads(self.config.read_text())
        if self.desktops and (self.keydir / TOKENS_FILE).exists():
            urls = json.loads((self.keydir / TOKENS_FILE).read_text())
            data.update(envs=list(urls), env_tokens=[urls[u] for u in urls])
        if self.vms:
            data.update(vm_fleet=str(self.folder / "vms" / "fleet.json"))
        _write_private(self.config, to_toml(from_dict(ActorConfig, data)).encode())

    def _fleet_down(self, kind: str) -> None:
        """SIGTERM to a fleet's `up` (it stops every desktop or VM), SIGKILL after 60 s."""
        p = self.fleets.pop(kind, None)
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)

    def _fleets_down(self) -> None:
        for kind in list(self.fleets):
            self._fleet_down(kind)

    # ---- the actor -----------------------------------------------------------------------

    def start(self) -> int:
        """Start (or start again) the desktops, if any, and the actor process; its pid."""
        self.starts += 1
        self._stop_actor(30.0)  # a desktop or VM died under a running actor: all start again
        for kind in self._kinds():
            if (p := self.fleets.get(kind)) is None or p.poll() is not None:
                self._fleet_up(kind)
        args = [sys.executable, "-m", "arpo.actor.cli", "--config", str(self.config)]
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                start_new_session=True, preexec_fn=die_with_parent(signal.SIGKILL),
            )  # fmt: skip
        return self.popen.pid

    def _read(self, path: Path, key: str) -> bytes:
        try:
            with path.open("rb") as f:
                f.seek(self.offsets[key])
                data = f.read(MAX_CHUNK)
        except FileNotFoundError:
            return b""
        if key == "ledger":  # whole lines only: the driver appends them to its copy
            data = data[: data.rfind(b"\n") + 1]
        self.offsets[key] += len(data)
        return data

    def poll(self) -> dict[str, Any]:
        """The actor's state, the new bytes of its log and of its spool ledger, and the ids
        its spool holds now (pending, refused). Desktops that went down stop the actor
        first (it reports as exited; the driver's `start` brings both up again)."""
        from arpo.actor.spool import LEDGER, read_spool

        lost_envs = bool(self._kinds()) and not self._fleets_alive()
        if lost_envs and self.popen is not None and self.popen.poll() is None:
            with self.log.open("ab") as out:
                out.write(b"node agent: its desktops or VMs went down: stopping the actor\n")
            self._stop_actor(30.0)
        code = None if self.popen is None else self.popen.poll()
        contents = read_spool(self.spool)
        return {
            "alive": self.popen is not None and code is None,
            "code": code,
            "starts": self.starts,
            "desktops": 0 if lost_envs else self.desktops,
            "vms": 0 if lost_envs else self.vms,
            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""),  # Ray's, for the actor too
            "log": self._read(self.log, "log"),
            "ledger": self._read(self.spool / LEDGER, "ledger"),
            "pending": sorted(contents.pending),
            "refused": sorted(contents.refused),
        }

    def _stop_actor(self, timeout: float) -> None:
        _stop(self.popen, timeout)

    def stop(self, timeout: float) -> dict[str, Any]:
        """SIGTERM to the actor (it flushes its spool to the learner), SIGKILL after
        `timeout`; then the desktops go down; then the last poll."""
        self._stop_actor(timeout)
        answer = self.poll()
        self._fleets_down()
        return answer

    def remove(self) -> None:
        """Remove this node's folder (after the last poll brought everything back), and the
        run's folder on this node once it is empty."""
        self._fleets_down()
        shutil.rmtree(self.folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.folder.parent.rmdir()


def learner_command(
    config: Path, procs: int = 1, nnodes: int = 1, node_rank: int = 0, master: str = ""
) -> list[str]:
    """The learner's command line: `arpo-learner --config <config>`, under torchrun
    (`python -m torch.distributed.run`) when it has more than one rank (`procs` on each of
    `nnodes` nodes): a standalone rendezvous on one machine, else a static one at `master`
    (host:port on rank 0's node). Rank 0 binds the data and control links."""
    cli = ["-m", "arpo.learner.cli", "--config", str(config)]
    if procs * nnodes == 1:
        return [sys.executable, *cli]
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={procs}"]
    if nnodes == 1:
        run.append("--standalone")
    else:
        host, _, port = master.rpartition(":")
        run += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={host}",
                f"--master-port={port}"]  # fmt: skip
    return [*run, *cli]


def interface_of(ip: str) -> str:
    """The name of this machine's network interface holding `ip` ('' when none does): gloo
    must speak on the cluster's network, not on whatever the host name resolves to."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            return name
    return ""


class LearnerAgent:
    """The learner on a node offering `cluster.learner_resource`: `arpo-learner` with the
    run's config (`<run_dir>/learner.toml`), its data and control links bound to this node's
    cluster address, its files in the run's folder, which must be on storage this node and
    the driver both reach (checked with a marker the driver wrote). Its output goes to
    `<run_dir>/logs/learner.log`; it dies with this agent (a parent-death signal)."""

    def __init__(self, run_dir: str, marker: str) -> None:
        import socket

        self.run_dir = Path(run_dir)
        self.host = socket.gethostname()
        try:
            seen = (self.run_dir / MARKER_FILE).read_text()
        except OSError:
            seen = ""
        if seen != marker:
            raise ArpoError(
                f"run_dir {run_dir} is not this run's folder as node {self.host} sees it: the "
                "learner's node must reach the driver's run_dir (put it on shared storage, the "
                "same path on every node that offers cluster.learner_resource)"
            )
        self.popen: subprocess.Popen | None = None

    def ports(self, ip: str) -> dict[str, str]:
        """Free endpoints on this node for the learner's links and its torchrun master."""
        from arpo_envs.procs import free_ports

        data, control, master = free_ports(3)
        return {"data": f"tcp://{ip}:{data}", "control": f"tcp://{ip}:{control}",
                "master": f"{ip}:{master}"}  # fmt: skip

    def start(
        self,
        ip: str,
        resume: bool,
        *,
        procs: int = 1,
        nnodes: int = 1,
        node_rank: int = 0,
        ports: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Start the learner (or rank `node_rank` of its torchrun group over `nnodes`
        nodes, `procs` ranks each) on `ip` (this node's cluster address), with `--resume`
        when `resume`; its endpoints (`ports`, from rank 0's node; its own by default) and
        pid. The group's processes talk over the interface holding `ip`."""
        ports = ports or self.ports(ip)
        data, control = ports["data"], ports["control"]
        args = [*learner_command(self.run_dir / "learner.toml", procs, nnodes, node_rank,
                                 ports["master"]),
                f"transport.data={data}", f"transport.control={control}",
                *(["--resume"] if resume else [])]  # fmt: skip
        env = dict(os.environ)
        if nnodes > 1 and (iface := interface_of(ip)):
            env["GLOO_SOCKET_IFNAME"] = iface
        name = "learner.log" if node_rank == 0 else f"learner-node{node_rank}.log"
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        with (self.run_dir / "logs" / name).open("ab") as out:
            what = "learner bound to" if node_rank == 0 else f"learner node {node_rank} joins"
            out.write(f"node agent on {self.host}: {what} {data}\n".encode())
            out.flush()
            self.popen = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                start_new_session=True, preexec_fn=die_with_parent(signal.SIGKILL),
            )  # fmt: skip
        return {"data": data, "control": control, "pid": self.popen.pid, "host": self.host}

    def poll(self) -> int | None:
        """None while the learner runs, else its exit code."""
        return None if self.popen is None else self.popen.poll()

    def stop(self, timeout: float) -> int | None:
        """SIGTERM (it checkpoints and exits), SIGKILL after `timeout`; its exit code."""
        return _stop(self.popen, timeout)


class EngineAgent:
    """A shared policy engine on a node offering `cluster.engine_resource`: `arpo-engine`
    (`arpo.policy.engine_server`) with the run's engine config, bound to this node's cluster
    address with the run's bearer token (handed over through Ray, passed to the server in
    its environment, never in its command line), following the learner with the actors'
    CURVE keys. Its folder, keys and model are laid out as a `NodeAgent`'s; its log comes
    back through `poll`; it dies with this agent (a parent-death signal)."""

    def __init__(
        self,
        engine_id: str,
        config_toml: str,
        keys: dict[str, bytes],
        model: str,
        model_tar: bytes | None,
        run_id: str,
        token: str,
        start_timeout_s: float = 300.0,
    ) -> None:
        self.engine_id = engine_id
        self.token = token
        self.start_timeout_s = start_timeout_s
        self.folder, _, model = node_folder(run_id, engine_id, keys, model, model_tar)
        self.config = self.folder / "engine.toml"
        _write_private(self.config, _fill(config_toml, self.folder, model))
        self.log = self.folder / "engine.log"
        self.popen: subprocess.Popen | None = None
        self.offset = 0

    def start(self, ip: str) -> dict[str, Any]:
        """Start the server bound to `ip` and wait until it serves; {"url", "pid"}. ArpoError
        with its log's end when it exits or does not serve within `start_timeout_s`."""
        import re

        _stop(self.popen, 30.0)
        start = self.log.stat().st_size if self.log.exists() else 0
        args = [sys.executable, "-m", "arpo.policy.engine_server", "--config", str(self.config),
                f"host={ip}", "port=0", f"server_id={self.engine_id}"]  # fmt: skip
        env = {**os.environ, "ARPO_ENGINE_TOKEN": self.token}
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                start_new_session=True, preexec_fn=die_with_parent(signal.SIGKILL),
            )  # fmt: skip
        end = time.monotonic() + self.start_timeout_s
        while True:
            text = self.log.read_bytes()[start:].decode(errors="replace")
            if m := re.search(r"^engine server (\S+) serving", text, re.M):
                return {"url": m.group(1), "pid": self.popen.pid}
            if self.popen.poll() is not None or time.monotonic() > end:
                why = (f"exited with code {self.popen.returncode}" if self.popen.poll() is not None
                       else f"did not serve within {self.start_timeout_s:.0f} s")  # fmt: skip
                _stop(self.popen, 10.0)
                raise ArpoError(f"the engine server {self.engine_id} {why}: {text[-1500:]}")
            time.sleep(0.2)

    def poll(self) -> dict[str, Any]:
        """The server's state and the new bytes of its log."""
        code = None if self.popen is None else self.popen.poll()
        try:
            with self.log.open("rb") as f:
                f.seek(self.offset)
                data = f.read(MAX_CHUNK)
        except FileNotFoundError:
            data = b""
        self.offset += len(data)
        return {"alive": self.popen is not None and code is None, "code": code, "log": data}

    def stop(self, timeout: float) -> dict[str, Any]:
        """SIGTERM, SIGKILL after `timeout`; then the last poll."""
        _stop(self.popen, timeout)
        return self.poll()

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.folder.parent.rmdir()

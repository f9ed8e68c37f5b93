"""A Ray cluster on this machine for tests and benchmarks: a bridge, one network namespace
per Ray node (node 0 the head, where the driver runs), `ray start` in each, so ZeroMQ and Ray
cross real interfaces. Needs root and iproute2.

    c = Cluster(nodes=3)
    c.ray_start(0); c.ray_start(1, sim=4); c.ray_start(2, desktops=1)
    ...  # `ip netns exec c.spaces[0] python -m arpo.train ... cluster.address=<c.ip(0)>:6379`
    c.kill(1)   # SIGKILL every process of node 1
    c.close()
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
RAY_PORT = 6379


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command (ip, ray) and return its output; CalledProcessError when it fails."""
    return subprocess.run(args, capture_output=True, text=True, check=check, timeout=120)


class Cluster:
    """A bridge on this machine and one network namespace per Ray node: node 0 is the
    head (and the driver), nodes 1.. are workers offering `arpo_sim`."""

    def __init__(self, nodes: int) -> None:
        self.tag = secrets.token_hex(2)
        self.subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
        self.bridge = f"arb{self.tag}"
        self.temp = Path(tempfile.mkdtemp(prefix=f"ray-{self.tag}-"))
        self.spaces: list[str] = []
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for _ in range(nodes):
            self.add_space()

    def add_space(self) -> str:
        i = len(self.spaces)
        ns, a, b = f"arpo{self.tag}n{i}", f"ara{self.tag}{i}", f"arb{self.tag}{i}"
        self.spaces.append(ns)
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        sh("ip", "link", "set", b, "netns", ns)
        sh("ip", "link", "set", a, "master", self.bridge, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.ip(i)}/24", "dev", b)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", b, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        return ns

    def ip(self, i: int) -> str:
        return f"{self.subnet}.{i + 2}"

    def env(self) -> dict[str, str]:
        return {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_USAGE_STATS_ENABLED": "0"}

    def ray_start(
        self,
        i: int,
        sim: int = 0,
        desktops: int = 0,
        gpus: int = 0,
        learner: int = 0,
        engines: int = 0,
    ) -> None:
        """`ray start` of node `i` in its namespace (the head for 0), offering `sim`
        simulated and `desktops` local desktops, `gpus` GPUs (declared: Ray hands out
        their indices whether or not the devices exist), with `learner` a place for the
        learner (`arpo_learner`) and with `engines` one for a shared engine server."""
        if i == len(self.spaces):
            self.add_space()
        common = [f"--node-ip-address={self.ip(i)}", "--num-cpus=1", "--disable-usage-stats",
                  f"--num-gpus={gpus}"]  # fmt: skip
        offers = {k: v for k, v in (("arpo_sim", sim), ("arpo_desktops", desktops),
                                    ("arpo_learner", learner), ("arpo_engines", engines))
                  if v}  # fmt: skip
        if offers:
            common.append("--resources=" + json.dumps(offers))
        if i == 0:
            args = ["--head", f"--port={RAY_PORT}", "--include-dashboard=false",
                    f"--temp-dir={self.temp}"]  # fmt: skip
        else:
            args = [f"--address={self.ip(0)}:{RAY_PORT}"]
        cmd = ["ip", "netns", "exec", self.spaces[i], str(BIN / "ray"), "start", *args, *common]
        out = subprocess.run(cmd, capture_output=True, text=True, env=self.env(), timeout=120)
        assert out.returncode == 0, f"ray start of node {i} failed:\n{out.stdout}\n{out.stderr}"

    def kill(self, i: int) -> int:
        """SIGKILL every process of node `i` (its raylet, its workers, their children)."""
        pids = [int(p) for p in sh("ip", "netns", "pids", self.spaces[i]).stdout.split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def close(self) -> None:
        for i in reversed(range(len(self.spaces))):
            with contextlib.suppress(Exception):
                self.kill(i)
        time.sleep(0.5)
        for ns in self.spaces:
            sh("ip", "netns", "del", ns, check=False)
        sh("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.temp, ignore_errors=True)

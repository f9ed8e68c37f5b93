"""Shared fixtures: realistic trajectory records built from real PNG screenshots."""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from arpo.record import Status, Trajectory, Turn


def make_png(rng: np.random.Generator, approx_bytes: int = 90_000) -> bytes:
    """A real PNG of random pixels of about `approx_bytes` (noise does not compress)."""
    from PIL import Image

    side = max(1, int((approx_bytes / 3) ** 0.5))
    pixels = rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def make_trajectory(
    rng: np.random.Generator,
    *,
    turns: int = 15,
    tokens: int = 20_000,
    png_bytes: int = 90_000,
    pngs: list[bytes] | None = None,
    task_id: str = "0b17a146-2934-46c7-8727-73ff6b6483e8",
    version: int = 3,
) -> Trajectory:
    """A record shaped like a real ARPO episode: `turns` turns, ~`tokens` tokens in all."""
    per_turn = tokens // max(turns, 1)
    out = []
    for i in range(turns):
        n_resp = per_turn // 6
        n_prompt = per_turn - n_resp
        png = pngs[i % len(pngs)] if pngs else make_png(rng, png_bytes)
        out.append(
            Turn(
                prompt_ids=rng.integers(0, 151_000, n_prompt, dtype=np.int32),
                screenshot=png,
                response_ids=rng.integers(0, 151_000, n_resp, dtype=np.int32),
                logprobs=-rng.random(n_resp, dtype=np.float32) * 5,
                policy_version=version + (i // 8),
                action=f"pyautogui.click({i * 10}, {i * 7})" if i < turns - 1 else "DONE",
                parsed=True,
            )
        )
    return Trajectory(
        task_id=task_id,
        turns=tuple(out),
        checker_score=1.0,
        format_reward=0.0,
        reward=1.0,
        status=Status.OK,
        group_id="g-17",
        slot=5,
        actor_id="actor-0",
        timings={"reset": 0.41, "total": 23.5},
    )


@pytest.fixture(scope="session")
def png_pool() -> list[bytes]:
    rng = np.random.default_rng(0)
    return [make_png(rng) for _ in range(4)]


@pytest.fixture
def realistic(png_pool: list[bytes]) -> Trajectory:
    return make_trajectory(np.random.default_rng(1), pngs=png_pool)


# ---- shared by the pool-run tests (select, collect, evaluate) ---------------------------

POOL_FAMILIES = ["click_button", "menu_pick", "type_submit"]
"""Simulated task families of the small pools those tests write."""
SCRIPTED_ACTOR = ["sim_envs=4", "policy='scripted'", "episode.scroll_clicks=1", "progress_s=0"]
"""`local_actor_args` of a scripted local actor (no model) on 4 simulated desktops."""


def sim_desktop(*args: str, port: int = 0) -> tuple[subprocess.Popen, str]:
    """One simulated desktop's server in its own process (`arpo-envs sim -n 1` with `args`)
    on `port` (0: a free one), and its URL once the server prints it."""
    cmd = [sys.executable, "-m", "arpo_envs.cli", "sim", "-n", "1", "--base-port", str(port)]
    proc = subprocess.Popen([*cmd, *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        if not line:
            proc.kill()
            raise AssertionError(f"the simulated desktop did not start: {cmd + list(args)}")
        if line.startswith("env 0 "):
            return proc, line.split()[2]


@pytest.fixture(scope="session")
def vm_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A fleet of 2 QEMU VMs of the test image (`arpo_envs.vm.fleet.FleetConfig`), started
    once for every VM test module of the session (tests/test_vm.py, tests/test_vm_fork.py):
    a fleet's start costs a minute or two under software emulation. Its health timer runs
    every 3 s."""
    from arpo_envs.vm.fleet import FleetConfig, down, up
    from arpo_envs.vm.image import build
    from arpo_envs.vm.qemu import MachineConfig

    build()  # cached after the first time on a machine
    folder = tmp_path_factory.mktemp("fleet") / "vms"
    cfg = FleetConfig(
        n=2, dir=str(folder), machine=MachineConfig(), health_interval_s=3.0, health_timeout_s=20.0
    )
    up(cfg, announce=lambda s: None)
    yield cfg
    down(cfg.state_file, announce=lambda s: None)


def loopback() -> object:
    """Transport endpoints on free loopback ports."""
    from arpo.transport import TransportConfig

    return TransportConfig(data="tcp://127.0.0.1:0", control="tcp://127.0.0.1:0")


class ListStore:
    """A store that keeps every item ingest puts into it, in order."""

    def __init__(self) -> None:
        self.items: list[tuple[str, object]] = []

    def put(self, task: str, item: object) -> None:
        self.items.append((task, item))

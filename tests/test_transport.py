"""The links between actors and the learner: CURVE keys, loopback-only binds, weights, restarts."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from conftest import make_trajectory

from arpo import wire
from arpo.buffer import ReplayStore
from arpo.config import load_config
from arpo.errors import ConfigError
from arpo.service.ingest import Ingest
from arpo.transport import (
    ActorLink,
    RouterServer,
    TransportConfig,
    WeightsServer,
    bind_router,
    connect_dealer,
    create_keys,
    fetch_weights,
    is_loopback,
    stop_authenticator,
)


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.parametrize(
    ("endpoint", "loopback"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.8.0.1:0", True),
        ("tcp://localhost:1", True),
        ("tcp://[::1]:5", True),
        ("ipc:///tmp/x", True),
        ("inproc://x", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://10.1.2.3:5555", False),
        ("tcp://eth0:5555", False),
    ],
)
def test_loopback_detection(endpoint: str, loopback: bool) -> None:
    assert is_loopback(endpoint) is loopback


def test_binding_beyond_loopback_needs_curve_keys() -> None:
    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="CURVE"):
            bind_router(ctx, "tcp://0.0.0.0:0", TransportConfig())
    finally:
        ctx.term()
    with pytest.raises(ConfigError, match="curve_secret_key"):
        load_config(TransportConfig, None, ["curve_secret_key='k'"])


def test_curve_lets_only_authorised_actors_deliver(tmp_path: Path, png_pool: list[bytes]) -> None:
    _, learner_secret = create_keys(tmp_path / "learner", "learner")
    learner_public = tmp_path / "learner" / "learner.key"
    actor_public, actor_secret = create_keys(tmp_path / "actors", "actor")
    _, rogue_secret = create_keys(tmp_path / "rogue", "rogue")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    (authorized / "actor.key").write_bytes(actor_public.read_bytes())

    learner_cfg = TransportConfig(
        data="tcp://127.0.0.1:0",
        curve_secret_key=str(learner_secret),
        curve_authorized=str(authorized),
    )
    store = ReplayStore(max_bytes=1 << 30, seed=0)
    ingest = Ingest(store, transport=learner_cfg)
    endpoint = ingest.start()
    ctx = zmq.Context()
    try:
        traj = make_trajectory(np.random.default_rng(0), turns=2, tokens=300, pngs=png_pool)
        # An actor whose key is not authorised: the handshake is refused, nothing arrives.
        rogue = connect_dealer(
            ctx,
            endpoint,
            TransportConfig(
                curve_secret_key=str(rogue_secret), curve_server_key=str(learner_public)
            ),
        )
        rogue.send_multipart(wire.encode(traj))
        _wait(lambda: ingest.stats()["rejected"].get("unauthenticated", 0) >= 1, "refusal")
        assert not rogue.poll(300) and store.fresh_len(traj.task_id) == 0
        rogue.close(0)
        # A plain-text client cannot talk to a CURVE server either.
        plain = connect_dealer(ctx, endpoint, TransportConfig())
        plain.send_multipart(wire.encode(traj))
        assert not plain.poll(500) and store.fresh_len(traj.task_id) == 0
        plain.close(0)
        # The authorised actor delivers.
        good = connect_dealer(
            ctx,
            endpoint,
            TransportConfig(
                curve_secret_key=str(actor_secret), curve_server_key=str(learner_public)
            ),
        )
        good.send_multipart(wire.encode(traj))
        assert good.poll(30_000)
        assert wire.decode(good.recv_multipart()) == wire.Ack((traj.trajectory_id,))
        assert store.fresh_len(traj.task_id) == 1
        good.close(0)
    finally:
        ingest.stop()
        stop_authenticator(zmq.Context.instance())
        ctx.term()
        store.close()


def test_weights_stream_in_chunks_and_by_shared_path(tmp_path: Path) -> None:
    weights = WeightsServer(chunk_bytes=1000)
    blob = np.random.default_rng(0).bytes(10_500)
    weights.publish(3, blob)

    def handler(frames: list[bytes]) -> list:
        msg = wire.decode(frames)
        if isinstance(msg, wire.WeightsRequest):
            return weights.handle(msg)
        if isinstance(msg, wire.Heartbeat):
            hb = wire.Heartbeat("learner", "learner", 1, weights.version, time.time())
            return [wire.encode(hb)]
        return []

    server = RouterServer("tcp://127.0.0.1:0", TransportConfig(), handler, name="control")
    endpoint = server.start()

    async def go() -> tuple:
        link = ActorLink(
            TransportConfig(data="tcp://127.0.0.1:1", control=endpoint, request_timeout_s=30),
            on_ack=print,
            actor_id="a",
        )
        try:
            streamed = await fetch_weights(link)
            path = tmp_path / "v4.safetensors"
            path.write_bytes(blob[::-1])
            weights.publish(4, blob[::-1], str(path))
            shared = await fetch_weights(link)
            return streamed, shared
        finally:
            await link.close()

    try:
        streamed, shared = asyncio.run(go())
    finally:
        server.stop()
    ann, data = streamed
    assert ann.version == 3 and ann.chunks == 11 and data == blob
    assert ann.sha256 == hashlib.sha256(blob).hexdigest()
    ann, data = shared
    assert ann.version == 4 and data == tmp_path / "v4.safetensors"


def test_actor_link_reconnects_after_the_learner_restarts(png_pool: list[bytes]) -> None:
    """Acks and heartbeats flow again once a learner comes back on the same endpoint."""
    store = ReplayStore(max_bytes=1 << 30, seed=0)
    tc = TransportConfig(data="tcp://127.0.0.1:0")
    first = Ingest(store, transport=tc)
    endpoint = first.start()
    acked: list[str] = []

    async def go() -> None:
        link = ActorLink(TransportConfig(data=endpoint, control="tcp://127.0.0.1:1"),
                         on_ack=lambda ids: acked.extend(ids), actor_id="a")  # fmt: skip
        link.start()
        try:
            for i in range(2):
                t = make_trajectory(np.random.default_rng(i), turns=2, tokens=300, pngs=png_pool)
                for _ in range(300):  # resend until acknowledged, as the actor's sender does
                    await link.send(wire.encode(t), timeout=1.0)
                    for _ in range(10):
                        await asyncio.sleep(0.02)
                        if t.trajectory_id in acked:
                            break
                    if t.trajectory_id in acked:
                        break
                assert t.trajectory_id in acked
                if i == 0:
                    await asyncio.to_thread(first.stop)
                    second = Ingest(store, transport=TransportConfig(data=endpoint))
                    await asyncio.to_thread(second.start)
            await asyncio.to_thread(second.stop)
        finally:
            await link.close()

    asyncio.run(go())
    assert len(acked) >= 2 and store.fresh_len("0b17a146-2934-46c7-8727-73ff6b6483e8") == 2
    store.close()


def _bench(script: str) -> str:
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    p = subprocess.run(
        [sys.executable, str(root / "benchmarks" / script), "--quick"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=root,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def test_transport_benchmark_quick_mode_checks_and_runs() -> None:
    assert "| arpo + spool |" in _bench("bench_transport.py")


@pytest.mark.slow
def test_rollout_benchmark_quick_mode_checks_and_runs() -> None:
    assert "| 0.75 |" in _bench("bench_rollout.py")

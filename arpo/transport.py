"""Every socket of the system: ZeroMQ between actors and the learner.

Topology (the learner binds, actors connect; any number of actors on any hosts):

    actor DEALER --data-->    learner ROUTER (ingest)   Trajectory ->, <- Ack; Heartbeat <->
    actor DEALER --control--> learner ROUTER (grants)   GrantRequest -> <- GrantReply;
                                                        WeightsRequest -> <- WeightsAnnounce /
                                                        WeightsChunk; FileRequest -> <-
                                                        FileChunk; Heartbeat <->

Every message is `arpo.wire` (nothing else crosses a socket). DEALER/ROUTER on both
links: no REQ/REP state machine to wedge when one side restarts; requests carry their
own ids and a reply that comes too late is dropped. Both sides reconnect by
themselves (ZeroMQ reconnects a connecting socket with capped backoff); delivery of
trajectories is at least once because the actor keeps each one in its spool until it
is acknowledged and resends after `ack_timeout_s` (`arpo.actor.spool`).

Weights go learner -> actors by pull: the learner's heartbeat says which version it
publishes, the actor asks for the announcement, then for the chunks of the
safetensors stream one by one (works across hosts, survives restarts of either side,
never floods a slow actor); when the announcement names a file the actor can see
with the announced size (a shared filesystem), the actor reads it instead.

Endpoints are `tcp://host:port`, `ipc://path` or `inproc://name` (`:0` binds any free
port; `bound_endpoint` says which). Every socket has high-water marks, a linger, and
every wait has a timeout. Binding beyond loopback needs CURVE keys: the learner's
secret certificate and a folder of authorised actor public certificates; actors need
their own secret certificate and the learner's public one (`create_keys`). A client
without an authorised key cannot complete the handshake: its messages never reach the
application, and the refused handshakes are counted (socket monitor).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from arpo import wire
from arpo.config import MAX_SECONDS, check_range, check_seconds, fail, option
from arpo.errors import WireError

log = logging.getLogger("arpo.transport")

Frames = Sequence[Any]

MIN_QUEUED_FILE_BYTES = 4 << 20
"""The least `max_queued_file_bytes`: one chunk of a task file (arpo.env.taskfiles.CHUNK_BYTES)."""


@dataclass
class TransportConfig:
    """Endpoints, limits, timeouts and keys of the actor <-> learner links."""

    data: str = option(
        "tcp://127.0.0.1:5555", "Trajectories and acks: the learner's ingest ROUTER endpoint."
    )
    control: str = option(
        "tcp://127.0.0.1:5556", "Task grants and weights: the learner's control ROUTER endpoint."
    )
    sndhwm: int = option(64, "Send high-water mark (messages queued per peer before waiting).")
    rcvhwm: int = option(256, "Receive high-water mark (messages queued per peer).")
    linger_ms: int = option(1000, "How long a closing socket may still flush queued messages.")
    kernel_buffer_bytes: int = option(
        4 << 20,
        "TCP send and receive buffer size (SO_SNDBUF / SO_RCVBUF) of every socket; "
        "multi-MB trajectories move about twice as fast as with the system default.",
    )
    max_message_bytes: int = option(
        1 << 30,
        "Largest frame the learner's sockets accept (ZMQ_MAXMSGSIZE); a peer sending "
        "a larger one is disconnected by ZeroMQ.",
    )
    max_trajectory_bytes: int = option(
        256 << 20,
        "Largest trajectory message ingest accepts (all frames); larger ones are "
        "counted as oversized and dropped.",
    )
    max_queued_file_bytes: int = option(
        256 << 20,
        "Learner: most bytes of task-file chunks (FileChunk replies) queued on the control "
        "link for all actors together, not yet sent on; a FileRequest beyond it is answered "
        "'busy' (counted as file_busy) and the actor asks again a little later. At least "
        "4 MiB, one chunk.",
    )
    send_timeout_s: float = option(10.0, "Longest wait for room in a send queue.")
    request_timeout_s: float = option(10.0, "Longest wait for the answer to a control request.")
    heartbeat_s: float = option(1.0, "Interval of heartbeats, both ways.")
    peer_timeout_s: float = option(
        10.0, "A peer silent this long is reported as not answering (and logged)."
    )
    ack_timeout_s: float = option(
        30.0, "An unacknowledged trajectory is sent again after this long."
    )
    reconnect_ivl_ms: int = option(100, "First reconnect delay of a connecting socket.")
    reconnect_ivl_max_ms: int = option(2000, "Cap of the reconnect delay.")
    curve_secret_key: str = option(
        "", "This side's CURVE secret certificate (from `create_keys`); empty: no encryption."
    )
    curve_server_key: str = option(
        "", "Actor: the learner's CURVE public certificate (needed with curve_secret_key)."
    )
    curve_authorized: str = option(
        "", "Learner: folder of authorised actor public certificates (needed with CURVE)."
    )

    def validate(self) -> None:
        for name in ("data", "control"):
            ep = getattr(self, name)
            if not ep.startswith(("tcp://", "ipc://", "inproc://")):
                fail(name, f"{ep!r} must start with tcp://, ipc:// or inproc://")
        for name in ("sndhwm", "rcvhwm", "max_message_bytes", "max_trajectory_bytes"):
            if getattr(self, name) < 1:
                fail(name, "must be >= 1")
        if self.max_queued_file_bytes < MIN_QUEUED_FILE_BYTES:
            fail(
                "max_queued_file_bytes",
                f"is {self.max_queued_file_bytes}; must be at least {MIN_QUEUED_FILE_BYTES} "
                "(one task-file chunk), or no large task file could ever be served",
            )
        for name in (
            "send_timeout_s",
            "request_timeout_s",
            "heartbeat_s",
            "peer_timeout_s",
            "ack_timeout_s",
        ):
            check_seconds(name, getattr(self, name))
        for name in ("linger_ms", "reconnect_ivl_ms", "reconnect_ivl_max_ms"):
            check_range(name, getattr(self, name), 0, MAX_SECONDS * 1000, "milliseconds")
        if self.reconnect_ivl_max_ms and self.reconnect_ivl_max_ms < self.reconnect_ivl_ms:
            fail("reconnect_ivl_max_ms", "must be 0 or at least reconnect_ivl_ms")
        if self.curve_secret_key and not zmq.has("curve"):
            fail("curve_secret_key", "this libzmq was built without CURVE support")
        peer_keys = bool(self.curve_server_key or self.curve_authorized)
        if bool(self.curve_secret_key) != peer_keys:
            fail(
                "curve_secret_key",
                "CURVE needs this side's secret certificate plus curve_server_key (actor) "
                "or curve_authorized (learner)",
            )


# ---------------------------------------------------------------------------- keys and checks


def create_keys(folder: str | Path, name: str) -> tuple[Path, Path]:
    """Write a CURVE key pair `name.key` (public) and `name.key_secret` into `folder`."""
    import zmq.auth

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(folder), name)
    return Path(public), Path(secret)


def is_loopback(endpoint: str) -> bool:
    """Whether binding `endpoint` stays on this machine (ipc, inproc, or a loopback address)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface name or a hostname: treat as exposed


def _bind_endpoint(endpoint: str) -> str:
    return (
        endpoint[:-2] + ":*"
        if endpoint.startswith("tcp://") and endpoint.endswith(":0")
        else endpoint
    )


def _common(sock: zmq.Socket, cfg: TransportConfig) -> None:
    sock.setsockopt(zmq.SNDHWM, cfg.sndhwm)
    sock.setsockopt(zmq.RCVHWM, cfg.rcvhwm)
    sock.setsockopt(zmq.LINGER, cfg.linger_ms)
    sock.setsockopt(zmq.SNDBUF, cfg.kernel_buffer_bytes)
    sock.setsockopt(zmq.RCVBUF, cfg.kernel_buffer_bytes)
    sock.setsockopt(zmq.RECONNECT_IVL, cfg.reconnect_ivl_ms)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, cfg.reconnect_ivl_max_ms)


_AUTH_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_authenticators: dict[int, Any] = {}
_auth_lock = threading.Lock()


def _start_authenticator(ctx: zmq.Context, folder: str) -> None:
    """One ZAP authenticator per context, allowing the CURVE keys found in `folder`."""
    from zmq.auth.thread import ThreadAuthenticator

    with _auth_lock:
        auth = _authenticators.get(id(ctx))
        if auth is None:
            auth = ThreadAuthenticator(ctx, log=logging.getLogger("arpo.transport.auth"))
            auth.start()
            _authenticators[id(ctx)] = auth
        auth.configure_curve(domain="*", location=folder)


def stop_authenticator(ctx: zmq.Context) -> None:
    with _auth_lock:
        auth = _authenticators.pop(id(ctx), None)
    if auth is not None:
        auth.stop()


def bind_router(ctx: zmq.Context, endpoint: str, cfg: TransportConfig) -> zmq.Socket:
    """The learner's side of a link: a ROUTER bound to `endpoint` (see `bound_endpoint`)."""
    import zmq.auth

    if not is_loopback(endpoint) and not cfg.curve_secret_key:
        raise ValueError(
            f"refusing to bind {endpoint!r} beyond loopback without CURVE keys: set "
            "curve_secret_key and curve_authorized (create them with arpo.transport.create_keys)"
        )
    sock = ctx.socket(zmq.ROUTER)
    _common(sock, cfg)
    sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted actor takes its identity back
    if cfg.curve_secret_key:
        public, secret = zmq.auth.load_certificate(cfg.curve_secret_key)
        if secret is None:
            raise ValueError(f"{cfg.curve_secret_key} holds no secret key")
        _start_authenticator(ctx, cfg.curve_authorized)
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_server = True
    try:
        sock.bind(_bind_endpoint(endpoint))
    except zmq.ZMQError:
        sock.close(0)
        raise
    return sock


def bound_endpoint(sock: zmq.Socket) -> str:
    """The endpoint a socket is bound to (with the port chosen for `:0`)."""
    ep = sock.getsockopt(zmq.LAST_ENDPOINT)
    return ep.decode() if isinstance(ep, bytes) else str(ep)


def connect_dealer(ctx: zmq.Context, endpoint: str, cfg: TransportConfig) -> zmq.Socket:
    """The actor's side of a link: a DEALER connected to `endpoint` (reconnects by itself)."""
    import zmq.auth

    sock = ctx.socket(zmq.DEALER)
    _common(sock, cfg)
    if cfg.curve_secret_key:
        public, secret = zmq.auth.load_certificate(cfg.curve_secret_key)
        server_public, _ = zmq.auth.load_certificate(cfg.curve_server_key)
        if secret is None:
            raise ValueError(f"{cfg.curve_secret_key} holds no secret key")
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = server_public
    sock.connect(endpoint)
    return sock


# ---------------------------------------------------------------------------- learner side


Handler = Callable[[list[Any]], list[Frames]]
"""Takes a received message (`zmq.Frame`s without the routing id; `wire.decode` reads them
without a copy); returns the replies to send back to the same peer."""


class RouterServer:
    """A ROUTER on its own thread that hands every message to `handler` and sends its replies.

    The socket is used only by the server thread. A reply that finds the peer's queue full
    is dropped and counted (the actor resends or asks again). Refused CURVE handshakes are
    reported to `on_auth_failure(event_name)`.

        server = RouterServer("tcp://127.0.0.1:0", cfg, handler, name="ingest")
        server.start(); print(server.endpoint); ...; server.stop()
    """

    def __init__(
        self,
        endpoint: str,
        config: TransportConfig,
        handler: Handler,
        *,
        name: str,
        context: zmq.Context | None = None,
        on_auth_failure: Callable[[str], None] | None = None,
        poll_ms: int = 100,
    ) -> None:
        self.config = config
        self.handler = handler
        self.name = name
        self._endpoint = endpoint
        self._ctx = context or zmq.Context.instance()
        self._on_auth_failure = on_auth_failure
        self._poll_ms = poll_ms
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.endpoint = ""
        self.dropped_replies = 0
        self.handler_errors = 0

    def start(self, timeout: float = 30.0) -> str:
        """Bind and start serving; returns the bound endpoint. Bind errors are raised here."""
        self._thread = threading.Thread(target=self._run, name=f"arpo-{self.name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"{self.name}: server did not start within {timeout} s")
        if self._error is not None:
            raise self._error
        return self.endpoint

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("%s: server thread did not stop within %s s", self.name, timeout)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            sock = bind_router(self._ctx, self._endpoint, self.config)
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        monitor = sock.get_monitor_socket(_AUTH_EVENTS) if self.config.curve_secret_key else None
        self.endpoint = bound_endpoint(sock)
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(self._poll_ms))
                if monitor is not None and monitor in events:
                    self._monitor_event(monitor)
                if sock not in events:
                    continue
                # Drain what is queued, then poll again (and check the stop flag).
                for _ in range(256):
                    try:
                        # copy=False: no per-frame bytes object here (measured about 1.5x
                        # faster for multi-MB messages); whoever keeps data copies it.
                        msg = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(sock, msg)
        finally:
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(0)
            sock.close(self.config.linger_ms)

    def _monitor_event(self, monitor: zmq.Socket) -> None:
        from zmq.utils.monitor import recv_monitor_message

        try:
            ev = recv_monitor_message(monitor, zmq.NOBLOCK)
        except zmq.Again:
            return
        name = getattr(ev.get("event"), "name", str(ev.get("event")))
        log.warning("%s: refused a connection: %s", self.name, name)
        if self._on_auth_failure is not None:
            self._on_auth_failure(name)

    def _handle(self, sock: zmq.Socket, msg: list[Any]) -> None:
        if len(msg) < 1:
            return
        ident, body = msg[0], msg[1:]
        try:
            replies = self.handler(body)
        except Exception:
            # A handler bug must not stop the server; it is logged with its traceback.
            self.handler_errors += 1
            log.exception("%s: handler failed on a message of %d frames", self.name, len(body))
            return
        for reply in replies:
            try:
                sock.send_multipart([ident, *reply], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.dropped_replies += 1
            except zmq.ZMQError as e:  # peer gone (host unreachable): the actor asks again
                self.dropped_replies += 1
                log.debug("%s: reply not sent: %s", self.name, e)


# ---------------------------------------------------------------------------- actor side


class ActorLink:
    """The actor's two DEALER sockets, used from one asyncio event loop.

    - `send(frames)`: a trajectory on the data link (waits up to `send_timeout_s` for room);
    - acknowledgements and learner heartbeats arriving on the data link go to `on_ack(ids)`
      and update `learner_version` / `last_heard["data"]`; refusals to
      `on_refuse(ids, reason)`;
    - `request(msg, match)`: one control request at a time, the first reply for which
      `match(reply)` is true, or None after `request_timeout_s`.
    """

    def __init__(
        self,
        config: TransportConfig,
        *,
        on_ack: Callable[[tuple[str, ...]], None],
        actor_id: str,
        on_refuse: Callable[[tuple[str, ...], str], None] | None = None,
    ) -> None:
        self.config = config
        self.actor_id = actor_id
        self._on_ack = on_ack
        self._on_refuse = on_refuse
        self._ctx = zmq.asyncio.Context()
        self.data = connect_dealer(self._ctx, config.data, config)
        self.control = connect_dealer(self._ctx, config.control, config)
        self._control_lock = asyncio.Lock()
        self._reader: asyncio.Task | None = None
        self.learner_version = -1
        """The newest policy version the learner publishes (from its heartbeats); -1 unknown."""
        self.last_heard = {"data": 0.0}
        """time.monotonic() of the last message from the learner's ingest (0: never)."""
        self.control_timeouts = 0
        """Control requests that got no answer in time (consecutive; 0 after an answer)."""
        self.bad_messages = 0

    def start(self) -> None:
        self._reader = asyncio.create_task(self._read_data(), name="actor-link-reader")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        # destroy() closes whatever socket is still open, with a bounded linger: a queued
        # message to a learner that is gone must not keep the process alive.
        self._ctx.destroy(linger=self.config.linger_ms)

    async def send(self, frames: Frames, timeout: float | None = None) -> bool:
        """Queue one message on the data link; False when there was no room in time."""
        # Try at once: polling first would cost an event-loop round trip per message.
        with contextlib.suppress(zmq.Again):
            self.data.send_multipart(list(frames), zmq.NOBLOCK, copy=False)
            return True
        t = self.config.send_timeout_s if timeout is None else timeout
        if not await self.data.poll(int(t * 1000), zmq.POLLOUT):
            return False
        try:
            self.data.send_multipart(list(frames), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def _heard(self, msg: wire.Message, link: str) -> None:
        if link == "control":
            self.control_timeouts = 0
        else:
            self.last_heard[link] = time.monotonic()
        if isinstance(msg, wire.Heartbeat) and msg.role == "learner":
            self.learner_version = max(self.learner_version, msg.version)

    async def _read_data(self) -> None:
        while True:
            frames = await self.data.recv_multipart()
            try:
                msg = wire.decode(frames)
            except WireError as e:
                self.bad_messages += 1
                log.warning("actor %s: malformed message from the learner: %s", self.actor_id, e)
                continue
            self._heard(msg, "data")
            if isinstance(msg, wire.Ack):
                self._on_ack(msg.ids)
            elif isinstance(msg, wire.Refuse) and self._on_refuse is not None:
                self._on_refuse(msg.ids, msg.reason)

    async def heartbeat(self, hb: wire.Heartbeat) -> None:
        """Send a heartbeat on the data link (never waits: a full queue skips it). The
        control link needs none: every request there is answered or times out."""
        with contextlib.suppress(zmq.Again):
            self.data.send_multipart(wire.encode(hb), zmq.NOBLOCK)

    async def request(
        self,
        msg: wire.Message,
        match: Callable[[wire.Message], bool],
        timeout: float | None = None,
    ) -> wire.Message | None:
        """Send a control request and wait for its reply (None on timeout)."""
        t = self.config.request_timeout_s if timeout is None else timeout
        async with self._control_lock:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + t
            if not await self.control.poll(int(t * 1000), zmq.POLLOUT):
                return None
            try:
                self.control.send_multipart(wire.encode(msg), zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            while (left := deadline - loop.time()) > 0:
                if not await self.control.poll(max(1, int(left * 1000)), zmq.POLLIN):
                    break
                frames = await self.control.recv_multipart()
                try:
                    reply = wire.decode(frames)
                except WireError as e:
                    self.bad_messages += 1
                    log.warning("actor %s: malformed control reply: %s", self.actor_id, e)
                    continue
                self._heard(reply, "control")
                if match(reply):
                    return reply
            self.control_timeouts += 1
            return None


# ---------------------------------------------------------------------------- weights


class WeightsServer:
    """The learner's newest weights as a safetensors byte stream, served in chunks.

    `publish(version, data, path)` replaces what is served; `handle(request)` answers a
    `WeightsRequest` with the announcement (chunk -1, or an outdated version) or a chunk.
    Thread-safe (the control server's thread serves while the trainer publishes).
    """

    def __init__(self, chunk_bytes: int = 32 << 20) -> None:
        if not 1 <= chunk_bytes <= wire.MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in 1..{wire.MAX_CHUNK_BYTES}")
        self.chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._data: memoryview | None = None
        self._announce: wire.WeightsAnnounce | None = None

    @property
    def version(self) -> int:
        """The version served (-1 before the first publish)."""
        with self._lock:
            return self._announce.version if self._announce is not None else -1

    def publish(self, version: int, data: bytes | bytearray | memoryview, path: str = "") -> None:
        """Serve `data` (a safetensors stream) as `version`; `path` names the same file if the
        learner wrote it to a filesystem actors may share."""
        import hashlib

        mv = memoryview(data).cast("B")
        ann = wire.WeightsAnnounce(
            version=version,
            nbytes=mv.nbytes,
            chunks=-(-mv.nbytes // self.chunk_bytes),
            chunk_bytes=self.chunk_bytes,
            sha256=hashlib.sha256(mv).hexdigest(),
            path=str(path),
        )
        with self._lock:
            self._data, self._announce = mv, ann

    def handle(self, req: wire.WeightsRequest) -> list[Frames]:
        with self._lock:
            ann, data = self._announce, self._data
        if ann is None or data is None:
            return []
        if req.chunk < 0 or req.version != ann.version or req.chunk >= ann.chunks:
            return [wire.encode(ann)]
        lo = req.chunk * ann.chunk_bytes
        chunk = wire.WeightsChunk(
            ann.version, req.chunk, ann.chunks, data[lo : lo + ann.chunk_bytes]
        )
        return [wire.encode(chunk)]


async def fetch_weights(
    link: ActorLink, timeout: float | None = None
) -> tuple[wire.WeightsAnnounce, bytes | Path] | None:
    """Fetch the learner's newest weights: the file path (shared filesystem) or the bytes.

    Chunks are requested one at a time; a new version appearing mid-way restarts the
    fetch; a missing reply (learner gone) gives None. The stream is checked against the
    announced SHA-256.
    """
    import hashlib

    ann = await link.request(
        wire.WeightsRequest(0, -1), lambda m: isinstance(m, wire.WeightsAnnounce), timeout
    )
    if not isinstance(ann, wire.WeightsAnnounce):
        return None
    for _ in range(8):  # restarts when the learner publishes again mid-fetch
        if ann.path:
            p = Path(ann.path)
            try:
                if p.is_file() and p.stat().st_size == ann.nbytes:
                    return ann, p
            except OSError:
                pass
        buf = bytearray(ann.nbytes)
        restarted = False
        for i in range(ann.chunks):
            reply = await link.request(
                wire.WeightsRequest(ann.version, i),
                lambda m, i=i: (
                    (isinstance(m, wire.WeightsChunk) and m.index == i)
                    or isinstance(m, wire.WeightsAnnounce)
                ),
                timeout,
            )
            if reply is None:
                return None
            if isinstance(reply, wire.WeightsAnnounce):
                if reply.version != ann.version:
                    ann, restarted = reply, True
                    break
                return None  # the same version but our chunk index was refused: give up
            assert isinstance(reply, wire.WeightsChunk)
            data = memoryview(reply.data).cast("B")
            lo = i * ann.chunk_bytes
            if reply.version != ann.version or lo + data.nbytes > ann.nbytes:
                ann, restarted = ann, True
                break
            buf[lo : lo + data.nbytes] = data
        if restarted:
            continue
        if hashlib.sha256(buf).hexdigest() != ann.sha256:
            log.warning("weights v%d: checksum mismatch, fetching again", ann.version)
            continue
        return ann, bytes(buf)
    return None

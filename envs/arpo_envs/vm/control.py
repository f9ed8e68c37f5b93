"""The VM fleet's control API, and the fleet process that serves it.

    python -m arpo_envs.vm.control '<FleetConfig as JSON>'   # what `up` starts, detached

The process runs one `supervisor.Fleet` and answers for it (`make_app`) until SIGTERM /
SIGINT, then stops every VM and removes the fleet's folder (`serve`).

- **Control API** on `control_host` (127.0.0.1 by default), every request with the
  fleet's bearer token (random; in the state file, mode 0600): `GET /fleet`,
  `GET /vms/<name>`, `POST /vms/<name>/revert`, `POST /vms/<name>/report`,
  `GET /vms/<name>/health`, `POST /vms/<name>/snapshot`, `POST /snapshots/<id>/fork`,
  `DELETE /snapshots/<id>`.
  Every body and every answer is a typed, versioned record of `arpo_envs.fleet_records`
  (`encode` / `decode`), a JSON object of at most a few KB (the actor's provider reads at
  most 1 MiB): a revert answers 200 `Reverted`, 409 `Quarantined` for a quarantined task,
  503 `Failure` (with the VM's state) when it failed; a body that is not the record the
  endpoint takes (not JSON, nested too deeply, another version, a field missing or of the
  wrong type) is 400 `Failure` naming the field, a wrong token 401 `Failure`; what the
  web server refuses itself (a body over 1 MiB 413, an unknown route 404, a method a
  route does not take 405 with its `Allow` header) and an error of the app (500) are
  `Failure` records too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import shutil
import signal
import sys
from typing import Any

from arpo_envs.fleet_records import (
    Failure,
    FleetRecordError,
    ForkRequest,
    ReportRequest,
    RevertRequest,
    SnapshotRequest,
    TaskQuarantined,
    VMHealth,
    VMReport,
    decode,
    encode,
)
from arpo_envs.vm.qemu import MachineConfig, VMError
from arpo_envs.vm.supervisor import Fleet, FleetConfig, Member, Refused

log = logging.getLogger("arpo_envs.vm.fleet")


def make_app(fleet: Fleet) -> Any:
    """The control API of `fleet`: every body it takes and every answer a record of
    `arpo_envs.fleet_records` (module docstring, *Control API*)."""
    from aiohttp import web

    def answer(rec: Any, status: int = 200) -> web.Response:
        return web.json_response(encode(rec), status=status)

    def refused(cls: type[web.HTTPException], error: str) -> web.HTTPException:
        """An answer that ends the request where it is raised (a Failure record)."""
        return cls(text=json.dumps(encode(Failure(error))), content_type="application/json")

    @web.middleware
    async def records(request: web.Request, handler: Any) -> web.StreamResponse:
        """What aiohttp answers itself (413 a body over client_max_size, 404 no such route,
        405 a method the route does not take) and what the handlers did not expect (500),
        as `Failure` records like every other answer; its status and headers kept."""
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.content_type == "application/json" or e.status < 400:
                raise  # a Failure already (`refused`), or a redirect
            why = e.text or e.reason
            if e.status == 404:
                why = f"no route {request.method} {request.path!r:.200}: {why}"
            elif e.status == 413:
                why = f"request body too large (a control API body is a few KB): {why}"
            elif e.status == 405:
                why = f"{request.method} is not allowed here; allowed: {e.headers.get('Allow')}"
            out = answer(Failure(why), e.status)
            if "Allow" in e.headers:
                out.headers["Allow"] = e.headers["Allow"]
            return out
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("control API: %s %s failed", request.method, request.path)
            return answer(Failure(f"internal error of the fleet: {type(e).__name__}: {e}"), 500)

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        import hmac

        got = request.headers.get("Authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {fleet.token}".encode()):
            return answer(Failure("missing or wrong fleet token"), 401)
        return await handler(request)

    def member(request: web.Request) -> Member:
        m = fleet.find(request.match_info["name"])
        if m is None:
            msg = f"no VM {request.match_info['name']!r}; VMs: {', '.join(fleet.members)}"
            if fleet.clones:
                msg += f"; clones: {', '.join(fleet.clones)}"
            raise refused(web.HTTPNotFound, msg)
        return m

    async def body(request: web.Request, cls: type[Any]) -> Any:
        """The request's body as the record `cls`; 400 naming what is wrong otherwise."""
        try:
            data = await request.json()
        except (ValueError, UnicodeDecodeError) as e:
            raise refused(web.HTTPBadRequest, f"body is not JSON: {e}") from None
        except RecursionError:  # JSON nested deeper than Python's parser goes
            raise refused(web.HTTPBadRequest, "body is not JSON: nested too deeply") from None
        try:
            return decode(data, cls)
        except FleetRecordError as e:
            raise refused(web.HTTPBadRequest, f"body is not a {cls.RECORD}: {e}") from None

    async def get_fleet(request: web.Request) -> web.Response:
        return answer(fleet.status())

    async def get_vm(request: web.Request) -> web.Response:
        return answer(VMReport(member(request).status()))

    async def revert(request: web.Request) -> web.Response:
        m = member(request)
        req: RevertRequest = await body(request, RevertRequest)
        try:
            return answer(await fleet.revert(m, req.task_id))
        except TaskQuarantined as e:
            return answer(e.record(), 409)
        except Refused as e:
            return answer(Failure(str(e), m.state), e.status)
        except VMError as e:
            return answer(Failure(str(e), m.state), 503)

    async def snapshot(request: web.Request) -> web.Response:
        m = member(request)
        await body(request, SnapshotRequest)
        try:
            return answer(await fleet.shielded(fleet.snapshot(m)))
        except Refused as e:
            return answer(Failure(str(e), m.state), e.status)
        except VMError as e:
            return answer(Failure(str(e), m.state), 503)

    async def fork(request: web.Request) -> web.Response:
        req: ForkRequest = await body(request, ForkRequest)
        try:
            return answer(await fleet.shielded(fleet.fork(request.match_info["id"], req.n)))
        except Refused as e:
            return answer(Failure(str(e)), e.status)
        except VMError as e:
            return answer(Failure(str(e)), 503)

    async def release(request: web.Request) -> web.Response:
        try:
            return answer(await fleet.shielded(fleet.release(request.match_info["id"])))
        except Refused as e:
            return answer(Failure(str(e)), e.status)

    async def report(request: web.Request) -> web.Response:
        m = member(request)
        req: ReportRequest = await body(request, ReportRequest)
        return answer(fleet.report(m, req.task_id, req.ok, req.error[:2000]))

    async def health(request: web.Request) -> web.Response:
        m = member(request)
        if m.state != "ready":
            return answer(VMHealth(False, m.state, m.last_error))
        ok, why = await fleet.check(m)
        if not ok and m.state != "ready":  # failed meanwhile (its QEMU exited): say why
            why = m.last_error or why
        return answer(VMHealth(ok, m.state, why))

    app = web.Application(middlewares=[records, auth], client_max_size=1 << 20)
    app.router.add_get("/fleet", get_fleet)
    app.router.add_get("/vms/{name}", get_vm)
    app.router.add_post("/vms/{name}/revert", revert)
    app.router.add_post("/vms/{name}/report", report)
    app.router.add_get("/vms/{name}/health", health)
    app.router.add_post("/vms/{name}/snapshot", snapshot)
    app.router.add_post("/snapshots/{id}/fork", fork)
    app.router.add_delete("/snapshots/{id}", release)
    return app


async def serve(config: FleetConfig, announce: Any = print) -> None:
    """Run the fleet until SIGTERM / SIGINT; then stop every VM and remove the folder."""
    from aiohttp import web

    fleet = Fleet(config)
    fleet.dir.mkdir(parents=True, exist_ok=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(make_app(fleet), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, config.control_host, config.control_port)
    await site.start()
    fleet._control_port = runner.addresses[0][1]
    fleet.write_state(ready=False)
    try:
        starting = asyncio.create_task(fleet.start())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            return
        starting.result()
        fleet.write_state(ready=True)
        for m in fleet.members.values():
            announce(f"vm {m.name} {m.vm.url} accel {fleet.machine.accel}")
        fleet.spawn(fleet.health_loop())
        await stop.wait()
    finally:
        await fleet.stop()
        await runner.cleanup()
        shutil.rmtree(fleet.dir, ignore_errors=True)


def config_from_json(raw: str) -> FleetConfig:
    d = json.loads(raw)
    d["machine"] = MachineConfig(**d.get("machine", {}))
    return FleetConfig(**d)


def main(argv: list[str] | None = None) -> int:
    """`python -m arpo_envs.vm.control '<FleetConfig as JSON>'`: the detached fleet process."""
    p = argparse.ArgumentParser(prog="python -m arpo_envs.vm.control")
    p.add_argument("config", help="FleetConfig as JSON")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(serve(config_from_json(args.config), announce=lambda s: print(s, flush=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

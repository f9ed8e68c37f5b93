"""The `arpo-envs` command: start environment servers, write task files.

    arpo-envs sim -n 8 --base-port 5100                  # 8 simulated desktops, 5100..5107
    arpo-envs sim -n 8 --latency lognormal:40,0.6 --slow-env 3 --slow-factor 5
    arpo-envs sim --host 0.0.0.0 --token "$ARPO_ENV_TOKEN"  # exposed: a token is required
    arpo-envs sim-tasks --out /tmp/sim_tasks -n 16       # OSWorld-schema tasks + oracles
    arpo-envs sim-bench -n 8                             # step latency and throughput
    arpo-envs up -n 8 --base-port 5200                   # 8 real Xvfb desktops (5200..5207)
    arpo-envs up -n 8 --detach; arpo-envs down           # in the background; stop from any shell
    arpo-envs status                                     # which desktops run (JSON)
    arpo-envs up -n 8 --tokens --tokens-file t.json      # each desktop its own token (0600 file)
    arpo-envs vm build                                   # the test VM image (Debian packages)
    arpo-envs vm up -n 2 --detach                        # QEMU VMs, reverted before each episode
    arpo-envs vm status; arpo-envs vm down               # counters; stop, leaving nothing behind

`sim` prints one line per desktop (`env <i> <url>`) once all are listening, and
stops cleanly on Ctrl-C or SIGTERM. The desktops (`up` / `status` / `down`) and the VMs
(`vm up` / `vm status` / `vm down`) are driven the same way (`arpo_envs.fleet`); `status`
prints a `FleetStatus` record (`arpo_envs.fleet_records`) as JSON and exits 1 when nothing
runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path


def _sim(args: argparse.Namespace) -> int:
    from arpo_envs.sim.latency import LatencyConfig
    from arpo_envs.sim.server import SimConfig, serve_until

    token = args.token or os.environ.get("ARPO_ENV_TOKEN") or None
    try:
        latency = LatencyConfig.parse(
            args.latency, slow_env=args.slow_env, slow_factor=args.slow_factor, seed=args.seed
        )
        configs = [
            SimConfig(
                width=args.width,
                height=args.height,
                host=args.host,
                port=0 if args.base_port == 0 else args.base_port + i,
                token=token,
                draw_cursor=not args.no_cursor,
                sleep_cap_s=args.sleep_cap,
                latency=latency,
                index=i,
                offload_encode=not args.encode_in_loop,
            )
            for i in range(args.n)
        ]
    except ValueError as e:
        print(f"arpo-envs sim: {e}", file=sys.stderr)
        return 2

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve_until(configs, stop, announce=lambda s: print(s, flush=True))

    asyncio.run(main())
    print("arpo-envs sim: stopped", flush=True)
    return 0


def _sim_tasks(args: argparse.Namespace) -> int:
    from arpo_envs.sim.tasks import FAMILIES, write_tasks

    families = list(FAMILIES) if args.families == "all" else args.families.split(",")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        print(
            f"arpo-envs sim-tasks: unknown families {unknown}; known: {', '.join(FAMILIES)}",
            file=sys.stderr,
        )
        return 2
    index = write_tasks(Path(args.out), families, args.n, args.seed, (args.width, args.height))
    total = sum(len(ids) for ids in index.values())
    print(f"wrote {total} tasks of {len(index)} families to {args.out}")
    return 0


def _sim_bench(args: argparse.Namespace) -> int:
    from arpo_envs.sim.bench import main as bench

    extra = ["--width", str(args.width), "--height", str(args.height), "--latency", args.latency]
    extra += ["--encode-in-loop"] if args.encode_in_loop else []
    return bench(args.n, args.episodes, extra)


def _up(args: argparse.Namespace) -> int:
    from arpo_envs.desktop.fleet import FleetConfig, up, wait_foreground

    if os.environ.get("ARPO_ENV_TOKEN"):
        print(
            "arpo-envs up: ARPO_ENV_TOKEN is not used (one token for every desktop would let "
            "code on one drive all); --tokens gives each desktop its own, written to "
            "--tokens-file (mode 0600; the state file keeps only their sha256)",
            file=sys.stderr,
        )
    try:
        kwargs = {"state_file": Path(args.state)} if args.state else {}
        cfg = FleetConfig(
            n=args.n,
            base_port=args.base_port,
            host=args.host,
            tokens=args.tokens,
            tokens_file=Path(args.tokens_file) if args.tokens_file else None,
            width=args.width,
            height=args.height,
            files_template=args.files_template,
            atspi=args.atspi,
            a11y_max_nodes=args.a11y_max_nodes,
            **kwargs,
        )
        up(cfg, announce=lambda s: print(s, flush=True))
    except (ValueError, RuntimeError) as e:
        print(f"arpo-envs up: {e}", file=sys.stderr)
        return 1
    if args.detach:
        print(f"arpo-envs up: detached; stop with `arpo-envs down` (state {cfg.state_file})")
        return 0
    wait_foreground(cfg.state_file)
    return 0


def _status(args: argparse.Namespace) -> int:
    from arpo_envs.desktop.fleet import status
    from arpo_envs.fleet_records import dumps

    try:
        st = status(Path(args.state) if args.state else None)
    except (OSError, ValueError) as e:  # a state file that is not one
        print(f"arpo-envs status: {e}", file=sys.stderr)
        return 2
    print(dumps(st))
    return 0 if st.running else 1


def _down(args: argparse.Namespace) -> int:
    from arpo_envs.desktop.fleet import down

    try:
        down(Path(args.state) if args.state else None, grace_s=args.grace)
    except (OSError, ValueError) as e:  # a state file that is not one
        print(f"arpo-envs down: {e}", file=sys.stderr)
        return 1
    return 0


def _vm_build(args: argparse.Namespace) -> int:
    import logging

    from arpo_envs.vm.image import BuildError, build, describe

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        img = build(force=args.force)
    except BuildError as e:
        print(f"arpo-envs vm build: {e}", file=sys.stderr)
        return 1
    print(json.dumps(describe(img), indent=2))
    return 0


def _vm_config(args: argparse.Namespace) -> object:
    from arpo_envs.vm.fleet import FleetConfig
    from arpo_envs.vm.qemu import MachineConfig

    return FleetConfig(
        n=args.n,
        dir=args.dir or "",
        image=args.image or "",
        base_port=args.base_port,
        machine=MachineConfig(
            memory_mb=args.memory or (4096 if args.image else 1536), cpus=args.cpus,
            accel=args.accel, width=args.width, height=args.height, internet=args.internet,
            firmware=args.firmware or ("uefi" if args.image else "bios"),
        ),
        health_interval_s=args.health_interval,
        max_clones=args.max_clones,
        max_snapshots=args.max_snapshots,
        snapshot_ttl_s=args.snapshot_ttl,
        snapshot_ram_dir=args.snapshot_ram_dir,
    )  # fmt: skip


def _vm_up(args: argparse.Namespace) -> int:
    import logging

    from arpo_envs.vm.fleet import run_foreground, up

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        cfg = _vm_config(args)
        announce = lambda s: print(s, flush=True)  # noqa: E731
        if args.detach:
            up(cfg, announce=announce)  # type: ignore[arg-type]
        else:
            run_foreground(cfg, announce=announce)  # type: ignore[arg-type]
    except (ValueError, RuntimeError) as e:
        print(f"arpo-envs vm up: {e}", file=sys.stderr)
        return 1
    return 0


def _vm_state_file(args: argparse.Namespace) -> Path:
    from arpo_envs.vm.fleet import STATE_FILE, default_dir

    return (Path(args.dir) if args.dir else default_dir()) / STATE_FILE


def _vm_status(args: argparse.Namespace) -> int:
    from arpo_envs.fleet_records import dumps
    from arpo_envs.vm.fleet import status

    st = status(_vm_state_file(args))
    print(dumps(st))
    return 0 if st.running else 1


def _vm_down(args: argparse.Namespace) -> int:
    from arpo_envs.vm.fleet import down

    down(_vm_state_file(args), grace_s=args.grace)
    return 0


def _add_vm_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    vm = sub.add_parser("vm", help="QEMU VMs: build the test image, start, status, stop")
    vsub = vm.add_subparsers(dest="vm_command", required=True)
    b = vsub.add_parser("build", help="build the test image from Debian's packages (cached)")
    b.add_argument("--force", action="store_true", help="rebuild even when cached")
    b.set_defaults(func=_vm_build)
    u = vsub.add_parser("up", help="start N VMs (copy-on-write overlays, snapshot reverts)")
    u.add_argument("-n", type=int, default=1, help="number of VMs (default 1)")
    u.add_argument("--dir", default=None, help="fleet folder (default /tmp/arpo-vm-fleet-<uid>)")
    u.add_argument("--image", default=None, help="a qcow2 to boot instead (OSWorld's Ubuntu.qcow2)")
    u.add_argument("--base-port", type=int, default=0, help="VM i on 127.0.0.1:base-port+i")
    u.add_argument(
        "--memory", type=int, default=0, help="guest MB (default 1536; 4096 with --image)"
    )
    u.add_argument(
        "--firmware",
        choices=["bios", "uefi"],
        default=None,
        help="default bios; uefi with --image (OSWorld's Ubuntu.qcow2 needs it)",
    )
    u.add_argument("--cpus", type=int, default=1, help="virtual CPUs (default 1)")
    u.add_argument("--accel", default="auto", choices=["auto", "kvm", "tcg"])
    u.add_argument("--width", type=int, default=1280)
    u.add_argument("--height", type=int, default=720)
    u.add_argument("--internet", action="store_true", help="let the guests reach other hosts")
    u.add_argument("--health-interval", type=float, default=30.0, help="seconds (0: none)")
    u.add_argument(
        "--max-clones", type=int, default=8, help="forked VMs alive at once (0: no forks)"
    )
    u.add_argument("--max-snapshots", type=int, default=4, help="saved states held at once")
    u.add_argument(
        "--snapshot-ttl", type=float, default=1800.0, help="seconds before an unreleased one goes"
    )
    u.add_argument(
        "--snapshot-ram-dir", default="", help="folder of the saved states' RAM (default /dev/shm)"
    )
    u.add_argument("--detach", action="store_true", help="return once every VM answers")
    u.set_defaults(func=_vm_up)
    s = vsub.add_parser("status", help="state, accelerator and counters of the fleet")
    s.add_argument("--dir", default=None)
    s.set_defaults(func=_vm_status)
    d = vsub.add_parser("down", help="stop the fleet and remove its folder (from any shell)")
    d.add_argument("--dir", default=None)
    d.add_argument("--grace", type=float, default=15.0, help="seconds before SIGKILL")
    d.set_defaults(func=_vm_down)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="arpo-envs", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("sim", help="start N simulated desktops in one process")
    s.add_argument("-n", type=int, default=1, help="number of desktops (default 1)")
    s.add_argument(
        "--base-port",
        type=int,
        default=5000,
        help="desktop i listens on base-port + i (0: any free ports)",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--token", default=None, help="bearer token (default: $ARPO_ENV_TOKEN)")
    s.add_argument("--width", type=int, default=1280)
    s.add_argument("--height", type=int, default=720)
    s.add_argument(
        "--latency", default="none", help="none | fixed:<ms> | lognormal:<median ms>[,<sigma>]"
    )
    s.add_argument("--slow-env", type=int, default=None, help="index of the one slow desktop")
    s.add_argument("--slow-factor", type=float, default=1.0, help="its latency multiplier")
    s.add_argument("--seed", type=int, default=0, help="seed of the latency draws")
    s.add_argument(
        "--sleep-cap",
        type=float,
        default=0.0,
        help="wait time.sleep of actions up to this many seconds (default 0)",
    )
    s.add_argument("--no-cursor", action="store_true", help="no pointer in screenshots")
    s.add_argument(
        "--encode-in-loop",
        action="store_true",
        help="encode screenshots on the event loop, not in a worker thread",
    )
    s.set_defaults(func=_sim)

    t = sub.add_parser("sim-tasks", help="write OSWorld-schema task files with oracles")
    t.add_argument("--out", required=True, help="output directory")
    t.add_argument("--families", default="all", help="comma-separated families (default all)")
    t.add_argument("-n", type=int, default=16, help="tasks per family (default 16)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--width", type=int, default=1280)
    t.add_argument("--height", type=int, default=720)
    t.set_defaults(func=_sim_tasks)

    b = sub.add_parser("sim-bench", help="measure step latency and throughput over HTTP")
    b.add_argument("-n", type=int, default=1, help="concurrent desktops and clients (default 1)")
    b.add_argument("--episodes", type=int, default=20, help="oracle episodes per client")
    b.add_argument("--width", type=int, default=1280)
    b.add_argument("--height", type=int, default=720)
    b.add_argument("--latency", default="none", help="latency of the desktops (see sim)")
    b.add_argument("--encode-in-loop", action="store_true", help="see sim --encode-in-loop")
    b.set_defaults(func=_sim_bench)

    u = sub.add_parser("up", help="start N local desktops (Xvfb + openbox + real apps)")
    u.add_argument("-n", type=int, default=1, help="number of desktops (default 1)")
    u.add_argument(
        "--base-port", type=int, default=5200, help="desktop i on base-port + i (0: any free)"
    )
    u.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    u.add_argument(
        "--tokens",
        action="store_true",
        help="each desktop its own random bearer token (the state file keeps only its sha256)",
    )
    u.add_argument(
        "--tokens-file",
        default=None,
        help="with --tokens: write the tokens here (mode 0600, removed by `down`), for an "
        "actor started from another shell: its `env_tokens`",
    )
    u.add_argument("--width", type=int, default=1280)
    u.add_argument("--height", type=int, default=720)
    u.add_argument("--files-template", default=None, help="directory copied to home on reset")
    u.add_argument(
        "--atspi",
        action="store_true",
        help="a session bus, the AT-SPI registry and LibreOffice's GTK 3 plugin per desktop: "
        "/accessibility gives GTK apps' and LibreOffice's whole trees (for the a11y_tree, "
        "screenshot_a11y_tree and som observations)",
    )
    u.add_argument(
        "--a11y-max-nodes",
        type=int,
        default=10_000,
        help="with --atspi: most nodes one /accessibility answer walks (the rest is left out)",
    )
    u.add_argument("--state", default=None, help="state file (default $ARPO_DESKTOP_STATE or /tmp)")
    u.add_argument("--detach", action="store_true", help="return once all desktops answer")
    u.set_defaults(func=_up)

    st = sub.add_parser("status", help="which desktops started by `up` run (from any shell)")
    st.add_argument("--state", default=None, help="state file of `up`")
    st.set_defaults(func=_status)

    d = sub.add_parser("down", help="stop the desktops started by `up` (from any shell)")
    d.add_argument("--state", default=None, help="state file of `up`")
    d.add_argument("--grace", type=float, default=10.0, help="seconds before SIGKILL")
    d.set_defaults(func=_down)
    _add_vm_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "n", 1) < 1:
        print("arpo-envs: -n must be at least 1", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

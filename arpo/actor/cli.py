"""The `arpo-actor` command: one actor process.

    arpo-actor sim_envs=8 policy=scripted spool_dir=runs/actor-0          # simulated desktops
    arpo-actor 'envs=["http://10.0.0.5:5000","http://10.0.0.6:5000"]' engine.model=runs/tiny \\
               transport.data=tcp://learner:5555 transport.control=tcp://learner:5556 \\
               transport.curve_secret_key=keys/actor.key_secret \\
               transport.curve_server_key=keys/learner.key
    arpo-actor --show-config                                               # every field

SIGTERM or Ctrl-C: stop taking grants, finish in-flight episodes within the deadline,
flush the spool, exit 0. Exit code 1 if a component failed, 2 for a bad configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from arpo.config import describe, load_config
from arpo.errors import ConfigError
from arpo.logs import setup_process


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="arpo-actor", description="Run episodes for the learner.")
    ap.add_argument("--config", help="TOML file with config fields")
    ap.add_argument("--show-config", action="store_true", help="list every config field and exit")
    ap.add_argument("--log-level", default="INFO", help="level of arpo's logs (default INFO)")
    ap.add_argument("overrides", nargs="*", metavar="field=value", help="override a config field")
    args = ap.parse_args(argv)

    from arpo.actor.actor import Actor, install_signal_handlers
    from arpo.actor.config import ActorConfig

    if args.show_config:
        print(describe(ActorConfig))
        return 0
    try:
        cfg = load_config(ActorConfig, args.config, args.overrides)
    except ConfigError as e:
        print(f"arpo-actor: {e}", file=sys.stderr)
        return 2
    setup_process(args.log_level)

    async def run() -> bool:
        actor = Actor(cfg)
        install_signal_handlers(actor)
        await actor.run()
        return not actor.failed

    ok = asyncio.run(run())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

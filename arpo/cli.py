"""The `arpo` command.

arpo demo [--config FILE] [field=value ...]    the smallest end-to-end run (see arpo.demo)
arpo demo --show-config                        every config field with its default and meaning
arpo select-tasks [--config FILE] [field=value ...]   N base-agent runs per task, keep the solvable
"""

from __future__ import annotations

import argparse
import sys

from arpo.config import describe, load_config
from arpo.errors import ConfigError


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file with config fields")
    p.add_argument("--show-config", action="store_true", help="list every config field and exit")
    p.add_argument(
        "overrides", nargs="*", metavar="field=value", help="override a config field (TOML value)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="arpo", description="ARPO: RL for GUI agents")
    sub = ap.add_subparsers(dest="command", required=True)
    _add_config_args(sub.add_parser("demo", help="the smallest end-to-end run of the data path"))
    _add_config_args(
        sub.add_parser("select-tasks", help="run the base agent N times per task, keep solvable")
    )
    args = ap.parse_args(argv)

    if args.command == "demo":
        from arpo.demo import DemoConfig, run

        if args.show_config:
            print(describe(DemoConfig))
            return 0
        try:
            cfg = load_config(DemoConfig, args.config, args.overrides)
        except ConfigError as e:
            print(f"arpo demo: {e}", file=sys.stderr)
            return 2
        run(cfg)

    if args.command == "select-tasks":
        from arpo.learner.select import SelectConfig
        from arpo.learner.select import main as select_main

        if args.show_config:
            print(describe(SelectConfig))
            return 0
        try:
            cfg = load_config(SelectConfig, args.config, args.overrides)
        except ConfigError as e:
            print(f"arpo select-tasks: {e}", file=sys.stderr)
            return 2
        return select_main(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The `arpo` command.

arpo train [--config FILE] [field=value ...]   a whole training run on this machine (arpo.train)
arpo demo [--config FILE] [field=value ...]    the smallest end-to-end run (see arpo.demo)
arpo demo --show-config                        every config field with its default and meaning
arpo select-tasks [--config FILE] [field=value ...]   N base-agent runs per task, keep the solvable
arpo sft [--config FILE] [field=value ...]            oracle demonstrations + supervised warm start
arpo offline --algo dpo|kto|rft [field=value ...]     offline baselines on collected trajectories
arpo eval [--config FILE] [field=value ...]           success rates of a checkpoint / model
arpo collect [--config FILE] [field=value ...]        N runs per task, trajectories kept on disk
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
    _add_config_args(sub.add_parser("train", help="learner, actors, desktops, eval: one run"))
    _add_config_args(sub.add_parser("demo", help="the smallest end-to-end run of the data path"))
    _add_config_args(
        sub.add_parser("select-tasks", help="run the base agent N times per task, keep solvable")
    )
    _add_config_args(sub.add_parser("eval", help="success rates of a checkpoint on a task set"))
    _add_config_args(
        sub.add_parser("collect", help="run a model N times per task, keep trajectories")
    )
    _add_config_args(sub.add_parser("sft", help="oracle demonstrations + supervised warm start"))
    offline_parser = sub.add_parser("offline", help="DPO / KTO / RFT on collected trajectories")
    _add_config_args(offline_parser)
    offline_parser.add_argument("--algo", choices=["dpo", "kto", "rft"], help="the method")
    args = ap.parse_args(argv)

    if args.command == "train":
        import logging

        from arpo.errors import ArpoError
        from arpo.train import TrainConfig
        from arpo.train import main as train_main

        if args.show_config:
            print(describe(TrainConfig))
            return 0
        try:
            cfg = load_config(TrainConfig, args.config, args.overrides)
        except ConfigError as e:
            print(f"arpo train: {e}", file=sys.stderr)
            return 2
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr
        )
        try:
            return train_main(cfg)
        except ArpoError as e:
            print(f"arpo train: {e}", file=sys.stderr)
            return 1

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

    if args.command == "eval":
        from arpo.learner.evaluate import EvalConfig
        from arpo.learner.evaluate import main as eval_main

        if args.show_config:
            print(describe(EvalConfig))
            return 0
        try:
            cfg = load_config(EvalConfig, args.config, args.overrides)
        except ConfigError as e:
            print(f"arpo eval: {e}", file=sys.stderr)
            return 2
        return eval_main(cfg)

    if args.command == "collect":
        from arpo.learner.collect import CollectConfig
        from arpo.learner.collect import main as collect_main

        if args.show_config:
            print(describe(CollectConfig))
            return 0
        try:
            cfg = load_config(CollectConfig, args.config, args.overrides)
        except ConfigError as e:
            print(f"arpo collect: {e}", file=sys.stderr)
            return 2
        return collect_main(cfg)

    if args.command == "sft":
        import json

        from arpo.errors import ArpoError
        from arpo.offline.sft import SFTConfig
        from arpo.offline.sft import run as sft_run

        if args.show_config:
            print(describe(SFTConfig))
            return 0
        try:
            cfg = load_config(SFTConfig, args.config, args.overrides)
            summary = sft_run(cfg)
        except ConfigError as e:
            print(f"arpo sft: {e}", file=sys.stderr)
            return 2
        except ArpoError as e:
            print(f"arpo sft: {e}", file=sys.stderr)
            return 1
        print(f"arpo sft: {summary['demos']} demonstrations, final loss "
              f"{summary['final_loss']:.4f}, saved to {cfg.out}")  # fmt: skip
        print(json.dumps(summary, default=float))

    if args.command == "offline":
        import json

        from arpo.errors import ArpoError
        from arpo.offline.offline import OfflineConfig
        from arpo.offline.offline import run as offline_run

        if args.show_config:
            print(describe(OfflineConfig))
            return 0
        overrides = ([f"algo={args.algo}"] if args.algo else []) + list(args.overrides)
        try:
            cfg = load_config(OfflineConfig, args.config, overrides)
            summary = offline_run(cfg)
        except ConfigError as e:
            print(f"arpo offline: {e}", file=sys.stderr)
            return 2
        except ArpoError as e:
            print(f"arpo offline: {e}", file=sys.stderr)
            return 1
        print(f"arpo offline {cfg.algo}: {summary['steps']} steps, final loss "
              f"{summary['final_loss']:.4f}, saved to {cfg.out}")  # fmt: skip
        print(json.dumps(summary, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())

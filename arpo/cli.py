"""The `arpo` command.

arpo train [--config FILE] [field=value ...]          a whole training run on this machine (arpo.train)
arpo select-tasks [--config FILE] [field=value ...]   N base-agent runs per task, keep the solvable
arpo sft [--config FILE] [field=value ...]            oracle demonstrations + supervised warm start
arpo offline --algo dpo|kto|rft [field=value ...]     offline baselines on collected trajectories
arpo eval [--config FILE] [field=value ...]           success rates of a checkpoint / model
arpo collect [--config FILE] [field=value ...]        N runs per task, trajectories kept on disk
arpo audit-tasks [--config FILE] [field=value ...]    every task set up on its environments, checked
arpo COMMAND --show-config                            every config field with its default and meaning
arpo fetch --tasks DIR --cache DIR                    the files OSWorld tasks download (arpo.env.fetch)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from arpo.config import describe, load_config
from arpo.errors import ERRORS, ConfigError


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file with config fields")
    p.add_argument("--show-config", action="store_true", help="list every config field and exit")
    p.add_argument(
        "overrides", nargs="*", metavar="field=value", help="override a config field (TOML value)"
    )


# command -> (help, config class, runner): the runner takes the loaded config and returns
# the exit code; configuration errors exit 2, other arpo errors 1.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("learner, actors, desktops, eval: one run", "arpo.train:TrainConfig",
              "arpo.cli:_train"),
    "select-tasks": ("run the base agent N times per task, keep solvable",
                     "arpo.pool.select:SelectConfig", "arpo.pool.select:main"),
    "eval": ("success rates of a checkpoint on a task set", "arpo.pool.evaluate:EvalConfig",
             "arpo.pool.evaluate:main"),
    "collect": ("run a model N times per task, keep trajectories",
                "arpo.pool.collect:CollectConfig", "arpo.pool.collect:main"),
    "sft": ("oracle demonstrations + supervised warm start", "arpo.offline.sft:SFTConfig",
            "arpo.cli:_sft"),
    "offline": ("DPO / KTO / RFT on collected trajectories",
                "arpo.offline.offline:OfflineConfig", "arpo.cli:_offline"),
    "audit-tasks": ("set up every task on its environments; do-nothing and oracle scores",
                    "arpo.pool.audit:AuditConfig", "arpo.pool.audit:main"),
}  # fmt: skip


# command -> (help, main): commands with options of their own (no config class), given their
# arguments whole; `main(argv, prog=...)` returns the exit code.
TOOLS: dict[str, tuple[str, str]] = {
    "fetch": ("download the files OSWorld tasks need into the file cache (see --help)",
              "arpo.env.fetch:main"),
}  # fmt: skip


def _load(ref: str) -> Any:
    import importlib

    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def _train(cfg: Any) -> int:
    import logging

    from arpo.train import main as train_main

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr
    )
    return train_main(cfg)


def _sft(cfg: Any) -> int:
    from arpo.offline.sft import run

    summary = run(cfg)
    print(f"arpo sft: {summary['demos']} demonstrations, final loss "
          f"{summary['final_loss']:.4f}, saved to {cfg.out}")  # fmt: skip
    print(json.dumps(summary, default=float))
    return 0


def _offline(cfg: Any) -> int:
    from arpo.offline.offline import run

    summary = run(cfg)
    print(f"arpo offline {cfg.algo}: {summary['steps']} steps, final loss "
          f"{summary['final_loss']:.4f}, saved to {cfg.out}")  # fmt: skip
    print(json.dumps(summary, default=float))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in TOOLS:
        return int(_load(TOOLS[argv[0]][1])(argv[1:], prog=f"arpo {argv[0]}"))
    ap = argparse.ArgumentParser(prog="arpo", description="ARPO: RL for GUI agents")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, (help_text, _, _) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        _add_config_args(p)
        if name == "offline":
            p.add_argument("--algo", choices=["dpo", "kto", "rft"], help="the method")
    for name, (help_text, _) in TOOLS.items():
        sub.add_parser(name, help=help_text)  # listed in --help; run above, before parsing
    args = ap.parse_args(argv)

    _, config_ref, runner_ref = COMMANDS[args.command]
    config_cls = _load(config_ref)
    if args.show_config:
        print(describe(config_cls))
        return 0
    overrides = list(args.overrides)
    if getattr(args, "algo", None):
        overrides.insert(0, f"algo={args.algo}")
    try:
        cfg = load_config(config_cls, args.config, overrides)
        return int(_load(runner_ref)(cfg) or 0)
    except ConfigError as e:
        print(f"arpo {args.command}: {e}", file=sys.stderr)
        return 2
    except ERRORS as e:
        print(f"arpo {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

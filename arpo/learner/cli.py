"""The `arpo-learner` command: one learner process (or one rank of it under torchrun).

    arpo-learner trainer.model=runs/tiny tasks=envs/arpo_envs/tasks/local iterations=100
    arpo-learner --config learner.toml --resume          # continue from the last checkpoint
    arpo-learner --show-config                           # every field, default and meaning
    torchrun --nproc-per-node 8 -m arpo.learner.cli --config learner.toml   # FSDP2

SIGTERM or Ctrl-C: finish the current iteration, checkpoint, exit 0. Exit code 1 if a
component failed, 2 for a bad configuration, 3 when the run cannot go on (every task left
it, or no episode arrived for `stall_s`; the message and `<run_dir>/tasks_out.json` name
the tasks and why).
"""

from __future__ import annotations

import argparse
import sys

from arpo.config import describe, load_config
from arpo.errors import ERRORS, EXIT_STALLED, ConfigError, RunStalled
from arpo.logs import setup_process


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="arpo-learner", description="Train the policy on what the actors send."
    )
    ap.add_argument("--config", help="TOML file with config fields")
    ap.add_argument("--show-config", action="store_true", help="list every config field and exit")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    ap.add_argument("--log-level", default="INFO", help="level of arpo's logs (default INFO)")
    ap.add_argument("overrides", nargs="*", metavar="field=value", help="override a config field")
    args = ap.parse_args(argv)

    from arpo.learner.learner import LearnerConfig, run_learner

    if args.show_config:
        print(describe(LearnerConfig))
        return 0
    overrides = list(args.overrides) + (["resume=true"] if args.resume else [])
    try:
        cfg = load_config(LearnerConfig, args.config, overrides)
    except ConfigError as e:
        print(f"arpo-learner: {e}", file=sys.stderr)
        return 2
    setup_process(args.log_level)
    try:
        run_learner(cfg)
    except ConfigError as e:
        print(f"arpo-learner: {e}", file=sys.stderr)
        return 2
    except RunStalled as e:
        print(f"arpo-learner: {e}", file=sys.stderr)
        return EXIT_STALLED
    except ERRORS as e:
        print(f"arpo-learner: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

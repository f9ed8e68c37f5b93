"""`arpo train`: a whole training run on one machine — learner, actors, environments, eval.

    arpo train                                   # the embedded default (make demo's recipe):
                                                 # tiny model, simulated desktops, 90 iterations
    arpo train --config run.toml                 # any configuration (`--show-config` lists it)
    arpo train local_desktops=2                  # plus real desktops (Xvfb + LibreOffice ...)
    arpo train vms=2                             # plus QEMU VMs of the test image (arpo-envs vm)
    arpo train minutes=30 learner.iterations=0   # a wall-clock budget instead of iterations

What it does, in order (every stage logs what it starts and where its log goes):

1. the policy: `model`, or the tiny Qwen2.5-VL built into `<run_dir>/tiny`, warm-started
   with `arpo sft` on oracle demonstrations of the simulated tasks when `warm_start`;
2. the task pool: `tasks`, or simulated tasks generated into `<run_dir>/tasks`
   (`sim_families` x `sim_tasks_per_family`), plus the local desktop tasks when
   `local_desktops > 0`;
   then, with `eval_warm_start`, `arpo eval` of the starting policy on the simulated tasks,
   and with `prefill_runs_per_task`, `arpo collect` of the starting policy on them at the
   rollout sampling settings (`<run_dir>/prefill`), whose successes start ARPO's replay
   buffers (the paper's pipeline has this step, the reference code comments it out);
3. processes: `arpo-learner` (its config written to `<run_dir>/learner.toml`), `actors`
   `arpo-actor` processes with `sim_envs_per_actor` simulated desktops each, and with
   `local_desktops > 0` that many real desktops (`arpo-envs up`) driven by one more actor,
   with `vms > 0` a fleet of that many VMs (`arpo-envs vm up`, reverted to their snapshot
   before every episode) or with `vm_fleet` a fleet started elsewhere, driven by one more;
   each process logs to `<run_dir>/logs/`;
4. supervision: a progress line from the learner's metrics; an actor that dies is
   started again (its spool resends what the learner has not acknowledged), a learner
   that dies is started again with `--resume` (`restart`), each at most
   `max_restarts` times; after `minutes` (or when the learner has run `iterations`)
   the learner gets SIGTERM (it finishes the iteration and checkpoints), then the
   actors, then the desktops;
5. results: `<run_dir>/learner/metrics.jsonl` (+ TensorBoard files), a plot of success
   rate and reward against iteration with the starting policy's evaluation as a line
   (`<run_dir>/curve.png`), `arpo eval` of the final checkpoint on the simulated tasks of
   the pool (`<run_dir>/eval/eval.md`) beside the same evaluation of the starting policy,
   run before training (`<run_dir>/eval_warm/eval.md`, `eval_warm_start`), with standard
   errors, and the checkpoint's path.

With `cluster.address` set (a Ray cluster: `arpo train cluster.address=auto`), stage 3
places the simulated-desktop actors, one per node offering `arpo_sim`, on the cluster's
nodes instead, the learner staying here (`cluster.py`; docs/guides/scaling.md).

The package, one file per job: `config.py` (`TrainConfig`, its defaults and checks),
`supervise.py` (`TrainRun`: the processes of a run, their supervision and clean stop;
`main`), `cluster.py` (`Placement`, `NodeAgent`: the actors on a Ray cluster's nodes),
`report.py` (what a finished run reports: `account`, `plot_curves`, `verdict`,
`comparison`, `tasks_out_table`, `preflight_markdown`).
"""

from arpo.train.config import LIMITS, READER_SFT_LR, TrainConfig
from arpo.train.report import (
    account,
    comparison,
    plot_curves,
    preflight_markdown,
    tasks_out_table,
    verdict,
)
from arpo.train.supervise import RunInterrupted, TrainRun, _descendants, long_tasks, main

__all__ = [
    "LIMITS",
    "READER_SFT_LR",
    "RunInterrupted",
    "TrainConfig",
    "TrainRun",
    "_descendants",
    "account",
    "comparison",
    "long_tasks",
    "main",
    "plot_curves",
    "preflight_markdown",
    "tasks_out_table",
    "verdict",
]

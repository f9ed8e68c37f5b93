"""Environments: the OSWorld protocol client, the task type, and the task runner and checkers.

- `client`: async HTTP client of an OSWorld VM server or local desktop server;
- `task`: OSWorld task files parsed into frozen dataclasses, and their loaders;
- `environment`: one environment's life: its provider's revert, the retried setup before
  every episode, health waits, quarantine, forks (`provider`: what reverts it);
- `runner`: setup steps, actions and evaluation with OSWorld's semantics;
- `a11y`: OSWorld's linearisation of the accessibility tree and its set-of-marks;
- `taskfiles`, `fetch`: task files by content, and fetching OSWorld's task files;
- `bringup`: the environments section of `arpo train` and `arpo audit-tasks`, and the
  bring-up and stop of the local desktops and VM fleets they start;
- `getters`, `metrics`, `xlsx`, `cache`: the checker's parts.
"""

from arpo.env.client import ClientConfig, EnvClient, ExecResult
from arpo.env.environment import Environment, EnvironmentConfig, SetupFailure
from arpo.env.runner import EvalResult, RunnerConfig, TaskRunner, unsupported
from arpo.env.task import (
    Evaluator,
    GetterSpec,
    PoolTask,
    Step,
    Task,
    load_index,
    load_pool,
    load_selection,
    load_task,
    load_task_pool,
    load_task_set,
    load_tasks,
    task_domain,
)

__all__ = [
    "ClientConfig",
    "EnvClient",
    "Environment",
    "EnvironmentConfig",
    "EvalResult",
    "Evaluator",
    "ExecResult",
    "GetterSpec",
    "PoolTask",
    "RunnerConfig",
    "SetupFailure",
    "Step",
    "Task",
    "TaskRunner",
    "load_index",
    "load_pool",
    "load_selection",
    "load_task",
    "load_task_pool",
    "load_task_set",
    "load_tasks",
    "task_domain",
    "unsupported",
]

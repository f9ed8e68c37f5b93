"""Pool runs: a policy run N times on every task of a pool, through the real rollout path.

    arpo select-tasks tasks=runs/task_pool runs_per_task=16 out=runs/selection.json
    arpo eval checkpoint=runs/learner/checkpoints tasks=runs/task_pool out=runs/eval
    arpo collect model=runs/tiny tasks=runs/task_pool out=runs/collect-base
    arpo audit-tasks tasks=envs/arpo_envs/tasks/local local_desktops=2

- `rollouts`: the shared core (`PoolConfig`, `run_pool`): grant server, ingest and
  `arpo-actor` processes as in training, one group of `runs_per_task` slots per task;
- `select`: `arpo select-tasks`, the tasks the base agent can solve;
- `evaluate`: `arpo eval`, success rates of a checkpoint or model by task and domain;
- `collect`: `arpo collect`, every trajectory kept on disk for the offline methods;
- `audit`: `arpo audit-tasks`, every task set up once on an environment of its pool,
  its checker scored on the untouched state and after its oracle, no policy (also
  `arpo train`'s preflight).

Nothing here trains: the runs use the services of `arpo.service` and read the learner's
checkpoints (`arpo.learner.checkpoint`), nothing else of the learner.
"""

"""OSWorld's own evaluator code, run in an environment of its own.

- `requirements.txt`: what `make osworld-evaluator` installs into `.venv-osworld` under OSWorld's
  published package (desktop-env 1.0.2, installed with --no-deps);
- `worker.py`: the worker program that runs in that environment (standard library + desktop_env);
- `client.py`: the project's side: starts, bounds and restarts workers, and turns their failures
  into `eval_error` results;
- `names.py`: the setup steps, getters and metrics that package has, by name.
"""

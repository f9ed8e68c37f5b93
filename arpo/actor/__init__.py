"""The actor: many environments driven by one asyncio process, trajectories spooled and sent.

- `config`: `ActorConfig`, the one configuration of `arpo-actor`;
- `episode`: one episode on one environment (setup, the turn loop, evaluation);
- `spool`: finished trajectories on disk until the learner acknowledges them;
- `actor`: the process (workers, sender, heartbeats, weights, progress, shutdown);
- `scripted`: an engine-shaped policy replaying task oracles, for tests and benchmarks;
- `cli`: the `arpo-actor` command.
"""

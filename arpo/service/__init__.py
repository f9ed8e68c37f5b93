"""The learner host's network services, used by the training loop and by the pool runs.

- `ingest`: the receiving end of the data link: trajectories in, journaled, stored,
  acknowledged;
- `journal`: the write-ahead journal's format, its writer and its readers (also the
  on-disk form of collections and demonstrations: `read_collection`);
- `grants`: the server of the control link: task grants (which episode each actor runs
  next, staleness admission), weights and heartbeats.

Used by `arpo.learner` and `arpo.pool`; imports neither.
"""

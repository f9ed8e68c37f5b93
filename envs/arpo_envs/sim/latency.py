"""Step latency of the simulated desktop, for rollout benchmarks that need realistic environments.

A real desktop answers /execute and /screenshot in tens of milliseconds, a VM with a
loaded host sometimes in seconds, and one slow VM among many sets the pace of a
lock-step rollout. `LatencyConfig` describes the delay added before each such
response:

- `none`: no delay (the default);
- `fixed`: `ms` milliseconds every time;
- `lognormal`: a lognormal draw with median `ms` and shape `sigma` (long right tail);
- `slow_env` / `slow_factor`: environment number `slow_env` of a multi-desktop process
  gets every delay multiplied by `slow_factor` ("one slow environment among many").

On the command line: `--latency fixed:50`, `--latency lognormal:40,0.6`,
`--slow-env 3 --slow-factor 5`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

Kind = Literal["none", "fixed", "lognormal"]


@dataclass(frozen=True, slots=True)
class LatencyConfig:
    """Delay added before each /execute and /screenshot response."""

    kind: Kind = "none"
    """Distribution: "none", "fixed" or "lognormal"."""
    ms: float = 0.0
    """fixed: the delay; lognormal: the median delay (milliseconds)."""
    sigma: float = 0.5
    """lognormal: standard deviation of the log of the delay (0.5: p90 about 1.9x the median)."""
    slow_env: int | None = None
    """Index of the one slow environment of a multi-desktop process (None: all alike)."""
    slow_factor: float = 1.0
    """Multiplier of every delay of the slow environment."""
    seed: int = 0
    """Seed of the lognormal draws (each environment draws from its own stream)."""

    def __post_init__(self) -> None:
        if self.kind not in ("none", "fixed", "lognormal"):
            raise ValueError(f"latency kind {self.kind!r} unknown; use none, fixed or lognormal")
        if self.ms < 0 or not math.isfinite(self.ms):
            raise ValueError(f"latency ms must be a finite number >= 0, got {self.ms}")
        if self.kind != "none" and self.ms == 0:
            raise ValueError(f"latency kind {self.kind!r} needs ms > 0 (or use kind 'none')")
        if self.sigma < 0:
            raise ValueError(f"latency sigma must be >= 0, got {self.sigma}")
        if self.slow_factor <= 0:
            raise ValueError(f"slow_factor must be > 0, got {self.slow_factor}")
        if self.slow_env is not None and self.slow_env < 0:
            raise ValueError(f"slow_env is an environment index >= 0, got {self.slow_env}")

    @classmethod
    def parse(cls, spec: str, **kw: object) -> LatencyConfig:
        """'none', 'fixed:<ms>' or 'lognormal:<median ms>[,<sigma>]'."""
        kind, _, args = spec.partition(":")
        try:
            if kind == "none" and not args:
                return cls("none", **kw)  # type: ignore[arg-type]
            values = [float(a) for a in args.split(",")] if args else []
            if kind == "fixed" and len(values) == 1:
                return cls("fixed", values[0], **kw)  # type: ignore[arg-type]
            if kind == "lognormal" and len(values) in (1, 2):
                return cls("lognormal", *values, **kw)  # type: ignore[arg-type]
        except ValueError as e:
            raise ValueError(f"bad latency {spec!r}: {e}") from None
        raise ValueError(
            f"bad latency {spec!r}; use 'none', 'fixed:<ms>' or 'lognormal:<median ms>[,<sigma>]'"
        )

    def sampler(self, env_index: int = 0) -> LatencySampler:
        return LatencySampler(self, env_index)


class LatencySampler:
    """Draws the delays of one environment."""

    def __init__(self, config: LatencyConfig, env_index: int):
        self.config = config
        self.factor = config.slow_factor if config.slow_env == env_index else 1.0
        self._rng = random.Random(f"latency:{config.seed}:{env_index}")

    def seconds(self) -> float:
        c = self.config
        if c.kind == "none":
            return 0.0
        ms = c.ms if c.kind == "fixed" else c.ms * math.exp(c.sigma * self._rng.gauss(0.0, 1.0))
        return ms * self.factor / 1000.0

"""Statistics shared by the experiment scripts: the 95 % t-interval of a mean over seeds, and
results written as strict JSON (no NaN: an interval of one seed is null)."""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

# Two-sided 95 % quantiles of Student's t by degrees of freedom (1..10).
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def t_interval(xs: list[float]) -> tuple[float, float, float]:
    """Mean and the 95 % t-interval of the mean (nan bounds for fewer than 2 values)."""
    m = statistics.mean(xs)
    if len(xs) < 2:
        return m, math.nan, math.nan
    t = _T95[len(xs) - 2] if len(xs) - 1 <= len(_T95) else 1.96
    h = t * statistics.stdev(xs) / math.sqrt(len(xs))
    return m, m - h, m + h


def strict_json(value: Any) -> str:
    """`value` as indented JSON that strict readers take: every NaN or infinity is null."""

    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(value), indent=2, allow_nan=False) + "\n"

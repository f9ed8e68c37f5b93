"""Statistics shared by the experiment scripts: the 95 % t-interval of a mean over seeds."""

from __future__ import annotations

import math
import statistics

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

"""Summaries of repeated measurements: mean and a 95% confidence interval (Student's t), and ratios to a baseline
measured in the same invocation."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

# Two-sided 95% quantiles of Student's t, t(0.975, df) for df = 1..30 (standard tables); beyond 30 the normal
# quantile is within 4% and is used.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def interval(values: Sequence[float]) -> dict:
    """Mean, sample standard deviation and the half-width of the two-sided 95% interval of the mean (Student's t
    with n-1 degrees of freedom). With one value the deviation and half-width are None: one run says nothing
    about its spread."""
    values = [float(v) for v in values]
    n = len(values)
    if n == 0:
        raise ValueError("interval of no values")
    mean = statistics.fmean(values)
    if n < 2:
        return {"n": 1, "mean": mean, "sd": None, "ci95": None, "values": values}
    sd = statistics.stdev(values)
    half = (T975[n - 2] if n - 1 <= len(T975) else 1.960) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "ci95": half, "low": mean - half, "high": mean + half, "values": values}


def fmt(summary: dict, digits: int = 3) -> str:
    """``1.047 ± 0.021 (n=3)``."""
    if summary["n"] < 2:
        return f"{summary['mean']:.{digits}f} (n=1)"
    return f"{summary['mean']:.{digits}f} ± {summary['ci95']:.{digits}f} (n={summary['n']})"


def power_law(sizes: list[int], values: list[float | None]) -> float | None:
    """Least-squares slope of log(value) against log(N)."""
    pts = [(math.log(n), math.log(v)) for n, v in zip(sizes, values) if v is not None and v > 0]
    if len(pts) < 2:
        return None
    mx, my = statistics.fmean(x for x, _ in pts), statistics.fmean(y for _, y in pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else None


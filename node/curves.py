"""Curves the way ML people read them: training loss smoothed over its raw points, series kept to a bounded size.

Shared by the demo's plot (``scripts/swarm.py``) and ``atoll dashboard``."""

from __future__ import annotations

from typing import Sequence, TypeVar

T = TypeVar("T")


def smoothed(values: Sequence[float], weight: float = 0.9) -> list[float]:
    """An exponential moving average of ``values``, debiased at the start (as TensorBoard's smoothing is): the
    first points are not pulled toward zero."""
    if not 0 <= weight < 1:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight ** i))
    return out


def thin(points: list[T], cap: int) -> list[T]:
    """``points`` kept to at most ``cap``: past it, every second point is dropped (the first and the last remain), as
    often as needed, so a long series keeps an even resolution over its whole length."""
    if cap < 4:
        raise ValueError(f"cap must be at least 4, got {cap}")
    while len(points) > cap:
        points = points[::2] + ([points[-1]] if len(points) % 2 == 0 else [])
    return points

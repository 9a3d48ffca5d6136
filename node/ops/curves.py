"""Curves the way ML people read them: training loss smoothed over its raw points, series kept to a bounded size.

Shared by the demo's plot (``scripts/swarm.py``) and ``atoll dashboard``."""

from __future__ import annotations

from typing import Generic, Sequence, TypeVar

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


class Series(Generic[T]):
    """Points offered one at a time, kept to at most ``cap`` (plus the newest) at one even stride: every
    ``stride``-th point offered is kept; when the kept ones pass ``cap``, every second one is dropped and the stride
    doubles. So the whole series keeps one resolution, however long it runs (dropping every second point of the
    whole list at each overflow would make the oldest part ever sparser). The newest point offered is always part of
    ``points()``, so a curve ends at its latest value."""

    def __init__(self, cap: int) -> None:
        if cap < 4:
            raise ValueError(f"cap must be at least 4, got {cap}")
        self.cap, self.stride, self.offered = cap, 1, 0
        self._kept: list[T] = []
        self._newest: T | None = None

    def add(self, point: T) -> None:
        if self.offered % self.stride == 0:
            self._kept.append(point)
            if len(self._kept) > self.cap:
                self._kept = self._kept[::2]
                self.stride *= 2
        self._newest = point
        self.offered += 1

    def points(self) -> list[T]:
        on_stride = (self.offered - 1) % self.stride == 0
        return self._kept if not self.offered or on_stride else [*self._kept, self._newest]  # type: ignore[list-item]

    def last(self) -> T | None:
        """The newest point offered; None before any."""
        return self._newest

"""Settings a benchmark or a test gives its daemons so that runs compare: not faults (nothing goes wrong) and not
product settings (no operator needs them). ``--harness NAME=VALUE`` (``NodeConfig.harness``), hidden from
``--help``; a daemon without them gets ``Harness()``, which changes nothing.

- ``step_delay=S``: sleep S seconds per inner step (a slower daemon, or cores left free on a shared machine).
- ``step_jitter=F`` with ``jitter_seed=N``: each step's delay varies by up to ±F of ``step_delay`` (uniformly,
  from a generator seeded with N: the same draws in every run), as a real chip's step time does.
- ``start_together=N``: hold the first step until N daemons train (runs compared step for step start in lockstep).
- ``data_shard=K``: read shard K of the corpus, not the one the peer id picks. Daemons that start from one model
  and read one shard train identically; a test whose daemons must make different lines pins different shards
  (three peer ids hash into one of 16 shards together about one time in six).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

KINDS: dict[str, type] = {"step_delay": float, "step_jitter": float, "jitter_seed": int, "start_together": int,
                          "data_shard": int}


def parse_items(items: Sequence[str], kinds: dict[str, type], noun: str) -> dict[str, Any]:
    """``NAME=VALUE`` strings typed by ``kinds``; ``ValueError`` with one line naming the bad item (a ``noun``)."""
    out: dict[str, Any] = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in kinds or not value:
            raise ValueError(f"unknown {noun} {item!r}; known: {', '.join(f'{k}=...' for k in kinds)}")
        try:
            out[name] = kinds[name](value)
        except ValueError:
            raise ValueError(f"bad value in {item!r}") from None
    return out


@dataclass(frozen=True)
class Harness:
    step_delay: float = 0.0
    start_together: int = 0
    data_shard: int | None = None
    step_jitter: float = 0.0
    jitter_seed: int = 0
    _draws: random.Random = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_draws", random.Random(self.jitter_seed))

    @classmethod
    def parse(cls, items: Sequence[str]) -> Harness:
        """``NAME=VALUE`` strings; ``ValueError`` with one line naming the bad item."""
        values = parse_items(items, KINDS, "harness setting")
        for name, value in values.items():
            if value < 0:
                raise ValueError(f"{name} must not be negative, got {value}")
        if values.get("step_jitter", 0) > 1:
            raise ValueError(f"step_jitter must be at most 1 (a share of step_delay), got {values['step_jitter']}")
        return cls(**values)

    def pace(self) -> None:
        """Before each inner step: ``step_delay``, varied by ``step_jitter``."""
        if self.step_delay:
            jitter = self.step_jitter * (2 * self._draws.random() - 1) if self.step_jitter else 0.0
            time.sleep(self.step_delay * (1 + jitter))

    def shard(self, shard: int, num_shards: int) -> int:
        """The corpus shard this daemon reads: ``shard`` (the peer id's) unless ``data_shard`` pins another."""
        return (shard if self.data_shard is None else self.data_shard) % num_shards

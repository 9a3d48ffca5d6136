"""What a daemon counts about itself, and where it writes it down.

``Counters`` is the one object behind the progress record the syncer publishes, the ``summary`` event a daemon
writes when it stops (benchmarks read it) and ``atoll status``. Each field has one writer: the training loop
(steps, tokens, losses, time, lost tokens, skipped rounds) or the syncer's event loop (rounds merged, forks
healed); readers on the other thread see a value at most one update old. ``MetricsLog`` appends JSON events to
``<checkpoint_dir>/metrics.jsonl``.
"""

from __future__ import annotations

import collections
import json
import math
import os
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any


from atoll.protocols import dht_io
from atoll.protocols.records import Status

if TYPE_CHECKING:
    from atoll.protocols.stats import TrafficStats


SKIPPED = "skipped"  # ``Counters.round_ended``'s result for a sync point that started no round
# Upper bounds (seconds) of the buckets of a round's duration: from a LAN's sub-second rounds to a WAN's minutes.
IN_FLIGHT_KEPT = 256  # merged rounds whose steps in flight the median and 95th percentile are taken over
ROUND_SECONDS_BUCKETS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    """Counts of observations at most each of ``bounds`` (cumulative, as Prometheus's buckets are), their number
    and their sum; one writer, readers on any thread."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.count, self.sum = 0, 0.0

    def observe(self, x: float) -> None:
        # In this order a reader on another thread (a scrape) never sees a bucket above a wider one or above the
        # count: Prometheus would take that for a reset.
        self.count += 1
        for i in reversed(range(len(self.bounds))):
            if x <= self.bounds[i]:
                self.counts[i] += 1
        self.sum += x


@dataclass
class Counters:
    device: str = ""
    ranks: int = 1  # the island's processes (node/island/ranks.py)
    algorithm: str = ""
    status: Status = Status.JOINING
    step: int = 0
    tokens: int = 0
    tokens_per_s: float = 0.0
    loss: float | None = None
    held_out_loss: float | None = None
    held_out_step: int | None = None  # the step at which held_out_loss was measured
    tokens_lost: int = 0  # tokens whose work no merge kept (overwritten, dropped past the carry bound, a fork's)
    tokens_carried: int = 0  # tokens of work a merge or an adoption moved onto a newer replica (each move counts)
    train_seconds: float = 0.0
    blocked_seconds: float = 0.0  # time the loop waited on the network
    eval_seconds: float = 0.0
    step_time: float = 0.0  # seconds per inner step, a moving average (the grace window is sized from it)
    rounds_done: int = 0
    rounds_skipped: int = 0
    forks_healed: int = 0
    rejoins: int = 0  # times the DHT was bootstrapped again after a while with no live peer (node/rounds/rejoin.py)
    ddp_failed_steps: int = 0
    rank_drift: int = 0  # checks at which a rank of the island held a θ other than rank 0's (node/island/ranks.py)
    island_sync_seconds: float = 0.0  # rank 0's time in the island's collectives that sent θ or compared it
    paused_seconds: float = 0.0  # time paused (island/pause.py): lent back to its owner, not counted against goodput
    pauses: int = 0
    started: float = field(default_factory=time.monotonic)
    # The training loop's: each round's end by fragment (``round_ended``), and when the last checkpoint was written.
    rounds_by_result: dict[tuple[int, str], int] = field(default_factory=dict)
    round_seconds: dict[int, Histogram] = field(default_factory=dict)  # merged rounds' durations by fragment
    # Inner steps from each of the recent merged rounds' snapshots to their merge: how late rounds land, in steps.
    in_flight_steps: collections.deque = field(default_factory=lambda: collections.deque(maxlen=IN_FLIGHT_KEPT))
    checkpoint_at: float | None = None  # wall-clock time

    def round_ended(self, fragment: int, result: str, seconds: float | None = None) -> None:
        """A round of ``fragment`` ended as ``result`` (a round ``Outcome``'s value, or ``SKIPPED``: none was
        started at a sync point because the previous one had not landed), taking ``seconds`` if it merged."""
        key = (fragment, result)
        self.rounds_by_result[key] = self.rounds_by_result.get(key, 0) + 1
        if result == SKIPPED:
            self.rounds_skipped += 1
        if seconds is not None:
            self.round_seconds.setdefault(fragment, Histogram(ROUND_SECONDS_BUCKETS)).observe(seconds)

    def in_flight(self) -> tuple[int | None, int | None]:
        """The median and 95th percentile of ``in_flight_steps`` (None before a round merged)."""
        steps = sorted(self.in_flight_steps)
        if not steps:
            return None, None
        return steps[len(steps) // 2], steps[min(len(steps) - 1, math.ceil(0.95 * len(steps)) - 1)]

    def stepped(self, seconds: float) -> None:
        """One inner step took ``seconds``."""
        self.step_time = seconds if not self.step_time else 0.9 * self.step_time + 0.1 * seconds

    def progress(self) -> dict[str, Any]:
        """This daemon's own fields of its progress record."""
        wall = max(time.monotonic() - self.started - self.paused_seconds, 1e-9)
        return {
            "status": self.status.value, "device": self.device, "ranks": self.ranks, "algorithm": self.algorithm,
            "step": self.step,
            "tokens": self.tokens, "tokens_per_s": float(self.tokens_per_s), "loss": _finite_or_none(self.loss),
            "held_out_loss": _finite_or_none(self.held_out_loss),
            "held_out_step": self.held_out_step if _finite_or_none(self.held_out_loss) is not None else None,
            "tokens_lost": int(self.tokens_lost), "tokens_carried": int(self.tokens_carried),
            "in_flight_p50": self.in_flight()[0], "in_flight_p95": self.in_flight()[1],
            "goodput": float(min(1.0, self.train_seconds / wall)), "blocked_s": float(self.blocked_seconds),
            "rounds": self.rounds_done, "rounds_skipped": self.rounds_skipped, "forks_healed": self.forks_healed,
        }

    def summary(self, traffic: TrafficStats, versions: list[int]) -> dict[str, Any]:
        """What this daemon did over its lifetime: the last metrics event."""
        return {**self.progress(), "status": Status.STOPPED.value, "version": sum(versions), "versions": versions,
                "train_seconds": self.train_seconds, "wall_seconds": time.monotonic() - self.started,
                "bytes_sent": traffic.bytes_sent, "bytes_received": traffic.bytes_received,
                "rejected": traffic.rejected, "rejected_by_kind": dict(traffic.rejected_by_kind),
                "clipped": traffic.clipped, "streams_in": traffic.streams_in, "rank_drift": self.rank_drift,
                "rejoins": self.rejoins, "island_sync_seconds": self.island_sync_seconds,
                "pauses": self.pauses, "paused_seconds": self.paused_seconds,
                "dht_calls": dht_io.calls_summary()}


class MetricsLog:
    """JSON lines, one event each, flushed at once; a log without a path writes nothing. Thread-safe: events come
    from the training loop and from the checkpoint writer. Each of ``sinks`` hears every event as a dict (the
    experiment trackers: ``node/ops/trackers.py``), whether or not there is a file."""

    def __init__(self, path: Path | None, sinks: tuple[Callable[[dict[str, Any]], None], ...] = ()) -> None:
        self._file = open(path, "a") if path is not None else None
        self._sinks = sinks
        self._lock = threading.Lock()

    def write(self, **fields: Any) -> None:
        with self._lock:
            event = {"time": time.time(), **fields}
            if self._file is not None:
                self._file.write(json.dumps(event) + "\n")
                self._file.flush()
            for sink in self._sinks:
                sink(event)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class HeldOut:
    """Held-out evaluations of θ (the trainee's ``held_out_loss``), kept within ``budget`` of the wall time: one runs
    only if, taking as long as the last one did, it still fits (the first one always runs). On a device every
    evaluation is time not spent training; an evaluation allowed once the budget was merely not yet spent overshot
    it by one evaluation each time (docs/results.md, "Mixed hardware"). ``budget`` 1 evaluates whenever asked."""

    def __init__(self, budget: float, counters: Counters) -> None:
        self.budget, self.counters = budget, counters
        self.last = 0.0  # seconds the last evaluation took

    def evaluate(self, learner: Any) -> None:
        c = self.counters
        if self.budget < 1 and c.held_out_loss is not None and c.eval_seconds + self.last > self.budget * (
                time.monotonic() - c.started):
            return
        t0 = time.monotonic()
        c.held_out_loss = learner.held_out_loss()
        self.last = time.monotonic() - t0
        c.eval_seconds += self.last
        c.held_out_step = learner.step


def _finite_or_none(x: float | None) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def current_rss_mib() -> int:
    """This process's resident memory now, in MiB."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20
    except OSError:
        return peak_rss_mib()


def peak_rss_mib() -> int:
    """This process's peak resident memory so far, in MiB (not its DHT child's or p2pd's)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # KiB on Linux

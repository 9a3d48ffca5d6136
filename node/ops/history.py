"""What ``atoll dashboard`` has read of a run, over time: each island's training loss and held-out evaluations, and
the run's counters. The daemons publish only their newest figures (their progress records); this is the history
the dashboard keeps of its own reads (``History``), bounded, and the one JSON document its page draws."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .curves import Series, smoothed

HISTORY_POINTS = 2000  # points kept per series (``curves.Series``)
SMOOTHING = 0.9  # the training loss's moving-average weight (``curves.smoothed``)
FORGET_AFTER = 600.0  # seconds an island may go unlisted before its curves are dropped (its counters stay counted)
READS_KEPT = 64  # an island's newest distinct steps kept to place its evaluations in time
# Counters summed over the islands for the run's series; the first three are in every summary as well.
RUN_COUNTERS = ("tokens", "bytes_sent", "bytes_received", "rounds", "rounds_skipped", "rejected", "forks_healed")


def finite(x: Any) -> float | None:
    """``x`` as a float when it is a finite number (a record from the network may carry anything JSON allows)."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def json_safe(x: Any) -> Any:
    """``x`` with every float that is not finite replaced by None: strict JSON, which the page's parser needs, from
    figures a peer published."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


@dataclass
class _Read:
    """The reads that found an island at one step: the first and the newest."""

    step: int
    first: float
    last: float


@dataclass
class _Island:
    """One island's series, its newest record, and the reads that place its evaluations in time."""

    loss: Series  # (time, step, training loss)
    held_out: Series  # (time, step, held-out loss)
    record: dict[str, Any] = field(default_factory=dict)
    reads: list[_Read] = field(default_factory=list)  # its newest distinct steps, oldest first; this life only
    listed_at: float = 0.0  # the newest read that listed it
    version_grew_at: float | None = None  # when this dashboard saw its replica's version grow


def time_at_step(reads: list[_Read], at: int) -> float | None:
    """When an island whose reads were ``reads`` was at step ``at``: the first read at that step, or linear between
    the newest read before it and the first read after it. None when it was there before the first of ``reads``
    (before this dashboard, or before a restart, first read it): an evaluation is drawn where it happened, or not at
    all."""
    if not reads or at < reads[0].step:
        return None
    for before, after in zip(reads, reads[1:]):
        if before.step == at:
            return before.first
        if before.step < at < after.step:
            return before.last + (after.first - before.last) * (at - before.step) / (after.step - before.step)
    return reads[-1].first  # at the newest step (or past it: a record's own step lags its evaluation's)


class History:
    """What the dashboard has read: each island's training loss and held-out evaluations over time, and the run's
    counters over time, each series at most ``points`` points (``curves.Series``). Thread-safe: the poller adds,
    the HTTP server's threads view.

    A training-loss point is added when an island's step moved since its last one (a record republished at the same
    step adds nothing); a held-out point only when its ``held_out_step`` is new, placed at the time the island was at
    that step (``time_at_step``), so an evaluation is drawn once, where it happened, and a figure repeated by later
    records is not. The run's counters are summed over every island this dashboard has seen, each at its newest
    record: an island that left still counts what it did. An island unlisted for ``FORGET_AFTER`` seconds has its
    curves dropped (its counters kept in the sums), so a long-lived dashboard of a run whose members come and go
    stays bounded."""

    def __init__(self, points: int = HISTORY_POINTS) -> None:
        self.points = points
        self.islands: dict[str, _Island] = {}
        self.departed = {k: 0.0 for k in RUN_COUNTERS}  # the counters of the islands forgotten
        self.run: Series = Series(points)  # (time, {counter: value, "version": newest version})
        self.doc: dict[str, Any] | None = None  # the newest status document
        self.polls = 0
        self.first_poll: float | None = None
        self.error: str | None = None  # why the newest poll failed; None when it did not
        self._lock = threading.Lock()

    def add(self, doc: dict[str, Any]) -> None:
        """One poll's status document (``status.collect_status``)."""
        with self._lock:
            t = doc["time"]
            self.doc, self.error = doc, None
            self.polls += 1
            self.first_poll = t if self.first_poll is None else self.first_poll
            for rec in doc["peers"] or []:
                self._add_record(t, rec)
            self._forget(t)
            if doc["peers"] is not None:
                sums = {k: self.departed[k] + sum(finite(i.record.get(k)) or 0.0 for i in self.islands.values())
                        for k in RUN_COUNTERS}
            else:  # a large run, read from its summaries: only what they total
                sums = {k: float(doc["totals"][k]) for k in ("tokens", "bytes_sent", "bytes_received")}
            sums["version"] = float(doc["totals"]["max_version"])
            self.run.add((t, sums))

    def _add_record(self, t: float, rec: dict[str, Any]) -> None:
        island = self.islands.get(rec["peer_id"])
        if island is None:
            island = self.islands[rec["peer_id"]] = _Island(Series(self.points), Series(self.points))
        step, loss = rec["step"], finite(rec.get("loss"))
        if island.reads and step < island.reads[-1].step:  # restarted from an older checkpoint: a new life
            island.reads.clear()
        if island.reads and island.reads[-1].step == step:
            island.reads[-1].last = t
        else:
            island.reads = [*island.reads[-(READS_KEPT - 1):], _Read(step, t, t)]
        held_out, at = finite(rec.get("held_out_loss")), rec.get("held_out_step")
        newest = island.held_out.last()
        if held_out is not None and isinstance(at, int) and (newest is None or newest[1] != at):
            when = time_at_step(island.reads, at)
            if when is not None:
                island.held_out.add((when, at, held_out))
        newest = island.loss.last()
        if loss is not None and (newest is None or newest[1] != step):
            island.loss.add((t, step, loss))
        if island.record and rec["version"] > island.record["version"]:
            island.version_grew_at = t
        island.record, island.listed_at = rec, t

    def _forget(self, now: float) -> None:
        for pid in [p for p, i in self.islands.items() if now - i.listed_at > FORGET_AFTER]:
            record = self.islands.pop(pid).record
            for k in RUN_COUNTERS:
                self.departed[k] += finite(record.get(k)) or 0.0

    def failed(self, why: str) -> None:
        """The newest poll failed (``why``: one line); the page says so, and keeps what it has."""
        with self._lock:
            self.error = why

    def view(self, now: float | None = None) -> dict[str, Any]:
        """The page's state as one strict-JSON-ready document (``json_safe``): the run (id, config, totals, where
        they come from), the islands of the newest poll with the seconds since this dashboard saw each one's replica
        version grow, each island's training loss (raw and ``smoothed``) and held-out evaluations, and the run's
        counters over time."""
        now = time.time() if now is None else now
        with self._lock:
            doc = self.doc or {}
            islands = []
            for rec in doc.get("peers") or []:
                grew = self.islands[rec["peer_id"]].version_grew_at
                islands.append({**rec, "last_round_s": None if grew is None else max(0.0, now - grew)})
            seen = sorted(self.islands)
            loss = {pid: self.islands[pid].loss.points() for pid in seen}
            held_out = {pid: self.islands[pid].held_out.points() for pid in seen}
            run = self.run.points()
            return json_safe({
                "run_id": doc.get("run_id"), "time": doc.get("time"), "now": now, "polls": self.polls,
                "first_poll": self.first_poll, "error": self.error, "config": doc.get("config"),
                "totals": doc.get("totals"), "summary": doc.get("summary"), "verified": doc.get("verified", False),
                "islands": islands, "seen": seen,
                "loss": [{"peer_id": pid, "t": [p[0] for p in pts], "step": [p[1] for p in pts],
                          "raw": [p[2] for p in pts], "smooth": smoothed([p[2] for p in pts], SMOOTHING)}
                         for pid, pts in loss.items()],
                "held_out": [{"peer_id": pid, "t": [p[0] for p in pts], "step": [p[1] for p in pts],
                              "value": [p[2] for p in pts]} for pid, pts in held_out.items()],
                "run": {"t": [t for t, _ in run],
                        **{k: [sums.get(k) for _, sums in run] for k in (*RUN_COUNTERS, "version")}},
            })

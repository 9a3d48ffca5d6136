"""A run's totals in a few records: what ``atoll status`` reads instead of every progress record of a large run.

A few daemons, the summarizers, publish every heartbeat the totals of the peer table they hold
(``node/rounds/peers.py``, which past a few dozen peers is itself assembled from shards read in turns). Who summarizes
needs no election messages: the ``SUMMARIZERS`` peers whose ids hash lowest (``summary_rank``) among those in a daemon's
table and itself. Tables differ a little between daemons, so for a moment one more or one fewer may write; a reader
takes the median of each total over the fresh summaries it finds (``merge``), so that one summarizer that lies, or whose
table is behind, does not make the figures.

The totals are those ``atoll status`` shows for a run (``totals``): the same function makes them from a summarizer's
table and from the records themselves when a reader lists every peer.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from typing import Any, Iterable, Optional

import pydantic.v1 as pydantic
from pydantic.v1 import StrictFloat, conint, constr

SUMMARIZERS = 3
LEAVING = "leaving"
TOTALS = ("peers", "ranks", "tokens", "tokens_per_s", "max_version", "bytes_sent", "bytes_received")


def summary_key(run_id: str) -> str:
    """Where the summarizers' records live, a subkey per summarizer."""
    return f"{run_id}_summary"


def summary_rank(peer_id: str) -> bytes:
    """The order in which peers are summarizers: a hash of the id, not the id, so that no prefix of an id wins."""
    return hashlib.blake2b(b"atoll-summarizer:" + peer_id.encode(), digest_size=8).digest()


def is_summarizer(peer_id: str, others: Iterable[str], count: int = SUMMARIZERS) -> bool:
    """Whether ``peer_id`` is among the ``count`` lowest ranks of itself and ``others`` (the peers it knows)."""
    mine = summary_rank(peer_id)
    lower = 0
    for other in others:
        if other != peer_id and summary_rank(other) < mine:
            lower += 1
            if lower >= count:
                return False
    return True


def totals(records: Iterable[Any]) -> dict[str, Any]:
    """The run's totals over progress records (objects with ``ProgressRecord``'s fields), leaving peers left out."""
    out: dict[str, Any] = {"peers": 0, "ranks": 0, "tokens": 0, "tokens_per_s": 0.0, "max_version": 0,
                           "bytes_sent": 0, "bytes_received": 0}
    for r in records:
        if r.status == LEAVING:
            continue
        out["peers"] += 1
        out["ranks"] += r.ranks
        out["tokens"] += r.tokens
        out["tokens_per_s"] += r.tokens_per_s
        out["max_version"] = max(out["max_version"], r.version)
        out["bytes_sent"] += r.bytes_sent
        out["bytes_received"] += r.bytes_received
    return out


class SummaryRecord(pydantic.BaseModel):
    """One summarizer's totals (``totals``) of the peers in its table, itself included, at ``time`` (DHT time)."""

    peer_id: constr(strict=True, min_length=1, max_length=128)
    peers: conint(ge=0, le=1 << 24, strict=True)
    ranks: conint(ge=0, strict=True)
    tokens: conint(ge=0, strict=True)
    tokens_per_s: StrictFloat
    max_version: conint(ge=0, strict=True)
    bytes_sent: conint(ge=0, strict=True)
    bytes_received: conint(ge=0, strict=True)
    time: StrictFloat

    class Config:
        extra = pydantic.Extra.forbid

    @pydantic.validator("tokens_per_s", "time")
    def _finite(cls, v: float) -> float:  # noqa: N805 (pydantic signature)
        if not math.isfinite(v) or v < 0:
            raise ValueError("must be finite and non-negative")
        return v


def parse_summary(value: Any) -> Optional[SummaryRecord]:
    """A summary record from a DHT value, or None if it is malformed."""
    try:
        return SummaryRecord.parse_obj(value)
    except (pydantic.ValidationError, TypeError):
        return None


def merge(summaries: list[SummaryRecord]) -> dict[str, Any]:
    """The run's totals from several summaries: the median of each (the lower median of an even count, so that
    integers stay integers and two summaries cannot make a figure neither gave). Empty input: ValueError."""
    if not summaries:
        raise ValueError("no summaries to merge")
    return {field: statistics.median_low([getattr(s, field) for s in summaries]) for field in TOTALS}

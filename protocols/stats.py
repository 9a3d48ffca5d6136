"""Traffic counters shared by the protocols (averaging, state sync) and published by the daemon."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrafficStats:
    """Counters the daemon publishes; only touched from the protocol event loop. ``on_offence`` (if set) hears
    of every rejection whose sender is known (an authenticated peer id or record key)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    rejected: int = 0
    rejected_by_kind: dict[str, int] = field(default_factory=dict)
    clipped: int = 0  # contributions (or declared weights/norms) scaled down by robust merging
    streams_in: int = 0  # incoming streams that reached atoll's handlers (``p2p_guard``), served or refused
    on_offence: Callable[[str | bytes, str], Any] | None = None

    def stream_in(self) -> None:
        self.streams_in += 1

    def reject(self, kind: str, offender: str | bytes | None = None, count: int = 1) -> None:
        self.rejected += count
        self.rejected_by_kind[kind] = self.rejected_by_kind.get(kind, 0) + count
        if offender is not None and self.on_offence is not None:
            self.on_offence(offender, kind)

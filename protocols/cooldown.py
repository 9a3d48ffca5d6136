"""Peer cooldown: who sent this daemon something it rejected, and until when it is left out.

Offenders are named by something the network authenticates: a peer id that libp2p verified for the stream the
bad message came on (an averaging part, a state download), or the member key a DHT record is signed with
(a record's own ``peer_id`` field is only a claim, so a malformed record cools down its signing key, never
the peer id it names: nobody can get an honest peer left out by forging records in its name).

Leaving a peer out is a local decision and never makes members disagree: a group decided by another daemon is
still used verbatim (see ``protocols/matchmaking.py``); this daemon only stops counting the offender as live,
expected, registered or a donor, and treats its parts as missing in the shards it reduces. Every shard has one
reducer whose result all members apply, so replicas stay identical.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Hashable

logger = logging.getLogger("atoll")

MAX_ENTRIES = 4096  # offenders remembered at once; identities are cheap, memory is not


def describe(source: str | bytes) -> str:
    """A short printable name: the tail of a peer id, or a hash prefix of a record's signing key."""
    if isinstance(source, bytes):
        return "key:" + hashlib.sha256(source).hexdigest()[:8]
    return source[-8:]


class Cooldown:
    """Offenders and the time their cooldown ends. Not thread-safe: used on the protocol event loop only
    (``active`` may be read from other threads: a dict lookup)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not seconds >= 0:
            raise ValueError(f"cooldown must be >= 0 seconds, got {seconds}")
        self.seconds, self.clock = seconds, clock
        self._until: dict[str | bytes, float] = {}

    def offend(self, source: str | bytes, kind: str) -> bool:
        """Record an offence of ``source``; returns True (and logs one line) when it starts a cooldown, False when
        ``source`` was already cooling down (its cooldown restarts, silently: a flood costs one log line)."""
        if self.seconds == 0:
            return False
        now = self.clock()
        fresh = not self.active(source)
        self._until[source] = now + self.seconds
        if len(self._until) > MAX_ENTRIES:
            self._prune(now)
        if fresh:
            logger.warning("peer %s sent a rejected %s: left out of rounds, donors and peer lists for %.0f s",
                           describe(source), kind, self.seconds)
        return fresh

    def active(self, source: str | bytes) -> bool:
        until = self._until.get(source)
        return until is not None and self.clock() < until

    def _prune(self, now: float) -> None:
        self._until = {s: t for s, t in self._until.items() if t > now}
        while len(self._until) > MAX_ENTRIES:  # still full: forget the ones that end soonest
            del self._until[min(self._until, key=self._until.__getitem__)]

    def __len__(self) -> int:
        now = self.clock()
        return sum(1 for t in self._until.values() if t > now)


class Strikes:
    """Misses of each peer in a row (a coordinator that did not decide, a reducer that did not answer): the
    ``limit``-th in a row is an offence, and a success starts the count over. An honest peer that froze misses
    too, rarely ``limit`` times in a row. Bounded: past ``MAX_TRACKED`` peers the counts start over."""

    MAX_TRACKED = 1024

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self.missed: dict[str, int] = {}
        self.last: dict[str, Hashable] = {}  # what each peer's last miss was about (``miss``'s ``event``)

    def hit(self, peer: str) -> None:
        self.missed.pop(peer, None)
        self.last.pop(peer, None)

    def miss(self, peer: str, event: Hashable = None) -> bool:
        """Count one miss; True when it is the ``limit``-th in a row (the count then starts over). A miss about
        the same ``event`` (not None) as the peer's last one is that miss again, not counted."""
        if event is not None and self.last.get(peer) == event:
            return False
        count = self.missed.get(peer, 0) + 1
        if count >= self.limit:
            self.missed.pop(peer, None)
            self.last.pop(peer, None)
            return True
        if len(self.missed) >= self.MAX_TRACKED and peer not in self.missed:
            self.missed.clear()
            self.last.clear()
        self.missed[peer] = count
        if event is not None:
            self.last[peer] = event
        return False

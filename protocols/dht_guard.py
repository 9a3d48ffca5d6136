"""What one peer can make this daemon's DHT node do and hold: bounded keys, records, calls in flight and bytes.

hivemind's DHT handlers (1.1.12) serve any number of keys in one ``rpc_find`` and any number of records in one
``rpc_store``, each in one uninterrupted loop on the DHT's event loop, and as many calls at once as a peer sends:
the second review's outsider (no token needed) sent ``rpc_find`` calls of 30k–150k keys and ``rpc_store`` calls
of 3,000 junk-signed records, a few at a time, at one node, and the whole swarm's merges fell from about 62 to
17–25 a minute. ``install`` wraps both handlers so that:

- a call with more than ``MAX_FIND_KEYS`` keys (``MAX_STORE_RECORDS`` records) is answered with nothing, before
  any key is looked at: the caller sees a malformed answer and treats this node as one that failed it (an honest
  daemon asks for a few dozen keys at most, and stores one or a few records a call);
- a peer has at most ``MAX_CALLS_PER_PEER`` calls in flight at this node; further ones are answered with nothing;
- a peer writes at most ``STORE_BYTES_PER_S`` bytes of values a second into this node, sustained, in bursts of up
  to ``STORE_BURST_BYTES`` (a token bucket per peer); a store past it is answered with nothing. The review's
  member wrote 64 KB values under new keys until a node's storage grew from 695 to 2,004 MiB in 100 s (13 MB/s);
  an honest daemon writes a few KB a second into any one node, some tens in the fastest local tests;
- every refusal is counted in ``REFUSED`` (by kind), which the DHT's process logs at most once per ``LOG_EVERY``.

hivemind collects a servicer's handlers from its class when the handlers are added, so the wrappers are put on
``DHTProtocol`` itself, in the daemon's process before its DHT starts: the DHT's child process is forked from it
and inherits them (as ``scripts/wire_probe`` does for its counters). ``install`` fails loudly if hivemind's shape
changed.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter

from hivemind.dht.protocol import DHTProtocol
from hivemind.proto import dht_pb2

logger = logging.getLogger("atoll")

MAX_FIND_KEYS = 256  # an honest get_many asks one node for at most a few dozen keys
MAX_STORE_RECORDS = 256  # an honest store writes one key (a dictionary of its subkeys) or a few
MAX_CALLS_PER_PEER = 16  # a daemon polls several rounds, its peer table and nudged keys at once
LOG_EVERY = 10.0
STORE_BYTES_PER_S = 128 * 1024
STORE_BURST_BYTES = 8 * 1024 * 1024
MAX_BUCKETS = 4096  # peers whose write budgets are remembered; full (idle) ones are forgotten first

REFUSED: Counter = Counter()
_in_flight: Counter = Counter()
_logged_at = [-1e9]


class _Budgets:
    """A token bucket of value bytes per peer: ``STORE_BURST_BYTES`` deep, refilled at ``STORE_BYTES_PER_S``."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.buckets: dict[str, tuple[float, float]] = {}  # peer -> (bytes it may write now, when that was)

    def take(self, peer: str, size: int) -> bool:
        now = self.clock()
        level, at = self.buckets.get(peer, (float(STORE_BURST_BYTES), now))
        level = min(float(STORE_BURST_BYTES), level + (now - at) * STORE_BYTES_PER_S)
        ok = size <= level
        if len(self.buckets) >= MAX_BUCKETS and peer not in self.buckets:
            full = [p for p, (lv, t) in self.buckets.items()
                    if lv + (now - t) * STORE_BYTES_PER_S >= STORE_BURST_BYTES]
            for p in full or list(self.buckets)[: len(self.buckets) // 2]:
                del self.buckets[p]
        self.buckets[peer] = (level - size if ok else level, now)
        return ok


BUDGETS = _Budgets()


def _refuse(kind: str, peer: str) -> None:
    REFUSED[kind] += 1
    now = time.monotonic()
    if now - _logged_at[0] >= LOG_EVERY:
        _logged_at[0] = now
        logger.warning("DHT node refused a call of %s (%s); refused so far: %s", peer[-8:], kind, dict(REFUSED))


def _guard(handler, size, limit: int, kind: str, empty, cost=None):
    @functools.wraps(handler)
    async def guarded(self, request, context):
        peer = str(context.remote_id)
        if size(request) > limit:
            _refuse(kind, peer)
            return empty(self)
        if _in_flight[peer] >= MAX_CALLS_PER_PEER:
            _refuse("dht_calls_in_flight", peer)
            return empty(self)
        if cost is not None and not BUDGETS.take(peer, cost(request)):
            _refuse("dht_store_bytes", peer)
            return empty(self)
        _in_flight[peer] += 1
        try:
            return await handler(self, request, context)
        finally:
            _in_flight[peer] -= 1
            if not _in_flight[peer]:
                del _in_flight[peer]

    guarded.atoll_guarded = True
    return guarded


def install() -> None:
    """Wrap ``DHTProtocol.rpc_find`` and ``rpc_store`` (once; idempotent)."""
    for name in ("rpc_find", "rpc_store"):
        if not callable(getattr(DHTProtocol, name, None)):
            raise RuntimeError(f"hivemind's DHTProtocol has no {name}: dht_guard no longer fits it")
    if getattr(DHTProtocol.rpc_find, "atoll_guarded", False):
        return
    DHTProtocol.rpc_find = _guard(DHTProtocol.rpc_find, lambda r: len(r.keys), MAX_FIND_KEYS, "dht_find_keys",
                                  lambda self: dht_pb2.FindResponse(results=[], peer=self.node_info))
    DHTProtocol.rpc_store = _guard(DHTProtocol.rpc_store, lambda r: len(r.keys), MAX_STORE_RECORDS,
                                   "dht_store_records",
                                   lambda self: dht_pb2.StoreResponse(store_ok=[], peer=self.node_info),
                                   cost=lambda r: sum(len(v) for v in r.values) + sum(len(k) for k in r.subkeys))

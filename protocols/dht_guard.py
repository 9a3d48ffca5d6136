"""What one peer can make this daemon's DHT node do per call: bounded keys, records and calls in flight.

hivemind's DHT handlers (1.1.12) serve any number of keys in one ``rpc_find`` and any number of records in one
``rpc_store``, each in one uninterrupted loop on the DHT's event loop, and as many calls at once as a peer sends:
the second review's outsider (no token needed) sent ``rpc_find`` calls of 30k–150k keys and ``rpc_store`` calls
of 3,000 junk-signed records, a few at a time, at one node, and the whole swarm's merges fell from about 62 to
17–25 a minute. ``install`` wraps both handlers so that:

- a call with more than ``MAX_FIND_KEYS`` keys (``MAX_STORE_RECORDS`` records) is answered with nothing, before
  any key is looked at: the caller sees a malformed answer and treats this node as one that failed it (an honest
  daemon asks for a few dozen keys at most, and stores one or a few records a call);
- a peer has at most ``MAX_CALLS_PER_PEER`` calls in flight at this node; further ones are answered with nothing;
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

REFUSED: Counter = Counter()
_in_flight: Counter = Counter()
_logged_at = [-1e9]


def _refuse(kind: str, peer: str) -> None:
    REFUSED[kind] += 1
    now = time.monotonic()
    if now - _logged_at[0] >= LOG_EVERY:
        _logged_at[0] = now
        logger.warning("DHT node refused a call of %s (%s); refused so far: %s", peer[-8:], kind, dict(REFUSED))


def _guard(handler, size, limit: int, kind: str, empty):
    @functools.wraps(handler)
    async def guarded(self, request, context):
        peer = str(context.remote_id)
        if size(request) > limit:
            _refuse(kind, peer)
            return empty(self)
        if _in_flight[peer] >= MAX_CALLS_PER_PEER:
            _refuse("dht_calls_in_flight", peer)
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
                                   lambda self: dht_pb2.StoreResponse(store_ok=[], peer=self.node_info))

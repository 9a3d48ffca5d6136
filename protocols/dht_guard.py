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
- a peer asks at most ``KEYS_PER_S`` keys a second of this node, found or stored, sustained, in bursts of up to
  ``KEYS_BURST`` (a token bucket per peer); a call past it is answered with nothing. Within the bounds above, a
  member that kept 16 finds of 256 keys and stores of 256 junk records in flight at every node cut the swarm's
  merges to 0.36-0.48 of a clean run's (``scripts/hostile/exhaustion.py``): each key found costs the node a
  look-up and its nearest peers, each record a validation (with this budget: 0.38-0.53, docs/security.md; what
  is left is most likely the refused calls' own size). An honest daemon asks a node for tens of keys a second;
- a peer writes at most ``STORE_BYTES_PER_S`` bytes of values a second into this node, sustained, in bursts of up
  to ``STORE_BURST_BYTES`` (a token bucket per peer); a store past it is answered with nothing. The review's
  member wrote 64 KB values under new keys until a node's storage grew from 695 to 2,004 MiB in 100 s (13 MB/s);
  an honest daemon writes a few KB a second into any one node, some tens in the fastest local tests;
- a peer holds at most ``MAX_KEYS_PER_PEER`` live records (key and subkey) and ``MAX_BYTES_PER_PEER`` bytes of
  them in this node at once (until they expire); a store past either is answered with nothing. The write budget
  bounds how fast one identity fills a node, this how much it can hold: an honest daemon keeps hundreds of
  small records alive in a node (a registration per round lives 4 gather timeouts + 60 s). A node sees keys
  only as hashes, so it cannot check their shapes: it bounds what each writer holds instead.
- a peer that broke a bound no honest daemon comes near (more keys or records in one call than above, or a request
  larger than ``MAX_REQUEST_BYTES``), or that kept writing or asking past its budget (``RATE_OFFENCE_COUNT``
  refusals by a budget within ``RATE_OFFENCE_WINDOW`` s), is refused every call for ``OFFENCE_COOLDOWN`` seconds,
  before its request is parsed (``dht_cooling``): hivemind parses a unary request whole before any handler sees
  it (a find of 30,000 keys is 600 KB), so the bounds above, checked on the parsed request, cost the node a parse
  for every refused call; a cooling peer's calls cost it a dictionary look-up. Requests are checked for size before the parse too.
- every refusal is counted in ``REFUSED`` (by kind), which the DHT's process logs at most once per ``LOG_EVERY``.

hivemind collects a servicer's handlers from its class when the handlers are added, so the wrappers are put on
``DHTProtocol`` itself, in the daemon's process before its DHT starts: the DHT's child process is forked from it
and inherits them (as ``scripts/wire_probe`` does for its counters). The check before the parse replaces
``P2P._add_protobuf_unary_handler`` (hivemind's registration of a unary handler, which parses the request): the
same code with the check first, for the DHT's handlers only. ``install`` fails loudly if hivemind's shape changed.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections import Counter

from hivemind.dht.protocol import DHTProtocol
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time

logger = logging.getLogger("atoll")

MAX_FIND_KEYS = 256  # an honest get_many asks one node for at most a few dozen keys
MAX_STORE_RECORDS = 256  # an honest store writes one key (a dictionary of its subkeys) or a few
MAX_CALLS_PER_PEER = 16  # a daemon polls several rounds, its peer table and nudged keys at once
LOG_EVERY = 10.0
STORE_BYTES_PER_S = 128 * 1024
STORE_BURST_BYTES = 8 * 1024 * 1024
KEYS_PER_S = 1024  # keys found and records stored a second, per peer (an honest daemon: tens)
KEYS_BURST = 4096
MAX_BUCKETS = 4096  # peers whose budgets are remembered; full (idle) ones are forgotten first
MAX_KEYS_PER_PEER = 16384  # an honest daemon: a registration a round (each lives 4 gathers + 60 s) and a few more
MAX_BYTES_PER_PEER = 16 * 1024 * 1024
MAX_HELD = 1 << 18  # live records tracked over all peers; past it (after dropping expired ones) stores are refused
OFFENCE_COOLDOWN = 30.0  # seconds a peer that broke a count or size bound is refused everything
OFFENCES = ("dht_find_keys", "dht_store_records", "dht_request_bytes")
# The budgets' refusals (keys a second, value bytes a second): one is no offence (an honest burst may meet a
# budget), RATE_OFFENCE_COUNT of them within RATE_OFFENCE_WINDOW seconds are. A peer refused that often keeps
# sending past its budget: the re-measured dynamic-keys member drew about 80 such refusals a second from each node,
# and each still cost the node a parse.
RATE_REFUSALS = ("dht_keys_rate", "dht_store_bytes")
RATE_OFFENCE_COUNT = 16
RATE_OFFENCE_WINDOW = 10.0
# Bytes of one request, before it is parsed: a find of MAX_FIND_KEYS keys is about 6 KB; a store cannot write more
# than a burst of the write budget anyway.
MAX_REQUEST_BYTES = {"rpc_find": 64 * 1024, "rpc_store": STORE_BURST_BYTES + 64 * 1024, "rpc_ping": 64 * 1024}
MAX_COOLING = 4096  # peers remembered as cooling; past it the ones whose cool-down ended first are forgotten

REFUSED: Counter = Counter()
_in_flight: Counter = Counter()
_logged_at = [-1e9]


class _Budgets:
    """A token bucket per peer: ``burst`` deep, refilled at ``rate`` a second (by default value bytes:
    ``STORE_BURST_BYTES`` and ``STORE_BYTES_PER_S``)."""

    def __init__(self, clock=time.monotonic, rate: float = STORE_BYTES_PER_S, burst: float = STORE_BURST_BYTES) -> None:
        self.clock, self.rate, self.burst = clock, rate, burst
        self.buckets: dict[str, tuple[float, float]] = {}  # peer -> (what it may spend now, when that was)

    def take(self, peer: str, size: int) -> bool:
        now = self.clock()
        level, at = self.buckets.get(peer, (float(self.burst), now))
        level = min(float(self.burst), level + (now - at) * self.rate)
        ok = size <= level
        if len(self.buckets) >= MAX_BUCKETS and peer not in self.buckets:
            full = [p for p, (lv, t) in self.buckets.items() if lv + (now - t) * self.rate >= self.burst]
            for p in full or list(self.buckets)[: len(self.buckets) // 2]:
                del self.buckets[p]
        self.buckets[peer] = (level - size if ok else level, now)
        return ok


BUDGETS = _Budgets()
WORK = _Budgets(rate=KEYS_PER_S, burst=KEYS_BURST)  # keys found and records stored


class _Holdings:
    """The live records each peer stored in this node: (key, subkey) -> (expiration, bytes), expired ones dropped
    as they are met. A record stored again replaces its earlier self, as in hivemind's storage."""

    def __init__(self, clock=get_dht_time) -> None:
        self.clock = clock
        self.peers: dict[str, dict[tuple[bytes, bytes], tuple[float, int]]] = {}
        self.total = 0
        self._swept_at = -1e9

    def _drop_expired(self, peer: str, now: float) -> dict[tuple[bytes, bytes], tuple[float, int]]:
        held = self.peers.get(peer, {})
        expired = [k for k, (until, _) in held.items() if until <= now]
        for k in expired:
            del held[k]
        self.total -= len(expired)
        if not held:
            self.peers.pop(peer, None)
        return held

    def admit(self, peer: str, records: list[tuple[bytes, bytes, float, int]]) -> str | None:
        """Record ``records`` (key, subkey, expiration, bytes) as ``peer``'s, or None; else the kind of refusal."""
        now = self.clock()
        held = dict(self._drop_expired(peer, now))
        for key, subkey, until, size in records:
            held[(key, subkey)] = (until, size)
        if len(held) > MAX_KEYS_PER_PEER:
            return "dht_keys_held"
        if sum(size for _, size in held.values()) > MAX_BYTES_PER_PEER:
            return "dht_bytes_held"
        grown = len(held) - len(self.peers.get(peer, {}))
        if self.total + grown > MAX_HELD and now - self._swept_at >= 1.0:
            self._swept_at = now
            for other in list(self.peers):
                if other != peer:
                    self._drop_expired(other, now)
        if self.total + grown > MAX_HELD:
            return "dht_records_held"
        self.peers[peer] = held
        self.total += grown
        return None


HOLDINGS = _Holdings()


def _held(request: dht_pb2.StoreRequest) -> list[tuple[bytes, bytes, float, int]]:
    return [(bytes(k), bytes(s), float(t), len(v) + len(s))
            for k, s, t, v in zip(request.keys, request.subkeys, request.expiration_time, request.values)]


class _Cooling:
    """Peers refused everything until a time (``OFFENCE_COOLDOWN`` after their last offence)."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.until: dict[str, float] = {}

    def offend(self, peer: str) -> None:
        now = self.clock()
        if len(self.until) >= MAX_COOLING and peer not in self.until:
            for p in sorted(self.until, key=self.until.__getitem__)[: len(self.until) // 2]:
                del self.until[p]
        self.until[peer] = now + OFFENCE_COOLDOWN

    def cooling(self, peer: str) -> bool:
        until = self.until.get(peer)
        if until is None:
            return False
        if until <= self.clock():
            del self.until[peer]
            return False
        return True


COOLING = _Cooling()


class _Overruns:
    """Each peer's recent refusals by a budget (``RATE_REFUSALS``): whether it now has ``RATE_OFFENCE_COUNT``
    within ``RATE_OFFENCE_WINDOW`` seconds (and then its count starts again)."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.times: dict[str, list[float]] = {}

    def overran(self, peer: str) -> bool:
        now = self.clock()
        if len(self.times) >= MAX_COOLING and peer not in self.times:
            self.times.clear()  # remembered peers are only those refused in the last window: forget them all
        recent = [t for t in self.times.get(peer, []) if now - t < RATE_OFFENCE_WINDOW] + [now]
        if len(recent) >= RATE_OFFENCE_COUNT:
            self.times.pop(peer, None)
            return True
        self.times[peer] = recent
        return False


OVERRUNS = _Overruns()


def _refuse(kind: str, peer: str) -> None:
    if kind in OFFENCES or (kind in RATE_REFUSALS and OVERRUNS.overran(peer)):
        COOLING.offend(peer)
    REFUSED[kind] += 1
    now = time.monotonic()
    if now - _logged_at[0] >= LOG_EVERY:
        _logged_at[0] = now
        logger.warning("DHT node refused a call of %s (%s); refused so far: %s", peer[-8:], kind, dict(REFUSED))


def _guard(handler, size, limit: int, kind: str, empty, cost=None, held=None):
    @functools.wraps(handler)
    async def guarded(self, request, context):
        peer = str(context.remote_id)
        if size(request) > limit:
            _refuse(kind, peer)
            return empty(self)
        if _in_flight[peer] >= MAX_CALLS_PER_PEER:
            _refuse("dht_calls_in_flight", peer)
            return empty(self)
        if not WORK.take(peer, size(request)):
            _refuse("dht_keys_rate", peer)
            return empty(self)
        if cost is not None and not BUDGETS.take(peer, cost(request)):
            _refuse("dht_store_bytes", peer)
            return empty(self)
        refusal = HOLDINGS.admit(peer, held(request)) if held is not None else None
        if refusal is not None:
            _refuse(refusal, peer)
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


def admit_request(handle_name: str, request: bytes, peer: str) -> bool:
    """Whether a unary request to a DHT handler (``handle_name`` ends with ``DHTProtocol.<rpc>``) is parsed at all:
    not from a cooling peer, not larger than ``MAX_REQUEST_BYTES``. A refusal is counted (and an oversized request
    is an offence). Other handlers' requests are admitted."""
    servicer, _, rpc = handle_name.rpartition(".")
    if not servicer.endswith("DHTProtocol") or rpc not in MAX_REQUEST_BYTES:
        return True
    if COOLING.cooling(peer):
        REFUSED["dht_cooling"] += 1
        return False
    if len(request) > MAX_REQUEST_BYTES[rpc]:
        _refuse("dht_request_bytes", peer)
        return False
    return True


class Refused(Exception):
    """A DHT request refused before it was parsed; the caller sees its call fail."""


async def _add_protobuf_unary_handler(self, handle_name, handler, input_protobuf_type, balanced=False) -> None:
    """hivemind's ``P2P._add_protobuf_unary_handler`` (1.1.12) with ``admit_request`` before the parse."""

    async def _unary_handler(request: bytes, remote_id) -> bytes:
        if not admit_request(handle_name, request, str(remote_id)):
            raise Refused("refused")
        input_serialized = input_protobuf_type.FromString(request)
        context = P2PContext(handle_name=handle_name, local_id=self.peer_id, remote_id=remote_id)
        response = await handler(input_serialized, context)
        return response.SerializeToString()

    await self._client.add_unary_handler(handle_name, _unary_handler, balanced=balanced)


_add_protobuf_unary_handler.atoll_guarded = True  # type: ignore[attr-defined]


def install() -> None:
    """Wrap ``DHTProtocol.rpc_find`` and ``rpc_store``, and check DHT requests before hivemind parses them (once;
    idempotent)."""
    for name in ("rpc_find", "rpc_store"):
        if not callable(getattr(DHTProtocol, name, None)):
            raise RuntimeError(f"hivemind's DHTProtocol has no {name}: dht_guard no longer fits it")
    original = getattr(P2P, "_add_protobuf_unary_handler", None)
    if original is None or list(inspect.signature(original).parameters) != [
            "self", "handle_name", "handler", "input_protobuf_type", "balanced"]:
        raise RuntimeError("hivemind's P2P._add_protobuf_unary_handler changed: dht_guard no longer fits it")
    if getattr(DHTProtocol.rpc_find, "atoll_guarded", False):
        return
    P2P._add_protobuf_unary_handler = _add_protobuf_unary_handler
    DHTProtocol.rpc_find = _guard(DHTProtocol.rpc_find, lambda r: len(r.keys), MAX_FIND_KEYS, "dht_find_keys",
                                  lambda self: dht_pb2.FindResponse(results=[], peer=self.node_info))
    DHTProtocol.rpc_store = _guard(DHTProtocol.rpc_store, lambda r: len(r.keys), MAX_STORE_RECORDS,
                                   "dht_store_records",
                                   lambda self: dht_pb2.StoreResponse(store_ok=[], peer=self.node_info),
                                   cost=lambda r: sum(len(v) for v in r.values) + sum(len(k) for k in r.subkeys),
                                   held=_held)

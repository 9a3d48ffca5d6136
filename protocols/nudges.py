"""Wake-ups: a round's news told to the peers it concerns, so that they read it now instead of polling for it.

The DHT stays the only source of truth: registrations, group decisions and open rounds are signed records,
validated on store and on read, as before. A nudge carries only the DHT key of a record that just changed, and
wakes whoever in this daemon waits on that key (``Nudges.listen``) to read it at once. Waiters keep a slow poll as
the fallback for nudges lost or never sent, so a daemon that reads a key when told and every second or two
makes a fraction of the DHT calls a 0.2 s poll made, and learns of a change sooner. On a thin link the DHT calls
were what filled it (docs/results.md, "The thinnest link").

Contract:
- ``tell`` sends a key to some peers, at most ``TELL_TIMEOUT`` seconds each, concurrently, and never raises: a
  nudge that does not arrive costs the receiver one fallback poll interval.
- ``NudgeServicer.rpc_nudge`` accepts a nudge only from a peer ``known`` to this daemon (a member in its table, not
  cooling down): a stranger's is dropped without a lookup. A malformed message is refused and counted
  (``nudge``). A nudge for a key nobody waits on is dropped silently: peers tell every live peer, and most of
  them are not in that round.
- A nudge can only make a waiter read one key early. Waiters bound their own reads (``Listener.wait``'s
  ``min_gap``): a peer that nudges a thousand times a second costs no more reads than the fallback poll of
  0.2 s did.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from .p2p_guard import RateLimitedLog
from .stats import TrafficStats
from .wire import WireError, pack_request, pack_response, unpack

logger = logging.getLogger("atoll")
MAX_KEY_CHARS = 256  # the longest key atoll writes is a round's group key: run id, fragment, version, digest
TELL_TIMEOUT = 5.0  # seconds per peer; a nudge is a hint, and the fallback poll covers one that is late


class Listener:
    """One waiter's registration for some keys; ``wait`` returns when one of them is nudged or after a timeout."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._last = -float("inf")
        self.keys: tuple[str, ...] = ()  # set by ``Nudges.follow``

    def poke(self) -> None:
        self._event.set()

    async def wait(self, timeout: float, min_gap: float = 0.0) -> bool:
        """Wait up to ``timeout`` seconds for a nudge; True if one came. Returns no sooner than ``min_gap`` seconds
        after the previous return, so that nudges cannot drive the caller's reads faster than that. A nudge that
        arrived while the caller was busy (between two waits) ends the next wait at once."""
        loop = asyncio.get_running_loop()
        nudged = False
        try:
            await asyncio.wait_for(self._event.wait(), max(timeout, 0.0))
            nudged = True
        except asyncio.TimeoutError:
            pass
        self._event.clear()
        gap = self._last + min_gap - loop.time()
        if gap > 0:
            await asyncio.sleep(gap)
        self._last = loop.time()
        return nudged


class Nudges:
    """Who in this daemon waits on which DHT key, and how it tells others (``send(peers, key)``: starts ``tell`` in
    the background; None sends nothing, as in tests without sockets). Runs on the protocol event loop; not
    thread-safe."""

    def __init__(self, send: Callable[[list[str], str], Any] | None = None) -> None:
        self._waiting: dict[str, set[Listener]] = {}
        self.send = send

    def tell(self, peers: Iterable[str], key: str) -> None:
        """Nudge ``peers`` about ``key`` in the background (nothing if there is no ``send``, or no peer)."""
        peers = list(peers)
        if self.send is not None and peers:
            self.send(peers, key)

    @contextmanager
    def listen(self, keys: Iterable[str]) -> Iterator[Listener]:
        """A ``Listener`` woken by a nudge for any of ``keys`` while the block runs (``follow`` changes them)."""
        listener = Listener()
        self.follow(listener, keys)
        try:
            yield listener
        finally:
            self.follow(listener, ())

    def follow(self, listener: Listener, keys: Iterable[str]) -> None:
        """From now on, wake ``listener`` for ``keys`` only (none: it is forgotten)."""
        for key in listener.keys:
            waiting = self._waiting.get(key)
            if waiting is not None:
                waiting.discard(listener)
                if not waiting:
                    del self._waiting[key]
        listener.keys = tuple(keys)
        for key in listener.keys:
            self._waiting.setdefault(key, set()).add(listener)

    def poke(self, key: str) -> bool:
        """Wake the listeners of ``key``; whether there were any."""
        waiting = self._waiting.get(key)
        for listener in waiting or ():
            listener.poke()
        return bool(waiting)

    def waiting(self) -> int:
        """How many keys are listened to (for tests: a finished wait leaves nothing behind)."""
        return len(self._waiting)


class NudgeServicer(ServicerBase):
    """Serves ``rpc_nudge``: ``{"key": str}`` from a known peer wakes the listeners of that key."""

    def __init__(self, nudges: Nudges, known: Callable[[str], bool], stats: TrafficStats) -> None:
        self.nudges, self.known, self.stats = nudges, known, stats
        self.received = 0  # nudges accepted (whether or not anyone listened)
        self._log = RateLimitedLog()

    async def rpc_nudge(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        sender = str(context.remote_id)
        if not self.known(sender):  # a joiner not yet in our table: its round's registrations are read anyway
            return pack_response({"ok": False})
        try:
            key = unpack(request, {"key": str})["key"]
            if not 0 < len(key) <= MAX_KEY_CHARS:
                raise WireError(f"a key of {len(key)} characters")
        except WireError as e:
            self.stats.reject("nudge", sender)
            self._log("nudge", "refused a nudge from %s: %s", sender[-8:], e)
            return pack_response({"ok": False})
        self.received += 1
        self.nudges.poke(key)
        return pack_response({"ok": True})


async def tell(p2p: P2P, namespace: str, peers: Iterable[str], key: str, timeout: float = TELL_TIMEOUT) -> int:
    """Nudge ``peers`` about ``key``, concurrently; how many answered. Never raises (the fallback polls cover a
    nudge that failed)."""
    peers = list(peers)
    if p2p is None or not peers:
        return 0
    request = pack_request({"key": key})

    async def one(peer: str) -> bool:
        try:
            stub = NudgeServicer.get_stub(p2p, PeerID.from_base58(peer), namespace=namespace)
            await stub.rpc_nudge(request, timeout=timeout)
            return True
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an unreachable peer, a closed connection, a timeout: it will poll
            logger.debug("nudge to %s about %s failed: %r", peer[-8:], key, e)
            return False

    started = time.monotonic()
    answered = sum(await asyncio.gather(*(one(peer) for peer in peers)))
    logger.debug("nudged %d of %d peers about %s in %.2f s", answered, len(peers), key, time.monotonic() - started)
    return answered

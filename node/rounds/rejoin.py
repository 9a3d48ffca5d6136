"""Finding the run again after a partition (on the syncer's event loop).

A daemon whose link is cut loses what connects it to the run, on both sides of the cut: its connections die,
libp2p backs off from redialing the peers it could not reach, and hivemind's DHT drops the peers that stopped
answering from its routing table, as theirs drop it. When the link comes back nothing puts them back. The
daemon reads and writes its own DHT node only, sees no live peer and trains alone for good, and the others
never see it again (``scripts/bench_partition.py``).

``Rejoin`` watches the peer table. After ``after`` seconds with no live peer but itself, it bootstraps its DHT
node again, as hivemind does at start: from the run's initial peers and from every peer it has seen live (the
libp2p peerstore still holds their addresses). A ping puts both sides back in each other's routing table, and a
lookup of its own id fills the rest. While it stays alone, it tries again every ``after`` seconds. The peers on
the other side need do nothing: once its records reach their DHT nodes again, they read it as a live peer, and
fork healing does the rest.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from hivemind.p2p import PeerID
from multiaddr import Multiaddr

from atoll.protocols.dht_io import run_in_dht

from .context import SyncContext

logger = logging.getLogger("atoll")
REJOIN_AFTER = 10.0  # seconds alone before the DHT is bootstrapped again (and between tries)
CONNECT_TIMEOUT = 5.0
LOOKUP_TIMEOUT = 10.0


async def bootstrap_again(_dht, node, peer_ids: list[str], maddrs: list[str]) -> int:
    """Run in hivemind's DHT process: dial ``maddrs`` (``/p2p/`` multiaddrs), ping them and ``peer_ids`` (a ping adds
    both sides to each other's routing table), then look up this node's own id. Returns how many answered."""
    peers = {PeerID.from_base58(p) for p in peer_ids}
    for text in maddrs:
        addr = Multiaddr(text)
        peer = PeerID.from_base58(addr["p2p"])
        peers.add(peer)
        try:  # a known address first: the peerstore may have forgotten it, and a ping alone would not dial it
            await asyncio.wait_for(node.p2p._client.connect(peer, [addr.decapsulate(Multiaddr(f"/p2p/{peer}"))]),
                                   CONNECT_TIMEOUT)
        except Exception as e:  # unreachable still (or in libp2p's dial backoff): the ping says so too
            logger.debug("rejoin: could not dial %s: %r", text, e)
    peers.discard(node.peer_id)
    answers = await asyncio.gather(*(node.protocol.call_ping(p) for p in peers))
    answered = sum(a is not None for a in answers)
    if answered:
        try:
            await asyncio.wait_for(node.find_nearest_nodes([node.node_id]), LOOKUP_TIMEOUT)
        except Exception as e:  # the pings already put the peers that answered in the routing table
            logger.debug("rejoin: own-id lookup failed: %r", e)
    return answered


class Rejoin:
    def __init__(self, ctx: SyncContext, after: float = REJOIN_AFTER, clock=time.monotonic) -> None:
        self.ctx, self.after, self._clock = ctx, after, clock
        self.seen: set[str] = set()  # every peer ever read live: the ones to look for
        self._alone_since: float | None = None
        self._last_try = float("-inf")

    def check(self, live: set[str]) -> None:
        """Called after each read of the peer table with the live peers' ids; starts a bootstrap when one is due (a
        task of its own: dead peers' dials take seconds, and the heartbeat must not wait for them)."""
        others = live - {self.ctx.peer_id}
        self.seen |= others
        now = self._clock()
        if others:
            self._alone_since = None
            return
        if self._alone_since is None:
            self._alone_since = now
        if not (self.seen or self.ctx.cfg.initial_peers):
            return  # a founder that never had a peer: nobody to look for
        if now - self._alone_since < self.after or now - self._last_try < self.after:
            return
        first = self._last_try < self._alone_since
        self._last_try = now
        self.ctx.spawn(self._bootstrap(now - self._alone_since, first))

    def after_stall(self, live: set[str]) -> None:
        """Back from a stall (``Syncer._watch_stalls``): if the table shows no live peer but us although we had
        some, bootstrap at once. The others stopped hearing from us for the stall's length and may have dropped us
        from their routing tables, as our DHT node may have dropped them; waiting ``after`` seconds first would let
        the daemon train, and merge rounds, alone meanwhile."""
        if live - {self.ctx.peer_id} or not self.seen:
            return
        now = self._clock()
        self._alone_since = now if self._alone_since is None else self._alone_since
        self._last_try = now
        self.ctx.spawn(self._bootstrap(0.0, True))

    async def _bootstrap(self, alone: float, first: bool) -> None:
        peers, initial = sorted(self.seen), list(self.ctx.cfg.initial_peers)
        call = functools.partial(bootstrap_again, peer_ids=peers, maddrs=initial)
        budget = (len(initial) + 1) * CONNECT_TIMEOUT + LOOKUP_TIMEOUT + 10  # dials one by one, pings at once
        answered = await run_in_dht(self.ctx.dht, call, timeout=budget)
        self.ctx.counters.rejoins += 1
        # One line when a lonely spell's first try is made and one when peers answer; the tries between are quiet
        # (a daemon whose peers all left would otherwise log every ``after`` seconds for as long as it trains).
        logger.log(logging.INFO if first or answered else logging.DEBUG,
                   "no live peer for %.0f s: bootstrapped the DHT again from %d known peer(s) and %d initial "
                   "peer(s); %s answered", alone, len(peers), len(initial), answered or "none")

"""Rejoin: when a daemon with nobody live bootstraps its DHT again, and what the bootstrap does in the DHT process
(with stand-ins for hivemind's node: no sockets)."""

import asyncio
from types import SimpleNamespace

import pytest
from hivemind.p2p import PeerID

import atoll.node.rounds.rejoin as rejoin
from atoll.node.metrics import Counters

ME, A, B = ("QmSGwFGzAxuKt58pYVmatcncBYiaTyb2mUEtei5dQmavPf", "QmSqNn7mVoKGDPjnL2bt7dAmoq6yQpNTA6GHjVecJRJF4Q",
            "QmbAbrQLemrrfqzVs1dfTp8ujfHcEMavpEs1xBpnfu61tN")


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def calls(monkeypatch):
    made = []

    async def fake_run_in_dht(dht, fn, timeout=None, on_timeout=None):
        made.append(fn.keywords)
        return 1

    monkeypatch.setattr(rejoin, "run_in_dht", fake_run_in_dht)
    return made


def make(initial_peers=()):
    ctx = SimpleNamespace(peer_id=ME, dht=None, counters=Counters(),
                          cfg=SimpleNamespace(initial_peers=list(initial_peers)), spawn=asyncio.run)
    clock = Clock()
    return rejoin.Rejoin(ctx, after=10.0, clock=clock), clock, ctx


def test_a_daemon_that_lost_its_peers_bootstraps_again_after_the_delay_and_then_every_delay(calls):
    r, clock, ctx = make()
    r.check({ME, A, B})
    r.check({ME})  # alone from now
    clock.now += 9.9
    r.check({ME})
    assert calls == []
    clock.now += 0.2
    r.check({ME})
    assert calls == [{"peer_ids": sorted([A, B]), "maddrs": []}] and ctx.counters.rejoins == 1
    clock.now += 5
    r.check({ME})
    assert len(calls) == 1  # not again before another delay
    clock.now += 5.1
    r.check({ME})
    assert len(calls) == 2
    r.check({ME, A})  # back: the clock starts over when it is alone again
    clock.now += 30
    r.check({ME})
    assert len(calls) == 2
    clock.now += 10.1
    r.check({ME})
    assert len(calls) == 3


def test_back_from_a_stall_with_nobody_visible_it_bootstraps_at_once(calls):
    """After a stall the others may have dropped us (and we them): a table with nobody live, when we had peers, is
    not waited out for ``after`` seconds. With peers visible, or none ever seen, nothing is done."""
    r, clock, ctx = make()
    r.after_stall({ME})
    assert calls == []  # never had a peer: nobody to look for
    r.check({ME, A})
    r.after_stall({ME, A})
    assert calls == []
    r.after_stall({ME})
    assert calls == [{"peer_ids": [A], "maddrs": []}] and ctx.counters.rejoins == 1
    clock.now += 9.9
    r.check({ME})  # the regular tries count from this one
    assert len(calls) == 1
    clock.now += 0.2
    r.check({ME})
    assert len(calls) == 2


def test_a_founder_that_never_had_a_peer_looks_for_nobody(calls):
    r, clock, _ = make()
    for _ in range(5):
        r.check({ME})
        clock.now += 20
    assert calls == []


def test_a_joiner_alone_from_the_start_tries_its_initial_peers(calls):
    maddr = f"/ip4/10.77.0.2/tcp/4001/p2p/{A}"
    r, clock, _ = make([maddr])
    r.check(set())
    clock.now += 10.5
    r.check(set())
    assert calls == [{"peer_ids": [], "maddrs": [maddr]}]


def test_bootstrap_again_dials_the_addresses_pings_everyone_once_and_looks_itself_up():
    dialed, pinged, looked_up = [], [], []

    async def connect(peer, addrs):
        dialed.append((str(peer), [str(a) for a in addrs]))
        if str(peer) == B:
            raise ConnectionError("dial backoff")  # the ping still goes out, and says whether it answers

    async def call_ping(peer):
        pinged.append(str(peer))
        return "node-id" if str(peer) == A else None

    async def find_nearest_nodes(ids):
        looked_up.append(ids)

    node = SimpleNamespace(peer_id=PeerID.from_base58(ME), node_id="own-id", p2p=SimpleNamespace(
        _client=SimpleNamespace(connect=connect)), protocol=SimpleNamespace(call_ping=call_ping),
        find_nearest_nodes=find_nearest_nodes)
    answered = asyncio.run(rejoin.bootstrap_again(
        None, node, peer_ids=[A, ME], maddrs=[f"/ip4/10.77.0.2/tcp/4001/p2p/{A}", f"/ip4/10.77.1.2/tcp/4002/p2p/{B}"]))
    assert dialed == [(A, ["/ip4/10.77.0.2/tcp/4001"]), (B, ["/ip4/10.77.1.2/tcp/4002"])]
    assert sorted(pinged) == sorted([A, B])  # each once, never ourselves
    assert answered == 1 and looked_up == [["own-id"]]


def test_bootstrap_again_skips_the_lookup_when_nobody_answers():
    looked_up = []

    async def call_ping(peer):
        return None

    async def connect(peer, addrs):
        return None

    async def find_nearest_nodes(ids):
        looked_up.append(ids)

    node = SimpleNamespace(peer_id=PeerID.from_base58(ME), node_id="own-id", p2p=SimpleNamespace(
        _client=SimpleNamespace(connect=connect)), protocol=SimpleNamespace(call_ping=call_ping),
        find_nearest_nodes=find_nearest_nodes)
    assert asyncio.run(rejoin.bootstrap_again(None, node, peer_ids=[A], maddrs=[])) == 0 and looked_up == []

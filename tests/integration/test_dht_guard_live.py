"""``dht_guard`` over real hivemind DHTs on 127.0.0.1: a node started after ``install`` answers a find of more keys
than ``MAX_FIND_KEYS`` with nothing (its caller sees a failed call), and a find of a few keys as before; the peer
that asked too much is then refused every call for ``OFFENCE_COOLDOWN``, before its request is parsed, while other
peers are served."""

import functools

import pytest
from hivemind import DHT
from hivemind.dht.routing import DHTID

from atoll.protocols import dht_guard

pytestmark = pytest.mark.integration


async def _find(_dht, node, peer, count: int):
    # Runs in the asking DHT's process: one rpc_find of ``count`` keys at ``peer``.
    keys = [DHTID.generate(source=f"key{i}") for i in range(count)]
    found = await node.protocol.call_find(peer, keys)
    return None if found is None else len(found)


def test_a_dht_node_answers_a_find_of_too_many_keys_with_nothing():
    dht_guard.install()  # before the DHTs' processes fork from this one: they inherit the guarded handlers
    target = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    asker = other = None
    try:
        asker = DHT(start=True, initial_peers=target.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        other = DHT(start=True, initial_peers=target.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        ask = functools.partial(_find, peer=target.peer_id)
        assert asker.run_coroutine(functools.partial(ask, count=10)) == 10
        assert asker.run_coroutine(functools.partial(ask, count=dht_guard.MAX_FIND_KEYS)) == dht_guard.MAX_FIND_KEYS
        assert asker.run_coroutine(functools.partial(ask, count=dht_guard.MAX_FIND_KEYS + 1)) is None
        assert asker.run_coroutine(functools.partial(ask, count=10)) is None  # cooling down: refused unparsed
        assert other.run_coroutine(functools.partial(ask, count=10)) == 10
    finally:
        for dht in (asker, other):
            if dht is not None:
                dht.shutdown()
        target.shutdown()

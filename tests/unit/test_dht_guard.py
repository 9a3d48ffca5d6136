"""The DHT node's handlers bound what one call may ask and how many calls one peer has in flight.

No sockets: the wrapped handlers are called directly with hivemind's request messages and a stand-in context.
"""

import asyncio
from types import SimpleNamespace

from hivemind.dht.protocol import DHTProtocol
from hivemind.proto import dht_pb2

from atoll.protocols import dht_guard


def test_a_find_of_too_many_keys_or_a_store_of_too_many_records_is_answered_with_nothing():
    """The second review's outsider: ``rpc_find`` with 30k-150k keys and ``rpc_store`` with 3,000 junk-signed
    records, a few at a time, at one node: the whole swarm's merges fell from about 62 to 17-25 a minute."""
    dht_guard.install()
    dht_guard.install()  # idempotent
    assert DHTProtocol.rpc_find.atoll_guarded and DHTProtocol.rpc_store.atoll_guarded
    me = SimpleNamespace(node_info=dht_pb2.NodeInfo())
    ctx = SimpleNamespace(remote_id="QmOutsider")
    before = dict(dht_guard.REFUSED)
    find = dht_pb2.FindRequest(keys=[b"k%d" % i for i in range(dht_guard.MAX_FIND_KEYS + 1)])
    assert list(asyncio.run(DHTProtocol.rpc_find(me, find, ctx)).results) == []
    store = dht_pb2.StoreRequest(keys=[b"k"] * (dht_guard.MAX_STORE_RECORDS + 1))
    assert list(asyncio.run(DHTProtocol.rpc_store(me, store, ctx)).store_ok) == []
    assert dht_guard.REFUSED["dht_find_keys"] == before.get("dht_find_keys", 0) + 1
    assert dht_guard.REFUSED["dht_store_records"] == before.get("dht_store_records", 0) + 1


def test_a_peer_has_a_bounded_number_of_calls_in_flight(monkeypatch):
    calls = []

    async def slow(self, request, context):
        calls.append(context.remote_id)
        await self.gate.wait()
        return dht_pb2.FindResponse(results=[dht_pb2.FindResult()] * len(request.keys))

    guarded = dht_guard._guard(slow, lambda r: len(r.keys), dht_guard.MAX_FIND_KEYS, "dht_find_keys",
                               lambda self: dht_pb2.FindResponse(results=[]))

    async def main():
        me = SimpleNamespace(gate=asyncio.Event())
        flood = [asyncio.ensure_future(guarded(me, dht_pb2.FindRequest(keys=[b"k"]), SimpleNamespace(remote_id="Qm1")))
                 for _ in range(dht_guard.MAX_CALLS_PER_PEER + 3)]
        other = asyncio.ensure_future(guarded(me, dht_pb2.FindRequest(keys=[b"k"]), SimpleNamespace(remote_id="Qm2")))
        await asyncio.sleep(0.01)
        answered_empty = [f for f in flood if f.done()]
        me.gate.set()
        results = await asyncio.gather(*flood, other)
        return answered_empty, results

    answered_empty, results = asyncio.run(main())
    assert len(answered_empty) == 3 and all(list(f.result().results) == [] for f in answered_empty)
    assert calls.count("Qm1") == dht_guard.MAX_CALLS_PER_PEER and calls.count("Qm2") == 1  # others unaffected
    assert sum(1 for r in results if len(r.results) == 1) == dht_guard.MAX_CALLS_PER_PEER + 1
    assert dht_guard._in_flight == {}


def test_a_peer_asks_a_bounded_number_of_keys_a_second(monkeypatch):
    """A member kept 16 finds of 256 keys (the most a call may ask) and stores of 256 junk records in flight at
    every node: within the per-call bounds, the swarm's merges fell to 0.36-0.48 of a clean run's. Keys found and
    records stored come out of a token bucket per peer: a burst of ``KEYS_BURST``, then ``KEYS_PER_S``."""
    dht_guard.install()
    now = [0.0]
    monkeypatch.setattr(dht_guard, "WORK", dht_guard._Budgets(clock=lambda: now[0], rate=dht_guard.KEYS_PER_S,
                                                              burst=dht_guard.KEYS_BURST))
    me = SimpleNamespace(node_info=dht_pb2.NodeInfo())
    flooder, honest = SimpleNamespace(remote_id="QmFlooder"), SimpleNamespace(remote_id="QmHonest")
    find = dht_pb2.FindRequest(keys=[b"k%d" % i for i in range(dht_guard.MAX_FIND_KEYS)])
    n = dht_guard.MAX_STORE_RECORDS
    store = dht_pb2.StoreRequest(keys=[b"k"] * n, subkeys=[b"s"] * n, values=[b"junk"] * n, expiration_time=[1.0] * n,
                                 in_cache=[False] * n)
    served = []
    monkeypatch.setattr(DHTProtocol, "rpc_find", dht_guard._guard(
        lambda self, request, context: _answered(served, request), lambda r: len(r.keys), dht_guard.MAX_FIND_KEYS,
        "dht_find_keys", lambda self: dht_pb2.FindResponse(results=[])))
    before = dht_guard.REFUSED["dht_keys_rate"]
    calls = dht_guard.KEYS_BURST // dht_guard.MAX_FIND_KEYS
    assert all(len(asyncio.run(DHTProtocol.rpc_find(me, find, flooder)).results) for _ in range(calls))
    assert list(asyncio.run(DHTProtocol.rpc_find(me, find, flooder)).results) == []  # the burst is spent
    assert list(asyncio.run(DHTProtocol.rpc_store(me, store, flooder)).store_ok) == []  # and so is a store
    assert dht_guard.REFUSED["dht_keys_rate"] == before + 2
    assert len(asyncio.run(DHTProtocol.rpc_find(me, dht_pb2.FindRequest(keys=[b"a", b"b"]), honest)).results) == 2
    now[0] += 1.0  # a second refills KEYS_PER_S: four more finds of 256 keys
    assert sum(bool(asyncio.run(DHTProtocol.rpc_find(me, find, flooder)).results) for _ in range(10)) == \
        dht_guard.KEYS_PER_S // dht_guard.MAX_FIND_KEYS
    assert len(served) == calls + 1 + dht_guard.KEYS_PER_S // dht_guard.MAX_FIND_KEYS


async def _answered(served: list, request):
    served.append(len(request.keys))
    return dht_pb2.FindResponse(results=[dht_pb2.FindResult()] * len(request.keys))


def test_a_peer_writes_a_bounded_number_of_bytes_a_second():
    """The second review's member wrote 64 KB values under ever new keys: a node's storage grew from 695 to
    2,004 MiB in 100 s. A peer's value bytes into one node come out of a token bucket: a burst of
    ``STORE_BURST_BYTES``, then ``STORE_BYTES_PER_S``; others are unaffected."""
    now = [0.0]
    budgets = dht_guard._Budgets(clock=lambda: now[0])
    value = 64 * 1024
    burst = dht_guard.STORE_BURST_BYTES // value
    assert all(budgets.take("m", value) for _ in range(burst))
    assert not budgets.take("m", value)  # the burst is spent
    assert budgets.take("honest", 2048)
    now[0] += 1.0  # a second refills STORE_BYTES_PER_S: two more values of 64 KB
    assert sum(budgets.take("m", value) for _ in range(10)) == dht_guard.STORE_BYTES_PER_S // value
    # Over 100 s the member writes at most the burst and 100 s of refill (the review's: 1.3 GB).
    written = 0
    for _ in range(1000):
        now[0] += 0.1
        written += sum(value for _ in range(10) if budgets.take("m", value))
    assert written <= 100 * dht_guard.STORE_BYTES_PER_S + value


def test_a_store_past_the_budget_is_answered_with_nothing(monkeypatch):
    dht_guard.install()
    now = [0.0]
    monkeypatch.setattr(dht_guard, "BUDGETS", dht_guard._Budgets(clock=lambda: now[0]))
    me = SimpleNamespace(node_info=dht_pb2.NodeInfo())
    big = dht_pb2.StoreRequest(keys=[b"k"], subkeys=[b"s"], values=[b"x" * (dht_guard.STORE_BURST_BYTES + 1)],
                               expiration_time=[1.0], in_cache=[False])
    before = dht_guard.REFUSED["dht_store_bytes"]
    assert list(asyncio.run(DHTProtocol.rpc_store(me, big, SimpleNamespace(remote_id="QmWriter"))).store_ok) == []
    assert dht_guard.REFUSED["dht_store_bytes"] == before + 1


def test_a_peer_holds_a_bounded_number_of_live_records_and_bytes_in_a_node(monkeypatch):
    """The second review's member wrote 64 KB values under ever new keys: a node's storage grew without bound."""
    monkeypatch.setattr(dht_guard, "MAX_KEYS_PER_PEER", 4)
    monkeypatch.setattr(dht_guard, "MAX_BYTES_PER_PEER", 100)
    monkeypatch.setattr(dht_guard, "MAX_HELD", 6)
    now = [1000.0]
    holdings = dht_guard._Holdings(clock=lambda: now[0])
    assert holdings.admit("m", [(b"k%d" % i, b"", 1010.0, 10) for i in range(4)]) is None
    assert holdings.admit("m", [(b"k4", b"", 1010.0, 10)]) == "dht_keys_held"
    assert holdings.admit("m", [(b"k0", b"", 1020.0, 10)]) is None  # stored again: it replaces itself
    assert holdings.admit("m", [(b"k1", b"", 1010.0, 80)]) == "dht_bytes_held"
    assert holdings.admit("h", [(b"k", b"", 1010.0, 10)]) is None  # another peer has its own quota
    assert holdings.admit("h", [(b"j", b"", 1010.0, 10), (b"i", b"", 1010.0, 10)]) == "dht_records_held"
    now[0] = 1015.0  # most of m's records expired: room again, for m and for the others
    assert holdings.admit("m", [(b"k5", b"", 1030.0, 10), (b"k6", b"", 1030.0, 10)]) is None
    assert holdings.admit("h", [(b"j", b"", 1030.0, 10)]) is None
    assert holdings.total == sum(len(h) for h in holdings.peers.values()) == 4  # m: k0, k5, k6; h: j


def test_the_store_handler_refuses_a_store_past_a_peers_holdings(monkeypatch):
    monkeypatch.setattr(dht_guard, "HOLDINGS", dht_guard._Holdings(clock=lambda: 0.0))
    monkeypatch.setattr(dht_guard, "MAX_KEYS_PER_PEER", 2)
    stored = []

    async def store(self, request, context):
        stored.extend(request.keys)
        return dht_pb2.StoreResponse(store_ok=[True] * len(request.keys))

    guarded = dht_guard._guard(store, lambda r: len(r.keys), dht_guard.MAX_STORE_RECORDS, "dht_store_records",
                               lambda self: dht_pb2.StoreResponse(store_ok=[]), held=dht_guard._held)

    def call(keys):
        request = dht_pb2.StoreRequest(keys=keys, subkeys=[b""] * len(keys), values=[b"v"] * len(keys),
                                       expiration_time=[60.0] * len(keys))
        return list(asyncio.run(guarded(None, request, SimpleNamespace(remote_id="Qm1"))).store_ok)

    assert call([b"a", b"b"]) == [True, True]
    assert call([b"c"]) == []  # a third live key
    assert stored == [b"a", b"b"]


def test_a_peer_that_broke_a_bound_is_refused_before_its_requests_are_parsed(monkeypatch):
    """The live flood kept sending finds of 30,000 keys (600 KB) that hivemind parsed whole before the bounds above
    refused them: an offence now cools the peer down, and its requests are refused before the parse."""
    dht_guard.install()
    now = [100.0]
    monkeypatch.setattr(dht_guard, "COOLING", dht_guard._Cooling(clock=lambda: now[0]))
    me = SimpleNamespace(node_info=dht_pb2.NodeInfo())
    small = dht_pb2.FindRequest(keys=[b"a", b"b"]).SerializeToString()
    name = "DHTProtocol.rpc_find"
    assert dht_guard.admit_request(name, small, "QmBig") and dht_guard.admit_request(name, small, "QmOther")
    big = dht_pb2.FindRequest(keys=[b"k%d" % i for i in range(dht_guard.MAX_FIND_KEYS + 1)])
    assert list(asyncio.run(DHTProtocol.rpc_find(me, big, SimpleNamespace(remote_id="QmBig"))).results) == []
    before = dht_guard.REFUSED["dht_cooling"]
    assert not dht_guard.admit_request(name, small, "QmBig")
    assert not dht_guard.admit_request("ns::DHTProtocol.rpc_store", small, "QmBig")  # every DHT call, any namespace
    assert dht_guard.REFUSED["dht_cooling"] == before + 2
    assert dht_guard.admit_request(name, small, "QmOther")  # others unaffected
    assert dht_guard.admit_request("StateServicer.rpc_download_state", small, "QmBig")  # not the DHT's: not here
    now[0] += dht_guard.OFFENCE_COOLDOWN - 0.1
    assert not dht_guard.admit_request(name, small, "QmBig")
    now[0] += 0.2
    assert dht_guard.admit_request(name, small, "QmBig")  # the cool-down ended
    # A request larger than a DHT call needs is refused unparsed, and is an offence itself.
    assert not dht_guard.admit_request(name, b"x" * (dht_guard.MAX_REQUEST_BYTES["rpc_find"] + 1), "QmHuge")
    assert not dht_guard.admit_request(name, small, "QmHuge")
    # A rate refusal is no offence: an honest daemon's burst does not cool it down.
    assert "dht_keys_rate" not in dht_guard.OFFENCES and "dht_calls_in_flight" not in dht_guard.OFFENCES


def test_a_peer_that_keeps_going_past_its_budget_cools_down(monkeypatch):
    """The dynamic-keys member, re-measured, drew about 80 byte-budget refusals a second from each node, each one
    parsed. A budget's refusal is no offence; RATE_OFFENCE_COUNT of them within RATE_OFFENCE_WINDOW s are."""
    now = [0.0]
    monkeypatch.setattr(dht_guard, "COOLING", dht_guard._Cooling(clock=lambda: now[0]))
    monkeypatch.setattr(dht_guard, "OVERRUNS", dht_guard._Overruns(clock=lambda: now[0]))
    small = dht_pb2.FindRequest(keys=[b"a"]).SerializeToString()
    name = "DHTProtocol.rpc_store"
    for _ in range(dht_guard.RATE_OFFENCE_COUNT - 1):  # an honest burst, refused now and then: never cooled
        dht_guard._refuse("dht_store_bytes", "QmBurst")
        now[0] += dht_guard.RATE_OFFENCE_WINDOW / (dht_guard.RATE_OFFENCE_COUNT - 1) + 0.01
    assert dht_guard.admit_request(name, small, "QmBurst")
    for kind in ("dht_store_bytes", "dht_keys_rate") * (dht_guard.RATE_OFFENCE_COUNT // 2):
        assert dht_guard.admit_request(name, small, "QmFlood")  # refused by its budgets, not cooling yet
        dht_guard._refuse(kind, "QmFlood")
        now[0] += 0.05
    assert not dht_guard.admit_request(name, small, "QmFlood")  # the 16th refusal within 10 s: cooling
    assert dht_guard.admit_request(name, small, "QmBurst")
    now[0] += dht_guard.OFFENCE_COOLDOWN
    assert dht_guard.admit_request(name, small, "QmFlood")


def test_the_unary_handler_parses_and_serves_only_admitted_requests(monkeypatch):
    """``install`` replaces hivemind's registration of a unary handler with the same code plus the check: an admitted
    request is parsed and answered as before; a refused one fails before the parse and the handler never runs."""
    from hivemind.p2p import P2P

    dht_guard.install()
    assert P2P._add_protobuf_unary_handler is dht_guard._add_protobuf_unary_handler
    now = [0.0]
    monkeypatch.setattr(dht_guard, "COOLING", dht_guard._Cooling(clock=lambda: now[0]))
    registered, seen = {}, []

    async def add_unary_handler(name, fn, balanced=False):
        registered[name] = fn

    async def handler(request, context):
        seen.append((list(request.keys), str(context.remote_id), context.handle_name))
        return dht_pb2.FindResponse(results=[dht_pb2.FindResult()] * len(request.keys))

    p2p = SimpleNamespace(peer_id="QmMe", _client=SimpleNamespace(add_unary_handler=add_unary_handler))
    asyncio.run(P2P._add_protobuf_unary_handler(p2p, "DHTProtocol.rpc_find", handler, dht_pb2.FindRequest))
    serve = registered["DHTProtocol.rpc_find"]
    answer = asyncio.run(serve(dht_pb2.FindRequest(keys=[b"a"]).SerializeToString(), "QmPeer"))
    assert len(dht_pb2.FindResponse.FromString(answer).results) == 1
    assert seen == [([b"a"], "QmPeer", "DHTProtocol.rpc_find")]
    dht_guard.COOLING.offend("QmPeer")
    try:
        asyncio.run(serve(dht_pb2.FindRequest(keys=[b"a"]).SerializeToString(), "QmPeer"))
    except dht_guard.Refused:
        pass
    else:
        raise AssertionError("a cooling peer's request was served")
    assert len(seen) == 1

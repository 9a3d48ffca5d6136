"""Nudges: a registration, a group decision or an open round told to the peers it concerns wakes their reads of
that DHT key; a flood of nudges cannot drive a waiter's reads faster than its own bound; strangers and malformed
nudges wake nobody; and a round forms from nudges alone, with a handful of DHT reads instead of a 0.2 s poll
(no sockets: the DHT is in memory, the wire is a direct call)."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from atoll.protocols import matchmaking
from atoll.protocols.matchmaking import Policy, Registrant, Round, form_group, group_key, round_key
from atoll.protocols.nudges import MAX_KEY_CHARS, Nudges, NudgeServicer
from atoll.protocols.stats import TrafficStats
from atoll.protocols.wire import pack_request, unpack
from support.views import Peers


def test_a_nudge_wakes_the_listeners_of_its_key_only():
    async def main():
        nudges = Nudges()
        with nudges.listen(["k1"]) as one, nudges.listen(["k2"]) as two:
            assert nudges.poke("k1") and not nudges.poke("k3")
            assert await one.wait(5.0) is True
            assert await two.wait(0.0) is False  # k2 was not nudged
            nudges.follow(two, ["k3"])  # retargeted: k2 no longer wakes it, k3 does
            assert not nudges.poke("k2") and nudges.poke("k3")
            assert await two.wait(5.0) is True
        assert nudges.waiting() == 0  # a finished wait leaves nothing behind

    asyncio.run(main())


def test_a_nudge_that_came_while_the_waiter_was_busy_ends_its_next_wait_at_once():
    async def main():
        nudges = Nudges()
        with nudges.listen(["k"]) as listener:
            nudges.poke("k")  # between two waits (the waiter was reading the DHT)
            started = time.monotonic()
            assert await listener.wait(30.0) is True
            assert time.monotonic() - started < 5.0

    asyncio.run(main())


def test_a_flood_of_nudges_cannot_make_reads_more_frequent_than_the_waiters_bound():
    """A hostile member nudging without pause: each wait still returns at least ``min_gap`` after the last."""
    async def main():
        nudges = Nudges()
        with nudges.listen(["k"]) as listener:
            async def flood():
                while True:
                    nudges.poke("k")
                    await asyncio.sleep(0)

            task = asyncio.create_task(flood())
            returns = []
            for _ in range(6):
                await listener.wait(10.0, min_gap=0.05)
                returns.append(time.monotonic())
            task.cancel()
        return [b - a for a, b in zip(returns, returns[1:])]

    gaps = asyncio.run(main())
    assert all(gap >= 0.05 - 1e-3 for gap in gaps), gaps


def serve(servicer, sender, msg):
    return unpack(asyncio.run(servicer.rpc_nudge(pack_request(msg), SimpleNamespace(remote_id=sender))), {"ok": bool})


def test_the_servicer_wakes_listeners_for_known_peers_and_refuses_the_rest():
    stats, nudges = TrafficStats(), Nudges()
    servicer = NudgeServicer(nudges, known=lambda peer: peer == "member", stats=stats)
    with nudges.listen(["k"]) as listener:
        assert serve(servicer, "stranger", {"key": "k"})["ok"] is False  # dropped, no lookup, no offence
        assert not listener._event.is_set() and stats.rejected == 0
        assert serve(servicer, "member", {"key": "k"})["ok"] is True
        assert listener._event.is_set() and servicer.received == 1
        assert serve(servicer, "member", {"key": "x" * (MAX_KEY_CHARS + 1)})["ok"] is False
        assert serve(servicer, "member", {"key": 5})["ok"] is False
        assert serve(servicer, "member", {})["ok"] is False
    assert stats.rejected == 3 and stats.rejected_by_kind == {"nudge": 3}
    assert serve(servicer, "member", {"key": "nobody-listens"})["ok"] is True  # harmless: nobody woken


class CountingDHT:
    """Subkeyed records shared in memory, counting reads per key."""

    def __init__(self, records, reads):
        self.records, self.reads = records, reads

    async def store(self, key, value, expiration_time, subkey, return_future):
        self.records.setdefault(key, {})[subkey] = value
        return True

    async def get(self, key, latest, return_future):
        self.reads[key] = self.reads.get(key, 0) + 1
        items = {s: SimpleNamespace(value=v) for s, v in self.records.get(key, {}).items()}
        return SimpleNamespace(value=items) if items else None


def test_a_round_forms_from_nudges_with_a_few_reads_instead_of_a_poll(monkeypatch):
    """a registers first and coordinates (first in hash order at v14), expecting b; b registers later. The fallback
    poll is set to a minute: the round can only form in time because b's registration is told to a and a's
    decision is told to b. Each reads the round's keys a few times, not five times a second."""
    monkeypatch.setattr(matchmaking, "NUDGED_POLL", 60.0)
    key, gkey = round_key("run", 0, 14, "D"), group_key("run", 0, 14, "D")
    records, reads = {}, {"a": {}, "b": {}}
    nudges = {"a": Nudges(), "b": Nudges()}
    told = []
    for me in nudges:
        def send(peers, k, me=me):
            told.append((me, tuple(peers), k))
            for peer in peers:
                nudges[peer].poke(k)
        nudges[me].send = send

    def form(me, live):
        return form_group(CountingDHT(records, reads[me]), Round("run", 0, 14, "D"), Registrant(me, me.encode(), 1.0),
                          Policy(30.0), Peers(live), nudges=nudges[me])

    async def main():
        a = asyncio.create_task(form("a", {"b": 14}))
        while reads["a"].get(gkey, 0) < 1:  # a registered and read the round once: now it waits
            await asyncio.sleep(0.01)
        started = time.monotonic()
        b = await asyncio.wait_for(form("b", {"a": 14}), 20.0)
        return await asyncio.wait_for(a, 20.0), b, time.monotonic() - started

    members_a, members_b, took = asyncio.run(main())
    assert members_a == members_b == ["a", "b"]
    assert took < 20.0
    assert ("b", ("a",), key) in told and ("a", ("b",), gkey) in told
    assert ("a", ("b",), key) in told  # a told b of its registration too (b was live at this version)
    assert sum(reads["a"].values()) <= 6 and sum(reads["b"].values()) <= 6, reads


def test_without_nudges_the_round_still_forms_by_polling(monkeypatch):
    """A peer whose nudges never arrive (an old daemon, a lost message): the fallback poll forms the round."""
    monkeypatch.setattr(matchmaking, "NUDGED_POLL", 0.05)
    key = round_key("run", 0, 14, "D")
    records, reads = {}, {}

    class Late(CountingDHT):
        async def get(self, k, latest, return_future):
            if k == key and reads.get(key) == 1:  # b registers (later than a) after a's first read, telling nobody
                records[key][b"b"] = {"peer_id": "b", "weight": 1.0, "time": matchmaking.get_dht_time()}
            return await super().get(k, latest, return_future)

    async def main():
        return await asyncio.wait_for(form_group(
            Late(records, reads), Round("run", 0, 14, "D"), Registrant("a", b"a", 1.0), Policy(30.0),
            Peers({"b": 14}), nudges=Nudges()), 20.0)

    # a, the coordinator, waits for b: it finds b's registration at a fallback read, not told of it.
    assert asyncio.run(main()) == ["a", "b"]
    assert reads[key] >= 2


@pytest.mark.parametrize("peers", [[], ["p"]])
def test_tell_without_a_sender_or_peers_sends_nothing(peers):
    nudges = Nudges()
    nudges.tell(peers, "k")  # no ``send``: nothing to do, nothing raised
    sent = []
    nudges.send = lambda p, k: sent.append((p, k))
    nudges.tell(peers, "k")
    assert sent == ([(peers, "k")] if peers else [])

"""Open rounds: a daemon reads the announcement keys of the rounds it could join (one per fragment, at its version
and digest) in one DHT call, joins a peer's round once per version, counts malformed announcements, and does not
announce a round a peer already announced (no sockets: the DHT read is a stub, the poll's wait is cut short)."""

import asyncio
from types import SimpleNamespace

import pytest

from atoll.node.rounds import round_protocol
from atoll.node.rounds.round_protocol import RoundProtocol
from atoll.protocols import nudges
from atoll.protocols.cooldown import Cooldown
from atoll.protocols.records import open_rounds_key
from atoll.protocols.stats import TrafficStats

IDS = [(5, 1.0, "aa"), (7, 1.0, "bb")]  # fragment -> (version, weight, digest) of the replica we hold


def watching(monkeypatch, announcements: dict[str, dict], polls: int = 1):
    stats, asked = TrafficStats(), []
    ctx = SimpleNamespace(dht=None, peer_id="me", namespace=lambda: "run", reject=stats.reject, cooldown=Cooldown(60.0),
                          in_round=set(), replica=SimpleNamespace(num_fragments=2, identity=lambda p: IDS[p]))
    rounds = RoundProtocol(ctx, peers=None, catch_up=None, fragments=[])

    async def get_many(dht, keys, on_timeout=None):
        asked.append(list(keys))
        return {key: SimpleNamespace(value={f"[owner:{i}]".encode(): SimpleNamespace(value=v)
                                            for i, v in enumerate(announcements.get(key, []))}) for key in keys}

    left = [polls]

    async def wait(listener, timeout, min_gap=0.0):  # the poll's wait, cut short
        if left[0] == 0:
            raise asyncio.CancelledError
        left[0] -= 1
        return False

    monkeypatch.setattr(round_protocol.dht_io, "get_many", get_many)
    monkeypatch.setattr(nudges.Listener, "wait", wait)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(rounds.watch_open_rounds())
    return rounds, asked, stats


def test_a_peers_announcement_of_our_round_is_joined_and_not_announced_again(monkeypatch):
    key1 = open_rounds_key("run", 1, 7, "bb")
    rounds, asked, stats = watching(monkeypatch, {key1: [{"peer_id": "peer", "fragment": 1, "version": 7}]})
    assert asked == [[open_rounds_key("run", 0, 5, "aa"), key1]]  # one call, the rounds we could join only
    assert rounds.take_open_rounds() == {1} and rounds._announced == {1: 7}
    assert stats.rejected == 0


def test_our_own_a_joined_and_a_mismatched_announcement_are_not_joined(monkeypatch):
    key0, key1 = open_rounds_key("run", 0, 5, "aa"), open_rounds_key("run", 1, 7, "bb")
    rounds, _, stats = watching(monkeypatch, {
        key0: [{"peer_id": "me", "fragment": 0, "version": 5}],  # ours
        key1: [{"peer_id": "peer", "fragment": 0, "version": 7},  # another fragment's, under this key
               {"peer_id": "peer", "fragment": 1, "version": 7, "extra": 1}]})  # malformed
    assert rounds.take_open_rounds() == set() and rounds._announced == {}
    assert stats.rejected_by_kind == {"open_round": 2}
    rounds._last_round[1] = 7  # we registered for v7 already: the announcement is noted, the round not joined again
    rounds, _, _ = watching(monkeypatch, {key1: [{"peer_id": "peer", "fragment": 1, "version": 7}]})
    assert rounds.take_open_rounds() == {1}

"""A decoupled round whose group is only this daemon merges alone only when that cannot fork the replica: not while
a live peer holds the fragment at a later version; after a stall only on a fresh read of the table (no sockets: the
peer table is a stub)."""

import asyncio
import time
from types import SimpleNamespace

from atoll.node.catchup import MAX_LONELY_LEAD
from atoll.node import round_protocol
from atoll.node.round_protocol import RoundProtocol
from atoll.protocols.records import Status


class Table:
    def __init__(self, records):
        self.records, self.reads, self.ages = records, 0, []

    async def refresh(self, max_age=0.0):
        self.reads += 1
        self.ages.append(max_age)
        return {r.peer_id: r for r in self.records}


def peer(name, versions, status=Status.TRAINING):
    return SimpleNamespace(peer_id=name, fragment_versions=versions, status=status)


def may_merge_alone(records, version, fragment=0, settle_until=0.0, had_peers=False):
    table = Table(records)
    rounds = RoundProtocol(SimpleNamespace(settle_until=settle_until), peers=table, catch_up=None)
    rounds.had_peers = lambda: had_peers
    return asyncio.run(rounds._may_merge_alone(fragment, version)), table.ages


def test_alone_in_the_swarm_or_ahead_of_it_merges():
    assert may_merge_alone([], 7) == (True, [round_protocol.PEERS_MAX_AGE])
    assert may_merge_alone([peer("a", [7, 9]), peer("b", [6, 3])], 7)[0]  # at our version or behind: not a fork
    assert may_merge_alone([peer("a", [7, 9])], 9, fragment=1)[0]


def test_a_live_peer_at_a_later_version_stops_a_lone_merge():
    assert not may_merge_alone([peer("a", [8, 0])], 7)[0]
    assert not may_merge_alone([peer("a", [7, 0]), peer("b", [7 + MAX_LONELY_LEAD, 0])], 7)[0]
    # Another fragment's versions do not matter; nor do peers that are not training (joining, paused, leaving).
    assert may_merge_alone([peer("a", [7, 50])], 7)[0]
    assert may_merge_alone([peer("a", [9, 0], Status.PAUSED), peer("b", [9, 0], Status.JOINING)], 7)[0]


def test_a_claim_too_far_ahead_is_ignored():
    """One lying peer cannot stop a lone daemon's rounds with a made-up version (the catch-up ignores it too)."""
    assert may_merge_alone([peer("liar", [7 + MAX_LONELY_LEAD + 1, 0])], 7)[0]


def test_after_a_stall_the_table_is_read_afresh_before_a_lone_merge():
    """The table held right after a stall is from before it: a lone merge then waits for a fresh read (max_age 0).
    It is not refused outright: as the coordinator of a round at the others' version, refusing our group of one
    would fail the round for them too."""
    settling = time.monotonic() + 60
    assert may_merge_alone([], 7, settle_until=settling) == (True, [0.0])
    assert may_merge_alone([peer("a", [8, 0])], 7, settle_until=settling) == (False, [0.0])


def test_after_a_stall_an_empty_table_is_our_dht_having_lost_the_others():
    """Settling, with no live peer visible although we had some: our DHT node lost them during the stall (the
    rejoin is finding them), so no round merges alone; once settled, or with a peer visible, the usual rule."""
    settling = time.monotonic() + 60
    assert may_merge_alone([], 7, settle_until=settling, had_peers=True) == (False, [0.0])
    assert may_merge_alone([peer("a", [9, 0], Status.LEAVING)], 7, settle_until=settling, had_peers=True)[0] is False
    assert may_merge_alone([peer("a", [7, 0])], 7, settle_until=settling, had_peers=True)[0]
    assert may_merge_alone([], 7, had_peers=True)[0]  # not settling: alone in the swarm merges


def test_a_stall_is_noticed_and_the_daemon_comes_back_at_once(monkeypatch):
    """The stall watch: a gap without the event loop running (here 30 s between two of its 0.5 s ticks) republishes,
    reads the table and catches up, and opens the settle window; normal ticks do nothing."""
    from atoll.node import syncer

    clock = iter([100.0, 100.5, 101.0, 131.0, 131.5])
    monkeypatch.setattr(syncer, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    ticks, done = [], []

    async def sleep(seconds):
        ticks.append(seconds)
        if len(ticks) == 5:
            raise asyncio.CancelledError

    monkeypatch.setattr(syncer, "asyncio", SimpleNamespace(sleep=sleep))
    table = SimpleNamespace(publish=lambda: record(done, "published"), refresh=lambda: record(done, "read", {}))
    me = SimpleNamespace(ctx=SimpleNamespace(cfg=SimpleNamespace(heartbeat=1.0), settle_until=0.0), table=table,
                         catch_up=SimpleNamespace(maybe_catch_up=lambda: done.append("caught up")), spawned=[],
                         rejoin=SimpleNamespace(after_stall=lambda live: done.append(f"rejoin {sorted(live)}")))
    me._spawn = me.spawned.append
    me._come_back = lambda: syncer.Syncer._come_back(me)

    async def watch():
        try:
            await syncer.Syncer._watch_stalls(me)
        except asyncio.CancelledError:
            pass
        assert len(me.spawned) == 1  # the 30 s gap only
        await me.spawned[0]

    asyncio.run(watch())
    assert me.ctx.settle_until == 131.0 + syncer.STALL_SETTLE_S
    assert done == ["published", "read", "rejoin []", "caught up"]


async def _value(value):
    return value


def record(log, what, value=None):
    log.append(what)
    return _value(value)

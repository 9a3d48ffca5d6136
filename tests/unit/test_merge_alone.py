"""A decoupled round whose group is only this daemon merges alone only when that cannot fork the replica: not while
a live peer holds the fragment at a later version (caught up instead), not while one holds our very replica (the
work waits for the next round, a bounded number of times); after a stall only on a fresh read of the table (no
sockets: the peer table is a stub)."""

import asyncio
import time
from types import SimpleNamespace

from atoll.node.rounds import waits
from atoll.node.rounds.catchup import MAX_LONELY_LEAD
from atoll.node.rounds.round_protocol import MAX_DEFERRALS, Outcome, RoundProtocol
from atoll.protocols.records import Status

BEHIND, DEFERRED = Outcome.BEHIND, Outcome.DEFERRED
OURS = "ours"  # the digest of our replica of every fragment


class Table:
    def __init__(self, records):
        self.records, self.reads, self.ages = records, 0, []

    def revoked(self, peer_id):
        return False

    async def refresh(self, max_age=0.0):
        self.reads += 1
        self.ages.append(max_age)
        return {r.peer_id: r for r in self.records}


def peer(name, versions, status=Status.TRAINING, hashes=(OURS, OURS)):
    return SimpleNamespace(peer_id=name, fragment_versions=versions, fragment_hashes=list(hashes), status=status)


def protocol(records, settle_until=0.0, had_peers=False, local_merge="delta", cooled=(), ancestors=(OURS,)):
    ctx = SimpleNamespace(settle_until=settle_until, cfg=SimpleNamespace(run=SimpleNamespace(local_merge=local_merge)),
                          cooldown=SimpleNamespace(active=lambda peer: peer in cooled),
                          replica=SimpleNamespace(ancestors=lambda p: tuple(ancestors)))
    rounds = RoundProtocol(ctx, peers=Table(records), catch_up=None, fragments=[])
    rounds.had_peers = lambda: had_peers
    return rounds


def refuse_alone(records, version, fragment=0, **kw):
    """What a lone round at ``version`` of ``fragment`` (our replica ``OURS``) comes to: None (merge alone) or why
    not, and the max ages of the table reads it made."""
    rounds = protocol(records, **kw)
    return asyncio.run(rounds._refuse_alone(fragment, version, OURS)), rounds.peers.ages


def test_alone_in_the_swarm_or_ahead_of_it_merges():
    assert refuse_alone([], 7) == (None, [waits.PEERS_MAX_AGE])
    assert refuse_alone([peer("b", [6, 3], hashes=("theirs", OURS))], 7)[0] is None  # behind on another line
    assert refuse_alone([peer("a", [7, 9], hashes=("other", OURS))], 7)[0] is None  # at our version on a fork


def test_a_live_peer_at_a_later_version_stops_a_lone_merge():
    assert refuse_alone([peer("a", [8, 0])], 7)[0] is BEHIND
    assert refuse_alone([peer("a", [7, 0]), peer("b", [7 + MAX_LONELY_LEAD, 0])], 7)[0] is BEHIND
    # Another fragment's versions do not matter; nor do peers that are not training (joining, paused, leaving).
    assert refuse_alone([peer("a", [6, 50], hashes=("theirs", OURS))], 7)[0] is None
    assert refuse_alone([peer("a", [9, 0], Status.PAUSED), peer("b", [7, 0], Status.JOINING)], 7)[0] is None


def test_a_live_peer_holding_our_replica_defers_the_lone_merge_a_bounded_number_of_times():
    """A peer at our version with our digest missed this round (it registered after the group closed): merging
    alone would fork the fragment, so the work waits for the next round. A peer that claims our replica and never
    joins can delay each version only MAX_DEFERRALS times; a new version starts the count again."""
    rounds = protocol([peer("a", [7, 0])])
    rounds._last_round[0], rounds._announced[0] = 7, 7
    verdicts = [asyncio.run(rounds._refuse_alone(0, 7, OURS)) for _ in range(MAX_DEFERRALS + 1)]
    assert verdicts == [DEFERRED] * MAX_DEFERRALS + [None]
    # Deferred, the daemon watches for a peer opening the fragment's round at this version again, and announces it.
    assert 0 not in rounds._last_round and 0 not in rounds._announced
    rounds.peers.records = [peer("a", [8, 0])]
    assert asyncio.run(rounds._refuse_alone(0, 8, OURS)) is DEFERRED
    assert asyncio.run(rounds._refuse_alone(1, 0, OURS)) is DEFERRED  # each fragment counts its own


def test_a_live_peer_catching_up_to_our_replica_defers_the_lone_merge_a_bounded_number_of_times():
    """A peer behind us on our line (it holds one of our replica's ancestors) is on its way to our version: a lone
    merge would put us one further ahead each time it arrives, and a fast lone daemon outran its joiners for good
    (test_split_round's four daemons stayed forked). The same bound as for a peer holding our very replica."""
    rounds = protocol([peer("b", [5, 0], hashes=("v5", OURS))], ancestors=("v4", "v5", "v6", OURS))
    verdicts = [asyncio.run(rounds._refuse_alone(0, 7, OURS)) for _ in range(MAX_DEFERRALS + 1)]
    assert verdicts == [DEFERRED] * MAX_DEFERRALS + [None]
    # An older replica we do not descend from (a fork), or a version farther back than a lonely claim may lead, is
    # no reason to wait.
    assert refuse_alone([peer("b", [5, 0], hashes=("v5'", OURS))], 7, ancestors=("v5", OURS))[0] is None
    far = 7 - MAX_LONELY_LEAD - 1
    assert refuse_alone([peer("b", [far, 0], hashes=("old", OURS))], 7, ancestors=("old", OURS))[0] is None


def test_a_peer_we_cool_down_does_not_defer_a_lone_merge():
    """A peer in cooldown (or revoked) is left out of our groups: it cannot meet us in the next round either."""
    assert refuse_alone([peer("a", [7, 0])], 7, cooled={"a"})[0] is None
    assert refuse_alone([peer("a", [7, 0]), peer("b", [7, 0])], 7, cooled={"a"})[0] is DEFERRED


def test_under_overwrite_a_lone_merge_is_not_deferred():
    """Without the delta rule a deferred round's work would be overwritten by the next merge: merge alone."""
    assert refuse_alone([peer("a", [7, 0])], 7, local_merge="overwrite")[0] is None


def test_a_claim_too_far_ahead_is_ignored():
    """One lying peer cannot stop a lone daemon's rounds with a made-up version (the catch-up ignores it too)."""
    assert refuse_alone([peer("liar", [7 + MAX_LONELY_LEAD + 1, 0])], 7)[0] is None


def test_after_a_stall_the_table_is_read_afresh_before_a_lone_merge():
    """The table held right after a stall is from before it: a lone merge then waits for a fresh read (max_age 0)."""
    settling = time.monotonic() + 60
    assert refuse_alone([], 7, settle_until=settling) == (None, [0.0])
    assert refuse_alone([peer("a", [8, 0])], 7, settle_until=settling) == (BEHIND, [0.0])


def test_after_a_stall_an_empty_table_is_our_dht_having_lost_the_others():
    """Settling, with no live peer visible although we had some: our DHT node lost them during the stall (the
    rejoin is finding them), so no round merges alone; once settled, or with a peer visible, the usual rule."""
    settling = time.monotonic() + 60
    assert refuse_alone([], 7, settle_until=settling, had_peers=True) == (BEHIND, [0.0])
    assert refuse_alone([peer("a", [9, 0], Status.LEAVING)], 7, settle_until=settling, had_peers=True)[0] is BEHIND
    fork = peer("a", [6, 0], hashes=("theirs", OURS))  # behind us on another line: the usual rule merges
    assert refuse_alone([fork], 7, settle_until=settling, had_peers=True)[0] is None
    assert refuse_alone([], 7, had_peers=True)[0] is None  # not settling: alone in the swarm merges


def test_a_stall_is_noticed_and_the_daemon_comes_back_at_once(monkeypatch):
    """The stall watch: a gap without the event loop running (here 30 s between two of its 0.5 s ticks) republishes,
    reads the table and catches up, and opens the settle window; normal ticks do nothing."""
    from atoll.node.rounds import syncer

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

"""The peer table: reads with ``max_age`` are shared and reused, plain reads always go to the DHT; the progress
records' shards are all read while the swarm is small, and in turns within ``READ_BUDGET`` records past it (no
sockets: the DHT read is replaced by a stub)."""

import asyncio
import math
from types import SimpleNamespace

import pytest
from hivemind.utils import get_dht_time

from atoll.node.rounds import peers as peers_module
from atoll.node.rounds.peers import ALL_READ_UP_TO, READ_BUDGET, WRITE_ALL_UP_TO, PeerTable
from atoll.protocols.cooldown import Cooldown
from atoll.protocols.records import ALL_SHARDS, PROGRESS_SHARDS, Status, progress_key, progress_shard
from atoll.protocols.stats import TrafficStats
from support.records import progress_record


def counting_table(delay: float = 0.0) -> tuple[PeerTable, list[int]]:
    table = PeerTable(ctx=SimpleNamespace(peer_id="me"))  # the stubbed read below is all a refresh touches
    reads: list[int] = []

    async def read(shards, prune=False):
        reads.append(len(reads))
        await asyncio.sleep(delay)
        peers = {f"peer{len(reads)}": object()}
        with table._lock:
            table._peers = peers
        return peers

    table._read_shards = read
    return table, reads


def test_concurrent_reads_with_max_age_share_one_dht_read():
    async def main():
        table, reads = counting_table(delay=0.05)
        tables = await asyncio.gather(*(table.refresh(max_age=1.0) for _ in range(5)))
        assert reads == [0] and all(t == tables[0] for t in tables) and "peer1" in tables[0]

    asyncio.run(main())


def test_recent_read_is_reused_until_max_age_then_read_again():
    async def main():
        table, reads = counting_table()
        await table.refresh(max_age=60)
        assert "peer1" in await table.refresh(max_age=60) and len(reads) == 1
        table._read_at -= 61  # the table is now older than max_age (no sleeping: a busy machine may stall)
        assert "peer2" in await table.refresh(max_age=60) and len(reads) == 2

    asyncio.run(main())


def test_plain_reads_always_go_to_the_dht():
    async def main():
        table, reads = counting_table(delay=0.02)
        await table.refresh(max_age=1.0)
        await asyncio.gather(table.refresh(), table.refresh())
        assert len(reads) == 3  # a caller that needs a fresh table (after a failed all-reduce) never gets a cached one
        assert "peer1" not in await table.refresh() and len(reads) == 4

    asyncio.run(main())


# ---- shards ----------------------------------------------------------------------------------------------------
class ShardedDHT:
    """``dht_io.get_many`` over progress records kept per shard key, and under the ``ALL_SHARDS`` key as well where
    ``all_too`` (as the writers of a small swarm do); notes the shards each read asked for (``ALL_SHARDS``: -1)."""

    def __init__(self, records, all_too: bool = True) -> None:
        self.held: dict[str, dict] = {}
        self.asked: list[list[int]] = []
        for rec in records:
            self.put(rec, all_too=all_too)

    def put(self, rec, shard: int | None = None, all_too: bool = False) -> None:
        value = SimpleNamespace(value=rec.dict())
        for s in [progress_shard(rec.peer_id) if shard is None else shard] + ([ALL_SHARDS] if all_too else []):
            self.held.setdefault(progress_key("run", s), {})[f"k{rec.peer_id}".encode()] = value

    def drop(self, peer: str) -> None:
        for held in self.held.values():
            held.pop(f"k{peer}".encode(), None)

    async def get_many(self, dht, keys, on_timeout=None):
        self.asked.append([ALL_SHARDS if key == progress_key("run", ALL_SHARDS) else int(key.rsplit("_", 1)[1])
                           for key in keys])
        return {key: SimpleNamespace(value=dict(self.held[key])) if key in self.held else None for key in keys}


def sharded_table(monkeypatch, peers: int, clock: list[float]) -> tuple[PeerTable, ShardedDHT, TrafficStats]:
    now = get_dht_time()
    records = [progress_record(f"p{i}", [1], ["x"]) for i in range(peers)]
    for rec in records:
        rec.time = now
    dht = ShardedDHT(records, all_too=peers <= WRITE_ALL_UP_TO)
    monkeypatch.setattr(peers_module.dht_io, "get_many", dht.get_many)
    monkeypatch.setattr(peers_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    stats = TrafficStats()
    ctx = SimpleNamespace(dht=None, namespace=lambda: "run", reject=stats.reject, cooldown=Cooldown(60.0),
                          replica=SimpleNamespace(num_fragments=1, identities=lambda: []), peer_id="me",
                          cfg=SimpleNamespace(heartbeat=2.0, run=SimpleNamespace(sync_every=20)),
                          counters=SimpleNamespace(step_time=0.0),
                          algorithm=SimpleNamespace(synchronous=False, gradient_allreduce=False))
    return PeerTable(ctx), dht, stats


def test_a_small_swarm_reads_every_shard_once_then_one_key(monkeypatch):
    clock = [0.0]
    table, dht, _ = sharded_table(monkeypatch, 40, clock)
    for _ in range(3):
        assert len(asyncio.run(table.refresh())) == 40
        clock[0] += 2.0
    assert dht.asked == [list(range(PROGRESS_SHARDS)), [ALL_SHARDS], [ALL_SHARDS]]


def test_a_swarm_that_grows_past_the_budget_reads_shards_and_one_that_shrinks_one_key_again(monkeypatch):
    clock = [0.0]
    table, dht, _ = sharded_table(monkeypatch, 60, clock)
    asyncio.run(table.refresh())
    asyncio.run(table.refresh())
    assert dht.asked[-1] == [ALL_SHARDS]
    now = get_dht_time()

    def grow(to: int) -> None:
        for i in range(len(table.peers()), to):
            rec = progress_record(f"p{i}", [1], ["x"])
            rec.time = now
            dht.put(rec, all_too=True)  # every writer's table is within WRITE_ALL_UP_TO

    grow(ALL_READ_UP_TO)  # within the margin: still one key
    assert len(asyncio.run(table.refresh())) == ALL_READ_UP_TO and dht.asked[-1] == [ALL_SHARDS]
    grow(ALL_READ_UP_TO + 10)
    assert len(asyncio.run(table.refresh())) == ALL_READ_UP_TO + 10 and dht.asked[-1] == [ALL_SHARDS]
    asyncio.run(table.refresh())  # the key showed more than the margin: every shard once
    assert dht.asked[-1] == list(range(PROGRESS_SHARDS)) and len(table.peers()) == ALL_READ_UP_TO + 10
    asyncio.run(table.refresh())
    assert dht.asked[-1][0] == table.my_shard and len(dht.asked[-1]) < PROGRESS_SHARDS  # then in turns
    assert len(table.peers()) == ALL_READ_UP_TO + 10
    for i in range(READ_BUDGET - 10, ALL_READ_UP_TO + 10):
        dht.drop(f"p{i}")  # most leave
    for _ in range(PROGRESS_SHARDS + 1):  # a turn round the shards sees it
        clock[0] += 2.0
        asyncio.run(table.refresh())
        if dht.asked[-1] == [ALL_SHARDS]:
            break
    assert dht.asked[-1] == [ALL_SHARDS] and len(table.peers()) == READ_BUDGET - 10


def test_a_daemon_writes_its_record_under_the_one_key_too_while_its_table_is_small(monkeypatch):
    stored: list[str] = []

    async def store(dht, key, *args, **kwargs):
        stored.append(key)
        return True

    for peers, keys in ((None, 2), (40, 2), (WRITE_ALL_UP_TO, 2), (WRITE_ALL_UP_TO + 16, 1)):
        clock = [0.0]
        table, _, _ = sharded_table(monkeypatch, peers or 0, clock)
        monkeypatch.setattr(peers_module.dht_io, "store", store)
        monkeypatch.setattr(table, "progress_record", lambda status: {})
        if peers is not None:
            asyncio.run(table.refresh())
        stored.clear()
        table.ctx.subkey = b"k"
        asyncio.run(table.publish(status=Status.TRAINING))
        assert sorted(stored) == sorted([progress_key("run", table.my_shard), progress_key("run", ALL_SHARDS)][:keys])


def test_a_large_swarm_reads_its_shard_and_the_others_in_turns_within_the_budget(monkeypatch):
    clock = [0.0]
    n = 40 * PROGRESS_SHARDS  # 40 records a shard: one read of our own shard and one other
    table, dht, _ = sharded_table(monkeypatch, n, clock)
    assert len(asyncio.run(table.refresh())) == n  # the first read knows nothing yet: every shard
    mine = table.my_shard
    others = [s for s in range(PROGRESS_SHARDS) if s != mine]
    turn = round(READ_BUDGET / (n / PROGRESS_SHARDS)) - 1
    assert turn >= 1
    seen: list[int] = []
    for _ in range(math.ceil(len(others) / turn)):
        clock[0] += 2.0
        asyncio.run(table.refresh())
        asked = dht.asked[-1]
        assert asked[0] == mine and mine not in asked[1:] and len(asked) == 1 + turn
        seen += asked[1:]
        assert len(table.peers()) == n  # what was read in earlier turns is kept
    assert set(seen) == set(others)  # one turn round reads every other shard
    # A peer that left is gone once its shard is read again; a shard not read for longer than a turn and a
    # record's lifetime is dropped.
    gone = next(f"p{i}" for i in range(n) if progress_shard(f"p{i}") == mine)
    del dht.held[progress_key("run", mine)][f"k{gone}".encode()]
    clock[0] += 2.0
    asyncio.run(table.refresh())
    assert gone not in table.peers() and len(table.peers()) == n - 1
    clock[0] += 1000.0
    asyncio.run(table.refresh())
    assert {progress_shard(p) for p in table.peers()} == set(dht.asked[-1])


def test_a_record_in_the_wrong_shard_is_refused_and_counted(monkeypatch):
    clock = [0.0]
    table, dht, stats = sharded_table(monkeypatch, 4, clock)
    stray = progress_record("stray", [1], ["x"])
    stray.time = get_dht_time()
    dht.put(stray, shard=(progress_shard("stray") + 1) % PROGRESS_SHARDS)
    assert set(asyncio.run(table.refresh())) == {"p0", "p1", "p2", "p3"}
    assert stats.rejected_by_kind == {"progress_shard": 1}


def test_a_member_is_looked_for_in_its_own_shard_only(monkeypatch):
    clock = [0.0]
    table, dht, _ = sharded_table(monkeypatch, 3 * PROGRESS_SHARDS, clock)
    assert asyncio.run(table.is_member("p7"))
    assert dht.asked == [[progress_shard("p7")]]


@pytest.mark.parametrize("shards", [1, PROGRESS_SHARDS])
def test_a_progress_record_from_the_future_is_left_out_and_counted(monkeypatch, shards):
    """A member's record claiming a time ahead of the reader's clock (to outlive its expiry in others' eyes, or to
    look fresher than it is) is not a live peer; it is counted, not held against the key (clocks drift)."""
    now = get_dht_time()
    fresh, ahead = progress_record("b", [1], ["x"]), progress_record("m", [1], ["x"])
    fresh.time, ahead.time = now, now + 3600
    held: dict[str, dict] = {}
    for subkey, rec in ((b"kb", fresh), (b"km", ahead)):
        held.setdefault(progress_key("run", progress_shard(rec.peer_id, shards)), {})[subkey] = \
            SimpleNamespace(value=rec.dict())

    async def get_many(dht, keys, on_timeout=None):
        return {key: SimpleNamespace(value=held[key]) if key in held else None for key in keys}

    monkeypatch.setattr("atoll.node.rounds.peers.dht_io.get_many", get_many)
    stats = TrafficStats()
    ctx = SimpleNamespace(dht=None, namespace=lambda: "run", reject=stats.reject, cooldown=Cooldown(60.0),
                          replica=SimpleNamespace(num_fragments=1, identities=lambda: []), peer_id="me",
                          cfg=SimpleNamespace(heartbeat=2.0, run=SimpleNamespace(sync_every=20)),
                          counters=SimpleNamespace(step_time=0.0),
                          algorithm=SimpleNamespace(synchronous=False, gradient_allreduce=False))  # open run
    peers = asyncio.run(PeerTable(ctx, shards=shards).refresh())
    assert set(peers) == {"b"} and stats.rejected_by_kind == {"progress_record_time": 1}


def test_a_look_up_reads_the_shards_of_unknown_peers_at_most_once_per_max_age(monkeypatch):
    clock = [0.0]
    table, dht, _ = sharded_table(monkeypatch, 3 * PROGRESS_SHARDS, clock)
    asyncio.run(table.look_up({"p1", "p2"}))
    assert dht.asked == [sorted({progress_shard("p1"), progress_shard("p2")})]
    assert {"p1", "p2"} <= set(table.peers())
    asyncio.run(table.look_up({"p1"}))  # known now: nothing to read
    shard = progress_shard("p1")
    stranger = next(f"q{i}" for i in range(1000) if progress_shard(f"q{i}") == shard)  # no record anywhere
    gone = next(p for p in table.peers() if p != "p1" and progress_shard(p) == shard)
    dht.held[progress_key("run", shard)].pop(f"k{gone}".encode())  # it left
    asyncio.run(table.look_up({stranger}))  # its shard was read less than max_age ago: not read again
    assert len(dht.asked) == 1 and gone in table.peers()
    clock[0] += 1.5
    asyncio.run(table.look_up({stranger}))
    assert dht.asked[1] == [shard] and gone not in table.peers() and stranger not in table.peers()


def test_a_record_lives_three_heartbeats_of_the_last_ones_length(caplog):
    table = PeerTable(ctx=SimpleNamespace(peer_id="me", cfg=SimpleNamespace(heartbeat=2.0, run=SimpleNamespace(
        sync_every=20)), counters=SimpleNamespace(step_time=0.01),  # rounds of 0.2 s: the pace is the heartbeat
        algorithm=SimpleNamespace(synchronous=False, gradient_allreduce=False)))
    assert table.lifetime() == 6.0  # before any heartbeat: three configured ones
    table.heartbeat_took(2.5)
    assert table.lifetime() == 7.5 and not caplog.records
    # A heartbeat stretched past the record's lifetime by a slow DHT: the record had expired before this store,
    # which is said; the next records live three of these.
    table.heartbeat_took(9.0)
    assert table.lifetime() == 27.0
    assert len(caplog.records) == 1 and "longer than our progress record lived (8 s)" in caplog.text
    table.heartbeat_took(1.0)  # quick again: never below three configured heartbeats
    assert table.lifetime() == 6.0
    table.heartbeat_took(1e6)
    assert table.lifetime() == peers_module.MAX_EXPIRY["progress"]  # what the DHT's validators accept


def publishing_table(monkeypatch):
    """A table whose stores are recorded: the absolute DHT expiration of every record it publishes."""
    expirations: list[float] = []

    async def store(dht, key, value, expiration, *args, **kwargs):
        expirations.append(expiration)
        return True

    table, _, _ = sharded_table(monkeypatch, 0, [0.0])
    monkeypatch.setattr(peers_module.dht_io, "store", store)
    monkeypatch.setattr(table, "progress_record", lambda status: {})
    table.ctx.subkey, table.ctx.cfg = b"k", SimpleNamespace(heartbeat=1.0, run=SimpleNamespace(sync_every=20))
    return table, expirations


def test_publish_stores_the_record_for_its_lifetime(monkeypatch):
    table, expirations = publishing_table(monkeypatch)
    table.heartbeat_took(4.0)
    asyncio.run(table.publish(status=Status.TRAINING))
    lifetimes = [e - get_dht_time() for e in expirations]
    assert lifetimes and all(11.5 < e <= 12.0 for e in lifetimes), lifetimes


def test_after_a_long_heartbeat_expirations_never_go_backwards(monkeypatch):
    """A DHT node keeps a stored value against one that expires sooner: after a freeze stretched our record's
    lifetime, a record with the usual lifetime would be refused and the others would read the old one for minutes.
    Every publication expires strictly later than the one before."""
    table, expirations = publishing_table(monkeypatch)
    table.heartbeat_took(61.0)
    asyncio.run(table.publish(status=Status.TRAINING))
    long = expirations[-1]
    assert long - get_dht_time() > 180
    table.heartbeat_took(1.0)
    published = []
    for _ in range(3):
        before = len(expirations)
        asyncio.run(table.publish(status=Status.TRAINING))
        published.append(set(expirations[before:]))
    assert all(len(e) == 1 for e in published)  # one expiration for the record under each of its keys
    times = [long, *(e.pop() for e in published)]
    assert all(a < b for a, b in zip(times, times[1:])), times


# ---- the pace of our record and of reads of the table --------------------------------------------------------------
def paced_table(monkeypatch, clock: list[float], step_time: float, heartbeat: float = 2.0) -> tuple[PeerTable, list]:
    """A table whose publications are counted: a daemon of rounds of 100 steps of ``step_time`` seconds."""
    stored: list[float] = []

    async def store(dht, key, value, expiration, subkey, **kw):
        stored.append(expiration - clock[0])

    monkeypatch.setattr(peers_module.dht_io, "store", store)
    monkeypatch.setattr(peers_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(peers_module, "get_dht_time", lambda: clock[0])
    identities = [(3, 1.0, "abc")]
    counters = SimpleNamespace(step_time=step_time, status=Status.TRAINING,
                               progress=lambda: {"step": 1})
    ctx = SimpleNamespace(dht=None, namespace=lambda: "run", reject=TrafficStats().reject, peer_id="me",
                          replica=SimpleNamespace(identities=lambda: list(identities), schedule_step=0),
                          cfg=SimpleNamespace(heartbeat=heartbeat, run=SimpleNamespace(sync_every=100),
                                              client_mode=False),
                          counters=counters, stats=TrafficStats(), subkey=b"me",
                          algorithm=SimpleNamespace(synchronous=False, gradient_allreduce=False))
    table = PeerTable(ctx)
    table._per_shard = 0.1  # a small swarm: one key besides our shard
    return table, stored, identities


def test_the_pace_follows_the_rounds_between_the_heartbeat_and_its_cap():
    def pace(step_time, heartbeat=2.0, synchronous=False, ddp=False):
        ctx = SimpleNamespace(cfg=SimpleNamespace(heartbeat=heartbeat, run=SimpleNamespace(sync_every=100)),
                              counters=SimpleNamespace(step_time=step_time), peer_id="me",
                              algorithm=SimpleNamespace(synchronous=synchronous, gradient_allreduce=ddp))
        table = PeerTable(ctx)
        table._paced = 1e9  # published at a long pace already: no cap on its growth
        return table.pace()

    assert pace(0.0) == 2.0 and pace(0.05) == 2.0  # rounds of 0 and 5 s: every heartbeat, as before
    assert pace(1.0) == 25.0  # rounds of 100 s: four times a round
    assert pace(10.0) == peers_module.MAX_PACE  # rounds of 1,000 s: at most MAX_PACE apart
    assert pace(10.0, heartbeat=120.0) == 120.0  # a heartbeat set longer than the cap is kept
    # Learners that wait for their rounds (diloco, streaming) and ddp's every-step all-reduce: a dead peer's record
    # must go at once, or every round waits its deadline for it.
    assert pace(10.0, synchronous=True) == 2.0 and pace(10.0, ddp=True) == 2.0


def test_a_slow_round_publishes_at_its_pace_and_at_once_when_the_replica_changes(monkeypatch):
    clock = [0.0]
    table, stored, identities = paced_table(monkeypatch, clock, step_time=1.0)  # pace 25 s
    beats = 0

    def beat():  # the syncer's heartbeat, every 2 s: it publishes when the table says it is due
        nonlocal beats
        if table.publish_due():
            asyncio.run(table.publish())
            beats += 1
        clock[0] += 2.0

    for _ in range(30):  # the pace doubles from the heartbeat's at each publication, to 25 s
        beat()
    assert [round(ttl) for ttl in stored[::2]] == [6, 12, 24, 48, 75]  # three paces each; two keys a publication
    at = len(stored)
    for _ in range(30):  # 60 s more at 25 s
        beat()
    assert len(stored) - at == 2 * 2
    identities[0] = (4, 2.0, "abd")  # a round merged: the others must see it now
    assert table.publish_due()
    beat()
    assert not table.publish_due()
    table.ctx.counters.status = Status.PAUSED
    assert table.publish_due()


def test_a_rounds_own_publication_does_not_stop_the_heartbeat_reading_the_table(monkeypatch):
    """A round publishes our record when it lands; the table is read and the summary published on clocks of their
    own, at the pace (a round landing every 1.5 s kept the heartbeat from ever being due, in the review)."""
    clock = [0.0]
    table, _, identities = paced_table(monkeypatch, clock, step_time=1.0)
    table._paced = 25.0
    for i in range(40):  # 80 s; a round lands (and publishes) before every heartbeat
        identities[0] = (5 + i, 1.0, f"d{i}")
        asyncio.run(table.publish())
        assert not table.publish_due()
        if table.read_due():
            table._read_at = clock[0]  # what ``refresh`` notes
        if table.summary_due():
            table._summarized_at = clock[0]
        clock[0] += 2.0
    assert table._read_at >= 50.0 and table._summarized_at >= 50.0


def test_one_slow_step_does_not_make_the_record_live_minutes(monkeypatch):
    clock = [0.0]
    table, stored, _ = paced_table(monkeypatch, clock, step_time=40.0)  # a warm-up step of 40 s
    asyncio.run(table.publish())
    assert stored[0] == pytest.approx(6.0)  # the pace grows from the heartbeat's, twice at most a publication
    table.ctx.counters.step_time = 0.05
    clock[0] += 3.0
    asyncio.run(table.publish())
    assert stored[-1] == pytest.approx(6.0)


def test_a_fast_round_publishes_every_heartbeat_as_before(monkeypatch):
    clock = [0.0]
    table, stored, _ = paced_table(monkeypatch, clock, step_time=0.01)  # rounds of 1 s: pace = heartbeat
    for _ in range(10):
        assert table.publish_due() and table.read_due() and table.summary_due()
        asyncio.run(table.publish())
        clock[0] += 2.0
    assert stored == [pytest.approx(6.0)] * 20  # our shard and the small swarm's one key, each beat


def test_a_record_about_to_expire_is_published_again_whatever_the_pace(monkeypatch):
    clock = [0.0]
    table, stored, _ = paced_table(monkeypatch, clock, step_time=1.0)
    table._paced = 25.0
    asyncio.run(table.publish(ttl=10.0))  # a short-lived record (a stall's, say)
    clock[0] = 6.0
    assert not table.publish_due()
    clock[0] = 7.0  # 3 s before it expires, within a heartbeat and a half
    assert table.publish_due()

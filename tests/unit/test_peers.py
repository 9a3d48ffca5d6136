"""The peer table: reads with ``max_age`` are shared and reused, plain reads always go to the DHT (no sockets:
the DHT read is replaced by a counting stub)."""

import asyncio

from atoll.node.peers import PeerTable


def counting_table(delay: float = 0.0) -> tuple[PeerTable, list[int]]:
    table = PeerTable(ctx=None)  # the stubbed read below is all a refresh touches
    reads: list[int] = []

    async def read():
        reads.append(len(reads))
        await asyncio.sleep(delay)
        peers = {f"peer{len(reads)}": object()}
        with table._lock:
            table._peers = peers
        return peers

    table._read_table = read
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


def test_a_progress_record_from_the_future_is_left_out_and_counted(monkeypatch):
    """A member's record claiming a time ahead of the reader's clock (to outlive its expiry in others' eyes, or to
    look fresher than it is) is not a live peer; it is counted, not held against the key (clocks drift)."""
    from types import SimpleNamespace

    from hivemind.utils import get_dht_time

    from atoll.protocols.cooldown import Cooldown
    from atoll.protocols.stats import TrafficStats
    from test_state_sync import record

    now = get_dht_time()
    fresh, ahead = record("b", [1], ["x"]), record("m", [1], ["x"])
    fresh.time, ahead.time = now, now + 3600
    entry = SimpleNamespace(value={b"kb": SimpleNamespace(value=fresh.dict()),
                                   b"km": SimpleNamespace(value=ahead.dict())})

    async def get(dht, key, on_timeout=None):
        return entry

    monkeypatch.setattr("atoll.node.peers.dht_io.get", get)
    stats = TrafficStats()
    ctx = SimpleNamespace(dht=None, namespace=lambda: "run", reject=stats.reject, cooldown=Cooldown(60.0),
                          replica=SimpleNamespace(num_fragments=1), peer_id="me", run_public_key=None)  # open run
    peers = asyncio.run(PeerTable(ctx)._read_table())
    assert set(peers) == {"b"} and stats.rejected_by_kind == {"progress_record_time": 1}

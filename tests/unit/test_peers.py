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

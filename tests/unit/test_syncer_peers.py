"""The peer table: reads with ``max_age`` are shared and reused, plain reads always go to the DHT (no sockets:
the DHT read is replaced by a counting stub)."""

import asyncio
import threading

from atoll.node.syncer import Syncer


def counting_syncer(delay: float = 0.0) -> tuple[Syncer, list[int]]:
    syncer = Syncer.__new__(Syncer)
    syncer._peers, syncer._everyone, syncer._peers_lock = {}, {}, threading.Lock()
    syncer._peers_read, syncer._peers_read_at = None, 0.0
    reads: list[int] = []

    async def read():
        reads.append(len(reads))
        await asyncio.sleep(delay)
        table = {f"peer{len(reads)}": object()}
        with syncer._peers_lock:
            syncer._peers = table
        return table

    syncer._read_peers = read
    return syncer, reads


def test_concurrent_reads_with_max_age_share_one_dht_read():
    async def main():
        syncer, reads = counting_syncer(delay=0.05)
        tables = await asyncio.gather(*(syncer.refresh_peers(max_age=1.0) for _ in range(5)))
        assert reads == [0] and all(t == tables[0] for t in tables) and "peer1" in tables[0]

    asyncio.run(main())


def test_recent_read_is_reused_until_max_age_then_read_again():
    async def main():
        syncer, reads = counting_syncer()
        await syncer.refresh_peers(max_age=60)
        assert "peer1" in await syncer.refresh_peers(max_age=60) and len(reads) == 1
        syncer._peers_read_at -= 61  # the table is now older than max_age (no sleeping: a busy machine may stall)
        assert "peer2" in await syncer.refresh_peers(max_age=60) and len(reads) == 2

    asyncio.run(main())


def test_plain_reads_always_go_to_the_dht():
    async def main():
        syncer, reads = counting_syncer(delay=0.02)
        await syncer.refresh_peers(max_age=1.0)
        await asyncio.gather(syncer.refresh_peers(), syncer.refresh_peers())
        assert len(reads) == 3  # a caller that needs a fresh table (after a failed all-reduce) never gets a cached one
        assert "peer1" not in await syncer.refresh_peers() and len(reads) == 4

    asyncio.run(main())

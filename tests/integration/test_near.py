"""``near`` over real hivemind DHTs on 127.0.0.1: in a small swarm a write goes straight to the nodes without
the lookup hivemind's store walks first, every other node reads it (signed by the writer's owner key, validated
by each) from its own storage and ``READ_BEAM`` others, a node that is gone is passed over, and one that does
not answer holds neither writes nor reads, in a small swarm or in hivemind's walks."""

import asyncio
import functools

from hivemind import DHT
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time

from atoll.protocols.identity import RecordSigner
from atoll.protocols import dht_io, near

KEY = "near_test_progress"


async def _count_finds(_dht, node) -> None:
    # Runs in the DHT's process: count this node's outgoing find calls from now on (from 0 again if counting).
    node.finds_made = 0
    if getattr(node, "counting_finds", False):
        return
    call_find = node.protocol.call_find

    async def counting(*args, **kwargs):
        node.finds_made += 1
        return await call_find(*args, **kwargs)

    node.protocol.call_find, node.counting_finds = counting, True


async def _finds(_dht, node) -> int:
    return node.finds_made


async def _hedges(_dht, node) -> int:
    return near.latency(node).hedges


def _swarm(n: int) -> list[tuple[DHT, RecordSigner]]:
    nodes = []
    for _ in range(n):
        validator = RecordSigner()
        peers = nodes[0][0].get_visible_maddrs() if nodes else []
        dht = DHT(initial_peers=peers, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                  record_validators=[validator])
        nodes.append((dht, validator))
    return nodes


async def _known(_dht, node) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


def _wait_until_known(dht: DHT, count: int, timeout: float = 20.0) -> None:
    """Until ``dht``'s routing table holds ``count`` nodes (each joiner is added once it has called the node)."""
    async def wait():
        deadline = asyncio.get_running_loop().time() + timeout
        while dht.run_coroutine(_known) < count:
            assert asyncio.get_running_loop().time() < deadline, f"the node knows fewer than {count} others"
            await asyncio.sleep(0.1)
    asyncio.run(wait())


def _read_until(dht: DHT, subkey: bytes, expect: object, timeout: float = 20.0) -> object:
    """The value under ``subkey`` once it is ``expect`` (or what was last read when ``timeout`` runs out): a node
    that joined last may take a moment to hear of the others."""
    async def read():
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            found = await dht_io.get(dht, KEY)
            value = None if found is None else found.value.get(subkey)
            value = None if value is None else value.value
            if value == expect or asyncio.get_running_loop().time() > deadline:
                return value
            await asyncio.sleep(0.2)
    return asyncio.run(read())


def test_a_small_swarm_writes_without_a_lookup_and_every_node_reads_it():
    nodes = _swarm(4)
    try:
        (writer, validator), readers = nodes[0], nodes[1:]
        _wait_until_known(writer, len(readers))
        writer.run_coroutine(_count_finds)
        subkey = validator.local_public_key

        stored = asyncio.run(dht_io.store(writer, KEY, {"step": 1}, get_dht_time() + 60, subkey))
        assert stored
        assert writer.run_coroutine(_finds) == 0
        for dht, _ in readers:
            assert _read_until(dht, subkey, {"step": 1}) == {"step": 1}

        # A read asks the reader's own storage and READ_BEAM others, not every node as hivemind's latest read does.
        reader = readers[0][0]
        reader.run_coroutine(_count_finds)
        found = asyncio.run(dht_io.get(reader, KEY))
        assert found.value[subkey].value == {"step": 1}
        # (one more for each time an answer was late: a loaded machine)
        assert 1 <= reader.run_coroutine(_finds) <= near.READ_BEAM + reader.run_coroutine(_hedges)
        reader.run_coroutine(_count_finds)
        assert reader.get(KEY, latest=True).value[subkey].value == {"step": 1}
        assert reader.run_coroutine(_finds) == len(nodes) - 1

        # hivemind's own store, for comparison: it walks the DHT first (the test's counter does count finds).
        assert writer.store(KEY, {"step": 2}, get_dht_time() + 61, subkey=subkey)
        assert writer.run_coroutine(_finds) > 0

        # One reader gone: the write still reaches the others (the next known node takes the gone one's place).
        gone, _ = readers.pop()
        gone.shutdown()
        nodes.pop()
        stored = asyncio.run(dht_io.store(writer, KEY, {"step": 3}, get_dht_time() + 62, subkey, timeout=30))
        assert stored
        for dht, _ in readers:
            assert _read_until(dht, subkey, {"step": 3}) == {"step": 3}

        # A write that expires no later than what the nodes hold is refused everywhere.
        assert not asyncio.run(dht_io.store(writer, KEY, {"step": 0}, get_dht_time() + 1, subkey))
    finally:
        for dht, _ in nodes:
            dht.shutdown()


def test_a_node_that_knows_a_full_bucket_uses_hivemind_s_store():
    nodes = _swarm(2)
    try:
        (writer, validator), (reader, _) = nodes
        # A bucket of one: this node already knows that many others, so the write walks the DHT as hivemind's does.
        writer.run_coroutine(functools.partial(_set_bucket_size, 1))
        writer.run_coroutine(_count_finds)
        assert asyncio.run(dht_io.store(writer, KEY, {"step": 1}, get_dht_time() + 60, validator.local_public_key))
        assert writer.run_coroutine(_finds) > 0
        assert _read_until(reader, validator.local_public_key, {"step": 1}) == {"step": 1}
    finally:
        for dht, _ in nodes:
            dht.shutdown()


async def _set_bucket_size(size: int, _dht, node) -> None:
    node.protocol.bucket_size = size


HUNG_S = 60.0  # a node that does not answer for longer than any read or write here may take


async def _hang_calls_to(peer: str, _dht, node) -> None:
    """Runs in the DHT's process: this node's finds and stores to ``peer`` wait ``HUNG_S`` s first (a node whose
    event loop someone else keeps busy); every node it calls is written down. The hedge is 2 s here, so that a
    healthy node on a loaded machine never looks late."""
    near.HEDGE_AFTER = 2.0
    node.called = []
    for name in ("call_find", "call_store"):
        original = getattr(node.protocol, name)

        async def hanging(peer_id, *args, _original=original, **kwargs):
            node.called.append(str(peer_id))
            if str(peer_id) == peer:
                await asyncio.sleep(HUNG_S)
            return await _original(peer_id, *args, **kwargs)

        setattr(node.protocol, name, hanging)


async def _called(_dht, node) -> list[str]:
    return node.called


def _write_then_read_past(writer: DHT, reader: DHT, subkey: bytes, hung_peer: str) -> int:
    """Three writes and five reads of ``KEY`` past the hung node, each within a quarter of its hang; the hung node
    was asked by the writer. Returns how many calls the reader made to it."""
    for step in range(3):
        assert asyncio.run(dht_io.store(writer, KEY, {"step": step}, get_dht_time() + 60 + step, subkey,
                                        timeout=HUNG_S / 4))
    assert hung_peer in writer.run_coroutine(_called)  # it was asked, and not waited for
    for _ in range(5):
        found = asyncio.run(dht_io.get(reader, KEY, timeout=HUNG_S / 4))
        assert found is not None and found.value[subkey].value == {"step": 2}
    return reader.run_coroutine(_called).count(hung_peer)


def test_a_node_that_does_not_answer_holds_neither_writes_nor_reads():
    nodes = _swarm(4)
    try:
        (writer, validator), (reader, _), (hung, _), _ = nodes
        for dht, _ in nodes:
            _wait_until_known(dht, len(nodes) - 1)
        hung_peer = str(hung.peer_id)
        for dht in (writer, reader):
            dht.run_coroutine(functools.partial(_hang_calls_to, hung_peer))
        # Four replicas: the write returns once three answered (itself and two others), without the hung one.
        # Reads answer from the others; once it is late, the hung node is asked last, so no more.
        assert _write_then_read_past(writer, reader, validator.local_public_key, hung_peer) <= 1
    finally:
        for dht, _ in nodes:
            dht.shutdown()


async def _node_id(_dht, node) -> DHTID:
    return node.node_id


def test_a_node_that_does_not_answer_holds_neither_a_walk_nor_a_store_of_a_larger_swarm():
    # Nodes that know a full bucket (3 here) read and write through hivemind's walks, which wait for every node
    # they asked: one that never answers held each read and write until it gave up (15 s here).
    nodes = _swarm(6)
    try:
        for dht, _ in nodes:
            _wait_until_known(dht, len(nodes) - 1)
        (writer, validator), (reader, _) = nodes[:2]
        key_id = DHTID.generate(source=KEY)
        # The node nearest the key: every walk for it asks that one, and every store writes to it.
        hung = min((dht for dht, _ in nodes[2:]), key=lambda dht: key_id.xor_distance(dht.run_coroutine(_node_id)))
        hung_peer = str(hung.peer_id)
        for dht in (writer, reader):
            dht.run_coroutine(functools.partial(_set_bucket_size, 3))
            dht.run_coroutine(functools.partial(_hang_calls_to, hung_peer))
        # Asked once: past its deadline, it is passed over, and no second call is sent while the first is out.
        assert _write_then_read_past(writer, reader, validator.local_public_key, hung_peer) == 1
    finally:
        for dht, _ in nodes:
            dht.shutdown()

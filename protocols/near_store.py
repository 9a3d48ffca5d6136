"""A DHT write that skips the lookup in a small swarm (runs in hivemind's DHT process, ``DHT.run_coroutine``).

hivemind's store first walks the DHT to find the nodes nearest the key, asking up to ``bucket_size`` nodes, and
every answer to that walk carries the whole value the node holds under the key: for a key with one subkey per peer
(the small swarm's shared progress key, a round's registrations) that is every peer's record, from every node, at
every write. atoll's reads all ask for the latest value (``dht_io``), and a latest read visits every node within
its beam of ``bucket_size``: while this node knows fewer than ``bucket_size`` others, a value held by any live node
is found by every read, so the walk before a write buys nothing. Then the record goes straight to the
``num_replicas`` nearest nodes this node knows (itself included, as hivemind does), the next known one taking the
place of any that does not answer. A node that knows ``bucket_size`` others or more uses hivemind's store unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from hivemind.dht.crypto import DHTRecord
from hivemind.dht.routing import DHTID


async def store_near(key: str, subkey: Any, value: Any, expiration_time: float, _dht: Any, node: Any) -> bool:
    """Store ``value`` under ``key`` (and ``subkey``) until ``expiration_time``: whether at least one node took it
    (a node refuses a value that expires no later than the one it holds). Signed by the node's record validator as
    hivemind's store signs it, so every node (this one included) validates it as it would validate hivemind's."""
    protocol = node.protocol
    key_id = DHTID.generate(source=key)
    known = [(node_id, peer_id) for node_id, peer_id in
             protocol.routing_table.get_nearest_neighbors(key_id, protocol.bucket_size, exclude=node.node_id)
             if peer_id not in node.blacklist]
    if len(known) >= protocol.bucket_size:
        return bool(await node.store(key, value, expiration_time, subkey=subkey))

    record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), protocol.serializer.dumps(value),
                       expiration_time)
    if protocol.record_validator is not None:
        record = dataclasses.replace(record, value=protocol.record_validator.sign_value(record))
    # Nearest last, so that pop() takes the nearest untried node.
    candidates = sorted([*known, (node.node_id, None)], key=lambda c: key_id.xor_distance(c[0]), reverse=True)
    stored = answered = 0
    pending: set[asyncio.Task] = set()
    while answered < node.num_replicas and (candidates or pending):
        while candidates and answered + len(pending) < node.num_replicas:
            node_id, peer_id = candidates.pop()
            if peer_id is None:
                answered += 1
                valid = protocol.record_validator is None or protocol.record_validator.validate(record)
                stored += bool(valid and protocol.storage.store(key_id, record.value, expiration_time,
                                                               subkey=subkey))
            else:
                pending.add(asyncio.create_task(protocol.call_store(
                    peer_id, keys=[key_id], values=[record.value], expiration_time=[expiration_time],
                    subkeys=[subkey])))
        if pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                result = task.result()
                if result is not None:  # None: no answer, and the next known node is tried
                    answered += 1
                    stored += bool(result[0])
    return stored > 0

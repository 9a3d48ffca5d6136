"""DHT writes and reads of a small swarm, near the key (run in hivemind's DHT process, ``DHT.run_coroutine``).

hivemind's store first walks the DHT for the nodes nearest the key, and a latest read walks every node within a
beam of ``bucket_size``; every answer in either walk carries the whole value the node holds under the key. For a
key with one subkey per peer (a small swarm's shared progress key, a round's registrations) that is every peer's
record, from every node, at every read and every write: on a thin link these walks filled the link
(docs/results.md, "What the control plane carries").

While this node knows fewer than ``bucket_size`` others, it knows the swarm: a write goes straight to the
``num_replicas`` nearest nodes it knows (itself included, as hivemind's store does), the next known one taking
the place of any that does not answer; and a latest read asks this node's own storage and the ``READ_BEAM``
nearest others (hivemind's read with a narrower beam, which still follows any nearer node they name). Every
writer and reader of a small swarm ranks the same nodes nearest a key, so the nodes read are among those written
to; the second one read covers a write the first missed (it was restarting, say). A node that knows
``bucket_size`` others or more uses hivemind's walks unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from hivemind.dht.crypto import DHTRecord
from hivemind.dht.routing import DHTID

READ_BEAM = 2


def _known(node: Any, key_id: DHTID) -> list[tuple[DHTID, Any]]:
    """The nodes this one knows nearest ``key_id``, up to ``bucket_size`` of them, not counting itself."""
    protocol = node.protocol
    return [(node_id, peer_id) for node_id, peer_id in
            protocol.routing_table.get_nearest_neighbors(key_id, protocol.bucket_size, exclude=node.node_id)
            if peer_id not in node.blacklist]


def _small(node: Any, key_id: DHTID) -> bool:
    return len(_known(node, key_id)) < node.protocol.bucket_size


async def get_near(keys: tuple[str, ...], _dht: Any, node: Any) -> dict[str, Any]:
    """The latest value of each of ``keys`` (None where there is none), as hivemind's ``get_many`` returns it: from
    this node and the ``READ_BEAM`` nearest others in a small swarm, else from hivemind's full walk."""
    small = all(_small(node, DHTID.generate(source=key)) for key in keys)
    beam = {"beam_size": READ_BEAM} if small else {}
    return dict(await node.get_many(keys, sufficient_expiration_time=float("inf"), **beam))


async def store_near(key: str, subkey: Any, value: Any, expiration_time: float, _dht: Any, node: Any) -> bool:
    """Store ``value`` under ``key`` (and ``subkey``) until ``expiration_time``: whether at least one node took it
    (a node refuses a value that expires no later than the one it holds). Signed by the node's record validator as
    hivemind's store signs it, so every node (this one included) validates it as it would validate hivemind's."""
    protocol = node.protocol
    key_id = DHTID.generate(source=key)
    known = _known(node, key_id)
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

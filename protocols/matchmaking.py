"""Forming a round through the DHT, with no leader.

A daemon ready for round (fragment, version) stores a signed registration under the round's key. Every
member reads the registrations until it sees every peer it expects (the live peers at the same version,
from their progress records) or until the gather deadline, which all members derive from the same data: the
earliest registration time plus ``gather_timeout``. Only registrations of expected peers count, so a stale
registration left by a daemon that has since died or moved on cannot pull anyone into a dead group. Registrations stamped after the deadline are ignored by
everyone, so members that read complete data agree on the group. A rare disagreement yields different group
ids; the all-reduce then fails for the disagreeing member, which falls behind and catches up by download.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from hivemind import DHT
from hivemind.utils import get_dht_time

from .records import parse_round_record, round_key, unwrap_subkeys

logger = logging.getLogger("atoll")


async def form_group(
    dht: DHT,
    *,
    run_id: str,
    fragment: int,
    version: int,
    peer_id: str,
    subkey: bytes,
    weight: float,
    expected: Callable[[], Awaitable[set[str]]],
    gather_timeout: float,
    abort: Callable[[], bool],
    poll_interval: float = 0.2,
    on_reject: Callable[[str], None] = lambda kind: None,
) -> list[str] | None:
    """Register for the round and return its sorted member list (always including this daemon).

    ``expected()`` refreshes and returns the live peers at this version (excluding this daemon).
    Returns None when ``abort()`` becomes true (e.g. a heavier replica appeared and this daemon must catch up).
    """
    key = round_key(run_id, fragment, version)
    now = get_dht_time()
    record = {"peer_id": peer_id, "weight": float(weight), "time": float(now)}
    stored = await dht.store(key, record, expiration_time=now + 4 * gather_timeout + 60, subkey=subkey,
                             return_future=True)
    if not stored:
        logger.warning("round v%d: could not store registration in the DHT", version)
    deadline = now + gather_timeout
    while True:
        if abort():
            return None
        entry = await dht.get(key, latest=True, return_future=True)
        peers = await expected()
        registered: dict[str, float] = {peer_id: now}
        for value in unwrap_subkeys(entry).values():
            rec = parse_round_record(value)
            if rec is None:
                on_reject("round_record")
            elif rec["peer_id"] in peers:
                registered[rec["peer_id"]] = rec["time"]
        deadline = min(registered.values()) + gather_timeout
        on_time = {p for p, t in registered.items() if t <= deadline}
        if peers <= on_time or get_dht_time() > deadline:
            return sorted(on_time | {peer_id})
        await asyncio.sleep(poll_interval)

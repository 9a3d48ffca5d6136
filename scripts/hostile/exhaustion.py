"""A hostile member's attacks on the honest daemons' resources (``scripts/hostile/member.py`` runs them): the
second review's DHT floods, held-open state downloads and dynamic DHT keys, live against a swarm.

- ``dht_flood``: at every honest daemon's DHT node, ``MAX_CALLS_PER_PEER`` callers at once, each in turn asking
  ``rpc_find`` for 256 keys (the most a node answers) and for 30,000, and ``rpc_store`` of 256 junk records and of
  3,000 (the review's sizes), without pause.
- ``held_downloads``: 32 downloads of the largest fragment from every honest daemon at once, each read up to its
  header and then never again; a refused or broken one is asked for again a second later.
- ``dynamic_keys``: group decisions of about 50 KB (1,000 made-up members) under new round keys (versions past the
  swarm's, bases of its own), each living an hour, as fast as its own DHT node stores them at the nearest nodes.
- ``cpu_burn``: a control, no message at all: the member's DHT process spins for the attack's length, taking
  whatever CPU its nice level gets it, as the flood's processes do. On a machine the honest daemons share, what
  it costs them is what the flood costs through the CPU alone, not through the network.

Each returns what it did (counts; ``member.partial`` holds them while it runs, but for the flood's and the keys',
counted in the DHT process until they end); what it cost the honest daemons is measured by ``bench_hostile`` (their
merges, held-out loss, resident memory and file descriptors).
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from typing import TYPE_CHECKING, Any

from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from atoll.protocols.dht_guard import MAX_CALLS_PER_PEER, MAX_FIND_KEYS, MAX_STORE_RECORDS
from atoll.protocols.matchmaking import group_key
from atoll.protocols.near import store_near
from atoll.protocols.state_serve import StateServicer
from atoll.protocols.wire import pack_request, unpack

if TYPE_CHECKING:
    from .member import HostileMember

BIG_FIND_KEYS = 30_000
BIG_STORE_RECORDS = 3_000
HELD_PER_DONOR = 32
FAKE_MEMBERS = 1_000  # a group value of about 50 KB, under the 64 KiB a group record may hold


async def _calls(_dht: Any, node: Any, peer: str, seconds: float) -> dict[str, int]:
    """Runs in the member's DHT process: one caller's flood of ``peer`` for ``seconds``."""
    target, end = PeerID.from_base58(peer), time.monotonic() + seconds
    small_keys = [DHTID.generate() for _ in range(MAX_FIND_KEYS)]
    big_keys = [DHTID.generate() for _ in range(BIG_FIND_KEYS)]
    counts = {"finds": 0, "finds_answered": 0, "stores": 0, "stores_answered": 0}
    junk = os.urandom(200)
    # The node's own store: the one its hivemind code calls waits for no slow node (``near.bound_calls``), and
    # would leave out the very victims this flood slows down.
    call_store = getattr(node, "atoll_direct_store", node.protocol.call_store)
    turn = 0
    while time.monotonic() < end:
        find = turn % 2 == 0
        size = (MAX_FIND_KEYS if find else MAX_STORE_RECORDS) if turn % 4 < 2 else \
            (BIG_FIND_KEYS if find else BIG_STORE_RECORDS)
        turn += 1
        try:
            if find:
                answer = await node.protocol.call_find(target, small_keys if size == MAX_FIND_KEYS else big_keys)
            else:
                keys = small_keys[:size] if size <= len(small_keys) else big_keys[:size]
                answer = await call_store(target, keys, [junk] * size, get_dht_time() + 3600)
        except Exception:  # noqa: BLE001 - a refused or broken call: the flood goes on
            answer = None
        kind = "finds" if find else "stores"
        counts[kind] += 1
        counts[kind + "_answered"] += answer is not None
        await asyncio.sleep(0)
    return counts


async def dht_flood(member: HostileMember, seconds: float) -> dict[str, int]:
    peers = {r.peer_id for r in await member._honest()}
    futures = [member.dht.run_coroutine(functools.partial(_calls, peer=peer, seconds=seconds), return_future=True)
               for peer in sorted(peers) for _ in range(MAX_CALLS_PER_PEER)]
    totals: dict[str, int] = {"victims": len(peers), "callers": len(futures)}
    for counts in await asyncio.gather(*futures, return_exceptions=True):
        for k, v in (counts.items() if isinstance(counts, dict) else ()):
            totals[k] = totals.get(k, 0) + v
    return totals


async def held_downloads(member: HostileMember, seconds: float) -> dict[str, int]:
    fragment = max(range(len(member.numels)), key=member.numels.__getitem__)
    counts = member.partial = {"held": 0, "refused": 0, "failed": 0}
    end = time.monotonic() + seconds

    async def hold(donor: str) -> None:
        while time.monotonic() < end:
            try:
                stub = StateServicer.get_stub(member.p2p, PeerID.from_base58(donor), namespace=member.run_id)
                stream = await stub.rpc_download_state(pack_request({"fragment": fragment}))
                header = unpack(await asyncio.wait_for(anext(stream), 30), {"ok": bool})
            except Exception:  # noqa: BLE001 - the donor is gone or broke the stream: ask again
                counts["failed"] += 1
                await asyncio.sleep(1.0)
                continue
            if not header["ok"]:  # "busy": it serves a peer two transfers at once
                counts["refused"] += 1
                await asyncio.sleep(1.0)
                continue
            counts["held"] += 1
            await asyncio.sleep(max(0.0, end - time.monotonic()))  # never read past the header

    async def stay_live() -> None:  # a member is served state while its progress record is live
        while time.monotonic() < end:
            honest = await member._honest()
            if honest:
                await member._publish(member._record_like(max(honest, key=lambda r: r.version)))
            await asyncio.sleep(2.0)

    live = asyncio.create_task(stay_live())
    donors: list[str] = []
    while not donors and time.monotonic() < end:
        await asyncio.sleep(1.0)
        donors = sorted({r.peer_id for r in await member._honest()})
    await asyncio.gather(*(hold(d) for d in donors for _ in range(HELD_PER_DONOR)))
    await live
    return counts


async def _fill(dht: Any, node: Any, run_id: str, fragments: int, version: int, subkey: bytes,
                seconds: float) -> dict[str, int]:
    """Runs in the member's DHT process (a value this large gets lost in hivemind's pipe to it): ``dynamic_keys``."""
    fakes = sorted(f"Qm{os.urandom(22).hex()}" for _ in range(FAKE_MEMBERS))
    counts = {"stored": 0, "refused": 0}
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n += 1
        key = group_key(run_id, n % fragments, version + 1 + n, f"{n:016x}")
        value = {"groups": [fakes], "time": float(get_dht_time())}
        stored = await store_near(key, subkey, value, get_dht_time() + 3600, dht, node)
        counts["stored" if stored else "refused"] += 1
    return counts


async def dynamic_keys(member: HostileMember, seconds: float) -> dict[str, int]:
    end = time.monotonic() + seconds
    honest: list = []
    while not honest and time.monotonic() < end:
        honest = await member._honest()
        await asyncio.sleep(0 if honest else 1.0)
    if not honest:
        return {"stored": 0, "refused": 0}
    top = max(honest, key=lambda r: r.version)
    return await member.dht.run_coroutine(functools.partial(
        _fill, run_id=member.run_id, fragments=len(member.numels), version=top.version, subkey=member.subkey,
        seconds=end - time.monotonic()), return_future=True)


async def _spin(_dht: Any, _node: Any, seconds: float) -> dict[str, int]:
    """Runs in the member's DHT process: busy for ``seconds``, yielding to its loop every 10 ms."""
    end, slices = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        until = time.monotonic() + 0.01
        while time.monotonic() < until:
            pass
        slices += 1
        await asyncio.sleep(0)
    return {"busy_slices": slices}


async def cpu_burn(member: HostileMember, seconds: float) -> dict[str, int]:
    return await member.dht.run_coroutine(functools.partial(_spin, seconds=seconds), return_future=True)


ATTACKS = {"cpu_burn": cpu_burn, "dht_flood": dht_flood, "held_downloads": held_downloads, "dynamic_keys": dynamic_keys}

"""DHT writes and reads of a small swarm, near the key (run in hivemind's DHT process, ``DHT.run_coroutine``).

hivemind's store first walks the DHT for the nodes nearest the key, and a latest read walks every node within a
beam of ``bucket_size``; every answer in either walk carries the whole value the node holds under the key. For a
key with one subkey per peer (a small swarm's shared progress key, a round's registrations) that is every peer's
record, from every node, at every read and every write: on a thin link these walks filled the link
(docs/results.md, "What the control plane carries").

While this node knows fewer than ``bucket_size`` others, it knows the swarm: a write goes straight to the
``num_replicas`` nearest nodes it knows (itself included, as hivemind's store does), the next known one taking
the place of any that does not answer; and a latest read asks this node's own storage and ``READ_BEAM`` of those
replicas. A node that knows ``bucket_size`` others or more uses hivemind's walks unchanged.

Slow replicas: one busy node (a member that floods its own DHT node slows every call to it, docs/security.md)
must not set the pace of every read and write of the swarm. So each node times its calls to the others
(``Latency``), a read asks the replicas that answered fastest first and asks the next one as well when an answer
is ``HEDGE_AFTER`` s late, and a write returns once ``R - READ_BEAM + 1`` of its ``R`` replicas answered, the
others finishing in the background. Any ``READ_BEAM`` replicas a read asks then include one that
answered the write: the two sets of a swarm's ``R`` replicas cannot miss each other.

A larger swarm's walks are bounded too (``bound_calls``). hivemind's walk waits for every node it asked before it
ends, so in a swarm of 24 nodes one that answered 1.5 s late made every read and write 1.5 s late
(``scripts/bench_slow_node.py``), and a member controls how late its own node answers, up to the protocol's
``wait_timeout``. Every find and store hivemind makes goes through ``bounded``: a call to a node known to be slow
(``Latency.slow``) is answered at once as a node that failed, and sent in the background, one at a time, so that
the node's time is still measured; any other call is waited for at most ``CALL_DEADLINE`` s (or the hedge, when
that is longer), and then the walk or store goes on without it (a store to the next nearest node), and the node
that missed it is passed over for ``PASS_OVER`` s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from typing import Any

from hivemind.dht.crypto import DHTRecord
from hivemind.dht.routing import DHTID

logger = logging.getLogger("atoll")

READ_BEAM = 2
HEDGE_AFTER = 0.2  # s: a read's replica this late is joined by the next one (a healthy answer on loopback is ms)
HEDGE_FACTOR = 4.0
CALL_DEADLINE = 1.0  # s: how long a call is waited for at most before a read or write goes on without it (a slow
# link's answers take a few hundred ms)
PASS_OVER = 30.0  # s: a node that let a call pass its deadline is not waited for during this long (``bounded``)
MAX_PASSED_OVER = 4096  # nodes remembered as passed over; past it, those whose time is up are forgotten
RECENT = 300.0  # s: the nodes timed this recently make the median of ``bounded``'s hedge (not those long gone)
MAX_TIMED = 4096  # nodes whose times are kept; past it, those not timed for ``RECENT`` s are forgotten
LOOP_LATE = 0.5  # a deadline's timer this much later than the deadline (its share): this node's own loop was held
LATENCY_WEIGHT = 0.5  # each call's share of a node's latency estimate (an exponential average)
_BACKGROUND: set[asyncio.Future] = set()  # work left to finish after its read or write returned: asyncio keeps
# only weak references to tasks


def _keep(tasks: Any) -> None:
    """Hold ``tasks`` until they finish (see ``_BACKGROUND``); nobody awaits them, so their exceptions are read here
    (asyncio would log each as never retrieved)."""
    for task in tasks:
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)
        task.add_done_callback(_read_exception)


def _read_exception(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.debug("a DHT call left to finish in the background failed: %r", task.exception())


class Latency:
    """How long this node's calls to each other node take (an exponential average, seconds; a call that got no
    answer counts as ``wait_timeout``), and the calls still out: a node whose oldest open call is older than its
    average counts as that slow. Read replicas are asked fastest first; unknown nodes count as fast."""

    def __init__(self) -> None:
        self.seconds: dict[Any, float] = {}
        self.timed_at: dict[Any, float] = {}  # when each node's last call ended (the loop's clock)
        self.open: dict[Any, list[float]] = {}  # start times of the calls still out, per node
        self.hedges = 0  # nodes asked by reads beyond ``READ_BEAM`` because an answer was late
        self.passed_over = 0  # calls answered as failed at once: the node was known slow (``bounded``)
        self.passed_until: dict[Any, float] = {}  # nodes that let a call pass its deadline: until when they are slow
        self.given_up = 0  # calls not waited for past their deadline (``bounded``)

    def observe(self, peer_id: Any, seconds: float, now: float = 0.0) -> None:
        old = self.seconds.get(peer_id)
        self.seconds[peer_id] = seconds if old is None else old + LATENCY_WEIGHT * (seconds - old)
        self.timed_at[peer_id] = now
        if len(self.seconds) > MAX_TIMED:
            for gone in [p for p, t in self.timed_at.items() if t < now - RECENT]:
                del self.seconds[gone], self.timed_at[gone]

    def recent(self, now: float) -> list[Any]:
        """The nodes timed within ``RECENT`` s: their median is a hedge's measure of this swarm now."""
        return [p for p, t in self.timed_at.items() if t >= now - RECENT]

    def waited(self, peer_id: Any, now: float) -> float:
        """How long the oldest call to ``peer_id`` still out has been waited for (0: none)."""
        return max((now - t for t in self.open.get(peer_id, ())), default=0.0)

    def estimate(self, peer_id: Any, now: float) -> float:
        return max(self.seconds.get(peer_id, 0.0), self.waited(peer_id, now))

    def fastest_first(self, peers: list[Any], now: float) -> list[Any]:
        """``peers`` by their latency, in the order they came (nearest first) between equals."""
        return sorted(peers, key=lambda p: self.estimate(p, now))

    def hedge_after(self, peers: list[Any], now: float) -> float:
        """How late an answer from ``peers`` may be before the next node is asked too: ``HEDGE_AFTER``, or
        ``HEDGE_FACTOR`` × their median latency when every node answers slowly (a loaded machine)."""
        estimates = sorted(self.estimate(p, now) for p in peers)
        return max(HEDGE_AFTER, HEDGE_FACTOR * estimates[len(estimates) // 2]) if estimates else HEDGE_AFTER

    def slow(self, peer_id: Any, now: float) -> bool:
        """Whether ``peer_id`` is not to be waited for: it let a call pass its deadline less than ``PASS_OVER`` s
        ago, or it answers later than a hedge over the nodes timed lately (``hedge_after``, ``recent``). The first
        is what keeps a node that answers late only now and then (its average falling between) from costing a
        deadline at every other call."""
        if now < self.passed_until.get(peer_id, -math.inf):
            return True
        # A node not timed lately is judged afresh, as one never timed is: against a hedge of the nodes timed
        # lately, an average from long ago (a slower link then, or this node idle since) would pass it over.
        average = self.seconds.get(peer_id, 0.0) if self.timed_at.get(peer_id, now) >= now - RECENT else 0.0
        return max(average, self.waited(peer_id, now)) > self.hedge_after(self.recent(now), now)

    def missed(self, peer_id: Any, now: float) -> None:
        """``peer_id`` let a call pass its deadline at ``now``."""
        if len(self.passed_until) >= MAX_PASSED_OVER:
            self.passed_until = {p: t for p, t in self.passed_until.items() if t > now}
        self.passed_until[peer_id] = now + PASS_OVER

    async def timed(self, peer_id: Any, call: Any, no_answer: float) -> Any:
        """``call``'s result (None when the node did not answer), its time observed."""
        loop = asyncio.get_running_loop()
        started, result = loop.time(), None
        self.open.setdefault(peer_id, []).append(started)
        try:
            result = await call
        finally:
            opened = self.open[peer_id]
            opened.remove(started)
            if not opened:
                del self.open[peer_id]
            ended = loop.time()
            took = ended - started
            self.observe(peer_id, took if result is not None else max(no_answer, took), ended)
        return result


async def _answered(task: asyncio.Future, timeout: float) -> bool:
    """Whether ``task`` finished within ``timeout`` s; if the caller is cancelled meanwhile (its walk ended), the
    task runs on in the background: it still times its node."""
    try:
        done, _ = await asyncio.wait([task], timeout=timeout)
    except asyncio.CancelledError:
        _keep([task])
        raise
    return bool(done)


async def bounded(node: Any, peer_id: Any, call: Any) -> Any:
    """``call``'s result (a coroutine's: hivemind's find or store, to ``peer_id``), or None (no answer) when the node
    is known slow (``Latency.slow``: the call is then sent in the background if no other call to it is out, so that
    its time is still measured) or did not answer within ``CALL_DEADLINE`` s (or the hedge, if longer; the call
    finishes in the background). Every call is timed here, once."""
    clock, wait_timeout = latency(node), node.protocol.wait_timeout
    now = asyncio.get_running_loop().time()
    if clock.slow(peer_id, now):
        clock.passed_over += 1
        if peer_id in clock.open:
            call.close()
        else:
            _keep([asyncio.ensure_future(clock.timed(peer_id, call, wait_timeout))])
        return None
    deadline = max(CALL_DEADLINE, clock.hedge_after(clock.recent(now), now))
    task = asyncio.ensure_future(clock.timed(peer_id, call, wait_timeout))
    if await _answered(task, deadline):
        return task.result()
    late = asyncio.get_running_loop().time() - now - deadline
    if late > LOOP_LATE * deadline:
        # This node's own loop was held past the deadline (a long validation, the GIL): the answer may be here,
        # not yet read. It gets a moment more, and the node is not blamed either way.
        if await _answered(task, HEDGE_AFTER):
            return task.result()
        _keep([task])
        return None
    clock.given_up += 1
    clock.missed(peer_id, asyncio.get_running_loop().time())
    logger.info("DHT node %s answered no call within %.1f s: not waited for during %.0f s (%d such calls so far)",
                str(peer_id)[-8:], deadline, PASS_OVER, clock.given_up)
    _keep([task])
    return None


def bound_calls(node: Any) -> None:
    """Send every find and store hivemind's code makes on ``node`` through ``bounded``: its walks (reads, and a
    store's search for the nearest nodes), its stores and its upkeep. A small swarm's reads and writes here keep
    their own rules (a hedge, a write quorum) and call the node's own finds and stores (``atoll_direct_find``,
    ``atoll_direct_store``): they wait for no slow node already. Once per node; what it wraps is whatever the
    node held when first called (a test's stand-in as well)."""
    if getattr(node, "atoll_bounded", False):
        return
    find, store = node._call_find_with_blacklist, node.protocol.call_store
    node.atoll_direct_find, node.atoll_direct_store = find, store

    async def find_bounded(peer_id: Any, keys: Any) -> Any:
        if peer_id in node.blacklist:  # not asked at all (hivemind's own rule): no time to measure
            return None
        return await bounded(node, peer_id, find(peer_id, keys))

    async def store_bounded(peer_id: Any, *args: Any, **kwargs: Any) -> Any:
        return await bounded(node, peer_id, store(peer_id, *args, **kwargs))

    node._call_find_with_blacklist, node.protocol.call_store = find_bounded, store_bounded
    node.atoll_bounded = True


def latency(node: Any) -> Latency:
    """The node's ``Latency`` (kept on the node: every coroutine here runs in the DHT's process, given the node)."""
    if not isinstance(getattr(node, "atoll_latency", None), Latency):
        node.atoll_latency = Latency()
    return node.atoll_latency


def _known(node: Any, key_id: DHTID) -> list[tuple[DHTID, Any]]:
    """The nodes this one knows nearest ``key_id``, up to ``bucket_size`` of them, not counting itself."""
    protocol = node.protocol
    return [(node_id, peer_id) for node_id, peer_id in
            protocol.routing_table.get_nearest_neighbors(key_id, protocol.bucket_size, exclude=node.node_id)
            if peer_id not in node.blacklist]


def _small(node: Any, key_id: DHTID) -> bool:
    return len(_known(node, key_id)) < node.protocol.bucket_size


def replicas(node: Any, key_id: DHTID) -> tuple[list[tuple[DHTID, Any]], int]:
    """The nodes a small swarm's writes of ``key_id`` go to, nearest first (``peer_id`` None: this node), then the
    other known nodes that stand in for any that does not answer; and ``R``, how many of them are the replicas."""
    candidates = sorted([*_known(node, key_id), (node.node_id, None)], key=lambda c: key_id.xor_distance(c[0]))
    return candidates, min(node.num_replicas, len(candidates))


def write_quorum(count: int) -> int:
    """Answers a write of ``count`` replicas waits for: enough that any ``READ_BEAM`` of them include one."""
    return max(1, count - READ_BEAM + 1)


def read_order(node: Any, key_id: DHTID) -> list[Any]:
    """The other nodes a small swarm's read of ``key_id`` asks, in order: the replicas fastest first, then the
    nodes that stand in for them."""
    candidates, count = replicas(node, key_id)
    others = [peer for _, peer in candidates[:count] if peer is not None]
    now = asyncio.get_running_loop().time()
    return latency(node).fastest_first(others, now) + [peer for _, peer in candidates[count:] if peer is not None]


async def get_near(keys: tuple[str, ...], _dht: Any, node: Any) -> dict[str, Any]:
    """The latest value of each of ``keys`` (None where there is none), as hivemind's ``get_many`` returns it: from
    this node and ``READ_BEAM`` of the key's replicas in a small swarm, else from hivemind's full walk."""
    bound_calls(node)
    ids = {key: DHTID.generate(source=key) for key in keys}
    if not all(_small(node, key_id) for key_id in ids.values()):
        return dict(await node.get_many(keys, sufficient_expiration_time=float("inf")))
    found = await _read(node, list(ids.values()))
    return {key: found[key_id] for key, key_id in ids.items()}


async def _read(node: Any, key_ids: list[DHTID]) -> dict[DHTID, Any]:
    """Each key's latest value from this node's storage and ``READ_BEAM`` answers of its read order (``read_order``),
    merged as hivemind's read merges them (``_SearchState``: the latest value, a dictionary's subkeys joined). A
    replica that fails is replaced at once; one that is late (``Latency.hedge_after``) is joined by the next."""
    from hivemind.dht.node import _SearchState  # hivemind's merge of a read's answers: one rule for both reads

    protocol, clock = node.protocol, latency(node)
    states = {k: _SearchState(k, float("inf"), serializer=protocol.serializer,
                              record_validator=protocol.record_validator) for k in key_ids}
    for key_id, state in states.items():
        state.add_candidate(protocol.storage.get(key_id), source_node_id=node.node_id)
        state.add_candidate(protocol.cache.get(key_id), source_node_id=node.node_id)
    order = {k: read_order(node, k) for k in key_ids}
    answered = dict.fromkeys(key_ids, 0)
    pending: dict[asyncio.Task, list[DHTID]] = {}

    def ask(wanted: list[DHTID]) -> bool:
        """The next node in each wanted key's order, one call per node; whether there was one."""
        calls: dict[Any, list[DHTID]] = {}
        for key_id in wanted:
            if order[key_id]:
                calls.setdefault(order[key_id].pop(0), []).append(key_id)
        for peer_id, ids in calls.items():
            call = node.atoll_direct_find(peer_id, ids)
            pending[asyncio.ensure_future(clock.timed(peer_id, call, protocol.wait_timeout))] = ids
        return bool(calls)

    loop = asyncio.get_running_loop()
    hedge = clock.hedge_after(list({p for peers in order.values() for p in peers}), loop.time())
    for _ in range(READ_BEAM):
        ask(key_ids)
    while pending and any(answered[k] < READ_BEAM for k in key_ids):
        done, _ = await asyncio.wait(list(pending), timeout=hedge, return_when=asyncio.FIRST_COMPLETED)
        if not done:  # late: the next one as well, for every key still short of answers
            clock.hedges += ask([k for k in key_ids if answered[k] < READ_BEAM])
            continue
        failed: list[DHTID] = []
        for task in done:
            ids, response = pending.pop(task), task.result()
            for key_id in ids:
                if response is None:
                    failed.append(key_id)
                else:
                    answered[key_id] += 1
                    states[key_id].add_candidate(response[key_id][0], source_node_id=None)
        ask([k for k in failed if answered[k] < READ_BEAM])  # no answer: the next one in order instead
    _keep(pending)  # late answers still time their nodes
    for state in states.values():
        state.finish_search()
    return {key_id: state.future.result() for key_id, state in states.items()}


async def store_near(key: str, subkey: Any, value: Any, expiration_time: float, _dht: Any, node: Any) -> bool:
    """Store ``value`` under ``key`` (and ``subkey``) until ``expiration_time``: whether at least one node took it
    (a node refuses a value that expires no later than the one it holds), known once ``write_quorum`` of the key's
    replicas answered; the others are written in the background. Signed by the node's record validator as
    hivemind's store signs it, so every node (this one included) validates it as it would validate hivemind's."""
    bound_calls(node)
    protocol = node.protocol
    key_id = DHTID.generate(source=key)
    if not _small(node, key_id):
        return bool(await node.store(key, value, expiration_time, subkey=subkey))

    record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), protocol.serializer.dumps(value),
                       expiration_time)
    if protocol.record_validator is not None:
        record = dataclasses.replace(record, value=protocol.record_validator.sign_value(record))
    quorum = asyncio.get_running_loop().create_future()
    _keep([asyncio.ensure_future(_replicate(node, key_id, subkey, record, quorum))])
    return await asyncio.shield(quorum)


async def _replicate(node: Any, key_id: DHTID, subkey: Any, record: DHTRecord, quorum: asyncio.Future) -> None:
    """Write ``record`` to the key's replicas (``replicas``: the next known node in place of one that does not
    answer) until all answered; ``quorum`` gets whether a node took it once ``write_quorum`` of them answered."""
    protocol, clock = node.protocol, latency(node)
    candidates, count = replicas(node, key_id)
    untried, needed = candidates[::-1], write_quorum(count)  # pop() takes the nearest untried node
    stored = answered = 0
    pending: set[asyncio.Future] = set()
    try:
        while answered < count and (untried or pending):
            while untried and answered + len(pending) < count:
                _, peer_id = untried.pop()
                if peer_id is None:
                    answered += 1
                    valid = protocol.record_validator is None or protocol.record_validator.validate(record)
                    stored += bool(valid and protocol.storage.store(key_id, record.value, record.expiration_time,
                                                                   subkey=subkey))
                else:
                    call = node.atoll_direct_store(peer_id, keys=[key_id], values=[record.value],
                                                   expiration_time=[record.expiration_time], subkeys=[subkey])
                    pending.add(asyncio.ensure_future(clock.timed(peer_id, call, protocol.wait_timeout)))
            if answered >= needed and not quorum.done():
                quorum.set_result(stored > 0)
            if pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    result = task.result()
                    if result is not None:  # None: no answer, and the next known node is tried
                        answered += 1
                        stored += bool(result[0])
    finally:  # the caller hears what was stored, even if a call raised
        if not quorum.done():
            quorum.set_result(stored > 0)

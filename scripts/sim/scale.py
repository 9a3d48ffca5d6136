"""A swarm of simulated islands that runs atoll's real protocol code, in virtual time, for hundreds to thousands
of islands in one process (issue: a thousand islands).

What is real: each island's ``PeerTable`` (``node/rounds/peers.py``: its progress record, published every heartbeat,
and its reads of the run's peer table, parsed by ``records.parse_progress``), ``matchmaking.form_group`` (the
registrations, the coordinator, the group decision and its checks, the split into groups capped at
``max_group``), the open-round announcements read and parsed as ``RoundProtocol.watch_open_rounds`` does, the
grace window (``waits.grace_window``/``join_window``), and the order of replicas (``records.heavier``)
that decides catch-up and fork healing.

What stands in:
- the DHT (``SimDHT``): one in-process store with hivemind's semantics for subkeys and expirations; every call
  takes ``latency`` seconds and is counted per island (calls, entries and bytes returned by kind of key, as
  ``dht_io.key_kind`` names them) and per key (the load on the nodes that store it). Bytes are each record's
  msgpack size plus its owner subkey and signature, as the DHT stores them;
- the learner: an island trains ``sync_every`` steps of ``step_time`` (times its speed factor) between rounds;
- the all-reduce: the members that reach it within ``allreduce_s`` of the first merge; every one of them ends
  on one new replica (version + 1, the members' weights added, a digest of the base and the members);
- the merge of a split round's groups (``RoundProtocol._merge_siblings``): the groups of one decision whose results
  reach it within ``allreduce_s`` of the first end on one replica (their weights added); a member at a position
  some group lacks keeps its group's result, as in the protocol, and adopts the merge by download;
- a download: ``download_s`` seconds, then the donor's replica as it is then.

Time is virtual (``VirtualLoop``): the event loop jumps to its next timer instead of sleeping, so a minute of a
thousand islands costs what their Python code costs, not a minute. Parsing a record is memoized per stored value
(every island would parse the same bytes the same way); the counts are of what each island asked and got.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import math
import random
import selectors
import statistics
from collections import defaultdict
from types import SimpleNamespace
from typing import Any, Iterator

import msgpack
from hivemind.utils.timed_storage import ValueWithExpiration

from atoll.node.rounds import peers as peers_module
from atoll.node.rounds.round_protocol import OPEN_ROUND_POLL
from atoll.node.rounds.waits import FragmentPeers, grace_window, join_window
from atoll.protocols import coordination, dht_io, matchmaking, records
from atoll.protocols.cooldown import Cooldown
from atoll.protocols.dht_io import key_kind
from atoll.protocols.records import PROGRESS_SHARDS, Status, heavier, open_rounds_key, parse_open_round
from atoll.protocols.stats import TrafficStats
from atoll.protocols.summary import merge, parse_summary, summary_key

SIGNATURE_BYTES = 100  # ``[signature:<an Ed25519 signature in base64>]`` (identity.RecordSigner); 256 before
SUBKEY_BYTES = 62  # an owner subkey: ``[owner:<the member's peer id>]``, msgpack bytes; 400 with RSA member keys
TOKENS_PER_STEP = 4096
MEMO_ENTRIES = 200_000  # parsed values kept (each holds its value: its id is not reused while cached)


# ---- virtual time ------------------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class _VirtualSelector(selectors.SelectSelector):
    """Never waits: a wait of ``timeout`` seconds moves the clock on by that much (nothing in the simulation does
    I/O; the loop's own wake-up pipe is registered but never needed)."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None) -> list:
        if timeout is None:
            raise RuntimeError("the simulation has nothing left to run (every task waits without a timer)")
        self.clock.now += max(0.0, timeout)
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: Clock) -> None:
        super().__init__(_VirtualSelector(clock))
        self.clock = clock

    def time(self) -> float:
        return self.clock.now


@contextlib.contextmanager
def virtual_protocol_time(clock: Clock) -> Iterator[None]:
    """The protocol modules read the clock through ``get_dht_time`` and ``time.monotonic``; point both at the
    simulation's clock, and memoize the parsers of stored values (see the module's docstring)."""
    saved = [(matchmaking, "get_dht_time"), (peers_module, "get_dht_time"), (peers_module, "time"),
             (peers_module, "parse_progress"), (matchmaking, "parse_round_record")]
    old = [getattr(module, name) for module, name in saved]
    memo_progress, memo_round = _memo(records.parse_progress), _memo(records.parse_round_record)
    matchmaking.get_dht_time = peers_module.get_dht_time = clock
    peers_module.time = SimpleNamespace(monotonic=clock, time=clock)
    peers_module.parse_progress, matchmaking.parse_round_record = memo_progress, memo_round
    try:
        yield
    finally:
        for (module, name), value in zip(saved, old):
            setattr(module, name, value)


def _memo(parse: Any) -> Any:
    cache: dict[int, tuple[Any, Any]] = {}

    def parsed(value: Any) -> Any:
        hit = cache.get(id(value))
        if hit is None or hit[0] is not value:
            if len(cache) > MEMO_ENTRIES:
                cache.clear()
            hit = cache[id(value)] = (value, parse(value))  # the value is kept: its id is not reused
        return hit[1]

    return parsed


_parse_open_round = _memo(parse_open_round)


# ---- the DHT -----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Traffic:
    """What one island asked of the DHT, by ``op kind`` ("get progress", "store round", ...)."""

    calls: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    entries: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))


class SimDHT:
    """One store for the whole swarm: ``key -> {subkey: value with expiration}``, and the bytes each entry takes. A
    store keeps a subkey's value if its expiration is not older than the one held (hivemind's rule); a read returns
    the entries that have not expired, after ``latency`` seconds."""

    def __init__(self, clock: Clock, latency: float) -> None:
        self.clock, self.latency = clock, latency
        self.data: dict[str, dict[Any, ValueWithExpiration]] = defaultdict(dict)
        self.sizes: dict[str, dict[Any, int]] = defaultdict(dict)
        self.total: dict[str, int] = defaultdict(int)  # bytes held under each key
        self.soonest: dict[str, float] = defaultdict(lambda: math.inf)  # the earliest expiration under each key
        self.latest: dict[str, float] = defaultdict(lambda: -math.inf)
        self.key_reads: dict[str, int] = defaultdict(int)  # reads per key: the load on the nodes that hold it
        self.key_bytes: dict[str, int] = defaultdict(int)

    def client(self, traffic: Traffic) -> "SimClient":
        return SimClient(self, traffic)

    def read(self, key: str) -> tuple[dict[Any, ValueWithExpiration], int]:
        """The live entries under ``key`` (a copy) and their bytes."""
        held, now = self.data.get(key), self.clock.now
        if held is None:
            return {}, 0
        if self.soonest[key] <= now:
            for subkey in [s for s, v in held.items() if v.expiration_time <= now]:
                del held[subkey]
                self.total[key] -= self.sizes[key].pop(subkey)
            self.soonest[key] = min((v.expiration_time for v in held.values()), default=math.inf)
        return dict(held), self.total[key]

    def write(self, key: str, subkey: Any, value: Any, expiration_time: float, size: int) -> None:
        held = self.data[key]
        if subkey in held and held[subkey].expiration_time > expiration_time:
            return
        self.total[key] += size - self.sizes[key].get(subkey, 0)
        self.sizes[key][subkey] = size
        held[subkey] = ValueWithExpiration(value, expiration_time)
        self.soonest[key] = min(self.soonest[key], expiration_time)
        self.latest[key] = max(self.latest[key], expiration_time)


class SimClient:
    """An island's handle on ``SimDHT``, with the two calls of hivemind's ``DHT`` that ``dht_io`` makes."""

    def __init__(self, dht: SimDHT, traffic: Traffic) -> None:
        self.dht, self.traffic = dht, traffic

    def get(self, key: str, latest: bool = True, return_future: bool = True) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(self.dht.latency, self._answer, [key], future, False)
        return future

    def run_coroutine(self, fn: Any, return_future: bool = True) -> asyncio.Future:
        """What ``dht_io.get_many`` asks of a DHT's process: ``fn(dht, node)`` with a node whose ``get_many`` reads
        several keys in one call of ``latency`` seconds."""
        return asyncio.ensure_future(fn(self, SimpleNamespace(get_many=self._get_many)))

    async def _get_many(self, keys: tuple[str, ...], sufficient_expiration_time: float = 0.0) -> dict[str, Any]:
        future = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(self.dht.latency, self._answer, list(keys), future, True)
        return await future

    def _answer(self, keys: list[str], future: asyncio.Future, many: bool) -> None:
        """One call (counted once, of the first key's kind) that returns every key's live entries (``many``: as a
        dict by key, else the one key's)."""
        name = "get " + key_kind(keys[0])
        self.traffic.calls[name] += 1
        found = {}
        for key in keys:
            live, size = self.dht.read(key)
            self.traffic.entries[name] += len(live)
            self.traffic.bytes[name] += size
            self.dht.key_reads[key] += 1
            self.dht.key_bytes[key] += size
            found[key] = ValueWithExpiration(live, self.dht.latest[key]) if live else None
        if not future.done():
            future.set_result(found if many else found[keys[0]])

    def store(self, key: str, value: Any, expiration_time: float, subkey: Any = None,
              return_future: bool = True) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        size = len(msgpack.packb(value, use_bin_type=True)) + SUBKEY_BYTES + SIGNATURE_BYTES
        name = "store " + key_kind(key)
        self.traffic.calls[name] += 1
        self.traffic.bytes[name] += size

        def land() -> None:
            self.dht.write(key, subkey, value, expiration_time, size)
            if not future.done():
                future.set_result(True)

        asyncio.get_running_loop().call_later(self.dht.latency, land)
        return future


# ---- the islands -------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class SimConfig:
    islands: int = 64
    seconds: float = 120.0  # virtual seconds measured, after ``warmup``
    warmup: float = 30.0
    max_group: int = 16
    latency: float = 0.1  # seconds per DHT call
    heartbeat: float = 2.0
    step_time: float = 0.5
    speed_spread: float = 0.1  # islands' step times differ by up to this share
    sync_every: int = 20
    overlap: int = 2
    grace_gamma: float = 0.5
    gather_timeout: float = 30.0
    allreduce_s: float = 2.0
    download_s: float = 5.0
    merge_groups: bool = True  # False: a split round's groups stay apart (the protocol before its groups merged)
    progress_shards: int = PROGRESS_SHARDS  # 1: every record under one key, read whole (the layout before shards)
    drain: float = 30.0  # virtual seconds after the window without new rounds (``Swarm.run``)
    newcomers: int = 4  # islands that join during the window
    seed: int = 0


@dataclasses.dataclass
class Replica:
    """Stands in for ``node/rounds/replica.Replica``: one fragment's identity, nothing more."""

    version: int = 0
    weight: float = 0.0
    digest: str = "0" * 16
    schedule_step: int = 0
    num_fragments: int = 1

    def identity(self, p: int = 0) -> tuple[int, float, str]:
        return self.version, self.weight, self.digest

    def identities(self) -> list[tuple[int, float, str]]:
        return [self.identity()]

    @property
    def total_version(self) -> int:
        return self.version


class Island:
    def __init__(self, sim: "Swarm", index: int, rng: random.Random, joins_at: float) -> None:
        self.sim, self.index, self.joins_at = sim, index, joins_at
        self.peer_id = "12D3KooW" + hashlib.sha256(f"{sim.cfg.seed}/{index}".encode()).hexdigest()[:44]
        self.subkey = f"[owner:{self.peer_id}]".encode().ljust(SUBKEY_BYTES, b"=")
        self.step_time = sim.cfg.step_time * (1 + rng.uniform(-sim.cfg.speed_spread, sim.cfg.speed_spread))
        self.traffic = Traffic()
        self.replica = Replica()
        self.status = Status.JOINING
        self.step = 0
        self.rounds = 0
        self.in_round = False
        self.downloading = False
        self.opened = asyncio.Event()
        self.next_due = math.inf  # when our next round is due (``train``)
        self.last_round_version = -1
        self.announced = -1  # the version whose round a peer announced (``RoundProtocol._announced``)
        self.first_merge_at: float | None = None
        self.formation: list[float] = []
        self.sizes: list[int] = []
        self.contributors: list[int] = []
        self.adopted = 0
        stats = TrafficStats()
        cfg = SimpleNamespace(heartbeat=sim.cfg.heartbeat, client_mode=False, run_id=sim.run_id,
                              run=SimpleNamespace(sync_every=sim.cfg.sync_every))
        counters = SimpleNamespace(status=Status.JOINING, progress=self._progress, step_time=self.step_time)
        self.ctx = SimpleNamespace(
            cfg=cfg, dht=sim.dht.client(self.traffic), peer_id=self.peer_id, subkey=self.subkey,
            algorithm=SimpleNamespace(synchronous=False, gradient_allreduce=False),  # decoupled
            replica=self.replica, counters=counters, stats=stats,
            cooldown=Cooldown(60.0, sim.clock),
            namespace=lambda: sim.run_id, reject=stats.reject,
        )
        self.table = peers_module.PeerTable(self.ctx, shards=sim.cfg.progress_shards)

    def _progress(self) -> dict[str, Any]:
        return {"status": self.status.value, "device": "cpu", "ranks": 1, "algorithm": "decoupled",
                "step": self.step, "tokens": self.step * TOKENS_PER_STEP,
                "tokens_per_s": float(TOKENS_PER_STEP / self.step_time), "loss": 3.5, "held_out_loss": None,
                "tokens_lost": 0, "goodput": 0.9, "blocked_s": 0.0, "rounds": self.rounds, "rounds_skipped": 0,
                "forks_healed": self.adopted}

    # ---- what the syncer does ----------------------------------------------------------------------------------
    def heavier_peers(self) -> list:
        mine = self.replica.identity()
        return [peer for peer in self.table.training() if heavier(peer.fragment(0), mine)]

    async def heartbeat(self) -> None:
        while True:
            self.ctx.counters.status = self.status
            if self.table.publish_due():  # as the syncer's heartbeat: at the table's pace (``PeerTable.pace``)
                await self.table.publish(self.status)
            await self.table.publish_head()
            if self.table.read_due():
                await self.table.refresh()
            if self.table.summary_due():
                await self.table.publish_summary()
            if self.status == Status.TRAINING and not self.in_round and not self.downloading and self.heavier_peers():
                self._catching_up = asyncio.ensure_future(self.catch_up())  # as the syncer does: beside the beat
            await asyncio.sleep(self.sim.cfg.heartbeat)

    async def catch_up(self) -> None:
        """Download the heaviest replica a live peer holds (its identity when the download ends)."""
        best = max(self.heavier_peers(), key=lambda peer: peer.fragment(0), default=None)
        if best is None or self.downloading:
            return
        self.downloading = True
        try:
            await asyncio.sleep(self.sim.cfg.download_s)
            donor = self.sim.by_peer[best.peer_id]
            if heavier(donor.replica.identity(), self.replica.identity()):
                self.replica.version, self.replica.weight, self.replica.digest = donor.replica.identity()
                self.replica.schedule_step = donor.replica.schedule_step
                self.next_due = donor.next_due
                self.adopted += self.status == Status.TRAINING
        finally:
            self.downloading = False

    async def watch_open_rounds(self) -> None:
        """As ``RoundProtocol.watch_open_rounds``: a peer's round from our version and replica, opened."""
        while True:
            await asyncio.sleep(OPEN_ROUND_POLL)
            version, _, digest = self.replica.identity()
            key = open_rounds_key(self.sim.run_id, 0, version, digest)
            found = await dht_io.get_many(self.ctx.dht, [key])
            for value in records.unwrap_subkeys(found.get(key)).values():
                parsed = _parse_open_round(value)
                if parsed is None or parsed[0] == self.peer_id or parsed[1:] != (0, version):
                    continue
                self.announced = version
                if not self.in_round and self.last_round_version != version:
                    self.opened.set()

    async def train(self) -> None:
        """A step every ``step_time``; at a step boundary, a round when ``sync_every`` steps have passed since the
        last (``next_due``) or a peer opened one at our version. Training goes on while a round runs (decoupled); a
        round due while the last still runs starts when it ends. A download takes the donor's place in the schedule
        (``catch_up``), as the protocol's catch-up does."""
        cfg, running = self.sim.cfg, None
        self.next_due = self.sim.clock.now + cfg.sync_every * self.step_time
        while True:
            await asyncio.sleep(self.step_time)
            self.step += 1
            if not (self.opened.is_set() or self.sim.clock.now >= self.next_due):
                continue
            self.opened.clear()
            self.next_due = self.sim.clock.now + cfg.sync_every * self.step_time
            if running is not None and not running.done():
                await running
            if not self.downloading and self.sim.clock.now < self.sim.rounds_stop_at:
                running = asyncio.ensure_future(self.outer_round())

    async def outer_round(self) -> None:
        cfg, sim = self.sim.cfg, self.sim
        version, _, digest = self.replica.identity()
        self.in_round, self.last_round_version = True, version
        started = sim.clock.now
        decided: list[coordination.Decision] = []
        try:
            if self.announced != version:
                await self.ctx.dht.store(open_rounds_key(sim.run_id, 0, version, digest),
                                         {"peer_id": self.peer_id, "fragment": 0, "version": version},
                                         sim.clock.now + cfg.gather_timeout, self.subkey)

            grace = max(grace_window(cfg.grace_gamma, cfg.overlap, self.step_time, 0.0, cfg.allreduce_s),
                        join_window(self.step_time, cfg.latency, cfg.sync_every, OPEN_ROUND_POLL,
                                    matchmaking.POLL_INTERVAL))
            members = await matchmaking.form_group(
                self.ctx.dht, matchmaking.Round(sim.run_id, 0, version, digest),
                matchmaking.Registrant(self.peer_id, self.subkey, float(cfg.sync_every * TOKENS_PER_STEP),
                                       started=self.joins_at),
                matchmaking.Policy(cfg.gather_timeout, quorum=1, grace=lambda: grace, max_group=cfg.max_group),
                FragmentPeers(self.table, 0, (version, digest), lambda peer: False),
                abort=lambda: bool(self.heavier_peers()), on_decision=decided.append)
            if not members:
                if decided:  # as ``RoundProtocol.run``: left out, follow the members
                    self.table.follow([m for group in decided[-1].groups for m in group])
                return
            if sim.measure_from <= sim.clock.now < sim.rounds_stop_at:
                self.formation.append(sim.clock.now - started)
            merged = await sim.allreduce(self, version, digest, tuple(members))
            if (merged is not None and cfg.merge_groups and len(decided[-1].groups) > 1
                    and coordination.sibling_group(decided[-1].groups, self.peer_id)):
                merged = await sim.merge_siblings(version, digest, decided[-1].groups, merged) or merged
            if merged is None or self.replica.identity() != (version, self.replica.weight, digest):
                return  # the round failed, or we adopted another replica meanwhile
            self.replica.version, self.replica.weight, self.replica.digest = merged[0], merged[1], merged[2]
            self.replica.schedule_step = self.step
            self.rounds += 1
            if sim.measure_from <= sim.clock.now < sim.rounds_stop_at:
                self.sizes.append(len(members))
                self.contributors.append(merged[3])
            if self.first_merge_at is None:
                self.first_merge_at = sim.clock.now
        finally:
            self.in_round = False
            self._published = asyncio.ensure_future(self.table.publish(self.status))  # as ``RoundProtocol.run``

    async def live(self) -> None:
        await asyncio.sleep(max(0.0, self.joins_at - self.sim.clock.now))
        self.joins_at = self.sim.clock.now
        tasks = [asyncio.ensure_future(self.heartbeat())]
        await self.table.publish(Status.JOINING)
        await self.table.refresh()
        if self.table.training():  # a joiner downloads the run's state before it trains
            await self.catch_up()
        self.status = Status.TRAINING
        tasks += [asyncio.ensure_future(self.watch_open_rounds()), asyncio.ensure_future(self.train())]
        await asyncio.gather(*tasks)


# ---- the swarm ---------------------------------------------------------------------------------------------------
class Swarm:
    def __init__(self, cfg: SimConfig, clock: Clock) -> None:
        self.cfg, self.clock = cfg, clock
        self.run_id = f"sim{cfg.seed}"
        self.dht = SimDHT(clock, cfg.latency)
        self.measure_from = clock.now + cfg.warmup
        rng = random.Random(cfg.seed)
        starts = [clock.now + rng.uniform(0, min(10.0, cfg.warmup / 2)) for _ in range(cfg.islands)]
        starts += [self.measure_from + (i + 1) * cfg.seconds / (cfg.newcomers + 2) for i in range(cfg.newcomers)]
        self.islands = [Island(self, i, rng, t) for i, t in enumerate(starts)]
        self.by_peer = {island.peer_id: island for island in self.islands}
        self._groups: dict[tuple, dict[str, Any]] = {}
        self._merges: dict[tuple, dict[str, Any]] = {}
        self.merged_weight = 0.0  # the weight every merged group added, on any line
        self.rounds_stop_at = math.inf
        self.settled_at: float | None = None  # when every training island held one replica, after rounds stopped
        self.lines: list[tuple[float, int]] = []  # (time, distinct replicas among training islands)

    async def allreduce(self, island: Island, version: int, digest: str, members: tuple[str, ...]
                        ) -> tuple[int, float, str, int] | None:
        """The members of one group that arrive within ``allreduce_s`` of the first merge into one replica."""
        key = (version, digest, members)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = {"arrived": [], "done": asyncio.get_running_loop().create_future()}
            asyncio.get_running_loop().call_later(self.cfg.allreduce_s, self._merge, key, island.replica.weight)
        if group["done"].done():
            return None  # too late: the others merged without us
        group["arrived"].append(island.peer_id)
        return await asyncio.shield(group["done"])

    async def merge_siblings(self, version: int, digest: str, groups: list[list[str]],
                             own: tuple[int, float, str, int]) -> tuple[int, float, str, int] | None:
        """Stands in for ``RoundProtocol._merge_siblings``: the results of one decision's groups that reach the merge
        within ``allreduce_s`` of the first, combined into one replica; None for a group that comes too late."""
        key = (version, digest, tuple(map(tuple, groups)))
        merge = self._merges.get(key)
        if merge is None:
            merge = self._merges[key] = {"results": {}, "done": asyncio.get_running_loop().create_future()}
            asyncio.get_running_loop().call_later(self.cfg.allreduce_s, self._merge_groups, key,
                                                  own[1] - own[3] * self.cfg.sync_every * TOKENS_PER_STEP)
        if merge["done"].done():
            return None
        merge["results"][own[2]] = own
        return await asyncio.shield(merge["done"])

    def _merge_groups(self, key: tuple, base_weight: float) -> None:
        version, digest, _ = key
        merge = self._merges.pop(key)
        results = sorted(merge["results"].values(), key=lambda r: r[2])
        new = hashlib.sha256(f"{digest}/{version}/{','.join(r[2] for r in results)}".encode()).hexdigest()[:16]
        merge["done"].set_result((version + 1, base_weight + sum(r[1] - base_weight for r in results), new,
                                  sum(r[3] for r in results)))

    def _merge(self, key: tuple, base_weight: float) -> None:
        version, digest, _ = key
        group = self._groups.pop(key)
        arrived = sorted(group["arrived"])
        added = len(arrived) * self.cfg.sync_every * TOKENS_PER_STEP
        self.merged_weight += added
        new = hashlib.sha256(f"{digest}/{version}/{','.join(arrived)}".encode()).hexdigest()[:16]
        group["done"].set_result((version + 1, base_weight + added, new, len(arrived)))

    async def watch_lines(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            training = [i for i in self.islands if i.status == Status.TRAINING]
            if training:  # the replicas at the newest version: more than one is a fork
                newest = max(i.replica.version for i in training)
                self.lines.append((self.clock.now, len({i.replica.digest for i in training
                                                        if i.replica.version == newest})))
                if (self.settled_at is None and self.clock.now >= self.rounds_stop_at
                        and len({i.replica.identity() for i in training}) == 1):
                    self.settled_at = self.clock.now

    async def run(self) -> None:
        """Warm-up, the measured window, then ``drain`` seconds in which no round starts and the replicas settle
        (the rounds under way end, catch-up goes on): work kept and convergence are counted with nothing in flight."""
        tasks = [asyncio.ensure_future(island.live()) for island in self.islands]
        tasks.append(asyncio.ensure_future(self.watch_lines()))
        await asyncio.sleep(self.measure_from + self.cfg.seconds - self.clock.now)
        self._snapshot = {i.peer_id: _totals(i.traffic) for i in self.islands}
        self.key_reads_at_end = dict(self.dht.key_reads), dict(self.dht.key_bytes)
        # What ``atoll status`` would read now, and how many islands are live.
        held, _ = self.dht.read(summary_key(self.run_id))
        self.summaries_at_end = [s for s in (parse_summary(v.value) for v in held.values()) if s is not None]
        self.live_at_end = sum(i.status in (Status.JOINING, Status.TRAINING) for i in self.islands)
        self.rounds_stop_at = self.clock.now
        await asyncio.sleep(self.cfg.drain)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _totals(traffic: Traffic) -> dict[str, dict[str, int]]:
    return {"calls": dict(traffic.calls), "entries": dict(traffic.entries), "bytes": dict(traffic.bytes)}


def simulate(cfg: SimConfig) -> dict[str, Any]:
    """Run one swarm and return its figures (see ``summarize``)."""
    clock = Clock()
    loop = VirtualLoop(clock)
    try:
        with virtual_protocol_time(clock):
            swarm = Swarm(cfg, clock)
            baseline: dict[str, dict] = {}
            loop.run_until_complete(_with_baseline(swarm, baseline))
            left = asyncio.all_tasks(loop)  # reads the cancelled tasks had in flight
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(_drain(left))
        return summarize(swarm, baseline)
    finally:
        loop.close()


async def _drain(tasks: set[asyncio.Task]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)


async def _with_baseline(swarm: Swarm, baseline: dict[str, dict]) -> None:
    """Run the swarm, noting every island's counts when the measured window opens."""
    async def note() -> None:
        await asyncio.sleep(swarm.measure_from - swarm.clock.now)
        baseline.update({i.peer_id: _totals(i.traffic) for i in swarm.islands})
        swarm.key_reads_at_start = dict(swarm.dht.key_reads), dict(swarm.dht.key_bytes)

    await asyncio.gather(note(), swarm.run())


def summarize(swarm: Swarm, baseline: dict[str, dict]) -> dict[str, Any]:
    """Per island and minute of the measured window (islands present all along): DHT calls, entries and KiB
    returned, by ``op kind`` and in all; the busiest key's reads per second; round formation seconds and sizes;
    newcomers' seconds to their first merged round; the distinct replicas at the newest version over the window;
    after the drain, the replicas held and the share of all merged work on the one most islands hold; and how
    long after the last rounds began every island held one replica (``settled_s``; None if not within the drain).
    """
    cfg = swarm.cfg
    minutes = cfg.seconds / 60
    steady = [i for i in swarm.islands[:cfg.islands]]
    per_kind: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for island in steady:
        end, start = swarm._snapshot[island.peer_id], baseline.get(island.peer_id, {})
        for field in ("calls", "entries", "bytes"):
            for name, value in end[field].items():
                per_kind[name][field] += (value - start.get(field, {}).get(name, 0)) / len(steady) / minutes
    totals = {field: sum(k[field] for k in per_kind.values()) for field in ("calls", "entries", "bytes")}
    formation = [t for i in steady for t in i.formation]
    sizes = [s for i in steady for s in i.sizes]
    newcomers = swarm.islands[cfg.islands:]
    to_round = [i.first_merge_at - i.joins_at for i in newcomers if i.first_merge_at is not None]
    (reads0, bytes0), (reads1, bytes1) = swarm.key_reads_at_start, swarm.key_reads_at_end
    reads = {key: n - reads0.get(key, 0) for key, n in reads1.items()}
    busiest = max(reads, key=reads.get)
    final = [i.replica.identity() for i in swarm.islands if i.status == Status.TRAINING]
    top = max(set(final), key=final.count)
    lines = [n for t, n in swarm.lines if swarm.measure_from <= t < swarm.rounds_stop_at]
    return {
        "islands": cfg.islands, "config": dataclasses.asdict(cfg),
        "per_island_per_min": {"calls": totals["calls"], "entries": totals["entries"],
                               "kib": totals["bytes"] / 1024,
                               "by_kind": {k: {f: round(v, 2) for f, v in d.items()}
                                           for k, d in sorted(per_kind.items())}},
        "busiest_key": {"kind": key_kind(busiest), "reads_per_s": reads[busiest] / cfg.seconds,
                        "mib_per_s": (bytes1[busiest] - bytes0.get(busiest, 0)) / cfg.seconds / 2**20},
        "formation_s": _stats(formation), "round_members": _stats(sizes),
        "round_contributors": _stats([c for i in steady for c in i.contributors]),
        "rounds_per_island_per_min": len(sizes) / len(steady) / minutes,
        "newcomer_s_to_first_round": _stats(to_round), "newcomers_merged": len(to_round),
        "replicas_at_end": len(set(final)), "islands_on_top_line": final.count(top),
        "replicas_over_time": _stats([float(n) for n in lines]),
        "work_kept": top[1] / swarm.merged_weight if swarm.merged_weight else 0.0,
        "settled_s": swarm.settled_at - swarm.rounds_stop_at if swarm.settled_at is not None else None,
        "summary": {"summarizers": len(swarm.summaries_at_end), "live_islands": swarm.live_at_end,
                    "peers": merge(swarm.summaries_at_end)["peers"] if swarm.summaries_at_end else None},
    }


def _stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    return {"n": len(xs), "mean": statistics.fmean(xs), "p50": xs[len(xs) // 2],
            "p90": xs[min(len(xs) - 1, math.ceil(0.9 * len(xs)) - 1)], "max": xs[-1]}

"""This daemon's progress record and its table of live peers, both through the DHT (on the syncer's event loop).

Every daemon publishes one signed progress record per heartbeat under its shard of the run's progress keys
(``records.progress_shard``); reading the shards gives the table of live peers. The first read takes every shard.
Up to ``READ_BUDGET`` records a read takes one key instead: while its table holds at most ``WRITE_ALL_UP_TO``
records, a daemon writes its record under the ``ALL_SHARDS`` key as well, since one read of 16 keys costs a small
swarm several times what one key does. Past ``READ_BUDGET`` records, a read takes our own shard and as many others,
in turns, as make about ``READ_BUDGET`` records, and the table keeps what each shard held until it is read again
(for at most one turn round the shards and the records' lifetime): what one read costs stays flat as the swarm
grows, and the table is a view of the swarm that is at most one turn old. Malformed records are counted and cool
their signing key down; the records of peers (or keys) cooling down are ignored, and so are leaving peers.

The record is published and the table read at a pace (``pace``) that follows the rounds: every heartbeat while a
round takes less than ``BEATS_PER_ROUND`` heartbeats, else ``BEATS_PER_ROUND`` times a round (at most every
``MAX_PACE`` seconds), and at the next heartbeat whenever our replica or status changed (the others must see a new
version at once: donors, catch-up and rounds read it). A round that forms reads the table itself when it needs it
fresh (``refresh(max_age=...)``), so a slow pace costs the rounds nothing; what it saves is the records a daemon
whose round lasts minutes wrote and read every few seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import threading
import time
from typing import Any

from hivemind.utils import get_dht_time

from atoll.protocols import dht_io
from atoll.protocols.identity import owner_of_raw_subkey, peer_id_of
from atoll.protocols.revocation import REVOCATION_TTL, newest_revocation
from atoll.protocols.record_validator import sync_run_validator
from atoll.protocols.records import (ALL_SHARDS, MAX_CLOCK_SKEW, MAX_EXPIRY, PROGRESS_SHARDS, READ_BUDGET,
                                     HeadRecord, ProgressRecord, Status, config_key, head_key, parse_head,
                                     parse_progress, progress_key, progress_shard, revoked_key, unwrap_subkeys)
from atoll.protocols.summary import is_summarizer, summary_key, totals

from .context import SyncContext

logger = logging.getLogger("atoll")
MEMBER_WAIT = 3.0  # seconds a private run's donor looks for an unknown requester among its peers
CONFIG_REPUBLISH = 60.0  # seconds between re-publications of the run's config (so it outlives its first daemon)
CONFIG_TTL = 600.0
HEAD_REPUBLISH = 30.0  # seconds between notes of how far the run got
HEAD_TTL = 7 * 24 * 3600.0  # a run's head outlives its daemons: a newcomer then waits for a holder to return
REVOCATION_POLL = 5.0  # seconds between reads of the run's revocation list (and of the DHT's refusal counts)
REVOCATION_REPUBLISH = CONFIG_REPUBLISH
ALL_READ_UP_TO = READ_BUDGET * 5 // 4  # once reading the ALL_SHARDS key, it is read up to this many records
WRITE_ALL_UP_TO = 2 * READ_BUDGET  # a daemon writes its record under the ALL_SHARDS key while its table is this small
FOLLOW_S = 20.0  # seconds the shards of peers we follow (``follow``) are read at every read of the table
FOLLOW_PEERS = 2
# A progress record lives this many paces (each at least the last heartbeat's length): one or two lost stores do not
# make a live daemon vanish from the others' tables.
LIFETIME_BEATS = 3
BEATS_PER_ROUND = 4  # publications of our record (and reads of the table) a round, at least, when rounds are slow
MAX_PACE = 60.0  # seconds between publications at most, however slow the rounds (a record lives 3 of them)
EXPIRATION_STEP = 1e-3  # seconds a record's expiration grows by, at least, from one publication to the next


@dataclasses.dataclass
class _Shard:
    read_at: float  # monotonic
    peers: dict[str, ProgressRecord]
    everyone: dict[str, ProgressRecord]


class PeerTable:
    def __init__(self, ctx: SyncContext, config_record: dict[str, Any] | None = None,
                 shards: int = PROGRESS_SHARDS, run_public_key: bytes | None = None, revocation: Any = None) -> None:
        self.ctx = ctx
        self.run_public_key = run_public_key  # a private run's run key (signs its revocation lists)
        self.revocation = revocation  # the newest list signed by the run key (revocation.RevocationList), if any
        self.shards = shards
        self.my_shard = progress_shard(ctx.peer_id, shards)
        self._held: dict[int, _Shard] = {}  # what each shard held when it was last read
        self._per_shard: float | None = None  # records per shard in the last read (None: nothing read yet)
        self._reading_all = False  # the last read of the table took the ALL_SHARDS key
        self._turn = 0  # the next of the other shards to read, when not all are read at once
        self._keep = 0.0  # seconds a shard's records are kept when it is not read again
        self._looked_up: dict[int, float] = {}  # shard -> when ``look_up`` last read it (monotonic)
        self._follow: dict[int, float] = {}  # shard -> until when every read takes it (``follow``)
        self.config_record = config_record
        self._config_published = 0.0
        self._head_published = 0.0
        self._peers: dict[str, ProgressRecord] = {}
        self._everyone: dict[str, ProgressRecord] = {}  # peers cooling down included (ddp's fixed membership)
        self._lock = threading.Lock()
        self._read: asyncio.Future | None = None  # the shared read of the table in flight, if any
        self._read_at = 0.0
        self._revocations_read = -1e9
        self._revocation_published = -1e9
        self._dht_refused: dict[str, int] = {}  # the DHT process's refusal counts as last added to our stats
        self._told_revoked = False
        self._beat = 0.0  # seconds the last heartbeat took, its sleep included (0: none yet)
        self._expires = -float("inf")  # DHT time our last published record expires at
        self._published_at = -float("inf")  # monotonic: when ``publish`` last stored our record
        self._published_as: tuple | None = None  # our status and replica then (``_identity``)
        self._lives = 0.0  # seconds the record published then lives
        self._paced = 0.0  # the pace when we last published (0: never)
        self._summarized_at = -float("inf")  # monotonic: when ``publish_summary`` last ran

    # ---- our record -----------------------------------------------------------------------------------------
    def progress_record(self, status: Status) -> dict[str, Any]:
        ctx, stats = self.ctx, self.ctx.stats
        ids = ctx.replica.identities()
        rec = ctx.counters.progress()
        rec.update(
            peer_id=ctx.peer_id, status=status.value, version=sum(v for v, _, _ in ids),
            fragment_versions=[v for v, _, _ in ids], fragment_weights=[float(w) for _, w, _ in ids],
            fragment_hashes=[d for _, _, d in ids], schedule_step=ctx.replica.schedule_step,
            bytes_sent=stats.bytes_sent, bytes_received=stats.bytes_received, rejected=stats.rejected,
            rejected_by_kind=dict(stats.rejected_by_kind), clipped=stats.clipped, time=float(get_dht_time()),
            reachable=not ctx.cfg.client_mode,
        )
        return rec

    async def publish(self, status: Status | None = None, ttl: float | None = None,
                      timeout: float | None = None) -> None:
        ctx = self.ctx
        rec = self.progress_record(status or ctx.counters.status)
        ttl = ttl if ttl is not None else self.lifetime()
        size = self.size()
        shards = [self.my_shard] + ([ALL_SHARDS] if size is None or size <= WRITE_ALL_UP_TO else [])
        # A DHT node replaces a stored value only with one that expires later. After a long heartbeat (a freeze)
        # our record was stored to live long; a record stored with the usual lifetime would be refused, and the
        # others would read the old one (versions, status, schedule as of then) until it expired. So expirations
        # never go backwards: a shorter lifetime takes effect once the long one has run out.
        expiration = max(get_dht_time() + ttl, self._expires + EXPIRATION_STEP)
        self._expires = expiration
        self._published_at, self._published_as = time.monotonic(), self._identity(status or ctx.counters.status)
        self._lives, self._paced = expiration - get_dht_time(), self.pace()
        await asyncio.gather(*(dht_io.store(ctx.dht, progress_key(ctx.namespace(), shard), rec, expiration,
                                            ctx.subkey, timeout=timeout, on_timeout=ctx.reject) for shard in shards))

    def lifetime(self) -> float:
        """Seconds our progress record lives: ``LIFETIME_BEATS`` paces (``pace``), each at least as long as the last
        heartbeat took (at most what the DHT's validators accept)."""
        return min(LIFETIME_BEATS * max(self.pace(), self._beat), MAX_EXPIRY["progress"])

    def pace(self) -> float:
        """Seconds between publications of our record, reads of the table and summaries: the heartbeat, or a
        round's length (steps a round times the measured step time) over ``BEATS_PER_ROUND`` when that is longer, at
        most ``MAX_PACE`` (or the heartbeat, if longer), and at most twice the pace of our last publication (one
        slow step, a warm-up's or a stall's, must not make the record live minutes). The heartbeat where learners
        wait for their rounds (``synchronous``, ``ddp``): there a dead peer's record must go at once, or every round
        waits its gather deadline for it."""
        ctx, cfg = self.ctx, self.ctx.cfg
        if ctx.algorithm.synchronous or ctx.algorithm.gradient_allreduce:
            return cfg.heartbeat
        round_s = ctx.counters.step_time * cfg.run.sync_every
        return max(cfg.heartbeat, min(round_s / BEATS_PER_ROUND, MAX_PACE, 2 * self._paced))

    def publish_due(self) -> bool:
        """Whether this heartbeat publishes our record: every heartbeat while the pace is the heartbeat (as it
        always was); else once a pace has passed since our last publication (a round's own included), at once when
        our status or replica changed since, or when the record published then is about to expire (a heartbeat and
        a half before it does: one late or lost store does not make us vanish)."""
        ctx = self.ctx
        if self._due(self._published_at):
            return True
        margin = 1.5 * max(ctx.cfg.heartbeat, self._beat)
        return (time.monotonic() - self._published_at >= self._lives - margin
                or self._identity(ctx.counters.status) != self._published_as)

    def read_due(self) -> bool:
        """Whether this heartbeat reads the table: every heartbeat while the pace is the heartbeat; else once a pace
        has passed since the table was last read (by anyone: a round's or catch-up's read makes it fresh too)."""
        return self._due(self._read_at)

    def summary_due(self) -> bool:
        """Whether this heartbeat publishes the summary (if we are a summarizer): as ``read_due``, on a clock of its
        own (the summary lives three paces, whoever read the table meanwhile)."""
        return self._due(self._summarized_at)

    def _due(self, last: float) -> bool:
        """Every heartbeat while the pace is the heartbeat; else once a pace has passed since ``last`` (monotonic)."""
        pace = self.pace()
        return pace <= self.ctx.cfg.heartbeat or time.monotonic() - last >= pace

    def _identity(self, status: Status) -> tuple:
        """What the others must see at once when it changes: our status and our replica's versions and digests."""
        return status, tuple(self.ctx.replica.identities())

    def heartbeat_took(self, seconds: float) -> None:
        """The heartbeat's last cycle (its DHT calls and its sleep) took ``seconds``. A slow DHT (a loaded machine,
        a congested link) stretches the cycle; a record that lived a fixed three heartbeats then expired before the
        next store, and the daemon dropped out of the others' tables and of ``atoll status`` while it trained."""
        if seconds > self.lifetime():
            logger.warning("a heartbeat took %.1f s, longer than our progress record lived (%.0f s): records now "
                           "live %.0f s", seconds, self.lifetime(), LIFETIME_BEATS * seconds)
        self._beat = seconds

    def size(self) -> float | None:
        """How many records the swarm holds by the last read of the table (an estimate past ``READ_BUDGET``); None
        before the first read."""
        return None if self._per_shard is None else self._per_shard * self.shards

    async def republish_config(self) -> None:
        """The run's config, again every ``CONFIG_REPUBLISH`` seconds: the run outlives the daemon that started it."""
        if self.config_record is None or time.monotonic() - self._config_published <= CONFIG_REPUBLISH:
            return
        await dht_io.store(self.ctx.dht, config_key(self.ctx.cfg.run_id), self.config_record,
                           get_dht_time() + CONFIG_TTL, self.ctx.subkey, on_timeout=self.ctx.reject)
        self._config_published = time.monotonic()

    async def publish_head(self, force: bool = False) -> None:
        """Note how far the run got (our replica's total version), every ``HEAD_REPUBLISH`` seconds or now."""
        ctx = self.ctx
        version = ctx.replica.total_version
        if version == 0 or (not force and time.monotonic() - self._head_published <= HEAD_REPUBLISH):
            return
        record = {"peer_id": ctx.peer_id, "version": int(version), "time": float(get_dht_time())}
        await dht_io.store(ctx.dht, head_key(ctx.namespace()), record, get_dht_time() + HEAD_TTL, ctx.subkey,
                           timeout=3.0 if force else None, on_timeout=ctx.reject)
        self._head_published = time.monotonic()

    async def read_head(self) -> HeadRecord | None:
        """The furthest the run got, by the members' notes (None: no note, a new run); times from the future are
        dropped."""
        ctx = self.ctx
        heads = []
        for subkey, value in unwrap_subkeys(await dht_io.get(ctx.dht, head_key(ctx.namespace()),
                                                             on_timeout=ctx.reject)).items():
            rec = parse_head(value)
            if rec is None:
                ctx.reject("head_record", subkey)
            elif rec.time > get_dht_time() + MAX_CLOCK_SKEW:
                ctx.reject("head_record_time")  # counted, not held against the key: clocks do drift
            else:
                heads.append(rec)
        return max(heads, key=lambda h: (h.version, h.time)) if heads else None

    async def publish_summary(self) -> None:
        """If this daemon is one of the run's summarizers (``summary.is_summarizer`` over its table), publish the
        totals of its table and itself, for ``atoll status`` to read instead of every record."""
        ctx = self.ctx
        self._summarized_at = time.monotonic()
        everyone = self.everyone()
        if not is_summarizer(ctx.peer_id, everyone):
            return
        own = parse_progress(self.progress_record(ctx.counters.status))
        record = {"peer_id": ctx.peer_id, **totals([*everyone.values(), *([own] if own is not None else [])]),
                  "time": float(get_dht_time())}
        # Under the run's id, not a fault-injection side's namespace: the summary is for ``atoll status`` alone.
        await dht_io.store(ctx.dht, summary_key(ctx.cfg.run_id), record, get_dht_time() + 3 * self.pace(),
                           ctx.subkey, on_timeout=ctx.reject)

    # ---- revocation ------------------------------------------------------------------------------------------
    async def check_revocations(self) -> None:
        """A private run: every ``REVOCATION_POLL`` seconds, read the run's revocation list, adopt a newer one signed
        by the run key (kept on disk, applied to the DHT's validator), republish the newest every
        ``REVOCATION_REPUBLISH`` seconds, and add the DHT's refusal counts (``dht_*`` kinds) to ours."""
        ctx = self.ctx
        if time.monotonic() - self._revocations_read < REVOCATION_POLL:
            return
        self._revocations_read = time.monotonic()
        if self.run_public_key is not None:  # an open run has no revocations; its DHT's refusals are counted too
            await self._read_revocations()
        refused = await dht_io.run_in_dht(ctx.dht, functools.partial(sync_run_validator, self.revocation),
                                          on_timeout=ctx.reject)
        for kind, count in (refused or {}).items():
            if count > self._dht_refused.get(kind, 0):
                ctx.stats.reject(kind, count=count - self._dht_refused.get(kind, 0))
                self._dht_refused[kind] = count
        if self.revocation is not None and time.monotonic() - self._revocation_published > REVOCATION_REPUBLISH:
            await dht_io.store(ctx.dht, revoked_key(ctx.cfg.run_id), self.revocation.to_record(),
                               get_dht_time() + REVOCATION_TTL, ctx.subkey, on_timeout=ctx.reject)
            self._revocation_published = time.monotonic()

    async def _read_revocations(self) -> None:
        ctx = self.ctx
        entry = await dht_io.get(ctx.dht, revoked_key(ctx.cfg.run_id), on_timeout=ctx.reject)
        newest, bad = newest_revocation(ctx.cfg.run_id, self.run_public_key, list(unwrap_subkeys(entry).values()),
                                        self.revocation)
        if bad:
            ctx.stats.reject("revocation_record", count=bad)
        if newest is not self.revocation:
            self.revocation = newest
            logger.warning("revocation list %d of the run: %d member(s) revoked; their records and requests are "
                           "refused from now on", newest.serial, len(newest.revoked))
            from .join import save_revocation

            save_revocation(ctx.cfg.checkpoint_dir, newest)
            self._revocation_published = -1e9
            self._drop_revoked()
        if self.revocation is not None and self.revoked(ctx.peer_id) and not self._told_revoked:
            self._told_revoked = True
            logger.error("this daemon's membership was revoked by the run key: the others refuse its records")

    def _drop_revoked(self) -> None:
        with self._lock:
            for held in self._held.values():
                held.peers = {p: r for p, r in held.peers.items() if not self.revoked(p)}
                held.everyone = {p: r for p, r in held.everyone.items() if not self.revoked(p)}
            self._peers = {p: r for p, r in self._peers.items() if not self.revoked(p)}
            self._everyone = {p: r for p, r in self._everyone.items() if not self.revoked(p)}

    # ---- the table ------------------------------------------------------------------------------------------
    async def refresh(self, max_age: float = 0.0) -> dict[str, ProgressRecord]:
        """Read the live peers' progress records (all shards, or our own and some others in turns: see the module).

        ``max_age > 0``: a table whose read began less than ``max_age`` seconds ago is returned as it is, and a
        read in flight is shared. Reads are not cheap: each DHT node asked checks the signature of every record
        it returns."""
        if max_age > 0:
            if self._read is not None and not self._read.done():
                return await asyncio.shield(self._read)
            if time.monotonic() - self._read_at < max_age:
                return self.peers()
        self._read_at = time.monotonic()
        read = asyncio.ensure_future(self._read_shards(self._shards_to_read(), prune=True))
        if max_age > 0:
            self._read = read
        return await asyncio.shield(read)

    async def look_up(self, peer_ids: set[str], max_age: float = 1.0) -> dict[str, ProgressRecord]:
        """Read the shards (``records.progress_shard``) of those of ``peer_ids`` the table does not hold, in one DHT
        call, and return the live peers. A shard looked up less than ``max_age`` seconds ago (or being read) is not
        read again: looking up strangers or newcomers costs at most one read per shard and ``max_age``."""
        now, known = time.monotonic(), self.everyone()
        shards = sorted({progress_shard(p, self.shards) for p in peer_ids if p not in known}
                        - {s for s, at in self._looked_up.items() if now - at < max_age})
        if shards:
            self._looked_up.update((s, now) for s in shards)
            await self._read_shards(shards)
        return self.peers()

    def follow(self, peer_ids: list[str]) -> None:
        """Read the shards of a few of ``peer_ids`` at every read of the table for the next ``FOLLOW_S`` seconds. A
        daemon left out of a round follows its members: they are about to hold the replica it must catch up to, and
        read in turns their records could reach it a turn round the shards late, too late for the next round (it
        would be left out again, and again)."""
        until = time.monotonic() + FOLLOW_S
        for peer in sorted(peer_ids)[:FOLLOW_PEERS]:
            self._follow[progress_shard(peer, self.shards)] = until

    def _shards_to_read(self) -> list[int]:
        """Every shard at the first read; the ``ALL_SHARDS`` key while the swarm fits ``READ_BUDGET`` (once there, up
        to ``ALL_READ_UP_TO``); every shard once more when it outgrew it; then our own shard, the next others in
        turn, and the shards we follow."""
        size = self.size()
        self._keep = 0.0
        if size is not None and size <= (ALL_READ_UP_TO if self._reading_all else READ_BUDGET):
            return [ALL_SHARDS]
        if size is None or self._reading_all:
            return list(range(self.shards))
        others = [s for s in range(self.shards) if s != self.my_shard]
        count = max(1, min(len(others), round(READ_BUDGET / max(self._per_shard, 1.0)) - 1))
        chosen = [others[(self._turn + i) % len(others)] for i in range(count)]
        self._turn = (self._turn + count) % len(others)
        # A shard not read now is kept one turn round the others (at a read per pace) and a record's lifetime.
        self._keep = (math.ceil(len(others) / count) + 3) * self.pace()
        now = time.monotonic()
        self._follow = {s: until for s, until in self._follow.items() if until > now}
        return [self.my_shard, *chosen, *sorted(set(self._follow) - set(chosen) - {self.my_shard})]

    async def _read_shards(self, shards: list[int], prune: bool = False) -> dict[str, ProgressRecord]:
        """Read ``shards`` into the table; ``prune``: drop the shards not read for longer than ``_keep``."""
        ctx, ns = self.ctx, self.ctx.namespace()
        keys = [progress_key(ns, shard) for shard in shards]
        found = await dht_io.get_many(ctx.dht, keys, on_timeout=ctx.reject)
        now, at = get_dht_time(), time.monotonic()
        held = 0
        for shard, key in zip(shards, keys):
            entries = unwrap_subkeys(found.get(key))
            held += len(entries)
            self._held[shard] = _Shard(at, *self._parse_shard(shard, entries, now))
        if prune:
            self._reading_all = shards == [ALL_SHARDS]
        if self._reading_all and shards == [ALL_SHARDS]:
            self._per_shard = held / self.shards
        elif len(shards) > 1:
            self._per_shard = held / len(shards)
        with self._lock:
            stale = [s for s, h in self._held.items() if s not in shards and at - h.read_at > self._keep]
            for shard in stale if prune else ():
                del self._held[shard]
            self._peers = {p: r for h in self._held.values() for p, r in h.peers.items()}
            self._everyone = {p: r for h in self._held.values() for p, r in h.everyone.items()}
            return dict(self._peers)

    def _parse_shard(self, shard: int, entries: dict[bytes, Any], now: float) -> tuple[dict, dict]:
        ctx = self.ctx
        peers, everyone = {}, {}
        for subkey, value in entries.items():
            if ctx.cooldown.active(subkey):
                continue
            rec = parse_progress(value)
            if rec is None or len(rec.fragment_versions) != ctx.replica.num_fragments:
                ctx.reject("progress_record", subkey)
                continue
            if rec.time > now + MAX_CLOCK_SKEW:
                ctx.reject("progress_record_time")  # from the future: counted, not held against the key (clocks drift)
                continue
            if shard != ALL_SHARDS and progress_shard(rec.peer_id, self.shards) != shard:
                ctx.reject("progress_shard", subkey)  # our DHT's validator refuses these; a foreign node may not
                continue
            if self.run_public_key is not None:
                # Our DHT's validator refuses these already; a record it stored before it knew, or one a node
                # without atoll's validators returned, is refused here too.
                signer = peer_id_of(owner_of_raw_subkey(subkey) or b"")
                if signer is None or self.revoked(signer):
                    ctx.reject("revoked", None)
                    continue
                if rec.peer_id != signer:
                    ctx.reject("progress_peer_id", subkey)
                    continue
            if rec.peer_id != ctx.peer_id and rec.status != Status.LEAVING:
                everyone[rec.peer_id] = rec
                if not ctx.cooldown.active(rec.peer_id):
                    peers[rec.peer_id] = rec
        return peers, everyone

    def peers(self) -> dict[str, ProgressRecord]:
        """The live peers as last read (thread-safe)."""
        with self._lock:
            return dict(self._peers)

    def everyone(self) -> dict[str, ProgressRecord]:
        """The live peers as last read, those cooling down included."""
        with self._lock:
            return dict(self._everyone)

    def training(self) -> list[ProgressRecord]:
        return [peer for peer in self.peers().values() if peer.status == Status.TRAINING]

    def revoked(self, peer_id: str) -> bool:
        """Whether the run key revoked ``peer_id``'s membership (its records and requests are refused)."""
        return self.revocation is not None and peer_id in self.revocation.revoked

    async def is_member(self, peer_id: str) -> bool:
        """Private runs: whether ``peer_id`` published a progress record (the DHT accepts those only from members).

        A joiner asks for state right after publishing its first record, which may still be on its way to us: an
        unknown peer is looked for again for up to ``MEMBER_WAIT`` seconds before it is refused. Concurrent askers
        share one read of the peer's shard at a time, at most two a second, so a flood of strangers costs the DHT
        little."""
        if self.revoked(peer_id):
            self.ctx.reject("revoked")
            return False
        deadline = time.monotonic() + MEMBER_WAIT
        while peer_id not in self.peers():
            if time.monotonic() > deadline:
                return False
            try:
                await self.look_up({peer_id}, max_age=0.5)
            except Exception as e:  # the DHT may fail a read; we look again or refuse
                logger.debug("could not refresh peers: %r", e)
            if peer_id not in self.peers():
                await asyncio.sleep(0.25)
        return True

"""The syncer: atoll's protocol side, on one uvloop event loop in a background thread.

It publishes this daemon's progress record every heartbeat, keeps a table of live peers, serves the averaging
and state-download RPCs, runs outer rounds (one fragment each) when the learner asks, and keeps every fragment
of the replica consistent with the swarm: when a live peer holds a heavier replica of a fragment it downloads
it and hands it to the learner. The learner
talks to it only through thread-safe calls that return ``concurrent.futures.Future`` objects; tensor work
(outer steps, hashing) runs in an executor, never on the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import uvloop
from hivemind import DHT
from hivemind.utils import get_dht_time

from atoll.models.fragments import Fragment
from atoll.models.outer import NesterovOuter, grace_window, join_window
from atoll.protocols.averaging import AllreduceResult, AveragingServicer, GroupSpec, TrafficStats, allreduce
from atoll.protocols.codecs import ErrorFeedback
from atoll.protocols.cooldown import Cooldown
from atoll.protocols.matchmaking import POLL_INTERVAL, form_group
from atoll.protocols.records import (
    ProgressRecord, config_key, heavier, open_rounds_key, parse_open_round, parse_progress, progress_key, unwrap_subkeys,
)
from atoll.protocols.state_sync import Replay, ReplicaState, StateServicer, download_state, p2p_opener

from .config import NodeConfig
from .replica import Replica

logger = logging.getLogger("atoll")
MAX_ATTEMPTS = 3
CORRUPTIONS = ("truncated", "header", "codec", "nan")
OPEN_ROUND_POLL = 0.5  # seconds between reads of the rounds others opened (decoupled)
PEERS_MAX_AGE = 1.0  # seconds a peer table read may be reused while forming a group (it is polled)
MEMBER_WAIT = 3.0  # seconds a private run's donor looks for an unknown requester among its peers


@dataclass
class RoundOutcome:
    """``merged``: the replica advanced to ``version`` with ``digest`` and total ``weight`` (the round's result,
    which the replica may have replaced by a heavier download before the learner merges). ``behind``: a heavier
    replica exists; wait for it."""

    kind: str  # "merged" | "behind" | "failed"
    version: int
    members: list[str] = field(default_factory=list)
    contributors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    digest: str = ""
    weight: float = 0.0


class Syncer:
    def __init__(self, cfg: NodeConfig, dht: DHT, subkey: bytes, replica: Replica,
                 progress: Callable[[], dict[str, Any]], fragments: list[Fragment], private: bool = False) -> None:
        self.cfg, self.dht, self.replica, self._progress, self.fragments = cfg, dht, replica, progress, fragments
        self.peer_id = str(dht.peer_id)
        self.cooldown = Cooldown(cfg.peer_cooldown)
        self.stats = TrafficStats(on_offence=self._offence)
        self.outer = NesterovOuter(cfg.run.outer_lr, cfg.run.outer_momentum)
        self.error_feedback = ErrorFeedback()  # per fragment; only touched on the event loop
        self.faults = cfg.parsed_faults()
        self.rounds_done = 0
        self.rounds_skipped = 0
        self.rounds_attempted = 0  # multi-member groups this daemon was in (the fault schedule counts these)
        self.corrupt_delivered = 0  # rounds whose injected malformed parts reached a group that completed
        self.forks_healed = 0
        self.step_time = 0.0  # seconds per inner step, set by the learner (for the grace window)
        self._sync_time = EMA()
        self._quorum_time = EMA()
        self._read_time = EMA()  # one read of the open rounds: the DHT's latency as this daemon sees it
        self._subkey = subkey  # our RSA public key: the DHT lets only us write records under it
        self._peers: dict[str, ProgressRecord] = {}
        self._everyone: dict[str, ProgressRecord] = {}  # peers cooling down included (ddp's fixed membership)
        self._peers_lock = threading.Lock()
        self._adopted: list[ReplicaState] = []
        self._adopted_lock = threading.Lock()
        self._downloading: set[int] = set()
        self._in_round: set[int] = set()
        self._open: set[int] = set()  # decoupled: fragments whose round at our version a peer opened
        self._open_lock = threading.Lock()
        self._last_round: dict[int, int] = {}  # fragment -> the version of the last round we registered for
        self._leaving = False
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run_loop, name="atoll-syncer", daemon=True)
        self._heartbeat_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self.last_group: list[str] | None = None  # ddp: the members of the last completed all-reduce
        self.config_record: dict[str, Any] | None = None  # re-published so the run outlives its first daemon
        self._config_published = 0.0
        self.private = private  # members only: the DHT holds members' records only; state is served to them only
        self._peers_read: asyncio.Future | None = None  # the shared read of the peer table in flight, if any
        self._peers_read_at = 0.0

    # ---- lifetime -------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("syncer did not start within 60 s")

    def _run_loop(self) -> None:
        self._loop = uvloop.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._setup())
        self._ready.set()
        self._loop.run_forever()

    async def _setup(self) -> None:
        self.p2p = await self.dht.replicate_p2p()
        self.averager = AveragingServicer(self.cfg.run_id, self.peer_id, self.stats, self.cooldown,
                                          self.cfg.run.clip_factor, self.cfg.run.round_timeout,
                                          past=lambda p, v: 0 <= p < self.replica.num_fragments
                                          and self.replica.identity(p)[0] > v)
        await self.averager.add_p2p_handlers(self.p2p, namespace=self.cfg.run_id)
        await StateServicer(self.replica.snapshot, self.replica.num_fragments, self.stats,
                            authorize=self.is_member if self.private else None,
                            replay=self.replica.replay_from).add_p2p_handlers(
            self.p2p, namespace=self.cfg.run_id)
        self._open_state_stream = p2p_opener(self.p2p, self.cfg.run_id)
        self._heartbeat_task = self._spawn(self._heartbeat())
        if self.cfg.run.algorithm == "decoupled":
            self._spawn(self._watch_open_rounds())

    def _spawn(self, coro) -> asyncio.Task | None:
        """Start a background task and hold a reference until it ends (asyncio keeps only weak ones).

        Once leaving has begun nothing new starts: a round cancelled by the leave would otherwise spawn a publish
        from its ``finally`` that outlives the DHT it writes to."""
        if self._leaving:
            coro.close()
            return None
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _submit(self, coro) -> concurrent.futures.Future:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def shutdown(self) -> None:
        """Announce leaving (status ``leaving``, short expiry) and stop the event loop."""
        if self._loop is None or not self._loop.is_running():
            return
        self._leaving = True
        try:
            self._submit(self._announce_leaving()).result(timeout=10)
        except Exception as e:  # leaving must not fail because the network did
            logger.warning("could not announce leaving: %r", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _announce_leaving(self) -> None:
        ours = [t for t in self._tasks if t is not asyncio.current_task()]  # not hivemind's own tasks
        for task in ours:
            task.cancel()
        await asyncio.gather(*ours, return_exceptions=True)
        await self._publish(status="leaving", ttl=self.cfg.heartbeat)
        await self.p2p.shutdown()

    # ---- progress and peers ---------------------------------------------------------------------------------
    def progress_record(self, status: str) -> dict[str, Any]:
        ids = self.replica.identities()
        rec = dict(self._progress())
        rec.update(
            peer_id=self.peer_id, status=status, version=sum(v for v, _, _ in ids),
            fragment_versions=[v for v, _, _ in ids], fragment_weights=[float(w) for _, w, _ in ids],
            fragment_hashes=[d for _, _, d in ids], schedule_step=self.replica.schedule_step,
            rounds=self.rounds_done, rounds_skipped=self.rounds_skipped, forks_healed=self.forks_healed,
            bytes_sent=self.stats.bytes_sent, bytes_received=self.stats.bytes_received,
            rejected=self.stats.rejected, rejected_by_kind=dict(self.stats.rejected_by_kind),
            clipped=self.stats.clipped, time=float(get_dht_time()),
        )
        return rec

    async def _publish(self, status: str | None = None, ttl: float | None = None) -> None:
        rec = self.progress_record(status or self._status())
        ttl = ttl if ttl is not None else 3 * self.cfg.heartbeat
        await self.dht.store(progress_key(self._namespace()), rec, expiration_time=get_dht_time() + ttl,
                             subkey=self._subkey, return_future=True)

    def _status(self) -> str:
        return self._progress().get("status", "training")

    def _offence(self, source: str | bytes, kind: str) -> None:
        """A rejected message whose sender is known (a peer id or a record's signing key): cool it down."""
        if source != self.peer_id and source != self._subkey:
            self.cooldown.offend(source, kind)

    def _reject(self, kind: str, source: str | bytes | None = None) -> None:
        self.stats.reject(kind, source)

    async def refresh_peers(self, max_age: float = 0.0) -> dict[str, ProgressRecord]:
        """Read the live peers' progress records; malformed ones are counted and cool their signing key down,
        and the records of peers (or keys) cooling down are ignored.

        ``max_age > 0``: a table whose read began less than ``max_age`` seconds ago is returned as it is, and a
        read in flight is shared. Reads are not cheap: the progress key holds one signed record per peer, and each
        DHT node asked checks every signature, so a swarm of N daemons polling it costs O(N^2) checks per poll."""
        if max_age > 0:
            if self._peers_read is not None and not self._peers_read.done():
                return await asyncio.shield(self._peers_read)
            if time.monotonic() - self._peers_read_at < max_age:
                return self.peers()
        self._peers_read_at = time.monotonic()
        read = asyncio.ensure_future(self._read_peers())
        if max_age > 0:
            self._peers_read = read
        return await asyncio.shield(read)

    async def _read_peers(self) -> dict[str, ProgressRecord]:
        entry = await self.dht.get(progress_key(self._namespace()), latest=True, return_future=True)
        peers, everyone = {}, {}
        for subkey, value in unwrap_subkeys(entry).items():
            if self.cooldown.active(subkey):
                continue
            rec = parse_progress(value)
            if rec is None or len(rec.fragment_versions) != self.replica.num_fragments:
                self._reject("progress_record", subkey)
                continue
            if rec.peer_id != self.peer_id and rec.status != "leaving":
                everyone[rec.peer_id] = rec
                if not self.cooldown.active(rec.peer_id):
                    peers[rec.peer_id] = rec
        with self._peers_lock:
            self._peers, self._everyone = peers, everyone
        return peers

    async def is_member(self, peer_id: str) -> bool:
        """Private runs: whether ``peer_id`` published a progress record (the DHT accepts those only from members).

        A joiner asks for state right after publishing its first record, which may still be on its way to us: an
        unknown peer is looked for again for up to ``MEMBER_WAIT`` seconds before it is refused. Concurrent askers
        share one refresh at a time, at most two a second, so a flood of strangers costs the DHT little."""
        deadline = time.monotonic() + MEMBER_WAIT
        while peer_id not in self.peers():
            if time.monotonic() > deadline:
                return False
            await self._refresh_members()
            if peer_id not in self.peers():
                await asyncio.sleep(0.25)
        return True

    async def _refresh_members(self) -> None:
        try:
            await self.refresh_peers(max_age=0.5)
        except Exception as e:  # the DHT may fail a read; the caller looks again or refuses
            logger.debug("could not refresh peers: %r", e)

    def peers(self) -> dict[str, ProgressRecord]:
        with self._peers_lock:
            return dict(self._peers)

    async def _heartbeat(self) -> None:
        while True:
            try:
                await self._publish()
                if self.config_record is not None and time.monotonic() - self._config_published > 60:
                    await self.dht.store(config_key(self.cfg.run_id), self.config_record, subkey=self._subkey,
                                         expiration_time=get_dht_time() + 600, return_future=True)
                    self._config_published = time.monotonic()
                await self.refresh_peers()
                self._maybe_catch_up()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # one failed heartbeat must not end the loop
                logger.warning("heartbeat failed: %r", e)
            await asyncio.sleep(self.cfg.heartbeat)

    # ---- consistency: adopt heavier replicas ------------------------------------------------------------------
    def _heavier_peers(self, p: int) -> list[ProgressRecord]:
        mine = self.replica.identity(p)
        return [peer for peer in self.peers().values()
                if peer.status == "training" and heavier(peer.fragment(p), mine)]

    def behind(self, p: int) -> bool:
        return bool(self._heavier_peers(p))

    def _maybe_catch_up(self) -> None:
        if self._leaving or self._progress().get("status") == "joining":
            return
        for p in range(self.replica.num_fragments):
            if p in self._downloading or p in self._in_round:
                continue
            donors = donor_order(p, self._heavier_peers(p))
            if donors:
                self._downloading.add(p)
                self._spawn(self._catch_up(p, donors))

    async def _catch_up(self, p: int, donors: list[ProgressRecord]) -> None:
        try:
            mine = self.replica.identity(p)
            logger.info("peer %s holds a heavier replica of fragment %d (v%d vs our v%d); downloading it",
                        donors[0].peer_id[-8:], p, donors[0].fragment(p)[0], mine[0])
            state = await self._download(p, [d.peer_id for d in donors])
            if state is not None and await asyncio.get_running_loop().run_in_executor(None, self.replica.adopt, state):
                if state.forked:
                    self.forks_healed += 1  # two groups merged from the same version: ours lost
                with self._adopted_lock:
                    self._adopted.append(state)
        finally:
            self._downloading.discard(p)

    def error_feedback_state(self) -> dict[str, torch.Tensor]:
        """A copy of the error-feedback residuals, taken on the event loop that owns them."""

        async def copy() -> dict[str, torch.Tensor]:
            return self.error_feedback.state_dict()

        if self._loop is not None and self._loop.is_running():
            return self._submit(copy()).result(30)
        return self.error_feedback.state_dict()

    def replica_changed(self, p: int, version: int) -> bool:
        """True once fragment ``p`` has moved past ``version`` (a round merged or a heavier replica was adopted)."""
        return self.replica.identity(p)[0] != version

    def take_adopted(self) -> list[ReplicaState]:
        """Fragments adopted since the last call (the learner must reload them into θ)."""
        with self._adopted_lock:
            states, self._adopted = self._adopted, []
            return states

    async def _download_fragments(self, fragments: list[int], peers: list[ProgressRecord]) -> list[ReplicaState | None]:
        """Download the heaviest replica of each of ``fragments`` at once, spread over the donors holding it (see
        ``donor_order``), and adopt them into the replica; None for a fragment no donor could send."""

        async def fetch(p: int) -> ReplicaState | None:
            donors = donor_order(p, peers)
            if donors and donors[0].fragment(p) == self.replica.identity(p):
                # We hold that very replica already (a joiner of a young run holds Θ₀ from the shared seed):
                # nothing to download; the donor's record still tells where the sync schedule is.
                held = self.replica.snapshot(p)
                held.schedule_step, held.donor = donors[0].schedule_step, donors[0].peer_id
                return held
            state = await self._download(p, [d.peer_id for d in donors])
            if state is not None and not await asyncio.get_running_loop().run_in_executor(
                    None, self.replica.adopt, state):
                # Not heavier than ours: fine if it is ours (identical), else ours moved on meanwhile.
                return state if state.digest == self.replica.identity(p)[2] else None
            return state

        return list(await asyncio.gather(*(fetch(p) for p in fragments)))

    async def _download(self, p: int, donors: list[str]) -> ReplicaState | None:
        """Fragment ``p``'s replica from the first of ``donors`` that delivers one: by replaying the rounds from
        ours when a donor still holds them, else (or when a replay does not check out) in full."""
        state = await download_state(self._open_state_stream, donors, p, self.replica.numel(p),
                                     self.cfg.run.round_timeout, self.stats, have=self.replica.identity(p)[2])
        if isinstance(state, Replay):
            replayed = await asyncio.get_running_loop().run_in_executor(None, self.replica.replay, state, self.outer)
            if replayed is not None:
                return replayed
            if self.replica.identity(p)[2] == state.rounds[0].base:  # it did not check out: the donor's fault
                self._reject("replay", state.donor)
            state = await download_state(self._open_state_stream, donors, p, self.replica.numel(p),
                                         self.cfg.run.round_timeout, self.stats)
        return state

    def download_initial_state(self, timeout: float) -> list[ReplicaState]:
        """Joining: download every fragment's heaviest replica among live peers. Blocks up to ``timeout``; returns
        the fragments adopted, in order, stopping at the first that could not be downloaded."""

        async def run() -> list[ReplicaState]:
            await self._publish()  # donors of a private run serve members only: be one of their peers first
            peers = [peer for peer in (await self.refresh_peers()).values() if peer.status == "training"]
            if not peers:
                return []
            out = []
            for state in await self._download_fragments(list(range(self.replica.num_fragments)), peers):
                if state is None:
                    break
                out.append(state)
            return out

        return self._submit(run()).result(timeout)

    def catch_up_now(self, timeout: float) -> list[ReplicaState]:
        """Returning from a checkpoint: before training, download every fragment a live peer holds a heavier
        replica of (all at once, as a joiner does), so that the daemon does not merge rounds of a replica the
        swarm has moved past. The adopted fragments are queued for the learner (``take_adopted``)."""

        async def run() -> list[ReplicaState]:
            await self._publish()  # as a joiner does: donors of a private run serve the peers they know
            peers = [peer for peer in (await self.refresh_peers()).values() if peer.status == "training"]
            behind = [p for p in range(self.replica.num_fragments)
                      if any(heavier(peer.fragment(p), self.replica.identity(p)) for peer in peers)]
            states = [s for s in await self._download_fragments(behind, peers) if s is not None]
            for state in states:
                if state.forked:
                    self.forks_healed += 1
            with self._adopted_lock:
                self._adopted.extend(states)
            return states

        return self._submit(run()).result(timeout)

    def grace(self) -> float:
        """The adaptive grace window (seconds) a decoupled round may wait for more members after quorum: the
        overlap's slack, and with ``join_window`` at least the time a peer needs to join a round we opened."""
        run = self.cfg.run
        slack = grace_window(run.grace_gamma, run.overlap, self.step_time, self._quorum_time.value,
                             self._sync_time.value)
        if run.grace_gamma == 0 or not run.join_window:
            return slack
        return max(slack, join_window(self.step_time, self._read_time.value, run.sync_every, OPEN_ROUND_POLL,
                                      POLL_INTERVAL))

    def _namespace(self) -> str:
        """Where progress records, round registrations and open rounds live. The ``split_side``/``split_until``
        faults partition the swarm: until its learner reaches step ``split_until``, a daemon sees and meets only
        daemons of its own side, so both sides train and merge apart (a split swarm) until they meet again."""
        side = self.faults.get("split_side")
        if side is not None and self._progress().get("step", 0) < self.faults.get("split_until", 0):
            return f"{self.cfg.run_id}-side{side}"
        return self.cfg.run_id

    # ---- rounds --------------------------------------------------------------------------------------------
    def submit_round(self, p: int, delta: torch.Tensor, weight: float,
                     base: tuple[int, str]) -> concurrent.futures.Future:
        """Start an outer round of fragment ``p`` with this daemon's pseudo-gradient, computed against the replica
        ``base`` = (version, digest); resolves to a ``RoundOutcome``."""
        return self._submit(self._round(p, delta, weight, base))

    async def _round(self, p: int, delta: torch.Tensor, weight: float, base: tuple[int, str]) -> RoundOutcome:
        started = time.monotonic()
        run = self.cfg.run
        version, digest = base
        self._in_round.add(p)
        behind = False
        try:

            async def live_peers() -> dict[str, int]:
                peers = await self.refresh_peers(max_age=PEERS_MAX_AGE)
                # A peer at our version with another replica (a fork) meets in another round: do not expect it.
                return {peer.peer_id: peer.fragment_versions[p] for peer in peers.values()
                        if peer.status == "training" and not (peer.fragment_versions[p] == version
                                                              and peer.fragment_hashes[p] != digest)}

            decoupled = run.algorithm == "decoupled"
            self._last_round[p] = version
            if decoupled:
                self._spawn(self._announce_round(p, version))
            members = await form_group(
                self.dht, run_id=self._namespace(), fragment=p, version=version, peer_id=self.peer_id,
                subkey=self._subkey, weight=weight, live_peers=live_peers, gather_timeout=run.gather_timeout,
                abort=lambda: self.behind(p), quorum=run.quorum if decoupled else None,
                grace=self.grace, on_reject=self._reject, max_group=run.max_group, excluded=self.cooldown.active,
                base=digest,
            )
            formed = time.monotonic()
            if members is None:
                behind = True
                return RoundOutcome("behind", version, seconds=formed - started)
            if not members:
                return RoundOutcome("failed", version, seconds=formed - started)
            if run.quorum > 1:
                self._quorum_time.update(formed - started)
            if self.faults.get("kill_in_round") == self.rounds_done + 1:
                logger.warning("fault injection: killing this daemon (and its DHT and p2pd) in round v%d", version)
                os.killpg(os.getpgid(0), signal.SIGKILL)
            mode = "rda" if decoupled and run.rda and not self.fragments[p].has_embedding else "mean"
            # A round merged alone is compressed too: every round of a compressed run is then replayable from its
            # codec bytes (a peer that missed it catches up cheaply), and error feedback keeps what it dropped.
            use_ef = run.compression != "none" and run.error_feedback
            target = self.error_feedback.target(str(p), delta) if use_ef else delta
            corrupt = None
            if len(members) > 1:  # a solo round sends nothing, so it cannot carry an injected fault
                self.rounds_attempted += 1
            first_bad = self.faults.get("corrupt_round")
            # Each kind must reach the group twice. A round whose group the others refused (they had this daemon
            # cooling down after its previous offence) delivered nothing, so its kind is sent again.
            index = self.corrupt_delivered if first_bad is not None and self.rounds_attempted >= first_bad else -1
            if len(members) > 1 and 0 <= index < 2 * len(CORRUPTIONS):
                corrupt = CORRUPTIONS[index % len(CORRUPTIONS)]
                logger.warning("fault injection: sending %s parts in round f%d v%d", corrupt, p, version)
            byzantine = self._byzantine(len(members))
            result, alive = await self._allreduce(p, version, members, target, weight, mode, run.compression, corrupt,
                                                  byzantine=byzantine, base=digest)
            if corrupt is not None and result is not None:
                self.corrupt_delivered += 1
                if self.corrupt_delivered == 2 * len(CORRUPTIONS):
                    logger.warning("fault injection: malformed parts reached %d rounds; valid parts from now on",
                                   self.corrupt_delivered)
            if result is None:
                return RoundOutcome("failed", version, members, seconds=time.monotonic() - started)
            self._sync_time.update(time.monotonic() - formed)
            if use_ef and result.sent is not None:
                self.error_feedback.commit(str(p), target, result.sent)
            applied = await asyncio.get_running_loop().run_in_executor(
                None, self.replica.apply_outer_step, p, version, result.merged, result.weight, self.outer, digest,
                result.shards, result.rda_norm)
            if applied is None:
                behind = True
                return RoundOutcome("behind", version, members, seconds=time.monotonic() - started)
            self.rounds_done += 1
            return RoundOutcome("merged", version + 1, members, result.contributors, time.monotonic() - started,
                                digest=applied[2], weight=applied[1])
        finally:
            self._in_round.discard(p)
            self._spawn(self._publish())
            if behind:
                self._maybe_catch_up()

    # ---- decoupled: join rounds that others opened ------------------------------------------------------------
    async def _announce_round(self, p: int, version: int) -> None:
        record = {"peer_id": self.peer_id, "fragment": p, "version": version}
        await self.dht.store(open_rounds_key(self._namespace()), record, subkey=self._subkey,
                             expiration_time=get_dht_time() + self.cfg.run.gather_timeout, return_future=True)

    async def _watch_open_rounds(self) -> None:
        """Daemons drift apart in their schedules (different speeds, joins, restarts). Whenever a live peer opens a
        round of a fragment at the version we hold, tell the learner, which contributes to it at its next step
        boundary instead of at its own due step: rounds stay full without anyone waiting."""
        while True:
            await asyncio.sleep(OPEN_ROUND_POLL)
            try:
                t0 = time.monotonic()
                entry = await self.dht.get(open_rounds_key(self._namespace()), latest=True, return_future=True)
                self._read_time.update(time.monotonic() - t0)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the next poll tries again
                logger.debug("could not read open rounds: %r", e)
                continue
            peers = self.peers()
            for subkey, value in unwrap_subkeys(entry).items():
                parsed = parse_open_round(value) if not self.cooldown.active(subkey) else None
                if parsed is None:
                    if not self.cooldown.active(subkey):
                        self._reject("open_round", subkey)
                    continue
                peer, p, version = parsed
                if (peer == self.peer_id or peer not in peers or p >= self.replica.num_fragments
                        or p in self._in_round or self._last_round.get(p) == version
                        or version != self.replica.identity(p)[0] or self._forked_from(peers[peer], p)):
                    continue
                with self._open_lock:
                    self._open.add(p)

    def _forked_from(self, peer: ProgressRecord, p: int) -> bool:
        """The peer holds another replica of fragment ``p`` at our version (its round is not ours to join)."""
        version, _, digest = self.replica.identity(p)
        return peer.fragment_versions[p] == version and peer.fragment_hashes[p] != digest

    def take_open_rounds(self) -> set[int]:
        """Fragments whose round at our version a peer has opened since the last call."""
        with self._open_lock:
            opened, self._open = self._open, set()
            return opened

    def _byzantine(self, group_size: int) -> str | None:
        """The ``byzantine`` fault: how this daemon misbehaves in this round (from its ``byzantine_from``-th
        multi-member round on), or None."""
        kind = self.faults.get("byzantine")
        if kind is None or group_size < 2 or self.rounds_attempted < self.faults.get("byzantine_from", 1):
            return None
        logger.warning("fault injection: byzantine (%s) contribution in round %d", kind, self.rounds_attempted)
        return kind

    async def _allreduce(self, p: int, version: int, members: list[str], tensor: torch.Tensor, weight: float,
                         mode: str, codec: str, corrupt: str | None = None, first_attempt: int = 0,
                         byzantine: str | None = None, base: str = "") -> tuple[AllreduceResult | None, list[str]]:
        """The group's all-reduce, retried without reducers that failed; (None, _) when it cannot complete.
        Attempt numbers are part of the group id, so a caller that starts over passes a fresh ``first_attempt``."""
        alive = list(members)
        for attempt in range(first_attempt, first_attempt + MAX_ATTEMPTS):
            spec = GroupSpec(self.cfg.run_id, p, version, attempt, tuple(alive), tensor.numel(), mode, codec,
                             self.cfg.run.codec_block, base)
            result = await allreduce(self.p2p, self.averager, spec, self.peer_id, tensor, weight,
                                     self.cfg.run.round_timeout, corrupt, byzantine)
            if result.merged is not None:
                return result, alive
            if result.refused:
                # Live members disagree about the group. Merging without them would fork the replica;
                # instead keep the local progress and let consistency catch us up to the heavier side.
                logger.info("round f%d v%d: members %s disagree about the group; skipping this round", p,
                            version, [r[-8:] for r in result.refused])
                return None, alive
            if self.peer_id in result.failed:  # our own shard failed: nothing to retry without
                return None, alive
            alive = [m for m in alive if m not in result.failed]
            logger.info("round f%d v%d attempt %d failed (reducers %s); retrying with %d members", p, version,
                        attempt, [f[-8:] for f in result.failed], len(alive))
        return None, alive

    # ---- ddp: a gradient all-reduce every inner step (the synchronous baseline) ---------------------------------
    def submit_gradient_allreduce(self, version: int, grads: torch.Tensor, weight: float) -> concurrent.futures.Future:
        """Average this step's gradients with every live ddp peer at the same ``version`` (steps taken together);
        resolves to the token-weighted mean (the same values on every member), or None if no group formed."""
        return self._submit(self._gradient_allreduce(version, grads, weight))

    async def _gradient_allreduce(self, version: int, grads: torch.Tensor, weight: float) -> torch.Tensor | None:
        """ddp's membership is fixed (its daemons start together), so its group needs no matchmaking: it is every
        live training peer, as this daemon's table of peers shows it. Views that disagree, or a member that fails,
        make the all-reduce fail for everyone; then each asks again with a freshly read table."""
        for attempt in range(MAX_ATTEMPTS):
            if attempt:
                await self.refresh_peers()
            with self._peers_lock:  # every member must list the same group: an offender stays in it (its parts
                peers = dict(self._everyone)  # are still treated as missing in the shards we reduce)
            members = sorted([self.peer_id, *(p for p, rec in peers.items() if rec.status == "training")])
            self._in_round.add(0)
            try:
                # Gradients travel in fp32: the codec is for outer deltas (ddp is the uncompressed baseline).
                result, alive = await self._allreduce(0, version, members, grads, weight, "mean", "none",
                                                      first_attempt=attempt * MAX_ATTEMPTS)
            finally:
                self._in_round.discard(0)
            if result is not None:
                self.last_group = alive
                self.rounds_done += 1
                return result.merged
            logger.info("ddp step v%d: all-reduce failed (attempt %d); asking again", version, attempt)
            await asyncio.sleep(0.2 * (attempt + 1))
        return None


def donor_order(p: int, peers: list[ProgressRecord]) -> list[ProgressRecord]:
    """Whom to download fragment ``p`` from, best first: the peers holding its heaviest replica, rotated by ``p``
    so that concurrent downloads of different fragments start at different donors (and a donor that fails
    mid-transfer is followed by another holding the same replica, which can resume it), then the others,
    heaviest first."""
    if not peers:
        return []
    best = max(peer.fragment(p) for peer in peers)
    holders = sorted((peer for peer in peers if peer.fragment(p) == best), key=lambda peer: peer.peer_id)
    k = p % len(holders)
    rest = sorted((peer for peer in peers if peer.fragment(p) != best), key=lambda peer: peer.fragment(p),
                  reverse=True)
    return holders[k:] + holders[:k] + rest


class EMA:
    """Exponential moving average of a duration; 0 until the first sample."""

    def __init__(self, beta: float = 0.7) -> None:
        self.beta, self.value, self._seen = beta, 0.0, False

    def update(self, x: float) -> None:
        self.value = x if not self._seen else self.beta * self.value + (1 - self.beta) * x
        self._seen = True

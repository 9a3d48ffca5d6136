"""The syncer: atoll's protocol side, on one uvloop event loop in a background thread, and its thread-safe facade.

It serves the averaging and state-download RPCs, publishes this daemon's progress record every heartbeat and
reads the peer table (``peers.py``), downloads heavier replicas (``catchup.py``) and runs outer rounds
(``round_protocol.py``). The training loop talks to it only through the methods below, which return at once
(``concurrent.futures.Future`` for work under way); tensor work (outer steps, hashing) runs in an executor, never
on the event loop. The daemon hands it everything it needs at construction (the replica, the counters it
publishes, the faults to inject); the syncer never calls back into the daemon.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Any

import torch
import uvloop
from hivemind import DHT

from atoll.models.fragments import Fragment
from atoll.models.outer import NesterovOuter
from atoll.protocols.averaging import ANSWER_GRACE
from atoll.protocols.reducer import AveragingServicer
from atoll.protocols.cooldown import Cooldown
from atoll.protocols.nudges import NudgeServicer, tell
from atoll.protocols.p2p_guard import MemberGate, StreamGuard, install as install_p2p_guard
from atoll.protocols.records import HeadRecord, ProgressRecord, Status
from atoll.protocols.state_serve import StateServicer
from atoll.protocols.state_sync import ReplicaState
from atoll.protocols.stats import TrafficStats

from ..algorithm import algorithm
from ..config import NodeConfig
from ..faults import Faults
from ..metrics import Counters
from .catchup import CatchUp
from .context import SyncContext
from .contribution import Contribution
from .peers import PeerTable
from .rejoin import Rejoin
from .replica import Replica
from .round_protocol import RoundProtocol

logger = logging.getLogger("atoll")
LEAVE_TIMEOUT = 3.0  # seconds the leaving announcement may take
STALL_TICK_S = 0.5  # how often the stall watch wakes
STALL_MIN_S = 5.0  # a gap this long (or three heartbeats) without the loop running is a stall
# After a stall the DHT's first calls may give up (dht_io's 10 s timeouts) before a fresh read of the table arrives.
STALL_SETTLE_S = 20.0
# Before its P2P stops, a leaving daemon serves the streams peers still have open (the reduced shard of the last
# round, which a member may still be fetching: a ddp daemon that left at --max-steps cut one off), for at most
# LINGER seconds, and until none has been open for LINGER_QUIET (a request may be on its way).
LINGER, LINGER_QUIET = 5.0, 0.5


class Syncer:
    def __init__(self, cfg: NodeConfig, dht: DHT, subkey: bytes, replica: Replica, fragments: list[Fragment],
                 counters: Counters, faults: Faults, private: bool = False,
                 config_record: dict[str, Any] | None = None,
                 error_feedback: dict[str, torch.Tensor] | None = None, run_public_key: bytes | None = None,
                 revocation: Any = None) -> None:
        self.guard: StreamGuard | None = None  # bounds our handlers' streams (set once the P2P is up)
        self.ctx = ctx = SyncContext(
            cfg=cfg, algorithm=algorithm(cfg.run.algorithm), dht=dht, peer_id=str(dht.peer_id), subkey=subkey,
            replica=replica, counters=counters, faults=faults, stats=TrafficStats(),
            cooldown=Cooldown(cfg.peer_cooldown),
            outer=NesterovOuter(cfg.run.outer_lr, cfg.run.outer_momentum, cfg.run.outer_period), spawn=self._spawn,
        )
        self.private = private  # members only: the DHT holds members' records only; state is served to members only
        self.realign = False  # after a stall: the next replica adopted before settle_until brings its donor's schedule
        ctx.stats.on_offence = ctx.offence
        ctx.error_feedback.load_state_dict(error_feedback or {})
        self.table = PeerTable(ctx, config_record, run_public_key=run_public_key, revocation=revocation)
        self.catch_up = CatchUp(ctx, self.table)
        self.rounds = RoundProtocol(ctx, self.table, self.catch_up, fragments)
        self.rejoin = Rejoin(ctx)
        self.rounds.had_peers = lambda: bool(self.rejoin.seen)
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run_loop, name="atoll-syncer", daemon=True)
        self._tasks: set[asyncio.Task] = set()

    @property
    def peer_id(self) -> str:
        return self.ctx.peer_id

    @property
    def stats(self) -> TrafficStats:
        return self.ctx.stats

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
        ctx, run, replica = self.ctx, self.ctx.cfg.run, self.ctx.replica
        install_p2p_guard()  # every frame read in this process is bounded before it is buffered
        ctx.p2p = await ctx.dht.replicate_p2p()
        # Streams of our handlers are bounded per peer and in all, with a first-message deadline; in a private run
        # a peer without a progress record is served only once its record is found (bounded waits), before
        # anything of its stream is read. Streams from peers in the table have a budget strangers cannot take.
        known = lambda peer: peer in self.table.peers()  # noqa: E731
        gate = MemberGate(known, self.table.is_member) if self.private else None
        self.guard = StreamGuard(ctx.stats.reject, known, gate, arrived=ctx.stats.stream_in)
        self.guard.attach(ctx.p2p)
        self.rounds.averager = AveragingServicer(
            ctx.cfg.run_id, ctx.peer_id, ctx.stats, ctx.cooldown, run.clip_factor, run.round_timeout,
            past=lambda p, v: 0 <= p < replica.num_fragments and replica.identity(p)[0] > v,
            authorize=gate.is_member if gate is not None else None, answer=ctx.faults.answer())
        await self.rounds.averager.add_p2p_handlers(ctx.p2p, namespace=ctx.cfg.run_id)
        # Registrations, group decisions and open rounds are told to the peers they concern, who read them at
        # once instead of polling the DHT for them (a thin link's control plane: docs/results.md).
        self.rounds.nudges.send = lambda peers, key: self._spawn(tell(ctx.p2p, ctx.cfg.run_id, peers, key))
        await NudgeServicer(self.rounds.nudges, lambda peer: known(peer) and not ctx.cooldown.active(peer)
                            and not self.table.revoked(peer), ctx.stats).add_p2p_handlers(ctx.p2p, namespace=ctx.cfg.run_id)
        await StateServicer(replica.snapshot, replica.num_fragments, ctx.stats,
                            authorize=gate.is_member if gate is not None else None,
                            replay=replica.replay_from, identity=replica.identity,
                            ).add_p2p_handlers(ctx.p2p, namespace=ctx.cfg.run_id)
        self.catch_up.start()
        self._spawn(self._heartbeat())
        self._spawn(self._watch_stalls())
        if ctx.algorithm.joins_open_rounds:
            self._spawn(self.rounds.watch_open_rounds())

    def _spawn(self, coro) -> asyncio.Task | None:
        """Start a background task and hold a reference until it ends (asyncio keeps only weak ones).

        Once leaving has begun nothing new starts: a round cancelled by the leave would otherwise spawn a publish
        from its ``finally`` that outlives the DHT it writes to."""
        if self.ctx.leaving:
            coro.close()
            return None
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _submit(self, coro) -> concurrent.futures.Future:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _heartbeat(self) -> None:
        while True:
            began = time.monotonic()
            try:
                # At the table's pace (``PeerTable.pace``): every heartbeat while rounds are short.
                if self.table.publish_due():
                    await self.table.publish()
                await self.table.republish_config()
                await self.table.publish_head()
                await self.table.check_revocations()
                live = await self.table.refresh() if self.table.read_due() else self.table.peers()
                if self.table.summary_due():
                    await self.table.publish_summary()
                self.rejoin.check(set(live))
                self.catch_up.maybe_catch_up()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # one failed heartbeat must not end the loop
                logger.warning("heartbeat failed: %r", e)
            await asyncio.sleep(self.ctx.cfg.heartbeat)
            self.table.heartbeat_took(time.monotonic() - began)

    async def _watch_stalls(self) -> None:
        """Notice that the event loop did not run for a while (the process was frozen by SIGSTOP or a debugger,
        starved of CPU, or the machine slept) and come back into step at once: publish a fresh progress record
        (the old one expired meanwhile: the others stopped counting on us), read the swarm and catch up, and for
        ``STALL_SETTLE_S`` read the table afresh before any round merges alone (``RoundProtocol._refuse_alone``)."""
        ctx, last = self.ctx, time.monotonic()
        while True:
            ctx.loop_due = last + STALL_TICK_S
            await asyncio.sleep(STALL_TICK_S)
            now = time.monotonic()
            stalled, last = now - last - STALL_TICK_S, now
            if stalled >= ANSWER_GRACE:  # long enough for a round's members to leave our reducer out
                ctx.gap_ended = now
            if stalled < max(STALL_MIN_S, 3 * ctx.cfg.heartbeat):
                continue
            ctx.settle_until, self.realign = now + STALL_SETTLE_S, True
            logger.warning("the daemon did not run for %.1f s (frozen, or starved of CPU): publishing our record "
                           "again and catching up", stalled)
            self._spawn(self._come_back())

    async def _come_back(self) -> None:
        try:
            await self.table.publish()
            live = await self.table.refresh()
            self.rejoin.after_stall(set(live))
            self.catch_up.maybe_catch_up()
        except Exception as e:  # the heartbeat does the same a moment later
            logger.info("coming back after a stall: %r", e)

    def shutdown(self) -> None:
        """Announce leaving (status ``leaving``, short expiry) and stop the event loop."""
        if self._loop is None or not self._loop.is_running():
            return
        self.ctx.leaving = True
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
        # Short: with SIGTERM sent to the whole process group the DHT process is gone, and nobody would read it.
        await asyncio.gather(self.table.publish_head(force=True),
                             self.table.publish(status=Status.LEAVING, ttl=self.ctx.cfg.heartbeat,
                                                timeout=LEAVE_TIMEOUT))
        await self._linger()
        await self.ctx.p2p.shutdown()

    async def _linger(self) -> None:
        """Wait (up to ``LINGER``) until no peer has had a stream open to us for ``LINGER_QUIET`` seconds."""
        guard = self.guard
        if guard is None:
            return
        loop = asyncio.get_running_loop()
        deadline, quiet_since = loop.time() + LINGER, None
        while loop.time() < deadline:
            if guard.limits.open_total:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = loop.time()
            elif loop.time() - quiet_since >= LINGER_QUIET:
                return
            await asyncio.sleep(0.05)

    # ---- the facade the training loop uses -----------------------------------------------------------------
    def submit_round(self, p: int, contribution: Contribution, base: tuple[int, str]) -> concurrent.futures.Future:
        """Start an outer round of fragment ``p`` with this daemon's contribution (its pseudo-gradient against the
        replica ``base`` = (version, digest), given now or when the group has formed); resolves to a
        ``RoundOutcome``."""
        return self._submit(self.rounds.run(p, contribution, base))

    def submit_gradient_allreduce(self, version: int, grads: torch.Tensor, weight: float) -> concurrent.futures.Future:
        """ddp: average this step's gradients with every live peer at ``version``; resolves to the mean or None."""
        return self._submit(self.rounds.gradient_allreduce(version, grads, weight))

    def announce(self, timeout: float = LEAVE_TIMEOUT) -> None:
        """Publish our progress record now, with the status the counters hold (a pause or a resume must not wait a
        heartbeat: until the others read it they expect us in their rounds). Blocks up to ``timeout``; a failure is
        logged, and the next heartbeat says it again."""
        try:
            self._submit(self.table.publish(timeout=timeout)).result(timeout + 1)
        except Exception as e:  # noqa: BLE001 — the heartbeat publishes it anyway
            logger.warning("could not publish our status %s at once: %r", self.ctx.counters.status.value, e)

    def take_adopted(self) -> list[ReplicaState]:
        """Fragments adopted since the last call (the learner must reload them into θ)."""
        return self.catch_up.take_adopted()

    def take_realign(self) -> bool:
        """True once after a stall (``_watch_stalls``) while it settles: the training side then takes the next
        adopted replica's sync-schedule step as its own (``Rounds._realign``), as a joiner or a restarted daemon
        does, so that its fragments fall due with the others' again."""
        ctx = self.ctx
        if not self.realign:
            return False
        self.realign = False
        return time.monotonic() < ctx.settle_until

    def take_candidates(self) -> list[ReplicaState]:
        """Replicas nobody vouches for that a lonely daemon downloaded, for the learner to vet
        (``node/rounds/vetting.py``); each must be answered with ``settle``."""
        return self.catch_up.take_candidates()

    def candidates_waiting(self) -> bool:
        """Whether a downloaded replica waits for the learner's vetting (``take_candidates``)."""
        return self.catch_up.candidates_waiting()

    def settle(self, state: ReplicaState, passed: bool) -> bool:
        """Adopt a candidate that ``passed`` the learner's check (then ``take_adopted`` returns it); True if adopted."""
        return self.catch_up.settle(state, passed)

    def take_open_rounds(self) -> set[int]:
        """Fragments whose round at our version a peer has opened since the last call (decoupled)."""
        return self.rounds.take_open_rounds()

    def download_initial_state(self, timeout: float) -> list[ReplicaState]:
        """Joining: download every fragment's heaviest replica among live peers. Blocks up to ``timeout``; returns
        the fragments adopted, in order, stopping at the first that could not be downloaded."""
        return self._submit(self.catch_up.join()).result(timeout)

    def catch_up_now(self, timeout: float) -> list[ReplicaState]:
        """Returning from a checkpoint: before training, download every fragment the swarm has moved past (queued
        for ``take_adopted``)."""
        return self._submit(self.catch_up.after_restore()).result(timeout)

    def run_head(self, timeout: float = 30.0) -> HeadRecord | None:
        """How far the run got by its members' notes (``PeerTable.read_head``); blocks up to ``timeout``."""
        return self._submit(self.table.read_head()).result(timeout)

    def peers(self) -> dict[str, ProgressRecord]:
        """The live peers as last read."""
        return self.table.peers()

    def last_group(self) -> list[str] | None:
        """ddp: the members of the last completed all-reduce."""
        return self.rounds.last_group

    def replica_changed(self, p: int, version: int) -> bool:
        """True once fragment ``p`` has moved past ``version`` (a round merged or a heavier replica was adopted)."""
        return self.ctx.replica.identity(p)[0] != version

    def error_feedback_state(self) -> dict[str, torch.Tensor]:
        """The error-feedback residuals of this moment (the tensors are not copied: ``ErrorFeedback.residuals``).
        Read from the caller's thread: a checkpoint does not wait for the event loop, which may be busy."""
        return self.ctx.error_feedback.residuals()

"""One outer round of one fragment, on the syncer's event loop: matchmaking, the group's all-reduce, the outer step.

A round (p, v) is formed among the live daemons holding fragment p at version v with the same replica
(``protocols/matchmaking.py``); the group all-reduces its members' compressed deltas (``protocols/averaging.py``),
retrying without reducers that failed, and each member applies the outer step to its replica. Decoupled rounds
close at a quorum plus a grace window, and are announced so that peers a few steps off their schedule join them
(``watch_open_rounds``). ddp's per-step gradient all-reduce runs through the same all-reduce.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from hivemind.utils import get_dht_time

from atoll.models.fragments import Fragment
from atoll.models.robust import MergeRule
from atoll.protocols import dht_io
from atoll.protocols.averaging import ANSWER_GRACE, HONEST, AllreduceResult, Tamper, allreduce
from atoll.protocols.cooldown import Strikes
from atoll.protocols.coordination import Decision, SpentDecisions, sibling_group
from atoll.protocols.matchmaking import POLL_INTERVAL, Policy, Registrant, Round, SilentCoordinators, form_group
from atoll.protocols.nudges import Nudges
from atoll.protocols.records import Status, open_rounds_key, parse_open_round, unwrap_subkeys
from atoll.protocols.reducer import AveragingServicer, GroupSpec

from ..algorithm import LocalMerge
from .catchup import MAX_LONELY_LEAD, CatchUp
from .context import SyncContext
from .contribution import Contribution
from .peers import PeerTable
from .waits import PEERS_MAX_AGE, EMA, FragmentPeers, grace_window, join_window

logger = logging.getLogger("atoll")
MAX_ATTEMPTS = 3
SIBLING_ATTEMPTS = 1000  # the attempt numbers (in group ids) of a split round's merge of its groups
OPEN_ROUND_POLL = 0.5  # seconds at least between reads of the rounds others opened (decoupled)
OPEN_ROUND_FALLBACK = 3.0  # seconds at most between them: a peer that opens one tells us (``protocols/nudges.py``)
REFUSAL_OFFENCES = 3  # groups in a row a member refused before it is an offender
MAX_DEFERRALS = 2  # lone rounds deferred at one version of a fragment before one merges alone anyway


class Outcome(enum.Enum):
    MERGED = "merged"  # the replica advanced
    BEHIND = "behind"  # a heavier replica exists: catch up instead
    FAILED = "failed"  # no group, or its all-reduce did not complete: keep the local progress
    DEFERRED = "deferred"  # alone while live peers hold our very replica: no lone merge, the work goes on


class Reduced(NamedTuple):
    """What a group's all-reduce came to (``RoundProtocol.allreduce``): its ``result`` (None if it did not complete),
    the members still in it after retries (``alive``), and whether a member ``disowned`` the group as decided: a
    reducer refused its first attempt because it had moved past the round (merged that version by another group:
    ``GroupRefused.past``). Such a reducer never opens the group, and every member's first attempt needs its
    shard: the decision completes for nobody. Other refusals do not disown it (a reducer cooling one member down,
    or out of waiting slots, refuses that member alone while the others complete)."""

    result: AllreduceResult | None
    alive: list[str]
    disowned: bool = False


@dataclass
class RoundOutcome:
    """``MERGED``: the replica advanced to ``version`` with ``digest`` and total ``weight`` (the round's result,
    which the replica may have replaced by a heavier download before the learner merges). ``formation_seconds``:
    from the round's start to its group's decision, of ``seconds`` in all."""

    kind: Outcome
    version: int
    members: list[str] = field(default_factory=list)
    contributors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    digest: str = ""
    weight: float = 0.0
    reducers: list[str] = field(default_factory=list)
    formation_seconds: float = 0.0


class RoundProtocol:
    def __init__(self, ctx: SyncContext, peers: PeerTable, catch_up: CatchUp, fragments: list[Fragment]) -> None:
        self.ctx, self.peers, self.catch_up, self.fragments = ctx, peers, catch_up, fragments
        self.started_at = get_dht_time()  # DHT time this process's rounds began: our registrations carry it
        self.averager: AveragingServicer | None = None  # set once the event loop has started
        self.last_group: list[str] | None = None  # ddp: the members of the last completed all-reduce
        self.sync_time = EMA()
        self.quorum_time = EMA()
        self.read_time = EMA()  # one read of the open rounds: the DHT's latency as this daemon sees it
        self._open: set[int] = set()  # decoupled: fragments whose round at our version a peer opened
        self._open_lock = threading.Lock()
        self._last_round: dict[int, int] = {}  # fragment -> the version of the last round we registered for
        self._announced: dict[int, int] = {}  # fragment -> the version whose round a peer announced
        self.had_peers: Callable[[], bool] = lambda: False  # whether any peer was ever live (``Rejoin.seen``)
        self._deferred: dict[int, tuple[int, int]] = {}  # fragment -> (version, lone rounds deferred at it)
        self.nudges = Nudges()  # its ``send`` is set once the event loop has started
        self.silent = SilentCoordinators()  # coordinators bypassed, rounds in a row (an offence after a few)
        self.spent = SpentDecisions()  # decisions whose all-reduce failed: a retry at their round needs a new one
        self.refusals = Strikes(REFUSAL_OFFENCES)  # members that refused our group, rounds in a row

    def grace(self) -> float:
        """The adaptive grace window (seconds) a decoupled round may wait for more members after quorum: the
        overlap's slack, and with ``join_window`` at least the time a peer needs to join a round we opened."""
        run, step_time = self.ctx.cfg.run, self.ctx.counters.step_time
        slack = grace_window(run.grace_gamma, run.overlap, step_time, self.quorum_time.value, self.sync_time.value)
        if run.grace_gamma == 0 or not run.join_window:
            return slack
        return max(slack, join_window(step_time, self.read_time.value, run.sync_every, OPEN_ROUND_POLL,
                                      POLL_INTERVAL))

    # ---- an outer round ---------------------------------------------------------------------------------------
    async def run(self, p: int, contribution: Contribution, base: tuple[int, str]) -> RoundOutcome:
        """An outer round of fragment ``p`` with our ``contribution`` (the pseudo-gradient and its weight), taken
        against the replica ``base`` = (version, digest). A contribution not given yet is asked for once the group
        has formed (``Contribution``): the training loop snapshots θ_p at its next step boundary."""
        ctx, run, algo = self.ctx, self.ctx.cfg.run, self.ctx.algorithm
        started = time.monotonic()
        version, digest = base
        ctx.in_round.add(p)
        behind = False
        try:

            self._last_round[p] = version
            decided: list[Decision] = []
            # Synchronous rounds follow a failed decision again: members that completed it moved on, and a new group
            # of those that failed would fork from them (refused by the ones that moved on, they catch up instead).
            # Not one a member disowned (``Reduced``) when there is no line to catch up to: followed again it fails
            # again until it is stale (``DECISION_LIFETIME_FACTOR`` gather timeouts): a swarm back from a restart
            # re-followed, round after round, a decision listing a founder that had merged that version alone.
            spent = self.spent.of((p, version, digest))
            if algo.joins_open_rounds and self._announced.get(p) != version:
                ctx.spawn(self._announce(p, version, digest))
            members = await form_group(
                ctx.dht, Round(ctx.namespace(), p, version, digest),
                Registrant(ctx.peer_id, ctx.subkey, contribution.weight, started=self.started_at),
                Policy(run.gather_timeout, run.quorum if algo.quorum else None, self.grace, run.max_group),
                FragmentPeers(self.peers, p, base, self.peers.revoked), abort=lambda: self.catch_up.behind(p),
                on_reject=ctx.reject, on_decision=decided.append, spent=spent, nudges=self.nudges, silent=self.silent)
            formed = time.monotonic()
            if members is None:
                behind = True
                return RoundOutcome(Outcome.BEHIND, version, seconds=formed - started)
            if not members:
                if decided:  # left out: its members will hold the replica to catch up to
                    self.peers.follow([m for group in decided[-1].groups for m in group])
                return RoundOutcome(Outcome.FAILED, version, seconds=formed - started)
            # A group of one in a split round merges with its siblings.
            split = bool(decided) and len(decided[-1].groups) > 1
            if algo.quorum and members == [ctx.peer_id] and not split:
                refused = await self._refuse_alone(p, version, digest)
                if refused is not None:
                    behind = refused is Outcome.BEHIND
                    return RoundOutcome(refused, version, members, seconds=formed - started)
            # The others wait for our part as long as a reduce may take: so may we, for our training loop's (a step,
            # or an evaluation or checkpoint capture in between).
            taken = await contribution.take(max(3 * ctx.counters.step_time, run.round_timeout / 2))
            if taken is None:
                logger.warning("round f%d v%d: no contribution from the training loop in time (paused, stopping, or "
                               "the replica moved while the group formed): leaving the group", p, version)
                return RoundOutcome(Outcome.FAILED, version, members, seconds=time.monotonic() - started)
            delta, weight = taken
            if run.quorum > 1:
                self.quorum_time.update(formed - started)
            ctx.faults.group_formed(ctx.counters.rounds_done, version)
            rda = algo.rda and run.rda and not self.fragments[p].has_embedding
            mode = "rda" if rda else "mean"
            # A round merged alone is compressed too: every round of a compressed run is then replayable from its
            # codec bytes (a peer that missed it catches up cheaply), and error feedback keeps what it dropped.
            use_ef = run.compression != "none" and run.error_feedback
            target = ctx.error_feedback.target(str(p), delta) if use_ef else delta
            tamper = ctx.faults.tamper(len(members), p, version)
            reduced = await self.allreduce(p, version, members, target, weight, mode, run.compression, tamper,
                                           base=digest, max_weight=ctx.max_weight)
            result, alive = reduced.result, reduced.alive
            ctx.faults.round_ended(tamper, result is not None)
            if result is not None and self._stalled_since(formed):
                logger.warning("round f%d v%d: this daemon did not run for a while during the all-reduce (frozen or "
                               "starved): its members may have left its reducer out; not merging, catching up "
                               "instead", p, version)
                result, behind = None, True
            if result is None:
                if decided and reduced.disowned and not algo.quorum and self.catch_up.behind(p):
                    # Members that moved past the round hold a line others vouch for: catch up to it (our work
                    # stays in θ) rather than decide the round again without them, a fork of theirs.
                    behind = True
                    return RoundOutcome(Outcome.BEHIND, version, members, seconds=time.monotonic() - started)
                if decided and (algo.quorum or reduced.disowned):
                    spent.add(decided[-1].id)
                return RoundOutcome(Outcome.FAILED, version, members, seconds=time.monotonic() - started)
            self.sync_time.update(time.monotonic() - formed)
            if use_ef and result.sent is not None:
                ctx.error_feedback.commit(str(p), target, result.sent)
            if decided and len(decided[-1].groups) > 1:
                result = await self._merge_siblings(p, version, decided[-1].groups, result, digest)
            applied = await asyncio.get_running_loop().run_in_executor(
                None, ctx.replica.apply_outer_step, p, version, result.merged, result.weight, ctx.outer, digest,
                result.shards, result.rda_norm)
            if applied is None:
                behind = True
                return RoundOutcome(Outcome.BEHIND, version, members, seconds=time.monotonic() - started)
            ctx.counters.rounds_done += 1
            return RoundOutcome(Outcome.MERGED, version + 1, members, result.contributors,
                                time.monotonic() - started, digest=applied[2], weight=applied[1],
                                reducers=list(self.reducers(alive)), formation_seconds=formed - started)
        finally:
            ctx.in_round.discard(p)
            ctx.spawn(self.peers.publish())
            if behind:
                self.catch_up.maybe_catch_up()

    def _stalled_since(self, since: float) -> bool:
        """Whether this daemon's event loop stopped for ``ANSWER_GRACE`` or more since ``since`` (monotonic). A
        daemon frozen or starved while its all-reduce ran may have been left out as a reducer by the other members,
        who then merged without it; the same attempt can still complete here once it runs again (every other shard
        answered), and merging it would fork the replica from theirs."""
        ctx, now = self.ctx, time.monotonic()
        return ctx.gap_ended >= since or (ctx.loop_due > 0 and now - ctx.loop_due >= ANSWER_GRACE)

    async def _refuse_alone(self, p: int, version: int, digest: str) -> Outcome | None:
        """Why a decoupled round of fragment ``p`` at ``version`` (replica ``digest``) whose group is only ourselves
        must not merge; None when it may. Merging alone makes a replica of ``version + 1`` that only we hold: when
        the others merge that version among themselves it is a fork, and the lighter side loses its work.

        - ``BEHIND`` when a live peer holds the fragment at a later version: the swarm merged on without us (we were
          frozen, paused, slow, or left out). The replica is caught up; the work stays in θ (the delta rule) and
          goes into the next round. A claim more than ``MAX_LONELY_LEAD`` versions ahead is ignored, as by the
          catch-up: one lying peer cannot stop a lone daemon's rounds.
        - ``DEFERRED`` when a live peer holds our very replica (same version and digest): it did not make it into
          this round (its registration came after the group closed, over a slow DHT), and will meet us in the
          next one. Likewise when a live peer holds an older replica of our line (one of ``Replica.ancestors``):
          it is catching up to ours, and a lone merge would put us a version further ahead each time it arrives
          (a fast lone daemon outran its joiners by more than ``MAX_LONELY_LEAD`` versions, and the swarm stayed
          forked). Under the delta rule waiting costs no work: θ keeps it and the next contribution carries it.
          At most ``MAX_DEFERRALS`` times at one version: a peer claiming our replica (or an ancestor) and never
          joining cannot stop our rounds, only slow them. Not under ``--local-merge overwrite``: there a lone merge
          keeps more.
        - While the daemon settles after a stall (``Syncer._watch_stalls``) the table is read afresh first: the one
          it holds is from before the stall. A table with no live peer at all, when we had some, says that our DHT
          node lost the others during the stall (``Rejoin.after_stall`` is finding them again), not that they left:
          no round merges alone (``BEHIND``) until they are back or the settling ends."""
        settling = time.monotonic() < self.ctx.settle_until
        peers = await self.peers.refresh(max_age=0.0 if settling else PEERS_MAX_AGE)
        live = [peer for peer in peers.values() if peer.status == Status.TRAINING]
        if settling and self.had_peers() and not live:
            logger.info("round f%d v%d: alone, and no peer is visible since the stall: not merging alone until the "
                        "DHT finds them again", p, version)
            return Outcome.BEHIND
        ahead = [peer.fragment_versions[p] for peer in live
                 if version < peer.fragment_versions[p] <= version + MAX_LONELY_LEAD]
        if ahead:
            logger.info("round f%d v%d: alone while %d live peer(s) hold the fragment at v%d; merging alone would "
                        "fork it: catching up instead", p, version, len(ahead), max(ahead))
            return Outcome.BEHIND
        # Peers we cool down or that were revoked are left out of our groups: they cannot meet us in the next round.
        # A peer on our line behind us (it holds an ancestor of our replica: catching up, or its record predates our
        # last merge) is on its way to this version: merging alone would only make it chase us again.
        line = set(self.ctx.replica.ancestors(p)) | {digest}
        coming = [peer for peer in live
                  if version - MAX_LONELY_LEAD <= peer.fragment_versions[p] <= version
                  and peer.fragment_hashes[p] in line
                  and not (self.ctx.cooldown.active(peer.peer_id) or self.peers.revoked(peer.peer_id))]
        at, deferred = self._deferred.get(p, (version, 0))
        deferred = deferred if at == version else 0
        if coming and LocalMerge(self.ctx.cfg.run.local_merge) is LocalMerge.DELTA and deferred < MAX_DEFERRALS:
            self._deferred[p] = (version, deferred + 1)
            # Our next round of p is at this version again: watch for a peer opening it, and announce ours.
            self._last_round.pop(p, None)
            self._announced.pop(p, None)
            logger.info("round f%d v%d: alone while %d live peer(s) hold this replica or are catching up to it; "
                        "merging alone would fork it: the work goes into the next round", p, version, len(coming))
            return Outcome.DEFERRED
        return None

    async def _merge_siblings(self, p: int, version: int, groups: list[list[str]], result: AllreduceResult,
                              digest: str) -> AllreduceResult:
        """A round split into several groups (more registrants than ``max_group``) merges their results, so that it
        ends on one replica instead of one per group. Every group started from the same replica, and the outer step
        is linear in the merged delta: the groups' merged deltas averaged by their weights give what one group of
        all the members would have (a ``mean`` round exactly, up to the codec; RDA's per-group results are averaged
        as they are). This member merges with the one at its position in every other group
        (``coordination.sibling_group``), and all those sibling groups sum in the groups' order: each computes the
        same bits. One that fails, or a member at a position not every group has, keeps its own group's result,
        the lighter replica: it adopts the merged one by download, as it would a fork's."""
        siblings = sibling_group(groups, self.ctx.peer_id)
        if siblings is None:
            return result
        run = self.ctx.cfg.run
        merged = (await self.allreduce(p, version, siblings, result.merged, result.weight, "mean", run.compression,
                                       first_attempt=SIBLING_ATTEMPTS, base=digest, ordered=True)).result
        if merged is None:
            logger.info("round f%d v%d: could not merge with the round's other %d groups; keeping our group's "
                        "result", p, version, len(groups) - 1)
            return result
        contributors = sorted({m for members in groups if set(members) & set(merged.contributors) for m in members})
        return dataclasses.replace(merged, contributors=contributors, sent=result.sent)

    def _refused(self, refusers: list[str], group: str | None) -> None:
        """Members that refused our group, counted (``group_refusal``); ``REFUSAL_OFFENCES`` refusals of one peer
        in a row, of different groups, are an offence (``group_refusal_offence``). One refusal is not: under faults
        honest views of a group disagree often enough that cooling every refuser down split the swarm; but a
        registrant that refuses every group it is put in (the second review's squatter) made every round with it
        skip. Only a refusal of a group as decided strikes (``allreduce``'s first attempt; ``group`` its id, None
        for a retry): a retry's group is the decided one less the reducers that failed *for us*, and honest
        members that saw different reducers fail retry with different groups and refuse each other's. A
        synchronous round follows a failed decision again, and a member that refused it refuses it again: one
        strike. Struck for those, twelve honest daemons under load cooled each other down: an offender is left out
        of the rounds its striker decides, and its streams to it are refused, which fails more reducers."""
        for peer in refusers:
            self.ctx.reject("group_refusal")
            if group is not None and self.refusals.miss(peer, group):
                self.ctx.reject("group_refusal_offence", peer)

    async def allreduce(self, p: int, version: int, members: list[str], tensor: torch.Tensor, weight: float,
                        mode: str, codec: str, tamper: Tamper = HONEST, first_attempt: int = 0,
                        base: str = "", ordered: bool = False, max_weight: float = 0.0) -> Reduced:
        """The group's all-reduce, retried without reducers that failed (``Reduced``; its result None when it
        cannot complete). Attempt numbers are part of the group id, so a caller that starts over passes a fresh
        ``first_attempt``. ``max_weight``: the most weight one member may declare (``GroupSpec.max_weight``)."""
        ctx = self.ctx
        alive = list(members)
        for attempt in range(first_attempt, first_attempt + MAX_ATTEMPTS):
            reducers = self.reducers(alive)
            if not reducers:
                # Only members behind NAT: none can open a stream to another, and a replica merged here could be
                # downloaded from nobody (it would stay apart from the run's). Keep the local progress instead.
                logger.info("round f%d v%d: no reachable member to reduce; skipping this round", p, version)
                return Reduced(None, alive)
            spec = GroupSpec(ctx.cfg.run_id, p, version, attempt, tuple(alive), tensor.numel(), mode, codec,
                             ctx.cfg.run.codec_block, base, MergeRule(ctx.cfg.run.robust_merge), reducers, ordered,
                             max_weight)
            result = await allreduce(ctx.p2p, self.averager, spec, ctx.peer_id, tensor, weight,
                                     ctx.cfg.run.round_timeout, tamper)
            if result.merged is not None:
                for reducer in reducers:  # each answered: a group it knew
                    self.refusals.hit(reducer)
                return Reduced(result, alive)
            if result.refused:
                # Live members disagree about the group. Merging without them would fork the replica;
                # instead keep the local progress and let consistency catch us up to the heavier side.
                logger.info("round f%d v%d: members %s disagree about the group; skipping this round", p,
                            version, [r[-8:] for r in result.refused])
                decided = attempt == first_attempt
                self._refused(result.refused, spec.group_id if decided else None)
                return Reduced(None, alive, disowned=decided and bool(result.moved_past))
            if ctx.peer_id in result.failed:  # our own shard failed: nothing to retry without
                return Reduced(None, alive)
            alive = [m for m in alive if m not in result.failed]
            logger.info("round f%d v%d attempt %d failed (reducers %s); retrying with %d members", p, version,
                        attempt, [f[-8:] for f in result.failed], len(alive))
        return Reduced(None, alive)

    def reducers(self, members: list[str]) -> tuple[str, ...]:
        """The members that can reduce a shard: all but those behind NAT (``--client-mode``: their progress record
        says ``reachable`` False), who contribute over streams they open themselves. Every member computes the
        same tuple from the same records: the flag is fixed for a daemon's life and its record is what made it a
        live peer. One we hold no record of counts as reachable (a view that differs makes the group ids differ:
        the round is refused and skipped, never merged apart)."""
        known = self.peers.everyone()
        me = self.ctx.peer_id

        def reachable(peer: str) -> bool:
            if peer == me:
                return not self.ctx.cfg.client_mode
            return known[peer].reachable if peer in known else True

        return tuple(m for m in members if reachable(m))

    # ---- decoupled: join rounds that others opened -----------------------------------------------------------
    async def _announce(self, p: int, version: int, base: str) -> None:
        ctx = self.ctx
        record = {"peer_id": ctx.peer_id, "fragment": p, "version": version}
        key = open_rounds_key(ctx.namespace(), p, version, base)
        if await dht_io.store(ctx.dht, key, record, get_dht_time() + ctx.cfg.run.gather_timeout, ctx.subkey,
                              on_timeout=ctx.reject):
            # Every live peer: a table a few seconds old may show one that holds this replica by now at the one
            # before; those that cannot join it are not listening to this key and drop the nudge.
            self.nudges.tell([peer.peer_id for peer in self.peers.everyone().values()
                              if peer.status == Status.TRAINING], key)

    async def watch_open_rounds(self) -> None:
        """Daemons drift apart in their schedules (different speeds, joins, restarts). Whenever a peer opens a round
        of a fragment from the replica we hold, note it for the learner, which contributes to it at its next step
        boundary instead of at its own due step: rounds stay full without anyone waiting.

        Each read takes the announcement keys of the rounds we could join (one per fragment: our version and
        digest), in one DHT call: when a peer that opened one tells us (``protocols/nudges.py``), at most every
        ``OPEN_ROUND_POLL`` s, and otherwise every ``OPEN_ROUND_FALLBACK`` s. A round already announced by a peer
        is not announced again by those who join it (``_announced``), so a read returns the few daemons that opened
        it, whatever the swarm's size. An announcement is a hint to contribute early, not a membership: the round's
        registrations are checked as always, and a fragment joins at most one opened round per version."""
        ctx = self.ctx
        with self.nudges.listen(()) as told:
            while True:
                await told.wait(OPEN_ROUND_FALLBACK, OPEN_ROUND_POLL)
                ids = [ctx.replica.identity(p) for p in range(ctx.replica.num_fragments)]
                keys = [open_rounds_key(ctx.namespace(), p, version, digest)
                        for p, (version, _, digest) in enumerate(ids)]
                self.nudges.follow(told, keys)  # a peer that opens one of them tells us (``_announce``)
                await self._read_open_rounds(ids, keys)

    async def _read_open_rounds(self, ids: list[tuple[int, float, str]], keys: list[str]) -> None:
        """One read of the announcement ``keys`` (one per fragment, at the version and digest of ``ids``)."""
        ctx = self.ctx
        try:
            t0 = time.monotonic()
            found = await dht_io.get_many(ctx.dht, keys, on_timeout=ctx.reject)
            self.read_time.update(time.monotonic() - t0)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the next poll tries again
            logger.debug("could not read open rounds: %r", e)
            return
        for p, ((version, _, _), key) in enumerate(zip(ids, keys)):
            for subkey, value in unwrap_subkeys(found.get(key)).items():
                parsed = parse_open_round(value) if not ctx.cooldown.active(subkey) else None
                if parsed is None or parsed[1:] != (p, version):
                    if not ctx.cooldown.active(subkey):
                        ctx.reject("open_round", subkey)
                    continue
                peer = parsed[0]
                if peer == ctx.peer_id or ctx.cooldown.active(peer):
                    continue
                self._announced[p] = version  # opened by a peer: joining it needs no announcement of ours
                if p in ctx.in_round or self._last_round.get(p) == version:
                    continue
                with self._open_lock:
                    self._open.add(p)

    def take_open_rounds(self) -> set[int]:
        """Fragments whose round at our version a peer has opened since the last call; thread-safe."""
        with self._open_lock:
            opened, self._open = self._open, set()
            return opened

    # ---- ddp: a gradient all-reduce every inner step -----------------------------------------------------------
    async def gradient_allreduce(self, version: int, grads: torch.Tensor, weight: float) -> torch.Tensor | None:
        """Average this step's gradients with every live ddp peer at the same ``version``; the token-weighted mean
        (the same values on every member), or None if no group formed.

        ddp's membership is fixed (its daemons start together), so its group needs no matchmaking: it is every
        live training peer, as this daemon's table of peers shows it. Views that disagree, or a member that fails,
        make the all-reduce fail for everyone; then each asks again with a freshly read table."""
        ctx = self.ctx
        for attempt in range(MAX_ATTEMPTS):
            if attempt:
                await self.peers.refresh()
            # Every member must list the same group: an offender stays in it (its parts are still treated as
            # missing in the shards we reduce).
            peers = self.peers.everyone()
            members = sorted([ctx.peer_id, *(p for p, rec in peers.items() if rec.status == Status.TRAINING)])
            ctx.in_round.add(0)
            try:
                # Gradients travel in fp32: the codec is for outer deltas (ddp is the uncompressed baseline).
                result, alive, _ = await self.allreduce(0, version, members, grads, weight, "mean", "none",
                                                        first_attempt=attempt * MAX_ATTEMPTS)
            finally:
                ctx.in_round.discard(0)
            if result is not None:
                self.last_group = alive
                ctx.counters.rounds_done += 1
                return result.merged
            logger.info("ddp step v%d: all-reduce failed (attempt %d); asking again", version, attempt)
            await asyncio.sleep(0.2 * (attempt + 1))
        return None

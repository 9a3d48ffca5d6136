"""A fragment round's life on the training loop's side: snapshot, contribution, merge — and adopted replicas.

A round of fragment p starts at its due step (or when a peer opened it, decoupled). The synchronous algorithms copy
θ_p to host memory there, without holding up the next steps, and hand the pseudo-gradient Θ_base − θ_p to the
syncer with the round; τ steps later they wait for its result. A decoupled round registers at once and takes its
snapshot when its group has formed (``--snapshot-at formation``, the default; ``due`` snapshots at the due step):
the syncer asks (``Contribution``), the loop snapshots at its next step boundary, and only the reduce is in flight;
the result merges whenever it lands. By default (``LocalMerge.DELTA``) the merge keeps what the learner trained
while the round was in flight: θ_p ← Θ_p,new + (θ_p,now − θ_p,snapshot), and those steps are carried into the
next contribution, so that every inner step lands in exactly one merged pseudo-gradient. A replica the syncer
adopted from a peer moves θ_p at the next step boundary, carrying the unmerged work the same way (θ_p ← Θ_p,new +
θ_p − base); one nobody vouches for (a lonely daemon's, see ``catchup``) is first vetted on the held-out data
(``vetting``). Carried work is bounded at ``CARRY_PERIODS`` periods (``sync_every`` steps each): beyond it, and
under ``overwrite``, the work is dropped. Every token of work that no merge keeps is counted as lost (the steps a
merge overwrites or the bound drops, and our part of rounds a fork lost); every token the carry keeps is counted as
carried.

The loop calls ``before_step`` and ``after_step``, nothing else; neither awaits the network.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from atoll.models.fragments import Fragment
from atoll.models.outer import pseudo_gradient
from atoll.protocols.state_sync import MAX_ANCESTORS, ReplicaState

from ..algorithm import Algorithm, LocalMerge, SnapshotAt
from ..config import NodeConfig
from ..metrics import SKIPPED, Counters, HeldOut, MetricsLog
from ..trainee import Trainee
from .contribution import Contribution
from .local_state import LocalFragmentState
from .replica import Replica
from .round_protocol import Outcome, RoundOutcome
from .syncer import Syncer
from .vetting import Vetting

logger = logging.getLogger("atoll")
# A peer's open round is joined once we have done at least 1/4 of a period's steps on the fragment since our last
# round of it: a 3x slower daemon still joins the rounds its faster peers open; a liar gains at most 4x the rate.
OPEN_ROUND_MIN_SHARE = 4
# The most periods of work carried onto a new replica. A round that takes longer than a period to land (a thin
# link: its due round is skipped meanwhile), or one that failed before it, carries all its steps: carrying them beat
# dropping them at every delay measured in one process, up to five periods (docs/results.md, "The carry bound").
# Past the longest measured (a daemon frozen or alone for minutes, its work trained against a replica the swarm
# has moved far past) the work is dropped and counted. A contribution carrying more than about 4 periods meets the
# reducers' weight clip (4x the lower median): it still counts, at that weight.
CARRY_PERIODS = 5
# Rounds timed before a synchronous daemon judges its round cadence against the heartbeat (the first steps include
# warm-up).
CADENCE_AFTER_ROUNDS = 3


def records_lag(step_time: float, sync_every: int, heartbeat: float) -> float:
    """How many of a fragment's rounds pass between two of a peer's progress records (0 before a step was timed).
    A synchronous round waits only for the peers whose record is at most one version behind ours: past 1, live
    peers read as further behind and groups close without them, and the replica forks (catch-up repairs it, at
    the cost of their work)."""
    return heartbeat / (step_time * sync_every) if step_time > 0 else 0.0


@dataclass
class _Pending:
    future: concurrent.futures.Future
    merge_at: int  # schedule step at which the result is merged in (due step + τ)
    version: int
    # θ_p at the snapshot (flat fp32 host): the delta rule keeps θ_p,now − theta. None until a round that snapshots
    # at its group's formation has taken it.
    theta: torch.Tensor | None
    counters: tuple[int, int] | None  # the tokens and steps behind our contribution (the fragment's, at the snapshot)
    base_id: tuple[int, str]  # the replica the contribution was taken against
    delta: torch.Tensor | None = None  # our contribution (Θ_base − θ at the snapshot), kept for stale contributions
    contribution: Contribution | None = None  # a round that asks for its snapshot once its group has formed


@dataclass
class _Snapshot:
    """A round about to start: θ_p on its way to host memory, and what the round is taken against."""

    theta: concurrent.futures.Future  # flat fp32 host θ_p as of the due step
    base: torch.Tensor  # Θ_base at that step (LocalFragmentState replaces, never mutates, its base)
    base_id: tuple[int, str]
    weight: float
    merge_at: int
    counters: tuple[int, int]  # the fragment's tokens and steps at the snapshot
    for_round: _Pending | None = None  # the formed round this snapshot is its contribution to


@dataclass(eq=False)
class _MergedRound:
    """One of our recent merged rounds of a fragment, kept so that a fork that loses it can be detected (its
    ``digest`` is not an ancestor of the replica that won) and its work counted or contributed again."""

    digest: str  # the replica the round produced
    counters: tuple[int, int]  # the tokens and steps behind our part
    delta: torch.Tensor | None = None  # our part (Θ_base − θ at the snapshot), kept only for stale contributions


class Rounds:
    def __init__(self, cfg: NodeConfig, algorithm: Algorithm, learner: Trainee, fragments: list[Fragment],
                 replica: Replica, local: list[LocalFragmentState], syncer: Syncer, counters: Counters,
                 metrics: MetricsLog, held_out: HeldOut, stop: threading.Event) -> None:
        self.cfg, self.run, self.algorithm = cfg, cfg.run, algorithm
        self.learner, self.fragments = learner, fragments
        self.replica, self.local, self.syncer = replica, local, syncer
        self.counters, self.metrics, self.held_out, self.stop = counters, metrics, held_out, stop
        self.keep_stale = algorithm.stale_contributions and cfg.run.stale_contributions
        self.local_merge = LocalMerge(cfg.run.local_merge)
        # Unmerged work survives an adoption under the delta rule (and, as before it, with stale contributions).
        self.carry_adopted = self.local_merge is LocalMerge.DELTA or self.keep_stale
        self.carry_max_steps = CARRY_PERIODS * cfg.run.sync_every
        # Decoupled rounds snapshot θ_p once their group has formed; the synchronous ones at the due step, where the
        # merge waits for them.
        self.snapshot_at_formation = (not algorithm.synchronous
                                      and SnapshotAt(cfg.snapshot_at) is SnapshotAt.FORMATION)
        self.pending: dict[int, _Pending] = {}
        self.snapshots: dict[int, _Snapshot] = {}  # rounds whose θ_p snapshot is still on its way to the host
        self.merged_rounds: dict[int, list[_MergedRound]] = {}  # per fragment, newest last
        self.vetting = Vetting(learner, fragments, replica)
        self._cadence_checked = not algorithm.synchronous

    def before_step(self) -> None:
        """Load the replicas the syncer adopted into θ."""
        self._apply_adopted()

    def after_step(self) -> bool:
        """Start the rounds due at this step (or opened by peers), start those whose snapshot reached the host,
        merge those due; True when the last fragment merged (a consistent point for a checkpoint)."""
        step, merged_last = self.replica.schedule_step, False
        for fragment in self.fragments:
            if fragment.due(step, self.run.sync_every):
                merged_last |= self._merge_landed(fragment.index)
                self._start(fragment.index, own_schedule=True)
        if self.algorithm.joins_open_rounds:
            for p in sorted(self.syncer.take_open_rounds()):
                merged_last |= self._merge_landed(p)
                self._start(p)
        self._serve_contributions()
        self._submit_snapshots()
        return self._merge_due() or merged_last

    # ---- adopted replicas ---------------------------------------------------------------------------------
    def _apply_adopted(self) -> None:
        learner, counters = self.learner, self.counters
        n = len(self.fragments)
        for candidate in self.syncer.take_candidates():
            self.syncer.settle(candidate, self.vetting.vet(candidate))
        adopted = self.syncer.take_adopted()
        if adopted and self.syncer.take_realign():
            self._realign(adopted[0])
        for state in adopted:
            p = state.fragment
            new, base_id = self.replica.params_and_id(p)
            local, fragment = self.local[p], self.fragments[p]
            # Our merged rounds that the new replica does not descend from were lost with our side of a fork.
            ours = self.merged_rounds.get(p, [])
            lost_rounds = [r for r in ours if r.digest not in state.ancestors] if state.forked else []
            self.merged_rounds[p] = [r for r in ours if r not in lost_rounds]
            lost = sum(r.counters[0] for r in lost_rounds) // n
            if self.carry_adopted and local.steps <= self.carry_max_steps:
                # Keep the work no round has merged yet: θ_p moves with the new Θ_p, and the unmerged progress
                # rides along into our next contribution, weighted by the tokens behind it. With stale
                # contributions our part of the lost rounds rides along too (Θ_base − θ_snapshot = delta, so its
                # progress is −delta).
                progress = learner.gather(fragment).double() - local.base.double()
                again = [r for r in lost_rounds if r.delta is not None] if self.keep_stale else []
                for r in again:
                    progress -= r.delta.double()
                    local.tokens += r.counters[0]
                    local.steps += r.counters[1]
                lost = sum(r.counters[0] for r in lost_rounds if r not in again) // n
                counters.tokens_carried += local.tokens // n
                local.rebase(new, base_id)
                learner.put(fragment, (new.double() + progress).float())
                what = "carried" + (" with our part of the lost round" if again else "")
            else:
                lost += local.restart(new, base_id) // n
                learner.put(fragment, new)
                what = "discarded"
            counters.tokens_lost += lost
            how = f" by replaying {len(state.rounds)} rounds" if state.rounds else ""
            logger.info("adopted fragment %d v%d (ours was v%s) from %s%s%s; unmerged local work %s, %d tokens' work "
                        "lost", p, state.version, state.replaced, state.donor[-8:], how,
                        " (a fork: ours lost)" if state.forked else "", what, lost)
            self.metrics.write(event="adopted", fragment=p, version=state.version, replaced=state.replaced,
                               lost_tokens=lost, step=learner.step, forked=state.forked, hash=state.digest,
                               donors=list(state.donors), replayed=len(state.rounds))

    def _realign(self, state: ReplicaState) -> None:
        """Back from a stall (a freeze, a starved CPU), take the donor's place in the sync schedule. Our schedule
        step stood still while theirs went on; kept, our fragments would fall due at other moments than theirs,
        so we would open rounds nobody joins and miss theirs, adopting their results one version behind again and
        again while our unmerged work grows past the carry bound. Rounds in flight keep their place relative to
        the schedule (their merge steps move by the same jump)."""
        jump = state.schedule_step - self.replica.schedule_step
        if jump == 0:
            return
        self.replica.schedule_step = state.schedule_step
        for item in (*self.pending.values(), *self.snapshots.values()):
            item.merge_at += jump
        logger.info("back from a stall: our sync schedule moves %+d steps to %s's (schedule step %d)", jump,
                    state.donor[-8:], state.schedule_step)
        self.metrics.write(event="realigned", jump=jump, schedule_step=state.schedule_step, donor=state.donor)

    # ---- contributing ---------------------------------------------------------------------------------------
    def _start(self, p: int, own_schedule: bool = False) -> None:
        """Contribute fragment ``p`` to its next round: at its due step (``own_schedule``), or earlier when a peer
        opened that round (decoupled)."""
        if p in self.pending or p in self.snapshots:  # the previous round has not landed: do not queue another
            if own_schedule:
                self.counters.round_ended(p, SKIPPED)
            return
        if own_schedule and self.algorithm.joins_open_rounds and self.local[p].fresh_steps < self.run.sync_every // 2:
            # We joined a round of p that a peer opened not long ago: opening another now would only split the
            # swarm's work on p into smaller rounds.
            return
        if not own_schedule and self.local[p].fresh_steps < self.run.sync_every // OPEN_ROUND_MIN_SHARE:
            # A peer's round opened right after our last one: honest peers a little off our schedule do not do
            # that, and a member announcing rounds at every step would make us contribute at every step.
            return
        self._apply_adopted()  # the pseudo-gradient must be taken against the replica the round will update
        local = self.local[p]
        version, _, digest = self.replica.identity(p)
        if (version, digest) != local.base_id or local.steps == 0:
            # An adoption is landing right now, or one just restarted this fragment: nothing of ours to merge yet.
            self.counters.round_ended(p, SKIPPED)
            return
        merge_at = self.replica.schedule_step + self.run.overlap_steps
        local.round_started()
        if not self._cadence_checked and self.counters.rounds_done >= CADENCE_AFTER_ROUNDS:
            self._cadence_checked = True
            lag = records_lag(self.counters.step_time, self.run.sync_every, self.cfg.heartbeat)
            if lag > 1:
                logger.warning("a round every %.2f s is faster than the heartbeat (%.1f s): peers will read as %.0f "
                               "rounds behind and synchronous rounds close without them; set --heartbeat below "
                               "%.2f s or raise --sync-every", self.counters.step_time * self.run.sync_every,
                               self.cfg.heartbeat, lag, self.counters.step_time * self.run.sync_every)
        if self.snapshot_at_formation:
            # The round registers now and asks for the snapshot once its group has formed (``_serve_contributions``).
            contribution = Contribution(self.algorithm.weight(local.tokens, local.steps))
            future = self.syncer.submit_round(p, contribution, local.base_id)
            self.pending[p] = _Pending(future, merge_at, local.base_id[0], None, None, local.base_id,
                                       contribution=contribution)
            return
        # θ_p as of this step, copied to host memory without holding up the next steps (on an accelerator the copy
        # lands a step or two later; the round starts then, against the base it was taken from).
        self._snapshot(p, merge_at)
        self._submit_snapshots()

    def _snapshot(self, p: int, merge_at: int, for_round: _Pending | None = None) -> None:
        local = self.local[p]
        self.snapshots[p] = _Snapshot(self.learner.snapshot(self.fragments[p].params), local.base, local.base_id,
                                      self.algorithm.weight(local.tokens, local.steps), merge_at,
                                      (local.tokens, local.steps), for_round)

    def _serve_contributions(self) -> None:
        """Snapshot the fragments whose rounds formed their groups and ask for their contributions."""
        for p, pending in self.pending.items():
            contribution = pending.contribution
            if contribution is None or p in self.snapshots or not contribution.wanted():
                continue
            if self.local[p].base_id != pending.base_id or self.local[p].steps == 0:
                # An adoption moved θ_p's base while the group formed: no contribution against the round's replica.
                contribution.refuse()
                continue
            self._snapshot(p, pending.merge_at, pending)

    def _submit_snapshots(self) -> None:
        """Start the rounds whose fragment snapshots have reached host memory (or hand a formed round its
        contribution)."""
        for p, snap in list(self.snapshots.items()):
            # A synchronous round merges at a fixed step: training past it on θ_p would be overwritten, so wait.
            if not snap.theta.done() and not (self.algorithm.synchronous
                                              and self.replica.schedule_step >= snap.merge_at):
                continue
            del self.snapshots[p]
            theta = snap.theta.result()
            delta = pseudo_gradient(snap.base, theta)
            pending = snap.for_round
            if pending is not None:
                if self.pending.get(p) is pending and pending.contribution is not None:  # not ended meanwhile
                    pending.theta, pending.counters = theta, snap.counters
                    pending.delta = delta.float() if self.keep_stale else None
                    pending.contribution.give(delta, snap.weight)
                continue
            future = self.syncer.submit_round(p, Contribution.ready(delta, snap.weight), snap.base_id)
            self.pending[p] = _Pending(future, snap.merge_at, snap.base_id[0], theta, snap.counters, snap.base_id,
                                       delta.float() if self.keep_stale else None)

    def drain(self, timeout: float, paused: Callable[[], None] = lambda: None) -> int:
        """Before a pause: start the rounds whose snapshots are on their way, call ``paused`` (the island says so
        to its peers: no new round expects it), and merge every round in flight, waiting up to ``timeout`` for them
        to land (not counted as blocked: the loop is about to stop anyway); a round whose group forms meanwhile takes
        its snapshot here. A round still out at the deadline stays pending and merges after the resume; one whose
        group forms during the pause fails (nothing snapshots a paused loop), its work kept. Returns how many rounds
        ended."""
        deadline = time.monotonic() + timeout
        while self.snapshots and not all(s.theta.done() for s in self.snapshots.values()):
            if time.monotonic() >= deadline or self.stop.wait(0.02):
                break
        self._submit_snapshots()
        paused()
        while self.pending and not all(p.future.done() for p in self.pending.values()):
            self._serve_contributions()  # rounds forming now still get their snapshot: θ does not move any more
            self._submit_snapshots()
            if time.monotonic() >= deadline or self.stop.wait(0.02):
                break
        ended = 0
        for p, pending in list(self.pending.items()):
            if pending.future.done():
                del self.pending[p]
                self._finish(p, pending)
                ended += 1
        return ended

    # ---- merging ----------------------------------------------------------------------------------------------
    def _merge_landed(self, p: int) -> bool:
        """Merge p's round if it landed since the last boundary, before p's next round starts (a round still pending
        would make it skip); True when that was the last fragment."""
        pending = self.pending.get(p)
        if pending is None or not pending.future.done() or self.replica.schedule_step < pending.merge_at:
            return False
        del self.pending[p]
        return self._finish(p, pending)

    def _merge_due(self) -> bool:
        last_merged = False
        for p, pending in list(self.pending.items()):
            if self.replica.schedule_step < pending.merge_at:
                continue
            if not pending.future.done():
                if not self.algorithm.synchronous:
                    continue  # never wait; merge whenever the round lands
                if not self._wait(pending.future.done):
                    return last_merged
            del self.pending[p]
            last_merged |= self._finish(p, pending)
        return last_merged

    def _wait(self, done, deadline: float | None = None) -> bool:
        """Block the loop until ``done()`` (or ``deadline``); time counted as blocked. False if asked to stop."""
        t0 = time.monotonic()
        try:
            while not done():
                if deadline is not None and time.monotonic() >= deadline:
                    return True
                if self.stop.wait(0.02):
                    return False
            return True
        finally:
            self.counters.blocked_seconds += time.monotonic() - t0

    def _merge(self, p: int, pending: _Pending) -> None:
        """Take round ``pending``'s result (the replica as it is now) into θ_p by the run's ``local_merge``."""
        learner, counters, local, n = self.learner, self.counters, self.local[p], len(self.fragments)
        fragment = self.fragments[p]
        merged, base_id = self.replica.params_and_id(p)
        # The work trained on θ_p since the snapshot: τ steps, or more when the round landed late (a grace window
        # that waited for a joiner), or fewer when a pause merged it early (``drain``).
        since = (local.tokens - pending.counters[0], local.steps - pending.counters[1])
        counters.in_flight_steps.append(since[1])
        rounds = self.merged_rounds.setdefault(p, [])
        for older in rounds:
            older.delta = None  # memory: only the newest round can be contributed again
        rounds.append(_MergedRound(base_id[1], pending.counters, pending.delta))
        del rounds[:-MAX_ANCESTORS]
        delta_rule = self.local_merge is LocalMerge.DELTA and since[1] <= self.carry_max_steps
        if local.base_id != pending.base_id:
            # A replica adopted while the round was in flight already moved θ_p and its base (``_apply_adopted``):
            # what θ_p holds beyond that base moves onto this result the same way.
            if delta_rule:
                self._rebase_onto(p, merged, base_id)  # the adoption counted this work carried already
                return
            since = (local.tokens, local.steps)
        if delta_rule:
            value = merged.double() + (learner.gather(fragment).double() - pending.theta.double())
            local.carry(merged, base_id, *since)
            counters.tokens_carried += since[0] // n
            learner.put(fragment, value.float())
            return
        # Overwriting (or mixing) drops the work since the snapshot (the paper's α = 0 choice); so does a carry past
        # the bound.
        counters.tokens_lost += since[0] // n
        local.restart(merged, base_id)
        if self.local_merge is LocalMerge.MIX:
            merged = self.run.alpha * learner.gather(fragment) + (1 - self.run.alpha) * merged
        learner.put(fragment, merged)

    def _rebase_onto(self, p: int, replica: torch.Tensor, replica_id: tuple[int, str]) -> None:
        """θ_p ← Θ_p + (θ_p − base): what θ_p holds beyond its base moves onto ``replica``, which becomes the base."""
        fragment, local = self.fragments[p], self.local[p]
        value = replica.double() + (self.learner.gather(fragment).double() - local.base.double())
        local.rebase(replica, replica_id)
        self.learner.put(fragment, value.float())

    def _finish(self, p: int, pending: _Pending) -> bool:
        learner, run, counters = self.learner, self.run, self.counters
        try:
            outcome = pending.future.result()
        except (concurrent.futures.CancelledError, Exception) as e:  # a round must never end the training loop
            logger.warning("round f%d v%d ended with an error: %r", p, pending.version, e)
            outcome = RoundOutcome(Outcome.FAILED, pending.version)
        counters.round_ended(p, outcome.kind.value, outcome.seconds if outcome.kind is Outcome.MERGED else None)
        if outcome.kind is Outcome.BEHIND:
            logger.info("round f%d v%d abandoned: a heavier replica exists; catching up", p, pending.version)
            if self.algorithm.synchronous:
                # Not past a replica downloaded for vetting: the loop vets it (``before_step``), and until then the
                # replica cannot change (a daemon back from an old checkpoint waited out the whole deadline).
                deadline = time.monotonic() + 2 * self.cfg.heartbeat + 2 * run.round_timeout
                self._wait(lambda: self.syncer.replica_changed(p, pending.version)
                           or self.syncer.candidates_waiting(), deadline)
            return False
        if outcome.kind is Outcome.FAILED:
            logger.warning("round f%d v%d failed; continuing with local progress", p, pending.version)
            return False
        if outcome.kind is Outcome.DEFERRED:  # said why already; θ keeps the work for the next round
            return False
        if pending.theta is None:
            # Merged without our snapshot: cannot happen (the reduce needs it). Should it, θ_p moves onto the result
            # as onto an adopted replica, so that its base and the replica stay one.
            logger.warning("round f%d v%d merged without our contribution; our work is carried onto it", p,
                           pending.version)
            self._rebase_onto(p, *self.replica.params_and_id(p))
            return False
        self._merge(p, pending)
        # The round's own result: a heavier replica downloaded since (now in θ_p) is recorded as an adoption.
        if p == 0:
            self.held_out.evaluate(learner)
        held_out = counters.held_out_loss
        logger.info("round f%d v%d→v%d done in %.1fs: %d members, %d contributors, held-out loss %s, hash %s",
                    p, pending.version, outcome.version, outcome.seconds, len(outcome.members),
                    len(outcome.contributors), f"{held_out:.4f}" if held_out is not None else "-", outcome.digest)
        stats = self.syncer.stats
        self.metrics.write(event="round", fragment=p, version=outcome.version, hash=outcome.digest,
                           weight=outcome.weight, members=outcome.members, contributors=outcome.contributors,
                           reducers=outcome.reducers,
                           step=learner.step, tokens=learner.tokens, held_out_loss=held_out,
                           held_out_step=counters.held_out_step, seconds=outcome.seconds,
                           formation_seconds=outcome.formation_seconds,
                           in_flight_steps=counters.in_flight_steps[-1] if counters.in_flight_steps else None,
                           bytes_sent=stats.bytes_sent, bytes_received=stats.bytes_received)
        return p == len(self.fragments) - 1

"""Keeping every fragment of the replica consistent with the swarm (on the syncer's event loop).

When live peers hold a heavier replica of a fragment (a round we missed, or the other side of a fork), the
fragment is downloaded from one of them — by replaying the rounds from ours when the donor still holds them, else
in full — adopted into the replica, and queued for the learner (``take_adopted``). Joiners download every fragment
before their first step; a daemon restored from a checkpoint downloads the ones the swarm has moved past.

A replica is only a claim in a progress record, and the bytes a donor sends can only be checked against the digest
the donor itself announced: one member could otherwise make everyone adopt a model it made up (the review's
all-zero replica). So a claim counts only when it is *vouched for*: at least ``state_vouchers`` distinct live peers
(all of them, when fewer are live) publish that very (version, weight, digest). A heavier claim of one peer alone
is neither downloaded nor a reason to abandon a round; honest swarms do not need it, since the members of a round
all hold its result, and a lone daemon that merged alone is overtaken by the others' next round (or, if it is
heavier, adopted once a second daemon holds its replica). And a donor that does not back a claim it vouches for —
it refuses, stalls or sends what does not check out, ``UNBACKED_OFFENCES`` times in a row — is an offender.

A lone daemon's fork can also run ahead: alone, its rounds close at once, so its versions (and even its merged
weight) can outpace the others'. Version first, its claim stays the heaviest but nobody vouches for it, and it
never takes theirs: the fork would never heal (the chaos run's and the xla swarm's stalemates). So a lonely daemon
(below) takes a claim two or more live peers hold, whatever its version and weight (``fork_line``): one daemon's
fork gives way to the swarm's line.

One case needs more: when every live daemon's replica of a fragment is its own (concurrent solo rounds forked the
swarm three ways, say), no claim is vouched for and no two daemons ever meet in a round again. So a *lonely*
daemon — one whose replica no live peer holds — that sees no vouched heavier claim may take the heaviest claim of
one peer at most ``MAX_LONELY_LEAD`` versions ahead of ours, at most once per ``LONELY_INTERVAL`` seconds per
fragment. It downloads it, drops it if it fails a gross filter (``plausible``: a norm within 2x of our replica's,
no blown-up momentum), and hands it to the learner as a *candidate* (``take_candidates``), which adopts it only if
the daemon's own held-out loss says it is no worse than ours (``vetting``; ``settle``). A daemon that shares
its replica with any live peer never takes a claim of one.

Vouching is only as good as the vouchers: two colluding members vouch for any replica they like. So a vouched
replica a training daemon downloads is vetted the same way when it is unlike ours (``unlike_ours``: it fails the
gross filter, or lies farther than ``MAX_VOUCHED_DISTANCE`` of our norm from ours). An honest catch-up moves a
fragment by a few rounds' outer steps and is adopted at once; joiners and restored daemons, whose replica is not
the run's yet, take vouched replicas as they are.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import Counter

import torch

from atoll.protocols.records import ProgressRecord, Status, heavier
from atoll.protocols.state_serve import p2p_opener
from atoll.protocols.state_sync import (MAX_ANCESTORS, MAX_TRANSFERS_PER_PEER, DonorRefused, Replay, ReplicaState,
                                        download_state)

from ..progress import track
from .context import SyncContext
from .donors import donor_order, donors, vouched
from .peers import PeerTable

logger = logging.getLogger("atoll")
UNBACKED_OFFENCES = 2  # failed downloads in a row from one donor (one may be bad luck: it died, or moved on)
# Paces of our table (heartbeats while rounds are short): a donor's record, as we read it, shows what it moved on to
# after at most about this long.
RECORD_GRACE = 3.0
MAX_TRACKED_DONORS = 1024
LONELY_INTERVAL = 10.0  # seconds between adoptions of a claim nobody vouches for, per fragment
MAX_NORM_RATIO = 2.0  # such a state's norm may differ from our replica's by at most this factor
# A vouched-for replica farther than this from ours (relative to our norm) is vetted before it is adopted. An honest
# daemon catching up by some rounds moves its fragment a little; two colluding members vouching for a made-up one
# (the all-zero model: 1.0; Θ₀ scrambled: about 1.4) move it far. Vetting costs the learner two evaluations.
MAX_VOUCHED_DISTANCE = 0.5
FAILED_VETTING_SECONDS = 600.0  # a replica that failed vetting is not downloaded again for this long
MAX_FAILED = 1024
MOMENTUM_FACTOR = 4.0
MAX_LONELY_LEAD = 32  # versions: forked honest daemons merge at about the same pace, a made-up claim need not


class CatchUp:
    def __init__(self, ctx: SyncContext, peers: PeerTable) -> None:
        self.ctx, self.peers = ctx, peers
        self._downloading: set[int] = set()
        self._adopted: list[ReplicaState] = []
        self._lock = threading.Lock()
        self._open_stream = None
        self._failures: dict[str, tuple] = {}  # donor -> (the claim it failed, failures in a row, since when)
        self._clock = time.monotonic
        self._lonely_at: dict[int, float] = {}  # fragment -> when we last took a claim nobody vouched for
        self._candidates: dict[int, ReplicaState] = {}  # fragment -> a state for the learner to vet
        self._replacing: dict[int, str | None] = {}  # fragment -> the replica a candidate's adoption may replace
        self._failed: dict[str, float] = {}  # digest -> when a replica of it failed the learner's vetting
        self._slots: dict[str, asyncio.Semaphore] = {}  # donor -> our transfers from it in flight (at most 2)

    def start(self) -> None:
        """On the event loop, once the P2P is up."""
        self._open_stream = p2p_opener(self.ctx.p2p, self.ctx.cfg.run_id)

    def _slot(self, donor: str) -> asyncio.Semaphore:
        """The semaphore our downloads from ``donor`` share: a donor serves a peer ``MAX_TRANSFERS_PER_PEER`` at once
        (a joiner downloads every fragment at once, perhaps all from one donor)."""
        slot = self._slots.get(donor)
        if slot is None:
            if len(self._slots) >= MAX_TRACKED_DONORS:
                self._slots = {d: s for d, s in self._slots.items() if s.locked()}
            slot = self._slots[donor] = asyncio.Semaphore(MAX_TRANSFERS_PER_PEER)
        return slot

    def heavier_peers(self, p: int) -> list[ProgressRecord]:
        """The live peers holding a vouched-for replica of fragment ``p`` heavier than ours; or, when no live peer
        holds ours (``alone``), the swarm's line of a fork we are on alone (``fork_line``)."""
        mine = self.ctx.replica.identity(p)
        training = self.peers.training()
        backed = [peer for peer in vouched(p, training, self.ctx.cfg.state_vouchers)
                  if not self.failed_vetting(peer.fragment(p)[2])]
        return [peer for peer in backed if heavier(peer.fragment(p), mine)] or self.fork_line(p, backed, training)

    def fork_line(self, p: int, backed: list[ProgressRecord], training: list[ProgressRecord]
                  ) -> list[ProgressRecord]:
        """If no live peer holds our replica of fragment ``p`` (we are on a fork alone), the holders of the line to
        take instead of ours, whatever the versions and weights: the claim at least two live peers hold (of
        ``backed``, the vouched-for ones), the most held first, then the heaviest. Two at least: with one other
        live daemon its claim is "vouched for" by itself, and two daemons forked apart would each take the other's
        (the local swarm's swap: a founder took a joiner's lone fork by weight while the joiner took the founder's
        by version). A claim older than the ancestry a replica keeps may be an ancestor of ours: its holders are
        behind us on our line, and it is taken only if they will never take ours, held by us alone (``taken_by``):
        a daemon that ran alone more rounds ahead than its ancestry reaches kept its line and they kept theirs, the
        swarm split for good (a whole swarm restarted from its checkpoints, its founder back first)."""
        mine = self.ctx.replica.identity(p)
        if not backed or not self.alone(p, training):
            return []
        oldest = mine[0] - MAX_ANCESTORS + 1 if self.taken_by(training) else -math.inf
        held = Counter(peer.fragment(p) for peer in backed if peer.fragment(p)[0] >= oldest)
        lines = [claim for claim, n in held.items() if n >= 2]
        if not lines:
            return []
        best = max(lines, key=lambda claim: (held[claim], claim[1], claim))
        return [peer for peer in backed if peer.fragment(p) == best]

    def taken_by(self, training: list[ProgressRecord]) -> bool:
        """Whether a claim only we hold is vouched for in the view of the ``training`` peers (``vouched``: each of
        them counts the others and us): it is where one voucher is enough (``state_vouchers`` 1, or one live peer)."""
        return min(self.ctx.cfg.state_vouchers, len(training)) <= 1

    def alone(self, p: int, training: list[ProgressRecord]) -> bool:
        """No live peer holds our replica of fragment ``p``, nor one it descends from (a peer just behind us: its
        record predates the round we merged). Called on the event loop every heartbeat: no tensor copy here."""
        mine = self.ctx.replica.identity(p)
        line = set(self.ctx.replica.ancestors(p))
        return not any(peer.fragment(p) == mine or peer.fragment(p)[2] in line for peer in training)

    def behind(self, p: int) -> bool:
        return bool(self.heavier_peers(p))

    def lonely_claim(self, p: int) -> list[ProgressRecord]:
        """When no live peer holds our replica of fragment ``p`` or one it descends from, and none vouches for a
        heavier one: the holders of the heaviest claim (to download, then check with ``plausible``), at most once
        per ``LONELY_INTERVAL``."""
        if time.monotonic() - self._lonely_at.get(p, -1e9) < LONELY_INTERVAL:
            return []
        mine = self.ctx.replica.identity(p)
        training = self.peers.training()
        heavier_ones = [peer for peer in training
                        if heavier(peer.fragment(p), mine) and peer.fragment(p)[0] <= mine[0] + MAX_LONELY_LEAD
                        and not self.failed_vetting(peer.fragment(p)[2])]
        if not heavier_ones or not self.alone(p, training):
            return []
        best = max(peer.fragment(p) for peer in heavier_ones)
        return [peer for peer in heavier_ones if peer.fragment(p) == best]

    def plausible(self, state: ReplicaState, mine: ReplicaState | None = None) -> str | None:
        """Why a downloaded state nobody vouched for is not taken (see the module's docstring); None if it may be. A
        gross filter, not a proof: such a state's norm must be within a factor ``MAX_NORM_RATIO`` of our replica's
        (the review's all-zero model is not; honest forks, even one far from ours, are), and its outer momentum at
        most ``MOMENTUM_FACTOR`` times ours. ``mine``: our replica's snapshot, if the caller took one."""
        mine = mine or self.ctx.replica.snapshot(state.fragment)
        size, theirs = (float(torch.linalg.vector_norm(t.double())) for t in (mine.params, state.params))
        if not size / MAX_NORM_RATIO <= theirs <= size * MAX_NORM_RATIO:
            return f"its norm is {theirs:.3g}, ours {size:.3g}"
        momentum, ours = (float(torch.linalg.vector_norm(m.double())) for m in (state.momentum, mine.momentum))
        if not momentum <= MOMENTUM_FACTOR * ours + 0.1 * size:
            return f"its outer momentum is {momentum:.3g}, ours {ours:.3g}"
        return None

    def unlike_ours(self, state: ReplicaState) -> str | None:
        """Why a downloaded state some peers vouch for still needs the learner's vetting: it fails ``plausible``,
        or lies farther than ``MAX_VOUCHED_DISTANCE`` from our replica; None if it may be adopted as it is.
        Vouching is only as good as the vouchers: two colluding members vouch for anything they like."""
        snapshot = self.ctx.replica.snapshot(state.fragment)
        problem = self.plausible(state, snapshot)
        if problem is not None:
            return problem
        mine = snapshot.params.double()
        distance = float(torch.linalg.vector_norm(state.params.double() - mine))
        size = float(torch.linalg.vector_norm(mine))
        if distance > MAX_VOUCHED_DISTANCE * size:
            return f"it lies {distance / size if size else math.inf:.3g} of our norm from ours"
        return None

    def failed_vetting(self, digest: str) -> bool:
        """Whether a replica with this digest failed the learner's vetting in the last ``FAILED_VETTING_SECONDS``:
        it is not downloaded again meanwhile (two colluders kept a daemon downloading and evaluating theirs)."""
        at = self._failed.get(digest)
        return at is not None and time.monotonic() - at < FAILED_VETTING_SECONDS

    def take_candidates(self) -> list[ReplicaState]:
        """Downloaded states for the learner to vet (claims nobody vouches for, and vouched ones unlike ours), one
        per fragment at most; thread-safe."""
        with self._lock:
            states, self._candidates = list(self._candidates.values()), {}
            return states

    def candidates_waiting(self) -> bool:
        """Whether a downloaded state waits for the learner's vetting (``take_candidates``); thread-safe."""
        with self._lock:
            return bool(self._candidates)

    def settle(self, state: ReplicaState, passed: bool) -> bool:
        """The learner's verdict on a candidate: adopt it if it ``passed`` (queued for ``take_adopted``), else count
        it (not held against the donor: an honest fork can be worse than ours on our held-out data). True if it
        was adopted (False also when ours became at least as heavy meanwhile). Thread-safe."""
        with self._lock:
            replacing = self._replacing.pop(state.fragment, None)
        if not passed:
            self.ctx.reject("worse_state")
            with self._lock:
                now = time.monotonic()
                self._failed = {d: t for d, t in self._failed.items() if now - t < FAILED_VETTING_SECONDS}
                if len(self._failed) < MAX_FAILED:
                    self._failed[state.digest] = now
            return False
        if not self.ctx.replica.adopt(state, replacing=replacing):
            return False
        self._queue([state])
        return True

    def take_adopted(self) -> list[ReplicaState]:
        """Fragments adopted since the last call (the learner must reload them into θ); thread-safe."""
        with self._lock:
            states, self._adopted = self._adopted, []
            return states

    def _queue(self, states: list[ReplicaState]) -> None:
        for state in states:
            if state.forked:
                self.ctx.counters.forks_healed += 1  # two groups merged from the same version: ours lost
        with self._lock:
            self._adopted.extend(states)

    def maybe_catch_up(self) -> None:
        """Start a download of every fragment a live peer holds a heavier replica of (none while joining)."""
        ctx = self.ctx
        # A paused daemon downloads nothing: it catches up once, by replay, when it resumes (Island.resume).
        if ctx.leaving or ctx.counters.status in (Status.JOINING, Status.PAUSED):
            return
        for p in range(ctx.replica.num_fragments):
            if p in self._downloading or p in ctx.in_round or p in self._candidates:
                continue
            donors, check = donor_order(p, self.heavier_peers(p)), False
            if not donors:
                donors, check = donor_order(p, self.lonely_claim(p)), True
            if donors:
                self._downloading.add(p)
                ctx.spawn(self._catch_up(p, donors, check))

    async def _catch_up(self, p: int, donors: list[ProgressRecord], check: bool = False) -> None:
        """Download fragment ``p`` from ``donors`` and adopt it; ``check``: nobody vouched for it (``plausible``,
        then the learner's vetting). A vouched one is vetted too if it is unlike ours (``unlike_ours``)."""
        try:
            mine = self.ctx.replica.identity(p)
            # ``fork_line``: a fork we are on alone; the swarm's line replaces ours if ours is still ours then.
            replacing = None if heavier(donors[0].fragment(p), mine) else mine[2]
            logger.info("peer %s holds a heavier replica of fragment %d (v%d vs our v%d%s); downloading it",
                        donors[0].peer_id[-8:], p, donors[0].fragment(p)[0], mine[0],
                        "; no live peer holds ours, nobody vouches for it: it will be vetted" if check else
                        f"; no live peer holds ours: it is the swarm's line (weight {donors[0].fragment(p)[1]:.4g} vs "
                        f"our {mine[1]:.4g})" if replacing else "")
            if check:
                self._lonely_at[p] = time.monotonic()
            state = await self._download(p, donors)
            loop = asyncio.get_running_loop()
            problem = await loop.run_in_executor(None, self.plausible, state) if state is not None and check else None
            if problem is not None:
                # Counted, not held against the donor: an honest fork that grew too deep to check looks the same.
                logger.warning("fragment %d: not adopting the v%d replica %s sent, vouched for by nobody: %s", p,
                               state.version, state.donor[-8:], problem)
                self.ctx.reject("implausible_state")
                return
            if state is not None and not check:
                unlike = await loop.run_in_executor(None, self.unlike_ours, state)
                if unlike is not None:
                    logger.warning("fragment %d: the v%d replica its holders vouch for is unlike ours (%s): vetting it "
                                   "on our held-out data first", p, state.version, unlike)
                    check = True
            if state is not None and check:
                with self._lock:
                    self._candidates[p] = state  # the learner vets it (the module's docstring)
                    self._replacing[p] = replacing
            elif state is not None and await loop.run_in_executor(
                    None, lambda: self.ctx.replica.adopt(state, replacing=replacing)):
                self._queue([state])
        finally:
            self._downloading.discard(p)

    async def _download_fragments(self, fragments: list[int], peers: list[ProgressRecord]) -> list[ReplicaState | None]:
        """Download the heaviest replica of each of ``fragments`` at once, spread over the donors holding it (see
        ``donor_order``), and adopt them into the replica; None for a fragment no donor could send."""
        replica = self.ctx.replica

        async def fetch(p: int) -> ReplicaState | None:
            donors = donor_order(p, vouched(p, peers, self.ctx.cfg.state_vouchers))
            if donors and donors[0].fragment(p) == replica.identity(p):
                # We hold that very replica already (a joiner of a young run holds Θ₀ from the shared seed):
                # nothing to download; the donor's record still tells where the sync schedule is.
                held = replica.snapshot(p)
                held.schedule_step, held.donor = donors[0].schedule_step, donors[0].peer_id
                return held
            state = await self._download(p, donors, blame=False)
            if state is not None and not await asyncio.get_running_loop().run_in_executor(None, replica.adopt, state):
                # Not heavier than ours: fine if it is ours (identical), else ours moved on meanwhile.
                return state if state.digest == replica.identity(p)[2] else None
            return state

        return list(await asyncio.gather(*(fetch(p) for p in fragments)))

    async def _download(self, p: int, donors: list[ProgressRecord], blame: bool = True) -> ReplicaState | None:
        """Fragment ``p``'s replica from the first of ``donors`` that delivers one: by replaying the rounds from
        ours when a donor still holds them, else (or when a replay does not check out) in full. Each donor must
        send exactly the replica its record claims (``download_state``'s ``claims``): copying an honest claim into
        one's record makes a member a donor, never a source of anything but that replica.

        A donor counts towards ``_unbacked`` only if it refused to serve the replica it claims and no other donor
        delivered that replica: then the claim itself was not backed. One that did not answer (frozen,
        restarting, gone: an attacker that stalls looks the same, so only vouching bounds it) merely failed. ``blame`` False (joining, restoring): no donor is blamed at all;
        a joiner's concurrent downloads of every fragment fail together while its donors do not know it yet, and
        an unserved claim only delays a join, where it would abort rounds later."""
        claims = {d.peer_id: d.fragment(p) for d in donors}
        failed: list[str] = []
        moved: dict[str, tuple] = {}  # donor -> the heavier replica it said it holds now

        def refused(donor: str, error: BaseException) -> None:
            # A donor that moved on to a heavier replica since its record (a round landed) did not fail its claim.
            if not isinstance(error, DonorRefused):
                return
            if error.holds is not None and heavier(error.holds, claims[donor]):
                moved[donor] = tuple(error.holds)
            else:
                failed.append(donor)

        state = await self._fetch(p, [d.peer_id for d in donors], claims, refused)
        if state is None and moved:
            # Every donor moved on since its record (a fast daemon merges several rounds a heartbeat): a refusal,
            # sent by the donor over its own authenticated stream, is as good as its next record. Its new claim
            # is taken only if it would be vouched for (and heavier than ours) had the records said so.
            fresher = self.fresher_donors(p, moved)
            if fresher:
                claims = {d.peer_id: d.fragment(p) for d in fresher}
                logger.info("fragment %d: %s moved on to v%d since its record; asking for that", p,
                            "+".join(d.peer_id[-8:] for d in fresher), fresher[0].fragment(p)[0])
                state = await self._fetch(p, [d.peer_id for d in fresher], claims, refused)
        delivered = None if state is None else (state.version, state.weight, state.digest)
        known = self.peers.everyone()
        for donor in dict.fromkeys(failed) if blame else ():
            claim = known[donor].fragment(p) if donor in known else None
            if delivered is None or claim != delivered:
                self._unbacked(donor, claim)
        if state is not None:
            self._failures.pop(state.donor, None)
        return state

    def fresher_donors(self, p: int, moved: dict[str, tuple]) -> list[ProgressRecord]:
        """The live peers' records with the claims of ``moved`` (donors that refused, saying which heavier replica
        of fragment ``p`` they hold now) in place of their records' claims: the donors, best first, of a claim
        that is then vouched for and heavier than ours; none if no such claim."""
        training = self.peers.training()
        updated = [peer.copy(update={"fragment_versions": _set(peer.fragment_versions, p, moved[peer.peer_id][0]),
                                     "fragment_weights": _set(peer.fragment_weights, p, moved[peer.peer_id][1]),
                                     "fragment_hashes": _set(peer.fragment_hashes, p, moved[peer.peer_id][2])})
                   if peer.peer_id in moved else peer for peer in training]
        mine = self.ctx.replica.identity(p)
        backed = [peer for peer in vouched(p, updated, self.ctx.cfg.state_vouchers)
                  if peer.peer_id in moved and heavier(peer.fragment(p), mine)]
        return donor_order(p, backed)

    async def _fetch(self, p: int, order: list[str], claims: dict[str, tuple], refused) -> ReplicaState | None:
        """One try of ``order`` for their ``claims`` of fragment ``p`` (a replay first, then in full)."""
        ctx, replica = self.ctx, self.ctx.replica
        timeout = ctx.cfg.run.round_timeout
        with track(f"fragment {p}: downloading the replica", 8 * replica.numel(p)) as bar:
            state = await download_state(self._open_stream, order, p, replica.numel(p), timeout, ctx.stats,
                                         have=replica.identity(p)[2], on_failure=refused, progress=bar.update,
                                         claims=claims, slots=self._slot)
            bar.close(ok=state is not None)
        if isinstance(state, Replay):
            replayed = await asyncio.get_running_loop().run_in_executor(None, replica.replay, state, ctx.outer)
            if replayed is not None:
                return replayed
            if replica.identity(p)[2] == state.rounds[0].base:  # it did not check out: the donor's fault
                ctx.reject("replay", state.donor)
                self._unbacked(state.donor, claims.get(state.donor))
            with track(f"fragment {p}: downloading the replica", 8 * replica.numel(p)) as bar:
                state = await download_state(self._open_stream, order, p, replica.numel(p), timeout, ctx.stats,
                                             on_failure=refused, progress=bar.update, claims=claims,
                                             slots=self._slot)
                bar.close(ok=state is not None)
        return state

    def _unbacked(self, donor: str, claim: tuple | None) -> None:
        """A donor we chose for the replica it claims (``claim``) did not deliver it. ``UNBACKED_OFFENCES`` in a row
        for one claim, the first and the last at least ``RECORD_GRACE`` paces apart, make it an offender: a
        member that claims a heavier replica and never serves it would otherwise keep everyone abandoning their
        rounds to catch up (the review's variant: merges fell from 80 to 0). The grace: an honest donor that moved
        on, even to a lighter replica (it took the swarm's line over its fork), refuses the claim its record still
        shows until its next record is published and read (the local swarm's founder, blamed within a second)."""
        now = self._clock()
        held, failures, since = self._failures.get(donor, (claim, 0, now))
        if held != claim:
            failures, since = 0, now
        failures += 1
        # Paces, not heartbeats: we read the donor's next record at our table's pace (``PeerTable.pace``).
        if failures < UNBACKED_OFFENCES or now - since < RECORD_GRACE * self.peers.pace():
            if len(self._failures) >= MAX_TRACKED_DONORS and donor not in self._failures:
                self._failures.clear()
            self._failures[donor] = (claim, failures, since)
            return
        self._failures.pop(donor, None)
        self.ctx.reject("unbacked_claim", donor)  # an offence: the donor cools down

    async def join(self) -> list[ReplicaState]:
        """Joining: download every fragment's heaviest replica among live peers. Returns the fragments adopted, in
        order, stopping at the first that could not be downloaded."""
        await self.peers.publish()  # donors of a private run serve members only: be one of their peers first
        peers = donors(await self.peers.refresh())
        if not peers:
            return []
        out = []
        for state in await self._download_fragments(list(range(self.ctx.replica.num_fragments)), peers):
            if state is None:
                break
            out.append(state)
        return out

    async def after_restore(self) -> list[ReplicaState]:
        """Returning from a checkpoint: download every fragment a live peer holds a heavier replica of (all at once,
        as a joiner does), so that the daemon does not merge rounds of a replica the swarm has moved past. The
        adopted fragments are queued for the learner."""
        replica = self.ctx.replica
        await self.peers.publish()  # as a joiner does: donors of a private run serve the peers they know
        peers = donors(await self.peers.refresh())
        vouchers = self.ctx.cfg.state_vouchers
        behind = [p for p in range(replica.num_fragments)
                  if any(heavier(peer.fragment(p), replica.identity(p)) for peer in vouched(p, peers, vouchers))]
        states = [s for s in await self._download_fragments(behind, peers) if s is not None]
        self._queue(states)
        return states


def _set(values: list, i: int, value) -> list:
    out = list(values)
    out[i] = value
    return out

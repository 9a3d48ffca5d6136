"""Forming a round through the DHT: registrations, and a group decided by the earliest registrant.

A daemon ready for round (fragment, version) stores a signed registration ``{peer_id, weight, time}`` under the
round's key. A registration counts if its owner is alive (it has a live progress record) and is not known to be
past this version, so a stale registration left by a daemon that has since died or moved on is ignored.

The round's coordinator is the counted registrant whose hash of (round key, peer id) is the lowest: nothing a
member sets steers it (the second review's squatter re-registered with a time that kept it the earliest registrant,
and never decided: every fragment froze). It closes the group when
every peer it expects has registered (the live peers at this version or one behind, i.e. about to arrive), or
— with a minimum quorum K — once K members are in and the grace window since then has passed, or at its
gather deadline; then it publishes the sorted member list under ``<round key>_group`` — several lists when more
than the round-size cap registered (each group all-reduces apart, and then the groups' results are merged:
``sibling_group`` and ``RoundProtocol._merge_siblings``). Everyone else waits for a group
record and uses it verbatim, so all members run the all-reduce with the same list. A daemon left
out of the group (it registered too late) gets an empty list and catches up by download. Every deadline is
counted from the reader's own registration: the coordinator's gather deadline, then turns of ``turn_seconds``
after which a coordinator that has not published (it died, froze, or never decides on purpose) is bypassed and
the next in hash order takes over, at most ``MAX_TURNS`` of them; then the round is skipped and retried at the next
sync point (``form_group`` always ends). A coordinator bypassed ``SILENT_OFFENCES`` rounds in a row is an
offender (``SilentCoordinators``). Registration times are bounded by the reader's clock: older than a
registration's lifetime in the DHT, or more than ``MAX_CLOCK_SKEW`` ahead, is rejected as forged; a registrant's
time is the one the reader first saw (a later one is counted and ignored), and it only orders the dealing of
registrants into groups. Decisions
older than a few gather timeouts are ignored, so a round that was abandoned cannot shut anyone out for good.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from hivemind import DHT
from hivemind.utils import get_dht_time

from .cooldown import Strikes
from . import coordination, dht_io
from .coordination import Decision, Deciders, split_groups
from .nudges import Nudges
# MAX_GROUP and parse_group_record live in records.py (the DHT's validators check group decisions on store); they
# are re-exported here.
from .records import MAX_CLOCK_SKEW, MAX_GROUP, parse_group_record, parse_round_record, round_key, unwrap_subkeys  # noqa: F401

logger = logging.getLogger("atoll")
POLL_INTERVAL = 0.2  # seconds between a registrant's reads of the round's decisions (and the coordinator's of its
# registrations)
REGISTRATIONS_REREAD = 1.0  # seconds between a registrant's reads of the registrations while it waits for a decision
NUDGED_POLL = 1.0  # seconds between reads when registrations and decisions are told (``nudges``): the fallback
SILENT_OFFENCES = 3  # rounds in a row a peer was bypassed as the coordinator before it is an offender


def group_key(run_id: str, fragment: int, version: int, base: str = "") -> str:
    return round_key(run_id, fragment, version, base) + "_group"


@dataclass(frozen=True)
class Round:
    """Which round: of ``fragment`` of run ``run_id``, at ``version``, updating the replica whose digest is ``base``
    (only daemons holding that very replica meet)."""

    run_id: str
    fragment: int
    version: int
    base: str = ""


@dataclass(frozen=True)
class Registrant:
    """This daemon as the round sees it: its peer id, the key that signs its records, the weight it declares,
    and ``started``: the DHT time its process started (a decision made before was made without it)."""

    peer_id: str
    subkey: bytes
    weight: float
    started: float = 0.0


@dataclass(frozen=True)
class Policy:
    """How a round forms. ``quorum=None`` waits for every expected peer (synchronous algorithms); an integer K
    closes the group once K members registered and ``grace()`` seconds passed since (or everyone expected is in).
    More than ``max_group`` registrants are split into several groups (``split_groups``)."""

    gather_timeout: float
    quorum: int | None = None
    grace: Callable[[], float] = lambda: 0.0
    max_group: int = MAX_GROUP
    poll_interval: float = POLL_INTERVAL


class PeerView:
    """The peers as this daemon sees them (the daemon's peer table; this base: a fixed set of live peers, from
    ``live``'s override).

    ``live()`` refreshes and returns ``{peer_id: version}`` of the live training peers (excluding this one).
    Peers this daemon cools down (``protocols/cooldown.py``) or that were revoked are left out of it, so they are
    neither expected nor registered here. ``look_up(peer_ids)``: registrants that ``live`` does not list are looked
    up (a large swarm's table is read in turns: a newcomer may not be in it yet); True when it looked, and ``live``
    is asked again. ``expects(peer)``: whether the coordinator waits for a live peer's registration (not for one
    whose record shows another replica at this version: it meets in another round); its registration, under this
    round's key, counts all the same (the record may be older than the registration). ``shunned(peer)``: members a
    decision must not list for us to follow it (revoked ones: they may not see our part at all)."""

    async def live(self) -> dict[str, int]:
        return {}

    async def look_up(self, peer_ids: set[str]) -> bool:
        return False

    def expects(self, peer_id: str) -> bool:
        return True

    def shunned(self, peer_id: str) -> bool:
        return False


async def form_group(dht: DHT, round: Round, me: Registrant, policy: Policy, peers: PeerView, *,
                     abort: Callable[[], bool] = lambda: False,
                     on_reject: Callable[..., None] = lambda kind, source=None: None,
                     on_decision: Callable[[Decision], None] = lambda decision: None,
                     spent: set[tuple[bytes, float]] | frozenset = frozenset(), nudges: Nudges | None = None,
                     silent: SilentCoordinators | None = None) -> list[str] | None:
    """Register for ``round`` and return its sorted member list (``_form_group``). ``silent``: remembers, across
    rounds, the coordinators this daemon bypassed (``SilentCoordinators``)."""
    watch = _Watch()
    try:
        return await _form_group(dht, round, me, policy, peers, abort=abort, on_reject=on_reject,
                                 on_decision=on_decision, spent=spent, nudges=nudges, watch=watch)
    finally:
        if silent is not None:
            watch.passed.discard(me.peer_id)
            silent.observe(watch, on_reject)


class _Watch:
    """What one daemon saw of a round's coordinators: whose turn passed, who decided."""

    def __init__(self) -> None:
        self.passed: set[str] = set()
        self.decided: set[str] = set()


class SilentCoordinators:
    """Peers this daemon bypassed as a round's coordinator (their turn passed with no decision from them), rounds
    in a row; ``SILENT_OFFENCES`` in a row make an offence (``on_reject("silent_coordinator", peer)``). A decision
    read from a peer starts its count over. An honest coordinator that froze is bypassed too, rarely three rounds
    in a row; cooling it down costs nothing the bypass did not."""

    def __init__(self) -> None:
        self.strikes = Strikes(SILENT_OFFENCES)

    def observe(self, watch: _Watch, on_reject: Callable[..., None]) -> None:
        for peer in watch.decided:
            self.strikes.hit(peer)
        for peer in sorted(watch.passed - watch.decided):
            on_reject("silent_coordinator", None)
            if self.strikes.miss(peer):
                on_reject("silent_coordinator_offence", peer)


async def _form_group(
    dht: DHT,
    round: Round,
    me: Registrant,
    policy: Policy,
    view: PeerView,
    *,
    abort: Callable[[], bool],
    on_reject: Callable[..., None],
    on_decision: Callable[[Decision], None],
    spent: set[tuple[bytes, float]] | frozenset,
    nudges: Nudges | None,
    watch: _Watch,
) -> list[str] | None:
    """Register for the round and return its sorted member list (``Round``, ``Registrant``, ``Policy`` and
    ``PeerView`` say what each of those is).

    Each daemon gets its own group of a split round. Returns None when ``abort()`` becomes true (a heavier replica
    appeared: catch up instead), and an empty list when this daemon is in none of the round's groups or no group
    was decided in time. ``on_reject(kind, source)`` hears of every malformed record, with the key that signed it.
    This daemon never puts a peer ``view.live()`` leaves out (cooled down, revoked) in a group it decides, and a
    decision such a peer signed does not count (``Deciders``: not a registrant). A decision by a registrant we do
    not cool down is followed even if it lists one we do: peers cool an offender down at different moments, and a
    daemon that ignored such decisions missed every round the others' coordinators formed until they too cooled it
    down (the second review's silent reducer and squatter cost most of their merges there: docs/security.md). The
    round runs with the offender in it, as it does for the members that do not cool it down: our reducer leaves
    its part out, and a shard it spoils or withholds is refused or times out, and every member retries without it
    alike.
    ``on_decision(decision)`` hears the round's decision, every group of it (``sibling_group``), and its id.
    ``spent``: ids of this round's decisions not to follow (their all-reduce failed here: ``SpentDecisions``).
    ``nudges``: a registrant tells the live peers that it registered, and the coordinator tells
    the registrants that it decided (``protocols/nudges.py``); each reads when told, and polls only every
    ``NUDGED_POLL`` seconds (and at the coordinator's deadlines) instead of every ``poll_interval``. Without it,
    everyone polls every ``poll_interval``.
    ``me.started``: a decision made earlier was made without us: a daemon restarted mid-round finds its previous
    life's registration listed in it, and following it would run that round's all-reduce again, from reducers that
    answer with their results of the first run — a replica none of the others holds.
    """
    run_id, fragment, version, base = round.run_id, round.fragment, round.version, round.base
    peer_id, subkey, weight, not_before = me.peer_id, me.subkey, me.weight, me.started
    gather_timeout, quorum, grace = policy.gather_timeout, policy.quorum, policy.grace
    max_group, poll_interval = policy.max_group, policy.poll_interval
    live_peers, shunned = view.live, view.shunned
    key, gkey = round_key(run_id, fragment, version, base), group_key(run_id, fragment, version, base)
    now = get_dht_time()
    lifetime = 4 * gather_timeout + 60
    expiration = now + lifetime
    record = {"peer_id": peer_id, "weight": float(weight), "time": float(now)}
    timed_out = lambda kind: on_reject(kind, None)  # noqa: E731
    if not await dht_io.store(dht, key, record, expiration, subkey, on_timeout=timed_out):
        logger.warning("round v%d: could not store registration in the DHT", version)
    quorum_since: float | None = None
    entry, read_at, coordinating, told = None, -float("inf"), True, nudges is None
    first_seen: dict[str, float] = {}  # registrant -> its registration's time as we first read it
    listening = nudges or Nudges()  # without nudges nothing wakes these listeners: the loop sleeps instead
    with listening.listen([key]) as registrations, listening.listen([gkey]) as decisions:
        while True:
            if abort():
                return None
            # The registrations (one per registrant: the round's biggest record) are read at every poll only by the
            # coordinator. The others poll the decision, and read the registrations when one appears (to check it),
            # and every ``REGISTRATIONS_REREAD`` seconds (to see a coordinator that must be bypassed).
            loop = asyncio.get_running_loop()
            if coordinating or loop.time() - read_at >= REGISTRATIONS_REREAD:
                read_at = loop.time()
                entry, group_entry = await asyncio.gather(
                    dht_io.get(dht, key, on_timeout=timed_out), dht_io.get(dht, gkey, on_timeout=timed_out))
            else:
                group_entry = await dht_io.get(dht, gkey, on_timeout=timed_out)
                if unwrap_subkeys(group_entry):
                    read_at = loop.time()
                    entry = await dht_io.get(dht, key, on_timeout=timed_out)
            peers = await live_peers()
            if not told:  # whoever coordinates reads the registrations now, not at its next poll
                told = True
                nudges.tell(list(peers), key)
            unknown = {rec["peer_id"] for rec in map(parse_round_record, unwrap_subkeys(entry).values())
                       if rec is not None and rec["peer_id"] not in peers and rec["peer_id"] != peer_id}
            if unknown and await view.look_up(unknown):
                peers = await live_peers()
            registered: dict[str, float] = {peer_id: now}
            signers: dict[bytes, str] = {subkey: peer_id}  # whose key signed each counted registration
            t = get_dht_time()
            for source, value in unwrap_subkeys(entry).items():
                rec = parse_round_record(value)
                if rec is None:
                    on_reject("round_record", source)
                elif not t - lifetime <= rec["time"] <= t + MAX_CLOCK_SKEW:
                    # Older than any registration still stored could be, or from the future: a forged time (one of
                    # -1e12 made its writer every round's coordinator with a deadline long past: nobody merged).
                    on_reject("round_record_time", source)
                elif rec["peer_id"] in peers and peers[rec["peer_id"]] <= version and source != subkey:
                    first = first_seen.setdefault(rec["peer_id"], rec["time"])
                    if rec["time"] != first:  # re-registered: its first time stands (it cannot move a deadline)
                        on_reject("round_record_changed", None)
                        first_seen[rec["peer_id"]] = rec["time"] = first
                    registered[rec["peer_id"]] = first
                    signers[source] = rec["peer_id"]
            deciders = Deciders(registered, signers, peer_id, now, gather_timeout, max_group, watch.decided)
            decision = coordination.first_decision(group_entry, gather_timeout, on_reject, shunned, not_before,
                                                   deciders, spent, now=get_dht_time())
            if decision is not None:
                on_decision(decision)
                return next((members for members in decision.groups if peer_id in members), [])
            coordinator, deadline = coordination.coordinator(registered, key, t, now, gather_timeout, watch.passed)
            if coordinator is None:
                logger.warning("round v%d: no group was decided in time", version)
                return []
            coordinating = coordinator == peer_id
            if coordinating:
                expected = {p for p, v in peers.items() if version - 1 <= v <= version and view.expects(p)}
                t = get_dht_time()
                close = expected <= set(registered) or t > deadline
                if quorum is not None and len(registered) >= quorum:
                    quorum_since = t if quorum_since is None else quorum_since
                    close = close or t >= quorum_since + grace()
                if close:
                    ours = Decision(split_groups(registered, max_group), subkey, float(get_dht_time()))
                    await dht_io.store(dht, gkey, {"groups": ours.groups, "time": ours.time}, expiration, subkey,
                                       on_timeout=timed_out)
                    if nudges is not None:
                        nudges.tell([p for p in registered if p != peer_id], gkey)
                    # Another registrant whose view of the DHT lacked our registration may have decided first, taking
                    # itself for the coordinator: everyone follows the earliest decision, so we do too.
                    first = coordination.first_decision(await dht_io.get(dht, gkey, on_timeout=timed_out),
                                                        gather_timeout, on_reject, shunned, not_before, deciders,
                                                        spent, now=get_dht_time()) or ours
                    on_decision(first)
                    return next((members for members in first.groups if peer_id in members), [])
            if nudges is None:
                await asyncio.sleep(poll_interval)
            elif coordinating:  # told of registrations; its own deadlines wake it too
                timers = [deadline] + ([quorum_since + grace()] if quorum_since is not None else [])
                await registrations.wait(min([NUDGED_POLL] + [x - get_dht_time() for x in timers]), poll_interval)
            else:
                await decisions.wait(NUDGED_POLL, poll_interval)


"""Who decides a round's groups, and what a decision is (``matchmaking.form_group`` runs the round around them):
registrants take turns as coordinator in an order no member can steer (``coordinator_rank``: a hash of the round's
key and the peer id), each turn ``turn_seconds`` long and at most ``MAX_TURNS`` of them; a coordinator splits the
registrants into groups (``split_groups``; sibling groups merge their results, ``sibling_group``); a decision counts
only from a key that registered and within its turn (``Deciders``), the first valid one wins (``first_decision``),
and one whose all-reduce failed is not followed again (``SpentDecisions``).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


# MAX_GROUP and parse_group_record live in records.py (the DHT's validators check group decisions on store); they
# are re-exported here.
from .records import MAX_CLOCK_SKEW, MAX_GROUP, parse_group_record, unwrap_subkeys

logger = logging.getLogger("atoll")

DECISION_LIFETIME_FACTOR = 3  # a group decision older than this many gather timeouts is stale
MAX_TURNS = 3  # coordinators tried in one round before it is skipped


def split_groups(registered: dict[str, float], max_group: int) -> list[list[str]]:
    """Split the registrants of a round into the fewest groups of at most ``max_group`` members, of sizes that
    differ by at most one. Registrants are dealt in order of registration (time, then peer id), so every group
    gets some of the earliest; each group is sorted (the order the all-reduce uses)."""
    if max_group < 1:
        raise ValueError(f"max_group must be positive, got {max_group}")
    ordered = sorted(registered, key=lambda p: (registered[p], p))
    count = -(-len(ordered) // max_group)
    return [sorted(ordered[i::count]) for i in range(count)]


def sibling_group(groups: list[list[str]], peer_id: str) -> list[str] | None:
    """Who ``peer_id`` merges the groups' results with, when a round was split into several groups (``split_groups``):
    the member at its own position in every group, in the groups' order (the order every sibling group sums in,
    so that all of them compute the same merge). None if the round has one group, or if ``peer_id`` is at a
    position some group does not reach (groups differ in size by one at most): its group's result stays lighter
    than the merge, which it then adopts by download like a replica of a fork."""
    mine = next((members for members in groups if peer_id in members), None)
    if mine is None or len(groups) < 2:
        return None
    position = mine.index(peer_id)
    if position >= min(len(members) for members in groups):
        return None
    return [members[position] for members in groups]


@dataclass(frozen=True)
class Decision:
    """A round's group decision as one daemon followed it: the groups, and who signed it when (its identity)."""

    groups: list[list[str]]
    signer: bytes
    time: float

    @property
    def id(self) -> tuple[bytes, float]:
        return self.signer, self.time


class SpentDecisions:
    """Per round (fragment, version, replica), the decisions whose all-reduce failed for this daemon (a member
    refused the group, a reducer failed): a round retried at that version does not follow them again. The
    decision stays valid for a while after its all-reduce failed, and stays the earliest: followed again, it
    repeats the failure. A member that refuses every group it is put in (the second review's squatter) kept honest
    daemons on one stale decision a dozen times a fragment, even after they had cooled it down. Only a failed
    all-reduce spends a decision: a daemon a decision left out still follows it (it is left out alike), or in a
    synchronous round it would decide a group of its own with peers that moved on. A synchronous round spends only
    a decision a member disowned (a reducer past the round refused it), which nobody completed, and only when no
    vouched line is there to catch up to: after any other failure the members whose all-reduce completed moved on,
    and a new group of those whose all-reduce failed would fork from them. Bounded: the last ``MAX_ROUNDS`` rounds."""

    MAX_ROUNDS = 256

    def __init__(self) -> None:
        self._by_round: dict[Any, set[tuple[bytes, float]]] = {}

    def of(self, round_id: Any) -> set[tuple[bytes, float]]:
        """The ids (``Decision.id``) of round ``round_id``'s spent decisions (a set the caller adds to)."""
        if round_id not in self._by_round and len(self._by_round) >= self.MAX_ROUNDS:
            del self._by_round[next(iter(self._by_round))]  # the oldest round first (dicts keep insertion order)
        return self._by_round.setdefault(round_id, set())


def coordinator_rank(key: str, peer_id: str) -> bytes:
    """A registrant's place in a round's order of coordinators: a hash of the round's key and its peer id."""
    return hashlib.sha256(f"{key}|{peer_id}".encode()).digest()


def turn_seconds(gather_timeout: float) -> float:
    """How long a coordinator has, past the gather deadline (or past its predecessor's turn), to publish."""
    return gather_timeout / 2 + 2


def coordinator(registered: dict[str, float], key: str, now: float, start: float, gather_timeout: float,
                 passed: set[str] | None = None) -> tuple[str | None, float]:
    """The round's coordinator at ``now`` and its deadline to close the group, as a daemon that registered at
    ``start`` sees it: registrants in hash order (``coordinator_rank``), the first until ``start`` + the gather
    timeout + a turn (``turn_seconds``), each next one a turn more (its deadline already past: it closes at once),
    at most ``MAX_TURNS``; (None, deadline) once they all had theirs: the round is skipped. The peers whose turn
    ended are added to ``passed``."""
    turn = turn_seconds(gather_timeout)
    order = sorted(registered, key=lambda p: coordinator_rank(key, p))[:MAX_TURNS]
    for i, p in enumerate(order):
        if now <= start + gather_timeout + (i + 1) * turn:
            return p, start + gather_timeout + i * turn
        if passed is not None:
            passed.add(p)
    return None, start + gather_timeout


class Deciders:
    """Who may decide a round, as this daemon sees its registrations: a decision counts only if the key that signed
    it also signed a counted registration (a member cannot decide rounds it did not register for), it lists its
    writer, it was made between that registration and the writer's gather deadline (a registration back-dated to
    become the coordinator cannot decide), and it does not leave out this daemon although it registered well
    before, and it splits its registrants as ``split_groups`` does (a member cannot impose singleton or fake groups
    on the others). A decision that fails is ignored, counted, and bypassed like a coordinator that never decided;
    its writer is an offender only for what no honest coordinator writes (``HONEST_NEVER``)."""

    def __init__(self, registered: dict[str, float], signers: dict[bytes, str], peer_id: str, since: float,
                 gather_timeout: float, max_group: int = MAX_GROUP, decided: set[str] | None = None) -> None:
        self.registered, self.signers, self.peer_id, self.since = registered, signers, peer_id, since
        self.gather_timeout, self.max_group = gather_timeout, max_group
        self.decided = decided if decided is not None else set()  # writers of the decisions that counted

    def problem(self, source: bytes, groups: list[list[str]], decided_at: float) -> str | None:
        """Why the decision signed by ``source`` does not count; None if it does."""
        writer = self.signers.get(source)
        if writer is None:
            return "group_record_signer"  # no counted registration of its key: not a registrant of this round
        if writer == self.peer_id:
            return None
        if not any(writer in members for members in groups):
            return "group_record_writer"
        sizes = [len(members) for members in groups]
        if len(groups) != -(-sum(sizes) // self.max_group) or max(sizes) - min(sizes) > 1:
            return "group_record_split"  # not how ``split_groups`` splits: singleton groups imposed, say
        registered_at = self.registered[writer]
        # A coordinator decides by its gather deadline, or (taking over from one that did not) by the end of its
        # turn in ``coordinator``; the rest is slack for slow reads.
        latest = registered_at + self.gather_timeout + MAX_TURNS * turn_seconds(self.gather_timeout) + 5
        if not registered_at - MAX_CLOCK_SKEW <= decided_at <= latest:
            return "group_record_time"
        if (decided_at > self.since + OMISSION_GRACE
                and not any(self.peer_id in members for members in groups)):
            return "group_record_omission"
        return None


OMISSION_GRACE = 5.0  # seconds after our registration within which a decision may not have seen it yet
HONEST_NEVER = ("group_record_writer", "group_record_split")  # what no honest coordinator writes: offences


def first_decision(group_entry: Any, gather_timeout: float, on_reject: Callable[..., None],
                   shunned: Callable[[str], bool], not_before: float = 0.0, deciders: Deciders | None = None,
                   spent: set[tuple[bytes, float]] | frozenset = frozenset(), *, now: float) -> Decision | None:
    """The earliest valid, recent group decision of a round (the one every daemon follows), or None, at DHT time
    ``now``. With ``deciders``, only decisions by one of the round's registrants count (see ``Deciders``); none in
    ``spent``."""
    decisions = []
    stale_before = max(now - DECISION_LIFETIME_FACTOR * gather_timeout, not_before)
    for source, value in unwrap_subkeys(group_entry).items():
        groups = parse_group_record(value)
        if groups is None:
            on_reject("group_record", source)
        elif any(shunned(m) for members in groups for m in members):
            continue
        elif not isinstance(value["time"], float) or (source, value["time"]) in spent:
            continue  # spent: its all-reduce failed here (``SpentDecisions``)
        elif value["time"] >= stale_before:
            # An older decision belongs to a round that ended (or never ran) long ago: ignore it, or a daemon left
            # out of it would be shut out of this version forever.
            problem = deciders.problem(source, groups, value["time"]) if deciders is not None else None
            if problem is None:
                decisions.append(Decision(groups, source, value["time"]))
                if deciders is not None and source in deciders.signers:
                    deciders.decided.add(deciders.signers[source])
            elif problem != "group_record_signer":  # a registration we do not see yet is no offence
                # A late decision or one that missed us is counted, not held against its writer: an honest
                # coordinator that was frozen, or read the registrations slowly, writes one too.
                on_reject(problem, source if problem in HONEST_NEVER else None)
    return min(decisions, key=lambda d: (d.time, d.groups)) if decisions else None

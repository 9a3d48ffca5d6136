"""A round retried at its version does not follow again a decision whose all-reduce failed here
(``SpentDecisions``); a synchronous round only one a member disowned. A daemon a decision left out keeps following
it (synchronous rounds depend on it)."""

import asyncio
from types import SimpleNamespace

import torch

from atoll.node.rounds import round_protocol
from atoll.node.rounds.contribution import Contribution
from atoll.node.rounds.round_protocol import Outcome, Reduced, RoundProtocol
from atoll.protocols.averaging import HONEST
from atoll.protocols.coordination import Decision, SpentDecisions


def _rounds(monkeypatch, decision, allreduce_result, quorum=True, disowned=False, behind=False):
    """A RoundProtocol whose ``form_group`` follows ``decision`` (recording the ``spent`` set it was given) and whose
    all-reduce returns ``allreduce_result`` (``disowned``: a member refused the group as decided)."""
    seen_spent = []

    async def form_group(dht, round, me, policy, peers, *, on_decision, spent, **kwargs):
        seen_spent.append(set(spent))
        on_decision(decision)
        return next((members for members in decision.groups if me.peer_id in members), [])

    monkeypatch.setattr(round_protocol, "form_group", form_group)
    rounds = RoundProtocol.__new__(RoundProtocol)
    run = SimpleNamespace(quorum=1, gather_timeout=5.0, max_group=8, compression="none", error_feedback=False,
                          round_timeout=5.0, rda=False, join_window=False)
    faults = SimpleNamespace(group_formed=lambda *a: None, tamper=lambda *a: HONEST, round_ended=lambda *a: None)
    rounds.ctx = SimpleNamespace(
        cfg=SimpleNamespace(run=run), algorithm=SimpleNamespace(joins_open_rounds=False, quorum=quorum, rda=False),
        in_round=set(), spawn=lambda coro: coro.close(), dht=None, max_weight=0.0, namespace=lambda: "run", peer_id="a",
        subkey=b"a", reject=lambda *a: None, faults=faults, counters=SimpleNamespace(step_time=0.1, rounds_done=0))
    rounds.fragments, rounds.started_at = [SimpleNamespace(has_embedding=False)], 0.0
    rounds.catch_up = SimpleNamespace(behind=lambda p: behind, maybe_catch_up=lambda: None)

    async def publish():
        return None

    followed = []
    rounds.peers = SimpleNamespace(publish=publish, follow=followed.append, refresh=None, look_up=None,
                                   revoked=lambda peer: False)
    rounds.spent, rounds.silent, rounds.nudges = SpentDecisions(), None, None
    rounds._last_round, rounds._announced = {}, {}
    rounds.quorum_time = SimpleNamespace(update=lambda v: None)
    rounds.grace = lambda: 0.0

    async def allreduce(*args, **kwargs):
        return Reduced(allreduce_result, ["a", "b"], disowned)

    rounds.allreduce = allreduce
    return rounds, seen_spent, followed


def _round(rounds):
    return asyncio.run(rounds.run(0, Contribution.ready(torch.zeros(4), 1.0), (7, "D"))).kind


def test_a_decision_whose_allreduce_failed_is_not_followed_at_the_retry(monkeypatch):
    decision = Decision([["a", "b"]], b"b", 100.0)
    rounds, seen_spent, _ = _rounds(monkeypatch, decision, None)
    assert _round(rounds) is Outcome.FAILED
    assert _round(rounds) is Outcome.FAILED
    assert seen_spent == [set(), {(b"b", 100.0)}]  # the retry at v7 is told not to follow b's decision again
    assert rounds.spent.of((0, 8, "D")) == set()  # a later version of the fragment is another round


def test_a_daemon_left_out_of_a_decision_keeps_following_it(monkeypatch):
    """A synchronous round's late joiner that a decision left out follows it again at its retry (it is left out
    alike, and follows the members to catch up): deciding a group of its own would list peers that moved on."""
    decision = Decision([["b", "c"]], b"b", 100.0)
    rounds, seen_spent, followed = _rounds(monkeypatch, decision, None)
    assert _round(rounds) is Outcome.FAILED
    assert _round(rounds) is Outcome.FAILED
    assert seen_spent == [set(), set()] and followed == [["b", "c"], ["b", "c"]]


def test_a_synchronous_round_follows_its_failed_decision_again(monkeypatch):
    """diloco and streaming: the members whose all-reduce completed moved on; a new group of those whose all-reduce
    failed would fork from them, so the decision is followed again (the others catch up to those that moved on)."""
    decision = Decision([["a", "b"]], b"b", 100.0)
    rounds, seen_spent, _ = _rounds(monkeypatch, decision, None, quorum=False)
    assert _round(rounds) is Outcome.FAILED
    assert _round(rounds) is Outcome.FAILED
    assert seen_spent == [set(), set()]


def test_a_synchronous_round_does_not_follow_again_a_decision_a_member_disowned(monkeypatch):
    """A swarm back from a restart: a decision listed the founder, which had merged that version alone by its own
    decision and refused the group as a round it had moved past. Followed again, the decision failed again at once,
    round after round until it was stale, while the founder ran on alone. A decision a member disowned completes
    for nobody: with no vouched line to catch up to, it is spent in a synchronous round too, and the round at that
    version decides anew. With one (members that moved past it hold a line others vouch for), the daemon catches
    up instead: a new group without them would fork from them."""
    decision = Decision([["a", "b"]], b"a", 100.0)
    rounds, seen_spent, _ = _rounds(monkeypatch, decision, None, quorum=False, disowned=True)
    assert _round(rounds) is Outcome.FAILED
    assert _round(rounds) is Outcome.FAILED
    assert seen_spent == [set(), {(b"a", 100.0)}]
    rounds, seen_spent, _ = _rounds(monkeypatch, decision, None, quorum=False, disowned=True, behind=True)
    assert _round(rounds) is Outcome.BEHIND
    assert _round(rounds) is Outcome.BEHIND
    assert seen_spent == [set(), set()]

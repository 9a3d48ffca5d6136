"""A member that refuses the groups it is put in: counted each time, an offender after ``REFUSAL_OFFENCES`` in a
row; a round it answered in starts its count over. (The second review's squatter registered for every round and
refused every group: each round with it skipped.) No sockets: the all-reduce is a stand-in."""

import asyncio
from types import SimpleNamespace

import pytest
import torch

from atoll.node.rounds import round_protocol
from atoll.node.rounds.round_protocol import REFUSAL_OFFENCES, RoundProtocol
from atoll.protocols.averaging import AllreduceResult


def _protocol(outcomes, rejected):
    ctx = SimpleNamespace(cfg=SimpleNamespace(run_id="run", client_mode=False,
                                              run=SimpleNamespace(codec_block=4, robust_merge="clip",
                                                                  round_timeout=5.0)),
                          peer_id="me", p2p=None, reject=lambda kind, source=None: rejected.append((kind, source)),
                          cooldown=SimpleNamespace(active=lambda peer: False))
    rounds = RoundProtocol(ctx, peers=SimpleNamespace(everyone=lambda: {}, revoked=lambda peer: False), catch_up=None,
                           fragments=[])
    rounds.averager = None
    return rounds


def test_a_member_refusing_groups_in_a_row_is_an_offender(monkeypatch):
    rejected, outcomes = [], []

    async def stand_in(p2p, servicer, spec, me, tensor, weight, timeout, tamper):
        refuse = outcomes.pop(0)
        if refuse:
            return AllreduceResult(None, 0.0, [], [], ["squatter"])
        return AllreduceResult(tensor, weight, list(spec.members), [])

    monkeypatch.setattr(round_protocol, "allreduce", stand_in)
    rounds = _protocol(outcomes, rejected)

    versions = iter(range(1, 100))

    def round_(refuse: bool):  # each round at the next version: a group of its own
        outcomes.append(refuse)
        result, _, _ = asyncio.run(rounds.allreduce(0, next(versions), ["me", "squatter"], torch.zeros(4), 1.0, "mean",
                                                 "none"))
        return result

    for _ in range(REFUSAL_OFFENCES - 1):
        assert round_(True) is None
    assert round_(False) is not None  # it answered one: the count starts over
    for _ in range(REFUSAL_OFFENCES - 1):
        round_(True)
    assert ("group_refusal_offence", "squatter") not in rejected
    round_(True)
    assert rejected.count(("group_refusal_offence", "squatter")) == 1
    assert rejected.count(("group_refusal", None)) == 2 * REFUSAL_OFFENCES - 1


def test_a_refusal_of_a_retried_group_is_no_strike(monkeypatch):
    """A retry's group is the decided one less the reducers that failed for this member; honest members that saw
    different reducers fail retry with different groups and refuse each other's. Those refusals are counted, never
    struck: only the decided group's (the first attempt's) are."""
    rejected, outcomes = [], []

    async def stand_in(p2p, servicer, spec, me, tensor, weight, timeout, tamper):
        if spec.attempt == 0:
            return AllreduceResult(None, 0.0, [], ["slow"], [])  # a reducer failed for us: retry without it
        return AllreduceResult(None, 0.0, [], [], ["other"])  # which "other" saw differently: it refuses ours

    monkeypatch.setattr(round_protocol, "allreduce", stand_in)
    rounds = _protocol(outcomes, rejected)
    for _ in range(3 * REFUSAL_OFFENCES):
        result, _, _ = asyncio.run(rounds.allreduce(0, 1, ["me", "other", "slow"], torch.zeros(4), 1.0, "mean", "none"))
        assert result is None
    assert rejected.count(("group_refusal", None)) == 3 * REFUSAL_OFFENCES
    assert not [r for r in rejected if r[0] == "group_refusal_offence"]


def test_a_decided_group_refused_again_is_one_strike(monkeypatch):
    """A synchronous round follows a failed decision again; a member that refused its group refuses it again. That
    is one refusal of one group, however often it is repeated: one strike, no offence."""
    rejected = []

    async def stand_in(p2p, servicer, spec, me, tensor, weight, timeout, tamper):
        return AllreduceResult(None, 0.0, [], [], ["other"])

    monkeypatch.setattr(round_protocol, "allreduce", stand_in)
    rounds = _protocol([], rejected)
    for _ in range(3 * REFUSAL_OFFENCES):
        result, _, _ = asyncio.run(rounds.allreduce(0, 7, ["me", "other"], torch.zeros(4), 1.0, "mean", "none"))
        assert result is None
    assert rejected.count(("group_refusal", None)) == 3 * REFUSAL_OFFENCES
    assert not [r for r in rejected if r[0] == "group_refusal_offence"]
    # the same member refusing groups of other rounds: those strike
    for version in range(8, 8 + REFUSAL_OFFENCES - 1):
        asyncio.run(rounds.allreduce(0, version, ["me", "other"], torch.zeros(4), 1.0, "mean", "none"))
    assert rejected.count(("group_refusal_offence", "other")) == 1


def _round_ctx(quorum: bool, rejected):
    """What ``RoundProtocol.run`` reads of its context, for a round of one fragment on a 4-value replica."""
    from atoll.node.algorithm import ALGORITHMS, AlgorithmName

    algorithm = ALGORITHMS[AlgorithmName.DECOUPLED if quorum else AlgorithmName.DILOCO]
    run = SimpleNamespace(codec_block=4, robust_merge="clip", round_timeout=5.0, gather_timeout=5.0, quorum=2,
                          max_group=16, compression="none", error_feedback=False, rda=False, grace_gamma=0.0,
                          overlap=0, join_window=False, sync_every=10)
    return SimpleNamespace(
        cfg=SimpleNamespace(run_id="run", client_mode=False, run=run), algorithm=algorithm, peer_id="me", subkey=b"me",
        p2p=None, dht=None, reject=lambda kind, source=None: rejected.append((kind, source)), in_round=set(),
        spawn=lambda coro: coro.close(), namespace=lambda: "run", max_weight=0.0,
        counters=SimpleNamespace(step_time=0.01, rounds_done=0),
        faults=SimpleNamespace(group_formed=lambda *a: None, tamper=lambda *a: round_protocol.HONEST,
                               round_ended=lambda *a: None),
        cooldown=SimpleNamespace(active=lambda peer: False))


@pytest.mark.parametrize("quorum", [False, True])
def test_a_decision_a_member_disowned_is_not_followed_again(monkeypatch, quorum):
    """Twelve DiLoCo daemons back from a restart: a decision listed the founder, which had merged that version alone
    by its own decision and refused the group as one it did not know. A synchronous round follows a failed decision
    again (its completed members moved on), so the others re-followed this one, failing at once, for a minute until
    it was stale. A disowned decision completed for nobody: it is spent, and the next round at that version needs a
    new one. A decision whose all-reduce failed otherwise is still followed again in a synchronous round."""
    from atoll.node.rounds.contribution import Contribution
    from atoll.protocols.coordination import Decision

    rejected, seen_spent = [], []
    decision = Decision([["founder", "me"]], b"other", 100.0)
    refuse = {"now": True}

    async def form_group(dht, round, me, policy, view, *, on_decision, spent, **kwargs):
        seen_spent.append(set(spent))
        on_decision(decision)
        return ["founder", "me"]

    async def stand_in(p2p, servicer, spec, me, tensor, weight, timeout, tamper):
        if refuse["now"]:
            return AllreduceResult(None, 0.0, [], [], ["founder"])  # "unknown group"
        return AllreduceResult(None, 0.0, [], ["founder"], [])  # its shard timed out: retried, then given up

    monkeypatch.setattr(round_protocol, "form_group", form_group)
    monkeypatch.setattr(round_protocol, "allreduce", stand_in)
    rounds = RoundProtocol(_round_ctx(quorum, rejected),
                           peers=SimpleNamespace(everyone=lambda: {}, revoked=lambda peer: False,
                                                 publish=lambda: asyncio.sleep(0)),
                           catch_up=SimpleNamespace(behind=lambda p: False), fragments=[SimpleNamespace()])

    def round_at_v7():
        outcome = asyncio.run(rounds.run(0, Contribution.ready(torch.zeros(4), 1.0), (7, "D")))
        assert outcome.kind is round_protocol.Outcome.FAILED

    round_at_v7()
    round_at_v7()
    assert seen_spent == [set(), {decision.id}]
    # A decision whose all-reduce failed otherwise (a reducer timed out, for us at least): a synchronous round
    # follows it again, a decoupled one does not.
    decision = Decision([["founder", "me"]], b"other", 101.0)
    refuse["now"] = False
    round_at_v7()
    round_at_v7()
    assert (decision.id in seen_spent[-1]) is quorum

"""A member that refuses the groups it is put in: counted each time, an offender after ``REFUSAL_OFFENCES`` in a
row; a round it answered in starts its count over. (The second review's squatter registered for every round and
refused every group: each round with it skipped.) No sockets: the all-reduce is a stand-in."""

import asyncio
from types import SimpleNamespace

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
        result, _, _ = asyncio.run(rounds.allreduce(0, next(versions), ["me", "squatter"], torch.zeros(4), 1.0,
                                                    "mean", "none"))
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
        result, _, disowned = asyncio.run(rounds.allreduce(0, 1, ["me", "other", "slow"], torch.zeros(4), 1.0, "mean",
                                                           "none"))
        assert result is None and not disowned  # the decided group itself was answered: not disowned
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
        result, _, disowned = asyncio.run(rounds.allreduce(0, 7, ["me", "other"], torch.zeros(4), 1.0, "mean", "none"))
        # Refused, but not as a round it moved past: it may be refusing us alone (cooling us down, out of waiting
        # slots) while the others complete the group.
        assert result is None and not disowned
    assert rejected.count(("group_refusal", None)) == 3 * REFUSAL_OFFENCES
    assert not [r for r in rejected if r[0] == "group_refusal_offence"]
    # the same member refusing groups of other rounds: those strike
    for version in range(8, 8 + REFUSAL_OFFENCES - 1):
        asyncio.run(rounds.allreduce(0, version, ["me", "other"], torch.zeros(4), 1.0, "mean", "none"))
    assert rejected.count(("group_refusal_offence", "other")) == 1


def test_a_decided_group_refused_by_a_reducer_past_its_round_is_disowned(monkeypatch):
    """A reducer that merged the round's version by another group refuses ours at once and never opens it: the
    decided group completes for nobody (``Reduced.disowned``). A retry's refusal disowns nothing."""

    async def stand_in(p2p, servicer, spec, me, tensor, weight, timeout, tamper):
        if spec.attempt == 0 and spec.members == ("me", "other", "slow"):
            return AllreduceResult(None, 0.0, [], ["slow"], [])
        return AllreduceResult(None, 0.0, [], [], ["other"], moved_past=["other"])

    monkeypatch.setattr(round_protocol, "allreduce", stand_in)
    rounds = _protocol([], [])
    assert asyncio.run(rounds.allreduce(0, 7, ["me", "other"], torch.zeros(4), 1.0, "mean", "none")).disowned
    assert not asyncio.run(rounds.allreduce(0, 7, ["me", "other", "slow"], torch.zeros(4), 1.0, "mean",
                                            "none")).disowned

"""The fault injector's schedules, as the product's hooks see them (no sockets, no processes killed)."""

import pytest
import torch

from atoll.node.faults import CORRUPTIONS, Corrupted, Faults, Hostile, Scaled, parse_faults
from atoll.protocols.averaging import HONEST


def test_parse_types_values_and_rejects_unknown_ones():
    assert parse_faults(["slow_checkpoint=0.5", "byzantine=nan", "byzantine_from=3"]) == {
        "slow_checkpoint": 0.5, "byzantine": "nan", "byzantine_from": 3}
    for bad in ("nope=1", "kill_in_round=", "kill_in_round=x", "byzantine=evil"):
        with pytest.raises(ValueError):
            parse_faults([bad])
    with pytest.raises(ValueError, match="step_delay is a harness setting, not a fault: --harness step_delay=0.5"):
        parse_faults(["step_delay=0.5"])


def test_no_faults_means_every_hook_is_a_no_op():
    faults = Faults()
    assert faults.tamper(4, 0, 0) is HONEST
    assert faults.namespace("run", 0) == "run" and faults.checkpoint_interrupt(1) is None
    faults.group_formed(0, 0)  # would SIGKILL the test run if it did anything


def test_corrupt_kinds_advance_only_when_a_completed_round_carried_them():
    faults = Faults(["corrupt_round=2"])
    assert faults.tamper(1, 0, 0) is HONEST  # a solo round sends nothing and is not counted
    assert faults.tamper(3, 0, 0) is HONEST  # the first multi-member round: before corrupt_round
    sent = []
    while True:
        tamper = faults.tamper(3, 0, 0)
        if tamper is HONEST:
            break
        assert isinstance(tamper, Corrupted)
        sent.append(tamper.kind)
        refused = len(sent) % 3 == 0  # every third round is refused by the group: its kind is sent again
        faults.round_ended(tamper, completed=not refused)
    delivered = [k for i, k in enumerate(sent) if (i + 1) % 3]
    assert delivered == list(CORRUPTIONS) * 2  # every kind twice, a refused round's kind again at once
    assert sent[2] == sent[3]
    assert faults.corrupt_delivered == 2 * len(CORRUPTIONS)


def test_byzantine_from_its_nth_multi_member_round_and_scale_undone_for_error_feedback():
    faults = Faults(["byzantine=scale", "byzantine_from=2"])
    assert faults.tamper(2, 0, 0) is HONEST
    tamper = faults.tamper(2, 0, 1)
    assert isinstance(tamper, Scaled)
    delta = torch.randn(10)
    assert torch.allclose(tamper.own(tamper.delta(delta)), delta) and torch.equal(tamper.delta(delta), delta * 1000)
    assert isinstance(Faults(["byzantine=shape"]).tamper(2, 0, 0), Hostile)


def test_split_side_until_its_step():
    faults = Faults(["split_side=1", "split_until=50"])
    assert faults.namespace("run", 49) == "run-side1" and faults.namespace("run", 50) == "run"
    with pytest.raises(ValueError, match="split_side must be 0 to 3"):
        Faults(["split_side=4"])


def test_checkpoint_kill_at_its_number_only():
    faults = Faults(["kill_in_checkpoint=2"])
    assert faults.checkpoint_interrupt(1) is None and callable(faults.checkpoint_interrupt(2))


def test_a_hostile_reducer_answers_with_its_shard_scaled_or_not_at_all():
    import asyncio

    import torch

    from atoll.node.faults import REDUCER_SCALE, SilentAnswer
    from atoll.protocols import codecs
    from atoll.protocols.reducer import Answer, GroupSpec

    assert parse_faults(["reducer=silent"]) == {"reducer": "silent"}
    with pytest.raises(ValueError, match="unknown reducer kind"):
        parse_faults(["reducer=loud"])
    assert type(Faults().answer()) is Answer  # honest
    spec = GroupSpec("run", 0, 1, 0, ("a", "b"), 8, codec="none")
    shard = codecs.encode(torch.arange(8.0), "none")
    scaled = asyncio.run(Faults(["reducer=scale"]).answer().payload(shard, spec, 1.0))
    assert torch.equal(codecs.decode(scaled), torch.arange(8.0) * REDUCER_SCALE)
    assert isinstance(Faults(["reducer=silent"]).answer(), SilentAnswer)

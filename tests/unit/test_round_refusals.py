"""A member that refuses our group is counted, not cooled down (honest views of a group disagree under faults)."""

from types import SimpleNamespace

from atoll.node.round_protocol import RoundProtocol
from atoll.protocols.cooldown import Cooldown
from atoll.protocols.stats import TrafficStats


def test_refusals_are_counted_and_not_held_against_the_refuser():
    stats, cooldown = TrafficStats(), Cooldown(60.0)
    stats.on_offence = lambda source, kind: cooldown.offend(source, kind)
    rounds = RoundProtocol.__new__(RoundProtocol)  # only the refusal bookkeeping is under test
    rounds.ctx = SimpleNamespace(reject=stats.reject)
    for _ in range(3):
        rounds._refused(["m"])
    assert stats.rejected_by_kind == {"group_refusal": 3} and not cooldown.active("m")

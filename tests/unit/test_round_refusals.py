"""A member that refuses our group is counted, not cooled down (honest views of a group disagree under faults),
until it has refused ``REFUSAL_OFFENCES`` groups in a row (``tests/unit/test_group_refusals.py``)."""

from types import SimpleNamespace

from atoll.node.rounds.round_protocol import REFUSAL_OFFENCES, RoundProtocol
from atoll.protocols.cooldown import Cooldown, Strikes
from atoll.protocols.stats import TrafficStats


def test_refusals_are_counted_and_not_held_against_the_refuser():
    stats, cooldown = TrafficStats(), Cooldown(60.0)
    stats.on_offence = lambda source, kind: cooldown.offend(source, kind)
    rounds = RoundProtocol.__new__(RoundProtocol)  # only the refusal bookkeeping is under test
    rounds.ctx = SimpleNamespace(reject=stats.reject)
    rounds.refusals = Strikes(REFUSAL_OFFENCES)
    for i in range(REFUSAL_OFFENCES - 1):
        rounds._refused(["m"], f"group {i}")
    assert stats.rejected_by_kind == {"group_refusal": REFUSAL_OFFENCES - 1} and not cooldown.active("m")

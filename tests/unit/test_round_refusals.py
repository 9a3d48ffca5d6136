"""A member that refuses every group it is put in becomes an offender; one disagreement is forgiven."""

from types import SimpleNamespace

from atoll.node.round_protocol import REFUSALS_OFFENCE, RoundProtocol
from atoll.protocols.cooldown import Cooldown
from atoll.protocols.stats import TrafficStats


def protocol():
    stats, cooldown = TrafficStats(), Cooldown(60.0)
    stats.on_offence = lambda source, kind: cooldown.offend(source, kind)
    rounds = RoundProtocol.__new__(RoundProtocol)  # only the refusal bookkeeping is under test
    rounds.ctx, rounds._refusals = SimpleNamespace(reject=stats.reject), {}
    return rounds, stats, cooldown


def test_refusing_rounds_in_a_row_is_an_offence():
    rounds, stats, cooldown = protocol()
    for _ in range(REFUSALS_OFFENCE - 1):
        rounds._refused(["m", "h"])
    assert not cooldown.active("m") and stats.rejected == 0
    rounds._refusals.pop("h")  # h merged a round with us in between (as ``allreduce`` does on success)
    rounds._refused(["m"])
    assert cooldown.active("m") and not cooldown.active("h")
    assert stats.rejected_by_kind == {"group_refusal": 1}

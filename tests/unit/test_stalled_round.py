"""A daemon whose event loop stopped during its all-reduce (frozen, starved) does not merge that attempt: the other
members may have left its reducer out and merged without it, while every other shard still answered it."""

import time
from types import SimpleNamespace

from atoll.node.rounds.round_protocol import RoundProtocol
from atoll.protocols.averaging import ANSWER_GRACE


def _rounds(loop_due, gap_ended=float("-inf")):
    rounds = RoundProtocol.__new__(RoundProtocol)  # only the stall check is under test
    rounds.ctx = SimpleNamespace(loop_due=loop_due, gap_ended=gap_ended)
    return rounds


def test_a_loop_that_kept_running_merges():
    now = time.monotonic()
    assert not _rounds(now + 0.5)._stalled_since(now - 3)
    assert not _rounds(0.0)._stalled_since(now - 3)  # the stall watch has not started: nothing to say
    assert not _rounds(now, gap_ended=now - 10)._stalled_since(now - 3)  # a gap before the round


def test_a_gap_during_the_round_or_not_yet_seen_by_the_watch_does_not():
    now = time.monotonic()
    assert _rounds(now + 0.5, gap_ended=now - 1)._stalled_since(now - 3)  # the watch saw it
    assert _rounds(now - ANSWER_GRACE - 0.5)._stalled_since(now - 3)  # thawed just now, the watch not yet run

"""The check of a synchronous daemon's round cadence against its heartbeat (``node/rounds/rounds.records_lag``)."""

import pytest

from atoll.node.rounds.rounds import records_lag


def test_rounds_slower_than_the_heartbeat_see_peers_at_most_a_version_behind():
    # 500 steps of 0.2 s: a round every 100 s, a record every 2 s.
    assert records_lag(0.2, 500, 2.0) == pytest.approx(0.02)


def test_rounds_faster_than_the_heartbeat_lag_by_the_ratio():
    # test_swarm's old cadence: 20 steps of 15 ms (a round every 0.3 s) against a record every second.
    assert records_lag(0.015, 20, 1.0) == pytest.approx(1.0 / 0.3)
    assert records_lag(0.015, 20, 1.0) > 1


def test_no_lag_is_judged_before_a_step_was_timed():
    assert records_lag(0.0, 20, 1.0) == 0.0

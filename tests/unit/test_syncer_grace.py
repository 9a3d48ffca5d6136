"""The grace window a decoupled round waits after quorum: the overlap's slack, and with ``join_window`` at least the
time a peer needs to join a round we opened; γ = 0 still means no wait (no sockets: a bare Syncer)."""

import dataclasses

import pytest

from atoll.models.outer import grace_window, join_window
from atoll.node.config import NodeConfig, RunConfig
from atoll.node.syncer import EMA, OPEN_ROUND_POLL, POLL_INTERVAL, Syncer


def bare_syncer(step_time: float, read_time: float, **run: object) -> Syncer:
    syncer = Syncer.__new__(Syncer)
    syncer.cfg = NodeConfig(run=dataclasses.replace(RunConfig(algorithm="decoupled"), **run))
    syncer.step_time = step_time
    syncer._quorum_time, syncer._sync_time, syncer._read_time = EMA(), EMA(), EMA()
    syncer._sync_time.update(0.1)
    syncer._read_time.update(read_time)
    return syncer


def test_short_steps_wait_for_a_joiner_not_just_the_overlaps_slack():
    syncer = bare_syncer(0.25, 0.04, overlap=2, sync_every=40)
    slack = grace_window(0.5, 2, 0.25, 0.0, 0.1)
    assert slack == pytest.approx(0.2)
    expected = join_window(0.25, 0.04, 40, OPEN_ROUND_POLL, POLL_INTERVAL)
    assert expected == pytest.approx(OPEN_ROUND_POLL + POLL_INTERVAL + 0.5 + 0.12)
    assert syncer.grace() == pytest.approx(expected)


def test_long_steps_keep_the_overlaps_slack():
    syncer = bare_syncer(4.0, 0.04, overlap=8, sync_every=400)
    assert syncer.grace() == pytest.approx(0.5 * (8 * 4.0 - 0.1))


def test_gamma_zero_or_join_window_off_keep_the_papers_window():
    assert bare_syncer(0.25, 0.04, grace_gamma=0.0).grace() == 0.0
    assert bare_syncer(0.25, 0.04, join_window=False).grace() == pytest.approx(grace_window(0.5, 2, 0.25, 0.0, 0.1))

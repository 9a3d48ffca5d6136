"""The grace window a decoupled round waits after quorum: the overlap's slack, and with ``join_window`` at least the
time a peer needs to join a round we opened; γ = 0 still means no wait (no sockets: the round protocol alone)."""

import dataclasses
from types import SimpleNamespace

import pytest

from atoll.node.config import NodeConfig, RunConfig
from atoll.node.metrics import Counters
from atoll.node.rounds.round_protocol import OPEN_ROUND_POLL, POLL_INTERVAL, RoundProtocol
from atoll.node.rounds.waits import grace_window, join_window


def bare_protocol(step_time: float, read_time: float, **run: object) -> RoundProtocol:
    cfg = NodeConfig(run=dataclasses.replace(RunConfig(algorithm="decoupled"), **run))
    rounds = RoundProtocol(SimpleNamespace(cfg=cfg, counters=Counters(step_time=step_time)), peers=None,
                           catch_up=None, fragments=[])
    rounds.sync_time.update(0.1)
    rounds.read_time.update(read_time)
    return rounds


def test_short_steps_wait_for_a_joiner_not_just_the_overlaps_slack():
    syncer = bare_protocol(0.25, 0.04, overlap=2, sync_every=40)
    slack = grace_window(0.5, 2, 0.25, 0.0, 0.1)
    assert slack == pytest.approx(0.2)
    expected = join_window(0.25, 0.04, 40, OPEN_ROUND_POLL, POLL_INTERVAL)
    assert expected == pytest.approx(OPEN_ROUND_POLL + POLL_INTERVAL + 0.5 + 0.12)
    assert syncer.grace() == pytest.approx(expected)


def test_long_steps_keep_the_overlaps_slack():
    syncer = bare_protocol(4.0, 0.04, overlap=8, sync_every=400)
    assert syncer.grace() == pytest.approx(0.5 * (8 * 4.0 - 0.1))


def test_gamma_zero_or_join_window_off_keep_the_papers_window():
    assert bare_protocol(0.25, 0.04, grace_gamma=0.0).grace() == 0.0
    assert bare_protocol(0.25, 0.04, join_window=False).grace() == pytest.approx(grace_window(0.5, 2, 0.25, 0.0, 0.1))

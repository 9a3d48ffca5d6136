"""Peer cooldown: offenders are left out for a while, logged once per cooldown, memory bounded."""

import logging

from atoll.protocols import cooldown as cooldown_module
from atoll.protocols.stats import TrafficStats
from atoll.protocols.cooldown import Cooldown, describe


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_offender_cools_down_for_the_configured_time(caplog):
    clock = Clock()
    c = Cooldown(30, clock)
    with caplog.at_level(logging.WARNING, logger="atoll"):
        assert c.offend("QmPeerAAAABBBB", "shape") is True
        clock.t += 10
        assert c.offend("QmPeerAAAABBBB", "nonfinite") is False  # already cooling: no second line
    assert [r.getMessage() for r in caplog.records] == [
        "peer AAAABBBB sent a rejected shape: left out of rounds, donors and peer lists for 30 s"]
    assert c.active("QmPeerAAAABBBB") and not c.active("QmOther")
    clock.t += 25
    assert c.active("QmPeerAAAABBBB")  # the second offence restarted it: 35 s after the first
    clock.t += 5.1
    assert not c.active("QmPeerAAAABBBB") and len(c) == 0


def test_zero_disables_and_keys_are_described():
    c = Cooldown(0)
    assert c.offend("QmX", "shape") is False and not c.active("QmX")
    assert describe(b"ssh-rsa key").startswith("key:") and describe("QmPeer12345678") == "12345678"


def test_memory_is_bounded(monkeypatch):
    monkeypatch.setattr(cooldown_module, "MAX_ENTRIES", 10)
    clock = Clock()
    c = Cooldown(60, clock)
    for i in range(50):
        clock.t += 0.01
        c.offend(f"peer{i}", "protocol")
    assert len(c._until) <= 10
    assert c.active("peer49")  # the newest offenders are kept


def test_stats_count_kinds_and_report_known_offenders():
    heard = []
    stats = TrafficStats(on_offence=lambda source, kind: heard.append((source, kind)))
    stats.reject("shape", "QmA")
    stats.reject("truncated")
    stats.reject("shape", b"key")
    assert stats.rejected == 3 and stats.rejected_by_kind == {"shape": 2, "truncated": 1}
    assert heard == [("QmA", "shape"), (b"key", "shape")]

"""``near``'s choice of nodes, without sockets: a write's quorum meets every read, replicas are read fastest
first (a node with a call long out counts as that slow), and the hedge waits longer when every node is slow."""

import itertools

import pytest

from atoll.protocols import near


@pytest.mark.parametrize("replicas", range(1, 8))
def test_every_read_meets_every_write_quorum(replicas):
    # The naive reference: every set of nodes a write may have waited for, against every set a read may ask.
    quorum = near.write_quorum(replicas)
    beam = min(near.READ_BEAM, replicas)
    assert 1 <= quorum <= replicas
    for written in itertools.combinations(range(replicas), quorum):
        for read in itertools.combinations(range(replicas), beam):
            assert set(written) & set(read), (written, read)
    if replicas > near.READ_BEAM:  # and no more than that: one answer fewer leaves a read set that misses it
        assert replicas - (quorum - 1) >= beam


def test_replicas_are_read_fastest_first_and_an_open_call_counts():
    latency = near.Latency()
    peers = ["a", "b", "c", "d"]
    assert latency.fastest_first(peers, now=0.0) == peers  # nothing known: nearest first
    latency.observe("a", 0.5)
    latency.observe("b", 0.01)
    assert latency.fastest_first(peers, now=0.0) == ["c", "d", "b", "a"]
    latency.observe("a", 0.1)  # an exponential average: halfway
    assert latency.seconds["a"] == pytest.approx(0.3)
    latency.open["c"] = [10.0]  # a call to c has been out since t = 10
    assert latency.estimate("c", now=11.0) == pytest.approx(1.0)
    assert latency.fastest_first(peers, now=11.0) == ["d", "b", "a", "c"]


def test_the_hedge_waits_for_a_loaded_machine():
    latency = near.Latency()
    peers = ["a", "b", "c"]
    assert latency.hedge_after(peers, now=0.0) == near.HEDGE_AFTER
    latency.observe("a", 2.0)  # one slow node: the median is a fast one's
    latency.observe("b", 0.01)
    latency.observe("c", 0.02)
    assert latency.hedge_after(peers, now=0.0) == near.HEDGE_AFTER
    latency.seconds = {"a": 1.2, "b": 1.0, "c": 0.8}  # every node slow: a late answer is a multiple of theirs
    assert latency.hedge_after(peers, now=0.0) == pytest.approx(near.HEDGE_FACTOR * 1.0)

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


def test_a_node_holds_a_key_when_it_is_among_its_nearest_replicas():
    import random
    from types import SimpleNamespace

    from hivemind.dht.routing import DHTID

    rng = random.Random(5)
    for trial in range(50):
        ids = [DHTID.generate(source=f"node-{trial}-{i}") for i in range(rng.randint(1, 12))]
        me, others = ids[0], ids[1:]
        table = SimpleNamespace(get_nearest_neighbors=lambda key, k, exclude: sorted(
            [(i, f"peer-{i}") for i in others], key=lambda c: key.xor_distance(c[0]))[:k])
        node = SimpleNamespace(node_id=me, blacklist=set(), num_replicas=5,
                               protocol=SimpleNamespace(routing_table=table, bucket_size=20))
        key = DHTID.generate(source=f"key-{trial}")
        # The naive reference: this node's rank by distance to the key among every node it knows and itself.
        rank = sorted(ids, key=key.xor_distance).index(me)
        assert near.holds(node, key) == (rank < 5)
        if len(ids) <= 5:
            assert near.holds(node, key)  # a swarm of at most num_replicas: every node holds every key

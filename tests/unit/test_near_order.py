"""``near``'s choice of nodes, without sockets: a write's quorum meets every read, replicas are read fastest
first (a node with a call long out counts as that slow), the hedge waits longer when every node is slow, and no
call is waited for past its deadline or to a node known slow (``bounded``)."""

import asyncio
import itertools
import time
from types import SimpleNamespace

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


class _Node:
    """What ``bounded`` and ``bound_calls`` use of hivemind's ``DHTNode``: calls that answer after a set time."""

    def __init__(self) -> None:
        self.protocol = SimpleNamespace(wait_timeout=3.0, call_store=self._store)
        self.blacklist: set[str] = set()
        self.started: list[str] = []  # the peers each call that began was to

    async def answer(self, peer: str, seconds: float, value: object = "ok") -> object:
        self.started.append(peer)
        await asyncio.sleep(seconds)
        return value

    async def _call_find_with_blacklist(self, peer: str, keys: object) -> object:
        return await self.answer(peer, 0.0, ("found", keys))

    async def _store(self, peer: str, *args: object, **kwargs: object) -> object:
        return await self.answer(peer, 0.0, [True])


@pytest.fixture
def short(monkeypatch):
    """Deadlines of tens of ms, so that late calls are late by a wide margin on a loaded machine."""
    monkeypatch.setattr(near, "CALL_DEADLINE", 0.05)
    monkeypatch.setattr(near, "HEDGE_AFTER", 0.05)
    monkeypatch.setattr(near, "LOOP_LATE", 4.0)  # a deadline's timer 0.2 s late: the test's own loop was held


def test_a_call_past_its_deadline_is_given_up_and_its_node_passed_over(short):
    node = _Node()

    async def run():
        clock = near.latency(node)
        assert await near.bounded(node, "a", node.answer("a", 0.0)) == "ok"
        assert await near.bounded(node, "b", node.answer("b", 0.5)) is None  # given up at 0.05 s
        assert clock.given_up == 1 and "b" in clock.open  # the call is still out, in the background
        second = node.answer("b", 0.0)
        assert await near.bounded(node, "b", second) is None  # passed over: not sent while the first is out
        assert node.started.count("b") == 1 and clock.passed_over == 1
        await asyncio.sleep(0.6)
        assert clock.seconds["b"] >= 0.5 and "b" not in clock.open  # its answer timed it
        # Still passed over (it missed a deadline PASS_OVER s ago at most), but sent in the background: timed again.
        assert await near.bounded(node, "b", node.answer("b", 0.0)) is None
        await asyncio.sleep(0.01)
        assert node.started.count("b") == 2 and clock.passed_over == 2
        assert await near.bounded(node, "a", node.answer("a", 0.0)) == "ok"  # the others are asked as ever

    asyncio.run(run())


def test_a_node_slow_on_average_is_passed_over_until_its_time_comes_down(short, monkeypatch):
    node = _Node()
    clock = near.latency(node)
    clock.seconds = {"a": 0.01, "b": 0.01, "c": 0.35}  # c answered, but on average far past the hedge

    async def run():
        # Each call it is passed over is sent in the background and answers at once, about halving its average
        # (0.35, 0.175, 0.0875, 0.044...): twice at least it is past the hedge of 0.05 s whatever the loop's delays,
        # and within a few more answers it is under it and waited for again.
        clock.timed_at = dict.fromkeys(clock.seconds, asyncio.get_running_loop().time())
        for _ in range(2):
            assert await near.bounded(node, "c", node.answer("c", 0.0)) is None
            await asyncio.sleep(0.01)
        for _ in range(6):
            if not clock.slow("c", asyncio.get_running_loop().time()):
                break
            assert await near.bounded(node, "c", node.answer("c", 0.0)) is None
            await asyncio.sleep(0.01)
        assert clock.passed_over == len(node.started) >= 2  # each one was sent, in the background
        assert await near.bounded(node, "c", node.answer("c", 0.0)) == "ok"  # fast again: waited for
        assert clock.given_up == 0

    asyncio.run(run())


def test_a_deadline_missed_while_this_node_s_own_loop_was_held_blames_no_node(short):
    node = _Node()

    async def run():
        call = asyncio.ensure_future(near.bounded(node, "a", node.answer("a", 0.1)))
        await asyncio.sleep(0.01)  # the call is out, its deadline (0.05 s) set
        time.sleep(0.5)  # this loop held (a long validation): the deadline and the answer both come due meanwhile
        assert await call == "ok"  # the answer is read after all
        clock = near.latency(node)
        assert clock.given_up == 0 and not clock.slow("a", asyncio.get_running_loop().time())

    asyncio.run(run())


def test_the_hedge_s_median_is_of_the_nodes_timed_lately():
    clock = near.Latency()
    for gone in ("g1", "g2", "g3"):  # nodes that left long ago, their calls unanswered
        clock.observe(gone, 3.0, now=0.0)
    for peer in ("a", "b"):
        clock.observe(peer, 0.01, now=1000.0)
    assert set(clock.recent(now=1000.0)) == {"a", "b"}
    assert clock.hedge_after(clock.recent(1000.0), 1000.0) == near.HEDGE_AFTER  # not 4 x 3 s
    assert not clock.slow("g1", now=1000.0)  # timed long ago: judged afresh, as a node never timed


def test_after_an_idle_spell_no_node_is_slow_for_its_old_average():
    # Thirty nodes of a slower link timed 0.3 s each, then nothing for longer than RECENT: none is passed over
    # (against a hedge of nodes timed lately, of which there are none, 0.3 s would be past it).
    clock = near.Latency()
    for i in range(30):
        clock.observe(f"p{i}", 0.3, now=0.0)
    assert not any(clock.slow(f"p{i}", now=10.0) for i in range(30))  # 4 x 0.3 s: none late
    later = near.RECENT + 1
    for fast in ("f1", "f2", "f3"):
        clock.observe(fast, 0.02, now=later)
    assert not any(clock.slow(f"p{i}", now=later) for i in range(30))
    clock.observe("p0", 0.3, now=later)  # timed again now: slow beside the three fast nodes (hedge 0.2 s)
    assert clock.slow("p0", now=later) and not clock.slow("p1", now=later)


def test_a_passed_over_node_is_asked_again_after_pass_over(short, monkeypatch):
    monkeypatch.setattr(near, "PASS_OVER", 0.2)
    node = _Node()
    clock = near.latency(node)

    async def run():
        clock.missed("a", asyncio.get_running_loop().time())
        assert clock.slow("a", asyncio.get_running_loop().time())
        await asyncio.sleep(0.25)
        assert not clock.slow("a", asyncio.get_running_loop().time())
        assert await near.bounded(node, "a", node.answer("a", 0.0)) == "ok"

    asyncio.run(run())


def test_passed_over_nodes_are_forgotten_once_their_time_is_up(monkeypatch):
    monkeypatch.setattr(near, "MAX_PASSED_OVER", 4)
    clock = near.Latency()
    for i in range(4):
        clock.missed(f"old{i}", now=0.0)
    clock.missed("new", now=near.PASS_OVER + 1)  # the four old ones' time is up: forgotten
    assert set(clock.passed_until) == {"new"}


def test_bound_calls_wraps_a_node_s_finds_and_stores_once_and_asks_no_blacklisted_node(short):
    node = _Node()
    near.bound_calls(node)
    near.bound_calls(node)  # once: a second call wraps nothing again

    async def run():
        assert await node._call_find_with_blacklist("a", ["k"]) == ("found", ["k"])
        assert await node.protocol.call_store("b", keys=["k"]) == [True]
        node.blacklist.add("c")
        assert await node._call_find_with_blacklist("c", ["k"]) is None
        assert node.started == ["a", "b"]  # c was not asked
        assert set(near.latency(node).seconds) == {"a", "b"}  # each call timed once, c not at all

    asyncio.run(run())

"""Group decisions: splitting a round's registrants under the size cap, validating decision records, and two
coordinators with different views of the DHT agreeing on the earlier decision."""

import asyncio
from types import SimpleNamespace

import pytest

from atoll.protocols.coordination import split_groups
from atoll.protocols.matchmaking import MAX_GROUP, Policy, Registrant, Round, parse_group_record
from support.views import Peers


def registrants(n):
    return {f"peer{i:03d}": 100.0 + i for i in range(n)}


@pytest.mark.parametrize("n,cap", [(1, 1), (1, 16), (5, 16), (16, 16), (17, 16), (10, 3), (40, 7), (9, 1)])
def test_split_groups_partitions_under_the_cap(n, cap):
    reg = registrants(n)
    groups = split_groups(reg, cap)
    flat = [p for g in groups for p in g]
    assert sorted(flat) == sorted(reg)  # everyone, once
    assert len(groups) == -(-n // cap)  # the fewest groups
    sizes = [len(g) for g in groups]
    assert max(sizes) <= cap and max(sizes) - min(sizes) <= 1
    assert all(g == sorted(g) for g in groups)


def test_split_groups_deals_the_earliest_registrants_to_different_groups():
    reg = {"d": 1.0, "c": 2.0, "b": 3.0, "a": 4.0}
    assert split_groups(reg, 2) == [["b", "d"], ["a", "c"]]
    # The same registrations in any dict order give the same groups (every daemon must agree).
    assert split_groups(dict(reversed(list(reg.items()))), 2) == [["b", "d"], ["a", "c"]]


def test_split_groups_rejects_a_non_positive_cap():
    with pytest.raises(ValueError):
        split_groups(registrants(3), 0)


def test_parse_group_record_accepts_disjoint_sorted_groups():
    assert parse_group_record({"groups": [["a", "b"], ["c"]], "time": 1.0}) == [["a", "b"], ["c"]]


@pytest.mark.parametrize("value", [
    None, [], {"members": ["a"], "time": 1.0}, {"groups": [], "time": 1.0}, {"groups": [["b", "a"]], "time": 1.0},
    {"groups": [["a"], ["a"]], "time": 1.0}, {"groups": [["a", "a"]], "time": 1.0}, {"groups": [[]], "time": 1.0},
    {"groups": [[1]], "time": 1.0}, {"groups": [["a" * 200]], "time": 1.0}, {"groups": "a", "time": 1.0},
    {"groups": [["a"]], "time": 1.0, "extra": 1},
    {"groups": [[f"p{i:05d}"] for i in range(MAX_GROUP + 1)], "time": 1.0},
])
def test_parse_group_record_rejects_malformed_decisions(value):
    assert parse_group_record(value) is None


class FakeDHT:
    """Subkeyed records in memory; ``hide`` lists (key, subkey) pairs this daemon's view does not see yet."""

    def __init__(self, shared=None, hide=()):
        self.records = shared if shared is not None else {}
        self.hide = set(hide)

    async def store(self, key, value, expiration_time, subkey, return_future):
        self.records.setdefault(key, {})[subkey] = value
        return True

    async def get(self, key, latest, return_future):
        items = {s: SimpleNamespace(value=v) for s, v in self.records.get(key, {}).items() if (key, s) not in self.hide}
        return SimpleNamespace(value=items) if items else None


def test_a_coordinator_that_decided_after_another_follows_the_earlier_decision(monkeypatch):
    """b registered before a, but a's view of the DHT lacked b's registration: a took itself for the coordinator
    and decided [a] alone. b, the coordinator in its own view (its first read of the decisions came before a's),
    decides [a, b] later; re-reading, it follows a's earlier decision (it is left out and catches up by
    download) instead of asking a for a shard of a group a never runs."""
    from atoll.protocols.matchmaking import form_group, group_key, round_key

    clock = iter(range(1000, 2000))  # DHT time: one second per reading
    monkeypatch.setattr("atoll.protocols.matchmaking.get_dht_time", lambda: float(next(clock)))
    key, gkey = round_key("run", 0, 13, "D"), group_key("run", 0, 13, "D")
    shared = {key: {b"a": {"peer_id": "a", "weight": 1.0, "time": 1000.5}},  # b registers at 1000
              gkey: {b"a": {"groups": [["a"]], "time": 1000.6}}}

    class Late(FakeDHT):  # a's decision lands just after b's first read of the decisions
        reads = 0

        async def get(self, k, latest, return_future):
            if k == gkey:
                Late.reads += 1
                if Late.reads == 1:
                    return None
            return await super().get(k, latest, return_future)

    async def live():
        return {"a": 13}

    members = asyncio.run(form_group(Late(shared), Round("run", 0, 13, "D"), Registrant("b", b"b", 1.0),
                                     Policy(5.0), Peers(live)))
    assert {s: v["groups"] for s, v in shared[gkey].items()} == {b"a": [["a"]], b"b": [["a", "b"]]}  # b decided
    assert members == []  # and followed the earlier decision


def test_a_restarted_daemon_does_not_follow_the_decision_its_previous_life_was_in(monkeypatch):
    """c was in round (0, 13)'s group [a, c] when it crashed; restarted (its process started at 1599.5), it registers
    for that round again. The old decision lists it, but was made without this life: following it would run the
    old all-reduce again against reducers that answer with their first results. c decides a group of its own."""
    from atoll.protocols.matchmaking import form_group, group_key, round_key

    key, gkey = round_key("run", 0, 13, "D"), group_key("run", 0, 13, "D")

    async def live():
        return {"a": 13}

    def join(not_before):
        clock = iter(range(1600, 2600))
        monkeypatch.setattr("atoll.protocols.matchmaking.get_dht_time", lambda: float(next(clock)))
        return asyncio.run(form_group(FakeDHT(shared), Round("run", 0, 13, "D"),
                                      Registrant("c", b"c", 1.0, started=not_before), Policy(5.0), Peers(live)))

    shared = {key: {b"a": {"peer_id": "a", "weight": 1.0, "time": 1598.0}},
              gkey: {b"a": {"groups": [["a", "c"]], "time": 1599.0}}}  # recent: not stale by age
    assert join(not_before=1500.0) == ["a", "c"]  # the defect this guards against: the old group, followed
    assert b"c" not in shared[gkey]
    assert join(not_before=1599.5) == ["a", "c"]  # the old decision ignored: c waited out a, then decided anew
    assert shared[gkey][b"c"]["groups"] == [["a", "c"]]


def _form(shared, peer, monkeypatch, start, live_versions, gather_timeout=5.0, dht=None, shunned=lambda peer: False,
          **options):
    from atoll.protocols.matchmaking import form_group

    clock = iter(range(start, start + 1000))  # DHT time: one second per reading
    monkeypatch.setattr("atoll.protocols.matchmaking.get_dht_time", lambda: float(next(clock)))
    rejected = []
    members = asyncio.run(asyncio.wait_for(form_group(
        (dht or FakeDHT)(shared), Round("run", 0, 13, "D"), Registrant(peer, peer.encode(), 1.0),
        Policy(gather_timeout, poll_interval=0.0), Peers(live_versions, shunned=shunned),
        on_reject=lambda kind, src: rejected.append((kind, src)), **options), timeout=30))
    return members, rejected


def test_a_registration_with_a_forged_time_is_rejected_and_the_round_still_forms(monkeypatch):
    """The reproduced attack: a member registered at time -1e12, became every round's coordinator with a deadline
    long past, and everyone gave up (zero multi-member merges). Its time is implausible: rejected, counted."""
    from atoll.protocols.matchmaking import round_key

    key = round_key("run", 0, 13, "D")
    shared = {key: {b"evil": {"peer_id": "evil", "weight": 1.0, "time": -1e12},
                    b"future": {"peer_id": "future", "weight": 1.0, "time": 1e12}}}
    members, rejected = _form(shared, "a", monkeypatch, 5000, {"evil": 13, "future": 13})
    assert members == ["a"]  # a coordinated, with nobody plausible to wait for
    assert ("round_record_time", b"evil") in rejected and ("round_record_time", b"future") in rejected


def test_a_coordinator_that_never_decides_is_bypassed(monkeypatch):
    """The earliest registrant (plausible time, alive) never publishes a decision (it died, or it registered with
    an early time on purpose). Past its deadline the next registrant coordinates instead of everyone giving up."""
    from atoll.protocols.matchmaking import group_key, round_key

    key, gkey = round_key("run", 0, 13, "D"), group_key("run", 0, 13, "D")
    shared = {key: {b"mute": {"peer_id": "mute", "weight": 1.0, "time": 4990.0},  # deadline 4995: long past
                    b"b": {"peer_id": "b", "weight": 1.0, "time": 4999.0}}}
    # b (a record with no daemon behind it in this test) never decides either: past its deadline, a coordinates.
    members, rejected = _form(shared, "a", monkeypatch, 5000, {"mute": 13, "b": 13})
    assert rejected == []
    assert members == ["a", "b", "mute"]
    assert shared[gkey] == {b"a": {"groups": [["a", "b", "mute"]], "time": shared[gkey][b"a"]["time"]}}


def test_the_coordinator_is_the_first_registrant_in_hash_order_for_a_turn_each_counted_from_our_registration():
    """The second review's squatter re-registered with a time that kept it the earliest registrant, and never
    decided: every fragment froze. The order of coordinators is a hash of the round key and the peer id, and
    every deadline is counted from the reader's own registration (``start``), so no registration time steers it."""
    from atoll.protocols.coordination import MAX_TURNS, coordinator, coordinator_rank, turn_seconds

    key = "run_f0_v13"
    registered = {"old": -1e6, "b": 98.0, "a": 98.0, "c": 99.0, "d": 1e6}
    order = sorted(registered, key=lambda p: coordinator_rank(key, p))
    assert order != sorted(registered, key=lambda p: (registered[p], p))  # not by time
    start, gather, turn = 100.0, 10.0, turn_seconds(10.0)
    passed = set()
    assert coordinator(registered, key, 100.0, start, gather, passed) == (order[0], start + gather)
    assert coordinator(registered, key, start + gather + turn, start, gather, passed)[0] == order[0]
    assert passed == set()
    assert coordinator(registered, key, start + gather + turn + 0.1, start, gather, passed) == (
        order[1], start + gather + turn)
    assert passed == {order[0]}
    assert coordinator(registered, key, start + gather + MAX_TURNS * turn + 0.1, start, gather, passed)[0] is None
    assert passed == set(order[:MAX_TURNS])  # at most MAX_TURNS tried: the round always ends
    # Whatever the times, the same order.
    assert coordinator({p: 0.0 for p in registered}, key, 100.0, start, gather)[0] == order[0]


def test_a_registrant_that_re_registers_with_another_time_keeps_its_first(monkeypatch):
    """A registrant's later registration under another time is counted and ignored: the time it was first read
    with stands (it cannot move a deadline or its place in the dealing of groups)."""
    from atoll.protocols.coordination import coordinator_rank
    from atoll.protocols.matchmaking import round_key

    key = round_key("run", 0, 13, "D")
    shared = {key: {b"x": {"peer_id": "x", "weight": 1.0, "time": 4999.0}}}

    class Moving(FakeDHT):
        async def get(self, k, latest, return_future):
            if k == key:
                shared[key][b"x"] = {"peer_id": "x", "weight": 1.0, "time": float(4990 + len(seen))}
                seen.append(1)
            return await super().get(k, latest, return_future)

    seen = []
    # a coordinates (first in hash order of a and x) and waits for z, which never registers: it reads the
    # registrations at every poll until its deadline.
    assert coordinator_rank(key, "a") < coordinator_rank(key, "x")
    members, rejected = _form(shared, "a", monkeypatch, 5000, {"x": 13, "z": 13}, dht=Moving)
    assert members == ["a", "x"] and len(seen) >= 2
    assert ("round_record_changed", None) in rejected


def test_a_round_ends_after_max_turns_whatever_its_registrants_do(monkeypatch):
    """Registrants that never decide, however many, and however they re-register: the round is skipped after
    ``MAX_TURNS`` coordinators had their turn, counted from our own registration."""
    from atoll.protocols.coordination import MAX_TURNS, coordinator_rank, turn_seconds
    from atoll.protocols.matchmaking import round_key

    key = round_key("run", 0, 13, "D")
    mutes = [f"m{i}" for i in range(40)]
    ahead = [p for p in mutes if coordinator_rank(key, p) < coordinator_rank(key, "a")][:MAX_TURNS + 2]
    assert len(ahead) == MAX_TURNS + 2
    shared = {key: {p.encode(): {"peer_id": p, "weight": 1.0, "time": 5000.0} for p in ahead}}
    times = []

    class Timed(FakeDHT):
        async def get(self, k, latest, return_future):
            times.append(1)
            return await super().get(k, latest, return_future)

    members, rejected = _form(shared, "a", monkeypatch, 5000, {p: 13 for p in ahead}, dht=Timed)
    assert members == []  # nobody decided: skipped, not waited on forever
    # One second of DHT time a reading: it ended within the turns (plus a reading or two of slack).
    assert len(times) <= 5.0 + MAX_TURNS * turn_seconds(5.0) + 4


def test_a_coordinator_bypassed_rounds_in_a_row_is_an_offender():
    from atoll.protocols.matchmaking import SILENT_OFFENCES, SilentCoordinators, _Watch

    silent, rejected = SilentCoordinators(), []

    def round_where(passed=(), decided=()):
        watch = _Watch()
        watch.passed, watch.decided = set(passed), set(decided)
        silent.observe(watch, lambda kind, source=None: rejected.append((kind, source)))

    for _ in range(SILENT_OFFENCES - 1):
        round_where(passed=["mute"])
    round_where(decided=["mute"])  # it decided one: the count starts over
    for _ in range(SILENT_OFFENCES - 1):
        round_where(passed=["mute"])
    assert ("silent_coordinator_offence", "mute") not in rejected
    round_where(passed=["mute"])
    assert rejected.count(("silent_coordinator_offence", "mute")) == 1
    assert rejected.count(("silent_coordinator", None)) == 2 * (SILENT_OFFENCES - 1) + 1
    # A coordinator bypassed whose decision we read after all is no silent one.
    round_where(passed=["late"], decided=["late"])
    assert "late" not in silent.strikes.missed


def test_a_decision_by_a_key_that_did_not_register_is_ignored(monkeypatch):
    """A member (or a stale daemon) publishes a group decision for a round it is not a registrant of."""
    from atoll.protocols.matchmaking import group_key

    gkey = group_key("run", 0, 13, "D")
    shared = {gkey: {b"evil": {"groups": [["evil"]], "time": 5000.5}}}
    members, rejected = _form(shared, "a", monkeypatch, 5000, {"evil": 13})
    assert members == ["a"]  # a coordinated its round, alone
    assert b"a" in shared[gkey]


@pytest.mark.parametrize("groups, time, kind, offender", [
    ([["evil"]], 5012.0, "group_record_omission", None),  # leaves a out, long after a registered
    ([["a"], ["evil"]], 5001.0, "group_record_split", b"evil"),  # singletons imposed on a round of two
    ([["a"]], 5001.0, "group_record_writer", b"evil"),  # a decision that does not list its writer
    ([["a", "evil"]], 4987.0, "group_record_time", None),  # made well before its writer registered
])
def test_a_registrant_cannot_impose_a_forged_decision(monkeypatch, groups, time, kind, offender):
    """The earliest registrant's decision counts only if it looks like one ``form_group`` makes: it lists its
    writer, splits as ``split_groups`` does, was made within its writer's turn, and includes every daemon that
    registered well before it. Otherwise it is counted, ignored, and the writer is bypassed like a mute one. Its
    writer is an offender only for what no honest coordinator writes: a frozen or slow one can decide late, or
    without a registration it had not read yet."""
    from atoll.protocols.matchmaking import group_key, round_key

    key, gkey = round_key("run", 0, 13, "D"), group_key("run", 0, 13, "D")
    shared = {key: {b"evil": {"peer_id": "evil", "weight": 1.0, "time": 4999.0}},
              gkey: {b"evil": {"groups": groups, "time": time}}}
    members, rejected = _form(shared, "a", monkeypatch, 5000, {"evil": 13})
    assert (kind, offender) in rejected
    assert members == ["a", "evil"]  # a took over once evil's turn was over, with evil still in
    assert shared[gkey][b"a"]["groups"] == [["a", "evil"]]


def test_a_registrant_waiting_for_the_decision_reads_the_registrations_rarely_and_when_it_lands(monkeypatch):
    """The registrations (one per registrant) are the round's biggest record: a, not the coordinator, polls the
    decision and reads them only every ``REGISTRATIONS_REREAD`` seconds and once the decision appears (to check
    it). Loop time is stepped by each poll's sleep, not slept."""
    from atoll.protocols import matchmaking
    from atoll.protocols.matchmaking import REGISTRATIONS_REREAD, form_group, group_key, round_key

    key, gkey = round_key("run", 0, 13, "D"), group_key("run", 0, 13, "D")
    monkeypatch.setattr(matchmaking, "get_dht_time", lambda: 1001.0)
    shared = {key: {b"b": {"peer_id": "b", "weight": 1.0, "time": 1000.0}}}  # first in hash order: it coordinates
    reads = {key: 0, gkey: 0}
    polls = int(3 * REGISTRATIONS_REREAD / 0.2)

    class Counting(FakeDHT):
        async def get(self, k, latest, return_future):
            reads[k] += 1
            if k == gkey and reads[gkey] == polls:  # a decides after ``polls`` polls
                shared[gkey] = {b"b": {"groups": [["a", "b"]], "time": 1000.9}}
            return await super().get(k, latest, return_future)

    loop = asyncio.new_event_loop()
    now = [0.0]
    monkeypatch.setattr(loop, "time", lambda: now[0])

    async def sleep(seconds):
        now[0] += seconds

    async def live():
        return {"b": 13}

    monkeypatch.setattr(matchmaking.asyncio, "sleep", sleep)
    try:
        members = loop.run_until_complete(form_group(
            Counting(shared), Round("run", 0, 13, "D"), Registrant("a", b"a", 1.0), Policy(30.0), Peers(live)))
    finally:
        loop.close()
    assert members == ["a", "b"] and reads[gkey] == polls
    # Every 1 s of 3 s of polls, and once more when the decision landed: not at each of the 15 polls.
    assert reads[key] == pytest.approx(3 * 1 + 1, abs=1)


def test_a_registrant_missing_from_the_table_is_looked_up_and_counted(monkeypatch):
    """A large swarm's table is read in turns: a newcomer's registration may name a peer the coordinator has not
    read yet. It is looked up (its shard read) and then counted, instead of waiting a turn round the shards."""
    from atoll.protocols import matchmaking
    from atoll.protocols.matchmaking import form_group, group_key, round_key

    key, gkey = round_key("run", 0, 13, "D"), group_key("run", 0, 13, "D")
    clock = iter(range(1000, 2000))
    monkeypatch.setattr(matchmaking, "get_dht_time", lambda: float(next(clock)))
    shared = {key: {b"n": {"peer_id": "n", "weight": 1.0, "time": 1001.0}}}  # a newcomer; we register at 1000
    table, asked = {"a": 13}, []

    async def live():
        return dict(table)

    async def look_up(peer_ids):
        asked.append(set(peer_ids))
        table.update({p: 13 for p in peer_ids})

    members = asyncio.run(form_group(
        FakeDHT(shared), Round("run", 0, 13, "D"), Registrant("c", b"c", 1.0), Policy(5.0, quorum=1, poll_interval=0.0),
        Peers(live, look_up=look_up)))
    assert asked[0] == {"n"} and "n" in members


def test_a_decision_listing_a_peer_we_cool_down_is_followed_unless_that_peer_wrote_it(monkeypatch):
    """x is an offender in a's eyes (cooled down: the round protocol's ``live_peers`` leaves it out) but not yet in
    b's. b's decision lists x: a follows it, as b does, rather than missing the round (ignoring it made every round
    b coordinated fail for both until b cooled x down too). A decision x signed does not count for a (x is no
    registrant in its view), and a decision listing a revoked member (``shunned``) is not followed at all."""
    from atoll.protocols.matchmaking import group_key, round_key

    key, gkey = round_key("run", 0, 13, "D"), group_key("run", 0, 13, "D")
    registrations = {b"b": {"peer_id": "b", "weight": 1.0, "time": 4999.0},
                     b"x": {"peer_id": "x", "weight": 1.0, "time": 4998.0}}
    shared = {key: dict(registrations), gkey: {b"b": {"groups": [["a", "b", "x"]], "time": 5000.5}}}
    members, rejected = _form(shared, "a", monkeypatch, 5000, {"b": 13})
    assert members == ["a", "b", "x"] and rejected == []

    shared = {key: dict(registrations), gkey: {b"x": {"groups": [["a", "b", "x"]], "time": 5000.5}}}
    members, _ = _form(shared, "a", monkeypatch, 5000, {"b": 13})
    assert members == ["a", "b"]  # x's decision ignored; b never decided either: a coordinated, without x
    assert shared[gkey][b"a"]["groups"] == [["a", "b"]]

    shared = {key: dict(registrations), gkey: {b"b": {"groups": [["a", "b", "x"]], "time": 5000.5}}}
    members, _ = _form(shared, "a", monkeypatch, 5000, {"b": 13}, shunned=lambda peer: peer == "x")
    assert members == ["a", "b"]  # x revoked: b's decision is not followed; a decided without x


def test_a_spent_decision_is_not_followed_again_and_a_new_one_is_made(monkeypatch):
    """a followed b's decision and its all-reduce failed (a member refused the group, say): at its next sync point a
    registers for the same round again, where b's decision is still valid and still the earliest. Followed again it
    repeats the failure for as long as it stays valid (the second review's squatter kept honest daemons on one stale
    decision a dozen times a fragment); spent, a waits for a new decision instead, here its own."""
    from atoll.protocols.matchmaking import group_key, round_key

    key, gkey = round_key("run", 0, 13, "D"), group_key("run", 0, 13, "D")
    shared = {key: {b"b": {"peer_id": "b", "weight": 1.0, "time": 4999.0}},
              gkey: {b"b": {"groups": [["a", "b"]], "time": 5000.5}}}
    followed = []
    members, _ = _form(shared, "a", monkeypatch, 5000, {"b": 13}, on_decision=followed.append)
    assert members == ["a", "b"] and b"a" not in shared[gkey] and followed[-1].id == (b"b", 5000.5)
    members, _ = _form(shared, "a", monkeypatch, 5010, {"b": 13})
    assert members == ["a", "b"] and b"a" not in shared[gkey]  # unspent, the same decision again
    spent = {followed[-1].id}
    members, _ = _form(shared, "a", monkeypatch, 5010, {"b": 13}, spent=spent, on_decision=followed.append)
    assert members == ["a", "b"] and shared[gkey][b"a"]["time"] > 5010  # a new decision: a's (b never decided again)
    assert followed[-1].id == (b"a", shared[gkey][b"a"]["time"])


def test_spent_decisions_are_remembered_for_the_latest_rounds_only():
    from atoll.protocols.coordination import SpentDecisions

    spent = SpentDecisions()
    spent.of((0, 1, "D")).add((b"b", 1.0))
    assert spent.of((0, 1, "D")) == {(b"b", 1.0)}
    for i in range(2, SpentDecisions.MAX_ROUNDS + 2):
        spent.of((0, i, "D"))
    assert len(spent._by_round) == SpentDecisions.MAX_ROUNDS
    assert spent.of((0, 1, "D")) == set()  # the oldest round was forgotten

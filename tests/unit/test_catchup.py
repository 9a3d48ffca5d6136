"""Catch-up believes only vouched-for replicas, and a donor that does not back its claim becomes an offender.

No sockets: ``CatchUp`` runs against a stand-in context whose peer table is a fixed list of progress records.
"""

import itertools
import random
import time
from types import SimpleNamespace

import torch

from atoll.node.rounds.catchup import UNBACKED_OFFENCES, CatchUp
from atoll.node.rounds.donors import vouched
from atoll.node.rounds.replica import Replica
from atoll.protocols.cooldown import Cooldown
from atoll.protocols.state_sync import MAX_ANCESTORS
from atoll.protocols.stats import TrafficStats
from support.records import progress_record


def naive_vouched(p, peers, vouchers):
    out = []
    for peer in peers:
        same = 0
        for other in peers:
            if other.fragment(p) == peer.fragment(p):
                same += 1
        if same >= min(vouchers, len(peers)):
            out.append(peer)
    return out


def test_vouched_matches_a_naive_count_of_holders():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(0, 7)
        peers = [progress_record(f"p{i}", [rng.randint(3, 5)], [rng.choice("ab")]) for i in range(n)]
        for vouchers in (1, 2, 3):
            assert vouched(0, peers, vouchers) == naive_vouched(0, peers, vouchers)


class Table:
    def __init__(self, peers, pace=1.0):
        self._peers, self._pace = peers, pace

    def pace(self):  # PeerTable.pace: seconds between our reads of the table (the heartbeat while rounds are short)
        return self._pace

    def training(self):
        return list(self._peers)


def holder(name, version, weight, digest):
    """A peer's record holding fragment 0 at ``version`` with merged ``weight`` and ``digest``."""
    r = progress_record(name, [version], [digest])
    r.fragment_weights = [weight]
    return r


def catch_up(peers, vouchers=2, pace=1.0):
    replica = Replica([torch.zeros(4)], versions=[5], weights=[5.0])
    stats = TrafficStats()
    ctx = SimpleNamespace(replica=replica, cfg=SimpleNamespace(state_vouchers=vouchers, heartbeat=1.0), stats=stats,
                          cooldown=Cooldown(60.0), peer_id="me", subkey=b"me")
    stats.on_offence = lambda source, kind: ctx.cooldown.offend(source, kind)  # as the syncer wires it
    ctx.reject = stats.reject
    cu = CatchUp(ctx, Table(peers, pace))
    cu._clock = itertools.count(0.0, 10.0).__next__  # each failure a record's grace after the last
    return cu, ctx


def test_one_peer_claiming_a_heavier_replica_is_not_believed():
    # The review's attack: one member's record claims v9 of a replica only it holds (an all-zero model, say).
    honest = [progress_record("b", [5], ["ours"]), progress_record("c", [5], ["ours"])]
    liar = progress_record("m", [9], ["zeros"])
    cu, _ = catch_up(honest + [liar])
    cu.ctx.replica._frags[0].digest = "ours"
    assert cu.heavier_peers(0) == [] and not cu.behind(0)
    # A second holder vouches for it: now it is the swarm's replica, and we are behind.
    cu.peers = Table(honest[:1] + [liar, progress_record("c", [9], ["zeros"])])
    assert {peer.peer_id for peer in cu.heavier_peers(0)} == {"m", "c"} and cu.behind(0)


def test_with_a_single_live_peer_its_replica_is_vouched_for_by_itself():
    cu, _ = catch_up([progress_record("b", [6], ["next"])])
    assert [peer.peer_id for peer in cu.heavier_peers(0)] == ["b"]
    # And with more vouchers required than peers are live, all of them must agree.
    cu, _ = catch_up([progress_record("b", [6], ["next"]), progress_record("c", [6], ["next"]), progress_record("d", [5], ["x"])], vouchers=5)
    assert cu.heavier_peers(0) == []


def test_a_donor_that_fails_its_claim_repeatedly_is_an_offender():
    cu, ctx = catch_up([])
    claim = (9, 9.0, "x")
    for _ in range(UNBACKED_OFFENCES - 1):
        cu._unbacked("m", claim)
    assert not ctx.cooldown.active("m") and ctx.stats.rejected == 0
    cu._unbacked("m", claim)
    assert ctx.cooldown.active("m") and ctx.stats.rejected_by_kind == {"unbacked_claim": 1}
    # A success in between starts the count over (as ``_download`` does on a delivered state).
    cu._unbacked("d", claim)
    cu._failures.pop("d", None)
    cu._unbacked("d", claim)
    assert not ctx.cooldown.active("d")


def test_a_donor_is_blamed_only_once_its_record_had_time_to_show_it_moved_on():
    """The local swarm's founder: it took the swarm's line over its own fork (a lighter replica), and refused the
    claim its record still showed twice within a second: blamed at once, it was left out of every round for two
    minutes. A donor fails a claim only if it still refuses it ``RECORD_GRACE`` paces of our table after the first
    time: where rounds are slow we read its next record a pace later (25 s here), not a heartbeat."""
    from atoll.node.rounds.catchup import RECORD_GRACE

    cu, ctx = catch_up([], pace=25.0)
    now = [0.0]
    cu._clock = lambda: now[0]
    claim = (9, 9.0, "x")
    for _ in range(UNBACKED_OFFENCES + 2):  # refused again and again within the grace
        cu._unbacked("a", claim)
        now[0] += 0.3
    assert not ctx.cooldown.active("a")
    cu._unbacked("a", (8, 10.0, "y"))  # its record moved on: the count starts over
    for _ in range(UNBACKED_OFFENCES + 2):  # a few heartbeats on, our table not read again yet: not blamed
        now[0] += 2.0 * ctx.cfg.heartbeat
        cu._unbacked("a", (8, 10.0, "y"))
    assert not ctx.cooldown.active("a")
    now[0] += RECORD_GRACE * 25.0
    cu._unbacked("a", (8, 10.0, "y"))  # still refusing what its record claims a grace later: an offence
    assert ctx.cooldown.active("a") and ctx.stats.rejected_by_kind == {"unbacked_claim": 1}


def test_a_lonely_daemon_takes_a_claim_nobody_vouches_for_only_through_a_gross_filter():
    from atoll.protocols.state_sync import ReplicaState

    b, c = progress_record("b", [9], ["b-line"]), progress_record("c", [7], ["c-line"])
    cu, ctx = catch_up([b, c])  # three replicas, one each: nobody vouches for any
    ctx.replica = Replica([torch.ones(4)], momentum=[torch.full((4,), 0.1)], versions=[5], weights=[5.0])
    assert cu.heavier_peers(0) == [] and [peer.peer_id for peer in cu.lonely_claim(0)] == ["b"]

    def state(params, momentum=None):
        momentum = torch.full((4,), 0.1) if momentum is None else momentum
        return ReplicaState(9, 99.0, "b-line", params, momentum, 0, "b", 0, ("b-line",))

    assert cu.plausible(state(torch.ones(4) * 1.3)) is None  # a fork: 30% away
    assert cu.plausible(state(-torch.ones(4))) is None  # far from ours, but of its size: an honest fork can be
    assert "norm" in cu.plausible(state(torch.zeros(4)))  # the review's all-zero model
    assert "norm" in cu.plausible(state(torch.ones(4) * 0.2))  # most of the way to it
    assert "norm" in cu.plausible(state(torch.ones(4) * 1e3))
    assert "momentum" in cu.plausible(state(torch.ones(4), momentum=torch.full((4,), 1e6)))


def test_a_daemon_that_shares_its_replica_never_takes_a_lone_claim():
    cu, ctx = catch_up([])
    version, weight, digest = ctx.replica.identity(0)
    shares = progress_record("b", [version], [digest])
    shares.fragment_weights = [weight]
    cu.peers = Table([shares, progress_record("m", [version + 5], ["zeros"])])
    assert cu.lonely_claim(0) == []
    # Alone, it may take one, then not again for LONELY_INTERVAL seconds.
    cu.peers = Table([progress_record("m", [version + 5], ["zeros"])])
    assert cu.lonely_claim(0)
    cu._lonely_at[0] = time.monotonic()
    assert cu.lonely_claim(0) == []


def test_a_peer_just_behind_us_on_our_line_means_we_are_not_lonely():
    """Right after a round, the others' records still show the replica it started from: a member's lone heavier
    claim must not find us 'lonely' in that moment."""
    from atoll.models.outer import NesterovOuter

    cu, ctx = catch_up([])
    before = ctx.replica.identity(0)
    ctx.replica.apply_outer_step(0, before[0], torch.ones(4), 1.0, NesterovOuter())
    behind = progress_record("b", [before[0]], [before[2]])
    cu.peers = Table([behind, progress_record("m", [before[0] + 5], ["zeros"])])
    assert cu.lonely_claim(0) == []


def test_a_lonely_claim_far_ahead_of_ours_is_not_taken():
    from atoll.node.rounds.catchup import MAX_LONELY_LEAD

    cu, ctx = catch_up([])
    version = ctx.replica.identity(0)[0]
    cu.peers = Table([progress_record("m", [version + MAX_LONELY_LEAD + 1], ["made-up"]), progress_record("c", [version - 1], ["c"])])
    assert cu.lonely_claim(0) == []
    cu.peers = Table([progress_record("m", [version + MAX_LONELY_LEAD], ["fork"]), progress_record("c", [version - 1], ["c"])])
    assert [peer.peer_id for peer in cu.lonely_claim(0)] == ["m"]


def test_a_lonely_download_goes_to_the_learner_and_is_adopted_only_if_it_passes():
    import asyncio

    from atoll.protocols.state_sync import ReplicaState

    cu, ctx = catch_up([])
    ctx.replica = Replica([torch.ones(4)], momentum=[torch.full((4,), 0.1)], versions=[5], weights=[5.0])
    cu.peers = Table([progress_record("m", [7], ["m-line"]), progress_record("c", [5], ["c-line"])])
    sent = ReplicaState(7, 7.0, "m-line", torch.ones(4) * 1.1, torch.full((4,), 0.1), 0, "m", 0, ("m-line",))

    async def download(p, donors):
        return sent

    cu._download = download
    donors = cu.lonely_claim(0)
    asyncio.run(cu._catch_up(0, donors, check=True))
    assert ctx.replica.identity(0)[0] == 5 and cu.take_adopted() == []  # not adopted by the syncer
    assert cu.take_candidates() == [sent] and cu.take_candidates() == []
    assert not cu.settle(sent, passed=False)
    assert ctx.stats.rejected_by_kind == {"worse_state": 1} and ctx.replica.identity(0)[0] == 5
    assert not ctx.cooldown.active("m")  # counted, not held against the donor
    assert cu.settle(sent, passed=True)
    assert ctx.replica.identity(0)[0] == 7 and cu.take_adopted() == [sent]


def test_only_a_refusal_of_a_claim_nobody_delivered_counts_against_its_donor(monkeypatch):
    import asyncio

    import atoll.node.rounds.catchup as catchup_module
    from atoll.protocols.state_sync import DonorRefused, ReplicaState

    def table(peers):
        t = Table(peers)
        t.everyone = lambda: {peer.peer_id: peer for peer in peers}
        return t

    def serve(delivered, error=DonorRefused("no")):
        async def download_state(open_stream, donors, p, numel, timeout, stats, have=None, on_failure=None,
                                 progress=None, claims=None, slots=None):
            assert claims == {peer.peer_id: peer.fragment(p) for peer in cu.peers.everyone().values()}
            on_failure(donors[0], error)  # the first donor fails
            version, weight, digest = delivered
            return ReplicaState(version, weight, digest, torch.zeros(4), torch.zeros(4), 0, donors[1], p)
        return download_state

    b, c = progress_record("b", [9], ["x"]), progress_record("c", [9], ["x"])
    cu, ctx = catch_up([b, c])
    ctx.cfg.run = SimpleNamespace(round_timeout=1.0)
    cu.peers = table([b, c])
    monkeypatch.setattr(catchup_module, "download_state", serve(b.fragment(0)))
    for _ in range(UNBACKED_OFFENCES + 1):
        assert asyncio.run(cu._download(0, [b, c])) is not None
    assert not ctx.cooldown.active("b") and "unbacked_claim" not in ctx.stats.rejected_by_kind
    # Now c holds another (lighter) replica: what b claimed was never delivered, so b's failures count.
    c = progress_record("c", [8], ["y"])
    cu.peers = table([b, c])
    monkeypatch.setattr(catchup_module, "download_state", serve(c.fragment(0)))
    for _ in range(UNBACKED_OFFENCES):
        asyncio.run(cu._download(0, [b, c]))
    assert ctx.cooldown.active("b") and ctx.stats.rejected_by_kind["unbacked_claim"] == 1
    # A donor that does not answer at all (frozen, restarting) is never blamed.
    cu, ctx = catch_up([b, c])
    ctx.cfg.run = SimpleNamespace(round_timeout=1.0)
    cu.peers = table([b, c])
    monkeypatch.setattr(catchup_module, "download_state", serve(c.fragment(0), ConnectionResetError("frozen")))
    for _ in range(UNBACKED_OFFENCES + 1):
        asyncio.run(cu._download(0, [b, c]))
    assert not ctx.cooldown.active("b") and "unbacked_claim" not in ctx.stats.rejected_by_kind
    # A donor that refuses because it moved on to a heavier replica since its record did not fail its claim; one that
    # says it moved on to a lighter one (or says nothing) did.
    for holds, blamed in (((10, 10.0, "z"), False), ((8, 1.0, "z"), True), (None, True)):
        cu, ctx = catch_up([b, c])
        ctx.cfg.run = SimpleNamespace(round_timeout=1.0)
        cu.peers = table([b, c])
        monkeypatch.setattr(catchup_module, "download_state", serve(c.fragment(0), DonorRefused("moved on", holds)))
        for _ in range(UNBACKED_OFFENCES):
            asyncio.run(cu._download(0, [b, c]))
        assert ctx.cooldown.active("b") == blamed, holds
    # Joining or restoring: nobody is blamed, even for a claim nobody delivered.
    cu, ctx = catch_up([b, c])
    ctx.cfg.run = SimpleNamespace(round_timeout=1.0)
    cu.peers = table([b, c])
    for _ in range(UNBACKED_OFFENCES + 1):
        asyncio.run(cu._download(0, [b, c], blame=False))
    assert not ctx.cooldown.active("b") and "unbacked_claim" not in ctx.stats.rejected_by_kind


def test_a_lonely_daemon_that_ran_ahead_alone_takes_the_vouched_line_with_more_merged_weight():
    """The chaos run's stalemate: a daemon alone on a fork merged rounds by itself faster than the others (v88 with
    weight 2.3e8 against their v66 with 4.3e8). Version first, its claim stayed the heaviest and nobody vouched for
    it, so neither side ever took the other's. A lonely daemon takes the line two live peers hold."""
    from atoll.protocols.state_sync import ReplicaState

    cu, ctx = catch_up([])
    ctx.replica = Replica([torch.ones(4)], versions=[88], weights=[234.0])
    line = [holder("a", 66, 434.0, "theirs"), holder("b", 66, 434.0, "theirs")]
    cu.peers = Table(line)
    assert [peer.peer_id for peer in cu.heavier_peers(0)] == ["a", "b"] and cu.behind(0)
    # Not the line of one peer, even with more merged weight than ours: with one other live daemon its claim is
    # vouched for by itself, and two forked daemons took each other's (we by weight, it by version: the local
    # swarm's swap). Nor when unvouched, nor when a live peer holds our replica (we are not alone: a fork of two
    # is vouched, and heavier by version).
    cu.peers = Table([holder("a", 66, 434.0, "theirs")])
    assert cu.heavier_peers(0) == []
    cu.peers = Table([holder("a", 66, 434.0, "theirs"), holder("b", 66, 434.0, "other"),
                      holder("c", 60, 100.0, "third")])
    assert cu.heavier_peers(0) == []
    _, weight, digest = ctx.replica.identity(0)
    cu.peers = Table(line + [holder("c", 88, weight, digest)])
    assert cu.heavier_peers(0) == []
    # The replica takes such a state only in place of the very replica it was chosen to replace, and calls it a
    # fork it lost.
    state = ReplicaState(66, 434.0, "theirs", torch.zeros(4), torch.zeros(4), 0, "a", 0, ("theirs",))
    assert not ctx.replica.adopt(state)  # by version, ours is heavier
    assert not ctx.replica.adopt(state, replacing="not ours")  # ours changed since (a round merged it)
    assert ctx.replica.adopt(state, replacing=digest) and state.forked
    assert ctx.replica.identity(0) == (66, 434.0, "theirs")
    lighter = ReplicaState(60, 400.0, "x", torch.zeros(4), torch.zeros(4), 0, "a", 0, ("x",))
    assert not ctx.replica.adopt(lighter, replacing=digest)


def test_a_lonely_daemon_ahead_in_version_and_weight_takes_the_line_two_live_peers_hold():
    """The xla swarm's stalemate: a daemon merged v15 alone while the other two merged it together, then kept
    merging alone, and led them in version and in merged weight (v20, 300 against v17, 250). Neither rule above
    applied: it never took their line, nor they its claim nobody vouched for; it never met them in a round again.
    A lonely daemon takes the claim at least two live peers hold, whatever its version and weight."""
    cu, ctx = catch_up([])
    ctx.replica = Replica([torch.ones(4)], versions=[20], weights=[300.0])
    _, weight, digest = ctx.replica.identity(0)
    line = [holder("a", 17, 250.0, "theirs"), holder("b", 17, 250.0, "theirs")]
    cu.peers = Table(line)
    assert [peer.peer_id for peer in cu.heavier_peers(0)] == ["a", "b"] and cu.behind(0)
    # The most held line first.
    cu.peers = Table(line + [holder("c", 18, 260.0, "other"), holder("d", 18, 260.0, "other"),
                             holder("e", 17, 250.0, "theirs")])
    assert [peer.peer_id for peer in cu.heavier_peers(0)] == ["a", "b", "e"]
    # Not a claim one peer holds (two forked daemons would swap replicas), with one live peer (the same), when a
    # live peer holds ours (we are not alone), nor a claim older than the ancestry we keep (perhaps our ancestor)
    # where its holders take ours (below).
    cu.peers = Table([holder("a", 17, 250.0, "theirs"), holder("b", 17, 250.0, "other"),
                      holder("c", 17, 250.0, "third")])
    assert cu.heavier_peers(0) == []
    cu.peers = Table([holder("a", 17, 250.0, "theirs")])
    assert cu.heavier_peers(0) == []
    cu.peers = Table(line + [holder("c", 20, weight, digest)])
    assert cu.heavier_peers(0) == []
    old = Table([holder("a", 17, 250.0, "old"), holder("b", 17, 250.0, "old")])
    cu, ctx = catch_up([], vouchers=1)
    ctx.replica = Replica([torch.ones(4)], versions=[60], weights=[300.0])
    cu.peers = old
    assert cu.heavier_peers(0) == []


def test_a_daemon_that_ran_alone_past_its_ancestry_takes_the_line_that_never_takes_its_own():
    """A whole swarm restarted from its checkpoints: the founder came back first, merged alone at once round after
    round, and ran more versions ahead of the others than the ancestry a replica keeps (v124 against their v52).
    Their claim might have been an ancestor of its own, so it never took it; its own claim was held by it alone, so
    they never took it either: the swarm stayed split for the rest of the run. Where its holders will not take ours
    (two of them, two vouchers needed), the line two live peers hold is taken at any version."""
    line = [holder("a", 52, 250.0, "theirs"), holder("b", 52, 250.0, "theirs")]
    cu, ctx = catch_up(line)
    ctx.replica = Replica([torch.ones(4)], versions=[124], weights=[300.0])
    assert MAX_ANCESTORS < 124 - 52
    assert [peer.peer_id for peer in cu.heavier_peers(0)] == ["a", "b"] and cu.behind(0)
    # A single voucher suffices for them: they take our claim (heavier by version) as they would any, so we keep it.
    cu, ctx = catch_up(line, vouchers=1)
    ctx.replica = Replica([torch.ones(4)], versions=[124], weights=[300.0])
    assert cu.heavier_peers(0) == []
    # Not alone (a live peer holds our replica): nothing to take.
    cu, ctx = catch_up([])
    ctx.replica = Replica([torch.ones(4)], versions=[124], weights=[300.0])
    _, weight, digest = ctx.replica.identity(0)
    cu.peers = Table(line + [holder("c", 124, weight, digest)])
    assert cu.heavier_peers(0) == []


def test_a_donor_that_moved_on_is_asked_for_what_it_holds_now_if_that_would_be_vouched_for(monkeypatch):
    """The local swarm's joiner: the founder merged several rounds a heartbeat alone, so its record's claim was
    always stale, every download of it was refused ("moved on"), and the joiner never caught up (it merged alone
    and forked). A refusal naming a heavier replica counts as the donor's newer record: it is downloaded if it
    would then be vouched for, and only then (one member saying it moved on makes nothing vouched for)."""
    import asyncio

    import atoll.node.rounds.catchup as catchup_module
    from atoll.protocols.state_sync import DonorRefused, ReplicaState

    asked = []

    def serve(holds):
        async def download_state(open_stream, donors, p, numel, timeout, stats, have=None, on_failure=None,
                                 progress=None, claims=None, slots=None):
            asked.append(dict(claims))
            for donor in donors:
                if claims[donor] == holds.get(donor):
                    version, weight, digest = holds[donor]
                    return ReplicaState(version, weight, digest, torch.zeros(4), torch.zeros(4), 0, donor, p)
                on_failure(donor, DonorRefused("moved on", holds.get(donor)))
            return None
        return download_state

    def table(peers):
        t = Table(peers)
        t.everyone = lambda: {peer.peer_id: peer for peer in peers}
        return t

    a = progress_record("a", [9], ["x"])
    cu, ctx = catch_up([a])
    ctx.cfg.run = SimpleNamespace(round_timeout=1.0)
    cu.peers = table([a])
    now = (14, 14.0, "y")
    monkeypatch.setattr(catchup_module, "download_state", serve({"a": now}))
    state = asyncio.run(cu._download(0, [a]))
    assert state is not None and (state.version, state.weight, state.digest) == now
    assert asked == [{"a": a.fragment(0)}, {"a": now}]
    assert not ctx.cooldown.active("a")
    # Among three live peers, one's newer claim alone is not vouched for: not asked for.
    b, c = progress_record("b", [9], ["x"]), progress_record("c", [5], ["z"])
    asked.clear()
    cu.peers = table([a, b, c])
    monkeypatch.setattr(catchup_module, "download_state", serve({"a": now, "b": (10, 10.0, "w")}))
    assert asyncio.run(cu._download(0, [a, b])) is None and len(asked) == 1
    # Two donors that moved on to the same replica vouch for it together.
    asked.clear()
    monkeypatch.setattr(catchup_module, "download_state", serve({"a": now, "b": now}))
    state = asyncio.run(cu._download(0, [a, b]))
    assert state is not None and state.digest == "y" and asked[-1] == {"a": now, "b": now}


def test_a_vouched_replica_unlike_ours_is_vetted_first_and_one_like_ours_is_adopted():
    """Two colluding members vouch for the replica they made up (the review's all-zero model): a vouched
    download far from our replica goes to the learner's vetting like a lonely one; an honest catch-up (a few
    rounds' steps away) is adopted at once."""
    import asyncio

    from atoll.node.rounds.catchup import MAX_VOUCHED_DISTANCE
    from atoll.protocols.state_sync import ReplicaState

    cu, ctx = catch_up([])
    ctx.replica = Replica([torch.ones(4)], momentum=[torch.full((4,), 0.1)], versions=[5], weights=[5.0])
    sent = {}

    async def download(p, donors):
        return sent["state"]

    cu._download = download
    for params in (torch.zeros(4), torch.tensor([1.0, -1.0, 1.0, -1.0]),  # zeros; a scrambled sign pattern
                   torch.ones(4) * (1 + 1.01 * MAX_VOUCHED_DISTANCE)):
        sent["state"] = ReplicaState(9, 90.0, "made-up", params, torch.full((4,), 0.1), 0, "m", 0, ("made-up",))
        asyncio.run(cu._catch_up(0, [progress_record("m", [9], ["made-up"])]))
        assert ctx.replica.identity(0)[0] == 5 and cu.take_adopted() == []
        assert cu.take_candidates() == [sent["state"]]
    assert not cu.settle(sent["state"], passed=False) and ctx.replica.identity(0)[0] == 5
    near = ReplicaState(7, 7.0, "swarm", torch.ones(4) * 1.05, torch.full((4,), 0.1), 0, "b", 0, ("swarm",))
    sent["state"] = near
    asyncio.run(cu._catch_up(0, [progress_record("b", [7], ["swarm"])]))
    assert ctx.replica.identity(0)[0] == 7 and cu.take_adopted() == [near] and cu.take_candidates() == []


def test_a_replica_that_failed_vetting_is_not_downloaded_again():
    """Two colluders' made-up replica, vetted and refused, was downloaded and evaluated again at every heartbeat
    (446 to 1,092 times in a one-minute run)."""
    from atoll.protocols.state_sync import ReplicaState

    made_up = [progress_record("m", [9], ["made-up"]), progress_record("n", [9], ["made-up"])]
    cu, ctx = catch_up(made_up)
    cu.peers = Table(made_up)
    assert [peer.peer_id for peer in cu.heavier_peers(0)] == ["m", "n"]
    state = ReplicaState(9, 90.0, "made-up", torch.zeros(4), torch.zeros(4), 0, "m", 0, ("made-up",))
    assert not cu.settle(state, passed=False)
    assert cu.failed_vetting("made-up") and cu.heavier_peers(0) == []

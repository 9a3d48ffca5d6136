"""Members behind NAT (``--client-mode``) contribute to rounds but never reduce a shard or serve state.

The all-reduce runs over real hivemind P2P daemons on loopback; the member that is not a reducer gets no inbound
stream at all (its servicer is never registered with its P2P daemon), so the round can only complete if nobody
tries to open one to it — exactly a peer behind NAT.
"""

import asyncio
from types import SimpleNamespace

import pytest
import torch
from hivemind.p2p import P2P

from atoll.node.rounds.donors import donor_order
from atoll.node.rounds.round_protocol import RoundProtocol
from atoll.protocols.averaging import allreduce
from atoll.protocols.reducer import AveragingServicer, GroupSpec
from atoll.protocols.stats import TrafficStats


def test_group_id_names_the_reducers_only_when_some_member_is_not_one():
    every = GroupSpec("run", 0, 3, 0, ("a", "b", "c"), 100)
    assert GroupSpec("run", 0, 3, 0, ("a", "b", "c"), 100, reducers=("a", "b", "c")).group_id == every.group_id
    assert GroupSpec("run", 0, 3, 0, ("a", "b", "c"), 100, reducers=("a", "b")).group_id != every.group_id
    two = GroupSpec("run", 0, 3, 0, ("a", "b", "c"), 100, block=4, reducers=("a", "c"))
    assert two.bounds() == [(0, 52), (52, 100)]  # one shard per reducer, not per member


def test_allreduce_with_a_member_that_nobody_can_reach():
    async def main():
        peers = [await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in range(3)]
        try:
            ids = [p.peer_id.to_base58() for p in peers]
            servicers = [AveragingServicer("run", i, TrafficStats()) for i in ids]
            nat = min(range(3), key=lambda k: ids[k])  # the first member in sorted order: it would reduce shard 0
            for k in range(3):
                if k != nat:  # the NATed member registers no handler: any stream opened to it fails
                    await servicers[k].add_p2p_handlers(peers[k], namespace="run")
            # The NATed member knows the others' addresses (it dials them); they do not know its own.
            for k in range(3):
                if k != nat:
                    await peers[nat]._client.connect(peers[k].peer_id, peers[k]._visible_maddrs)
            members = tuple(sorted(ids))
            reducers = tuple(m for m in members if m != ids[nat])
            spec = GroupSpec("run", 0, 0, 0, members, 1000, block=4, reducers=reducers)
            deltas = [torch.full((1000,), float(k + 1)) for k in range(3)]
            weights = [1.0, 2.0, 3.0]
            results = await asyncio.gather(*(allreduce(peers[k], servicers[k], spec, ids[k], deltas[k], weights[k], 10)
                                             for k in range(3)))
            return ids, nat, servicers, results, deltas, weights
        finally:
            for p in peers:
                await p.shutdown()

    ids, nat, servicers, results, deltas, weights = asyncio.run(main())
    assert all(r.merged is not None and not r.failed for r in results)
    expect = sum(w * d for w, d in zip(weights, deltas)) / sum(weights)
    for r in results:
        assert torch.equal(r.merged, results[0].merged)  # bit-identical on every member, the NATed one included
        assert torch.allclose(r.merged.float(), expect)
        assert r.contributors == sorted(ids)  # its contribution is merged
        assert len(r.shards) == 2  # one reduced shard per reducer
    assert servicers[nat]._groups == {}  # it never opened a reduction


def _record(peer_id, fragment, reachable=True):
    return SimpleNamespace(peer_id=peer_id, reachable=reachable, fragment=lambda p: fragment)


def test_a_peer_behind_nat_is_never_a_donor():
    heavy, light = (5, 2.0, "h"), (4, 1.0, "l")
    peers = [_record("nat", heavy, reachable=False), _record("pub1", heavy), _record("pub2", light)]
    assert [d.peer_id for d in donor_order(0, peers)] == ["pub1", "pub2"]
    assert donor_order(0, [_record("nat", heavy, reachable=False)]) == []  # nobody to download from: no attempt


@pytest.mark.parametrize("me_behind_nat", [False, True])
def test_reducers_leave_out_the_members_behind_nat(me_behind_nat):
    table = SimpleNamespace(everyone=lambda: {"b": _record("b", None), "c": _record("c", None, reachable=False)})
    ctx = SimpleNamespace(peer_id="a", cfg=SimpleNamespace(client_mode=me_behind_nat))
    protocol = RoundProtocol.__new__(RoundProtocol)
    protocol.ctx, protocol.peers = ctx, table
    assert protocol.reducers(["a", "b", "c", "d"]) == (("b", "d") if me_behind_nat else ("a", "b", "d"))
    # "d": no record of it yet counts as reachable; a group of NATed members only has no reducer.
    assert protocol.reducers(["c"]) == ()

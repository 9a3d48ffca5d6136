"""State transfer over real p2p daemons on 127.0.0.1: a donor whose stream breaks off mid-transfer hands over to
another donor holding the same replica, which resumes at the byte offset already received; a hostile member that
copied an honest claim cannot get its own replica taken, and an honest donor that moved on says so."""

import asyncio

import pytest
import torch
from hivemind.p2p import P2P

from atoll.models.outer import tensor_hash
from scripts.hostile.member import StateServicer as HostileServicer

from atoll.protocols.state_serve import StateServicer, p2p_opener
from atoll.protocols.state_sync import DonorRefused, NotTheClaim, ReplicaState, download_state
from atoll.protocols.stats import TrafficStats

pytestmark = pytest.mark.integration

NUMEL, PART, DIE_AFTER = 50_000, 64 * 1024, 2  # 400 kB of payload in 7 parts; the first donor sends 2


class DonorDied(Exception):
    pass


class DyingServicer(StateServicer):
    """A donor whose stream breaks off before it sends part ``DIE_AFTER`` of a transfer."""

    def _send_part(self, n, part):
        if n == DIE_AFTER:
            raise DonorDied
        return super()._send_part(n, part)


# hivemind registers a servicer's RPCs under its class's name: the receiver asks for StateServicer's.
DyingServicer.__name__ = StateServicer.__name__


async def transfer():
    g = torch.Generator().manual_seed(0)
    params, momentum = torch.randn(NUMEL, generator=g), torch.randn(NUMEL, generator=g)
    digest = tensor_hash(params, momentum)
    state = ReplicaState(9, 3.0, digest, params, momentum, 120, ancestors=(digest,))

    receiver = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peers, stats = [receiver], {}
    try:
        for name, servicer in (("dying", DyingServicer), ("healthy", StateServicer)):
            p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                   initial_peers=await receiver.get_visible_maddrs())
            peers.append(p2p)
            stats[name] = TrafficStats()
            await servicer(lambda _p: state, 1, stats[name], part_bytes=PART).add_p2p_handlers(p2p, namespace="run")
        ids = [p.peer_id.to_base58() for p in peers[1:]]
        got = await download_state(p2p_opener(receiver, "run"), ids, 0, NUMEL, 10.0, TrafficStats())
        return state, got, stats, ids
    finally:
        for p2p in peers:
            await p2p.shutdown()


def test_transfer_resumes_from_another_donor_after_one_breaks_off():
    state, got, stats, ids = asyncio.run(transfer())
    assert got is not None and got.digest == state.digest
    assert torch.equal(got.params, state.params) and torch.equal(got.momentum, state.momentum)
    assert got.donors == tuple(ids) and got.resumed_bytes == DIE_AFTER * PART
    assert stats["dying"].bytes_sent == DIE_AFTER * PART
    assert stats["healthy"].bytes_sent == 8 * NUMEL - DIE_AFTER * PART


def replica(seed: int, version: int) -> ReplicaState:
    g = torch.Generator().manual_seed(seed)
    params, momentum = torch.randn(NUMEL, generator=g), torch.randn(NUMEL, generator=g)
    digest = tensor_hash(params, momentum)
    return ReplicaState(version, float(version), digest, params, momentum, 120, ancestors=(digest,))


async def download_claimed(donors):
    """``donors``: (servicer class, the state it serves) in the order tried, each chosen for the honest claim."""
    honest = replica(0, 9)
    claim = (honest.version, honest.weight, honest.digest)
    receiver = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peers, stats, refusals = [receiver], TrafficStats(), []
    try:
        for servicer, state in donors:
            p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                   initial_peers=await receiver.get_visible_maddrs())
            peers.append(p2p)
            served = honest if state is None else state
            await servicer(lambda _p, s=served: s, 1, TrafficStats(), part_bytes=PART).add_p2p_handlers(
                p2p, namespace="run")
        ids = [p.peer_id.to_base58() for p in peers[1:]]
        got = await download_state(p2p_opener(receiver, "run"), ids, 0, NUMEL, 10.0, stats,
                                   on_failure=lambda donor, e: refusals.append((ids.index(donor), e)),
                                   claims={i: claim for i in ids})
        return honest, got, stats, refusals
    finally:
        for p2p in peers:
            await p2p.shutdown()


def test_a_member_that_copied_an_honest_claim_cannot_make_a_requester_take_its_own_replica():
    made_up = replica(1, 10)  # heavier than the claim it copied: adopted before, for the donor's header was all
    honest, got, stats, refusals = asyncio.run(download_claimed([(HostileServicer, made_up), (StateServicer, None)]))
    assert got is not None and got.digest == honest.digest
    assert [i for i, _ in refusals] == [0] and isinstance(refusals[0][1], NotTheClaim)
    assert stats.rejected_by_kind == {"not_the_claim": 1}


def test_an_honest_donor_that_moved_on_refuses_and_says_what_it_holds():
    newer = replica(2, 10)
    honest, got, stats, refusals = asyncio.run(download_claimed([(StateServicer, newer), (StateServicer, None)]))
    assert got is not None and got.digest == honest.digest
    (i, error), = refusals
    assert i == 0 and isinstance(error, DonorRefused) and error.holds == (newer.version, newer.weight, newer.digest)
    assert stats.rejected == 0

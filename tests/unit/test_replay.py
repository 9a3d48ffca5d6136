"""Catching up by replay: a replica that missed rounds reaches the donor's replica bit for bit by replaying the
rounds' compressed reduced shards, and refuses replays that do not check out. The wire part runs a real
``StateServicer`` in-process (no sockets)."""

import asyncio
from types import SimpleNamespace

import pytest
import torch

from atoll.models.outer import NesterovOuter, merged_delta, pseudo_gradient
from atoll.node.rounds.replica import Replica
from atoll.protocols import codecs
from atoll.protocols.reducer import shard_bounds
from atoll.protocols.state_serve import StateServicer
from atoll.protocols.state_sync import Replay, download_state
from atoll.protocols.stats import TrafficStats
from atoll.protocols.wire import pack_request

NUMEL, BLOCK = 3000, 64
OUTER = NesterovOuter(0.7, 0.9)
CONTEXT = SimpleNamespace(remote_id="QmRequester")


def do_round(replica: Replica, seed: int, codec="int4", members=3, rda=False, outer=OUTER):
    """One merged round as ``allreduce`` produces it: every reduced shard encoded and decoded, then merged."""
    version, _, digest = replica.identity(0)
    theta = replica.snapshot(0).params
    g = torch.Generator().manual_seed(seed)
    local = theta + 0.01 * torch.randn(NUMEL, generator=g)
    delta = pseudo_gradient(theta, local)
    shards = [(hi - lo, codecs.encode(delta[lo:hi].float(), codec, BLOCK))
              for lo, hi in shard_bounds(NUMEL, members, BLOCK)]
    norm = float(torch.linalg.vector_norm(delta)) if rda else None
    merged = merged_delta([codecs.decode(b, expected_numel=n) for n, b in shards], norm)
    assert replica.apply_outer_step(0, version, merged, 2.5, outer, digest, shards, norm)


def pair(rounds=0):
    torch.manual_seed(0)
    theta = torch.randn(NUMEL)
    ahead, behind = Replica([theta]), Replica([theta.clone()])
    for i in range(rounds):
        do_round(ahead, i)
        do_round(behind, i)
    return ahead, behind


@pytest.mark.parametrize("rda", [False, True])
@pytest.mark.parametrize("codec, missed", [("int4", 3), ("int8", 2), ("bf16", 1)])  # as many as fit half a transfer
def test_replaying_missed_rounds_gives_the_donors_replica_bit_for_bit(codec, missed, rda):
    ahead, behind = pair(rounds=2)
    for i in range(2, 2 + missed):
        do_round(ahead, i, codec, rda=rda)
    replay = ahead.replay_from(0, behind.identity(0)[2])
    assert replay is not None and len(replay.rounds) == missed
    state = behind.replay(replay, OUTER)
    assert state is not None and behind.adopt(state)
    assert behind.identity(0) == ahead.identity(0)
    assert torch.equal(behind.snapshot(0).momentum, ahead.snapshot(0).momentum)
    assert behind.snapshot(0).ancestors == ahead.snapshot(0).ancestors
    # The replayed rounds join the log: the caught-up replica can serve the same replay to others.
    assert behind.replay_from(0, replay.rounds[0].base).rounds == replay.rounds


def test_a_replay_is_much_smaller_than_the_full_state():
    ahead, behind = pair()
    for i in range(3):
        do_round(ahead, i, "int4")
    replay = ahead.replay_from(0, behind.identity(0)[2])
    # Each 4-bit round (with block-64 scales and headers) is under 1/12 of Θ_p and its momentum in fp32.
    assert sum(r.nbytes for r in replay.rounds) < 3 * 8 * NUMEL / 12


def test_no_replay_from_an_unknown_replica_or_across_an_unreplayable_round():
    ahead, behind = pair(rounds=1)
    assert ahead.replay_from(0, "0" * 16) is None
    do_round(ahead, 5)
    assert ahead.replay_from(0, behind.identity(0)[2]) is not None
    version, _, digest = ahead.identity(0)
    ahead.apply_outer_step(0, version, torch.zeros(NUMEL, dtype=torch.float64), 1.0, OUTER, digest)  # merged alone
    assert ahead.replay_from(0, behind.identity(0)[2]) is None


def test_the_log_keeps_no_more_than_half_a_full_transfer():
    ahead, behind = pair()
    for i in range(3):
        do_round(ahead, i, "none")  # fp32 shards: each round alone is half the full transfer plus headers
    assert ahead.replay_from(0, behind.identity(0)[2]) is None
    for i in range(40):
        do_round(ahead, 10 + i, "int4")
    longest = next(c for c in (ahead.replay_from(0, d) for d in ahead.snapshot(0).ancestors) if c is not None)
    assert 0 < len(longest.rounds) <= 32 and sum(r.nbytes for r in longest.rounds) <= 4 * NUMEL
    assert len(longest.rounds) < 40  # older rounds were let go


def test_a_tampered_replay_is_refused():
    ahead, behind = pair()
    for i in range(2):
        do_round(ahead, i)
    replay = ahead.replay_from(0, behind.identity(0)[2])
    r = replay.rounds[1]
    n, b = r.shards[0]
    bad = bytearray(b)
    bad[-1] ^= 0x11  # other 4-bit codes: valid bytes, another result
    tampered = Replay(**{**replay.__dict__, "rounds": (replay.rounds[0], type(r)(**{**r.__dict__, "shards": (
        (n, bytes(bad)), *r.shards[1:])}))})
    before = behind.identity(0)
    assert behind.replay(tampered, OUTER) is None
    assert behind.identity(0) == before
    # A replay that no longer starts at our replica (we moved on) is not applied either.
    do_round(behind, 99)
    assert behind.replay(replay, OUTER) is None


def test_replay_under_delayed_nesterov_follows_the_phase_and_refuses_a_relabelled_round():
    """Delayed Nesterov's phase is the replica's version: a replay across a period boundary reaches the donor's
    replica bit for bit, and a round relabelled with another version (another phase) is refused."""
    dn = NesterovOuter(0.7, 0.9, period=2)
    ahead, behind = pair()
    for i in range(3):
        do_round(ahead, i, outer=dn)
    replay = ahead.replay_from(0, behind.identity(0)[2])
    assert len(replay.rounds) == 3
    relabelled = Replay(**{**replay.__dict__, "rounds": tuple(
        type(r)(**{**r.__dict__, "version": r.version + 1}) for r in replay.rounds)})
    assert behind.replay(relabelled, dn) is None
    state = behind.replay(replay, dn)
    assert state is not None and behind.adopt(state)
    assert behind.identity(0) == ahead.identity(0)


def serve(replica):
    stats = TrafficStats()
    servicer = StateServicer(replica.snapshot, 1, stats, replay=replica.replay_from)

    async def open_stream(_donor, request):
        return servicer.rpc_download_state(pack_request(request), CONTEXT)

    return open_stream, stats


def test_download_with_have_gets_a_replay_and_without_it_the_full_state():
    ahead, behind = pair(rounds=1)
    for i in range(1, 4):
        do_round(ahead, i)
    open_stream, donor_stats = serve(ahead)
    stats = TrafficStats()
    got = asyncio.run(download_state(open_stream, ["a"], 0, NUMEL, 5.0, stats, have=behind.identity(0)[2]))
    assert isinstance(got, Replay) and len(got.rounds) == 3 and got.donor == "a"
    assert stats.bytes_received == donor_stats.bytes_sent == sum(r.nbytes for r in got.rounds) < 8 * NUMEL / 4
    assert behind.adopt(behind.replay(got, OUTER)) and behind.identity(0) == ahead.identity(0)

    stranger = Replica([torch.randn(NUMEL)])
    full = asyncio.run(download_state(open_stream, ["a"], 0, NUMEL, 5.0, TrafficStats(),
                                      have=stranger.identity(0)[2]))
    assert not isinstance(full, Replay) and full.digest == ahead.identity(0)[2]


def test_a_replay_is_sent_only_to_the_replica_the_requester_chose_the_donor_for():
    ahead, behind = pair(rounds=1)
    for i in range(1, 4):
        do_round(ahead, i)
    open_stream, _ = serve(ahead)
    wanted = asyncio.run(download_state(open_stream, ["a"], 0, NUMEL, 5.0, TrafficStats(),
                                        have=behind.identity(0)[2], claims={"a": ahead.identity(0)}))
    assert isinstance(wanted, Replay) and (wanted.version, wanted.weight, wanted.digest) == ahead.identity(0)
    refusals = []
    older = (ahead.identity(0)[0] - 1, ahead.identity(0)[1], "an older digest")
    moved = asyncio.run(download_state(open_stream, ["a"], 0, NUMEL, 5.0, TrafficStats(),
                                       have=behind.identity(0)[2], claims={"a": older},
                                       on_failure=lambda donor, e: refusals.append(e)))
    assert moved is None and refusals[0].holds == ahead.identity(0)  # it moved on, and says to what


def test_a_malformed_replay_header_is_rejected_and_the_next_donor_asked():
    ahead, behind = pair()
    for i in range(2):
        do_round(ahead, i)
    good, _ = serve(ahead)

    async def liar(_donor, request):  # its chain does not start at the requester's replica
        real = ahead.replay_from(0, request["have"])
        lie = Replay(**{**real.__dict__, "rounds": real.rounds[1:]})
        servicer = StateServicer(ahead.snapshot, 1, TrafficStats(), replay=lambda _p, _h: lie)
        return servicer.rpc_download_state(pack_request(request), CONTEXT)

    async def either(donor, request):
        return await (liar if donor == "liar" else good)(donor, request)

    stats = TrafficStats()
    got = asyncio.run(download_state(either, ["liar", "good"], 0, NUMEL, 5.0, stats, have=behind.identity(0)[2]))
    assert isinstance(got, Replay) and got.donor == "good"
    assert stats.rejected_by_kind == {"state": 1}

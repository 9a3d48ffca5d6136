"""The averaging round's math and message checks, without sockets."""

import asyncio
import time

import msgpack
import pytest
import torch

from atoll.protocols.reducer import AveragingServicer, GroupSpec, shard_bounds
from atoll.protocols.stats import TrafficStats
from atoll.protocols.wire import WireError, pack_request, parts_to_tensor, tensor_to_parts, unpack


def test_shard_bounds_align_to_codec_blocks():
    b = shard_bounds(1000, 3, align=256)
    assert b == [(0, 512), (512, 768), (768, 1000)]
    assert all(lo % 256 == 0 for lo, _ in b)


def test_shard_bounds_are_balanced_and_cover():
    for numel in (0, 1, 7, 100, 1001):
        for parts in (1, 2, 3, 8):
            b = shard_bounds(numel, parts)
            assert b[0][0] == 0 and b[-1][1] == numel
            assert all(b[i][1] == b[i + 1][0] for i in range(parts - 1))
            sizes = [hi - lo for lo, hi in b]
            assert max(sizes) - min(sizes) <= 1


def test_group_id_depends_on_everything_that_must_agree():
    base = GroupSpec("run", 0, 3, 0, ("a", "b"), 100)
    for other in (GroupSpec("run", 0, 3, 1, ("a", "b"), 100), GroupSpec("run", 0, 4, 0, ("a", "b"), 100),
                  GroupSpec("run", 0, 3, 0, ("a", "c"), 100), GroupSpec("run", 0, 3, 0, ("a", "b"), 101),
                  GroupSpec("run", 0, 3, 0, ("a", "b"), 100, base="d1")):
        assert other.group_id != base.group_id
    assert GroupSpec("run", 0, 3, 0, ("a", "b"), 100).group_id == base.group_id


def test_reduction_is_weighted_and_independent_of_arrival_order():
    async def reduce(order):
        servicer = AveragingServicer("run", "b", TrafficStats())
        spec = GroupSpec("run", 0, 0, 0, ("a", "b", "c"), 12, block=4)
        reduction = servicer.open(spec, timeout=5)
        parts = {"a": (1.0, torch.full((4,), 1.0)), "b": (2.0, torch.full((4,), 4.0)),
                 "c": (1.0, torch.full((4,), 0.1))}
        for peer in order:
            reduction.add(peer, *parts[peer])
        return await reduction.result

    r1 = asyncio.run(reduce("abc"))
    r2 = asyncio.run(reduce("cba"))
    assert torch.equal(r1.values, r2.values)
    expect = (1.0 * 1.0 + 2.0 * 4.0 + 1.0 * 0.1) / 4.0
    assert torch.allclose(r1.values, torch.full((4,), expect, dtype=torch.float32))
    assert r1.values.dtype == torch.float32  # what travels is what everyone applies
    assert r1.contributors == ["a", "b", "c"] and r1.weight == 4.0


def test_reduction_times_out_without_missing_members():
    async def run():
        servicer = AveragingServicer("run", "a", TrafficStats())
        reduction = servicer.open(GroupSpec("run", 0, 0, 0, ("a", "b"), 8, block=4), timeout=0.2)
        reduction.add("a", 1.0, torch.ones(4))
        return await reduction.result

    result = asyncio.run(run())
    assert result.contributors == ["a"] and torch.equal(result.values, torch.ones(4))


def test_a_group_id_opened_again_keeps_its_first_reduction():
    """A round retried at the same version by the same members has the same group id: whoever asks, early or
    late, must get the values of one reduction (a replaced reduction let two members of one round disagree)."""

    async def run():
        servicer = AveragingServicer("run", "a", TrafficStats())
        spec = GroupSpec("run", 0, 0, 0, ("a", "b"), 8, block=4)
        first = servicer.open(spec, timeout=0.2)
        first.add("a", 1.0, torch.ones(4))
        early = await first.result  # b's part never came: reduced without it
        again = servicer.open(spec, timeout=5)
        again.add("a", 1.0, torch.full((4,), 7.0))
        again.add("b", 1.0, torch.full((4,), 3.0))
        return early, again, await again.result

    early, again, late = asyncio.run(run())
    assert torch.equal(late.values, early.values) and late.contributors == ["a"]


def test_wire_roundtrip_and_rejections():
    t = torch.randn(1000)
    parts = list(tensor_to_parts(t, part_bytes=1000))
    assert len(parts) == 4 and torch.equal(parts_to_tensor(parts, 1000), t)
    with pytest.raises(WireError, match="bytes"):
        parts_to_tensor(parts[:-1], 1000)
    bad = torch.tensor([1.0, float("nan")])
    with pytest.raises(WireError, match="NaN"):
        parts_to_tensor(list(tensor_to_parts(bad)), 2)
    msg = unpack(pack_request({"group_id": "g", "weight": 2, "numel": 3}), {"group_id": str, "weight": float})
    assert msg["weight"] == 2
    with pytest.raises(WireError, match="lacks"):
        unpack(pack_request({"a": 1}), {"b": int})
    with pytest.raises(WireError, match="type"):
        unpack(pack_request({"numel": "3"}), {"numel": int})
    with pytest.raises(WireError, match="type"):
        unpack(pack_request({"numel": True}), {"numel": int})

    class Raw:
        metadata = b"\xc1\xff\x00"

    with pytest.raises(WireError, match="undecodable"):
        unpack(Raw(), {})

    class Big:
        metadata = msgpack.packb({"data": b"x" * (3 << 20)})

    with pytest.raises(WireError, match="oversized"):
        unpack(Big(), {})


@pytest.mark.parametrize("kind", ["truncated", "header", "codec", "nan"])
def test_corrupted_parts_never_decode(kind):
    from atoll.protocols import codecs
    from atoll.node.faults import corrupt_payload

    for codec in ("none", "bf16", "int8", "int4"):
        payload = codecs.encode(torch.randn(1000), codec, 256)
        with pytest.raises(codecs.CodecError):
            codecs.decode(corrupt_payload(payload, kind), expected_numel=1000)


def test_reducer_clips_an_outsized_contribution_before_merging():
    """Three members, one sending its delta ×1000 and claiming a huge weight: the reducer's result equals the
    weighted mean of the naive clipped reference (outliers above 4 × the lower median scaled to it)."""

    async def reduce():
        servicer = AveragingServicer("run", "b", TrafficStats(), clip_factor=4.0)
        spec = GroupSpec("run", 0, 0, 0, ("a", "b", "c"), 12, block=4)
        reduction = servicer.open(spec, timeout=5)
        reduction.add("a", 1.0, torch.tensor([1.0, 0.0, 0.0, 0.0]))
        reduction.add("b", 2.0, torch.tensor([0.0, 2.0, 0.0, 0.0]))
        reduction.add("c", 1e9, torch.tensor([0.0, 0.0, 3000.0, 4000.0]))
        return await reduction.result, servicer.stats

    result, stats = asyncio.run(reduce())
    # Norms 1, 2, 5000: lower median 2, above 8 is an outlier -> c becomes (0, 0, 1.2, 1.6). Weights 1, 2, 1e9
    # -> 1, 2, 2.
    want = (1.0 * torch.tensor([1.0, 0, 0, 0]) + 2.0 * torch.tensor([0, 2.0, 0, 0])
            + 2.0 * torch.tensor([0, 0, 1.2, 1.6])) / 5.0
    assert torch.allclose(result.values, want.float(), rtol=1e-6, atol=0)
    assert result.clipped == ["c"] and stats.clipped == 1 and result.weight == 5.0


def test_cooling_down_sender_is_treated_as_missing_and_still_gets_the_result():
    from atoll.protocols.cooldown import Cooldown

    class Ctx:
        remote_id = "c"

    async def run():
        cooldown = Cooldown(60)
        cooldown.offend("c", "shape")
        servicer = AveragingServicer("run", "b", TrafficStats(), cooldown)
        spec = GroupSpec("run", 0, 0, 0, ("b", "c"), 8, block=4)
        reduction = servicer.open(spec, timeout=5)
        reduction.add("b", 1.0, torch.full((4,), 2.0))

        async def requests():
            yield pack_request({"group_id": spec.group_id, "weight": 1.0, "numel": 4, "wait": 1.0, "norm": 0.0,
                                "codec": "none"})
            yield pack_request({"data": b"never read"})

        answers = [unpack(m, {}) async for m in servicer.rpc_aggregate(requests(), Ctx())]
        return answers, reduction, servicer.stats

    answers, reduction, stats = asyncio.run(run())
    assert answers[0]["ok"] and answers[0]["contributors"] == ["b"]
    assert stats.rejected_by_kind == {"cooldown": 1}


def test_a_member_cooling_down_is_missing_from_the_start():
    """Its streams are refused before they name a group (in a private run it is no member while it cools down),
    so the shard must not wait out its timeout for a part that never comes."""
    from atoll.protocols.cooldown import Cooldown

    async def run():
        cooldown = Cooldown(60)
        cooldown.offend("c", "late_reducer_offence")
        servicer = AveragingServicer("run", "b", TrafficStats(), cooldown)
        reduction = servicer.open(GroupSpec("run", 0, 0, 0, ("a", "b", "c"), 12, block=4), timeout=30)
        reduction.add("b", 1.0, torch.full((4,), 2.0))
        reduction.add("a", 1.0, torch.full((4,), 4.0))
        return await asyncio.wait_for(reduction.result, 1.0)

    result = asyncio.run(run())
    assert result.contributors == ["a", "b"] and torch.equal(result.values, torch.full((4,), 3.0))


@pytest.mark.parametrize("codec", ["none", "int8", "int4"])
def test_byzantine_payloads_are_refused_with_their_kind(codec):
    from atoll.protocols import codecs
    from atoll.node.faults import byzantine_payload

    flat = torch.randn(1000, dtype=torch.float64)
    for kind, expected in (("nan", "nonfinite"), ("shape", "shape")):
        payload = byzantine_payload(flat, 256, 768, codec, 64, kind)
        with pytest.raises(codecs.CodecError) as info:
            codecs.decode(payload, expected_numel=512)
        assert info.value.kind == expected
        assert len(payload) <= codecs.encoded_size(512, codec, 64)  # refused by decode, not by the size bound


def test_a_request_for_a_round_the_reducer_is_past_is_refused_at_once():
    """Two coordinators that saw the DHT differently can put a daemon in a group it never runs; the members who
    ask it for a shard must not wait out the round timeout for a group it will never open."""

    class Ctx:
        remote_id = "b"

    async def ask(version, wait):
        servicer = AveragingServicer("run", "a", TrafficStats(), max_wait=60.0,
                                     past=lambda fragment, v: fragment == 0 and v < 5)
        header = {"group_id": "never-opened", "weight": 1.0, "numel": 4, "wait": wait, "norm": 0.0, "codec": "none",
                  "fragment": 0, "version": version}

        async def requests():
            yield pack_request(header)

        t0 = time.monotonic()
        answers = [unpack(m, {}) async for m in servicer.rpc_aggregate(requests(), Ctx())]
        return answers, time.monotonic() - t0

    # Past round 3: refused without waiting (bounded at 10 s here, far below the 60 s it would otherwise wait).
    answers, _ = asyncio.run(asyncio.wait_for(ask(3, wait=60.0), 10.0))
    assert not answers[0]["ok"] and "unknown group" in answers[0]["error"]
    assert answers[0]["past"] is True  # the group will complete for nobody: its members decide the round anew
    # Not past round 5: it may still open the group, so the request waits for it as long as asked.
    answers, seconds = asyncio.run(ask(5, wait=0.5))
    assert not answers[0]["ok"] and seconds >= 0.45 and "past" not in answers[0]


def _spec(members=("a", "b", "c")):
    return GroupSpec(run_id="r", fragment=0, version=1, attempt=0, members=tuple(members), numel=8, mode="rda")


@pytest.mark.parametrize("header,kind", [
    ({"weight": float("inf"), "norm": 1.0, "contributors": ["a"]}, "reducer_weight"),  # the reproduced attack
    ({"weight": float("nan"), "norm": 1.0, "contributors": ["a"]}, "reducer_weight"),
    ({"weight": 0.0, "norm": 1.0, "contributors": ["a"]}, "reducer_weight"),
    ({"weight": 3.1e15, "norm": 1.0, "contributors": ["a"]}, "reducer_weight"),  # above 3 members' largest
    ({"weight": 5.0, "norm": float("inf"), "contributors": ["a"]}, "reducer_norm"),
    ({"weight": 5.0, "norm": -1.0, "contributors": ["a"]}, "reducer_norm"),
    ({"weight": 5.0, "norm": 1.0, "contributors": []}, "reducer_contributors"),
    ({"weight": 5.0, "norm": 1.0, "contributors": ["a", "a"]}, "reducer_contributors"),
    ({"weight": 5.0, "norm": 1.0, "contributors": ["a", "mallory"]}, "reducer_contributors"),
    ({"weight": 5.0, "norm": 1.0, "contributors": ["a", 7]}, "reducer_contributors"),
])
def test_a_reducers_impossible_scalars_are_refused_with_their_kind(header, kind):
    from atoll.protocols.averaging import check_answer

    assert check_answer(header, _spec())[1] == kind
    assert check_answer({"weight": 5.0, "norm": 1.0, "contributors": ["c", "a"]}, _spec()) is None


def test_no_single_reducer_sets_the_rounds_weight_or_norm():
    """The replica's weight was the largest claimed by any shard, and RDA's norm came from that shard: one lying
    reducer set both. Now both are the median over shards, the same on every member."""
    from atoll.protocols.averaging import combine_scalars
    from atoll.protocols.reducer import ShardResult

    def shard(weight, norm):
        return ShardResult(torch.zeros(2), weight, ["a"], norm, None)

    honest = [shard(12.0, 2.0), shard(12.0, 2.0), shard(12.0, 2.0)]
    assert combine_scalars(honest, rda=True) == (12.0, 2.0)
    liar = [shard(12.0, 2.0), shard(1e15, 1e29), shard(12.0, 2.0)]
    assert combine_scalars(liar, rda=True) == (12.0, 2.0)
    assert combine_scalars(liar, rda=False) == (12.0, None)
    # An even count takes the lower middle: a liar pushing up cannot move it.
    assert combine_scalars([shard(12.0, 2.0), shard(1e15, 1e29)], rda=True) == (12.0, 2.0)


def _answer(spec, deltas, weights, clip=4.0, scale=1.0):
    """A reducer's answer to ``deltas`` (one per member, as members send them: encoded, then decoded): its header,
    the norm floor of its payload (×``scale``: a hostile reducer's), and each member's own (weight, norm, size)."""
    from atoll.protocols import codecs
    from atoll.protocols.averaging import _size
    from atoll.protocols.reducer import _Reduction

    sent = {m: codecs.decode(codecs.encode(d.float(), spec.codec, spec.block)) for m, d in zip(spec.members, deltas)}
    norms = {m: float(torch.linalg.vector_norm(d.double())) for m, d in zip(spec.members, deltas)}

    async def reduce():
        reduction = _Reduction(spec, (0, spec.numel), 10.0, clip)
        for m, w in zip(spec.members, weights):
            reduction.parts[m] = (w, sent[m], norms[m])
        result = reduction._compute()
        reduction._timer.cancel()
        return result

    result = asyncio.run(reduce())
    payload = result.payload if scale == 1.0 else codecs.encode(codecs.decode(result.payload) * scale, spec.codec,
                                                                 spec.block)
    header = {"weight": result.weight, "contributors": result.contributors, "norm": result.norm,
              "parts": result.parts}
    own = {m: (w, norms[m], _size(sent[m], norms[m], spec.mode == "rda")) for m, w in zip(spec.members, weights)}
    from atoll.protocols.codecs import norm_floor
    return header, norm_floor(payload), own


def _deltas(members, n=600, seed=0):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=gen, dtype=torch.float64)
    return [(base + 0.7 * torch.randn(n, generator=gen, dtype=torch.float64)) * (1 + 0.3 * k)
            for k in range(members)]


@pytest.mark.parametrize("merge", ["clip", "trimmed", "centered"])
@pytest.mark.parametrize("codec", ["none", "int8", "int4", "int2"])
@pytest.mark.parametrize("mode", ["mean", "rda"])
def test_an_honest_reducers_shard_passes_and_one_times_minus_five_does_not(merge, codec, mode):
    from atoll.protocols.averaging import check_shard

    for m in (2, 3, 4, 5):
        members = tuple(f"p{k}" for k in range(m))
        spec = GroupSpec("run", 0, 1, 0, members, 600, mode=mode, codec=codec, block=64, merge=merge)
        deltas, weights = _deltas(m, seed=m), [1.0 + k for k in range(m)]
        reducer = members[-1]
        for me in members[:-1]:
            header, floor, own = _answer(spec, deltas, weights)
            assert check_shard(header, spec, reducer, me, [own[me]], floor, 4.0) is None
            if merge == "centered" and m > 2:
                continue  # centered clipping's bound grows with its iterations: ×5 fits it (docs/security.md)
            header, floor, own = _answer(spec, deltas, weights, scale=-5.0)
            problem = check_shard(header, spec, reducer, me, [own[me]], floor, 4.0)
            assert problem is not None and problem[1] == "reducer_shard", (m, me, problem)


def test_a_reducer_that_misstates_our_part_or_sends_malformed_scalars_is_refused():
    from atoll.protocols.averaging import check_shard

    members = ("a", "b", "c")
    spec = GroupSpec("run", 0, 1, 0, members, 600, codec="int8", block=64, merge="trimmed")
    header, floor, own = _answer(spec, _deltas(3), [1.0, 1.0, 1.0])
    assert check_shard(header, spec, "c", "a", [own["a"]], floor, 4.0) is None
    bigger = dict(header, parts=[[1.0, p[1], p[2] * 4] if i == 0 else p for i, p in enumerate(header["parts"])])
    assert check_shard(bigger, spec, "c", "a", [own["a"]], floor, 4.0)[1] == "reducer_parts"
    assert check_shard(bigger, spec, "c", "b", [own["b"]], floor, 4.0) is None  # only "a" can tell
    # A part we sent this reducer earlier for the same group (it keeps the first it got) is ours too.
    assert check_shard(bigger, spec, "c", "a", [own["a"], (1.0, own["a"][1], own["a"][2] * 4)], floor, 4.0) is None
    for parts in ([[1.0, 1.0]] * 3, [[1.0, 1.0, float("nan")]] * 3, [[0.0, 1.0, 1.0]] * 3, [[1, 1.0, 1.0]] * 3,
                  header["parts"][:2], "many"):
        assert check_shard(dict(header, parts=parts), spec, "c", "a", [own["a"]], floor, 4.0)[1] == "reducer_parts"


def test_reducers_still_out_once_the_others_answered_get_a_deadline_of_their_own():
    from atoll.protocols import averaging

    async def main(own_late: bool):
        loop = asyncio.get_running_loop()
        quick, mute, own = loop.create_future(), loop.create_future(), loop.create_future()
        loop.call_later(0.05, quick.set_result, "shard")
        loop.call_later(0.05 if not own_late else 0.6, own.set_result, "own shard")
        started = time.monotonic()
        late, abandoned = await averaging._await_answers({"quick": quick, "mute": mute, "me": own}, "me", 0.2)
        assert abandoned == []
        return late, time.monotonic() - started, mute.cancelled()

    late, took, cancelled = asyncio.run(main(False))
    assert late == ["mute"] and cancelled and 0.2 <= took < 1.0  # the grace after the others: not the round's bound
    # While our own shard is still out, nobody is given up on (our own reduction has its own timer).
    late, took, _ = asyncio.run(main(True))
    assert late == ["mute"] and took >= 0.6 + 0.2


def test_the_answer_grace_is_a_floor_and_the_shard_at_the_slowest_supported_rate():
    """A small shard gets the floor; a large one what its transfer takes at ``ANSWER_MIN_RATE`` on top."""
    from atoll.protocols import averaging

    assert averaging.answer_grace(0) == averaging.ANSWER_GRACE
    mb = 1024 * 1024
    assert averaging.answer_grace(mb) == pytest.approx(averaging.ANSWER_GRACE + mb / averaging.ANSWER_MIN_RATE)
    assert averaging.answer_grace(mb) > 30  # a megabyte behind a 256 kbit/s uplink: half a minute
    assert averaging.answer_grace(4096) < 2.5  # a nano shard: the floor, nearly


def test_once_a_reducer_failed_the_others_are_not_waited_for():
    """The attempt cannot merge any more: a reducer refused the group, or its shard was refused. (Waiting for a
    hostile reducer that holds its answer until the round's timeout cost the second review's swarm 30 s a round.)"""
    from atoll.protocols import averaging

    async def main():
        loop = asyncio.get_running_loop()
        refusing, mute, own = loop.create_future(), loop.create_future(), loop.create_future()
        loop.call_later(0.05, refusing.set_exception, averaging.GroupRefused("unknown group"))
        started = time.monotonic()
        out = await averaging._await_answers({"refusing": refusing, "mute": mute, "me": own}, "me", 10.0)
        return out, time.monotonic() - started, own.cancelled()

    (late, abandoned), took, own_cancelled = asyncio.run(main())
    assert late == [] and sorted(abandoned) == ["me", "mute"] and took < 0.5
    assert own_cancelled  # (a stand-in here: allreduce shields its own reduction, which goes on for the others)


def test_strikes_count_misses_in_a_row():
    from atoll.protocols.cooldown import Strikes

    strikes = Strikes(3)
    assert [strikes.miss("x") for _ in range(2)] == [False, False]
    strikes.hit("x")
    assert [strikes.miss("x") for _ in range(3)] == [False, False, True]
    assert strikes.miss("x") is False  # counting starts over after an offence


def test_strikes_count_a_repeated_event_once():
    from atoll.protocols.cooldown import Strikes

    strikes = Strikes(3)
    assert [strikes.miss("x", "g1") for _ in range(5)] == [False] * 5  # one event, however often
    assert strikes.miss("x", "g2") is False and strikes.miss("x", "g3") is True  # three events in a row
    assert strikes.miss("x", "g3") is False  # after an offence the count starts over, its event forgotten
    strikes.hit("x")
    assert [strikes.miss("x", "g4"), strikes.miss("x", "g4"), strikes.miss("x")] == [False, False, False]
    assert strikes.miss("x") is True  # misses without an event always count

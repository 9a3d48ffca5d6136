"""The bookkeeping of ``protocols/p2p_guard.py`` (no sockets): the frame bound, stream counters, bounded membership
checks, the first-message deadline, and the averaging servicer's membership check before any waiting."""

import asyncio
import random

import pytest
from hivemind.p2p import P2P

from atoll.protocols import p2p_guard
from atoll.protocols.reducer import AveragingServicer
from atoll.protocols.p2p_guard import (
    MAX_FRAME_BYTES,
    FrameTooLarge,
    MemberGate,
    RateLimitedLog,
    StreamGuard,
    StreamLimits,
    bounded_receive_raw_data,
    frame_allowed,
)
from atoll.protocols.stats import TrafficStats
from atoll.protocols.wire import MAX_MESSAGE_BYTES, PART_BYTES, pack_request, unpack


def _frame(payload: bytes, declared: int | None = None) -> bytes:
    return (len(payload) if declared is None else declared).to_bytes(8, "big") + payload


def _reader(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def test_the_frame_bound_fits_atolls_largest_message_and_nothing_far_above():
    rng = random.Random(0)
    for n in [0, 1, MAX_FRAME_BYTES - 1, MAX_FRAME_BYTES, MAX_FRAME_BYTES + 1, 1 << 30, (1 << 64) - 1, -1] + [
            rng.randrange(0, 1 << 40) for _ in range(1000)]:
        assert frame_allowed(n) == (0 <= n <= MAX_FRAME_BYTES)
    # The largest envelope atoll accepts (wire.unpack) in an ExpertRequest, and a data part with its framing.
    assert len(pack_request({"data": b"x" * PART_BYTES}).SerializeToString()) <= MAX_FRAME_BYTES
    biggest = pack_request({}).__class__(metadata=b"m" * MAX_MESSAGE_BYTES).SerializeToString()
    assert MAX_MESSAGE_BYTES < len(biggest) <= MAX_FRAME_BYTES < 2 * MAX_MESSAGE_BYTES


def test_bounded_reader_reads_frames_up_to_the_bound_and_refuses_a_larger_declaration_unread():
    async def run():
        small = await bounded_receive_raw_data(_reader(_frame(b"hello")))
        at_cap = await bounded_receive_raw_data(_reader(_frame(b"\0" * MAX_FRAME_BYTES)))
        reader = _reader(_frame(b"abc", declared=1 << 30), eof=False)  # a 1 GiB declaration, 3 bytes sent
        with pytest.raises(FrameTooLarge) as info:
            await asyncio.wait_for(bounded_receive_raw_data(reader), 1.0)  # refused at once: it does not wait for it
        return small, len(at_cap), info.value, reader

    small, at_cap, error, reader = asyncio.run(run())
    assert small == b"hello" and at_cap == MAX_FRAME_BYTES
    assert isinstance(error, asyncio.IncompleteReadError) and error.declared == 1 << 30  # hivemind: "stream ended"
    assert len(reader._buffer) == 3  # nothing past the header was read


def test_install_replaces_hiveminds_reader_once_and_fails_loudly_if_it_is_gone(monkeypatch):
    monkeypatch.setattr(P2P, "receive_raw_data", P2P.__dict__["receive_raw_data"])  # restored after the test
    p2p_guard.install()
    p2p_guard.install()
    assert P2P.receive_raw_data is bounded_receive_raw_data
    assert "receive_raw_data" in P2P.receive_protobuf.__code__.co_names  # hivemind's loop still goes through it

    class Reshaped:  # a hivemind whose P2P reads frames some other way
        HEADER_LEN, BYTEORDER = 8, "big"

        @staticmethod
        async def receive_protobuf(t, reader):
            return await reader.readexactly(8)

    monkeypatch.setattr(p2p_guard, "P2P", Reshaped)
    with pytest.raises(RuntimeError, match="cannot be installed"):
        p2p_guard.install()


def test_stream_limits_match_a_reference_under_random_traffic():
    rng = random.Random(1)
    limits = StreamLimits(per_peer=3, total=10, strangers=4)
    streams: list[tuple[str, bool]] = []  # the reference: every open stream
    peers = [f"p{i}" for i in range(8)]
    for _ in range(5000):
        if streams and rng.random() < 0.45:
            peer, member = streams.pop(rng.randrange(len(streams)))
            limits.release(peer, member)
        else:
            peer = rng.choice(peers)
            member = peer < "p4"
            want = (sum(p == peer for p, _ in streams) < 3 and len(streams) < 10
                    and (member or sum(not m for _, m in streams) < 4))
            assert limits.admit(peer, member) == want
            if want:
                streams.append((peer, member))
        assert limits.open_total == len(streams)
        assert limits.open_strangers == sum(not m for _, m in streams)
        assert limits.open == {p: n for p in peers if (n := sum(q == p for q, _ in streams))}


def test_member_gate_looks_a_peer_up_once_and_bounds_lookups_in_all():
    async def run():
        release = asyncio.Event()
        looks = []

        async def look(peer):
            looks.append(peer)
            await release.wait()
            return peer.startswith("joiner")

        gate = MemberGate(lambda peer: peer == "member", look, total=2)
        assert await gate.check("member") is None  # in the table: no wait, no lookup
        # A joiner's four downloads at once, and a stranger's three streams: one lookup each, shared.
        waits = [asyncio.ensure_future(gate.check(p)) for p in ("joiner", "x", "joiner", "x", "joiner", "x",
                                                                "joiner")]
        await asyncio.sleep(0)
        refused = await gate.check("y")  # two peers are being looked up: a third is refused at once
        assert await gate.check("member") is None  # members are never held up by strangers' waits
        waits[0].cancel()  # one of the joiner's streams closes: the others still get the answer
        await asyncio.sleep(0)
        release.set()
        answers = await asyncio.gather(*waits[1:])
        return refused, answers, looks, gate

    refused, answers, looks, gate = asyncio.run(run())
    assert refused == "member_check_limit"
    assert answers == ["unauthorized", None, "unauthorized", None, "unauthorized", None]
    assert sorted(looks) == ["joiner", "x"]
    assert gate.lookups == {}


class _Info:
    def __init__(self, peer):
        self.peer_id = peer


class _Writer:
    """Closing it ends the stream as p2pd's socket would: the reader sees the end."""

    def __init__(self, reader):
        self.reader, self.closed = reader, False

    def close(self):
        if not self.closed:
            self.closed = True
            self.reader.feed_eof()


async def _hivemind_like_handler(info, reader, writer):
    """Reads frames until the stream ends, as hivemind's stream loop does."""
    while True:
        try:
            await bounded_receive_raw_data(reader)
        except asyncio.IncompleteReadError:
            return


def test_guard_closes_idle_streams_counts_refusals_and_releases_every_slot():
    stats = TrafficStats()

    async def run():
        limits = StreamLimits(per_peer=2, total=3, strangers=1)
        guard = StreamGuard(stats.reject, known=lambda peer: peer != "stranger", limits=limits,
                            first_message_timeout=0.2, arrived=stats.stream_in)
        handler = guard.wrap(_hivemind_like_handler)
        idle = [asyncio.StreamReader() for _ in range(4)]
        writers = [_Writer(r) for r in idle]
        tasks = [asyncio.ensure_future(handler(_Info(p), r, w))
                 for p, r, w in zip(("a", "a", "a", "stranger"), idle, writers)]
        busy = asyncio.StreamReader()
        busy.feed_data(_frame(b"first"))  # this stream's first message arrived: no deadline afterwards
        tasks.append(asyncio.ensure_future(handler(_Info("b"), busy, _Writer(busy))))
        await asyncio.sleep(0.05)
        third_of_a = writers[2].closed  # per-peer limit: refused at once
        full = limits.open_total
        await asyncio.sleep(0.4)
        idle_closed = [w.closed for w in writers]
        busy.feed_eof()
        await asyncio.gather(*tasks)
        return third_of_a, full, idle_closed, limits

    third_of_a, full, idle_closed, limits = asyncio.run(run())
    assert third_of_a and full == 3  # a, a, and the stranger (b found the total full)
    assert idle_closed == [True, True, True, True]
    assert stats.rejected_by_kind == {"stream_limit": 2, "first_message_timeout": 3}
    assert stats.streams_in == 5  # every stream that reached the guard, served or refused
    assert limits.open == {} and limits.open_total == 0 and limits.open_strangers == 0


def test_guard_refuses_an_oversized_frame_as_an_offence_and_strangers_failing_the_gate():
    stats = TrafficStats()
    offenders = []
    stats.on_offence = lambda peer, kind: offenders.append((peer, kind))

    async def run():
        async def look(peer):
            return False

        guard = StreamGuard(stats.reject, known=lambda peer: peer == "member",
                            gate=MemberGate(lambda peer: peer == "member", look))
        handler = guard.wrap(_hivemind_like_handler)
        big = _reader(_frame(b"", declared=1 << 30), eof=False)
        stranger = _reader(_frame(b"never read"), eof=False)
        await asyncio.wait_for(handler(_Info("member"), big, _Writer(big)), 2)
        await asyncio.wait_for(handler(_Info("outsider"), stranger, _Writer(stranger)), 2)
        return stranger, guard

    stranger, guard = asyncio.run(run())
    assert stats.rejected_by_kind == {"frame_too_large": 1, "unauthorized": 1}
    assert offenders == [("member", "frame_too_large")]  # an outsider's refusal is counted, not remembered
    assert len(stranger._buffer) == len(_frame(b"never read"))  # refused before anything was read
    assert guard.limits.open_total == 0


def test_rate_limited_log_says_how_many_it_left_out(caplog):
    now = [0.0]
    log = RateLimitedLog(every=10.0, clock=lambda: now[0])
    logged = []
    for t in (0.0, 1.0, 2.0, 11.0, 12.0, 25.0):
        now[0] = t
        logged.append(log("k", "refused %s", t))
    assert logged == [True, False, False, True, False, True]
    assert "2 more like it not logged" in caplog.records[1].getMessage()
    assert log("other", "another kind") is True


def test_a_non_member_takes_no_waiting_slot_and_has_nothing_read():
    class Ctx:
        remote_id = "outsider"

    async def run():
        stats = TrafficStats()
        asked = []

        async def authorize(peer):
            asked.append(peer)
            return False

        servicer = AveragingServicer("run", "a", stats, max_wait=60.0, authorize=authorize)
        read = []

        async def requests():
            read.append(1)
            yield pack_request({"group_id": "g", "weight": 1.0, "numel": 4, "wait": 60.0, "norm": 0.0,
                                "codec": "none"})

        answers = [unpack(m, {}) async for m in servicer.rpc_aggregate(requests(), Ctx())]
        return answers, stats, asked, read, servicer

    answers, stats, asked, read, servicer = asyncio.run(asyncio.wait_for(run(), 5))
    assert not answers[0]["ok"] and "not a member" in answers[0]["error"]
    assert asked == ["outsider"] and read == [] and servicer._waiting == {} and servicer._opened == {}
    assert stats.rejected_by_kind == {"unauthorized": 1}

"""State downloads resume where a dying donor stopped, never splice two replicas, and spread over donors.

The donors are real ``StateServicer`` handlers called in-process (no sockets): the opener hands the request
straight to the donor's handler, and a donor "dies" by raising from its part-sending step after k parts.
"""

import asyncio
from types import SimpleNamespace

import torch

from atoll.models.outer import tensor_hash
from atoll.node.rounds.donors import donor_order
from atoll.protocols.state_serve import StateServicer
from atoll.protocols.state_sync import ReplicaState, download_state
from atoll.protocols.stats import TrafficStats
from atoll.protocols.wire import pack_request, unpack
from support.records import progress_record

CONTEXT = SimpleNamespace(remote_id="QmRequester")  # what the servicer reads of hivemind's P2PContext

NUMEL = 1000  # 8000 bytes of payload: 8 parts of 1 KiB (the last one shorter)
PART = 1024


class DonorDied(Exception):
    pass


class DyingServicer(StateServicer):
    """A donor whose stream breaks off before it sends part ``die_after`` of a transfer (never, when None)."""

    def __init__(self, *args, die_after=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.die_after = die_after

    def _send_part(self, n, part):
        if n == self.die_after:
            raise DonorDied
        return super()._send_part(n, part)


def replica(seed, version=3):
    g = torch.Generator().manual_seed(seed)
    params, momentum = torch.randn(NUMEL, generator=g), torch.randn(NUMEL, generator=g)
    digest = tensor_hash(params, momentum)
    return ReplicaState(version, 7.0, digest, params, momentum, schedule_step=40, ancestors=(digest,))


class Donor:
    def __init__(self, state, die_after=None, tamper=False):
        self.stats = TrafficStats()
        self.requests = []
        self.state = state

        def snapshot(_p):
            if not tamper:
                return state
            bad = state.params.clone()
            bad[-1] += 1.0  # the bytes near the end differ from what the header's digest promises
            return ReplicaState(state.version, state.weight, state.digest, bad, state.momentum, state.schedule_step,
                                ancestors=state.ancestors)

        self.servicer = DyingServicer(snapshot, 1, self.stats, part_bytes=PART, die_after=die_after)


def opener(donors):
    async def open_stream(name, request):
        donors[name].requests.append(request)
        return donors[name].servicer.rpc_download_state(pack_request(request), CONTEXT)

    return open_stream


def fetch(donors, order, progress=lambda received: None):
    stats = TrafficStats()
    state = asyncio.run(download_state(opener(donors), order, 0, NUMEL, 5.0, stats, progress=progress))
    return state, stats


def test_one_donor_downloads_and_verifies():
    donors = {"a": Donor(replica(1))}
    state, stats = fetch(donors, ["a"])
    assert state.digest == donors["a"].state.digest and torch.equal(state.params, donors["a"].state.params)
    assert state.donors == ("a",) and state.resumed_bytes == 0
    assert stats.bytes_received == donors["a"].stats.bytes_sent == 8 * NUMEL


def test_donor_dying_mid_stream_is_resumed_by_a_donor_with_the_same_replica():
    same = replica(1)
    donors = {"a": Donor(same, die_after=3), "b": Donor(same)}
    heard = []
    state, stats = fetch(donors, ["a", "b"], heard.append)
    # The bytes received so far after each part, across the hand-over: no part counted twice, none left out.
    assert heard == [PART * i for i in range(1, len(heard))] + [8 * NUMEL]
    assert len(heard) == -(-8 * NUMEL // PART)
    assert state is not None and state.digest == same.digest
    assert torch.equal(state.params, same.params) and torch.equal(state.momentum, same.momentum)
    assert state.donors == ("a", "b") and state.resumed_bytes == 3 * PART
    assert donors["b"].requests == [{"fragment": 0, "offset": 3 * PART, "digest": same.digest}]
    # b sent only what a had not: nothing was received twice.
    assert donors["a"].stats.bytes_sent == 3 * PART
    assert donors["b"].stats.bytes_sent == 8 * NUMEL - 3 * PART
    assert stats.bytes_received == 8 * NUMEL and stats.rejected == 0


def test_donor_with_another_replica_restarts_from_zero():
    a, b = replica(1), replica(2, version=4)
    donors = {"a": Donor(a, die_after=5), "b": Donor(b)}
    state, _ = fetch(donors, ["a", "b"])
    assert state.digest == b.digest and torch.equal(state.params, b.params)  # not a splice of a and b
    assert state.donors == ("b",) and state.resumed_bytes == 0
    assert donors["b"].stats.bytes_sent == 8 * NUMEL


def test_lying_resumer_is_caught_by_the_hash_and_the_next_donor_starts_over():
    same = replica(1)
    donors = {"a": Donor(same, die_after=2), "liar": Donor(same, tamper=True), "c": Donor(same)}
    state, stats = fetch(donors, ["a", "liar", "c"])
    assert state.digest == same.digest and torch.equal(state.params, same.params)
    assert state.donors == ("c",) and state.resumed_bytes == 0
    assert donors["c"].requests == [{"fragment": 0}]
    assert stats.rejected_by_kind == {"state": 1}


def test_every_donor_failing_gives_none():
    donors = {"a": Donor(replica(1), die_after=1), "b": Donor(replica(1), die_after=2)}
    state, _ = fetch(donors, ["a", "b"])
    assert state is None


def test_bad_offsets_are_refused_and_counted():
    donor = Donor(replica(1))

    async def first(request):
        stream = donor.servicer.rpc_download_state(pack_request(request), CONTEXT)
        return unpack(await anext(stream), {"ok": bool})

    for bad in (-4, 3, "x", True):
        assert asyncio.run(first({"fragment": 0, "offset": bad, "digest": donor.state.digest}))["ok"] is False
    assert donor.stats.rejected_by_kind == {"state_request": 4}
    past_the_end = asyncio.run(first({"fragment": 0, "offset": 8 * NUMEL + 4, "digest": donor.state.digest}))
    assert past_the_end["ok"] and past_the_end["offset"] == 0


def test_donor_order_spreads_fragments_over_the_holders_of_the_heaviest_replica():
    peers = [progress_record("p1", [5, 5, 5, 5], list("abcd")), progress_record("p2", [5, 5, 5, 5], list("abcd")),
             progress_record("p3", [5, 5, 5, 5], list("abcd")), progress_record("old", [4, 4, 4, 4], list("wxyz"))]
    orders = [[peer.peer_id for peer in donor_order(p, peers)] for p in range(4)]
    assert orders == [["p1", "p2", "p3", "old"], ["p2", "p3", "p1", "old"], ["p3", "p1", "p2", "old"],
                      ["p1", "p2", "p3", "old"]]
    # A peer with a different replica of the same version is not a holder of the heaviest one.
    peers[1] = progress_record("p2", [5, 6, 5, 5], list("abcd"))
    assert [peer.peer_id for peer in donor_order(1, peers)] == ["p2", "p1", "p3", "old"]
    assert donor_order(0, []) == []


def claim(state):
    return state.version, state.weight, state.digest


def fetch_claims(donors, order, claims):
    stats, refused = TrafficStats(), []
    state = asyncio.run(download_state(opener(donors), order, 0, NUMEL, 5.0, stats,
                                       on_failure=lambda donor, e: refused.append((donor, e)), claims=claims))
    return state, stats, refused


class IgnoresWant(Donor):
    """A hostile donor: it serves what it holds whatever the requester wants (a copier of an honest claim)."""

    def __init__(self, state):
        super().__init__(state)
        inner = self.servicer.rpc_download_state

        def rpc_download_state(request, context):
            msg = unpack(request, {"fragment": int})
            msg.pop("want", None)
            return inner(pack_request(msg), context)

        self.servicer.rpc_download_state = rpc_download_state


def test_a_donor_that_sends_another_replica_than_its_claim_is_refused_and_the_next_one_delivers():
    honest, made_up = replica(1), replica(2, version=9)  # the made-up one is heavier: before, it would be adopted
    donors = {"copier": IgnoresWant(made_up), "honest": Donor(honest)}
    state, stats, refused = fetch_claims(donors, ["copier", "honest"], {"copier": claim(honest), "honest": claim(honest)})
    assert state.digest == honest.digest and state.donors == ("honest",)
    assert stats.rejected_by_kind == {"not_the_claim": 1}  # an offence of the copier
    assert [d for d, _ in refused] == ["copier"]
    assert donors["copier"].stats.bytes_sent == 0  # refused at its header: none of its bytes were read


def test_a_donor_that_moved_on_refuses_saying_what_it_holds_and_no_offence_is_counted():
    old, new = replica(1), replica(2, version=4)
    donors = {"moved": Donor(new), "still": Donor(old)}
    state, stats, refused = fetch_claims(donors, ["moved", "still"], {"moved": claim(old), "still": claim(old)})
    assert state.digest == old.digest and state.donors == ("still",)
    assert donors["moved"].requests[0]["want"] == old.digest
    (donor, error), = refused
    assert donor == "moved" and error.holds == claim(new)
    assert stats.rejected == 0 and donors["moved"].stats.bytes_sent == 0


def test_a_claim_with_another_weight_or_version_is_not_the_claim():
    state = replica(1)
    for wrong in ((state.version + 1, state.weight, state.digest), (state.version, state.weight * 2, state.digest)):
        got, stats, _ = fetch_claims({"a": IgnoresWant(state)}, ["a"], {"a": wrong})
        assert got is None and stats.rejected_by_kind == {"not_the_claim": 1}


def test_without_a_claim_a_donor_is_checked_against_its_own_header_only():
    state = replica(1)
    got, stats, _ = fetch_claims({"a": Donor(state)}, ["a"], {})
    assert got.digest == state.digest and stats.rejected == 0


def test_transfers_in_flight_share_one_copy_and_a_peer_gets_two_at_once():
    """The second review: 32 downloads of the largest fragment, never read, each held its own copy of the replica
    (+160 MiB on tiny). Transfers of one replica share one copy of its bytes, released with the last of them; a
    peer has at most ``MAX_TRANSFERS_PER_PEER`` transfers in flight, more are refused ("busy")."""
    from atoll.protocols.state_sync import MAX_TRANSFERS_PER_PEER

    state = replica(1)
    snapshots = []

    def snapshot(_p):
        snapshots.append(1)
        return state

    stats = TrafficStats()
    servicer = StateServicer(snapshot, 1, stats, part_bytes=PART,
                             identity=lambda _p: (state.version, state.weight, state.digest))

    async def main():
        streams, headers = [], []
        for i in range(6):  # three peers, two transfers each, none read past the header
            ctx = SimpleNamespace(remote_id=f"Qm{i // 2}")
            stream = servicer.rpc_download_state(pack_request({"fragment": 0}), ctx)
            headers.append(unpack(await anext(stream), {"ok": bool}))
            streams.append(stream)
        assert all(h["ok"] for h in headers)
        assert len(servicer._shared) == 1 and next(iter(servicer._shared.values())).users == 6
        assert len(snapshots) == 1  # one copy for six transfers
        extra = servicer.rpc_download_state(pack_request({"fragment": 0}), SimpleNamespace(remote_id="Qm0"))
        refused = unpack(await anext(extra), {"ok": bool})
        assert refused == {"ok": False, "error": "busy"} and stats.rejected_by_kind == {"busy": 1}
        assert MAX_TRANSFERS_PER_PEER == 2
        for stream in streams:
            await stream.aclose()  # the requesters went away
        assert servicer._shared == {} and servicer._active == {}
        # A request for a replica we no longer hold is refused without a copy of the one we hold.
        elsewhere = servicer.rpc_download_state(pack_request({"fragment": 0, "want": "other"}), CONTEXT)
        moved = unpack(await anext(elsewhere), {"ok": bool})
        assert moved["error"] == "moved on" and moved["holds"][2] == state.digest and len(snapshots) == 1

    asyncio.run(main())


def test_a_requester_never_asks_one_donor_for_more_than_it_serves():
    """A joiner downloads every fragment at once, perhaps all from one donor: ``slots`` keeps its transfers from
    one donor to ``MAX_TRANSFERS_PER_PEER`` at a time, so none is refused as busy."""
    from atoll.protocols.state_sync import MAX_TRANSFERS_PER_PEER

    donor = Donor(replica(1))
    at_once, most = [0], [0]
    inner = donor.servicer.rpc_download_state

    async def counting(request, context):
        at_once[0] += 1
        most[0] = max(most[0], at_once[0])
        try:
            async for message in inner(request, context):
                await asyncio.sleep(0)
                yield message
        finally:
            at_once[0] -= 1

    donor.servicer.rpc_download_state = counting

    async def main():
        slots = {}

        def slot(name):
            return slots.setdefault(name, asyncio.Semaphore(MAX_TRANSFERS_PER_PEER))

        return await asyncio.gather(*(download_state(opener({"a": donor}), ["a"], 0, NUMEL, 5.0, TrafficStats(),
                                                     slots=slot) for _ in range(5)))

    states = asyncio.run(main())
    assert all(s is not None for s in states) and most[0] == MAX_TRANSFERS_PER_PEER


def test_a_transfer_whose_reader_stalls_is_cut_and_its_copy_released(monkeypatch):
    """A requester that keeps its stream open but stops reading held the transfer (and its share of the replica's
    bytes) as long as it liked. Each part must now leave within ``PART_DEADLINE`` of the previous one; past it the
    task that writes the transfer (hivemind's, emulated here: it awaits each write) is cancelled."""
    from atoll.protocols import state_serve

    monkeypatch.setattr(state_serve, "PART_DEADLINE", 0.2)
    state = replica(1)
    stats = TrafficStats()
    servicer = StateServicer(lambda _p: state, 1, stats, part_bytes=PART,
                             identity=lambda _p: (state.version, state.weight, state.digest))

    async def main():
        written, stalled = [], asyncio.Event()

        async def process():  # hivemind's _process_stream: iterate the handler, await each write
            stream = servicer.rpc_download_state(pack_request({"fragment": 0}), CONTEXT)
            try:
                async for response in stream:
                    written.append(response)
                    if len(written) == 3:
                        await stalled.wait()  # the reader stopped reading: the write never completes
            finally:
                await stream.aclose()

        task = asyncio.create_task(process())
        try:
            await asyncio.wait_for(asyncio.shield(task), 5.0)
        except asyncio.CancelledError:
            pass
        return task, len(written)

    task, written = asyncio.run(main())
    assert task.cancelled() and written == 3
    assert stats.rejected_by_kind == {"stalled_transfer": 1}
    assert servicer._shared == {} and servicer._active == {}


def test_a_transfer_read_in_time_is_not_cut(monkeypatch):
    from atoll.protocols import state_serve

    monkeypatch.setattr(state_serve, "PART_DEADLINE", 0.2)
    donors = {"a": Donor(replica(1))}
    state, _ = fetch(donors, ["a"])
    assert state is not None and donors["a"].stats.rejected == 0

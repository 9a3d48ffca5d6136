"""Property-based fuzzing of every decoder and record validator with random and mutated input.

The property everywhere: a decoder either returns a valid result (right size, finite values) or raises its own
error type (``CodecError``/``WireError``, both ``ValueError`` subclasses with a ``kind``); a record parser returns
a valid record or None. Never another exception, never a NaN let through. Examples are few per test (the suite
must stay fast); mutations start from valid messages so that they reach the deep checks, not just the header.
"""

import asyncio
import math
import struct

import msgpack
import pytest
import torch
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from atoll.protocols.identity import RecordSigner
from atoll.protocols import codecs, state_serve, state_sync
from atoll.protocols.reducer import AveragingServicer, GroupSpec
from atoll.protocols.matchmaking import parse_group_record
from atoll.protocols.record_validator import make_validators
from atoll.protocols.records import (ProgressRecord, parse_open_round, parse_progress, parse_round_record,
                                     parse_run_config, progress_key, progress_shard)
from atoll.protocols.stats import TrafficStats
from atoll.protocols.wire import MAX_MESSAGE_BYTES, WireError, pack_request, pack_response, parts_to_tensor, unpack

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# msgpack-able values of every shape a hostile peer might send.
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70).filter(lambda i: -2**63 <= i < 2**64),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40), st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(st.text(max_size=12), inner, max_size=5)),
                      max_leaves=20)


def _valid_payloads():
    torch.manual_seed(0)
    x = torch.randn(300)
    return [codecs.encode(x, c, 64) for c in codecs.CODECS]


PAYLOADS = _valid_payloads()


def mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    out = bytearray(data)
    for pos, byte in edits:
        if out:
            out[pos % len(out)] = byte
    return bytes(out[:cut] if cut is not None else out)


def check_decoded(tensor: torch.Tensor, numel: int | None) -> None:
    assert tensor.dtype == torch.float32 and tensor.dim() == 1
    assert numel is None or tensor.numel() == numel
    assert bool(torch.isfinite(tensor).all())


# ---- codecs ---------------------------------------------------------------------------------------------------
@FUZZ
@given(st.binary(max_size=2000), st.one_of(st.none(), st.integers(0, 400)))
def test_decode_random_bytes(data, numel):
    try:
        check_decoded(codecs.decode(data, expected_numel=numel, max_numel=10_000), numel)
    except codecs.CodecError as e:
        assert e.kind in ("codec", "shape", "nonfinite")


@FUZZ
@given(st.sampled_from(range(len(PAYLOADS))), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)),
                                                       max_size=6), st.one_of(st.none(), st.integers(0, 2000)))
def test_decode_mutated_payloads(index, edits, cut):
    data = mutate(PAYLOADS[index], edits, cut)
    try:
        check_decoded(codecs.decode(data, expected_numel=300), 300)
    except codecs.CodecError:
        pass


def _non_finite_examples(test):
    """Every codec with NaN, ±Inf and (bf16) a finite fp32 that rounds to Inf, whatever the search draws."""
    for codec in codecs.CODECS:
        for value in (float("nan"), float("inf"), float("-inf"), 3.4e38):
            test = example(value, 1, codec)(test)
    return test


@FUZZ
@given(st.floats(allow_nan=True, allow_infinity=True, width=32), st.integers(0, 299),
       st.sampled_from(codecs.CODECS))
@_non_finite_examples
def test_a_non_finite_value_never_decodes(value, index, codec):
    """Plant a value in a valid payload, as a value (none, bf16) or a block's scale (block codecs): a non-finite
    one must be refused; a finite one decodes to finite values or is refused."""
    data = bytearray(codecs.encode(torch.ones(300), codec, 64))
    if codec == "bf16":  # the body is bf16 bit patterns: plant the value's (a large finite fp32 may round to Inf)
        bits = torch.tensor([value], dtype=torch.float32).to(torch.bfloat16)
        planted = float(bits.float())
        offset = codecs.HEADER_SIZE + 2 * (index % 5)
        data[offset : offset + 2] = bits.view(torch.int16).numpy().tobytes()
    else:
        planted = float(torch.tensor([value], dtype=torch.float32))
        offset = codecs.HEADER_SIZE + 4 * (index % 5)  # a value (none) or a scale (block codecs)
        data[offset : offset + 4] = struct.pack("<f", value)
    if not math.isfinite(planted):
        with pytest.raises(codecs.CodecError):
            codecs.decode(bytes(data), expected_numel=300)
        return
    try:
        check_decoded(codecs.decode(bytes(data), expected_numel=300), 300)
    except codecs.CodecError:
        pass


# ---- wire envelopes ---------------------------------------------------------------------------------------------
class Msg:
    def __init__(self, metadata):
        self.metadata = metadata


@FUZZ
@given(st.one_of(st.binary(max_size=300), values.map(lambda v: msgpack.packb(v, use_bin_type=True)), values),
       st.dictionaries(st.sampled_from(["a", "group_id", "weight", "data"]),
                       st.sampled_from([str, int, float, bytes, bool, list]), max_size=3))
def test_unpack_random_envelopes(metadata, required):
    try:
        msg = unpack(Msg(metadata), required)
    except WireError as e:
        assert e.kind in ("protocol", "oversize")
        return
    assert isinstance(msg, dict) and set(required) <= set(msg)


def test_unpack_refuses_oversized_metadata():
    with pytest.raises(WireError) as info:
        unpack(Msg(b"\0" * (MAX_MESSAGE_BYTES + 1)), {})
    assert info.value.kind == "oversize"


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=4), st.integers(0, 40))
def test_parts_to_tensor_random(parts, numel):
    try:
        check_decoded(parts_to_tensor(parts, numel), numel)
    except WireError as e:
        assert e.kind in ("shape", "nonfinite")


# ---- DHT records ----------------------------------------------------------------------------------------------
GOOD = dict(peer_id="QmPeer", status="training", device="cpu", ranks=1, algorithm="diloco", step=10, version=2,
            fragment_versions=[2], fragment_weights=[1024.0], fragment_hashes=["abc"], schedule_step=3, tokens=4096,
            tokens_per_s=100.0, loss=2.5, held_out_loss=None, rounds=2, rounds_skipped=0, forks_healed=0,
            tokens_lost=0, goodput=0.9, blocked_s=1.5, bytes_sent=10, bytes_received=20, rejected=0,
            rejected_by_kind={"shape": 1}, clipped=0, time=1.0, reachable=True)


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(GOOD) + ["extra"]), values, max_size=6), st.booleans())
def test_progress_records_are_valid_or_refused(changes, drop):
    rec = {**GOOD, **changes}
    if drop and changes:
        del rec[next(iter(changes))]
    parsed = parse_progress(rec)
    if parsed is not None:
        assert isinstance(parsed, ProgressRecord)
        assert all(math.isfinite(w) and w >= 0 for w in parsed.fragment_weights)
        assert math.isfinite(parsed.time) and len(parsed.rejected_by_kind) <= 32


@FUZZ
@given(values)
def test_record_parsers_take_anything(value):
    assert parse_progress(value) is None or isinstance(value, dict)
    assert parse_run_config(value) is None or isinstance(value, dict)
    rec = parse_round_record(value)
    if rec is not None:
        assert math.isfinite(rec["weight"]) and rec["weight"] > 0 and math.isfinite(rec["time"])
    parsed = parse_open_round(value)
    assert parsed is None or (parsed[1] >= 0 and parsed[2] >= 0)
    groups = parse_group_record(value)
    assert groups is None or all(g == sorted(g) for g in groups)


@FUZZ
@given(st.dictionaries(st.sampled_from(["peer_id", "weight", "time", "fragment", "version", "groups"]), values,
                       max_size=4))
def test_round_records_with_the_right_keys(value):
    test_record_parsers_take_anything.hypothesis.inner_test(value)


@FUZZ
@given(st.one_of(values, st.dictionaries(st.sampled_from(sorted(GOOD)), values, max_size=4).map(
    lambda c: {**GOOD, **c})))
def test_schema_validator_never_raises(value):
    signer = RecordSigner()
    schema = make_validators("run1")[2]  # the run's rules (after signatures and membership): progress by shape
    try:
        serialized = DHTProtocol.serializer.dumps(value)
    except Exception:  # not serializable: cannot arrive over the wire
        return
    record = DHTRecord(key=DHTID.generate(source=progress_key("run1", progress_shard(GOOD["peer_id"]))).to_bytes(),
                       subkey=DHTProtocol.serializer.dumps(signer.local_public_key), value=serialized,
                       expiration_time=get_dht_time() + 10)
    ok = schema.validate(record)
    assert ok in (True, False)
    if ok and value is not None:  # None is the schema's "deleted" value; readers skip it
        assert parse_progress(value) is not None


# ---- the averaging RPC: random headers and parts against an open group --------------------------------------------
class Ctx:
    remote_id = "peerA"


header_fields = st.fixed_dictionaries({}, optional={
    "group_id": st.one_of(st.just("GID"), st.text(max_size=30)),
    "weight": st.one_of(st.floats(), st.integers(-2**63, 2**63 - 1)),
    "numel": st.one_of(st.just(8), st.integers(-10, 100)), "wait": st.floats(), "norm": st.floats(),
    "codec": st.one_of(st.just("none"), st.text(max_size=6)), "fragment": values, "version": values,
    "junk": values})


@settings(max_examples=30, deadline=None)
@given(header_fields, st.lists(st.one_of(
    st.sampled_from([codecs.encode(torch.ones(8), "none")]).map(lambda p: {"data": p}),
    st.binary(max_size=64).map(lambda b: {"data": b}), values.map(lambda v: {"data": v})), max_size=4))
def test_aggregate_rpc_with_random_messages(header, parts):
    async def run():
        stats = TrafficStats()
        servicer = AveragingServicer("run", "peerB", stats, max_wait=0.05, past=lambda f, v: v < 3)
        spec = GroupSpec("run", 0, 0, 0, ("peerA", "peerB"), 16, block=8)
        reduction = servicer.open(spec, timeout=0.2)
        reduction.add("peerB", 1.0, torch.full((8,), 2.0))
        if header.get("group_id") == "GID":
            header["group_id"] = spec.group_id

        async def requests():
            yield pack_request(header)
            for p in parts:
                yield pack_request(p)

        answers = [unpack(m, {}) async for m in servicer.rpc_aggregate(requests(), Ctx())]
        result = await reduction.result
        return answers, result, stats

    answers, result, stats = asyncio.run(run())
    assert answers
    assert bool(torch.isfinite(result.values).all())
    if "peerA" in result.contributors:  # accepted: a valid part of the right size
        assert stats.rejected == 0 and answers[0]["ok"]
    else:
        assert stats.rejected >= 1 or not answers[0]["ok"] or result.contributors == ["peerB"]


# ---- state sync: a donor that answers with random or mutated messages ----------------------------------------------
def _good_state_messages(numel=6):
    params, momentum = torch.arange(numel, dtype=torch.float32), torch.zeros(numel)
    digest = state_sync.tensor_hash(params, momentum)
    header = {"ok": True, "version": 3, "weight": 2.0, "digest": digest, "numel": numel, "schedule_step": 1,
              "fragment": 0, "ancestors": [digest], "offset": 0}
    return [header, {"data": torch.cat([params, momentum]).numpy().tobytes()}]


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 1), st.sampled_from(["ok", "version", "weight", "digest", "numel",
                                                               "schedule_step", "fragment", "ancestors", "data"]),
                          values), max_size=3),
       st.booleans())
def test_state_download_with_a_lying_donor(edits, truncate):
    messages = _good_state_messages()
    for index, key, value in edits:
        messages[index][key] = value
    if truncate:
        messages = messages[:1]

    async def open_stream(donor, request):
        async def stream():
            for m in messages:
                yield pack_response(m)
        return stream()

    stats = TrafficStats()
    try:
        state = asyncio.run(state_sync._continue_from(
            open_stream, "QmDonorDonorDonorDonorDonorDonorDonorDonorDon", 0, state_sync._Transfer(6), 0.5, stats))
    except (WireError, StopAsyncIteration, asyncio.TimeoutError):
        return
    assert state.params.numel() == 6 and bool(torch.isfinite(state.params).all())
    assert bool(torch.isfinite(state.momentum).all()) and state.digest == messages[0]["digest"]


def test_a_donor_streaming_empty_parts_forever_is_refused():
    header = _good_state_messages()[0]

    async def open_stream(donor, request):
        async def stream():
            yield pack_response(header)
            while True:
                yield pack_response({"data": b""})
        return stream()

    with pytest.raises(WireError, match="empty"):
        asyncio.run(state_sync._continue_from(open_stream, "QmDonor", 0, state_sync._Transfer(6), 0.5, TrafficStats()))


# ---- catching up by replay: a donor whose replay is mutated ----------------------------------------------------------
def _good_replay():
    from atoll.models.outer import NesterovOuter, merged_delta
    from atoll.node.rounds.replica import Replica
    from atoll.protocols.reducer import shard_bounds

    torch.manual_seed(1)
    theta = torch.randn(256)
    ahead, behind = Replica([theta]), Replica([theta.clone()])
    for seed in range(2):
        version, _, digest = ahead.identity(0)
        delta = torch.randn(256, generator=torch.Generator().manual_seed(seed)).double() * 0.01
        shards = [(hi - lo, codecs.encode(delta[lo:hi].float(), "int4", 64)) for lo, hi in shard_bounds(256, 2, 64)]
        merged = merged_delta([codecs.decode(b, expected_numel=n) for n, b in shards], None)
        ahead.apply_outer_step(0, version, merged, 1.0, NesterovOuter(), digest, shards, None)
    servicer = state_serve.StateServicer(ahead.snapshot, 1, TrafficStats(), replay=ahead.replay_from)

    async def collect():
        request = pack_request({"fragment": 0, "have": behind.identity(0)[2]})
        return [unpack(m, {}) async for m in servicer.rpc_download_state(request, None)]

    return behind, asyncio.run(collect())


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 1), st.sampled_from(["version", "base", "result", "weight", "norm",
                                                               "numels", "sizes"]), values), max_size=2),
       st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=3))
def test_replay_from_a_lying_donor(edits, data_edits):
    from atoll.models.outer import NesterovOuter

    behind, messages = _good_replay()
    assert "replay" in messages[0] and len(messages) == 2
    for index, key, value in edits:
        messages[0]["replay"][index][key] = value
    messages[1]["data"] = mutate(messages[1]["data"], data_edits, None)

    async def open_stream(donor, request):
        async def stream():
            for m in messages:
                yield pack_response(m)
        return stream()

    have = behind.identity(0)[2]
    try:
        replay = asyncio.run(state_sync._continue_from(open_stream, "QmDonor", 0, state_sync._Transfer(256), 0.5,
                                                       TrafficStats(), have))
    except (WireError, StopAsyncIteration, asyncio.TimeoutError):
        return
    assert isinstance(replay, state_sync.Replay)
    state = behind.replay(replay, NesterovOuter())
    if state is not None:  # only the exact rounds reach the announced replica
        assert state.digest == messages[0]["digest"] and bool(torch.isfinite(state.params).all())

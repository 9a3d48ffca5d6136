"""Tests for atoll.protocols.codecs against a naive float64 (numpy) reference.

The reference below re-derives everything from the documented wire format and
quantization rules (scale = absmax/grid_max, nearest grid point, ties to the
even code), element by element in float64, independently of the torch code.
"""

from __future__ import annotations

import hashlib
import io
import struct

import numpy as np
import pytest
import torch

from atoll.protocols import codec_threads
from atoll.protocols import codecs as C
from atoll.protocols.error_feedback import ErrorFeedback

BLOCK_CODECS = ("int8", "int4", "fp4", "int2")
LOSSY = ("bf16",) + BLOCK_CODECS
GRIDS = {
    "int8": np.arange(-127, 128, dtype=np.float64),
    "int4": np.arange(-7, 8, dtype=np.float64),
    "fp4": np.array([-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64),
    "int2": np.array([-1.0, 0.0, 1.0]),
}
BITS = {"int8": 8, "int4": 4, "fp4": 4, "int2": 2}
F32_MAX = float(np.finfo(np.float32).max)
HDR = struct.Struct("<4sBBHQI")
# The encoder rounds y = x*(1/s) to fp32 before rounding it to a code, so an
# element within REL_SLACK*absmax of a midpoint may go to either neighbour.
REL_SLACK = 2.0**-20
ABS_TINY = 2.0**-140  # absolute slack for blocks with an fp32-subnormal scale


# ----------------------------------------------------------------------------- reference


def ref_scales(x: np.ndarray, codec: str, B: int) -> np.ndarray:
    """fp32 scales absmax/grid_max (float64 division then one rounding to fp32 is
    exact for a quotient of two fp32 values: 53 >= 2*24+2, so no double-rounding)."""
    nb = -(-x.size // B)
    xp = np.zeros(nb * B)
    xp[: x.size] = x
    absmax = np.abs(xp).reshape(nb, B).max(axis=1)
    gmax = GRIDS[codec].max()
    with np.errstate(over="ignore"):
        s = (absmax / gmax).astype(np.float32)
        # The encoder nudges a scale down when grid_max*scale overflows fp32.
        bad = np.isinf((s.astype(np.float64) * gmax).astype(np.float32))
        while bad.any():
            s = np.where(bad, np.nextafter(s, np.float32(0)), s)
            bad = np.isinf((s.astype(np.float64) * gmax).astype(np.float32))
    return s


def ref_codes(x: np.ndarray, scales: np.ndarray, codec: str, B: int):
    """Nearest-grid codes (ties to the even code) of x/scale, plus a near-tie mask."""
    grid = GRIDS[codec]
    tol = REL_SLACK * grid[-1]  # in units of the scale
    off = (grid.size - 1) // 2
    s = np.repeat(scales.astype(np.float64), B)[: x.size]
    y = np.divide(x, s, out=np.zeros(x.size), where=s > 0)
    y = np.clip(y, grid[0], grid[-1])
    d = np.abs(y[:, None] - grid[None, :]) if grid.size < 20 else None
    if d is None:  # uniform integer grid: nearest = rint (half-even), distance to the tie is |frac - .5|
        codes = np.rint(y)
        near = np.abs(np.abs(y - np.floor(y)) - 0.5) < tol
        return codes.astype(np.int64), near
    order = np.argsort(d, axis=1, kind="stable")
    best, second = order[:, 0], order[:, 1]
    db, ds = d[np.arange(x.size), best], d[np.arange(x.size), second]
    code_b, code_s = best - off, second - off
    tie = db == ds
    pick = np.where(tie & (code_b % 2 != 0), code_s, code_b)
    near = (ds - db) < 2 * tol  # |y - midpoint| = (ds - db)/2
    return pick, near


def unpack_payload(payload: bytes):
    """Parse a block-codec payload with numpy, straight from the documented format."""
    magic, version, cid, flags, numel, B = HDR.unpack_from(payload, 0)
    codec = C.CODECS[cid]
    nb = -(-numel // B)
    scales = np.frombuffer(payload, dtype="<f4", count=nb, offset=20)
    body = np.frombuffer(payload, dtype=np.uint8, offset=20 + 4 * nb)
    bits = BITS[codec]
    if bits == 8:
        codes = body.view(np.int8).astype(np.int64)
    else:
        k, mask = 8 // bits, (1 << bits) - 1
        idx = np.stack([(body >> (bits * j)) & mask for j in range(k)], axis=1).reshape(-1)[:numel]
        codes = idx.astype(np.int64) - (GRIDS[codec].size - 1) // 2
    return codec, numel, B, scales, codes


def ref_decode(codes: np.ndarray, scales: np.ndarray, codec: str, B: int) -> np.ndarray:
    grid = GRIDS[codec]
    off = (grid.size - 1) // 2
    s = np.repeat(scales.astype(np.float64), B)[: codes.size]
    return (grid[codes + off] * s).astype(np.float32)  # exact product, one rounding: same as fp32 mul


def bound(x: np.ndarray, codec: str, B: int) -> np.ndarray:
    """Documented per-element error bound, from the float64 block absmax."""
    if codec == "none":
        return np.zeros(x.size)
    if codec == "bf16":
        return np.maximum(2.0**-8 * np.abs(x), 2.0**-134)
    nb = -(-x.size // B)
    xp = np.zeros(nb * B)
    xp[: x.size] = x
    absmax = np.repeat(np.abs(xp).reshape(nb, B).max(axis=1), B)[: x.size]
    s = absmax / GRIDS[codec].max()
    if codec == "fp4":
        y = np.divide(np.abs(x), s, out=np.zeros(x.size), where=s > 0)
        half = np.where(y < 2, 0.25, np.where(y < 4, 0.5, 1.0))
    else:
        half = 0.5
    return half * s + REL_SLACK * absmax + ABS_TINY


# ----------------------------------------------------------------------------- inputs


def _rng(seed):
    return np.random.default_rng(seed)


def adversarial():
    """(name, fp32 numpy array) pairs; sizes deliberately not multiples of the blocks."""
    r = _rng(1)
    out = []
    out.append(("randn", r.standard_normal(4099).astype(np.float32)))
    out.append(("zeros", np.zeros(1001, np.float32)))
    out.append(("neg_zeros", np.full(300, -0.0, np.float32)))
    out.append(("constant", np.full(1003, 3.7, np.float32)))
    cb = np.repeat(np.array([2.5, -1e-3, 7.0, -7.0, 0.0, 1e20], np.float32), 70)
    out.append(("constant_blocks", cb))
    o = (r.standard_normal(2051) * 1e-3).astype(np.float32)
    o[[5, 700, 2050]] = [1e30, -3e38, 5e37]
    out.append(("outliers", o))
    out.append(("subnormal", (r.standard_normal(1030) * 1e-40).astype(np.float32)))
    out.append(("min_subnormal", (r.integers(-1, 2, 515) * np.float32(1.4e-45)).astype(np.float32)))
    out.append(("tiny_normal", (r.standard_normal(777) * 1e-37).astype(np.float32)))
    mix = r.standard_normal(1500).astype(np.float32)
    mix[256:512] *= np.float32(1e-42)
    mix[512:768] = 0
    out.append(("mixed_blocks", mix))
    out.append(("flt_max", np.array([F32_MAX, -F32_MAX, 1.0, F32_MAX * 0.99, -1e38], np.float32)))
    wide = (r.standard_normal(3001) * 10.0 ** r.uniform(-30, 30, 3001)).astype(np.float32)
    out.append(("wide_range", wide))
    out.append(("single", np.array([-2.5], np.float32)))
    out.append(("three", np.array([1.0, -0.4, 0.25], np.float32)))
    return out


ADV = adversarial()


# ----------------------------------------------------------------------------- tests: reference agreement


@pytest.mark.parametrize("codec", BLOCK_CODECS)
@pytest.mark.parametrize("B", [4, 36, 256])
@pytest.mark.parametrize("name,x", ADV, ids=[n for n, _ in ADV])
def test_block_codec_matches_float64_reference(codec, B, name, x):
    payload = C.encode(torch.from_numpy(x), codec, B)
    got_codec, numel, gotB, scales, codes = unpack_payload(payload)
    assert (got_codec, numel, gotB) == (codec, x.size, B)
    # Scales: bit-identical to the reference.
    want_s = ref_scales(x, codec, B)
    np.testing.assert_array_equal(scales.view(np.uint32), want_s.view(np.uint32))
    # Codes: identical except (deterministic) neighbour choices near a midpoint.
    want_c, near = ref_codes(x.astype(np.float64), want_s, codec, B)
    diff = codes != want_c
    assert not (diff & ~near).any(), f"{(diff & ~near).sum()} codes differ away from a tie"
    if diff.any():
        grid = GRIDS[codec]
        off = (grid.size - 1) // 2
        assert (np.abs(np.searchsorted(grid, grid[codes[diff] + off]) - np.searchsorted(grid, grid[want_c[diff] + off])) == 1).all()
    # Decoder: exactly code*scale in fp32.
    dec = C.decode(payload, expected_numel=x.size).numpy()
    np.testing.assert_array_equal(dec, ref_decode(codes, scales, codec, B))


@pytest.mark.parametrize("codec", C.CODECS)
@pytest.mark.parametrize("B", [4, 256])
@pytest.mark.parametrize("name,x", ADV, ids=[n for n, _ in ADV])
def test_round_trip_error_bound(codec, B, name, x):
    if codec == "bf16" and np.abs(x.astype(np.float64)).max() >= 3.3961e38:
        with pytest.raises(ValueError, match="bf16"):
            C.encode(torch.from_numpy(x), codec, B)
        return
    payload = C.encode(torch.from_numpy(x), codec, B)
    assert len(payload) == C.encoded_size(x.size, codec, B)
    dec = C.decode(payload, expected_numel=x.size)
    assert dec.dtype == torch.float32 and dec.shape == (x.size,)
    assert torch.isfinite(dec).all()
    x64 = x.astype(np.float64)
    err = np.abs(dec.numpy().astype(np.float64) - x64)
    b = bound(x64, codec, B)
    worst = np.argmax(err - b)
    assert (err <= b).all(), f"{codec}/{name}: |err| {err[worst]:.3g} > bound {b[worst]:.3g} at {worst} (x={x64[worst]:.3g})"
    if codec == "none":
        np.testing.assert_array_equal(dec.numpy().view(np.uint32), x.view(np.uint32))


@pytest.mark.parametrize("codec", ("int4", "fp4", "int2"))
def test_decode_every_valid_byte(codec):
    """Exhaustive check of the sub-byte decoding table against the documented layout."""
    bits, grid = BITS[codec], GRIDS[codec]
    k, mask = 8 // bits, (1 << bits) - 1
    valid = [b for b in range(256) if all(((b >> (bits * j)) & mask) < grid.size for j in range(k))]
    numel = len(valid) * k
    nb = -(-numel // 4)
    payload = HDR.pack(b"ATLC", 1, C.CODECS.index(codec), 0, numel, 4) + np.full(nb, 0.5, "<f4").tobytes() + bytes(valid)
    want = [grid[(b >> (bits * j)) & mask] * 0.5 for b in valid for j in range(k)]
    assert C.decode(payload).tolist() == want


def test_bound_is_tight_enough_to_fail():
    """Sanity check of the test itself: a decoder off by one code violates the bound."""
    x = _rng(2).standard_normal(1000).astype(np.float32)
    _, _, _, scales, codes = unpack_payload(C.encode(torch.from_numpy(x), "int8", 256))
    bad = ref_decode(np.clip(codes + 1, -127, 127), scales, "int8", 256).astype(np.float64)
    assert (np.abs(bad - x) > bound(x.astype(np.float64), "int8", 256)).any()


def test_bf16_matches_round_to_nearest_even():
    x = _rng(3).standard_normal(5000).astype(np.float32) * np.float32(1e3)
    x[:4] = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130], np.float32)  # exact ties + subnormal
    bits = x.view(np.uint32).astype(np.uint64)
    # Reference RNE on the bit pattern: add 0x7FFF + lsb of the kept half, truncate.
    want = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    payload = C.encode(torch.from_numpy(x), "bf16")
    np.testing.assert_array_equal(np.frombuffer(payload, np.uint16, offset=20), want)
    assert list(np.frombuffer(payload, np.uint16, offset=20)[:3]) == [0x3F80, 0x3F82, 0xBF80]


def test_exact_ties_round_half_even():
    # scale = 127/127 = 1 exactly: 1.5 -> 2, -2.5 -> -2, 0.5 -> 0
    p = C.encode(torch.tensor([127.0, 1.5, -2.5, 0.5]), "int8", 4)
    assert C.decode(p).tolist() == [127.0, 2.0, -2.0, 0.0]
    # fp4, scale 1: every midpoint of the E2M1 grid goes to the even code.
    x = torch.tensor([6.0, 2.5, -0.25, 0.75, 5.0, -3.5, 1.25, 0.0])
    p = C.encode(x, "fp4", 8)
    assert C.decode(p).tolist() == [6.0, 2.0, 0.0, 1.0, 4.0, -4.0, 1.0, 0.0]
    assert p[20:24] == struct.pack("<f", 1.0) and p[24:] == bytes([0xBE, 0x97, 0x1D, 0x79])
    # int4: scale 1, [7, 0.5, -1.5, 2.5] -> [7, 0, -2, 2]; int2: scale 2, [2, 1, -1, -1.2] -> [1, 0, 0, -1]
    assert C.decode(C.encode(torch.tensor([7.0, 0.5, -1.5, 2.5]), "int4", 4)).tolist() == [7.0, 0.0, -2.0, 2.0]
    assert C.decode(C.encode(torch.tensor([2.0, 1.0, -1.0, -1.2]), "int2", 4)).tolist() == [2.0, 0.0, 0.0, -2.0]


# ----------------------------------------------------------------------------- tests: format and determinism


@pytest.mark.parametrize("codec", C.CODECS)
def test_header_layout_and_size(codec):
    x = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    p = C.encode(x, codec, 256)
    magic, version, cid, flags, numel, B = HDR.unpack_from(p, 0)
    assert (magic, version, cid, flags, numel) == (b"ATLC", 1, C.CODECS.index(codec), 0, 1001)
    assert C.HEADER_SIZE == 20
    body = {"none": 4004, "bf16": 2002, "int8": 16 + 1001, "int4": 16 + 501, "fp4": 16 + 501, "int2": 16 + 251}[codec]
    assert B == (0 if codec in ("none", "bf16") else 256)
    assert len(p) == 20 + body == C.encoded_size(1001, codec, 256)


def test_codec_ids_are_stable():
    assert C.CODECS == ("none", "bf16", "int8", "int4", "fp4", "int2")


@pytest.mark.parametrize("codec", C.CODECS)
def test_empty_tensor(codec):
    p = C.encode(torch.empty(0), codec)
    assert len(p) == C.encoded_size(0, codec) == 20
    assert C.decode(p, expected_numel=0).shape == (0,)


def _portable_input(n: int) -> torch.Tensor:
    # Integer hash -> exact fp32 values: identical on every platform/version
    # (unlike an RNG stream or libm).
    i = np.arange(n, dtype=np.uint64)
    h = (i * np.uint64(2654435761) + np.uint64(12345)) % np.uint64(2**32)
    x = (h.astype(np.float64) / 2**32 - 0.5) * 2.0 ** ((i % 7).astype(np.float64) - 3)
    return torch.from_numpy(x.astype(np.float32))


# sha256 of encode(_portable_input(10_000), codec, 256): pins the byte format,
# so a change that alters bytes on the wire cannot land silently.
GOLDEN = {
    "none": "d9291b8ab8f4bcfbd24f4558992d91d5e00fdcf4c21a2d61c52911ec22c2f96a",
    "bf16": "a7afe78b41205790a6f85e82506a1d7ced916a9762c8900c018904f3d25a2130",
    "int8": "50a30982c7aaad4da5d09c5e19446d749f0aba8cc1e5347bd2a1b69cb5076305",
    "int4": "4b38b763727f37742fc51f73823cea8ea2bc02bfea6105a848c0c5a7750c0481",
    "fp4": "0066753d703053fa2cc1e7669cfa796185b1144eacef0cfc3ee193e438b28317",
    "int2": "57de3c6e78aff9f5963ee42b5e7aaaf2ba9c486fdfaeb23eb87f376fd0c33fc4",
}


def ref_payload(x: np.ndarray, codec: str, B: int, near_tie_codes: np.ndarray | None = None) -> bytes:
    """The whole payload built by the numpy reference.

    Elements near a midpoint (either neighbour is acceptable, see REL_SLACK)
    take their code from ``near_tie_codes``, which must then be a neighbour.
    """
    cid = C.CODECS.index(codec)
    if codec == "none":
        return HDR.pack(b"ATLC", 1, cid, 0, x.size, 0) + x.astype("<f4").tobytes()
    if codec == "bf16":
        bits = x.view(np.uint32).astype(np.uint64)
        return HDR.pack(b"ATLC", 1, cid, 0, x.size, 0) + ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()
    s = ref_scales(x, codec, B)
    codes, near = ref_codes(x.astype(np.float64), s, codec, B)
    if near.any():
        assert near_tie_codes is not None and (np.abs(near_tie_codes[near] - codes[near]) <= 1).all()
        codes = np.where(near, near_tie_codes, codes)
    bits = BITS[codec]
    if bits == 8:
        body = codes.astype(np.int8).tobytes()
    else:
        k = 8 // bits
        idx = np.zeros(-(-x.size // k) * k, np.int64)
        idx[: x.size] = codes + (GRIDS[codec].size - 1) // 2
        idx[x.size :] = (GRIDS[codec].size - 1) // 2  # padding = the code of 0
        body = (idx.reshape(-1, k) << (bits * np.arange(k))).sum(axis=1).astype(np.uint8).tobytes()
    return HDR.pack(b"ATLC", 1, cid, 0, x.size, B) + s.astype("<f4").tobytes() + body


@pytest.mark.parametrize("codec", C.CODECS)
def test_golden_bytes(codec):
    x = _portable_input(10_001)
    payload = C.encode(x, codec, 256)
    impl_codes = unpack_payload(payload)[4] if codec in BLOCK_CODECS else None
    assert payload == ref_payload(x.numpy(), codec, 256, impl_codes)  # independent construction, byte for byte
    assert hashlib.sha256(C.encode(x[:10_000], codec, 256)).hexdigest() == GOLDEN[codec]


@pytest.mark.parametrize("codec", C.CODECS)
def test_deterministic_across_calls_threads_and_layouts(codec):
    x = torch.randn(300_001, generator=torch.Generator().manual_seed(4)) * 3
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = C.encode(x, codec)
        torch.set_num_threads(2)
        b = C.encode(x, codec)
    finally:
        torch.set_num_threads(prev)
    assert a == b == C.encode(x.clone(), codec)
    # Shape and memory layout do not matter, only the flattened values.
    x2 = x[:300_000].view(600, 500)
    assert C.encode(x2, codec) == C.encode(x2.t().contiguous().t(), codec) == C.encode(x[:300_000], codec)
    strided = torch.randn(2000, generator=torch.Generator().manual_seed(5))[::2]
    assert C.encode(strided, codec, 32) == C.encode(strided.contiguous(), codec, 32)


@pytest.mark.parametrize("codec", ["int8", "int4", "fp4", "int2"])
def test_codec_threads_split_large_payloads_byte_for_byte(codec):
    """Above the parallel threshold a payload's blocks are encoded and decoded in runs on several threads: the
    same bytes and values as on one, including the tail block; NaN is still refused."""
    x = torch.randn(codec_threads.PARALLEL_MIN * 3 + 1234, generator=torch.Generator().manual_seed(6))
    try:
        C.set_threads(1)
        one = C.encode(x, codec)
        values_one = C.decode(one)
        C.set_threads(4)
        four = C.encode(x, codec)
        assert codec_threads.pooled()  # the payload was large enough to be split
        assert four == one
        assert torch.equal(C.decode(four), values_one)
        bad = x.clone()
        bad[codec_threads.PARALLEL_MIN * 2 + 7] = float("nan")  # in the third run
        with pytest.raises(ValueError, match="NaN"):
            C.encode(bad, codec)
    finally:
        C.set_threads(1)
    with pytest.raises(ValueError):
        C.set_threads(0)


@pytest.mark.parametrize("codec", C.CODECS)
def test_a_tensor_on_the_device_encodes_as_its_host_copy(codec, device_name):
    """A tensor on an accelerator encodes to the bytes of its host copy (strided and bf16 ones too), NaN is refused
    there as on the host, and its payload decodes to a host fp32 tensor, the host copy's."""
    x = torch.randn(5001, generator=torch.Generator().manual_seed(11)) * 3
    on = x.to(device_name)
    assert on.device.type == device_name
    payload = C.encode(on, codec, 64)
    assert payload == C.encode(x, codec, 64)
    assert C.encode(on[::3], codec, 64) == C.encode(x[::3], codec, 64)
    assert C.encode(on.to(torch.bfloat16), codec, 64) == C.encode(x.to(torch.bfloat16), codec, 64)
    decoded = C.decode(payload, expected_numel=x.numel())
    assert decoded.device.type == "cpu" and decoded.dtype == torch.float32
    assert torch.equal(decoded, C.decode(C.encode(x, codec, 64)))
    bad = on.clone()
    bad[4000] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        C.encode(bad, codec, 64)


def test_decode_does_not_alias_payload_and_accepts_buffers():
    x = torch.randn(100)
    p = bytearray(C.encode(x, "none"))
    d = C.decode(p)
    p[20:24] = b"\0\0\0\0"
    assert torch.equal(d, x)
    assert torch.equal(C.decode(memoryview(bytes(p))), C.decode(bytes(p)))


def test_encode_does_not_modify_input():
    x = torch.randn(1000)
    keep = x.clone()
    for codec in C.CODECS:
        C.encode(x, codec, 64)
    assert torch.equal(x, keep)


# ----------------------------------------------------------------------------- tests: rejection


def _payload(codec="int8", n=1000, B=256):
    return C.encode(torch.randn(n, generator=torch.Generator().manual_seed(6)), codec, B)


def _with_header(p: bytes, **kw) -> bytes:
    fields = dict(zip(("magic", "version", "cid", "flags", "numel", "block"), HDR.unpack_from(p, 0)))
    fields.update(kw)
    return HDR.pack(*fields.values()) + p[20:]


@pytest.mark.parametrize("codec", C.CODECS)
def test_rejects_truncated_and_oversized(codec):
    p = _payload(codec)
    for bad in (b"", p[:5], p[:19], p[:20], p[:-1], p + b"\0"):
        with pytest.raises(C.CodecError, match="truncated|oversized"):
            C.decode(bad)


@pytest.mark.parametrize("codec", C.CODECS)
def test_rejects_header_disagreeing_with_payload(codec):
    p = _payload(codec)
    with pytest.raises(C.CodecError, match="implies"):
        C.decode(_with_header(p, numel=990))
    with pytest.raises(C.CodecError, match="implies"):
        C.decode(_with_header(p, numel=2**60))  # must not try to allocate
    with pytest.raises(C.CodecError, match="expected"):
        C.decode(p, expected_numel=999)
    with pytest.raises(C.CodecError, match="max_numel"):
        C.decode(p, max_numel=999)
    assert C.decode(p, expected_numel=1000, max_numel=1000).shape == (1000,)
    if codec in ("none", "bf16"):
        with pytest.raises(C.CodecError, match="block"):
            C.decode(_with_header(p, block=256))
    else:
        for blk in (0, 3, 130, 2**31):
            with pytest.raises(C.CodecError, match="block"):
                C.decode(_with_header(p, block=blk))
        with pytest.raises(C.CodecError, match="implies"):
            C.decode(_with_header(p, block=128))  # valid block, but 8 scales instead of 4


def test_rejects_bad_magic_version_flags_unknown_codec():
    p = _payload()
    with pytest.raises(C.CodecError, match="magic"):
        C.decode(_with_header(p, magic=b"XXXX"))
    with pytest.raises(C.CodecError, match="version"):
        C.decode(_with_header(p, version=2))
    with pytest.raises(C.CodecError, match="flags"):
        C.decode(_with_header(p, flags=1))
    for cid in (6, 99, 255):
        with pytest.raises(C.CodecError, match="unknown codec"):
            C.decode(_with_header(p, cid=cid))


def _set_f32(p: bytes, offset: int, value: float) -> bytes:
    return p[:offset] + struct.pack("<f", value) + p[offset + 4 :]


@pytest.mark.parametrize("codec", BLOCK_CODECS)
def test_rejects_bad_scales(codec):
    p = _payload(codec)
    for v in (float("nan"), float("inf"), -1.0):
        with pytest.raises(C.CodecError, match="scales"):
            C.decode(_set_f32(p, 20 + 4, v))
    # Finite scale, but code*scale overflows to Inf (int2's largest code is 1: no overflow).
    if codec == "int2":
        assert torch.isfinite(C.decode(_set_f32(p, 20, F32_MAX))).all()
    else:
        with pytest.raises(C.CodecError, match="NaN/Inf"):
            C.decode(_set_f32(p, 20, F32_MAX))


@pytest.mark.parametrize("codec,byte", [("int4", 0xF7), ("int4", 0x7F), ("fp4", 0xF7), ("int2", 0b11), ("int2", 0b11000000)])
def test_rejects_invalid_sub_byte_codes(codec, byte):
    p = bytearray(_payload(codec))
    p[20 + 16 + 10] = byte  # a byte inside the first block's codes
    with pytest.raises(C.CodecError, match="NaN/Inf"):
        C.decode(bytes(p))


def test_rejects_int8_minus_128():
    p = bytearray(_payload("int8"))
    p[20 + 16 + 3] = 0x80
    with pytest.raises(C.CodecError, match="-128"):
        C.decode(bytes(p))


@pytest.mark.parametrize("codec,pattern", [("none", b"\x00\x00\xc0\x7f"), ("none", b"\x00\x00\x80\xff"), ("bf16", b"\xc0\x7f"), ("bf16", b"\x80\x7f")])
def test_rejects_non_finite_values(codec, pattern):
    p = bytearray(_payload(codec))
    p[40 : 40 + len(pattern)] = pattern
    with pytest.raises(C.CodecError, match="NaN/Inf"):
        C.decode(bytes(p))


@pytest.mark.parametrize("codec", C.CODECS)
def test_random_corruption_never_escapes_codec_error(codec):
    """Flipping random bytes gives either a finite tensor of the header's size or CodecError."""
    good = _payload(codec, n=517, B=64)
    r = _rng(7)
    for _ in range(300):
        p = bytearray(good)
        for pos in r.integers(0, len(p), r.integers(1, 4)):
            p[pos] = int(r.integers(0, 256))
        try:
            out = C.decode(bytes(p), max_numel=10_000)
        except C.CodecError:
            continue
        assert out.dtype == torch.float32 and out.dim() == 1 and torch.isfinite(out).all()


def test_codec_error_is_value_error():
    assert issubclass(C.CodecError, ValueError)


def test_encode_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown codec"):
        C.encode(torch.zeros(4), "int3")
    with pytest.raises(ValueError, match="unknown codec"):
        C.encoded_size(4, "zstd")
    for codec in C.CODECS:
        for bad in (float("nan"), float("inf"), -float("inf")):
            x = torch.zeros(1000)
            x[600] = bad
            with pytest.raises(ValueError, match="NaN or Inf"):
                C.encode(x, codec, 256)
    with pytest.raises(ValueError, match="bf16"):
        C.encode(torch.tensor([F32_MAX]), "bf16")
    for blk in (0, 2, 6, 130, 2**31):
        with pytest.raises(ValueError, match="block_size"):
            C.encode(torch.zeros(8), "int8", blk)
    with pytest.raises(ValueError, match="floating"):
        C.encode(torch.zeros(8, dtype=torch.int32), "int8")


# ----------------------------------------------------------------------------- tests: error feedback

# Worst residual for deltas with |d| <= D, from |r| <= err(absmax(d + r)):
# int: R <= (D+R)/(2*gmax) -> D/(2*gmax-1); fp4: R <= (D+R)/6; bf16: R <= 2^-8 (D+R).
EF_BOUND = {"bf16": 1 / 255, "int8": 1 / 253, "int4": 1 / 13, "fp4": 1 / 5, "int2": 1.0}


def compress(ef, key, delta, codec, block_size=256):
    """One round of error-feedback compression as a daemon runs it: encode the target, keep what was dropped.
    Returns the payload and what a receiver decodes from it."""
    target = ef.target(key, delta)
    payload = C.encode(target, codec, block_size)
    decoded = C.decode(payload, expected_numel=target.numel())
    ef.commit(key, target, decoded)
    return payload, decoded


def residual(ef, key):
    """The stored residual of ``key`` (a copy), or None."""
    return ef.state_dict().get(key)


def _deltas(rounds, n, seed):
    r = _rng(seed)
    bias = r.standard_normal(n) * 0.3  # persistent component: what plain quantization keeps dropping
    for t in range(rounds):
        yield ((bias + r.standard_normal(n)) * 10.0 ** r.uniform(-0.3, 0.3)).astype(np.float32)


@pytest.mark.parametrize("codec", LOSSY)
def test_error_feedback_running_sum_stays_bounded(codec):
    rounds, n, B = 300, 2000, 64
    ef = ErrorFeedback()
    s_true = np.zeros(n)
    s_dec = np.zeros(n)
    dmax = 0.0
    errs = []
    for d in _deltas(rounds, n, 8):
        payload, decoded = compress(ef, "frag0", torch.from_numpy(d), codec, B)
        assert torch.equal(decoded, C.decode(payload))  # what a receiver gets
        s_true += d
        s_dec += decoded.numpy()
        dmax = max(dmax, float(np.abs(d).max()))
        errs.append(np.abs(s_true - s_dec).max())
        # The gap is exactly the stored residual (up to fp32 rounding).
        np.testing.assert_allclose(s_true - s_dec, residual(ef, "frag0").numpy(), rtol=0, atol=1e-4 * dmax)
    errs = np.array(errs)
    assert errs.max() <= EF_BOUND[codec] * dmax * 1.01 + 1e-4 * dmax
    # Not growing: the last third is no worse than the first third allows.
    assert errs[-100:].max() <= 1.5 * errs[:100].max() + 1e-6


@pytest.mark.parametrize("codec", ("int4", "fp4", "int2"))
def test_without_error_feedback_the_gap_grows(codec):
    """Control for the test above: plain quantization lets the same running gap grow."""
    rounds, n, B = 300, 2000, 64
    s_true = np.zeros(n)
    s_dec = np.zeros(n)
    dmax = 0.0
    for d in _deltas(rounds, n, 8):
        s_true += d
        s_dec += C.decode(C.encode(torch.from_numpy(d), codec, B)).numpy()
        dmax = max(dmax, float(np.abs(d).max()))
    assert np.abs(s_true - s_dec).max() > 3 * EF_BOUND[codec] * dmax


def test_error_feedback_checkpoint_resume_is_identical():
    deltas = [torch.from_numpy(d) for d in _deltas(12, 3000, 9)]
    ef = ErrorFeedback()
    for d in deltas[:6]:
        compress(ef, "a", d, "int4", 128)
        compress(ef, "b", d[:1000] * 2, "int8", 256)
    buf = io.BytesIO()
    torch.save(ef.state_dict(), buf)
    buf.seek(0)
    resumed = ErrorFeedback()
    resumed.load_state_dict(torch.load(buf))
    assert set(resumed.state_dict()) == {"a", "b"}
    for d in deltas[6:]:
        assert compress(ef, "a", d, "int4", 128)[0] == compress(resumed, "a", d, "int4", 128)[0]
        assert compress(ef, "b", d[:1000] * 2, "int8")[0] == compress(resumed, "b", d[:1000] * 2, "int8")[0]
    # state_dict returns copies.
    sd = ef.state_dict()
    sd["a"].zero_()
    assert residual(ef, "a").abs().max() > 0


def test_error_feedback_edge_cases():
    ef = ErrorFeedback()
    d = torch.randn(500)
    d_copy = d.clone()
    compress(ef, "k", d, "int2")
    before = residual(ef, "k").clone()
    bad = d.clone()
    bad[3] = float("nan")
    with pytest.raises(ValueError):
        compress(ef, "k", bad, "int2")
    assert torch.equal(residual(ef, "k"), before)  # failed round leaves state untouched
    with pytest.raises(ValueError, match="elements"):
        compress(ef, "k", torch.randn(501), "int2")
    # Lossless codec: the residual is flushed into the payload and dropped.
    payload, dec = compress(ef, "k", d, "none")
    assert torch.allclose(dec, d + before) and residual(ef, "k") is None
    compress(ef, "k", d, "int4")
    compress(ef, "k", d, "int4")
    assert torch.equal(d, d_copy)  # the caller's delta is never modified
    ef.load_state_dict({})  # forgets every residual
    assert ef.state_dict() == {}
    with pytest.raises(ValueError):
        ef.load_state_dict({"x": torch.tensor([float("inf")])})


def test_error_feedback_residuals_are_this_moments_values_without_a_copy():
    """A checkpoint holds ``residuals()`` while rounds go on: a later commit must replace, not overwrite, them."""
    ef = ErrorFeedback()
    g = torch.Generator().manual_seed(3)
    target = ef.target("0", torch.randn(1000, generator=g))
    ef.commit("0", target, C.decode(C.encode(target, "int4")))
    held = ef.residuals()
    before = held["0"].clone()
    assert held["0"] is ef.residuals()["0"]
    target = ef.target("0", torch.randn(1000, generator=g))
    ef.commit("0", target, C.decode(C.encode(target, "int4")))
    assert torch.equal(held["0"], before) and not torch.equal(ef.residuals()["0"], before)
    assert ef.state_dict()["0"] is not ef.residuals()["0"]


@pytest.mark.parametrize("codec", C.CODECS)
def test_norm_floor_is_a_lower_bound_of_what_was_encoded(codec):
    gen = torch.Generator().manual_seed(7)
    for trial in range(120):
        n = int(torch.randint(1, 1500, (), generator=gen))
        x = torch.randn(n, generator=gen)
        if trial % 4 == 1:
            x = x * (torch.rand(n, generator=gen) < 0.05)  # mostly zeros
        elif trial % 4 == 2:
            x = (2 * x).exp() * torch.randn(n, generator=gen).sign()  # heavy tails: most values near a block's zero
        elif trial % 4 == 3:
            x = x * 1e-38  # subnormal scales
        payload = C.encode(x, codec, 64)
        floor = C.norm_floor(payload)
        assert floor <= float(torch.linalg.vector_norm(x.double())) * (1 + 1e-6) + 1e-45
        assert floor == C.norm_floor(payload, C.decode(payload))
    # And tight enough to tell a shard ×5 from the shard: typical values keep most of their norm.
    x = torch.randn(10_000, generator=gen)
    assert C.norm_floor(C.encode(x, codec, 256)) > 0.5 * float(x.norm())
    assert C.norm_floor(C.encode(torch.zeros(10), codec, 256)) == 0.0

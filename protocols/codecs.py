"""Lossy and lossless codecs for the outer deltas that atoll daemons exchange: ``encode`` a flat tensor into a
self-describing payload, ``decode`` it back; everything needed to decode is inside the payload.

Pure tensor code (torch and the standard library): no wire, no networking; ``codec_threads.py`` says how many
threads a large payload's blocks may use. The network layer names the codec in every message.

The codecs (``CODECS``): ``none`` is fp32, bit-exact; ``bf16`` is bfloat16, round-to-nearest-even
(``Tensor.to(torch.bfloat16)``); the block codecs quantize each block of ``block`` values with its own scale:
``int8`` (scale = absmax/127, codes round(x/scale) in [-127, 127]), ``int4`` (scale = absmax/7, codes in [-7, 7],
two per byte), ``fp4`` (the E2M1 grid ±{0, .5, 1, 1.5, 2, 3, 4, 6}·scale, scale = absmax/6, two per byte) and
``int2`` (ternary: scale = absmax, codes in {-1, 0, 1}, four per byte; for ablations only).

Wire format, all little-endian. The header is ``HEADER_SIZE`` = 20 bytes, ``struct`` format ``<4sBBHQI``: magic
``b"ATLC"``, version u8 (= 1), codec id u8, flags u16 (= 0), numel u64, block u32. Codec ids are the positions in
``CODECS`` (none=0, bf16=1, int8=2, int4=3, fp4=4, int2=5) and are part of the wire format: never reorder
``CODECS``. ``block`` is 0 for ``none`` and ``bf16``. The body of ``none`` is numel fp32 values, of ``bf16`` numel
bf16 bit patterns. The body of a block codec is ``nblocks = ceil(numel/block)`` fp32 scales, then the codes of the
flat tensor, ``ceil(numel*bits/8)`` bytes. int8 codes are two's complement int8. Sub-byte codes are stored as the
unsigned index into the codec's grid (``code + 7`` for int4/fp4, ``code + 1`` for int2), element ``i`` of a byte
in bits ``[bits*i, bits*(i+1))`` (the first element in the low bits). Grid index 15 (4-bit) or 3 (2-bit) is
invalid and decodes to NaN, which ``decode`` rejects. ``block`` must be a multiple of 4, so that every block
starts on a byte boundary for every codec. Bits of the last byte beyond ``numel`` (and the padded positions of a
partial last block) are written as the code of 0 and ignored by the decoder.

Error bounds, for ``s`` the block's stored scale and ``x`` an input element: ``none`` is exact; ``bf16`` keeps
``|x - x̂| <= 2**-8 * |x|`` (or ``2**-134`` for bf16-subnormal magnitudes); ``int8``, ``int4`` and ``int2`` keep
``|x - x̂| <= s/2``, i.e. absmax/254, absmax/14 and absmax/2; ``fp4`` keeps half the local grid step: ``s/4`` for
``|x| <= 2s``, ``s/2`` for ``|x| <= 4s``, ``s`` above (so at most absmax/6). Each block bound holds up to
``2**-20 * absmax`` (``x * (1/s)`` is rounded to fp32 before it is rounded to a code, so an element that close to
a midpoint may land on either neighbour, deterministically) plus ``2**-140`` absolute for blocks whose scale is an
fp32 subnormal (absmax below ~1e-36). ``tests/unit/test_codecs.py`` checks these bounds against float64.

Determinism: only IEEE-exact operations touch the data (max/min, one correctly rounded multiply, round-half-even,
exact integer arithmetic), and no sums or other order-dependent reductions, so the same input gives the same bytes
on every machine and thread count (assuming the default: denormals not flushed, see ``torch.set_flush_denormal``).
``-0.0`` scales are canonicalised to ``+0.0``.

``ErrorFeedback`` (``error_feedback.py``) keeps, per key (fragment), what quantization dropped, to be added to the
next delta. docs/codecs.md has the same contract, why scales are fp32, and the measured costs.
"""

from __future__ import annotations

import struct
import sys
import warnings

import torch

from .codec_threads import in_runs, set_threads, threads

__all__ = [
    "CODECS",
    "HEADER_SIZE",
    "MAGIC",
    "VERSION",
    "CodecError",
    "NonFiniteError",
    "ShapeError",
    "decode",
    "encode",
    "encoded_size",
    "norm_floor",
    "set_threads",
    "threads",
]

if sys.byteorder != "little":  # the payload is raw little-endian tensor memory
    raise ImportError("atoll codecs require a little-endian host")

CODECS: tuple[str, ...] = ("none", "bf16", "int8", "int4", "fp4", "int2")
_CODEC_IDS = {name: i for i, name in enumerate(CODECS)}

MAGIC = b"ATLC"
VERSION = 1
_HEADER = struct.Struct("<4sBBHQI")
HEADER_SIZE = _HEADER.size  # 20: keeps the fp32 scales 4-byte aligned
MAX_BLOCK_SIZE = 1 << 30

# Elements per step of the block codecs: the temporaries (256 KiB each) stay in L2 and are reused, instead of a
# fresh 4·numel-byte allocation per op (page faults dominated the unchunked version).
_CHUNK = 1 << 16
_FLT_MIN = 2.0**-126  # smallest normal fp32: 1/scale is finite for scales >= this
# Smallest fp32 that rounds to +inf in bf16 (bit pattern 0x7F7F8000, ties-to-even).
_BF16_OVERFLOW = struct.unpack("<f", struct.pack("<I", 0x7F7F8000))[0]

# torch.frombuffer warns (once per process) that read-only buffers such as ``bytes`` give non-writable tensors.
# decode never writes into them; the one-time warning is consumed here so that it does not reach the daemon's log.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)


class CodecError(ValueError):
    """A payload is malformed, uses an unknown codec, or decodes to non-finite values."""

    kind = "codec"


class ShapeError(CodecError):
    """A payload holds a different number of values than the receiver expects."""

    kind = "shape"


class NonFiniteError(CodecError):
    """A payload's scales or values are NaN/Inf (or negative scales)."""

    kind = "nonfinite"


class _BlockSpec:
    """Static description of a blockwise codec."""

    def __init__(self, bits: int, grid: list[float]):
        self.grid = list(grid)
        self.bits = bits
        self.per_byte = 8 // bits
        self.grid_max = float(max(grid))  # scale = absmax / grid_max
        self.offset = (len(grid) - 1) // 2  # grid index of 0; code = index - offset
        # One add turns a byte of packed signed codes into a byte of packed grid indices.
        self.packed_offset = sum(self.offset << (bits * j) for j in range(self.per_byte))
        self.table = None
        if bits < 8:
            # Byte -> the ``per_byte`` fp32 values it holds, gathered as one wide element (a plain copy of the bits,
            # so the NaN of invalid codes survives).
            ext = grid + [float("nan")] * ((1 << bits) - len(grid))
            byte = torch.arange(256)
            cols = [torch.tensor(ext, dtype=torch.float32)[(byte >> (bits * j)) & ((1 << bits) - 1)]
                    for j in range(self.per_byte)]
            # One 8-byte (4-bit codecs) or 16-byte (int2) element per byte value: index_select on a 1-D table is
            # ~4x faster than on rows.
            wide = torch.int64 if self.per_byte == 2 else torch.complex128
            self.table = torch.stack(cols, 1).contiguous().view(wide).reshape(256)


_SPECS = {
    "int8": _BlockSpec(8, [float(i) for i in range(-127, 128)]),
    "int4": _BlockSpec(4, [float(i) for i in range(-7, 8)]),
    "fp4": _BlockSpec(4, [-6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]),
    "int2": _BlockSpec(2, [-1.0, 0.0, 1.0]),
}


def _check_codec(codec: str) -> None:
    if codec not in _CODEC_IDS:
        raise ValueError(f"unknown codec {codec!r}; known: {', '.join(CODECS)}")


def _check_block(block_size: int) -> None:
    if not (isinstance(block_size, int) and 4 <= block_size <= MAX_BLOCK_SIZE and block_size % 4 == 0):
        raise ValueError(f"block_size must be a multiple of 4 in [4, {MAX_BLOCK_SIZE}], got {block_size!r}")


def encoded_size(numel: int, codec: str, block_size: int = 256) -> int:
    """Exact byte length of ``encode(t, codec, block_size)`` for a tensor of ``numel`` elements."""
    _check_codec(codec)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if codec == "none":
        return HEADER_SIZE + 4 * numel
    if codec == "bf16":
        return HEADER_SIZE + 2 * numel
    _check_block(block_size)
    spec = _SPECS[codec]
    nblocks = -(-numel // block_size)
    return HEADER_SIZE + 4 * nblocks + -(-numel * spec.bits // 8)


# ----------------------------------------------------------------------------- encode


def flat_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a flat, contiguous fp32 tensor in host memory (a copy unless it already is one)."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise ValueError(f"expected a floating-point tensor, got {getattr(tensor, 'dtype', type(tensor))}")
    return tensor.detach().to(device="cpu", dtype=torch.float32).reshape(-1).contiguous()


def _finite_absmax(x: torch.Tensor) -> float:
    """max |x| over a non-empty tensor; ValueError if any element is NaN/Inf (one pass, no allocation)."""
    lo, hi = torch.aminmax(x)  # NaN propagates through min/max
    lo, hi = float(lo), float(hi)
    if not (abs(lo) < float("inf") and abs(hi) < float("inf")):
        raise ValueError("cannot encode a tensor containing NaN or Inf")
    return max(hi, -lo)


class _Scratch:
    """Reusable temporaries for encoding up to ``n`` elements at a time."""

    def __init__(self, n: int, spec: _BlockSpec, codec: str):
        self.y = torch.empty(n, dtype=torch.float32)
        self.aux = torch.empty(n, dtype=torch.float32) if codec == "fp4" else None
        self.pk = torch.empty(n // spec.per_byte, dtype=torch.float32) if spec.bits < 8 else None
        self.pki = torch.empty(n // spec.per_byte, dtype=torch.int32) if spec.bits < 8 else None


def _y_to_codes(y: torch.Tensor, spec: _BlockSpec, codec: str, dst: torch.Tensor, scr: _Scratch) -> None:
    """Quantize ``y = x/scale`` (fp32, contiguous, clobbered) into packed codes written to ``dst`` (uint8)."""
    if codec == "fp4":
        # Piecewise-linear map of the E2M1 grid onto consecutive integers, t(y) = y/2 + clamp(y,±2) + clamp(y,±4)/2
        # = 2y on |y|<=2, y±2 on |y|<=4, y/2±4 above: round(t) is the nearest grid point and exact midpoints go to
        # the even code (round-half-even).
        c4 = torch.clamp(y, -4.0, 4.0, out=scr.aux[: y.numel()])
        c4.add_(y).mul_(0.5)
        y.clamp_(-2.0, 2.0).add_(c4)
    y.round_()  # round-half-even: exact ties go to the even integer
    if spec.bits == 8:
        dst.view(torch.int8).copy_(y)  # values are integers in [-127, 127]: exact
        return
    # Pack in fp32 (exact small integers) and convert once: sum_j code_j·2^(bits·j).
    k, b = spec.per_byte, spec.bits
    yv = y.view(-1, k)
    acc = scr.pk[: yv.shape[0]]
    torch.add(yv[:, 0], yv[:, 1], alpha=1 << b, out=acc)
    for j in range(2, k):
        acc.add_(yv[:, j], alpha=1 << (b * j))
    acc.add_(spec.packed_offset)
    dst.copy_(scr.pki[: acc.numel()].copy_(acc))  # fp32->int32->uint8 is ~3x faster than fp32->uint8


def _encode_rows(rows: torch.Tensor, spec: _BlockSpec, codec: str, scales_out: torch.Tensor,
                 codes_out: torch.Tensor) -> None:
    """Encode ``rows`` (m, B) fp32: the per-row scales into ``scales_out`` (m,), the codes into ``codes_out``
    (m·B·bits/8 uint8)."""
    m, B = rows.shape
    # amax and amin are fast row reductions, aminmax(dim) is not.
    absmax = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_())
    if not bool(torch.isfinite(absmax).all()):  # NaN propagates through amax/amin
        raise ValueError("cannot encode a tensor containing NaN or Inf")
    absmax.add_(0.0)  # canonicalise -0.0 (all -0.0 block) to +0.0 for byte-identical output
    scale = absmax / spec.grid_max
    # Decoding computes code·scale in fp32: nudge scales whose grid_max·scale would round to inf (absmax within an
    # ulp of FLT_MAX) down one ulp.
    for _ in range(4):
        over = torch.isinf(scale * spec.grid_max)
        if not bool(over.any()):
            break
        scale = torch.where(over, torch.nextafter(scale, torch.zeros_like(scale)), scale)
    scales_out.copy_(scale)
    normal = scale >= _FLT_MIN
    # Zero blocks get code 0; so do tiny ones for now, redone below.
    inv = torch.where(normal, 1.0 / scale, torch.zeros_like(scale))

    bytes_per_row = B * spec.bits // 8
    rows_per_chunk = max(1, _CHUNK // B)
    n_chunk = rows_per_chunk * B
    scr = _Scratch(min(n_chunk, m * B), spec, codec)
    for r0 in range(0, m, rows_per_chunk):
        r1 = min(m, r0 + rows_per_chunk)
        y = scr.y[: (r1 - r0) * B]
        torch.mul(rows[r0:r1], inv[r0:r1, None], out=y.view(r1 - r0, B))
        _y_to_codes(y, spec, codec, codes_out[r0 * bytes_per_row : r1 * bytes_per_row], scr)

    # Blocks whose scale is an fp32 subnormal (absmax < ~1e-36): 1/scale would overflow, so divide in float64
    # instead. Rare, and off the fast path.
    tiny = ((scale > 0) & ~normal).nonzero().flatten()
    if tiny.numel():
        y = (rows[tiny].double() / scale[tiny].double()[:, None]).clamp_(-spec.grid_max, spec.grid_max).float()
        y = y.reshape(-1).contiguous()
        dst = torch.empty(tiny.numel() * bytes_per_row, dtype=torch.uint8)
        _y_to_codes(y, spec, codec, dst, _Scratch(y.numel(), spec, codec))
        codes_out.view(m, bytes_per_row)[tiny] = dst.view(-1, bytes_per_row)


def encode(tensor: torch.Tensor, codec: str, block_size: int = 256) -> bytes:
    """``tensor`` (any shape, flattened; fp32 expected, other float dtypes are converted) encoded with ``codec``:
    a self-describing payload (header and body, see the module docstring) of exactly
    ``encoded_size(tensor.numel(), codec, block_size)`` bytes. Identical input gives identical bytes.

    ``block_size`` (a multiple of 4) only matters for the block codecs. Raises ``ValueError`` for an unknown codec,
    a bad block size, a non-float tensor, NaN/Inf elements, or (bf16) finite values that would round to Inf.
    """
    _check_codec(codec)
    x = flat_fp32(tensor)
    n = x.numel()
    cid = _CODEC_IDS[codec]
    if codec in ("none", "bf16"):
        header = _HEADER.pack(MAGIC, VERSION, cid, 0, n, 0)
        if n == 0:
            return header
        absmax = _finite_absmax(x)
        if codec == "none":
            return b"".join((header, memoryview(x.numpy()).cast("B")))
        if absmax >= _BF16_OVERFLOW:
            raise ValueError(f"bf16 cannot represent {absmax:.6g} (rounds to Inf)")
        bits = x.to(torch.bfloat16).view(torch.int16)  # round-to-nearest-even
        return b"".join((header, memoryview(bits.numpy()).cast("B")))

    _check_block(block_size)
    spec = _SPECS[codec]
    B = block_size
    nfull, tail = divmod(n, B)
    nblocks = nfull + (tail > 0)
    body = torch.empty(encoded_size(n, codec, B) - HEADER_SIZE, dtype=torch.uint8)
    scales = body[: 4 * nblocks].view(torch.float32)  # offset 0 of a fresh tensor: aligned
    codes = body[4 * nblocks :]
    row_bytes = B * spec.bits // 8
    if nfull:
        rows = x[: nfull * B].view(nfull, B)
        in_runs(nfull, lambda r0, r1: _encode_rows(rows[r0:r1], spec, codec, scales[r0:r1],
                                                    codes[r0 * row_bytes : r1 * row_bytes]))
    if tail:
        # The partial last block is zero-padded to a full block (zeros do not change its absmax); only the bytes
        # that hold real elements are kept.
        padded = torch.zeros(1, B, dtype=torch.float32)
        padded[0, :tail] = x[nfull * B :]
        tail_codes = torch.empty(row_bytes, dtype=torch.uint8)
        _encode_rows(padded, spec, codec, scales[nfull:], tail_codes)
        codes[nfull * row_bytes :] = tail_codes[: codes.numel() - nfull * row_bytes]
    header = _HEADER.pack(MAGIC, VERSION, cid, 0, n, B)
    return b"".join((header, memoryview(body.numpy())))


# ----------------------------------------------------------------------------- decode


def _decode_rows(codes: torch.Tensor, scales: torch.Tensor, spec: _BlockSpec, B: int, out: torch.Tensor) -> None:
    """Decode m rows: ``codes`` (m·B·bits/8 uint8), ``scales`` (m,) into ``out`` (m, B) fp32."""
    m = out.shape[0]
    bytes_per_row = B * spec.bits // 8
    rows_per_chunk = max(1, _CHUNK // B)
    idx = torch.empty(rows_per_chunk * bytes_per_row, dtype=torch.int32) if spec.bits < 8 else None
    for r0 in range(0, m, rows_per_chunk):
        r1 = min(m, r0 + rows_per_chunk)
        o = out[r0:r1]
        c = codes[r0 * bytes_per_row : r1 * bytes_per_row]
        if spec.bits == 8:
            o.copy_(c.view(torch.int8).view(r1 - r0, B))
        else:
            ix = idx[: c.numel()]
            ix.copy_(c)  # index_select wants int32/int64 indices
            torch.index_select(spec.table, 0, ix, out=o.view(spec.table.dtype).view(-1))
        o.mul_(scales[r0:r1, None])


def decode(payload: bytes, *, expected_numel: int | None = None, max_numel: int | None = None) -> torch.Tensor:
    """A payload produced by ``encode``, decoded into a new flat fp32 CPU tensor.

    ``payload`` may be any bytes-like object; it is not modified and the result does not alias it. Raises
    ``CodecError`` (its message says what was wrong) for a payload shorter than the header, bad magic, version or
    flags, an unknown codec id, an invalid block size, ``numel`` above ``max_numel`` or different from
    ``expected_numel`` (both checked before anything is allocated), a length different from what the header
    implies, negative or non-finite scales, int8 code -128, or any NaN/Inf in the decoded values.
    """
    view = memoryview(payload)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    size = view.nbytes
    if size < HEADER_SIZE:
        raise CodecError(f"truncated payload: {size} bytes, header alone is {HEADER_SIZE}")
    magic, version, cid, flags, numel, block = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise CodecError(f"unsupported codec format version {version} (this build reads {VERSION})")
    if cid >= len(CODECS):
        raise CodecError(f"unknown codec id {cid} (known: {', '.join(f'{i}={c}' for i, c in enumerate(CODECS))})")
    codec = CODECS[cid]
    if flags != 0:
        raise CodecError(f"{codec}: unknown header flags {flags:#x}")
    if max_numel is not None and numel > max_numel:
        raise ShapeError(f"{codec}: header numel {numel} exceeds max_numel {max_numel}")
    if expected_numel is not None and numel != expected_numel:
        raise ShapeError(f"{codec}: header numel {numel} != expected {expected_numel}")
    if codec in ("none", "bf16"):
        if block != 0:
            raise CodecError(f"{codec}: header block size must be 0, got {block}")
    else:
        try:
            _check_block(block)
        except ValueError as e:
            raise CodecError(f"{codec}: invalid header block size: {e}") from None
    want = encoded_size(numel, codec, block)
    if size != want:
        kind = "truncated" if size < want else "oversized"
        raise CodecError(f"{codec}: {kind} payload: {size} bytes, header (numel={numel}, block={block}) implies {want}")

    raw = torch.frombuffer(view, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    body = raw[HEADER_SIZE:]
    n = numel
    if n == 0:
        return torch.empty(0, dtype=torch.float32)
    if codec == "none":
        out = body.clone().view(torch.float32)  # copy: never alias the caller's buffer
    elif codec == "bf16":
        out = body.view(torch.bfloat16).to(torch.float32)
    else:
        spec = _SPECS[codec]
        B = block
        nfull, tail = divmod(n, B)
        nblocks = nfull + (tail > 0)
        scales = body[: 4 * nblocks].clone().view(torch.float32)  # small; clone also guarantees alignment
        s_lo, s_hi = torch.aminmax(scales)
        if not (float(s_lo) >= 0.0 and float(s_hi) < float("inf")):  # NaN fails both
            raise NonFiniteError(f"{codec}: scales must be finite and >= 0 (min {float(s_lo)}, max {float(s_hi)})")
        codes = body[4 * nblocks :]
        if spec.bits == 8 and int(codes.view(torch.int8).min()) < -127:
            raise CodecError("int8: code -128 is outside the codec's range [-127, 127]")
        out = torch.empty(n, dtype=torch.float32)
        row_bytes = B * spec.bits // 8
        if nfull:
            rows = out[: nfull * B].view(nfull, B)
            in_runs(nfull, lambda r0, r1: _decode_rows(codes[r0 * row_bytes : r1 * row_bytes], scales[r0:r1],
                                                        spec, B, rows[r0:r1]))
        if tail:
            tail_codes = torch.zeros(row_bytes, dtype=torch.uint8)
            got = codes[nfull * row_bytes :]
            tail_codes[: got.numel()] = got
            tmp = torch.empty(1, B, dtype=torch.float32)
            _decode_rows(tail_codes, scales[nfull:], spec, B, tmp)
            out[nfull * B :] = tmp[0, :tail]
    lo, hi = torch.aminmax(out)  # one pass; NaN propagates, Inf shows as an extreme
    if not (abs(float(lo)) < float("inf") and abs(float(hi)) < float("inf")):
        raise NonFiniteError(f"{codec}: payload decodes to NaN/Inf values")
    return out


def norm_floor(payload: bytes, values: torch.Tensor | None = None, *, expected_numel: int | None = None) -> float:
    """A lower bound on the L2 norm of every tensor that ``encode`` turns into ``payload`` (which is decoded and
    checked as ``decode`` does). A value decoded to a grid level g·scale was one that rounds to g: at least the
    midpoint between g and the next level towards zero, times the scale (0 for code 0); bf16 keeps 8 significant
    bits; ``none`` is exact. So a receiver can hold the sender to a bound on what it encoded, whatever the codec
    dropped: ``norm_floor(encode(x)) <= ‖x‖`` (up to fp32 rounding of x itself). ``values``: the payload as
    ``decode`` returned it, if the caller has it already."""
    if values is None:
        values = decode(payload, expected_numel=expected_numel)
    if values.numel() == 0:
        return 0.0
    _, _, cid, _, _, block = _HEADER.unpack_from(payload, 0)
    codec = CODECS[cid]
    if codec == "none":
        return float(torch.linalg.vector_norm(values, dtype=torch.float64))
    if codec == "bf16":
        return float(torch.linalg.vector_norm(values, dtype=torch.float64)) * (1 - 2.0**-8)
    spec = _SPECS[codec]
    nblocks = -(-values.numel() // block)
    scales = torch.frombuffer(bytearray(payload[HEADER_SIZE : HEADER_SIZE + 4 * nblocks]), dtype=torch.float32)
    per_value = scales.repeat_interleave(block)[: values.numel()]
    ratio = torch.where(per_value > 0, values.abs() / per_value.clamp_min(_FLT_MIN * 2.0**-23), 0.0)
    levels = sorted({abs(g) for g in spec.grid} - {0.0})
    between = torch.tensor([(a + b) / 2 for a, b in zip(levels, levels[1:])], dtype=torch.float32)
    # The encoder rounds x·(1/scale) in fp32 first: a value a few ulps of grid_max below a midpoint may round up.
    floors = torch.tensor([max(0.0, (a + b) / 2 - spec.grid_max * 2.0**-18) for a, b in zip([0.0, *levels], levels)],
                          dtype=torch.float32)
    low = torch.where(ratio > 0, floors[torch.bucketize(ratio, between)], 0.0) * per_value
    return float(torch.linalg.vector_norm(low, dtype=torch.float64))

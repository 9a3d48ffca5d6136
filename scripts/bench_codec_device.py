#!/usr/bin/env python3
"""The delta codec's throughput on a GPU tensor against a host tensor: what an island's rank 0 pays per round to
encode a delta of ``--numel`` parameters (1B by default on cuda) and to decode the merged one.

    python -m scripts.bench_codec_device --device cuda --out OUT.json                  # 1e9 values, int4, 3 repeats
    python -m scripts.bench_codec_device --device cpu --numel 1e6 --out /tmp/codec.json   # the CPU dry run

``protocols/codecs.py`` works on host memory: ``encode`` first copies its input to the host as fp32
(``flat_fp32``), then quantizes there on ``--codec-threads`` threads (0: the daemon's rule, 1 on a cpu device,
else up to 8); ``decode`` returns a host tensor. Measured, each ``--repeats`` times, the order reversed every other
repetition, the clock read after ``torch.cuda.synchronize()``:

- host_encode / host_decode: ``encode`` of a host fp32 tensor; ``decode`` of its payload to a host tensor;
- device_encode: ``encode`` of the same values in a cuda tensor, as the code stands (the fp32 copy to the host
  included), and d2h_fp32, that copy alone (``tensor.to("cpu")``);
- device_decode: ``decode`` then ``.to(device)``: the merged delta back in GPU memory;
- prototype_encode / prototype_decode: the same codec computed ON the device with the same torch operations
  (``device_encode``/``device_decode`` below: block scales, rounding and packing on the GPU), so that only the
  payload (int4: 0.52 bytes a value, codes and fp32 scales) crosses to the host instead of 4 bytes a value, and
  back. Not the daemon's code: a measurement of the opportunity. Its payload is compared byte for byte with
  ``encode``'s, and its decoded values with ``decode``'s, once (outside the timing).
- host_encode_1t / host_decode_1t: the host codec on one thread, on at most 2**26 values, for its thread scaling.

On cpu the device kinds are skipped, and the prototype runs on host tensors (its byte-for-byte check still holds).

Budget: one host encode of 2**24 values first says how long one of ``--numel`` takes; above ``--max-pass-seconds``
the measurement runs at 2.5e8 values (``--fallback-numel``) and the per-1B figures are extrapolated linearly (the
JSON says so). After each repetition, the ones left are dropped if they would overrun ``--budget-seconds``. Host
memory peaks near 3 fp32 copies of ``--numel`` (the host tensor; the first decode, kept for the prototype's check
until it runs; the copy ``encode`` of a cuda tensor makes, or the prototype's decoded values brought back for the
check) plus a payload or two (0.52 GB each at int4): about 14 GB at 1e9. The JSON gives the measured peak
(``ru_maxrss``). On the GPU: the values, one decoded copy, a payload and 64 MiB temporaries, about 9 GB at 1e9
(``peak_gpu_gib``).
Bad arguments (a device torch does not see, an unknown codec) end the script with one line and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

from scripts.results import write_result
from scripts.stats import interval

ROOT = Path(__file__).resolve().parent.parent

PER = 1_000_000_000  # figures per 1B parameters
SCALING_NUMEL = 1 << 26  # the one-thread measurement's size
CALIBRATION_NUMEL = 1 << 24
FALLBACK_NUMEL = 250_000_000
CHUNK = 1 << 24  # values per step of the device prototype (bounds its temporaries to 64 MiB of fp32 each)


class BadArgs(Exception):
    """Arguments this script cannot run with: one line, exit status 2."""


# ---- the codec computed on the device (a prototype: the opportunity, not the daemon's code) ------------------------
def _codec():
    from atoll.protocols import codecs

    return codecs


def device_encode(x, codec: str = "int4", block_size: int = 256) -> bytes:
    """``codecs.encode(x, codec, block_size)``, byte for byte, with the quantization done where ``x`` lives: only
    the payload's body (scales and packed codes) is copied to the host. Block codecs only."""
    import torch

    codecs = _codec()
    if codec not in codecs._SPECS:
        raise ValueError(f"device_encode: block codecs only ({', '.join(codecs._SPECS)}), not {codec!r}")
    codecs._check_block(block_size)
    spec, B, dev = codecs._SPECS[codec], block_size, x.device
    x = x.detach().reshape(-1)
    if x.dtype != torch.float32:
        x = x.float()
    n = x.numel()
    nfull, tail = divmod(n, B)
    nblocks = nfull + (tail > 0)
    header = codecs._HEADER.pack(codecs.MAGIC, codecs.VERSION, codecs.CODECS.index(codec), 0, n, B)
    if n == 0:
        return header
    if tail:  # zero-padded to whole blocks, as the codec pads its last block (zeros do not change its absmax)
        x = torch.cat([x, x.new_zeros(nblocks * B - n)])
    rows = x.view(nblocks, B)
    row_bytes = B * spec.bits // 8
    body = torch.empty(4 * nblocks + nblocks * row_bytes, dtype=torch.uint8, device=dev)
    scales_out, codes = body[: 4 * nblocks].view(torch.float32), body[4 * nblocks :]

    absmax = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_())
    if not bool(torch.isfinite(absmax).all()):
        raise ValueError("cannot encode a tensor containing NaN or Inf")
    absmax.add_(0.0)  # -0.0 → +0.0
    # Divided by a device tensor: CUDA turns a division by a Python float (a CPU scalar) into a multiplication by
    # its reciprocal, which can be one ulp off the host's division, and the bytes would differ.
    scale = absmax / torch.tensor(spec.grid_max, dtype=torch.float32, device=dev)
    for _ in range(4):  # as codecs._encode_rows: scales whose grid_max·scale overflows go down one ulp
        over = torch.isinf(scale * spec.grid_max)
        if not bool(over.any()):
            break
        scale = torch.where(over, torch.nextafter(scale, torch.zeros_like(scale)), scale)
    scales_out.copy_(scale)
    normal = scale >= codecs._FLT_MIN
    inv = torch.where(normal, 1.0 / scale, torch.zeros_like(scale))
    step = max(1, CHUNK // B)
    for r0 in range(0, nblocks, step):
        r1 = min(nblocks, r0 + step)
        y = rows[r0:r1] * inv[r0:r1, None]
        _pack(y.view(-1), spec, codec, codes[r0 * row_bytes : r1 * row_bytes])
    tiny = ((scale > 0) & ~normal).nonzero().flatten()
    if tiny.numel():  # scales that are fp32 subnormals: the codec's own float64 path, on the host (rare)
        dst = torch.empty(tiny.numel() * row_bytes, dtype=torch.uint8)
        codecs._encode_rows(rows[tiny].cpu(), spec, codec, torch.empty(tiny.numel()), dst)
        codes.view(nblocks, row_bytes)[tiny] = dst.view(-1, row_bytes).to(dev)
    size = codecs.encoded_size(n, codec, B) - codecs.HEADER_SIZE
    host = body[:size].cpu()
    return b"".join((header, memoryview(host.numpy())))


def _pack(y, spec, codec: str, dst) -> None:
    """``y = x/scale`` (fp32, clobbered) quantized and packed into ``dst`` (uint8), as ``codecs._y_to_codes``."""
    import torch

    if codec == "fp4":
        c4 = torch.clamp(y, -4.0, 4.0).add_(y).mul_(0.5)
        y.clamp_(-2.0, 2.0).add_(c4)
    y.round_()
    if spec.bits == 8:
        dst.view(torch.int8).copy_(y)
        return
    k, b = spec.per_byte, spec.bits
    yv = y.view(-1, k)
    acc = torch.add(yv[:, 0], yv[:, 1], alpha=1 << b)
    for j in range(2, k):
        acc.add_(yv[:, j], alpha=1 << (b * j))
    acc.add_(spec.packed_offset)
    dst.copy_(acc.to(torch.int32))


def device_decode(payload: bytes, device, expected_numel: int | None = None):
    """``codecs.decode(payload)`` on ``device``: the payload's body is copied there and decoded there, with the
    codec's checks (finite, non-negative scales; finite values). Block codecs only."""
    import torch

    codecs = _codec()
    magic, version, cid, flags, n, B = codecs._HEADER.unpack_from(payload, 0)
    codec = codecs.CODECS[cid] if cid < len(codecs.CODECS) else None
    if magic != codecs.MAGIC or version != codecs.VERSION or flags or codec not in codecs._SPECS:
        raise codecs.CodecError("device_decode: not a block codec's payload")
    if expected_numel is not None and n != expected_numel:
        raise codecs.ShapeError(f"{codec}: header numel {n} != expected {expected_numel}")
    if len(payload) != codecs.encoded_size(n, codec, B):
        raise codecs.CodecError(f"{codec}: payload length does not match its header")
    spec = codecs._SPECS[codec]
    nblocks = -(-n // B)
    row_bytes = B * spec.bits // 8
    raw = torch.frombuffer(payload, dtype=torch.uint8)[codecs.HEADER_SIZE :]
    body = raw.to(device, copy=True)  # on the host too: aligned, and never the caller's buffer
    scales = body[: 4 * nblocks].view(torch.float32)
    codes = body[4 * nblocks :]
    if codes.numel() < nblocks * row_bytes:  # the last block's missing bytes: decoded, then sliced off
        codes = torch.cat([codes, codes.new_zeros(nblocks * row_bytes - codes.numel())])
    s_lo, s_hi = torch.aminmax(scales)
    if not (float(s_lo) >= 0.0 and float(s_hi) < float("inf")):
        raise codecs.NonFiniteError(f"{codec}: scales must be finite and >= 0")
    out = torch.empty(nblocks * B, dtype=torch.float32, device=device)
    rows = out.view(nblocks, B)
    table = spec.table.to(device) if spec.table is not None else None
    step = max(1, CHUNK // B)
    for r0 in range(0, nblocks, step):
        r1 = min(nblocks, r0 + step)
        c = codes[r0 * row_bytes : r1 * row_bytes]
        o = rows[r0:r1]
        if spec.bits == 8:
            o.copy_(c.view(torch.int8).view(r1 - r0, B))
        else:
            torch.index_select(table, 0, c.to(torch.int32), out=o.view(table.dtype).view(-1))
        o.mul_(scales[r0:r1, None])
    out = out[:n]
    lo, hi = torch.aminmax(out)
    if not (abs(float(lo)) < float("inf") and abs(float(hi)) < float("inf")):
        raise codecs.NonFiniteError(f"{codec}: payload decodes to NaN/Inf values")
    return out


# ---- measuring ----------------------------------------------------------------------------------------------------
def daemon_codec_threads(kind: str) -> int:
    """``node.device.codec_threads(0, kind)``: the daemon's default (1 on a cpu device, else up to 8)."""
    return 1 if kind == "cpu" else max(1, min(8, os.cpu_count() or 1))


def parse_numel(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"a whole number of values, at least 1, not {text!r}")
    return int(value)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise BadArgs(message)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="cuda or cpu (auto: cuda when torch sees one)")
    p.add_argument("--numel", type=parse_numel, help="values in the delta (default: 1e9 on cuda, 1e8 on cpu)")
    p.add_argument("--codec", default="int4", help="a block codec: int4 (default), int8, fp4, int2")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--codec-threads", type=int, default=0, help="the codec's threads (0: the daemon's default)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the daemon's default: 1)")
    p.add_argument("--max-pass-seconds", type=float, default=8.0,
                   help="above this projected time for one host encode of --numel, measure 2.5e8 and extrapolate")
    p.add_argument("--fallback-numel", type=parse_numel, default=FALLBACK_NUMEL,
                   help="what is measured when --numel would take too long (default: 2.5e8)")
    p.add_argument("--budget-seconds", type=float, help="drop repetitions that would overrun this, counted from "
                                                        "after the imports (default: 25 on cuda, none on cpu)")
    p.add_argument("--no-prototype", action="store_true", help="skip the on-device codec prototype")
    p.add_argument("--out", help="the JSON's path (default: print it only)")
    return p.parse_args(argv)


def check(args: argparse.Namespace) -> str:
    """The device kind; ``BadArgs`` for what cannot run."""
    import torch

    from atoll.protocols import codecs

    kind = args.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind not in ("cpu", "cuda"):
        raise BadArgs(f"--device: cpu or cuda, not {kind!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise BadArgs(f"--device cuda: torch {torch.__version__} sees no CUDA device here")
    if args.codec not in codecs._SPECS:
        raise BadArgs(f"--codec: a block codec ({', '.join(codecs._SPECS)}), not {args.codec!r}")
    try:
        codecs._check_block(args.block_size)
    except ValueError as e:
        raise BadArgs(f"--block-size: {e}") from None
    for key in ("repeats", "threads"):
        if getattr(args, key) < 1:
            raise BadArgs(f"--{key} must be at least 1")
    if args.codec_threads < 0:
        raise BadArgs("--codec-threads must not be negative")
    return kind


def _timed(fn, fence):
    fence()
    t0 = time.perf_counter()
    out = fn()
    fence()
    return out, time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict:
    """Measure what ``args`` (``parse``'s) ask for; write the JSON to ``--out`` if given; return it."""
    kind = check(args)
    import torch

    from atoll.protocols import codecs

    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    threads = args.codec_threads or daemon_codec_threads(kind)
    codecs.set_threads(threads)
    cuda = kind == "cuda"
    dev = torch.device(kind)
    fence = torch.cuda.synchronize if cuda else (lambda: None)
    asked = args.numel or (PER if cuda else 100_000_000)
    budget = args.budget_seconds if args.budget_seconds is not None else (25.0 if cuda else None)
    gen = torch.Generator(device=dev).manual_seed(0)

    # How long one host encode of ``asked`` values would take, from a small one.
    sample = torch.randn(min(asked, CALIBRATION_NUMEL), generator=torch.Generator().manual_seed(1)) * 1e-3
    codecs.encode(sample, args.codec, args.block_size)  # the pool's threads start
    _, t = _timed(lambda: codecs.encode(sample, args.codec, args.block_size), fence)
    projected = t * asked / sample.numel()
    numel = asked if projected <= args.max_pass_seconds else min(asked, args.fallback_numel)
    del sample

    # The values: a delta's magnitude (the speed does not depend on it); the same values on the host and device.
    if cuda:
        x_dev = torch.randn(numel, device=dev, generator=gen).mul_(1e-3)
        x_host = x_dev.cpu()
    else:
        x_dev, x_host = None, torch.randn(numel, generator=gen).mul_(1e-3)
    fp32_bytes = 4 * numel
    payload_bytes = codecs.encoded_size(numel, args.codec, args.block_size)
    scale_n = min(numel, SCALING_NUMEL)
    x_small = x_host[:scale_n]

    checks: dict = {}
    reference: list = []  # host_decode's first output, until the prototype's decode is compared with it
    kinds = ["host_encode", "host_decode", "host_encode_1t", "host_decode_1t"]
    if cuda:
        kinds += ["device_encode", "d2h_fp32", "device_decode"]
    if not args.no_prototype:
        kinds += ["prototype_encode", "prototype_decode"]
    seconds: dict[str, list[float]] = {k: [] for k in kinds}
    payload = b""  # host_encode's, which comes first in the first repetition
    small_payload = codecs.encode(x_small, args.codec, args.block_size)

    def one(name: str) -> None:
        nonlocal payload
        if name == "host_encode":
            payload, s = _timed(lambda: codecs.encode(x_host, args.codec, args.block_size), fence)
        elif name == "host_decode":
            got, s = _timed(lambda: codecs.decode(payload, expected_numel=numel), fence)
            if not args.no_prototype and not reference and "prototype_decode_equal" not in checks:
                reference.append(got)  # the reference for the prototype's decode, once
        elif name in ("host_encode_1t", "host_decode_1t"):
            codecs.set_threads(1)
            try:
                if name == "host_encode_1t":
                    _, s = _timed(lambda: codecs.encode(x_small, args.codec, args.block_size), fence)
                else:
                    _, s = _timed(lambda: codecs.decode(small_payload, expected_numel=scale_n), fence)
            finally:
                codecs.set_threads(threads)
        elif name == "device_encode":
            got, s = _timed(lambda: codecs.encode(x_dev, args.codec, args.block_size), fence)
            if "device_encode_bytes_equal" not in checks:
                checks["device_encode_bytes_equal"] = got == payload
        elif name == "d2h_fp32":
            _, s = _timed(lambda: x_dev.to("cpu"), fence)
        elif name == "device_decode":
            _, s = _timed(lambda: codecs.decode(payload, expected_numel=numel).to(dev), fence)
        elif name == "prototype_encode":
            src = x_dev if cuda else x_host
            got, s = _timed(lambda: device_encode(src, args.codec, args.block_size), fence)
            if "prototype_bytes_equal" not in checks:
                checks["prototype_bytes_equal"] = got == payload
                if got != payload and len(got) == len(payload):
                    a = torch.frombuffer(bytearray(got), dtype=torch.uint8)
                    b = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                    checks["prototype_bytes_differing"] = int((a != b).sum())
        elif name == "prototype_decode":
            got, s = _timed(lambda: device_decode(payload, dev, expected_numel=numel), fence)
            if "prototype_decode_equal" not in checks:
                want = reference.pop() if reference else codecs.decode(payload)
                checks["prototype_decode_equal"] = bool(torch.equal(got.cpu(), want))
                reference.clear()
        else:
            raise AssertionError(name)
        seconds[name].append(s)

    repeats_done, rep_seconds = 0, []  # a repetition's measured seconds (the first one's checks left out)
    for rep in range(args.repeats):
        for name in (kinds if rep % 2 == 0 else kinds[::-1]):
            one(name)
        rep_seconds.append(sum(seconds[k][-1] for k in kinds))
        repeats_done += 1
        spent = time.perf_counter() - started
        if budget is not None and rep + 1 < args.repeats and spent + max(rep_seconds) > budget:
            break

    sizes = {k: (scale_n if k.endswith("_1t") else numel) for k in kinds}
    moved = {"host_encode": 0, "host_decode": 0, "host_encode_1t": 0, "host_decode_1t": 0,
             "device_encode": fp32_bytes, "d2h_fp32": fp32_bytes, "device_decode": fp32_bytes,
             "prototype_encode": payload_bytes if cuda else 0, "prototype_decode": payload_bytes if cuda else 0}
    measured = {}
    for k in kinds:
        per_b = [s * PER / sizes[k] for s in seconds[k]]
        measured[k] = {"seconds": seconds[k], "numel": sizes[k],
                       "mb_per_s_of_fp32": [4 * sizes[k] / s / 1e6 for s in seconds[k]],
                       "seconds_per_1b": interval(per_b), "median_seconds_per_1b": statistics.median(per_b),
                       "bytes_across_pcie": moved[k]}

    def med(k: str) -> float | None:
        return measured[k]["median_seconds_per_1b"] if k in measured else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    result = {
                "device": kind, "gpu": torch.cuda.get_device_name() if cuda else None,
        "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "codec": args.codec, "block_size": args.block_size, "codec_threads": threads, "torch_threads": args.threads,
        "numel_asked": asked, "numel_measured": numel, "extrapolated": numel != asked,
        "projected_host_encode_seconds_at_numel_asked": projected, "max_pass_seconds": args.max_pass_seconds,
        "repeats": args.repeats, "repeats_done": repeats_done, "budget_seconds": budget,
        "repetition_seconds": rep_seconds,
        "fp32_bytes": fp32_bytes, "payload_bytes": payload_bytes, "compression": fp32_bytes / payload_bytes,
        "measured": measured, "checks": checks,
        "summary_seconds_per_1b": {
            "encode_host_tensor": med("host_encode"), "encode_cuda_tensor_as_is": med("device_encode"),
            "of_which_d2h_fp32": med("d2h_fp32"), "encode_on_device_prototype": med("prototype_encode"),
            "decode_to_host": med("host_decode"), "decode_to_device_as_is": med("device_decode"),
            "decode_on_device_prototype": med("prototype_decode"),
            "host_encode_thread_scaling": ratio(med("host_encode_1t"), med("host_encode")),
            "host_decode_thread_scaling": ratio(med("host_decode_1t"), med("host_decode")),
        },
        "peak_host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "seconds": time.perf_counter() - started,
    }
    summary = result["summary_seconds_per_1b"]
    print(f"{kind}{' (' + result['gpu'] + ')' if cuda else ''}: {args.codec}, {numel:.3g} values measured"
          f"{' (extrapolated to ' + format(asked, '.3g') + ')' if numel != asked else ''}, codec threads {threads}, "
          f"{repeats_done} repetitions; seconds per 1B values (median):", flush=True)
    for k, v in summary.items():
        print(f"  {k:34s} {'-' if v is None else format(v, '8.3f'):>8s}", flush=True)
    print(f"  checks: {checks}; peak host RSS {result['peak_host_rss_gib']:.1f} GiB; {result['seconds']:.1f} s",
          flush=True)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_result(out, result)
        print(f"wrote {out}")
    return result


def main(argv: list[str] | None = None) -> int:
    try:
        run(parse(argv))
    except BadArgs as e:
        print(f"bench_codec_device: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

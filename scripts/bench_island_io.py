#!/usr/bin/env python3
"""The throughputs an island's rank 0 depends on when a fragment's delta leaves the island through it.

    python -m scripts.bench_island_io [--mib 256] [--repeats 5] [--out docs/results/island_io/bench_island_io.json]

Measured on this machine, side by side in one invocation, each ``--repeats`` times (medians and 95% intervals):

- the int4 codec (``protocols/codecs.py``, error feedback's encode and the reducer's decode) on ``--mib`` MiB of
  fp32: on one thread; with 2 torch intra-op threads (``codec_torch2``: torch does not spread these kernels); and
  with the codec's own 2 threads (``codecs.set_threads``, ``--codec-threads``: runs of blocks at once);
- the pseudo-gradient Θ − θ and Nesterov outer step's memory-bound host arithmetic on the same size;
- the gloo broadcast of ``--mib`` MiB from rank 0 to a second rank on loopback (what ``IslandSync`` does to send
  merged values to the island's other ranks; NCCL over NVLink is another league, and this machine has none).

The arithmetic for a 12B model (docs/design.md, "Islands of many ranks") takes these per-core figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scripts.bars import each
from scripts.results import write_result
from scripts.stats import fmt, interval

from atoll.protocols import codecs

ROOT = Path(__file__).resolve().parent.parent


def codec_gbps(x: torch.Tensor, threads: int, repeats: int, codec_threads: int = 1) -> list[float]:
    """GB/s of fp32 input through int4 encode then decode, per repetition."""
    torch.set_num_threads(threads)
    codecs.set_threads(codec_threads)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        payload = codecs.encode(x, "int4")
        codecs.decode(payload, expected_numel=x.numel())
        out.append(x.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return out


def outer_gbps(x: torch.Tensor, threads: int, repeats: int) -> list[float]:
    """GB/s of fp32 through Δ = Θ − θ and a Nesterov step on Θ (momentum and Θ updated in place)."""
    torch.set_num_threads(threads)
    theta, base, momentum = x.clone(), x + 0.01, torch.zeros_like(x)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        delta = base - theta
        momentum.mul_(0.9).add_(delta)
        base.sub_(delta.add_(momentum, alpha=0.9), alpha=0.7)
        out.append(x.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return out


def _broadcast_worker(rank: int, port: int, numel: int, repeats: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.randn(numel) if rank == 0 else torch.empty(numel)
    dist.broadcast(x, src=0)  # warm the connection
    speeds = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(x, src=0)
        dist.barrier()
        speeds.append(numel * 4 / (time.perf_counter() - t0) / 1e9)
    if rank == 0:
        queue.put(speeds)
    dist.destroy_process_group()


def broadcast_gbps(numel: int, repeats: int) -> list[float]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_broadcast_worker, args=(r, port, numel, repeats, queue)) for r in range(2)]
    for p in procs:
        p.start()
    speeds = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    return speeds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "island_io" / "bench_island_io.json"))
    args = ap.parse_args()
    numel = args.mib * 2**20 // 4
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    measured: dict[str, list[float]] = {k: [] for k in ("codec_1t", "codec_torch2", "codec_2t", "outer_1t",
                                                         "outer_2t")}
    for _ in each(range(args.repeats), "repeats"):  # interleaved: background load hits each alike
        measured["codec_1t"] += codec_gbps(x, 1, 1)
        measured["codec_torch2"] += codec_gbps(x, 2, 1)
        measured["codec_2t"] += codec_gbps(x, 1, 1, codec_threads=2)
        measured["outer_1t"] += outer_gbps(x, 1, 1)
        measured["outer_2t"] += outer_gbps(x, 2, 1)
    measured["gloo_broadcast"] = broadcast_gbps(numel, args.repeats)
    result = {"mib": args.mib,
              "cores": os.cpu_count(), "gb_per_s": {k: interval(v) for k, v in measured.items()},
              "median_gb_per_s": {k: statistics.median(v) for k, v in measured.items()}}
    result["codec_2t_over_1t"] = interval([b / a for a, b in zip(measured["codec_1t"], measured["codec_2t"])])
    for k, v in result["gb_per_s"].items():
        print(f"{k}: {fmt(v, 3)} GB/s")
    print(f"codec at 2 codec threads / 1 thread: {fmt(result['codec_2t_over_1t'], 2)}")
    write_result(Path(args.out), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

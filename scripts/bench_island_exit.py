#!/usr/bin/env python3
"""Whether a rank of an island can abort as it exits, with the island's collectives as they were and as they are.

    python -m scripts.bench_island_exit [--blocks 3] [--collectives 2000] [--runs 20] [--load 0]
        [--out docs/results/island_exit/bench_island_exit.json]

Two modes: ``raw`` makes the collectives with ``torch.distributed`` directly, as ``IslandSync`` did; ``settled``
through ``node/island/collectives.py``, which keeps what gloo's threads still hold until they let go, and waits for
the last of it at exit. In each block (a
block stands for a seed; the modes alternate within it, their order too):

- **the window**: a two-rank gloo job makes ``--collectives`` all-reduces of a boundary's header per rank and mode
  (the modes alternating every 10 all-reduces) and counts
  those that returned with the tensor left to gloo's thread to free (still held by it, and not kept by
  ``collectives``): each is a moment at which a rank that exits, dropping the tensor, can abort. Also the mean time
  per all-reduce: what keeping costs.
- **exits**: ``--runs`` two-rank jobs shaped like a follower's last steps (``examples/own_loop.py`` under
  torchrun): a ``DistributedDataParallel`` step (the wrapper kept to the end), then the broadcast of a small
  object, and a boundary's collectives on temporaries (an all-reduce of a header, a broadcast of values), then
  ``destroy_process_group`` with the DDP wrapper still holding the group, and exit. A job aborted when a rank died
  of SIGABRT or printed "terminate called"; how often depends on the host's scheduling, so a rate of 0 in a few
  dozen says little alone. A Wilson 95% interval on each mode's rate.

``--load`` busy processes keep the cores contended while it runs (a CI host running other tests).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("raw", "settled")
_KEPT: list = []


def _collectives():
    """``node/island/collectives.py``, by its path: the package's imports (hivemind, ...) would lengthen the exit
    both modes are measured on."""
    spec = importlib.util.spec_from_file_location("collectives", ROOT / "node" / "island" / "collectives.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker(mode: str, rank: int, store: str, check: bool) -> int:
    """One rank of one run (see the module's docstring). With ``check``, also what ``collectives`` promises: the
    object arrives whole, and every temporary is back to one reference when its call returns."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    collectives = _collectives()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(64, 64))
    _KEPT.append(model)  # a script's model lives to its end, as a top-level one does
    for _ in range(2):
        model(torch.randn(8, 64)).sum().backward()
    header = torch.tensor([0.0, float(rank)], dtype=torch.float64)
    values = torch.full((4096,), float(rank))
    sent = {"step": 40, "stop": True, "peer": "QmX" * 10} if rank == 0 else None
    if mode == "raw":
        box = [sent]
        dist.broadcast_object_list(box, src=0)
        got = box[0]
        dist.all_reduce(header, op=dist.ReduceOp.MAX)
        dist.broadcast(values, src=0)
    else:
        got = collectives.broadcast_object(sent, 0)
        collectives.all_reduce(header, dist.ReduceOp.MAX)
        collectives.broadcast(values, 0)
    if check:
        if mode == "settled":
            collectives.settle()  # what the exit handler does
        counts = (header._use_count(), values._use_count())
        if got != {"step": 40, "stop": True, "peer": "QmX" * 10} or float(header[1]) != 1.0 or float(values[0]) != 0:
            print(f"rank {rank}: wrong values {got} {header.tolist()} {values[0]}", flush=True)
            return 3
        if counts != (1, 1):
            print(f"rank {rank}: a collective's tensor still held after it returned: use counts {counts}", flush=True)
            return 3
        print(f"rank {rank}: ok", flush=True)
    del header, values
    dist.destroy_process_group()
    return 0


def window(rank: int, store: str, n: int) -> int:
    """One rank of a job making ``n`` boundary headers' all-reduces in each mode, the modes alternating every 10:
    prints, per mode, how many returned with the tensor left to gloo's thread to free (each a moment at which a
    rank that exits can abort) and the mean seconds per all-reduce."""
    import torch
    import torch.distributed as dist

    collectives = _collectives()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    held = dict.fromkeys(MODES, 0)
    seconds = dict.fromkeys(MODES, 0.0)
    for i in range(2 * n):
        mode = MODES[(i // 10) % 2]
        header = torch.tensor([0.0, float(i)], dtype=torch.float64)
        t0 = time.perf_counter()
        if mode == "raw":
            dist.all_reduce(header, op=dist.ReduceOp.MAX)
        else:
            collectives.all_reduce(header, dist.ReduceOp.MAX)
        seconds[mode] += time.perf_counter() - t0
        # left to gloo's thread to free: still held by it, and (settled) not kept by the caller's side either
        held[mode] += header._use_count() > 1 and not any(t is header for t in collectives._pending)
    print(json.dumps({m: {"held": held[m], "n": n, "seconds": seconds[m] / n} for m in MODES}), flush=True)
    dist.destroy_process_group()
    return 0


def _spawn(args: list[str], timeout: float) -> tuple[list[int | None], list[str]]:
    """Two ranks of ``scripts.bench_island_exit`` with ``args``: their exit codes and outputs."""
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "scripts.bench_island_exit", *args, "--store", store]
        procs = [subprocess.Popen([*cmd, "--rank", str(r)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(2)]
        outs, codes = [], []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            outs.append(out)
            codes.append(p.returncode)
    return codes, outs


def run_pair(mode: str, check: bool = False, timeout: float = 120.0) -> tuple[str, list[str]]:
    """One run of two ranks: ('ok' | 'aborted' | 'failed', each rank's output)."""
    codes, outs = _spawn(["--worker", mode, *(["--check"] if check else [])], timeout)
    if any(c in (-6, 134) for c in codes) or any("terminate called" in o for o in outs):
        return "aborted", outs
    return ("ok" if codes == [0, 0] else "failed"), outs


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a rate of k in n."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20, help="exiting jobs per mode per block")
    ap.add_argument("--collectives", type=int, default=2000, help="all-reduces per mode per block (the window)")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--load", type=int, default=0, help="busy processes contending for the cores")
    ap.add_argument("--out", default=str(ROOT / "docs/results/island_exit/bench_island_exit.json"))
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--window", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.rank, args.store, args.check)
    if args.window:
        return window(args.rank, args.store, args.collectives)

    from scripts.results import write_result
    from scripts.stats import interval

    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    counts = {m: [{"ok": 0, "aborted": 0, "failed": 0} for _ in range(args.blocks)] for m in MODES}
    windows: dict[str, list[dict]] = {m: [] for m in MODES}
    t0 = time.monotonic()
    try:
        for b in range(args.blocks):
            codes, outs = _spawn(["--window", "--collectives", str(args.collectives)], 600)
            if codes != [0, 0]:
                raise SystemExit("the window job failed:\n" + "\n".join(o[-800:] for o in outs))
            ranks = [json.loads(o.strip().splitlines()[-1]) for o in outs]
            for mode in MODES:
                windows[mode].append({"held": sum(r[mode]["held"] for r in ranks),
                                      "n": sum(r[mode]["n"] for r in ranks),
                                      "seconds": sum(r[mode]["seconds"] for r in ranks) / 2})
            for i in range(args.runs):
                for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                    outcome, outs = run_pair(mode)
                    counts[mode][b][outcome] += 1
                    if outcome == "failed":
                        print(f"block {b} run {i} {mode}: failed\n" + "\n".join(o[-800:] for o in outs), flush=True)
            print(f"block {b}: " + "; ".join(
                f"{m}: left to gloo {windows[m][b]['held']}/{windows[m][b]['n']}, "
                f"{windows[m][b]['seconds'] * 1e6:.0f} us each, aborted {counts[m][b]['aborted']}/{args.runs}"
                for m in MODES), flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    summary = {}
    for m in MODES:
        n = sum(sum(c.values()) for c in counts[m])
        k = sum(c["aborted"] for c in counts[m])
        lo, hi = wilson(k, n)
        held = [w["held"] / w["n"] for w in windows[m]]
        summary[m] = {"left_to_gloo": interval(held), "left_to_gloo_per_block": held,
                      "us_per_all_reduce": interval([w["seconds"] * 1e6 for w in windows[m]]),
                      "exits": n, "aborted": k, "failed": sum(c["failed"] for c in counts[m]),
                      "rate": k / n if n else None,
                      "rate_95": [lo, hi], "aborted_per_block": [c["aborted"] for c in counts[m]]}
        print(f"{m}: left to gloo {held}; aborted {k}/{n} = {k / max(n, 1):.3f} (95% {lo:.3f}-{hi:.3f}); per block "
              f"{summary[m]['aborted_per_block']}")
    ratio = [s_["seconds"] / r["seconds"] for s_, r in zip(windows["settled"], windows["raw"])]
    summary["settled_over_raw_seconds"] = interval(ratio)
    print(f"settled/raw seconds per all-reduce: {ratio}")
    path = write_result(args.out, {"runs_per_block": args.runs, "collectives_per_block": args.collectives,
                                   "blocks": args.blocks, "load": args.load, "seconds": time.monotonic() - t0,
                                   "modes": summary, "counts": counts, "windows": windows},
                        seeds=list(range(args.blocks)))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

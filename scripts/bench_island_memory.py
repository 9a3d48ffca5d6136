#!/usr/bin/env python3
"""Peak resident memory per rank of an island: one rank, two data-parallel ranks, two sharded ranks (--fsdp).

    python -m scripts.bench_island_memory [--layers 8] [--width 1024] [--steps 3] [--label TEXT] [--out JSON]
    python -m scripts.bench_island_memory --fit SMALL_JSON BIG_JSON [--budget-mib 22528]

The model is a GPT of this file's ``wide`` factory (byte vocabulary, 64-token windows, ``--width`` wide,
``--layers`` deep: about 100M parameters by default), so that θ, its gradients and AdamW's two moments (16 bytes per
parameter) dominate a rank's memory rather than torch's own. Each configuration trains ``--steps`` steps of an
island alone in a new open run (diloco, one solo round), with the island's batch fixed at 2 sequences, and each
rank logs its peak resident memory (``getrusage``) as it stops; rank 0's figure is the one it logs last, after
its last checkpoint is written. Rank 0 also holds the outer state (Θ, momentum and
the fragment's base: 12 bytes per parameter, whatever the sharding), so the sharding shows on rank 1; a rank's
whole model state is 16 bytes per parameter unsharded and half that over two sharded ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.bars import each
from scripts.results import write_result

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {"1 rank": ["--batch-size", "2"], "2 ranks, data parallel": ["--nproc-per-node", "2", "--batch-size", "1"],
           "2 ranks, fsdp": ["--nproc-per-node", "2", "--batch-size", "1", "--fsdp"]}
PEAK = re.compile(r"(?:rank (\d) of \d+: stopped|stopped).*peak resident memory (\d+) MiB")


def wide():
    """The benchmark's model (``--model scripts.bench_island_memory:wide``), shaped by BENCH_WIDTH and BENCH_LAYERS."""
    from atoll.models.gpt import GPT, GPTConfig

    width, layers = int(os.environ.get("BENCH_WIDTH", "1024")), int(os.environ.get("BENCH_LAYERS", "8"))
    return GPT(GPTConfig(vocab_size=256, seq_len=64, d_model=width, n_layers=layers, n_heads=width // 128))


def run(extra: list[str], steps: int, env: dict[str, str]) -> dict[int, int]:
    with tempfile.TemporaryDirectory(prefix="bench-island-memory-") as tmp:
        cmd = [sys.executable, "-m", "atoll.node.cli", "start", "--open", "--model", "scripts.bench_island_memory:wide",
               "--algorithm", "diloco", "--sync-every", str(steps), "--overlap", "0", "--max-steps", str(steps),
               "--warmup-steps", "0", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--eval-batches", "1",
               "--max-restarts", "0", "--checkpoint-dir", tmp, *extra]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{extra} failed:\n{out.stderr[-3000:]}")
    peaks: dict[int, int] = {}
    for rank, mib in PEAK.findall(out.stderr):  # a process's peak only grows: the last line is its peak
        peaks[int(rank or 0)] = max(peaks.get(int(rank or 0), 0), int(mib))
    return peaks


def fit(small: dict, big: dict, budget_mib: float) -> dict:
    """Per rank, peak = fixed + slope × parameters, through the two runs' peaks; and the largest model whose
    ranks' peaks sum to at most ``budget_mib`` (every rank on one host, as here)."""
    out = {}
    dn = big["parameters"] - small["parameters"]
    for name, peaks in big["peak_rss_mib"].items():
        ranks = {}
        for rank, mib in peaks.items():
            slope = (mib - small["peak_rss_mib"][name][rank]) * 2**20 / dn  # bytes per parameter
            ranks[rank] = {"bytes_per_parameter": round(slope, 1),
                           "fixed_mib": round(mib - slope * big["parameters"] / 2**20)}
        fixed = sum(r["fixed_mib"] for r in ranks.values()) * 2**20
        largest = (budget_mib * 2**20 - fixed) / sum(r["bytes_per_parameter"] for r in ranks.values())
        out[name] = {"ranks": ranks, "largest_parameters_in_budget": int(largest)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--label", default="", help="what this run measures (kept in the JSON)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "island_memory" / "bench_island_memory.json"))
    ap.add_argument("--fit", nargs=2, metavar=("SMALL_JSON", "BIG_JSON"),
                    help="no run: fit each rank's peak to fixed + slope × parameters from two earlier runs, and the "
                         "largest model whose ranks fit in --budget-mib together (written into BIG_JSON)")
    ap.add_argument("--budget-mib", type=float, default=22 * 1024, help="the host memory all ranks share (--fit)")
    args = ap.parse_args()
    if args.fit:
        small, big = (json.loads(Path(f).read_text()) for f in args.fit)
        big["fit"] = {"budget_mib": args.budget_mib, "from": args.fit, **fit(small, big, args.budget_mib)}
        print(json.dumps(big["fit"], indent=1))
        write_result(Path(args.fit[1]), big)
        return 0
    env = {**os.environ, "BENCH_WIDTH": str(args.width), "BENCH_LAYERS": str(args.layers),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    os.environ.update(BENCH_WIDTH=env["BENCH_WIDTH"], BENCH_LAYERS=env["BENCH_LAYERS"])
    params = sum(p.numel() for p in wide().parameters())
    result = {"label": args.label, "parameters": params,
              "model_state_mib_unsharded": params * 16 / 2**20, "peak_rss_mib": {}}
    for name, extra in each(CONFIGS.items(), "configurations"):
        result["peak_rss_mib"][name] = peaks = run(extra, args.steps, env)
        print(f"{name}: peak resident memory per rank (MiB) {peaks}", flush=True)
    result["bytes_per_parameter"] = {name: {rank: round(mib * 2**20 / params, 1) for rank, mib in peaks.items()}
                                     for name, peaks in result["peak_rss_mib"].items()}
    print(f"{params / 1e6:.1f}M parameters: θ, gradients and AdamW state {params * 16 / 2**20:.0f} MiB unsharded")
    write_result(Path(args.out), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

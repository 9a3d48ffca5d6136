#!/usr/bin/env python3
"""Quality of compressed outer deltas: 4 daemons, the same token budget, one run per codec.

    python -m scripts.bench_compression_quality [--algorithm decoupled] [--steps 300] [--model tiny]

For each codec (none, bf16, int8, int4 without and with error feedback, int2) a fresh local swarm of four
daemons trains ``--steps`` inner steps each. The held-out loss of every daemon's final global replica Θ (all
fragments, from its last checkpoint) is evaluated on the same 32 held-out batches; the mean over daemons is
reported with its ratio to `none`. Bytes on the wire per token is the bytes all daemons sent divided by the
tokens they trained, compared with ddp's: an fp32 gradient all-reduce every step moves 2·(M−1)/M of the model
per daemon per step (the bandwidth-optimal volume; computed, since ddp would be the same for every codec).
It is also reported without the joiners' one-off download of the whole state (``after joining``), which a
short run cannot amortise as a long one does. With ``--seeds`` every codec runs once per seed (the initial
model differs) and each ratio is taken against `none` of the same seed, then averaged: the spread between seeds
shows how much of a difference is noise. Writes docs/results/compression_quality/bench_compression_quality_<algorithm>.json and .png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from scripts.bars import each
from scripts.benchkit import BATCH, run_swarm
from scripts.results import pyplot, save_figure, write_result

from atoll.models.configs import get_model_config
from atoll.node.config import RunConfig

DAEMONS = 4
RUNS = [("none", "none", True), ("bf16", "bf16", True), ("int8", "int8", True), ("int4", "int4", False),
        ("int4+ef", "int4", True), ("int2+ef", "int2", True)]


def run_once(label: str, codec: str, ef: bool, seed: int, args: argparse.Namespace) -> dict:
    extra = ["--compression", codec, "--error-feedback", "true" if ef else "false", "--seed", str(seed),
             *args.daemon_args.split()]
    result = run_swarm(Path("runs/bench_compression") / f"{args.algorithm}-{label}", args.algorithm, args, extra)
    return {"label": label, "codec": codec, "error_feedback": ef, "seed": seed, **result}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sync-every", type=int, default=40)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--algorithm", default="decoupled", choices=("diloco", "streaming", "decoupled"))
    parser.add_argument("--daemon-args", default="", help="extra flags for every daemon, e.g. '--overlap 8'")
    parser.add_argument("--codecs", nargs="+", default=[label for label, _, _ in RUNS],
                        choices=[label for label, _, _ in RUNS], help="runs to make (the first is the reference)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run per codec and seed")
    parser.add_argument("--name", default=None, help="results file name (default: per algorithm)")
    parser.add_argument("--out", default="docs/results/compression_quality")
    args = parser.parse_args()
    run = RunConfig(model=args.model, sync_every=args.sync_every, algorithm=args.algorithm)
    n = get_model_config(args.model).num_params
    ddp_bytes_per_token = 2 * (DAEMONS - 1) / DAEMONS * 4 * n / (BATCH * get_model_config(args.model).seq_len)
    runs, per_seed = [], []
    chosen = sorted((r for r in RUNS if r[0] in args.codecs), key=lambda r: args.codecs.index(r[0]))
    for seed in each(args.seeds, "seeds"):
        for label, codec, ef in each(chosen, "codecs"):
            print(f"{label}, seed {seed}: {DAEMONS} daemons x {args.steps} steps ...", flush=True)
            r = run_once(label, codec, ef, seed, args)
            per_seed.append(r)
            print(f"    held-out {r['held_out_loss_mean']:.4f}  bytes/token {r['bytes_per_token']:.1f} "
                  f"({r['bytes_per_token_after_joining']:.1f} after joining)  "
                  f"({r['seconds']:.0f} s)", flush=True)
        base = per_seed[-len(chosen)]["held_out_loss_mean"]  # the first codec given is the reference (`none`)
        for r in per_seed[-len(chosen):]:
            r["loss_ratio_to_none"] = r["held_out_loss_mean"] / base
            r["bytes_per_token_ddp_over_this"] = ddp_bytes_per_token / r["bytes_per_token"]
            r["bytes_per_token_ddp_over_this_after_joining"] = ddp_bytes_per_token / r["bytes_per_token_after_joining"]
    results = []  # per codec, over seeds
    for label, codec, ef in chosen:
        mine = [r for r in per_seed if r["label"] == label]
        bpt = statistics.mean(r["bytes_per_token"] for r in mine)
        bpt_joined = statistics.mean(r["bytes_per_token_after_joining"] for r in mine)
        results.append({
            "label": label, "codec": codec, "error_feedback": ef, "seeds": [r["seed"] for r in mine],
            "held_out_loss_mean": statistics.mean(r["held_out_loss_mean"] for r in mine),
            "loss_ratio_to_none": statistics.mean(r["loss_ratio_to_none"] for r in mine),
            "loss_ratio_per_seed": [r["loss_ratio_to_none"] for r in mine],
            "bytes_per_token": bpt, "bytes_per_token_after_joining": bpt_joined,
            "bytes_per_token_ddp_over_this": ddp_bytes_per_token / bpt,
            "bytes_per_token_ddp_over_this_after_joining": ddp_bytes_per_token / bpt_joined,
            "replayed_adoptions": sum(r.get("replayed_adoptions", 0) for r in mine),
            "full_adoptions": sum(r.get("full_adoptions", 0) for r in mine),
        })
    doc = {           "algorithm": args.algorithm, "model": args.model,
           "params": n, "daemons": DAEMONS, "daemon_args": args.daemon_args, "steps_per_daemon": args.steps,
           "sync_every": args.sync_every,
           "seeds": args.seeds, "fragments": run.num_fragments, "ddp_bytes_per_token": ddp_bytes_per_token,
           "codecs": results, "runs": per_seed}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or f"bench_compression_quality_{args.algorithm}"
    write_result(out / f"{name}.json", doc)
    plt = pyplot()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    labels = [r["label"] for r in results]
    ax1.bar(labels, [r["loss_ratio_to_none"] for r in results], color="tab:blue")
    ax1.axhline(1.0, color="k", lw=0.8)
    ax1.set_ylabel("held-out loss / none")
    ax1.set_ylim(min(0.95, min(r["loss_ratio_to_none"] for r in results) - 0.01),
                 max(1.05, max(r["loss_ratio_to_none"] for r in results) + 0.01))
    ax2.bar(labels, [r["bytes_per_token_ddp_over_this"] for r in results], color="tab:green")
    ax2.set_yscale("log")
    ax2.set_ylabel("ddp bytes per token / this")
    fig.suptitle(f"compressed outer deltas: {DAEMONS} daemons, {args.algorithm}, {args.model}, {args.steps} steps each")
    fig.tight_layout()
    save_figure(fig, out / f"{name}.png")
    for r in results:
        spread = f" (per seed {', '.join(f'{x:.4f}' for x in r['loss_ratio_per_seed'])})" if len(args.seeds) > 1 else ""
        print(f"{r['label']:8s} loss ratio {r['loss_ratio_to_none']:.4f}{spread}   ddp/this bytes "
              f"{r['bytes_per_token_ddp_over_this']:.0f}x ({r['bytes_per_token_ddp_over_this_after_joining']:.0f}x "
              f"after joining)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""ddp vs diloco vs streaming vs decoupled: 4 daemons, the same token budget, side by side in one run.

    python -m scripts.bench_algorithms [--steps 300] [--model tiny] [--sync-every 40] [--algorithms ...]

For each algorithm a fresh local swarm of four daemons (same model, data, batch size, transport) trains
``--steps`` inner steps each. Reported per algorithm: the held-out loss of every daemon's final global replica
Θ (all fragments, from its last checkpoint, evaluated on the same held-out batches) and its ratio to ddp's,
bytes every daemon sent per token trained and the ratio to ddp's, goodput (share of wall time in inner steps),
time blocked on the network, rounds, forks healed and tokens lost. Writes docs/results/algorithms/bench_algorithms.json
and .png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scripts.bars import each
from scripts.benchkit import BATCH, DAEMONS, run_swarm
from scripts.results import pyplot, save_figure, write_result

from atoll.node.config import RunConfig

ALGORITHMS = ("ddp", "diloco", "streaming", "decoupled")


def plot(doc: dict, out: Path) -> None:
    """Horizontal bars, one row per run (labels get long): loss ratio to ddp, bytes per token, goodput."""
    plt = pyplot()

    results = doc["runs"]
    labels = [r.get("label", r["algorithm"]) for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(14, 0.35 * len(results) + 1.8), sharey=True)
    rows = range(len(results))
    axes[0].barh(rows, [r.get("loss_ratio_to_ddp", 0) for r in results], color="tab:blue")
    axes[0].axvline(1.01, color="tab:red", ls="--", lw=1, label="goal: 1.01x ddp")
    axes[0].set_xlim(0.95, max(r.get("loss_ratio_to_ddp", 1) for r in results) + 0.02)
    axes[0].set_xlabel("held-out loss / ddp of the same seed (final Θ, mean of daemons)")
    axes[0].legend(fontsize=8)
    axes[1].barh(rows, [r["bytes_per_token"] for r in results], color="tab:green")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("bytes sent per token trained")
    axes[2].barh(rows, [r["goodput_mean"] for r in results], color="tab:orange")
    axes[2].set_xlim(0, 1)
    axes[2].set_xlabel("goodput (share of wall time in inner steps)")
    axes[0].set_yticks(list(rows), labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(f"{doc['daemons']} daemons, {doc['model']}, {doc['steps_per_daemon']} steps each, "
                 f"H={doc['sync_every']}")
    fig.tight_layout()
    save_figure(fig, out / "bench_algorithms.png")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sync-every", type=int, default=40)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument("--daemon-args", default="", help="extra flags for every daemon, e.g. '--overlap 8'")
    parser.add_argument("--label", default=None, help="name the runs (default: the algorithm)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the daemons' --seed (initial model, data order); a non-zero seed is added to the label, "
                             "and ratios are taken to the ddp run of the same seed when there is one")
    parser.add_argument("--append", action="store_true",
                        help="add these runs to the existing JSON (same label: replaced) instead of starting over")
    parser.add_argument("--out", default="docs/results/algorithms")
    parser.add_argument("--replot", action="store_true", help="only redraw the plot from the JSON")
    args = parser.parse_args()
    out = Path(args.out)
    if args.replot:
        plot(json.loads((out / "bench_algorithms.json").read_text()), out)
        return 0
    command = "python -m scripts.bench_algorithms " + " ".join(sys.argv[1:])
    previous = json.loads((out / "bench_algorithms.json").read_text())["runs"] if args.append else []
    results = []
    for algorithm in each(args.algorithms, "algorithms"):
        label = (args.label or algorithm) + (f" seed {args.seed}" if args.seed else "")
        print(f"{label}: {DAEMONS} daemons x {args.steps} steps ...", flush=True)
        r = run_swarm(Path("runs/bench_algorithms") / algorithm, algorithm, args,
                      [*args.daemon_args.split(), "--seed", str(args.seed)])
        r.update(label=label, daemon_args=args.daemon_args, seed=args.seed, command=command)
        results.append(r)
        print(f"    held-out {r['held_out_loss_mean']:.4f}  bytes/token {r['bytes_per_token']:.1f}  goodput "
              f"{r['goodput_mean']:.2f}  blocked {r['blocked_s_mean']:.1f}s  ({r['seconds']:.0f} s)", flush=True)
    results = [r for r in previous if r.get("label", r["algorithm"]) not in {x["label"] for x in results}] + results
    ref = next((r for r in results if r["algorithm"] == "ddp"), None)
    for r in results:
        same_seed = [x for x in results if x["algorithm"] == "ddp" and x.get("seed", 0) == r.get("seed", 0)]
        ref_r = same_seed[-1] if same_seed else ref
        if ref_r is not None:
            r["ratio_reference"] = ref_r.get("label", ref_r["algorithm"])
            r["loss_ratio_to_ddp"] = r["held_out_loss_mean"] / ref_r["held_out_loss_mean"]
            r["ddp_bytes_per_token_over_this"] = ref_r["bytes_per_token"] / r["bytes_per_token"]
    doc = {"model": args.model,
           "daemons": DAEMONS, "steps_per_daemon": args.steps, "batch_size": BATCH, "sync_every": args.sync_every,
           "fragments": RunConfig().fragments, "overlap": RunConfig().overlap, "runs": results}
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "bench_algorithms.json", doc, seeds=[args.seed])
    plot(doc, out)
    for r in results:
        extra = (f"  loss/ddp {r['loss_ratio_to_ddp']:.4f}  ddp bytes/this {r['ddp_bytes_per_token_over_this']:.0f}x"
                 if ref is not None else "")
        print(f"{r.get('label', r['algorithm']):14s} loss {r['held_out_loss_mean']:.4f}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

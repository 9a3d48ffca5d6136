#!/usr/bin/env python3
"""A straggler: 4 daemons, one of them 3× slower, the same wall time; with and without it, side by side.

    python scripts/bench_straggler.py [--seconds 90] [--model tiny] [--sync-every 40]

For each setting (diloco; decoupled with K = 1 and no grace window, K = 1 with the adaptive grace window, and
K = M = 4) two fresh swarms run for ``--seconds`` of training: one where every daemon is fast, one where the
last daemon sleeps long enough per step to be 3× slower. Steps are dominated by a fixed per-step delay (the
same on every fast daemon) so that the comparison measures waiting, not the noise of four daemons sharing two
cores. Reported: the fast daemons' tokens/s with the straggler relative to without it (goal for decoupled:
≥ 0.97×), the straggler's share of merged rounds, and the held-out loss of each swarm's final global replica.
Writes docs/results/bench_straggler.json and .png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_algorithms import evaluate_swarm, summaries  # noqa: E402
from bench_parity import BATCH  # noqa: E402
from swarm import LocalSwarm  # noqa: E402

from atoll.node.config import RunConfig  # noqa: E402

DAEMONS = 4
FAST_DELAY = 0.15  # seconds per step on every daemon, on top of the compute
SETTINGS = [
    ("diloco", "diloco", []),
    ("decoupled K=1", "decoupled", ["--quorum", "1", "--grace-gamma", "0"]),
    ("decoupled K=1+grace", "decoupled", ["--quorum", "1", "--grace-gamma", "0.5"]),
    ("decoupled K=M", "decoupled", ["--quorum", str(DAEMONS)]),
]


def run_once(root: Path, algorithm: str, extra: list[str], straggler: bool, args: argparse.Namespace) -> dict:
    common = ["--model", args.model, "--algorithm", algorithm, "--sync-every", str(args.sync_every),
              "--batch-size", str(BATCH), "--gather-timeout", "20", "--round-timeout", "20", "--threads", "1",
              "--overlap", str(args.overlap), *extra]
    shutil.rmtree(root, ignore_errors=True)
    with LocalSwarm(root, common) as swarm:
        for i in range(DAEMONS):
            slow = straggler and i == DAEMONS - 1
            # 3× slower: three times the per-step delay plus twice an estimate of the compute it would also do.
            delay = 3 * FAST_DELAY + 2 * args.compute_estimate if slow else FAST_DELAY
            swarm.start(f"d{i}", ["--fault", f"step_delay={delay}"], join=i > 0)
        time.sleep(args.seconds)
        swarm.stop_all(timeout=120)
    run = RunConfig(model=args.model, algorithm=algorithm, sync_every=args.sync_every)
    s = summaries(swarm)
    losses = evaluate_swarm(swarm, run)
    fast = s[:-1] if straggler else s
    slow_id = swarm.daemons[f"d{DAEMONS - 1}"].maddrs[0].rsplit("/", 1)[1]
    rounds = [r for d in swarm.daemons.values() for r in d.rounds()]
    return {"straggler": straggler, "fast_tokens_per_s": statistics.mean(x["tokens"] / x["wall_seconds"] for x in fast),
            "tokens_per_s_per_daemon": [x["tokens"] / x["wall_seconds"] for x in s],
            "blocked_s_mean": statistics.mean(x["blocked_s"] for x in s),
            "rounds_with_last_daemon": sum(slow_id in r["contributors"] for r in rounds) / max(1, len(rounds)),
            "held_out_loss_mean": statistics.mean(losses), "held_out_loss_per_daemon": losses}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=90)
    parser.add_argument("--sync-every", type=int, default=40)
    parser.add_argument("--overlap", type=int, default=8)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--compute-estimate", type=float, default=0.05, help="seconds of compute per step")
    parser.add_argument("--out", default="docs/results")
    args = parser.parse_args()
    results = []
    for label, algorithm, extra in SETTINGS:
        row = {"setting": label, "algorithm": algorithm, "flags": extra}
        for straggler in (False, True):
            print(f"{label}: {'one 3x slower daemon' if straggler else 'all fast'} for {args.seconds:.0f} s ...",
                  flush=True)
            root = Path("runs/bench_straggler") / f"{label.replace(' ', '_').replace('=', '')}-{int(straggler)}"
            row["with" if straggler else "without"] = run_once(root, algorithm, extra, straggler, args)
        row["fast_tokens_per_s_ratio"] = row["with"]["fast_tokens_per_s"] / row["without"]["fast_tokens_per_s"]
        results.append(row)
        print(f"    fast daemons' tokens/s with/without the straggler: {row['fast_tokens_per_s_ratio']:.3f}; "
              f"held-out {row['without']['held_out_loss_mean']:.4f} / {row['with']['held_out_loss_mean']:.4f}",
              flush=True)
    doc = {"command": "python scripts/bench_straggler.py " + " ".join(sys.argv[1:]), "model": args.model,
           "daemons": DAEMONS, "seconds": args.seconds, "sync_every": args.sync_every, "overlap": args.overlap,
           "fast_step_delay": FAST_DELAY, "results": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_straggler.json").write_text(json.dumps(doc, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [r["setting"] for r in results]
    ax1.bar(labels, [r["fast_tokens_per_s_ratio"] for r in results], color="tab:blue")
    ax1.axhline(0.97, color="k", ls="--", lw=0.8)
    ax1.set_ylim(0, 1.1)
    ax1.set_ylabel("fast daemons' tokens/s: with / without straggler")
    x = range(len(results))
    ax2.bar([i - 0.2 for i in x], [r["without"]["held_out_loss_mean"] for r in results], 0.4, label="all fast")
    ax2.bar([i + 0.2 for i in x], [r["with"]["held_out_loss_mean"] for r in results], 0.4, label="one 3× slower")
    ax2.set_xticks(list(x), labels)
    lo = min(min(r["with"]["held_out_loss_mean"], r["without"]["held_out_loss_mean"]) for r in results)
    ax2.set_ylim(lo * 0.95, None)
    ax2.set_ylabel("held-out loss (final Θ)")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"{DAEMONS} daemons, {args.model}, {args.seconds:.0f} s each, H={args.sync_every}")
    fig.tight_layout()
    fig.savefig(out / "bench_straggler.png", dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())

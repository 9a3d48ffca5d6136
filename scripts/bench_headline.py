#!/usr/bin/env python3
"""The quality headline: ddp against decoupled in its default configuration, interleaved, several seeds.

    python -m scripts.bench_headline [--seeds 0 1 2] [--steps 300] [--model tiny] [--sync-every 40]

For each seed, the same four-daemon swarm as ``scripts/bench_algorithms.py`` (tiny, batch 8, equal tokens) runs
each configuration in turn: ``ddp`` (the baseline), ``decoupled`` with every default (plain averaging, int4, join
window, the delta rule), ``decoupled`` with the papers' Nesterov outer step, ``decoupled`` as it was before the
delta rule (Nesterov, overwriting at a merge) and ``diloco``. The order rotates from seed to seed, so
that neither side always runs first on the shared machine. Each ratio is a configuration's held-out loss (final
global replica, mean of the daemons) over the ddp run of the same seed in this invocation; reported per seed and
as the mean with a 95% interval over seeds. Writes ``<out>/bench_headline.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from scripts.bars import each
from scripts.benchkit import BATCH, DAEMONS, run_swarm
from scripts.results import pyplot, save_figure, write_result
from scripts.stats import fmt, interval

NESTEROV = ["--outer-lr", "0.7", "--outer-momentum", "0.9"]  # the papers' outer step
CONFIGS = (  # label, algorithm, extra daemon flags
    ("ddp", "ddp", []),
    ("decoupled (defaults)", "decoupled", []),  # plain averaging, the delta rule
    ("decoupled, Nesterov", "decoupled", NESTEROV),
    ("decoupled as before (Nesterov, overwriting)", "decoupled", [*NESTEROV, "--local-merge", "overwrite"]),
    ("diloco", "diloco", []),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sync-every", type=int, default=40)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--out", default="docs/results/headline")
    args = parser.parse_args()
    started = time.time()
    runs = []
    for i, seed in enumerate(each(args.seeds, "seeds")):
        order = CONFIGS[i % len(CONFIGS):] + CONFIGS[:i % len(CONFIGS)]
        for label, algorithm, extra in order:
            print(f"seed {seed}: {label}, {DAEMONS} daemons x {args.steps} steps ...", flush=True)
            bench = SimpleNamespace(model=args.model, sync_every=args.sync_every, steps=args.steps)
            r = run_swarm(Path("runs/bench_headline") / algorithm, algorithm, bench, [*extra, "--seed", str(seed)])
            r.update(label=label, seed=seed, flags=extra)
            runs.append(r)
            print(f"    held-out {r['held_out_loss_mean']:.4f}  tokens lost {r['tokens_lost'] / r['tokens_total']:.0%}"
                  f"  carried {r['tokens_carried'] / r['tokens_total']:.0%}"
                  f"  blocked {r['blocked_s_mean']:.1f}s  ({r['seconds']:.0f} s)", flush=True)
    ddp = {r["seed"]: r for r in runs if r["algorithm"] == "ddp"}
    summary = {}
    for label, _, _ in CONFIGS:
        mine = [r for r in runs if r["label"] == label]
        for r in mine:
            r["loss_ratio_to_ddp"] = r["held_out_loss_mean"] / ddp[r["seed"]]["held_out_loss_mean"]
            r["ddp_bytes_per_token_over_this"] = ddp[r["seed"]]["bytes_per_token"] / r["bytes_per_token"]
        summary[label] = {
            "held_out_loss": interval([r["held_out_loss_mean"] for r in mine]),
            "loss_ratio_to_ddp": interval([r["loss_ratio_to_ddp"] for r in mine]),
            "ddp_bytes_per_token_over_this": interval([r["ddp_bytes_per_token_over_this"] for r in mine]),
            "tokens_lost_share": interval([r["tokens_lost"] / r["tokens_total"] for r in mine]),
            "tokens_carried_share": interval([r["tokens_carried"] / r["tokens_total"] for r in mine]),
            "in_flight_steps_p50_p95": _percentiles([x for r in mine for x in r["in_flight_steps"]]),
            "blocked_s_per_daemon": interval([r["blocked_s_mean"] for r in mine]),
            "goodput": interval([r["goodput_mean"] for r in mine]),
            "seeds_within_1pct_of_ddp": sum(r["loss_ratio_to_ddp"] <= 1.01 for r in mine),
        }
    doc = {"model": args.model,
           "daemons": DAEMONS, "steps_per_daemon": args.steps, "batch_size": BATCH, "sync_every": args.sync_every,
           "seeds": args.seeds, "minutes": (time.time() - started) / 60, "summary": summary, "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "bench_headline.json", doc)
    plot(doc, out / "bench_headline.png")
    for label, s in summary.items():
        print(f"{label:28s} held-out {fmt(s['held_out_loss'], 4)}  / ddp {fmt(s['loss_ratio_to_ddp'])}  "
              f"ddp bytes/these {fmt(s['ddp_bytes_per_token_over_this'], 0)}  blocked {fmt(s['blocked_s_per_daemon'], 1)} s")
    return 0


def _percentiles(values: list[int]) -> list[int] | None:
    values = sorted(values)
    if not values:
        return None
    return [values[len(values) // 2], values[min(len(values) - 1, -(-95 * len(values) // 100) - 1)]]


def plot(doc: dict, path: Path) -> None:
    plt = pyplot()

    labels = [label for label, _, _ in CONFIGS if label != "ddp"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, label in enumerate(labels):
        s = doc["summary"][label]["loss_ratio_to_ddp"]
        ax.errorbar([s["mean"]], [i], xerr=[[s["ci95"] or 0], [s["ci95"] or 0]], fmt="o", color="black",
                    capsize=5, label="mean, 95% interval" if i == 0 else None)
        ax.plot(s["values"], [i] * len(s["values"]), "x", color="tab:blue", label="one seed" if i == 0 else None)
    ax.axvline(1.0, color="gray", lw=0.8)
    ax.axvline(1.01, color="tab:red", ls="--", lw=0.8, label="goal 1.01x")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(-0.7, len(labels) - 0.3)
    ax.set_xlabel("held-out loss / ddp of the same seed, same invocation")
    ax.set_title(f"{doc['daemons']} daemons, {doc['model']}, {doc['steps_per_daemon']} steps each, H={doc['sync_every']}, "
                 f"seeds {doc['seeds']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())

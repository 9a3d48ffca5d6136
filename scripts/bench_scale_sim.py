#!/usr/bin/env python3
"""What the protocol costs one island, and how much of the swarm's work it keeps, at hundreds to thousands of
islands: the real protocol code over a simulated DHT, in virtual time (``scripts/sim/scale.py``).

    python -m scripts.bench_scale_sim [--sizes 64 256 1024] [--seeds 0 1 2] [--largest-seeds 1] [--seconds 120]
        [--max-group 16]

For each size and seed two swarms run, side by side: ``merged`` (the protocol: a round split into groups merges
their results, ``RoundProtocol._merge_siblings``) and ``split`` (the protocol before that: the groups' replicas
stay apart, and adoption keeps the heaviest). Each runs ``--warmup`` virtual seconds, is measured for
``--seconds`` (four newcomers join during it), then drains for 30 s without new rounds. Per island and minute it reports the DHT calls, the entries (records) and KiB
they returned; the busiest key's reads per second (the load on the DHT nodes that hold it); round formation time
and members (its group) and contributors (every group merged into its result); a newcomer's seconds to its first
merged round; the distinct replicas at the newest version over the window (a fork is two or more); after the
drain, the share of all the work merged in rounds that the most-held replica carries (``work kept``: the rest
was merged on lines given up for a heavier one), and the seconds after the last rounds until every island held
one replica.

Each figure is the mean over seeds, with the lowest and highest seed; its growth with N is the least-squares
slope of log figure against log N (0: flat, 1: linear). Nothing here is timed on the wall clock: the figures are
counts, the same on any machine. Writes docs/results/scale_sim/bench_scale_sim.json and .png (``--out`` to change);
``--add-to JSON`` keeps an earlier run's results and adds the sizes given (each variant of the largest size can
then run in its own process: ``--variants``). ``--before JSON`` shows an earlier revision's merged runs beside
these, as the baseline of a change to the protocol (the old code cannot run in the same process as the new).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from scripts.bars import each
from scripts.results import pyplot, save_figure, write_result
from scripts.sim.scale import SimConfig, simulate
from scripts.stats import power_law

ROOT = Path(__file__).resolve().parents[1]
FIGURES = {  # key: (label, unit, how to read it from one run's summary)
    "entries": ("records read per island", "per min", lambda r: r["per_island_per_min"]["entries"]),
    "kib": ("bytes read per island", "KiB/min", lambda r: r["per_island_per_min"]["kib"]),
    "calls": ("DHT calls per island", "per min", lambda r: r["per_island_per_min"]["calls"]),
    "hot_key": ("reads of the busiest key", "per s", lambda r: r["busiest_key"]["reads_per_s"]),
    "formation": ("round formation", "s", lambda r: r["formation_s"].get("mean")),
    "members": ("round members (its group)", "islands", lambda r: r["round_members"].get("mean")),
    "contributors": ("round contributors (groups merged)", "islands",
                     lambda r: r["round_contributors"].get("mean")),
    "newcomer": ("newcomer to its first round", "s", lambda r: r["newcomer_s_to_first_round"].get("mean")),
    "replicas": ("replicas at the newest version", "mean", lambda r: r["replicas_over_time"].get("mean")),
    "work_kept": ("work kept on the surviving line", "share", lambda r: r["work_kept"]),
    "settled": ("one replica, after the last rounds", "s", lambda r: r["settled_s"]),
}


VARIANTS = {"merged": True, "split": False}  # name: SimConfig.merge_groups
BEFORE = "one key (before)"  # ``--before``: an earlier revision's merged runs, every record under one key
COLORS = {"merged": "C0", "split": "C3", BEFORE: "C7"}


def row(n: int, variant: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"islands": n, "variant": variant, "seeds": len(runs)}
    for key, (_, _, get) in FIGURES.items():
        values = [v for v in (get(r) for r in runs) if v is not None]
        out[key] = statistics.fmean(values) if values else None
        out[key + "_range"] = [min(values), max(values)] if values else None
    return out


def plot(doc: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(3, 4, figsize=(17, 10))
    for ax, (key, (label, unit, _)) in zip(axes.flat, FIGURES.items()):
        before = doc.get("before_label", BEFORE)
        for variant, color in {**COLORS, before: COLORS[BEFORE]}.items():
            rows = [r for r in doc["sizes"] if r["variant"] == variant and r[key] is not None]
            if not rows:
                continue
            sizes, values = [r["islands"] for r in rows], [r[key] for r in rows]
            lo = [max(0.0, v - r[key + "_range"][0]) for v, r in zip(values, rows)]  # float rounding: never < 0
            hi = [max(0.0, r[key + "_range"][1] - v) for v, r in zip(values, rows)]
            slope = doc["growth"].get(variant, {}).get(key)
            ax.errorbar(sizes, values, yerr=[lo, hi], fmt="o-", color=color, capsize=3,
                        label=variant + (f" (∝ N^{slope:.2f})" if slope is not None else ""))
            ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xscale("log", base=2)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("islands")
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(FIGURES):]:
        ax.axis("off")
    fig.suptitle(f"bench_scale_sim: the protocol's real code over a simulated DHT, groups capped at "
                 f"{doc['max_group']}; merged: a split round's groups merge, split: they stay apart; "
                 f"{doc.get('before_label', BEFORE)}: an earlier revision's merged runs (mean over seeds, bars: "
                 f"lowest and highest seed)",
                 fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[64, 256, 1024])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--largest-seeds", type=int, help="run only this many of the seeds at the largest size (its "
                    "cost grows as N^2: ~10 min a seed and variant at 1024 on one core)")
    ap.add_argument("--seconds", type=float, default=120.0, help="the measured window (virtual seconds)")
    ap.add_argument("--warmup", type=float, default=30.0)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--max-group", type=int, default=16)
    ap.add_argument("--latency", type=float, default=0.1, help="seconds per DHT call")
    ap.add_argument("--before-label", default=BEFORE, help="what ``--before``'s runs are called in the table and plot")
    ap.add_argument("--step-time", type=float, default=SimConfig.step_time, help="seconds an inner step takes")
    ap.add_argument("--sync-every", type=int, default=SimConfig.sync_every, help="inner steps a round")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "scale_sim" / "bench_scale_sim")
    ap.add_argument("--add-to", type=Path, nargs="+", default=[], help="earlier runs' JSON: keep their runs and add "
                    "these sizes' (the figures are counts in virtual time, the same on any machine and day)")
    ap.add_argument("--before", type=Path, help=f"an earlier revision's JSON: its merged runs are shown as "
                    f"{BEFORE!r}, the baseline of the progress shards and per-round open keys (the protocol's code "
                    f"before them cannot run beside today's in one process; the counts are deterministic)")
    args = ap.parse_args()
    if any(n < 2 for n in args.sizes) or args.max_group < 1 or args.seconds <= 0 or args.latency < 0:
        print("bench_scale_sim: error: sizes must be at least 2, --max-group at least 1, --seconds positive and "
              "--latency not negative", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    commands = [shlex.join(["python", "-m", "scripts.bench_scale_sim", *sys.argv[1:]])]
    earlier_commands = []
    for path in args.add_to:
        earlier = json.loads(path.read_text())
        for name, results in earlier["runs"].items():
            n, variant = name.split(" ", 1)
            if int(n) not in args.sizes:
                runs.setdefault((int(n), variant), []).extend(results)
        earlier_commands += [c for c in (earlier["command"], *earlier.get("added", [])) if c not in earlier_commands]
    commands = [*earlier_commands, *commands]
    before = json.loads(args.before.read_text()) if args.before else None
    for name, results in (before or {}).get("runs", {}).items():
        n, variant = name.split(" ", 1)
        if variant == "merged":
            runs[(int(n), args.before_label)] = results
    for n in each(args.sizes or [None], "sizes"):
        seeds = [] if n is None else (args.seeds[:args.largest_seeds] if args.largest_seeds and n == max(args.sizes)
                                   else args.seeds)
        for seed in each(seeds, f"seeds at N={n}"):
            for variant, merge in ((v, VARIANTS[v]) for v in args.variants):
                started = time.monotonic()
                cfg = SimConfig(islands=n, seconds=args.seconds, warmup=args.warmup, max_group=args.max_group,
                                latency=args.latency, seed=seed, merge_groups=merge, step_time=args.step_time,
                                sync_every=args.sync_every)
                result = simulate(cfg)
                result["wall_s"] = round(time.monotonic() - started, 1)
                runs.setdefault((n, variant), []).append(result)
                print(f"N={n} seed={seed} {variant}: " + ", ".join(
                    f"{key} {get(result):.3g}" for key, (_, _, get) in FIGURES.items() if get(result) is not None)
                      + f" ({result['wall_s']} s)", flush=True)
        rows = [row(m, v, rs) for (m, v), rs in sorted(runs.items())]
        growth = {v: {key: power_law([r["islands"] for r in rows if r["variant"] == v],
                                     [r[key] for r in rows if r["variant"] == v]) for key in FIGURES}
                  for v in COLORS if any(r["variant"] == v for r in rows)}
        doc = {"command": commands[0], "added": commands[1:],
               "before": {"path": str(args.before), "command": before["command"],
                          "added": before.get("added", [])} if before else None,
               "seconds": args.seconds, "warmup": args.warmup, "max_group": args.max_group,
               "before_label": args.before_label,
               "latency": args.latency, "step_time": args.step_time, "sync_every": args.sync_every,
               "seeds": args.seeds, "sizes": rows, "growth": growth,
               "runs": {f"{m} {v}": rs for (m, v), rs in sorted(runs.items())}}
        write_result(args.out.with_suffix(".json"), doc)  # after each size: a later one may fail
        plot(doc, args.out.with_suffix(".png"))
    for variant in growth:
        print(variant)
        for key, (label, unit, _) in FIGURES.items():
            cells = "  ".join(f"{r[key]:.3g}" if r[key] is not None else "-" for r in rows if r["variant"] == variant)
            slope = growth[variant][key]
            print(f"  {label:36s} {unit:8s} {cells}" + (f"   slope {slope:.2f}" if slope is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

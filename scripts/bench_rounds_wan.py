#!/usr/bin/env python3
"""Round formation over a WAN's latency: decoupled rounds among four regions of the emulated WAN
(``scripts/wan.py``), one daemon each, over loopback-like links (RTT 0) and over ``--rtts`` ms, side by side.

    python -m scripts.bench_rounds_wan --rtts 0 100 --seeds 0 1 2 [--label NAME] [--daemon-args="--flag value"]
        [--env NAME=VALUE ...]

Each (RTT, seed) builds a fresh WAN and runs ``scripts/wan_runs.py``'s atoll run, as ``bench_wan.py`` does (the
same model, budget, start-together and timeouts), of ``decoupled``. From the daemons' own round records it reports:

- how long a round takes to form (registration to the group's decision, ``formation_seconds``), median and 90th
  percentile over every daemon's record of every round;
- round sizes: the distinct groups (fragment, version, members) and the share of them with one member;
- forks: (fragment, version) pairs the daemons ended with more than one replica of;
- adoptions (a daemon taking a peer's heavier replica) and the tokens they discarded; tokens lost in all
  (adoptions, forks and the carry bound), and carried by the delta rule, as shares of the tokens trained;
- steps in flight (a merged round's snapshot to its merge), median and 95th percentile over every round;
- compute utilization and the held-out loss of the final replicas (as ``bench_wan.py``).

Runs with a ``--label`` of their own (a protocol setting passed with ``--daemon-args``, or an environment with
``--env``) are kept beside the others
in ``<out>/bench_rounds_wan.json``; each ratio is taken against the label ``--baseline`` at the same RTT and seed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from scripts import wan
from scripts import wan_runs
from scripts.bars import each
from scripts.results import pyplot, save_figure, write_result
from scripts.stats import fmt, interval


def analyse(root: Path) -> dict:
    """Round-formation figures of one run, from the daemons' metrics under ``root``."""
    rounds, adopted = [], []
    for d in sorted(root.glob("d*")):
        events = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
        rounds += [dict(e, daemon=d.name) for e in events if e.get("event") == "round"]
        adopted += [e for e in events if e.get("event") == "adopted"]
    groups = {(r["fragment"], r["version"], tuple(sorted(r["members"]))) for r in rounds}
    sizes = [len(g[2]) for g in groups]
    replicas = defaultdict(set)
    for r in rounds:
        replicas[(r["fragment"], r["version"])].add(r["hash"])
    formation = sorted(r.get("formation_seconds", 0.0) for r in rounds)
    # steps trained on the fragment between a merged round's snapshot and its merge, pooled over the daemons
    in_flight = sorted(r["in_flight_steps"] for r in rounds if r.get("in_flight_steps") is not None)
    return {"groups": len(groups), "group_sizes": {str(k): sizes.count(k) for k in sorted(set(sizes))},
            "solo_share": sizes.count(1) / len(sizes) if sizes else None,
            "mean_group_size": statistics.mean(sizes) if sizes else None,
            "formation_s_median": statistics.median(formation) if formation else None,
            "formation_s_p90": formation[int(0.9 * (len(formation) - 1))] if formation else None,
            "forks": sum(len(h) > 1 for h in replicas.values()), "adoptions": len(adopted),
            "adoption_lost_tokens": sum(e.get("lost_tokens", 0) for e in adopted),
            "rounds_per_daemon": len(rounds) / max(len(list(root.glob("d*"))), 1),
            "in_flight_p50": pct(in_flight, 0.5), "in_flight_p95": pct(in_flight, 0.95)}


def pct(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``values``; None if empty."""
    return values[min(len(values) - 1, max(0, int(q * len(values) + 0.5) - 1))] if values else None


def one(rtt: float, seed: int, args: argparse.Namespace) -> dict:
    args.seed = seed
    regions = [wan.Region(r, rate_mbit=args.rate, delay_ms=rtt / 4) for r in wan_runs.REGIONS]
    root = Path("runs/bench_rounds_wan") / f"{args.label}-{rtt:g}-{seed}"
    with wan.Wan(regions, tag="br") as w:
        r = wan_runs.run_atoll(w, root, "decoupled", args.steps, args)
    r.update(analyse(root), rtt_ms=rtt, seed=seed, label=args.label, rate_mbit=args.rate,
             daemon_args=args.daemon_args, env=args.env, lost_share=r["tokens_lost"] / max(r["tokens_total"], 1),
             carried_share=r["tokens_carried"] / max(r["tokens_total"], 1))
    return r


KEYS = ("solo_share", "mean_group_size", "formation_s_median", "formation_s_p90", "in_flight_p50", "in_flight_p95",
        "rounds_per_daemon", "forks", "adoptions", "lost_share", "carried_share", "utilization", "held_out_loss_mean")


def summarize(doc: dict) -> list[str]:
    lines = ["| label | RTT ms | seeds | " + " | ".join(KEYS) + " |", "|---" * (len(KEYS) + 3) + "|"]
    cells = defaultdict(list)
    for r in doc["runs"]:
        cells[(r["label"], r["rtt_ms"])].append(r)
    doc["summary"] = []
    for (label, rtt), runs in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        row = {"label": label, "rtt_ms": rtt, "seeds": sorted(r["seed"] for r in runs)}
        for k in KEYS:
            values = [r[k] for r in runs if r.get(k) is not None]
            row[k] = interval(values) if values else None
        base = [b for b in doc["runs"] if b["label"] == doc.get("baseline") and b["rtt_ms"] == rtt]
        if label != doc.get("baseline") and base:  # within each seed, against the baseline's run of that seed
            by_seed = {b["seed"]: b for b in base}
            pairs = [(r, by_seed[r["seed"]]) for r in runs if r["seed"] in by_seed]
            if pairs:
                row["held_out_over_baseline"] = interval([r["held_out_loss_mean"] / b["held_out_loss_mean"]
                                                          for r, b in pairs])
        doc["summary"].append(row)
        lines.append(f"| {label} | {rtt:g} | {len(runs)} | " + " | ".join(
            "-" if row[k] is None else fmt(row[k], 3 if k not in ("forks", "adoptions") else 1) for k in KEYS) + " |")
    return lines


def plot(doc: dict, path: Path) -> None:
    plt = pyplot()

    rows = doc["summary"]
    shown = ("solo_share", "formation_s_median", "in_flight_p50", "lost_share", "held_out_loss_mean")
    fig, axes = plt.subplots(1, len(shown), figsize=(4 * len(shown), 3.4))
    names = [f"{r['label']}\nRTT {r['rtt_ms']:g}" for r in rows]
    for ax, k in zip(axes, shown):
        means = [r[k]["mean"] if r[k] else float("nan") for r in rows]
        errs = [(r[k]["ci95"] or 0) if r[k] else 0 for r in rows]
        ax.bar(range(len(rows)), means, yerr=errs, color=["tab:gray" if r["rtt_ms"] == 0 else "tab:red" for r in rows],
               capsize=3)
        for i, r in enumerate(rows):  # every seed, not just the mean
            vals = r[k]["values"] if r[k] else []
            ax.plot([i] * len(vals), vals, "k.", ms=4)
        ax.set_xticks(range(len(rows)), names, fontsize=7)
        ax.set_title(k.replace("_", " "), fontsize=9)
    fig.suptitle(f"decoupled, 4 regions, {doc['model']}, {doc['steps']} steps, H={doc['sync_every']}: mean ± 95% "
                 f"over seeds (dots: each seed)", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rtts", type=float, nargs="+", default=[0.0, 100.0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rate", type=float, default=0.0, help="Mbit/s each way, every region (0: uncapped)")
    p.add_argument("--model", default="nano")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--sync-every", type=int, default=100)
    p.add_argument("--label", default="default")
    p.add_argument("--baseline", default="default")
    p.add_argument("--daemon-args", default="", help="extra `atoll start` arguments for this label, one string")
    p.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE",
                   help="environment of this label's daemons (and their p2pd), e.g. LIBP2P_TCP_REUSEPORT=true")
    p.add_argument("--run-timeout", type=float, default=600.0)
    p.add_argument("--straggler-wait", type=float, default=60.0)
    p.add_argument("--out", default="docs/results/rounds_wan")
    p.add_argument("--replot", action="store_true")
    args = p.parse_args()
    out = Path(args.out)
    path = out / "bench_rounds_wan.json"
    doc = json.loads(path.read_text()) if path.exists() else {"runs": [], "commands": []}
    if not args.replot:
        doc.update(model=args.model, steps=args.steps, sync_every=args.sync_every, baseline=args.baseline)
        doc["commands"].append("python -m scripts.bench_rounds_wan " + shlex.join(sys.argv[1:]))
        args.daemon_args = shlex.split(args.daemon_args)
        for item in args.env:  # the daemons inherit it, and p2pd from them
            name, _, value = item.partition("=")
            os.environ[name] = value
        # seeds outside, RTTs inside: both RTTs of a seed run close together in time
        for seed in each(args.seeds, "seeds"):
            for rtt in args.rtts:
                t0 = time.monotonic()
                r = one(rtt, seed, args)
                key = (args.label, rtt, seed)
                doc["runs"] = [x for x in doc["runs"] if (x["label"], x["rtt_ms"], x["seed"]) != key]
                doc["runs"].append(r)
                f = (lambda v: "-" if v is None else f"{v:.2f}")  # noqa: E731 (a run with no round has no figure)
                print(f"{args.label} RTT {rtt:g} seed {seed}: solo {f(r['solo_share'])}, groups {r['group_sizes']}, "
                      f"formation {f(r['formation_s_median'])}/{f(r['formation_s_p90'])} s, forks {r['forks']}, "
                      f"adoptions {r['adoptions']}, lost {r['lost_share']:.0%}, util {r['utilization']:.2f}, "
                      f"loss {r['held_out_loss_mean']:.3f} ({time.monotonic() - t0:.0f} s)", flush=True)
                out.mkdir(parents=True, exist_ok=True)
                write_result(path, doc)
    table = summarize(doc)
    write_result(path, doc)
    plot(doc, out / "bench_rounds_wan.png")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""A region cut off and restored: four regions of the emulated WAN (``scripts/wan.py``), one ``decoupled`` daemon
each, and region ``rd``'s link cut for ``--cut-s`` seconds in the middle of the run.

    python -m scripts.bench_partition [--seeds 0 1 2] [--cut-s 60] [--before-s 30] [--after-s 60] [--rtt 50]

Timeline of each seed: the four daemons start together (``start_together``, as ``bench_wan.py``) and train until
stopped; ``--before-s`` seconds after the first step, ``Wan.cut("rd")`` makes the router drop every packet to or from
``rd`` (a failed link: nothing is refused, connections stall); ``--cut-s`` later ``Wan.restore("rd")``; after
``--after-s`` more every daemon is stopped with SIGTERM (a graceful leave and a last checkpoint).

Reported from the daemons' own records (``metrics.jsonl``: progress every 10 steps, rounds, adoptions, summary):

- **global downtime**: the longest interval in which no round completed on any of the three connected daemons,
  inside the cut and before it; their steps/s inside the cut over before it;
- **the cut region**: its steps/s inside the cut over before it (it keeps training) and the rounds it merged alone;
- **healing**: seconds from the restore to the first round of each fragment that holds all four daemons, and
  whether all four recorded that round with the same replica hash (one history: the cut daemon's own line was
  given up, not merged beside the others'); forks healed and tokens it lost after the restore, tokens lost in all.

Writes ``<out>/<name>.json`` and ``<name>.png`` (``--name``, default ``bench_partition``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

from scripts import wan
from scripts.bars import each
from scripts.benchkit import BATCH
from scripts.results import pyplot, save_figure, write_result
from scripts.stats import fmt, interval
from scripts.swarm import LocalSwarm

REGIONS = ("ra", "rb", "rc", "rd")
CUT = "rd"
CUT_DAEMON = f"d{REGIONS.index(CUT)}"


def events(root: Path, name: str) -> list[dict]:
    path = root / name / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steps_per_s(evs: list[dict], t0: float, t1: float) -> float | None:
    """The step rate between wall times ``t0`` and ``t1``, from the progress events inside the interval."""
    pts = [(e["time"], e["step"]) for e in evs if "event" not in e and "step" in e and t0 <= e["time"] <= t1]
    if len(pts) < 2 or pts[-1][0] == pts[0][0]:
        return None
    return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])


def longest_gap(times: list[float], t0: float, t1: float) -> float:
    """The longest interval inside [t0, t1] with none of ``times`` in it (its ends count as events)."""
    marks = [t0, *sorted(t for t in times if t0 <= t <= t1), t1]
    return max(b - a for a, b in zip(marks, marks[1:]))


def analyse(root: Path, t_cut: float, t_restore: float, t_start: float, t_end: float) -> dict:
    names = sorted(p.name for p in root.glob("d*"))
    evs = {n: events(root, n) for n in names}
    connected = [n for n in names if n != CUT_DAEMON]
    rounds = {n: [e for e in evs[n] if e.get("event") == "round"] for n in names}
    connected_times = [r["time"] for n in connected for r in rounds[n]]
    rate = {n: {"before": steps_per_s(evs[n], t_start, t_cut), "cut": steps_per_s(evs[n], t_cut, t_restore),
                "after": steps_per_s(evs[n], t_restore, t_end)} for n in names}
    ratio = {n: (r["cut"] / r["before"] if r["cut"] and r["before"] else 0.0) for n, r in rate.items()}
    alone = [r for r in rounds[CUT_DAEMON] if t_cut <= r["time"] <= t_restore]
    # Healing: per fragment, the first round after the restore whose group holds all four daemons.
    summaries = {n: [e for e in evs[n] if e.get("event") == "summary"] for n in names}
    healed, one_history = {}, {}
    fragments = sorted({r["fragment"] for n in names for r in rounds[n]})
    for p in fragments:
        full = sorted((r for r in rounds[CUT_DAEMON] if r["fragment"] == p and r["time"] > t_restore
                       and len(r["members"]) == len(names)), key=lambda r: r["time"])
        if not full:
            healed[p], one_history[p] = None, False
            continue
        first = full[0]
        healed[p] = first["time"] - t_restore
        group = set(first["members"])
        same = [r for n in names for r in rounds[n]
                if r["fragment"] == p and r["version"] == first["version"] and set(r["members"]) == group]
        one_history[p] = len(same) == len(names) and len({r["hash"] for r in same}) == 1
    adopted_after = [e for e in evs[CUT_DAEMON] if e.get("event") == "adopted" and e["time"] > t_restore]
    s = {n: summaries[n][-1] if summaries[n] else {} for n in names}
    return {
        "global_gap_in_cut_s": longest_gap(connected_times, t_cut, t_restore),
        "global_gap_before_cut_s": longest_gap(connected_times, t_start, t_cut),
        "connected_rate_in_cut_over_before": statistics.mean(ratio[n] for n in connected),
        "cut_rate_in_cut_over_before": ratio[CUT_DAEMON],
        "steps_per_s": rate, "cut_rounds_alone": len(alone),
        "cut_rounds_alone_members": sorted({len(r["members"]) for r in alone}),
        "heal_s_per_fragment": healed, "heal_s_max": max(healed.values()) if None not in healed.values() else None,
        "one_history_per_fragment": one_history, "one_history": all(one_history.values()) and bool(one_history),
        "cut_adoptions_after_restore": len(adopted_after),
        "cut_tokens_lost_to_adoptions_after_restore": sum(e.get("lost_tokens", 0) for e in adopted_after),
        "cut_forks_healed": s[CUT_DAEMON].get("forks_healed"),
        "tokens_lost": {n: s[n].get("tokens_lost") for n in names}, "tokens": {n: s[n].get("tokens") for n in names},
    }


def one(seed: int, args: argparse.Namespace) -> dict:
    root = Path("runs/bench_partition") / f"s{seed}"
    shutil.rmtree(root, ignore_errors=True)
    regions = [wan.Region(r, rate_mbit=args.rate, delay_ms=args.rtt / 4) for r in REGIONS]
    common = ["--model", args.model, "--algorithm", "decoupled", "--sync-every", str(args.sync_every),
              "--batch-size", str(BATCH), "--threads", "1", "--seed", str(seed), "--gather-timeout", "20",
              "--round-timeout", "20", "--harness", f"start_together={len(REGIONS)}"]
    with wan.Wan(regions, tag="bp") as w, LocalSwarm(root, common) as swarm:
        def launch(i: int) -> None:
            r = REGIONS[i]
            swarm.start(f"d{i}", join=i > 0, prefix=["ip", "netns", "exec", w.ns(r)], host=w.addr(r))

        launch(0)
        with concurrent.futures.ThreadPoolExecutor(len(REGIONS) - 1) as pool:
            list(pool.map(launch, range(1, len(REGIONS))))
        deadline = time.monotonic() + 180
        while not all(any("step" in e and "event" not in e for e in d.metrics()) for d in swarm.daemons.values()):
            if time.monotonic() > deadline:
                raise RuntimeError("the daemons did not start training within 180 s")
            time.sleep(0.5)
        t_start = time.time()
        time.sleep(args.before_s)
        t_cut = time.time()
        w.cut(CUT)
        print(f"  seed {seed}: {CUT} cut at +{t_cut - t_start:.0f} s", flush=True)
        time.sleep(args.cut_s)
        w.restore(CUT)
        t_restore = time.time()
        print(f"  seed {seed}: {CUT} restored at +{t_restore - t_start:.0f} s", flush=True)
        time.sleep(args.after_s)
        t_end = time.time()
        codes = swarm.stop_all(timeout=60)
    r = analyse(root, t_cut, t_restore, t_start, t_end)
    r.update(seed=seed, exit_codes=codes, cut_s=t_restore - t_cut, before_s=t_cut - t_start, after_s=t_end - t_restore)
    return r


def plot(doc: dict, path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for r in doc["runs"]:
        rates = r["steps_per_s"]
        for ax, name in zip(axes[:2], ("connected", "cut")):
            names = [n for n in rates if (n == CUT_DAEMON) == (name == "cut")]
            for n in names:
                ax.plot(["before", "cut", "after"], [rates[n][k] or 0 for k in ("before", "cut", "after")], "o-",
                        alpha=0.6, label=f"seed {r['seed']} {n}")
        axes[2].bar([f"seed {r['seed']}"], [r["heal_s_max"] or float("nan")],
                    color="tab:green" if r["one_history"] else "tab:red")
    axes[0].set_title("connected daemons: steps/s", fontsize=9)
    axes[1].set_title(f"the cut region's daemon ({CUT_DAEMON}): steps/s", fontsize=9)
    axes[2].set_title("seconds from restore to a 4-member round of every fragment\n(green: one history)", fontsize=9)
    for ax in axes[:2]:
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=6)
    fig.suptitle(f"decoupled, 4 regions, RTT {doc['rtt_ms']:g} ms, region {CUT} cut for {doc['cut_s']:g} s",
                 fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--cut-s", type=float, default=60.0)
    p.add_argument("--before-s", type=float, default=30.0)
    p.add_argument("--after-s", type=float, default=60.0)
    p.add_argument("--rtt", type=float, default=50.0, help="ms between any two regions")
    p.add_argument("--rate", type=float, default=0.0, help="Mbit/s each way, every region (0: uncapped)")
    p.add_argument("--model", default="nano")
    p.add_argument("--sync-every", type=int, default=100)
    p.add_argument("--out", default="docs/results/partition")
    p.add_argument("--name", default="bench_partition", help="the output files' stem")
    args = p.parse_args()
    doc = {"model": args.model, "sync_every": args.sync_every, "rtt_ms": args.rtt, "rate_mbit": args.rate,
           "cut_s": args.cut_s, "runs": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for seed in each(args.seeds, "seeds"):
        r = one(seed, args)
        doc["runs"].append(r)
        print(f"seed {seed}: gap in cut {r['global_gap_in_cut_s']:.1f} s (before {r['global_gap_before_cut_s']:.1f}), "
              f"connected rate x{r['connected_rate_in_cut_over_before']:.2f}, cut rate x"
              f"{r['cut_rate_in_cut_over_before']:.2f}, alone {r['cut_rounds_alone']} rounds, heal "
              f"{r['heal_s_per_fragment']}, one history {r['one_history']}, adoptions "
              f"{r['cut_adoptions_after_restore']}"
              f", exit {r['exit_codes']}", flush=True)
        write_result(out / f"{args.name}.json", doc)
    runs = doc["runs"]
    doc["summary"] = {k: interval([r[k] for r in runs]) for k in
                      ("global_gap_in_cut_s", "global_gap_before_cut_s", "connected_rate_in_cut_over_before",
                       "cut_rate_in_cut_over_before") if all(r[k] is not None for r in runs)}
    healed = [r["heal_s_max"] for r in runs if r["heal_s_max"] is not None]
    doc["summary"]["heal_s_max"] = interval(healed) if healed else None
    doc["summary"]["one_history"] = f"{sum(r['one_history'] for r in runs)} of {len(runs)}"
    write_result(out / f"{args.name}.json", doc)
    plot(doc, out / f"{args.name}.png")
    for k, v in doc["summary"].items():
        print(f"{k}: {fmt(v) if isinstance(v, dict) else v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

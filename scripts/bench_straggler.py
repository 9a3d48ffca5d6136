#!/usr/bin/env python3
"""A straggler: 4 daemons, one of them 3x slower, against all fast and against a CPU-load control; repeated.

    python -m scripts.bench_straggler [--seconds 60] [--repeats 3] [--model tiny] [--sync-every 40]

For each setting (diloco; decoupled with every default; ``--settings`` adds decoupled with K = 1 and no grace
window and decoupled with K = M = 4) and each repeat, three fresh swarms run for ``--seconds`` of training, in an
order that rotates from repeat to repeat:

- ``fast``: four daemons, every one fast;
- ``straggler``: the fourth daemon sleeps long enough per step to be 3x slower, and is a member of the run;
- ``control``: the same slow fourth daemon, but training alone in a run of its own: it loads the machine's CPU as
  the straggler does (a slow daemon computes less per second and frees CPU for the others), yet nobody can wait
  for it.

Steps are dominated by a fixed per-step delay (the same on every fast daemon) so that the comparison measures
waiting more than the noise of four daemons sharing two cores. Reported, per setting over the repeats (mean and
95% interval): the fast daemons' seconds blocked on the network (the headline: a straggler must not make the
others wait), their tokens/s with the straggler relative to the control of the same repeat (like-for-like CPU)
and to all fast, the straggler's share of merged rounds, and the held-out loss of each swarm's final global
replica. Writes docs/results/straggler/bench_straggler.json and .png.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

from scripts.bars import each
from scripts.benchkit import BATCH, evaluate_swarm, summaries
from scripts.swarm import LocalSwarm

from atoll.node.config import RunConfig
from scripts.results import pyplot, save_figure, write_result
from scripts.stats import fmt, interval

DAEMONS = 4
FAST_DELAY = 0.15  # seconds per step on every daemon, on top of the compute
SETTINGS = {
    "diloco": ("diloco", []),
    "decoupled": ("decoupled", []),
    "decoupled K=1 no grace": ("decoupled", ["--quorum", "1", "--grace-gamma", "0"]),
    "decoupled K=M": ("decoupled", ["--quorum", str(DAEMONS)]),
}
VARIANTS = ("fast", "straggler", "control")


def run_once(root: Path, algorithm: str, extra: list[str], variant: str, args: argparse.Namespace) -> dict:
    common = ["--model", args.model, "--algorithm", algorithm, "--sync-every", str(args.sync_every),
              "--batch-size", str(BATCH), "--gather-timeout", "20", "--round-timeout", "20", "--threads", "1",
              "--overlap", str(args.overlap), *extra]
    shutil.rmtree(root, ignore_errors=True)
    slow = f"d{DAEMONS - 1}"
    with LocalSwarm(root, common) as swarm:
        for i in range(DAEMONS):
            name = f"d{i}"
            # 3x slower: three times the per-step delay plus twice an estimate of the compute it would also do.
            delay = 3 * FAST_DELAY + 2 * args.compute_estimate if variant != "fast" and name == slow else FAST_DELAY
            if variant == "control" and name == slow:  # a run of its own: the same load, nobody to wait for it
                swarm.start(name, ["--harness", f"step_delay={delay}", "--run-id", "control"], join=False)
            else:
                swarm.start(name, ["--harness", f"step_delay={delay}"], join=i > 0)
        time.sleep(args.seconds)
        swarm.stop_all(timeout=120)
    run = RunConfig(model=args.model, algorithm=algorithm, sync_every=args.sync_every)
    s = dict(zip(swarm.daemons, summaries(swarm)))
    members = [n for n in swarm.daemons if not (variant == "control" and n == slow)]
    losses = evaluate_swarm(swarm, run)
    fast = [s[n] for n in swarm.daemons if n != slow]
    slow_id = swarm.daemons[slow].maddrs[0].rsplit("/", 1)[1]
    rounds = [r for n in members for r in swarm.daemons[n].rounds()]
    return {"variant": variant,
            "fast_tokens_per_s": statistics.mean(x["tokens"] / x["wall_seconds"] for x in fast),
            "fast_blocked_s": statistics.mean(x["blocked_s"] for x in fast),
            "tokens_per_s_per_daemon": {n: x["tokens"] / x["wall_seconds"] for n, x in s.items()},
            "blocked_s_per_daemon": {n: x["blocked_s"] for n, x in s.items()},
            "rounds_with_last_daemon": sum(slow_id in r["contributors"] for r in rounds) / max(1, len(rounds)),
            "held_out_loss_mean": statistics.mean(losses[:len(members)]),
            "held_out_loss_per_daemon": dict(zip(swarm.daemons, losses))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--settings", nargs="+", default=["diloco", "decoupled"], choices=list(SETTINGS))
    parser.add_argument("--sync-every", type=int, default=40)
    parser.add_argument("--overlap", type=int, default=8)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--compute-estimate", type=float, default=0.05, help="seconds of compute per step")
    parser.add_argument("--out", default="docs/results/straggler")
    args = parser.parse_args()
    started = time.time()
    runs: dict[str, list[dict]] = {label: [] for label in args.settings}
    for rep in each(range(args.repeats), "repeats"):
        for label in args.settings:
            algorithm, extra = SETTINGS[label]
            order = VARIANTS[rep % 3:] + VARIANTS[:rep % 3]
            got = {}
            for variant in order:
                print(f"repeat {rep + 1}/{args.repeats} {label}: {variant} for {args.seconds:.0f} s ...", flush=True)
                root = Path("runs/bench_straggler") / f"{label.replace(' ', '_').replace('=', '')}-{variant}"
                got[variant] = run_once(root, algorithm, extra, variant, args)
            got["ratio_to_control"] = got["straggler"]["fast_tokens_per_s"] / got["control"]["fast_tokens_per_s"]
            got["ratio_to_fast"] = got["straggler"]["fast_tokens_per_s"] / got["fast"]["fast_tokens_per_s"]
            got["control_over_fast"] = got["control"]["fast_tokens_per_s"] / got["fast"]["fast_tokens_per_s"]
            runs[label].append(got)
            print(f"    fast daemons blocked {got['straggler']['fast_blocked_s']:.1f} s with the straggler, "
                  f"{got['control']['fast_blocked_s']:.1f} s in the control; tokens/s straggler/control "
                  f"{got['ratio_to_control']:.3f}, straggler/fast {got['ratio_to_fast']:.3f}", flush=True)
    results = []
    for label in args.settings:
        reps = runs[label]
        row = {"setting": label, "algorithm": SETTINGS[label][0], "flags": SETTINGS[label][1], "repeats": reps}
        for key in ("ratio_to_control", "ratio_to_fast", "control_over_fast"):
            row[key] = interval([r[key] for r in reps])
        for variant in VARIANTS:
            row[f"fast_blocked_s_{variant}"] = interval([r[variant]["fast_blocked_s"] for r in reps])
            row[f"held_out_loss_{variant}"] = interval([r[variant]["held_out_loss_mean"] for r in reps])
        row["rounds_with_straggler"] = interval([r["straggler"]["rounds_with_last_daemon"] for r in reps])
        results.append(row)
        print(f"{label:24s} blocked (fast daemons, s): straggler {fmt(row['fast_blocked_s_straggler'], 1)}, "
              f"control {fmt(row['fast_blocked_s_control'], 1)}; tokens/s straggler/control "
              f"{fmt(row['ratio_to_control'])}, /fast {fmt(row['ratio_to_fast'])}")
    doc = {"model": args.model,
           "daemons": DAEMONS, "seconds": args.seconds, "repeats": args.repeats, "sync_every": args.sync_every,
           "overlap": args.overlap, "fast_step_delay": FAST_DELAY, "minutes": (time.time() - started) / 60,
           "results": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "bench_straggler.json", doc)
    plot(doc, out / "bench_straggler.png")
    return 0


def plot(doc: dict, path: Path) -> None:
    plt = pyplot()

    results = doc["results"]
    labels = [r["setting"] for r in results]
    x = range(len(results))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, variant in enumerate(VARIANTS):
        key = f"fast_blocked_s_{variant}"
        ax1.bar([j + (i - 1) * 0.27 for j in x], [r[key]["mean"] for r in results], 0.27,
                yerr=[r[key]["ci95"] or 0 for r in results], capsize=4, label=variant)
    ax1.set_xticks(list(x), labels)
    ax1.set_ylabel(f"fast daemons' seconds blocked in {doc['seconds']:.0f} s")
    ax1.legend(fontsize=8)
    for i, key in enumerate(("ratio_to_control", "ratio_to_fast")):
        ax2.bar([j + (i - 0.5) * 0.4 for j in x], [r[key]["mean"] for r in results], 0.4,
                yerr=[r[key]["ci95"] or 0 for r in results], capsize=4,
                label={"ratio_to_control": "straggler / control", "ratio_to_fast": "straggler / all fast"}[key])
    ax2.axhline(0.97, color="k", ls="--", lw=0.8)
    ax2.set_ylim(0, 1.15)
    ax2.set_xticks(list(x), labels)
    ax2.set_ylabel("fast daemons' tokens/s, ratio")
    ax2.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"{doc['daemons']} daemons, {doc['model']}, {doc['seconds']:.0f} s each, H={doc['sync_every']}, "
                 f"{doc['repeats']} repeats (mean, 95% interval)", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Whether honest daemons hold each other for offenders: a swarm of honest DiLoCo daemons, some of them stopped
for a few seconds now and then, and what they drew.

    python -m scripts.bench_honest_offences [--daemons 12] [--seconds 150] [--stopped 2] [--stop-for 6]
        [--stop-every 16] [--seeds 0 1 2] [--tree DIR] [--label NAME] [--keep DIR]
        [--out docs/results/honest_offences/bench_honest_offences.json]

The swarm is ``test_twelve``'s (nano, DiLoCo, a round every 20 steps, steps slowed so that twelve loops leave the
cores to the protocol), its joiners started at once. Every ``--stop-every`` seconds ``--stopped`` daemons (chosen by
the seed) are stopped (SIGSTOP) for ``--stop-for`` seconds: a daemon starved or frozen for a moment, as on a loaded
host. Every daemon is honest, so every offence one of them records against another is a false one, and since an
offender is left out of its striker's rounds, it costs the rounds that include every daemon.

Reported per run: the rounds that merged every daemon (``full``: the least and the mean over the daemons), the
offences the daemons recorded by kind (from their logs), their streams refused as from non-members, and the rounds
skipped because members disagreed about the group. ``--tree DIR`` runs the daemons from another checkout (a
``git worktree`` of an earlier revision) while this harness stays the same. Each ``--label`` is kept in ``--out``
beside the others. ``--keep DIR`` keeps each run's folders (the daemons' logs) under DIR.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from scripts.results import command, git_rev, write_result
from scripts.swarm import LocalSwarm

COMMON = ["--model", "nano", "--batch-size", "2", "--algorithm", "diloco", "--sync-every", "20",
          "--gather-timeout", "20", "--round-timeout", "20", "--heartbeat", "2"]


def run(seed: int, args: argparse.Namespace, root: Path) -> dict:
    names = [f"d{i:02d}" for i in range(args.daemons)]
    rng = random.Random(seed)
    stopped = rng.sample(names[1:], args.stopped)  # never the founder: the others join through it
    prefix = ["env", "-C", args.tree, f"PYTHONPATH={args.tree}"] if args.tree else None
    swarm = LocalSwarm(root, [*COMMON, "--harness", f"step_delay={args.step_delay}"])
    started = time.monotonic()
    try:
        swarm.start(names[0], join=False, prefix=prefix)
        with concurrent.futures.ThreadPoolExecutor(len(names) - 1) as pool:
            list(pool.map(lambda n: swarm.start(n, prefix=prefix), names[1:]))
        end = time.monotonic() + args.seconds
        time.sleep(rng.uniform(0, args.stop_every))
        while time.monotonic() < end:
            if args.stop_for > 0:
                pids = [swarm.daemons[n].proc.pid for n in stopped]
                for pid in pids:
                    os.kill(pid, signal.SIGSTOP)
                try:
                    time.sleep(args.stop_for)
                finally:
                    for pid in pids:
                        os.kill(pid, signal.SIGCONT)
            time.sleep(max(0.0, min(args.stop_every - args.stop_for, end - time.monotonic())))
        full = [sum(1 for r in swarm.daemons[n].rounds() if len(r["members"]) == len(names)) for n in names]
        merged = [len(swarm.daemons[n].rounds()) for n in names]
    finally:
        swarm.stop_all(timeout=30)
    offences: collections.Counter = collections.Counter()
    unauthorized = disagreed = 0
    for daemon in swarm.daemons.values():
        for line in daemon.log().splitlines():
            found = re.search(r"sent a rejected (\w+)", line)
            if found:
                offences[found.group(1)] += 1
            unauthorized += "(unauthorized)" in line
            disagreed += "disagree about the group" in line
    return {"seed": seed, "stopped": stopped, "seconds": round(time.monotonic() - started, 1),
            "full_rounds_min": min(full), "full_rounds_mean": statistics.mean(full),
            "rounds_mean": statistics.mean(merged),
            "offences": dict(offences), "offences_total": sum(offences.values()),
            "streams_refused_unauthorized": unauthorized, "rounds_disagreed": disagreed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--daemons", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=150.0,
                        help="how long the stops go on, from when every daemon started")
    parser.add_argument("--stopped", type=int, default=2, help="daemons stopped together")
    parser.add_argument("--stop-for", type=float, default=6.0)
    parser.add_argument("--stop-every", type=float, default=16.0)
    parser.add_argument("--step-delay", type=float, default=0.03)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tree", default="", help="run the daemons from this checkout")
    parser.add_argument("--label", default="current")
    parser.add_argument("--keep", default="", help="keep each run's folders (logs, metrics) under this folder")
    parser.add_argument("--out", default="docs/results/honest_offences/bench_honest_offences.json")
    args = parser.parse_args()
    if args.daemons < 2 or not 0 <= args.stopped < args.daemons or args.stop_for >= args.stop_every:
        print("bench_honest_offences: need 2 or more daemons, fewer stopped than daemons, and --stop-for below "
              "--stop-every", file=sys.stderr)
        return 2
    return run_labelled(args, run, "bench_honest_offences")

def run_labelled(args: argparse.Namespace, run: Callable[[int, argparse.Namespace, Path], dict], prefix: str) -> int:
    """Run ``run(seed, args, folder)`` for each of ``args.seeds`` (``args.tree``, ``args.keep``, ``args.label``,
    ``args.out`` as this bench's options say), print each result, and keep them in ``args.out`` under the label
    beside the others. A folder ``--keep`` already holds for a run is refused (exit 2): its daemons would resume from
    what they find there. Shared with ``bench_swarm_restart``."""
    keep = [Path(args.keep).resolve() / f"{args.label}-seed{seed}" for seed in args.seeds] if args.keep else []
    held = next((folder for folder in keep if folder.exists()), None)
    if held is not None:
        print(f"{prefix}: {held} exists: its daemons would resume from it; pass another --keep or --label",
              file=sys.stderr)
        return 2
    if args.tree:
        args.tree = str(Path(args.tree).resolve())
    commit = git_rev(Path(args.tree)) if args.tree else git_rev()
    runs = []
    for i, seed in enumerate(args.seeds):
        if keep:
            result = run(seed, args, keep[i])
        else:
            with tempfile.TemporaryDirectory(prefix=f"{prefix}-") as root:
                result = run(seed, args, Path(root))
        print(json.dumps(result), flush=True)
        runs.append(result)
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.exists() else {"runs": {}}
    doc["runs"][args.label] = {"commit": commit, "command": command(), "settings": {
        k: v for k, v in vars(args).items() if k not in ("out", "label", "tree", "keep")}, "runs": runs}
    write_result(out, doc, seeds=args.seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())

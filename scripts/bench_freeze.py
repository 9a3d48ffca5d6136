#!/usr/bin/env python3
"""A daemon frozen from outside, and how it comes back (#32, item 5).

    python -m scripts.bench_freeze [--freeze 60] [--after 75] [--model tiny] [--repeats 3]

Three decoupled daemons train; after ``--warmup`` seconds one of them is stopped with SIGSTOP (its process group:
the daemon, its DHT process and p2pd) for ``--freeze`` seconds, then resumed. Over the next ``--after`` seconds the
script counts, from the resumed daemon's own records: the rounds it merged alone (each a fork when the others are
ahead), its adoptions (by replay, in full, forks) and the tokens they lost, the seconds until it was in a shared
round again, how many of the swarm's rounds after the thaw it was in, and its step against the others' at the end.
Writes ``<out>/bench_freeze.json`` (every run, and each figure's mean and 95% interval over the runs).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from pathlib import Path

from scripts.results import write_result
from scripts.stats import interval
from scripts.swarm import LocalSwarm


def last_step(d) -> int:
    steps = [m["step"] for m in d.metrics() if "step" in m and "event" not in m]
    return steps[-1] if steps else 0


def once(args: argparse.Namespace, root: Path) -> dict:
    """One run: three daemons, one frozen and resumed; the figures of the ``--after`` seconds after the thaw."""
    common = ["--model", args.model, "--algorithm", "decoupled", "--batch-size", "4", "--sync-every", "40",
              "--heartbeat", "1", "--harness", f"step_delay={args.step_delay}"]
    shutil.rmtree(root, ignore_errors=True)  # a fresh run: leftover checkpoints would be resumed
    with LocalSwarm(root, common) as swarm:
        for i, name in enumerate(("a", "b", "frozen")):
            swarm.start(name, join=i > 0)
        time.sleep(args.warmup)
        frozen = swarm.daemons["frozen"]
        frozen_id = frozen.maddrs[0].rsplit("/p2p/", 1)[-1]
        skip = len(frozen.metrics())
        swarm.signal("frozen", signal.SIGSTOP)
        time.sleep(args.freeze)
        swarm.signal("frozen", signal.SIGCONT)
        thawed = time.time()
        time.sleep(args.after)
        steps = {n: last_step(d) for n, d in swarm.daemons.items()}
        records = frozen.metrics()[skip:]
        others = [m for n in ("a", "b") for m in swarm.daemons[n].metrics()
                  if m.get("event") == "round" and m.get("time", 0) >= thawed]
    after = [m for m in records if m.get("time", 0) >= thawed]
    rounds = [m for m in after if m.get("event") == "round"]
    adopted = [m for m in after if m.get("event") == "adopted"]
    shared = [m["time"] - thawed for m in rounds if len(m["contributors"]) >= 2]
    early = [m for m in after if m["time"] - thawed <= args.early]  # the freeze's own aftermath
    # The swarm's rounds after the thaw (as the other two merged them): how many the resumed daemon was in.
    swarm_rounds = {(m["fragment"], m["version"]): frozen_id in m["members"] for m in others}
    return {
        "rounds_after": len(rounds), "rounds_alone": sum(len(m["members"]) == 1 for m in rounds),
        "swarm_rounds_after": len(swarm_rounds), "swarm_rounds_with_it": sum(swarm_rounds.values()),
        "adoptions": len(adopted), "adoptions_replayed": sum(m["replayed"] > 0 for m in adopted),
        "adoptions_forked": sum(bool(m["forked"]) for m in adopted),
        "rounds_alone_early": sum(m.get("event") == "round" and len(m["members"]) == 1 for m in early),
        "adoptions_forked_early": sum(m.get("event") == "adopted" and bool(m["forked"]) for m in early),
        "tokens_lost_by_adoptions": sum(m["lost_tokens"] for m in adopted),
        "first_shared_round_after_s": min(shared) if shared else None,
        "steps_at_end": steps,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--warmup", type=float, default=60.0)
    parser.add_argument("--freeze", type=float, default=60.0)
    parser.add_argument("--after", type=float, default=75.0)
    parser.add_argument("--step-delay", type=float, default=0.03)
    parser.add_argument("--repeats", type=int, default=1, help="independent runs, one after the other")
    parser.add_argument("--early", type=float, default=30.0,
                        help="seconds after the thaw whose lone rounds and forks are counted apart (*_early)")
    parser.add_argument("--out", default="docs/results/freeze")
    args = parser.parse_args()
    runs = []
    for i in range(args.repeats):
        runs.append(once(args, Path("runs/bench_freeze")))
        print(f"run {i + 1}/{args.repeats}: {json.dumps(runs[-1])}", flush=True)
    numeric = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
    result = {
        "freeze_s": args.freeze,
        "after_s": args.after, "model": args.model, "runs": runs,
        "summary": {k: interval([r[k] for r in runs if r[k] is not None]) for k in numeric
                    if any(r[k] is not None for r in runs)},
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    write_result(Path(args.out) / "bench_freeze.json", result)
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

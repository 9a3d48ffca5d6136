#!/usr/bin/env python3
"""A daemon frozen from outside, and how it comes back (#32, item 5).

    python scripts/bench_freeze.py [--freeze 60] [--after 75] [--model tiny]

Three decoupled daemons train; after ``--warmup`` seconds one of them is stopped with SIGSTOP (its process group:
the daemon, its DHT process and p2pd) for ``--freeze`` seconds, then resumed. Over the next ``--after`` seconds the
script counts, from the resumed daemon's own records: the rounds it merged alone (each a fork when the others are
ahead), its adoptions (by replay, in full, forks) and the tokens they lost, the seconds until it was in a shared
round again, and its step against the others' at the end. Writes ``<out>/bench_freeze.json``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from swarm import LocalSwarm  # noqa: E402


def last_step(d) -> int:
    steps = [m["step"] for m in d.metrics() if "step" in m and "event" not in m]
    return steps[-1] if steps else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--warmup", type=float, default=60.0)
    parser.add_argument("--freeze", type=float, default=60.0)
    parser.add_argument("--after", type=float, default=75.0)
    parser.add_argument("--step-delay", type=float, default=0.03)
    parser.add_argument("--out", default="docs/results")
    args = parser.parse_args()
    common = ["--model", args.model, "--algorithm", "decoupled", "--batch-size", "4", "--sync-every", "40",
              "--heartbeat", "1", "--fault", f"step_delay={args.step_delay}"]
    root = Path("runs/bench_freeze")
    with LocalSwarm(root, common) as swarm:
        for i, name in enumerate(("a", "b", "frozen")):
            swarm.start(name, join=i > 0)
        time.sleep(args.warmup)
        frozen = swarm.daemons["frozen"]
        skip = len(frozen.metrics())
        swarm.signal("frozen", signal.SIGSTOP)
        time.sleep(args.freeze)
        swarm.signal("frozen", signal.SIGCONT)
        thawed = time.time()
        time.sleep(args.after)
        steps = {n: last_step(d) for n, d in swarm.daemons.items()}
        records = frozen.metrics()[skip:]
    after = [m for m in records if m.get("time", 0) >= thawed]
    rounds = [m for m in after if m.get("event") == "round"]
    adopted = [m for m in after if m.get("event") == "adopted"]
    shared = [m["time"] - thawed for m in rounds if len(m["contributors"]) >= 2]
    result = {
        "command": "python scripts/bench_freeze.py " + " ".join(sys.argv[1:]), "freeze_s": args.freeze,
        "after_s": args.after, "model": args.model,
        "rounds_after": len(rounds), "rounds_alone": sum(len(m["members"]) == 1 for m in rounds),
        "adoptions": len(adopted), "adoptions_replayed": sum(m["replayed"] > 0 for m in adopted),
        "adoptions_forked": sum(bool(m["forked"]) for m in adopted),
        "tokens_lost_by_adoptions": sum(m["lost_tokens"] for m in adopted),
        "first_shared_round_after_s": min(shared) if shared else None,
        "steps_at_end": steps,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_freeze.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

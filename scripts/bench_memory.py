#!/usr/bin/env python3
"""What one daemon holds in memory beyond its model state: its process, hivemind's DHT process and p2pd.

    python -m scripts.bench_memory [--models nano tiny] [--rounds 3]

For each model, a private swarm of two daemons trains (decoupled, the defaults) until the first has merged
``--rounds`` rounds with the other; then the first daemon's processes are measured from /proc:

- RSS: resident pages, shared ones included. The DHT process is *forked* from the daemon, so most of its
  resident pages are the daemon's (copy-on-write: the libraries, the interpreter's heap as it was at the fork),
  and adding RSS counts them twice;
- USS: the pages only that process holds (``Private_Clean + Private_Dirty`` of ``smaps_rollup``);
- the daemon's tree: the daemon's RSS and its children's USS, what the daemon costs the machine;
- the model state: θ, its gradients, AdamW's two moments, the replica Θ and the outer momentum, six fp32
  copies of the parameters (the codec's buffers and the error-feedback residuals come on top, and count as
  beyond it here).

Writes docs/results/memory/bench_memory.json (``--out`` to change).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from scripts.bars import each
from scripts.results import write_result
from scripts.swarm import LocalSwarm, wait_for
from scripts.swarm import daemon_processes

ROOT = Path(__file__).resolve().parents[1]
MODEL_COPIES = 6  # θ, its gradients, AdamW's m and v, the replica Θ, the outer momentum


def memory(pid: int) -> dict[str, float]:
    """MiB resident (RSS), proportional (PSS) and unique (USS) of one process."""
    rollup = {line.split(":")[0]: int(line.split()[1]) / 1024
              for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]}
    return {"rss": rollup["Rss"], "pss": rollup["Pss"], "uss": rollup["Private_Clean"] + rollup["Private_Dirty"]}


def model_mib(name: str) -> float:
    from atoll.models.registry import build_model

    model, _ = build_model(name, 0)
    return MODEL_COPIES * 4 * sum(p.numel() for p in model.parameters()) / 2**20


def measure(model: str, rounds: int, root: Path) -> dict[str, Any]:
    args = ["--model", model, "--batch-size", "4", "--algorithm", "decoupled", "--sync-every", "20"]
    with LocalSwarm(root / model, args) as swarm:
        a = swarm.start("a", join=False, wait=300)
        swarm.start("b", wait=300)
        wait_for(lambda: len([r for r in a.rounds() if len(r["contributors"]) == 2]) >= rounds, 900,
                 f"{rounds} rounds of both daemons")
        time.sleep(5)
        procs = daemon_processes(a.proc.pid)
        figures = {role: memory(pid) for role, pid in procs.items()}
        codes = swarm.stop_all(timeout=60)
    tree = figures["daemon"]["rss"] + sum(f["uss"] for role, f in figures.items() if role != "daemon")
    state = model_mib(model)
    return {"model": model, "processes": figures, "tree_mib": tree, "rss_sum_mib": sum(f["rss"] for f in
                                                                                        figures.values()),
            "model_state_mib": state, "beyond_model_mib": tree - state, "exit": codes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["nano", "tiny"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_memory")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "memory" / "bench_memory.json")
    args = ap.parse_args()
    results = []
    for model in each(args.models, "models"):
        r = measure(model, args.rounds, args.work)
        results.append(r)
        p = r["processes"]
        print(f"{model}: daemon RSS {p['daemon']['rss']:.0f} (USS {p['daemon']['uss']:.0f}), DHT process RSS "
              f"{p['dht']['rss']:.0f} USS {p['dht']['uss']:.0f}, p2pd RSS {p['p2pd']['rss']:.0f} USS "
              f"{p['p2pd']['uss']:.0f}; tree {r['tree_mib']:.0f} MiB (RSS summed {r['rss_sum_mib']:.0f}), model "
              f"state {r['model_state_mib']:.0f}, beyond it {r['beyond_model_mib']:.0f} MiB", flush=True)
    write_result(args.out, {"results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())

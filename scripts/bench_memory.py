#!/usr/bin/env python3
"""What one daemon holds in memory beyond its model state: its process, hivemind's DHT process and p2pd.

    python -m scripts.bench_memory [--models nano tiny] [--rounds 3] [--variants forked in-process] [--repeats 1]

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

``--variants``: ``forked`` runs the daemons with hivemind's DHT process (the default), ``in-process`` with
``--dht-in-process true`` (its DHT node on a thread of the daemon, ``protocols/local_dht.py``): per repeat both, in an
order that alternates. Beside the memory, what the variant costs the daemon measured: its merges a minute and
steps a second between its first and last two-member round of the window.

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


def measure(model: str, rounds: int, root: Path, in_process: bool = False) -> dict[str, Any]:
    args = ["--model", model, "--batch-size", "4", "--algorithm", "decoupled", "--sync-every", "20",
            "--dht-in-process", "true" if in_process else "false"]
    with LocalSwarm(root / model, args) as swarm:
        a = swarm.start("a", join=False, wait=300)
        swarm.start("b", wait=300)
        wait_for(lambda: len([r for r in a.rounds() if len(r["contributors"]) == 2]) >= rounds, 900,
                 f"{rounds} rounds of both daemons")
        time.sleep(5)
        procs = daemon_processes(a.proc.pid)
        figures = {role: memory(pid) for role, pid in procs.items()}
        shared = [r for r in a.rounds() if len(r["contributors"]) == 2]
        codes = swarm.stop_all(timeout=60)
    tree = figures["daemon"]["rss"] + sum(f["uss"] for role, f in figures.items() if role != "daemon")
    state = model_mib(model)
    window = shared[-1]["time"] - shared[0]["time"]
    return {"model": model, "variant": "in-process" if in_process else "forked", "processes": figures,
            "tree_mib": tree, "rss_sum_mib": sum(f["rss"] for f in figures.values()),
            "model_state_mib": state, "beyond_model_mib": tree - state, "exit": codes,
            "merges_per_min": 60 * (len(shared) - 1) / window if window > 0 else None,
            "steps_per_s": (shared[-1]["step"] - shared[0]["step"]) / window if window > 0 else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["nano", "tiny"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_memory")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "memory" / "bench_memory.json")
    ap.add_argument("--variants", nargs="+", choices=("forked", "in-process"), default=["forked"])
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    results = []
    for repeat in each(range(args.repeats), "repeats"):
        for model in args.models:
            variants = args.variants if repeat % 2 == 0 else args.variants[::-1]
            for variant in variants:
                r = measure(model, args.rounds, args.work, variant == "in-process")
                r["repeat"] = repeat
                results.append(r)
                p = r["processes"]
                dht = f"DHT process RSS {p['dht']['rss']:.0f} USS {p['dht']['uss']:.0f}, " if "dht" in p else ""
                print(f"{model} {variant}: daemon RSS {p['daemon']['rss']:.0f} (USS {p['daemon']['uss']:.0f}), {dht}"
                      f"p2pd RSS {p['p2pd']['rss']:.0f} USS {p['p2pd']['uss']:.0f}; tree {r['tree_mib']:.0f} MiB "
                      f"(RSS summed {r['rss_sum_mib']:.0f}), model state {r['model_state_mib']:.0f}, beyond it "
                      f"{r['beyond_model_mib']:.0f} MiB; {r['merges_per_min']:.1f} merges/min, "
                      f"{r['steps_per_s']:.1f} steps/s", flush=True)
    write_result(args.out, {"results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())

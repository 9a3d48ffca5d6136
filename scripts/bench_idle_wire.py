#!/usr/bin/env python3
"""What the control plane alone puts on a thin link: four regions of the emulated WAN (``scripts/wan.py``), one
decoupled daemon each, training with no round ever due (``--sync-every`` past the budget), so that every byte on
the wire is the DHT's and libp2p's: progress records, reads of the peer table and of open rounds, summaries.

    python -m scripts.bench_idle_wire [--rate 0.88] [--steps 300] [--step-delay 0.1]

Each region's ``eth0`` transmit counter is sampled every 2 s; the rate is taken over the samples while all four
daemons train (the first and last samples of that span). The daemons' own DHT calls per second, by operation and
record kind, come from their summaries (``dht_calls``). Writes ``<out>/bench_idle_wire.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from scripts import wan
from scripts import wan_runs
from scripts.results import write_result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=0.88, help="Mbit/s each way, every region")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--step-delay", type=float, default=0.1)
    parser.add_argument("--out", default="docs/results/idle_wire")
    args = parser.parse_args()
    run_args = argparse.Namespace(model="nano", sync_every=100 * args.steps, seed=0, run_timeout=600,
                                  straggler_wait=30, daemon_args=["--harness", f"step_delay={args.step_delay}"])
    regions = [wan.Region(r, rate_mbit=args.rate, delay_ms=0) for r in wan_runs.REGIONS]
    samples: list[tuple[float, dict[str, int]]] = []
    stop = threading.Event()
    root = Path("runs/bench_idle_wire")
    with wan.Wan(regions, tag="iw") as w:
        def sample() -> None:
            while not stop.is_set():
                samples.append((time.time(), wan_runs.tx_bytes(w)))
                stop.wait(2.0)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        wan_runs.run_atoll(w, root, "decoupled", args.steps, run_args)
        stop.set()
        sampler.join()
    records = [metrics(d) for d in sorted(root.glob("d*"))]
    s = [r[-1] for r in records]  # each daemon's closing summary
    # The span in which all four trained: from the last daemon's first step to the first daemon's last one.
    steps = [[m["time"] for m in r if "event" not in m and m.get("step", 0) > 0] for r in records]
    begin, end = max(t[0] for t in steps), min(t[-1] for t in steps)
    span = [(t, tx) for t, tx in samples if begin <= t <= end]
    (t0, a), (t1, b) = span[0], span[-1]
    rates = {r: (b[r] - a[r]) / (t1 - t0) for r in wan_runs.REGIONS}
    calls: dict[str, list[float]] = {}
    for x in s:
        for kind, c in x["dht_calls"].items():
            calls.setdefault(kind, []).append(c["calls"] / x["wall_seconds"])
    result = {
        "rate_mbit": args.rate,
        "span_s": t1 - t0, "tx_bytes_per_s": rates,
        "share_of_link": statistics.mean(rates.values()) * 8 / (args.rate * 1e6),
        "dht_calls_per_s": {k: statistics.mean(v) for k, v in sorted(calls.items(), key=lambda kv: -sum(kv[1]))},
        "dht_calls_per_s_total": sum(statistics.mean(v) for v in calls.values()),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    write_result(Path(args.out) / "bench_idle_wire.json", result)
    print(json.dumps(result, indent=1))
    return 0


def metrics(d: Path) -> list[dict]:
    """A daemon's metrics records, its closing summary last."""
    return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What one read of a private run's progress key costs as the run grows, with the DHT's remembered verdicts
(``protocols/validated.py``) and without them, side by side.

    python -m scripts.bench_dht_reads [--records 64 256 1024] [--nodes 4] [--reads 20] [--repeats 3]

For each repeat and variant, ``--nodes`` real hivemind DHT nodes (each its own process and p2pd, with a member's
validators, as every daemon runs) start on loopback and each is given the same ``--records`` signed progress
records (one per member, each member's key certified by the run key), as the DHT would hold them for a swarm of
that many daemons. Then a client node reads the key ``--reads`` times in a row, as a daemon's heartbeat and its
round formation do. Reported per size: seconds per read and the reading DHT process's CPU seconds per read (it
checks every record of every node's answer), and how long ``atoll status --json``'s collection takes
(``node.status.collect_status``: the progress and config keys read, every record parsed) on a fresh client. The
variants run one after the other within each repeat, on fresh nodes. Writes docs/results/dht_reads/bench_dht_reads.json and
.png.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from hivemind import DHT

from scripts.bars import each
from scripts.dht_fill import HOLD_CHUNK, RUN, hold, members, signed_records
from scripts.results import pyplot, save_figure, write_result
from scripts.swarm import cpu_seconds
from atoll.node.ops.status import collect_status
from atoll.protocols import dht_io, validated
from atoll.protocols.auth import RunKey
from atoll.protocols.record_validator import make_validators
from atoll.protocols.records import parse_progress, progress_keys, unwrap_subkeys

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = {"remembered": validated.REMEMBER_S, "checked every read": 0.0}


def measure(chains: list, nodes: int, reads: int, run_key: RunKey) -> dict[str, float]:
    """Start ``nodes`` nodes holding the progress records of ``chains``, read them ``reads`` times from a client;
    the figures."""
    records = signed_records(chains)
    dhts: list[DHT] = []
    try:
        for _ in range(nodes):
            peers = [str(a) for a in dhts[0].get_visible_maddrs()] if dhts else []
            dhts.append(DHT(initial_peers=peers, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                            record_validators=make_validators(RUN, run_key.issue_token(RUN))))
        for dht in dhts:  # a few records a call: the DHT process reads a call from its pipe without blocking
            for i in range(0, len(records), HOLD_CHUNK):
                chunk = records[i:i + HOLD_CHUNK]
                assert dht.run_coroutine(functools.partial(hold, chunk)) == len(chunk)
        bootstrap = [str(a) for a in dhts[0].get_visible_maddrs()]
        client = DHT(initial_peers=bootstrap, start=True, client_mode=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                     record_validators=make_validators(RUN, run_key.issue_token(RUN)))
        try:
            dht_io.get_many_blocking(client, progress_keys(RUN))  # routing tables filled before the clock starts
            seconds, cpu, seen = [], [], []
            for _ in range(reads):
                c0, t0 = cpu_seconds(client.pid), time.perf_counter()
                found = dht_io.get_many_blocking(client, progress_keys(RUN), timeout=60)
                seconds.append(time.perf_counter() - t0)
                cpu.append(cpu_seconds(client.pid) - c0)
                seen.append(sum(parse_progress(v) is not None for entry in found.values()
                                for v in unwrap_subkeys(entry).values()))
        finally:
            client.shutdown()
        fresh = DHT(initial_peers=bootstrap, start=True, client_mode=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                    record_validators=make_validators(RUN, run_key.issue_token(RUN)))
        try:
            t0 = time.perf_counter()
            doc = collect_status(fresh, RUN)
            status_s = time.perf_counter() - t0
        finally:
            fresh.shutdown()
    finally:
        for dht in dhts:
            dht.shutdown()
    return {"read_s": statistics.fmean(seconds), "read_cpu_s": statistics.fmean(cpu), "records_seen": min(seen),
            "status_collect_s": status_s, "status_peers": len(doc["peers"])}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for n in sorted({r["records"] for r in runs}):
        for variant in VARIANTS:
            mine = [r for r in runs if r["records"] == n and r["variant"] == variant]
            row = {"records": n, "variant": variant, "repeats": len(mine)}
            for k in ("read_s", "read_cpu_s", "status_collect_s"):
                values = [r[k] for r in mine]
                row[k], row[k + "_range"] = statistics.fmean(values), [min(values), max(values)]
            row["records_seen_min"] = min(r["records_seen"] for r in mine)
            row["status_peers_min"] = min(r["status_peers"] for r in mine)
            rows.append(row)
        base = [r for r in runs if r["records"] == n and r["variant"] == "checked every read"]
        new = [r for r in runs if r["records"] == n and r["variant"] == "remembered"]
        ratios = [a["read_cpu_s"] / b["read_cpu_s"] for a, b in zip(new, base) if b["read_cpu_s"] > 0]
        rows[-2]["cpu_ratio"] = statistics.fmean(ratios) if ratios else None
        rows[-2]["cpu_ratio_range"] = [min(ratios), max(ratios)] if ratios else None
    return rows


def plot(doc: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (key, label) in zip(axes, (("read_s", "one read of the progress key, s"),
                                       ("read_cpu_s", "reader's DHT process CPU per read, s"),
                                       ("status_collect_s", "atoll status's collection, s"))):
        for i, variant in enumerate(VARIANTS):
            rows = [r for r in doc["rows"] if r["variant"] == variant]
            xs = [r["records"] for r in rows]
            ys = [r[key] for r in rows]
            lo = [max(0.0, y - r[key + "_range"][0]) for y, r in zip(ys, rows)]
            hi = [max(0.0, r[key + "_range"][1] - y) for y, r in zip(ys, rows)]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, color=f"C{i}", label=variant)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("progress records (daemons)")
        ax.set_title(label, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"bench_dht_reads: {doc['nodes']} DHT nodes, mean of {doc['repeats']} repeats (bars: min-max)")
    fig.tight_layout()
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--reads", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "dht_reads" / "bench_dht_reads")
    args = ap.parse_args()
    run_key = RunKey.generate()
    print(f"signing {max(args.records)} members' records...", flush=True)
    everyone = members(run_key, max(args.records))
    runs = []
    for repeat in each(range(args.repeats), "repeats"):
        for n in args.records:
            for variant, remember in VARIANTS.items():
                validated.REMEMBER_S = remember  # the nodes' processes fork from this one and keep it
                figures = measure(everyone[:n], args.nodes, args.reads, run_key)
                runs.append({"repeat": repeat, "records": n, "variant": variant, **figures})
                print(f"repeat {repeat} records {n:5d} {variant:>20}: read {figures['read_s'] * 1e3:7.1f} ms, "
                      f"cpu {figures['read_cpu_s'] * 1e3:7.1f} ms, status {figures['status_collect_s']:.2f} s "
                      f"({figures['status_peers']} peers)", flush=True)
    validated.REMEMBER_S = VARIANTS["remembered"]
    doc = {"nodes": args.nodes, "reads": args.reads, "repeats": args.repeats,
           "rows": summarize(runs), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out.with_suffix(".json"), doc)
    plot(doc, args.out.with_suffix(".png"))
    for row in doc["rows"]:
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_range")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

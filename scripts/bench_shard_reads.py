#!/usr/bin/env python3
"""What a read of a small swarm's progress records costs: one key against 16 shards, side by side.

    python -m scripts.bench_shard_reads [--records 8 64] [--nodes 8] [--reads 15] [--repeats 3]

Past 64 records a daemon reads a few of the 16 progress shards at a time (``node/rounds/peers.py``); up to 64 it reads
all 16 keys in one ``get_many``, where it read one key before the shards. This measures what that costs a small swarm,
and whether hivemind's caching of what a read found on the nearest node that lacks it (``cache_nearest``, on by default:
a store per key found) is part of it.

For each repeat, size and variant, ``--nodes`` real hivemind DHT nodes (each its own process and p2pd, with an open
run's validators) start on loopback. Before each read every record is stored again on every node with a later
expiry, as the members' heartbeats do (so that the nodes hold something newer than a reader's cache, as in a live
swarm); then a client node reads them: under one key (``<run>_progress_all``, as before the shards) or under the 16
shards' keys in one call. Reported per read: its time, the reader's CPU (its DHT process and p2pd) and the serving
nodes' CPU (all of theirs), each the mean over ``--reads`` reads. Variants run in an order that rotates between
repeats. Writes docs/results/shard_reads/bench_shard_reads.json (``--out``).
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
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from atoll.protocols.identity import RecordSigner
from scripts.bars import each
from scripts.dht_fill import HOLD_CHUNK, hold, progress_value
from scripts.results import write_result
from scripts.swarm import cpu_seconds
from scripts.swarm import descendants

from atoll.protocols import dht_io
from atoll.protocols.record_validator import make_validators
from atoll.protocols.records import parse_progress, progress_key, progress_keys, progress_shard, unwrap_subkeys

ROOT = Path(__file__).resolve().parents[1]

RUN = "bench"
ONE_KEY = f"{RUN}_progress_all"
VARIANTS = {"one key": (False, 1), "16 shards": (True, 1), "one key, no cache_nearest": (False, 0),
            "16 shards, no cache_nearest": (True, 0)}


def tree_cpu(pid: int) -> float:
    """CPU seconds of a DHT process and its p2pd."""
    total = 0.0
    for p in [pid, *descendants(pid)]:
        try:
            total += cpu_seconds(p)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def signed(owners: list[tuple[CompositeValidator, bytes, str]], sharded: bool) -> list[tuple]:
    """Each member's record, signed, under its shard's key or the one key, expiring 30 s from now."""
    out = []
    for chain, owner, peer in owners:
        key = DHTID.generate(source=progress_key(RUN, progress_shard(peer)) if sharded else ONE_KEY).to_bytes()
        value = progress_value(peer)
        record = DHTRecord(key, MSGPackSerializer.dumps(owner), MSGPackSerializer.dumps(value), get_dht_time() + 30)
        out.append((key, owner, chain.sign_value(record), record.expiration_time))
    return out


def measure(owners: list, nodes: int, reads: int, sharded: bool, cache_nearest: int) -> dict[str, float]:
    dhts: list[DHT] = []
    try:
        for _ in range(nodes):
            peers = [str(a) for a in dhts[0].get_visible_maddrs()] if dhts else []
            dhts.append(DHT(initial_peers=peers, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                            record_validators=make_validators(RUN), cache_nearest=cache_nearest))
        client = DHT(initial_peers=[str(a) for a in dhts[0].get_visible_maddrs()], start=True, client_mode=True,
                     host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=make_validators(RUN),
                     cache_nearest=cache_nearest)
        keys = progress_keys(RUN) if sharded else [ONE_KEY]
        try:
            seconds, reader, serving, seen = [], [], [], []
            for i in range(reads + 1):
                records = signed(owners, sharded)
                for dht in dhts:
                    for j in range(0, len(records), HOLD_CHUNK):
                        dht.run_coroutine(functools.partial(hold, records[j:j + HOLD_CHUNK]))
                c0, s0, t0 = tree_cpu(client.pid), sum(tree_cpu(d.pid) for d in dhts), time.perf_counter()
                found = dht_io.get_many_blocking(client, keys, timeout=60)
                time.sleep(0.5)  # what the read set off (stores of what it found) ends before the CPU is read
                elapsed = time.perf_counter() - t0
                if i == 0:
                    continue  # routing tables filled
                seconds.append(elapsed - 0.5)
                reader.append(tree_cpu(client.pid) - c0)
                serving.append(sum(tree_cpu(d.pid) for d in dhts) - s0)
                seen.append(sum(parse_progress(v) is not None for entry in found.values()
                                for v in unwrap_subkeys(entry).values()))
        finally:
            client.shutdown()
    finally:
        for dht in dhts:
            dht.shutdown()
    return {"read_s": statistics.fmean(seconds), "reader_cpu_s": statistics.fmean(reader),
            "serving_cpu_s": statistics.fmean(serving), "records_seen": min(seen)}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for n in sorted({r["records"] for r in runs}):
        for variant in VARIANTS:
            mine = [r for r in runs if r["records"] == n and r["variant"] == variant]
            if not mine:
                continue
            row: dict[str, Any] = {"records": n, "variant": variant, "repeats": len(mine),
                                   "records_seen_min": min(r["records_seen"] for r in mine)}
            for k in ("read_s", "reader_cpu_s", "serving_cpu_s"):
                values = [r[k] for r in mine]
                row[k], row[k + "_range"] = statistics.fmean(values), [min(values), max(values)]
            base = {r["repeat"]: r for r in runs if r["records"] == n and r["variant"] == "one key"}
            ratios = [(r["reader_cpu_s"] + r["serving_cpu_s"]) / (base[r["repeat"]]["reader_cpu_s"]
                                                                  + base[r["repeat"]]["serving_cpu_s"])
                      for r in mine if r["repeat"] in base]
            if ratios:
                row["cpu_vs_one_key"], row["cpu_vs_one_key_range"] = statistics.fmean(ratios), [min(ratios),
                                                                                                max(ratios)]
            rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--reads", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "shard_reads" / "bench_shard_reads")
    args = ap.parse_args()
    owners = []
    for i in range(max(args.records)):
        signer = RecordSigner()  # a key of its own: one owner subkey each
        owners.append((CompositeValidator([signer, *make_validators(RUN)[1:]]), signer.local_public_key,
                       f"QmBenchPeer{i:05d}"))
    runs = []
    for repeat in each(range(args.repeats), "repeats"):
        for n in args.records:
            order = args.variants[repeat % len(args.variants):] + args.variants[:repeat % len(args.variants)]
            for variant in order:
                sharded, cache_nearest = VARIANTS[variant]
                figures = measure(owners[:n], args.nodes, args.reads, sharded, cache_nearest)
                runs.append({"repeat": repeat, "records": n, "variant": variant, **figures})
                print(f"repeat {repeat} records {n:4d} {variant:>28}: read {figures['read_s'] * 1e3:6.1f} ms, "
                      f"reader cpu {figures['reader_cpu_s'] * 1e3:6.1f} ms, serving cpu "
                      f"{figures['serving_cpu_s'] * 1e3:6.1f} ms, {figures['records_seen']} seen", flush=True)
    doc = {           "nodes": args.nodes, "reads": args.reads, "repeats": args.repeats, "rows": summarize(runs), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out.with_suffix(".json"), doc)
    for row in doc["rows"]:
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_range")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

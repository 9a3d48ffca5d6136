#!/usr/bin/env python3
"""One slow DHT node in a swarm large enough for hivemind's walks: what it costs every other node's reads and writes.

    python -m scripts.bench_slow_node [--nodes 24] [--delays 0 0.5 2.5] [--repeats 3] [--before DIR]

A swarm of ``--nodes`` real hivemind DHT nodes on 127.0.0.1 (each its own process and p2pd, as a daemon's is), one
of which answers every find and store ``--delays`` seconds late (a member controls how late its own node answers,
up to the protocol's ``wait_timeout``, 3 s). Every other node knows at least ``bucket_size`` (20) others, so atoll's
reads and writes (``dht_io.get`` and ``dht_io.store``) take hivemind's walks there, not a small swarm's direct
path. Four honest nodes read 10 keys, each three times over; two write 10 keys, each twice; every call is timed.
The first call a node makes to the slow one is counted like any other.

``--before DIR`` runs the same swarms with atoll's code from another checkout (``git worktree add DIR REV``),
side by side in the same invocation, in an order that alternates from repeat to repeat. Each swarm is a fresh
process (``--child``) that imports atoll from the tree it measures and nothing from ``scripts/``. Writes
``docs/results/slow_node/bench_slow_node.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEYS = 10
READERS, WRITERS = 4, 2
READ_PASSES, WRITE_PASSES = 3, 2


def _slow_handlers(seconds: float) -> tuple:
    """hivemind's DHT handlers answer ``seconds`` late in the processes forked from now on (a node's DHT process
    is forked from this one when it starts; hivemind collects the handlers from the class, and checks their
    annotations)."""
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.p2p import P2PContext
    from hivemind.proto import dht_pb2

    find, store = DHTProtocol.__dict__["rpc_find"], DHTProtocol.__dict__["rpc_store"]

    async def rpc_find(self, request: dht_pb2.FindRequest, context: P2PContext) -> dht_pb2.FindResponse:
        await asyncio.sleep(seconds)
        return await find(self, request, context)

    async def rpc_store(self, request: dht_pb2.StoreRequest, context: P2PContext) -> dht_pb2.StoreResponse:
        await asyncio.sleep(seconds)
        return await store(self, request, context)

    # hivemind reads the types from the annotations, which ``from __future__ import annotations`` made strings.
    rpc_find.__annotations__ = {"request": dht_pb2.FindRequest, "context": P2PContext, "return": dht_pb2.FindResponse}
    rpc_store.__annotations__ = {"request": dht_pb2.StoreRequest, "context": P2PContext,
                                 "return": dht_pb2.StoreResponse}
    DHTProtocol.rpc_find, DHTProtocol.rpc_store = rpc_find, rpc_store
    return find, store


async def _known(_dht, node) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


async def _bucket(_dht, node) -> int:
    return node.protocol.bucket_size


def child(nodes: int, delay: float) -> dict:
    """One swarm: start it, fill the honest nodes' tables, time the writes and the reads; the figures as a dict."""
    from hivemind import DHT
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.utils import get_dht_time

    from atoll.protocols import dht_io

    slow_at = nodes // 2
    dhts = []
    try:
        for i in range(nodes):
            restore = _slow_handlers(delay) if i == slow_at and delay > 0 else None
            peers = dhts[0].get_visible_maddrs() if dhts else []
            dhts.append(DHT(initial_peers=peers, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
            if restore is not None:
                DHTProtocol.rpc_find, DHTProtocol.rpc_store = restore
        honest = [d for i, d in enumerate(dhts) if i != slow_at]
        readers, writers = honest[1:1 + READERS], honest[1 + READERS:1 + READERS + WRITERS]
        bucket = readers[0].run_coroutine(_bucket)
        # Walks for keys nobody wrote fill each node's table, until it knows a bucket's worth of others.
        deadline = time.monotonic() + 60
        for i in range(1000):
            short = [d for d in readers + writers if d.run_coroutine(_known) < bucket]
            if not short or time.monotonic() > deadline:
                break
            for d in short:
                d.get(f"bench_slow_node_fill_{i}", latest=True)
        known = [d.run_coroutine(_known) for d in readers + writers]

        writes, reads, failed = [], [], 0
        for p in range(WRITE_PASSES):
            for k in range(KEYS):
                writer = writers[k % len(writers)]
                started = time.monotonic()
                ok = asyncio.run(dht_io.store(writer, f"bench_slow_node_{k}", {"k": k, "pass": p},
                                              get_dht_time() + 300 + p))
                writes.append(time.monotonic() - started)
                failed += not ok
        missing = 0
        for _ in range(READ_PASSES):
            for k in range(KEYS):
                for reader in readers:
                    started = time.monotonic()
                    found = asyncio.run(dht_io.get(reader, f"bench_slow_node_{k}"))
                    reads.append(time.monotonic() - started)
                    missing += found is None or found.value != {"k": k, "pass": WRITE_PASSES - 1}
        return {"nodes": nodes, "delay_s": delay, "bucket_size": bucket, "known_min": min(known),
                "write_s": writes, "read_s": reads, "writes_failed": failed, "reads_stale_or_missing": missing}
    finally:
        for d in dhts:
            d.shutdown()


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "mean": statistics.fmean(ordered),
            "p90": ordered[int(0.9 * (len(ordered) - 1))], "max": ordered[-1], "total": sum(ordered)}


def run_child(tree: Path, nodes: int, delay: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", "--nodes", str(nodes),
                           "--delays", str(delay)], cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"a swarm of {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=24)
    parser.add_argument("--delays", type=float, nargs="+", default=[0.0, 0.5, 2.5])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", default="", help="a checkout of the code to compare with")
    parser.add_argument("--out", default="docs/results/slow_node/bench_slow_node.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.nodes < 2 + READERS + WRITERS or any(d < 0 for d in args.delays) or args.repeats < 1:
        print(f"bench_slow_node: --nodes at least {2 + READERS + WRITERS}, delays not negative, --repeats >= 1",
              file=sys.stderr)
        return 2
    if args.child:
        print(json.dumps(child(args.nodes, args.delays[0])))
        return 0

    from scripts.results import write_result
    from scripts.stats import interval

    trees = {"after": ROOT} | ({"before": Path(args.before).resolve()} if args.before else {})
    runs = []
    for repeat in range(args.repeats):
        order = list(trees) if repeat % 2 == 0 else list(trees)[::-1]
        for delay in args.delays:
            for label in order:
                got = run_child(trees[label], args.nodes, delay)
                got.update(variant=label, repeat=repeat, reads=summary(got["read_s"]), writes=summary(got["write_s"]))
                runs.append(got)
                print(f"repeat {repeat}, delay {delay:g} s, {label}: reads median {got['reads']['median']:.3f} s "
                      f"mean {got['reads']['mean']:.3f} p90 {got['reads']['p90']:.3f}; writes median "
                      f"{got['writes']['median']:.3f} s mean {got['writes']['mean']:.3f}; stale/missing reads "
                      f"{got['reads_stale_or_missing']}, failed writes {got['writes_failed']}, "
                      f"fewest known {got['known_min']}", flush=True)
    table = {}
    for delay in args.delays:
        for label in trees:
            mine = [r for r in runs if r["delay_s"] == delay and r["variant"] == label]
            table[f"{label} {delay:g}"] = {
                "read_mean_s": interval([r["reads"]["mean"] for r in mine]),
                "read_median_s": interval([r["reads"]["median"] for r in mine]),
                "write_mean_s": interval([r["writes"]["mean"] for r in mine]),
                "write_median_s": interval([r["writes"]["median"] for r in mine]),
                "reads_stale_or_missing": sum(r["reads_stale_or_missing"] for r in mine),
                "writes_failed": sum(r["writes_failed"] for r in mine)}
    if args.before:  # the command in the result names the revision, not this machine's folder
        rev = subprocess.run(["git", "-C", args.before, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip() or "an earlier revision"
        sys.argv = [f"<a git worktree of {rev}>" if a == args.before else a for a in sys.argv]
    doc = {"nodes": args.nodes,
           "delays": args.delays, "repeats": args.repeats, "keys": KEYS, "readers": READERS, "writers": WRITERS,
           "read_passes": READ_PASSES, "write_passes": WRITE_PASSES, "table": table, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, doc)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

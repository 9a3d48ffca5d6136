#!/usr/bin/env python3
"""What the control plane puts on the wire, by kind: four regions of the emulated WAN (``scripts/wan.py``), one
decoupled daemon each, training with rounds (``wan_runs.py``'s run, as ``bench_wan.py``), with a probe in every
daemon's processes (``scripts/wire_probe/sitecustomize.py``, loaded through ``PYTHONPATH``) that counts the payload
of every p2p unary call by RPC (the DHT's ``rpc_find``/``rpc_store``/``rpc_ping``, atoll's nudges) and by the kind of
record the DHT operation was for (progress, round, group, open, summary, ...; "background" for hivemind's own).

    python -m scripts.bench_wire_kinds [--rate 0.88] [--label NAME] [--out DIR]

Reported against the bytes on each region's ``eth0`` (TCP/IP, libp2p's framing and encryption included) and the
outer deltas and state the daemons counted as sent. ``--label`` names the code under test: run the script from
another checkout (a ``git worktree``) for a before/after in one results file, ``<out>/bench_wire_kinds.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from scripts import wan
from scripts import wan_runs
from scripts.results import pyplot, save_figure, write_result

HERE = Path(__file__).resolve().parent


def probe_totals(folder: Path) -> dict[str, dict[str, int]]:
    """Every process's counts summed, by "<rpc> <kind>"."""
    totals: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "sent": 0, "received": 0})
    for path in folder.glob("*.json"):
        for name, c in json.loads(path.read_text()).items():
            for k in ("calls", "sent", "received"):
                totals[name][k] += c[k]
    return dict(totals)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=0.88, help="Mbit/s each way, every region")
    p.add_argument("--rtt", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--sync-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds every step sleeps (slower rounds)")
    p.add_argument("--label", default="default")
    p.add_argument("--out", default="docs/results/wire_kinds")
    p.add_argument("--replot", action="store_true", help="only redraw the plot from the JSON")
    args = p.parse_args()
    if args.replot:
        out = Path(args.out)
        plot(json.loads((out / "bench_wire_kinds.json").read_text()), out / "bench_wire_kinds.png")
        return 0
    probe = Path(tempfile.mkdtemp(prefix="atoll-wire-probe-"))
    os.environ["ATOLL_WIRE_PROBE"] = str(probe)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "wire_probe"), os.environ.get("PYTHONPATH")]))
    run_args = argparse.Namespace(model="nano", sync_every=args.sync_every, seed=args.seed, run_timeout=600,
                                  straggler_wait=60,
                                  daemon_args=["--harness", f"step_delay={args.step_delay}"] if args.step_delay else [])
    regions = [wan.Region(r, rate_mbit=args.rate, delay_ms=args.rtt / 4) for r in wan_runs.REGIONS]
    with wan.Wan(regions, tag="wk") as w:
        r = wan_runs.run_atoll(w, Path("runs/bench_wire_kinds") / args.label, "decoupled", args.steps, run_args)
    kinds = probe_totals(probe)
    payload = sum(c["sent"] + c["received"] for c in kinds.values())
    seconds = r["wall_seconds"]
    result = {
        "label": args.label, "rate_mbit": args.rate, "rtt_ms": args.rtt, "seed": args.seed, "steps": args.steps,
        "sync_every": args.sync_every, "step_delay": args.step_delay,
        "wall_seconds": seconds, "wire_bytes": r["wire_bytes"],
        "bytes_sent_counted": r["bytes_sent_counted"], "dht_and_nudge_payload_bytes": payload,
        "by_kind": dict(sorted(kinds.items(), key=lambda kv: -(kv[1]["sent"] + kv[1]["received"]))),
        "rounds_per_daemon": r["rounds_per_daemon"], "held_out_loss_mean": r["held_out_loss_mean"],
        "utilization": r["utilization"], "tokens_lost": r["tokens_lost"], "tokens_total": r["tokens_total"],
        "records_counted_by_kind": r["dht_record_bytes"],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench_wire_kinds.json"
    doc = json.loads(path.read_text()) if path.exists() else {"runs": []}
    doc["runs"] = [x for x in doc["runs"] if x["label"] != args.label] + [result]
    write_result(path, doc, seeds=[args.seed])
    plot(doc, out / "bench_wire_kinds.png")
    print(f"{args.label}: wire {r['wire_bytes'] / 1e6:.1f} MB in {seconds:.0f} s, DHT+nudge payload "
          f"{payload / 1e6:.1f} MB, counted sent {r['bytes_sent_counted'] / 1e6:.2f} MB, "
          f"rounds {r['rounds_per_daemon']}")
    for name, c in list(result["by_kind"].items())[:14]:
        print(f"  {name:24s} {c['calls']:6d} calls  {(c['sent'] + c['received']) / 1e3:9.1f} KB  "
              f"{(c['sent'] + c['received']) / max(c['calls'], 1):7.0f} B/call")
    counted = sum(result["records_counted_by_kind"].values())
    print(f"the daemons' own count of their records' bytes (each once): {counted / 1e6:.2f} MB; by kind, against "
          "the DHT RPCs' payload for that kind:")
    for kind, wire_kb, counted_kb in against_counted(result):
        print(f"  {kind:18s} RPC payload {wire_kb:9.1f} KB  records counted {counted_kb:9.1f} KB  "
              f"{wire_kb / counted_kb if counted_kb else float('nan'):5.1f}x")
    return 0


def against_counted(run: dict) -> list[tuple[str, float, float]]:
    """(what, KB of the DHT RPCs' payload, KB of the records the daemons counted for it), most payload first: each
    kind's writes (``rpc_store <kind>`` against the daemons' ``store <kind>``), and all reads together (the probe
    cannot tell the kind of a read a node makes for ``near``'s small-swarm path: it counts them as background).
    The ratio is what replication, the walks and the records' signatures add to the records themselves."""
    wire: dict[str, float] = defaultdict(float)
    counted: dict[str, float] = defaultdict(float)
    for name, c in run["by_kind"].items():
        rpc, kind = name.split(" ", 1)
        if rpc == "rpc_store":
            wire[f"store {kind}"] += (c["sent"] + c["received"]) / 1e3
        elif rpc == "rpc_find":
            wire["get (every kind)"] += (c["sent"] + c["received"]) / 1e3
    for name, b in run.get("records_counted_by_kind", {}).items():
        op, kind = name.split(" ", 1)
        counted[f"store {kind}" if op == "store" else "get (every kind)"] += b / 1e3
    whats = sorted(set(wire) | set(counted), key=lambda k: -wire.get(k, 0.0))
    return [(w, wire.get(w, 0.0), counted.get(w, 0.0)) for w in whats]


def per_kind(run: dict) -> dict[str, float]:
    """KB/s per region of each record kind (every RPC of it, both ways)."""
    rates: dict[str, float] = defaultdict(float)
    for name, c in run["by_kind"].items():
        rates[name.split(" ", 1)[1]] += (c["sent"] + c["received"]) / run["wall_seconds"] / 4 / 1e3
    return dict(rates)


def plot(doc: dict, path: Path) -> None:
    """Stacked bars, one per label: the DHT's payload by kind, beside the wire and the counted payload."""
    plt = pyplot()

    runs = doc["runs"]
    rates = [per_kind(r) for r in runs]
    kinds = sorted({k for r in rates for k in r}, key=lambda k: -sum(r.get(k, 0) for r in rates))
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(runs), 4))
    bottom = [0.0] * len(runs)
    for kind in kinds:
        values = [r.get(kind, 0.0) for r in rates]
        ax.bar(range(len(runs)), values, bottom=bottom, label=kind, width=0.5)
        bottom = [b + v for b, v in zip(bottom, values)]
    wire = [r["wire_bytes"] / r["wall_seconds"] / 4 / 1e3 for r in runs]
    counted = [r["bytes_sent_counted"] / r["wall_seconds"] / 4 / 1e3 for r in runs]
    ax.plot(range(len(runs)), wire, "k_", ms=40, mew=2, label="wire (eth0)")
    ax.plot(range(len(runs)), counted, "r_", ms=40, mew=2, label="outer deltas, counted")
    ax.set_xticks(range(len(runs)), [r["label"] for r in runs], fontsize=8)
    ax.set_ylabel("KB/s per region")
    ax.set_title(f"control plane by kind, {runs[0]['rate_mbit']:g} Mbit/s, decoupled, 4 regions", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())

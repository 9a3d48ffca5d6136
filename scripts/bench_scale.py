#!/usr/bin/env python3
"""What the protocol costs one daemon as the swarm grows: live swarms of N `nano` daemons on this machine.

    python -m scripts.bench_scale [--sizes 4 8 16] [--seconds 120] [--model nano]

For each N, a fresh private swarm starts (the founder, then N-1 joiners), trains until every daemon's record is
visible and training, and is then measured for ``--seconds``. Training is slowed by a fixed per-step delay so that
N daemons sharing this machine's cores measure the protocol more than the contention. Per daemon it reports:

- DHT calls per minute of its life, by operation and record kind (``protocols/dht_io.py``'s counts, from its
  summary), and the entries (progress records) one read of the progress key returns;
- the time of one peer-table read (``get progress``), mean over the daemon's reads;
- bytes through its DHT process per minute (``/proc/PID/io``, read + written, over the window: the DHT's RPCs to
  and from p2pd, served and asked, and the pipe to the daemon) and through p2pd (its sockets: the DHT's traffic
  and the rounds' streams, which the daemon's own ``bytes_sent``/``bytes_received`` give);
- round formation time and round sizes (members) of the rounds merged in the window;
- resident memory of the daemon, its DHT process and p2pd at the end of the window, and the CPU each used in
  the window (cores: CPU seconds per second; with N daemons on this machine's cores, latencies grow with N
  through contention as well as through the protocol, and the CPU figures say which);
- how long ``atoll status --json`` takes from a fresh process (three calls in the window) and how many peers it
  lists, and how many records one DHT client sees at the window's end.

Daemons count as started once their own metrics show training (not through the DHT, which is what is measured).

Each figure's growth with N is fit as a power law (slope of log figure against log N: 0 is flat, 1 linear) over
the sizes at which the whole swarm used less than 95% of the machine's cores; the plot marks the others. Writes
docs/results/scale/bench_scale.json and .png (``--out`` to change; ``--replot JSON`` redraws an earlier run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from scripts.bars import each
from scripts.results import pyplot, save_figure, write_result
from scripts.stats import power_law
from scripts.swarm import LocalSwarm, StatusReader, daemon_processes, wait_for

ROOT = Path(__file__).resolve().parents[1]
STEP_DELAY = 0.25  # seconds per inner step on every daemon: keeps N daemons' compute off the protocol's path
COMMON = ["--batch-size", "4", "--algorithm", "decoupled", "--sync-every", "20"]


def proc_figures(pid: int) -> dict[str, float] | None:
    """Resident MiB, I/O bytes (read + written through syscalls) and CPU seconds (user + system) of one process."""
    try:
        rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS:")) / 1024
        io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15
        return {"rss_mib": rss, "io_bytes": int(io["rchar"]) + int(io["wchar"]), "cpu_s": cpu}
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return None


FIGURES = {  # figure: (label, unit)
    "dht_calls_per_min": ("DHT calls per daemon", "per min"),
    "table_read_s": ("peer-table read", "s"),
    "table_entries_per_read": ("records per progress read", ""),
    "dht_io_mib_per_min": ("DHT process I/O per daemon", "MiB/min"),
    "p2pd_io_mib_per_min": ("p2pd I/O per daemon", "MiB/min"),
    "formation_s": ("round formation", "s"),
    "round_members": ("round size", "members"),
    "status_s": ("atoll status", "s"),
    "rss_daemon_mib": ("daemon RSS", "MiB"),
    "rss_dht_mib": ("DHT process RSS", "MiB"),
    "rss_p2pd_mib": ("p2pd RSS", "MiB"),
    "cpu_dht": ("DHT process CPU", "cores"),
}


def sample(swarm: LocalSwarm) -> dict[str, dict[str, dict[str, float]]]:
    out = {}
    for name, d in swarm.daemons.items():
        procs = daemon_processes(d.proc.pid)
        out[name] = {role: figures for role, pid in procs.items() if (figures := proc_figures(pid)) is not None}
    return out


def timed_status(bootstrap: list[str]) -> tuple[float, int | None]:
    """Seconds ``atoll status --json`` took from a fresh process, and how many peers it listed (None: it failed)."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "atoll.node.cli", "status", "--initial-peers", *bootstrap, "--json"],
                          capture_output=True, timeout=300)
    seconds = time.monotonic() - start
    try:
        return seconds, len(json.loads(done.stdout)["peers"]) if done.returncode == 0 else None
    except (json.JSONDecodeError, KeyError):
        return seconds, None


def training(d: Any) -> bool:
    """The daemon has trained past its first steps (its own metrics: not through the DHT, which is measured)."""
    return any("step" in m and "event" not in m and m["step"] >= 20 for m in d.metrics())


def measure(n: int, seconds: float, root: Path, model: str) -> dict[str, Any]:
    common = [*COMMON, "--model", model, "--harness", f"step_delay={STEP_DELAY}"]
    with LocalSwarm(root, common) as swarm:
        started = time.monotonic()
        for i in range(n):
            swarm.start(f"d{i:02d}", join=i > 0, wait=300)
        wait_for(lambda: all(training(d) for d in swarm.daemons.values()), 900, f"{n} daemons training")
        ready = time.monotonic()
        print(f"N={n}: all training {ready - started:.0f} s after the first start", flush=True)
        before, t0 = sample(swarm), time.time()
        status = []
        for k in range(3):
            time.sleep(seconds / 4)
            status.append(timed_status(swarm.bootstrap))
        time.sleep(max(0.0, seconds - (time.time() - t0)))
        after, t1 = sample(swarm), time.time()
        reader = StatusReader(swarm.bootstrap)  # the run's records as one DHT client sees them at the window's end
        try:
            seen = reader.read()["peers"]
        finally:
            reader.close()
        codes = swarm.stop_all(timeout=90)
        daemons = []
        for name, d in swarm.daemons.items():
            metrics = d.metrics()
            summary = next((m for m in metrics if m.get("event") == "summary"), None)
            if summary is None:
                raise RuntimeError(f"{name} wrote no summary (exit {codes.get(name)}); log:\n{d.log()[-2000:]}")
            minutes = summary["wall_seconds"] / 60
            rounds = [m for m in metrics if m.get("event") == "round" and t0 <= m["time"] <= t1]
            calls = summary["dht_calls"]
            progress = calls.get("get progress", {"calls": 0, "seconds": 0.0, "entries": 0})
            window_min = (t1 - t0) / 60
            roles = [role for role in ("daemon", "dht", "p2pd") if role in after[name] and role in before[name]]
            io = {role: (after[name][role]["io_bytes"] - before[name][role]["io_bytes"]) / window_min
                  for role in roles}
            cpu = {role: (after[name][role]["cpu_s"] - before[name][role]["cpu_s"]) / (t1 - t0) for role in roles}
            daemons.append({
                "name": name, "exit": codes.get(name),
                "dht_calls_per_min": {k: v["calls"] / minutes for k, v in calls.items()},
                "dht_calls_per_min_total": sum(v["calls"] for v in calls.values()) / minutes,
                "table_read_s": progress["seconds"] / progress["calls"] if progress["calls"] else None,
                "table_entries_per_read": progress["entries"] / progress["calls"] if progress["calls"] else None,
                "dht_io_bytes_per_min": io.get("dht"), "p2pd_io_bytes_per_min": io.get("p2pd"),
                "round_bytes_per_min": (summary["bytes_sent"] + summary["bytes_received"]) / minutes,
                "rss_mib": {role: f["rss_mib"] for role, f in after[name].items()},
                "cpu_share": cpu,  # CPU seconds per second of the window, by process
                "rounds": len(rounds),
                "formation_s": [m["formation_seconds"] for m in rounds if m.get("formation_seconds") is not None],
                "round_members": [len(m["members"]) for m in rounds],
                "rejected": summary["rejected_by_kind"],
            })
    return {"daemons_n": n, "window_s": t1 - t0, "start_to_training_s": ready - started,
            "status_s": [s for s, _ in status], "status_peers": [p for _, p in status],
            "records_seen": len(seen), "records_training": sum(p["status"] == "training" for p in seen),
            "daemons": daemons}


def mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def per_size(result: dict[str, Any]) -> dict[str, Any]:
    ds = result["daemons"]
    formation = [s for d in ds for s in d["formation_s"]]
    members = [m for d in ds for m in d["round_members"]]
    return {
        "daemons": result["daemons_n"],
        "dht_calls_per_min": mean([d["dht_calls_per_min_total"] for d in ds]),
        "progress_reads_per_min": mean([d["dht_calls_per_min"].get("get progress", 0.0) for d in ds]),
        "table_read_s": mean([d["table_read_s"] for d in ds]),
        "table_entries_per_read": mean([d["table_entries_per_read"] for d in ds]),
        "dht_io_mib_per_min": mean([d["dht_io_bytes_per_min"] / 2**20 for d in ds if d["dht_io_bytes_per_min"]]),
        "p2pd_io_mib_per_min": mean([d["p2pd_io_bytes_per_min"] / 2**20 for d in ds if d["p2pd_io_bytes_per_min"]]),
        "round_mib_per_min": mean([d["round_bytes_per_min"] / 2**20 for d in ds]),
        "formation_s": mean(formation), "formation_s_max": max(formation, default=None),
        "round_members": mean(members), "rounds_per_daemon": mean([d["rounds"] for d in ds]),
        "rss_daemon_mib": mean([d["rss_mib"].get("daemon") for d in ds]),
        "rss_dht_mib": mean([d["rss_mib"].get("dht") for d in ds]),
        "rss_p2pd_mib": mean([d["rss_mib"].get("p2pd") for d in ds]),
        "status_s": mean(result["status_s"]),
        "status_peers_min": min((p for p in result["status_peers"] if p is not None), default=None),
        "status_failed": sum(p is None for p in result["status_peers"]),
        "records_seen": result["records_seen"],
        "cpu_daemon": mean([d["cpu_share"].get("daemon") for d in ds]),
        "cpu_dht": mean([d["cpu_share"].get("dht") for d in ds]),
        "cpu_p2pd": mean([d["cpu_share"].get("p2pd") for d in ds]),
        "cpu_swarm": sum(sum(v for v in d["cpu_share"].values()) for d in ds),
    }


SATURATED = 0.95  # share of the machine's cores the whole swarm used, from which latencies measure contention


def saturated(row: dict[str, Any], cpus: int) -> bool:
    return row["cpu_swarm"] >= SATURATED * cpus


def growth(rows: list[dict[str, Any]], cpus: int) -> dict[str, float | None]:
    """Each figure's power-law exponent in N, fitted over the sizes at which the machine was not saturated."""
    free = [r for r in rows if not saturated(r, cpus)]
    sizes = [r["daemons"] for r in free]
    return {key: power_law(sizes, [r[key] for r in free]) for key in FIGURES}


def plot(doc: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    rows = doc["sizes"]
    sizes = [r["daemons"] for r in rows]
    busy = [saturated(r, doc["cpus"]) for r in rows]
    fig, axes = plt.subplots(3, 4, figsize=(16, 10))
    for ax, (key, (label, unit)) in zip(axes.flat, FIGURES.items()):
        values = [r[key] for r in rows]
        ax.plot(sizes, values, "-", color="C0", alpha=0.5)
        ax.plot([n for n, b in zip(sizes, busy) if not b], [v for v, b in zip(values, busy) if not b], "o", color="C0",
                label="machine not saturated")
        ax.plot([n for n, b in zip(sizes, busy) if b], [v for v, b in zip(values, busy) if b], "o", color="C3",
                mfc="none", label=f"swarm used ≥ {SATURATED:.0%} of the cores")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        slope = doc["growth"].get(key)
        ax.set_title(f"{label}" + (f" (∝ N^{slope:.2f})" if slope is not None else ""), fontsize=10)
        ax.set_xlabel("daemons")
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(FIGURES):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"bench_scale: per-daemon cost against swarm size ({doc['model']}, {doc['seconds']:.0f} s windows)")
    fig.tight_layout()
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--seconds", type=float, default=120.0, help="the measured window per size")
    ap.add_argument("--model", default="nano")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_scale")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "scale" / "bench_scale")
    ap.add_argument("--replot", type=Path, help="recompute the summary and plot of an earlier run's JSON, and exit")
    args = ap.parse_args()
    if args.replot is not None:
        doc = json.loads(args.replot.read_text())
        doc["sizes"] = [per_size(r) for r in doc["runs"]]
        doc["growth"] = growth(doc["sizes"], doc["cpus"])
        write_result(args.replot, doc)
        plot(doc, args.replot.with_suffix(".png"))
        return 0
    if any(n < 2 for n in args.sizes):
        print("bench_scale: error: every size must be at least 2 daemons", file=sys.stderr)
        return 2
    results: list[dict[str, Any]] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for n in each(args.sizes, "sizes"):
        work = args.work / f"n{n}"
        subprocess.run(["rm", "-rf", str(work)], check=True)
        results.append(measure(n, args.seconds, work, args.model))
        print(json.dumps(per_size(results[-1])), flush=True)
        rows = [per_size(r) for r in results]
        doc = {"model": args.model,
               "seconds": args.seconds, "step_delay_s": STEP_DELAY, "cpus": os.cpu_count(), "sizes": rows,
               "growth": growth(rows, os.cpu_count() or 1), "runs": results}
        write_result(args.out.with_suffix(".json"), doc)  # after each size: a later one may fail
        plot(doc, args.out.with_suffix(".png"))
    for key, (label, unit) in FIGURES.items():
        cells = "  ".join(f"{r[key]:.3g}" if r[key] is not None else "-" for r in rows)
        slope = doc["growth"][key]
        print(f"{label:30s} {unit:9s} {cells}   slope {slope:.2f}" if slope is not None else f"{label:30s} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

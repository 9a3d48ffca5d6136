#!/usr/bin/env python3
"""Where a local swarm's CPU goes: the training processes, their DHT processes, their p2pd.

    python -m scripts.swarm_cpu [--daemons 6] [--step-delay 0.1] [--seconds 30] [--name swarm_cpu_6]

Starts ``--daemons`` daemons as ``scripts/chaos.py`` does (model ``nano``, batch 4, H=40, heartbeat 1 s, plain
averaging, ``--step-delay`` seconds of sleep per step), lets them train 10 s, then samples for ``--seconds``:
the machine's busy share (/proc/stat), each process group's CPU seconds split by kind (the daemon's own process,
its hivemind DHT process, its p2pd), and the inner steps per second of each daemon. Then kills one daemon and
restarts it from its checkpoint, and times the restart: process start to printed multiaddrs (the DHT is up), to
its checkpoint loaded, to its first step. Writes ``docs/results/swarm_cpu/<name>.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from scripts.chaos import busy_share, cpu_times, step_lines
from scripts.results import write_result
from scripts.swarm import LocalSwarm, cpu_seconds



def processes_by_kind(swarm: LocalSwarm) -> dict[str, list[int]]:
    kinds: dict[str, list[int]] = {"training": [], "dht": [], "p2pd": []}
    for d in swarm.daemons.values():
        kinds["training"].append(d.proc.pid)
        group = subprocess.run(["pgrep", "-g", str(d.proc.pid)], capture_output=True, text=True).stdout.split()
        for pid in map(int, group):
            if pid != d.proc.pid:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                kinds["p2pd" if comm.startswith("p2pd") else "dht"].append(pid)
    return kinds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--daemons", type=int, default=6)
    parser.add_argument("--step-delay", type=float, default=0.1)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--name", default=None, help="results name (default swarm_cpu_<daemons>)")
    parser.add_argument("--out", default="docs/results/swarm_cpu/swarm_cpu")
    args = parser.parse_args()
    name = args.name or f"swarm_cpu_{args.daemons}"
    common = ["--model", "nano", "--algorithm", "decoupled", "--sync-every", "40", "--batch-size", "4",
              "--gather-timeout", "10", "--round-timeout", "10", "--heartbeat", "1", "--threads", "1",
              "--harness", f"step_delay={args.step_delay}", "--eval-budget", "1", "--outer-lr", "1",
              "--outer-momentum", "0"]
    root = Path("runs") / name
    shutil.rmtree(root, ignore_errors=True)
    with LocalSwarm(root, []) as swarm:
        swarm.start("d0", common, join=False)
        for i in range(1, args.daemons):
            swarm.start(f"d{i}", common)
        while not all(step_lines(d) for d in swarm.daemons.values()):
            time.sleep(0.5)
        time.sleep(10)
        kinds = processes_by_kind(swarm)
        before = {k: sum(map(cpu_seconds, pids)) for k, pids in kinds.items()}
        t0, cpu0 = time.time(), cpu_times()
        time.sleep(args.seconds)
        t1, busy = time.time(), busy_share(cpu0, cpu_times())
        cores = {k: (sum(map(cpu_seconds, pids)) - before[k]) / (t1 - t0) / args.daemons for k, pids in kinds.items()}
        rates = []
        for d in swarm.daemons.values():
            steps = [m for m in step_lines(d) if t0 <= m["time"] <= t1]
            rates.append((steps[-1]["step"] - steps[0]["step"]) / (steps[-1]["time"] - steps[0]["time"]))
        swarm.kill("d1")
        started = time.time()
        swarm.start("d1", common)
        printed = time.time()
        while not [m for m in step_lines(swarm.daemons["d1"]) if m["time"] >= started]:
            time.sleep(0.2)
        after = [m for m in swarm.daemons["d1"].metrics() if m.get("time", 0) >= started]
        resumed = next(m["time"] for m in after if m.get("event") == "resumed")
        first = next(m["time"] for m in after if "step" in m and "event" not in m)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True).stdout.strip())
    result = {
        "name": name,         "commit": commit + ("+dirty" if dirty else ""), "args": vars(args),
        "machine_cpu_busy": busy, "cores_per_daemon": cores,
        "steps_per_s_per_daemon": sum(rates) / len(rates), "steps_per_s_without_cpu_limit": 1 / args.step_delay,
        "restart_s": {"dht_up": printed - started, "checkpoint_loaded": resumed - started,
                      "first_step": first - started},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / f"{name}.json", result)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A swarm of four atoll daemons in the emulated WAN (``wan.py``), one per region, run to its end and measured:
the wire bytes each region sent, the final replicas' held-out loss, the daemons' summaries. ``bench_wan.py`` runs it
per algorithm and link; the benches of one WAN cell (``bench_rounds_wan``, ``bench_idle_wire``,
``bench_wire_kinds``) run it as it is."""

from __future__ import annotations

import argparse
import concurrent.futures
import shutil
import statistics
import time
from pathlib import Path

from scripts import wan
from scripts.benchkit import BATCH, DAEMONS, evaluate_global, evaluate_swarm, summaries
from scripts.swarm import LocalSwarm

from atoll.node.config import RunConfig

REGIONS = ("ra", "rb", "rc", "rd")


def tx_bytes(w: wan.Wan) -> dict[str, int]:
    out = {}
    for r in REGIONS:
        res = w.run(r, ["cat", "/sys/class/net/eth0/statistics/tx_bytes"])
        out[r] = int(res.stdout.strip())
    return out


def run_atoll(w: wan.Wan, root: Path, algorithm: str, steps: int, args: argparse.Namespace,
              seed: int | None = None) -> dict:
    seed = args.seed if seed is None else seed
    common = ["--model", args.model, "--algorithm", algorithm, "--sync-every", str(args.sync_every),
              "--batch-size", str(BATCH), "--max-steps", str(steps), "--gather-timeout", "20",
              "--round-timeout", "20", "--threads", "1", "--quorum", str(DAEMONS if algorithm == "ddp" else 1),
              "--seed", str(seed)]
    if algorithm != "ddp":  # hold the first step until all four train (ddp's --quorum does that already)
        common += ["--harness", f"start_together={DAEMONS}"]
    common += getattr(args, "daemon_args", [])  # bench_rounds_wan: a protocol setting under comparison
    shutil.rmtree(root, ignore_errors=True)
    before = tx_bytes(w)
    start = time.monotonic()
    with LocalSwarm(root, common) as swarm:
        def launch(i: int) -> None:
            r = REGIONS[i]
            swarm.start(f"d{i}", join=i > 0, prefix=["ip", "netns", "exec", w.ns(r)], host=w.addr(r))

        # The founder first (the run's key and its bootstrap address), then the three others at once: started one
        # after another, the founder would have trained much of a short budget alone before the last one joined.
        launch(0)
        with concurrent.futures.ThreadPoolExecutor(DAEMONS - 1) as pool:
            list(pool.map(launch, range(1, DAEMONS)))
        stopped = wait_daemons(swarm, args)
    seconds = time.monotonic() - start
    wire = {r: v - before[r] for r, v in tx_bytes(w).items()}
    run = RunConfig(model=args.model, algorithm=algorithm, sync_every=args.sync_every, seed=seed)
    losses = evaluate_swarm(swarm, run)
    global_loss = evaluate_global(swarm, run) if algorithm != "ddp" else None
    s = summaries(swarm)
    steps_done = [x["step"] for x in s]
    walls = [x["wall_seconds"] for x in s]
    return {"algorithm": algorithm, "steps_per_daemon": steps_done, "held_out_loss_mean": statistics.mean(losses),
            "held_out_loss_global": global_loss,
            "held_out_loss_per_daemon": losses, "wall_seconds": max(walls), "wall_seconds_per_daemon": walls,
            "train_seconds_per_daemon": [x["train_seconds"] for x in s],
            "seconds_per_step": statistics.mean(x["wall_seconds"] / max(x["step"], 1) for x in s),
            "utilization": statistics.mean(x["goodput"] for x in s),
            "utilization_per_daemon": [x["goodput"] for x in s],
            "blocked_s_mean": statistics.mean(x["blocked_s"] for x in s),
            "step_seconds_per_daemon": step_seconds(s),
            "tokens_total": sum(x["tokens"] for x in s), "tokens_lost": sum(x["tokens_lost"] for x in s),
            "tokens_carried": sum(x.get("tokens_carried", 0) for x in s),
            "in_flight_p50_per_daemon": [x.get("in_flight_p50") for x in s],
            "in_flight_p95_per_daemon": [x.get("in_flight_p95") for x in s],
            "bytes_sent_counted": sum(x["bytes_sent"] for x in s), "wire_bytes": sum(wire.values()),
            "wire_bytes_per_region": wire, "rounds_per_daemon": [x["rounds"] for x in s],
            "outside_seconds": seconds, "stopped_by_bench": stopped, "dht_record_bytes": dht_record_bytes(s)}


def dht_record_bytes(summaries: list[dict]) -> dict[str, int]:
    """The daemons' own count of the DHT records' bytes (``dht_io.CallStats.bytes``: what their writes stored and
    their reads returned, each once), summed by "<op> <kind>"."""
    out: dict[str, int] = {}
    for x in summaries:
        for name, c in (x.get("dht_calls") or {}).items():
            out[name] = out.get(name, 0) + int(c.get("bytes", 0))
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def wait_daemons(swarm: LocalSwarm, args: argparse.Namespace) -> list[str]:
    """Wait for every daemon to finish its steps; once one has, give the others ``--straggler-wait`` more seconds
    and then stop them (SIGTERM, a graceful leave): a ddp daemon left out of its peers' all-reduce (seen over
    these links) would otherwise wait for them forever. Returns the daemons stopped that way."""
    deadline, first_done = time.monotonic() + args.run_timeout, None
    while any(d.alive() for d in swarm.daemons.values()) and time.monotonic() < deadline:
        if first_done is None and any(not d.alive() for d in swarm.daemons.values()):
            first_done = time.monotonic()
        if first_done is not None and time.monotonic() - first_done > args.straggler_wait:
            break
        time.sleep(0.5)
    stopped = [n for n, d in swarm.daemons.items() if d.alive()]
    for n in stopped:
        print(f"    {n} still running {args.straggler_wait:g} s after the first daemon finished: stopping it",
              flush=True)
        swarm.stop(n, timeout=30)
    return stopped


def step_seconds(s: list[dict]) -> list[float | None]:
    """Per daemon: seconds per inner step, training plus time blocked on the network (ddp's all-reduce), without
    start-up or the wait for the others to start."""
    return [(x["train_seconds"] + x["blocked_s"]) / x["step"] if x["step"] else None for x in s]

#!/usr/bin/env python3
"""The seeds' headline, scaled to this machine: four regions of an emulated WAN (``scripts/wan.py``), one daemon
each, the same model and token budget over the same links, for ddp, diloco, streaming, decoupled and hivemind's
own ``hivemind.Optimizer`` set up as OpenDiLoCo (``scripts/hivemind_opendiloco.py``).

    python -m scripts.bench_wan --calibrate                       # measure the inner step time here, print rates
    python -m scripts.bench_wan --rates 0.88 2.2 8.8 --rtts 0 100 [--algorithms ...] [--steps 800] [--ddp-steps 8]
    python -m scripts.bench_wan --rates 2.2 --rtts 0 --seeds 0 1 2 --algorithms ddp diloco decoupled
    python -m scripts.bench_wan --replot

Every point of the sweep (a link rate in Mbit/s, both directions of every region's access link, and an RTT between
any two regions: each region's one-way delay is RTT/4) builds a fresh ``Wan`` of four regions and runs each
algorithm in it in turn; every daemon runs ``--steps`` inner steps (ddp: ``--ddp-steps``, then extrapolated).

Measured per run: the wall-clock time of the budget (the slowest daemon's own wall time, from its start to its
last step, joining included), the held-out loss of every daemon's final replica (the same held-out batches for
every algorithm), compute utilization (atoll: the daemon's ``goodput``, share of its wall time in inner steps;
hivemind: forward, backward and local AdamW seconds over wall seconds), bytes on the wire (every region's
``eth0`` transmit counter in its namespace: headers, DHT and all) and bytes the daemons counted as sent, tokens
lost. The target held-out loss is ``--target-ratio`` × the held-out loss of ddp after ``--steps`` steps over the
uncapped links (measured once, ``--reference``); an algorithm's time to target is its budget's wall time when its
final replica reaches the target, else "not reached". ddp's trajectory does not depend on the link, so over a
capped link its time to target is EXTRAPOLATED: the measured seconds per step × ``--steps`` (labelled as such).
Each run is keyed by (algorithm, rate, RTT, seed) and records the commit it ran (a point re-run replaces only its
own runs); a point with several seeds is also summarised (mean and 95% interval, ``seeds`` in the JSON).
Writes ``<out>/bench_wan.json`` (each point appended; ``--fresh`` starts over) and ``bench_wan.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scripts import wan
from scripts.bars import each
from scripts.benchkit import BATCH, DAEMONS, evaluate_global, evaluate_swarm, make_learner, summaries
from scripts.results import pyplot, save_figure, write_result
from scripts.stats import fmt, interval
from scripts.swarm import LocalSwarm
from scripts.wan_runs import REGIONS, run_atoll, step_seconds, tx_bytes

from atoll.node.config import RunConfig

ALGORITHMS = ("ddp", "diloco", "streaming", "decoupled", "hivemind")
HIVEMIND = Path(__file__).resolve().parent / "hivemind_opendiloco.py"
# The seed's production setting: 12B parameters in bf16 (2 bytes each) over 2-5 Gbps, one inner step per second.
PROD_PARAMS, PROD_BYTES_PER_PARAM, PROD_STEP_S, PROD_GBPS = 12e9, 2, 1.0, (2.0, 5.0)
COMMIT = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                        cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"


def prod_ratios() -> dict[str, float]:
    """Seconds of one full-model transfer over seconds of one inner step, at 2 and at 5 Gbps."""
    bits = PROD_PARAMS * PROD_BYTES_PER_PARAM * 8
    return {f"{g:g} Gbps": bits / (g * 1e9) / PROD_STEP_S for g in PROD_GBPS}


def model_bytes(model: str) -> int:
    """The model here in fp32 (its training dtype on the CPU, and what ddp's gradients are)."""
    learner, _ = make_learner(RunConfig(model=model), shard=0)
    return sum(p.numel() for p in learner.params) * 4


def ddp_seconds_per_step(r: dict) -> float:
    """ddp's measured seconds per step: the median over the daemons that ran every step asked of them (a daemon left
    behind by a failed all-reduce would count its wait as steps it never took)."""
    per = r.get("step_seconds_per_daemon")
    if per is None:  # a run before this field: read the daemons' summaries back
        root = Path("runs/bench_wan") / f"ddp-{r['rate_mbit']:g}-{r['rtt_ms']:g}"
        s = [[json.loads(line) for line in (root / f"d{i}" / "metrics.jsonl").read_text().splitlines()
              if '"summary"' in line][-1] for i in range(DAEMONS)]
        per = r["step_seconds_per_daemon"] = step_seconds(s)
    full = [t for t, n in zip(per, r["steps_per_daemon"]) if t is not None and n >= r["steps_run"]]
    return statistics.median(full or [t for t in per if t is not None])


def swarm_in(root: Path) -> LocalSwarm:
    """The (stopped) swarm of a run folder under runs/bench_wan, to read its summaries and checkpoints."""
    from scripts.swarm import DaemonProcess

    swarm = LocalSwarm(root)
    for i in range(DAEMONS):
        swarm.daemons[f"d{i}"] = DaemonProcess(f"d{i}", None, root / f"d{i}")  # type: ignore[arg-type]
    return swarm


def recover_atoll(root: Path, algorithm: str, rate: float, rtt: float, steps: int, printed_wire_mb: float,
                  args: argparse.Namespace) -> dict:
    """An atoll run whose point was lost before its JSON was written (a later run of the same point failed): read
    back from its folder under runs/bench_wan (the daemons' summaries and checkpoints, evaluated as usual). Its
    wire bytes are what the benchmark printed for it (MB, one decimal); the per-region counts are not kept."""
    swarm = swarm_in(root)
    run = RunConfig(model=args.model, algorithm=algorithm, sync_every=args.sync_every, seed=args.seed)
    losses = evaluate_swarm(swarm, run)
    s = summaries(swarm)
    walls = [x["wall_seconds"] for x in s]
    return {"algorithm": algorithm, "steps_per_daemon": [x["step"] for x in s],
            "held_out_loss_mean": statistics.mean(losses), "held_out_loss_per_daemon": losses,
            "wall_seconds": max(walls), "wall_seconds_per_daemon": walls,
            "train_seconds_per_daemon": [x["train_seconds"] for x in s],
            "seconds_per_step": statistics.mean(x["wall_seconds"] / max(x["step"], 1) for x in s),
            "utilization": statistics.mean(x["goodput"] for x in s),
            "utilization_per_daemon": [x["goodput"] for x in s],
            "blocked_s_mean": statistics.mean(x["blocked_s"] for x in s), "step_seconds_per_daemon": step_seconds(s),
            "tokens_total": sum(x["tokens"] for x in s), "tokens_lost": sum(x["tokens_lost"] for x in s),
            "bytes_sent_counted": sum(x["bytes_sent"] for x in s), "wire_bytes": printed_wire_mb * 1e6,
            "wire_bytes_source": "the benchmark's printed output (MB, one decimal): the point's JSON was lost",
            "rounds_per_daemon": [x["rounds"] for x in s], "recovered_from_run_folder": True,
            "rate_mbit": rate, "rtt_ms": rtt, "steps_budget": args.steps, "steps_run": steps}


def global_from_folders(doc: dict, args: argparse.Namespace) -> None:
    """``held_out_loss_global`` for runs measured before it was recorded, from their run folders (atoll runs of a
    recorded commit only: the folder of an older run has been overwritten since)."""
    for r in doc["runs"]:
        if r["algorithm"] in ("ddp", "hivemind") or "commit" not in r or r.get("held_out_loss_global") is not None:
            continue
        seed = r.get("seed", 0)
        root = Path("runs/bench_wan") / (f"{r['algorithm']}-{r['rate_mbit']:g}-{r['rtt_ms']:g}" +
                                         (f"-s{seed}" if seed else ""))
        if not root.exists():
            continue
        swarm = swarm_in(root)
        run = RunConfig(model=args.model, algorithm=r["algorithm"], sync_every=args.sync_every, seed=seed)
        r["held_out_loss_global"] = evaluate_global(swarm, run)
        r["held_out_loss_global_source"] = "run folder, after the run (--global-from-folders)"


def run_hivemind(w: wan.Wan, root: Path, steps: int, args: argparse.Namespace, seed: int) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    before = tx_bytes(w)
    start = time.monotonic()
    procs, peers = [], []
    try:
        for i, r in enumerate(REGIONS):
            cmd = [sys.executable, str(HIVEMIND), "--host", w.addr(r), "--index", str(i), "--peers", str(DAEMONS),
                   "--steps", str(steps), "--sync-every", str(args.sync_every), "--batch-size", str(BATCH),
                   "--model", args.model, "--compression", args.hivemind_compression,
                   "--out", str(root / f"p{i}.json"), "--initial-peers", *peers]
            log = open(root / f"p{i}.log", "wb")
            p = w.popen(r, cmd, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
            procs.append(p)
            if not peers:  # the first peer's multiaddrs bootstrap the others
                line = p.stdout.readline().decode().strip()
                if not line.startswith("/"):
                    raise RuntimeError(f"hivemind peer 0 printed no multiaddr; see {root / 'p0.log'}")
                peers = [line]
        deadline, first_done = time.monotonic() + args.run_timeout, None
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if first_done is None and any(p.poll() is not None for p in procs):
                first_done = time.monotonic()
            if first_done is not None and time.monotonic() - first_done > args.straggler_wait:
                break
            time.sleep(0.5)
        stopped = [i for i, p in enumerate(procs) if p.poll() is None]
        for i in stopped:
            print(f"    hivemind peer {i} still running {args.straggler_wait:g} s after the first finished: stopping it",
                  flush=True)
            procs[i].terminate()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(90)
    finally:
        for p in procs:  # its own group: the DHT process and p2pd die with it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
    seconds = time.monotonic() - start
    wire = {r: v - before[r] for r, v in tx_bytes(w).items()}
    docs = [json.loads((root / f"p{i}.json").read_text()) for i in range(DAEMONS)]
    import torch

    learner, held_out = make_learner(RunConfig(model=args.model, seed=seed), shard=0)
    losses = []
    for i in range(DAEMONS):
        learner.model.load_state_dict(torch.load(root / f"p{i}.pt"))
        losses.append(learner.evaluate(held_out))
    walls = [d["wall_seconds"] for d in docs]
    return {"algorithm": "hivemind", "hivemind_compression": args.hivemind_compression,
            "steps_per_daemon": [d["steps"] for d in docs], "held_out_loss_mean": statistics.mean(losses),
            "held_out_loss_per_daemon": losses, "wall_seconds": max(walls), "wall_seconds_per_daemon": walls,
            "seconds_per_step": statistics.mean(d["wall_seconds"] / max(d["steps"], 1) for d in docs),
            "utilization": statistics.mean(d["utilization"] for d in docs),
            "utilization_per_daemon": [d["utilization"] for d in docs],
            "tokens_total": sum(d["tokens"] for d in docs), "tokens_lost": sum(d["tokens_lost"] for d in docs),
            "bytes_sent_counted": None, "wire_bytes": sum(wire.values()), "wire_bytes_per_region": wire,
            "epochs_per_daemon": [d["epochs"] for d in docs],
            "state_loads": sum(len(d["state_loads"]) for d in docs), "outside_seconds": seconds,
            "stopped_by_bench": [f"p{i}" for i in stopped]}


def one_point(rate: float, rtt: float, algorithms: list[str], args: argparse.Namespace, seed: int = 0) -> list[dict]:
    regions = [wan.Region(r, rate_mbit=rate, delay_ms=rtt / 4) for r in REGIONS]
    out = []
    with wan.Wan(regions, tag="bw") as w:
        for algorithm in algorithms:
            steps = args.ddp_steps if algorithm == "ddp" and rate > 0 else args.steps
            print(f"rate {rate:g} Mbit/s, RTT {rtt:g} ms, seed {seed}: {algorithm}, {DAEMONS} x {steps} steps ...",
                  flush=True)
            root = Path("runs/bench_wan") / (f"{algorithm}-{rate:g}-{rtt:g}" + (f"-s{seed}" if seed else ""))
            t0 = time.monotonic()
            if algorithm == "hivemind":
                r = run_hivemind(w, root, steps, args, seed)
            else:
                r = run_atoll(w, root, algorithm, steps, args, seed)
            r.update(rate_mbit=rate, rtt_ms=rtt, seed=seed, steps_budget=args.steps, steps_run=steps,
                     commit=COMMIT)
            print(f"    held-out {r['held_out_loss_mean']:.4f}  wall {r['wall_seconds']:.1f}s  "
                  f"s/step {r['seconds_per_step']:.3f}  util {r['utilization']:.2f}  wire {r['wire_bytes'] / 1e6:.1f} MB"
                  f"  lost {r['tokens_lost']}  ({time.monotonic() - t0:.0f} s)", flush=True)
            out.append(r)
    return out


def derive(doc: dict) -> None:
    """Target, time to target (measured or extrapolated), speedups over ddp and ratios to hivemind, per point."""
    ref = doc.get("reference")
    if not ref:
        return
    target = doc["target_ratio"] * ref["held_out_loss_mean"]
    doc["target_held_out_loss"] = target
    budget = doc["steps"]
    points: dict = {}
    for r in doc["runs"]:
        points.setdefault((r["rate_mbit"], r["rtt_ms"], r.get("seed", 0)), []).append(r)
        if r["algorithm"] == "ddp":
            if r["steps_run"] >= budget:
                r["time_to_target_s"], r["time_to_target_kind"] = r["wall_seconds"], "measured"
            else:  # ddp steps are the same whatever the link: it reaches the reference's loss after `budget` steps
                r["ddp_seconds_per_step"] = ddp_seconds_per_step(r)
                r["time_to_target_s"] = r["ddp_seconds_per_step"] * budget
                r["time_to_target_kind"] = (f"EXTRAPOLATED: {r['ddp_seconds_per_step']:.3f} s/step (median of the "
                                            f"daemons, measured over {r['steps_run']} steps) x {budget} steps")
            r["reaches_target"] = ref["held_out_loss_mean"] <= target
        else:
            r["reaches_target"] = r["held_out_loss_mean"] <= target
            if r.get("held_out_loss_global") is not None:  # the heaviest replica of every fragment, as a joiner gets
                r["global_reaches_target"] = r["held_out_loss_global"] <= target
            r["time_to_target_s"] = r["wall_seconds"] if r["reaches_target"] else None
            r["time_to_target_kind"] = "measured" if r["reaches_target"] else "not reached within the budget"
            if min(r["steps_per_daemon"]) < r["steps_run"]:
                r["time_to_target_kind"] += (f"; stopped by the benchmark at steps {r['steps_per_daemon']} of "
                                             f"{r['steps_run']} after {r['wall_seconds']:.0f} s")
    for (rate, rtt, _), runs in points.items():
        # ddp's steps and hivemind's run of the same seed, else of seed 0 (the sweep's single-seed points)
        same = runs + points.get((rate, rtt, 0), [])
        ddp = next((r for r in same if r["algorithm"] == "ddp"), None)
        hm = next((r for r in same if r["algorithm"] == "hivemind"), None)
        for r in runs:
            t = r.get("time_to_target_s")
            if ddp and t:
                r["speedup_over_ddp"] = ddp["time_to_target_s"] / t
            if ddp:
                r["wall_speedup_over_ddp_budget"] = ddp["time_to_target_s"] / r["wall_seconds"]
            if hm and t and hm.get("time_to_target_s"):
                r["time_to_target_over_hivemind"] = t / hm["time_to_target_s"]
            if hm:
                r["wall_over_hivemind"] = r["wall_seconds"] / hm["wall_seconds"]
                r["wire_bytes_over_hivemind"] = r["wire_bytes"] / hm["wire_bytes"] if hm["wire_bytes"] else None
    doc["seeds"] = seed_summary(doc)


def seed_summary(doc: dict) -> list[dict]:
    """Per (rate, RTT, algorithm) run with more than one seed: mean and 95% interval of what varies by seed."""
    groups: dict = {}
    for r in doc["runs"]:
        groups.setdefault((r["rate_mbit"], r["rtt_ms"], r["algorithm"]), []).append(r)
    rows = []
    for (rate, rtt, algorithm), runs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0],
                                                                             ALGORITHMS.index(kv[0][2]))):
        if len({r.get("seed", 0) for r in runs}) < 2 or algorithm == "ddp":
            continue
        rows.append({"rate_mbit": rate, "rtt_ms": rtt, "algorithm": algorithm,
                     "seeds": sorted(r.get("seed", 0) for r in runs),
                     "reached": sum(bool(r.get("reaches_target")) for r in runs),
                     "global_reached": sum(bool(r.get("global_reaches_target")) for r in runs),
                     "held_out_loss_global": global_interval(runs),
                     "held_out_loss": interval([r["held_out_loss_mean"] for r in runs]),
                     "wall_seconds": interval([r["wall_seconds"] for r in runs]),
                     "speedup_over_ddp": [r.get("speedup_over_ddp") for r in runs],
                     "utilization": interval([r["utilization"] for r in runs]),
                     "tokens_lost_share": interval([r["tokens_lost"] / max(r["tokens_total"], 1) for r in runs])})
    return rows


def global_interval(runs: list[dict]) -> dict | None:
    values = [r.get("held_out_loss_global") for r in runs]
    return interval(values) if all(v is not None for v in values) else None


def seed_table(doc: dict) -> str:
    rows = ["| rate Mbit/s | RTT ms | algorithm | seeds | reached the target | held-out loss | global model: reached, "
            "loss | wall s | speedup over ddp (to target), per seed | utilization | tokens lost |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc.get("seeds", []):
        sp = " / ".join("-" if x is None else f"{x:.1f}x" for x in r["speedup_over_ddp"])
        rows.append(f"| {r['rate_mbit']:g} | {r['rtt_ms']:g} | {r['algorithm']} | {len(r['seeds'])} | "
                    f"{r['reached']} of {len(r['seeds'])} | {fmt(r['held_out_loss'])} | "
                    f"{r.get('global_reached', 0)}, "
                    f"{'-' if not r.get('held_out_loss_global') else fmt(r['held_out_loss_global'])} | "
                    f"{fmt(r['wall_seconds'], 1)} | "
                    f"{sp} | {fmt(r['utilization'], 2)} | {fmt(r['tokens_lost_share'], 3)} |")
    return "\n".join(rows)


def table(doc: dict) -> str:
    """The runs as a markdown table (what docs/results.md quotes)."""
    rows = ["| rate Mbit/s | RTT ms | algorithm | seed | commit | steps / daemon | held-out loss | wall s (budget) | time to target s | "
            "speedup over ddp (to target) | speedup over ddp (same steps) | utilization | wire MB | counted sent MB | "
            "tokens lost | global model loss | / hivemind: time to target, budget wall |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(doc["runs"], key=lambda r: (r["rtt_ms"], r["rate_mbit"], r.get("seed", 0),
                                                ALGORITHMS.index(r["algorithm"]))):
        t = r.get("time_to_target_s")
        kind = r.get("time_to_target_kind", "")
        tt = "not reached" if t is None else f"{t:.0f}" + (" (extrapolated)" if kind.startswith("EXTRA") else "")
        sp = r.get("speedup_over_ddp")
        hm = r.get("time_to_target_over_hivemind")
        sent = r.get("bytes_sent_counted")
        wb = r.get("wall_speedup_over_ddp_budget")
        wh = r.get("wall_over_hivemind")
        lost = r["tokens_lost"] / r["tokens_total"] if r["tokens_total"] else 0
        rows.append(f"| {r['rate_mbit']:g} | {r['rtt_ms']:g} | {r['algorithm']} | {r.get('seed', 0)} | "
                    f"{r.get('commit', 'before #32')} | "
                    f"{'/'.join(str(x) for x in r['steps_per_daemon'])} | {r['held_out_loss_mean']:.3f} | "
                    f"{r['wall_seconds']:.1f} | {tt} | {'-' if sp is None else f'{sp:.1f}x'} | "
                    f"{'-' if r['algorithm'] == 'ddp' or wb is None else f'{wb:.1f}x'} | "
                    f"{r['utilization']:.2f} | {r['wire_bytes'] / 1e6:.1f} | "
                    f"{'-' if sent is None else f'{sent / 1e6:.1f}'} | {lost:.0%} | "
                    f"{'-' if r.get('held_out_loss_global') is None else format(r['held_out_loss_global'], '.3f')} | "
                    f"{'-' if hm is None else f'{hm:.2f}'} / {'-' if wh is None else f'{wh:.2f}'} |")
    return "\n".join(rows)


def plot(doc: dict, path: Path) -> None:
    plt = pyplot()

    runs = [r for r in doc["runs"]]
    rtts = sorted({r["rtt_ms"] for r in runs})
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    colors = {"ddp": "black", "diloco": "tab:blue", "streaming": "tab:green", "decoupled": "tab:red",
              "hivemind": "tab:purple"}
    for rtt, style in zip(rtts, ["-", "--", ":"]):
        for a in ALGORITHMS:
            mine = [r for r in runs if r["algorithm"] == a and r["rtt_ms"] == rtt]
            pts = sorted((r for r in mine if r.get("seed", 0) == 0), key=lambda r: r["rate_mbit"])  # lines: seed 0
            if not pts:
                continue
            others = [r for r in mine if r.get("seed", 0) != 0]  # further seeds: crosses
            axes[0].plot([r["rate_mbit"] for r in others], [r.get("time_to_target_s") or r["wall_seconds"]
                                                            for r in others], "x", color=colors[a])
            axes[1].plot([r["rate_mbit"] for r in others], [r["utilization"] for r in others], "x", color=colors[a])
            x = [r["rate_mbit"] for r in pts]
            y = [r.get("time_to_target_s") or float("nan") for r in pts]
            label = f"{a}, RTT {rtt:g} ms" + (" (extrapolated)" if a == "ddp" else "")
            axes[0].plot(x, y, style, marker="o", color=colors[a], label=label)
            missed = [r for r in pts if r.get("time_to_target_s") is None]
            if missed:  # the budget's wall time of a run whose final replica missed the target: hollow
                axes[0].plot([r["rate_mbit"] for r in missed], [r["wall_seconds"] for r in missed], "o",
                             mfc="none", color=colors[a], label=f"{a}, RTT {rtt:g} ms: budget done, target NOT reached")
            axes[1].plot(x, [r["utilization"] for r in pts], style, marker="o", color=colors[a])
            axes[2].plot(x, [r["wire_bytes"] / 1e6 / max(r["tokens_total"], 1) * 1e3 for r in pts], style,
                         marker="o", color=colors[a])
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("link rate, Mbit/s each way (every region)")
        for name, rate in doc.get("production_rates_mbit", {}).items():
            ax.axvline(rate, color="gray", lw=0.8, ls="--")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].set_ylabel(f"wall seconds to held-out loss {doc.get('target_held_out_loss', float('nan')):.3f}")
    axes[0].legend(fontsize=6)
    axes[1].set_ylabel("compute utilization (share of wall time in inner steps)")
    axes[1].set_ylim(0, 1.05)
    axes[2].set_ylabel("bytes on the wire per 1000 tokens (MB)")
    axes[2].set_yscale("log")
    fig.suptitle(f"4 regions, {doc['model']}, {doc['steps']} steps each, H={doc['sync_every']}; gray dashed: the "
                 f"production ratio (12B bf16, 2 and 5 Gbps, 1 s/step) scaled here", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="nano")
    p.add_argument("--steps", type=int, default=800, help="inner steps per daemon: the token budget")
    p.add_argument("--ddp-steps", type=int, default=12, help="ddp's steps over a capped link (then extrapolated)")
    p.add_argument("--sync-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0, help="the seed of --calibrate and --reference runs")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds of the sweep's points (default: --seed)")
    p.add_argument("--rates", type=float, nargs="*", default=[], help="Mbit/s, each way, every region")
    p.add_argument("--rtts", type=float, nargs="*", default=[0.0], help="ms between any two regions")
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    p.add_argument("--hivemind-compression", default="fp16", choices=["fp16", "uint8"])
    p.add_argument("--target-ratio", type=float, default=1.05)
    p.add_argument("--reference", action="store_true", help="run ddp over uncapped links, RTT 0 (the target)")
    p.add_argument("--calibrate", action="store_true", help="decoupled over uncapped links: inner step time here")
    p.add_argument("--run-timeout", type=float, default=900.0)
    p.add_argument("--straggler-wait", type=float, default=90.0,
                   help="seconds the other daemons get once the first has finished its steps; then they are stopped")
    p.add_argument("--import-calibration", default=None, metavar="JSON",
                   help="with --replot: take 'calibration' and 'production_rates_mbit' from the JSON a --calibrate "
                        "run wrote to another --out")
    p.add_argument("--recover", nargs="*", default=[], metavar="ALGORITHM:RATE:RTT:STEPS:WIRE_MB",
                   help="add an atoll run from its folder under runs/bench_wan (see recover_atoll)")
    p.add_argument("--global-from-folders", action="store_true",
                   help="with --replot: add the global model's held-out loss (held_out_loss_global) to every atoll run "
                        "of this code whose folder under runs/bench_wan is still there")
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--out", default="docs/results/wan")
    p.add_argument("--replot", action="store_true")
    args = p.parse_args()
    out = Path(args.out)
    path = out / "bench_wan.json"
    if args.replot:
        doc = json.loads(path.read_text())
        if args.import_calibration:
            cal = json.loads(Path(args.import_calibration).read_text())
            doc["calibration"], doc["production_rates_mbit"] = cal["calibration"], cal["production_rates_mbit"]
            doc["commands"] = cal["commands"] + doc["commands"]
        if args.global_from_folders:
            global_from_folders(doc, args)
        derive(doc)
        write_result(path, doc)
        plot(doc, out / "bench_wan.png")
        print(table(doc))
        if doc.get("seeds"):
            print(seed_table(doc))
        return 0
    doc = json.loads(path.read_text()) if path.exists() and not args.fresh else {"runs": [], "commands": []}
    doc.update(model=args.model, steps=args.steps, sync_every=args.sync_every, batch_size=BATCH, daemons=DAEMONS,
               seed=args.seed, target_ratio=args.target_ratio, production_ratio_transfer_over_step=prod_ratios())
    doc["commands"].append("python -m scripts.bench_wan " + " ".join(sys.argv[1:]))
    mb = model_bytes(args.model)
    doc["model_bytes_fp32"] = mb
    for spec in args.recover:  # ALGORITHM:RATE:RTT:STEPS:WIRE_MB
        algorithm, rate, rtt, steps, wire_mb = spec.split(":")
        r = recover_atoll(Path("runs/bench_wan") / f"{algorithm}-{float(rate):g}-{float(rtt):g}", algorithm,
                          float(rate), float(rtt), int(steps), float(wire_mb), args)
        doc["runs"] = [x for x in doc["runs"] if (x["algorithm"], x["rate_mbit"], x["rtt_ms"]) !=
                       (algorithm, r["rate_mbit"], r["rtt_ms"])] + [r]
    if args.calibrate:
        (r,) = one_point(0.0, 0.0, ["decoupled"], args)
        step = statistics.mean(t / s for t, s in zip(r["train_seconds_per_daemon"], r["steps_per_daemon"]))
        doc["calibration"] = {"inner_step_s": step, "run": r}
        doc["production_rates_mbit"] = {k: mb * 8 / (ratio * step) / 1e6 for k, ratio in prod_ratios().items()}
        print(f"inner step {step * 1e3:.1f} ms; model {mb / 1e6:.3f} MB fp32; a full-model transfer / step equal to "
              f"production's: {doc['production_rates_mbit']}")
    if args.reference:
        (r,) = one_point(0.0, 0.0, ["ddp"], args)
        doc["reference"] = r
    key = lambda r: (r["algorithm"], r["rate_mbit"], r["rtt_ms"], r.get("seed", 0))  # noqa: E731
    points = [(rtt, rate, seed) for rtt in args.rtts for rate in args.rates for seed in args.seeds or [args.seed]]
    for rtt, rate, seed in each(points, "points"):
        new = one_point(rate, rtt, args.algorithms, args, seed)
        keys = {key(r) for r in new}
        doc["runs"] = [r for r in doc["runs"] if key(r) not in keys] + new
        derive(doc)
        out.mkdir(parents=True, exist_ok=True)
        write_result(path, doc)  # after every point: a late failure keeps what was measured
    derive(doc)
    out.mkdir(parents=True, exist_ok=True)
    write_result(path, doc)
    if doc["runs"]:
        plot(doc, out / "bench_wan.png")
    for r in doc["runs"]:
        print(f"{r['algorithm']:10s} {r['rate_mbit']:6g} Mbit/s RTT {r['rtt_ms']:4g} seed {r.get('seed', 0)}  loss {r['held_out_loss_mean']:.4f}"
              f"  t→target {r.get('time_to_target_s') or float('nan'):8.1f}s  x ddp {r.get('speedup_over_ddp', 0):5.1f}"
              f"  util {r['utilization']:.2f}  wire {r['wire_bytes'] / 1e6:7.1f} MB  lost {r['tokens_lost']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Mixed hardware: four daemons, two of them about 18% slower, against the same swarm at one speed; repeated.

    python -m scripts.bench_mixed [--seconds 60] [--seeds 0 1 2] [--model tiny] [--sync-every 40]

The paper's setting, scaled to this machine: learners of two speeds, every step's time varied by ±10%
(``--harness step_jitter``, drawn from a generator seeded per daemon and seed). Steps are dominated by a fixed
per-step delay (as in ``bench_straggler``), so that "18% slower" means the delay and an estimate of the compute,
not the noise of four daemons sharing two cores; the slow daemons' measured pace is reported beside it. Every
configuration runs the same model, data and wall-clock budget, once per seed (a seed pins each daemon's data
shard and its jitter's draws), in an order that rotates from seed to seed:

- ``uniform``: ``decoupled`` with the defaults, four daemons at the fast pace (the reference);
- ``mixed``: ``decoupled`` with the defaults (quorum, grace window, token weights);
- ``mixed, wait for all``: ``decoupled`` with ``--quorum 4`` (the paper's K = all);
- ``mixed, K=1 no grace``: ``decoupled`` with ``--quorum 1 --grace-gamma 0``;
- ``mixed, diloco``: synchronous DiLoCo.

Reported per configuration (mean and 95% interval over the seeds): the held-out loss at the end of the budget
(each daemon's final replica, evaluated here; their mean) and at equal tokens against the uniform run of the same
seed (the first daemon's own held-out evaluations at its fragment-0 merges, against the swarm's tokens at that
moment; the uniform run's curve interpolated at the tokens the configuration reached), goodput (the share of wall
time in inner steps since each daemon's training began, mean over daemons; and over the uniform run's, since
this machine's merges count against every configuration), tokens lost (trained and never merged), and the slow
daemons' share of the tokens that reached a merge. Writes docs/results/mixed/bench_mixed.json and .png.

``--rate MBIT --rtt MS``: the same swarms over the emulated WAN (``scripts/wan.py``, as ``bench_wan``: four regions,
one daemon each, every region's access link capped at ``--rate`` both ways, ``--rtt`` between any two regions),
where a round is in flight for longer, so that waiting for the slow daemons costs the fast ones more staleness
than on loopback. Needs root (network namespaces).

``--devices``: the mixed-device variant, in the xla environment (``make xla-venv``; torch_xla's runtime on the
CPU). Three daemons, synchronous DiLoCo for ``--steps`` steps each, data pinned per seed and position: all three
on the CPU (fp32), against one of them on xla (bf16 autocast) beside two on the CPU; the held-out loss of the
final replicas, xla over CPU, per seed. Writes docs/results/mixed/bench_mixed_devices.json.

    PYTHONPATH=build/xla-path PJRT_DEVICE=CPU ~/.cache/atoll/venv-xla/bin/python -m scripts.bench_mixed --devices
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import shutil
import statistics
import sys
import time
from pathlib import Path

from scripts import wan
from scripts.bars import each
from scripts.benchkit import BATCH, evaluate_swarm, summaries
from scripts.swarm import LocalSwarm

from atoll.node.config import RunConfig
from scripts.results import pyplot, save_figure, write_result
from scripts.stats import fmt, interval
from scripts.wan_runs import REGIONS

DAEMONS = 4
SLOW = ("d2", "d3")
FAST_DELAY = 0.15  # seconds per step on every daemon, on top of the compute
SLOWER = 0.18  # the paper's slower chips
JITTER = 0.10  # the paper's injected variance, each step
CONFIGS = {
    "uniform": ("decoupled", [], False),
    "mixed": ("decoupled", [], True),
    "mixed, wait for all": ("decoupled", ["--quorum", str(DAEMONS)], True),
    "mixed, K=1 no grace": ("decoupled", ["--quorum", "1", "--grace-gamma", "0"], True),
    "mixed, diloco": ("diloco", [], True),
}


def slow_delay(compute_estimate: float) -> float:
    """The per-step delay that makes a step ``SLOWER`` longer than a fast one (its delay and compute)."""
    return FAST_DELAY + SLOWER * (FAST_DELAY + compute_estimate)


def tokens_at(progress: list[tuple[float, int]], t: float) -> float:
    """A daemon's tokens at time ``t``, linear between its progress records (0 before the first)."""
    times = [p[0] for p in progress]
    i = bisect.bisect_right(times, t)
    if i == 0:
        return 0.0
    if i == len(progress):
        return float(progress[-1][1])
    (t0, k0), (t1, k1) = progress[i - 1], progress[i]
    return k0 + (k1 - k0) * (t - t0) / (t1 - t0) if t1 > t0 else float(k1)


def held_out_curve(swarm: LocalSwarm) -> list[tuple[float, float]]:
    """(the swarm's tokens, d0's held-out loss) at each of d0's fresh evaluations (fragment-0 merges)."""
    progress = {}
    for name, d in swarm.daemons.items():
        records = [(m["time"], m["tokens"]) for m in d.metrics()
                   if m.get("event") in (None, "round", "summary") and "tokens" in m and "time" in m]
        progress[name] = sorted(records)
    curve = []
    for r in swarm.daemons["d0"].rounds():
        if r.get("fragment") == 0 and r.get("held_out_loss") is not None and r.get("held_out_step") == r["step"]:
            curve.append((sum(tokens_at(p, r["time"]) for p in progress.values()), r["held_out_loss"]))
    return sorted(curve)


def at_tokens(curve: list[tuple[float, float]], tokens: float) -> float | None:
    """The curve's held-out loss at ``tokens``, linear between its points; None outside it."""
    xs = [c[0] for c in curve]
    i = bisect.bisect_left(xs, tokens)
    if not curve or tokens < xs[0] or tokens > xs[-1]:
        return None
    if xs[i] == tokens or i == 0:
        return curve[i][1]
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)


def run_once(root: Path, label: str, seed: int, args: argparse.Namespace, w: wan.Wan | None = None) -> dict:
    algorithm, extra, mixed = CONFIGS[label]
    common = ["--model", args.model, "--algorithm", algorithm, "--sync-every", str(args.sync_every),
              "--batch-size", str(BATCH), "--gather-timeout", "20", "--round-timeout", "20", "--threads", "1",
              *extra]
    shutil.rmtree(root, ignore_errors=True)
    with LocalSwarm(root, common) as swarm:
        for i in range(DAEMONS):
            name = f"d{i}"
            delay = slow_delay(args.compute_estimate) if mixed and name in SLOW else FAST_DELAY
            # Each daemon's data shard and jitter are pinned by seed and position, so that every configuration of a
            # seed trains on the same data (a fresh identity would pick another shard) and only the speeds differ.
            harness = [f"step_delay={delay}", f"step_jitter={JITTER}", f"jitter_seed={seed * DAEMONS + i}",
                       f"data_shard={seed * DAEMONS + i}"]
            # d0 evaluates at each of its fragment-0 merges: the curve the configurations are compared on.
            own = ["--eval-budget", "1"] if i == 0 else []
            where = {} if w is None else {"prefix": ["ip", "netns", "exec", w.ns(REGIONS[i])],
                                          "host": w.addr(REGIONS[i])}
            swarm.start(name, [*(x for h in harness for x in ("--harness", h)), *own], join=i > 0, **where)
        time.sleep(args.seconds)
        swarm.stop_all(timeout=120)
    run = RunConfig(model=args.model, algorithm=algorithm, sync_every=args.sync_every)
    s = dict(zip(swarm.daemons, summaries(swarm)))
    losses = evaluate_swarm(swarm, run)
    merged = {n: max(0, x["tokens"] - x["tokens_lost"]) for n, x in s.items()}
    pace = {n: x["step"] / x["wall_seconds"] for n, x in s.items()}
    fast = [pace[n] for n in s if n not in SLOW]
    trained = sum(x["tokens"] for x in s.values())
    return {"config": label, "seed": seed, "held_out_loss_end": statistics.mean(losses),
            "held_out_loss_per_daemon": dict(zip(swarm.daemons, losses)),
            "curve": held_out_curve(swarm), "tokens_total": trained,
            "goodput": statistics.mean(x["goodput"] for x in s.values()),
            "tokens_lost": sum(x["tokens_lost"] for x in s.values()),
            "tokens_lost_share": sum(x["tokens_lost"] for x in s.values()) / max(1, trained),
            "slow_share_of_merged": sum(merged[n] for n in SLOW) / max(1, sum(merged.values())),
            "slow_pace_over_fast": statistics.mean(pace[n] for n in SLOW) / statistics.mean(fast),
            "steps_per_s": pace, "blocked_s": {n: x["blocked_s"] for n, x in s.items()},
            "rounds": {n: x["rounds"] for n, x in s.items()}}


DEVICE_CONFIGS = {"all cpu": ("cpu", "cpu", "cpu"), "one xla": ("xla", "cpu", "cpu")}
DEVICE_RUN_TIMEOUT = 1200  # seconds for a swarm of the mixed-device variant to finish its steps


def run_devices(root: Path, label: str, seed: int, args: argparse.Namespace) -> dict:
    """One swarm of the mixed-device variant: every daemon to ``--steps``, in lockstep (synchronous rounds)."""
    run = RunConfig(model="nano", algorithm="diloco", sync_every=20)
    common = ["--model", run.model, "--algorithm", run.algorithm, "--sync-every", str(run.sync_every),
              "--batch-size", "4", "--max-steps", str(args.steps), "--gather-timeout", "30", "--round-timeout", "30",
              "--threads", "1"]
    shutil.rmtree(root, ignore_errors=True)
    devices = DEVICE_CONFIGS[label]
    with LocalSwarm(root, common) as swarm:
        for i, device in enumerate(devices):
            harness = [f"data_shard={seed * len(devices) + i}", f"start_together={len(devices)}"]
            swarm.start(f"d{i}", ["--device", device, *(x for h in harness for x in ("--harness", h))], join=i > 0)
        codes = {n: d.proc.wait(DEVICE_RUN_TIMEOUT) for n, d in swarm.daemons.items()}
    if any(codes.values()):
        raise RuntimeError(f"{label}: daemons exited {codes}; see {root}")
    s = summaries(swarm)
    return {"config": label, "seed": seed, "devices": list(devices),
            "held_out_loss_end": statistics.mean(evaluate_swarm(swarm, run)),
            "steps": [x["step"] for x in s], "wall_seconds": [x["wall_seconds"] for x in s]}


def measure_devices(args: argparse.Namespace) -> int:
    runs = []
    for n, seed in enumerate(each(args.seeds, "seeds")):
        got = {}
        for label in (list(DEVICE_CONFIGS) if n % 2 == 0 else list(DEVICE_CONFIGS)[::-1]):
            print(f"seed {seed}: {label}, {args.steps} steps ...", flush=True)
            got[label] = run_devices(Path("runs/bench_mixed") / label.replace(" ", "_"), label, seed, args)
        got["ratio"] = got["one xla"]["held_out_loss_end"] / got["all cpu"]["held_out_loss_end"]
        print(f"  held-out: all cpu {got['all cpu']['held_out_loss_end']:.4f}, one xla "
              f"{got['one xla']['held_out_loss_end']:.4f} (x{got['ratio']:.4f})", flush=True)
        runs.append(got)
    ratio = interval([r["ratio"] for r in runs])
    print(f"held-out loss, one xla daemon over all cpu: x{fmt(ratio, 4)}")
    doc = {"command": "python -m scripts.bench_mixed " + " ".join(sys.argv[1:]), "model": "nano", "daemons": 3,
           "algorithm": "diloco", "sync_every": 20, "steps": args.steps, "seeds": args.seeds, "ratio": ratio,
           "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "bench_mixed_devices.json", doc)
    return 0


def compare(got: dict[str, dict]) -> None:
    """Each configuration against the uniform run of the same seed: its held-out loss at equal tokens (both curves
    at the fewer tokens of the two runs' last evaluations), at the end, and its goodput."""
    uniform = got["uniform"]
    for r in got.values():
        r["held_out_end_ratio"] = r["held_out_loss_end"] / uniform["held_out_loss_end"]
        r["goodput_ratio"] = r["goodput"] / uniform["goodput"]
        r["held_out_at_equal_tokens_ratio"] = r["equal_tokens"] = None
        if r["curve"] and uniform["curve"]:
            tokens = min(r["curve"][-1][0], uniform["curve"][-1][0])
            mine, reference = at_tokens(r["curve"], tokens), at_tokens(uniform["curve"], tokens)
            if mine is not None and reference is not None:
                r["equal_tokens"], r["held_out_at_equal_tokens_ratio"] = tokens, mine / reference


def measure(args: argparse.Namespace, runs: list[dict[str, dict]], w: wan.Wan | None) -> None:
    """Every configuration once per seed (in an order that rotates), compared with the seed's uniform swarm."""
    for n, seed in enumerate(each(args.seeds, "seeds")):
        order = args.configs[n % len(args.configs):] + args.configs[:n % len(args.configs)]
        got = {}
        for label in order:
            print(f"seed {seed}: {label} for {args.seconds:.0f} s ...", flush=True)
            root = Path("runs/bench_mixed") / label.replace(" ", "_").replace(",", "").replace("=", "")
            got[label] = run_once(root, label, seed, args, w)
        compare(got)
        for label in args.configs:
            r = got[label]
            print(f"  {label:22s} held-out end {r['held_out_loss_end']:.4f} (x{r['held_out_end_ratio']:.3f}), at equal "
                  f"tokens x{r['held_out_at_equal_tokens_ratio'] or float('nan'):.3f}; goodput {r['goodput']:.3f} "
                  f"(x{r['goodput_ratio']:.3f}); "
                  f"tokens lost {r['tokens_lost_share']:.3f}; slow share {r['slow_share_of_merged']:.3f} "
                  f"(pace x{r['slow_pace_over_fast']:.3f})", flush=True)
        runs.append(got)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--sync-every", type=int, default=40)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--compute-estimate", type=float, default=0.25,
                        help="seconds of compute per step (tiny, batch 8, four daemons on two cores)")
    parser.add_argument("--out", default="docs/results/mixed")
    parser.add_argument("--devices", action="store_true", help="the mixed-device variant (the xla environment)")
    parser.add_argument("--steps", type=int, default=200, help="--devices: steps per daemon")
    parser.add_argument("--rate", type=float, default=None, help="over the emulated WAN: Mbit/s each way, every region")
    parser.add_argument("--rtt", type=float, default=0.0, help="over the emulated WAN: ms between any two regions")
    args = parser.parse_args()
    if args.rate is not None and (args.rate <= 0 or args.rtt < 0):
        parser.error("--rate must be positive and --rtt not negative")
    if args.devices:
        return measure_devices(args)
    if "uniform" not in args.configs:
        parser.error("--configs must include uniform (the reference)")
    started = time.time()
    runs: list[dict[str, dict]] = []
    with contextlib.ExitStack() as stack:
        w = None
        if args.rate is not None:
            regions = [wan.Region(r, rate_mbit=args.rate, delay_ms=args.rtt / 4) for r in REGIONS]
            w = stack.enter_context(wan.Wan(regions, tag="bm"))
        measure(args, runs, w)
    results = []
    for label in args.configs:
        row: dict = {"config": label, "algorithm": CONFIGS[label][0], "flags": CONFIGS[label][1],
                     "mixed": CONFIGS[label][2]}
        for key in ("held_out_loss_end", "held_out_end_ratio", "held_out_at_equal_tokens_ratio", "goodput",
                    "goodput_ratio", "tokens_lost_share", "slow_share_of_merged", "slow_pace_over_fast"):
            values = [got[label][key] for got in runs if got[label].get(key) is not None]
            row[key] = interval(values) if values else None
        results.append(row)
        show = {k: fmt(v) if isinstance(v, dict) else "-" for k, v in row.items()}
        print(f"{label:22s} held-out at equal tokens x{show['held_out_at_equal_tokens_ratio']}, end "
              f"x{show['held_out_end_ratio']}; goodput {show['goodput']} (x{show['goodput_ratio']}); "
              f"tokens lost {show['tokens_lost_share']}; slow share {show['slow_share_of_merged']}")
    doc = {"command": "python -m scripts.bench_mixed " + " ".join(sys.argv[1:]), "model": args.model,
           "daemons": DAEMONS, "slow": list(SLOW), "seconds": args.seconds, "seeds": args.seeds,
           "sync_every": args.sync_every, "fast_step_delay": FAST_DELAY,
           "slow_step_delay": slow_delay(args.compute_estimate), "jitter": JITTER,
           "minutes": (time.time() - started) / 60, "wan": None if args.rate is None else
           {"rate_mbit": args.rate, "rtt_ms": args.rtt, "regions": list(REGIONS)}, "results": results, "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "bench_mixed.json", doc)
    plot(doc, out / "bench_mixed.png")
    return 0


def plot(doc: dict, path: Path) -> None:
    plt = pyplot()
    results = doc["results"]
    labels = [r["config"].replace(", ", ",\n") for r in results]
    x = list(range(len(results)))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (("held_out_at_equal_tokens_ratio", "held-out at equal tokens / uniform", 1.0),
              ("goodput", "goodput (share of wall time in inner steps)", 0.97),
              ("slow_share_of_merged", "slow daemons' share of merged tokens", 0.5))
    for ax, (key, ylabel, line) in zip(axes, panels):
        means = [r[key]["mean"] if r[key] else 0 for r in results]
        errors = [(r[key]["ci95"] or 0) if r[key] else 0 for r in results]
        ax.bar(x, means, 0.6, yerr=errors, capsize=4)
        ax.axhline(line, color="k", ls="--", lw=0.8)
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel(ylabel, fontsize=8)
    axes[0].set_ylim(0.9, 1.1)
    link = doc.get("wan")
    over = f", over a WAN of {link['rate_mbit']:g} Mbit/s, RTT {link['rtt_ms']:g} ms" if link else ""
    fig.suptitle(f"{doc['daemons']} daemons ({', '.join(doc['slow'])} {SLOWER:.0%} slower, ±{doc['jitter']:.0%} per "
                 f"step), {doc['model']}, {doc['seconds']:.0f} s, H={doc['sync_every']}{over}, seeds "
                 f"{' '.join(map(str, doc['seeds']))} (mean, 95% interval)", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Plan a run at internet scale: a goodput simulator and a bandwidth/step-schedule model.

Two subcommands, each prints a table and writes JSON + a PNG plot into ``--out``
(default ``runs/sim``, created if missing and ignored by git; ``--out docs/results/simulate``
rewrites the committed results):

``goodput``
    Discrete-event simulation of N chips split into M learners under per-chip Poisson
    interruptions, for ``dp``, ``elastic``, ``decoupled`` (central syncer) and ``atoll``
    (no syncer). Writes ``simulate_goodput.{json,png}``: Table 1 of the Decoupled DiLoCo
    paper simulated with confidence intervals over seeds and compared with the paper, its
    extension to 10M chips and up to 1024 learners, a timing of 2.4M chips over one
    simulated week, and with ``--calibrate`` the fit of the parameters the paper does not
    state to the Table 1 columns not held out (``--holdout-chips``), with the error on the
    held-out columns and a leave-one-column-out cross-validation.

``bandwidth``
    Wall-clock and compute utilization of the ``ddp``, ``diloco``, ``streaming`` and
    ``decoupled`` step schedules over a WAN. Writes ``simulate_bandwidth.{json,png}``:
    Streaming DiLoCo's headline and the seed's 12B / 4 regions / 2-5 Gbps scenario.

This file is only the command line: the models live in ``scripts/sim`` (see its
``__init__``), which is imported from the folder of this file, so it runs from any cwd.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from dataclasses import asdict
from typing import Any, Sequence

import numpy as np


from scripts.results import write_result
from scripts.sim.bandwidth import bandwidth_study
from scripts.sim.goodput import (
    ABLATION_GRIDS, CALIBRATION_DP_PREFILTER, CALIBRATION_HORIZON_S, CALIBRATION_SEEDS, DAY_S, DEFAULT_CALIBRATION_GRID,
    DEFAULT_HOLDOUT_CHIPS, EXTENDED_CHIPS, EXTENDED_LEARNERS, WEEK_S, YEAR_S, FailureModel,
    RowSpec, calibrate, cell_errors, cross_validate, error_summary, fmt_chips, run_table,
    simulate, table1_cells, table1_errors, table1_rows, with_params)
from scripts.sim.paper import PAPER_CHIPS, PAPER_TABLE1
from scripts.sim.plots import plot_bandwidth, plot_goodput

# Relative to the cwd, like any --out; runs/ is git-ignored wherever it is.
DEFAULT_OUT = "runs/sim"
OUT_HELP = ("output folder for JSON and PNG, created if missing; "
            "--out docs/results/simulate rewrites the committed results")


def _env() -> dict[str, Any]:
    return {"python": platform.python_version(), "numpy": np.__version__,
            "machine": platform.machine(), "cpus": os.cpu_count()}


def _fmt_summary(s: dict[str, Any]) -> str:
    if not s["n_cells"]:
        return "no cells"
    return f"max |difference| = {s['max_abs_err']:.2f} points, RMS = {s['rms_err']:.2f} ({s['n_cells']} cells)"


def _table1_summary(table: dict[str, Any], holdout_chips: Sequence[int]) -> dict[str, Any]:
    """Errors of a full Table 1 over all cells, the fitting cells and the held-out cells."""
    held = table1_cells(holdout_chips)
    fit = table1_cells() - held
    return {"held_out_chips": list(holdout_chips),
            "fit_chips": [n for n in PAPER_CHIPS if n not in holdout_chips],
            "all_cells": error_summary(cell_errors(table, table1_cells())),
            "fit_cells": error_summary(cell_errors(table, fit)),
            "held_out_cells": error_summary(cell_errors(table, held))}


def _print_table1(table: dict[str, Any], summary: dict[str, Any] | None) -> None:
    errs = table1_errors(table)
    held = set(summary["held_out_chips"]) if summary else set()
    head = "config".ljust(16) + "".join(
        f"{fmt_chips(n) + (' (held out)' if n in held else ''):>22}" for n in PAPER_CHIPS)
    print("Table 1 goodput %: simulated ±95% CI [paper] (difference)")
    print(head)
    for label, paper in PAPER_TABLE1.items():
        row = table[label]
        cells = []
        for n, p, e in zip(PAPER_CHIPS, paper, errs[label]):
            c = row[str(n)]
            cells.append(f"{c['goodput_mean']:5.1f}±{c['goodput_ci95']:.1f} [{p}] ({e:+.1f})")
        print(label.ljust(16) + "".join(f"{x:>22}" for x in cells))
    if summary is None:
        flat = cell_errors(table, table1_cells())
        print(f"all cells: {_fmt_summary(error_summary(flat))}; split unknown for these "
              "parameters (not the defaults, no --calibrate)")
        return
    print(f"fitting cells ({', '.join(fmt_chips(n) for n in summary['fit_chips'])}): "
          f"{_fmt_summary(summary['fit_cells'])}")
    if summary["held_out_chips"]:
        print(f"held-out cells ({', '.join(fmt_chips(n) for n in summary['held_out_chips'])}), "
              f"out of sample: {_fmt_summary(summary['held_out_cells'])}")
    print(f"all cells: {_fmt_summary(summary['all_cells'])}")


def _print_extension(table: dict[str, Any], chips: Sequence[int]) -> None:
    print("Extension: goodput % / uptime % (atoll rows: uptime without | with a central syncer)")
    print("config".ljust(16) + "".join(f"{fmt_chips(n):>18}" for n in chips))
    for label, row in table.items():
        cells = []
        for n in chips:
            c = row.get(str(n))
            if c is None:
                cells.append("-")
            elif label.startswith("atoll"):
                cells.append(f"{c['goodput_mean']:5.1f}/{c['uptime_no_syncer_mean']:.2f}|{c['uptime_with_syncer_mean']:.2f}")
            else:
                cells.append(f"{c['goodput_mean']:5.1f}/{c['uptime_mean']:6.2f}")
        print(label.ljust(16) + "".join(f"{x:>18}" for x in cells))


def cmd_goodput(args: argparse.Namespace) -> int:
    """Run the goodput study and write its JSON and PNG; returns the exit status."""
    fm = FailureModel(
        mtbi_chip_s=args.mtbi_years * YEAR_S, host_chips=args.host_chips, repair_s=args.repair_s,
        downscale_s=args.downscale_s, upscale_s=args.upscale_s,
        readmit_window_s=args.readmit_window_s, step_s=args.step_s, speed_cv=args.speed_cv,
        syncer_mtbi_s=args.syncer_mtbi_years * YEAR_S, syncer_repair_s=args.syncer_repair_s)
    try:
        fm.validate()
        if args.seeds < 1 or args.horizon_days <= 0 or args.quorum < 1:
            raise ValueError("--seeds and --quorum must be >= 1 and --horizon-days > 0")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    horizon = (1.0 if args.quick else args.horizon_days) * DAY_S
    seeds = list(range(1 if args.quick else args.seeds))
    os.makedirs(args.out, exist_ok=True)
    result: dict[str, Any] = {"env": _env()}
    # Which Table 1 cells the parameters in use were fitted on, when that is known.
    split: list[int] | None = list(DEFAULT_HOLDOUT_CHIPS) if fm == FailureModel() else None
    source = ("FailureModel defaults (fitted with " + _holdout_text(DEFAULT_HOLDOUT_CHIPS) + ")"
              if split is not None else "command-line flags (not the fitted defaults)")
    if args.calibrate:
        split = list(args.holdout_chips)
        held = table1_cells(split)
        cache: dict[Any, dict[str, Any]] = {}
        t0 = time.perf_counter()
        calibration = calibrate(DEFAULT_CALIBRATION_GRID, horizon_s=CALIBRATION_HORIZON_S,
                                seeds=CALIBRATION_SEEDS, base=fm,
                                dp_prefilter=CALIBRATION_DP_PREFILTER, holdout=held, cache=cache)
        if not calibration:
            print(f"error: no grid point has its fitting dp cells within "
                  f"{CALIBRATION_DP_PREFILTER} points of the paper", file=sys.stderr)
            return 1
        print(f"calibration search, {_holdout_text(split)} ({time.perf_counter() - t0:.0f} s), "
              "best first (in sample = the fitting cells; out of sample = the held-out cells):")
        for c in calibration[:10]:
            print(f"  {_entry_text(c)} {c['params']}")
        winner = calibration[0]
        fm_flags, fm = fm, with_params(fm, winner["params"])
        source = f"calibration winner ({_holdout_text(split)})"
        print(f"  winner equals the parameters given (flags / defaults): {fm == fm_flags}")
        cv = None
        if not args.no_cv:
            t0 = time.perf_counter()
            cv = cross_validate(DEFAULT_CALIBRATION_GRID, [table1_cells([n]) for n in PAPER_CHIPS],
                                CALIBRATION_HORIZON_S, CALIBRATION_SEEDS, base=fm_flags,
                                dp_prefilter=CALIBRATION_DP_PREFILTER, cache=cache)
            print(f"leave-one-column-out cross-validation ({time.perf_counter() - t0:.0f} s):")
            for f in cv["folds"]:
                w = f["winner"]
                held_text = ", ".join(sorted({fmt_chips(c[1]) for c in f["holdout"]}))
                print(f"  hold out {held_text:>5}: "
                      + (f"{_entry_text(w)} {w['params']}" if w else "no point passed the prefilter"))
            print(f"  pooled, each cell predicted by the fit that did not see it: "
                  f"{_fmt_summary(cv['pooled'])}")
        ablation = {}
        for name, grid in ABLATION_GRIDS.items():
            best_abl = calibrate(grid, CALIBRATION_HORIZON_S, CALIBRATION_SEEDS, base=fm_flags,
                                 dp_prefilter=math.inf, top=1, holdout=held, cache=cache)[0]
            ablation[name] = best_abl
            print(f"  ablation {name}: best {_entry_text(best_abl)} {best_abl['params']}")
        result["calibration"] = {
            "grid": DEFAULT_CALIBRATION_GRID, "horizon_s": CALIBRATION_HORIZON_S,
            "seeds": list(CALIBRATION_SEEDS), "held_out_chips": split,
            "fit_chips": [n for n in PAPER_CHIPS if n not in split],
            "score": "max |sim - paper| over the fitting cells (the Table 1 columns not held "
                     "out), ties by RMS; held-out cells take no part in the ranking",
            "winner": winner, "winner_equals_given_parameters": fm == fm_flags,
            "given_parameters": asdict(fm_flags),
            "top": calibration, "cross_validation": cv, "ablation": ablation}
    result.update({"failure_model": asdict(fm), "failure_model_source": source,
                   "horizon_s": horizon, "seeds": seeds,
                   "quorum": args.quorum})

    # Timing: 2.4M chips over one simulated week, one seed, one process.
    timing = {}
    for regime, m in (("dp", 1), ("elastic", 1), ("decoupled", 8), ("atoll", 1024)):
        t0, c0 = time.perf_counter(), time.process_time()
        r = simulate(2_400_000, regime, m, 1, fm, WEEK_S, 0)
        timing[f"{regime} M={m}"] = {"wall_s": round(time.perf_counter() - t0, 3),
                                     "cpu_s": round(time.process_time() - c0, 3),
                                     "interruptions": r.interruptions, "resizes": r.resizes}
    result["timing_2p4M_chips_one_week"] = timing
    print("timing, 2.4M chips over one simulated week (one seed):")
    for k, v in timing.items():
        print(f"  {k:<18} wall {v['wall_s']:.2f} s  cpu {v['cpu_s']:.2f} s  "
              f"({v['interruptions']} interruptions, {v['resizes']} stops)")

    t0 = time.perf_counter()
    t1 = run_table(table1_rows(), PAPER_CHIPS, fm, horizon, seeds, args.quorum)
    result["table1"] = {"paper": {k: list(v) for k, v in PAPER_TABLE1.items()},
                        "chips": list(PAPER_CHIPS), "simulated": t1,
                        "difference": table1_errors(t1)}
    summary = _table1_summary(t1, split) if split is not None else None
    result["table1"]["summary"] = summary
    _print_table1(t1, summary)
    print(f"(table 1: {time.perf_counter() - t0:.1f} s, {len(seeds)} seed(s) of {horizon / DAY_S:g} days)")

    chips = list(args.chips) if args.chips else list(EXTENDED_CHIPS)
    learners = list(args.learners) if args.learners else list(EXTENDED_LEARNERS)
    if args.quick:
        learners = [m for m in learners if m in (2, 8, 64, 1024)] or learners[:2]
    rows = [RowSpec("dp", "dp"), RowSpec("elastic", "elastic")]
    rows += [RowSpec(f"atoll M={m}", "atoll", m) for m in learners]
    t0 = time.perf_counter()
    ext = run_table(rows, chips, fm, horizon, seeds, args.quorum)
    result["extension"] = {"chips": chips, "learners": learners, "simulated": ext,
                           "note": "atoll rows: goodput is also that of decoupled (central "
                                   "syncer) with the same M; uptime_no_syncer_mean is atoll's, "
                                   "uptime_with_syncer_mean the same learners with a central syncer."}
    _print_extension(ext, chips)
    print(f"(extension: {time.perf_counter() - t0:.1f} s)")

    jpath = os.path.join(args.out, "simulate_goodput.json")
    ppath = os.path.join(args.out, "simulate_goodput.png")
    write_result(jpath, result, seeds=seeds)
    plot_goodput(result, ppath)
    print(f"wrote {jpath} and {ppath}")
    return 0


def cmd_bandwidth(args: argparse.Namespace) -> int:
    """Run the bandwidth study and write its JSON and PNG; returns the exit status."""
    if args.latency_ms < 0 or any(b <= 0 for b in args.scenario_gbps):
        print("error: latency must be >= 0 and bandwidths > 0", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    res = bandwidth_study(args.quick, args.latency_ms, args.scenario_gbps, args.scenario_step_s)
    res = {"env": _env(), **res}
    print("Streaming DiLoCo headline: Gbps needed for 95% compute utilization (2 islands)")
    print(f"{'model':>6} {'step s':>8} " + "".join(f"{k:>24}" for k in res["headline"][0]["gbps_for_95pct"]))
    for row in res["headline"]:
        print(f"{row['params'] / 1e9:>5g}B {row['assumed_step_compute_s']:>8.3f} "
              + "".join(f"{v:>24.2f}" for v in row["gbps_for_95pct"].values()))
    print("paper: ddp 100/200/300 Gbps; streaming (overlap, FP4) 95% at 1-5 Gbps")
    sc = res["scenario"]
    print(f"\nSeed scenario: 12B, 4 regions, {sc['latency_ms']:g} ms one-way, "
          f"step compute {sc['assumed_step_compute_s']:.2f} s (assumed)")
    print(f"{'Gbps':>5} " + "".join(f"{k:>34}" for k in sc["methods"]))
    for row in sc["rows"]:
        cells = []
        for k in sc["methods"]:
            c = row[k]
            cells.append(f"{c['step_wall_s']:8.2f}s u={100 * c['utilization']:5.1f}% x{c['speedup_over_ddp']:<7.1f}")
        print(f"{row['gbps']:>5g} " + "".join(f"{x:>34}" for x in cells))
    print("(step wall-clock, compute utilization, speedup over ddp)")
    print("decoupled effective H (fragment rounds actually merged; design H=24): "
          + ", ".join(f"{r['gbps']:g} Gbps: {r['decoupled']['effective_sync_every']:.1f}"
                      for r in sc["rows"]))
    jpath = os.path.join(args.out, "simulate_bandwidth.json")
    ppath = os.path.join(args.out, "simulate_bandwidth.png")
    write_result(jpath, res)
    plot_bandwidth(res, ppath)
    print(f"wrote {jpath} and {ppath}")
    return 0


def _holdout_text(chips: Sequence[int]) -> str:
    if not chips:
        return "fitted on all 30 cells, none held out"
    fit = [fmt_chips(n) for n in PAPER_CHIPS if n not in chips]
    return f"fitted on {', '.join(fit)}; held out {', '.join(fmt_chips(n) for n in chips)}"


def _entry_text(entry: dict[str, Any]) -> str:
    ins, out = entry["in_sample"], entry["out_of_sample"]
    text = f"in sample max|err|={ins['max_abs_err']:.2f} rms={ins['rms_err']:.2f}"
    if out["n_cells"]:
        text += f"; out of sample max|err|={out['max_abs_err']:.2f} rms={out['rms_err']:.2f}"
    return text


def _holdout_chips(text: str) -> list[int]:
    """Chip counts of Table 1 columns to hold out; "none" holds out nothing."""
    if text.strip().lower() == "none":
        return []
    vals = sorted(set(_int_list(text)))
    bad = [v for v in vals if v not in PAPER_CHIPS]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad} not among Table 1's chip counts {list(PAPER_CHIPS)}")
    if len(vals) == len(PAPER_CHIPS):
        raise argparse.ArgumentTypeError("holding out every column leaves nothing to fit on")
    return vals


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(float(x)) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError("values must be >= 1")
    return vals


def _float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="simulate.py",
        description="Plan an atoll run at a scale no test can reach: goodput under chip "
                    "failures (Decoupled DiLoCo Table 1) and step-time/bandwidth of sync "
                    "schedules (Streaming DiLoCo Fig. 4). Writes JSON and PNG to --out.")
    sub = p.add_subparsers(dest="cmd", required=True)
    fm = FailureModel()
    g = sub.add_parser(
        "goodput", help="failure simulation: goodput and uptime vs chips and learners",
        description="Discrete-event simulation of per-chip Poisson interruptions for dp, elastic "
                    "dp, Decoupled DiLoCo (central syncer) and atoll (no syncer). Compares with "
                    "Table 1, then extends it to 10M chips and up to 1024 learners. Timing "
                    "defaults are fitted to part of Table 1 (docs/simulator.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g.add_argument("--out", default=DEFAULT_OUT, help=OUT_HELP)
    g.add_argument("--seeds", type=int, default=3, help="seeds per cell (CI over seeds)")
    g.add_argument("--horizon-days", type=float, default=7.0, help="simulated time per run")
    g.add_argument("--quick", action="store_true", help="1 seed, 1 simulated day, fewer learner counts")
    g.add_argument("--calibrate", action="store_true",
                   help="first fit the unstated parameters to the Table 1 columns not held out "
                        "(grid search), report the error on the held-out columns, run a "
                        "leave-one-column-out cross-validation and the same search with each "
                        "mechanism switched off (~15 min on one core), and use the fit's best point")
    g.add_argument("--holdout-chips", type=_holdout_chips, default=list(DEFAULT_HOLDOUT_CHIPS),
                   help="with --calibrate: comma-separated chip counts whose Table 1 columns take "
                        "no part in the fit and measure its out-of-sample error ('none': fit on all 30)")
    g.add_argument("--no-cv", action="store_true",
                   help="with --calibrate: skip the leave-one-column-out cross-validation")
    g.add_argument("--quorum", type=int, default=1, help="K: learners needed for the global model to advance")
    g.add_argument("--chips", type=_int_list, default=None,
                   help="comma-separated chip counts for the extension table (default 150k..10M)")
    g.add_argument("--learners", type=_int_list, default=None,
                   help="comma-separated learner counts M for the extension (default 2..1024)")
    g.add_argument("--mtbi-years", type=float, default=fm.mtbi_chip_s / YEAR_S, help="per-chip MTBI")
    g.add_argument("--host-chips", type=int, default=fm.host_chips, help="chips lost per interruption (failure domain)")
    g.add_argument("--repair-s", type=float, default=fm.repair_s, help="time until a failed host is usable again")
    g.add_argument("--downscale-s", type=float, default=fm.downscale_s, help="re-shard pause when hosts leave")
    g.add_argument("--upscale-s", type=float, default=fm.upscale_s, help="re-shard pause when hosts rejoin")
    g.add_argument("--readmit-window-s", type=float, default=fm.readmit_window_s,
                   help="max wait of a repaired host for a resize to ride along with")
    g.add_argument("--step-s", type=float, default=fm.step_s,
                   help="training step; interruptions act at its end (0 = continuous time)")
    g.add_argument("--speed-cv", type=float, default=fm.speed_cv, help="per-step chip speed jitter (relative std)")
    g.add_argument("--syncer-mtbi-years", type=float, default=fm.syncer_mtbi_s / YEAR_S,
                   help="MTBI of one central-syncer shard (CPU host)")
    g.add_argument("--syncer-repair-s", type=float, default=fm.syncer_repair_s, help="syncer shard downtime")
    g.set_defaults(func=cmd_goodput)

    b = sub.add_parser(
        "bandwidth", help="step schedule: wall-clock and utilization vs WAN bandwidth",
        description="Steady-state step time of ddp / diloco / streaming / decoupled schedules "
                    "over a WAN. Reproduces Streaming DiLoCo's 95%%-utilization headline and "
                    "the 12B / 4 regions / 2-5 Gbps scenario with the speedup over ddp.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    b.add_argument("--out", default=DEFAULT_OUT, help=OUT_HELP)
    b.add_argument("--quick", action="store_true", help="coarser bandwidth grid for the curves")
    b.add_argument("--seeds", type=int, default=1, help="unused (the model is deterministic); accepted for symmetry")
    b.add_argument("--latency-ms", type=float, default=35.0, help="one-way WAN latency of the 12B scenario")
    b.add_argument("--scenario-gbps", type=_float_list, default=[2.0, 3.0, 4.0, 5.0],
                   help="comma-separated WAN bandwidths of the 12B scenario")
    b.add_argument("--scenario-step-s", type=float, default=None,
                   help="compute time of one 12B step (default: interpolated from the inferred 10B/100B ones)")
    b.set_defaults(func=cmd_bandwidth)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

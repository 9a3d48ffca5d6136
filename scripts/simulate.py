#!/usr/bin/env python3
"""Plan a run at internet scale: a goodput simulator and a bandwidth/step-schedule model.

Two subcommands, each prints a table and writes JSON + a PNG plot into ``--out``
(default ``docs/results``):

``goodput``
    Discrete-event simulation of N chips split into M learners under per-chip Poisson
    interruptions. Regimes: ``dp`` (synchronous data-parallel, no elasticity), ``elastic``
    (data-parallel that re-shards around failed hosts), ``decoupled`` (Decoupled DiLoCo:
    M elastic learners that never wait for each other, plus a central syncer that is one
    more failure domain) and ``atoll`` (the same learners, no syncer: every learner is a
    replica of it, the global model advances while at least K learners run). Reports goodput
    (useful chip-time / allocated chip-time) and uptime (fraction of time in which the global
    model advances) with confidence intervals over seeds, reproduces Table 1 of the Decoupled
    DiLoCo paper and extends it to 10M chips and up to 1024 learners.

``bandwidth``
    Wall-clock and compute utilization of one training-step schedule for a model of S
    parameters on M islands joined by links of B Gbps and one-way latency L: ``ddp``
    (gradient all-reduce every step, overlapped with the backward pass), ``diloco`` (whole
    model every H steps, blocking), ``streaming`` (P fragments, overlap of tau steps,
    codec bits; blocks when a fragment is late) and ``decoupled`` (the same fragments, but
    the learner never blocks: a late fragment is merged late, an overloaded link skips
    rounds). Reproduces Streaming DiLoCo's headline and the seed's 12B / 4 regions /
    2-5 Gbps scenario.

Only numpy, matplotlib (Agg, imported lazily for plots) and the standard library are used.
Everything below the CLI is a pure function of its arguments (randomness comes from an
explicit seed), so tests import this file and call the functions directly.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import platform
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from statistics import NormalDist
from typing import Any, Iterable, Sequence

import numpy as np

YEAR_S = 365.0 * 86400.0
DAY_S = 86400.0
WEEK_S = 7.0 * DAY_S

# ----------------------------------------------------------------------------------------
# Paper reference values (Decoupled DiLoCo, arXiv 2604.21428, Table 1: goodput %).
# They are used only to print/plot the comparison and to score the calibration search;
# the simulated numbers never read them.
# ----------------------------------------------------------------------------------------
PAPER_CHIPS: tuple[int, ...] = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
PAPER_TABLE1: dict[str, tuple[int, ...]] = {
    "dp": (72, 57, 38, 27, 18),
    "elastic": (88, 80, 69, 58, 40),
    "decoupled M=2": (94, 88, 80, 70, 54),
    "decoupled M=4": (96, 93, 89, 82, 73),
    "decoupled M=8": (98, 96, 94, 88, 80),
    "decoupled M=16": (99, 98, 96, 93, 86),
}
EXTENDED_CHIPS: tuple[int, ...] = PAPER_CHIPS + (4_800_000, 10_000_000)
EXTENDED_LEARNERS: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

REGIMES = ("dp", "elastic", "decoupled", "atoll")


# ========================================================================================
# Goodput simulation
# ========================================================================================
@dataclass(frozen=True)
class FailureModel:
    """Timing model of interruptions, repairs and resizes.

    Defaults are the values calibrated against Table 1 (see ``calibrate`` and
    docs/simulator.md); the paper states only ``mtbi_chip_s`` (1 year).

    Attributes:
        mtbi_chip_s: mean time between interruptions of one chip (Poisson per chip).
        host_chips: failure domain: an interruption of one chip takes down its whole host.
        repair_s: time until a failed host is usable again (rebooted or replaced by a
            spare). Non-elastic data-parallel is stopped for exactly this long.
        downscale_s: stop-the-world re-shard of a group when it loses hosts.
        upscale_s: stop-the-world re-shard of a group when repaired hosts rejoin.
        readmit_window_s: a repaired host waits at most this long to rejoin, so that its
            upscale can ride along with the next resize instead of costing one of its own.
        step_s: training step. Interruptions are acted on at the end of the step in which
            they occur, all of one step together, and that step's work is kept.
            0 means continuous time (each interruption acts at once).
        speed_cv: per-step, per-chip compute-time jitter (relative standard deviation);
            a synchronous group waits for its slowest chip every step.
        syncer_mtbi_s: mean time between interruptions of one syncer shard (a CPU host;
            the central syncer has one shard per learner).
        syncer_repair_s: downtime of a failed syncer shard.
    """

    mtbi_chip_s: float = YEAR_S
    host_chips: int = 4
    repair_s: float = 84.0
    downscale_s: float = 22.0
    upscale_s: float = 22.0
    readmit_window_s: float = 300.0
    step_s: float = 5.0
    speed_cv: float = 0.002
    syncer_mtbi_s: float = YEAR_S
    syncer_repair_s: float = 84.0

    def validate(self) -> None:
        """Raise ValueError on a physically meaningless setting."""
        if self.mtbi_chip_s <= 0 or self.host_chips < 1:
            raise ValueError("mtbi_chip_s must be > 0 and host_chips >= 1")
        for name in ("repair_s", "downscale_s", "upscale_s", "readmit_window_s", "step_s",
                     "speed_cv", "syncer_repair_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.syncer_mtbi_s <= 0:
            raise ValueError("syncer_mtbi_s must be > 0")


@dataclass(frozen=True)
class GroupRun:
    """Timeline of one synchronous group (the whole job, or one learner).

    ``pause_starts``/``pause_ends`` are the disjoint, sorted intervals in which the group
    does no work (clipped to the horizon). ``useful_chip_s`` is chip-time spent on steps
    that count, after straggler waits and hosts missing from the group.
    """

    chips: float
    pause_starts: np.ndarray
    pause_ends: np.ndarray
    running_s: float
    useful_chip_s: float
    interruptions: int


def expected_max_normal(n: float) -> float:
    """E[max of n iid standard normals] (Blom's approximation; 0 for n <= 1).

    Blom's plotting position is within 1% of the exact value for n >= 10 and is the
    standard closed form; it keeps the model free of numerical integration.
    """
    if n <= 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def straggler_efficiency(chips: float, speed_cv: float) -> float:
    """Fraction of a synchronous group's chip-time that is compute, not waiting.

    Each step every chip needs (1 + cv*Z) of the nominal time and all wait for the
    slowest, so the step takes 1 + cv*E[max Z] and the mean chip is busy 1 of it.
    """
    return 1.0 / (1.0 + speed_cv * expected_max_normal(chips))


def _pause_measure(x: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Total paused time in [0, x) for each x, given disjoint sorted pause intervals."""
    if starts.size == 0:
        return np.zeros_like(x)
    cum = np.concatenate(([0.0], np.cumsum(ends - starts)))
    k = np.searchsorted(starts, x, side="right")  # pauses that started at or before x
    idx = np.maximum(k - 1, 0)
    partial = np.clip(np.minimum(x, ends[idx]) - starts[idx], 0.0, None)
    return np.where(k > 0, cum[idx] + partial, 0.0)


def simulate_group(fail_times: Sequence[float], chips: float, elastic: bool,
                   fm: FailureModel, horizon_s: float) -> GroupRun:
    """Run one synchronous group through a sorted list of host-interruption times.

    Contract:
      * Non-elastic (``elastic=False``): the first interruption stops the group at the
        next step boundary for ``repair_s``; interruptions that occur before the group
        resumes are repaired in the same stop (they cost nothing more).
      * Elastic: an interruption makes the group re-shard without the host
        (``downscale_s``) at the next step boundary; the host is repaired ``repair_s``
        after its interruption and rejoins through an upscale (``upscale_s``) triggered
        ``readmit_window_s`` later unless another resize starts first, in which case it
        rides along. Every event that occurs before a resize ends is folded into it.
      * Step boundaries are counted from the last resume; ``step_s = 0`` acts at once.
    Returns the pause intervals, running time, and useful chip-time (straggler efficiency
    times chip-time of hosts that were present).
    Cost is O(number of interruptions) with bisection on Python lists: no time loop.
    """
    F = list(fail_times)
    nf = len(F)
    R = [f + fm.repair_s for f in F] if elastic else []
    nr = len(R)
    step = fm.step_s
    window = fm.readmit_window_s
    pause_fail = fm.downscale_s if elastic else fm.repair_s
    pause_return = fm.upscale_s
    bis_r = bisect.bisect_right
    ceil = math.ceil
    inf = math.inf
    starts: list[float] = []
    ends: list[float] = []
    t = 0.0
    i = j = 0
    while True:
        if i < nf:
            x = F[i]
            sf = t + step * ceil((x - t) / step) if step > 0 else x
        else:
            sf = inf
        if j < nr:
            x = R[j] + window
            sr = t + step * ceil((x - t) / step) if step > 0 else x
        else:
            sr = inf
        s = sf if sf < sr else sr
        if s >= horizon_s:
            break
        i_s = bis_r(F, s, i)
        end = s + (pause_fail if i_s > i else pause_return)
        i = bis_r(F, end, i_s)
        if nr:
            j = bis_r(R, end, j)
        starts.append(s)
        ends.append(end)
        t = end
        if t >= horizon_s:
            break
    ps = np.minimum(np.asarray(starts, dtype=float), horizon_s)
    pe = np.minimum(np.asarray(ends, dtype=float), horizon_s)
    running = horizon_s - float(np.sum(pe - ps))

    # Chip-time of hosts that are down while the group runs (between an interruption and
    # the step boundary, and for elastic groups until the host is re-admitted).
    lost = 0.0
    if nf:
        f_arr = np.asarray(F, dtype=float)
        back = f_arr + (fm.repair_s if elastic else 0.0)
        # The host is back at the end of the first pause that ends at or after `back`.
        if pe.size:
            k = np.searchsorted(pe, back, side="left")
            readmit = np.where(k < pe.size, pe[np.minimum(k, pe.size - 1)], horizon_s)
        else:
            readmit = np.full(nf, horizon_s)
        readmit = np.minimum(np.maximum(readmit, f_arr), horizon_s)
        down = float(np.sum(readmit - f_arr))
        paused_part = float(np.sum(_pause_measure(readmit, ps, pe) - _pause_measure(f_arr, ps, pe)))
        lost = max(0.0, down - paused_part) * fm.host_chips
    eff = straggler_efficiency(chips, fm.speed_cv)
    useful = eff * max(0.0, chips * running - lost)
    return GroupRun(chips, ps, pe, running, useful, nf)


def fraction_running_at_least(groups: Sequence[GroupRun], quorum: int, horizon_s: float,
                              blockers: Sequence[tuple[np.ndarray, np.ndarray]] = ()) -> float:
    """Fraction of [0, horizon) in which at least ``quorum`` groups run and no blocker is down.

    Vectorized sweep over all pause boundaries. A blocker (e.g. a syncer shard) counts as
    len(groups) paused groups while it is down, which makes the quorum unreachable.
    """
    m = len(groups)
    if quorum < 1 or quorum > m:
        raise ValueError("quorum must be in [1, number of groups]")
    ts = [g.pause_starts for g in groups] + [b[0] for b in blockers]
    te = [g.pause_ends for g in groups] + [b[1] for b in blockers]
    ws = [np.ones(g.pause_starts.size) for g in groups] + [np.full(b[0].size, float(m)) for b in blockers]
    starts = np.concatenate(ts) if ts else np.zeros(0)
    ends = np.concatenate(te) if te else np.zeros(0)
    w = np.concatenate(ws) if ws else np.zeros(0)
    keep = ends > starts
    starts, ends, w = starts[keep], ends[keep], w[keep]
    if starts.size == 0:
        return 1.0
    times = np.concatenate((starts, ends, [horizon_s]))
    delta = np.concatenate((w, -w, [0.0]))
    order = np.argsort(times, kind="stable")
    times, delta = times[order], delta[order]
    paused = np.cumsum(delta)
    seg = np.diff(np.concatenate(([0.0], times)))
    # Segment i runs from times[i-1] to times[i] with the paused count before event i.
    before = np.concatenate(([0.0], paused[:-1]))
    ok = (m - before) >= quorum - 1e-9
    return float(np.sum(seg[ok])) / horizon_s


@dataclass(frozen=True)
class SimResult:
    """Outcome of one simulated run (one seed).

    ``uptime`` follows the regime; for learner regimes ``uptime_no_syncer`` (atoll) and
    ``uptime_with_syncer`` (central syncer) are both computed from the same learners.
    ``resizes`` counts stops of all groups (restarts, downscales, upscales).
    """

    goodput: float
    uptime: float
    uptime_no_syncer: float
    uptime_with_syncer: float
    interruptions: int
    resizes: int


def _interruptions(rng: np.random.Generator, rate_per_s: float, horizon_s: float,
                   groups: int) -> list[list[float]]:
    """Poisson interruption times over [0, horizon), split uniformly over equal groups."""
    k = int(rng.poisson(rate_per_s * horizon_s))
    times = rng.uniform(0.0, horizon_s, k)
    ids = rng.integers(0, groups, k)
    order = np.lexsort((times, ids))
    times, ids = times[order], ids[order]
    cuts = np.searchsorted(ids, np.arange(groups + 1))
    return [times[cuts[g]:cuts[g + 1]].tolist() for g in range(groups)]


def simulate(n_chips: int, regime: str, learners: int = 1, quorum: int = 1,
             fm: FailureModel = FailureModel(), horizon_s: float = WEEK_S,
             seed: int = 0) -> SimResult:
    """Simulate one run of ``n_chips`` chips for ``horizon_s`` seconds.

    Args:
        regime: ``dp`` | ``elastic`` (one group of all chips; ``learners`` must be 1) or
            ``decoupled`` | ``atoll`` (``learners`` equal elastic groups of n_chips/learners).
        quorum: K, learners that must be running for the global model to advance.
    Returns goodput = useful chip-time / (n_chips * horizon) and uptime = fraction of time the
    global model advances (dp/elastic: the job runs; decoupled: >= K learners run and every
    syncer shard is up; atoll: >= K learners run). Learners never wait for the syncer, so its
    outages cost uptime, not goodput; ``decoupled`` and ``atoll`` therefore differ only in
    uptime, and with the same seed they share their learner failures.
    """
    fm.validate()
    if regime not in REGIMES:
        raise ValueError(f"unknown regime {regime!r}; choose from {REGIMES}")
    if regime in ("dp", "elastic"):
        learners = 1
    if learners < 1 or n_chips < learners:
        raise ValueError("need 1 <= learners <= n_chips")
    kind = 0 if regime == "dp" else 1
    rng = np.random.default_rng(np.random.SeedSequence([seed, n_chips, learners, kind]))
    per_group = _interruptions(rng, n_chips / fm.mtbi_chip_s, horizon_s, learners)
    chips = n_chips / learners
    groups = [simulate_group(f, chips, regime != "dp", fm, horizon_s) for f in per_group]
    useful = sum(g.useful_chip_s for g in groups)
    goodput = useful / (n_chips * horizon_s)
    resizes = sum(g.pause_starts.size for g in groups)
    interruptions = sum(g.interruptions for g in groups)
    if regime in ("dp", "elastic"):
        up = groups[0].running_s / horizon_s
        return SimResult(goodput, up, up, up, interruptions, resizes)
    up_atoll = fraction_running_at_least(groups, quorum, horizon_s)
    # The paper's syncer is sharded one shard per learner; a shard that is down stalls its
    # fragments, so any shard down counts as the global model not advancing.
    srng = np.random.default_rng(np.random.SeedSequence([seed, n_chips, learners, 2]))
    syncer_fm = replace(fm, step_s=0.0, repair_s=fm.syncer_repair_s)
    sfail = _interruptions(srng, learners / fm.syncer_mtbi_s, horizon_s, 1)[0]
    syncer = simulate_group(sfail, 1.0, False, syncer_fm, horizon_s)
    up_central = fraction_running_at_least(groups, quorum, horizon_s,
                                           blockers=[(syncer.pause_starts, syncer.pause_ends)])
    up = up_atoll if regime == "atoll" else up_central
    return SimResult(goodput, up, up_atoll, up_central, interruptions, resizes)


# ---------------------------------------------------------------------------- statistics
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086)


def mean_ci95(values: Sequence[float]) -> tuple[float, float]:
    """Mean and half-width of the two-sided 95% Student-t interval (0 for one value)."""
    arr = np.asarray(values, dtype=float)
    mean = float(arr.mean())
    if arr.size < 2:
        return mean, 0.0
    t = _T975[arr.size - 2] if arr.size - 2 < len(_T975) else 1.96
    return mean, float(t * arr.std(ddof=1) / math.sqrt(arr.size))


@dataclass(frozen=True)
class RowSpec:
    """One row of a goodput table: a regime and its number of learners."""

    label: str
    regime: str
    learners: int = 1


def table1_rows() -> list[RowSpec]:
    """The six configurations of the paper's Table 1."""
    rows = [RowSpec("dp", "dp"), RowSpec("elastic", "elastic")]
    rows += [RowSpec(f"decoupled M={m}", "decoupled", m) for m in (2, 4, 8, 16)]
    return rows


def run_table(rows: Sequence[RowSpec], chips: Sequence[int], fm: FailureModel,
              horizon_s: float, seeds: Sequence[int], quorum: int = 1) -> dict[str, Any]:
    """Simulate every (row, chips) cell for every seed.

    Returns ``{label: {str(chips): {goodput_mean, goodput_ci95, uptime_mean, uptime_ci95,
    uptime_no_syncer_mean, uptime_with_syncer_mean, goodput_seeds, ...}}}``, in percent.
    """
    out: dict[str, Any] = {}
    for row in rows:
        cells: dict[str, Any] = {}
        for n in chips:
            if row.learners > n:
                continue
            k = min(quorum, row.learners)
            res = [simulate(n, row.regime, row.learners, k, fm, horizon_s, s) for s in seeds]
            g, gci = mean_ci95([100 * r.goodput for r in res])
            u, uci = mean_ci95([100 * r.uptime for r in res])
            ua, _ = mean_ci95([100 * r.uptime_no_syncer for r in res])
            uc, _ = mean_ci95([100 * r.uptime_with_syncer for r in res])
            cells[str(n)] = {
                "goodput_mean": round(g, 3), "goodput_ci95": round(gci, 3),
                "uptime_mean": round(u, 4), "uptime_ci95": round(uci, 4),
                "uptime_no_syncer_mean": round(ua, 4),
                "uptime_with_syncer_mean": round(uc, 4),
                "goodput_seeds": [round(100 * r.goodput, 3) for r in res],
                "interruptions_per_seed": round(float(np.mean([r.interruptions for r in res])), 1),
            }
        out[row.label] = cells
    return out


def table1_errors(table: dict[str, Any]) -> dict[str, list[float]]:
    """Simulated minus paper goodput (points) for every Table 1 cell present in ``table``."""
    errs: dict[str, list[float]] = {}
    for label, paper in PAPER_TABLE1.items():
        row = table.get(label, {})
        errs[label] = [round(row[str(n)]["goodput_mean"] - p, 3)
                       for n, p in zip(PAPER_CHIPS, paper) if str(n) in row]
    return errs


def calibrate(grid: dict[str, Sequence[float]], horizon_s: float = 2 * DAY_S,
              seeds: Sequence[int] = (0,), base: FailureModel = FailureModel(),
              dp_prefilter: float = 2.6, top: int = 15) -> list[dict[str, Any]]:
    """Grid search of the unstated timing parameters against Table 1.

    ``grid`` maps FailureModel field names to candidate values; the pseudo-field
    ``resize_s`` sets downscale_s and upscale_s together. The DP row depends only
    on (step_s, speed_cv, repair_s), so it is scored first and combinations whose DP row is
    already off by more than ``dp_prefilter`` points skip the other five rows. The score is
    the largest absolute cell error (minimax), ties broken by the RMS error.
    Returns the ``top`` best entries, best first.
    """
    dp_keys = [k for k in ("step_s", "speed_cv", "repair_s") if k in grid]
    other_keys = [k for k in grid if k not in dp_keys]
    rows = table1_rows()

    def product(keys: list[str]) -> Iterable[dict[str, float]]:
        if not keys:
            yield {}
            return
        head, rest = keys[0], keys[1:]
        for v in grid[head]:
            for tail in product(rest):
                yield {head: v, **tail}

    results: list[dict[str, Any]] = []
    for dp_part in product(dp_keys):
        fm_dp = replace(base, **dp_part)
        dp_tab = run_table(rows[:1], PAPER_CHIPS, fm_dp, horizon_s, seeds)
        dp_err = table1_errors(dp_tab)["dp"]
        if max(abs(e) for e in dp_err) > dp_prefilter:
            continue
        for rest in product(other_keys):
            fields = dict(rest)
            if "resize_s" in fields:
                fields["downscale_s"] = fields["upscale_s"] = fields.pop("resize_s")
            fm = replace(fm_dp, **fields)
            tab = run_table(rows[1:], PAPER_CHIPS, fm, horizon_s, seeds)
            tab.update(dp_tab)
            errs = [e for row in table1_errors(tab).values() for e in row]
            results.append({
                "params": {**dp_part, **rest},
                "max_abs_err": round(max(abs(e) for e in errs), 3),
                "rms_err": round(math.sqrt(sum(e * e for e in errs) / len(errs)), 3),
            })
    results.sort(key=lambda r: (r["max_abs_err"], r["rms_err"]))
    return results[:top]


DEFAULT_CALIBRATION_GRID: dict[str, list[float]] = {
    "step_s": [4.0, 5.0, 6.0, 7.0],
    "speed_cv": [0.0, 0.001, 0.002],
    "repair_s": [80.0, 84.0, 88.0],
    "resize_s": [18.0, 20.0, 22.0, 24.0],
    "readmit_window_s": [0.0, 100.0, 200.0, 300.0, 400.0],
}
CALIBRATION_HORIZON_S = 3 * DAY_S
CALIBRATION_SEEDS = (0, 1)

# What each mechanism buys: the same search with one mechanism switched off.
ABLATION_GRIDS: dict[str, dict[str, list[float]]] = {
    "continuous time (step_s=0)": {**DEFAULT_CALIBRATION_GRID, "step_s": [0.0],
                                   "repair_s": [70.0, 74.0, 78.0, 82.0, 86.0],
                                   "resize_s": [14.0, 18.0, 22.0, 26.0]},
    "no readmit window (readmit_window_s=0)": {**DEFAULT_CALIBRATION_GRID,
                                               "readmit_window_s": [0.0],
                                               "resize_s": [10.0, 14.0, 18.0, 22.0, 26.0]},
    "no speed variance (speed_cv=0)": {**DEFAULT_CALIBRATION_GRID, "speed_cv": [0.0]},
}


# ========================================================================================
# Bandwidth / step-schedule model
# ========================================================================================
@dataclass(frozen=True)
class Network:
    """M islands joined by links of ``gbps`` (per island, each direction) and one-way latency."""

    islands: int
    gbps: float
    latency_s: float = 0.0


def allreduce_s(payload_bits: float, net: Network) -> float:
    """Seconds for a bandwidth-optimal all-reduce (ring / reduce-scatter + all-gather).

    Each island sends and receives 2(M-1)/M of the payload and the two phases take
    2(M-1) latency-bound hops. One island: 0.
    """
    m = net.islands
    if m <= 1:
        return 0.0
    return 2.0 * (m - 1) / m * payload_bits / (net.gbps * 1e9) + 2.0 * (m - 1) * net.latency_s


@dataclass(frozen=True)
class Method:
    """A synchronization schedule.

    kind: ``ddp`` | ``diloco`` | ``streaming`` | ``decoupled``.
    sync_every: H, inner steps between two syncs of the same fragment (ddp: 1).
    fragments: P (diloco and ddp: 1).
    overlap_steps: tau, inner steps computed while a fragment is in flight.
    bits: bits per value on the wire (ddp: gradient dtype; others: outer-delta codec).
    backward_overlap_frac: ddp only; share of a step (the backward pass) that the
        gradient all-reduce can hide behind.
    """

    kind: str
    sync_every: int = 1
    fragments: int = 1
    overlap_steps: int = 0
    bits: float = 16.0
    backward_overlap_frac: float = 2.0 / 3.0

    def label(self) -> str:
        if self.kind == "ddp":
            return f"ddp ({self.bits:g}-bit grads)"
        if self.kind == "diloco":
            return f"diloco H={self.sync_every} ({self.bits:g}-bit)"
        return (f"{self.kind} H={self.sync_every} P={self.fragments} "
                f"tau={self.overlap_steps} ({self.bits:g}-bit)")


@dataclass(frozen=True)
class StepResult:
    """Steady-state timing of a schedule.

    step_wall_s: mean wall-clock per inner step. utilization: compute time / wall time.
    avg_gbps: mean traffic per island over the run. effective_sync_every: H actually
    achieved per fragment (> H when rounds are skipped). merge_delay_steps: mean steps
    between a fragment's send and its merge.
    """

    step_wall_s: float
    utilization: float
    avg_gbps: float
    effective_sync_every: float
    merge_delay_steps: float


def step_schedule(params: float, compute_s: float, net: Network, method: Method,
                  periods: int = 8, max_in_flight: int = 2) -> StepResult:
    """Time one schedule for a model of ``params`` parameters and ``compute_s`` per step.

    ddp: the all-reduce of this step's gradients overlaps the backward pass, so a step takes
    compute*(1-f) + max(compute*f, allreduce). diloco: a blocking all-reduce of the whole
    model every H steps. streaming/decoupled: fragment p is sent after the steps where
    (step - offset_p) mod H == 0 (offsets spread evenly), over one FIFO link; streaming
    blocks before step t+tau+1 until the fragment sent after step t has arrived;
    decoupled never blocks and skips a round when ``max_in_flight`` fragments are already
    queued or in flight (the paper keeps two in flight), so an overloaded link stretches
    the effective H instead of stalling compute. Streaming and decoupled are simulated for
    ``periods`` periods of H steps; the first period is warm-up.
    """
    if compute_s <= 0 or params <= 0:
        raise ValueError("compute_s and params must be > 0")
    kind = method.kind
    if kind == "ddp":
        t = allreduce_s(params * method.bits, net)
        f = method.backward_overlap_frac
        wall = compute_s * (1 - f) + max(compute_s * f, t)
        bits = 2.0 * (net.islands - 1) / max(net.islands, 1) * params * method.bits
        return StepResult(wall, compute_s / wall, bits / wall / 1e9, 1.0, 0.0)
    if kind == "diloco":
        h = method.sync_every
        t = allreduce_s(params * method.bits, net)
        wall = compute_s + t / h
        bits = 2.0 * (net.islands - 1) / max(net.islands, 1) * params * method.bits / h
        return StepResult(wall, compute_s / wall, bits / wall / 1e9, float(h), 0.0)
    if kind not in ("streaming", "decoupled"):
        raise ValueError(f"unknown method {kind!r}")
    h, p, tau = method.sync_every, method.fragments, method.overlap_steps
    if p < 1 or h < 1 or tau < 0:
        raise ValueError("need H >= 1, P >= 1, tau >= 0")
    t_frag = allreduce_s(params / p * method.bits, net)
    frag_bits = 2.0 * (net.islands - 1) / max(net.islands, 1) * params / p * method.bits
    offsets = [int(round(q * h / p)) % h for q in range(p)]
    due_at: dict[int, list[int]] = {}
    for q, off in enumerate(offsets):
        due_at.setdefault(off, []).append(q)
    n_steps = periods * h
    warm = h
    clock = 0.0
    link_free = 0.0
    in_flight: deque[float] = deque()                 # completion times of queued transfers
    pending: deque[tuple[int, float]] = deque()        # (apply before this step, arrival)
    sent = due = 0
    delays: list[float] = []
    sent_bits = 0.0
    t_warm = 0.0
    for step in range(n_steps):
        if step == warm:
            t_warm = clock
        while pending and pending[0][0] <= step:
            _, done = pending.popleft()
            if kind == "streaming":
                clock = max(clock, done)
        clock += compute_s
        for q in due_at.get(step % h, ()):
            while in_flight and in_flight[0] <= clock:
                in_flight.popleft()
            if step >= warm:
                due += 1
            if kind == "decoupled" and len(in_flight) >= max_in_flight:
                continue
            done = max(clock, link_free) + t_frag
            link_free = done
            in_flight.append(done)
            pending.append((step + 1 + tau, done))
            if step >= warm:
                sent += 1
                sent_bits += frag_bits
                delays.append((done - clock) / compute_s)
    span = clock - t_warm
    wall = span / (n_steps - warm)
    eff_h = h * due / sent if sent else math.inf
    return StepResult(wall, compute_s / wall, sent_bits / span / 1e9, eff_h,
                      float(np.mean(delays)) if delays else math.inf)


def required_gbps(target_util: float, params: float, compute_s: float, islands: int,
                  method: Method, latency_s: float = 0.0, lo: float = 1e-3,
                  hi: float = 1e5) -> float:
    """Smallest bandwidth (Gbps) at which ``method`` reaches ``target_util`` utilization.

    For ``decoupled`` (whose utilization is always 1) the target is instead staying on
    schedule: no skipped rounds and every fragment merged within tau steps of its send.
    Bisection in log-space; returns ``inf`` if even ``hi`` is not enough (latency-bound).
    """
    def ok(gbps: float) -> bool:
        r = step_schedule(params, compute_s, Network(islands, gbps, latency_s), method)
        if method.kind == "decoupled":
            return (r.effective_sync_every <= method.sync_every * (1 + 1e-9)
                    and r.merge_delay_steps <= max(method.overlap_steps, 1e-9) + 1e-9)
        return r.utilization >= target_util - 1e-12
    if not ok(hi):
        return math.inf
    if ok(lo):
        return lo
    a, b = math.log(lo), math.log(hi)
    for _ in range(60):
        mid = 0.5 * (a + b)
        if ok(math.exp(mid)):
            b = mid
        else:
            a = mid
    return math.exp(b)


def infer_compute_s(params: float, ddp_gbps_at_target: float, islands: int = 2,
                    target_util: float = 0.95, grad_bits: float = 16.0,
                    latency_s: float = 0.0, backward_overlap_frac: float = 2.0 / 3.0) -> float:
    """Step compute time at which ddp reaches ``target_util`` at exactly the given bandwidth.

    Solves compute/(compute*(1-f) + allreduce) = target for compute (the overlapped regime,
    where the all-reduce is longer than the backward pass).
    """
    t = allreduce_s(params * grad_bits, Network(islands, ddp_gbps_at_target, latency_s))
    f = backward_overlap_frac
    return t / (1.0 / target_util - (1.0 - f))


# Streaming DiLoCo, Figure 4 (as reported): bandwidth data-parallel needs for 95% compute
# utilization, and the range in which Streaming DiLoCo reaches it.
STREAMING_HEADLINE = {
    "params": [1e9, 10e9, 100e9],
    "ddp_gbps_for_95": [100.0, 200.0, 300.0],
    "streaming_gbps_for_95_range": [1.0, 5.0],
    # Assumed layer counts (not stated): fragments are 3 layers each, as in the paper.
    "layers": [24, 48, 96],
}


def bandwidth_study(quick: bool = False, latency_ms: float = 35.0,
                    scenario_gbps: Sequence[float] = (2.0, 3.0, 4.0, 5.0),
                    scenario_compute_s: float | None = None) -> dict[str, Any]:
    """Reproduce Streaming DiLoCo's headline and the 12B / 4-region scenario.

    Step times are not stated by the paper: for each model size we assume the step time at
    which ddp reaches 95% utilization at exactly the paper's ddp bandwidth (2 islands,
    bf16 gradients hidden behind the backward pass, zero latency), then ask what every
    other schedule needs at that same step time. The 12B step time is interpolated
    log-log between the inferred 10B and 100B values unless ``scenario_compute_s`` is given.
    """
    hl = STREAMING_HEADLINE
    headline: list[dict[str, Any]] = []
    curves: dict[str, Any] = {}
    grid = np.logspace(-1, 3, 25 if quick else 61)
    for params, ddp_bw, layers in zip(hl["params"], hl["ddp_gbps_for_95"], hl["layers"]):
        comp = infer_compute_s(params, ddp_bw)
        frags = max(1, layers // 3)
        methods = {
            "ddp": Method("ddp", bits=16),
            "diloco": Method("diloco", sync_every=100, bits=16),
            "streaming": Method("streaming", sync_every=100, fragments=frags, overlap_steps=0, bits=16),
            "streaming+overlap+fp4": Method("streaming", sync_every=100, fragments=frags,
                                            overlap_steps=1, bits=4),
        }
        need = {k: required_gbps(0.95, params, comp, 2, m) for k, m in methods.items()}
        headline.append({
            "params": params, "assumed_step_compute_s": round(comp, 4), "fragments": frags,
            "gbps_for_95pct": {k: round(v, 3) for k, v in need.items()},
            "ratio_ddp_over_streaming_fp4": round(need["ddp"] / need["streaming+overlap+fp4"], 1),
        })
        curves[f"{params:.0e}"] = {
            k: [round(step_schedule(params, comp, Network(2, float(b)), m).utilization, 5)
                for b in grid] for k, m in methods.items()}
    # Seed scenario: 12B model, 4 US regions, 2-5 Gbps WAN, P = H = 24, tau = 2, int4.
    c10 = headline[1]["assumed_step_compute_s"]
    c100 = headline[2]["assumed_step_compute_s"]
    comp12 = scenario_compute_s or c10 * (12e9 / 10e9) ** (math.log(c100 / c10) / math.log(10.0))
    sc_methods = {
        "ddp": Method("ddp", bits=16),
        "diloco": Method("diloco", sync_every=24, bits=16),
        "streaming": Method("streaming", sync_every=24, fragments=24, overlap_steps=2, bits=4),
        "decoupled": Method("decoupled", sync_every=24, fragments=24, overlap_steps=2, bits=4),
    }
    lat = latency_ms / 1000.0
    scenario_rows = []
    for bw in scenario_gbps:
        net = Network(4, float(bw), lat)
        res = {k: step_schedule(12e9, comp12, net, m) for k, m in sc_methods.items()}
        ddp_wall = res["ddp"].step_wall_s
        scenario_rows.append({
            "gbps": bw,
            **{k: {"step_wall_s": round(r.step_wall_s, 4), "utilization": round(r.utilization, 5),
                   "speedup_over_ddp": round(ddp_wall / r.step_wall_s, 2),
                   "avg_gbps": round(r.avg_gbps, 4),
                   "effective_sync_every": round(r.effective_sync_every, 2),
                   "merge_delay_steps": round(r.merge_delay_steps, 3)}
               for k, r in res.items()}})
    sens_compute = [0.5, 1.0, 2.0, 5.0, 10.0, 30.0]
    sensitivity = []
    for c in sens_compute:
        row: dict[str, Any] = {"step_compute_s": c}
        for bw in (min(scenario_gbps), max(scenario_gbps)):
            net = Network(4, float(bw), lat)
            d = step_schedule(12e9, c, net, sc_methods["ddp"]).step_wall_s
            x = step_schedule(12e9, c, net, sc_methods["decoupled"])
            row[f"decoupled_speedup_at_{bw:g}gbps"] = round(d / x.step_wall_s, 2)
            row[f"decoupled_effective_H_at_{bw:g}gbps"] = round(x.effective_sync_every, 1)
        sensitivity.append(row)
    return {
        "headline": headline,
        "headline_reference": hl,
        "utilization_curves": {"gbps": [round(float(b), 5) for b in grid], "models": curves},
        "scenario": {
            "params": 12e9, "islands": 4, "latency_ms": latency_ms,
            "assumed_step_compute_s": round(comp12, 4),
            "methods": {k: m.label() for k, m in sc_methods.items()},
            "rows": scenario_rows,
            "speedup_vs_step_time": sensitivity,
        },
    }


# ========================================================================================
# Output: tables, JSON, plots
# ========================================================================================
def _fmt_chips(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"


def _env() -> dict[str, Any]:
    return {"python": platform.python_version(), "numpy": np.__version__,
            "machine": platform.machine(), "cpus": os.cpu_count()}


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=False)
        fh.write("\n")


def _pyplot() -> Any:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _chip_ticks(ax: Any, chips: Sequence[int]) -> None:
    ax.set_xscale("log")
    ax.set_xticks(list(chips))
    ax.set_xticklabels([_fmt_chips(n) for n in chips], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("chips")


def plot_goodput(result: dict[str, Any], path: str) -> None:
    """Three panels: Table 1 vs paper, the extension to 10M chips, uptime atoll vs syncer."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.2))
    t1 = result["table1"]["simulated"]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ax = axes[0]
    for i, (label, paper) in enumerate(PAPER_TABLE1.items()):
        row = t1[label]
        xs = [n for n in PAPER_CHIPS if str(n) in row]
        ys = [row[str(n)]["goodput_mean"] for n in xs]
        es = [row[str(n)]["goodput_ci95"] for n in xs]
        c = colors[i % len(colors)]
        ax.errorbar(xs, ys, yerr=es, color=c, marker="o", ms=4, capsize=2, label=f"{label} (sim)")
        ax.plot(PAPER_CHIPS, paper, color=c, ls="none", marker="x", ms=8)
    _chip_ticks(ax, PAPER_CHIPS)
    ax.set_ylabel("goodput %")
    ax.set_title("Table 1 reproduced (lines, 95% CI) vs paper (x)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)

    ext = result["extension"]["simulated"]
    ax = axes[1]
    cmap = plt.get_cmap("viridis")
    labels = list(ext)
    for i, label in enumerate(labels):
        row = ext[label]
        xs = [int(n) for n in row]
        ys = [row[str(n)]["goodput_mean"] for n in xs]
        if label in ("dp", "elastic"):
            ax.plot(xs, ys, color="k", ls="--" if label == "dp" else ":", marker=".", label=label)
        else:
            ax.plot(xs, ys, color=cmap(i / max(len(labels) - 1, 1)), marker=".", label=label)
    _chip_ticks(ax, [int(n) for n in result["extension"]["chips"]])
    ax.set_ylabel("goodput %")
    ax.set_title("Extension: up to 10M chips, M up to 1024")
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)

    ax = axes[2]
    floor = 1e-4   # log axis: a downtime of 0 is drawn at the floor
    for i, label in enumerate(labels):
        if not label.startswith("atoll"):
            continue
        m = int(label.split("=")[1])
        if m not in (2, 4, 8, 64, 1024):
            continue
        row = ext[label]
        xs = [int(n) for n in row]
        c = cmap(i / max(len(labels) - 1, 1))
        ax.plot(xs, [max(100 - row[str(n)]["uptime_no_syncer_mean"], floor) for n in xs],
                color=c, marker=".", label=f"atoll M={m}")
        ax.plot(xs, [max(100 - row[str(n)]["uptime_with_syncer_mean"], floor) for n in xs],
                color=c, ls=":", marker="x", ms=4, label=f"central syncer M={m}")
    for label in ("dp", "elastic"):
        row = ext[label]
        xs = [int(n) for n in row]
        ax.plot(xs, [max(100 - row[str(n)]["uptime_mean"], floor) for n in xs], color="k",
                ls="--" if label == "dp" else ":", label=label)
    _chip_ticks(ax, [int(n) for n in result["extension"]["chips"]])
    ax.set_yscale("log")
    ax.set_ylabel("global-model downtime % (100 - uptime)")
    ax.set_title(f"Downtime: atoll vs central syncer, quorum K={result['quorum']}")
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bandwidth(result: dict[str, Any], path: str) -> None:
    """Two panels: utilization vs bandwidth (Streaming DiLoCo Fig. 4 style), 12B speedups."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.2))
    ax = axes[0]
    curves = result["utilization_curves"]
    gbps = curves["gbps"]
    styles = ["-", "--", ":"]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for si, (model, by_method) in enumerate(curves["models"].items()):
        for ci, (meth, ys) in enumerate(by_method.items()):
            # diloco and blocking streaming need the same total bits, so their curves coincide;
            # diloco is drawn wide and pale underneath.
            wide = meth == "diloco"
            ax.plot(gbps, [100 * y for y in ys], ls=styles[si % 3], color=colors[ci % len(colors)],
                    lw=5 if wide else 1.5, alpha=0.35 if wide else 1.0,
                    label=f"{meth}, {float(model) / 1e9:g}B")
    ax.axhline(95, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("bandwidth between 2 islands (Gbps)")
    ax.set_ylabel("compute utilization %")
    ax.set_title("Utilization vs bandwidth, 2 islands (step times inferred, see JSON)")
    ax.legend(fontsize=6, ncol=3, loc="lower right")
    ax.grid(alpha=0.3)

    ax = axes[1]
    sc = result["scenario"]
    bws = np.linspace(1.0, 10.0, 37)
    comp = sc["assumed_step_compute_s"]
    meths = {"diloco": Method("diloco", sync_every=24, bits=16),
             "streaming": Method("streaming", sync_every=24, fragments=24, overlap_steps=2, bits=4),
             "decoupled": Method("decoupled", sync_every=24, fragments=24, overlap_steps=2, bits=4)}
    lat = sc["latency_ms"] / 1000.0
    for ci, (k, m) in enumerate(meths.items()):
        ys = []
        stretched = []
        for b in bws:
            net = Network(4, float(b), lat)
            d = step_schedule(12e9, comp, net, Method("ddp", bits=16)).step_wall_s
            r = step_schedule(12e9, comp, net, m)
            ys.append(d / r.step_wall_s)
            stretched.append(r.effective_sync_every > m.sync_every * 1.001)
        ax.plot(bws, ys, color=colors[(ci + 1) % len(colors)], label=m.label())
        if k == "decoupled" and any(stretched):
            xs = [b for b, f in zip(bws, stretched) if f]
            yv = [y for y, f in zip(ys, stretched) if f]
            ax.plot(xs, yv, color=colors[(ci + 1) % len(colors)], lw=6, alpha=0.25,
                    label="decoupled: link too slow for H=24, rounds skipped (H grows)")
    ax.axvspan(2, 5, color="grey", alpha=0.15, label="seed scenario 2-5 Gbps")
    ax.axhline(20, color="k", lw=0.8, ls="--", label="paper: >20x")
    ax.set_yscale("log")
    ax.set_xlabel("WAN bandwidth per region (Gbps)")
    ax.set_ylabel("speedup over ddp (wall-clock per step)")
    ax.set_title(f"12B, 4 regions, {sc['latency_ms']:g} ms, step compute {comp:.2f} s (assumed)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _print_table1(table: dict[str, Any]) -> None:
    errs = table1_errors(table)
    head = "config".ljust(16) + "".join(f"{_fmt_chips(n):>22}" for n in PAPER_CHIPS)
    print("Table 1 goodput %: simulated ±95% CI [paper] (difference)")
    print(head)
    for label, paper in PAPER_TABLE1.items():
        row = table[label]
        cells = []
        for n, p, e in zip(PAPER_CHIPS, paper, errs[label]):
            c = row[str(n)]
            cells.append(f"{c['goodput_mean']:5.1f}±{c['goodput_ci95']:.1f} [{p}] ({e:+.1f})")
        print(label.ljust(16) + "".join(f"{x:>22}" for x in cells))
    flat = [abs(e) for row in errs.values() for e in row]
    print(f"max |difference| = {max(flat):.2f} points; RMS = {math.sqrt(sum(e * e for e in flat) / len(flat)):.2f}")


def _print_extension(table: dict[str, Any], chips: Sequence[int]) -> None:
    print("Extension: goodput % / uptime % (atoll rows: uptime without | with a central syncer)")
    print("config".ljust(16) + "".join(f"{_fmt_chips(n):>18}" for n in chips))
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
    result: dict[str, Any] = {"command": " ".join(sys.argv), "env": _env()}
    calibration = None
    if args.calibrate:
        t0 = time.perf_counter()
        calibration = calibrate(DEFAULT_CALIBRATION_GRID, horizon_s=CALIBRATION_HORIZON_S,
                                seeds=CALIBRATION_SEEDS, base=fm)
        print(f"calibration search ({time.perf_counter() - t0:.0f} s), best first:")
        for c in calibration[:10]:
            print(f"  max|err|={c['max_abs_err']:.2f} rms={c['rms_err']:.2f} {c['params']}")
        best = dict(calibration[0]["params"])
        if "resize_s" in best:
            best["downscale_s"] = best["upscale_s"] = best.pop("resize_s")
        fm = replace(fm, **best)
        ablation = {}
        for name, grid in ABLATION_GRIDS.items():
            best_abl = calibrate(grid, CALIBRATION_HORIZON_S, CALIBRATION_SEEDS, base=fm,
                                 dp_prefilter=math.inf, top=1)[0]
            ablation[name] = best_abl
            print(f"  ablation {name}: best max|err|={best_abl['max_abs_err']:.2f} {best_abl['params']}")
        result["calibration"] = {"grid": DEFAULT_CALIBRATION_GRID, "ablation": ablation,
                                 "horizon_s": CALIBRATION_HORIZON_S,
                                 "seeds": list(CALIBRATION_SEEDS), "score": "max |sim - paper| over the 30 cells, "
                                 "ties by RMS", "top": calibration}
    result.update({"failure_model": asdict(fm), "horizon_s": horizon, "seeds": seeds,
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
    _print_table1(t1)
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
    _write_json(jpath, result)
    plot_goodput(result, ppath)
    print(f"wrote {jpath} and {ppath}")
    return 0


def cmd_bandwidth(args: argparse.Namespace) -> int:
    if args.latency_ms < 0 or any(b <= 0 for b in args.scenario_gbps):
        print("error: latency must be >= 0 and bandwidths > 0", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    res = bandwidth_study(args.quick, args.latency_ms, args.scenario_gbps, args.scenario_step_s)
    res = {"command": " ".join(sys.argv), "env": _env(), **res}
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
    _write_json(jpath, res)
    plot_bandwidth(res, ppath)
    print(f"wrote {jpath} and {ppath}")
    return 0


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
                    "dp, Decoupled DiLoCo (central syncer) and atoll (no syncer). Reproduces "
                    "Table 1, then extends it to 10M chips and up to 1024 learners. Defaults "
                    "are the calibrated values (docs/simulator.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g.add_argument("--out", default="docs/results", help="output folder for JSON and PNG")
    g.add_argument("--seeds", type=int, default=3, help="seeds per cell (CI over seeds)")
    g.add_argument("--horizon-days", type=float, default=7.0, help="simulated time per run")
    g.add_argument("--quick", action="store_true", help="1 seed, 1 simulated day, fewer learner counts")
    g.add_argument("--calibrate", action="store_true",
                   help="first run the grid search of unstated parameters against Table 1, "
                        "and the same search with each mechanism switched off (~15 min on "
                        "one core), and use its best point")
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
    b.add_argument("--out", default="docs/results", help="output folder for JSON and PNG")
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

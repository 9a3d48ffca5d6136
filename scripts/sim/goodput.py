"""Goodput simulator: N chips in M synchronous learners under per-chip Poisson interruptions.

Regimes: ``dp`` (synchronous data-parallel, no elasticity), ``elastic`` (data-parallel that
re-shards around failed hosts), ``decoupled`` (Decoupled DiLoCo: M elastic learners that
never wait for each other, plus a central syncer that is one more failure domain) and
``atoll`` (the same learners, no syncer: every learner is a replica of it, the global model
advances while at least K learners run). ``simulate`` returns goodput (useful chip-time /
allocated chip-time) and uptime (fraction of time in which the global model advances) for
one seed; ``run_table`` aggregates seeds into means with 95% confidence intervals;
``table1_rows``/``table1_errors`` compare against the Decoupled DiLoCo paper's Table 1,
``calibrate`` fits the timing parameters the paper does not state to some of its cells and
reports the error on the cells held out, and ``cross_validate`` repeats that per fold.

Every function is pure: randomness comes from an explicit seed, and nothing is printed or
written.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace
from statistics import NormalDist
from typing import Any, Iterable, Sequence

import numpy as np

from .paper import PAPER_CHIPS, PAPER_TABLE1

YEAR_S = 365.0 * 86400.0
DAY_S = 86400.0
WEEK_S = 7.0 * DAY_S

# The extension study: Table 1 carried on to 10M chips and up to 1024 learners.
EXTENDED_CHIPS: tuple[int, ...] = PAPER_CHIPS + (4_800_000, 10_000_000)
EXTENDED_LEARNERS: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

REGIMES = ("dp", "elastic", "decoupled", "atoll")


@dataclass(frozen=True)
class FailureModel:
    """Timing model of interruptions, repairs and resizes.

    The paper states only ``mtbi_chip_s`` (1 year). The five timings ``step_s``,
    ``speed_cv``, ``repair_s``, ``downscale_s`` = ``upscale_s`` and ``readmit_window_s``
    default to the winner of ``calibrate`` fitted to Table 1's 150k, 600k and 1.2M columns,
    with the 300k and 2.4M columns held out (``DEFAULT_HOLDOUT_CHIPS``; see
    docs/simulator.md); the other fields are assumed, not fitted.

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
    readmit_window_s: float = 200.0
    step_s: float = 5.0
    speed_cv: float = 0.001
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


def fmt_chips(n: int) -> str:
    """Short label of a chip count (150k, 2.4M) for table headers and plot ticks."""
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"


def with_params(base: FailureModel, params: dict[str, float]) -> FailureModel:
    """``base`` with the fields of one calibration grid point set.

    The pseudo-field ``resize_s`` sets downscale_s and upscale_s together.
    """
    fields = dict(params)
    if "resize_s" in fields:
        fields["downscale_s"] = fields["upscale_s"] = fields.pop("resize_s")
    return replace(base, **fields)


Cell = tuple[str, int]


def table1_cells(chips: Iterable[int] = PAPER_CHIPS) -> frozenset[Cell]:
    """The Table 1 cells ``(row label, chips)`` of the given chip counts (whole columns)."""
    cols = set(chips)
    unknown = cols - set(PAPER_CHIPS)
    if unknown:
        raise ValueError(f"not a Table 1 chip count: {sorted(unknown)}; choose from {PAPER_CHIPS}")
    return frozenset((label, n) for label in PAPER_TABLE1 for n in PAPER_CHIPS if n in cols)


def cell_errors(table: dict[str, Any], cells: Iterable[Cell],
                paper: dict[str, Sequence[float]] = PAPER_TABLE1) -> dict[Cell, float]:
    """Simulated minus paper goodput (points) of each of ``cells``; every cell must be in ``table``."""
    out: dict[Cell, float] = {}
    for label, n in cells:
        p = paper[label][PAPER_CHIPS.index(n)]
        out[(label, n)] = round(table[label][str(n)]["goodput_mean"] - p, 3)
    return out


def error_summary(errs: dict[Cell, float], per_cell: bool = False) -> dict[str, Any]:
    """Number of cells, largest absolute error and RMS error of a set of cell errors (both
    None if it is empty), and with ``per_cell`` each error as ``{label: {str(chips): err}}``."""
    if not errs:
        return {"n_cells": 0, "max_abs_err": None, "rms_err": None}
    vals = list(errs.values())
    out: dict[str, Any] = {
        "n_cells": len(vals),
        "max_abs_err": round(max(abs(e) for e in vals), 3),
        "rms_err": round(math.sqrt(sum(e * e for e in vals) / len(vals)), 3),
    }
    if per_cell:
        cells: dict[str, dict[str, float]] = {}
        for (label, n), e in sorted(errs.items(), key=lambda kv: (list(PAPER_TABLE1).index(kv[0][0]),
                                                                   kv[0][1])):
            cells.setdefault(label, {})[str(n)] = e
        out["errors"] = cells
    return out


def calibrate(grid: dict[str, Sequence[float]], horizon_s: float = 2 * DAY_S,
              seeds: Sequence[int] = (0,), base: FailureModel = FailureModel(),
              dp_prefilter: float = 2.6, top: int = 15, holdout: Iterable[Cell] = (),
              paper: dict[str, Sequence[float]] = PAPER_TABLE1,
              cache: dict[Any, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Grid search of the unstated timing parameters against the Table 1 cells not held out.

    ``grid`` maps FailureModel field names to candidate values; the pseudo-field
    ``resize_s`` sets downscale_s and upscale_s together. ``holdout`` is a set of
    ``(row label, chips)`` cells (``table1_cells`` gives whole columns) that take no part in
    the search: the score, the DP prefilter and the ranking use only the other ("fitting")
    cells of ``paper``. The held-out cells are still simulated, and each entry reports its
    error on them. The DP row depends only on (step_s, speed_cv, repair_s), so it is
    scored first and combinations whose DP fitting cells are already off by more than
    ``dp_prefilter`` points skip the other five rows. The score is the largest absolute
    fitting-cell error (minimax), ties broken by the RMS error.

    ``cache`` (a dict, shared between calls) keeps simulated rows keyed by the failure
    model, horizon and seeds, so that searches over the same grid with different splits
    simulate each point once. Simulation is deterministic, so it changes no result.

    Returns the ``top`` best entries, best first (none if every point fails the prefilter), each
    ``{"params", "in_sample": {n_cells, max_abs_err, rms_err},
    "out_of_sample": {n_cells, max_abs_err, rms_err, errors: {label: {str(chips): err}}}}``
    (errors in points, simulated minus paper; out_of_sample has no ``errors`` and None
    errors when nothing is held out).
    """
    held = frozenset(holdout)
    all_cells = table1_cells()
    if not held <= all_cells:
        raise ValueError(f"held-out cells not in Table 1: {sorted(held - all_cells)}")
    fit = all_cells - held
    if not fit:
        raise ValueError("every Table 1 cell is held out: nothing to fit on")
    dp_keys = [k for k in ("step_s", "speed_cv", "repair_s") if k in grid]
    other_keys = [k for k in grid if k not in dp_keys]
    rows = table1_rows()
    dp_fit = [c for c in fit if c[0] == rows[0].label]
    memo: dict[Any, dict[str, Any]] = {} if cache is None else cache

    def tables(fm: FailureModel, part: slice) -> dict[str, Any]:
        key = (fm, float(horizon_s), tuple(seeds), part.start, part.stop)
        if key not in memo:
            memo[key] = run_table(rows[part], PAPER_CHIPS, fm, horizon_s, seeds)
        return memo[key]

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
        dp_tab = tables(fm_dp, slice(0, 1))
        dp_err = cell_errors(dp_tab, dp_fit, paper)
        if dp_err and max(abs(e) for e in dp_err.values()) > dp_prefilter:
            continue
        for rest in product(other_keys):
            fm = with_params(fm_dp, rest)
            tab = {**dp_tab, **tables(fm, slice(1, None))}
            results.append({
                "params": {**dp_part, **rest},
                "in_sample": error_summary(cell_errors(tab, fit, paper)),
                "out_of_sample": error_summary(cell_errors(tab, held, paper), per_cell=True),
            })
    results.sort(key=lambda r: (r["in_sample"]["max_abs_err"], r["in_sample"]["rms_err"]))
    return results[:top]


def cross_validate(grid: dict[str, Sequence[float]], folds: Sequence[Iterable[Cell]],
                   horizon_s: float = 2 * DAY_S, seeds: Sequence[int] = (0,),
                   base: FailureModel = FailureModel(), dp_prefilter: float = 2.6,
                   paper: dict[str, Sequence[float]] = PAPER_TABLE1,
                   cache: dict[Any, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Run ``calibrate`` once per fold, holding that fold's cells out, and pool the errors.

    Every cell of the folds is predicted by the winner of the search that did not see it;
    ``pooled`` summarises those predictions (max abs, RMS, per cell). With a shared
    ``cache`` each grid point is simulated once for all folds.
    Returns ``{"folds": [{"holdout": [[label, chips], ...], "winner": entry}], "pooled": ...}``
    (a fold whose every point fails the DP prefilter has winner None and adds no cells).
    """
    memo: dict[Any, dict[str, Any]] = {} if cache is None else cache
    out_folds = []
    pooled: dict[Cell, float] = {}
    for fold in folds:
        held = frozenset(fold)
        found = calibrate(grid, horizon_s, seeds, base, dp_prefilter, 1, held, paper, memo)
        best = found[0] if found else None
        out_folds.append({"holdout": sorted([list(c) for c in held],
                                            key=lambda c: (c[1], list(PAPER_TABLE1).index(c[0]))),
                          "winner": best})
        for label, per in (best["out_of_sample"].get("errors", {}) if best else {}).items():
            for n, e in per.items():
                pooled[(label, int(n))] = e
    return {"folds": out_folds, "pooled": error_summary(pooled, per_cell=True)}


DEFAULT_CALIBRATION_GRID: dict[str, list[float]] = {
    "step_s": [4.0, 5.0, 6.0, 7.0],
    "speed_cv": [0.0, 0.001, 0.002],
    "repair_s": [80.0, 84.0, 88.0],
    "resize_s": [18.0, 20.0, 22.0, 24.0],
    "readmit_window_s": [0.0, 100.0, 200.0, 300.0, 400.0],
}
CALIBRATION_HORIZON_S = 3 * DAY_S
# The split of the calibration: fit on 150k, 600k and 1.2M chips; hold out 300k (inside the
# fitted range) and 2.4M (twice the largest fitted count: extrapolation). See docs/simulator.md.
DEFAULT_HOLDOUT_CHIPS: tuple[int, ...] = (300_000, 2_400_000)
CALIBRATION_SEEDS = (0, 1)
CALIBRATION_DP_PREFILTER = 2.6

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

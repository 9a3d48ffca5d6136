"""Bandwidth / step-schedule model: wall-clock and utilization of WAN synchronization.

For a model of S parameters on M islands joined by links of B Gbps and one-way latency L,
``step_schedule`` times one steady-state schedule: ``ddp`` (gradient all-reduce every step,
overlapped with the backward pass), ``diloco`` (whole model every H steps, blocking),
``streaming`` (P fragments, overlap of tau steps, codec bits; blocks when a fragment is
late) and ``decoupled`` (the same fragments, but the learner never blocks: a late fragment
is merged late, an overloaded link skips rounds). ``required_gbps`` inverts it,
``infer_compute_s`` recovers the step times the paper leaves unstated, and
``bandwidth_study`` reproduces Streaming DiLoCo's headline and the seed's 12B / 4 regions /
2-5 Gbps scenario.

The model is deterministic and every function is pure: nothing is printed or written.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .paper import STREAMING_HEADLINE


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

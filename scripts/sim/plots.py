"""Plots of the goodput and bandwidth results (PNG, matplotlib's Agg backend).

Each function takes the result dict that the CLI writes as JSON and saves one figure to
``path``. matplotlib is imported when the first figure is drawn, not with this module, so
that importing the CLI does not pay for it.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from scripts.results import pyplot, save_figure

from .bandwidth import Method, Network, step_schedule
from .goodput import fmt_chips
from .paper import PAPER_CHIPS, PAPER_TABLE1


def _chip_ticks(ax: Any, chips: Sequence[int]) -> None:
    ax.set_xscale("log")
    ax.set_xticks(list(chips))
    ax.set_xticklabels([fmt_chips(n) for n in chips], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("chips")


def plot_goodput(result: dict[str, Any], path: str) -> None:
    """Three panels: Table 1 vs paper, the extension to 10M chips, uptime atoll vs syncer."""
    plt = pyplot()
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
    summary = result["table1"].get("summary")
    held = summary["held_out_chips"] if summary else []
    for n in held:  # columns that took no part in the fit of the timing parameters
        ax.axvspan(n / 1.15, n * 1.15, color="0.85", alpha=0.6, lw=0)
    _chip_ticks(ax, PAPER_CHIPS)
    ax.set_ylabel("goodput %")
    if summary is None:
        title = "Table 1: simulated (lines, 95% CI) vs paper (x)"
    elif held:
        title = ("Table 1: sim (lines, 95% CI) vs paper (x)\nfitted to "
                 + ", ".join(fmt_chips(n) for n in summary["fit_chips"])
                 + "; shaded columns held out")
    else:
        title = "Table 1: sim (lines, 95% CI) vs paper (x), fitted to all 30 cells"
    ax.set_title(title, fontsize=10)
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
    save_figure(fig, path)


def plot_bandwidth(result: dict[str, Any], path: str) -> None:
    """Two panels: utilization vs bandwidth (Streaming DiLoCo Fig. 4 style), 12B speedups."""
    plt = pyplot()
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
    save_figure(fig, path)

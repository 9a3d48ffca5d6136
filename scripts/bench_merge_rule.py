#!/usr/bin/env python3
"""The merge rule, in one process: what a round landing k steps after its snapshot costs under each rule.

    python -m scripts.bench_merge_rule                      # nano, 4 learners, H=50, k = 0 5 25 45, 3 seeds

For every seed and outer step, the reference is the same swarm with rounds landing at once (k = 0, where every
rule is the same); each rule and delay is reported as its held-out loss against that reference. The swarm is
``inproc_swarm.Swarm``: atoll's own learners, fragments (P = 4), int4 codec with error feedback, RDA and outer step,
no network. Rules: ``overwrite`` (θ_p ← Θ_p,new), ``mix`` (α = 0.5) and ``delta`` (θ_p ← Θ_p,new + θ_p,now −
θ_p,snapshot). Outer steps: the papers' Nesterov (0.7, 0.9), plain averaging (1, 0) and Delayed Nesterov (0.7, 0.9,
the momentum every 2nd or 3rd round). To choose an outer step, every run is also reported against the first outer
step's reference of the same seed (``vs_first_reference``): ``--outers avg nesterov dn2 dn3 --rules delta``.
Delays may reach past a period (k ≥ H): a fragment's round then skips the rounds that fall due while it is in
flight, as a daemon does, and each merge carries k steps; ``--carry-max N`` bounds the delta rule at N steps
(beyond it the work is dropped, as the daemon's carry bound does). The bound is chosen with
``--delays 0 50 100 150 --rules delta overwrite --outers avg``: carrying k steps against dropping them.

Writes docs/results/merge_rule/bench_merge_rule.{json,png} (``--out`` for another stem); ``--replot`` redraws from the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from scripts.inproc_swarm import Config, run_configs
from scripts.results import pyplot, save_figure, write_result
from scripts.stats import fmt, interval

ROOT = Path(__file__).resolve().parent.parent

# (lr, momentum, period): the papers' Nesterov, plain averaging, and Delayed Nesterov (momentum every N-th round of a
# fragment, arXiv 2401.09135) with N = 2 and 3.
OUTERS = {"nesterov": (0.7, 0.9, 1), "avg": (1.0, 0.0, 1), "dn2": (0.7, 0.9, 2), "dn3": (0.7, 0.9, 3)}


def measure(args: argparse.Namespace) -> dict:
    runs = []
    for seed in args.seeds:
        for outer in args.outers:
            lr, mu, period = OUTERS[outer]
            base = Config(kind="decoupled", fragments=args.fragments, outer_lr=lr, outer_momentum=mu,
                          outer_period=period, carry_max=args.carry_max)
            configs = [base]  # k = 0: the reference
            configs += [Config(**(asdict(base) | {"merge": rule, "delay": k})) for k in args.delays if k
                        for rule in args.rules]
            results = run_configs(configs, model=args.model, data=args.data, device_name="cpu",
                                  members=args.members, batch_size=args.batch_size, steps=args.steps,
                                  sync_every=args.sync_every, inner_lr=1e-3, warmup=20, eval_batches=32,
                                  eval_points=1, seed=seed, log=lambda line: print(f"seed {seed} {outer}: {line}",
                                                                                  flush=True))
            ref = results[0].held_out
            for cfg, r in zip(configs, results):
                runs.append({"seed": seed, "outer": outer, "rule": cfg.merge if cfg.delay else "reference",
                             "delay": cfg.delay, "held_out": r.held_out, "vs_reference": r.held_out / ref,
                             "counters": r.counters, "seconds": r.seconds})
    for r in runs:
        first = next(x for x in runs if (x["seed"], x["outer"], x["delay"]) == (r["seed"], args.outers[0], 0))
        r["vs_first_reference"] = r["held_out"] / first["held_out"]
    return {"args": vars(args), "runs": runs, "summary": summarise(runs, args)}


def summarise(runs: list[dict], args: argparse.Namespace) -> list[dict]:
    rows = []
    for outer in args.outers:
        for k in args.delays:
            for rule in args.rules if k else ["reference"]:
                own = [r for r in runs if (r["outer"], r["delay"], r["rule"]) == (outer, k, rule)]
                if own:
                    rows.append({"outer": outer, "delay": k, "rule": rule,
                                 "vs_reference": interval([r["vs_reference"] for r in own]),
                                 "vs_first_reference": interval([r["vs_first_reference"] for r in own])})
    return rows


def plot(doc: dict, path: Path) -> None:
    plt = pyplot()

    outers = doc["args"]["outers"]
    if len(doc["args"]["rules"]) == 1 and all("vs_first_reference" in r for r in doc["summary"]):
        plot_outers(doc, path, plt)
        return
    fig, axes = plt.subplots(1, len(outers), figsize=(6 * len(outers), 4.2), sharey=True, squeeze=False)
    for ax, outer in zip(axes[0], outers):
        for rule in doc["args"]["rules"]:
            rows = [r for r in doc["summary"] if r["outer"] == outer and r["rule"] == rule and r["delay"]]
            ks = [r["delay"] for r in rows]
            means = [r["vs_reference"]["mean"] for r in rows]
            errs = [r["vs_reference"]["ci95"] or 0 for r in rows]
            ax.errorbar(ks, means, yerr=errs, marker="o", capsize=3, label=rule)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(title=f"outer step: {outer}", xlabel=f"steps a round lands after its snapshot (H={doc['args']['sync_every']})",
               ylabel="held-out loss / rounds landing at once")
        ax.legend()
    fig.suptitle(f"merge rules, {doc['args']['model']}, {doc['args']['members']} learners, "
                 f"{len(doc['args']['seeds'])} seeds (mean, 95% interval)")
    fig.tight_layout()
    save_figure(fig, path.with_suffix(".png"))


def plot_outers(doc: dict, path: Path, plt) -> None:
    """One rule, several outer steps: every outer step's held-out loss against the first one's reference."""
    args = doc["args"]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for outer in args["outers"]:
        rows = [r for r in doc["summary"] if r["outer"] == outer]
        ax.errorbar([r["delay"] for r in rows], [r["vs_first_reference"]["mean"] for r in rows],
                    yerr=[r["vs_first_reference"]["ci95"] or 0 for r in rows], marker="o", capsize=3, label=outer)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xlabel=f"steps a round lands after its snapshot (H={args['sync_every']})",
           ylabel=f"held-out loss / {args['outers'][0]}, rounds landing at once",
           title=f"outer steps under the {args['rules'][0]} rule, {args['model']}, {args['steps']} steps, "
                 f"{len(args['seeds'])} seeds")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path.with_suffix(".png"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="nano")
    parser.add_argument("--data", default="builtin")
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sync-every", type=int, default=50)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--delays", type=int, nargs="+", default=[0, 5, 25, 45])
    parser.add_argument("--rules", nargs="+", default=["overwrite", "mix", "delta"], choices=["overwrite", "mix", "delta"])
    parser.add_argument("--outers", nargs="+", default=list(OUTERS), choices=list(OUTERS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--carry-max", type=int, default=0, help="the delta rule's bound in steps (0: none)")
    parser.add_argument("--out", default=str(ROOT / "docs/results/merge_rule/bench_merge_rule"))
    parser.add_argument("--replot", action="store_true", help="redraw the plot from the JSON")
    args = parser.parse_args()
    path = Path(args.out).with_suffix(".json")
    if args.replot:
        plot(json.loads(path.read_text()), path)
        return 0
    if any(k < 0 for k in args.delays) or args.carry_max < 0:
        print("bench_merge_rule: delays and --carry-max must be ≥ 0", file=sys.stderr)
        return 2
    doc = measure(args)
    write_result(path, doc, seeds=args.seeds)
    plot(doc, path)
    for row in doc["summary"]:
        print(f"{row['outer']:9s} k={row['delay']:3d} {row['rule']:9s} vs its own k=0 {fmt(row['vs_reference'], 4)}"
              f"  vs {args.outers[0]} k=0 {fmt(row['vs_first_reference'], 4)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

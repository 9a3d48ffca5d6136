#!/usr/bin/env python3
"""Direction-robust merges: their quality cost in an honest swarm, and what they buy against a direction attack.

    python -m scripts.bench_robust_merge [--seeds 0 1 2] [--steps 150] [--sync-every 15] \
        [--rules trimmed centered] [--attacks none direction] [--name bench_robust_merge]
    python -m scripts.bench_robust_merge --pool A.json B.json --name NAME   # earlier invocations, together

For each seed, the swarm of ``tests/integration/test_byzantine.py`` (four daemons, synchronous ``diloco``, nano,
batch 4, a fixed number of steps, every daemon started together at a bootstrap-only DHT node and held at a
barrier until all train, so that every round holds everyone at the same steps) runs once per configuration: the
current merge (``--robust-merge clip``: the norm clip, then the weighted mean) and each robust rule, with four
honest daemons (``none``: the quality cost) and with the fourth daemon sending the negation of its delta
(``--fault byzantine=direction``: the honest norm, a hostile direction; what the norm clip cannot see), or any
other ``--attacks``: a ``byzantine`` kind of ``node/faults.py``, or ``reducer-scale``/``reducer-silent`` (the fourth
daemon a hostile reducer, ``--fault reducer=K``). The order of the configurations rotates from seed to seed.
The same identities (so the same data shards) serve every run of an invocation. The figure of merit is the
held-out loss of the final global replica after the last round, as the honest daemons report it (mean over a, b,
c; all hold the same replica): results depend on steps and seeds, not on how loaded the machine is.

Reported per run, as ratios per seed (a rule over ``clip`` under the same attack; an attacked run over the honest
``clip`` run), and as the mean with a 95% interval over seeds (``scripts/stats.py``). Writes
``<out>/<name>.json`` and ``.png`` (``--name``, default ``bench_robust_merge``). ``--pool`` summarizes the
runs of several invocations (distinct seeds) together: every ratio is still within one seed of one invocation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from scripts.bars import each
from scripts.results import pyplot, save_figure, write_result
from scripts.stats import fmt, interval
from scripts.swarm import LocalSwarm

HONEST = ("a", "b", "c")
FOURTH = "x"


def common_args(steps: int, sync_every: int, seed: int) -> list[str]:
    return ["--model", "nano", "--batch-size", "4", "--algorithm", "diloco", "--sync-every", str(sync_every),
            "--max-steps", str(steps), "--gather-timeout", "20", "--round-timeout", "8", "--heartbeat", "1",
            "--harness", "step_delay=0.1", "--eval-budget", "1", "--seed", str(seed), "--open"]


def fault_of(attack: str) -> str:
    """The fourth daemon's ``--fault`` for an attack: ``reducer-K`` a hostile reducer (``reducer=K``: its members'
    checks), any other a hostile contribution (``byzantine=K``, ``node/faults.py``)."""
    if attack.startswith("reducer-"):
        return f"reducer={attack.removeprefix('reducer-')}"
    return f"byzantine={attack}"


def run_swarm(root: Path, identities: Path, args: list[str], rule: str, attack: str) -> dict:
    """Four daemons started together; each trains ``--max-steps`` and exits. The final round's held-out loss."""
    from hivemind import DHT

    from atoll.protocols.record_validator import make_validators

    started = time.time()
    bootstrap = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=list(make_validators("atoll")))
    try:
        peers = ["--initial-peers", str(bootstrap.get_visible_maddrs()[0]), "--new-run"]
        names = HONEST + (FOURTH,)
        with LocalSwarm(root, [*args, "--robust-merge", rule]) as swarm:
            together = ["--harness", f"start_together={len(names)}", *peers]
            daemons = [(n, ["--identity", str(identities / f"{n}.key"), *together]) for n in names]
            if attack != "none":
                daemons[-1][1].extend(["--fault", fault_of(attack)])
            with ThreadPoolExecutor(len(daemons)) as pool:
                list(pool.map(lambda d: swarm.start(*d, join=False), daemons))
            codes = {n: d.proc.wait(900) for n, d in swarm.daemons.items()}
            if any(code != 0 for code in codes.values()):
                raise RuntimeError(f"daemons exited with {codes}; logs under {root}")
            finals = {}
            for n in HONEST:
                rounds = swarm.daemons[n].rounds()
                if not rounds:
                    raise RuntimeError(f"{n} merged no round; log under {root / n}")
                finals[n] = rounds[-1]
            hashes = {r["hash"] for r in finals.values()}
            versions = {r["version"] for r in finals.values()}
            summaries = {n: next((m for m in swarm.daemons[n].metrics() if m.get("event") == "summary"), {})
                         for n in HONEST}
            losses = [finals[n]["held_out_loss"] for n in HONEST]
            return {"rule": rule, "attack": attack, "held_out_loss": statistics.fmean(losses),
                    "held_out_loss_by_daemon": dict(zip(HONEST, losses)), "version": max(versions),
                    "versions_agree": len(versions) == 1, "replicas_agree": len(hashes) == 1,
                    "clipped": sum(s.get("clipped", 0) for s in summaries.values()),
                    # What the honest daemons refused, by kind: a hostile reducer's shards (reducer_shard), say.
                    "rejected_by_kind": {k: sum(s.get("rejected_by_kind", {}).get(k, 0) for s in summaries.values())
                                         for k in sorted({k for s in summaries.values()
                                                          for k in s.get("rejected_by_kind", {})})},
                    "seconds": time.time() - started}
    finally:
        bootstrap.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--sync-every", type=int, default=15)
    parser.add_argument("--rules", nargs="+", default=["trimmed", "centered"])
    parser.add_argument("--attacks", nargs="+", default=["none", "direction"],
                        help="none, a byzantine kind (direction, edge, weight, ...), or reducer-scale / reducer-silent")
    parser.add_argument("--out", default="docs/results/robust_merge")
    parser.add_argument("--name", default="bench_robust_merge", help="file name (without .json/.png) under --out")
    parser.add_argument("--pool", nargs="+", metavar="JSON", help="run nothing: summarize the runs of these earlier "
                        "invocations together (same steps, H, rules and attacks; distinct seeds)")
    args = parser.parse_args()
    started = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.pool:
        docs = [json.loads(Path(p).read_text()) for p in args.pool]
        keys = ("steps_per_daemon", "sync_every", "rules", "attacks")
        if any(tuple(d[k] for k in keys) != tuple(docs[0][k] for k in keys) for d in docs):
            raise SystemExit("--pool: the invocations differ in steps, H, rules or attacks")
        seeds = [s for d in docs for s in d["seeds"]]
        if len(set(seeds)) != len(seeds):
            raise SystemExit("--pool: a seed appears in two invocations")
        runs = [r for d in docs for r in d["runs"]]
        meta = {k: docs[0][k] for k in keys}
        meta.update(seeds=seeds, pooled=list(args.pool), minutes=sum(d["minutes"] for d in docs))
    else:
        runs = measure(args, out)
        meta = {"steps_per_daemon": args.steps, "sync_every": args.sync_every, "rules": ["clip", *args.rules],
                "attacks": args.attacks, "seeds": args.seeds, "minutes": (time.time() - started) / 60}
    report(runs, meta, out, args.name)
    return 0


def measure(args: argparse.Namespace, out: Path) -> list[dict]:
    configs = [(rule, attack) for attack in args.attacks for rule in ("clip", *args.rules)]
    runs = []
    partial = out / f"{args.name}.partial.json"  # the runs so far, should the invocation die midway
    with tempfile.TemporaryDirectory(prefix="bench_robust_merge_") as tmp:
        identities = Path(tmp) / "identities"
        identities.mkdir()
        for i, seed in enumerate(each(args.seeds, "seeds")):
            order = configs[i % len(configs):] + configs[:i % len(configs)]
            for rule, attack in order:
                print(f"seed {seed}: merge {rule}, attack {attack}, 4 daemons x {args.steps} steps ...", flush=True)
                root = Path(tmp) / f"{len(runs)}-s{seed}-{rule}-{attack}"  # fresh: a repeated config must not resume
                r = run_swarm(root, identities, common_args(args.steps, args.sync_every, seed), rule, attack)
                r["seed"] = seed
                runs.append(r)
                print(f"    held-out {r['held_out_loss']:.4f}  version {r['version']}  replicas agree "
                      f"{r['replicas_agree']}  clipped {r['clipped']}  refused {r['rejected_by_kind']}  "
                      f"({r['seconds']:.0f} s)", flush=True)
                write_result(partial, {"runs": runs})
    partial.unlink()
    return runs


def report(runs: list[dict], meta: dict, out: Path, name: str) -> None:
    """Ratios per seed (to clip under the same attack, and to the honest clip run), their intervals; JSON, PNG."""
    attacks = meta["attacks"]
    configs = [(rule, attack) for attack in attacks for rule in meta["rules"]]
    by = {(r["seed"], r["rule"], r["attack"]): r for r in runs}
    for r in runs:
        r["ratio_to_clip_same_attack"] = r["held_out_loss"] / by[(r["seed"], "clip", r["attack"])]["held_out_loss"]
        if "none" in attacks:
            r["ratio_to_honest_clip"] = r["held_out_loss"] / by[(r["seed"], "clip", "none")]["held_out_loss"]
    summary = {}
    for rule, attack in configs:
        mine = [r for r in runs if r["rule"] == rule and r["attack"] == attack]
        s = {"held_out_loss": interval([r["held_out_loss"] for r in mine]),
             "ratio_to_clip_same_attack": interval([r["ratio_to_clip_same_attack"] for r in mine])}
        if "none" in attacks:
            s["ratio_to_honest_clip"] = interval([r["ratio_to_honest_clip"] for r in mine])
        summary[f"{rule}/{attack}"] = s
    doc = {"model": "nano",
           "daemons": 4, "algorithm": "diloco", "batch_size": 4, **meta, "summary": summary, "runs": runs}
    write_result(out / f"{name}.json", doc)
    plot(doc, out / f"{name}.png")
    for key, s in summary.items():
        line = (f"{key:22s} held-out {fmt(s['held_out_loss'], 4)}  "
                f"/ clip (same attack) {fmt(s['ratio_to_clip_same_attack'])}")
        if "ratio_to_honest_clip" in s:
            line += f"  / honest clip {fmt(s['ratio_to_honest_clip'])}"
        print(line)


def plot(doc: dict, path: Path) -> None:
    plt = pyplot()

    key = "ratio_to_honest_clip" if "none" in doc["attacks"] else "ratio_to_clip_same_attack"
    labels = list(doc["summary"])
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(labels) + 1.4))
    for i, label in enumerate(labels):
        s = doc["summary"][label][key]
        ax.errorbar([s["mean"]], [i], xerr=[[s["ci95"] or 0], [s["ci95"] or 0]], fmt="o", color="black",
                    capsize=5, label="mean, 95% interval" if i == 0 else None)
        ax.plot(s["values"], [i] * len(s["values"]), "x", color="tab:blue", label="one seed" if i == 0 else None)
    ax.axvline(1.0, color="gray", lw=0.8)
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(-0.7, len(labels) - 0.3)
    ax.set_xlabel("held-out loss / honest swarm with the clip merge, same seed" if key == "ratio_to_honest_clip"
                  else "held-out loss / clip merge, same seed and attack")
    ax.set_title(f"merge rule / attack: 4 daemons, diloco, nano, {doc['steps_per_daemon']} steps, "
                 f"H={doc['sync_every']}, seeds {doc['seeds']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())

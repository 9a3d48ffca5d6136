#!/usr/bin/env python3
"""Parity: one process alone vs three daemons with DiLoCo, same model and the same total token budget.

    python -m scripts.bench_parity [--steps 600] [--sync-every 50] [--model tiny]

(a) trains ``3 × steps`` inner steps in one process (plain AdamW, no outer loop); (b) runs three daemons on
127.0.0.1 with ``--max-steps steps`` each (the same tokens in total). Both are evaluated on the same held-out
batches: (a) its final model, (b) the final global replica Θ from a daemon's last checkpoint. Reports the
held-out loss of each, their ratio, and the bytes each daemon sent per outer round. Writes
docs/results/parity/bench_parity.json and .png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from scripts.bars import each
from scripts.benchkit import BATCH, CURVE_BATCHES, EVAL_BATCHES, make_learner
from scripts.results import pyplot, save_figure, write_result
from scripts.swarm import LocalSwarm

from atoll.models.configs import get_model_config
from atoll.models.fragments import make_fragments
from atoll.node.home.checkpoint import load_checkpoint
from atoll.node.config import RunConfig

def solo(run: RunConfig, steps: int) -> dict:
    torch.set_num_threads(1)
    learner, corpus = make_learner(run, shard=0)
    curve_set = corpus.held_out(CURVE_BATCHES, BATCH)  # the daemons' own evaluation batches
    curve, start = [], time.monotonic()
    for step in each(range(1, steps + 1), "one process: steps"):
        learner.train_step()
        if step % (steps // 10) == 0:
            curve.append({"tokens": learner.tokens, "held_out_loss": learner.evaluate(curve_set)})
    return {"held_out_loss": learner.evaluate(corpus.held_out(EVAL_BATCHES, BATCH)), "tokens": learner.tokens,
            "curve": curve, "seconds": time.monotonic() - start}


def swarm_run(run: RunConfig, steps: int, workdir: Path) -> dict:
    common = ["--model", run.model, "--algorithm", "diloco", "--sync-every", str(run.sync_every),
              "--batch-size", str(BATCH), "--max-steps", str(steps), "--gather-timeout", "20", "--round-timeout",
              "20", "--threads", "1", "--eval-budget", "1"]  # the curve: a held-out evaluation every round
    shutil.rmtree(workdir, ignore_errors=True)  # a previous run's checkpoints would be resumed, not trained from Θ₀
    start = time.monotonic()
    with LocalSwarm(workdir, common) as swarm:
        swarm.start("d0", join=False)
        swarm.start("d1")
        swarm.start("d2")
        for d in swarm.daemons.values():
            d.proc.wait(3600)
        codes = {n: d.proc.returncode for n, d in swarm.daemons.items()}
    seconds = time.monotonic() - start
    per_daemon = {}
    for name, d in swarm.daemons.items():
        rounds = d.rounds()
        sent = [b["bytes_sent"] - a["bytes_sent"] for a, b in zip(rounds, rounds[1:])]
        per_daemon[name] = {
            "exit_code": codes[name], "rounds": len(rounds),
            "bytes_sent_per_round_median": sorted(sent)[len(sent) // 2] if sent else None,
            "final_version": rounds[-1]["version"] if rounds else 0,
            # Only the rounds whose held-out figure was measured then: a round's record repeats the last one
            # when the evaluation's time budget skipped it.
            "curve": [{"tokens": r["tokens"], "held_out_loss": r["held_out_loss"]} for r in rounds
                      if r.get("held_out_loss") is not None and r.get("held_out_step") == r["step"]],
        }
    # Evaluate the global replica Θ of the daemon that reached the highest version.
    best = max(swarm.daemons.values(), key=lambda d: per_daemon[d.name]["final_version"])
    tensors, meta = load_checkpoint(best.workdir)
    learner, corpus = make_learner(run, shard=0)
    for f in make_fragments(learner.params, 1, run.sync_every, learner.model.embed.weight):  # DiLoCo: one fragment
        f.scatter(tensors[f"replica.{f.index}.params"], learner.params)
    tokens = sum(json.loads(sorted(d.workdir.glob("ckpt-*.json"))[-1].read_text())["tokens"]
                 for d in swarm.daemons.values())
    return {"held_out_loss": learner.evaluate(corpus.held_out(EVAL_BATCHES, BATCH)), "version": sum(meta["versions"]),
            "daemons": per_daemon, "seconds": seconds, "tokens": tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="inner steps per daemon (solo: 3x)")
    parser.add_argument("--sync-every", type=int, default=50)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--out", default="docs/results/parity")
    args = parser.parse_args()
    run = RunConfig(model=args.model, sync_every=args.sync_every)
    print(f"(b) three daemons, {args.steps} steps each, H={args.sync_every} ...", flush=True)
    diloco = swarm_run(run, args.steps, Path("runs/bench_parity"))
    print(f"    held-out loss {diloco['held_out_loss']:.4f} in {diloco['seconds']:.0f} s", flush=True)
    print(f"(a) one process, {3 * args.steps} steps ...", flush=True)
    alone = solo(run, 3 * args.steps)
    print(f"    held-out loss {alone['held_out_loss']:.4f} in {alone['seconds']:.0f} s", flush=True)
    result = {
                "model": args.model, "params": get_model_config(args.model).num_params, "sync_every": args.sync_every,
        "steps_per_daemon": args.steps, "batch_size": BATCH, "eval_batches": EVAL_BATCHES,
        "solo": alone, "diloco_3_daemons": diloco,
        "loss_ratio_diloco_over_solo": diloco["held_out_loss"] / alone["held_out_loss"],
        "fp32_model_bytes": 4 * get_model_config(args.model).num_params,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "bench_parity.json", result)
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([c["tokens"] for c in alone["curve"]], [c["held_out_loss"] for c in alone["curve"]], "k-o",
            label="one process (3x steps)")
    for name, d in diloco["daemons"].items():
        ax.plot([3 * c["tokens"] for c in d["curve"]], [c["held_out_loss"] for c in d["curve"]], "o-", alpha=0.7,
                markersize=3, label=f"DiLoCo {name} (x-axis: 3x its tokens)")
    ax.set_xlabel("tokens (swarm total)")
    ax.set_ylabel(f"held-out loss ({CURVE_BATCHES} batches; a point per evaluation)")
    ax.set_title(f"parity: ratio {result['loss_ratio_diloco_over_solo']:.3f}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out / "bench_parity.png")
    print(json.dumps({k: result[k] for k in ("loss_ratio_diloco_over_solo", "fp32_model_bytes")}, indent=1))
    print({n: d["bytes_sent_per_round_median"] for n, d in diloco["daemons"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())

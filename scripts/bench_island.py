#!/usr/bin/env python3
"""What an island of several ranks gives and costs on this machine: tokens/s and the island's own sync time.

    python -m scripts.bench_island [--model tiny] [--steps 160] [--repeats 3] [--out docs/results/island/bench_island]

Each configuration is one ``atoll start`` island alone in a new open run (diloco, H=``--sync-every``: every round
merges the whole model, so every round sends all of θ from rank 0 to the other ranks), trained for ``--steps``
steps on the built-in corpus with the island's batch fixed at ``--island-batch`` sequences:

- ``1x1``: one rank, one torch thread (the daemon as it was);
- ``1x2``: one rank, two torch threads (the same cores as two ranks, used by one process);
- ``2x1``: two ranks of one thread each (``--nproc-per-node 2``, gloo), each rank half the batch;
- ``4x1``: four ranks of one thread (this machine has two cores: oversubscribed; it shows how the island's sync
  grows with its ranks, not a speed-up).

The configurations run in turn within each repetition (rotated from one repetition to the next), so that what
else runs on the machine slows them alike. Reported per configuration: island tokens/s between step
``--warmup`` and the end (from the progress events of metrics.jsonl), and rank 0's time in the island's
collectives that send θ to the other ranks after a merge or compare it (``island_sync_seconds``) per round; the
ratio of each configuration's tokens/s to ``1x1``'s in the same repetition, with a 95% interval over repetitions.
Writes ``--out``.json and .png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.bars import each
from scripts.results import pyplot, save_figure, write_result
from scripts.stats import fmt, interval

ROOT = Path(__file__).resolve().parent.parent

CONFIGS = {"1x1": (1, 1), "1x2": (1, 2), "2x1": (2, 1), "4x1": (4, 1)}


def run_island(model: str, ranks: int, threads: int, island_batch: int, steps: int, sync_every: int,
               warmup: int, workdir: Path) -> dict:
    """Train one island alone; its tokens/s after ``warmup`` steps and its sync seconds per round."""
    if island_batch % ranks:
        raise SystemExit(f"--island-batch {island_batch} does not split over {ranks} ranks")
    cmd = [sys.executable, "-m", "atoll.node.cli", "start", "--open", "--model", model, "--algorithm", "diloco",
           "--sync-every", str(sync_every), "--max-steps", str(steps), "--batch-size", str(island_batch // ranks),
           "--threads", str(threads), "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--checkpoint-dir", str(workdir),
           "--eval-budget", "0.01"]
    if ranks > 1:
        cmd += ["--nproc-per-node", str(ranks), "--max-restarts", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"{ranks}x{threads} failed:\n{out.stderr[-3000:]}")
    events = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    progress = [e for e in events if e.get("event") is None and "step" in e and e["step"] >= warmup]
    first, last = progress[0], progress[-1]
    summary = next(e for e in events if e.get("event") == "summary")
    rounds = [e for e in events if e.get("event") == "round"]
    return {"tokens_per_s": (last["tokens"] - first["tokens"]) / (last["time"] - first["time"]),
            "sync_s_per_round": summary.get("island_sync_seconds", 0.0) / max(1, len(rounds)),
            "rounds": len(rounds), "rank_drift": summary.get("rank_drift", 0), "steps": summary["step"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--sync-every", type=int, default=20)
    ap.add_argument("--island-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "island" / "bench_island"))
    args = ap.parse_args()
    names = args.configs.split(",")
    runs: list[dict] = []
    for repeat in each(range(args.repeats), "repeats"):
        order = names[repeat % len(names):] + names[:repeat % len(names)]
        row = {}
        for name in order:
            ranks, threads = CONFIGS[name]
            with tempfile.TemporaryDirectory(prefix=f"bench-island-{name}-") as tmp:
                row[name] = run_island(args.model, ranks, threads, args.island_batch, args.steps, args.sync_every,
                                       args.warmup, Path(tmp))
            print(f"repeat {repeat} {name}: {row[name]['tokens_per_s']:.0f} tok/s, island sync "
                  f"{row[name]['sync_s_per_round'] * 1e3:.1f} ms/round over {row[name]['rounds']} rounds", flush=True)
        runs.append(row)
    result = {"model": args.model,
              "steps": args.steps, "warmup": args.warmup, "sync_every": args.sync_every,
              "island_batch": args.island_batch, "algorithm": "diloco", "runs": runs, "configs": {}}
    for name in names:
        result["configs"][name] = {
            "tokens_per_s": interval([r[name]["tokens_per_s"] for r in runs]),
            "ratio_to_1x1": interval([r[name]["tokens_per_s"] / r["1x1"]["tokens_per_s"] for r in runs])
            if "1x1" in names else None,
            "sync_ms_per_round": interval([r[name]["sync_s_per_round"] * 1e3 for r in runs]),
        }
        c = result["configs"][name]
        print(f"{name}: {fmt(c['tokens_per_s'], 0)} tok/s" + (f", x{fmt(c['ratio_to_1x1'], 3)} of 1x1"
                                                           if c["ratio_to_1x1"] else "")
              + f", island sync {fmt(c['sync_ms_per_round'], 2)} ms/round")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out.with_suffix(".json"), result)
    plot(result, out.with_suffix(".png"))
    return 0


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    names = list(result["configs"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key, label in ((left, "tokens_per_s", "island tokens/s"), (right, "sync_ms_per_round",
                                                                        "island sync, ms per round")):
        means = [result["configs"][n][key]["mean"] for n in names]
        errs = [result["configs"][n][key]["ci95"] or 0 for n in names]
        ax.bar(names, means, yerr=errs, capsize=4, color="#4c72b0")
        for i, n in enumerate(names):
            ax.scatter([i] * len(result["runs"]), [r[n][key] if key == "tokens_per_s" else r[n]["sync_s_per_round"]
                                                   * 1e3 for r in result["runs"]], color="black", s=8, zorder=3)
        ax.set_ylabel(label)
        ax.set_xlabel("ranks x threads")
    fig.suptitle(f"{result['model']}, island batch {result['island_batch']}, diloco H={result['sync_every']}")
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())

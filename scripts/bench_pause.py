#!/usr/bin/env python3
"""Lending the machine back: seconds from resume to the daemon's first contributed round, against a full restart.

    python -m scripts.bench_pause [--models tiny small] [--repeats 3] [--away 20]

For each model, one swarm of two daemons on 127.0.0.1 (decoupled, int4, a checkpoint dir each). Once both
contribute to shared rounds, the second daemon leaves the run's training for ``--away`` seconds, ``--repeats``
times in each of two ways, alternating which goes first:

- ``pause``: ``atoll pause`` (θ and AdamW's state to host memory, the daemon stays in the run), then
  ``atoll resume``;
- ``restart``: SIGTERM (a clean leave: last checkpoint, announce), then ``atoll start`` again with the same
  arguments (it resumes from its checkpoint and catches up).

Measured from the moment ``atoll resume`` is sent (or the new process is started) to the first round the daemon
then contributes to with the other (its own metrics' time of that round), and, for the pause, the time the resume
itself took (θ back on the device, the catch-up). Reported per model: mean and 95% interval of each, and the ratio
of the means. Writes docs/results/pause/bench_pause.json and .png.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from scripts.bars import each
from scripts.results import pyplot, save_figure, write_result
from scripts.stats import fmt, interval
from scripts.swarm import LocalSwarm, peer_id, wait_for

OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "pause"
SETTINGS = {  # per model: batch and sync period, so that a round of each fragment falls due every few seconds
    "tiny": ["--batch-size", "8", "--sync-every", "40"],
    "small": ["--batch-size", "4", "--sync-every", "20"],
}
COMMON = ["--algorithm", "decoupled", "--compression", "int4", "--heartbeat", "1", "--gather-timeout", "8",
          "--round-timeout", "15"]


def atoll(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "atoll.node.cli", *args], capture_output=True, text=True,
                          timeout=600)


def first_shared_round(d, since: float, timeout: float = 600) -> float:
    """The time of the first round ``d`` contributed to with another daemon after ``since``."""
    me = peer_id(d)
    rounds = wait_for(lambda: [r for r in d.rounds() if r["time"] > since and me in r["contributors"]
                               and len(r["contributors"]) >= 2], timeout, "a shared round")
    return rounds[0]["time"]


def away(swarm: LocalSwarm, how: str, seconds: float, args: list[str]) -> dict:
    d = swarm.daemons["b"]
    if how == "pause":
        out = atoll("pause", "--checkpoint-dir", str(d.workdir))
        assert out.returncode == 0, out.stdout + out.stderr
        time.sleep(seconds)
        began = time.time()
        out = atoll("resume", "--checkpoint-dir", str(d.workdir), "--wait", "0")
        assert out.returncode == 0, out.stdout + out.stderr
        first = first_shared_round(d, began)
        resumed = [m for m in d.metrics() if m.get("event") == "resumed"][-1]
        return {"seconds": first - began, "ready_seconds": resumed["seconds"]}
    assert swarm.stop("b") == 0, d.log()[-2000:]
    time.sleep(seconds)
    began = time.time()
    d = swarm.start("b", args)
    return {"seconds": first_shared_round(d, began) - began}


def run_model(model: str, repeats: int, seconds: float, root: Path) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    swarm = LocalSwarm(root, ["--model", model, *COMMON, *SETTINGS[model]])
    trials: dict[str, list[dict]] = {"pause": [], "restart": []}
    try:
        swarm.start("a", join=False)
        swarm.start("b")
        first_shared_round(swarm.daemons["b"], 0)
        for i in each(range(repeats), f"{model}: repeats"):
            order = ("pause", "restart") if i % 2 == 0 else ("restart", "pause")
            for how in order:
                trials[how].append(away(swarm, how, seconds, []))
                print(f"{model} repeat {i} {how}: {trials[how][-1]}", flush=True)
    finally:
        swarm.stop_all(timeout=60)
    pause = interval([t["seconds"] for t in trials["pause"]])
    restart = interval([t["seconds"] for t in trials["restart"]])
    return {"model": model, "args": [*COMMON, *SETTINGS[model]], "trials": trials, "pause": pause,
            "restart": restart, "ready": interval([t["ready_seconds"] for t in trials["pause"]]),
            "ratio": pause["mean"] / restart["mean"]}


def plot(doc: dict, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    models = [m["model"] for m in doc["models"]]
    for k, (how, colour) in enumerate((("pause", "tab:green"), ("restart", "tab:grey"))):
        xs = [i + (k - 0.5) * 0.35 for i in range(len(models))]
        means = [m[how]["mean"] for m in doc["models"]]
        errs = [m[how]["ci95"] or 0 for m in doc["models"]]
        ax.bar(xs, means, 0.35, yerr=errs, capsize=4, color=colour, label=f"{how} → first shared round")
        for x, m in zip(xs, doc["models"]):
            ax.scatter([x] * len(m[how]["values"]), m[how]["values"], color="black", s=10, zorder=3)
    ax.set_xticks(range(len(models)), models)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("seconds (mean, 95% interval; dots: repeats)")
    ax.set_title(f"Back to contributing after {doc['away']:.0f} s away: resume vs restart")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "small"], choices=sorted(SETTINGS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--away", type=float, default=20.0, help="seconds paused, or stopped, each time")
    ap.add_argument("--workdir", default="/tmp/atoll-bench-pause")
    args = ap.parse_args()
    doc = {"away": args.away,
           "repeats": args.repeats, "models": []}
    for model in args.models:
        result = run_model(model, args.repeats, args.away, Path(args.workdir) / model)
        doc["models"].append(result)
        print(f"{model}: pause {fmt(result['pause'], 1)} s, restart {fmt(result['restart'], 1)} s, ratio "
              f"{result['ratio']:.2f}; resume itself {fmt(result['ready'], 2)} s", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    write_result(OUT / "bench_pause.json", doc)
    plot(doc, OUT / "bench_pause.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

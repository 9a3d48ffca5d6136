#!/usr/bin/env python3
"""Whether a whole swarm stopped together comes back as one: twelve honest DiLoCo daemons train, all stop (SIGTERM,
as for maintenance), and all start again from their checkpoints, the founder first (the others join through it).

    python -m scripts.bench_swarm_restart [--daemons 12] [--before 60] [--after 120] [--stagger 0] [--seeds 0 1 2]
        [--tree DIR] [--label NAME] [--keep DIR] [--out docs/results/swarm_restart/bench_swarm_restart.json]

The swarm is ``test_twelve``'s (``scripts/bench_honest_offences.py``'s settings). Back from its checkpoint with
nobody else training yet, the founder's synchronous rounds close alone at once; the others restore, catch up to it
and register (``--stagger``: that many seconds after the founder, which runs ahead alone meanwhile).

Reported per run, for the ``--after`` seconds after the restart: the rounds that merged every daemon (``full``:
least and mean over the daemons) and when the first came, the founder's rounds alone, the rounds skipped because
members disagreed about the group, and the daemons that ended off the swarm's line (``daemons_apart``: their final
replica neither the one most of them hold, nor behind it nor ahead of it on its line; 0 is one swarm).
``--tree DIR`` runs the daemons from another checkout. ``--keep DIR`` keeps each run's folders (logs,
checkpoints) under DIR; it must not hold that run already (a daemon would resume from what it finds there).
``--rescore`` runs nothing: it recomputes ``daemons_apart`` of the runs in ``--out`` from the folders in ``--keep``.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import statistics
import sys
import time
from pathlib import Path

from scripts.bench_honest_offences import COMMON, run_labelled
from scripts.results import write_result
from scripts.swarm import LocalSwarm, peer_id


def start_all(swarm: LocalSwarm, names: list[str], prefix: list[str] | None, stagger: float = 0.0) -> None:
    """The founder, then (``stagger`` seconds later) the others at once, joining through it."""
    swarm.start(names[0], join=False, prefix=prefix)
    time.sleep(stagger)
    with concurrent.futures.ThreadPoolExecutor(len(names) - 1) as pool:
        list(pool.map(lambda n: swarm.start(n, prefix=prefix), names[1:]))


def disagreements(swarm: LocalSwarm, names: list[str]) -> int:
    """Rounds the daemons skipped because members disagreed about the group, in their logs so far."""
    return sum(swarm.daemons[n].log().count("disagree about the group") for n in names)


def final_replica(workdir: Path) -> tuple[str, set[str]]:
    """The digest of fragment 0 in a daemon's newest checkpoint, and its ancestors' digests."""
    meta = json.loads(sorted(workdir.glob("ckpt-*.json"))[-1].read_text())
    return meta["digests"][0], set(meta["ancestors"][0])


def apart(replicas: list[tuple[str, set[str]]]) -> int:
    """How many of the daemons' final replicas (digest, ancestry) are off the line the most of them ended on: neither
    that replica, nor behind it (in its ancestry), nor ahead of it (it in theirs). Daemons stopped in the middle
    of a round may end a version apart, on the same line."""
    common = collections.Counter(digest for digest, _ in replicas).most_common(1)[0][0]
    line = next(ancestors for digest, ancestors in replicas if digest == common)
    return sum(1 for digest, ancestors in replicas if digest not in line and common not in ancestors)


def run(seed: int, args: argparse.Namespace, root: Path) -> dict:
    names = [f"d{i:02d}" for i in range(args.daemons)]
    prefix = ["env", "-C", args.tree, f"PYTHONPATH={args.tree}"] if args.tree else None
    # The seed moves the data's order and so every daemon's timing: the runs differ as live runs do.
    swarm = LocalSwarm(root, [*COMMON, "--seed", str(seed), "--harness", f"step_delay={args.step_delay}"])
    try:
        start_all(swarm, names, prefix)
        time.sleep(args.before)
        codes = swarm.stop_all(timeout=60)
        before = {n: len(swarm.daemons[n].rounds()) for n in names}
        disagreed_before = disagreements(swarm, names)
        restarted = time.time()
        start_all(swarm, names, prefix, args.stagger)
        time.sleep(args.after)
        after = {n: swarm.daemons[n].rounds()[before[n]:] for n in names}
    finally:
        swarm.stop_all(timeout=60)
    founder = peer_id(swarm.daemons[names[0]])
    full = {n: [r for r in after[n] if len(r["members"]) == len(names)] for n in names}
    firsts = [full[n][0]["time"] - restarted for n in names if full[n]]
    replicas = [final_replica(swarm.daemons[n].workdir) for n in names]
    disagreed = disagreements(swarm, names) - disagreed_before
    return {"seed": seed, "exit_codes_at_stop": sorted(set(codes.values()), key=str),
            "full_rounds_min": min(len(f) for f in full.values()),
            "full_rounds_mean": statistics.mean(len(f) for f in full.values()),
            "first_full_round_s": round(min(firsts), 1) if firsts else None,
            "daemons_without_a_full_round": sum(1 for f in full.values() if not f),
            "founder_rounds_alone": sum(1 for r in after[names[0]] if r["members"] == [founder]),
            "rounds_disagreed": disagreed, "daemons_apart": apart(replicas)}


def _usage(message: str) -> int:
    print(f"bench_swarm_restart: {message}", file=sys.stderr)
    return 2


def rescore(out: Path, keep: Path) -> int:
    """``daemons_apart`` of every run in ``out`` whose folder ``keep`` still holds, from its final checkpoints (the
    runs' first measure, ``lines``, counted daemons stopped mid-round a version apart as a line of their own)."""
    if not out.exists():
        return _usage(f"{out} does not exist")
    doc = json.loads(out.read_text())
    for label, entry in doc["runs"].items():
        for result in entry["runs"]:
            folder = keep / f"{label}-seed{result['seed']}"
            if folder.is_dir():
                result.pop("lines", None)
                result["daemons_apart"] = apart([final_replica(d) for d in sorted(folder.glob("d*")) if d.is_dir()])
    write_result(out, doc)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--daemons", type=int, default=12)
    parser.add_argument("--before", type=float, default=60.0, help="seconds of training before the stop")
    parser.add_argument("--after", type=float, default=120.0, help="seconds measured after the restart")
    parser.add_argument("--stagger", type=float, default=0.0,
                        help="seconds between the founder's restart and the others' (machines come back apart)")
    parser.add_argument("--step-delay", type=float, default=0.03)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tree", default="", help="run the daemons from this checkout")
    parser.add_argument("--label", default="current")
    parser.add_argument("--keep", default="", help="keep each run's folders (logs, checkpoints) under this folder")
    parser.add_argument("--out", default="docs/results/swarm_restart/bench_swarm_restart.json")
    parser.add_argument("--rescore", action="store_true",
                        help="run nothing: recompute daemons_apart of the runs in --out from the folders in --keep")
    args = parser.parse_args()
    if args.rescore:
        return rescore(Path(args.out), Path(args.keep)) if args.keep else _usage("--rescore needs --keep")
    if args.daemons < 2 or args.before <= 0 or args.after <= 0 or args.stagger < 0:
        return _usage("need 2 or more daemons, positive --before and --after, and --stagger of 0 or more")
    return run_labelled(args, run, "bench_swarm_restart")

if __name__ == "__main__":
    sys.exit(main())

"""The daemon benchmarks' shared spine: the learner they evaluate with (a daemon's, on the built-in corpus), a local
swarm run to its end (``run_swarm``), what every daemon's final replica and the swarm's global model score on the
same held-out batches, the summaries the daemons wrote, and DiLoCo in one process (``diloco``, the reference loop
of the outer-step and model benches). The benches import this module, never each other."""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import torch

from scripts.swarm import LocalSwarm

from atoll.models.configs import get_model_config
from atoll.models.data import Corpus, load_corpus
from atoll.models.fragments import copy_into, flatten, make_fragments
from atoll.models.outer import NesterovOuter, pseudo_gradient, weighted_mean
from atoll.node.home.checkpoint import load_checkpoint
from atoll.node.config import RunConfig
from atoll.node.device import resolve_device
from atoll.node.island.learner import Learner

DAEMONS = 4
EVAL_BATCHES = 32  # the final comparison
CURVE_BATCHES = 8  # the curves: the batches a daemon evaluates on (its default --eval-batches, at batch BATCH)
BATCH = 8


def make_learner(run: RunConfig, shard: int) -> tuple[Learner, Corpus]:
    tokens, _ = load_corpus(run.data)
    corpus = Corpus(tokens, get_model_config(run.model).seq_len, run.num_shards)
    return Learner(run, resolve_device("cpu"), corpus, shard, BATCH), corpus



def evaluate_swarm(swarm: LocalSwarm, run: RunConfig) -> list[float]:
    """Held-out loss of each daemon's final global replica (its last checkpoint), on the same batches."""
    learner, corpus = make_learner(run, shard=0)
    held_out = corpus.held_out(EVAL_BATCHES, BATCH)
    fragments = make_fragments(learner.params, run.num_fragments, run.sync_every, learner.model.embed.weight)
    losses = []
    for d in swarm.daemons.values():
        tensors, _ = load_checkpoint(d.workdir)
        for f in fragments:
            f.scatter(tensors[f"replica.{f.index}.params"], learner.params)
        losses.append(learner.evaluate(held_out))
    return losses


def evaluate_global(swarm: LocalSwarm, run: RunConfig) -> float:
    """Held-out loss of the swarm's global model at the end: for every fragment, the heaviest replica any daemon's
    final checkpoint holds (the one a joiner would download, by merged weight), on the same batches as
    ``evaluate_swarm``. A daemon still behind, or on a fork's lighter side, when the run stopped does not count."""
    learner, corpus = make_learner(run, shard=0)
    held_out = corpus.held_out(EVAL_BATCHES, BATCH)
    fragments = make_fragments(learner.params, run.num_fragments, run.sync_every, learner.model.embed.weight)
    saved = [load_checkpoint(d.workdir) for d in swarm.daemons.values()]
    for f in fragments:
        tensors, _ = max(saved, key=lambda tm: (tm[1]["weights"][f.index], tm[1]["versions"][f.index]))
        f.scatter(tensors[f"replica.{f.index}.params"], learner.params)
    return learner.evaluate(held_out)


def summaries(swarm: LocalSwarm) -> list[dict]:
    out = []
    for name, d in swarm.daemons.items():
        found = [m for m in d.metrics() if m.get("event") == "summary"]
        if not found:
            raise RuntimeError(f"daemon {name} wrote no summary (crashed?); see {d.log_path}")
        out.append(found[-1])
    return out


def run_swarm(root: Path, algorithm: str, args: argparse.Namespace, extra: list[str] = ()) -> dict:
    common = ["--model", args.model, "--algorithm", algorithm, "--sync-every", str(args.sync_every),
              "--batch-size", str(BATCH), "--max-steps", str(args.steps), "--gather-timeout", "20",
              "--round-timeout", "20", "--threads", "1", "--quorum", str(DAEMONS if algorithm == "ddp" else 1),
              *extra]
    start = time.monotonic()
    shutil.rmtree(root, ignore_errors=True)  # a fresh run: leftover checkpoints would be resumed
    with LocalSwarm(root, common) as swarm:
        for i in range(DAEMONS):
            swarm.start(f"d{i}", join=i > 0)
        for d in swarm.daemons.values():
            d.proc.wait(7200)
    run = RunConfig(model=args.model, algorithm=algorithm, sync_every=args.sync_every)
    losses = evaluate_swarm(swarm, run)
    s = summaries(swarm)
    tokens = sum(x["tokens"] for x in s)
    sent = sum(x["bytes_sent"] for x in s)
    # Joiners download the whole state once: a fixed cost that a short benchmark does not amortise as a long run
    # does. Reported apart, so that the steady-state traffic per token can be read too.
    join = sum(m.get("bytes_received", 0) for d in swarm.daemons.values() for m in d.metrics()
               if m.get("event") == "joined")
    adopted = [m for d in swarm.daemons.values() for m in d.metrics() if m.get("event") == "adopted"]
    return {"algorithm": algorithm, "held_out_loss_mean": statistics.mean(losses), "held_out_loss_per_daemon": losses,
            "tokens_total": tokens, "bytes_sent_total": sent, "bytes_per_token": sent / tokens,
            "join_bytes": join, "bytes_per_token_after_joining": (sent - join) / tokens,
            "goodput_mean": statistics.mean(x["goodput"] for x in s),
            "blocked_s_mean": statistics.mean(x["blocked_s"] for x in s),
            "rounds_per_daemon": [x["rounds"] for x in s], "rounds_skipped": sum(x["rounds_skipped"] for x in s),
            "forks_healed": sum(x["forks_healed"] for x in s), "tokens_lost": sum(x["tokens_lost"] for x in s),
            "tokens_carried": sum(x.get("tokens_carried", 0) for x in s),
            # Steps from a round's snapshot to its merge, every merged round of every daemon.
            "in_flight_steps": [m["in_flight_steps"] for d in swarm.daemons.values() for m in d.rounds()
                                if m.get("in_flight_steps") is not None],
            "replayed_adoptions": len([m for m in adopted if m.get("replayed")]),
            "full_adoptions": len([m for m in adopted if not m.get("replayed")]),
            "seconds": time.monotonic() - start}


def diloco(ls: list[Learner], steps: int, sync_every: int, lr: float, momentum: float,
           warm: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Train ``ls`` with DiLoCo for ``steps`` inner steps each; returns the final Θ (flat fp32), also loaded into
    every learner. ``warm`` = (H0, S0): rounds every H0 steps during the first S0 steps."""
    theta = flatten(ls[0].params)
    buf = torch.zeros_like(theta)
    outer = NesterovOuter(lr, momentum)
    last = 0
    for step in range(1, steps + 1):
        for learner in ls:
            learner.train_step()
        every = warm[0] if step <= warm[1] else sync_every
        if step - last >= every or step == steps:  # the last round: Θ holds every step taken
            last = step
            deltas = [pseudo_gradient(theta, flatten(learner.params)) for learner in ls]
            outer.step(theta, buf, weighted_mean(deltas, [1.0] * len(ls)))
            for learner in ls:
                copy_into(theta, learner.params)
    return theta

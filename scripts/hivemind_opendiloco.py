#!/usr/bin/env python3
"""One peer of hivemind 1.1.12's own ``hivemind.Optimizer`` set up as OpenDiLoCo would: the peer a user would
pick instead of atoll, on the same model and data (``atoll.models``), for ``scripts/bench_wan.py``.

    python -m scripts.hivemind_opendiloco --host 10.77.0.2 --index 0 --peers 4 --steps 200 --sync-every 20 \
        --out runs/x/p0.json [--initial-peers MADDR ...] [--compression fp16|uint8]

Set-up, as OpenDiLoCo's hivemind path does it: ``use_local_updates=True`` (every peer runs its own AdamW inner
steps; hivemind averages the parameters when the swarm has collectively processed ``target_batch_size``
samples, an "epoch"), ``target_batch_size = H * peers * batch``, so that one epoch is H inner steps per peer as
atoll's ``--sync-every H``; the state averaging is compressed with hivemind's own codec (``Float16Compression`` or
``Uniform8BitQuantization``). No outer optimizer (hivemind's Optimizer has none: the average replaces the
parameters, i.e. outer lr 1, no momentum). Each peer trains data shard ``--index`` of atoll's built-in corpus.

The peer prints its visible multiaddrs (one per line, starting with ``/``) once its DHT is up, trains
``--steps`` inner steps, and writes ``--out`` (JSON): wall seconds, seconds in inner steps (forward, backward
and the local AdamW step: ``opt.step()`` of a step that did not end an epoch, and the same median for one that
did), epochs, steps lost to ``load_state_from_peers``, and the final parameters (``--out`` with ``.pt``).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", required=True)
    p.add_argument("--index", type=int, required=True, help="this peer's data shard")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--model", default="nano")
    p.add_argument("--compression", default="fp16", choices=["fp16", "uint8"])
    p.add_argument("--matchmaking-time", type=float, default=5.0)
    p.add_argument("--averaging-timeout", type=float, default=60.0)
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)

    import hivemind
    from hivemind.compression import Float16Compression, Uniform8BitQuantization

    from atoll.models.configs import get_model_config
    from atoll.models.data import Corpus, load_corpus
    from atoll.node.config import RunConfig
    from atoll.node.device import resolve_device
    from atoll.node.island.learner import Learner

    run = RunConfig(model=args.model, algorithm="diloco", sync_every=args.sync_every)
    tokens, _ = load_corpus(run.data)
    corpus = Corpus(tokens, get_model_config(run.model).seq_len, run.num_shards)
    learner = Learner(run, resolve_device("cpu"), corpus, args.index, args.batch_size)

    dht = hivemind.DHT(initial_peers=args.initial_peers, host_maddrs=[f"/ip4/{args.host}/tcp/0"], start=True)
    for maddr in dht.get_visible_maddrs():
        print(maddr, flush=True)
    compression = Float16Compression() if args.compression == "fp16" else Uniform8BitQuantization()
    opt = hivemind.Optimizer(
        dht=dht, run_id="opendiloco", params=learner.params,
        optimizer=lambda params: torch.optim.AdamW(params, lr=run.inner_lr, betas=(0.9, 0.95),
                                                   weight_decay=run.weight_decay),
        target_batch_size=args.sync_every * args.peers * args.batch_size, batch_size_per_step=args.batch_size,
        use_local_updates=True, matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout,
        state_averaging_compression=compression, grad_compression=compression, verbose=False)

    loads = []  # load_state_from_peers: the peer fell behind the swarm's epoch; its steps since its last epoch are lost
    last_epoch_step = [0]
    original_load = opt.load_state_from_peers

    def counted_load(**kwargs):
        loads.append({"step": learner.step, "steps_lost": learner.step - last_epoch_step[0]})
        return original_load(**kwargs)

    opt.load_state_from_peers = counted_load
    start = time.monotonic()
    plain, ending, epochs_seen, fb_seconds = [], [], [], 0.0
    losses = []
    stop = []  # SIGTERM (the benchmark giving up on a straggler): finish this step, write what was done, leave
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    while learner.step < args.steps and not stop:
        t0 = time.monotonic()
        loss = learner._forward_backward()
        t1 = time.monotonic()
        warm = run.warmup_steps
        for group in opt.param_groups:
            group["lr"] = run.inner_lr * min(1.0, (learner.step + 1) / warm) if warm else run.inner_lr
        torch.nn.utils.clip_grad_norm_(learner.params, 1.0)
        epoch = opt.local_epoch
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.monotonic()
        fb_seconds += t1 - t0
        (ending if opt.local_epoch != epoch else plain).append(t2 - t1)
        if opt.local_epoch != epoch:
            epochs_seen.append({"step": learner.step, "epoch": opt.local_epoch, "seconds": t2 - t1})
            last_epoch_step[0] = learner.step + 1
        learner._advance()
        learner._prefetch()
        losses.append(float(loss))
    wall = time.monotonic() - start
    local_step = statistics.median(plain) if plain else 0.0
    compute = fb_seconds + local_step * (len(plain) + len(ending))
    torch.save({name: t.detach().clone() for name, t in learner.model.state_dict().items()},
               Path(args.out).with_suffix(".pt"))
    doc = {"index": args.index, "steps": learner.step, "stopped_early": bool(stop), "tokens": learner.tokens, "wall_seconds": wall,
           "compute_seconds": compute, "utilization": compute / wall if wall else None,
           "forward_backward_seconds": fb_seconds, "local_step_median_s": local_step,
           "epoch_end_step_seconds": ending, "epochs": opt.local_epoch, "epoch_events": epochs_seen,
           "state_loads": loads, "tokens_lost": sum(x["steps_lost"] for x in loads) * learner.tokens_per_step,
           "train_loss_last": losses[-1] if losses else None}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    opt.shutdown()
    dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

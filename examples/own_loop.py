#!/usr/bin/env python3
"""Your own training loop as a member of an atoll run (docs/api.md).

The model, the optimizer, the data and the loop are the script's; ``atoll.Island`` joins the run around them.
This loop is written to be the same recipe as ``atoll start``'s own (AdamW with betas 0.9/0.95, linear warm-up,
gradient clipping at 1, the run's data shard read in order), so that the two can be compared bit for bit
(``tests/integration/test_api.py``); a loop of your own is free to differ in all of it.

    python examples/own_loop.py --steps 200 --open --checkpoint-dir ckpt-a
    python examples/own_loop.py --steps 200 --open --checkpoint-dir ckpt-b --initial-peers <a line a printed>
    torchrun --standalone --nproc-per-node 2 examples/own_loop.py --steps 200 --open --checkpoint-dir ckpt-c ...

Under ``torchrun`` the loop is data parallel (``DistributedDataParallel`` over gloo): rank ``r`` of ``W`` reads the
``r``-th slice of each step's ``W`` batches, and the island (rank 0 in the run, the others following it) counts the
tokens of all of them — the same recipe as ``atoll start --nproc-per-node W``.

SIGTERM or Ctrl-C ends the loop after the current step (on every rank); the island then leaves the run cleanly.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

import torch

import atoll
from atoll.models.data import Corpus, load_corpus
from atoll.models.registry import build_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="nano", help="a preset of atoll.models.configs")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep per step (tests)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="an island option (an `atoll start` setting by field name), e.g. --set sync_every=20")
    ap.add_argument("--checkpoint-dir")
    ap.add_argument("--initial-peers", nargs="*", default=[])
    ap.add_argument("--open", action="store_true")
    ap.add_argument("--join-token")
    ap.add_argument("--run-key")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    # The model and its optimizer: every member builds the same Θ₀ from the same seed.
    model, shape = build_model(args.model, args.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    train_model = model
    if world > 1:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo")
        train_model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    tokens, _ = load_corpus("builtin")

    options: dict = {"initial_peers": args.initial_peers, "checkpoint_dir": args.checkpoint_dir,
                     "host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "open": args.open, "join_token": args.join_token,
                     "run_key": args.run_key, "seed": args.seed}
    for item in args.set:
        name, _, value = item.partition("=")
        options[name] = value
    options = {k: v for k, v in options.items() if v is not None and v is not False and v != []}  # unset ones
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    corpus: Corpus | None = None

    def held_out_loss(m: torch.nn.Module) -> float:
        batches = corpus.held_out(8, args.batch_size)
        return sum(float(m(b[:, :-1], b[:, 1:])) for b in batches) / len(batches)

    try:
        island = atoll.Island(model, optimizer, evaluate=held_out_loss,
                              tokens_per_step=args.batch_size * shape.seq_len * world, **options)
        with island:
            for maddr in island.maddrs:  # for whoever joins next (the tests read these lines)
                print(maddr, flush=True)
            corpus = Corpus(tokens, shape.seq_len, island.num_shards)
            position = island.step * args.batch_size * world  # a restored member resumes its data where it was
            while island.step < args.steps and not island.stopping:
                if stop.is_set():
                    island.request_stop()  # every rank leaves the loop after the same step
                batch = corpus.batch_at(island.shard, position + rank * args.batch_size, args.batch_size)
                for group in optimizer.param_groups:
                    group["lr"] = args.lr * min(1.0, (island.step + 1) / args.warmup) if args.warmup else args.lr
                loss = train_model(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                island.tokens(batch[:, 1:].numel() * world, loss=float(loss.detach()))
                optimizer.step()  # the step boundary: atoll counts the step, starts and merges rounds here
                optimizer.zero_grad(set_to_none=True)
                position += args.batch_size * world
                if args.step_delay:
                    stop.wait(args.step_delay)
    except atoll.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if world > 1:
            # The process group is this script's (it made it): left alive at exit, gloo's threads outlived the
            # interpreter and one rank aborted ("terminate called without an active exception") now and then.
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

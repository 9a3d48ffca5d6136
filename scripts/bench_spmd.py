#!/usr/bin/env python3
"""Tokens/s and per-device bytes of the xla learner: plain (one device) or SPMD over N devices. One JSON line.

    PJRT_DEVICE=CPU python -m scripts.bench_spmd --model tiny --devices 4 --steps 20   # in the xla venv

``--devices 0`` is the plain learner. On torch_xla's CPU runtime the N devices share the host's cores: these are
not TPU numbers."""

import argparse
import json
import time

from atoll.models.configs import MODELS
from atoll.models.data import Corpus, load_corpus
from atoll.node.config import RunConfig
from atoll.node.device import resolve_device
from atoll.node.island.learner import Learner

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="tiny")
ap.add_argument("--devices", type=int, default=4)
ap.add_argument("--per-device", type=int, default=2, help="sequences per device and step")
ap.add_argument("--steps", type=int, default=20)
args = ap.parse_args()
device = resolve_device("xla", args.devices)
run = RunConfig(model=args.model)
tokens, _ = load_corpus("builtin")
corpus = Corpus(tokens, MODELS[args.model].seq_len, run.num_shards)
batch = args.per_device if args.devices else args.per_device * 4
learner = Learner(run, device, corpus, shard=0, batch_size=batch, precision="fp32")
for _ in range(3):  # warm-up: compile
    learner.train_step()
t0 = time.perf_counter()
for _ in range(args.steps):
    learner.train_step_lagged()
learner.train_step()
elapsed = time.perf_counter() - t0
out = {"model": args.model, "devices": args.devices, "island_batch": learner.island_batch,
       "tokens_per_s": round(learner.tokens_per_step * (args.steps + 1) / elapsed),
       "param_bytes": sum(p.numel() * p.element_size() for p in learner.params)}
if args.devices:
    from atoll.node.spmd import device_bytes
    out["param_bytes_per_device"] = device_bytes(learner.params)[0]
print(json.dumps(out))

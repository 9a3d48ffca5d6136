"""Run by test_xla_spmd.py in a process of its own: torch_xla fixes its device count and SPMD mode when its runtime
starts, so a learner over 4 devices cannot share the test process's runtime (one device, no SPMD).

It trains an SPMD learner (``--spmd-devices 4``, fp32) next to the CPU learner on the same data, writes into θ the
ways the rounds do, and prints what it observed as one JSON line; the test makes the assertions.
"""

import json
import os
import sys

import torch

from atoll.models.configs import MODELS
from atoll.models.data import Corpus, load_corpus
from atoll.models.fragments import copy_into, flatten, make_fragments
from atoll.node.config import RunConfig
from atoll.node.device import resolve_device
from atoll.node.island.learner import Learner
from atoll.node.spmd import device_bytes, local_shapes, sharding_of

DEVICES = int(sys.argv[1])
PER_DEVICE = 2  # sequences per device and step
RUN = RunConfig(model="nano", warmup_steps=5)


def specs(tensors):
    return [sharding_of(t) for t in tensors]


def opt_state(learner):
    return [v for p in learner.params for k, v in learner.optimizer.state[p].items() if k != "step"]


def main() -> None:
    xla = resolve_device("xla", DEVICES)
    tokens, _ = load_corpus("builtin")
    corpus = Corpus(tokens, MODELS["nano"].seq_len, RUN.num_shards)
    held_out = corpus.held_out(2, PER_DEVICE * DEVICES)
    x = Learner(RUN, xla, corpus, shard=2, batch_size=PER_DEVICE, precision="fp32")
    c = Learner(RUN, resolve_device("cpu"), corpus, shard=2, batch_size=PER_DEVICE * DEVICES)
    out = {"devices": xla.devices, "describe": xla.describe(), "island_batch": x.island_batch,
           "cpu_island_batch": c.island_batch, "shapes": [list(p.shape) for p in x.params],
           "same_theta0": bool(torch.equal(x.flat_params(), c.flat_params()))}
    out["held_out_before"] = x.evaluate(held_out)
    out["losses"] = [[x.train_step(), c.train_step()] for _ in range(6)]
    out["param_gap"] = float((x.flat_params() - c.flat_params()).abs().max())
    out["held_out_after"] = [x.evaluate(held_out), c.evaluate(held_out)]
    out["param_specs"] = specs(x.params)
    out["param_local_shapes"] = [[list(s) for s in local_shapes(p)] for p in x.params]
    out["opt_specs"] = specs(opt_state(x))
    out["opt_local_shapes"] = [[list(s) for s in local_shapes(v)] for v in opt_state(x)]
    out["param_bytes_per_device"] = device_bytes(x.params)
    out["opt_bytes_per_device"] = device_bytes(opt_state(x))
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in x.params)
    out["batch_spec"] = sharding_of(x._prefetched[1][0][0])

    # Writes of merged values, as the rounds make them: a fragment's scatter, the whole θ, a checkpoint's state.
    fragment = make_fragments(x.params, 2, RUN.sync_every)[0]
    merged = torch.randn(fragment.numel)
    fragment.scatter(merged, x.params)
    out["after_scatter_specs"] = specs([x.params[i] for i in fragment.params])
    out["after_scatter_local_shapes"] = [[list(s) for s in local_shapes(x.params[i])] for i in fragment.params]
    out["scatter_exact"] = bool(torch.equal(flatten(xla.to_host([x.params[i] for i in fragment.params])), merged))
    flat = x.flat_params() + 0.001
    x.load_flat(flat)
    out["after_load_flat_specs"] = specs(x.params)
    out["load_flat_exact"] = bool(torch.equal(x.flat_params(), flat))
    state = x.state_tensors()
    x.load_state_tensors(state)
    out["after_restore_specs"] = specs(x.params)
    out["after_restore_opt_specs"] = specs(opt_state(x))
    out["restore_exact"] = all(torch.equal(v, state[k]) for k, v in x.state_tensors().items())
    x.train_step()
    out["after_step_specs"] = specs(x.params)
    out["after_step_opt_specs"] = specs(opt_state(x))

    # Compilations: every path of a round, twice to warm up, then twice more.
    def cycle():
        for _ in range(3):
            x.train_step()
        snap = x.snapshot(list(fragment.params))
        x.train_step_lagged()
        fragment.scatter(snap.result(), x.params)
        x.evaluate(held_out)
        x.load_flat(x.flat_params())
        x.load_state_tensors(x.state_tensors())
        for _ in range(2):
            x.train_step_lagged()

    cycle()
    cycle()
    warm = xla.compilations()
    cycle()
    cycle()
    out["compilations"] = [warm, xla.compilations()]
    out["remarked"] = xla.spmd.remarked  # writes that lost a sharding (the guard's count)
    out["final_specs"] = specs(x.params)
    print(json.dumps(out))


if __name__ == "__main__":
    assert os.environ.get("PJRT_DEVICE") == "CPU"
    main()

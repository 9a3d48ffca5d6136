"""``atoll.Island`` around a user's loop on xla (torch_xla's CPU runtime): rounds merge into the user's parameters
on the device, and once the first rounds compiled their graphs nothing compiles again, rounds included (the
island cuts the graph at each step boundary, so the user's step is the same graph every step)."""

import torch
from xla_helpers import xla_only

import atoll
from atoll.models.data import Corpus, load_corpus
from atoll.models.fragments import flatten
from atoll.models.registry import build_model
from atoll.node.device import resolve_device

pytestmark = xla_only


def test_an_island_on_xla_merges_rounds_and_compiles_nothing_new(tmp_path):
    import torch_xla

    device = resolve_device("xla")
    model, shape = build_model("nano", 0)
    model = model.to(device.torch_device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, capturable=True)
    tokens, _ = load_corpus("builtin")
    corpus = Corpus(tokens, shape.seq_len, 1)
    island = atoll.Island(model, optimizer, tokens_per_step=4 * shape.seq_len, open=True, log_level="WARNING",
                          host_maddrs=["/ip4/127.0.0.1/tcp/0"], checkpoint_dir=str(tmp_path), algorithm="diloco",
                          sync_every=10, outer_lr=1.0, outer_momentum=0.0, compression="none")
    compiled = {}
    with island:
        for step in range(40):
            batch = corpus.batch_at(0, 4 * step, 4).to(device.torch_device)
            model(batch[:, :-1].contiguous(), batch[:, 1:].contiguous()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch_xla.sync()
            compiled[island.step] = device.compilations()
        theta = flatten(device.to_host(params))
        replica = island.replica.snapshot(0).params
    assert island.step == 40 and island.version == 4  # a round every 10 steps, merged into the model
    # Plain averaging alone: the merged Θ is θ itself, on the device.
    assert torch.equal(theta, replica)
    assert compiled[40] == compiled[21], compiled  # steps 21-40, two rounds among them: nothing new compiled

"""The pieces of an island of several ranks that need no process group: its place from the launcher's environment,
the micro-batches each rank reads, gradient accumulation against one big batch, the micro-batch count a run's
global batch implies, and how rank 0 finds what its boundary wrote."""

import pytest
import torch

from atoll.models.data import Corpus, load_corpus
from atoll.models.fragments import make_fragments
from atoll.node.config import ConfigError, NodeConfig, RunConfig
from atoll.node.island.daemon import micro_batches
from atoll.node.device import Device
from atoll.node.island.learner import Learner, micro_batch_starts
from atoll.node.island.ranks import IslandSync, Ranks


def test_ranks_from_the_launchers_environment():
    assert Ranks.from_env({}) == Ranks(0, 1, 0)
    assert Ranks.from_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}) == Ranks(3, 4, 1)
    assert Ranks(0, 2).leader and not Ranks(1, 2).leader
    for bad in ({"WORLD_SIZE": "two"}, {"WORLD_SIZE": "2", "RANK": "2"}, {"WORLD_SIZE": "0"}):
        with pytest.raises(ConfigError):
            Ranks.from_env(bad)


@pytest.mark.parametrize("world,accumulate", [(1, 1), (1, 3), (2, 1), (2, 2), (4, 3)])
def test_micro_batches_tile_the_island_batch(world, accumulate):
    """Over every rank and micro-batch, the windows of one step are position .. position + B·K·W − 1, each once."""
    position, size = 96, 4
    windows = [start + i for rank in range(world)
               for start in micro_batch_starts(position, size, accumulate, Ranks(rank, world))
               for i in range(size)]
    assert sorted(windows) == list(range(position, position + size * accumulate * world))


def _learner(batch_size: int, accumulate: int) -> Learner:
    run = RunConfig(model="nano", warmup_steps=0)
    tokens, _ = load_corpus("builtin")
    corpus = Corpus(tokens, 64, run.num_shards)
    return Learner(run, Device("cpu", torch.device("cpu")), corpus, 3, batch_size, accumulate=accumulate)


def test_accumulated_micro_batches_train_as_one_batch():
    """Two micro-batches of 2 are the step of one batch of 4 (the same windows, the gradients' mean)."""
    torch.manual_seed(0)
    one, two = _learner(4, 1), _learner(2, 2)
    assert one.tokens_per_step == two.tokens_per_step
    for _ in range(3):
        loss_one, loss_two = one.train_step(), two.train_step()
        assert loss_two == pytest.approx(loss_one, rel=1e-5)
    assert one.position == two.position == 12 and one.tokens == two.tokens
    for a, b in zip(one.params, two.params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_micro_batch_count_from_the_runs_global_batch():
    def cfg(global_batch, batch_size=4, grad_accum=1):
        return NodeConfig(run=RunConfig(global_batch=global_batch), batch_size=batch_size, grad_accum=grad_accum)

    assert micro_batches(cfg(0, grad_accum=3), 2) == 3  # no global batch: the island's own
    assert micro_batches(cfg(32), 2) == 4 and micro_batches(cfg(32), 8) == 1
    assert micro_batches(cfg(32, grad_accum=4), 2) == 4
    with pytest.raises(ConfigError, match="global_batch"):
        micro_batches(cfg(32), 3)
    with pytest.raises(ConfigError, match="grad_accum"):
        micro_batches(cfg(32, grad_accum=2), 2)


def test_rank_zero_finds_the_parameters_its_boundary_wrote():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    params = [p for p in model.parameters()]
    sync = IslandSync(Ranks(0, 2), params, control=None)
    sync.mark()
    assert sync.written() == []
    fragments = make_fragments(params, 2, 10)
    fragments[1].scatter(torch.zeros(fragments[1].numel), params)  # a merge of fragment 1
    assert sync.written() == sorted(fragments[1].params)
    sync.mark()
    with torch.no_grad():
        params[0].add_(1.0)  # any in-place write counts, whoever makes it
    assert sync.written() == [0]


def test_island_settings_are_validated():
    with pytest.raises(ConfigError, match="nnodes"):
        NodeConfig(nnodes="2:1").validate()
    with pytest.raises(ConfigError, match="rdzv_endpoint"):
        NodeConfig(nnodes="2").validate()
    with pytest.raises(ConfigError, match="rdzv_endpoint"):
        NodeConfig(nnodes="2", rdzv_endpoint="nohost").validate()
    with pytest.raises(ConfigError, match="grad_accum"):
        NodeConfig(grad_accum=0).validate()
    NodeConfig(nnodes="1:4", rdzv_endpoint="10.0.0.1:29400", nproc_per_node=8).validate()


def test_atoll_start_launches_an_island_only_outside_the_launcher():
    from atoll.node.island.launch import wants_launcher

    assert not wants_launcher(NodeConfig(), {})
    assert wants_launcher(NodeConfig(nproc_per_node=2), {})
    assert wants_launcher(NodeConfig(nnodes="2", rdzv_endpoint="h:1"), {})
    assert not wants_launcher(NodeConfig(nproc_per_node=2), {"TORCHELASTIC_RUN_ID": "x"})  # a rank itself


def test_precision_setting():
    with pytest.raises(ConfigError, match="precision"):
        NodeConfig(precision="fp16").validate()
    for value in ("auto", "fp32", "bf16"):
        NodeConfig(precision=value).validate()

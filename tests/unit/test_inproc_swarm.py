"""The in-process swarm (scripts/inproc_swarm.py) that measures merge rules and quality at scale: its rounds and
merge rules against plain training, on the CPU."""

import pytest
import torch

from atoll.node.config import RunConfig
from atoll.node.device import resolve_device
from atoll.node.learner import Learner
from inproc_swarm import Config, Swarm, load

RUN = RunConfig(model="nano", warmup_steps=3, sync_every=8)
EXACT = dict(outer_lr=1.0, outer_momentum=0.0, codec="none", rda=False)  # plain averaging, fp32 on the wire


@pytest.fixture(scope="module")
def corpus():
    return load("nano", "builtin", 2)


def plain(corpus, steps):
    learner = Learner(RUN, resolve_device("cpu"), corpus, shard=0, batch_size=2)
    for _ in range(steps):
        learner.train_step()
    return learner.flat_params()


@pytest.mark.parametrize("delay", [0, 3, 7])
def test_one_member_with_the_delta_rule_is_plain_training_bit_for_bit(corpus, delay):
    swarm = Swarm(Config(kind="decoupled", merge="delta", delay=delay, fragments=2, **EXACT), RUN,
                  resolve_device("cpu"), corpus, members=1, batch_size=2, sync_every=8)
    swarm.train(30)
    assert torch.equal(swarm.learners[0].flat_params(), plain(corpus, 30))
    # Rounds started at 4, 8, ..., 28 (two fragments, offsets 0 and 4); those that landed carried ``delay`` steps.
    landed = sum(1 for s in range(4, 31, 4) if s + delay <= 30)
    per_fragment_step = swarm.learners[0].tokens_per_step // 2
    assert swarm.counters.carried == landed * delay * per_fragment_step
    assert swarm.counters.lost == 0


def test_overwriting_a_late_round_loses_the_steps_since_its_snapshot(corpus):
    swarm = Swarm(Config(kind="decoupled", merge="overwrite", delay=3, fragments=2, **EXACT), RUN,
                  resolve_device("cpu"), corpus, members=1, batch_size=2, sync_every=8)
    swarm.train(30)
    assert not torch.equal(swarm.learners[0].flat_params(), plain(corpus, 30))
    assert swarm.counters.lost > 0 and swarm.counters.carried == 0


def test_replicas_are_the_mean_of_the_members_snapshots_and_the_global_model_is_evaluated(corpus):
    """Two members, plain averaging, exact codec, rounds landing at once (diloco): after a round Θ is the mean of
    the two snapshots, every learner holds Θ, and the held-out loss is Θ's, with each learner's θ put back."""
    swarm = Swarm(Config(kind="diloco", **EXACT), RUN, resolve_device("cpu"), corpus, members=2, batch_size=2,
                  sync_every=8)
    swarm.train(7)
    a, b = (learner.flat_params() for learner in swarm.learners)
    swarm.train(1)  # each trains step 8, then the round: Θ = mean of the two θ after step 8
    theta = [learner.flat_params() for learner in swarm.learners]
    assert torch.equal(theta[0], theta[1]) and torch.equal(swarm.replicas[0], theta[0])
    assert not torch.equal(a, b)
    swarm.train(3)
    batches = corpus.held_out(2, 2)
    before = [learner.flat_params() for learner in swarm.learners]
    loss = swarm.held_out_loss(batches)
    assert all(torch.equal(x, learner.flat_params()) for x, learner in zip(before, swarm.learners))
    probe = swarm.learners[1]
    probe.load_flat(swarm.replicas[0])
    assert loss == probe.evaluate(batches)


def test_a_fragment_never_has_two_rounds_in_flight(corpus):
    with pytest.raises(ValueError):
        Swarm(Config(kind="decoupled", delay=8, **EXACT), RUN, resolve_device("cpu"), corpus, members=1,
              batch_size=2, sync_every=8)

"""The in-process swarm (scripts/inproc_swarm.py) that measures merge rules and quality at scale: its rounds and
merge rules against plain training, on the CPU."""

import pytest
import torch

from atoll.node.config import RunConfig
from atoll.node.device import resolve_device
from atoll.node.island.learner import Learner
from scripts.inproc_swarm import Config, Swarm, load

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


def started_rounds(swarm, steps, delay):
    """A naive schedule: per fragment, the due steps at which no round of it was in flight (one lands at
    snapshot + delay, before a round falling due at that step starts)."""
    starts = []
    for f in swarm.fragments:
        busy_until = -1
        for step in range(1, steps + 1):
            if f.due(step, swarm.H) and step >= busy_until:
                starts.append(step)
                busy_until = step + delay
    return starts


def test_rounds_longer_than_a_period_skip_the_rounds_due_meanwhile_and_keep_every_step(corpus):
    """delay 11 > H = 8: a fragment's next due round is skipped while one is in flight (as a daemon does), the one
    that lands carries all 11 steps, and one member still trains exactly as plain training."""
    swarm = Swarm(Config(kind="decoupled", merge="delta", delay=11, fragments=2, **EXACT), RUN,
                  resolve_device("cpu"), corpus, members=1, batch_size=2, sync_every=8)
    swarm.train(30)
    assert torch.equal(swarm.learners[0].flat_params(), plain(corpus, 30))
    starts = started_rounds(swarm, 30, 11)
    due = sum(1 for f in swarm.fragments for step in range(1, 31) if f.due(step, 8))
    assert swarm.counters.skipped == due - len(starts) > 0
    per_fragment_step = swarm.learners[0].tokens_per_step // 2
    assert swarm.counters.carried == sum(1 for s in starts if s + 11 <= 30) * 11 * per_fragment_step
    assert swarm.counters.lost == 0


def test_the_carry_bound_drops_work_older_than_it(corpus):
    """carry_max 5 < delay 7: every late round's 7 steps are dropped (as overwriting would), none carried."""
    bounded = Swarm(Config(kind="decoupled", merge="delta", delay=7, carry_max=5, fragments=2, **EXACT), RUN,
                    resolve_device("cpu"), corpus, members=1, batch_size=2, sync_every=8)
    bounded.train(30)
    assert bounded.counters.carried == 0 and bounded.counters.lost > 0
    assert not torch.equal(bounded.learners[0].flat_params(), plain(corpus, 30))
    within = Swarm(Config(kind="decoupled", merge="delta", delay=7, carry_max=7, fragments=2, **EXACT), RUN,
                   resolve_device("cpu"), corpus, members=1, batch_size=2, sync_every=8)
    within.train(30)
    assert within.counters.lost == 0 and within.counters.carried == bounded.counters.lost


def test_a_negative_delay_is_refused(corpus):
    with pytest.raises(ValueError):
        Swarm(Config(kind="decoupled", delay=-1, **EXACT), RUN, resolve_device("cpu"), corpus, members=1,
              batch_size=2, sync_every=8)

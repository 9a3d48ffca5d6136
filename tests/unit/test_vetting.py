"""Vetting a replica nobody vouches for by our own held-out loss: the rule against a naive reference, a real nano
learner on the CPU (the review's all-zero model is refused, an honest candidate passes, θ comes back bit for bit),
and the reference window that keeps a peer from walking a daemon downhill one margin at a time."""

import math
import random

import pytest
import torch

from atoll.models.configs import MODELS
from atoll.models.data import Corpus, load_corpus
from atoll.models.fragments import make_fragments
from atoll.node.config import RunConfig
from atoll.node.device import resolve_device
from atoll.node.island.learner import Learner
from atoll.node.rounds.replica import Replica
from atoll.node.rounds.vetting import LOSS_MARGIN, REFERENCE_SECONDS, Vetting, acceptable
from atoll.protocols.state_sync import ReplicaState

RUN = RunConfig(model="nano", warmup_steps=3)


def test_acceptable_matches_a_naive_rule():
    rng = random.Random(0)
    for _ in range(1000):
        ours = rng.uniform(0.5, 6)
        theirs = rng.choice([ours * rng.uniform(0.8, 1.2), math.inf, math.nan, -math.inf])
        naive = not (math.isnan(theirs) or math.isinf(theirs)) and theirs - ours <= LOSS_MARGIN * ours
        assert acceptable(theirs, ours) == naive or abs(theirs - ours * (1 + LOSS_MARGIN)) < 1e-12
    assert not acceptable(2.0, math.nan)


@pytest.fixture(scope="module")
def corpus():
    tokens, _ = load_corpus("builtin")
    return Corpus(tokens, MODELS["nano"].seq_len, RUN.num_shards)


def setup(corpus, parts=2, clock=None):
    learner = Learner(RUN, resolve_device("cpu"), corpus, shard=0, batch_size=4, held_out=corpus.held_out(2, 4))
    fragments = make_fragments(learner.params, parts, 10, embedding=learner.model.embed.weight)
    for _ in range(200):  # Θ: a model that learned something, so that a broken candidate shows
        learner.train_step()
    replica = Replica([f.gather(learner.params) for f in fragments], versions=[3] * parts, weights=[3.0] * parts)
    for _ in range(3):  # θ moves on from Θ: local progress no round merged yet
        learner.train_step()
    vetting = Vetting(learner, fragments, replica, **({"clock": clock} if clock else {}))
    return learner, fragments, replica, vetting


def candidate(replica, p, params):
    snap = replica.snapshot(p)
    return ReplicaState(snap.version + 1, snap.weight + 1, "theirs", params, snap.momentum, 0, "peer-b", p,
                        ("theirs",))


def test_the_all_zero_model_is_refused_and_an_honest_one_passes(corpus):
    learner, fragments, replica, vetting = setup(corpus)
    theta = learner.flat_params()
    for p in range(len(fragments)):
        zeros = candidate(replica, p, torch.zeros(replica.numel(p)))
        assert not vetting.vet(zeros)
        noise = candidate(replica, p, torch.randn(replica.numel(p)) * replica.snapshot(p).params.norm()
                          / replica.numel(p) ** 0.5)
        assert not vetting.vet(noise)  # a made-up state of the replica's norm
        same = candidate(replica, p, replica.snapshot(p).params + 1e-6)  # a fork that hardly differs
        assert vetting.vet(same)
        bad = torch.full((replica.numel(p),), math.nan)
        assert not vetting.vet(candidate(replica, p, bad))
        assert not vetting.vet(candidate(replica, p, torch.zeros(3)))
    assert torch.equal(learner.flat_params(), theta)  # θ, with its unmerged progress, is back bit for bit


def test_losses_measure_the_replica_not_theta(corpus):
    learner, fragments, replica, vetting = setup(corpus, parts=1)
    ours, theirs = vetting.losses(candidate(replica, 0, replica.snapshot(0).params))
    assert ours == theirs  # the candidate is Θ itself
    theta = learner.flat_params()
    fragments[0].scatter(replica.snapshot(0).params, learner.params)
    assert learner.held_out_loss() == ours
    learner.load_flat(theta)
    assert learner.held_out_loss() != ours  # θ has moved on from Θ: evaluating θ would be wrong


def test_the_reference_is_the_best_loss_of_the_window():
    now = [0.0]
    vetting = Vetting(None, [], None, clock=lambda: now[0])
    step = 1 + 0.9 * LOSS_MARGIN  # each candidate a little less than one margin worse than ours
    losses = iter([(2.0, 2.0 * step), (2.0 * step, 2.0 * step * step), (2.1, 2.1)])
    vetting.losses = lambda state: next(losses)
    vetting.replica = type("R", (), {"numel": lambda self, p: 4})()
    state = ReplicaState(1, 1.0, "x", torch.ones(4), torch.zeros(4), 0, "b", 0)
    assert vetting.vet(state)  # within the margin of ours
    # Ours is now the candidate we took: the next must be within the margin of the window's best, not of ours.
    assert not vetting.vet(state)
    assert vetting.reference(0, 5.0) == 2.0
    now[0] += REFERENCE_SECONDS + 1
    assert vetting.reference(0, 5.0) == 5.0  # the window forgets
    assert vetting.vet(state)

"""A replica's history: every outer step (or ddp step) records its new digest as a descendant, and adopting a
replica tells a fork (ours is not in its history) from catching up (ours is)."""

import torch

from atoll.models.outer import NesterovOuter
from atoll.node.rounds.replica import Replica
from atoll.protocols.state_sync import MAX_ANCESTORS


def ancestors(replica: Replica, p: int = 0) -> list[str]:
    return list(replica.snapshot(p).ancestors)


def step(replica: Replica, value: float, p: int = 0) -> None:
    version, _, digest = replica.identity(p)
    assert replica.apply_outer_step(p, version, torch.full((8,), value, dtype=torch.float64), 1.0,
                                    NesterovOuter(0.7, 0.9), digest)


def test_history_grows_with_each_step_and_is_bounded():
    r = Replica([torch.zeros(8)])
    first = r.identity(0)[2]
    assert ancestors(r) == [first]
    for i in range(MAX_ANCESTORS + 5):
        step(r, 0.01 * (i + 1))
        assert ancestors(r)[-1] == r.identity(0)[2]
    assert len(ancestors(r)) == MAX_ANCESTORS
    assert first not in ancestors(r)


def test_adopting_a_descendant_is_not_a_fork():
    ahead, behind = Replica([torch.zeros(8)]), Replica([torch.zeros(8)])
    step(ahead, 0.1)
    step(behind, 0.1)  # the same round: identical replicas
    step(ahead, 0.2)
    state = ahead.snapshot(0)
    assert behind.adopt(state)
    assert not state.forked
    assert behind.identity(0) == ahead.identity(0) and ancestors(behind) == ancestors(ahead)


def test_adopting_a_sibling_is_a_fork():
    left, right = Replica([torch.zeros(8)]), Replica([torch.zeros(8)])
    step(left, 0.1)
    step(right, 0.3)  # two groups merged different deltas at the same version
    heavier = right.snapshot(0)
    heavier.weight = 2.0
    assert left.adopt(heavier)
    assert heavier.forked


def test_a_replica_older_than_the_known_history_is_not_called_a_fork():
    ahead, far_behind = Replica([torch.zeros(8)]), Replica([torch.zeros(8)])
    for i in range(MAX_ANCESTORS + 3):
        step(ahead, 0.01 * (i + 1))
    state = ahead.snapshot(0)
    assert far_behind.adopt(state)
    assert not state.forked  # version 0 is beyond the 32 versions the history covers: unknown, not a fork


def test_replace_params_advances_only_the_expected_version():
    r = Replica([torch.zeros(8)])
    assert r.replace_params(0, 0, torch.ones(8), 4.0)
    assert r.identity(0)[0] == 1 and r.identity(0)[1] == 4.0
    assert torch.equal(r.snapshot(0).params, torch.ones(8))
    assert not r.replace_params(0, 0, torch.zeros(8), 4.0)  # stale: the replica moved on
    assert len(ancestors(r)) == 2

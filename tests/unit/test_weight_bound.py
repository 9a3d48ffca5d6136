"""The bound on a member's declared weight: what the run's batch allows for the steps one contribution can hold
(``Algorithm.weight_bound``), applied by the reducer before its other clips (``clip_members``' ``cap``) and by a
member checking the reducer's answer, so that a weight lie is worth at most ``CARRIED_ROUNDS`` rounds of honest
work whatever the other members declare."""

import random

import pytest
import torch

from atoll.models.robust import clip_members
from atoll.node.algorithm import CARRIED_ROUNDS, AlgorithmName, algorithm
from atoll.protocols.reducer import GroupSpec


def test_the_bound_is_the_weight_of_the_run_batch_for_the_steps_a_contribution_holds():
    decoupled, diloco = algorithm(AlgorithmName.DECOUPLED), algorithm(AlgorithmName.DILOCO)
    tokens, h, overlap = 512, 50, 3
    steps = CARRIED_ROUNDS * h + overlap  # decoupled is fragmented: its overlap steps count
    assert decoupled.weight_bound(tokens, h, overlap) == (tokens * steps) ** 2 / steps
    assert diloco.weight_bound(tokens, h, overlap) == tokens * CARRIED_ROUNDS * h  # one fragment, no overlap
    assert decoupled.weight_bound(0, h, overlap) == 0.0  # a run that does not bound its tokens a step


def test_an_honest_contribution_fits_and_a_lie_is_worth_two_rounds_at_most():
    decoupled = algorithm(AlgorithmName.DECOUPLED)
    tokens, h = 512, 50
    bound = decoupled.weight_bound(tokens, h, 0)
    honest = decoupled.weight(tokens * h, h)
    carried = decoupled.weight(tokens * 2 * h, 2 * h)  # one missed round's work carried into this one
    assert honest < carried <= bound
    # The edge attack's weight: 3x the tokens a step (token weighting makes that 9x) for the same steps.
    lie = decoupled.weight(3 * tokens * h, h)
    got = clip_members([honest, honest, lie], [0.0] * 3, [1.0] * 3, 0.0, False, bound)
    assert got.weights == [honest, honest, bound] and got.clipped == [2]
    assert bound / honest == CARRIED_ROUNDS


def _naive(weights, norms, sizes, factor, rda, cap):
    """Each weight cut to ``cap`` first, then the clips as ``clip_members`` without a cap does them."""
    capped = [min(w, cap) for w in weights]
    got = clip_members(capped, norms, sizes, factor, rda)
    return got, sorted(set(got.clipped) | {i for i, w in enumerate(weights) if w > cap})


@pytest.mark.parametrize("rda", [False, True])
def test_the_cap_comes_before_the_relative_clips(rda):
    rng = random.Random(7)
    for _ in range(300):
        m = rng.randint(1, 6)
        weights = [rng.choice([1.0, rng.uniform(0.1, 5), rng.uniform(5, 50)]) for _ in range(m)]
        norms = [rng.choice([1.0, rng.uniform(0.1, 3), 0.0]) for _ in range(m)]
        sizes = [rng.choice([1.0, rng.uniform(0.1, 3), rng.uniform(3, 30)]) for _ in range(m)]
        cap = rng.uniform(0.5, 20)
        factor = rng.choice([0.0, 4.0])
        got = clip_members(weights, norms, sizes, factor, rda, cap)
        want, clipped = _naive(weights, norms, sizes, factor, rda, cap)
        assert got.weights == pytest.approx(want.weights, rel=1e-12) and got.scales == want.scales
        assert got.clipped == clipped and max(got.weights) <= cap


def test_a_reducer_cuts_a_weight_above_the_bound_and_members_check_the_same_cut():
    from test_averaging import _answer

    from atoll.protocols.averaging import check_shard

    members = ("a", "b", "c")
    capped = GroupSpec("run", 0, 1, 0, members, 600, block=64, max_weight=2.0)
    uncapped = GroupSpec("run", 0, 1, 0, members, 600, block=64)
    assert capped.group_id != uncapped.group_id  # members that disagree on the bound are in different groups
    gen = torch.Generator().manual_seed(4)
    direction = torch.randn(600, generator=gen, dtype=torch.float64)
    deltas = [direction, direction * 1.1, direction * 10]  # "c" sends a large delta and declares a large weight
    weights = [1.0, 1.0, 9.0]
    header, floor, own = _answer(capped, deltas, weights, clip=0.0)
    assert header["weight"] == 1.0 + 1.0 + 2.0  # "c"'s 9 cut to the bound; the parts say what it declared
    assert header["parts"][2][0] == 9.0
    for me in members[:2]:
        assert check_shard(header, capped, "c", me, [own[me]], floor, 0.0) is None
    # A reducer that leaves the bound out weighs "c" 9 of 11 instead of 2 of 4: its shard is larger than the
    # weighted mean under the bound allows, and the members who apply the bound refuse it.
    header, floor, own = _answer(uncapped, deltas, weights, clip=0.0)
    for me in members[:2]:
        assert check_shard(header, capped, "c", me, [own[me]], floor, 0.0)[1] == "reducer_shard"


def test_the_daemon_that_starts_a_run_bounds_its_tokens_a_step_at_its_own_and_joiners_are_held_to_it():
    import dataclasses

    from atoll.node.config import NodeConfig
    from atoll.node.island.daemon import derived_fields
    from atoll.node.island.member import check_step_tokens
    from atoll.node.run_config import ConfigError, RunConfig

    seq_len = 64  # the nano model's
    cfg = NodeConfig(batch_size=4, grad_accum=2, run=RunConfig(model="nano"))
    assert derived_fields(cfg.run, cfg, world=3)["max_step_tokens"] == 4 * 2 * 3 * seq_len
    fixed = dataclasses.replace(cfg, grad_accum=1, run=RunConfig(model="nano", global_batch=24))
    assert derived_fields(fixed.run, fixed, world=2)["max_step_tokens"] == 24 * seq_len  # the run's global batch
    chosen = RunConfig(model="nano", max_step_tokens=10_000)
    assert "max_step_tokens" not in derived_fields(chosen, dataclasses.replace(cfg, run=chosen), world=1)
    check_step_tokens(chosen, 10_000)
    check_step_tokens(RunConfig(), 10**9)  # 0: a run that does not bound it (an own loop that does not say)
    with pytest.raises(ConfigError, match="max_step_tokens: this island trains 10001 tokens a step"):
        check_step_tokens(chosen, 10_001)

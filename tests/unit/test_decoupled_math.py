"""Decoupled DiLoCo's pure pieces against naive references: fragments, RDA, token weights, grace, carry."""

import math

import pytest
import torch

from atoll.models.fragments import make_fragments, partition
from atoll.models.outer import NesterovOuter, radial_directional_average, token_weight, weighted_mean
from atoll.node.rounds.local_state import LocalFragmentState
from atoll.node.rounds.waits import grace_window, join_window


def test_partition_is_deterministic_balanced_and_complete():
    sizes = [1000, 10, 300, 300, 299, 5, 700, 64, 64, 1]
    a, b = partition(sizes, 3), partition(list(sizes), 3)
    assert a == b
    assert sorted(i for group in a for i in group) == list(range(len(sizes)))
    loads = [sum(sizes[i] for i in g) for g in a]
    # LPT's guarantee: the heaviest bin is at most 4/3 of the optimum (≥ the average and ≥ the largest item).
    assert max(loads) <= 4 / 3 * max(sum(sizes) / 3, max(sizes))
    with pytest.raises(ValueError):
        partition(sizes, 11)


def test_fragments_gather_scatter_and_schedule():
    params = [torch.nn.Parameter(torch.randn(n)) for n in (50, 7, 30, 30, 3)]
    frags = make_fragments(params, 2, period=10, embedding=params[0])
    assert [f.offset for f in frags] == [0, 5]
    assert sum(f.numel for f in frags) == 120 and [f.has_embedding for f in frags].count(True) == 1
    for f in frags:
        flat = torch.randn(f.numel)
        f.scatter(flat, params)
        assert torch.equal(f.gather(params), flat)
    due = [s for s in range(1, 31) if frags[1].due(s, 10)]
    assert due == [5, 15, 25] and not frags[0].due(0, 10)


def naive_rda(vs, ws):
    total = sum(ws)
    norm = sum(w * math.sqrt(sum(x * x for x in v)) for v, w in zip(vs, ws)) / total
    dirs = [[x / math.sqrt(sum(y * y for y in v)) for x in v] for v in vs]
    mean = [sum(w * d[i] for d, w in zip(dirs, ws)) / total for i in range(len(vs[0]))]
    length = math.sqrt(sum(x * x for x in mean))
    return [x * norm / length for x in mean]


def test_rda_matches_naive_reference():
    torch.manual_seed(0)
    vs = [torch.randn(20) * s for s in (1.0, 3.0, 0.5)]
    ws = [1.0, 2.0, 4.0]
    got = radial_directional_average(vs, ws)
    expect = naive_rda([v.tolist() for v in vs], ws)
    assert all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) for a, b in zip(got.tolist(), expect))


@pytest.mark.parametrize("m", [2, 4, 8, 16])
def test_rda_norm_does_not_shrink_with_m_for_orthogonal_inputs(m):
    vs = [torch.eye(16)[i] * 2.0 for i in range(m)]  # orthogonal, norm 2
    ws = [1.0] * m
    assert math.isclose(float(radial_directional_average(vs, ws).norm()), 2.0, rel_tol=1e-12)
    # The plain mean shrinks as 1/sqrt(M): what RDA is for.
    assert math.isclose(float(weighted_mean(vs, ws).norm()), 2.0 / math.sqrt(m), rel_tol=1e-12)


def test_rda_of_zero_inputs_is_zero():
    assert torch.count_nonzero(radial_directional_average([torch.zeros(5), torch.zeros(5)], [1.0, 1.0])) == 0


def test_token_weight():
    assert token_weight(1000, 10) == 1000 * 100  # tokens × tokens per step
    # Same tokens in fewer, larger steps weigh more (each step saw more data).
    assert token_weight(1000, 5) > token_weight(1000, 10)
    with pytest.raises(ValueError):
        token_weight(0, 1)


def test_grace_window():
    assert grace_window(0.5, 2, step_time=1.0, quorum_time=0.2, sync_time=0.3) == pytest.approx(0.75)
    assert grace_window(0.5, 2, step_time=0.01, quorum_time=0.2, sync_time=0.3) == 0.0  # no slack: no wait
    assert grace_window(0.0, 8, 1.0, 0.0, 0.0) == 0.0
    with pytest.raises(ValueError):
        grace_window(1.0, 2, 1.0, 0.0, 0.0)


def test_join_window_covers_a_peers_way_into_the_round_up_to_a_quarter_of_h():
    # 0.3 s steps, 50 ms DHT reads: open-rounds poll 0.5 + group poll 0.2 + two steps 0.6 + three reads 0.15.
    assert join_window(0.3, 0.05, sync_every=40, open_poll=0.5, group_poll=0.2) == pytest.approx(1.45)
    # A short H caps it at H/4 steps: 8 steps of 0.3 s → 0.6 s.
    assert join_window(0.3, 0.05, sync_every=8, open_poll=0.5, group_poll=0.2) == pytest.approx(0.6)
    # Before the learner has timed a step there is nothing to weigh the wait against: no wait.
    assert join_window(0.0, 0.05, sync_every=40, open_poll=0.5, group_poll=0.2) == 0.0


def test_local_state_counts_and_restarts():
    state = LocalFragmentState(torch.zeros(4), (0, "a"))
    theta = torch.tensor([-1.0, -2.0, 0.0, 1.0])
    assert state.delta(theta).tolist() == [1.0, 2.0, 0.0, -1.0]  # Θ_base − θ
    state.add_step(100)
    state.add_step(100)
    assert (state.tokens, state.steps) == (200, 2)
    assert state.restart(torch.full((4,), 5.0), (1, "b")) == 200  # unmerged work, lost on adoption
    assert state.base_id == (1, "b") and (state.tokens, state.steps) == (0, 0)
    assert torch.equal(state.delta(torch.full((4,), 5.0)), torch.zeros(4, dtype=torch.float64))


def test_decoupled_degenerates_to_diloco():
    """All daemons present, equal speeds, K = M, P = 1, τ = 0, α = 0, RDA off: the same merged update."""
    torch.manual_seed(1)
    theta_global = torch.randn(64)
    locals_ = [theta_global - 0.01 * torch.randn(64) for _ in range(3)]
    tokens, steps = 4096, 16
    # DiLoCo weights by tokens, decoupled by tokens²/steps: with equal speeds both are uniform.
    diloco_w = [float(tokens)] * 3
    decoupled_w = [token_weight(tokens, steps)] * 3
    results = []
    for weights in (diloco_w, decoupled_w):
        params, buf = theta_global.clone(), torch.zeros(64)
        states = [LocalFragmentState(theta_global) for _ in locals_]
        merged = weighted_mean([s.delta(t) for s, t in zip(states, locals_)], weights)
        NesterovOuter().step(params, buf, merged)
        results.append(params)
    assert torch.equal(results[0], results[1])

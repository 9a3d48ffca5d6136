"""Direction-robust merges (coordinate-wise trimmed mean, centered clipping) against naive references written
with plain Python loops and floats; their edge cases (1 and 2 members, ties, zeros, weights); determinism; the
reducer's wiring (``GroupSpec.merge``, ``mean`` and ``rda``); the ``byzantine=direction`` fault; the config."""

import asyncio
import math
import random

import pytest
import torch

from atoll.models.outer import weighted_mean
from atoll.models.robust import (CENTERED_ITERATIONS, MERGE_RULES, MergeRule, centered_clip, coordinate_median,
                                 robust_merge, trim_count, trimmed_mean)


# ---- naive references ----------------------------------------------------------------------------------------
def rows_of(vectors):
    return [[float(x) for x in v] for v in vectors]


def naive_trimmed(vectors, weights, b):
    rows = rows_of(vectors)
    m, n = len(rows), len(rows[0])
    out = []
    for j in range(n):
        ranked = sorted(range(m), key=lambda i: (rows[i][j], i))  # ties: the earlier member is the smaller
        kept = ranked[b : m - b]
        total = 0.0
        for i in kept:
            total += float(weights[i])
        acc = 0.0
        for i in kept:
            acc += rows[i][j] * (float(weights[i]) / total)
        out.append(acc)
    return out


def naive_median(rows):
    m, out = len(rows), []
    for j in range(len(rows[0])):
        col = sorted(r[j] for r in rows)
        out.append(col[m // 2] if m % 2 else (col[m // 2 - 1] + col[m // 2]) / 2)
    return out


def naive_centered(vectors, weights, iterations):
    rows = rows_of(vectors)
    if len(rows) <= 2:
        return naive_weighted_mean(rows, weights)
    total = math.fsum(float(w) for w in weights)
    shares = [float(w) / total for w in weights]
    v = naive_median(rows)
    for _ in range(iterations):
        diffs = [[x - c for x, c in zip(r, v)] for r in rows]
        dists = [math.sqrt(math.fsum(d * d for d in diff)) for diff in diffs]
        tau = sorted(dists)[(len(dists) - 1) // 2]
        if tau == 0:
            break
        step = [0.0] * len(v)
        for diff, dist, share in zip(diffs, dists, shares):
            if dist > 0:
                scale = share * min(1.0, tau / dist)
                step = [s + d * scale for s, d in zip(step, diff)]
        v = [c + s for c, s in zip(v, step)]
    return v


def naive_weighted_mean(rows, weights):
    total = math.fsum(float(w) for w in weights)
    return [math.fsum(r[j] * float(w) / total for r, w in zip(rows, weights)) for j in range(len(rows[0]))]


def as_tensor(values):
    return torch.tensor(values, dtype=torch.float64)


def random_case(members, n, seed, weighted):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    vectors = [torch.randn(n, dtype=torch.float64) * rng.choice([1e-3, 1.0, 30.0]) for _ in range(members)]
    weights = [rng.uniform(0.5, 3.0) if weighted else 1.0 for _ in range(members)]
    return vectors, weights


# ---- the trimmed mean ----------------------------------------------------------------------------------------
def test_trim_count():
    assert [trim_count(m) for m in range(1, 13)] == [0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    for m in range(1, 100):
        assert m - 2 * trim_count(m) >= 1
    with pytest.raises(ValueError):
        trim_count(0)


@pytest.mark.parametrize("members", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("weighted", [False, True])
def test_trimmed_mean_matches_naive_reference(members, weighted):
    vectors, weights = random_case(members, 41, members * 10 + weighted, weighted)
    got = trimmed_mean(vectors, weights)
    assert got.dtype == torch.float64 and got.shape == (41,)
    b = trim_count(members)
    want = naive_trimmed(vectors, weights, b) if b else naive_weighted_mean(rows_of(vectors), weights)
    assert torch.allclose(got, as_tensor(want), rtol=1e-12, atol=1e-300)
    for b in range(0, (members - 1) // 2 + 1):  # every allowed trim, explicitly
        got = trimmed_mean(vectors, weights, trim=b)
        want = naive_trimmed(vectors, weights, b) if b else naive_weighted_mean(rows_of(vectors), weights)
        assert torch.allclose(got, as_tensor(want), rtol=1e-12, atol=1e-300)


def test_trimmed_mean_of_one_and_two_members_is_the_weighted_mean_bit_for_bit():
    v = torch.randn(50, dtype=torch.float64) * 1e5
    assert torch.equal(trimmed_mean([v], [3.0]), v)
    u = torch.randn(50, dtype=torch.float64)
    assert torch.equal(trimmed_mean([v, u], [1.0, 2.5]), weighted_mean([v, u], [1.0, 2.5]))


def test_trimmed_mean_refuses_impossible_trims_and_bad_inputs():
    vs = [torch.zeros(3, dtype=torch.float64) for _ in range(4)]
    with pytest.raises(ValueError):
        trimmed_mean(vs, [1.0] * 4, trim=2)  # would leave nothing
    with pytest.raises(ValueError):
        trimmed_mean(vs, [1.0] * 3)
    with pytest.raises(ValueError):
        trimmed_mean(vs, [1.0, 1.0, 0.0, 1.0])
    with pytest.raises(ValueError):
        trimmed_mean([], [])
    with pytest.raises(ValueError):
        trimmed_mean([torch.zeros(3), torch.zeros(4), torch.zeros(3)], [1.0] * 3)


def test_trimmed_mean_ties_break_by_member_order_so_weights_are_well_defined():
    # Coordinate 0: three equal values with different weights; the trim drops the first (smallest by order) and
    # the last (largest), keeps the middle member's value and weight.
    vectors = [as_tensor([1.0, 0.0]), as_tensor([1.0, 5.0]), as_tensor([1.0, -5.0])]
    weights = [1.0, 2.0, 4.0]
    got = trimmed_mean(vectors, weights)
    assert torch.equal(got, as_tensor(naive_trimmed(vectors, weights, 1)))
    assert got.tolist() == [1.0, 0.0]
    # Many ties among four, weighted: equal to the naive order (value, member index).
    vectors = [as_tensor([2.0, 2.0, 0.0]), as_tensor([2.0, 1.0, 0.0]), as_tensor([1.0, 2.0, 0.0]),
               as_tensor([2.0, 2.0, -0.0])]
    weights = [1.0, 3.0, 5.0, 7.0]
    assert torch.allclose(trimmed_mean(vectors, weights), as_tensor(naive_trimmed(vectors, weights, 1)),
                          rtol=1e-15, atol=0)


def test_trimmed_mean_of_zeros_is_zero_and_extremes_are_dropped_whatever_their_weight():
    zeros = [torch.zeros(8, dtype=torch.float64) for _ in range(5)]
    assert torch.equal(trimmed_mean(zeros, [1.0] * 5), torch.zeros(8, dtype=torch.float64))
    honest = [torch.full((8,), x, dtype=torch.float64) for x in (1.0, 1.1, 0.9)]
    attacker = torch.full((8,), -1e6, dtype=torch.float64)
    got = trimmed_mean([*honest, attacker], [1.0, 1.0, 1.0, 1e6])
    assert float(got.min()) >= 0.9 and float(got.max()) <= 1.1  # within the honest range


def test_trimmed_mean_is_independent_of_input_order_for_distinct_values():
    vectors, weights = random_case(6, 33, 7, weighted=True)
    want = trimmed_mean(vectors, weights)
    perm = [4, 0, 5, 2, 1, 3]
    got = trimmed_mean([vectors[i] for i in perm], [weights[i] for i in perm])
    assert torch.equal(got, want)  # sums run in rank order, not member order


def test_chunked_merges_equal_unchunked_bit_for_bit_and_empty_shards_work():
    vectors, weights = random_case(6, 1001, 13, weighted=True)
    for chunk in (1, 7, 1000):
        assert torch.equal(trimmed_mean(vectors, weights, chunk=chunk), trimmed_mean(vectors, weights))
        assert torch.equal(coordinate_median(vectors, chunk=chunk), coordinate_median(vectors))
    empty = [torch.zeros(0, dtype=torch.float64) for _ in range(4)]
    for rule in MergeRule:  # a shard can hold no values (more members than codec blocks)
        assert robust_merge(empty, [1.0] * 4, rule).shape == (0,)


# ---- centered clipping ---------------------------------------------------------------------------------------
def test_coordinate_median_matches_naive_reference():
    for m in (1, 2, 3, 4, 7):
        vectors, _ = random_case(m, 19, m, weighted=False)
        assert torch.equal(coordinate_median(vectors), as_tensor(naive_median(rows_of(vectors))))


@pytest.mark.parametrize("members", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("iterations", [1, CENTERED_ITERATIONS, 10])
def test_centered_clip_matches_naive_reference(members, weighted, iterations):
    vectors, weights = random_case(members, 29, members * 7 + weighted, weighted)
    got = centered_clip(vectors, weights, iterations)
    assert got.dtype == torch.float64
    assert torch.allclose(got, as_tensor(naive_centered(vectors, weights, iterations)), rtol=1e-10, atol=1e-12)


def test_centered_clip_of_one_and_two_members_is_the_weighted_mean_bit_for_bit():
    v, u = torch.randn(20, dtype=torch.float64), torch.randn(20, dtype=torch.float64)
    assert torch.equal(centered_clip([v], [2.0]), v)
    assert torch.equal(centered_clip([v, u], [1.0, 3.0]), weighted_mean([v, u], [1.0, 3.0]))


def test_centered_clip_of_equal_inputs_and_of_zeros_returns_them():
    v = torch.randn(10, dtype=torch.float64)
    assert torch.equal(centered_clip([v, v.clone(), v.clone()], [1.0, 2.0, 3.0]), v)
    zeros = [torch.zeros(10, dtype=torch.float64) for _ in range(4)]
    assert torch.equal(centered_clip(zeros, [1.0] * 4), torch.zeros(10, dtype=torch.float64))


def test_centered_clip_stops_when_most_members_sit_on_the_centre():
    # Three of four at the same point: τ (the lower median distance, zeros counted) is 0, so the outlier cannot
    # move the centre at all (with zeros left out of τ, it would move it by a quarter of its distance).
    v = torch.ones(6, dtype=torch.float64)
    got = centered_clip([v, v.clone(), v.clone(), torch.full((6,), 1e9, dtype=torch.float64)], [1.0] * 4)
    assert torch.equal(got, v)


def test_centered_clip_bounds_a_hostile_direction_at_the_honest_norm():
    torch.manual_seed(3)
    base = torch.randn(200, dtype=torch.float64)
    honest = [base + 0.3 * torch.randn(200, dtype=torch.float64) for _ in range(3)]
    attacker = -honest[0]  # the honest norm, the opposite direction: the norm clip lets it through
    target = weighted_mean(honest, [1.0] * 3)
    plain = weighted_mean([*honest, attacker], [1.0] * 4)
    for rule in (MergeRule.CENTERED, MergeRule.TRIMMED):
        robust = robust_merge([*honest, attacker], [1.0] * 4, rule)
        assert float((robust - target).norm()) < 0.5 * float((plain - target).norm()), rule


def test_merges_are_deterministic_across_calls():
    vectors, weights = random_case(7, 1000, 11, weighted=True)
    for rule in MergeRule:
        first = robust_merge(vectors, weights, rule)
        for _ in range(3):
            assert torch.equal(robust_merge([v.clone() for v in vectors], list(weights), rule), first)


def test_robust_merge_dispatch_and_names():
    vectors, weights = random_case(5, 9, 5, weighted=True)
    assert torch.equal(robust_merge(vectors, weights, MergeRule.CLIP), weighted_mean(vectors, weights))
    assert torch.equal(robust_merge(vectors, weights, "trimmed"), trimmed_mean(vectors, weights))
    assert torch.equal(robust_merge(vectors, weights, MergeRule.CENTERED), centered_clip(vectors, weights))
    assert MERGE_RULES == ("clip", "trimmed", "centered")
    with pytest.raises(ValueError):
        robust_merge(vectors, weights, "median")


# ---- the reducer --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule", list(MergeRule))
@pytest.mark.parametrize("mode", ["mean", "rda"])
def test_reducer_merges_with_the_groups_rule(rule, mode):
    """A reducer of three members merges its shard with ``spec.merge`` (after the norm clip), in both modes: its
    values are the rule applied to the (rda: unit-direction) parts, in peer-id order whatever the arrival order."""
    from atoll.models.robust import clip_contributions, clip_scalars
    from atoll.protocols.reducer import AveragingServicer, GroupSpec
    from atoll.protocols.stats import TrafficStats

    torch.manual_seed(5)
    parts = {p: torch.randn(4) for p in ("c", "a", "b")}
    weights = {"a": 1.0, "b": 2.0, "c": 1.5}
    norms = {"a": 2.0, "b": 3.0, "c": 2.5}  # whole-fragment norms (rda)

    async def reduce():
        servicer = AveragingServicer("run", "b", TrafficStats(), clip_factor=4.0)
        spec = GroupSpec("run", 0, 0, 0, ("a", "b", "c"), 12, mode=mode, block=4, merge=rule)
        reduction = servicer.open(spec, timeout=5)
        for p in ("c", "a", "b"):
            reduction.add(p, weights[p], parts[p], norms[p])
        return await reduction.result

    result = asyncio.run(reduce())
    peers = ["a", "b", "c"]
    values = [parts[p].double() / norms[p] if mode == "rda" else parts[p] for p in peers]
    values, _ = clip_contributions(values, 4.0)
    ws, _ = clip_scalars([weights[p] for p in peers], 4.0)
    want = robust_merge(values, ws, rule).float()
    assert torch.equal(result.values, want)
    assert result.contributors == peers


def test_group_ids_differ_by_merge_rule_and_the_default_keeps_the_old_id():
    import hashlib

    from atoll.protocols.reducer import GroupSpec

    spec = GroupSpec("run", 0, 3, 0, ("a", "b"), 100)
    old = hashlib.sha256(b"run|0|3||0|a,b|100|mean|none|256").hexdigest()[:24]
    assert spec.group_id == old
    ids = {GroupSpec("run", 0, 3, 0, ("a", "b"), 100, merge=rule).group_id for rule in MergeRule}
    assert len(ids) == len(MergeRule)


# ---- the fault and the config --------------------------------------------------------------------------------
def test_byzantine_direction_sends_the_negated_delta_at_the_honest_norm():
    from atoll.node.faults import Faults, Reversed, parse_faults

    assert parse_faults(["byzantine=direction"]) == {"byzantine": "direction"}
    faults = Faults(["byzantine=direction"])
    assert faults.tamper(1, 0, 0).delta(torch.ones(3)).tolist() == [1.0, 1.0, 1.0]  # solo rounds stay honest
    tamper = faults.tamper(4, 0, 0)
    assert isinstance(tamper, Reversed)
    flat = torch.randn(100, dtype=torch.float64)
    claimed = tamper.delta(flat)
    assert torch.equal(claimed, -flat) and float(claimed.norm()) == float(flat.norm())
    assert torch.equal(tamper.own(claimed), flat)  # error feedback sees the honest delta


def test_config_validates_the_merge_rule():
    from atoll.node.config import ConfigError, RunConfig, load_config

    assert RunConfig().robust_merge == "trimmed"  # direction-robust by default (the hostile-internet issue)
    for rule in MERGE_RULES:
        cfg, explicit = load_config({"robust_merge": rule})
        assert cfg.run.robust_merge == rule and MergeRule(cfg.run.robust_merge).value == rule
        assert "robust_merge" in explicit and cfg.run.published()["robust_merge"] == rule
    with pytest.raises(ConfigError, match="robust_merge: unknown 'median'"):
        load_config({"robust_merge": "median"})
    with pytest.raises(ConfigError, match="robust_merge"):
        load_config({"robust_merge": 3})

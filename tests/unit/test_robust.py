"""Robust clipping against a naive reference (plain Python lists and math), including 1- and 2-member rounds."""

import math
import random

import pytest
import torch

from atoll.models.outer import weighted_mean
from atoll.models.robust import clip_bound, clip_contributions, clip_influence, clip_scalars, lower_median


def naive_clip(vectors, factor):
    rows = [[float(x) for x in v] for v in vectors]
    norms = [math.sqrt(math.fsum(x * x for x in r)) for r in rows]
    positive = sorted(n for n in norms if n > 0)
    if factor == 0 or not positive:
        return rows
    median = positive[(len(positive) - 1) // 2]
    return [[x * median / n for x in r] if n > factor * median else r for r, n in zip(rows, norms)]


@pytest.mark.parametrize("members", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("factor", [0.0, 1.0, 3.0, 10.0])
def test_clip_matches_naive_reference(members, factor):
    rng = random.Random(members * 100 + int(factor))
    torch.manual_seed(members)
    vectors = [torch.randn(37) * rng.choice([1e-3, 1.0, 50.0, 1e4]) for _ in range(members)]
    got, clipped = clip_contributions(vectors, factor)
    want = naive_clip(vectors, factor)
    assert len(got) == members
    for g, w in zip(got, want):
        assert g.dtype == torch.float64
        assert torch.allclose(g, torch.tensor(w, dtype=torch.float64), rtol=1e-12, atol=0)
    assert clipped == [i for i, (g, v) in enumerate(zip(want, vectors)) if g != [float(x) for x in v]]


def test_single_member_is_never_changed():
    v = torch.randn(100) * 1e6
    for factor in (0.0, 1.0, 10.0):
        (out,), clipped = clip_contributions([v], factor)
        assert clipped == [] and torch.equal(out, v.double())


def test_a_1000x_member_in_a_two_member_round_is_bounded():
    honest = torch.randn(64, dtype=torch.float64)
    attacker = 1000 * torch.randn(64, dtype=torch.float64)
    (h, a), clipped = clip_contributions([honest, attacker], 10.0)
    assert clipped == [1] and torch.equal(h, honest)
    assert math.isclose(float(a.norm()), float(honest.norm()), rel_tol=1e-12)
    # The merged delta is no longer than an honest contribution.
    merged = weighted_mean([h, a], [1.0, 1.0])
    assert float(merged.norm()) <= float(honest.norm()) * (1 + 1e-12)


def test_a_1000x_member_among_four_is_cut_to_factor_times_the_median():
    torch.manual_seed(0)
    honest = [torch.randn(64, dtype=torch.float64) * s for s in (1.0, 1.2, 0.9)]
    attacker = 1000 * torch.randn(64, dtype=torch.float64)
    out, clipped = clip_contributions([*honest, attacker], 3.0)
    assert clipped == [3]
    assert all(torch.equal(o, h) for o, h in zip(out, honest))
    median = sorted(float(v.norm()) for v in [*honest, attacker])[1]
    assert math.isclose(float(out[3].norm()), median, rel_tol=1e-12)
    # The direction is kept.
    assert torch.allclose(out[3] / out[3].norm(), attacker / attacker.norm(), rtol=0, atol=1e-12)


def test_zero_contributions_do_not_clip_the_others_to_zero():
    v = torch.randn(16, dtype=torch.float64)
    out, clipped = clip_contributions([torch.zeros(16), v], 2.0)
    assert clipped == [] and torch.equal(out[1], v)
    out, clipped = clip_contributions([torch.zeros(16), torch.zeros(16)], 2.0)
    assert clipped == [] and all(float(o.abs().sum()) == 0 for o in out)


def test_lower_median_and_scalars():
    assert lower_median([]) == 0.0 and lower_median([0.0, -1.0]) == 0.0
    assert lower_median([5.0]) == 5.0
    assert lower_median([1.0, 1000.0]) == 1.0
    assert lower_median([3.0, 1.0, 2.0]) == 2.0
    assert lower_median([4.0, 1.0, 3.0, 2.0]) == 2.0
    assert clip_scalars([1.0, 1e9, 2.0], 4.0) == ([1.0, 2.0, 2.0], [1])
    assert clip_scalars([1.0, 7.9, 2.0], 4.0) == ([1.0, 7.9, 2.0], [])  # honest spread below the factor stays
    assert clip_scalars([1.0, 1e9], 0.0) == ([1.0, 1e9], [])
    assert clip_bound([1.0, 2.0], 0.0) == math.inf


@pytest.mark.parametrize("factor", [0.5, -1.0, math.nan])
def test_factors_below_one_are_refused(factor):
    with pytest.raises(ValueError):
        clip_bound([1.0], factor)


def naive_clip_influence(weights, sizes, factor):
    products = [w * n for w, n in zip(weights, sizes)]
    positive = sorted(p for p in products if p > 0)
    if factor == 0 or not positive:
        return list(weights), []
    median = positive[(len(positive) - 1) // 2]
    out, cut = [], []
    for i, (w, n, p) in enumerate(zip(weights, sizes, products)):
        if p > factor * median:
            out.append(median / n)
            cut.append(i)
        else:
            out.append(w)
    return out, cut


def test_clip_influence_matches_naive_reference():
    rng = random.Random(0)
    for _ in range(500):
        m = rng.randint(1, 7)
        weights = [rng.choice([0.0, rng.uniform(0.1, 10.0)]) for _ in range(m)]
        sizes = [rng.choice([0.0, rng.uniform(0.1, 10.0), rng.uniform(0.1, 10.0) * 1e3]) for _ in range(m)]
        for factor in (0.0, 1.0, 4.0):
            got, cut = clip_influence(weights, sizes, factor)
            want, want_cut = naive_clip_influence(weights, sizes, factor)
            assert cut == want_cut and got == pytest.approx(want, rel=1e-12)


def test_weight_and_norm_each_just_inside_their_clips_weigh_one_member_jointly():
    """The second review's attack: a negated delta at 3x the norm declaring 3x the token weight passes the norm
    clip and the weight clip (each 4x the lower median), and weighed 9 honest members in the mean."""
    honest = [torch.tensor([1.0, 0.5]), torch.tensor([0.9, 0.6]), torch.tensor([1.1, 0.4])]
    attacker = -3.0 * torch.tensor([1.0, 0.5])
    values, cut = clip_contributions(honest + [attacker], 4.0)
    weights, cut_w = clip_scalars([1.0, 1.0, 1.0, 3.0], 4.0)
    assert cut == [] and cut_w == []  # each alone lets it through
    sizes = [float(torch.linalg.vector_norm(v)) for v in values]
    weights, cut_i = clip_influence(weights, sizes, 4.0)
    assert cut_i == [3]
    influence = [w * n for w, n in zip(weights, sizes)]
    assert influence[3] == pytest.approx(sorted(influence[:3])[1])  # the lower median of the four
    before = weighted_mean(values, [1.0, 1.0, 1.0, 3.0])
    after = weighted_mean(values, weights)
    assert before[0] < 0 < after[0]  # the mean pointed against the honest members; now it points with them


def _naive_clipping(weights, norms, sizes, factor, rda):
    """What the reducer did before ``clip_members``: each clip in turn, on the values themselves."""
    vectors = [torch.full((1,), float(s), dtype=torch.float64) for s in sizes]
    vectors, cut = clip_contributions(vectors, factor)
    scales = [float(v[0]) / s if s else 1.0 for v, s in zip(vectors, sizes)]
    weights, cut_w = clip_scalars(weights, factor)
    norms, cut_n = clip_scalars(norms, factor)
    clipped_sizes = [float(v[0]) for v in vectors]
    weights, cut_i = clip_influence(weights, norms if rda else clipped_sizes, factor)
    return scales, weights, norms, clipped_sizes, sorted(set(cut) | set(cut_w) | set(cut_n) | set(cut_i))


@pytest.mark.parametrize("rda", [False, True])
def test_clip_members_decides_from_scalars_what_the_clips_do(rda):
    from atoll.models.robust import clip_members

    rng = random.Random(3)
    for trial in range(300):
        m = rng.randint(2, 7)
        weights = [rng.choice([1.0, 2.0, rng.uniform(0.1, 5), rng.uniform(5, 50)]) for _ in range(m)]
        norms = [rng.choice([1.0, rng.uniform(0.1, 3), rng.uniform(3, 30), 0.0]) for _ in range(m)]
        sizes = [rng.choice([1.0, rng.uniform(0.1, 3), rng.uniform(3, 30)]) for _ in range(m)]
        got = clip_members(weights, norms, sizes, 4.0, rda)
        scales, w, n, s, cut = _naive_clipping(weights, norms, sizes, 4.0, rda)
        assert got.scales == pytest.approx(scales, rel=1e-12)
        assert got.weights == pytest.approx(w, rel=1e-12) and got.norms == n
        assert got.sizes == pytest.approx(s, rel=1e-12) and got.clipped == cut
    assert clip_members([1.0, 9.0], [1.0, 1.0], [1.0, 100.0], 0.0, rda).scales == [1.0, 1.0]  # clipping off


def _vectors(rng, m, n, kind):
    base = torch.randn(n, generator=rng, dtype=torch.float64)
    if kind == "correlated":  # honest deltas of one step from one replica: alike, each its own noise
        return [base + 0.5 * torch.randn(n, generator=rng, dtype=torch.float64) for _ in range(m)]
    if kind == "sparse":
        return [torch.randn(n, generator=rng, dtype=torch.float64) * (torch.rand(n, generator=rng) < 0.1)
                for _ in range(m)]
    # extreme: every member pushes all coordinates one way, with norms that differ by orders of magnitude
    return [base.abs() * 10.0 ** (k - m / 2) for k in range(m)]


@pytest.mark.parametrize("rule", ["clip", "trimmed", "centered"])
@pytest.mark.parametrize("kind", ["correlated", "sparse", "extreme"])
def test_merge_bound_bounds_every_merge(rule, kind):
    from atoll.models.robust import MergeRule, merge_bound, robust_merge

    rng = torch.Generator().manual_seed(11)
    pick = random.Random(5)
    for m in range(1, 8):
        for _ in range(6):
            vectors = _vectors(rng, m, 257, kind)
            weights = [pick.uniform(0.5, 4.0) for _ in range(m)]
            sizes = [float(torch.linalg.vector_norm(v)) for v in vectors]
            merged = float(torch.linalg.vector_norm(robust_merge(vectors, weights, MergeRule(rule))))
            assert merged <= merge_bound(MergeRule(rule), weights, sizes) * (1 + 1e-12)
            # One member (the reducer) sends anything at all: the trimmed bound without it still holds.
            e = pick.randrange(m)
            wild = [v if i != e else v * -1e6 for i, v in enumerate(vectors)]
            wild_sizes = [float(torch.linalg.vector_norm(v)) for v in wild]
            merged = float(torch.linalg.vector_norm(robust_merge(wild, weights, MergeRule(rule))))
            assert merged <= merge_bound(MergeRule(rule), weights, wild_sizes, exclude=e) * (1 + 1e-12)


def test_merge_bound_of_a_trimmed_mean_ignores_the_excluded_member():
    from atoll.models.robust import MergeRule, merge_bound

    sizes = [1.0, 1.0, 1.0, 4.0]
    assert merge_bound(MergeRule.TRIMMED, [1.0] * 4, sizes, exclude=3) == pytest.approx(math.sqrt(3.0))
    assert merge_bound(MergeRule.TRIMMED, [1.0] * 4, sizes) == pytest.approx(math.sqrt(19 / 2))
    assert merge_bound(MergeRule.CLIP, [1.0, 3.0], [2.0, 1.0]) == pytest.approx(5 / 4)
    assert merge_bound(MergeRule.TRIMMED, [1.0, 3.0], [2.0, 1.0], exclude=0) == pytest.approx(5 / 4)  # two: a mean

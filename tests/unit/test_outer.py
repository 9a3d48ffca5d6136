"""Outer-loop math against naive references, and DiLoCo's degenerate case against plain training."""

import math

import pytest
import torch

from atoll.models.configs import MODELS
from atoll.models.data import Corpus, load_corpus
from atoll.models.fragments import copy_into, flatten
from atoll.models.outer import NesterovOuter, pseudo_gradient, tensor_hash, weighted_mean
from atoll.node.config import RunConfig
from atoll.node.device import resolve_device
from atoll.node.island.learner import Learner
from atoll.node.rounds.replica import Replica


def test_nesterov_matches_hand_written_reference():
    torch.manual_seed(0)
    params, buf = torch.randn(50), torch.zeros(50)
    ref_p, ref_b = params.tolist(), [0.0] * 50
    opt = NesterovOuter(lr=0.7, momentum=0.9)
    for _ in range(4):
        delta = torch.randn(50) * 0.1
        opt.step(params, buf, delta.double())
        for i, d in enumerate(delta.double().tolist()):
            ref_b[i] = 0.9 * ref_b[i] + d
            ref_p[i] = ref_p[i] - 0.7 * (d + 0.9 * ref_b[i])
            ref_b[i] = float(torch.tensor(ref_b[i], dtype=torch.float32))  # state is stored in fp32
            ref_p[i] = float(torch.tensor(ref_p[i], dtype=torch.float32))
    assert params.tolist() == ref_p
    assert buf.tolist() == ref_b


def test_nesterov_chunking_does_not_change_the_result():
    torch.manual_seed(1)
    p1, b1, delta = torch.randn(1000), torch.randn(1000), torch.randn(1000).double()
    p2, b2 = p1.clone(), b1.clone()
    NesterovOuter().step(p1, b1, delta)
    NesterovOuter().step(p2, b2, delta, chunk=7)
    assert torch.equal(p1, p2) and torch.equal(b1, b2)


def test_sibling_lines_averaged_by_their_weights_equal_one_round_of_every_member():
    """The ground of the sibling merge (docs/design.md, "Past one group"): the outer step is linear in its delta
    given one base and one momentum, so G groups that merged their own means from one replica, averaged by the
    weight each merged, give what one group of all their members would have given (a mean round; RDA is not
    linear). Checked in float64 against that one round."""
    torch.manual_seed(1)
    opt = NesterovOuter(lr=0.7, momentum=0.9)
    base, momentum = torch.randn(40, dtype=torch.float64), torch.randn(40, dtype=torch.float64) * 0.1
    groups = [[torch.randn(40, dtype=torch.float64) for _ in range(n)] for n in (3, 5, 2)]
    weights = [[float(w) for w in torch.randint(1, 9, (len(g),))] for g in groups]
    lines = []
    for deltas, ws in zip(groups, weights):
        params, buf = base.clone(), momentum.clone()
        opt.step(params, buf, weighted_mean(deltas, ws))
        lines.append((params, buf, sum(ws)))
    total = sum(w for _, _, w in lines)
    merged_params = sum(p * w for p, _, w in lines) / total
    merged_buf = sum(b * w for _, b, w in lines) / total
    params, buf = base.clone(), momentum.clone()
    opt.step(params, buf, weighted_mean([d for g in groups for d in g], [w for ws in weights for w in ws]))
    assert torch.allclose(merged_params, params, rtol=0, atol=1e-12)
    assert torch.allclose(merged_buf, buf, rtol=0, atol=1e-12)


def test_delayed_nesterov_over_a_period_is_one_nesterov_step_on_the_mean_of_its_deltas():
    """Delayed Nesterov (period N): the rounds between momentum steps move Θ by lr/N of their deltas, and after the
    N-th round Θ is where one Nesterov step on the mean of the N deltas puts it; checked in float64 against a
    naive Nesterov over three periods, from a nonzero momentum, at every version phase."""
    torch.manual_seed(2)
    n, lr, mu = 4, 0.7, 0.9
    dn = NesterovOuter(lr, mu, period=n)
    params = torch.randn(30, dtype=torch.float64)
    m = torch.randn(30, dtype=torch.float64) * 0.1
    buf = mu * m  # the stored buffer at a period's start: μ·m
    ref_p, ref_m = params.clone(), m.clone()
    for period in range(3):
        deltas = [torch.randn(30, dtype=torch.float64) * 0.1 for _ in range(n)]
        for i, d in enumerate(deltas):
            before = params.clone()
            dn.step(params, buf, d, version=period * n + i)
            if i < n - 1:  # no momentum in between: exactly lr·Δ/N
                assert torch.allclose(before - params, lr * d / n, rtol=0, atol=1e-12)
        mean = sum(deltas) / n
        ref_m = mu * ref_m + mean
        ref_p = ref_p - lr * (mean + mu * ref_m)
        assert torch.allclose(params, ref_p, rtol=0, atol=1e-12)
        assert torch.allclose(buf, mu * ref_m, rtol=0, atol=1e-12)


def test_delayed_nesterov_with_no_momentum_is_plain_sgd_on_each_delta_and_its_phase_is_the_version():
    torch.manual_seed(3)
    p1, b1 = torch.randn(20), torch.zeros(20)
    p2, b2 = p1.clone(), b1.clone()
    d = torch.randn(20).double()
    NesterovOuter(1.0, 0.0, period=3).step(p1, b1, d, version=5)
    assert torch.allclose(p1.double(), p2.double() - d / 3, rtol=0, atol=1e-6)
    p3, b3 = p2.clone(), torch.randn(20)
    b4 = b3.clone()
    NesterovOuter(0.7, 0.9, period=3).step(p2, b3, d, version=1)  # mid-period: the buffer only accumulates
    NesterovOuter(0.7, 0.9, period=3).step(p3, b4, d, version=2)  # version 2 -> 3 closes the period
    assert not torch.equal(p2, p3) and not torch.equal(b3, b4)


def test_nesterov_rejects_bad_hyperparameters():
    with pytest.raises(ValueError):
        NesterovOuter(lr=0)
    with pytest.raises(ValueError):
        NesterovOuter(momentum=1.0)
    with pytest.raises(ValueError):
        NesterovOuter(period=0)


def test_weighted_mean_matches_naive_loop():
    torch.manual_seed(2)
    deltas = [torch.randn(33) for _ in range(4)]
    weights = [3.0, 1.0, 7.5, 0.25]
    got = weighted_mean(deltas, weights)
    total = sum(weights)
    for i in range(33):
        expect = sum(w * float(d[i]) for d, w in zip(deltas, weights)) / total
        assert math.isclose(float(got[i]), expect, rel_tol=1e-12, abs_tol=1e-15)


def test_weighted_mean_of_one_is_exact_and_rejects_bad_weights():
    d = torch.randn(100).double()
    assert torch.equal(weighted_mean([d], [12345.0]), d)
    with pytest.raises(ValueError):
        weighted_mean([d, d], [1.0, 0.0])
    with pytest.raises(ValueError):
        weighted_mean([], [])


def test_pseudo_gradient_and_flatten_roundtrip():
    a, b = torch.randn(10), torch.randn(10)
    assert torch.equal(pseudo_gradient(a, b), a.double() - b.double())
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    flat = flatten(params)
    target = torch.randn(flat.numel())
    copy_into(target, params)
    assert torch.equal(flatten(params), target)
    with pytest.raises(ValueError):
        copy_into(torch.zeros(3), params)


def test_tensor_hash_is_content_hash():
    a = torch.arange(10.0)
    assert tensor_hash(a) == tensor_hash(a.clone())
    b = a.clone()
    b[3] = torch.nextafter(b[3], torch.tensor(100.0))
    assert tensor_hash(a) != tensor_hash(b)


def _learner(run: RunConfig) -> Learner:
    tokens, _ = load_corpus("builtin")
    corpus = Corpus(tokens, MODELS[run.model].seq_len, run.num_shards)
    return Learner(run, resolve_device("cpu"), corpus, shard=3, batch_size=4)


def test_one_daemon_diloco_with_lr1_momentum0_equals_plain_training_bit_for_bit():
    run = RunConfig(model="nano", sync_every=5, outer_lr=1.0, outer_momentum=0.0)
    plain, diloco = _learner(run), _learner(run)
    replica = Replica([diloco.flat_params()])
    outer = NesterovOuter(run.outer_lr, run.outer_momentum)
    for _ in range(4):
        for _ in range(run.sync_every):
            plain.train_step()
            diloco.train_step()
        theta, (version, _) = replica.params_and_id(0)
        merged = weighted_mean([pseudo_gradient(theta, diloco.flat_params())], [float(diloco.tokens)])
        assert replica.apply_outer_step(0, version, merged, 1.0, outer)
        diloco.load_flat(replica.params_and_id(0)[0])
    assert torch.equal(plain.flat_params(), diloco.flat_params())
    assert replica.identity(0)[0] == 4


def test_outer_step_is_deterministic_across_replicas():
    torch.manual_seed(3)
    theta = torch.randn(500)
    r1, r2 = Replica([theta]), Replica([theta.clone()])
    outer = NesterovOuter()
    for v in range(3):
        delta = torch.randn(500).double() * 0.01
        result = r1.apply_outer_step(0, v, delta, 2.0, outer)
        assert result == r2.apply_outer_step(0, v, delta.clone(), 2.0, outer) == r1.identity(0)  # the new identity
        assert result[0] == v + 1 and result[1] == 2.0 * (v + 1)
    assert r1.identities() == r2.identities()
    assert not r1.apply_outer_step(0, 0, delta, 1.0, outer)  # stale version: refused

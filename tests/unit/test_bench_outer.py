"""scripts/bench_outer.py's DiLoCo against a naive reference: with plain averaging (lr 1, momentum 0) Θ after a
round is the mean of the learners' parameters; with Nesterov, the same rounds computed by hand."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from atoll.models.configs import get_model_config
from atoll.models.data import Corpus, load_corpus
from atoll.models.outer import flatten_params
from atoll.node.config import RunConfig
from atoll.node.device import resolve_device
from atoll.node.learner import Learner

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("atoll_scripts_bench_outer", ROOT / "scripts" / "bench_outer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def make(n=4):
    run = RunConfig(model="nano")
    tokens, _ = load_corpus(run.data)
    corpus = Corpus(tokens, get_model_config(run.model).seq_len, run.num_shards)
    return [Learner(run, resolve_device("cpu"), corpus, s, 2) for s in range(n)]


def naive(steps, sync_every, lr, momentum):
    """The same rounds in float64, written out: Θ ← Θ − lr·(Δ + μ·b), b ← μ·b + Δ, Δ the mean of Θ − θᵢ."""
    ls = make()
    theta = flatten_params(ls[0].params).double()
    buf = torch.zeros_like(theta)
    for step in range(1, steps + 1):
        for learner in ls:
            learner.train_step()
        if step % sync_every == 0 or step == steps:
            delta = sum(theta - flatten_params(learner.params).double() for learner in ls) / len(ls)
            buf = momentum * buf + delta
            theta = theta - lr * (delta + momentum * buf)
            for learner in ls:
                learner.load_flat(theta.float())
    return theta


@pytest.mark.parametrize("lr, momentum", [(1.0, 0.0), (0.7, 0.9)])
def test_diloco_rounds_match_the_naive_reference(bench, lr, momentum):
    got = bench.diloco(make(), steps=5, sync_every=2, lr=lr, momentum=momentum)  # rounds at 2, 4 and the last, 5
    want = naive(5, 2, lr, momentum)
    assert torch.allclose(got.double(), want, atol=1e-6, rtol=0)


def test_plain_averaging_is_the_mean_of_the_learners(bench):
    ls = make()
    theta0 = flatten_params(ls[0].params)
    trained = make()
    for learner in trained:
        for _ in range(3):
            learner.train_step()
    mean = torch.stack([flatten_params(learner.params) for learner in trained]).double().mean(0)
    got = bench.diloco(ls, steps=3, sync_every=3, lr=1.0, momentum=0.0)
    assert not torch.equal(got, theta0)
    assert torch.allclose(got.double(), mean, atol=1e-6, rtol=0)


def test_config_parsing(bench):
    assert bench.parse_config("ddp") == {"config": "ddp"}
    assert bench.parse_config("40,0.7,0.9") == {"config": "40,0.7,0.9", "sync_every": 40, "outer_lr": 0.7,
                                                 "outer_momentum": 0.9}
    with pytest.raises(SystemExit, match="bad config"):
        bench.parse_config("40,0.7")

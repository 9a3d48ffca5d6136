"""scripts/bench_outer.py's DiLoCo against a naive reference: with plain averaging (lr 1, momentum 0) Θ after a
round is the mean of the learners' parameters; with Nesterov, the same rounds computed by hand."""


import pytest
import torch

from atoll.models.configs import get_model_config
from atoll.models.data import Corpus, load_corpus
from atoll.models.fragments import flatten
from atoll.node.config import RunConfig
from atoll.node.device import resolve_device
from atoll.node.island.learner import Learner



@pytest.fixture(scope="module")
def bench():
    from scripts import bench_outer

    return bench_outer


def make(n=4):
    run = RunConfig(model="nano")
    tokens, _ = load_corpus(run.data)
    corpus = Corpus(tokens, get_model_config(run.model).seq_len, run.num_shards)
    return [Learner(run, resolve_device("cpu"), corpus, s, 2) for s in range(n)]


def naive(steps, sync_every, lr, momentum, round_steps=None):
    """The same rounds in float64, written out: Θ ← Θ − lr·(Δ + μ·b), b ← μ·b + Δ, Δ the mean of Θ − θᵢ.
    Rounds after every ``sync_every`` steps and the last, or at ``round_steps`` when given."""
    ls = make()
    theta = flatten(ls[0].params).double()
    buf = torch.zeros_like(theta)
    for step in range(1, steps + 1):
        for learner in ls:
            learner.train_step()
        if (step in round_steps) if round_steps is not None else (step % sync_every == 0 or step == steps):
            delta = sum(theta - flatten(learner.params).double() for learner in ls) / len(ls)
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
    theta0 = flatten(ls[0].params)
    trained = make()
    for learner in trained:
        for _ in range(3):
            learner.train_step()
    mean = torch.stack([flatten(learner.params) for learner in trained]).double().mean(0)
    got = bench.diloco(ls, steps=3, sync_every=3, lr=1.0, momentum=0.0)
    assert not torch.equal(got, theta0)
    assert torch.allclose(got.double(), mean, atol=1e-6, rtol=0)


def test_config_parsing(bench):
    assert bench.parse_config("ddp") == {"config": "ddp"}
    assert bench.parse_config("40,0.7,0.9") == {"config": "40,0.7,0.9", "sync_every": 40, "outer_lr": 0.7,
                                                 "outer_momentum": 0.9, "warm": [0, 0]}
    assert bench.parse_config("40,1,0,2x60")["warm"] == [2, 60]
    with pytest.raises(SystemExit, match="bad config"):
        bench.parse_config("40,0.7")


def test_warm_start_rounds_come_every_h0_steps_then_every_h(bench):
    # H0 = 1 for the first 2 steps, then H = 3: rounds after steps 1, 2, 5 and the last, 7.
    got = bench.diloco(make(), steps=7, sync_every=3, lr=0.7, momentum=0.9, warm=(1, 2))
    want = naive(7, None, 0.7, 0.9, round_steps={1, 2, 5, 7})
    assert torch.allclose(got.double(), want, atol=1e-6, rtol=0)


def test_cosine_schedule_against_its_formula(bench):
    base, warm, total = 2e-3, 4, 20
    lrs = [bench.cosine_lr(base, warm, step, total) for step in range(total)]
    assert lrs[:warm] == pytest.approx([base * (i + 1) / warm for i in range(warm)])
    assert lrs[warm] == pytest.approx(base)
    assert lrs[-1] == pytest.approx(0.1 * base)
    mid = warm + (total - 1 - warm) / 2  # half-way down the cosine: the mean of base and the floor
    assert bench.cosine_lr(base, warm, mid, total) == pytest.approx(0.55 * base)
    assert all(a >= b for a, b in zip(lrs[warm:], lrs[warm + 1:]))


def test_cosine_learners_use_the_schedule(bench):
    run = RunConfig(model="nano", inner_lr=1e-3, warmup_steps=2)
    ls, _ = bench.learners(run, 2, "cosine", steps=10)
    learner = ls[0]
    for step in range(10):
        assert learner._lr() == pytest.approx(bench.cosine_lr(1e-3, 2, step, 10))
        learner.train_step()


@pytest.mark.parametrize("text", ["40,1", "0,1,0", "40,1,0,2", "40,1,0,0x5", "40,1,0,2x5,3"])
def test_bad_configs_are_refused(bench, text):
    with pytest.raises(SystemExit, match="bad config"):
        bench.parse_config(text)

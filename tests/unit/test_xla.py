"""The xla device path, exercised for real when torch_xla is importable (``PJRT_DEVICE=CPU`` works anywhere)."""

import os

import pytest
import torch

from atoll.node.device import xla_available

pytestmark = pytest.mark.skipif(not xla_available(), reason="torch_xla is not installed in this environment")


def test_xla_learner_trains_and_matches_cpu():
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    from atoll.models.configs import MODELS
    from atoll.models.data import Corpus, load_corpus
    from atoll.node.config import RunConfig
    from atoll.node.device import resolve_device
    from atoll.node.learner import Learner

    run = RunConfig(model="nano")
    tokens, _ = load_corpus("builtin")
    corpus = Corpus(tokens, MODELS["nano"].seq_len, run.num_shards)
    xla = Learner(run, resolve_device("xla"), corpus, 0, 4)
    cpu = Learner(run, resolve_device("cpu"), corpus, 0, 4)
    for _ in range(3):
        lx, lc = xla.train_step(), cpu.train_step()
    assert abs(lx - lc) < 1e-2
    assert torch.allclose(xla.flat_params(), cpu.flat_params(), atol=1e-3)

"""scripts/bench_models.py: the Llama it matches to a GPT has the GPT's parameter count (within 2%, and the
closest SwiGLU width), its held-out batches, and its round-by-round DiLoCo equal to bench_outer's one call."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from atoll.models.data import Corpus
from atoll.models.fragments import flatten
from atoll.models.gpt import GPTConfig
from atoll.node.config import RunConfig
from atoll.node.device import resolve_device
from atoll.node.island.learner import Learner



@pytest.fixture(scope="module")
def bench():
    from scripts import bench_models

    return bench_models


@pytest.mark.parametrize("vocab,d,layers,heads", [(1024, 128, 4, 4), (2048, 128, 4, 4), (1024, 192, 6, 6),
                                                   (512, 64, 2, 4)])
def test_matched_llama_has_the_gpts_parameter_count(bench, vocab, d, layers, heads):
    gpt = GPTConfig(vocab_size=vocab, seq_len=32, d_model=d, n_layers=layers, n_heads=heads)
    llama = bench.matched_llama(gpt, n_kv_heads=2)
    assert (llama.vocab_size, llama.d_model, llama.n_layers, llama.n_heads) == (vocab, d, layers, heads)
    assert not llama.tie_embeddings and llama.ffn_dim % 8 == 0
    assert abs(llama.num_params / gpt.num_params - 1) < 0.02
    for other in (llama.ffn_dim - 8, llama.ffn_dim + 8):  # no other width of the grid is closer
        if other > 0:
            assert abs(replace(llama, ffn_dim=other).num_params - gpt.num_params) >= \
                abs(llama.num_params - gpt.num_params)
    for cfg in (gpt, llama):  # the counts are the modules' own
        assert sum(p.numel() for p in bench.build(cfg, 0).parameters()) == cfg.num_params


def test_matched_llama_refuses_when_the_head_alone_is_too_large(bench):
    gpt = GPTConfig(vocab_size=65536, seq_len=32, d_model=64, n_layers=1, n_heads=4)
    with pytest.raises(ValueError, match="more than"):
        bench.matched_llama(gpt, n_kv_heads=2)


def test_embedding_params(bench):
    gpt = GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=2, n_heads=4)
    llama = bench.matched_llama(gpt, n_kv_heads=2)
    assert bench.embedding_params(gpt) == 256 * 64
    assert bench.embedding_params(llama) == 2 * 256 * 64


def test_held_out_batches_are_fixed_distinct_windows(bench):
    tokens = np.arange(10_000, dtype=np.uint16)
    batches = bench.held_out_batches(tokens, 15, 4, 3)
    assert len(batches) == 4 and all(b.shape == (3, 16) for b in batches)
    starts = [int(row[0]) for b in batches for row in b]
    assert starts == sorted(set(starts)) and all(s % 16 == 0 for s in starts)
    with pytest.raises(ValueError, match="too small"):
        bench.held_out_batches(tokens[:100], 15, 4, 3)


def _learners(bench, cfg, corpus, seed=0):
    run = RunConfig(model="bench", seed=seed, num_shards=16, warmup_steps=2)
    state = bench.build(cfg, seed).state_dict()
    ls = []
    for i in range(4):
        model = bench.build(cfg, seed)
        model.load_state_dict(state)
        ls.append(Learner(run, resolve_device("cpu"), corpus, i, 2, model=model))
    return ls


def test_round_by_round_diloco_equals_one_call(bench):
    torch.set_num_threads(1)
    gpt = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=1, n_heads=2)
    llama = bench.matched_llama(gpt, n_kv_heads=1)
    corpus = Corpus(np.random.default_rng(0).integers(0, 64, 40_000).astype(np.uint16), 16, 16)
    for cfg in (gpt, llama):
        one = _learners(bench, cfg, corpus)
        theta = bench.diloco(one, 7, 3, 1.0, 0.0)
        chunked = _learners(bench, cfg, corpus)
        for chunk in (3, 3, 1):
            bench.diloco(chunked, chunk, 3, 1.0, 0.0)
        assert torch.equal(flatten(chunked[0].params), theta)
        assert all(torch.equal(flatten(learner.params), theta) for learner in chunked)

"""Deterministic sharding, resume position, held-out split, and corpus loading."""

import numpy as np
import pytest
import torch

from atoll.models.data import BLOCK_TOKENS, Corpus, load_corpus, shard_for_peer


def test_shard_for_peer_is_stable_and_spread():
    assert shard_for_peer("QmAbc", 16) == shard_for_peer("QmAbc", 16)
    shards = {shard_for_peer(f"peer{i}", 16) for i in range(200)}
    assert len(shards) == 16


def test_batches_are_a_pure_function_of_position():
    tokens = np.arange(60 * BLOCK_TOKENS, dtype=np.uint16) % 251
    a, b = Corpus(tokens, 32, 4), Corpus(tokens.copy(), 32, 4)
    # A reader resumed at position 40 sees what an uninterrupted reader sees after 40 windows.
    assert torch.equal(a.batch_at(2, 40, 8), b.batch_at(2, 40, 8))
    assert not torch.equal(a.batch_at(2, 40, 8), a.batch_at(2, 48, 8))
    assert not torch.equal(a.batch_at(1, 40, 8), a.batch_at(2, 40, 8))
    n = a.windows_in_shard(2)
    assert torch.equal(a.batch_at(2, n, 8), a.batch_at(2, 0, 8))  # wraps around


def test_held_out_is_disjoint_from_training_shards():
    # Each block holds its own index so that we can tell where a window came from.
    n_blocks = 100
    tokens = np.repeat(np.arange(n_blocks, dtype=np.uint16), BLOCK_TOKENS)
    corpus = Corpus(tokens, 32, 4)
    held = {int(v) for batch in corpus.held_out(4, 8) for v in batch.unique()}
    train = set()
    for s in range(4):
        for pos in range(0, corpus.windows_in_shard(s), 97):
            train |= {int(v) for v in corpus.batch_at(s, pos, 1).unique()}
    assert held and train and not held & train
    assert held == {49, 99}


def test_corpus_rejects_too_little_data():
    with pytest.raises(ValueError):
        Corpus(np.zeros(2 * 33 - 1, dtype=np.uint16), 32, 4)  # less than a training and a held-out window


def test_builtin_corpus_is_bytes_and_cached():
    tokens, vocab = load_corpus("builtin")
    assert vocab == 256 and tokens.dtype == np.uint16 and tokens.max() < 256 and tokens.size > 1_000_000
    again, _ = load_corpus("builtin")
    assert np.array_equal(tokens[:1000], again[:1000])


def test_load_text_folder_and_bin_shards(tmp_path):
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_bytes(b"hello world")
    tokens, vocab = load_corpus(str(tmp_path / "txt"))
    assert vocab == 256 and bytes(tokens.astype(np.uint8)) == b"hello world"
    (tmp_path / "bin").mkdir()
    np.array([1, 500, 7], dtype=np.uint16).tofile(tmp_path / "bin" / "shard0.bin")
    tokens, vocab = load_corpus(str(tmp_path / "bin"))
    assert tokens.tolist() == [1, 500, 7] and vocab == 501
    with pytest.raises(ValueError):
        load_corpus(str(tmp_path / "missing"))

"""A small corpus trains (smaller blocks, fewer shards); below the minimum, one clear error naming it."""

import numpy as np
import pytest

from atoll.models.data import HELD_OUT_EVERY, Corpus, min_corpus_tokens


def test_a_few_hundred_kilobytes_train_with_smaller_blocks():
    tokens = (np.arange(300_000) % 251).astype(np.uint16)  # the review's "few hundred KB" that raised before
    corpus = Corpus(tokens, 128, 16)
    assert corpus.shards == 16 and corpus.block == 300_000 // HELD_OUT_EVERY
    assert corpus.batch_at(15, 0, 8).shape == (8, 129)
    assert len(corpus.held_out(2, 4)) == 2


def test_the_minimum_corpus_trains_on_fewer_shards_the_same_everywhere():
    seq = 32
    tokens = np.repeat(np.arange(HELD_OUT_EVERY, dtype=np.uint16), seq + 1)  # each block (one window) its index
    assert tokens.size == min_corpus_tokens(seq)
    corpus = Corpus(tokens, seq, 64)
    assert corpus.shards == HELD_OUT_EVERY - 1  # fewer training blocks than shards: one block per shard
    held = {int(v) for b in corpus.held_out(1, 2) for v in b.unique()}
    assert held == {HELD_OUT_EVERY - 1}
    for shard in (0, 48, 49, 63):  # shards past the last read shard mod 49, like any daemon does
        window = corpus.batch_at(shard, 0, 1)
        assert {int(v) for v in window.unique()} <= set(range(HELD_OUT_EVERY - 1))
        assert np.array_equal(window, Corpus(tokens.copy(), seq, 64).batch_at(shard, 0, 1))
    assert np.array_equal(corpus.batch_at(63, 0, 1), corpus.batch_at(63 % 49, 0, 1))


def test_below_the_minimum_one_line_names_it():
    with pytest.raises(ValueError, match=f"at least {min_corpus_tokens(64)}") as e:
        Corpus(np.zeros(min_corpus_tokens(64) - 1, dtype=np.uint16), 64, 4)
    assert "\n" not in str(e.value)

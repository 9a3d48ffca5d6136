"""A small corpus trains (smaller blocks, fewer shards); below the minimum, one clear error naming it."""

import numpy as np
import pytest

from atoll.models.data import HELD_OUT_EVERY, MIN_WINDOWS, Corpus, min_corpus_tokens


def test_a_few_hundred_kilobytes_train_with_smaller_blocks():
    tokens = (np.arange(300_000) % 251).astype(np.uint16)  # the review's "few hundred KB" that raised before
    corpus = Corpus(tokens, 128, 16)
    assert corpus.shards == 16 and corpus.block == 300_000 // HELD_OUT_EVERY
    assert corpus.batch_at(15, 0, 8).shape == (8, 129)
    assert len(corpus.held_out(2, 4)) == 2


def test_the_minimum_corpus_trains_on_fewer_shards_the_same_everywhere():
    seq = 32
    tokens = np.repeat(np.arange(MIN_WINDOWS, dtype=np.uint16), seq + 1)  # each block (one window) its index
    assert tokens.size == min_corpus_tokens(seq)
    corpus = Corpus(tokens, seq, 64)
    assert corpus.shards == 1  # one training window: every shard reads it
    held = {int(v) for b in corpus.held_out(2, 8) for v in b.unique()}
    assert held == {1}
    for shard in (0, 1, 63):
        batch = corpus.batch_at(shard, 0, 8)  # a whole batch of the one window, wrapping
        assert batch.shape == (8, seq + 1) and {int(v) for v in batch.unique()} == {0}
        assert np.array_equal(batch, Corpus(tokens.copy(), seq, 64).batch_at(shard, 0, 8))


@pytest.mark.parametrize("windows", [3, 17, HELD_OUT_EVERY - 1, HELD_OUT_EVERY])
def test_fewer_windows_than_held_out_blocks_hold_out_the_last_one(windows):
    seq = 16
    tokens = np.repeat(np.arange(windows, dtype=np.uint16), seq + 1)
    corpus = Corpus(tokens, seq, 4)
    assert {int(v) for b in corpus.held_out(2, 4) for v in b.unique()} == {windows - 1}
    trained = {int(v) for s in range(corpus.shards) for v in corpus.batch_at(s, 0, windows).unique()}
    assert trained == set(range(windows - 1)) and corpus.shards == min(4, windows - 1)


def test_given_held_out_tokens_are_the_held_out_split_and_every_block_trains():
    seq = 16
    tokens = np.repeat(np.arange(200, dtype=np.uint16), seq + 1)
    held_out = np.full(3 * (seq + 1), 999, dtype=np.uint16)
    corpus = Corpus(tokens, seq, 4, held_out=held_out)
    assert {int(v) for b in corpus.held_out(2, 4) for v in b.unique()} == {999}
    trained = {int(v) for s in range(4) for v in corpus.batch_at(s, 0, corpus.windows_in_shard(s)).unique()}
    assert trained == set(range(200))
    one = Corpus(tokens[: seq + 1], seq, 4, held_out=held_out)  # one training window is enough then
    assert one.shards == 1
    short = Corpus(tokens, seq, 4, held_out=held_out[:seq])  # not one window: blocks of tokens are held out
    assert 999 not in {int(v) for b in short.held_out(2, 4) for v in b.unique()}


def test_below_the_minimum_one_line_names_it():
    with pytest.raises(ValueError, match=f"at least {min_corpus_tokens(64)}") as e:
        Corpus(np.zeros(min_corpus_tokens(64) - 1, dtype=np.uint16), 64, 4)
    assert "\n" not in str(e.value)

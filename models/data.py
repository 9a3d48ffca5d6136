"""Token streams: the built-in corpus, prepared datasets (``models/dataset.py``), text files/folders, and
pre-tokenized uint16 ``.bin`` shards.

A corpus is one flat token array split into a training part and a fixed held-out part. The training part is
cut into ``num_shards`` shards; a daemon reads the shard chosen from its peer id, sequentially, in
windows of ``seq_len + 1`` tokens, wrapping around. Its ``position`` (windows consumed) is all the state needed
to resume: ``batch_at(position)`` is a pure function of (corpus, shard, position).
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch

from .dataset import PreparedDataset, is_prepared, read_manifest

BLOCK_TOKENS = 1 << 14
HELD_OUT_EVERY = 50  # one block in 50 (2%) is held out


def _builtin_files() -> list[Path]:
    """The standard library's own ``.py`` files: present on every Python install, no download needed.

    Test suites and vendored packages are skipped so the corpus is ordinary library code; the list is sorted
    by relative path so every daemon on the same Python version reads the same bytes.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo", "__pycache__")
    files = sorted(
        p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts)
    )
    return files


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "atoll"


def load_builtin_corpus() -> np.ndarray:
    """Byte-level tokens (uint16) of the built-in corpus, cached on disk after the first read."""
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-v2"
    cache = _cache_dir() / f"builtin-{tag}.bin"
    if cache.exists():
        return np.fromfile(cache, dtype=np.uint16)
    tokens = _bytes_to_tokens(b"".join(p.read_bytes() + b"\n" for p in _builtin_files()))
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    tokens.tofile(tmp)
    os.replace(tmp, cache)
    return tokens


def _bytes_to_tokens(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)


def load_corpus(spec: str) -> tuple[np.ndarray, int]:
    """Load ``builtin``, a prepared dataset (a folder holding ``atoll data prepare``'s manifest.json), a text file,
    a folder of text files, or ``.bin`` uint16 shards (a file or a folder).

    Returns (tokens, vocab_size needed). A prepared dataset gives its training split only (its held-out split is
    never trained on; ``Corpus`` holds out blocks of these tokens for the daemon's own evaluation) and its
    tokenizer's vocabulary size, even where the tokens use fewer ids. Raises ``ValueError`` with a clear one-line
    message for a bad path or a manifest or shard that does not check out.
    """
    if spec == "builtin":
        return load_builtin_corpus(), 256
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"data path {spec!r} does not exist")
    if is_prepared(path):  # before the .bin rule below: a prepared dataset's shards are .bin files too
        dataset = PreparedDataset(path)
        return dataset.tokens("train"), dataset.manifest.vocab_size
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    bins = [p for p in files if p.suffix == ".bin"]
    if bins:
        tokens = np.concatenate([np.fromfile(p, dtype=np.uint16) for p in bins])
        vocab = int(tokens.max()) + 1 if tokens.size else 0
    else:
        tokens = _bytes_to_tokens(b"".join(p.read_bytes() for p in files))
        vocab = 256
    if tokens.size == 0:
        raise ValueError(f"data path {spec!r} holds no tokens")
    return tokens, vocab


BYTES = "bytes"  # ``tokenizer_of`` byte-level data: the built-in corpus, text files


def tokenizer_of(spec: str) -> str:
    """How the data ``spec`` names was tokenized: ``BYTES`` (the built-in corpus, text files), a prepared dataset's
    tokenizer sha256, or "" (uint16 ``.bin`` shards: nobody says). Reads no more than a manifest;
    ``ValueError`` as ``load_corpus`` for a bad path or manifest."""
    if spec == "builtin":
        return BYTES
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"data path {spec!r} does not exist")
    if is_prepared(path):
        return read_manifest(path).tokenizer_sha256
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return "" if any(p.suffix == ".bin" for p in files) else BYTES


MIN_WINDOWS = 2  # one window to train on and one held out: with wrapping, each makes a batch of any size


def min_corpus_tokens(seq_len: int) -> int:
    """The smallest corpus that trains: one training window and one held-out window of ``seq_len + 1`` tokens."""
    return MIN_WINDOWS * (seq_len + 1)


def load_held_out(spec: str) -> np.ndarray | None:
    """A prepared dataset's own held-out split (``atoll data prepare --held-out``), or None where ``spec`` has
    none (any other kind of data, or a split with no tokens): ``Corpus`` then holds out blocks of the training
    tokens. ``ValueError`` as ``load_corpus``."""
    path = Path(spec)
    if spec == "builtin" or not is_prepared(path):
        return None
    tokens = PreparedDataset(path).tokens("held_out")
    return tokens if tokens.size else None


class Corpus:
    """A token array cut into blocks: every ``HELD_OUT_EVERY``-th block is held out, the rest are dealt
    round-robin to ``num_shards`` shards. Interleaving keeps shards and the held-out split alike in
    distribution even when the source is a sorted list of very different files. Given ``held_out`` tokens (a
    prepared dataset's own split, at least one window), those are the held-out split and every block trains.

    A corpus too small for ``HELD_OUT_EVERY`` blocks of ``block`` tokens gets smaller blocks (down to one window,
    then one held out in as many as there are, at least two), and one with fewer training blocks than
    ``num_shards`` fewer shards: shard ``s`` reads shard ``s mod shards`` (``shards``), the same on every daemon.
    Below ``min_corpus_tokens`` (one training window and one held out), ``ValueError`` naming that minimum.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, num_shards: int, block: int = BLOCK_TOKENS,
                 held_out: np.ndarray | None = None) -> None:
        window = seq_len + 1
        if held_out is not None and held_out.size < window:
            held_out = None  # not one window: hold out blocks of ``tokens`` as for any corpus
        need = window if held_out is not None else min_corpus_tokens(seq_len)
        if tokens.size < need:
            raise ValueError(f"corpus too small: {tokens.size} tokens; a model of sequence length {seq_len} needs "
                             f"at least {need} (" + ("one training window)" if held_out is not None else
                                                     "one training window and one held out)"))
        block = max(window, min(block, tokens.size // HELD_OUT_EVERY))
        self.seq_len, self.num_shards, self.block = seq_len, num_shards, block
        n_blocks = tokens.size // block
        ids = np.arange(n_blocks)
        every = min(HELD_OUT_EVERY, n_blocks)  # at least 2 blocks here: one is held out, the others train
        held = ids[ids % every == every - 1] if held_out is None else ids[:0]
        train = ids[ids % every != every - 1] if held_out is None else ids
        self.shards = min(num_shards, train.size)
        blocks = tokens[: n_blocks * block].reshape(n_blocks, block)
        self._shards = [blocks[train[s::self.shards]].reshape(-1) for s in range(self.shards)]
        self._held_out = blocks[held].reshape(-1) if held_out is None else held_out

    def windows_in_shard(self, shard: int) -> int:
        return self._shards[shard % self.shards].size // (self.seq_len + 1)

    def batch_at(self, shard: int, position: int, batch_size: int) -> torch.Tensor:
        """Windows ``position .. position+batch_size-1`` of ``shard`` (wrapping), as int64 [B, seq_len+1]."""
        window = self.seq_len + 1
        starts = ((position + np.arange(batch_size)) % self.windows_in_shard(shard)) * window
        idx = starts[:, None] + np.arange(window)[None, :]
        return torch.from_numpy(self._shards[shard % self.shards][idx].astype(np.int64))

    def held_out_windows(self) -> int:
        """Windows of ``seq_len + 1`` tokens in the held-out split."""
        return self._held_out.size // (self.seq_len + 1)

    def held_out(self, num_batches: int, batch_size: int) -> list[torch.Tensor]:
        """A fixed list of held-out batches (the same on every daemon), spread evenly over the held-out split."""
        window = self.seq_len + 1
        n = self._held_out.size // window
        rows = np.linspace(0, n - 1, num_batches * batch_size).astype(np.int64).reshape(num_batches, batch_size)
        return [torch.from_numpy(self._held_out[r[:, None] * window + np.arange(window)[None, :]].astype(np.int64))
                for r in rows]


def shard_for_peer(peer_id: str, num_shards: int) -> int:
    """The shard a daemon reads: a stable hash of its peer id (not Python's randomized ``hash``)."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "big") % num_shards

"""A prepared dataset: the directory ``atoll data prepare`` writes, and its reading and validation.

Layout (format ``atoll-tokens``, version 1; docs/data.md has the field by field description)::

    DIR/manifest.json        what is below, with sizes and sha256 of every file
    DIR/tokenizer.json       the tokenizer the tokens were made with (``tokenizers``' JSON)
    DIR/train-00000.bin      tokens of whole documents, concatenated, raw little-endian ``dtype``
    DIR/train-00000.idx      document boundaries: uint64 offsets into the shard's tokens, documents + 1 of them
    DIR/held_out-00000.bin   the same for the held-out documents
    DIR/held_out-00000.idx

Document ``i`` of a shard is ``tokens[offsets[i]:offsets[i + 1]]``; no separator token is inserted, so the
token stream is exactly the concatenation of the documents' encodings.

``read_manifest`` checks everything that is cheap (fields, types, sizes, totals); ``PreparedDataset.tokens``
also checks each shard's sha256 as it reads it. Anything wrong is a ``ValueError`` with one line naming the
file and the field, never a half-read dataset.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

FORMAT = "atoll-tokens"
VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
SPLITS = ("train", "held_out")
_UINT16_VOCAB = 1 << 16  # ids 0 .. 65535 fit uint16
_HASH_CHUNK = 1 << 24


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab up to 65536), else uint32: the smallest dtype halves disk and memory."""
    return np.dtype(np.uint16 if vocab_size <= _UINT16_VOCAB else np.uint32)


def is_prepared(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding a manifest (then it is read as a prepared dataset, nothing else)."""
    p = Path(path)
    return p.is_dir() and (p / MANIFEST).is_file()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class Shard:
    """One ``.bin`` file of tokens and its ``.idx`` file of document offsets, as the manifest describes them."""

    split: str
    file: str
    tokens: int
    documents: int
    sha256: str
    offsets_file: str
    offsets_sha256: str

    def bytes(self, dtype: np.dtype) -> int:
        return self.tokens * dtype.itemsize

    @property
    def offsets_bytes(self) -> int:
        return (self.documents + 1) * 8


@dataclass(frozen=True)
class Manifest:
    """The validated content of ``manifest.json``."""

    dtype: np.dtype
    vocab_size: int
    tokenizer_sha256: str
    tokenizer_trained: bool
    held_out_fraction: float
    shards: tuple[Shard, ...]
    documents: dict[str, int]
    tokens: dict[str, int]

    def shards_of(self, split: str) -> list[Shard]:
        return [s for s in self.shards if s.split == split]


class _Fields:
    """Typed access to a JSON object that turns every problem into one ``ValueError`` line naming the field."""

    def __init__(self, obj: Any, where: str) -> None:
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        self.obj, self.where = obj, where

    def get(self, name: str, kind: type | tuple[type, ...]) -> Any:
        if name not in self.obj:
            raise ValueError(f"{self.where}: field {name!r} is missing")
        value = self.obj[name]
        # bool is an int in Python; a manifest saying ``"tokens": true`` is still wrong
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            raise ValueError(f"{self.where}: field {name!r} is {value!r}, not a {_kind_name(kind)}")
        if not isinstance(value, kind):
            raise ValueError(f"{self.where}: field {name!r} is {value!r}, not a {_kind_name(kind)}")
        return value

    def count(self, name: str) -> int:
        value = self.get(name, int)
        if value < 0:
            raise ValueError(f"{self.where}: field {name!r} is {value}, not a count")
        return value

    def sha256(self, name: str) -> str:
        value = self.get(name, str)
        if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
            raise ValueError(f"{self.where}: field {name!r} is not a sha256 (64 lowercase hex digits)")
        return value

    def file_name(self, name: str) -> str:
        value = self.get(name, str)
        # a manifest names files inside its own directory only: never a path that leaves it
        if not value or "/" in value or "\\" in value or value in (".", ".."):
            raise ValueError(f"{self.where}: field {name!r} is {value!r}, not a file name in the dataset directory")
        return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "list",
                        "dict": "object"}.get(k.__name__, k.__name__) for k in kinds)


def read_manifest(directory: str | Path) -> Manifest:
    """Parse and validate ``directory/manifest.json``: its format and version, every field's type, the dtype
    against the vocabulary, the totals against the shards, the tokenizer's hash, and each file's size (a
    truncated shard is refused here). Shard hashes are checked when the tokens are read."""
    root = Path(directory)
    path = root / MANIFEST
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable manifest ({_one_line(e)})") from None
    top = _Fields(doc, str(path))
    if top.get("format", str) != FORMAT:
        raise ValueError(f"{path}: format is {doc['format']!r}, not {FORMAT!r}")
    version = top.get("version", int)
    if version != VERSION:
        raise ValueError(f"{path}: format version {version} is not {VERSION}, the one this atoll reads; "
                         f"prepare the dataset again with this atoll")
    vocab_size = top.count("vocab_size")
    if vocab_size == 0:
        raise ValueError(f"{path}: vocab_size is 0")
    dtype_name = top.get("dtype", str)
    if dtype_name not in ("uint16", "uint32"):
        raise ValueError(f"{path}: dtype is {dtype_name!r}, not 'uint16' or 'uint32'")
    dtype = np.dtype(dtype_name)
    if dtype != dtype_for_vocab(vocab_size):  # the writer's rule: the smallest dtype that holds every id
        raise ValueError(f"{path}: dtype is {dtype_name} but vocab_size {vocab_size} is stored as "
                         f"{dtype_for_vocab(vocab_size).name}")
    tokenizer_file = top.file_name("tokenizer_file")
    tokenizer_sha256 = top.sha256("tokenizer_sha256")
    trained = top.get("tokenizer_trained", bool)
    fraction = top.get("held_out_fraction", (int, float))
    if not 0 <= fraction < 1:
        raise ValueError(f"{path}: held_out_fraction is {fraction}, not in [0, 1)")
    documents = _split_counts(top, "documents")
    tokens = _split_counts(top, "tokens")
    entries = top.get("shards", list)
    shards = tuple(_shard(entry, f"{path}: shards[{i}]") for i, entry in enumerate(entries))
    for split in SPLITS:
        of = [s for s in shards if s.split == split]
        if sum(s.tokens for s in of) != tokens[split] or sum(s.documents for s in of) != documents[split]:
            raise ValueError(f"{path}: the {split} shards hold {sum(s.tokens for s in of)} tokens in "
                             f"{sum(s.documents for s in of)} documents, the totals say {tokens[split]} in "
                             f"{documents[split]}")
    if tokens["train"] == 0:
        raise ValueError(f"{path}: no training tokens")
    names = [tokenizer_file, MANIFEST, *(n for s in shards for n in (s.file, s.offsets_file))]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: a file is named twice")
    tok_path = root / tokenizer_file
    if not tok_path.is_file():
        raise ValueError(f"{tok_path}: missing (the manifest names it as the tokenizer)")
    if sha256_file(tok_path) != tokenizer_sha256:
        raise ValueError(f"{tok_path}: sha256 differs from the manifest's tokenizer_sha256; the tokens were not "
                         f"made with this tokenizer")
    for s in shards:
        _check_size(root / s.file, s.bytes(dtype))
        _check_size(root / s.offsets_file, s.offsets_bytes)
    return Manifest(dtype, vocab_size, tokenizer_sha256, trained, float(fraction), shards, documents, tokens)


def _split_counts(top: _Fields, name: str) -> dict[str, int]:
    counts = _Fields(top.get(name, dict), f"{top.where}: {name}")
    return {split: counts.count(split) for split in SPLITS}


def _shard(entry: Any, where: str) -> Shard:
    f = _Fields(entry, where)
    split = f.get("split", str)
    if split not in SPLITS:
        raise ValueError(f"{where}: split is {split!r}, not one of {', '.join(SPLITS)}")
    return Shard(split, f.file_name("file"), f.count("tokens"), f.count("documents"), f.sha256("sha256"),
                 f.file_name("offsets_file"), f.sha256("offsets_sha256"))


def _check_size(path: Path, expected: int) -> None:
    try:
        size = path.stat().st_size
    except OSError:
        raise ValueError(f"{path}: missing (the manifest lists it)") from None
    if size != expected:
        raise ValueError(f"{path}: {size} bytes, the manifest says {expected}; the file is truncated or is not "
                         f"the one prepared, prepare the dataset again")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _read_checked(path: Path, expected_sha256: str) -> bytes:
    raw = path.read_bytes()
    if hashlib.sha256(raw).hexdigest() != expected_sha256:
        raise ValueError(f"{path}: sha256 differs from the manifest's; the file is corrupt, prepare the dataset again")
    return raw


class PreparedDataset:
    """A validated prepared dataset (``read_manifest`` on construction). Reading a shard checks its sha256."""

    def __init__(self, directory: str | Path) -> None:
        self.root = Path(directory)
        self.manifest = read_manifest(self.root)

    def shard_tokens(self, shard: Shard) -> np.ndarray:
        dtype = self.manifest.dtype.newbyteorder("<")  # the files are little-endian on every machine
        tokens = np.frombuffer(_read_checked(self.root / shard.file, shard.sha256), dtype=dtype)
        if tokens.size and int(tokens.max()) >= self.manifest.vocab_size:
            raise ValueError(f"{self.root / shard.file}: holds id {int(tokens.max())}, not below vocab_size "
                             f"{self.manifest.vocab_size}")
        return tokens.astype(self.manifest.dtype, copy=False)

    def shard_offsets(self, shard: Shard) -> np.ndarray:
        offsets = np.frombuffer(_read_checked(self.root / shard.offsets_file, shard.offsets_sha256), dtype="<u8")
        if offsets[0] != 0 or offsets[-1] != shard.tokens or np.any(np.diff(offsets.astype(np.int64)) < 0):
            raise ValueError(f"{self.root / shard.offsets_file}: not increasing offsets from 0 to {shard.tokens}")
        return offsets.astype(np.int64)

    def tokens(self, split: str = "train") -> np.ndarray:
        """Every token of ``split``, its shards in manifest order, as one array of the manifest's dtype."""
        parts = [self.shard_tokens(s) for s in self.manifest.shards_of(split)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.manifest.dtype)

    def documents(self, split: str = "train") -> Iterator[np.ndarray]:
        """Each document's tokens, in the order they were prepared."""
        for shard in self.manifest.shards_of(split):
            tokens, offsets = self.shard_tokens(shard), self.shard_offsets(shard)
            for i in range(shard.documents):
                yield tokens[offsets[i]:offsets[i + 1]]

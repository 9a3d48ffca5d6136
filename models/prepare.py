"""``atoll data prepare``: tokenize documents into a prepared dataset directory (format: ``models/dataset.py``).

The tokenizer is a given ``tokenizer.json`` (copied byte for byte into the output), or a byte-level BPE
trained on the inputs themselves (a first pass over them): byte-level, so any text encodes without unknown
tokens and decoding gives back exactly the text that was encoded. Tokens are encoded without the tokenizer's
special tokens (no [CLS]/[SEP] or BOS a post-processor would add): the stream is the documents' text only.

A document goes to the held-out split when the first 8 bytes of the sha256 of its UTF-8 text, read as a
fraction of 2^64, fall below ``held_out``: a function of the text alone, so it does not depend on input order,
and duplicates of a document always land on the same side (no held-out document also in training).

The output is atomic: everything is written into ``OUT.tmp-<pid>`` next to ``OUT`` and renamed at the end; an
error or an interrupt removes it, leaving no half-written dataset behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .dataset import FORMAT, MANIFEST, SPLITS, TOKENIZER, VERSION, Manifest, dtype_for_vocab, read_manifest
from .sources import Document, InputError, Source, collect_sources, iter_documents

DEFAULT_VOCAB = 4096
DEFAULT_HELD_OUT = 0.01
DEFAULT_SHARD_TOKENS = 1 << 26  # 128 MiB of uint16 per shard
_MIN_VOCAB = 256  # the byte alphabet of a byte-level BPE
_MAX_VOCAB = 1 << 32  # ids must fit uint32
_ENCODE_BATCH_CHARS = 1 << 22  # texts handed to encode_batch at once (it encodes them on every core)
_ENCODE_BATCH_DOCS = 4096


class PrepareError(ValueError):
    """A bad input or option; the message is one line."""


@dataclass(frozen=True)
class PrepareOptions:
    text_field: str = "text"
    tokenizer: str | None = None  # a tokenizer.json; None trains a byte-level BPE of ``vocab_size``
    vocab_size: int = DEFAULT_VOCAB
    held_out: float = DEFAULT_HELD_OUT
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    force: bool = False  # replace a non-empty OUT
    progress: bool | None = None  # a progress bar on stderr; None: when stderr is a terminal


def prepare(inputs: Sequence[str], out: str, options: PrepareOptions = PrepareOptions()) -> Manifest:
    """Tokenize ``inputs`` into the dataset directory ``out``; returns its (re-read, validated) manifest.
    Raises ``PrepareError`` (a ``ValueError``) with one line for a bad option, input or output path."""
    _check_options(options)
    out_path = Path(out)
    _check_out(out_path, options.force)
    try:
        sources = collect_sources(inputs)
    except InputError as e:
        raise PrepareError(str(e)) from None
    tmp = out_path.parent / f"{out_path.name}.tmp-{os.getpid()}"
    _check_overlap(sources, inputs, out_path, tmp)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        with _Progress(options.progress) as progress:
            _write(sources, tmp, options, progress)
        _install(tmp, out_path)
    except InputError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise PrepareError(str(e)) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return read_manifest(out_path)


def _check_options(o: PrepareOptions) -> None:
    if not o.text_field:
        raise PrepareError("text_field: must not be empty")
    if o.tokenizer is None and not _MIN_VOCAB <= o.vocab_size <= _MAX_VOCAB:
        raise PrepareError(f"vocab_size: {o.vocab_size} is not in [{_MIN_VOCAB}, {_MAX_VOCAB}] (a byte-level BPE "
                           f"starts from the {_MIN_VOCAB} bytes)")
    if not 0 <= o.held_out < 1:
        raise PrepareError(f"held_out: {o.held_out} is not a fraction in [0, 1)")
    if o.shard_tokens < 1:
        raise PrepareError(f"shard_tokens: {o.shard_tokens} is not a positive number of tokens")


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise PrepareError(f"out: {str(out)!r} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise PrepareError(f"out: {str(out)!r} exists and is not empty; pass --force to replace it")


def _check_overlap(sources: Sequence[Source], inputs: Sequence[str], out: Path, tmp: Path) -> None:
    """Refuse an output inside an input folder (the dataset being written would be read as input) and an input
    inside the output (``--force`` would delete it)."""
    out_r, tmp_r = out.resolve(), tmp.resolve()
    for spec in inputs:
        p = Path(spec).resolve()
        if p.is_dir() and (tmp_r.is_relative_to(p) or out_r.is_relative_to(p)):
            raise PrepareError(f"out: {str(out)!r} is inside the input folder {spec!r}; write it elsewhere")
    for s in sources:
        if s.path.resolve().is_relative_to(out_r):
            raise PrepareError(f"out: the input {str(s.path)!r} is inside {str(out)!r}; write it elsewhere")


def _install(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out``; an old ``out`` (``--force``) is moved aside first and removed only
    once the new one is in place."""
    old = None
    if out.is_dir() and any(out.iterdir()):
        old = out.parent / f"{out.name}.old-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)  # onto an empty folder or nothing: one rename
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write(sources: Sequence[Source], tmp: Path, o: PrepareOptions, progress: _Progress) -> None:
    total_bytes = sum(s.size for s in sources)
    tokenizer, tokenizer_bytes = _tokenizer(sources, o, progress, total_bytes)
    (tmp / TOKENIZER).write_bytes(tokenizer_bytes)
    vocab = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    if vocab <= 0:
        raise PrepareError("tokenizer: an empty vocabulary")
    if vocab > _MAX_VOCAB:
        raise PrepareError(f"tokenizer: vocabulary of {vocab} does not fit uint32")
    dtype = dtype_for_vocab(vocab)
    writers = {split: _ShardWriter(tmp, split, dtype, o.shard_tokens) for split in SPLITS}
    skipped = 0
    advance = progress.task("tokenizing", total_bytes)
    for texts in _batches(iter_documents(sources, o.text_field), advance):
        skipped += texts.count(None)
        kept = [t for t in texts if t is not None]
        for text, encoding in zip(kept, tokenizer.encode_batch(kept, add_special_tokens=False)):
            split = "held_out" if _held_out(text, o.held_out) else "train"
            writers[split].add(np.asarray(encoding.ids, dtype=np.int64))
    shards = [entry for split in SPLITS for entry in writers[split].close()]
    counts = {split: writers[split].counts() for split in SPLITS}
    if sum(d for d, _ in counts.values()) == 0:
        raise PrepareError(f"no documents: the inputs hold no text ({skipped} empty or null skipped)")
    if counts["train"][1] == 0:
        raise PrepareError(f"no training tokens: all {counts['held_out'][0]} document(s) went to the held-out "
                           f"split; give more documents or a smaller --held-out")
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype.name,
        "vocab_size": vocab,
        "tokenizer_file": TOKENIZER,
        "tokenizer_sha256": hashlib.sha256(tokenizer_bytes).hexdigest(),
        "tokenizer_trained": o.tokenizer is None,
        "boundaries": "offsets",  # informative: document i of a shard is tokens[offsets[i]:offsets[i+1]]
        "held_out_fraction": o.held_out,
        "text_field": o.text_field,
        "input_files": len(sources),
        "skipped_documents": skipped,
        "documents": {split: counts[split][0] for split in SPLITS},
        "tokens": {split: counts[split][1] for split in SPLITS},
        "shards": shards,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def _tokenizer(sources: Sequence[Source], o: PrepareOptions, progress: _Progress, total_bytes: int) -> tuple[Any, bytes]:
    """The tokenizer and the exact bytes of its tokenizer.json (what the manifest's hash is of)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if o.tokenizer is not None:
        path = Path(o.tokenizer)
        try:
            raw = path.read_bytes()
            return Tokenizer.from_str(raw.decode("utf-8")), raw
        except Exception as e:  # tokenizers raises plain Exception for a malformed file
            raise PrepareError(f"tokenizer: {o.tokenizer!r} is not a readable tokenizer.json "
                               f"({_one_line(e)})") from None
    tokenizer = Tokenizer(models.BPE())
    # byte-level both ways, no prefix space: decode(encode(text)) == text for every string
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=o.vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    advance = progress.task("training tokenizer", total_bytes)

    def texts() -> Iterator[str]:
        for doc in iter_documents(sources, o.text_field):
            advance(doc.consumed)
            if doc.text is not None:
                yield doc.text

    tokenizer.train_from_iterator(texts(), trainer)
    return tokenizer, tokenizer.to_str().encode("utf-8")


def _batches(docs: Iterator[Document], advance: Callable[[int], None]) -> Iterator[list[str | None]]:
    """Texts in batches for ``encode_batch``; ``None`` for each skipped record (null or empty)."""
    batch: list[str | None] = []
    chars = 0
    for doc in docs:
        advance(doc.consumed)
        if not doc.record:
            continue
        batch.append(doc.text)
        chars += len(doc.text or "")
        if chars >= _ENCODE_BATCH_CHARS or len(batch) >= _ENCODE_BATCH_DOCS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _held_out(text: str, fraction: float) -> bool:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") < fraction * 2.0 ** 64


class _ShardWriter:
    """The shards of one split: whole documents appended to ``<split>-NNNNN.bin`` until it reaches
    ``shard_tokens`` (a document is never cut, so a shard can exceed it by one document), with their offsets."""

    def __init__(self, root: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.root, self.split, self.shard_tokens = root, split, shard_tokens
        self.dtype = dtype.newbyteorder("<")  # little-endian on disk on every machine
        self.entries: list[dict[str, Any]] = []
        self.documents = self.tokens = 0
        self._file: Any = None

    def add(self, ids: np.ndarray) -> None:
        if self._file is None:
            self._open()
        data = ids.astype(self.dtype).tobytes()
        self._file.write(data)
        self._hash.update(data)
        self._offsets.append(self._offsets[-1] + ids.size)
        if self._offsets[-1] >= self.shard_tokens:
            self._finish()

    def close(self) -> list[dict[str, Any]]:
        if self._file is not None:
            self._finish()
        return self.entries

    def counts(self) -> tuple[int, int]:
        return self.documents, self.tokens

    def _open(self) -> None:
        self._name = f"{self.split}-{len(self.entries):05d}"
        self._file = open(self.root / f"{self._name}.bin", "wb")
        self._hash = hashlib.sha256()
        self._offsets = [0]

    def _finish(self) -> None:
        self._file.close()
        self._file = None
        offsets = np.asarray(self._offsets, dtype="<u8").tobytes()
        (self.root / f"{self._name}.idx").write_bytes(offsets)
        docs, tokens = len(self._offsets) - 1, self._offsets[-1]
        self.documents += docs
        self.tokens += tokens
        self.entries.append({"split": self.split, "file": f"{self._name}.bin", "tokens": tokens, "documents": docs,
                             "sha256": self._hash.hexdigest(), "offsets_file": f"{self._name}.idx",
                             "offsets_sha256": hashlib.sha256(offsets).hexdigest()})


class _Progress:
    """A rich progress bar on stderr, in bytes of input; silent when disabled or stderr is not a terminal."""

    def __init__(self, enabled: bool | None) -> None:
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        enabled = sys.stderr.isatty() if enabled is None else enabled
        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn(),
                             TimeRemainingColumn(), console=Console(stderr=True), disable=not enabled)

    def __enter__(self) -> _Progress:
        self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.stop()

    def task(self, description: str, total: int) -> Callable[[int], None]:
        task = self._bar.add_task(description, total=total)
        return lambda n: self._bar.advance(task, n)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__

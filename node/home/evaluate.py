"""``atoll sample`` and ``atoll eval``: text from a run's model, and its held-out loss on a dataset.

Both take a checkpoint directory or an export (``node/home/export.py``). The tokenizer is the export's
``tokenizer.json``, the byte-level mapping for a run on byte-level data, or the ``tokenizer.json`` of the prepared
dataset given with ``--data`` (checked against the run's).

``evaluate`` computes what a daemon's held-out figure computes (``Learner.evaluate``): the mean over fixed held-out
batches of each batch's mean next-token loss, the batches chosen as a daemon chooses them (``Corpus.held_out``: the
same on every daemon, spread over the held-out split), in fp32 on the CPU. Per byte: the batches' nats over the
UTF-8 bytes their target tokens decode to (bits per byte = that / ln 2); on byte-level data a token is a byte.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from atoll.models.data import BYTES, Corpus, load_corpus, load_held_out, tokenizer_of
from atoll.models.dataset import TOKENIZER, is_prepared
from atoll.models.generate import generate
from atoll.models.registry import shape_of

from .export import ExportError, Global


class Tokenizer:
    """Text to token ids and back: ``BYTES`` (id = byte) or a ``tokenizers`` JSON file."""

    def __init__(self, kind: str, path: Path | None = None) -> None:
        self.kind = kind
        self._tok = None
        if path is not None:
            from tokenizers import Tokenizer as HFTokenizer

            try:
                self._tok = HFTokenizer.from_file(str(path))
            except Exception as e:  # noqa: BLE001 - a broken file is one line
                raise ExportError(f"{str(path)!r} is not a tokenizers JSON file ({type(e).__name__}: {e})") from None

    def encode(self, text: str) -> list[int]:
        if self._tok is None:
            return list(text.encode("utf-8"))
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        if self._tok is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self._tok.decode(ids, skip_special_tokens=False)

    def byte_count(self, ids: list[int]) -> int:
        """The UTF-8 bytes ``ids`` stand for."""
        return len(ids) if self._tok is None else len(self.decode(ids).encode("utf-8"))


def tokenizer_for(g: Global, data: str | None) -> Tokenizer:
    """The tokenizer of ``g``'s run (see the module's docstring); ``ExportError`` when it cannot be found."""
    want = g.run.tokenizer
    if g.export_dir is not None and (g.export_dir / TOKENIZER).is_file() and data is None:
        # A byte-level run's export holds the byte tokenizer: its ids are the bytes, read here without it.
        return Tokenizer(BYTES) if want in ("", BYTES) else Tokenizer(want, g.export_dir / TOKENIZER)
    if data is not None and data != "builtin" and Path(data).exists() and is_prepared(Path(data)):
        kind = tokenizer_of(data)
        if want and want != BYTES and kind != want:
            raise ExportError(f"--data: {data!r} was tokenized by {kind[:12]}, the run's data by {want[:12]}")
        if want == BYTES:
            raise ExportError(f"--data: {data!r} is a prepared dataset; the run trained on byte-level data")
        return Tokenizer(kind, Path(data) / TOKENIZER)
    if want in ("", BYTES):
        return Tokenizer(BYTES)
    raise ExportError(f"the run's data was tokenized by {want[:12]}: pass --data with the run's prepared dataset")


def logits_fn(g: Global):
    """The model's ``logits(idx)``; ``ExportError`` for a model without one (a ``module:factory`` model need not
    have it)."""
    fn = getattr(g.model, "logits", None)
    if not callable(fn):
        raise ExportError(f"model {g.run.model!r} has no logits(idx) method: sampling needs one")
    return fn


def sample(g: Global, tok: Tokenizer, prompt: str, max_tokens: int, temperature: float, top_k: int, seed: int,
           on_text=None) -> str:
    """``max_tokens`` tokens after ``prompt``, decoded; ``on_text(piece)`` hears the text as it is drawn."""
    ids = tok.encode(prompt)
    if not ids:
        raise ExportError("--prompt: the prompt must hold at least one token")
    vocab = shape_of(g.model).vocab_size
    if max(ids) >= vocab:
        raise ExportError(f"--prompt: token {max(ids)} is outside the model's vocabulary of {vocab}")
    new: list[int] = []
    shown = [0]

    def heard(token: int) -> None:
        new.append(token)
        if on_text is not None:
            text = tok.decode(new)
            if not text.endswith("\ufffd"):  # a multi-byte character is shown once it is whole
                on_text(text[shown[0]:])
                shown[0] = len(text)

    out = generate(logits_fn(g), ids, max_tokens, shape_of(g.model).seq_len, temperature, top_k, seed, heard)
    if on_text is not None:
        text = tok.decode(out)
        if len(text) > shown[0]:
            on_text(text[shown[0]:])
    return tok.decode(out)


@dataclass
class Evaluation:
    loss: float  # nats per token (the daemon's held-out loss)
    perplexity: float
    loss_per_byte: float  # nats per byte
    bits_per_byte: float
    tokens: int
    bytes: int
    batches: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def held_out_batches(data: str, seq_len: int, vocab: int, num_batches: int, batch_size: int,
                     run_tokenizer: str = "") -> list[torch.Tensor]:
    """The held-out batches a daemon of a run on ``data`` evaluates (``num_batches`` 0: the whole held-out split, in
    batches of ``batch_size``)."""
    try:
        tokens, needed = load_corpus(data)
        held_out = load_held_out(data)
        kind = tokenizer_of(data)
    except ValueError as e:
        raise ExportError(f"--data: {e}") from None
    if run_tokenizer and kind and kind != run_tokenizer:
        raise ExportError(f"--data: {data!r} is tokenized as {kind[:12]}, the run's data as {run_tokenizer[:12]}")
    if needed > vocab:
        raise ExportError(f"--data: tokens go up to {needed - 1}; the model's vocabulary has {vocab}")
    try:
        corpus = Corpus(tokens, seq_len, 1, held_out=held_out)
    except ValueError as e:
        raise ExportError(f"--data: {e}") from None
    if num_batches <= 0:
        num_batches = max(1, corpus.held_out_windows() // batch_size)
    return corpus.held_out(num_batches, batch_size)


@torch.no_grad()
def evaluate(g: Global, tok: Tokenizer, batches: list[torch.Tensor], label: str = "evaluating") -> Evaluation:
    """The held-out figures of ``g``'s model on ``batches`` (see the module's docstring)."""
    model = g.model.eval()
    total = torch.zeros((), dtype=torch.float32)
    nats, tokens, nbytes = 0.0, 0, 0
    with _bar(label, len(batches)) as advance:
        for b in batches:
            inputs, targets = b[:, :-1].contiguous(), b[:, 1:].contiguous()
            loss = model(inputs, targets).float()
            total = total + loss
            nats += float(loss) * targets.numel()
            tokens += targets.numel()
            nbytes += sum(tok.byte_count(row.tolist()) for row in targets)
            advance()
    mean = float(total) / max(1, len(batches))
    per_byte = nats / max(1, nbytes)
    return Evaluation(mean, math.exp(min(mean, 700.0)), per_byte, per_byte / math.log(2), tokens, nbytes,
                      len(batches))


@contextlib.contextmanager
def _bar(label: str, total: int):
    """A progress bar of ``total`` batches on stderr when it is a terminal (nothing elsewhere); yields ``advance``."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task(label, total=total)
        yield lambda: progress.advance(task)

"""The documents of ``atoll data prepare``'s inputs: text files, folders of them, JSONL and Parquet files.

One document is a whole text file, one JSONL line's ``text_field`` (a string), or one Parquet row's
``text_field`` column (a string column). Files are chosen by suffix: ``.jsonl`` is JSONL, ``.parquet`` is
Parquet, anything else is UTF-8 text. A folder is read recursively in sorted order of relative path (the same
documents in the same order on every machine), skipping hidden entries (names starting with ``.``: ``.git``,
editor files).

A JSON ``null`` or an empty string is skipped (counted, not an error): datasets often hold rows without text.
Everything else that is wrong (a missing path, a line that is not JSON or lacks the field, a non-string value,
a file that is not UTF-8, Parquet without pyarrow) raises ``InputError``, one line naming the file (and line).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

TEXT, JSONL, PARQUET = "text", "jsonl", "parquet"
_PARQUET_BATCH = 1024


class InputError(ValueError):
    """An input that cannot be read as documents; the message is one line naming it."""


@dataclass(frozen=True)
class Source:
    path: Path
    kind: str
    size: int  # bytes on disk: what progress is measured in


@dataclass(frozen=True)
class Document:
    """One document's text, or ``None`` for a skipped one (null or empty), and how many bytes of its source
    file reading it consumed (for progress). ``record`` is False for a blank JSONL line: no document at all,
    only bytes read, so it is not counted as skipped."""

    text: str | None
    consumed: int
    record: bool = True


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    return JSONL if suffix == ".jsonl" else PARQUET if suffix == ".parquet" else TEXT


def collect_sources(inputs: Sequence[str]) -> list[Source]:
    """The files behind ``inputs`` (files and folders), in order; ``InputError`` for a missing path or a folder
    without files."""
    if not inputs:
        raise InputError("no inputs given")
    sources: list[Source] = []
    for spec in inputs:
        path = Path(spec)
        if path.is_dir():
            files = sorted((p for p in path.rglob("*") if p.is_file()
                            and not any(part.startswith(".") for part in p.relative_to(path).parts)),
                           key=lambda p: p.relative_to(path).parts)
            if not files:
                raise InputError(f"{spec}: a folder without any (non-hidden) file")
        elif path.is_file():
            files = [path]
        elif path.exists():
            raise InputError(f"{spec}: neither a file nor a folder")
        else:
            raise InputError(f"{spec}: no such file or folder")
        sources.extend(Source(p, _kind(p), p.stat().st_size) for p in files)
    return sources


def iter_documents(sources: Sequence[Source], text_field: str) -> Iterator[Document]:
    """Every document of ``sources``, in order."""
    for source in sources:
        if source.kind == TEXT:
            yield from _text(source.path)
        elif source.kind == JSONL:
            yield from _jsonl(source.path, text_field)
        else:
            yield from _parquet(source.path, text_field)


def _text(path: Path) -> Iterator[Document]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte {e.start}); only text files, .jsonl and .parquet are "
                         f"read") from None
    yield Document(text or None, len(raw))


def _jsonl(path: Path, field: str) -> Iterator[Document]:
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                yield Document(None, len(line), record=False)  # a blank line (often the last) is no record
                continue
            try:
                record = json.loads(line)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both are
                raise InputError(f"{path}:{number}: not JSON ({_one_line(e)})") from None
            if not isinstance(record, dict):
                raise InputError(f"{path}:{number}: a JSON {type(record).__name__}, not an object with field "
                                 f"{field!r}")
            if field not in record:
                raise InputError(f"{path}:{number}: no field {field!r} (choose another with --text-field)")
            yield Document(_text_value(record[field], f"{path}:{number}", field), len(line))


def _parquet(path: Path, field: str) -> Iterator[Document]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"{path}: reading Parquet needs pyarrow: pip install 'atoll[data]'") from None
    try:
        pf = pq.ParquetFile(path)
    except (OSError, ValueError, pa.ArrowException) as e:
        raise InputError(f"{path}: not a readable Parquet file ({_one_line(e)})") from None
    schema = pf.schema_arrow
    if field not in schema.names:
        raise InputError(f"{path}: no column {field!r} (it has {', '.join(schema.names)}; choose one with "
                         f"--text-field)")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or getattr(pa.types, "is_string_view", lambda _: False)(kind)):
        raise InputError(f"{path}: column {field!r} holds {kind}, not strings")
    rows = max(pf.metadata.num_rows, 1)
    size = path.stat().st_size
    batches = pf.iter_batches(columns=[field], batch_size=_PARQUET_BATCH)
    done, consumed = 0, 0
    while True:
        try:  # only reading is guarded here: a bad value below is its own error, not "unreadable"
            batch = next(batches, None)
        except (OSError, ValueError, pa.ArrowException) as e:
            raise InputError(f"{path}: not a readable Parquet file ({_one_line(e)})") from None
        if batch is None:
            return
        for value in batch.column(0).to_pylist():
            done += 1
            # the file's bytes spread evenly over its rows: Parquet is compressed, there is no better measure
            now = size * done // rows
            yield Document(_text_value(value, str(path), field), now - consumed)
            consumed = now


def _text_value(value: object, where: str, field: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise InputError(f"{where}: field {field!r} is a {type(value).__name__}, not a string")
    return value


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__

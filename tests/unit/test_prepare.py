"""``atoll data prepare`` and prepared datasets: text → tokens → text round-trips for every input kind, the
tokenizer's hash, the dtype choice, refused manifests and shards, ``load_corpus(DIR)``, and the CLI's one-line
errors."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from atoll.models.data import Corpus, load_corpus, load_held_out
from atoll.models.dataset import MANIFEST, PreparedDataset, dtype_for_vocab, read_manifest
from atoll.models.prepare import PrepareError, PrepareOptions, prepare
from atoll.node.cli import main

VOCAB = 300  # a small BPE trains in milliseconds


def _docs(n: int = 40) -> list[str]:
    """Documents with what a byte-level round trip must survive: non-ASCII, leading/trailing spaces, CR LF."""
    return [f"  doc {i}: the quick brown fox ünïcödé ✓ 日本語\r\n" + "jumps over the lazy dog. " * (i % 5 + 1)
            + ("\n" if i % 2 else "  ") for i in range(n)]


def _opts(**kw) -> PrepareOptions:
    return PrepareOptions(**{"vocab_size": VOCAB, "held_out": 0.2, "progress": False, **kw})


def _decoded(out: Path) -> dict[str, list[str]]:
    """Every document of the dataset, decoded with the tokenizer saved in it, per split."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ds = PreparedDataset(out)
    return {split: [tok.decode(d.tolist(), skip_special_tokens=False) for d in ds.documents(split)]
            for split in ("train", "held_out")}


def _assert_round_trip(out: Path, docs: list[str]) -> None:
    got = _decoded(out)
    assert sorted(got["train"] + got["held_out"]) == sorted(docs)
    for split in got:  # each split keeps the input order
        assert got[split] == [d for d in docs if d in set(got[split])]
    assert got["train"] and got["held_out"]  # 0.2 of 40 documents: both splits are used


def test_text_files_round_trip(tmp_path):
    docs = _docs()
    files = []
    for i, d in enumerate(docs):
        files.append(tmp_path / f"{i:02d}.txt")
        files[-1].write_text(d, encoding="utf-8", newline="")
    m = prepare([str(f) for f in files], str(tmp_path / "out"), _opts())
    _assert_round_trip(tmp_path / "out", docs)
    assert m.vocab_size == VOCAB and m.dtype == np.uint16 and m.tokenizer_trained
    assert sum(m.documents.values()) == len(docs)


def test_a_folder_is_read_recursively_in_order_without_hidden_files(tmp_path):
    docs = _docs(30)
    src = tmp_path / "src"
    for i, d in enumerate(docs):
        f = src / f"part{i % 3}" / "deeper" / f"{i:02d}.md"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(d, encoding="utf-8", newline="")
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref: not a document")
    (src / ".notes.txt").write_text("hidden")
    prepare([str(src)], str(tmp_path / "out"), _opts(held_out=0.3))
    got = _decoded(tmp_path / "out")
    assert sorted(got["train"] + got["held_out"]) == sorted(docs)
    order = [docs[i] for p in range(3) for i in range(p, len(docs), 3)]  # sorted by path: part0's first
    assert got["train"] == [d for d in order if d in set(got["train"])]


def test_jsonl_round_trip_skips_nulls_and_blank_lines(tmp_path):
    docs = _docs()
    lines = [json.dumps({"id": i, "body": d}) for i, d in enumerate(docs)]
    lines[3:3] = [json.dumps({"body": None}), "", json.dumps({"body": ""})]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    m = prepare([str(tmp_path / "in.jsonl")], str(tmp_path / "out"), _opts(text_field="body"))
    _assert_round_trip(tmp_path / "out", docs)
    assert json.loads((tmp_path / "out" / MANIFEST).read_text())["skipped_documents"] == 2  # null and ""
    assert sum(m.documents.values()) == len(docs)


def test_parquet_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = _docs()
    table = pa.table({"id": list(range(len(docs))), "content": docs})
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=7)
    prepare([str(tmp_path / "in.parquet")], str(tmp_path / "out"), _opts(text_field="content"))
    _assert_round_trip(tmp_path / "out", docs)


def _bpe_file(path: Path, texts: list[str], vocab: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return path


def test_a_given_tokenizer_is_used_and_hashed(tmp_path):
    from tokenizers import Tokenizer

    docs = _docs()
    tok_file = _bpe_file(tmp_path / "mine.json", ["something else entirely"] * 5, 280)
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    m = prepare([str(tmp_path / "in.jsonl")], str(tmp_path / "out"), _opts(tokenizer=str(tok_file)))
    assert m.tokenizer_sha256 == hashlib.sha256(tok_file.read_bytes()).hexdigest()
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == tok_file.read_bytes()
    assert not m.tokenizer_trained and m.vocab_size == Tokenizer.from_file(str(tok_file)).get_vocab_size()
    _assert_round_trip(tmp_path / "out", docs)
    tok = Tokenizer.from_file(str(tok_file))
    first_train = next(PreparedDataset(tmp_path / "out").documents("train"))
    assert first_train.tolist() in [tok.encode(d, add_special_tokens=False).ids for d in docs]


def test_dtype_follows_the_vocabulary(tmp_path):
    assert dtype_for_vocab(256) == np.uint16 and dtype_for_vocab(1 << 16) == np.uint16
    assert dtype_for_vocab((1 << 16) + 1) == np.uint32
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(70_000)}}  # ids past 65535 need uint32
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "big.json"))
    words = ["w5 w65535 w65536 w69999 nope", "w1 w2", "w69998"]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps({"text": w}) for w in words))
    m = prepare([str(tmp_path / "in.jsonl")], str(tmp_path / "out"), _opts(tokenizer=str(tmp_path / "big.json"),
                                                                            held_out=0))
    assert m.dtype == np.uint32 and m.vocab_size == 70_001
    tokens, vocab_size = load_corpus(str(tmp_path / "out"))
    assert tokens.dtype == np.uint32 and vocab_size == 70_001
    assert tokens.tolist() == [6, 65536, 65537, 70000, 0, 2, 3, 69999]
    shard = m.shards[0]
    assert (tmp_path / "out" / shard.file).stat().st_size == 4 * shard.tokens


def test_load_corpus_returns_the_training_split_and_the_vocab(tmp_path):
    docs = _docs(200)
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    m = prepare([str(tmp_path / "in.jsonl")], str(tmp_path / "out"), _opts(shard_tokens=500))
    assert len(m.shards_of("train")) > 1  # several shards, concatenated in order
    tokens, vocab = load_corpus(str(tmp_path / "out"))
    ds = PreparedDataset(tmp_path / "out")
    assert vocab == VOCAB and tokens.dtype == np.uint16 and tokens.size == m.tokens["train"]
    assert np.array_equal(tokens, np.concatenate(list(ds.documents("train"))))
    held_out = load_held_out(str(tmp_path / "out"))  # the dataset's own held-out split is the daemon's
    assert held_out is not None and np.array_equal(held_out, np.concatenate(list(ds.documents("held_out"))))
    corpus = Corpus(tokens, 8, 4, held_out=held_out)  # the daemon's next step: it trains on them
    assert corpus.batch_at(0, 0, 2).shape == (2, 9)
    held = {tuple(w) for b in corpus.held_out(4, 8) for w in b.tolist()}
    windows = {tuple(held_out[i:i + 9].tolist()) for i in range(0, held_out.size - 8, 9)}
    assert held <= windows
    assert load_held_out("builtin") is None and load_held_out(str(tmp_path / "in.jsonl")) is None
    for s in m.shards:  # whole documents per shard, the size limit passed by one document at most
        assert s.documents > 0


def test_held_out_depends_on_the_text_only(tmp_path):
    docs = _docs()
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in reversed(docs + docs)))
    prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "a"), _opts())
    prepare([str(tmp_path / "b.jsonl")], str(tmp_path / "b"), _opts())
    a, b = _decoded(tmp_path / "a"), _decoded(tmp_path / "b")
    assert set(a["held_out"]) == set(b["held_out"]) and not set(b["held_out"]) & set(b["train"])


@pytest.fixture
def dataset(tmp_path) -> Path:
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in _docs()))
    prepare([str(tmp_path / "in.jsonl")], str(tmp_path / "ds"), _opts(shard_tokens=400))
    return tmp_path / "ds"


def _edit_manifest(ds: Path, edit) -> None:
    doc = json.loads((ds / MANIFEST).read_text())
    edit(doc)
    (ds / MANIFEST).write_text(json.dumps(doc))


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(version=2), "format version 2 is not 1"),
    (lambda d: d.update(format="other"), "format is 'other'"),
    (lambda d: d.update(dtype="uint32"), "dtype is uint32 but vocab_size 300 is stored as uint16"),
    (lambda d: d.update(dtype="int8"), "dtype is 'int8'"),
    (lambda d: d.update(vocab_size="300"), "field 'vocab_size' is '300', not a integer"),
    (lambda d: d.pop("shards"), "field 'shards' is missing"),
    (lambda d: d.update(tokenizer_sha256="0" * 64), "sha256 differs from the manifest's tokenizer_sha256"),
    (lambda d: d["tokens"].update(train=d["tokens"]["train"] + 1), "the totals say"),
    (lambda d: d["shards"][0].update(file="../escape.bin"), "not a file name in the dataset directory"),
    (lambda d: d["shards"][0].update(tokens=d["shards"][0]["tokens"] + 1), "the totals say"),
    (lambda d: d["shards"][1].update(sha256="f" * 64), "sha256 differs from the manifest's; the file is corrupt"),
])
def test_a_wrong_manifest_is_refused_in_one_line(dataset, edit, message):
    _edit_manifest(dataset, edit)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as e:
        load_corpus(str(dataset))
    assert "\n" not in str(e.value)


def test_a_truncated_or_corrupt_shard_is_refused_in_one_line(dataset):
    shard = dataset / read_manifest(dataset).shards[0].file
    raw = shard.read_bytes()
    shard.write_bytes(raw[:-2])
    with pytest.raises(ValueError, match=f"{shard}: {len(raw) - 2} bytes, the manifest says {len(raw)}; the file "
                                         f"is truncated") as e:
        load_corpus(str(dataset))
    assert "\n" not in str(e.value)
    shard.write_bytes(bytes([raw[0] ^ 1]) + raw[1:])  # same size, one bit flipped
    with pytest.raises(ValueError, match="sha256 differs from the manifest's; the file is corrupt"):
        load_corpus(str(dataset))
    os.unlink(shard)
    with pytest.raises(ValueError, match="missing"):
        load_corpus(str(dataset))
    (dataset / MANIFEST).write_text("{not json")
    with pytest.raises(ValueError, match="not a readable manifest"):
        load_corpus(str(dataset))


def test_output_is_atomic_and_never_overwritten_without_force(tmp_path):
    (tmp_path / "in.txt").write_text("hello world " * 50)
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious").write_text("keep me")
    with pytest.raises(PrepareError, match="exists and is not empty; pass --force"):
        prepare([str(tmp_path / "in.txt")], str(out), _opts(held_out=0))
    assert (out / "precious").read_text() == "keep me"
    prepare([str(tmp_path / "in.txt")], str(out), _opts(held_out=0, force=True))
    assert not (out / "precious").exists() and read_manifest(out).documents["train"] == 1
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"other": 1}\n')
    with pytest.raises(PrepareError, match="bad.jsonl:2: no field 'text'"):
        prepare([str(tmp_path / "bad.jsonl")], str(tmp_path / "never"), _opts())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "in.txt", "out"]  # no DIR, no DIR.tmp-*


def test_an_output_inside_an_input_folder_is_refused(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("text")
    with pytest.raises(PrepareError, match="is inside the input folder"):
        prepare([str(tmp_path / "src")], str(tmp_path / "src" / "out"), _opts())


def test_cli_prepares_and_the_daemon_reads_it(tmp_path, capsys):
    for i, d in enumerate(_docs()):
        (tmp_path / f"{i}.txt").write_text(d)
    rc = main(["data", "prepare", *(str(tmp_path / f"{i}.txt") for i in range(40)), "--out", str(tmp_path / "ds"),
               "--vocab-size", "300", "--held-out", "0.1"])
    out = capsys.readouterr()
    assert rc == 0 and out.err == ""
    assert f"vocab 300 (trained tokenizer" in out.out and f"atoll start --data {tmp_path / 'ds'}" in out.out
    _, vocab = load_corpus(str(tmp_path / "ds"))
    assert vocab == 300


def _write_bad(tmp_path: Path, case: str) -> list[str]:
    if case == "missing":
        return [str(tmp_path / "nope.txt")]
    if case == "not json":
        (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
        return [str(tmp_path / "a.jsonl")]
    if case == "no field":
        (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
        return [str(tmp_path / "a.jsonl")]
    if case == "not a string":
        (tmp_path / "a.jsonl").write_text('{"text": 3}\n')
        return [str(tmp_path / "a.jsonl")]
    if case == "empty":
        (tmp_path / "a.txt").write_text("")
        (tmp_path / "b.jsonl").write_text("\n")
        return [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]
    if case == "empty folder":
        (tmp_path / "d").mkdir()
        return [str(tmp_path / "d")]
    if case == "binary":
        (tmp_path / "a.bin").write_bytes(b"\xff\xfe\x00")
        return [str(tmp_path / "a.bin")]
    if case == "bad parquet":
        (tmp_path / "a.parquet").write_text("not parquet")
        return [str(tmp_path / "a.parquet")]
    raise AssertionError(case)


@pytest.mark.parametrize("case, message", [
    ("missing", "nope.txt: no such file or folder"),
    ("not json", "a.jsonl:2: not JSON"),
    ("no field", "a.jsonl:2: no field 'text' (choose another with --text-field)"),
    ("not a string", "a.jsonl:1: field 'text' is a int, not a string"),
    ("empty", "no documents: the inputs hold no text (1 empty or null skipped)"),
    ("empty folder", "a folder without any (non-hidden) file"),
    ("binary", "a.bin: not UTF-8 text"),
    ("bad parquet", "a.parquet: not a readable Parquet file"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case, message):
    inputs = _write_bad(tmp_path, case)
    assert main(["data", "prepare", *inputs, "--out", str(tmp_path / "out"), "--vocab-size", "300"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("atoll: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_cli_parquet_without_pyarrow_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert main(["data", "prepare", str(tmp_path / "a.parquet"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "a.parquet: reading Parquet needs pyarrow: pip install 'atoll[data]'" in err and err.count("\n") == 1


@pytest.mark.parametrize("args, message", [
    (["--vocab-size", "100"], "vocab_size: 100 is not in [256,"),
    (["--held-out", "1"], "held_out: 1.0 is not a fraction"),
    (["--tokenizer", "missing.json"], "tokenizer: 'missing.json' is not a readable tokenizer.json"),
])
def test_cli_bad_options_are_one_line(tmp_path, capsys, args, message):
    (tmp_path / "a.txt").write_text("some text")
    assert main(["data", "prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_command_line_never_shows_a_traceback(tmp_path):
    """The real entry point, in a process of its own: a good run exits 0, a bad input exits 2 with one line."""
    (tmp_path / "a.jsonl").write_text('{"text": "hello there"}\n{"text": "general kenobi"}\n')
    def cmd(out: str) -> list[str]:
        return [sys.executable, "-m", "atoll.node.cli", "data", "prepare", str(tmp_path / "a.jsonl"), "--out",
                str(tmp_path / out), "--vocab-size", "260", "--held-out", "0"]

    ok = subprocess.run(cmd("out"), capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr
    assert read_manifest(tmp_path / "out").documents == {"train": 2, "held_out": 0}
    (tmp_path / "a.jsonl").write_text('{"text": "hello there"}\n[1, 2]\n')
    bad = subprocess.run(cmd("other"), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr == f"atoll: error: {tmp_path / 'a.jsonl'}:2: a JSON list, not an object with field 'text'\n"


def test_tokenizer_of_names_how_data_was_tokenized(tmp_path):
    from atoll.models.data import BYTES, tokenizer_of

    for i, d in enumerate(_docs()):
        (tmp_path / f"{i}.txt").write_text(d)
    m = prepare([str(tmp_path / f"{i}.txt") for i in range(10)], str(tmp_path / "ds"), _opts())
    assert tokenizer_of(str(tmp_path / "ds")) == m.tokenizer_sha256
    assert tokenizer_of("builtin") == BYTES and tokenizer_of(str(tmp_path / "0.txt")) == BYTES
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "raw.bin")
    assert tokenizer_of(str(tmp_path / "raw.bin")) == ""  # uint16 shards: nobody says how
    with pytest.raises(ValueError, match="does not exist"):
        tokenizer_of(str(tmp_path / "nope"))

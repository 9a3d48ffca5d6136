"""scripts/bench_device_overhead.py: the CPU dry run of the path a cuda run takes (one process, every repetition
after one warm-up, a prepared dataset, a --seq-len override, --max-seconds cutting the steps), its JSON, and bad
arguments refused in one line with exit status 2 before anything runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    from scripts import bench_device_overhead

    return bench_device_overhead


def _dataset(root: Path, vocab: int) -> Path:
    """A prepared dataset whose tokenizer has exactly ``vocab`` ids (a word-level one: no training)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from atoll.models.prepare import PrepareOptions, prepare

    root.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i + 1 for i in range(vocab - 1)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(root / "tok.json"))
    words = [" ".join(f"w{(7 * d + 13 * i) % (vocab - 1)}" for i in range(200)) for d in range(60)]
    (root / "in.jsonl").write_text("\n".join(json.dumps({"text": w}) for w in words))
    options = PrepareOptions(tokenizer=str(root / "tok.json"), held_out=0.1, progress=False)
    manifest = prepare([str(root / "in.jsonl")], str(root / "ds"), options)
    assert manifest.vocab_size == vocab
    return root / "ds"


def test_the_dry_run_of_the_cuda_path_writes_its_json(tmp_path):
    data = _dataset(tmp_path / "v256", 256)
    out = tmp_path / "overhead.json"
    cmd = [sys.executable, "-m", "scripts.bench_device_overhead", "--devices", "cpu", "--model", "nano", "--data", str(data),
           "--seq-len", "32", "--batch-size", "2", "--steps", "20", "--warmup", "1", "--repeats", "2", "--no-daemon",
           "--max-seconds", "1e-6", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    d = result["devices"]["cpu"]
    env = d["env"]
    assert (env["seq_len"], env["vocab_size"], env["batch_size"], env["tokens_per_step"]) == (32, 256, 2, 64)
    assert env["params"] > 0 and env["data"] == str(data) and env["torch"] == torch.__version__
    # --max-seconds far below one step: the measured steps are cut to one block of 10, and the JSON says so.
    assert (env["steps_asked"], env["steps"], d["steps"]) == (20, 10, 10) and env["calibration_step_seconds"] > 0
    assert d["daemon_skipped"] == "--no-daemon" and "daemon" not in d and "daemon" not in d["runs"][0]
    assert len(d["runs"]) == d["repeats"] == 2
    for kind in ("bare", "learner", "lagged"):
        assert len(d[kind]["tokens_per_s"]) == 2 and min(d[kind]["tokens_per_s"]) > 0
        assert env["last_loss"][kind] == env["last_loss"][kind]  # finite, not NaN
    for kind in ("learner", "lagged"):
        r = d[f"ratio_{kind}"]
        assert r["n"] == 2 and len(r["per_run"]) == 2 and r["low"] <= r["mean"] <= r["high"]
        assert r["per_run"] == [run[kind]["tokens_per_s"] / run["bare"]["tokens_per_s"] for run in d["runs"]]


def _refused(bench, capsys, *argv: str) -> str:
    assert bench.main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench_device_overhead: "), err
    return err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_refused_in_one_line(bench, capsys, tmp_path):
    err = _refused(bench, capsys, "--devices", "cuda", "--model", "llama-150m", "--out", str(tmp_path / "x"))
    assert "sees no CUDA device" in err
    assert not list(tmp_path.iterdir())


def test_a_model_is_only_fed_data_of_its_own_vocabulary(bench, capsys, tmp_path):
    err = _refused(bench, capsys, "--devices", "cpu", "--model", "llama-150m", "--data", "builtin", "--no-daemon")
    assert "vocabulary of 256" in err and "32768" in err
    data = _dataset(tmp_path / "v300", 300)
    err = _refused(bench, capsys, "--devices", "cpu", "--model", "nano", "--data", str(data), "--no-daemon")
    assert "vocabulary of 300" in err and "embeds 256" in err


def test_other_bad_arguments_are_refused_in_one_line(bench, capsys):
    assert "unknown 'tpu'" in _refused(bench, capsys, "--devices", "tpu")
    assert "--model" in _refused(bench, capsys, "--devices", "cpu", "--model", "nope")
    assert "does not exist" in _refused(bench, capsys, "--devices", "cpu", "--data", "/no/such/data")
    assert "add --no-daemon" in _refused(bench, capsys, "--devices", "cpu", "--seq-len", "32")
    assert "not a preset" in _refused(bench, capsys, "--devices", "cpu", "--model", "hf:x", "--seq-len", "32",
                                      "--no-daemon")
    assert "at least 1" in _refused(bench, capsys, "--devices", "cpu", "--steps", "0")
    assert "unrecognized" in _refused(bench, capsys, "--devices", "cpu", "--bogus")


def test_unset_settings_take_the_devices_defaults(bench):
    args = bench.parse(["--devices", "cuda,cpu"])
    cuda, cpu = bench.resolved(args, "cuda"), bench.resolved(args, "cpu")
    assert (cuda.steps, cuda.warmup, cuda.repeats, cuda.max_seconds) == (30, 5, 3, 30.0)
    assert (cpu.steps, cpu.warmup, cpu.repeats, cpu.max_seconds) == (100, 10, 4, None)
    given = bench.resolved(bench.parse(["--steps", "7", "--max-seconds", "0"]), "cuda")
    assert (given.steps, given.max_seconds, given.repeats) == (7, 0, 3)

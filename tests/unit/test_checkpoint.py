"""Checkpoints are atomic, verified on load, and fall back to the previous good one; tensors on the device
(``ATOLL_TEST_DEVICE``) are written as their host copies, and a learner's state read back continues exactly. A
non-finite checkpoint is neither written nor used, and a checkpoint reads no file outside its directory."""

import hashlib
import json
import threading

import pytest
import torch

from atoll.models.configs import MODELS
from atoll.models.data import Corpus, load_corpus
from atoll.node.home.checkpoint import CheckpointWriter, checkpoints, load_checkpoint, save_checkpoint
from atoll.node.config import RunConfig
from atoll.node.device import resolve_device
from atoll.node.island.learner import Learner


def test_roundtrip_and_keep_two(tmp_path, device_name):
    for i in range(4):
        save_checkpoint(tmp_path, {"a": torch.full((3,), float(i), device=device_name)}, {"version": i})
    tensors, meta = load_checkpoint(tmp_path)
    assert meta["version"] == 3 and torch.equal(tensors["a"], torch.full((3,), 3.0))  # on the host
    assert len(list(tmp_path.glob("ckpt-*.json"))) == 2
    assert not list(tmp_path.glob("*.tmp"))


def test_corrupt_newest_falls_back_to_previous(tmp_path):
    save_checkpoint(tmp_path, {"a": torch.zeros(4)}, {"version": 1})
    newest = save_checkpoint(tmp_path, {"a": torch.ones(4)}, {"version": 2})
    tensor_file = tmp_path / json.loads(newest.read_text())["tensors_file"]
    data = bytearray(tensor_file.read_bytes())
    data[-1] ^= 0xFF
    tensor_file.write_bytes(bytes(data))
    tensors, meta = load_checkpoint(tmp_path)
    assert meta["version"] == 1 and torch.equal(tensors["a"], torch.zeros(4))


def test_partial_write_is_invisible(tmp_path):
    save_checkpoint(tmp_path, {"a": torch.zeros(2)}, {"version": 5})
    # A crash after the tensors but before the JSON leaves a temp file and an orphan: both ignored.
    (tmp_path / "ckpt-00000002.safetensors").write_bytes(b"half")
    (tmp_path / "ckpt-00000003.json.tmp").write_text("{")
    assert load_checkpoint(tmp_path)[1]["version"] == 5


def test_empty_dir(tmp_path):
    assert load_checkpoint(tmp_path) is None
    assert load_checkpoint(tmp_path / "missing") is None


class _Killed(BaseException):
    """Stands for the process dying: nothing after the hook runs."""


def test_crash_mid_write_resumes_from_previous_good(tmp_path):
    save_checkpoint(tmp_path, {"a": torch.zeros(1000)}, {"version": 1})
    save_checkpoint(tmp_path, {"a": torch.ones(1000)}, {"version": 2})

    def die_half_written(tmp):
        data = tmp.read_bytes()
        tmp.write_bytes(data[: len(data) // 2])
        raise _Killed

    try:
        save_checkpoint(tmp_path, {"a": torch.full((1000,), 3.0)}, {"version": 3}, interrupt=die_half_written)
    except _Killed:
        pass
    assert list(tmp_path.glob("*.tmp"))  # the half-written tensors file is left behind, as a real crash leaves it
    tensors, meta = load_checkpoint(tmp_path)
    assert meta["version"] == 2 and torch.equal(tensors["a"], torch.ones(1000))
    # The next write after the restart succeeds, removes the leftover and keeps the previous good one.
    save_checkpoint(tmp_path, {"a": torch.full((1000,), 4.0)}, {"version": 4})
    assert not list(tmp_path.glob("*.tmp"))
    assert sorted(json.loads(p.read_text())["version"] for p in tmp_path.glob("ckpt-*.json")) == [2, 4]
    assert torch.equal(load_checkpoint(tmp_path)[0]["a"], torch.full((1000,), 4.0))


def test_crash_before_rename_of_first_checkpoint_leaves_none(tmp_path):
    def die(tmp):
        raise _Killed

    try:
        save_checkpoint(tmp_path, {"a": torch.zeros(8)}, {"version": 1}, interrupt=die)
    except _Killed:
        pass
    assert load_checkpoint(tmp_path) is None


def test_background_writer_writes_every_checkpoint_in_order(tmp_path):
    written = []
    writer = CheckpointWriter(tmp_path, lambda meta: written.append((meta["version"], threading.current_thread().name)))
    for i in range(5):
        writer.submit({"a": torch.full((1000,), float(i))}, {"version": i})
    writer.wait()
    assert [v for v, _ in written] == list(range(5))
    assert all(name == "atoll-checkpoint" for _, name in written)  # off the training thread
    tensors, meta = load_checkpoint(tmp_path)
    assert meta["version"] == 4 and torch.equal(tensors["a"], torch.full((1000,), 4.0))


def test_a_failed_background_write_is_counted_and_the_previous_checkpoint_stays(tmp_path):
    writer = CheckpointWriter(tmp_path, lambda meta: None)
    writer.submit({"a": torch.zeros(4)}, {"version": 1})
    writer.wait()
    writer.submit({"a": "not a tensor"}, {"version": 2})  # save_file raises in the writer thread
    writer.wait()
    assert writer.failures == 1
    assert load_checkpoint(tmp_path)[1]["version"] == 1


def test_a_learners_state_written_and_read_back_continues_bit_identically(tmp_path, device_name):
    """θ and AdamW's state of a learner on the device (at its default precision), through safetensors on disk, into
    a new learner on the device: the same losses and θ from there on."""
    run = RunConfig(model="nano", warmup_steps=3)
    tokens, _ = load_corpus("builtin")
    corpus = Corpus(tokens, MODELS["nano"].seq_len, run.num_shards)

    def make():
        return Learner(run, resolve_device(device_name), corpus, shard=0, batch_size=4)

    a = make()
    for _ in range(3):
        a.train_step()
    save_checkpoint(tmp_path, a.state_tensors(), {"step": a.step, "tokens": a.tokens, "position": a.position})
    tensors, meta = load_checkpoint(tmp_path)
    b = make()
    b.load_state_tensors(tensors)
    b.step, b.tokens, b.position = meta["step"], meta["tokens"], meta["position"]
    assert [a.train_step() for _ in range(3)] == [b.train_step() for _ in range(3)]
    assert torch.equal(a.flat_params(), b.flat_params())


def test_a_non_finite_checkpoint_is_not_written_and_the_intact_one_stays(tmp_path):
    save_checkpoint(tmp_path, {"a": torch.zeros(4)}, {"version": 1})
    save_checkpoint(tmp_path, {"a": torch.ones(4)}, {"version": 2})
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="a holds NaN or infinity"):
            save_checkpoint(tmp_path, {"a": torch.tensor([0.0, bad])}, {"version": 3})
    # Both intact checkpoints are still there: a non-finite one would have pushed the older out.
    assert sorted(json.loads(p.read_text())["version"] for p in tmp_path.glob("ckpt-*.json")) == [1, 2]
    writer = CheckpointWriter(tmp_path, lambda meta: None)
    writer.submit({"a": torch.full((2,), float("nan"))}, {"version": 4})
    writer.wait()
    assert writer.failures == 1 and load_checkpoint(tmp_path)[1]["version"] == 2


def _write_unchecked(directory, seq, tensors, meta):
    """A checkpoint pair as a writer without the finiteness check (or a hand-edited JSON) would leave it."""
    from safetensors.torch import save_file

    name = f"ckpt-{seq:08d}.safetensors"
    save_file(tensors, str(directory / name))
    digest = hashlib.sha256((directory / name).read_bytes()).hexdigest()
    (directory / f"ckpt-{seq:08d}.json").write_text(json.dumps({**meta, "tensors_sha256": digest,
                                                                "tensors_file": meta.get("tensors_file", name)}))


def test_a_checkpoint_with_nan_values_is_skipped_for_the_older_intact_one(tmp_path):
    save_checkpoint(tmp_path, {"a": torch.zeros(4)}, {"version": 1})
    _write_unchecked(tmp_path, 2, {"a": torch.tensor([1.0, float("nan"), 1.0, 1.0])}, {"version": 2})
    tensors, meta = load_checkpoint(tmp_path)
    assert meta["version"] == 1 and torch.equal(tensors["a"], torch.zeros(4))
    assert [m["version"] for _, m in checkpoints(tmp_path)] == [1]


def test_a_tensor_file_named_outside_the_directory_is_never_read(tmp_path):
    inside = tmp_path / "ckpt"
    inside.mkdir()
    save_checkpoint(inside, {"a": torch.zeros(4)}, {"version": 1})
    _write_unchecked(tmp_path, 9, {"a": torch.ones(4)}, {"version": 99})  # a valid pair, one level up
    outside = "../ckpt-00000009.safetensors"
    _write_unchecked(inside, 2, {"a": torch.ones(4)}, {"version": 2, "tensors_file": outside})
    # The JSON's hash is the one of its own file name's bytes; point it at the outside file's instead.
    meta = json.loads((inside / "ckpt-00000002.json").read_text())
    meta["tensors_sha256"] = hashlib.sha256((tmp_path / "ckpt-00000009.safetensors").read_bytes()).hexdigest()
    (inside / "ckpt-00000002.json").write_text(json.dumps(meta))
    assert load_checkpoint(inside)[1]["version"] == 1

"""The learner's device-facing API: split steps, gradients in and out, fragments in and out, prefetching,
checkpoints state, on the CPU or on ``ATOLL_TEST_DEVICE``'s device (tests/conftest.py). Two learners that run the
same steps must agree bit for bit at the device's default precision (bf16 autocast on cuda); a test that compares
the learner with a forward pass of its own asks for fp32, which that forward pass computes in. The same
properties on xla are in tests/xla/test_xla_learner.py."""

import math

import pytest
import torch

from atoll.models.configs import MODELS
from atoll.models.data import Corpus, load_corpus
from atoll.models.fragments import Fragment
from atoll.node.config import RunConfig
from atoll.node.device import Device, resolve_device
from atoll.node.island.learner import Learner

RUN = RunConfig(model="nano", warmup_steps=3)


@pytest.fixture(scope="module")
def corpus():
    tokens, _ = load_corpus("builtin")
    return Corpus(tokens, MODELS["nano"].seq_len, RUN.num_shards)


def make(corpus, device_name, precision=None):
    return Learner(RUN, resolve_device(device_name), corpus, shard=1, batch_size=4, precision=precision)


def on_device(batch, learner):
    """A batch's inputs and targets on the learner's device."""
    return batch[:, :-1].to(learner.device.torch_device), batch[:, 1:].to(learner.device.torch_device)


def test_train_step_is_backward_then_apply_step(corpus, device_name):
    fused, split = make(corpus, device_name), make(corpus, device_name)
    for _ in range(4):
        assert fused.train_step() == split.backward()
        split.apply_step()
    assert torch.equal(fused.flat_params(), split.flat_params())
    assert (fused.step, fused.tokens, fused.position) == (split.step, split.tokens, split.position) == (4, 4 * fused.tokens_per_step, 16)


def test_flat_grads_round_trip_and_loaded_grads_drive_the_step(corpus, device_name):
    a, b, c = make(corpus, device_name), make(corpus, device_name), make(corpus, device_name)
    a.backward()
    g = a.flat_grads()
    assert g.dtype == torch.float32 and g.numel() == a.flat_params().numel() and g.abs().sum() > 0
    # b computes its own gradient on a different batch, then takes a's: its step must equal a's step.
    b.position = 40
    b.backward()
    assert not torch.equal(b.flat_grads(), g)
    b.load_flat_grads(g)
    assert torch.equal(b.flat_grads(), g)
    a.apply_step()
    b.apply_step()
    assert torch.equal(a.flat_params(), b.flat_params())
    # Gradients that were never computed are loaded too (p.grad is None after a step).
    c.load_flat_grads(g)
    c.apply_step()
    assert torch.equal(a.flat_params(), c.flat_params())
    with pytest.raises(ValueError):
        c.load_flat_grads(g[:-1])


def test_fragments_and_snapshots_address_parameters_in_place(corpus, device_name):
    """What the daemon does with one fragment between steps: read it (``Fragment.gather``, or a ``snapshot`` that
    does not hold up training) and write merged values back into the learner's tensors (``Fragment.scatter``)."""
    learner = make(corpus, device_name)
    learner.train_step()
    flat = learner.flat_params()
    sizes = [p.numel() for p in learner.params]
    idx = [1, 3, 4]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    expected = torch.cat([flat[offsets[i]: offsets[i] + sizes[i]] for i in idx])
    fragment = Fragment(0, tuple(idx), expected.numel(), has_embedding=False, offset=0)
    assert torch.equal(fragment.gather(learner.params), expected)
    snap = learner.snapshot(idx)
    before = [p for p in learner.params]
    fragment.scatter(torch.zeros(expected.numel()), learner.params)
    assert all(a is b for a, b in zip(before, learner.params))  # the optimizer's tensors, changed in place
    assert torch.equal(snap.result(), expected)  # a snapshot is of the time it was taken
    assert fragment.gather(learner.params).abs().sum() == 0
    assert learner.snapshot(idx).result().abs().sum() == 0
    other = [i for i in range(len(sizes)) if i not in idx]
    assert torch.equal(learner.snapshot(other).result(),
                       torch.cat([flat[offsets[i]: offsets[i] + sizes[i]] for i in other]))


def test_prefetched_batch_follows_position_changes(corpus, device_name):
    """The daemon sets ``position`` on restore: a batch prefetched for the old position must not be used."""
    # fp32: the expected loss is a plain forward pass, without the autocast a device may default to.
    learner, ref = make(corpus, device_name, "fp32"), make(corpus, device_name, "fp32")
    learner.train_step()  # prefetches position 4
    learner.position = 100
    ref.load_flat(learner.flat_params())
    batch = corpus.batch_at(1, 100, 4)
    with torch.no_grad():
        expected = float(ref.model(*on_device(batch, ref)))
    assert learner.backward() == pytest.approx(expected, abs=1e-6)


def test_state_round_trip_continues_bit_identically(corpus, device_name):
    a = make(corpus, device_name)
    for _ in range(3):
        a.train_step()
    b = make(corpus, device_name)
    b.load_state_tensors(a.state_tensors())
    b.step, b.tokens, b.position = a.step, a.tokens, a.position
    for _ in range(3):
        assert a.train_step() == b.train_step()
    assert torch.equal(a.flat_params(), b.flat_params())
    assert all(v.device.type == "cpu" for v in a.state_tensors().values())


def test_the_default_precision_trains_with_fp32_master_weights(corpus, device_name):
    """At the device's default precision (bf16 autocast on cuda) the loss is finite and falls, and θ and AdamW's
    state stay fp32 on the device; ``test_state_round_trip_continues_bit_identically`` restores them exactly."""
    learner = make(corpus, device_name)
    losses = [learner.train_step() for _ in range(30)]
    assert all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses  # about 5.2 -> 3.7 on the CPU
    assert all(p.dtype == torch.float32 and p.device.type == device_name for p in learner.params)
    state = learner.optimizer.state[learner.params[0]]
    assert all(v.dtype == torch.float32 and v.device.type == device_name for v in state.values())


def test_bf16_autocast_trains_close_to_fp32(corpus, device_name):
    fp32, bf16 = make(corpus, device_name, "fp32"), make(corpus, device_name, "bf16")
    assert Device("cpu", torch.device("cpu")).precision == "fp32" and bf16.precision == "bf16"
    assert make(corpus, device_name).precision == {"cpu": "fp32", "cuda": "bf16"}[device_name]  # the default
    for _ in range(3):
        l32, l16 = fp32.train_step(), bf16.train_step()
        assert abs(l32 - l16) < 0.05
    assert all(p.dtype == torch.float32 for p in bf16.params)  # master weights stay fp32
    assert not torch.equal(fp32.flat_params(), bf16.flat_params())  # bf16 really ran
    with pytest.raises(ValueError):
        make(corpus, device_name, precision="fp8")


def test_evaluate_is_the_mean_held_out_loss(corpus, device_name):
    learner = make(corpus, device_name, "fp32")  # the direct losses are plain forward passes, without autocast
    batches = corpus.held_out(3, 4)
    with torch.no_grad():
        direct = [float(learner.model(*on_device(b, learner))) for b in batches]
    assert learner.evaluate(batches) == pytest.approx(sum(direct) / 3, rel=1e-6)
    assert learner.model.training


def test_lagged_step_returns_the_previous_loss_and_takes_the_same_step(corpus, device_name):
    plain, lagged = make(corpus, device_name), make(corpus, device_name)
    losses = [plain.train_step() for _ in range(4)]
    got = [lagged.train_step_lagged() for _ in range(4)]
    assert got == [None, *losses[:3]]
    assert torch.equal(plain.flat_params(), lagged.flat_params())
    fifth = lagged.train_step()  # mixing both is fine: the next lagged call returns this step's loss
    assert fifth == plain.train_step()
    assert lagged.train_step_lagged() == fifth

"""The learner on xla (torch_xla's CPU runtime) against the CPU learner: same steps, flat compilation count,
snapshots that are not disturbed by later steps, checkpoint state that moves between devices, bf16 autocast."""

import threading

import pytest
import torch
from xla_helpers import xla_only

from atoll.models.configs import MODELS
from atoll.models.data import Corpus, load_corpus
from atoll.models.fragments import copy_into, flatten
from atoll.node.config import RunConfig
from atoll.node.device import resolve_device
from atoll.node.island.learner import Learner


def gather(learner: Learner, indices) -> torch.Tensor:
    """The parameters ``indices`` as one flat fp32 host tensor."""
    return flatten(learner.device.to_host([learner.params[i] for i in indices]))


def scatter(learner: Learner, indices, flat: torch.Tensor) -> None:
    copy_into(flat, [learner.params[i] for i in indices])
    learner.device.sync()


pytestmark = xla_only

RUN = RunConfig(model="nano", warmup_steps=5)
BATCH = 4


@pytest.fixture(scope="module")
def corpus():
    tokens, _ = load_corpus("builtin")
    return Corpus(tokens, MODELS["nano"].seq_len, RUN.num_shards)


@pytest.fixture(scope="module")
def xla():
    return resolve_device("xla")


def cpu_learner(corpus):
    return Learner(RUN, resolve_device("cpu"), corpus, shard=2, batch_size=BATCH)


def xla_learner(corpus, xla, precision="fp32"):
    return Learner(RUN, xla, corpus, shard=2, batch_size=BATCH, precision=precision)


def test_xla_device_defaults_to_bf16_and_describes_itself(xla):
    assert xla.kind == "xla" and xla.torch_device.type == "xla"
    assert xla.precision == "bf16"
    assert xla.describe() == "xla:CPU/bf16"


def test_fp32_steps_match_the_cpu_learner(corpus, xla):
    x, c = xla_learner(corpus, xla), cpu_learner(corpus)
    assert torch.equal(x.flat_params(), c.flat_params())  # the same θ₀ (initialised on the host)
    for _ in range(8):
        lx, lc = x.train_step(), c.train_step()
        assert lx == pytest.approx(lc, abs=1e-4)
    lagged = [x.train_step_lagged() for _ in range(3)]  # the loss read one step late: the same steps
    expected = [c.train_step() for _ in range(3)]
    assert lagged[0] == pytest.approx(lx, abs=1e-4) and lagged[1:] == pytest.approx(expected[:2], abs=1e-4)
    assert (x.flat_params() - c.flat_params()).abs().max() < 1e-4
    # The split halves (the gradient all-reduce baseline's) agree with the CPU's too.
    assert x.backward() == pytest.approx(c.backward(), abs=1e-4)
    gx, gc = x.flat_grads(), c.flat_grads()
    assert (gx - gc).abs().max() < 1e-3 * gc.abs().max()
    x.load_flat_grads(gc)  # both apply the CPU's gradient
    x.apply_step()
    c.apply_step()
    assert (x.flat_params() - c.flat_params()).abs().max() < 1e-4
    held_out = corpus.held_out(2, BATCH)
    assert x.evaluate(held_out) == pytest.approx(c.evaluate(held_out), abs=1e-4)
    assert (x.step, x.tokens, x.position) == (c.step, c.tokens, c.position)


def test_bf16_autocast_runs_bf16_matmuls_and_trains_like_fp32(corpus, xla):
    import torch_xla

    b16, f32, c = xla_learner(corpus, xla, "bf16"), xla_learner(corpus, xla, "fp32"), cpu_learner(corpus)
    batch = corpus.batch_at(2, 0, BATCH).to(xla.torch_device)
    hlo = {}
    for name, learner in (("bf16", b16), ("fp32", f32)):
        with torch.no_grad(), learner._autocast_device.autocast():
            loss = learner.model(batch[:, :-1], batch[:, 1:])
        hlo[name] = torch_xla._XLAC._get_xla_tensors_hlo([loss])
        xla.sync()
    assert "bf16" in hlo["bf16"] and "bf16" not in hlo["fp32"]
    start = c.flat_params()
    for _ in range(5):
        assert b16.train_step() == pytest.approx(c.train_step(), abs=0.05)
    assert all(p.dtype == torch.float32 for p in b16.params)  # fp32 master weights
    # bf16 matmuls perturb the five steps' update, not replace it: the parameters differ from fp32's by a small
    # part of how far the five steps moved them (a fixed tolerance would not notice a wrong update of that size).
    moved = (c.flat_params() - start).abs().max()
    apart = (b16.flat_params() - c.flat_params()).abs().max()
    print(f"bf16 vs fp32 after 5 steps: apart {float(apart):.3g}, moved {float(moved):.3g}")
    assert 0 < apart < 0.5 * moved, (float(apart), float(moved))


def test_compilation_count_is_flat_after_warm_up(corpus, xla):
    """Every path the daemon and the all-reduce baseline use, once to warm up, then three more times:
    no new graph is compiled (the warm-up learning rate changes every step, the step count grows)."""
    learner = xla_learner(corpus, xla, "bf16")
    held_out = corpus.held_out(2, BATCH)
    fragment = [0, 3, 5]

    def cycle():
        for _ in range(3):
            learner.train_step()
        learner.backward()
        learner.load_flat_grads(learner.flat_grads() * 0.5)
        learner.apply_step()
        snap = learner.snapshot(fragment)
        learner.train_step()
        scatter(learner, fragment, snap.result())
        learner.evaluate(held_out)
        learner.load_flat(learner.flat_params())
        learner.load_state_tensors(learner.state_tensors())  # as on restore; the next step is its own graph once
        for _ in range(2):
            learner.train_step_lagged()

    before = xla.compilations()
    cycle()  # warm-up: every path once, then every path after every other (a step after a restore is a new graph)
    cycle()
    warm = xla.compilations()
    assert 0 < warm - before <= 12
    for _ in range(3):
        cycle()
    assert learner.step == 5 * 7 and xla.compilations() == warm
    # Past step ~324, 1 - 0.9^step rounds to exactly 1.0: with a host-side step count that constant changes the
    # graph once more. The learner's step count lives on the device, so crossing it compiles nothing.
    state = learner.state_tensors()
    for key in [k for k in state if k.endswith(".step")]:
        state[key] = torch.tensor(318.0)
    learner.load_state_tensors(state)
    for _ in range(10):
        learner.train_step()
    assert float(learner.state_tensors()["opt.0.step"]) == 328 and xla.compilations() == warm


def test_snapshot_is_of_the_moment_it_was_taken(corpus, xla):
    learner = xla_learner(corpus, xla, "bf16")
    learner.train_step()
    fragment = [1, 2, 4]
    expected = gather(learner, fragment)
    learner.snapshot([0]).result()
    gate = threading.Event()
    learner._snapshots.submit(gate.wait, 60)  # hold the transfer back until the steps below have run
    snap = learner.snapshot(fragment)
    for _ in range(3):  # in-place parameter updates must not reach the snapshot
        learner.train_step()
    assert not snap.done()  # the steps did not wait for it
    gate.set()
    assert torch.equal(snap.result(timeout=60), expected)
    assert not torch.equal(gather(learner, fragment), expected)


def test_merged_fragment_is_copied_in_place(corpus, xla):
    learner = xla_learner(corpus, xla, "bf16")
    learner.train_step()
    tensors = list(learner.params)
    fragment = [0, 4]
    merged = torch.randn(sum(learner.params[i].numel() for i in fragment))
    scatter(learner, fragment, merged)
    assert all(a is b for a, b in zip(tensors, learner.params))
    assert torch.equal(gather(learner, fragment), merged)
    assert learner.optimizer.param_groups[0]["params"][0] is learner.params[0]
    learner.train_step()  # and training goes on from the merged values
    assert (gather(learner, fragment) - merged).abs().max() < 0.01


def test_next_batch_is_prefetched_to_the_device(corpus, xla):
    learner = xla_learner(corpus, xla, "bf16")
    learner.train_step()
    (key, [(x, y)]) = learner._prefetched  # one micro-batch: a list of one (x, y)
    assert key == (learner.position, BATCH) and x.device.type == "xla" and y.device.type == "xla"
    expected = corpus.batch_at(2, learner.position, BATCH)
    assert torch.equal(x.cpu(), expected[:, :-1]) and torch.equal(y.cpu(), expected[:, 1:])


@pytest.mark.parametrize("direction", ["xla->cpu", "cpu->xla"])
def test_checkpoint_state_moves_between_devices(corpus, xla, direction):
    x, c = xla_learner(corpus, xla), cpu_learner(corpus)
    src, dst = (x, cpu_learner(corpus)) if direction == "xla->cpu" else (c, xla_learner(corpus, xla))
    for _ in range(4):
        src.train_step()
    state = src.state_tensors()
    assert all(v.device.type == "cpu" for v in state.values())
    assert state.keys() == cpu_learner(corpus).state_tensors().keys() | {
        f"opt.{i}.{k}" for i in range(len(src.params)) for k in ("step", "exp_avg", "exp_avg_sq")}
    assert float(state["opt.0.step"]) == 4
    dst.load_state_tensors(state)
    dst.step, dst.tokens, dst.position = src.step, src.tokens, src.position
    for _ in range(3):
        assert dst.train_step() == pytest.approx(src.train_step(), abs=1e-4)
    assert (dst.flat_params() - src.flat_params()).abs().max() < 1e-4


def test_a_paused_learner_frees_the_device_and_trains_on_as_its_twin(corpus, xla):
    """``release`` (a pause) empties θ and the AdamW state on the device; ``reclaim`` puts them back exactly, and
    the next steps are the twin's that never paused."""
    paused, twin = xla_learner(corpus, xla), xla_learner(corpus, xla)
    for _ in range(3):
        paused.train_step()
        twin.train_step()
    before = {k: v.clone() for k, v in paused.state_tensors().items()}
    kept = paused.release()
    assert paused.held_bytes() == 0
    paused.reclaim(kept)
    after = paused.state_tensors()
    assert all(torch.equal(before[k], after[k]) for k in before)
    for _ in range(2):
        assert paused.train_step() == pytest.approx(twin.train_step(), abs=1e-6)
    assert torch.equal(gather(paused, range(len(paused.params))), gather(twin, range(len(twin.params))))

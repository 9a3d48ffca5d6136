"""The user's side of ``atoll.Island`` without sockets: a ``LoopTrainee`` over any module and ``torch.optim``
optimizer checkpoints and restores θ and the optimizer's state exactly (param groups in another order than the
module's, SGD's None momentum, tied weights once), on the CPU or on ``ATOLL_TEST_DEVICE``'s device, counts steps and
tokens, evaluates without gradients, reads a snapshot off an accelerator only once the device wrote it; and
``Island`` refuses bad arguments with one-line ``ConfigError``s before it starts anything."""

import math

import pytest
import torch
import torch.nn as nn

import atoll
from atoll.models.fragments import flatten
from atoll.node.device import Device
from atoll.node.trainee import LoopTrainee, device_of

CPU = Device("cpu", torch.device("cpu"))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter
        self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, x, y):
        logits = self.head(torch.tanh(self.mid(self.embed(x))))
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def batch(seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 11, (4, 5), generator=g).to(device), torch.randint(0, 11, (4, 5), generator=g).to(device)


def train(model, optimizer, steps, first=0):
    device = next(model.parameters()).device
    for s in range(first, first + steps):
        model(*batch(s, device)).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("make", [
    # Groups in the reverse of the module's order: the optimizer numbers its state by group order, not ours.
    lambda m: torch.optim.AdamW([{"params": [m.mid.weight, m.mid.bias], "weight_decay": 0.0},
                                 {"params": [m.embed.weight]}], lr=1e-2),
    lambda m: torch.optim.SGD(m.parameters(), lr=0.1),  # momentum 0: its buffers are None
    lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True),
])
def test_a_checkpoint_restores_model_and_optimizer_exactly(make, device_name):
    torch.manual_seed(0)
    model = Tied().to(device_name)
    optimizer = make(model)
    trainee = LoopTrainee(model, optimizer, device_of(model))
    assert len(trainee.params) == 3  # embed (the tied head once), mid.weight, mid.bias; not the frozen one
    train(model, optimizer, 3)
    saved = trainee.state_tensors()
    assert all(v.device.type == "cpu" for v in saved.values())  # host copies, wherever the model lives
    train(model, optimizer, 4, first=3)
    reference = trainee.flat_params()

    torch.manual_seed(1)
    other = Tied().to(device_name)
    other_opt = make(other)
    restored = LoopTrainee(other, other_opt, device_of(other))
    restored.load_state_tensors(saved)
    train(other, other_opt, 4, first=3)
    assert torch.equal(restored.flat_params(), reference)


def test_advance_counts_steps_and_tokens_and_evaluate_runs_without_gradients():
    model = Tied()
    seen = []

    def evaluate(m):
        seen.append((torch.is_grad_enabled(), m.training))
        return 1.5

    trainee = LoopTrainee(model, torch.optim.SGD(model.parameters(), lr=0.1), CPU, evaluate)
    trainee.advance(20)
    trainee.advance(12)
    assert (trainee.step, trainee.tokens, trainee.tokens_per_step, trainee.position) == (2, 32, 12, 2)
    assert trainee.held_out_loss() == 1.5 and seen == [(False, False)] and model.training
    assert math.isnan(LoopTrainee(model, torch.optim.SGD(model.parameters(), lr=0.1), CPU).held_out_loss())


def test_the_device_is_the_models(device_name):
    device = device_of(Tied().to(device_name))
    assert (device.kind, device.torch_device.type, device.precision) == (device_name, device_name, "fp32")
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        device_of(frozen)


def test_a_snapshot_off_the_cpu_is_read_once_the_device_has_written_it():
    """On an accelerator ``snapshot`` copies θ on the device and a background thread reads the copies, on a stream
    of its own: it must wait for the device's fence (``Device.fence``) first, or it may read them before the device
    wrote them. A stand-in device logs the order."""
    log = []

    class Queued(Device):
        def fence(self):
            log.append("fenced")
            return lambda: log.append("written")

        def to_host(self, tensors):
            log.append("read")
            return super().to_host(tensors)

    model = Tied()
    trainee = LoopTrainee(model, torch.optim.SGD(model.parameters(), lr=0.1), Queued("cuda", torch.device("cpu")))
    expected = flatten([trainee.params[0], trainee.params[2]])
    assert torch.equal(trainee.snapshot([0, 2]).result(), expected)
    assert log == ["fenced", "written", "read"]


def test_a_snapshot_of_a_loop_on_a_side_stream_holds_what_that_stream_wrote(device_name):
    """The same on a GPU: the user's loop writes θ on a stream of its own, behind half a second of queued work, and
    takes a snapshot; the background thread reads on its own stream, which is not ordered after the loop's."""
    if device_name != "cuda":
        pytest.skip("streams are cuda's; the CPU copies at once")
    model = Tied().to(device_name)
    trainee = LoopTrainee(model, torch.optim.SGD(model.parameters(), lr=0.1), device_of(model))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        torch.cuda._sleep(1_000_000_000)  # GPU clock cycles: about half a second at 2 GHz
        for p in trainee.params:
            p.fill_(7.0)
        snapshot = trainee.snapshot(range(len(trainee.params)))
    assert torch.equal(snapshot.result(), torch.full((sum(p.numel() for p in trainee.params),), 7.0))


@pytest.mark.parametrize("args, kwargs, message", [
    (("not a model", torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)), {}, "model: expected a torch.nn.Module"),
    ((Tied(), "sgd"), {}, "optimizer: expected a torch.optim.Optimizer"),
    ((Tied(), None), {"no_such_setting": 1}, "config: unknown key(s) no_such_setting"),
    ((Tied(), None), {"algorithm": "gossip"}, "algorithm: unknown 'gossip'"),
    ((Tied(), None), {"tokens_per_step": 0}, "tokens_per_step: must be a positive int"),
    ((Tied(), None), {"sync_every": "often"}, "sync_every: expected a int"),
])
def test_bad_arguments_are_one_line_config_errors(args, kwargs, message):
    model, optimizer = args
    if optimizer is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(atoll.ConfigError) as e:
        atoll.Island(model, optimizer, **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_optimizer_that_leaves_out_trainable_parameters_is_refused():
    model = Tied()
    with pytest.raises(atoll.ConfigError, match=r"optimizer: it does not train 2 of the model's trainable "
                                                 r"parameters \(mid.weight, mid.bias\)"):
        atoll.Island(model, torch.optim.SGD([model.embed.weight], lr=0.1))

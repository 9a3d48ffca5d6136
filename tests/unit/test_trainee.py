"""The user's side of ``atoll.Island`` without sockets: a ``LoopTrainee`` over any module and ``torch.optim``
optimizer checkpoints and restores θ and the optimizer's state exactly (param groups in another order than the
module's, SGD's None momentum, tied weights once), counts steps and tokens, evaluates without gradients; and
``Island`` refuses bad arguments with one-line ``ConfigError``s before it starts anything."""

import math

import pytest
import torch
import torch.nn as nn

import atoll
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


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 11, (4, 5), generator=g), torch.randint(0, 11, (4, 5), generator=g)


def train(model, optimizer, steps, first=0):
    for s in range(first, first + steps):
        model(*batch(s)).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("make", [
    # Groups in the reverse of the module's order: the optimizer numbers its state by group order, not ours.
    lambda m: torch.optim.AdamW([{"params": [m.mid.weight, m.mid.bias], "weight_decay": 0.0},
                                 {"params": [m.embed.weight]}], lr=1e-2),
    lambda m: torch.optim.SGD(m.parameters(), lr=0.1),  # momentum 0: its buffers are None
    lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True),
])
def test_a_checkpoint_restores_model_and_optimizer_exactly(make):
    torch.manual_seed(0)
    model = Tied()
    optimizer = make(model)
    trainee = LoopTrainee(model, optimizer, CPU)
    assert len(trainee.params) == 3  # embed (the tied head once), mid.weight, mid.bias; not the frozen one
    train(model, optimizer, 3)
    saved = trainee.state_tensors()
    train(model, optimizer, 4, first=3)
    reference = trainee.flat_params()

    torch.manual_seed(1)
    other = Tied()
    other_opt = make(other)
    restored = LoopTrainee(other, other_opt, CPU)
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


def test_the_device_is_the_models():
    assert device_of(Tied()).kind == "cpu"
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        device_of(frozen)


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

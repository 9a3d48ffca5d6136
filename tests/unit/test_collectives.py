"""``collectives.settle``: the wait after a collective until the tensors only its caller held are back to that one
reference (the process group's thread let go of them). Another holder is stood in for by a view, which holds a
reference to its base; it lets go at a given pause, so the waits are counted, not timed."""

import torch

from atoll.node.island import collectives


def test_settle_returns_once_the_other_holder_let_go(monkeypatch):
    t = torch.zeros(8)
    ours = collectives._held([t])
    assert ours == [t]
    holder = [t.view(2, 4)]  # what a work in a worker thread holds until it is dropped
    assert t._use_count() == 2
    pauses = []

    def pause():
        pauses.append(1)
        if len(pauses) == 3:
            holder.clear()

    monkeypatch.setattr(collectives, "_pause", pause)
    assert collectives.settle(ours)
    assert len(pauses) == 3 and t._use_count() == 1


def test_tensors_held_elsewhere_too_are_not_waited_for():
    """A parameter's last reference is not the caller's to drop: no wait for it (it would never come)."""
    param = torch.nn.Parameter(torch.zeros(4))
    model_holds = [param.view(4)]  # autograd's graph, an optimizer: some other holder of the parameter
    temporary = torch.zeros(3)
    assert param._use_count() > 1
    assert collectives._held([param, temporary]) == [temporary]
    assert model_holds


def test_settle_gives_up_after_its_timeout(monkeypatch):
    t = torch.zeros(4)
    ours = collectives._held([t])
    stuck = [t.view(4)]  # never let go
    monkeypatch.setattr(collectives, "_pause", lambda: None)
    assert collectives.settle(ours, timeout=0.0) is False
    assert stuck and t._use_count() == 2

"""``collectives``: what a collective's caller alone held and the process group's thread still holds when the call
returns is kept referenced until that thread lets go, and ``settle`` (run at exit) waits for the last of it.
Another holder is stood in for by a view, which holds a reference to its base; it lets go at a given pause, so the
waits are counted, not timed."""

import torch

from atoll.node.island import collectives


def test_what_gloo_still_holds_is_kept_until_it_lets_go(monkeypatch):
    monkeypatch.setattr(collectives, "_pending", [])
    t, done = torch.zeros(8), torch.zeros(2)
    ours = collectives._held([t, done])
    assert ours == [t, done]
    holder = [t.view(2, 4)]  # what a work in a worker thread holds until it is dropped
    collectives._keep(ours)
    assert collectives._pending == [t]  # `done` was let go of already: not kept
    collectives._keep([])
    assert collectives._pending == [t]  # still held: still kept
    holder.clear()
    collectives._keep([])
    assert collectives._pending == []  # let go of: no longer kept, freed where the caller drops it


def test_settle_waits_for_the_last_kept_tensor(monkeypatch):
    t = torch.zeros(8)
    holder = [t.view(8)]
    monkeypatch.setattr(collectives, "_pending", [t])
    pauses = []

    def pause():
        pauses.append(1)
        if len(pauses) == 3:
            holder.clear()

    monkeypatch.setattr(collectives, "_pause", pause)
    assert collectives.settle()
    assert len(pauses) == 3 and collectives._pending == [] and t._use_count() == 1


def test_tensors_held_elsewhere_too_are_not_kept():
    """A parameter's last reference is not the caller's to drop: nothing to keep it for."""
    param = torch.nn.Parameter(torch.zeros(4))
    model_holds = [param.view(4)]  # autograd's graph, an optimizer: some other holder of the parameter
    temporary = torch.zeros(3)
    assert param._use_count() > 1
    assert collectives._held([param, temporary]) == [temporary]
    assert model_holds


def test_settle_gives_up_after_its_timeout(monkeypatch):
    t = torch.zeros(4)
    stuck = [t.view(4)]  # never let go
    monkeypatch.setattr(collectives, "_pending", [t])
    monkeypatch.setattr(collectives, "_pause", lambda: None)
    assert collectives.settle(timeout=0.0) is False
    assert stuck and collectives._pending == [t]

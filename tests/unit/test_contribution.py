"""A round's contribution handed from the training loop to the syncer's event loop (node/rounds/contribution.py): given
at once, given when asked, refused, or given too late (no sockets, no training)."""

import asyncio
import threading

import torch

from atoll.node.rounds.contribution import Contribution


def test_a_ready_contribution_is_taken_at_once():
    delta = torch.ones(3)
    c = Contribution.ready(delta, 2.0)
    assert not c.wanted() and c.settled()
    taken = asyncio.run(c.take(0.01))
    assert taken is not None and taken[0] is delta and taken[1] == 2.0


def test_the_loop_gives_the_contribution_the_round_asks_for():
    """The round registers with an estimate, asks once formed; the loop's thread sees it wanted and gives it."""
    c = Contribution(1.0)
    assert not c.wanted()

    def loop():  # the training loop: at its next step boundary after the ask
        while not c.wanted():
            threading.Event().wait(0.001)
        c.give(torch.zeros(2), 5.0)

    t = threading.Thread(target=loop)
    t.start()
    taken = asyncio.run(c.take(5.0))
    t.join()
    assert taken is not None and taken[1] == 5.0 and c.weight == 5.0 and not c.wanted()


def test_refused_or_too_late_is_none_and_a_late_give_is_harmless():
    refused = Contribution(1.0)
    refused.ask()
    refused.refuse()
    assert asyncio.run(refused.take(1.0)) is None and refused.given() is None

    late = Contribution(1.0)
    assert asyncio.run(late.take(0.01)) is None  # the loop never answered: the round leaves its group
    late.give(torch.zeros(1), 1.0)  # the loop answers after the round gave up: no error, nothing taken
    late.refuse()
    assert late.given() is None

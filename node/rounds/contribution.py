"""Our part of an outer round: the pseudo-gradient and its token weight, handed from the training loop to the round.

The synchronous algorithms snapshot θ_p at the fragment's due step and hand the contribution over with the round
(``Contribution.ready``). Decoupled DiLoCo takes it when the round's group has formed, as the paper's syncer does:
the round registers with an estimate of its weight, and once it knows its members it asks (``take``); the training
loop answers at its next step boundary (``wanted`` / ``give``), never waiting for the network. The steps trained
while the group formed then go into this contribution instead of being carried into the next one: only the
reduce itself is in flight.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import torch


class Contribution:
    """``weight`` is the estimate the round registers with until the contribution is given. Thread-safe: ``take``
    runs on the syncer's event loop, ``wanted``/``give``/``refuse`` on the training loop's thread."""

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self._asked = threading.Event()
        self._value: concurrent.futures.Future = concurrent.futures.Future()

    @classmethod
    def ready(cls, delta: torch.Tensor, weight: float) -> Contribution:
        """A contribution snapshotted already (at the due step)."""
        c = cls(weight)
        c._value.set_result((delta, weight))
        return c

    def ask(self) -> None:
        """The round has formed: the training loop is to snapshot θ_p at its next step boundary."""
        self._asked.set()

    def given(self) -> tuple[torch.Tensor, float] | None:
        """The contribution if given by now (None if not yet, or refused)."""
        return self._value.result() if self._value.done() and not self._value.cancelled() else None

    def settled(self) -> bool:
        """Given or refused."""
        return self._value.done()

    def wanted(self) -> bool:
        """The round has formed and asks for the snapshot; not yet given."""
        return self._asked.is_set() and not self._value.done()

    def give(self, delta: torch.Tensor, weight: float) -> None:
        self.weight = weight
        self._settle(lambda f: f.set_result((delta, weight)))

    def refuse(self) -> None:
        """No contribution against the round's replica can be made (an adoption moved θ_p's base meanwhile)."""
        self._settle(lambda f: f.set_result(None))

    def _settle(self, how) -> None:
        try:
            how(self._value)
        except concurrent.futures.InvalidStateError:  # the round gave up waiting (``take``'s timeout)
            pass

    async def take(self, timeout: float) -> tuple[torch.Tensor, float] | None:
        """Ask for the contribution and wait up to ``timeout`` seconds; None if refused or not given in time (the
        loop stopped, or paused without draining)."""
        self.ask()
        try:
            return await asyncio.wait_for(asyncio.wrap_future(self._value), timeout)
        except asyncio.TimeoutError:
            return None

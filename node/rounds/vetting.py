"""Vetting a replica nobody vouches for, on the learner's thread, by the one thing its sender cannot forge: this
daemon's own held-out loss.

A *lonely* daemon (no live peer holds its replica of a fragment, nobody vouches for a heavier one; see
``catchup``) may take one peer's heavier claim, since forked honest daemons would otherwise never meet again. What
it downloads is only what that peer says it is, so before adopting it the learner evaluates the model twice on
the fixed held-out batches: with our replica Θ, and with Θ whose fragment is the candidate. The candidate is
adopted only if its loss is finite and at most ``LOSS_MARGIN`` above the *reference*: the lowest loss of our own
replica or of an adopted candidate measured in the last ``REFERENCE_SECONDS`` (so a peer cannot walk a daemon's
model downhill by one margin at a time). An honest fork that merged more rounds than ours passes; the review's
all-zero model (ln 256 ≈ 5.5 against about 2.5) and any state worse than ours by more than the margin do not.

This checks quality, not provenance: a state as good as ours on our held-out data may still differ from what any
honest round produced (docs/security.md, Known limits).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from atoll.models.fragments import Fragment
from atoll.protocols.state_sync import ReplicaState

from ..trainee import Trainee
from .replica import Replica

logger = logging.getLogger("atoll")
LOSS_MARGIN = 0.25  # relative: an honest fork, and our replica with one fragment of it, can be far worse (docs/security.md)
REFERENCE_SECONDS = 600.0


def acceptable(theirs: float, reference: float, margin: float = LOSS_MARGIN) -> bool:
    """The rule: a candidate's held-out loss ``theirs`` passes against ``reference`` (both finite)."""
    return math.isfinite(theirs) and math.isfinite(reference) and theirs <= reference * (1 + margin)


class Vetting:
    """Judges candidates (``vet``) for one trainee (by its ``held_out_loss``); remembers the losses it measured, per fragment, for the
    reference. ``clock``: monotonic seconds (a parameter for the tests)."""

    def __init__(self, learner: Trainee, fragments: Sequence[Fragment], replica: Replica,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.learner, self.fragments, self.replica = learner, fragments, replica
        self.clock = clock
        self._measured: dict[int, deque[tuple[float, float]]] = {}  # fragment -> (when, loss), oldest first

    def reference(self, p: int, ours: float) -> float:
        """The lowest of ``ours`` and the losses measured for fragment ``p`` in the last ``REFERENCE_SECONDS``."""
        now, seen = self.clock(), self._measured.setdefault(p, deque())
        while seen and seen[0][0] < now - REFERENCE_SECONDS:
            seen.popleft()
        return min([ours, *(loss for _, loss in seen)])

    def _remember(self, p: int, loss: float) -> None:
        if math.isfinite(loss):
            self._measured.setdefault(p, deque()).append((self.clock(), loss))

    def losses(self, state: ReplicaState) -> tuple[float, float]:
        """The held-out loss of our replica Θ, and of Θ with fragment ``state.fragment`` replaced by the candidate's.
        θ (the learner's own, with its unmerged local progress) is put back afterwards, bit for bit."""
        learner = self.learner
        own = learner.flat_params()
        try:
            for q, fragment in enumerate(self.fragments):
                learner.put(fragment, self.replica.params_and_id(q)[0])
            ours = learner.held_out_loss()
            learner.put(self.fragments[state.fragment], state.params)
            theirs = learner.held_out_loss()
        finally:
            learner.load_flat(own)
        return ours, theirs

    def vet(self, state: ReplicaState) -> bool:
        """True if the candidate may be adopted (see the module's docstring); logs the verdict either way."""
        p = state.fragment
        if state.params.numel() != self.replica.numel(p) or not bool(torch.isfinite(state.params).all()):
            logger.warning("fragment %d: the v%d replica %s sent is malformed", p, state.version, state.donor[-8:])
            return False
        ours, theirs = self.losses(state)
        if not math.isfinite(ours):
            logger.warning("fragment %d: not adopting the v%d replica %s sent, vouched for by nobody: this island "
                           "measures no held-out loss to vet it by (atoll.Island takes evaluate=)", p, state.version,
                           state.donor[-8:])
            return False
        reference = self.reference(p, ours)
        self._remember(p, ours)
        if not acceptable(theirs, reference):
            logger.warning("fragment %d: not adopting the v%d replica %s sent, vouched for by nobody: its held-out "
                           "loss is %.4f, ours %.4f (reference %.4f)", p, state.version, state.donor[-8:], theirs,
                           ours, reference)
            return False
        self._remember(p, theirs)
        logger.info("fragment %d: the v%d replica %s sent, vouched for by nobody, passed the held-out check "
                    "(%.4f, ours %.4f)", p, state.version, state.donor[-8:], theirs, ours)
        return True

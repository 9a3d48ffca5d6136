"""What each training algorithm does differently, as data: the daemon and the syncer read these flags, never the
algorithm's name.

- ``ddp``: a gradient all-reduce every inner step among a fixed membership (the synchronous baseline).
- ``diloco``: the whole model is one fragment; every H steps a round of every live member, which the loop waits for.
- ``streaming``: P fragments on a staggered schedule, merged τ steps after their snapshot; the loop waits for a
  late merge.
- ``decoupled``: streaming's fragments, but the loop never waits: a round closes at a quorum K plus a grace window,
  daemons join rounds their peers opened, contributions are token-weighted and merged with RDA.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from atoll.models.outer import token_weight


class AlgorithmName(enum.StrEnum):
    DECOUPLED = "decoupled"
    STREAMING = "streaming"
    DILOCO = "diloco"
    DDP = "ddp"


class SnapshotAt(enum.StrEnum):
    """When a decoupled round takes its snapshot of θ_p (the synchronous algorithms always take it at the due step).

    - ``formation``: once the round's group has formed (the paper's syncer): the steps trained while the group formed
      go into this contribution, and only the reduce is in flight;
    - ``due``: at the fragment's due step, before the group forms: those steps are carried into the next one.
    """

    FORMATION = "formation"
    DUE = "due"


class LocalMerge(enum.StrEnum):
    """How a learner takes a round's result Θ_p,new into its own θ_p, given what it trained since the snapshot it
    contributed (``rounds.py``).

    - ``delta``: θ_p ← Θ_p,new + (θ_p,now − θ_p,snapshot): the steps trained while the round was in flight are
      kept and go into the next contribution (the same carry at an adoption: θ_p ← Θ_p,new + (θ_p − base));
    - ``overwrite``: θ_p ← Θ_p,new (the paper's α = 0): those steps are lost, and so is unmerged work at an adoption;
    - ``mix``: θ_p ← α·θ_p,now + (1 − α)·Θ_p,new (Streaming DiLoCo's α), adoptions as ``overwrite``.
    """

    DELTA = "delta"
    OVERWRITE = "overwrite"
    MIX = "mix"


# Rounds' worth of steps one contribution may hold at full weight: its own and one missed round's carried work.
CARRIED_ROUNDS = 2


@dataclass(frozen=True)
class Algorithm:
    """The policy of one algorithm."""

    name: AlgorithmName
    gradient_allreduce: bool = False  # a gradient all-reduce every step instead of outer rounds (fixed membership)
    fragmented: bool = False  # P fragments with an overlap of τ steps; otherwise one fragment, merged at once
    synchronous: bool = False  # the loop waits at a merge whose round has not landed, and after falling behind
    quorum: bool = False  # a round closes at K members plus the grace window, not when every live peer is in
    joins_open_rounds: bool = False  # contribute to a round a peer opened, ahead of one's own schedule
    token_weighted: bool = False  # weights c_tokens² / c_steps (else plain tokens)
    rda: bool = False  # radial-directional averaging of non-embedding fragments (when the run enables it)
    stale_contributions: bool = False  # may keep work a round missed for the next one (when the run enables it)

    def weight(self, tokens: int, steps: int) -> float:
        """A contribution's weight from the tokens and steps behind it since its fragment was last received."""
        return token_weight(tokens, steps) if self.token_weighted else float(tokens)

    def weight_bound(self, step_tokens: int, sync_every: int, overlap: int) -> float:
        """The most weight one contribution may declare (0: no bound, where the run does not bound its tokens a
        step): ``step_tokens`` for each of the steps one contribution can hold, ``CARRIED_ROUNDS`` rounds' worth
        plus the overlap (a round missed carries its work into the next; more than that is cut, not refused)."""
        if not step_tokens:
            return 0.0
        steps = CARRIED_ROUNDS * sync_every + self.overlap_steps(overlap)
        return self.weight(step_tokens * steps, steps)

    def num_fragments(self, configured: int) -> int:
        return configured if self.fragmented else 1

    def overlap_steps(self, configured: int) -> int:
        return configured if self.fragmented else 0


ALGORITHMS: dict[AlgorithmName, Algorithm] = {
    AlgorithmName.DDP: Algorithm(AlgorithmName.DDP, gradient_allreduce=True),
    AlgorithmName.DILOCO: Algorithm(AlgorithmName.DILOCO, synchronous=True),
    AlgorithmName.STREAMING: Algorithm(AlgorithmName.STREAMING, fragmented=True, synchronous=True),
    AlgorithmName.DECOUPLED: Algorithm(AlgorithmName.DECOUPLED, fragmented=True, quorum=True, joins_open_rounds=True,
                                       token_weighted=True, rda=True, stale_contributions=True),
}


def algorithm(name: str) -> Algorithm:
    """The policy named ``name``; ``ValueError`` for an unknown name."""
    return ALGORITHMS[AlgorithmName(name)]

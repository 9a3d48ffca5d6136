"""This daemon's replica of the global state: Θ, the outer momentum, version, merged weight, hash.

Lives in host memory as flat fp32 tensors and is shared by the learner thread and the protocol thread, so
every access goes through one lock. Identity of a replica: (version, weight, digest) — see
``atoll.protocols.records.heavier``.
"""

from __future__ import annotations

import threading

import torch

from atoll.models.outer import NesterovOuter, tensor_hash
from atoll.protocols.state_sync import ReplicaState


class Replica:
    def __init__(self, params: torch.Tensor, momentum: torch.Tensor | None = None, version: int = 0,
                 weight: float = 0.0) -> None:
        self._lock = threading.Lock()
        self.params = params.detach().to("cpu", torch.float32).clone()
        self.momentum = torch.zeros_like(self.params) if momentum is None else momentum.clone()
        self.version, self.weight = version, float(weight)
        self.digest = tensor_hash(self.params, self.momentum)
        self.steps_since_round = 0  # the learner's position in the sync period, shared with joiners

    @property
    def identity(self) -> tuple[int, float, str]:
        with self._lock:
            return self.version, self.weight, self.digest

    @property
    def numel(self) -> int:
        return self.params.numel()

    def params_copy(self) -> tuple[torch.Tensor, int]:
        with self._lock:
            return self.params.clone(), self.version

    def snapshot(self) -> ReplicaState:
        with self._lock:
            return ReplicaState(self.version, self.weight, self.digest, self.params.clone(), self.momentum.clone(),
                                self.steps_since_round)

    def apply_outer_step(self, version: int, delta: torch.Tensor, weight: float, outer: NesterovOuter) -> bool:
        """Apply a round's merged delta if the replica is still at ``version``; returns whether it was applied."""
        with self._lock:
            if self.version != version:
                return False
            outer.step(self.params, self.momentum, delta)
            self.version += 1
            self.weight += float(weight)
            self.digest = tensor_hash(self.params, self.momentum)
            return True

    def adopt(self, state: ReplicaState) -> bool:
        """Replace the replica with a heavier downloaded one; returns False if ours became at least as heavy."""
        with self._lock:
            if (state.version, state.weight, state.digest) <= (self.version, self.weight, self.digest):
                return False
            self.params, self.momentum = state.params.clone(), state.momentum.clone()
            self.version, self.weight, self.digest = state.version, state.weight, state.digest
            return True

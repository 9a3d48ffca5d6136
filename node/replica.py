"""This daemon's replica of the global state, per fragment: Θ_p, the outer momentum, version, merged weight, hash.

Lives in host memory as flat fp32 tensors and is shared by the learner thread and the protocol thread, so
every access goes through one lock. Identity of a fragment replica: (version, weight, digest) — see
``atoll.protocols.records.heavier``. ``diloco`` uses a single fragment holding every parameter.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from atoll.models.outer import NesterovOuter, tensor_hash
from atoll.protocols.state_sync import MAX_ANCESTORS, ReplicaState


class _Fragment:
    def __init__(self, params: torch.Tensor, momentum: torch.Tensor | None, version: int, weight: float,
                 ancestors: Sequence[str] = ()) -> None:
        self.params = params.detach().to("cpu", torch.float32).clone()
        self.momentum = torch.zeros_like(self.params) if momentum is None else momentum.detach().float().clone()
        self.version, self.weight = version, float(weight)
        self.digest = tensor_hash(self.params, self.momentum)
        self.ancestors = [a for a in ancestors if a != self.digest][-(MAX_ANCESTORS - 1):] + [self.digest]

    def advanced(self) -> None:
        """Θ_p changed into a descendant of itself: new digest, and the old one joins the ancestors."""
        self.digest = tensor_hash(self.params, self.momentum)
        self.ancestors = (self.ancestors + [self.digest])[-MAX_ANCESTORS:]


class Replica:
    def __init__(self, params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor] | None = None,
                 versions: Sequence[int] | None = None, weights: Sequence[float] | None = None,
                 ancestors: Sequence[Sequence[str]] | None = None) -> None:
        n = len(params)
        self._lock = threading.Lock()
        self._frags = [
            _Fragment(params[p], None if momentum is None else momentum[p], 0 if versions is None else versions[p],
                      0.0 if weights is None else weights[p], () if ancestors is None else ancestors[p])
            for p in range(n)
        ]
        self.schedule_step = 0  # the learner's position in the sync schedule, shared with joiners

    @property
    def num_fragments(self) -> int:
        return len(self._frags)

    def numel(self, p: int) -> int:
        return self._frags[p].params.numel()

    def identity(self, p: int) -> tuple[int, float, str]:
        with self._lock:
            f = self._frags[p]
            return f.version, f.weight, f.digest

    def identities(self) -> list[tuple[int, float, str]]:
        with self._lock:
            return [(f.version, f.weight, f.digest) for f in self._frags]

    @property
    def total_version(self) -> int:
        """Sum of fragment versions: one number that grows with every merged round."""
        return sum(v for v, _, _ in self.identities())

    def params_copy(self, p: int) -> tuple[torch.Tensor, int]:
        with self._lock:
            return self._frags[p].params.clone(), self._frags[p].version

    def params_and_id(self, p: int) -> tuple[torch.Tensor, tuple[int, str]]:
        """Θ_p and the (version, digest) it is, read together."""
        with self._lock:
            f = self._frags[p]
            return f.params.clone(), (f.version, f.digest)

    def snapshot(self, p: int) -> ReplicaState:
        with self._lock:
            f = self._frags[p]
            return ReplicaState(f.version, f.weight, f.digest, f.params.clone(), f.momentum.clone(),
                                self.schedule_step, fragment=p, ancestors=tuple(f.ancestors))

    def ancestors(self, p: int) -> list[str]:
        with self._lock:
            return list(self._frags[p].ancestors)

    def apply_outer_step(self, p: int, version: int, delta: torch.Tensor, weight: float,
                         outer: NesterovOuter, digest: str | None = None) -> bool:
        """Apply a round's merged delta if fragment ``p`` is still the replica the round started from (same
        version and, when given, the same digest: a heavier replica adopted at the same version does not count);
        returns whether it was applied."""
        with self._lock:
            f = self._frags[p]
            if f.version != version or (digest is not None and f.digest != digest):
                return False
            outer.step(f.params, f.momentum, delta)
            f.version += 1
            f.weight += float(weight)
            f.advanced()
            return True

    def adopt(self, state: ReplicaState) -> bool:
        """Replace a fragment with a heavier downloaded one; False if ours became at least as heavy meanwhile."""
        with self._lock:
            f = self._frags[state.fragment]
            if (state.version, state.weight, state.digest) <= (f.version, f.weight, f.digest):
                return False
            # A fork: our replica is not in the new one's history (as far as that history reaches back).
            oldest_known = state.version - len(state.ancestors) + 1
            state.forked = f.version >= oldest_known and f.digest not in state.ancestors
            f.params, f.momentum = state.params.clone(), state.momentum.clone()
            f.version, f.weight, f.digest = state.version, state.weight, state.digest
            f.ancestors = list(state.ancestors)[-MAX_ANCESTORS:] or [state.digest]
            return True

    def replace_params(self, p: int, version: int, params: torch.Tensor, weight: float) -> bool:
        """ddp: after a step every member applied the same averaged gradients, Θ_p is simply the new θ; applied
        only if fragment ``p`` is still at ``version`` (False when a heavier replica was adopted meanwhile)."""
        with self._lock:
            f = self._frags[p]
            if f.version != version:
                return False
            f.params = params.detach().to("cpu", torch.float32).clone()
            f.version += 1
            f.weight += float(weight)
            f.advanced()
            return True

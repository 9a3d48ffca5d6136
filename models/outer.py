"""Outer-loop math of DiLoCo on flat host tensors: pseudo-gradients, weighted merging, Nesterov.

Everything here is deterministic elementwise arithmetic in a fixed order, so two daemons that feed the same
inputs get bit-identical outputs. No I/O, no network.

Pseudo-gradients, merges and the outer step are computed in float64 and stored in fp32. For fp32 values a and b
the float64 difference a − b is exact (unless their exponents differ by more than 29), so with one daemon,
lr = 1 and momentum 0 the outer step returns exactly the local parameters: DiLoCo then equals plain training
bit for bit, which is what makes that case testable at all.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch


def pseudo_gradient(global_params: torch.Tensor, local_params: torch.Tensor) -> torch.Tensor:
    """Δ = Θ − θ in float64: the direction the outer optimizer descends along."""
    return global_params.double() - local_params.double()


def weighted_mean(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Σ (wᵢ/Σw)·Δᵢ in float64, accumulated in the given order (callers sort by peer id for determinism).

    Weights are normalized first so that a single contribution comes back unchanged (1.0·Δ = Δ exactly).
    """
    if len(deltas) != len(weights) or not deltas:
        raise ValueError("need one positive weight per delta, and at least one delta")
    if any(not w > 0 for w in weights):
        raise ValueError(f"weights must be positive, got {list(weights)}")
    total = math.fsum(float(w) for w in weights)
    acc = torch.zeros(deltas[0].shape, dtype=torch.float64)
    for d, w in zip(deltas, weights):
        acc.add_(d.double(), alpha=float(w) / total)
    return acc


class NesterovOuter:
    """SGD with Nesterov momentum on Θ (DiLoCo's outer optimizer), in place; with ``period`` N > 1, Delayed
    Nesterov (Liu et al., arXiv 2401.09135): the momentum is applied once every N rounds of a fragment.

    N = 1: ``buf ← μ·buf + Δ ; Θ ← Θ − lr·(Δ + μ·buf)``. With lr=1, μ=0 it reduces to Θ ← Θ − Δ = θ_avg.

    N > 1: every round ``buf ← buf + Δ/N ; Θ ← Θ − lr·Δ/N``; the round that brings the version to a multiple of N
    then does ``Θ ← Θ − lr·μ·buf ; buf ← μ·buf``. The stored buffer is μ·m plus the rounds' mean so far, so over N
    rounds Θ moves exactly as one Nesterov step on the mean of their N deltas, while a stale delta in between is
    applied without momentum's amplification (up to lr/(1−μ)). The phase is the replica's version, which every
    member and every replay shares, so the state stays (Θ, buf) and replicas stay bit-identical.
    """

    def __init__(self, lr: float = 0.7, momentum: float = 0.9, period: int = 1) -> None:
        if not lr > 0 or not 0 <= momentum < 1 or not (isinstance(period, int) and period >= 1):
            raise ValueError(f"outer lr must be > 0, momentum in [0, 1) and period an integer >= 1; got lr={lr} "
                             f"momentum={momentum} period={period}")
        self.lr, self.momentum, self.period = lr, momentum, period

    def step(self, params: torch.Tensor, buf: torch.Tensor, delta: torch.Tensor, version: int = 0,
             chunk: int = 1 << 22) -> None:
        """Update fp32 ``params`` and ``buf`` in place, computing in float64 a chunk at a time (bounded memory).
        ``version``: the replica's version the round started from (only Delayed Nesterov reads it)."""
        n = self.period
        apply_momentum = (version + 1) % n == 0
        for lo in range(0, params.numel(), chunk):
            hi = min(lo + chunk, params.numel())
            d = delta[lo:hi].double()  # may alias ``delta`` (already float64): never modified in place
            if n == 1:
                b = buf[lo:hi].double().mul_(self.momentum).add_(d)
                p = params[lo:hi].double().sub_(d.add(b, alpha=self.momentum), alpha=self.lr)
            else:
                b = buf[lo:hi].double().add_(d, alpha=1.0 / n)
                p = params[lo:hi].double().sub_(d, alpha=self.lr / n)
                if apply_momentum:
                    p.sub_(b, alpha=self.lr * self.momentum)
                    b.mul_(self.momentum)
            buf[lo:hi] = b
            params[lo:hi] = p


def tensor_hash(*tensors: torch.Tensor) -> str:
    """Content hash (sha256, hex prefix) of fp32 tensors: identical bytes ⇔ identical hash."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def radial_directional_average(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """RDA = (Σ w·‖v‖ / Σ w) · φ(Σ w·φ(v) / Σ w), φ(x) = x/‖x‖, in float64.

    The merged vector keeps the weighted mean norm of the inputs, so when inputs are nearly orthogonal its norm
    does not shrink as 1/√M like a plain mean's. Zero inputs contribute no direction.
    """
    if len(deltas) != len(weights) or not deltas:
        raise ValueError("need one positive weight per delta, and at least one delta")
    norms = [float(torch.linalg.vector_norm(d.double())) for d in deltas]
    directions = [d.double() / n if n > 0 else torch.zeros_like(d, dtype=torch.float64) for d, n in zip(deltas, norms)]
    mean_direction = weighted_mean(directions, weights)
    return rda_finish(mean_direction, weighted_norm(norms, weights))


def weighted_norm(norms: Sequence[float], weights: Sequence[float]) -> float:
    """Σ w·‖v‖ / Σ w: the norm RDA gives its result."""
    total = math.fsum(weights)
    return math.fsum(w * n for w, n in zip(weights, norms)) / total


def rda_finish(mean_direction: torch.Tensor, norm: float) -> torch.Tensor:
    """Scale the weighted mean of unit directions to ``norm`` (the last step of RDA; zero stays zero)."""
    length = float(torch.linalg.vector_norm(mean_direction))
    if length == 0.0:
        return torch.zeros_like(mean_direction, dtype=torch.float64)
    return mean_direction.double() * (norm / length)


def merged_delta(shards: Sequence[torch.Tensor], rda_norm: float | None) -> torch.Tensor:
    """A round's merged delta from its decoded reduced shards (member order): concatenated in float64 and, for
    ``rda``, rescaled to the round's norm. Every member and every replay computes it with this one function."""
    merged = torch.cat([s.double() for s in shards])
    return merged if rda_norm is None else rda_finish(merged, rda_norm)


def token_weight(tokens: int, steps: int) -> float:
    """Decoupled DiLoCo's contribution weight c_tokens² / c_steps (tokens since the fragment was last received,
    times tokens per step): a daemon that did more, larger steps since its last merge counts more."""
    if tokens <= 0 or steps <= 0:
        raise ValueError(f"need positive tokens and steps, got {tokens}, {steps}")
    return float(tokens) * float(tokens) / float(steps)

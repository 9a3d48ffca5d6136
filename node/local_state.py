"""What this daemon has learned on each fragment that the swarm has not merged yet.

Per fragment p it keeps ``base`` (the global Θ_p that θ_p last started from), ``carry`` (progress made from an
older base that no round has merged yet) and the token/step counters of Decoupled DiLoCo's weights. When a
heavier replica is adopted (a fork lost, a round missed), θ_p restarts from it but the progress made so far is
kept in ``carry`` and goes into the next contribution: work is delayed by a round, not thrown away.
"""

from __future__ import annotations

import torch

from atoll.models.outer import pseudo_gradient


class LocalFragmentState:
    def __init__(self, base: torch.Tensor) -> None:
        self.base = base.detach().to("cpu", torch.float32).clone()
        self.carry: torch.Tensor | None = None
        self.tokens = 0  # tokens trained since this fragment was last merged
        self.steps = 0

    def add_step(self, tokens: int) -> None:
        self.tokens += tokens
        self.steps += 1

    def delta(self, theta: torch.Tensor) -> torch.Tensor:
        """The pseudo-gradient to contribute: Θ_base − θ (float64), plus carried progress."""
        d = pseudo_gradient(self.base, theta)
        return d if self.carry is None else d.add_(self.carry.double())

    def merged(self, new_base: torch.Tensor) -> None:
        """A round that included our contribution landed: θ restarts from the new Θ, counters reset."""
        self.base = new_base.detach().to("cpu", torch.float32).clone()
        self.carry = None
        self.tokens = self.steps = 0

    def adopted(self, new_base: torch.Tensor, theta: torch.Tensor) -> None:
        """A heavier replica replaced Θ: keep the unmerged progress (base − θ) for the next contribution."""
        progress = (self.base.double() - theta.double()).float()
        self.carry = progress if self.carry is None else self.carry.add_(progress)
        self.base = new_base.detach().to("cpu", torch.float32).clone()

    def state_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}.base": self.base}
        if self.carry is not None:
            out[f"{prefix}.carry"] = self.carry
        return out

    def load(self, tensors: dict[str, torch.Tensor], prefix: str, tokens: int, steps: int) -> None:
        self.base = tensors[f"{prefix}.base"].float().clone()
        carry = tensors.get(f"{prefix}.carry")
        self.carry = None if carry is None else carry.float().clone()
        self.tokens, self.steps = tokens, steps

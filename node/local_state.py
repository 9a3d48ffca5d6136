"""What this daemon has learned on each fragment that the swarm has not merged yet.

Per fragment p it keeps ``base`` (the global Θ_p that θ_p last started from), ``carry`` (progress made from the
previous base that no round has merged yet) and the token/step counters of Decoupled DiLoCo's weights. When a
heavier replica is adopted (a fork lost, a round missed), θ_p restarts from it but the progress made since the
last restart is kept in ``carry`` and goes into the next contribution: work is delayed by a round, not thrown
away. Only one generation is carried: progress older than that is stale by several versions, and letting it
pile up would let a long-isolated daemon push a huge, heavily weighted delta; it is dropped and counted as lost.
"""

from __future__ import annotations

import torch

from atoll.models.outer import pseudo_gradient


class LocalFragmentState:
    def __init__(self, base: torch.Tensor, base_id: tuple[int, str] = (0, "")) -> None:
        self.base = base.detach().to("cpu", torch.float32).clone()
        self.base_id = base_id  # (version, digest) of the replica ``base`` was read from
        self.carry: torch.Tensor | None = None
        self.carry_tokens = self.carry_steps = 0
        self.gen_tokens = self.gen_steps = 0  # since θ_p last restarted from a base

    @property
    def tokens(self) -> int:
        """Tokens of unmerged work in the next contribution (its weight's c_tokens)."""
        return self.carry_tokens + self.gen_tokens

    @property
    def steps(self) -> int:
        return self.carry_steps + self.gen_steps

    def add_step(self, tokens: int) -> None:
        self.gen_tokens += tokens
        self.gen_steps += 1

    def delta(self, theta: torch.Tensor) -> torch.Tensor:
        """The pseudo-gradient to contribute: Θ_base − θ (float64), plus carried progress."""
        d = pseudo_gradient(self.base, theta)
        return d if self.carry is None else d.add_(self.carry.double())

    def merged(self, new_base: torch.Tensor, base_id: tuple[int, str]) -> None:
        """A round that included our contribution landed: θ restarts from the new Θ, counters reset."""
        self.base = new_base.detach().to("cpu", torch.float32).clone()
        self.base_id = base_id
        self.carry = None
        self.carry_tokens = self.carry_steps = self.gen_tokens = self.gen_steps = 0

    def adopted(self, new_base: torch.Tensor, base_id: tuple[int, str], theta: torch.Tensor) -> int:
        """A heavier replica replaced Θ: carry this generation's progress (base − θ) into the next contribution.

        Returns the tokens of older carried work that is dropped (lost)."""
        lost = self.carry_tokens
        self.carry = (self.base.double() - theta.double()).float()
        self.carry_tokens, self.carry_steps = self.gen_tokens, self.gen_steps
        self.gen_tokens = self.gen_steps = 0
        self.base = new_base.detach().to("cpu", torch.float32).clone()
        self.base_id = base_id
        return lost

    def state_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}.base": self.base}
        if self.carry is not None:
            out[f"{prefix}.carry"] = self.carry
        return out

    def counters(self) -> list[int]:
        """Token/step counters for checkpoints (``base_id`` is restored from the replica itself)."""
        return [self.carry_tokens, self.carry_steps, self.gen_tokens, self.gen_steps]

    def load(self, tensors: dict[str, torch.Tensor], prefix: str, counters: list[int]) -> None:
        self.base = tensors[f"{prefix}.base"].float().clone()
        carry = tensors.get(f"{prefix}.carry")
        self.carry = None if carry is None else carry.float().clone()
        self.carry_tokens, self.carry_steps, self.gen_tokens, self.gen_steps = counters

"""What this daemon has learned on each fragment that the swarm has not merged yet.

Per fragment p it keeps ``base`` (the global Θ_p that θ_p last started from, and that replica's identity) and the
token/step counters of Decoupled DiLoCo's weights. When a heavier replica is adopted (a fork lost, a round
missed), θ_p restarts from it and the unmerged local work on p is dropped and counted as lost, as in the paper;
with ``stale_contributions`` the work is rebased instead (``rebase``) and contributed to the next round.
"""

from __future__ import annotations

import torch

from atoll.models.outer import pseudo_gradient


class LocalFragmentState:
    """``base`` is replaced by ``restart``/``rebase``/``load``, never written in place: a holder of it (a round's
    snapshot, a checkpoint being written) keeps the tensor of the moment it took it, without a copy."""

    def __init__(self, base: torch.Tensor, base_id: tuple[int, str] = (0, "")) -> None:
        self.base = base.detach().to("cpu", torch.float32).clone()
        self.base_id = base_id  # (version, digest) of the replica ``base`` was read from
        self.tokens = 0  # tokens trained since θ_p last restarted from a base (c_tokens)
        self.steps = 0

    def add_step(self, tokens: int) -> None:
        self.tokens += tokens
        self.steps += 1

    def delta(self, theta: torch.Tensor) -> torch.Tensor:
        """The pseudo-gradient to contribute: Θ_base − θ, in float64."""
        return pseudo_gradient(self.base, theta)

    def restart(self, new_base: torch.Tensor, base_id: tuple[int, str]) -> int:
        """θ_p restarts from a new Θ_p (a round merged, or a heavier replica was adopted); counters reset.

        Returns the tokens of local work that no round merged (lost, when this is an adoption)."""
        unmerged = self.tokens
        self.base = new_base.detach().to("cpu", torch.float32).clone()
        self.base_id = base_id
        self.tokens = self.steps = 0
        return unmerged

    def rebase(self, new_base: torch.Tensor, base_id: tuple[int, str]) -> None:
        """A newer Θ_p arrived that does not contain our unmerged work: move the base, keep the counters (the work
        stays ours to contribute, and its weight keeps growing)."""
        self.base = new_base.detach().to("cpu", torch.float32).clone()
        self.base_id = base_id

    def state_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.base": self.base}

    def counters(self) -> list[int]:
        """Token/step counters for checkpoints (``base_id`` is restored from the replica itself)."""
        return [self.tokens, self.steps]

    def load(self, tensors: dict[str, torch.Tensor], prefix: str, counters: list[int]) -> None:
        self.base = tensors[f"{prefix}.base"].float().clone()
        self.tokens, self.steps = counters

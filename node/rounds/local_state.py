"""What this daemon has learned on each fragment that the swarm has not merged yet.

Per fragment p it keeps ``base`` (the global Θ_p that θ_p's unmerged work is measured from, and that replica's
identity) and the token/step counters of Decoupled DiLoCo's weights: the work in θ_p − base, which the next
contribution carries. Under the delta rule (``LocalMerge.DELTA``) a merged round moves the base to its result and
leaves the counters at the steps trained since the snapshot it contributed (``carry``); an adopted replica moves
the base and keeps them (``rebase``). Overwriting restarts θ_p from the new base and drops them (``restart``).
``fresh_steps`` counts the steps since our last round of p started, whatever was carried: the rounds' gates read it.
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
        self.tokens = 0  # tokens of the work in θ_p − base (c_tokens)
        self.steps = 0
        self.fresh_steps = 0  # steps since our last round of p started (or since θ_p restarted)

    def add_step(self, tokens: int) -> None:
        self.tokens += tokens
        self.steps += 1
        self.fresh_steps += 1

    def round_started(self) -> None:
        """A round of p started (its snapshot taken now, or when its group forms): the gates count steps from here."""
        self.fresh_steps = 0

    def delta(self, theta: torch.Tensor) -> torch.Tensor:
        """The pseudo-gradient to contribute: Θ_base − θ, in float64."""
        return pseudo_gradient(self.base, theta)

    def restart(self, new_base: torch.Tensor, base_id: tuple[int, str]) -> int:
        """θ_p restarts from a new Θ_p (a round merged, or a heavier replica was adopted); counters reset.

        Returns the tokens of local work that no round merged (lost, when this is an adoption)."""
        unmerged = self.tokens
        self.base = new_base.detach().to("cpu", torch.float32).clone()
        self.base_id = base_id
        self.tokens = self.steps = self.fresh_steps = 0
        return unmerged

    def carry(self, new_base: torch.Tensor, base_id: tuple[int, str], tokens: int, steps: int) -> None:
        """A round merged our snapshot into ``new_base``: θ_p keeps the ``tokens``/``steps`` trained since that
        snapshot (θ_p ← Θ_new + θ_now − θ_snapshot), which the next contribution carries."""
        self.base = new_base.detach().to("cpu", torch.float32).clone()
        self.base_id = base_id
        self.tokens, self.steps = tokens, steps

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
        self.fresh_steps = self.steps  # no round of ours is in flight after a restart

"""Fragments: the model's parameters split into P groups that are synchronized on a staggered schedule.

The split is derived from the model alone (tensor sizes in parameter order), so every daemon computes the same
assignment without negotiating it: longest-processing-time bin packing, largest tensor first (ties by index),
each into the lightest bin (ties by bin index).

``flatten`` and ``copy_into`` are the one way parameters (or their gradients) become a flat fp32 host tensor
and go back: a fragment, the whole model and the learner's gradients all go through them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


def flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """``tensors`` concatenated into one flat fp32 CPU tensor (a copy, whatever their device and dtype)."""
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def copy_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` into ``tensors`` in place, in ``flatten`` order, converted to each one's device and dtype.

    In place, so the tensors an optimizer holds stay the same objects. Raises ``ValueError`` when ``flat`` does
    not hold exactly as many values as ``tensors``. Each tensor copies from ``flat``'s own memory (``copy_``
    moves it across devices): on xla a tensor sharded over an SPMD mesh keeps its sharding and is written
    shard-wise, where a copy from an xla tensor would leave it replicated (``node/spmd.py``)."""
    needed = sum(t.numel() for t in tensors)
    if needed != flat.numel():
        raise ValueError(f"flat tensor has {flat.numel()} elements, the tensors need {needed}")
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t).to(dtype=t.dtype))
            offset += n


def partition(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of ``sizes`` grouped into ``parts`` bins of near-equal total size; each bin sorted ascending."""
    if parts <= 0:
        raise ValueError("need at least one fragment")
    if parts > len(sizes):
        raise ValueError(f"cannot split {len(sizes)} tensors into {parts} non-empty fragments")
    bins: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        target = min(range(parts), key=lambda b: (loads[b], b))
        bins[target].append(i)
        loads[target] += sizes[i]
    return [sorted(b) for b in bins]


@dataclass(frozen=True)
class Fragment:
    """One fragment: which parameters it holds, and whether it holds the (tied) embedding."""

    index: int
    params: tuple[int, ...]
    numel: int
    has_embedding: bool
    offset: int  # its due step is offset + k·H: offsets are spread over the sync period

    def gather(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """This fragment's parameters as one flat fp32 host tensor (a copy)."""
        return flatten(params[i] for i in self.params)

    def scatter(self, flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
        """Copy ``flat`` into this fragment's parameters in place (any device/dtype)."""
        if flat.numel() != self.numel:
            raise ValueError(f"fragment {self.index} has {self.numel} values, got {flat.numel()}")
        copy_into(flat, [params[i] for i in self.params])

    def due(self, step: int, period: int) -> bool:
        """True at the steps where this fragment starts a round: (step − offset) mod H == 0, step > 0."""
        return step > 0 and (step - self.offset) % period == 0


def make_fragments(params: Sequence[torch.Tensor], parts: int, period: int,
                   embedding: torch.Tensor | None = None) -> list[Fragment]:
    """Split ``params`` into ``parts`` fragments with due-step offsets spread evenly over ``period`` steps."""
    groups = partition([p.numel() for p in params], parts)
    out = []
    for k, group in enumerate(groups):
        offset = (k * period) // parts
        has_embedding = embedding is not None and any(params[i] is embedding for i in group)
        out.append(Fragment(k, tuple(group), sum(params[i].numel() for i in group), has_embedding, offset))
    return out

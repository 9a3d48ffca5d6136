"""Sampling text from a model's next-token logits (``atoll sample``): temperature and top-k, one token at a time.

Deterministic for a given ``torch.Generator`` state: the same seed, prompt and model give the same tokens on
the CPU. A context longer than the model's ``seq_len`` is cut to its last ``seq_len`` tokens (rotary positions
are relative, so the window slides).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def next_token(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """One token id drawn from ``logits`` (a vector over the vocabulary): the arg-max at ``temperature`` 0, else
    from softmax(logits / temperature) restricted to the ``top_k`` largest logits (0: all of them); ties in the
    k-th value are all kept."""
    logits = logits.detach().float().reshape(-1)
    if temperature <= 0:
        return int(torch.argmax(logits))
    scaled = logits / temperature
    if 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = torch.where(scaled < kth, torch.full_like(scaled, -float("inf")), scaled)
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(logits_of: Callable[[torch.Tensor], torch.Tensor], prompt: list[int], max_tokens: int, seq_len: int,
             temperature: float = 0.8, top_k: int = 40, seed: int = 0,
             on_token: Callable[[int], None] = lambda token: None) -> list[int]:
    """``max_tokens`` new token ids after ``prompt`` (at least one id). ``logits_of(idx)`` maps (1, t) ids to
    (1, t, vocab) logits; ``on_token`` hears each new id as it is drawn."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    out = []
    for _ in range(max_tokens):
        context = torch.tensor([ids[-seq_len:]], dtype=torch.long)
        token = next_token(logits_of(context)[0, -1], temperature, top_k, generator)
        ids.append(token)
        out.append(token)
        on_token(token)
    return out

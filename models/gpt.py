"""A small decoder-only transformer: pre-norm, rotary positions, tied embeddings.

Pure PyTorch, device-agnostic (cpu, cuda, xla): no data-dependent Python control flow in ``forward``, so
torch_xla traces one graph per input shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a model. ``d_model`` must be divisible by ``n_heads`` and the head dim must be even (rotary)."""

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("head dimension must be even for rotary embeddings")
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @property
    def num_params(self) -> int:
        """Exact number of trainable parameters (tied embeddings counted once)."""
        d, f = self.d_model, self.d_model * self.mlp_ratio
        per_layer = 2 * d + 4 * d * d + 2 * d * f  # two RMSNorm gains, qkv+proj, mlp in+out
        return self.vocab_size * d + self.n_layers * per_layer + d


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(seq_len: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.norm1 = RMSNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.norm2 = RMSNorm(cfg.d_model)
        self.fc_in = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.fc_out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(F.gelu(self.fc_in(self.norm2(x))))


def init_normal(model: nn.Module, n_layers: int, residual: tuple[str, ...], std: float = 0.02) -> None:
    """Normal(0, std) for every matrix, in parameter order; the residual projections (names ending in one of
    ``residual``) scaled down with depth (GPT-2), so deep stacks start near identity. Vectors keep their init."""
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue
        scale = 1.0 / math.sqrt(2 * n_layers) if name.endswith(residual) else 1.0
        nn.init.normal_(p, mean=0.0, std=std * scale)


class GPT(nn.Module):
    """Decoder-only language model. ``forward(idx, targets)`` returns the mean next-token cross-entropy."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        cos, sin = rotary_tables(cfg.seq_len, cfg.d_model // cfg.n_heads)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_normal(self, self.cfg.n_layers, ("proj.weight", "fc_out.weight"))

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-token logits at every position of ``idx`` (batch, t ≤ seq_len): shape (batch, t, vocab_size)."""
        t = idx.shape[1]
        x = self.embed(idx)
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        for block in self.blocks:
            x = block(x, cos, sin)
        return F.linear(self.norm(x), self.embed.weight)  # tied output head

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(idx)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

"""A Llama-style decoder: RMSNorm, SwiGLU, rotary positions, grouped-query attention, an untied output head.

The shape the people who adopt atoll train most (Llama 2/3, Mistral, Qwen share it), as a preset beside the
built-in GPT. Pure PyTorch, device-agnostic, no data-dependent control flow in ``forward`` (one graph per input
shape on xla). ``forward(idx, targets)`` returns the mean next-token cross-entropy, as ``GPT``'s does: that call
is the contract every atoll model meets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gpt import RMSNorm, apply_rotary, init_normal, rotary_tables


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-style model. ``n_heads`` must be a multiple of ``n_kv_heads`` (grouped-query attention:
    each key/value head serves ``n_heads // n_kv_heads`` query heads); the head dim must be even (rotary).
    ``ffn_dim`` 0: about 8/3·d_model rounded up to a multiple of 32 (SwiGLU's usual width)."""

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 0
    rope_theta: float = 10000.0
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "n_kv_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("head dimension must be even for rotary embeddings")
        if self.ffn_dim < 0:
            raise ValueError("ffn_dim must be positive (or 0 for the default)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def hidden(self) -> int:
        return self.ffn_dim or 32 * math.ceil(8 * self.d_model / 3 / 32)

    @property
    def num_params(self) -> int:
        """Exact number of trainable parameters (a tied head counted once)."""
        d, kv = self.d_model, self.n_kv_heads * self.head_dim
        per_layer = 2 * d + d * d + 2 * d * kv + d * d + 3 * d * self.hidden  # norms, q, k+v, o, gate/up/down
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.n_layers * per_layer + d + head


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.kv = nn.Linear(cfg.d_model, 2 * cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.n_kv_heads, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        groups = self.n_heads // self.n_kv_heads
        if groups > 1:  # each key/value head serves ``groups`` query heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.d_model), Attention(cfg)
        self.mlp_norm, self.mlp = RMSNorm(cfg.d_model), SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Llama-style decoder-only language model. ``forward(idx, targets)`` returns the mean next-token
    cross-entropy."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_normal(self, self.cfg.n_layers, ("o.weight", "down.weight"))

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-token logits at every position of ``idx`` (batch, t ≤ seq_len): shape (batch, t, vocab_size)."""
        t = idx.shape[1]
        x = self.embed(idx)
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        for block in self.blocks:
            x = block(x, cos, sin)
        x = self.norm(x)
        return F.linear(x, self.embed.weight) if self.head is None else self.head(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(idx)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

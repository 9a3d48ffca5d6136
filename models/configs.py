"""Named model shapes: the built-in GPT's, from a CPU-sized ``nano`` to the 12B shape of the seed's production
run, and Llama-style ones (``llama-*``: SwiGLU, grouped-query attention, an untied head).

Only the small ones are meant to train on this machine; the large ones exist for planning (parameter counts,
bytes per outer round) and are never instantiated by the tests.
"""

from __future__ import annotations

import torch.nn as nn

from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig

ModelConfig = GPTConfig | LlamaConfig

MODELS: dict[str, ModelConfig] = {
    # Byte-level models for CPU swarms and tests.
    "nano": GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_layers=2, n_heads=4),
    "tiny": GPTConfig(vocab_size=256, seq_len=128, d_model=128, n_layers=4, n_heads=4),
    "small": GPTConfig(vocab_size=256, seq_len=256, d_model=384, n_layers=6, n_heads=6),
    "llama-nano": LlamaConfig(vocab_size=256, seq_len=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2),
    "llama-tiny": LlamaConfig(vocab_size=256, seq_len=128, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2),
    # Planning shapes (a 32k-token vocabulary, as with a SentencePiece tokenizer).
    "150m": GPTConfig(vocab_size=32768, seq_len=2048, d_model=768, n_layers=12, n_heads=12),
    "1b": GPTConfig(vocab_size=32768, seq_len=2048, d_model=2048, n_layers=18, n_heads=16),
    "5b": GPTConfig(vocab_size=32768, seq_len=4096, d_model=4096, n_layers=24, n_heads=32),
    "12b": GPTConfig(vocab_size=32768, seq_len=4096, d_model=5120, n_layers=36, n_heads=40),
    "llama-150m": LlamaConfig(vocab_size=32768, seq_len=2048, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4),
}


def get_model_config(name: str) -> ModelConfig:
    """Return the named shape; raises ``KeyError`` with the list of known names."""
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def instantiate(cfg: ModelConfig) -> nn.Module:
    """The module of a preset shape (initialised from the current torch seed)."""
    return Llama(cfg) if isinstance(cfg, LlamaConfig) else GPT(cfg)

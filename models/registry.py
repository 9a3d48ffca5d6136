"""Which model a run trains: a named preset, a Hugging Face model or the user's own factory, and the digest every
daemon checks.

``--model`` is a preset name (``models/configs.py``: the GPT shapes and the Llama-style ones), ``hf:PATH`` (a
Hugging Face ``transformers`` causal LM from a local ``config.json`` or a directory holding one, optionally with
weights: ``models/hf.py``, the extra ``atoll[hf]``), or ``package.module:factory``, a callable of no arguments that
returns an ``nn.Module`` meeting atoll's contract:

- ``forward(idx, targets)`` returns the mean next-token loss as a scalar tensor (``idx``, ``targets``: int64
  token ids of shape (batch, seq_len));
- ``seq_len`` and ``vocab_size`` say the sequence length it trains on and how many token ids it embeds, as
  attributes of the module or of its ``cfg``/``config``.

The factory is called after the run's seed is set, on the CPU, so every daemon builds the same Θ₀. Everything that
goes wrong (a bad path, a failed import, a factory that raises or returns something else) is a ``ModelError``
with one line. ``model_digest`` names a model's parameters, shapes and dtypes: daemons of one run must agree on it.
"""

from __future__ import annotations

import hashlib
import importlib
import re
from dataclasses import dataclass

import torch
import torch.nn as nn

FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
HF = "hf:"  # hf:PATH, a Hugging Face model (checked before factories: a module named hf cannot be one)


class ModelError(ValueError):
    """A model that cannot be built or does not meet the contract (one line, for the CLI's exit 2)."""


@dataclass(frozen=True)
class ModelShape:
    """What atoll needs to know of a model besides its parameters."""

    vocab_size: int
    seq_len: int


def is_factory(name: str) -> bool:
    return bool(FACTORY.match(name))


def is_hf(name: str) -> bool:
    return name.startswith(HF)


def check_name(name: str) -> None:
    """``ModelError`` unless ``name`` is a preset, ``hf:PATH`` with a PATH, or looks like ``package.module:factory``
    (neither read nor imported here)."""
    from .configs import MODELS

    if is_hf(name):
        if not name[len(HF):].strip():
            raise ModelError(f"{name!r}: hf:PATH needs the PATH of a local config.json or of a directory with one")
        return
    if name not in MODELS and not is_factory(name):
        raise ModelError(f"unknown {name!r}: a preset ({', '.join(MODELS)}), hf:PATH or package.module:factory")


def build_model(name: str, seed: int) -> tuple[nn.Module, ModelShape]:
    """The model ``name`` initialised from ``seed`` on the CPU, and its shape; ``ModelError`` on any failure."""
    from .configs import MODELS, instantiate

    check_name(name)
    torch.manual_seed(seed)
    if name in MODELS:
        model = instantiate(MODELS[name])
    elif is_hf(name):
        from .hf import from_path

        try:
            model = from_path(name[len(HF):])
        except ModelError as e:
            raise ModelError(f"{name!r}: {e}") from None
    else:
        model = _from_factory(name)
    return model, shape_of(model, name)


def _from_factory(name: str) -> nn.Module:
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any failure of the user's import is one line
        raise ModelError(f"{name!r}: cannot import {module_name}: {type(e).__name__}: {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelError(f"{name!r}: {module_name} has no callable {attr!r}")
    try:
        model = factory()
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"{name!r}: the factory raised {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise ModelError(f"{name!r}: the factory returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def shape_of(model: nn.Module, name: str = "model") -> ModelShape:
    """The model's ``vocab_size`` and ``seq_len`` (on itself, or its ``cfg`` or ``config``); ``ModelError`` if
    missing, or if it has no trainable parameters."""
    values = {}
    for field in ("vocab_size", "seq_len"):
        for holder in (model, getattr(model, "cfg", None), getattr(model, "config", None)):
            value = getattr(holder, field, None) if holder is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                values[field] = value
                break
        else:
            raise ModelError(f"{name!r}: it has no positive integer {field!r} (on the module, or its cfg)")
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelError(f"{name!r}: it has no trainable parameters")
    return ModelShape(**values)


def embedding_of(model: nn.Module) -> torch.Tensor | None:
    """The token embedding's weight, found by identity: the weight of the module the model's
    ``get_input_embeddings()`` returns when it has one (Hugging Face models), else of its first ``nn.Embedding``
    (a tied output head is the same tensor, so it is seen once). None if the model has none."""
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            module = get()
        except Exception:  # noqa: BLE001 - a model that does not say: the first nn.Embedding below
            module = None
        if isinstance(module, nn.Embedding) and any(module.weight is p for p in model.parameters()):
            return module.weight
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return module.weight
    return None


def model_digest(model: nn.Module) -> str:
    """A digest of the model's trainable parameters: their names, shapes and dtypes, in order (tied tensors once,
    as ``parameters()`` yields them). Two daemons whose digests differ cannot average their replicas."""
    h = hashlib.sha256()
    for param_name, p in model.named_parameters():
        if p.requires_grad:
            h.update(f"{param_name}:{tuple(p.shape)}:{p.dtype};".encode())
    return h.hexdigest()[:16]

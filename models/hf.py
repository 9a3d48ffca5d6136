"""Hugging Face ``transformers`` causal language models as atoll models (the optional extra ``atoll[hf]``).

``HFCausalLM`` wraps a ``transformers`` causal LM (a ``LlamaForCausalLM``, say) so that it meets atoll's contract
(``models/registry.py``):

- ``forward(idx, targets)`` is the mean cross-entropy of the wrapped model's logits at every position against
  ``targets`` at the same position. atoll's ``targets`` are already ``idx`` shifted by one, so the HF model is
  never given ``labels`` (it would shift them again); the logits are taken in fp32 for the loss (under autocast
  they may come out in bf16);
- ``vocab_size`` is the HF config's ``vocab_size``; ``seq_len`` is the ``seq_len`` argument of the builders when
  given, else the config's ``max_position_embeddings`` (or ``n_positions``/``max_seq_len``), so a config that
  says ``"max_position_embeddings": 64`` trains on 64-token windows. An explicit ``seq_len`` may not exceed it.

The wrapped model is the adapter's ``lm`` attribute, so its parameter names (which ``model_digest`` hashes) are
the HF names under ``lm.`` (``lm.model.embed_tokens.weight``, ...). Weights are fp32 whatever the config's
``dtype`` says (the daemon runs the steps under autocast). Tied input/output embeddings are one tensor, seen once
by ``parameters()``; ``get_input_embeddings()`` names it, and ``registry.embedding_of`` asks it.

Builders, all on the CPU from the current torch seed, nothing downloaded (no hub, no remote code):

- ``from_config(config, seq_len=None, weights=None)``: a ``PretrainedConfig`` or a dict (with its
  ``model_type``, e.g. ``"llama"``);
- ``from_path(path, seq_len=None, weights=None)``: a local ``config.json`` file, or a local directory holding one
  (as ``save_pretrained`` writes it); a directory's own weights (``model.safetensors`` or the shards of
  ``model.safetensors.index.json``) are loaded as Θ₀ unless ``weights`` names others.

``weights`` (a ``.safetensors`` file, or a directory with safetensors weights) replaces the seeded initial values:
its tensor names and shapes must be exactly the wrapped model's (a tied output head may be missing: it is the
embedding), else one-line ``ModelError``. Every failure here is a ``ModelError`` with one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .registry import ModelError

INSTALL = "Hugging Face models need the transformers package: pip install 'atoll[hf]'"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len")


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ModelError(f"{INSTALL} ({e})") from None
    return transformers


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM under atoll's contract (see the module's docstring)."""

    def __init__(self, lm: nn.Module, seq_len: int | None = None) -> None:
        super().__init__()
        config = lm.config
        vocab = getattr(config, "vocab_size", None)
        if not isinstance(vocab, int) or vocab <= 0:
            raise ModelError(f"the {type(config).__name__} has no positive integer vocab_size")
        limit = next((getattr(config, f) for f in POSITION_FIELDS if isinstance(getattr(config, f, None), int)),
                     None)
        if seq_len is None:
            if limit is None:
                raise ModelError(f"the {type(config).__name__} has none of {', '.join(POSITION_FIELDS)}: give "
                                 f"seq_len")
            seq_len = limit
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
            raise ModelError(f"seq_len must be a positive integer, got {seq_len!r}")
        if limit is not None and seq_len > limit:
            raise ModelError(f"seq_len {seq_len} exceeds the config's {limit} positions")
        self.lm = lm
        self.vocab_size = vocab
        self.seq_len = seq_len

    def get_input_embeddings(self) -> nn.Module:
        return self.lm.get_input_embeddings()

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=idx, use_cache=False).logits

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(idx)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def from_config(config: Any, seq_len: int | None = None, weights: str | Path | None = None) -> HFCausalLM:
    """The causal LM of ``config`` (a ``PretrainedConfig``, or a dict with its ``model_type``), initialised from
    the current torch seed on the CPU in fp32, or with ``weights`` as its initial values."""
    transformers = _transformers()
    if isinstance(config, dict):
        config = _config_of(config, "the config dict")
    elif not isinstance(config, transformers.PretrainedConfig):
        raise ModelError(f"a Hugging Face config is a PretrainedConfig or a dict, not a {type(config).__name__}")
    try:
        lm = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"cannot build a causal LM from the {type(config).__name__}: {_one_line(e)}") from None
    lm.config.use_cache = False
    model = HFCausalLM(lm, seq_len)
    if weights is not None:
        load_weights(model, weights)
    return model


def _config_of(values: Any, source: str) -> Any:
    """The ``PretrainedConfig`` subclass of ``values["model_type"]``, made from ``values``."""
    transformers = _transformers()
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        raise ModelError(f"{source} has no 'model_type' (e.g. \"llama\"): not a Hugging Face config")
    try:
        cls = transformers.CONFIG_MAPPING[values["model_type"]]
    except KeyError:
        raise ModelError(f"{source}: transformers {transformers.__version__} knows no model_type "
                         f"{values['model_type']!r}") from None
    try:
        return cls.from_dict(dict(values))
    except Exception as e:  # noqa: BLE001 - a bad value is one line
        raise ModelError(f"{source}: {_one_line(e)}") from None


def read_config(path: str | Path) -> Any:
    """The ``PretrainedConfig`` of a local ``config.json`` (or of a directory holding one); never downloads."""
    _transformers()  # the extra is missing: say so first
    path = Path(path)
    if not path.exists():
        raise ModelError(f"no such file or directory {str(path)!r}")
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ModelError(f"{str(path)!r} holds no config.json")
    try:
        values = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{str(file)!r} is not JSON: {_one_line(e)}") from None
    return _config_of(values, repr(str(file)))


def from_path(path: str | Path, seq_len: int | None = None, weights: str | Path | None = None) -> HFCausalLM:
    """The causal LM of a local ``config.json``, or of a directory holding one (and, when it has them, its
    safetensors weights, loaded as Θ₀ unless ``weights`` names others)."""
    path = Path(path)
    config = read_config(path)
    if weights is None and path.is_dir() and ((path / WEIGHTS).is_file() or (path / WEIGHTS_INDEX).is_file()):
        weights = path
    return from_config(config, seq_len=seq_len, weights=weights)


def _weight_files(weights: Path) -> list[Path]:
    if weights.is_file():
        return [weights]
    if not weights.is_dir():
        raise ModelError(f"no weights {str(weights)!r}")
    if (weights / WEIGHTS).is_file():
        return [weights / WEIGHTS]
    index = weights / WEIGHTS_INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except Exception as e:  # noqa: BLE001
            raise ModelError(f"{str(index)!r} is not a safetensors index: {_one_line(e)}") from None
        return [weights / n for n in names]
    raise ModelError(f"{str(weights)!r} holds no {WEIGHTS} or {WEIGHTS_INDEX}")


def load_weights(model: HFCausalLM, weights: str | Path) -> None:
    """Replace the wrapped model's values with the tensors of ``weights`` (a ``.safetensors`` file or a directory
    with safetensors weights), converted to the parameters' dtype (fp32). The names and shapes must be the model's
    (a tied alias, like an output head tied to the embedding, may be absent; the adapter's own state, its names
    under ``lm.``, is accepted too); else one-line ``ModelError``. On the meta device (the daemon's digest) the
    names and shapes are checked and nothing is read."""
    from safetensors import safe_open

    weights = Path(weights)
    files = _weight_files(weights)
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    shapes[key] = tuple(f.get_slice(key).get_shape())
        except Exception as e:  # noqa: BLE001
            raise ModelError(f"{str(file)!r} is not a safetensors file: {_one_line(e)}") from None
    # The adapter's own state (its names under "lm.") is the wrapped model's under the same names without it.
    prefix = "lm." if shapes and all(k.startswith("lm.") for k in shapes) else ""
    shapes = {k[len(prefix):]: v for k, v in shapes.items()}
    lm = model.lm
    own = lm.state_dict(keep_vars=True)
    # A name whose tensor is also under another name (a tied head) need not be in the file, if that other one is.
    aliases: dict[int, list[str]] = {}
    for key, t in own.items():
        aliases.setdefault(id(t), []).append(key)
    missing = [k for k in own if k not in shapes and not any(a in shapes for a in aliases[id(own[k])])]
    unexpected = sorted(k for k in shapes if k not in own)
    wrong = [f"{k} {shapes[k]} != {tuple(own[k].shape)}" for k in own
             if k in shapes and shapes[k] != tuple(own[k].shape)]
    if missing or unexpected or wrong:
        parts = []
        for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
            if items:
                parts.append(f"{len(items)} {label} ({', '.join(items[:3])}{', ...' if len(items) > 3 else ''})")
        raise ModelError(f"weights {str(weights)!r} do not fit the {type(lm).__name__}: {'; '.join(parts)}")
    if any(t.is_meta for t in own.values()):
        return
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    own[key[len(prefix):]].copy_(f.get_tensor(key))

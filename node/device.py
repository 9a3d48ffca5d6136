"""The accelerator a daemon trains on: cpu, cuda, or xla (torch_xla, imported only when asked for)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from .config import ConfigError


@dataclass(frozen=True)
class Device:
    """A resolved device. ``sync()`` ends an inner step (``torch_xla.sync()`` on xla, a no-op elsewhere)."""

    kind: str
    torch_device: torch.device

    def sync(self) -> None:
        if self.kind == "xla":
            import torch_xla

            torch_xla.sync()

    def describe(self) -> str:
        if self.kind == "cuda":
            return f"cuda:{torch.cuda.get_device_name(self.torch_device)}"
        return self.kind


def xla_available() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def resolve_device(name: str) -> Device:
    """Map ``auto|cpu|cuda|xla`` to a device; ``ConfigError`` when the requested one is not usable here."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return Device("cpu", torch.device("cpu"))
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device: cuda requested but torch sees no CUDA device")
        return Device("cuda", torch.device("cuda"))
    if name == "xla":
        if not xla_available():
            raise ConfigError("device: xla requested but torch_xla is not installed (pip install 'atoll[xla]')")
        import torch_xla

        return Device("xla", torch_xla.device())
    raise ConfigError(f"device: unknown {name!r}")

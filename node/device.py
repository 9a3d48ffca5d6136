"""The accelerator a daemon trains on: cpu, cuda, or xla (torch_xla, imported only when asked for).

On xla (a TPU, or torch_xla's CPU runtime with ``PJRT_DEVICE=CPU``) operations are traced lazily and run when
``sync()`` cuts the graph; each distinct graph is compiled once and cached. The learner therefore syncs exactly
once per inner step, and everything that crosses the device boundary goes through ``to_host`` (one batched
transfer for many tensors) or an in-place copy whose source is an uploaded buffer (a graph input, never a new
graph shape).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .config import ConfigError

PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class Device:
    """A resolved device. ``sync()`` ends an inner step (``torch_xla.sync()`` on xla, a no-op elsewhere).

    ``precision`` is the learner's default compute precision: ``bf16`` autocast on xla and cuda (fp32 master
    weights and optimizer state, bf16 matmuls), ``fp32`` elsewhere. ``spmd``: on xla, the ``spmd.Spmd`` mesh the
    learner shards its tensors over (one process driving all of them), or None for one device.
    """

    kind: str
    torch_device: torch.device
    precision: str = "fp32"
    spmd: Any = None

    @property
    def devices(self) -> int:
        """The accelerators this one process drives: the SPMD mesh's, else 1."""
        return self.spmd.devices if self.spmd is not None else 1

    def upload(self, batch: torch.Tensor) -> torch.Tensor:
        """``batch`` on the device, without waiting; under SPMD split along dim 0 over the mesh."""
        out = batch.to(self.torch_device, non_blocking=True)
        return self.spmd.shard_batch(out) if self.spmd is not None else out

    def sync(self) -> None:
        if self.kind == "xla":
            import torch_xla

            torch_xla.sync()

    def fence(self) -> Callable[[], None]:
        """A wait, for another thread to call before it reads what this thread's work on the device wrote so far.

        On cuda an event recorded on this thread's current stream: another thread copies on its own current stream,
        which is not ordered after ours when ours is not the default stream (a user's loop may train on a side
        stream). Elsewhere a no-op: the CPU runs eagerly, and on xla ``sync`` has run the work."""
        if self.kind != "cuda":
            return lambda: None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.torch_device))
        return event.synchronize

    def to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of ``tensors`` in host memory. On xla one batched device-to-host transfer for all of them
        (pending operations on them run first, in one graph); elsewhere ``.cpu()`` each."""
        if self.spmd is not None and tensors:
            return self.spmd.to_host(tensors)
        if self.kind == "xla" and tensors:
            import torch_xla

            return list(torch_xla._XLAC._xla_get_cpu_tensors([t.detach() for t in tensors]))
        return [t.detach().to("cpu", copy=True) for t in tensors]

    def compilations(self) -> int:
        """Graphs compiled so far in this process (xla; always 0 elsewhere). Flat after warm-up means no
        per-step recompilation."""
        if self.kind != "xla":
            return 0
        import torch_xla.debug.metrics as met

        data = met.metric_data("CompileTime")
        return int(data[0]) if data else 0

    def autocast(self):
        """The autocast context of ``precision`` on this device (a no-op context for fp32)."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.kind, dtype=torch.bfloat16)

    def describe(self) -> str:
        if self.kind == "cuda":
            return f"cuda:{torch.cuda.get_device_name(self.torch_device)}"
        if self.kind == "xla":
            import torch_xla.runtime as xr

            spmd = f"/{self.spmd.describe()}" if self.spmd is not None else ""
            return f"xla:{xr.device_type()}/{self.precision}{spmd}"
        return self.kind


def xla_available() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def resolve_device(name: str, spmd_devices: int = 0) -> Device:
    """Map ``auto|cpu|cuda|xla`` to a device; ``ConfigError`` when the requested one is not usable here.

    ``ATOLL_XLA_PRECISION=fp32`` turns bf16 autocast off on xla (for debugging numerics against a CPU run).
    ``spmd_devices`` > 0 (xla only): SPMD over that many devices (``spmd.py``), turned on before the runtime starts.
    """
    if spmd_devices and name != "xla":
        raise ConfigError(f"spmd_devices: SPMD shards the learner over XLA devices; it needs --device xla, not {name}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return Device("cpu", torch.device("cpu"))
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device: cuda requested but torch sees no CUDA device")
        return Device("cuda", torch.device("cuda"), "bf16")  # autocast, as on a TPU
    if name == "xla":
        if not xla_available():
            raise ConfigError("device: xla requested but torch_xla is not installed (pip install 'atoll[xla]')")
        precision = os.environ.get("ATOLL_XLA_PRECISION", "bf16")
        if precision not in PRECISIONS:
            raise ConfigError(f"ATOLL_XLA_PRECISION: unknown {precision!r}; use one of {', '.join(PRECISIONS)}")
        spmd = None
        if spmd_devices:
            from .spmd import Spmd

            spmd = Spmd.start(spmd_devices)
        try:
            import torch_xla

            device = torch_xla.device()
        except Exception as e:  # no PJRT runtime usable here (e.g. PJRT_DEVICE=TPU on a machine without one)
            raise ConfigError(f"device: xla runtime failed to start ({type(e).__name__}: {e})") from None
        return Device("xla", device, precision, spmd)
    raise ConfigError(f"device: unknown {name!r}")


def codec_threads(setting: int, device_kind: str) -> int:
    """The codec's threads for ``--codec-threads`` (0: 1 on a cpu device, whose cores train; else up to 8)."""
    if setting:
        return setting
    return 1 if device_kind == "cpu" else max(1, min(8, os.cpu_count() or 1))

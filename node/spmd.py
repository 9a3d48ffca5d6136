"""SPMD islands on xla: one daemon process drives all of a host's XLA devices as one program (torch_xla SPMD).

With ``--spmd-devices N`` on ``--device xla`` the learner's tensors live on torch_xla's one virtual SPMD device and
are laid out over a 1-D mesh of the host's N devices (axis ``fsdp``), FSDP-style:

- every parameter is split along its dim 0 when N divides it, else along the first dim N divides, else it stays
  replicated (small or oddly shaped tensors: norms of odd widths, a vocabulary that N does not divide). Each device
  holds about 1/N of θ. ``partition`` is the rule; it depends only on shapes, so it is the same on every restart.
- the AdamW state (``exp_avg``, ``exp_avg_sq``) takes its parameter's sharding: the compiler propagates it when
  the first step creates the state, and ``shard_optimizer_state`` marks it again after a checkpoint is loaded
  (``load_state_dict`` puts fresh, replicated tensors there). The step count is a replicated scalar.
- each batch is split along dim 0 (the sequences) over the same mesh: data parallel; the compiler inserts the
  collectives (all-gathers of parameters, reduce-scatters of gradients) between the devices.

The island stays one process and one member of the swarm; its progress record counts the N devices as its ranks.

Writes into θ keep the sharding. torch_xla drops a tensor's sharding when ``copy_`` takes a source that is an
(unsharded) xla tensor, but keeps it, and uploads shard-wise, when the source is a host tensor; every write of
merged or restored values (``models.fragments.copy_into``, ``Trainee.load_state_tensors``) therefore copies
straight from host memory. ``keep`` is the guard behind that: at each step it re-marks any parameter whose
sharding was lost anyway (and logs it once), so θ never stays replicated on every device.

torch_xla's runtime fixes its device count when it starts: ``start`` must run before anything touches an xla
device. On torch_xla's CPU runtime (``PJRT_DEVICE=CPU``) it sets ``CPU_NUM_DEVICES`` to N unless already set.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from .config import ConfigError

logger = logging.getLogger("atoll")
AXIS = "fsdp"


class Spmd:
    """A 1-D mesh over ``devices`` XLA devices and the sharding rule of the learner's tensors (see the module's
    docstring). Made by ``start``."""

    def __init__(self, devices: int) -> None:
        import numpy as np
        import torch_xla.distributed.spmd as xs

        self.devices = devices
        self.mesh = xs.Mesh(np.arange(devices), (devices,), (AXIS,))
        self._xs = xs
        self._specs: dict[int, tuple] = {}  # id(tensor) -> the partition spec it was given (for ``keep``)
        self.remarked = 0  # tensors ``keep`` found unsharded and marked again (0 unless a write lost a sharding)

    @classmethod
    def start(cls, devices: int) -> Spmd:
        """Turn SPMD on over ``devices`` devices, before the xla runtime starts. ``ConfigError`` when the runtime
        has another number of devices."""
        if os.environ.get("PJRT_DEVICE", "").upper() == "CPU":
            os.environ.setdefault("CPU_NUM_DEVICES", str(devices))
        import torch_xla.runtime as xr

        try:
            xr.use_spmd()
            found = xr.global_runtime_device_count()
        except Exception as e:  # no PJRT runtime usable here
            raise ConfigError(f"spmd_devices: the xla runtime failed to start ({type(e).__name__}: {e})") from None
        if found != devices:
            hint = " (CPU_NUM_DEVICES sets it on PJRT_DEVICE=CPU)" if os.environ.get("PJRT_DEVICE") == "CPU" else ""
            raise ConfigError(f"spmd_devices: {devices} requested, but the xla runtime has {found} device(s){hint}")
        return cls(devices)

    # ---- the sharding rule --------------------------------------------------------------------------------------
    def partition(self, shape: Sequence[int]) -> tuple:
        """The partition spec of a parameter of ``shape``: the mesh axis on dim 0 if ``devices`` divides it, else on
        the first dim it divides, else replicated (all None)."""
        dims = [None] * len(shape)
        for d, size in enumerate(shape):
            if size % self.devices == 0 and size >= self.devices:
                dims[d] = AXIS
                break
        return tuple(dims)

    def shard(self, t: torch.Tensor, spec: tuple | None = None) -> torch.Tensor:
        """Mark ``t`` (an xla tensor) with ``spec`` (default: ``partition`` of its shape); remembered for ``keep``."""
        spec = self.partition(t.shape) if spec is None else spec
        self._xs.mark_sharding(t, self.mesh, spec)
        self._specs[id(t)] = spec
        return t

    def shard_params(self, params: Sequence[torch.Tensor]) -> None:
        for p in params:
            self.shard(p)

    def shard_batch(self, x: torch.Tensor) -> torch.Tensor:
        """A batch split over the devices along dim 0 (its sequences). The learner's training batches always
        divide (``batch_size`` per device); a held-out batch that does not stays replicated (every device computes
        all of it: correct, only slower)."""
        if x.shape[0] % self.devices == 0:
            self._xs.mark_sharding(x, self.mesh, (AXIS,) + (None,) * (x.dim() - 1))
        return x

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Each parameter's optimizer state tensors of its shape get its sharding (after ``load_state_dict``)."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                for v in optimizer.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor) and v.shape == p.shape and v.device.type == "xla":
                        self.shard(v, self._specs.get(id(p), self.partition(p.shape)))

    def keep(self, tensors: Sequence[torch.Tensor]) -> int:
        """Re-mark those of ``tensors`` (marked by ``shard`` before) that lost their sharding; how many did."""
        lost = 0
        for t in tensors:
            spec = self._specs.get(id(t))
            if spec is not None and any(spec) and sharding_of(t) in ("", "{replicated}"):
                self._xs.mark_sharding(t, self.mesh, spec)
                lost += 1
        if lost:
            if not self.remarked:
                logger.warning("spmd: %d parameter(s) lost their sharding in a write; marked again", lost)
            self.remarked += lost
        return lost

    def to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Full host copies of ``tensors``. A sharded tensor is read shard by shard (each device's piece, put in
        place by its indices) in one batched transfer for all of them; replicated ones in another.

        Why not ``_xla_get_cpu_tensors`` for all: on a sharded tensor it compiles a program that replicates the
        tensor before every transfer (torch_xla 2.9 does not cache it), so every round would compile again."""
        import torch_xla

        tensors = [t.detach() for t in tensors]
        out: list[torch.Tensor | None] = [None] * len(tensors)
        split = [i for i, t in enumerate(tensors) if sharding_of(t) not in ("", "{replicated}")]
        whole = [i for i in range(len(tensors)) if i not in set(split)]
        if whole:
            for i, t in zip(whole, torch_xla._XLAC._xla_get_cpu_tensors([tensors[i] for i in whole])):
                out[i] = t
        if split:
            # Pending writes run first (one graph for all of them); then wait for the device: the pieces are read
            # straight from device buffers, which a step or sync still in flight may not have filled yet (this runs
            # in the snapshot thread while training goes on).
            torch_xla._XLAC._xla_sync_multi([tensors[i] for i in split], [], wait=True)
            torch_xla._XLAC._xla_wait_device_ops(devices=[])
            shards = torch_xla._XLAC._get_local_shards([tensors[i] for i in split])
            places = torch_xla._XLAC._get_local_shard_replica_and_indices([tensors[i] for i in split])
            for i, pieces, where in zip(split, shards, places):
                full = torch.empty(tensors[i].shape, dtype=tensors[i].dtype)
                for (data, _device), (replica, indices) in zip(pieces, where):
                    if replica == 0:  # a partially replicated sharding holds each piece more than once
                        # a piece of an uneven split is padded at its end; its indices say how much is real
                        full[tuple(indices)] = data[tuple(slice(0, s.stop - s.start) for s in indices)]
                out[i] = full
        return out  # type: ignore[return-value]

    def describe(self) -> str:
        return f"spmd{self.devices}"


def sharding_of(t: torch.Tensor) -> str:
    """torch_xla's sharding spec of ``t`` as text: ``{devices=[4,1]0,1,2,3}`` for a tensor split in 4 along dim 0,
    ``{replicated}`` or '' for one that is not split."""
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(t)


def local_shapes(t: torch.Tensor) -> list[tuple[int, ...]]:
    """The shape of ``t``'s piece on each device, in device order (all equal to ``t.shape`` when replicated)."""
    import torch_xla

    return [tuple(shard.shape) for shard, _device in torch_xla._XLAC._get_local_shards([t])[0]]


def device_bytes(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Bytes of ``tensors`` held on each device (from their local shards)."""
    out: list[int] = []
    for t in tensors:
        sizes = [int(torch.Size(s).numel()) * t.element_size() for s in local_shapes(t)]
        out = sizes if not out else [a + b for a, b in zip(out, sizes)]
    return out

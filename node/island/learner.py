"""The learner: a plain synchronous training loop step on the device. It never touches the network.

It is the ``Trainee`` (``trainee.py``: θ in and out, checkpoint state) of ``atoll start``: it owns the local model
θ, the AdamW inner optimizer at the run's learning rates and the data position in this daemon's shard.

The same code runs on cpu, cuda and xla. What the xla path needs, and every device gets:

- one ``device.sync()`` per inner step, and graphs whose shape never depends on the step: the AdamW step count
  and bias corrections live on the device (``capturable``, off the CPU), Python scalars such as the warm-up lr
  become graph inputs, so after the first steps nothing compiles again (``device.compilations()`` is flat);
- the next batch is sliced and uploaded right after a step is dispatched, while the device still runs it;
  ``train_step`` then waits for the step's loss, ``train_step_lagged`` returns the previous one instead so that
  the host traces the next step while the device runs this one;
- parameters leave the device in one batched transfer (``device.to_host``), and ``snapshot`` copies a
  fragment on the device and moves it to host memory in a background thread while training goes on;
- merged values are copied back into the existing parameter tensors (uploaded buffers become graph inputs).

``precision`` is ``fp32`` or ``bf16`` (autocast: bf16 matmuls, fp32 master weights, optimizer state and loss);
the default is the device's (bf16 on xla, as on a TPU).

An inner step is ``accumulate`` micro-batches of ``batch_size`` sequences on each of the island's ``world`` ranks
(``ranks.py``): the island's batch is ``batch_size × accumulate × world`` windows of its shard, from ``position``
on, micro-batch ``m`` of rank ``r`` taking the ``(m·world + r)``-th slice. Under SPMD on xla (``spmd.py``) the
device's N chips count as ranks of one process: each micro-batch is ``batch_size × N`` windows split over them, and
θ and the AdamW state are sharded over them. On several ranks the model trains wrapped
in ``DistributedDataParallel`` (gradients averaged over the ranks once per step, on the last micro-batch), and every
rank's θ and optimizer state stay the same.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math

import torch

from atoll.models.data import Corpus
from atoll.models.registry import ModelShape, build_model, shape_of
from atoll.models.fragments import copy_into, flatten

from ..config import RunConfig
from ..device import PRECISIONS, Device
from ..trainee import Trainee
from .ranks import Ranks
from .sharded import ShardedSync


class Learner(Trainee):
    """The daemon's own inner loop (see the module's docstring). ``held_out``: the fixed batches
    ``held_out_loss`` evaluates; ``accumulate``: micro-batches per step; ``ranks``: this process's place in its
    island (its process group initialised, ``ranks.init_island``)."""

    def __init__(self, run: RunConfig, device: Device, corpus: Corpus, shard: int, batch_size: int,
                 precision: str | None = None, model: torch.nn.Module | None = None,
                 held_out: list[torch.Tensor] | None = None, accumulate: int = 1, ranks: Ranks = Ranks(),
                 fsdp: bool = False) -> None:
        self.run, self.corpus, self.shard, self.batch_size = run, corpus, shard, batch_size
        self.accumulate, self.ranks = accumulate, ranks
        self.held_out = held_out or []
        self.precision = precision or device.precision
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        self._autocast_device = Device(device.kind, device.torch_device, self.precision)
        if model is None:  # initialised on the CPU from the run's seed: the same θ₀ everywhere
            model, self.shape = build_model(run.model, run.seed)
        else:
            self.shape: ModelShape = shape_of(model, run.model)
        model = model.to(device.torch_device)
        if fsdp and ranks.world > 1:
            _fully_shard(model)  # before the optimizer: its state is then sharded like the parameters
        params = [p for p in model.parameters() if p.requires_grad]
        if device.spmd is not None:
            device.spmd.shard_params(params)
        # capturable: the step count and bias corrections are device tensors, so the optimizer's graph is the
        # same at every step on xla (a host-side step count would change constants and recompile).
        optimizer = torch.optim.AdamW(params, lr=run.inner_lr, betas=(0.9, 0.95), weight_decay=run.weight_decay,
                                      capturable=device.kind != "cpu")
        super().__init__(model, optimizer, device)  # ``position``: data windows consumed in this daemon's shard
        self.train_model: torch.nn.Module = model
        if ranks.world > 1 and not fsdp:
            from torch.nn.parallel import DistributedDataParallel

            # Every rank starts from the seed's θ₀ and rank 0's state is shared after start (ranks.IslandSync), so
            # DDP's own broadcast at construction only repeats it.
            self.train_model = DistributedDataParallel(
                model, device_ids=[ranks.local_rank] if device.kind == "cuda" else None)
        self._prefetched: tuple[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None
        self._lagged_loss: torch.Tensor | None = None

    @property
    def island_batch(self) -> int:
        """Sequences one inner step trains, over every micro-batch of every rank of the island."""
        return self.batch_size * self.accumulate * self.ranks.world * self.device.devices

    @property
    def tokens_per_step(self) -> int:
        return self.island_batch * self.shape.seq_len

    def _lr(self) -> float:
        warm = self.run.warmup_steps
        return self.run.inner_lr * min(1.0, (self.step + 1) / warm) if warm else self.run.inner_lr

    # ---- data -------------------------------------------------------------------------------------------------
    def _load(self, position: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of the step that starts at ``position`` (see the module's docstring)."""
        out = []
        upload, size = self.device.upload, self.batch_size * self.device.devices
        for start in micro_batch_starts(position, size, self.accumulate, self.ranks):
            batch = self.corpus.batch_at(self.shard, start, size)
            out.append((upload(batch[:, :-1].contiguous()), upload(batch[:, 1:].contiguous())))
        return out

    def _batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The batch at ``position``: the prefetched one when it is for this position (the daemon may move
        ``position`` on restore), else loaded now."""
        key = (self.position, self.batch_size)
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and prefetched[0] == key:
            return prefetched[1]
        return self._load(self.position)

    def _prefetch(self) -> None:
        """Slice and upload the next batch while the device runs the step just dispatched."""
        self._prefetched = ((self.position, self.batch_size), self._load(self.position))

    # ---- the inner step -----------------------------------------------------------------------------------------
    def _forward_backward(self) -> torch.Tensor:
        """This rank's micro-batches forward and backward; their mean loss. The gradients are the mean over the
        island's micro-batches (DDP averages the ranks' on the last one; each micro-batch's loss is scaled by
        1/accumulate)."""
        if self.device.spmd is not None:  # a write that lost a parameter's sharding must not leave it replicated
            self.device.spmd.keep(self.params)
        micro = self._batch()
        total = None
        for m, (x, y) in enumerate(micro):
            last = m == len(micro) - 1
            hold = self.train_model.no_sync() if self.ranks.world > 1 and not last else contextlib.nullcontext()
            with hold:
                with self._autocast_device.autocast():
                    loss = self.train_model(x, y)
                (loss / len(micro) if len(micro) > 1 else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total / len(micro) if len(micro) > 1 else total

    def _update(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _advance(self) -> None:
        self.position += self.island_batch
        self.step += 1
        self.tokens += self.tokens_per_step

    def train_step(self) -> float:
        """One AdamW step on the next batch of this daemon's shard; returns the training loss.

        The same as ``backward()`` then ``apply_step()``, fused so that xla syncs (and compiles) one graph per step.
        """
        loss = self._forward_backward()
        self._update()
        self.device.sync()
        self._advance()
        self._prefetch()
        self._lagged_loss = loss
        return float(loss)

    def train_step_lagged(self) -> float | None:
        """``train_step`` that returns the previous step's loss instead of this one's (None before any step).

        Reading this step's loss waits for the device to finish it, so the host cannot trace the next step
        meanwhile; the previous step's loss is already computed. On xla this lets the device run step k while the
        host traces step k+1. The parameters after the call are the same as after ``train_step``.
        """
        loss = self._forward_backward()
        self._update()
        self.device.sync()
        self._advance()
        self._prefetch()
        previous, self._lagged_loss = self._lagged_loss, loss
        return None if previous is None else float(previous)

    def backward(self) -> float:
        """Forward and backward on the next batch; leaves the gradients in place and returns the loss.
        Does not advance: ``apply_step()`` does."""
        loss = self._forward_backward()
        self.device.sync()
        return float(loss)

    def apply_step(self) -> None:
        """Clip, AdamW step and zero the gradients left by ``backward()`` (or ``load_flat_grads``); advance."""
        self._update()
        self.device.sync()
        self._advance()
        self._prefetch()

    def discard_step(self) -> None:
        """Drop the gradients left by ``backward()`` without stepping or advancing: the same batch comes next."""
        self.optimizer.zero_grad(set_to_none=True)

    def flat_grads(self) -> torch.Tensor:
        """The gradients as one flat fp32 host tensor (zeros for a parameter without a gradient)."""
        return self._to_host_flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])

    def load_flat_grads(self, flat: torch.Tensor) -> None:
        """Replace the gradients with ``flat`` (``flat_grads`` order), e.g. an all-reduced mean."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]  # None after a step
        copy_into(flat, grads)
        for p, g in zip(self.params, grads):
            p.grad = g
        self.device.sync()

    def release(self, keep: bool = True) -> dict[str, torch.Tensor] | None:
        self._prefetched = self._lagged_loss = None  # device tensors too
        return super().release(keep)

    @torch.no_grad()
    def evaluate(self, batches: list[torch.Tensor]) -> float:
        """Mean loss of the current θ on fixed held-out batches (accumulated on the device, read once)."""
        if not batches:
            return math.nan
        dev, upload = self.device.torch_device, self.device.upload
        self.model.eval()
        total = torch.zeros((), dtype=torch.float32, device=dev)
        for b in batches:
            with self._autocast_device.autocast():
                loss = self.model(upload(b[:, :-1].contiguous()), upload(b[:, 1:].contiguous()))
            total = total + loss.float()
            self.device.sync()
        self.model.train()
        return float(total) / len(batches)

    def held_out_loss(self) -> float:
        return self.evaluate(self.held_out)


def micro_batch_starts(position: int, batch_size: int, accumulate: int, ranks: Ranks) -> list[int]:
    """The first window of each of ``ranks.rank``'s micro-batches in the island step that starts at ``position``:
    micro-batch ``m`` of rank ``r`` is the ``(m·world + r)``-th slice of ``batch_size`` windows."""
    return [position + (m * ranks.world + ranks.rank) * batch_size for m in range(accumulate)]


def _fully_shard(model: torch.nn.Module) -> None:
    """FSDP2 over the island's ranks: each block of every ``ModuleList`` (a transformer's layers) is one unit,
    gathered whole only while it runs, and the rest (embeddings, head, final norm) the root unit."""
    from torch.distributed.fsdp import fully_shard

    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                fully_shard(block)
    fully_shard(model)


class ShardedLearner(Learner):
    """The learner of an island whose θ and AdamW state are sharded over its ranks (``--fsdp``): on rank 0 every
    read and write of θ, every held-out evaluation and every checkpoint goes through ``ShardedSync``, a collective
    of every rank; the other ranks serve them (``ShardedSync.serve``)."""

    def __init__(self, *args, control=None, **kwargs) -> None:
        super().__init__(*args, fsdp=True, **kwargs)
        self.sync = ShardedSync(self.ranks, self, control)

    def local_parameter_bytes(self) -> tuple[int, int]:
        """(this rank's bytes of θ, the whole model's)."""
        mine = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
                   for p in self.params)
        return mine, sum(p.numel() * p.element_size() for p in self.params)

    def gather(self, fragment) -> torch.Tensor:
        return flatten(self.sync.read(fragment.params))

    def put(self, fragment, flat: torch.Tensor) -> None:
        if flat.numel() != fragment.numel:
            raise ValueError(f"fragment {fragment.index} has {fragment.numel} values, got {flat.numel()}")
        self.sync.write(fragment.params, _split(flat, [self.params[i] for i in fragment.params]))

    def flat_params(self) -> torch.Tensor:
        return flatten(self.sync.read(range(len(self.params))))

    def load_flat(self, flat: torch.Tensor) -> None:
        self.sync.write(range(len(self.params)), _split(flat, self.params))

    def snapshot(self, indices):
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(flatten(self.sync.read(indices)))
        return done

    def held_out_loss(self) -> float:
        return self.sync.evaluate()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.sync.state()

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.sync.load(tensors)


def _split(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset:offset + t.numel()].reshape(t.shape))
        offset += t.numel()
    return out

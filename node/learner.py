"""The learner: a plain synchronous training loop step on the device. It never touches the network.

It owns the local model θ, the AdamW inner optimizer and the data position. Between steps the daemon may
replace θ with a merged replica (``load_flat``, or ``Fragment.scatter`` into ``params`` for one fragment) or read
it out (``flat_params``, or ``snapshot`` of one fragment) for a pseudo-gradient. Every flat tensor in or out goes
through ``atoll.models.fragments.flatten``/``copy_into``.

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
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Sequence

import torch

from atoll.models.data import Corpus
from atoll.models.registry import ModelShape, build_model, shape_of
from atoll.models.fragments import copy_into, flatten

from .config import RunConfig
from .device import PRECISIONS, Device


class Learner:
    def __init__(self, run: RunConfig, device: Device, corpus: Corpus, shard: int, batch_size: int,
                 precision: str | None = None, model: torch.nn.Module | None = None) -> None:
        self.run, self.device, self.corpus, self.shard, self.batch_size = run, device, corpus, shard, batch_size
        self.precision = precision or device.precision
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        self._autocast_device = Device(device.kind, device.torch_device, self.precision)
        if model is None:  # initialised on the CPU from the run's seed: the same θ₀ everywhere
            model, self.shape = build_model(run.model, run.seed)
        else:
            self.shape: ModelShape = shape_of(model, run.model)
        self.model = model.to(device.torch_device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # capturable: the step count and bias corrections are device tensors, so the optimizer's graph is the
        # same at every step on xla (a host-side step count would change constants and recompile).
        self.optimizer = torch.optim.AdamW(self.params, lr=run.inner_lr, betas=(0.9, 0.95),
                                           weight_decay=run.weight_decay, capturable=device.kind != "cpu")
        self.position = 0  # data windows consumed in this daemon's shard
        self.step = 0
        self.tokens = 0
        self._prefetched: tuple[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None
        self._snapshots: concurrent.futures.ThreadPoolExecutor | None = None
        self._lagged_loss: torch.Tensor | None = None

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.shape.seq_len

    def _lr(self) -> float:
        warm = self.run.warmup_steps
        return self.run.inner_lr * min(1.0, (self.step + 1) / warm) if warm else self.run.inner_lr

    # ---- data -------------------------------------------------------------------------------------------------
    def _load(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.corpus.batch_at(self.shard, position, self.batch_size)
        dev = self.device.torch_device
        return (batch[:, :-1].contiguous().to(dev, non_blocking=True),
                batch[:, 1:].contiguous().to(dev, non_blocking=True))

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
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
        x, y = self._batch()
        with self._autocast_device.autocast():
            loss = self.model(x, y)
        loss.backward()
        return loss.detach()

    def _update(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _advance(self) -> None:
        self.position += self.batch_size
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

    # ---- parameters in and out ----------------------------------------------------------------------------------
    def _to_host_flat(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        # ``Device.to_host`` moves them in one batched transfer; on xla, one by one would be a transfer each.
        return flatten(self.device.to_host(tensors))

    def flat_params(self) -> torch.Tensor:
        """θ as one flat fp32 host tensor (a copy)."""
        return self._to_host_flat(self.params)

    def load_flat(self, flat: torch.Tensor) -> None:
        """Copy ``flat`` (``flat_params`` order) into θ in place: the tensors the optimizer holds stay the same."""
        copy_into(flat, self.params)
        self.device.sync()

    def snapshot(self, indices: Sequence[int]) -> concurrent.futures.Future:
        """A future of parameters ``indices`` (a fragment's) as one flat fp32 host tensor, as of now, which does
        not hold up training.

        On an accelerator the parameters are first copied on the device (cheap), then moved to host memory by a
        background thread while the next steps run; on the CPU the copy is made right away.
        """
        if self.device.kind == "cpu":
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(self._to_host_flat([self.params[i] for i in indices]))
            return done
        with torch.no_grad():
            copies = [self.params[i].detach().clone() for i in indices]
        self.device.sync()  # the copies materialise as their own small graph, never inside a step's graph
        if self._snapshots is None:
            self._snapshots = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="snapshot")
        return self._snapshots.submit(self._to_host_flat, copies)

    @torch.no_grad()
    def evaluate(self, batches: list[torch.Tensor]) -> float:
        """Mean loss of the current θ on fixed held-out batches (accumulated on the device, read once)."""
        if not batches:
            return math.nan
        dev = self.device.torch_device
        self.model.eval()
        total = torch.zeros((), dtype=torch.float32, device=dev)
        for b in batches:
            with self._autocast_device.autocast():
                loss = self.model(b[:, :-1].contiguous().to(dev), b[:, 1:].contiguous().to(dev))
            total = total + loss.float()
            self.device.sync()
        self.model.train()
        return float(total) / len(batches)

    # ---- checkpoints --------------------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """θ and the inner optimizer state as named CPU tensors (for checkpoints); the same names and dtypes on
        every device, so a checkpoint written on one device loads on another."""
        names, tensors = [], []
        for i, p in enumerate(self.params):
            names.append(f"model.{i}")
            tensors.append(p)
        for i, p in enumerate(self.params):
            for k, v in self.optimizer.state.get(p, {}).items():
                names.append(f"opt.{i}.{k}")
                tensors.append(torch.as_tensor(v))
        return dict(zip(names, self.device.to_host(tensors)))

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for i, p in enumerate(self.params):
                p.copy_(tensors[f"model.{i}"].to(p.device, p.dtype))
        state = {}
        for i, _ in enumerate(self.params):
            entry = {k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"opt.{i}.")}
            if entry:
                state[i] = entry
        sd = self.optimizer.state_dict()
        sd["state"] = state
        # load_state_dict places each value on its parameter's device (the step count too, when capturable).
        self.optimizer.load_state_dict(sd)
        self.device.sync()

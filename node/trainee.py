"""What the rounds, checkpoints and vetting need of a model in training, whoever runs its loop.

A ``Trainee`` holds a module, its inner optimizer and the device they live on, and counts steps and tokens. Its
trainable parameters (``requires_grad``, in ``parameters()`` order, tied tensors once) are θ: between steps the
rounds read θ out (``flat_params``, ``snapshot`` of one fragment) and put merged values back in place
(``load_flat``, or ``Fragment.scatter`` into ``params``), so the tensors the optimizer holds stay the same.
``state_tensors`` names θ and the optimizer's state for a checkpoint, for any ``torch.optim`` optimizer.

Two kinds exist: the daemon's own ``Learner`` (``learner.py``: AdamW on the run's data) and ``LoopTrainee``, the
user's module and optimizer driven by the user's own loop (``island.py``). Every flat tensor in or out goes through
``atoll.models.fragments.flatten``/``copy_into``.
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable, Sequence
from itertools import groupby

import torch

from atoll.models.fragments import copy_into, flatten

from .device import Device


class Trainee:
    """θ, the inner optimizer and the counters of one model in training (see the module's docstring).

    ``step`` and ``tokens`` count the inner steps and tokens trained; ``position`` is the data position a
    checkpoint restores (the daemon's windows consumed; a user's loop reads ``step``).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: Device) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.step = 0
        self.tokens = 0
        self.position = 0
        self._snapshots: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def tokens_per_step(self) -> int:
        """Tokens the last inner step trained (the weight a step adds to a round)."""
        raise NotImplementedError

    def held_out_loss(self) -> float:
        """The current θ's loss on held-out data; NaN when this trainee has no way to measure it."""
        return math.nan

    # ---- parameters in and out ----------------------------------------------------------------------------------
    def _to_host_flat(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        # ``Device.to_host`` moves them in one batched transfer; on xla, one by one would be a transfer each.
        return flatten(self.device.to_host(tensors))

    def flat_params(self) -> torch.Tensor:
        """θ as one flat fp32 host tensor (a copy)."""
        return self._to_host_flat(self.params)

    def gather(self, fragment) -> torch.Tensor:
        """A fragment's parameters as one flat fp32 host tensor (a copy): every read of θ by rounds goes here (the
        delta rule reads θ_p at every merge), in one batched transfer (``Device.to_host``)."""
        return self._to_host_flat([self.params[i] for i in fragment.params])

    def put(self, fragment, flat: torch.Tensor) -> None:
        """Copy ``flat`` into a fragment's parameters in place: every write of θ by rounds goes here."""
        fragment.scatter(flat, self.params)

    def load_flat(self, flat: torch.Tensor) -> None:
        """Copy ``flat`` (``flat_params`` order) into θ in place: the tensors the optimizer holds stay the same."""
        copy_into(flat, self.params)
        self.device.sync()

    def snapshot(self, indices: Sequence[int]) -> concurrent.futures.Future:
        """A future of parameters ``indices`` (a fragment's) as one flat fp32 host tensor, as of now, which does
        not hold up training.

        On an accelerator the parameters are first copied on the device (cheap), then moved to host memory by a
        background thread while the next steps run, once the device has written the copies (``Device.fence``); on
        the CPU the copy is made right away.
        """
        if self.device.kind == "cpu":
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(self._to_host_flat([self.params[i] for i in indices]))
            return done
        params = [self.params[i].detach() for i in indices]
        with torch.no_grad():
            if self.device.kind == "cuda":
                # One flat copy per device (a user's model may span several), each moved in one transfer: a transfer
                # waits for all the work queued on the stream before it, which the training thread keeps adding to,
                # so one per tensor could each wait up to a step.
                copies = [torch.cat([p.reshape(-1) for p in run]) for _, run in groupby(params, lambda p: p.device)]
            else:
                copies = [p.clone() for p in params]
        self.device.sync()  # the copies materialise as their own small graph, never inside a step's graph
        written = self.device.fence()
        if self._snapshots is None:
            self._snapshots = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="snapshot")
        return self._snapshots.submit(self._to_host_after, written, copies)

    def _to_host_after(self, written: Callable[[], None], tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """``tensors`` as one flat fp32 host tensor, read once ``written()`` returned."""
        written()
        return self._to_host_flat(tensors)

    # ---- checkpoints --------------------------------------------------------------------------------------------
    def _optimizer_index(self) -> dict[int, int]:
        """Each parameter's number in ``optimizer.state_dict()`` (its place across the param groups, in order)."""
        order = [p for group in self.optimizer.param_groups for p in group["params"]]
        return {id(p): i for i, p in enumerate(order)}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """θ and the inner optimizer state as named CPU tensors (for checkpoints); the same names and dtypes on
        every device, so a checkpoint written on one device loads on another. Optimizer state entries that are
        None (SGD without momentum) are left out."""
        names, tensors = [], []
        for i, p in enumerate(self.params):
            names.append(f"model.{i}")
            tensors.append(p)
        for i, p in enumerate(self.params):
            for k, v in self.optimizer.state.get(p, {}).items():
                if v is not None:
                    names.append(f"opt.{i}.{k}")
                    tensors.append(torch.as_tensor(v))
        return dict(zip(names, self.device.to_host(tensors)))

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Put back what ``state_tensors`` named: θ in place, and the optimizer's state."""
        with torch.no_grad():
            for i, p in enumerate(self.params):
                # From the host tensor itself: on xla an SPMD-sharded parameter keeps its sharding (spmd.py).
                p.copy_(tensors[f"model.{i}"].to(dtype=p.dtype))
        index = self._optimizer_index()
        state = {}
        for i, p in enumerate(self.params):
            entry = {k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"opt.{i}.")}
            if entry and id(p) in index:
                state[index[id(p)]] = entry
        sd = self.optimizer.state_dict()
        sd["state"] = state
        # load_state_dict places each value on its parameter's device (the step count too, when capturable).
        self.optimizer.load_state_dict(sd)
        if self.device.spmd is not None:  # load_state_dict made the state anew, replicated: shard it like θ
            self.device.spmd.shard_optimizer_state(self.optimizer)
        self.device.sync()


    # ---- pausing (node/island/pause.py) ----------------------------------------------------------------------------
    def held_bytes(self) -> int:
        """Bytes of θ, its gradients and the optimizer's state this trainee holds now, on its device."""
        tensors = [*self.params, *(p.grad for p in self.params if p.grad is not None),
                   *(v for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v))]
        return sum(t.numel() * t.element_size() for t in tensors)

    def release(self, keep: bool = True) -> dict[str, torch.Tensor] | None:
        """Free the device's memory of θ, its gradients and the optimizer's state (a pause): the state as host
        tensors (``state_tensors``) when ``keep``, for ``reclaim``. θ's tensors stay the same objects, which the
        model and the optimizer hold, emptied until ``reclaim``."""
        state = self.state_tensors() if keep else None
        self._shapes = [p.shape for p in self.params]
        with torch.no_grad():
            for p in self.params:
                p.grad = None
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.optimizer.state.clear()
        self.device.sync()
        if self.device.kind == "cuda":
            torch.cuda.empty_cache()  # back to the driver, where another process can have it
        return state

    def reclaim(self, state: dict[str, torch.Tensor]) -> None:
        """Put back what ``release`` freed, from ``state`` (``state_tensors``' names: its copy or a checkpoint's).
        If the device cannot hold it again (another job took the memory), the trainee is left released as before
        and the error raised: the caller may try again later."""
        try:
            with torch.no_grad():
                for p, shape in zip(self.params, self._shapes):
                    p.data = torch.empty(shape, dtype=p.dtype, device=p.device)
            if self.device.spmd is not None:  # a new tensor is replicated: shard it as θ was, before it fills
                self.device.spmd.shard_params(self.params)
            self.load_state_tensors(state)
        except Exception:
            with torch.no_grad():
                for p in self.params:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self.optimizer.state.clear()
            if self.device.kind == "cuda":
                torch.cuda.empty_cache()
            raise


class LoopTrainee(Trainee):
    """The user's module and optimizer, stepped by the user's loop: ``advance`` counts a step of ``tokens``.
    ``evaluate(model) -> float``, if given, is the held-out loss (called without gradients, in eval mode)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: Device,
                 evaluate: Callable[[torch.nn.Module], float] | None = None) -> None:
        super().__init__(model, optimizer, device)
        self.evaluate = evaluate
        self._tokens_per_step = 0

    @property
    def tokens_per_step(self) -> int:
        return self._tokens_per_step

    def advance(self, tokens: int) -> None:
        self.step += 1
        self.position = self.step
        self.tokens += tokens
        self._tokens_per_step = tokens

    def held_out_loss(self) -> float:
        if self.evaluate is None:
            return math.nan
        training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return float(self.evaluate(self.model))
        finally:
            self.model.train(training)


def device_of(model: torch.nn.Module) -> Device:
    """The ``Device`` a user's module lives on (its first trainable parameter's), at fp32: a user's loop chooses
    its own precision."""
    p = next((p for p in model.parameters() if p.requires_grad), None)
    if p is None:
        raise ValueError("the model has no trainable parameters")
    kind = p.device.type
    if kind not in ("cpu", "cuda", "xla"):
        raise ValueError(f"the model is on a {kind!r} device; atoll runs on cpu, cuda and xla")
    return Device(kind, p.device)


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[int]:
    """The ids of the tensors ``optimizer`` steps."""
    return [id(p) for group in optimizer.param_groups for p in group["params"]]

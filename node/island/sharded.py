"""An island whose θ is sharded over its ranks (``--fsdp``): ``ShardedSync`` is ``IslandSync`` (``ranks.py``) for
FSDP's sharded parameters. Rank 0, the swarm member, asks the other ranks for what a round or a checkpoint needs
(``Op``): θ gathered whole or written back shard by shard, the optimizer's state, a held-out evaluation (a sharded
forward is a collective); the others answer at every step boundary until rank 0 says the boundary is over."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import Any

import torch

from . import collectives
from .ranks import LEADER, IslandSync, Ranks



class Op(enum.IntEnum):
    """What rank 0 asks of a sharded island's other ranks (``ShardedSync``)."""

    END = 0  # the boundary (or start) is over; its argument: whether the island stops
    READ = 1  # gather these parameters whole to rank 0
    WRITE = 2  # rank 0 sends these parameters whole; every rank keeps its shard
    EVAL = 3  # every rank runs the held-out evaluation (a sharded forward is a collective)
    STATE = 4  # gather θ and the optimizer state whole to rank 0 (a checkpoint)
    LOAD = 5  # rank 0 sends θ and the optimizer state whole; every rank keeps its shards
    TERMINATE = 6  # rank 0 has left the run: nothing more will be asked


class ShardedSync:
    """An island whose θ and optimizer state are sharded over its ranks (FSDP2 ``fully_shard``): each rank holds a
    shard of every parameter, so every read or write of θ at rank 0 is a collective of every rank.

    Rank 0 runs the island as any member does, and its learner reads and writes θ through this object
    (``read``, ``write``, ``evaluate``, ``state``, ``load``): each first tells the other ranks what it is about
    to do (an ``Op`` broadcast on the gloo group), then does it with them. The other ranks ``serve`` those
    requests at the same points of their loop: during rank 0's start, at every step boundary until ``END``, and
    after the last one until ``TERMINATE``. What travels between ranks is whole tensors, in host memory; every
    rank keeps its shard of what rank 0 writes (``distribute_tensor`` from its local copy, with no further
    communication)."""

    drifted = 0  # θ is sharded: no rank holds another's values to compare

    def __init__(self, ranks: Ranks, learner: Any, control: Any) -> None:
        self.ranks, self.learner, self.control = ranks, learner, control
        self.seconds = 0.0

    # ---- every rank, at a step boundary (``step_boundary``) -----------------------------------------------------
    def mark(self) -> None:
        pass  # rank 0's writes reach the other ranks as they are made (``write``)

    def check(self) -> bool:
        return True

    def boundary(self, stop: bool) -> bool | None:
        """Rank 0: the boundary is over (``end``); the others: rank 0's requests until then (``serve``)."""
        if self.ranks.leader:
            self.end(stop)
            return stop
        return self.serve()

    def finish(self, stop: bool | None) -> None:
        """A rank other than 0, after its last boundary: rank 0, leaving, still reads θ for its last checkpoint
        and evaluation, until it terminates."""
        if stop:
            self.serve()

    # ---- rank 0 -------------------------------------------------------------------------------------------------
    def _ask(self, op: Op, arg: Any = None) -> None:
        collectives.broadcast_object((int(op), arg), LEADER, self.control)

    def read(self, indices: Sequence[int]) -> list[torch.Tensor]:
        self._ask(Op.READ, list(indices))
        return self._read(list(indices))

    def write(self, indices: Sequence[int], values: Sequence[torch.Tensor]) -> None:
        self._ask(Op.WRITE, list(indices))
        self._write(list(indices), list(values))

    def evaluate(self) -> float:
        self._ask(Op.EVAL)
        return self.learner.evaluate(self.learner.held_out)

    def state(self) -> dict[str, torch.Tensor]:
        self._ask(Op.STATE)
        return self._state()

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        layout = [(name, tuple(t.shape), t.dtype) for name, t in sorted(tensors.items())]
        self._ask(Op.LOAD, layout)
        self._load(layout, tensors)

    def end(self, stop: bool) -> None:
        """The boundary is over. With it go rank 0's counters (a restore or download at start set them), which the
        other ranks' data positions follow."""
        learner = self.learner
        self._ask(Op.END, (bool(stop), learner.step, learner.tokens, learner.position))

    mean_loss = IslandSync.mean_loss  # the same collective on the same group

    def terminate(self) -> None:
        self._ask(Op.TERMINATE)

    # ---- the other ranks ----------------------------------------------------------------------------------------
    def serve(self) -> bool | None:
        """Do what rank 0 asks until it says ``END`` (returns whether the island stops) or ``TERMINATE`` (None)."""
        while True:
            code, arg = collectives.broadcast_object(None, LEADER, self.control)
            op = Op(code)
            if op is Op.END:
                stop, self.learner.step, self.learner.tokens, self.learner.position = arg
                return bool(stop)
            if op is Op.TERMINATE:
                return None
            if op is Op.READ:
                self._read(arg)
            elif op is Op.WRITE:
                self._write(arg, None)
            elif op is Op.EVAL:
                self.learner.evaluate(self.learner.held_out)
            elif op is Op.STATE:
                self._state()
            elif op is Op.LOAD:
                self._load(arg, None)

    # ---- both -------------------------------------------------------------------------------------------------------
    def _read(self, indices: list[int]) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = [self._whole(self.learner.params[i]) for i in indices]
        self.seconds += time.perf_counter() - t0
        return out

    def _whole(self, t: torch.Tensor) -> torch.Tensor | None:
        """A sharded tensor whole in rank 0's host memory (None on the other ranks, which only send their shard):
        a gather to rank 0, so that no other rank ever holds more than its shard."""
        if not hasattr(t, "full_tensor"):
            return t.detach().cpu()
        from torch.distributed.tensor import Shard

        if len(t.placements) != 1 or t.placements[0] != Shard(0):
            return t.full_tensor().detach().cpu()  # a layout we do not shard with: gathered on every rank
        world, rows = self.ranks.world, t.shape[0]
        lengths = [len(c) for c in torch.arange(rows).chunk(world)]  # how fully_shard cuts dim 0
        lengths += [0] * (world - len(lengths))
        local = t.to_local().detach().cpu()
        padded = torch.zeros((max(lengths),) + tuple(t.shape[1:]), dtype=local.dtype)
        padded[: local.shape[0]] = local
        if not self.ranks.leader:
            collectives.gather(padded, None, LEADER, self.control)
            return None
        parts = [torch.empty_like(padded) for _ in range(world)]
        collectives.gather(padded, parts, LEADER, self.control)
        return torch.cat([part[:n] for part, n in zip(parts, lengths)])

    def _write(self, indices: list[int], values: list[torch.Tensor] | None) -> None:
        t0 = time.perf_counter()
        params = [self.learner.params[i] for i in indices]
        with torch.no_grad():
            for k, p in enumerate(params):
                whole = (values[k].to(torch.float32).reshape(p.shape).contiguous() if values is not None
                         else torch.empty(tuple(p.shape), dtype=torch.float32))
                collectives.broadcast(whole, LEADER, self.control)
                _keep_shard(p, whole)
        self.seconds += time.perf_counter() - t0

    def _state(self) -> dict[str, torch.Tensor]:
        learner = self.learner
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for i, p in enumerate(learner.params):
                out[f"model.{i}"] = self._whole(p)
            for i, p in enumerate(learner.params):
                for k, v in learner.optimizer.state.get(p, {}).items():
                    if v is not None:
                        out[f"opt.{i}.{k}"] = self._whole(torch.as_tensor(v) if not hasattr(v, "full_tensor") else v)
        return out

    def _load(self, layout: list, tensors: dict[str, torch.Tensor] | None) -> None:
        learner = self.learner
        index = learner._optimizer_index()
        state: dict[int, dict[str, torch.Tensor]] = {}
        for name, shape, dtype in layout:  # one whole tensor at a time: every rank keeps only its shard of it
            t = tensors[name].contiguous() if tensors is not None else torch.empty(shape, dtype=dtype)
            collectives.broadcast(t, LEADER, self.control)
            kind, i = name.split(".")[0], int(name.split(".")[1])
            p = learner.params[i]
            with torch.no_grad():
                if kind == "model":
                    _keep_shard(p, t)
                elif kind == "opt":
                    key = name.split(".", 2)[2]
                    state.setdefault(index[id(p)], {})[key] = _shard_like(p, t) if t.shape == tuple(p.shape) else t
        sd = learner.optimizer.state_dict()
        sd["state"] = state
        learner.optimizer.load_state_dict(sd)


def _shard_like(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor

    # src_data_rank=None: every rank holds ``whole`` already, and keeps its own slice without communicating.
    return distribute_tensor(whole.to(p.device, p.dtype), p.device_mesh, p.placements, src_data_rank=None)


def _keep_shard(p: torch.Tensor, whole: torch.Tensor) -> None:
    """Write this rank's shard of ``whole`` into the sharded parameter ``p``, in place."""
    p.to_local().copy_(_shard_like(p, whole).to_local())

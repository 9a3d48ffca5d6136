"""An island of several processes: one torch.distributed job (``torchrun``, or ``atoll start --nproc-per-node``)
whose rank 0 is the swarm member.

Inside the island the ranks train data parallel: each rank runs the same ``Learner`` on its own micro-batches of
the island's data shard, and torch's ``DistributedDataParallel`` averages the gradients, so θ and the inner
optimizer's state are the same on every rank after every step. Rank 0 alone joins the swarm: it holds the DHT
identity, the run config, the replica (Θ, outer momentum, error feedback) in host memory, the rounds and the
checkpoints, and it is the one that sends a fragment's delta and receives its merge (``docs/design.md``, "Islands
of many ranks"). The other ranks never touch the network beyond their island.

What rank 0 does to θ at a step boundary (a merge, an adopted replica) every rank must do too. ``IslandSync`` is
the contract, one collective per boundary, called by every rank at the same point of every step through
``step_boundary`` (``ShardedSync``: the same for an island whose θ is sharded; ``OneRank``: an island of one):

- ``share_config`` / ``receive_config``: the run config rank 0 agreed with the swarm, and its peer id (the
  island's data shard), so that every rank builds the same learner;
- ``share_state`` / ``receive_state``: once rank 0 restored a checkpoint or downloaded the swarm's state, θ, the
  optimizer's state and the counters go to every rank;
- ``boundary``: rank 0 sends whether the island stops and the parameters its boundary wrote (found by their
  ``Tensor._version``, which every in-place write bumps: nothing in the rounds needs to report its writes);
- ``mean_loss``: the island's training loss, the mean over the ranks' micro-batches;
- ``check``: every so often, a checksum of θ on every rank against rank 0's; a rank that drifted (it should never
  happen) is logged, counted and given rank 0's θ.

Collectives of the boundary run on a gloo group over host tensors, so on CUDA they never wait for the device;
parameters travel on the training backend (nccl on CUDA, gloo on the CPU).
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..config import ConfigError
from . import collectives

if TYPE_CHECKING:  # sharded.py builds on this module
    from .sharded import ShardedSync

logger = logging.getLogger("atoll")
LEADER = 0
# A rank waits this long in a collective for the others; rank 0's synchronous merges and its first download of
# state happen while the others wait at a boundary, so it is far longer than any of those.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class Ranks:
    """This process's place in its island: ``rank`` of ``world``, ``local_rank`` on its host."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def leader(self) -> bool:
        return self.rank == LEADER

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Ranks:
        """The ranks torch's launcher (``torchrun``) sets in the environment; one rank of one without them."""
        env = os.environ if env is None else env
        try:
            world = int(env.get("WORLD_SIZE", "1"))
            rank = int(env.get("RANK", "0"))
            local = int(env.get("LOCAL_RANK", "0"))
        except ValueError:
            raise ConfigError("WORLD_SIZE, RANK and LOCAL_RANK must be integers (as torchrun sets them)") from None
        if world < 1 or not 0 <= rank < world or local < 0:
            raise ConfigError(f"RANK {rank} of WORLD_SIZE {world}: not a rank of the job")
        return cls(rank, world, local)


def init_island(ranks: Ranks, device_kind: str) -> tuple[Any, Any]:
    """Join the island's process group (unless the user's script already did); returns (the training group, the
    gloo group of the boundaries), both None for an island of one rank."""
    if ranks.world == 1:
        return None, None
    if device_kind == "xla":
        raise ConfigError("device: an island of several ranks trains on cpu or cuda; on xla one process drives the "
                          "host's chips")
    if dist.is_initialized():
        if dist.get_world_size() != ranks.world or dist.get_rank() != ranks.rank:
            raise ConfigError(f"the process group (rank {dist.get_rank()} of {dist.get_world_size()}) is not the "
                              f"launcher's (RANK {ranks.rank} of WORLD_SIZE {ranks.world})")
        gloo = dist.get_backend() == "gloo"
        return dist.group.WORLD, dist.group.WORLD if gloo else dist.new_group(backend="gloo",
                                                                               timeout=COLLECTIVE_TIMEOUT)
    backend = "nccl" if device_kind == "cuda" else "gloo"
    if device_kind == "cuda":
        torch.cuda.set_device(ranks.local_rank)
    store = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # The launcher's agent keeps one store across restarts, and gloo's ranks publish their addresses in it: a
        # restarted rank would read the dead one's address and fail to connect (torch 2.13). One prefix per attempt.
        agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), ranks.world,
                              is_master=False, timeout=COLLECTIVE_TIMEOUT)
        store = dist.PrefixStore(f"atoll/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent)
    dist.init_process_group(backend, store=store, rank=ranks.rank, world_size=ranks.world,
                            timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if backend != "gloo" else dist.group.WORLD
    return dist.group.WORLD, control


def step_boundary(sync: IslandSync | ShardedSync | OneRank, step: int | None, every: int, loss: float | None,
                  stop: Callable[[], bool], lead: Callable[[float | None], None] | None = None) -> bool | None:
    """An island's step boundary: the same collectives in the same order on every rank, whoever runs the loop
    (``atoll start``'s daemon, the optimizer hook of ``atoll.Island``, or a rank other than 0 following either).

    After a step (``step``: the count it reached; None before the first step, or after one that did not count),
    rank 0 marks θ (what its boundary writes next goes to the others), every rank's loss is averaged, and every
    ``every`` steps the ranks compare θ. Then rank 0 does its part, ``lead(loss)`` (rounds, merges, adopted
    replicas, checkpoints; None on the other ranks), and every rank learns whether the island stops: ``stop()``
    as rank 0 (or, data parallel, any rank) sees it once its part is done. None: rank 0 ended the island
    (``ShardedSync``)."""
    if step is not None:
        if lead is not None:
            sync.mark()
        loss = sync.mean_loss(loss)
        if step % every == 0:
            sync.check()
    if lead is not None:
        lead(loss)
    return sync.boundary(stop())


class OneRank:
    """An island of one rank: its boundary has nobody to tell (``IslandSync``'s interface, doing nothing)."""

    drifted = 0
    seconds = 0.0

    def mark(self) -> None:
        pass

    def mean_loss(self, loss: float | None) -> float | None:
        return loss

    def check(self) -> bool:
        return True

    def boundary(self, stop: bool) -> bool:
        return stop

    def finish(self, stop: bool | None) -> None:
        pass


class IslandSync:
    """The collectives that keep an island's ranks on one θ (see the module's docstring). ``params``: the
    learner's trainable parameters, in the same order on every rank."""

    def __init__(self, ranks: Ranks, params: Sequence[torch.Tensor], control: Any) -> None:
        self.ranks, self.params, self.control = ranks, list(params), control
        self.versions = [p._version for p in self.params]
        self.broadcasts = 0  # boundaries at which rank 0 sent parameters
        self.drifted = 0  # checks at which some rank's θ differed from rank 0's
        self.seconds = 0.0  # spent in the boundaries that sent parameters and in the checks (the island's cost)

    # ---- start ----------------------------------------------------------------------------------------------------
    def share_config(self, cfg: Any, peer_id: str) -> None:
        """Rank 0: the agreed config and the island's peer id, to every rank."""
        collectives.broadcast_object((cfg, peer_id), LEADER, self.control)

    def receive_config(self) -> tuple[Any, str]:
        """A follower: what ``share_config`` sent."""
        return collectives.broadcast_object(None, LEADER, self.control)

    def share_state(self, learner: Any) -> None:
        """Rank 0, once it restored or downloaded the island's state: θ, optimizer state and counters to every
        rank (``receive_state``)."""
        tensors = {name: t.contiguous() for name, t in learner.state_tensors().items()}
        layout = [(name, tuple(t.shape), t.dtype) for name, t in sorted(tensors.items())]
        collectives.broadcast_object((layout, learner.step, learner.tokens, learner.position), LEADER, self.control)
        for name, _, _ in layout:
            collectives.broadcast(tensors[name], LEADER, self.control)
        self.mark()

    def receive_state(self, learner: Any) -> None:
        """A follower: what ``share_state`` sent, loaded into ``learner``."""
        layout, step, tokens, position = collectives.broadcast_object(None, LEADER, self.control)
        tensors = {}
        for name, shape, dtype in layout:
            tensors[name] = torch.empty(shape, dtype=dtype)
            collectives.broadcast(tensors[name], LEADER, self.control)
        learner.load_state_tensors(tensors)
        learner.step, learner.tokens, learner.position = step, tokens, position

    # ---- every step -------------------------------------------------------------------------------------------------
    def mark(self) -> None:
        """Rank 0, after its optimizer step and before its boundary: what θ is now, to find the boundary's writes."""
        self.versions = [p._version for p in self.params]

    def written(self) -> list[int]:
        """The parameters written since ``mark`` (rank 0)."""
        return [i for i, p in enumerate(self.params) if p._version != self.versions[i]]

    def boundary(self, stop: bool) -> bool:
        """Every rank, at the same point of each step: rank 0 sends the parameters its boundary wrote, the others
        load them. Returns whether the island stops: whether any rank asked to (``stop``), so that every rank
        leaves its loop after the same step."""
        leader = self.ranks.leader
        written = self.written() if leader else []
        header = torch.tensor([float(stop), float(len(written))], dtype=torch.float64)
        collectives.all_reduce(header, dist.ReduceOp.MAX, self.control)  # the others' count is 0
        stop, count = bool(header[0]), int(header[1])
        if count:
            t0 = time.perf_counter()
            indices = torch.tensor(written if leader else [0] * count, dtype=torch.int64)
            collectives.broadcast(indices, LEADER, self.control)
            self._broadcast([self.params[i] for i in indices.tolist()])
            self.broadcasts += 1
            self.seconds += time.perf_counter() - t0
        if leader:
            self.mark()
        return stop

    def finish(self, stop: bool | None) -> None:
        """A rank other than 0, after its last boundary: nothing more to do with rank 0."""

    def mean_loss(self, loss: float | None) -> float | None:
        """The mean of every rank's ``loss`` (None where no rank has one)."""
        mine = torch.tensor([0.0 if loss is None else loss, 0.0 if loss is None else 1.0], dtype=torch.float64)
        collectives.all_reduce(mine, group=self.control)
        return float(mine[0] / mine[1]) if mine[1] else None

    def check(self) -> bool:
        """Every rank: is θ the same on every rank? A rank that differs from rank 0 gets rank 0's θ (logged and
        counted on rank 0). True when they agreed."""
        t0 = time.perf_counter()
        try:
            return self._check()
        finally:
            self.seconds += time.perf_counter() - t0

    def _check(self) -> bool:
        with torch.no_grad():
            # Two sums that differ unless the values do (or, vanishingly rarely, two changes cancel in both).
            sums = torch.zeros(2, dtype=torch.float64)
            for p in self.params:
                flat = p.detach().reshape(-1).double().cpu()
                sums[0] += flat.sum()
                sums[1] += flat.square().sum()
        every = [torch.zeros(2, dtype=torch.float64) for _ in range(self.ranks.world)]
        collectives.all_gather(every, sums, self.control)
        drifted = [r for r, s in enumerate(every) if not torch.equal(s, every[LEADER])]
        if not drifted:
            return True
        if self.ranks.leader:
            self.drifted += 1
            logger.error("island ranks %s hold a θ other than rank 0's; sending them rank 0's", drifted)
        self._broadcast(self.params)
        return False

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's values of ``tensors`` into every rank's, in one collective per dtype (a fragment is many
        small tensors; one broadcast each would pay the collective's latency for each)."""
        with torch.no_grad():
            for dtype in sorted({t.dtype for t in tensors}, key=str):
                group = [t for t in tensors if t.dtype == dtype]
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                collectives.broadcast(flat, LEADER)
                if not self.ranks.leader:
                    offset = 0
                    for t in group:
                        t.data.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()

    def digest(self) -> str:
        """A digest of θ's values on this rank (for the log: every rank of an island ends with the same one)."""
        h = hashlib.sha256()
        for p in self.params:
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]


def leave_island() -> None:
    """Leave the island's process group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()

"""The island's collectives (``ranks.IslandSync``, ``sharded.ShardedSync``), each returning only once the process
group's threads have let go of the tensors it was given.

Why: gloo completes a collective (``wait`` returns) before its worker thread drops the work, and with it the work's
references to the tensors. A temporary whose Python reference the caller drops meanwhile is then freed on that
thread, which takes the GIL to do it; if the interpreter has begun to exit by then (a rank that leaves right after
its last boundary), the thread is ended inside a C++ destructor and the process aborts ("terminate called without
an active exception", SIGABRT). A busy host makes the window wide enough (docs/design.md, "Islands of many
ranks"). So each call here waits, after the collective, until the tensors that only the caller held are back to
that one reference; they are then freed where the caller drops them, on its own thread. Tensors that others hold
too (a parameter) are not waited for: their last reference is not the caller's to drop.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger("atoll")
# A worker thread lets go of a finished collective as soon as it runs again; this bounds the wait should a tensor
# be held by something else after all (it is then the collective's caller that holds it a while longer).
SETTLE_SECONDS = 10.0


def _held(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The host tensors held by nothing but the caller (one reference), to wait for after the collective. A
    device tensor's collective (nccl) is let go of once the device ran it: waiting for that would stall the host
    on the device at every boundary."""
    return [t for t in tensors if t.device.type == "cpu" and t._use_count() == 1]


def settle(tensors: Sequence[torch.Tensor], timeout: float = SETTLE_SECONDS) -> bool:
    """Wait until each of ``tensors`` (held by the caller alone before a collective) is back to one reference;
    False if one is not within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    for t in tensors:
        while t._use_count() > 1:
            if time.monotonic() > deadline:
                logger.debug("a collective's tensor is still held %.0f s after it completed", timeout)
                return False
            _pause()
    return True


def _pause() -> None:
    time.sleep(0)  # gives the worker thread the core (and the GIL, which it does not need here)


def broadcast(t: torch.Tensor, src: int, group: Any = None) -> None:
    ours = _held([t])
    dist.broadcast(t, src=src, group=group)
    settle(ours)


def all_reduce(t: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None) -> None:
    ours = _held([t])
    dist.all_reduce(t, op=op, group=group)
    settle(ours)


def all_gather(outputs: list[torch.Tensor], t: torch.Tensor, group: Any = None) -> None:
    ours = _held([t, *outputs])
    dist.all_gather(outputs, t, group=group)
    settle(ours)


def gather(t: torch.Tensor, outputs: list[torch.Tensor] | None, dst: int, group: Any = None) -> None:
    ours = _held([t, *(outputs or [])])
    dist.gather(t, outputs, dst=dst, group=group)
    settle(ours)


def broadcast_object(obj: Any, src: int, group: Any = None) -> Any:
    """``src``'s ``obj`` on every rank (pickled: the ranks are one job, each trusts the others), as
    ``dist.broadcast_object_list`` does, through the two broadcasts above."""
    mine = dist.get_rank() == src
    data = pickle.dumps(obj) if mine else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    broadcast(size, src, group)
    payload = torch.empty(int(size[0]), dtype=torch.uint8)
    if mine:
        payload.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    broadcast(payload, src, group)
    return obj if mine else pickle.loads(payload.numpy().tobytes())

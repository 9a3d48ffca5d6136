"""The island's collectives (``ranks.IslandSync``, ``sharded.ShardedSync``), which never leave gloo's threads the
last reference to a tensor.

Why: gloo completes a collective (``wait`` returns) before its worker thread drops the work, and with it the work's
references to the tensors. A temporary whose Python reference the caller drops meanwhile is then freed on that
thread, which takes the GIL to do it; if the interpreter has begun to exit by then (a rank that leaves right after
its last boundary), the thread is ended inside a C++ destructor and the process aborts ("terminate called without
an active exception", SIGABRT). A busy host makes the window wide enough (docs/design.md, "Islands of several
ranks"). So the host tensors that only the caller held and that gloo still holds when a call returns are kept
here until gloo lets go (looked at again at every call, without waiting), and an exit handler waits for the last of
them before the interpreter begins to finalize. Tensors that others hold too (a parameter) are not kept: their
last reference is not the caller's to drop.
"""

from __future__ import annotations

import atexit
import logging
import pickle
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger("atoll")
# A worker thread lets go of a finished collective as soon as it runs again; this bounds the wait at exit should a
# tensor be held by something else after all.
SETTLE_SECONDS = 10.0
_pending: list[torch.Tensor] = []  # what gloo still held when its call returned, kept referenced until it lets go


def _held(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Before a collective: the host tensors held by nothing but the caller (one reference). A device tensor's
    collective (nccl) is let go of once the device ran it, by a thread of torch's that this does not cover."""
    return [t for t in tensors if t.device.type == "cpu" and t._use_count() == 1]


def _keep(ours: Sequence[torch.Tensor]) -> None:
    """After a collective: keep those of ``ours`` that gloo still holds, and let go of those it no longer does."""
    _pending[:] = [t for t in (*_pending, *ours) if t._use_count() > 1]


def settle(timeout: float = SETTLE_SECONDS) -> bool:
    """Wait until gloo let go of every tensor kept (``_keep``); False if one is still held after ``timeout``
    seconds. Runs at exit, before the interpreter finalizes."""
    deadline = time.monotonic() + timeout
    while True:
        _pending[:] = [t for t in _pending if t._use_count() > 1]
        if not _pending:
            return True
        if time.monotonic() > deadline:
            logger.warning("%d tensor(s) of the island's collectives still held %.0f s after they completed; this "
                           "process may abort as it exits", len(_pending), timeout)
            return False
        _pause()


def _pause() -> None:
    time.sleep(0)  # gives the worker thread the core (and the GIL, which it does not need here)


atexit.register(settle)


def broadcast(t: torch.Tensor, src: int, group: Any = None) -> None:
    ours = _held([t])
    dist.broadcast(t, src=src, group=group)
    _keep(ours)


def all_reduce(t: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None) -> None:
    ours = _held([t])
    dist.all_reduce(t, op=op, group=group)
    _keep(ours)


def all_gather(outputs: list[torch.Tensor], t: torch.Tensor, group: Any = None) -> None:
    ours = _held([t, *outputs])
    dist.all_gather(outputs, t, group=group)
    _keep(ours)


def gather(t: torch.Tensor, outputs: list[torch.Tensor] | None, dst: int, group: Any = None) -> None:
    ours = _held([t, *(outputs or [])])
    dist.gather(t, outputs, dst=dst, group=group)
    _keep(ours)


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

"""State sync: a daemon downloads the global replica (Θ, outer momentum, version, weight) from a donor.

The donor streams a header and then the tensors in parts; the receiver applies a timeout to every part, checks
sizes, finiteness and the content hash, and falls back to the next donor when one fails.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import AsyncIterator  # hivemind detects streaming RPCs by typing.AsyncIterator hints
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from atoll.models.outer import tensor_hash

from .averaging import TrafficStats
from .wire import WireError, check_fields, pack_request, pack_response, parts_to_tensor, tensor_to_parts, unpack

logger = logging.getLogger("atoll")


@dataclass
class ReplicaState:
    """A full replica of the global state, as served and as downloaded."""

    version: int
    weight: float
    digest: str
    params: torch.Tensor
    momentum: torch.Tensor
    steps_since_round: int
    donor: str = ""


_HEADER = {"version": int, "weight": float, "digest": str, "numel": int, "steps_since_round": int}


class StateServicer(ServicerBase):
    """Serves ``rpc_download_state`` from a snapshot callback (called on the event loop; must be cheap)."""

    def __init__(self, snapshot: Callable[[], ReplicaState | None], stats: TrafficStats) -> None:
        self._snapshot, self.stats = snapshot, stats

    async def rpc_download_state(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        state = self._snapshot()
        if state is None:
            yield pack_response({"ok": False, "error": "no state to share yet"})
            return
        yield pack_response(
            {"ok": True, "version": state.version, "weight": state.weight, "digest": state.digest,
             "numel": state.params.numel(), "steps_since_round": state.steps_since_round}
        )
        for tensor in (state.params, state.momentum):
            for part in tensor_to_parts(tensor):
                self.stats.bytes_sent += len(part)
                yield pack_response({"data": part})


async def _download_from(p2p: P2P, namespace: str, donor: str, numel: int, part_timeout: float,
                         stats: TrafficStats) -> ReplicaState:
    stub = StateServicer.get_stub(p2p, PeerID.from_base58(donor), namespace=namespace)
    stream = await asyncio.wait_for(stub.rpc_download_state(pack_request({})), part_timeout)
    header: dict[str, Any] = unpack(await asyncio.wait_for(anext(stream), part_timeout), {"ok": bool})
    if not header["ok"]:
        raise WireError(f"donor refused: {header.get('error')}")
    check_fields(header, _HEADER)
    if header["numel"] != numel:
        raise WireError(f"donor's model has {header['numel']} parameters, ours {numel}")
    chunks: list[bytes] = []
    received = 0
    while received < 8 * numel:
        chunk = unpack(await asyncio.wait_for(anext(stream), part_timeout), {"data": bytes})["data"]
        received += len(chunk)
        stats.bytes_received += len(chunk)
        chunks.append(chunk)
    flat = parts_to_tensor(chunks, 2 * numel)
    params, momentum = flat[:numel].clone(), flat[numel:].clone()
    digest = tensor_hash(params, momentum)
    if digest != header["digest"]:
        raise WireError(f"hash mismatch: donor announced {header['digest']}, received {digest}")
    return ReplicaState(header["version"], float(header["weight"]), digest, params, momentum,
                        header["steps_since_round"], donor)


async def download_state(
    p2p: P2P, namespace: str, donors: Sequence[str], numel: int, part_timeout: float, stats: TrafficStats
) -> ReplicaState | None:
    """Try ``donors`` in order (best first); return the first verified replica, or None if all failed."""
    for donor in donors:
        try:
            state = await _download_from(p2p, namespace, donor, numel, part_timeout, stats)
            logger.info("downloaded state v%d from %s", state.version, donor[-8:])
            return state
        except Exception as e:  # a donor can fail in many ways (dead, slow, lying); all mean: try the next
            if isinstance(e, WireError):
                stats.reject("state")
            logger.warning("state download from %s failed: %r; trying the next donor", donor[-8:], e)
    return None

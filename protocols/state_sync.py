"""State sync: a daemon downloads one fragment of the global replica (Θ_p, momentum, version, weight).

The donor streams a header and then the tensors in parts; the receiver applies a timeout to every part, checks
sizes, finiteness and the content hash, and falls back to the next donor when one fails.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
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
    """One fragment's replica, as served and as downloaded (``schedule_step``: the donor's sync-schedule step)."""

    version: int
    weight: float
    digest: str
    params: torch.Tensor
    momentum: torch.Tensor
    schedule_step: int
    donor: str = ""
    fragment: int = 0
    ancestors: tuple[str, ...] = ()  # digests of this replica's recent versions, oldest first, ``digest`` last
    forked: bool = False  # set on adoption: the replica it replaced was not one of its ancestors


_HEADER = {"version": int, "weight": float, "digest": str, "numel": int, "schedule_step": int, "fragment": int,
           "ancestors": list}
MAX_ANCESTORS = 32


class StateServicer(ServicerBase):
    """Serves ``rpc_download_state`` from a snapshot callback (called on the event loop; must be cheap)."""

    def __init__(self, snapshot: Callable[[int], ReplicaState | None], num_fragments: int,
                 stats: TrafficStats, authorize: Callable[[str], Awaitable[bool]] | None = None) -> None:
        self._snapshot, self.num_fragments, self.stats = snapshot, num_fragments, stats
        self._authorize = authorize  # private runs: serve members only

    async def rpc_download_state(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        if self._authorize is not None and not await self._authorize(str(context.remote_id)):
            self.stats.reject("unauthorized")
            logger.warning("refused a state download by %s: not a member of this private run",
                           str(context.remote_id)[-8:])
            yield pack_response({"ok": False, "error": "not a member of this run"})
            return
        try:
            fragment = unpack(request, {"fragment": int})["fragment"]
            if not 0 <= fragment < self.num_fragments:
                raise WireError(f"no fragment {fragment}")
        except WireError as e:
            self.stats.reject("state_request", str(context.remote_id))
            yield pack_response({"ok": False, "error": str(e)})
            return
        # Copying Θ_p and its momentum is tensor work: keep it off the event loop.
        state = await asyncio.get_running_loop().run_in_executor(None, self._snapshot, fragment)
        if state is None:
            yield pack_response({"ok": False, "error": "no state to share yet"})
            return
        yield pack_response(
            {"ok": True, "version": state.version, "weight": state.weight, "digest": state.digest,
             "numel": state.params.numel(), "schedule_step": state.schedule_step, "fragment": fragment,
             "ancestors": list(state.ancestors)}
        )
        for tensor in (state.params, state.momentum):
            for part in tensor_to_parts(tensor):
                self.stats.bytes_sent += len(part)
                yield pack_response({"data": part})


async def _download_from(p2p: P2P, namespace: str, donor: str, fragment: int, numel: int, part_timeout: float,
                         stats: TrafficStats) -> ReplicaState:
    stub = StateServicer.get_stub(p2p, PeerID.from_base58(donor), namespace=namespace)
    stream = await asyncio.wait_for(stub.rpc_download_state(pack_request({"fragment": fragment})), part_timeout)
    header: dict[str, Any] = unpack(await asyncio.wait_for(anext(stream), part_timeout), {"ok": bool})
    if not header["ok"]:
        raise WireError(f"donor refused: {header.get('error')}")
    check_fields(header, _HEADER)
    if header["numel"] != numel or header["fragment"] != fragment:
        raise WireError(f"donor's fragment {header['fragment']} has {header['numel']} values, ours {numel}")
    ancestors = header["ancestors"]
    if len(ancestors) > MAX_ANCESTORS or not all(isinstance(a, str) and 0 < len(a) <= 64 for a in ancestors):
        raise WireError(f"malformed ancestors list ({len(ancestors)} entries)")
    chunks: list[bytes] = []
    received = 0
    while received < 8 * numel:
        chunk = unpack(await asyncio.wait_for(anext(stream), part_timeout), {"data": bytes})["data"]
        if not chunk:  # a donor streaming empty parts would otherwise keep us reading forever
            raise WireError("empty data message from the donor")
        received += len(chunk)
        stats.bytes_received += len(chunk)
        chunks.append(chunk)
    flat = parts_to_tensor(chunks, 2 * numel)
    params, momentum = flat[:numel].clone(), flat[numel:].clone()
    digest = tensor_hash(params, momentum)
    if digest != header["digest"]:
        raise WireError(f"hash mismatch: donor announced {header['digest']}, received {digest}")
    if ancestors and ancestors[-1] != digest:
        raise WireError("the ancestors list does not end with the replica's own digest")
    return ReplicaState(header["version"], float(header["weight"]), digest, params, momentum,
                        header["schedule_step"], donor, fragment, tuple(ancestors) or (digest,))


async def download_state(
    p2p: P2P, namespace: str, donors: Sequence[str], fragment: int, numel: int, part_timeout: float,
    stats: TrafficStats,
) -> ReplicaState | None:
    """Try ``donors`` in order (best first); return the first verified fragment replica, or None if all failed."""
    for donor in donors:
        try:
            state = await _download_from(p2p, namespace, donor, fragment, numel, part_timeout, stats)
            logger.info("downloaded fragment %d v%d from %s", fragment, state.version, donor[-8:])
            return state
        except Exception as e:  # a donor can fail in many ways (dead, slow, lying); all mean: try the next
            if isinstance(e, WireError):
                stats.reject("state", donor)
            logger.warning("state download from %s failed: %r; trying the next donor", donor[-8:], e)
    return None

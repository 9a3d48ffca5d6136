"""State sync: a daemon downloads one fragment of the global replica (Θ_p, momentum, version, weight).

The donor streams a header and then the tensors' bytes (Θ_p then its momentum, fp32) in parts; the receiver
applies a timeout to every part, checks sizes, finiteness and the content hash, and moves on to the next donor
when one fails. A transfer that breaks off is resumed: the request names the byte offset already received and the
digest those bytes belong to, and a donor holding the same replica streams from there on; a donor holding
another replica answers from byte 0 instead (its header says so), so bytes of two replicas are never spliced.
The hash of the whole payload is checked at the end either way.
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
from .wire import PART_BYTES, WireError, check_fields, pack_request, pack_response, parts_to_tensor, unpack

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
    donors: tuple[str, ...] = ()  # downloaded: every donor that sent bytes of it, in order (``donor`` last)
    resumed_bytes: int = 0  # downloaded: bytes received before the last donor took over the transfer


_HEADER = {"version": int, "weight": float, "digest": str, "numel": int, "schedule_step": int, "fragment": int,
           "ancestors": list, "offset": int}
MAX_ANCESTORS = 32


class StateServicer(ServicerBase):
    """Serves ``rpc_download_state`` from a snapshot callback (called in an executor; it copies tensors).

    Request: ``fragment``, and optionally ``offset`` (bytes already received) with ``digest`` (the replica they
    belong to). ``on_part(n)`` is called before the n+1-th part of a transfer is sent (tests use it to make a
    donor fail mid-stream).
    """

    def __init__(self, snapshot: Callable[[int], ReplicaState | None], num_fragments: int,
                 stats: TrafficStats, part_bytes: int = PART_BYTES, on_part: Callable[[int], None] | None = None,
                 authorize: Callable[[str], Awaitable[bool]] | None = None) -> None:
        assert part_bytes > 0 and part_bytes % 4 == 0
        self._snapshot, self.num_fragments, self.stats = snapshot, num_fragments, stats
        self.part_bytes, self.on_part = part_bytes, on_part
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
            msg = unpack(request, {"fragment": int})
            fragment, offset, wanted = msg["fragment"], msg.get("offset", 0), msg.get("digest")
            if not 0 <= fragment < self.num_fragments:
                raise WireError(f"no fragment {fragment}")
            if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0 or offset % 4:
                raise WireError(f"bad offset {offset!r}")
            if wanted is not None and not isinstance(wanted, str):
                raise WireError("bad digest")
        except WireError as e:
            self.stats.reject("state_request", str(context.remote_id))
            yield pack_response({"ok": False, "error": str(e)})
            return
        # Copying Θ_p and its momentum is tensor work: keep it off the event loop.
        state = await asyncio.get_running_loop().run_in_executor(None, self._snapshot, fragment)
        if state is None:
            yield pack_response({"ok": False, "error": "no state to share yet"})
            return
        payload = await asyncio.get_running_loop().run_in_executor(None, _payload, state)
        # Resume only the replica the receiver's bytes came from; anything else starts over.
        start = offset if wanted == state.digest and offset <= len(payload) else 0
        yield pack_response(
            {"ok": True, "version": state.version, "weight": state.weight, "digest": state.digest,
             "numel": state.params.numel(), "schedule_step": state.schedule_step, "fragment": fragment,
             "ancestors": list(state.ancestors), "offset": start}
        )
        for n, at in enumerate(range(start, len(payload), self.part_bytes)):
            if self.on_part is not None:
                self.on_part(n)
            part = payload[at : at + self.part_bytes]
            self.stats.bytes_sent += len(part)
            yield pack_response({"data": part})


def _payload(state: ReplicaState) -> bytes:
    """The bytes a transfer carries: Θ_p then its momentum, little-endian fp32."""
    flat = torch.cat([state.params.reshape(-1), state.momentum.reshape(-1)]).to("cpu", torch.float32)
    return flat.contiguous().numpy().tobytes()


Opener = Callable[[str, dict[str, Any]], Awaitable[AsyncIterator[Any]]]


def p2p_opener(p2p: P2P, namespace: str) -> Opener:
    """Opens ``rpc_download_state`` streams to donors over hivemind's p2p."""

    async def open_stream(donor: str, request: dict[str, Any]) -> AsyncIterator[Any]:
        stub = StateServicer.get_stub(p2p, PeerID.from_base58(donor), namespace=namespace)
        return await stub.rpc_download_state(pack_request(request))

    return open_stream


class DonorRefused(WireError):
    """A donor answered that it will not serve us (no state yet, or we are not a member it knows): try another."""


class _Transfer:
    """The bytes of one fragment received so far, and the header of the replica they belong to."""

    def __init__(self, numel: int) -> None:
        self.numel, self.data, self.header = numel, bytearray(), None
        self.donors: list[str] = []
        self.resumed_bytes = 0


async def _continue_from(open_stream: Opener, donor: str, fragment: int, t: _Transfer, part_timeout: float,
                         stats: TrafficStats) -> ReplicaState:
    request: dict[str, Any] = {"fragment": fragment}
    if t.data:
        request.update(offset=len(t.data), digest=t.header["digest"])
    stream = await asyncio.wait_for(open_stream(donor, request), part_timeout)
    header: dict[str, Any] = unpack(await asyncio.wait_for(anext(stream), part_timeout), {"ok": bool})
    if not header["ok"]:
        raise DonorRefused(f"donor refused: {header.get('error')}")
    check_fields(header, _HEADER)
    if header["numel"] != t.numel or header["fragment"] != fragment:
        raise WireError(f"donor's fragment {header['fragment']} has {header['numel']} values, ours {t.numel}")
    ancestors = header["ancestors"]
    if len(ancestors) > MAX_ANCESTORS or not all(isinstance(a, str) and 0 < len(a) <= 64 for a in ancestors):
        raise WireError(f"malformed ancestors list ({len(ancestors)} entries)")
    if header["offset"] == 0:
        if t.data:
            logger.info("fragment %d: donor %s holds another replica; restarting the download from byte 0",
                        fragment, donor[-8:])
        t.data.clear()
        t.donors.clear()
        t.resumed_bytes = 0
    elif header["offset"] != len(t.data) or header["digest"] != t.header["digest"]:
        raise WireError(f"donor resumed at byte {header['offset']} of {header['digest']}, "
                        f"we asked for byte {len(t.data)} of {t.header['digest']}")
    else:
        logger.info("fragment %d: resuming the download at byte %d from %s", fragment, len(t.data), donor[-8:])
        t.resumed_bytes = len(t.data)
    t.header = header
    t.donors.append(donor)
    total = 8 * t.numel
    while len(t.data) < total:
        chunk = unpack(await asyncio.wait_for(anext(stream), part_timeout), {"data": bytes})["data"]
        if not chunk:  # a donor streaming empty parts would otherwise keep us reading forever
            raise WireError("empty data message from the donor")
        if len(chunk) % 4 or len(t.data) + len(chunk) > total:
            raise WireError(f"a part of {len(chunk)} bytes does not fit the payload")
        stats.bytes_received += len(chunk)
        t.data.extend(chunk)
    flat = parts_to_tensor([bytes(t.data)], 2 * t.numel)
    params, momentum = flat[: t.numel].clone(), flat[t.numel :].clone()
    digest = tensor_hash(params, momentum)
    if digest != header["digest"]:
        t.data.clear()  # some of these bytes are wrong, and nothing tells which: start over
        raise WireError(f"hash mismatch: donor announced {header['digest']}, received {digest}")
    if ancestors and ancestors[-1] != digest:
        raise WireError("the ancestors list does not end with the replica's own digest")
    return ReplicaState(header["version"], float(header["weight"]), digest, params, momentum,
                        header["schedule_step"], donor, fragment, tuple(ancestors) or (digest,),
                        donors=tuple(t.donors), resumed_bytes=t.resumed_bytes)


async def download_state(
    open_stream: Opener, donors: Sequence[str], fragment: int, numel: int, part_timeout: float,
    stats: TrafficStats,
) -> ReplicaState | None:
    """Try ``donors`` in order (best first) until one fragment replica verifies; None if all failed. A donor that
    fails mid-transfer hands over to the next one, which resumes where it stopped if it holds the same replica."""
    t = _Transfer(numel)
    for donor in donors:
        try:
            state = await _continue_from(open_stream, donor, fragment, t, part_timeout, stats)
            logger.info("downloaded fragment %d v%d from %s", fragment, state.version,
                        "+".join(d[-8:] for d in state.donors))
            return state
        except Exception as e:  # a donor can fail in many ways (dead, slow, lying); all mean: try the next
            if isinstance(e, WireError) and not isinstance(e, DonorRefused):  # a refusal is no offence
                stats.reject("state", donor)
            logger.warning("state download of fragment %d from %s failed after %d bytes: %r; trying the next donor",
                           fragment, donor[-8:], len(t.data), e)
    return None

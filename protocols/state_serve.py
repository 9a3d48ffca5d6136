"""The donor's side of state sync (``state_sync.py`` is the receiver's and says what travels): ``StateServicer``
serves ``rpc_download_state`` from a snapshot of this daemon's replica, or a replay of the rounds since the
requester's, sharing one copy of a replica's bytes among every transfer of it in flight, refusing a claim it no
longer holds ("moved on") and more than ``MAX_TRANSFERS_PER_PEER`` transfers to one peer, and cutting a transfer
whose reader stalls (``PART_DEADLINE``).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import AsyncIterator  # hivemind detects streaming RPCs by typing.AsyncIterator hints
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2


from .p2p_guard import RateLimitedLog
from .state_sync import MAX_TRANSFERS_PER_PEER, Claim, Opener, Replay, ReplicaState
from .stats import TrafficStats
from .wire import PART_BYTES, WireError, pack_request, pack_response, unpack

logger = logging.getLogger("atoll")

# Seconds a requester may take to read one part (PART_BYTES) of a transfer: past it the transfer is cut (a reader
# that stalls would hold its stream, and a copy of the replica, for as long as it keeps the connection open).
# Half a MiB (a part) a minute: far below any link a daemon trains over.
PART_DEADLINE = 60.0


class _Deadline:
    """Cancels the task that runs a transfer (hivemind's, which writes each part we yield) when ``arm`` was not
    called again within ``seconds``: each part must leave within that long of the previous one."""

    def __init__(self, seconds: float, expired: Callable[[], None]) -> None:
        self.seconds, self.expired = seconds, expired
        # Weak: the task's coroutine holds the transfer's generator, which must not outlive its reader for the timer.
        task = asyncio.current_task()
        self.task = weakref.ref(task) if task is not None else lambda: None
        self.handle: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        self.disarm()
        self.handle = asyncio.get_running_loop().call_later(self.seconds, self._expire)

    def _expire(self) -> None:
        task = self.task()
        if task is not None and not task.done():
            self.expired()
            task.cancel()

    def disarm(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
class StateServicer(ServicerBase):
    """Serves ``rpc_download_state`` from a snapshot callback (called in an executor; it copies tensors).

    Request: ``fragment``, and optionally ``offset`` (bytes already received) with ``digest`` (the replica they
    belong to), or ``have`` (the digest of the replica the requester holds: answered by a replay when
    ``replay(fragment, have)`` returns one), and ``want`` (the digest of the replica the requester chose us for,
    as our progress record claimed it): if we hold another one now (a round moved us on), we refuse, saying what
    we hold, rather than send what the requester did not ask for.
    """

    def __init__(self, snapshot: Callable[[int], ReplicaState | None], num_fragments: int,
                 stats: TrafficStats, part_bytes: int = PART_BYTES,
                 authorize: Callable[[str], Awaitable[bool]] | None = None,
                 replay: Callable[[int, str], Replay | None] | None = None,
                 identity: Callable[[int], Claim] | None = None) -> None:
        assert part_bytes > 0 and part_bytes % 4 == 0
        self._snapshot, self.num_fragments, self.stats = snapshot, num_fragments, stats
        self.part_bytes = part_bytes
        self._authorize = authorize  # private runs: serve members only
        self._replay = replay
        self._identity = identity  # the replica held now, without a copy: a transfer in flight may be shared
        self._log = RateLimitedLog()
        self._shared: dict[tuple[int, str], _Shared] = {}  # (fragment, digest) -> the bytes transfers read
        self._active: dict[str, int] = {}  # peer -> its transfers in flight

    async def rpc_download_state(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        if self._authorize is not None and not await self._authorize(str(context.remote_id)):
            self.stats.reject("unauthorized")
            self._log("unauthorized", "refused a state download by %s: not a member of this private run",
                      str(context.remote_id)[-8:])  # rate-limited: strangers' identities are free
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
            have, want = msg.get("have"), msg.get("want")
            if have is not None and not (isinstance(have, str) and len(have) <= 64):
                raise WireError("bad 'have' digest")
            if want is not None and not (isinstance(want, str) and len(want) <= 64):
                raise WireError("bad 'want' digest")
        except WireError as e:
            self.stats.reject("state_request", str(context.remote_id))
            yield pack_response({"ok": False, "error": str(e)})
            return
        replay = self._replay(fragment, have) if have and self._replay is not None and not offset else None
        if replay is not None and want is not None and replay.digest != want:
            replay = None  # the replica we hold is not the one wanted: the refusal below says so
        if replay is not None:
            yield pack_response(
                {"ok": True, "version": replay.version, "weight": replay.weight, "digest": replay.digest,
                 "numel": sum(n for n, _ in replay.rounds[0].shards), "schedule_step": replay.schedule_step,
                 "fragment": fragment, "ancestors": list(replay.ancestors), "offset": 0,
                 "replay": [{"version": r.version, "base": r.base, "result": r.result, "weight": r.weight,
                             "norm": -1.0 if r.rda_norm is None else r.rda_norm, "numels": [n for n, _ in r.shards],
                             "sizes": [len(b) for _, b in r.shards]} for r in replay.rounds]}
            )
            data = b"".join(b for r in replay.rounds for _, b in r.shards)
            deadline = self._deadline(context)
            try:
                for n, at in enumerate(range(0, len(data), self.part_bytes)):
                    deadline.arm()
                    yield self._send_part(n, data[at : at + self.part_bytes])
            finally:
                deadline.disarm()
            return
        if want is not None and self._identity is not None and self._identity(fragment)[2] != want:
            # Moved on: say so before copying a replica nobody asked for (the check below stays for a race).
            yield pack_response({"ok": False, "error": "moved on", "holds": list(self._identity(fragment))})
            return
        peer = str(context.remote_id)
        if self._active.get(peer, 0) >= MAX_TRANSFERS_PER_PEER:
            # Each transfer in flight holds its stream, and its bytes if no other transfer shares them.
            self.stats.reject("busy")
            yield pack_response({"ok": False, "error": "busy"})
            return
        self._active[peer] = self._active.get(peer, 0) + 1
        shared = None
        try:
            shared = await self._acquire(fragment)
            if shared is None:
                yield pack_response({"ok": False, "error": "no state to share yet"})
                return
            header = shared.header
            if want is not None and header["digest"] != want:
                yield pack_response({"ok": False, "error": "moved on",
                                     "holds": [header["version"], header["weight"], header["digest"]]})
                return
            payload = shared.payload
            # Resume only the replica the receiver's bytes came from; anything else starts over.
            start = offset if wanted == header["digest"] and offset <= len(payload) else 0
            yield pack_response({"ok": True, **header, "fragment": fragment, "offset": start})
            deadline = self._deadline(context)
            try:
                for n, at in enumerate(range(start, len(payload), self.part_bytes)):
                    deadline.arm()
                    yield self._send_part(n, payload[at : at + self.part_bytes])
            finally:
                deadline.disarm()
        finally:
            self._active[peer] -= 1
            if not self._active[peer]:
                del self._active[peer]
            if shared is not None:
                self._release(shared)

    def _deadline(self, context: P2PContext) -> _Deadline:
        peer = str(getattr(context, "remote_id", "?"))[-8:]

        def expired() -> None:
            self.stats.reject("stalled_transfer")  # a slow link, or a reader that stopped: no offence
            logger.warning("cut a state transfer to %s: a part not read within %g s", peer, PART_DEADLINE)

        return _Deadline(PART_DEADLINE, expired)

    async def _acquire(self, fragment: int) -> _Shared | None:
        """The bytes of fragment ``fragment``'s replica as held now, shared by every transfer of that very replica
        in flight (one copy, however many streams read it: 32 downloads of one fragment held 32 copies); None if
        there is none yet. Each ``_acquire`` is paired with a ``_release``."""
        loop = asyncio.get_running_loop()
        if self._identity is not None:
            held = self._shared.get((fragment, self._identity(fragment)[2]))
            if held is not None:
                held.users += 1
                return held
        # Copying Θ_p and its momentum is tensor work: keep it off the event loop.
        state = await loop.run_in_executor(None, self._snapshot, fragment)
        if state is None:
            return None
        key = (fragment, state.digest)
        held = self._shared.get(key)  # another transfer made it meanwhile
        if held is None:
            payload = await loop.run_in_executor(None, _payload, state)
            held = self._shared.get(key)
            if held is None:
                header = {"version": state.version, "weight": state.weight, "digest": state.digest,
                          "numel": state.params.numel(), "schedule_step": state.schedule_step,
                          "ancestors": list(state.ancestors)}
                held = self._shared[key] = _Shared(key, header, payload)
        held.users += 1
        return held

    def _release(self, shared: _Shared) -> None:
        shared.users -= 1
        if shared.users <= 0 and self._shared.get(shared.key) is shared:
            del self._shared[shared.key]

    def _send_part(self, n: int, part: bytes) -> runtime_pb2.ExpertResponse:
        """The message that carries ``part``, the ``n``-th part of this answer (counted from where the transfer
        starts), counted as sent. Every part of every answer goes through here."""
        self.stats.bytes_sent += len(part)
        return pack_response({"data": part})


@dataclass
class _Shared:
    """One replica's transfer bytes, and how many transfers in flight read them."""

    key: tuple[int, str]
    header: dict[str, Any]
    payload: bytes
    users: int = 0


def _payload(state: ReplicaState) -> bytes:
    """The bytes a transfer carries: Θ_p then its momentum, little-endian fp32."""
    flat = torch.cat([state.params.reshape(-1), state.momentum.reshape(-1)]).to("cpu", torch.float32)
    return flat.contiguous().numpy().tobytes()


def p2p_opener(p2p: P2P, namespace: str) -> Opener:
    """Opens ``rpc_download_state`` streams to donors over hivemind's p2p."""

    async def open_stream(donor: str, request: dict[str, Any]) -> AsyncIterator[Any]:
        stub = StateServicer.get_stub(p2p, PeerID.from_base58(donor), namespace=namespace)
        return await stub.rpc_download_state(pack_request(request))

    return open_stream

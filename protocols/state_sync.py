"""State sync: a daemon downloads one fragment of the global replica (Θ_p, momentum, version, weight).

The donor streams a header and then the tensors' bytes (Θ_p then its momentum, fp32) in parts; the receiver
applies a timeout to every part, checks sizes, finiteness and the content hash, and moves on to the next donor
when one fails. A transfer that breaks off is resumed: the request names the byte offset already received and the
digest those bytes belong to, and a donor holding the same replica streams from there on; a donor holding
another replica answers from byte 0 instead (its header says so), so bytes of two replicas are never spliced.
The hash of the whole payload is checked at the end either way.

Catching up by replay: a requester that names the replica it holds (``have``, a digest) may instead receive the
rounds that lead from it to the donor's replica, as their reduced shards were sent (compressed by the run's
codec) with each round's weight, RDA norm and resulting digest. Replaying them with the same outer step gives
the donor's replica bit for bit (``Replica.replay`` checks every digest), for a fraction of the bytes: the
momentum never travels. A donor offers a replay only when it holds every round of the chain and the chain is
at most half the size of the full transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import AsyncIterator  # hivemind detects streaming RPCs by typing.AsyncIterator hints
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from atoll.models.outer import tensor_hash

from .p2p_guard import RateLimitedLog
from .stats import TrafficStats
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
    replaced: int | None = None  # set on adoption: the version of the replica it replaced
    donors: tuple[str, ...] = ()  # downloaded: every donor that sent bytes of it, in order (``donor`` last)
    resumed_bytes: int = 0  # downloaded: bytes received before the last donor took over the transfer
    rounds: tuple[RoundDelta, ...] = ()  # obtained by replay: the rounds replayed, oldest first


@dataclass(frozen=True)
class RoundDelta:
    """One merged round of a fragment, as replayable: from the replica ``base`` at ``version``, the outer step
    of ``merged_delta`` of the decoded ``shards`` ((numel, codec bytes) each) and ``rda_norm`` gives the replica
    ``result`` at ``version + 1``, whose merged weight grew by ``weight``."""

    version: int
    base: str
    result: str
    weight: float
    rda_norm: float | None
    shards: tuple[tuple[int, bytes], ...]

    @property
    def nbytes(self) -> int:
        return sum(len(b) for _, b in self.shards)


@dataclass
class Replay:
    """A donor's answer to ``have``: the rounds from our replica to its own (version, weight, digest, ...)."""

    fragment: int
    version: int
    weight: float
    digest: str
    schedule_step: int
    ancestors: tuple[str, ...]
    rounds: tuple[RoundDelta, ...]
    donor: str = ""


_HEADER = {"version": int, "weight": float, "digest": str, "numel": int, "schedule_step": int, "fragment": int,
           "ancestors": list, "offset": int}
MAX_ANCESTORS = 32
MAX_REPLAY_ROUNDS = 32  # also the most rounds a replica keeps for replays
MAX_REPLAY_SHARDS = 1024  # shards per round (one per group member)
MAX_TRANSFERS_PER_PEER = 2  # full transfers one peer may have in flight from a donor; more are refused ("busy")
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
_ROUND = {"version": int, "base": str, "result": str, "weight": float, "norm": float, "numels": list, "sizes": list}


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


Opener = Callable[[str, dict[str, Any]], Awaitable[AsyncIterator[Any]]]


def p2p_opener(p2p: P2P, namespace: str) -> Opener:
    """Opens ``rpc_download_state`` streams to donors over hivemind's p2p."""

    async def open_stream(donor: str, request: dict[str, Any]) -> AsyncIterator[Any]:
        stub = StateServicer.get_stub(p2p, PeerID.from_base58(donor), namespace=namespace)
        return await stub.rpc_download_state(pack_request(request))

    return open_stream


Claim = tuple[int, float, str]  # a replica's identity as a progress record states it: version, weight, digest


class DonorRefused(WireError):
    """A donor answered that it will not serve us (no state yet, or we are not a member it knows, or it no longer
    holds the replica we chose it for: ``holds``, what it says it holds now): try another."""

    def __init__(self, message: str, holds: Claim | None = None) -> None:
        super().__init__(message)
        self.holds = holds


class NotTheClaim(WireError):
    """A donor sent a replica other than the one its progress record claimed, the one we chose it for: an offence
    (an honest donor that moved on refuses instead)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "not_the_claim")


class _Transfer:
    """The bytes of one fragment received so far, and the header of the replica they belong to."""

    def __init__(self, numel: int) -> None:
        self.numel, self.data, self.header = numel, bytearray(), None
        self.donors: list[str] = []
        self.resumed_bytes = 0


def _parse_replay(header: dict[str, Any], numel: int, have: str) -> list[dict[str, Any]]:
    """Check a replay header against the fragment's size and the replica we hold; its rounds, oldest first."""
    rounds = header["replay"]
    if not isinstance(rounds, list) or not 0 < len(rounds) <= MAX_REPLAY_ROUNDS:
        raise WireError("malformed replay: bad number of rounds", "replay")
    total, digest = 0, have
    for i, r in enumerate(rounds):
        if not isinstance(r, dict):
            raise WireError("malformed replay round", "replay")
        check_fields(r, _ROUND)
        numels, sizes = r["numels"], r["sizes"]
        if (not 0 < len(numels) <= MAX_REPLAY_SHARDS or len(sizes) != len(numels)
                or not all(type(n) is int and n > 0 for n in numels) or sum(numels) != numel
                or not all(type(b) is int and 0 < b <= 8 * n + 64 for b, n in zip(sizes, numels))):
            raise WireError("replay round's shards do not fit the fragment", "replay")
        if r["base"] != digest or r["version"] != header["version"] - len(rounds) + i:
            raise WireError("replay rounds do not form a chain from our replica", "replay")
        if not (0 < r["weight"] < 1e15 and (r["norm"] == -1.0 or 0 <= r["norm"] < 1e30)):
            raise WireError("replay round's weight or norm out of range", "replay")
        digest = r["result"]
        total += sum(sizes)
    if digest != header["digest"] or total > 8 * numel:
        raise WireError("replay does not end at the announced replica, or is larger than the replica", "replay")
    return rounds


async def _read_replay(stream: AsyncIterator[Any], header: dict[str, Any], rounds: list[dict[str, Any]],
                       donor: str, part_timeout: float, stats: TrafficStats) -> Replay:
    total = sum(sum(r["sizes"]) for r in rounds)
    data = bytearray()
    while len(data) < total:
        chunk = unpack(await asyncio.wait_for(anext(stream), part_timeout), {"data": bytes})["data"]
        if not chunk or len(data) + len(chunk) > total:
            raise WireError(f"a replay part of {len(chunk)} bytes does not fit", "replay")
        stats.bytes_received += len(chunk)
        data.extend(chunk)
    out, at = [], 0
    for r in rounds:
        shards = []
        for n, size in zip(r["numels"], r["sizes"]):
            shards.append((n, bytes(data[at : at + size])))
            at += size
        out.append(RoundDelta(r["version"], r["base"], r["result"], float(r["weight"]),
                              None if r["norm"] == -1.0 else float(r["norm"]), tuple(shards)))
    return Replay(header["fragment"], header["version"], float(header["weight"]), header["digest"],
                  header["schedule_step"], tuple(header["ancestors"]), tuple(out), donor)


async def _continue_from(open_stream: Opener, donor: str, fragment: int, t: _Transfer, part_timeout: float,
                         stats: TrafficStats, have: str | None = None,
                         progress: Callable[[int], None] = lambda received: None,
                         want: Claim | None = None) -> ReplicaState | Replay:
    request: dict[str, Any] = {"fragment": fragment}
    if want is not None:
        request.update(want=want[2])
    if t.data:
        request.update(offset=len(t.data), digest=t.header["digest"])
    elif have:
        request.update(have=have)
    stream = await asyncio.wait_for(open_stream(donor, request), part_timeout)
    header: dict[str, Any] = unpack(await asyncio.wait_for(anext(stream), part_timeout), {"ok": bool})
    if not header["ok"]:
        raise DonorRefused(f"donor refused: {header.get('error')}", _claim(header.get("holds")))
    check_fields(header, _HEADER)
    if want is not None and (header["version"], float(header["weight"]), header["digest"]) != want:
        raise NotTheClaim(f"the donor sent v{header['version']} ({header['digest']}), not the replica its record "
                          f"claims, v{want[0]} ({want[2]})")
    if header["numel"] != t.numel or header["fragment"] != fragment:
        raise WireError(f"donor's fragment {header['fragment']} has {header['numel']} values, ours {t.numel}")
    ancestors = header["ancestors"]
    if len(ancestors) > MAX_ANCESTORS or not all(isinstance(a, str) and 0 < len(a) <= 64 for a in ancestors):
        raise WireError(f"malformed ancestors list ({len(ancestors)} entries)")
    if "replay" in header:
        if not have or t.data:
            raise WireError("a replay we did not ask for", "replay")
        if ancestors and ancestors[-1] != header["digest"]:
            raise WireError("the ancestors list does not end with the replica's own digest")
        return await _read_replay(stream, header, _parse_replay(header, t.numel, have), donor, part_timeout, stats)
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
        progress(len(t.data))
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


def _claim(value: Any) -> Claim | None:
    """A refusal's ``holds`` as a claim, or None if it is not one."""
    if (isinstance(value, list) and len(value) == 3 and isinstance(value[0], int) and not isinstance(value[0], bool)
            and isinstance(value[1], (int, float)) and not isinstance(value[1], bool) and math.isfinite(value[1])
            and isinstance(value[2], str) and len(value[2]) <= 64):
        return value[0], float(value[1]), value[2]
    return None


async def download_state(
    open_stream: Opener, donors: Sequence[str], fragment: int, numel: int, part_timeout: float,
    stats: TrafficStats, have: str | None = None,
    on_failure: Callable[[str, BaseException], None] = lambda donor, error: None,
    progress: Callable[[int], None] = lambda received: None,
    claims: Mapping[str, Claim] | None = None,
    slots: Callable[[str], asyncio.Semaphore] | None = None,
) -> ReplicaState | Replay | None:
    """Try ``donors`` in order (best first) until one fragment replica verifies; None if all failed. A donor that
    fails mid-transfer hands over to the next one, which resumes where it stopped if it holds the same replica.
    With ``have`` (the digest of the replica we hold), a donor may answer with a ``Replay`` instead (checked for
    form here; the caller replays it and checks the digests). ``on_failure(donor, error)`` hears of every donor
    that did not deliver, a refusal included. ``progress(received)`` hears how many of the replica's ``8 * numel``
    bytes have arrived, after each part (a resumed download goes on from where it stopped). ``claims``: the replica
    each donor was chosen for (its progress record's claim); a donor then sends exactly that replica, or refuses
    (``DonorRefused.holds``: it moved on), and one that sends another is refused (``NotTheClaim``, an offence).
    Without a claim for a donor, what it sends is checked against its own header only. ``slots(donor)``: a
    semaphore of ``MAX_TRANSFERS_PER_PEER`` per donor, shared by the caller's concurrent downloads, so that it
    never asks one donor for more at once than the donor serves (``StateServicer``)."""
    t = _Transfer(numel)
    for donor in donors:
        try:
            async with slots(donor) if slots is not None else contextlib.nullcontext():
                state = await _continue_from(open_stream, donor, fragment, t, part_timeout, stats, have, progress,
                                             None if claims is None else claims.get(donor))
            if isinstance(state, Replay):
                logger.info("fragment %d: %s sent the %d rounds to v%d (%d bytes) to replay", fragment, donor[-8:],
                            len(state.rounds), state.version, sum(r.nbytes for r in state.rounds))
                return state
            logger.info("downloaded fragment %d v%d from %s", fragment, state.version,
                        "+".join(d[-8:] for d in state.donors))
            return state
        except Exception as e:  # a donor can fail in many ways (dead, slow, lying); all mean: try the next
            if isinstance(e, WireError) and not isinstance(e, DonorRefused):  # a refusal is no offence
                stats.reject("not_the_claim" if isinstance(e, NotTheClaim) else "state", donor)
            on_failure(donor, e)
            logger.warning("state download of fragment %d from %s failed after %d bytes: %r; trying the next donor",
                           fragment, donor[-8:], len(t.data), e)
    return None

"""State sync: a daemon downloads one fragment of the global replica (Θ_p, momentum, version, weight). This module
is the receiver and the wire's shapes; the donor's service is ``state_serve.py``.

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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import AsyncIterator  # hivemind detects streaming RPCs by typing.AsyncIterator hints
from dataclasses import dataclass
from typing import Any

import torch

from atoll.models.outer import tensor_hash

from .stats import TrafficStats
from .wire import WireError, check_fields, parts_to_tensor, unpack

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
_ROUND = {"version": int, "base": str, "result": str, "weight": float, "norm": float, "numels": list, "sizes": list}


Opener = Callable[[str, dict[str, Any]], Awaitable[AsyncIterator[Any]]]  # a stream to a donor (state_serve.p2p_opener)


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

"""The averaging round, as a member runs it: a weighted reduce-scatter/all-gather over streamed RPCs on hivemind's P2P.

Members of a group (sorted peer ids) split the flat vector into one contiguous shard per reducer. The reducers are
every member, or the members ``GroupSpec.reducers`` names (the others are behind NAT: nobody can open a stream
to them, but they can open one to a reducer); reducer j reduces shard j: every member streams its part of shard
j (and its weight) to reducer j inside one ``rpc_aggregate`` call and reads the reduced shard back on the same
stream. The reducer sums contributions in
peer-id order and sends everyone, itself included, the same fp32 bytes, so all members end the round with a
bit-identical merged delta.

Two merge modes: ``mean`` (token-weighted mean) and ``rda`` (radial-directional averaging: reducers average the
unit directions Δ/‖Δ‖ using each member's whole-fragment norm, sent alongside its part; every member then
rescales the gathered direction to the weighted mean norm, from the same bytes, so results stay identical).

Parts travel compressed with the run's codec (``protocols/codecs.py``, named in every message); shard boundaries
are aligned to the codec's block so that per-shard encoding equals encoding the whole fragment. Reduced shards
are compressed too, and the reducer applies the decoded values it sends, so replicas stay bit-identical. A part
that does not decode (unknown codec, wrong size, NaN/Inf) is rejected with a log line and its sender is treated
as missing; a reduced shard that does not decode counts as a failed reducer.

Hostile members are the reducer's to refuse and clip (``protocols/reducer.py``, which also holds ``GroupSpec`` and
the ``rpc_aggregate`` service); this module is the member's side of a round.

Hostile reducers: a reducer's answer names every contributor's declared (weight, norm) and the norm of the values
it merged. Each member checks its own entry, recomputes the reducer's clips from those scalars, and refuses a
shard whose norm (at least ``codecs.norm_floor`` of the bytes, whatever the codec dropped) exceeds what the
contributions allow (``check_shard``, ``models/robust.merge_bound``): an offence. The members cannot check a
shard's direction without the other parts: a reducer can still send a wrong shard within that bound.

A member that never sends its part costs its reducer at most ``timeout``; the shard is reduced without it. A
reducer that has not answered once at least as many others have gets a grace (``answer_grace``: ``ANSWER_GRACE`` s
and its shard's bytes at ``ANSWER_MIN_RATE``, or ``ANSWER_GRACE_FACTOR`` × the time the others took); then it is
left out, and ``LATE_OFFENCES`` rounds in a row make it an offender. A reducer that fails is reported in
``AllreduceResult.failed`` so the caller can retry the round without it.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any, AsyncIterator  # hivemind detects streaming RPCs by typing.AsyncIterator hints
from dataclasses import dataclass, field

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from atoll.models.outer import merged_delta
from atoll.models.robust import clip_members, merge_bound

from . import codecs
from .records import MAX_NORM, MAX_ROUND_WEIGHT
from .reducer import AveragingServicer, GroupSpec, ShardResult
from .wire import PART_BYTES, WireError, check_fields, pack_request, unpack

logger = logging.getLogger("atoll")

EXCHANGE_ATTEMPTS = 3  # a broken stream to a reducer is asked again this many times in all
# Once at least as many reducers answered as are still out, those get ANSWER_GRACE s plus their shard's transfer at
# ANSWER_MIN_RATE (or ANSWER_GRACE_FACTOR × the time the others took, if longer): they hold the same parts the
# others did, so their answer is only a reduce and a transfer away. A reducer that misses it is left out of the
# round, and LATE_OFFENCES times in a row an offender. Every second of grace is a second a silent reducer holds its
# fragment's round (docs/security.md); the rate term keeps a large shard behind a slow uplink in its round when the
# others answered fast.
ANSWER_GRACE = 2.0
ANSWER_MIN_RATE = 32 * 1024  # bytes a second: a 256 kbit/s uplink
ANSWER_GRACE_FACTOR = 2.0

def check_answer(header: dict[str, Any], spec: GroupSpec) -> tuple[str, str] | None:
    """Whether a reducer's scalars are possible: a finite weight no larger than every member's largest weight
    together, a finite norm, and contributors that are distinct members of the group. (message, kind) if not.
    A hostile reducer's infinite weight became the replica's weight and made its progress record fail the schema
    everywhere; these are the bounds a member can check without the other members' parts."""
    weight, norm, contributors = header["weight"], header["norm"], header["contributors"]
    if not (math.isfinite(weight) and 0 < weight <= MAX_ROUND_WEIGHT * len(spec.members)):
        return f"reducer claimed weight {weight}", "reducer_weight"
    if not (math.isfinite(norm) and 0 <= norm < MAX_NORM):
        return f"reducer claimed norm {norm}", "reducer_norm"
    if (not contributors or len(set(contributors)) != len(contributors)
            or not all(isinstance(c, str) and c in spec.members for c in contributors)):
        return "reducer named contributors that are not distinct members of the group", "reducer_contributors"
    return None


def check_shard(header: dict[str, Any], spec: GroupSpec, reducer: str, me: str,
                own: list[tuple[float, float, float]], floor: float, clip_factor: float) -> tuple[str, str] | None:
    """Whether a reducer's shard is one its contributions allow; (message, kind) if not. ``header["parts"]`` are
    the contributors' declared (weight, norm) and the norm of the values it merged, as the reducer says: our own
    entry must be one of the parts we sent it for this group (``own``, ``AveragingServicer.sent``), and the norm of what it sent (at least ``floor``, ``codecs.norm_floor``) must be
    within ``merge_bound`` of the contributions after the reducer's clips (``clip_members``), recomputed here
    from those scalars. The reducer's own contribution is one nobody can check, and ``merge_bound`` leaves it out
    where the rule allows (the trimmed mean). A reducer can still misstate another member's part to loosen the
    bound; that member then refuses its answer (and holds it against it)."""
    parts, contributors = header["parts"], header["contributors"]
    if not (isinstance(parts, list) and len(parts) == len(contributors)
            and all(isinstance(x, list) and len(x) == 3 and all(type(v) is float and math.isfinite(v) and v >= 0
                                                                for v in x) and x[0] > 0 for x in parts)):
        return "reducer sent malformed part scalars", "reducer_parts"
    if me in contributors:
        weight, norm, size = parts[contributors.index(me)]
        if not any(weight == w and norm == n and math.isclose(size, z, rel_tol=1e-6, abs_tol=1e-30) for w, n, z in own):
            return f"reducer misstated our part ({weight}, {norm}, {size}; ours {own})", "reducer_parts"
    weights, norms, sizes = zip(*parts)
    clip = clip_members(weights, norms, sizes, clip_factor, spec.mode == "rda", spec.max_weight)
    exclude = contributors.index(reducer) if reducer in contributors else None
    bound = merge_bound(spec.merge, clip.weights, clip.sizes, exclude)
    if floor > bound * (1 + 1e-5):
        return f"reduced shard's norm is at least {floor:.4g}, its contributions allow {bound:.4g}", "reducer_shard"
    return None


def combine_scalars(shards: list[ShardResult], rda: bool) -> tuple[float, float | None]:
    """The round's weight and (rda) the norm the merged direction is rescaled to, from the shards' answers: the
    median over shards (the lower one of an even count), so that no single reducer sets a fragment-wide scalar.
    Every member gathers the same answers in the same order, so every member picks the same values."""
    weights = sorted(s.weight for s in shards)
    weight = weights[(len(weights) - 1) // 2]
    if not rda:
        return weight, None
    norms = sorted(s.norm for s in shards)
    return weight, norms[(len(norms) - 1) // 2]


async def _exchange_with(
    p2p: P2P, servicer: AveragingServicer, spec: GroupSpec, reducer: str, payload: bytes, numel: int, weight: float,
    norm: float, own_size: float, timeout: float,
) -> ShardResult:
    stub = AveragingServicer.get_stub(p2p, PeerID.from_base58(reducer), namespace=spec.run_id)
    stats = servicer.stats
    sent = servicer.sent(spec.group_id, reducer, (weight, norm, own_size), timeout)

    async def requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
        yield pack_request({"group_id": spec.group_id, "weight": weight, "numel": numel, "wait": timeout,
                            "norm": norm, "codec": spec.codec, "fragment": spec.fragment, "version": spec.version})
        for start in range(0, len(payload), PART_BYTES):
            chunk = payload[start : start + PART_BYTES]
            stats.bytes_sent += len(chunk)
            yield pack_request({"data": chunk})

    async def call() -> ShardResult:
        stream = await stub.rpc_aggregate(requests())
        header = unpack(await anext(stream), {"ok": bool})
        if not header["ok"]:
            raise GroupRefused(f"reducer refused: {header.get('error')}", past=header.get("past") is True)
        check_fields(header, {"weight": float, "contributors": list, "numel": int, "norm": float, "parts": list})
        if header["numel"] != numel:
            raise WireError("reducer answered with a shard of the wrong size")
        problem = check_answer(header, spec)
        if problem is not None:
            stats.reject(problem[1], reducer)  # a reducer that lies about its scalars is an offender
            raise WireError(problem[0], problem[1])
        limit = codecs.encoded_size(numel, spec.codec, spec.block)
        chunks, size = [], 0
        async for msg in stream:
            chunk = unpack(msg, {"data": bytes})["data"]
            size += len(chunk)
            stats.bytes_received += len(chunk)
            if size > limit:
                raise WireError(f"reduced shard longer than {limit} bytes", "oversize")
            if not chunk:  # endless empty messages would keep us reading until the round's timeout
                raise WireError("empty data message from the reducer")
            chunks.append(chunk)
        if size < limit:  # every codec's size is fixed by numel: a short answer is a stream that broke
            raise BrokenStream(f"the reduced shard ended after {size} of {limit} bytes")
        answer = b"".join(chunks)
        try:
            values, floor = await asyncio.get_running_loop().run_in_executor(None, _decode_answer, answer, numel)
        except codecs.CodecError as e:
            stats.reject("codec")
            raise WireError(f"undecodable reduced shard: {e}") from None
        problem = check_shard(header, spec, reducer, servicer.local_peer, sent, floor, servicer.clip_factor)
        if problem is not None:
            stats.reject(problem[1], reducer)
            raise WireError(problem[0], problem[1])
        return ShardResult(values, float(header["weight"]), list(header["contributors"]), float(header["norm"]),
                           answer)

    # The reducer may wait up to `timeout` for slow members before it answers; allow for the transfer on top.
    return await asyncio.wait_for(call(), timeout=2 * timeout + 10)


def _decode_answer(answer: bytes, numel: int) -> tuple[torch.Tensor, float]:
    values = codecs.decode(answer, expected_numel=numel)
    return values, codecs.norm_floor(answer, values)


async def _exchange_retrying(
    p2p: P2P, servicer: AveragingServicer, spec: GroupSpec, reducer: str, *args: Any
) -> ShardResult:
    """``_exchange_with``, asked again when the stream broke (the reducer ignores a part it already holds and
    answers with its result): a dropped connection must not make members disagree about a round's outcome."""
    for attempt in range(EXCHANGE_ATTEMPTS):
        try:
            return await _exchange_with(p2p, servicer, spec, reducer, *args)
        except (WireError, asyncio.TimeoutError):  # a refusal or a bad answer: asking again would not help
            raise
        except Exception as e:
            if attempt + 1 == EXCHANGE_ATTEMPTS:
                raise
            logger.info("round v%d: stream to reducer %s broke (%r); asking again", spec.version, reducer[-8:], e)
            await asyncio.sleep(0.1 * (attempt + 1))
    raise AssertionError("unreachable")


class BrokenStream(ConnectionError):
    """A reducer's answer ended early: the transport broke, not the protocol (asked again)."""


class GroupRefused(WireError):
    """A live reducer does not know our group: the members disagree about who is in the round. ``past``: the reducer
    had moved past the group's round (merged that version by another group), so it will never open ours."""

    def __init__(self, message: str, past: bool = False) -> None:
        super().__init__(message)
        self.past = past


@dataclass
class AllreduceResult:
    """``failed``: reducers that could not be reached (dead, slow, or garbled); ``refused``: live ones that
    disagreed. ``sent``: our contribution as the others decoded it (for error feedback). ``shards`` (compressed
    runs, and groups with a remote member): each reduced shard as (numel, encoded bytes), in member order, and ``rda_norm``: with
    ``merged_delta`` they give ``merged`` exactly, so a peer that missed the round can replay it from them."""

    merged: torch.Tensor | None
    weight: float
    contributors: list[str]
    failed: list[str]
    refused: list[str] = field(default_factory=list)
    sent: torch.Tensor | None = None
    shards: list[tuple[int, bytes]] | None = None
    rda_norm: float | None = None
    moved_past: list[str] = field(default_factory=list)  # of ``refused``: those past the round (``GroupRefused``)


class Tamper:
    """How this member's contribution leaves it. The base class is the honest member and changes nothing; fault
    injection (``atoll.node.faults``) subclasses it to play a buggy or hostile one, so the protocol never looks at
    which fault is injected.

    ``delta`` is the delta this member claims as its own (its norm and parts are taken from it); ``weight`` the
    token weight it declares; ``part`` is the
    encoded bytes sent to the reducer of ``flat[lo:hi]``, given what an honest member would send; ``own`` is this
    member's contribution as error feedback must see it (what quantization dropped of the honest delta)."""

    def delta(self, flat: torch.Tensor) -> torch.Tensor:
        return flat

    def weight(self, weight: float) -> float:
        return weight

    def part(self, payload: bytes, flat: torch.Tensor, lo: int, hi: int, spec: GroupSpec) -> bytes:
        return payload

    def own(self, sent: torch.Tensor) -> torch.Tensor:
        return sent


HONEST = Tamper()


def _size(values: torch.Tensor, norm: float, rda: bool) -> float:
    """The norm of our part as its reducer merges it (``_Reduction._compute``: RDA divides by our norm)."""
    if rda:
        values = values.double() / norm if norm > 0 else torch.zeros(values.numel(), dtype=torch.float64)
    return float(torch.linalg.vector_norm(values.double()))


def _error(task: asyncio.Future) -> BaseException | None:
    """A finished task's exception; a cancelled one counts as failed (``exception()`` would raise)."""
    return asyncio.CancelledError() if task.cancelled() else task.exception()


def _consume(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: asyncio would log it, traceback and all, when the task is collected


def answer_grace(shard_bytes: int) -> float:
    """Seconds a reducer still out gets once at least as many have answered (before ``ANSWER_GRACE_FACTOR`` × the
    others' time is considered): the floor, and its answer of ``shard_bytes`` at ``ANSWER_MIN_RATE``."""
    return ANSWER_GRACE + shard_bytes / ANSWER_MIN_RATE


async def _await_answers(tasks: dict[str, asyncio.Future], local_peer: str,
                         grace: float) -> tuple[list[str], list[str]]:
    """Wait for the reducers' answers (each has the round's own bound) until this attempt's outcome is known:
    (late, abandoned). Once a reducer failed or refused, the attempt cannot merge: those still out are abandoned
    (cancelled; our own shard's reduction goes on for the others). Once at least as many answered as are still
    out, and our own shard is not among those, the rest get ``grace`` s or ``ANSWER_GRACE_FACTOR`` × the time so
    far, whichever is longer, and are late past it (cancelled)."""
    loop = asyncio.get_running_loop()
    started, deadline = loop.time(), None
    pending = set(tasks.values())
    abandoned = False
    while pending:
        wait = None if deadline is None else max(0.0, deadline - loop.time())
        done, pending = await asyncio.wait(pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            break
        if any(_error(t) is not None for t in done):
            abandoned = True
            break
        answered = sum(1 for t in tasks.values() if t.done())
        if deadline is None and pending and answered >= len(pending) and tasks.get(local_peer) not in pending:
            deadline = loop.time() + max(grace, ANSWER_GRACE_FACTOR * (loop.time() - started))
    out = [peer for peer, task in tasks.items() if task in pending]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return ([], out) if abandoned else (out, [])


def _encode_parts(flat: torch.Tensor, bounds: list[tuple[int, int]], codec: str, block: int,
                  solo: bool) -> tuple[list[bytes], list[torch.Tensor]]:
    """Encode each shard of our contribution, and decode it back: the values the reducers will use."""
    if solo and codec == "none":  # nothing travels: keep the exact float64 values
        return [b"" for _ in bounds], [flat[lo:hi] for lo, hi in bounds]
    payloads = [codecs.encode(flat[lo:hi].float(), codec, block) for lo, hi in bounds]
    return payloads, [codecs.decode(pl, expected_numel=hi - lo) for pl, (lo, hi) in zip(payloads, bounds)]


async def allreduce(
    p2p: P2P, servicer: AveragingServicer, spec: GroupSpec, local_peer: str, flat: torch.Tensor, weight: float,
    timeout: float, tamper: Tamper = HONEST,
) -> AllreduceResult:
    """Weighted merge of ``flat`` across ``spec.members``; see the module docstring for the protocol. ``tamper``
    decides what of our contribution leaves us (honest unless a fault is injected). A member that is not among
    the reducers only opens streams (to every reducer) and reduces nothing."""
    bounds = spec.bounds()
    reducers = spec.reducer_list
    flat, weight = tamper.delta(flat), tamper.weight(weight)
    norm = float(torch.linalg.vector_norm(flat.double()))
    me = reducers.index(local_peer) if local_peer in reducers else None
    solo = len(spec.members) == 1
    payloads, sent = await asyncio.get_running_loop().run_in_executor(
        None, _encode_parts, flat, bounds, spec.codec, spec.block, solo)
    tasks: dict[str, asyncio.Future] = {}
    # Tensor work, off the event loop: the norm of each part as its reducer will merge it (for ``check_shard``).
    sizes = [] if solo else await asyncio.get_running_loop().run_in_executor(
        None, lambda: [_size(v, norm, spec.mode == "rda") for v in sent])
    if me is not None:
        # Open our shard only now, with our own part in it at once: its timeout must not run while we encode
        # (a daemon frozen mid-encode would otherwise wake up to a reduction that timed out without its own part).
        reduction = servicer.open(spec, timeout)
        reduction.add(local_peer, weight, sent[me], norm)
    for j, peer in enumerate(reducers):
        if j != me:
            payload = tamper.part(payloads[j], flat, *bounds[j], spec)
            tasks[peer] = asyncio.ensure_future(
                _exchange_retrying(p2p, servicer, spec, peer, payload, bounds[j][1] - bounds[j][0], weight, norm,
                                   sizes[j], timeout)
            )
    if me is not None:
        tasks[local_peer] = asyncio.ensure_future(asyncio.shield(reduction.result))
    try:
        # Our parts are encoded as the reduced shards are: the largest is what the slowest answer carries.
        grace = answer_grace(max((len(pl) for pl in payloads), default=0))
        late, abandoned = await _await_answers(tasks, local_peer, grace)
    except asyncio.CancelledError:  # the round was cancelled: so are its exchanges, whose outcome nobody reads
        for task in tasks.values():
            task.cancel()
            task.add_done_callback(_consume)
        raise
    failed, refused, past, shards = list(late), [], [], {}
    for peer in late:
        logger.warning("round f%d v%d: reducer %s did not answer while the others had: leaving it out",
                       spec.fragment, spec.version, peer[-8:])
        servicer.stats.reject("late_reducer")
        if servicer.late.miss(peer):
            servicer.stats.reject("late_reducer_offence", peer)
    for peer, task in tasks.items():
        if peer in late or peer in abandoned:
            continue
        error = _error(task)
        if peer != local_peer and error is None:
            servicer.late.hit(peer)
        if error is not None:
            (refused if isinstance(error, GroupRefused) else failed).append(peer)
            if isinstance(error, GroupRefused) and error.past:
                past.append(peer)
            logger.warning("round v%d: shard from reducer %s failed: %r", spec.version, peer[-8:], error)
        else:
            shards[peer] = task.result()
    if failed or refused:
        return AllreduceResult(None, 0.0, [], failed, refused, moved_past=past)
    ordered = [shards[p] for p in reducers]
    weight, rda_norm = combine_scalars(ordered, spec.mode == "rda")
    merged = merged_delta([s.values for s in ordered], rda_norm)
    contributors = sorted({c for s in ordered for c in s.contributors})
    encoded = None if any(s.payload is None for s in ordered) else [(s.values.numel(), s.payload) for s in ordered]
    ours = tamper.own(torch.cat(sent))
    return AllreduceResult(merged, weight, contributors, [], [], ours, encoded, rda_norm)

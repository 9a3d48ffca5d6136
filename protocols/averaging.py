"""The averaging round: a weighted reduce-scatter/all-gather over streamed RPCs on hivemind's P2P.

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

Hostile members: every header field, size and value is checked before use (sizes against the shard and the
codec's exact encoded size, before anything is buffered); a rejected part is a missing member and its sender
an offender (``protocols/cooldown.py``): its parts are treated as missing in the shards this daemon reduces
while it cools down. Valid but outsized parts are clipped before the merge (``models/robust.py``: a
contribution, declared weight or RDA norm above ``clip_factor`` × the lower median of the shard's is scaled to
that median); clipping is per shard, because a reducer sees only its shard. The run's ``robust_merge``
(``GroupSpec.merge``) then picks how the shard's contributions merge: the weighted mean, or a coordinate-wise
trimmed mean or centered clipping, which also bound a member at a typical norm pointing anywhere.

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
import functools
import hashlib
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, AsyncIterator  # hivemind detects streaming RPCs by typing.AsyncIterator hints
from dataclasses import dataclass, field

import torch
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from atoll.models.outer import merged_delta, weighted_norm
from atoll.models.robust import MergeRule, clip_members, lower_median, merge_bound, robust_merge

from . import codecs
from .cooldown import Cooldown, Strikes
from .p2p_guard import RateLimitedLog
from .records import MAX_NORM, MAX_ROUND_WEIGHT
from .stats import TrafficStats
from .wire import PART_BYTES, WireError, check_fields, pack_request, pack_response, unpack

logger = logging.getLogger("atoll")

MAX_PENDING_GROUPS = 64
MAX_PENDING_PER_PEER = 8  # early requests one peer may keep waiting (one per concurrent round; fragments)
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
LATE_OFFENCES = 3


def shard_bounds(numel: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """Contiguous ranges covering ``range(numel)``, one per part, starting at multiples of ``align``; the numbers
    of ``align``-blocks per part differ by at most one."""
    if parts <= 0 or align <= 0:
        raise ValueError("need at least one part and a positive alignment")
    blocks = -(-numel // align)
    base, extra = divmod(blocks, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((min(start * align, numel), min(end * align, numel)))
        start = end
    return bounds


@dataclass(frozen=True)
class GroupSpec:
    """A group as one member sees it; members that see the same group compute the same ``group_id``."""

    run_id: str
    fragment: int
    version: int
    attempt: int
    members: tuple[str, ...]
    numel: int
    mode: str = "mean"  # "mean" or "rda"
    codec: str = "none"
    block: int = 256
    base: str = ""  # the digest of the replica the round starts from: forks at one version are different groups
    merge: MergeRule = MergeRule.CLIP  # how reducers merge (the run's robust_merge)
    reducers: tuple[str, ...] = ()  # the members that reduce a shard, in member order; () means every member
    # Sum the parts in member order, not sorted by peer id: sibling groups (matchmaking.sibling_group) list one
    # member of each round group in the groups' order, and each must compute the same bits from the same parts.
    ordered: bool = False

    @property
    def reducer_list(self) -> tuple[str, ...]:
        return self.reducers or self.members

    @property
    def group_id(self) -> str:
        text = (f"{self.run_id}|{self.fragment}|{self.version}|{self.base}|{self.attempt}|{','.join(self.members)}"
                f"|{self.numel}|{self.mode}|{self.codec}|{self.block}")
        if MergeRule(self.merge) is not MergeRule.CLIP:  # the default leaves group ids as they were before rules
            text += f"|{MergeRule(self.merge).value}"
        if self.reducers and self.reducers != self.members:  # every member reducing keeps the ids they had
            text += f"|r={','.join(self.reducers)}"
        if self.ordered:
            text += "|ordered"
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def bounds(self) -> list[tuple[int, int]]:
        """One range per reducer (``reducer_list``), in its order."""
        return shard_bounds(self.numel, len(self.reducer_list), self.block)


@dataclass
class ShardResult:
    values: torch.Tensor
    weight: float
    contributors: list[str]
    norm: float = 0.0  # rda: Σ w·‖Δ‖ / Σ w over the contributors
    payload: bytes | None = None  # the encoded values, as sent to the other members
    clipped: list[str] = field(default_factory=list)  # members whose contribution robust merging scaled down
    # Per contributor (in ``contributors``' order): its declared weight and norm and the norm of the values merged,
    # before any clip: what a member needs to bound the answer (``check_shard``).
    parts: list[list[float]] = field(default_factory=list)


class _Reduction:
    """One shard this daemon reduces for one group."""

    def __init__(self, spec: GroupSpec, bounds: tuple[int, int], timeout: float, clip_factor: float = 0.0) -> None:
        self.spec, self.bounds, self.timeout, self.clip_factor = spec, bounds, timeout, clip_factor
        self.parts: dict[str, tuple[float, torch.Tensor, float]] = {}
        self.missing: set[str] = set()
        self.stats: TrafficStats | None = None
        self._finishing = False
        self.result: asyncio.Future[ShardResult] = asyncio.get_running_loop().create_future()
        self._timer = asyncio.get_running_loop().call_later(timeout, self._finish)

    @property
    def numel(self) -> int:
        return self.bounds[1] - self.bounds[0]

    def add(self, peer: str, weight: float, values: torch.Tensor, norm: float = 0.0) -> None:
        if self._finishing or peer in self.parts or peer in self.missing:
            return
        self.parts[peer] = (weight, values, norm)
        self._maybe_finish()

    def exclude(self, peer: str) -> None:
        """The peer's part was rejected: reduce without it, and without waiting for it."""
        if peer not in self.parts:
            self.missing.add(peer)
            self._maybe_finish()

    def _maybe_finish(self) -> None:
        if len(self.parts) + len(self.missing) == len(self.spec.members):
            self._finish()

    def _finish(self) -> None:
        if self._finishing:
            return
        self._finishing = True
        self._timer.cancel()
        self._task = asyncio.ensure_future(self._reduce())  # referenced: asyncio keeps only weak ones

    async def _reduce(self) -> None:
        # Tensor work (merge, encode) runs in an executor: the event loop keeps serving other RPCs meanwhile.
        try:
            result = await asyncio.get_running_loop().run_in_executor(None, self._compute)
        except Exception as e:  # surfaces in every member's wait for this shard
            if not self.result.done():
                self.result.set_exception(e)
            return
        finally:
            self.parts.clear()  # the result is all that late askers need; parts would pile up at one round per step
        if result.clipped:
            if self.stats is not None:
                self.stats.clipped += len(result.clipped)
            logger.info("round f%d v%d: clipped the contributions of %s (above %g x the round's median) to it",
                        self.spec.fragment, self.spec.version, [c[-8:] for c in result.clipped], self.clip_factor)
        if not self.result.done():
            self.result.set_result(result)

    def _compute(self) -> ShardResult:
        # A fixed summation order: the result does not depend on arrival order.
        peers = [m for m in self.spec.members if m in self.parts] if self.spec.ordered else sorted(self.parts)
        weights = [self.parts[p][0] for p in peers]
        norms = [self.parts[p][2] for p in peers]
        if self.spec.mode == "rda":
            values = [self.parts[p][1].double() / n if n > 0 else torch.zeros(self.numel, dtype=torch.float64)
                      for p, n in zip(peers, norms)]
        else:
            values = [self.parts[p][1] for p in peers]
        sizes = [float(torch.linalg.vector_norm(v.double())) for v in values]
        if len(peers) > 1 and logger.isEnabledFor(logging.DEBUG):  # how far apart honest contributions are
            median = lower_median(sizes)
            logger.debug("round f%d v%d shard %s: contribution norms / lower median %s", self.spec.fragment,
                         self.spec.version, self.bounds, [round(n / median, 3) if median else None for n in sizes])
        # Robust merging (models/robust.py): outliers among what gets averaged, the weights, RDA's norms and weight ×
        # size (above clip_factor × the round's lower median) are scaled down: no single member dominates the merge.
        # Decided from scalars alone (clip_members), which every member is sent to check the answer against.
        clip = clip_members(weights, norms, sizes, self.clip_factor, self.spec.mode == "rda")
        values = [v.double() * scale if scale != 1.0 else v.double() for v, scale in zip(values, clip.scales)]
        parts = [[float(w), float(n), s] for w, n, s in zip(weights, norms, sizes)]
        weights, norms = clip.weights, clip.norms
        # The merge itself (the run's robust_merge): the weighted mean, or a direction-robust rule that also bounds
        # a member at a typical norm pointing anywhere (coordinate-wise trimmed mean, centered clipping).
        merged = robust_merge(values, weights, self.spec.merge)  # one member: every rule returns its values
        payload = None
        if len(self.spec.members) > 1 or self.spec.codec != "none":
            # Others receive the encoded shard; the reducer applies exactly the values they will decode. A round of
            # one is encoded too (unless uncompressed), so that peers that missed it can replay it from the bytes.
            payload = codecs.encode(merged.float(), self.spec.codec, self.spec.block)
            merged = codecs.decode(payload, expected_numel=self.numel)
        return ShardResult(merged, float(sum(weights)), peers, weighted_norm(norms, weights), payload,
                           [peers[i] for i in clip.clipped], parts)


class Answer:
    """How the shards this daemon reduces leave it. The base class is the honest reducer and changes nothing; fault
    injection (``atoll.node.faults``) subclasses it to play a hostile one, as ``Tamper`` does for members.
    ``payload`` gets the encoded reduced shard and returns what every asking member is sent, or None to send
    nothing (after holding the stream as long as it likes)."""

    async def payload(self, payload: bytes, spec: GroupSpec, timeout: float) -> bytes | None:
        return payload


class AveragingServicer(ServicerBase):
    """Serves ``rpc_aggregate`` for the shards this daemon reduces."""

    def __init__(self, run_id: str, local_peer: str, stats: TrafficStats, cooldown: Cooldown | None = None,
                 clip_factor: float = 0.0, max_wait: float = 600.0,
                 past: Callable[[int, int], bool] | None = None,
                 authorize: Callable[[str], Awaitable[bool]] | None = None, answer: Answer | None = None) -> None:
        """``answer``: how this daemon's reduced shards leave it (honest unless a fault is injected); ``cooldown``: peers whose parts are treated as missing; ``max_wait``: the longest a request for a group
        not opened here yet may wait for it (the run's round timeout: an honest member never asks for longer);
        ``past(fragment, version)``: whether this daemon is past that round (it will never open a group of it, so
        a request for one not opened is refused at once instead of after ``max_wait``); ``authorize(peer)``
        (private runs): whether a peer is a member, asked before its request is read or takes a waiting slot
        (bounded, ``p2p_guard.MemberGate``)."""
        self.run_id, self.local_peer, self.stats = run_id, local_peer, stats
        self.cooldown, self.clip_factor, self.max_wait = cooldown, clip_factor, max_wait
        self._past = past
        self._authorize = authorize
        self.answer = answer or Answer()
        self.late = Strikes(LATE_OFFENCES)  # reducers this daemon gave up on while the others answered, in a row
        self._sent: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        self._log = RateLimitedLog()
        self._groups: dict[str, _Reduction] = {}
        self._opened: dict[str, asyncio.Event] = {}
        self._waiting: dict[str, int] = {}  # peer -> its requests waiting for a group not opened yet

    def open(self, spec: GroupSpec, timeout: float) -> _Reduction:
        """Start reducing this daemon's shard of ``spec``; requests for it that arrived early are released.

        A group id this daemon still remembers keeps its reduction: a round retried at the same version by the
        same members has the same id, and members that asked the first reduction must get the same values as
        those that ask now (replacing it made them disagree: same contributors, different replicas)."""
        existing = self._groups.get(spec.group_id)
        if existing is not None:
            return existing
        index = spec.reducer_list.index(self.local_peer)
        reduction = _Reduction(spec, spec.bounds()[index], timeout, self.clip_factor)
        reduction.stats = self.stats
        if self.cooldown is not None:
            # Members we cool down are missing from the start: their streams are refused before they say which
            # group they are for (not members, in a private run), so the shard would wait out its timeout for them.
            for member in spec.members:
                if member != self.local_peer and self.cooldown.active(member):
                    reduction.exclude(member)
        gid = spec.group_id
        self._groups[gid] = reduction
        self._opened.setdefault(gid, asyncio.Event()).set()
        asyncio.get_running_loop().call_later(3 * timeout, self._forget, gid)
        return reduction

    def sent(self, gid: str, reducer: str, part: tuple[float, float, float],
             timeout: float) -> list[tuple[float, float, float]]:
        """Every (weight, norm, size) this daemon sent ``reducer`` for group ``gid``, ``part`` included. A reducer
        keeps the first part it got of a member for as long as it remembers the group (a round formed again at
        the same version by the same members has the same id, and gets the same result): its answer may name
        one we sent before, not the one we send now."""
        key = (gid, reducer)
        if key not in self._sent:
            self._sent[key] = []
            asyncio.get_running_loop().call_later(3 * timeout + 10, self._sent.pop, key, None)
        parts = self._sent[key]
        if part not in parts and len(parts) < 8:
            parts.append(part)
        return parts

    def _forget(self, gid: str) -> None:
        self._groups.pop(gid, None)
        self._opened.pop(gid, None)

    async def _await_group(self, gid: str, timeout: float, sender: str) -> _Reduction | None:
        if gid not in self._groups:
            waiting = len(self._opened) - len(self._groups)  # early requests for groups not opened here yet
            if gid not in self._opened and waiting >= MAX_PENDING_GROUPS:
                return None
            if self._waiting.get(sender, 0) >= MAX_PENDING_PER_PEER:  # one peer cannot take every waiting slot
                return None
            event = self._opened.setdefault(gid, asyncio.Event())
            self._waiting[sender] = self._waiting.get(sender, 0) + 1
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except asyncio.TimeoutError:
                if not event.is_set():
                    self._opened.pop(gid, None)
                return None
            finally:
                self._waiting[sender] -= 1
                if not self._waiting[sender]:
                    del self._waiting[sender]
        return self._groups.get(gid)

    async def _read_part(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], reduction: _Reduction,
                         header: dict[str, Any]) -> tuple[float, torch.Tensor, float]:
        """Check a member's header and read its part, bounded in bytes, messages and time; (weight, values, norm)."""
        spec = reduction.spec
        weight, norm = float(header["weight"]), float(header["norm"])
        if not 0 < weight < MAX_ROUND_WEIGHT:
            raise WireError(f"weight {weight} out of range", "weight")
        if not (math.isfinite(norm) and 0 <= norm < MAX_NORM):
            raise WireError(f"norm {norm} is not a finite non-negative number", "norm")
        if header["numel"] != reduction.numel:
            raise WireError(f"part has {header['numel']} values, shard has {reduction.numel}", "shape")
        if header["codec"] != spec.codec:
            raise WireError(f"part uses codec {header['codec']!r}, the run uses {spec.codec!r}", "codec")
        limit = codecs.encoded_size(reduction.numel, spec.codec, spec.block)
        max_messages = -(-limit // PART_BYTES)

        async def read() -> list[bytes]:
            parts, size = [], 0
            async for msg in requests:
                part = unpack(msg, {"data": bytes})["data"]
                size += len(part)
                self.stats.bytes_received += len(part)
                if size > limit or len(parts) >= max_messages:
                    raise WireError(f"part longer than {limit} bytes or {max_messages} messages", "oversize")
                if not part:
                    raise WireError("empty data message")
                parts.append(part)
            return parts

        try:  # a member streams its part at once; one that trickles it must not hold the handler forever
            parts = await asyncio.wait_for(read(), reduction.timeout + 10)
        except asyncio.TimeoutError:
            raise WireError("part not received in time", "slow") from None
        try:
            values = await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(codecs.decode, b"".join(parts), expected_numel=reduction.numel))
        except codecs.CodecError as e:
            raise WireError(f"undecodable part: {e}", e.kind) from None
        return weight, values, norm

    async def rpc_aggregate(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        sender = str(context.remote_id)
        reduction: _Reduction | None = None
        cooling = self.cooldown is not None and self.cooldown.active(sender)
        # A non-member (libp2p authenticated the peer id) takes no waiting slot and has nothing of its read: free
        # identities would otherwise fill every slot (eight of them halved the honest merges).
        if self._authorize is not None and not await self._authorize(sender):
            self.stats.reject("unauthorized")
            self._log("unauthorized", "refused an aggregate request by %s: not a member of this private run",
                      sender[-8:])
            yield pack_response({"ok": False, "error": "not a member of this run"})
            return
        try:
            header = unpack(await anext(requests), {"group_id": str, "weight": float, "numel": int, "wait": float,
                                                    "norm": float, "codec": str})
            wait = min(max(header["wait"], 0.0), self.max_wait) if math.isfinite(header["wait"]) else 0.0
            fragment, version = header.get("fragment"), header.get("version")
            if (self._past is not None and type(fragment) is int and type(version) is int
                    and self._past(fragment, version)):
                wait = 0.0  # two coordinators decided the round with different views: we ran another group of it
            # An offender's requests do not wait for groups we have not opened: it cannot hold waiting slots.
            reduction = await self._await_group(header["group_id"][:64], 0.0 if cooling else wait, sender)
            if reduction is None:
                raise WireError(f"unknown group {header['group_id'][:64]!r}", "unknown_group")
            if sender not in reduction.spec.members:
                reduction = None
                raise WireError("sender is not a member of the group", "not_member")
            if cooling:  # a member of a group someone else decided: its part counts as missing in our shard
                raise WireError("sender is cooling down after a rejected message", "cooldown")
            reduction.add(sender, *await self._read_part(requests, reduction, header))
        except (WireError, StopAsyncIteration) as e:
            kind = e.kind if isinstance(e, WireError) else "truncated"
            # Content a correct peer never sends makes its sender an offender; a stream that ended early, a group
            # we do not know (yet) or a slow sender can be the network's fault or a disagreement, not hostility.
            offence = kind not in ("truncated", "unknown_group", "slow", "cooldown")
            self.stats.reject(kind, sender if offence else None)
            log = logger.debug if cooling else logger.warning  # a flood from an offender costs no log lines
            log("rejected aggregate part from %s: %s", sender[-8:], e)
            if reduction is None:
                yield pack_response({"ok": False, "error": str(e)})
                return
            # A member of the group: its part is treated as missing (the shard is reduced without it, at once), but
            # it still gets the shard's result, so that it ends the round with the same values as everyone else.
            reduction.exclude(sender)
        # Shielded: a member that gives up on us closes its stream and hivemind cancels this handler; awaiting the
        # result unshielded would cancel it for every other member (and for our own round) too.
        result = await asyncio.shield(reduction.result)
        assert result.payload is not None  # groups with a remote member always encode their result
        payload = await self.answer.payload(result.payload, reduction.spec, reduction.timeout)
        if payload is None:
            return
        yield pack_response({"ok": True, "weight": result.weight, "contributors": result.contributors,
                             "numel": reduction.numel, "norm": result.norm, "parts": result.parts})
        for start in range(0, len(payload), PART_BYTES):
            chunk = payload[start : start + PART_BYTES]
            self.stats.bytes_sent += len(chunk)
            yield pack_response({"data": chunk})


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
    clip = clip_members(weights, norms, sizes, clip_factor, spec.mode == "rda")
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
            raise GroupRefused(f"reducer refused: {header.get('error')}")
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
    """A live reducer does not know our group: the members disagree about who is in the round."""


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
    failed, refused, shards = list(late), [], {}
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
            logger.warning("round v%d: shard from reducer %s failed: %r", spec.version, peer[-8:], error)
        else:
            shards[peer] = task.result()
    if failed or refused:
        return AllreduceResult(None, 0.0, [], failed, refused)
    ordered = [shards[p] for p in reducers]
    weight, rda_norm = combine_scalars(ordered, spec.mode == "rda")
    merged = merged_delta([s.values for s in ordered], rda_norm)
    contributors = sorted({c for s in ordered for c in s.contributors})
    encoded = None if any(s.payload is None for s in ordered) else [(s.values.numel(), s.payload) for s in ordered]
    ours = tamper.own(torch.cat(sent))
    return AllreduceResult(merged, weight, contributors, [], [], ours, encoded, rda_norm)

"""The reducer's side of the averaging round (``averaging.py`` is the member's): the group as every member computes
it (``GroupSpec``, ``shard_bounds``), and the ``rpc_aggregate`` service that reduces this daemon's shard of a group.

Reducer j of a group receives every member's part of shard j (and its weight, and for ``rda`` its whole-fragment
norm) inside one ``rpc_aggregate`` call per member, sums the contributions in peer-id order and answers each, itself
included, with the same fp32 bytes (compressed with the run's codec, and applied as decoded), so all members end the
round with a bit-identical merged delta.

Hostile members: every header field, size and value is checked before use (sizes against the shard and the
codec's exact encoded size, before anything is buffered); a rejected part is a missing member and its sender
an offender (``protocols/cooldown.py``): its parts are treated as missing in the shards this daemon reduces
while it cools down. Valid but outsized parts are clipped before the merge (``models/robust.py``: a declared
weight above the run's bound, ``GroupSpec.max_weight``, is cut to it; a contribution, declared weight or RDA norm
above ``clip_factor`` × the lower median of the shard's is scaled to that median); clipping is per shard, because
a reducer sees only its shard. The run's ``robust_merge``
(``GroupSpec.merge``) then picks how the shard's contributions merge: the weighted mean, or a coordinate-wise
trimmed mean or centered clipping, which also bound a member at a typical norm pointing anywhere. A member that
never sends its part costs its reducer at most ``timeout``; the shard is reduced without it.
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
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

from atoll.models.outer import weighted_norm
from atoll.models.robust import MergeRule, clip_members, lower_median, robust_merge

from . import codecs
from .cooldown import Cooldown, Strikes
from .p2p_guard import RateLimitedLog
from .records import MAX_NORM, MAX_ROUND_WEIGHT
from .stats import TrafficStats
from .wire import PART_BYTES, WireError, pack_response, unpack

logger = logging.getLogger("atoll")

MAX_PENDING_GROUPS = 64
MAX_PENDING_PER_PEER = 8  # early requests one peer may keep waiting (one per concurrent round; fragments)
# A reducer a member gave up on while the others answered (``averaging.answer_grace``) this many rounds in a row is
# an offender.
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
    # Sum the parts in member order, not sorted by peer id: sibling groups (coordination.sibling_group) list one
    # member of each round group in the groups' order, and each must compute the same bits from the same parts.
    ordered: bool = False
    # The most weight one member may declare in this group: the run's tokens a step for the steps a contribution can
    # hold (``Algorithm.weight_bound``); 0: no cap (sibling merges, whose weights are whole groups').
    max_weight: float = 0.0

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
        if self.max_weight:
            text += f"|w<={self.max_weight!r}"
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
            logger.info("round f%d v%d: clipped the contributions of %s (above %g x the round's median, or a weight "
                        "above the run's bound %g) to it", self.spec.fragment, self.spec.version,
                        [c[-8:] for c in result.clipped], self.clip_factor, self.spec.max_weight)
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
        cap = self.spec.max_weight
        for peer, weight in zip(peers, weights):
            if cap and weight > cap:  # a member that lies, or one carrying more than a missed round's work
                logger.info("round f%d v%d: %s declared weight %.4g, above the run's bound %.4g (max_step_tokens for "
                            "2 rounds of steps): cut to it", self.spec.fragment, self.spec.version, peer[-8:], weight,
                            cap)
        clip = clip_members(weights, norms, sizes, self.clip_factor, self.spec.mode == "rda", cap)
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
        past = False  # we moved past this group's round (merged its version by another group)
        try:
            header = unpack(await anext(requests), {"group_id": str, "weight": float, "numel": int, "wait": float,
                                                    "norm": float, "codec": str})
            wait = min(max(header["wait"], 0.0), self.max_wait) if math.isfinite(header["wait"]) else 0.0
            fragment, version = header.get("fragment"), header.get("version")
            past = (self._past is not None and type(fragment) is int and type(version) is int
                    and self._past(fragment, version))
            if past:
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
                # ``past``: the sender's group will not complete with us in it, for anyone (``GroupRefused.past``).
                yield pack_response({"ok": False, "error": str(e), **({"past": True} if past else {})})
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

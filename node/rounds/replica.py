"""This daemon's replica of the global state, per fragment: Θ_p, the outer momentum, version, merged weight, hash.

Lives in host memory as flat fp32 tensors and is shared by the learner thread and the protocol thread, so
every access goes through one lock. Identity of a fragment replica: (version, weight, digest) — see
``atoll.protocols.records.heavier``. ``diloco`` uses a single fragment holding every parameter.

Each fragment also keeps its last rounds as their compressed reduced shards (``RoundDelta``), so that a peer
holding an older replica on the same line can catch up by replaying them instead of downloading Θ_p and its
momentum (``protocols/state_sync.py``). The log holds an unbroken chain ending at the current replica: a
round that cannot be replayed (one sent uncompressed, or a ddp step) or an adoption from elsewhere starts it
over.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from atoll.models.outer import NesterovOuter, merged_delta, tensor_hash
from atoll.protocols import codecs
from atoll.protocols.state_sync import MAX_ANCESTORS, MAX_REPLAY_ROUNDS, Replay, ReplicaState, RoundDelta

logger = logging.getLogger("atoll")


class _Fragment:
    def __init__(self, params: torch.Tensor, momentum: torch.Tensor | None, version: int, weight: float,
                 ancestors: Sequence[str] = ()) -> None:
        self.params = params.detach().to("cpu", torch.float32).clone()
        self.momentum = torch.zeros_like(self.params) if momentum is None else momentum.detach().float().clone()
        self.version, self.weight = version, float(weight)
        self.digest = tensor_hash(self.params, self.momentum)
        self.ancestors = [a for a in ancestors if a != self.digest][-(MAX_ANCESTORS - 1):] + [self.digest]
        self.log: list[RoundDelta] = []  # the last replayable rounds, an unbroken chain ending at ``digest``

    def remember(self, rounds: Sequence[RoundDelta]) -> None:
        """Append rounds that end at the current replica; keep at most ``MAX_REPLAY_ROUNDS`` rounds, and no more
        bytes than half a full transfer (a longer replay is never offered)."""
        self.log.extend(rounds)
        budget = 4 * self.params.numel()
        while self.log and (len(self.log) > MAX_REPLAY_ROUNDS or sum(r.nbytes for r in self.log) > budget):
            self.log.pop(0)

    def advanced(self) -> None:
        """Θ_p changed into a descendant of itself: new digest, and the old one joins the ancestors."""
        self.digest = tensor_hash(self.params, self.momentum)
        self.ancestors = (self.ancestors + [self.digest])[-MAX_ANCESTORS:]


class Replica:
    def __init__(self, params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor] | None = None,
                 versions: Sequence[int] | None = None, weights: Sequence[float] | None = None,
                 ancestors: Sequence[Sequence[str]] | None = None) -> None:
        n = len(params)
        self._lock = threading.Lock()
        self._frags = [
            _Fragment(params[p], None if momentum is None else momentum[p], 0 if versions is None else versions[p],
                      0.0 if weights is None else weights[p], () if ancestors is None else ancestors[p])
            for p in range(n)
        ]
        self.schedule_step = 0  # the learner's position in the sync schedule, shared with joiners

    @property
    def num_fragments(self) -> int:
        return len(self._frags)

    def numel(self, p: int) -> int:
        return self._frags[p].params.numel()

    def identity(self, p: int) -> tuple[int, float, str]:
        with self._lock:
            f = self._frags[p]
            return f.version, f.weight, f.digest

    def identities(self) -> list[tuple[int, float, str]]:
        with self._lock:
            return [(f.version, f.weight, f.digest) for f in self._frags]

    def ancestors(self, p: int) -> tuple[str, ...]:
        """The digests of fragment ``p``'s recent versions, oldest first, the current one last (no tensor copy)."""
        with self._lock:
            return tuple(self._frags[p].ancestors)

    @property
    def total_version(self) -> int:
        """Sum of fragment versions: one number that grows with every merged round."""
        return sum(v for v, _, _ in self.identities())

    def params_and_id(self, p: int) -> tuple[torch.Tensor, tuple[int, str]]:
        """Θ_p and the (version, digest) it is, read together."""
        with self._lock:
            f = self._frags[p]
            return f.params.clone(), (f.version, f.digest)

    def snapshot(self, p: int) -> ReplicaState:
        with self._lock:
            f = self._frags[p]
            return ReplicaState(f.version, f.weight, f.digest, f.params.clone(), f.momentum.clone(),
                                self.schedule_step, fragment=p, ancestors=tuple(f.ancestors))

    def apply_outer_step(self, p: int, version: int, delta: torch.Tensor, weight: float,
                         outer: NesterovOuter, digest: str | None = None,
                         shards: Sequence[tuple[int, bytes]] | None = None,
                         rda_norm: float | None = None) -> tuple[int, float, str] | None:
        """Apply a round's merged delta if fragment ``p`` is still the replica the round started from (same
        version and, when given, the same digest: a heavier replica adopted at the same version does not count);
        returns the new replica's identity (the round's result), or None if it was not applied. ``shards`` and
        ``rda_norm``: what ``delta`` was made of (``merged_delta``), kept so peers can replay the round."""
        with self._lock:
            f = self._frags[p]
            if f.version != version or (digest is not None and f.digest != digest):
                return None
            base = f.digest
            outer.step(f.params, f.momentum, delta, version)
            f.version += 1
            f.weight += float(weight)
            f.advanced()
            if shards is None:
                f.log.clear()
            else:
                f.remember([RoundDelta(version, base, f.digest, float(weight), rda_norm, tuple(shards))])
            return f.version, f.weight, f.digest

    def replay_from(self, p: int, have: str) -> Replay | None:
        """The logged rounds that lead from the replica ``have`` to our current one (a donor's answer), or None
        when ``have`` is not on our log (then only a full transfer will do)."""
        with self._lock:
            f = self._frags[p]
            for i, r in enumerate(f.log):
                if r.base == have:
                    return Replay(p, f.version, f.weight, f.digest, self.schedule_step, tuple(f.ancestors),
                                  tuple(f.log[i:]))
            return None

    def replay(self, replay: Replay, outer: NesterovOuter) -> ReplicaState | None:
        """Replay a donor's rounds on our replica of the fragment: the resulting state (to ``adopt``) if every
        round decodes and ends at the digest the donor announced, else None (logged). The tensor work runs on
        copies, outside the lock."""
        p = replay.fragment
        state = self.snapshot(p)
        if not replay.rounds or replay.rounds[0].base != state.digest:
            logger.info("fragment %d: our replica moved on; the replay no longer applies", p)
            return None
        params, momentum, weight, digest = state.params, state.momentum, state.weight, state.digest
        ancestors = list(state.ancestors)
        for i, r in enumerate(replay.rounds):
            if r.version != state.version + i:  # the outer step's phase (Delayed Nesterov) is the version
                logger.warning("fragment %d: the replay's round %d claims v%d, expected v%d", p, i, r.version,
                               state.version + i)
                return None
            try:
                delta = merged_delta([codecs.decode(b, expected_numel=n) for n, b in r.shards], r.rda_norm)
            except codecs.CodecError as e:
                logger.warning("fragment %d: round v%d of the replay does not decode: %s", p, r.version, e)
                return None
            if delta.numel() != params.numel():
                logger.warning("fragment %d: round v%d of the replay has the wrong size", p, r.version)
                return None
            outer.step(params, momentum, delta, r.version)
            weight += float(r.weight)
            digest = tensor_hash(params, momentum)
            if digest != r.result:
                logger.warning("fragment %d: replaying round v%d gave %s, the donor announced %s", p, r.version,
                               digest, r.result)
                return None
            ancestors.append(digest)
        if (replay.version, weight) != (state.version + len(replay.rounds), replay.weight):
            logger.warning("fragment %d: the replay's version or weight disagrees with the donor's header", p)
            return None
        return ReplicaState(replay.version, weight, digest, params, momentum, replay.schedule_step, replay.donor, p,
                            tuple(ancestors[-MAX_ANCESTORS:]), donors=(replay.donor,), rounds=replay.rounds)

    def adopt(self, state: ReplicaState, replacing: str | None = None) -> bool:
        """Replace a fragment with a heavier downloaded one; False if ours became at least as heavy meanwhile.
        ``replacing``: the digest of ours when the state was chosen to replace it whatever the versions and
        weights (the swarm's line over a fork this daemon was on alone, ``catchup``); False if ours changed since
        (a round merged it with someone: not alone any more)."""
        with self._lock:
            f = self._frags[state.fragment]
            if replacing is not None:
                if f.digest != replacing or state.digest == f.digest:
                    return False
            elif (state.version, state.weight, state.digest) <= (f.version, f.weight, f.digest):
                return False
            # A fork: our replica is not in the new one's history, as far as that history reaches back
            # (MAX_ANCESTORS versions). Replacing a replica older than that counts as a catch-up, fork or not.
            oldest_known = state.version - len(state.ancestors) + 1
            state.forked = f.version >= oldest_known and f.digest not in state.ancestors
            state.replaced = f.version
            replayed_ours = bool(state.rounds) and state.rounds[0].base == f.digest
            f.params, f.momentum = state.params.clone(), state.momentum.clone()
            f.version, f.weight, f.digest = state.version, state.weight, state.digest
            f.ancestors = list(state.ancestors)[-MAX_ANCESTORS:] or [state.digest]
            if not replayed_ours:
                f.log.clear()
            f.remember(state.rounds if replayed_ours else ())
            return True

    def replace_params(self, p: int, version: int, params: torch.Tensor, weight: float) -> bool:
        """ddp: after a step every member applied the same averaged gradients, Θ_p is simply the new θ; applied
        only if fragment ``p`` is still at ``version`` (False when a heavier replica was adopted meanwhile)."""
        with self._lock:
            f = self._frags[p]
            if f.version != version:
                return False
            f.params = params.detach().to("cpu", torch.float32).clone()
            f.version += 1
            f.weight += float(weight)
            f.advanced()
            f.log.clear()
            return True

"""A hostile member of a run: it holds a valid join token and attacks the run through the DHT and the RPCs.

Not a daemon: a bare hivemind DHT with the token's validators, that reads the honest daemons' records and writes
its own, and serves the run's two RPCs with answers of its choosing. Each attack reproduces one of the review's
(docs/security.md) and runs for a given number of seconds:

- ``fake_heavier``: its progress record claims a replica five versions ahead of the swarm's, and it serves an
  all-zero model whose digest matches the claim (``refuse=True``: it claims the same and refuses to serve).
- ``scrambled_heavier``: the same claim, serving the run's initial model Θ₀ with its values shuffled and doubled, and zero
  momentum: a replica of about the trained one's norm (the gross filter lets it through) that is no model at all,
  and none of the daemons' ancestors (Θ₀ itself is every young replica's ancestor).
- ``copied_claim``: its progress record republishes the heaviest honest claim of every fragment (version, weight,
  digest), so that it is one more holder of that replica and a donor of it; asked for it, it sends a made-up
  replica (Θ₀ scrambled) under a header of its own, one version ahead and heavier, whatever the requester wants.
- ``decoy``: its progress record claims a replica at the swarm's version that nobody holds, and that loses every
  tie (a fork nobody waits for in a round, and nobody downloads): one more live peer that holds no honest
  daemon's replica (with a second member's ``scrambled_heavier``, a daemon alone on its side of a split sees only
  strangers' replicas: it is lonely).
- ``forged_rounds``: it registers for every fragment's next round with a back-dated time (the earliest
  plausible one: it becomes the coordinator and never decides) or an absurd one, then with the present time
  and group decisions that impose singleton groups or leave everyone else out.
- ``hostile_reducer``: it registers for the rounds like an honest member and, as the reducer of its shard,
  answers with an infinite weight, a huge norm and contributors that are not members.
- ``open_rounds``: it announces an open round of every fragment at the swarm's version twice a second.
- ``junk_records``: fifty progress records under fake peer ids (each under a subkey of its own), malformed round,
  group and open-round values, and a run config that claims the run is open and trains another model.
- ``dht_flood``, ``held_downloads``, ``dynamic_keys``: attacks on the honest daemons' memory and work
  (``scripts/hostile/exhaustion.py``).

Every attack returns what it did (counts); what the honest daemons made of it is read from their own records.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import tempfile
import threading
import time
from collections.abc import Coroutine
from typing import Any, AsyncIterator

import torch
from hivemind import DHT
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from atoll.models.configs import get_model_config
from atoll.node.algorithm import algorithm
from atoll.models.fragments import make_fragments
from atoll.models.gpt import GPT
from atoll.models.outer import tensor_hash
from atoll.node.rounds.catchup import MAX_NORM_RATIO
from atoll.protocols import dht_io, reducer, state_serve, state_sync
from atoll.protocols.auth import JoinToken
from atoll.protocols.matchmaking import group_key
from atoll.protocols.record_validator import make_validators
from atoll.protocols.records import (ALL_SHARDS, ProgressRecord, config_key, open_rounds_key, parse_progress,
                                     progress_key, progress_keys, progress_shard, replica_key, round_key,
                                     unwrap_subkeys)
from atoll.protocols.stats import TrafficStats
from atoll.protocols.wire import WireError, pack_request, pack_response, unpack

from . import exhaustion


class HostileMember:
    """A member of ``run_id`` (``token``: its join token file) on the DHT of ``initial_peers``; use as a context
    manager. ``model`` and ``fragments`` must be the run's (the zero replica it serves has the run's sizes)."""

    def __init__(self, run_id: str, initial_peers: list[str], token: str, model: str = "nano",
                 algorithm_name: str = "decoupled", fragments: int = 4, sync_every: int = 10,
                 gather_timeout: float = 8.0, namespace: str | None = None, seed: int = 0) -> None:
        self.run_id, self.initial_peers, self.gather_timeout = run_id, initial_peers, gather_timeout
        self.namespace = namespace or run_id  # where it reads and writes progress records (a split swarm's side)
        self.token = JoinToken.load(token)
        torch.manual_seed(seed)  # as the learner does: Θ₀
        gpt = GPT(get_model_config(model))
        frags = make_fragments(list(gpt.parameters()), algorithm(algorithm_name).num_fragments(fragments), sync_every,
                               embedding=gpt.embed.weight)
        self.numels = [f.numel for f in frags]
        generator = torch.Generator().manual_seed(1)
        # Twice Θ₀'s norm: a replica's norm grows from Θ₀'s as it trains, and the gross filter admits a factor of
        # MAX_NORM_RATIO (2) either way, so this passes it from Θ₀ until the replica is four times Θ₀'s norm (with
        # Θ₀'s own norm, a replica trained past twice that refused it before the held-out check was reached).
        self.scrambled = [MAX_NORM_RATIO * t[torch.randperm(t.numel(), generator=generator)]
                          for t in (f.gather(list(gpt.parameters())) for f in frags)]
        self.mode = "serve"  # what the state servicer does: "serve" its claim, or "refuse"
        self.copy_answers = 0  # downloads answered with a made-up replica under a copied claim (copied_claim)
        self.served = [torch.zeros(n) for n in self.numels]  # the Θ of its claim, per fragment
        self.reducer_hostile = False
        self.min_peers = 1  # fake_heavier and scrambled_heavier claim only once this many other live records are seen
        self.answers = 0
        self.partial: dict[str, int] | None = None  # the running attack's counts so far, where it keeps them
        self._ahead = [(0, 0.0)] * len(self.numels)  # the versions and weights it claims (fake_heavier)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.dht: DHT | None = None

    # ---- set-up --------------------------------------------------------------------------------------------------
    def __enter__(self) -> HostileMember:
        # Its own node takes the records it writes under a split swarm's side.
        sides = [self.namespace] if self.namespace != self.run_id else []
        validators = make_validators(self.run_id, self.token, namespaces=sides)
        self.subkey = validators[0].local_public_key
        # A member's peer id is its member key's (readers check it), as a daemon's is.
        with tempfile.TemporaryDirectory() as folder:
            identity = os.path.join(folder, "identity.key")
            with open(identity, "wb") as f:
                f.write(self.token.member_key.identity_bytes())
            self.dht = DHT(initial_peers=self.initial_peers, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                           record_validators=validators, identity_path=identity)
        self.peer_id = str(self.dht.peer_id)
        self._thread.start()
        self._run(self._serve())
        return self

    def __exit__(self, *exc: Any) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if self.dht is not None:
            self.dht.shutdown()

    def _run(self, coro: Coroutine, timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _serve(self) -> None:
        self.p2p = await self.dht.replicate_p2p()
        stats = TrafficStats()
        await StateServicer(self._zero_state, len(self.numels), stats).add_p2p_handlers(self.p2p,
                                                                                           namespace=self.run_id)
        await AveragingServicer(self).add_p2p_handlers(self.p2p, namespace=self.run_id)

    def _zero_state(self, p: int) -> state_sync.ReplicaState | None:
        if self.mode == "refuse":
            return None
        params, momentum = self.served[p], torch.zeros(self.numels[p])
        version, weight, digest = self._claim(p)
        self.copy_answers += self.mode == "copy"
        return state_sync.ReplicaState(version, weight, digest, params.clone(), momentum, 0, fragment=p)

    # ---- what the honest daemons publish -------------------------------------------------------------------------
    async def _honest(self) -> list[ProgressRecord]:
        found = await dht_io.get_many(self.dht, progress_keys(self.namespace))
        records = [parse_progress(v) for entry in found.values() for v in unwrap_subkeys(entry).values()]
        return [r for r in records if r is not None and r.peer_id != self.peer_id and r.status == "training"]

    @property
    def zero_digests(self) -> list[str]:
        """The digests of the all-zero replica it claims, per fragment."""
        return [tensor_hash(torch.zeros(n), torch.zeros(n)) for n in self.numels]

    @property
    def scrambled_digests(self) -> list[str]:
        """The digests of the scrambled replica it serves (scrambled_heavier, copied_claim), per fragment."""
        return [tensor_hash(t, torch.zeros(n)) for t, n in zip(self.scrambled, self.numels)]

    def _claim(self, p: int) -> tuple[int, float, str]:
        version, weight = self._ahead[p]
        return version, weight, tensor_hash(self.served[p], torch.zeros(self.numels[p]))

    async def _publish(self, record: dict[str, Any], ttl: float = 6.0) -> bool:
        """Under its shard and under a small swarm's one key, as an honest daemon publishes
        (``node/rounds/peers.py``)."""
        keys = [progress_key(self.namespace, progress_shard(self.peer_id)), progress_key(self.namespace, ALL_SHARDS)]
        stored = await asyncio.gather(*(dht_io.store(self.dht, key, record, get_dht_time() + ttl, self.subkey)
                                        for key in keys))
        return all(stored)

    async def _publish_claims(self, top: ProgressRecord) -> bool:
        """A record like ``top``'s claiming, for every fragment, what ``_claim`` says (``_ahead``, ``served``)."""
        claims = [self._claim(p) for p in range(len(self.numels))]
        return await self._publish(self._record_like(top, fragment_versions=[c[0] for c in claims],
                                                     fragment_weights=[c[1] for c in claims],
                                                     fragment_hashes=[c[2] for c in claims]))

    def _record_like(self, honest: ProgressRecord, **changes: Any) -> dict[str, Any]:
        record = honest.dict()
        record.update({"peer_id": self.peer_id, "time": float(get_dht_time()), "rejected": 0, "rejected_by_kind": {},
                       **changes})
        record["version"] = sum(record["fragment_versions"])
        return record

    # ---- attacks -------------------------------------------------------------------------------------------------
    def fake_heavier(self, seconds: float, refuse: bool = False) -> dict[str, int]:
        """Claim a replica five versions ahead (weight ×10), all zeros; serve it, or refuse to."""
        return self._run(self._fake_heavier(seconds, refuse), timeout=seconds + 60)

    def scrambled_heavier(self, seconds: float) -> dict[str, int]:
        """Claim a replica five versions ahead (weight ×10) and serve Θ₀ with its values shuffled."""
        return self._run(self._fake_heavier(seconds, False, self.scrambled), timeout=seconds + 60)

    async def _fake_heavier(self, seconds: float, refuse: bool,
                            served: list[torch.Tensor] | None = None) -> dict[str, int]:
        self.mode = "refuse" if refuse else "serve"
        self.served = served or [torch.zeros(n) for n in self.numels]
        published, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            honest = await self._honest()
            if len(honest) >= self.min_peers:
                top = max(honest, key=lambda r: r.version)
                self._ahead = [(v + 5, 10.0 * w + 1.0) for v, w in zip(top.fragment_versions, top.fragment_weights)]
                published += await self._publish_claims(top)
            await asyncio.sleep(1.0)
        self.mode = "serve"
        return {"claims_published": published, "digests": [self._claim(p)[2] for p in range(len(self.numels))]}

    def colluding_heavier(self, seconds: float) -> dict[str, int]:
        """``fake_heavier`` as one of two colluders with their own tokens: both claim the same all-zero replica far
        ahead of the honest daemons (their claims rounded so that both make the same one from the same honest
        records, and each other's records left out), so that each vouches for the other's claim."""
        return self._run(self._colluding_heavier(seconds), timeout=seconds + 60)

    async def _colluding_heavier(self, seconds: float) -> dict[str, int]:
        self.mode, self.served = "serve", [torch.zeros(n) for n in self.numels]
        ours = set(self.zero_digests)
        published, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            honest = [r for r in await self._honest() if not ours & set(r.fragment_hashes)]
            if honest:
                top = max(honest, key=lambda r: r.version)
                self._ahead = [((max(r.fragment_versions[p] for r in honest) // 20 + 2) * 20,
                                10.0 ** (math.ceil(math.log10(max(max(r.fragment_weights[p] for r in honest), 1.0)))
                                         + 1))
                               for p in range(len(self.numels))]
                published += await self._publish_claims(top)
            await asyncio.sleep(1.0)
        return {"claims_published": published, "digests": self.zero_digests}

    def copied_claim(self, seconds: float) -> dict[str, Any]:
        """Republish the heaviest honest claim of every fragment and serve a made-up, heavier replica for it."""
        return self._run(self._copied_claim(seconds), timeout=seconds + 60)

    async def _copied_claim(self, seconds: float) -> dict[str, Any]:
        self.mode, self.served = "copy", self.scrambled
        published, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            honest = await self._honest()
            if len(honest) >= self.min_peers:
                best = [max((r.fragment(p) for r in honest), key=lambda c: replica_key(*c))
                        for p in range(len(self.numels))]
                self._ahead = [(v + 1, 2.0 * w + 1.0) for v, w, _ in best]  # what it serves: heavier than the claim
                record = self._record_like(max(honest, key=lambda r: r.version),
                                           fragment_versions=[c[0] for c in best],
                                           fragment_weights=[c[1] for c in best], fragment_hashes=[c[2] for c in best])
                published += await self._publish(record)
            await asyncio.sleep(1.0)
        self.mode = "serve"
        return {"claims_published": published, "answered": self.copy_answers,
                "digests": [self._claim(p)[2] for p in range(len(self.numels))]}

    def decoy(self, seconds: float) -> dict[str, int]:
        """Claim a replica at the version of the honest daemon furthest behind, with the lowest digest, for
        ``seconds``."""
        return self._run(self._decoy(seconds), timeout=seconds + 60)

    async def _decoy(self, seconds: float) -> dict[str, int]:
        published, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            honest = await self._honest()
            if honest:
                low = min(honest, key=lambda r: r.version)  # behind the honest daemons, not behind a member's claim
                record = self._record_like(low, fragment_hashes=["0" * 16 for _ in low.fragment_versions])
                published += await self._publish(record)
            await asyncio.sleep(1.0)
        return {"claims_published": published}

    def forged_rounds(self, seconds: float) -> dict[str, int]:
        """Back-dated or absurd registrations for every fragment's next round, and forged group decisions."""
        return self._run(self._forged_rounds(seconds), timeout=seconds + 60)

    async def _forged_rounds(self, seconds: float) -> dict[str, int]:
        self.reducer_hostile = True  # put in a group by its plausible registrations, it answers as a reducer too
        counts = {"registrations": 0, "decisions": 0}
        start = time.monotonic()
        end, turn = start + seconds, 0
        while time.monotonic() < end:
            honest = await self._honest()
            if honest:
                top = max(honest, key=lambda r: r.version)
                await self._publish(self._record_like(top))  # live, and at the swarm's versions: a registrant
                now = get_dht_time()
                lifetime = 4 * self.gather_timeout + 60
                # First half: absurd and back-dated times, by turns (the earliest plausible one makes a coordinator
                # that never decides). Second half: the present, so that its decisions are read, and forged.
                deciding = time.monotonic() > start + seconds / 2
                when = now if deciding else (-1e12, now - lifetime + 5)[turn % 2]
                turn += 1
                for p in range(len(top.fragment_versions)):
                    version, _, base = top.fragment(p)
                    counts["registrations"] += await dht_io.store(
                        self.dht, round_key(self.run_id, p, version, base),
                        {"peer_id": self.peer_id, "weight": 1.0, "time": float(when)}, now + lifetime, self.subkey)
                    if not deciding:
                        continue
                    others = sorted({r.peer_id for r in honest})
                    groups = [[m] for m in sorted(others + [self.peer_id])] if p % 2 == 0 else [[self.peer_id]]
                    counts["decisions"] += await dht_io.store(
                        self.dht, group_key(self.run_id, p, version, base),
                        {"groups": groups, "time": float(get_dht_time())}, now + lifetime, self.subkey)
            await asyncio.sleep(0.5)
        self.reducer_hostile = False
        return counts

    def squat(self, seconds: float) -> dict[str, int]:
        """The second review's squatter: a registrant of every fragment's next round that re-registers every 0.2 s
        with a time just before the earliest other registration (the earliest registrant coordinated), and never
        decides."""
        return self._run(self._squat(seconds), timeout=seconds + 60)

    async def _squat(self, seconds: float) -> dict[str, int]:
        registrations, end, published = 0, time.monotonic() + seconds, -1e9
        lifetime = 4 * self.gather_timeout + 60
        while time.monotonic() < end:
            honest = await self._honest()
            if honest:
                top = max(honest, key=lambda r: r.version)
                if time.monotonic() - published > 1.0:
                    await self._publish(self._record_like(top))  # live, at the swarm's versions: a registrant
                    published = time.monotonic()
                now = get_dht_time()
                for p in range(len(top.fragment_versions)):
                    version, _, base = top.fragment(p)
                    key = round_key(self.run_id, p, version, base)
                    entry = await dht_io.get(self.dht, key)
                    times = [v["time"] for v in unwrap_subkeys(entry).values()
                             if isinstance(v, dict) and v.get("peer_id") != self.peer_id
                             and isinstance(v.get("time"), float)]
                    when = max(min(times, default=now) - 0.01, now - lifetime + 5)
                    registrations += await dht_io.store(
                        self.dht, key, {"peer_id": self.peer_id, "weight": 1.0, "time": float(when)}, now + lifetime,
                        self.subkey)
            await asyncio.sleep(0.2)
        return {"registrations": registrations}

    def hostile_reducer(self, seconds: float) -> dict[str, int]:
        """Join every round as a member would, and answer as a reducer with impossible scalars."""
        return self._run(self._hostile_reducer(seconds), timeout=seconds + 60)

    async def _hostile_reducer(self, seconds: float) -> dict[str, int]:
        self.reducer_hostile, self.answers = True, 0
        registrations, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            honest = await self._honest()
            if honest:
                top = max(honest, key=lambda r: r.version)
                await self._publish(self._record_like(top))
                now = get_dht_time()
                for p in range(len(top.fragment_versions)):
                    version, _, base = top.fragment(p)
                    registrations += await dht_io.store(
                        self.dht, round_key(self.run_id, p, version, base),
                        {"peer_id": self.peer_id, "weight": 1.0, "time": float(now)}, now + 60, self.subkey)
            # A synchronous swarm's rounds take a second or two: registering once a second (from records up to a
            # heartbeat old) missed every round of a 12 s phase in one run of test_adversarial.
            await asyncio.sleep(0.3)
        self.reducer_hostile = False
        return {"registrations": registrations, "hostile_answers": self.answers}

    def open_rounds(self, seconds: float) -> dict[str, int]:
        """Announce an open round of every fragment at the swarm's version, twice a second: without a bound, the
        honest daemons would contribute at every step boundary instead of every H steps."""
        return self._run(self._open_rounds(seconds), timeout=seconds + 60)

    async def _open_rounds(self, seconds: float) -> dict[str, int]:
        announced, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            honest = await self._honest()
            if honest:
                top = max(honest, key=lambda r: r.version)
                await self._publish(self._record_like(top))
                for p in range(len(top.fragment_versions)):
                    record = {"peer_id": self.peer_id, "fragment": p, "version": top.fragment_versions[p]}
                    key = open_rounds_key(self.run_id, p, top.fragment_versions[p], top.fragment_hashes[p])
                    announced += await dht_io.store(self.dht, key, record,
                                                    get_dht_time() + 8, self.subkey)
            await asyncio.sleep(0.5)
        return {"announced": announced}

    def junk_records(self) -> dict[str, int]:
        """Many identities from one token, malformed round values, and a hijacked run config (stored once each)."""
        return self._run(self._junk_records())

    async def _junk_records(self) -> dict[str, int]:
        counts = {"fake_identities": 0, "malformed": 0, "config": 0}
        honest = await self._honest()
        top = max(honest, key=lambda r: r.version)
        ten_years = get_dht_time() + 10 * 365 * 86400
        for i in range(50):
            fake = f"Qm{'fake' * 8}{i:04d}"
            record = self._record_like(top, peer_id=fake)
            counts["fake_identities"] += await dht_io.store(self.dht, progress_key(self.run_id, progress_shard(fake)),
                                                            record, ten_years, self.subkey + b"%04d" % i)
        version, _, base = top.fragment(0)
        # (Oversized, but under hivemind's own limit on what its DHT process reliably takes through its pipe: larger
        # commands arrive in pieces there and get lost, a hivemind race.)
        junk = [{"peer_id": self.peer_id, "weight": "heavy", "time": 1.0}, {"groups": "all", "time": 0.0},
                {"peer_id": self.peer_id, "weight": 1.0, "time": 1.0, "extra": "x" * 8_000}, [1, 2, 3]]
        for value in junk:
            for key in (round_key(self.run_id, 0, version, base), group_key(self.run_id, 0, version, base),
                        open_rounds_key(self.run_id, 0, version, base)):
                counts["malformed"] += await dht_io.store(self.dht, key, value, get_dht_time() + 600, self.subkey)
        hijack = {"fields": {"model": "12b", "clip_factor": 0.0}, "started_by": self.peer_id, "started_at": 0.0,
                  "access": "open", "run_key": None, "signature": None}
        counts["config"] = int(await dht_io.store(self.dht, config_key(self.run_id), hijack, get_dht_time() + 600,
                                                  self.subkey))
        return counts


class StateServicer(state_serve.StateServicer):
    """The run's state RPC (same handler name), serving whatever the hostile member's snapshot returns, deaf to the
    replica a requester wants (an honest donor that holds another one refuses)."""

    async def rpc_download_state(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        try:
            msg = unpack(request, {"fragment": int})
        except WireError:
            msg = None
        if msg is not None:
            msg.pop("want", None)
            request = pack_request(msg)
        async for response in super().rpc_download_state(request, context):
            yield response


class AveragingServicer(reducer.AveragingServicer):
    """The run's averaging RPC (same handler name): while the member attacks as a reducer, every request gets an
    answer with impossible scalars; otherwise it is refused as an unknown group."""

    def __init__(self, member: HostileMember) -> None:
        super().__init__(member.run_id, "", TrafficStats())
        self.member = member

    async def rpc_aggregate(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        if not self.member.reducer_hostile:
            yield pack_response({"ok": False, "error": "unknown group"})
            return
        try:
            numel = unpack(await anext(requests), {"numel": int})["numel"]  # the shard's size: only scalars lie
        except (WireError, StopAsyncIteration):
            return
        self.member.answers += 1
        yield pack_response({"ok": True, "weight": math.inf, "contributors": ["QmNobody"], "numel": numel,
                             "norm": 1e300, "parts": []})


def main(argv: list[str] | None = None) -> int:
    """Run attacks in order, as a process of its own (so that its DHT shares nothing with the caller's):
    ``python -m scripts.hostile.member --initial-peers M --token T --out result.json junk_records fake_heavier=12 ...``.
    After each attack the results so far are written to ``--out``, with ``done`` naming the attacks finished (and on
    SIGTERM, what the running attack did so far, where it keeps count: ``partial``)."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-id", default="atoll")
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="nano")
    parser.add_argument("--algorithm", default="decoupled")
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--gather-timeout", type=float, default=8.0)
    parser.add_argument("--namespace", default=None, help="the progress records' namespace (default: the run id)")
    parser.add_argument("--min-peers", type=int, default=1, help="claim a heavier replica only once this many "
                                                                 "other live progress records are seen")
    parser.add_argument("attacks", nargs="+", help="junk_records, or NAME=SECONDS (fake_heavier, refuse, "
                                                   "forged_rounds, hostile_reducer, open_rounds, scrambled_heavier, decoy, "
                                                   "copied_claim, squat, dht_flood, held_downloads, dynamic_keys)")
    args = parser.parse_args(argv)
    with HostileMember(args.run_id, args.initial_peers, args.token, args.model, args.algorithm, args.fragments,
                       args.sync_every, args.gather_timeout, args.namespace) as member:
        member.min_peers = args.min_peers
        out: dict[str, Any] = {"member": member.peer_id, "zero_digests": member.zero_digests,
                               "scrambled_digests": member.scrambled_digests, "done": []}
        _write(args.out, out)  # who it is and what it may serve, before any attack (a run may stop it midway)

        def stopped(*_: Any) -> None:  # SIGTERM (the bench stops it with the swarm): what the attack did so far
            if member.partial is not None:  # an attack is running (each ends with it None again)
                out[name] = {**member.partial, "stopped": True}
                _write(args.out, out)
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, stopped)
        for attack in args.attacks:
            name, _, seconds = attack.partition("=")
            member.partial = None
            if name == "junk_records":
                out[name] = member.junk_records()
            elif name == "refuse":
                out[name] = member.fake_heavier(float(seconds), refuse=True)
            elif name in exhaustion.ATTACKS:
                out[name] = member._run(exhaustion.ATTACKS[name](member, float(seconds)), timeout=float(seconds) + 120)
            else:
                out[name] = getattr(member, name)(float(seconds))
            out["done"].append(name)
            member.partial = None
            _write(args.out, out)
    return 0


def _write(path: str, doc: dict[str, Any]) -> None:
    import json

    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    raise SystemExit(main())

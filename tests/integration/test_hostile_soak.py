"""Soak: a hostile peer floods two training daemons with thousands of malformed averaging and state-download RPCs
and garbage DHT records under the run's keys. Afterwards both are still training (steps and rounds advance),
their replicas are identical, and the rejections are counted by kind in their progress records."""

import asyncio
import random
import time

import pytest
from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time
from scripts.swarm import LocalSwarm, StatusReader
from support.swarms import assert_replicas_agree, peer_id, wait_for

from atoll.protocols.identity import RecordSigner
from atoll.protocols.reducer import AveragingServicer
from atoll.protocols.matchmaking import group_key
from atoll.protocols.records import open_rounds_key, progress_keys, round_key
from atoll.protocols.state_serve import StateServicer
from atoll.protocols.wire import pack_request

pytestmark = [pytest.mark.integration, pytest.mark.waits]

RUN = "atoll"
COMMON = ["--model", "nano", "--batch-size", "4", "--algorithm", "diloco", "--sync-every", "20", "--gather-timeout", "8",
          "--round-timeout", "8", "--heartbeat", "1", "--harness", "step_delay=0.03",
          # An open run: anyone may store signed records under the run's keys, so the daemons must parse garbage
          # (a private run's DHT refuses an outsider's records before they are stored).
          "--open"]
AGGREGATE_RPCS, STATE_RPCS, RECORDS = 1500, 700, 300


def garbage_header(rng: random.Random) -> runtime_pb2.ExpertRequest:
    kind = rng.randrange(6)
    if kind == 0:
        return runtime_pb2.ExpertRequest(metadata=rng.randbytes(rng.randrange(64)))  # not msgpack
    if kind == 1:
        return pack_request({"group_id": rng.randbytes(8).hex()})  # fields missing
    header = {"group_id": rng.randbytes(12).hex(), "weight": 1.0, "numel": 1000, "wait": 30.0, "norm": 1.0,
              "codec": "none"}
    if kind == 2:
        header["weight"] = float("nan")
    elif kind == 3:
        header["numel"] = 2**62
    elif kind == 4:
        header["codec"] = "zip" * 100
    return pack_request(header)  # kind 5: an unknown group


async def aggregate(p2p, target: PeerID, rng: random.Random) -> None:
    async def requests():
        yield garbage_header(rng)
        for _ in range(rng.randrange(3)):
            yield pack_request({"data": rng.randbytes(rng.randrange(1, 4096))})

    stream = await AveragingServicer.get_stub(p2p, target, namespace=RUN).rpc_aggregate(requests())
    async for _ in stream:
        pass


async def download(p2p, target: PeerID, rng: random.Random) -> None:
    request = rng.choice([pack_request({"fragment": -1}), pack_request({"fragment": 10**9}),
                          pack_request({"fragment": "zero"}), pack_request({}),
                          runtime_pb2.ExpertRequest(metadata=rng.randbytes(32))])
    stream = await StateServicer.get_stub(p2p, target, namespace=RUN).rpc_download_state(request)
    async for _ in stream:
        pass


async def flood(dht: DHT, targets: list[PeerID], signer: RecordSigner,
                current: tuple[int, int, str]) -> dict[str, int]:
    rng = random.Random(0)
    p2p = await dht.replicate_p2p()
    sent = {"aggregate": 0, "state": 0, "records": 0}
    limit = asyncio.Semaphore(32)

    async def one(kind, call, target):
        async with limit:
            try:
                await asyncio.wait_for(call(p2p, target, random.Random(rng.random())), 30)
            except Exception:  # the daemons may refuse or drop us in any way: that is the point
                pass
            sent[kind] += 1

    calls = [one("aggregate", aggregate, targets[i % len(targets)]) for i in range(AGGREGATE_RPCS)]
    calls += [one("state", download, targets[i % len(targets)]) for i in range(STATE_RPCS)]
    rng.shuffle(calls)
    await asyncio.gather(*calls)

    fragment, version, digest = current  # the round the daemons are about to form: they read these keys
    keys = [*progress_keys(RUN), open_rounds_key(RUN, fragment, version, digest),
            round_key(RUN, fragment, version, digest),
            group_key(RUN, fragment, version, digest), *(round_key(RUN, 0, v) for v in range(40)),
            *(group_key(RUN, 0, v) for v in range(40))]
    junk = [None, 1, "x" * 1000, [1, 2], {"peer_id": 5}, {"groups": [["b", "a"]], "time": 1.0},
            {"peer_id": "Qm", "weight": float("nan"), "time": 1.0}, {"peer_id": "Qm", "fragment": -1, "version": 0}]
    for i in range(RECORDS):
        await dht.store(keys[i % len(keys)], junk[i % len(junk)], expiration_time=get_dht_time() + 60,
                        subkey=signer.local_public_key, return_future=True)
        sent["records"] += 1
    return sent


def last_step(d):
    steps = [m["step"] for m in d.metrics() if "step" in m and "event" not in m]
    return steps[-1] if steps else 0


def test_daemons_survive_a_flood_of_malformed_rpcs_and_records(tmp_path):
    with LocalSwarm(tmp_path, COMMON) as swarm:
        a = swarm.start("a", join=False)
        b = swarm.start("b")
        ids = {peer_id(a), peer_id(b)}
        wait_for(lambda: any(set(r["contributors"]) == ids for r in a.rounds()), 180, "a round with both daemons")
        signer = RecordSigner()
        hostile = DHT(initial_peers=swarm.bootstrap, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                      record_validators=[signer])
        try:
            before = {n: last_step(d) for n, d in swarm.daemons.items()}
            started = time.monotonic()
            last = a.rounds()[-1]
            current = (last["fragment"], last["version"], last["hash"])
            sent = asyncio.run(flood(hostile, [PeerID.from_base58(p) for p in ids], signer, current))
            flood_seconds = time.monotonic() - started
        finally:
            hostile.shutdown()
        print(f"flood: {sent} in {flood_seconds:.1f} s")
        assert sent == {"aggregate": AGGREGATE_RPCS, "state": STATE_RPCS, "records": RECORDS}
        rounds_after = {n: len(d.rounds()) for n, d in swarm.daemons.items()}
        # Still training: both advance and merge two more rounds together.
        wait_for(lambda: all(len([r for r in d.rounds()[rounds_after[n]:] if set(r["contributors"]) == ids]) >= 2
                             for n, d in swarm.daemons.items()), 180, "two rounds with both daemons after the flood")
        assert all(last_step(d) > before[n] + 20 for n, d in swarm.daemons.items())
        assert_replicas_agree(swarm, ("a", "b"))
        # The rejections are counted by kind in the daemons' progress records.
        reader = StatusReader(swarm.bootstrap)
        try:
            doc = wait_for(lambda: (lambda d: d if sum(p["rejected"] for p in d["peers"]) >= 1500 else None)(
                reader.read()), 60, "the rejections in the progress records")
        finally:
            reader.close()
        kinds: dict[str, int] = {}
        for p in doc["peers"]:
            assert sum(p["rejected_by_kind"].values()) == p["rejected"]
            for kind, count in p["rejected_by_kind"].items():
                kinds[kind] = kinds.get(kind, 0) + count
        print("rejections by kind:", kinds)
        # The hostile peer is in no group, so its parts never reach the per-member checks (weight, shape, codec,
        # finiteness: the unit, fuzz and Byzantine tests cover those); its envelopes, groups and requests do.
        for kind in ("protocol", "unknown_group", "state_request"):
            assert kinds.get(kind, 0) > 0, kinds
        # Malformed records are refused by the DHT's validators when stored or read (``dht_*``), or by the reader.
        record_kinds = ("round_record", "group_record", "open_round", "progress_record", "dht_schema", "dht_size",
                        "dht_subkey", "dht_expiry")
        assert any(k in kinds for k in record_kinds), kinds
        assert "left out of rounds" in a.log() + b.log()  # its peer id (and record key) cooled down
        codes = swarm.stop_all(timeout=60)
        assert all(code == 0 for code in codes.values()), codes
        for name, d in swarm.daemons.items():
            assert "Traceback" not in d.log(), name

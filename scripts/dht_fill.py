"""A DHT filled with a run's signed progress records without running a daemon: the run's members (validator
chains certified by a run key), their progress records signed as the daemons sign them, and a coroutine that puts
records straight into a DHT node's storage. The DHT read benches (``bench_dht_reads``, ``bench_shard_reads``,
``bench_status``) share it."""

from __future__ import annotations

from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from atoll.protocols.auth import RunKey
from atoll.protocols.record_validator import make_validators
from atoll.protocols.records import MAX_EXPIRY, progress_key, progress_shard

RUN = "bench"
HOLD_CHUNK = 1  # records per call into a DHT process: a call within PIPE_BUF (4 KiB) reaches its non-blocking pipe
# whole; a larger one (8 records, 16 KB) could arrive in parts, and hivemind's DHT process then failed reading it


def progress_value(peer: str) -> dict[str, Any]:
    """A daemon's progress record, as ``PeerTable.progress_record`` fills it (one fragment)."""
    return {"peer_id": peer, "status": "training", "device": "cpu", "ranks": 1, "algorithm": "decoupled",
            "step": 1000, "version": 50, "fragment_versions": [50], "fragment_weights": [1234.5],
            "fragment_hashes": ["0123456789abcdef"], "schedule_step": 1000, "tokens": 10 ** 7, "tokens_per_s": 5e3,
            "loss": 3.2, "held_out_loss": 3.4, "rounds": 50, "rounds_skipped": 1, "forks_healed": 0,
            "tokens_lost": 0, "goodput": 0.98, "blocked_s": 1.5, "bytes_sent": 10 ** 8, "bytes_received": 10 ** 8,
            "rejected": 0, "rejected_by_kind": {}, "clipped": 0, "time": float(get_dht_time()), "reachable": True}


def members(run_key: RunKey, count: int) -> list[tuple[list, str]]:
    """``count`` members of the run: each one's chain of validators (its key certified by the run key), peer id."""
    out = []
    for _ in range(count):
        token = run_key.issue_token(RUN)
        out.append((make_validators(RUN, token), token.member_key.peer_id))
    return out


def signed_records(chains: list[tuple[list, str]]) -> list[tuple[bytes, bytes, bytes, float]]:
    """Each member's progress record, signed and certified by its chain, expiring as late as the run's rules let
    a progress record, under its shard's key: (key, subkey, value, expiration) as a DHT node stores them."""
    out = []
    for chain, peer in chains:
        key = DHTID.generate(source=progress_key(RUN, progress_shard(peer))).to_bytes()
        subkey = chain[0].local_public_key
        record = DHTRecord(key, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(progress_value(peer)),
                           get_dht_time() + MAX_EXPIRY["progress"] - 30)
        out.append((key, subkey, CompositeValidator(chain).sign_value(record), record.expiration_time))
    return out


async def hold(records: list[tuple[bytes, bytes, bytes, float]], _dht: Any, node: Any) -> int:
    """In a DHT node's process: put the records in its storage, as if the members had stored them there."""
    for key, subkey, value, expiration in records:
        node.protocol.storage.store_subkey(DHTID.from_bytes(key), subkey, value, expiration)
    return len(records)

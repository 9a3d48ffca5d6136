"""DHT records of a run: its configuration, per-daemon progress, the run's summaries, and round registrations.

Every record lives under a key prefixed with the run id and a subkey that is exactly its owner's member key (its
peer id, ``[owner:...]``), so ``identity.RecordSigner`` lets only the owner write it, and one owner writes one
record per key. Every DHT node running atoll's validators checks each record when it stores it and when it reads
it (``RunRecordValidator``): the owner subkey, a size cap and an expiry cap per kind of key, the value's schema
(progress, summary, config and head records by pydantic, round registrations, group decisions, open-round
announcements and revocation lists by their parsers, also under the dynamic round keys), and in a private run that the peer id a
record claims is its signer's and that its signer is not revoked. Readers parse every value again.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import math
from typing import Any, Dict, List, Optional

import pydantic.v1 as pydantic
from hivemind.dht.schema import BytesWithPublicKey
import msgpack
from pydantic.v1 import StrictBool, StrictBytes, StrictFloat, StrictStr, conint, constr


logger = logging.getLogger("atoll")


class Status(enum.StrEnum):
    """A daemon's state as its progress record states it."""

    JOINING = "joining"
    TRAINING = "training"
    LEAVING = "leaving"
    PAUSED = "paused"  # lent back to its owner (node/island/pause.py): serves state, is expected in no round
    STOPPED = "stopped"  # only in a daemon's final summary, never published


STATUSES = (Status.JOINING.value, Status.TRAINING.value, Status.LEAVING.value, Status.PAUSED.value)

MAX_FRAGMENTS = 256
MAX_ROUND_WEIGHT = 1e15  # a member's declared weight, in a registration or an averaging part
MAX_NORM = 1e30  # a contribution's declared norm (RDA), from a member or a reducer
MAX_CLOCK_SKEW = 10.0  # seconds another daemon's clock may run ahead of ours before its times are implausible
MAX_REJECTION_KINDS = 32
MAX_GROUP = 1024  # members of one round's groups together (matchmaking re-exports it)
# Progress records are spread over this many keys by a hash of the peer id (``progress_shard``): no key is written
# by every daemon each heartbeat, and a reader of a large swarm reads a few shards at a time (``node/rounds/peers.py``).
PROGRESS_SHARDS = 16
# The key under which the daemons of a small swarm also write their record, so that one key holds the whole table:
# a read of 16 keys costs a small swarm several times a read of one (``node/rounds/peers.py``, docs/results.md).
ALL_SHARDS = -1
READ_BUDGET = 64  # progress records one read of the table aims at; up to it, the ALL_SHARDS key is read

# How far in the future a record's expiration may lie, per kind of key (seconds; a clock skew is added). Each is
# above what honest daemons use: progress 3 heartbeats (heartbeat <= 200 s), round registrations and group
# decisions 4 gather timeouts + 60 s (gather timeout <= 885 s), summaries as progress, open rounds one gather
# timeout, the config 24 h (join.py) and 10 min (peers.py), the head and the revocation list 7 days.
MAX_EXPIRY = {"progress": 600.0, "summary": 600.0, "round": 3600.0, "group": 3600.0, "open": 3600.0,
              "config": 24 * 3600.0, "head": 7 * 24 * 3600.0, "revoked": 7 * 24 * 3600.0}
# The largest serialized value per kind (bytes, signature and certificate stripped). A progress record with
# MAX_FRAGMENTS fragments, 64-character hashes, the longest strings and MAX_REJECTION_KINDS kinds is ~25 KB; a
# group decision of MAX_GROUP peer ids ~50 KB; a revocation list of MAX_REVOKED peer ids ~50 KB.
MAX_VALUE_BYTES = {"progress": 32_768, "summary": 1024, "round": 512, "group": 65_536, "open": 512, "config": 16_384,
                   "head": 512, "revoked": 65_536}
PEER_ID_KINDS = ("progress", "summary", "round", "open", "head")  # records that claim the peer id of their writer


def config_key(run_id: str) -> str:
    return f"{run_id}_config"


def progress_shard(peer_id: str, shards: int = PROGRESS_SHARDS) -> int:
    """The shard that holds ``peer_id``'s progress record: a hash of the id, so any reader can find one peer's record
    by reading one shard."""
    return int.from_bytes(hashlib.blake2b(peer_id.encode(), digest_size=8).digest(), "big") % shards


def progress_key(run_id: str, shard: int) -> str:
    """Where the progress records of the peers of ``shard`` (``progress_shard``) live, a subkey per peer; with
    ``ALL_SHARDS``, the key a small swarm's daemons write their records under as well."""
    return f"{run_id}_progress" if shard == ALL_SHARDS else f"{run_id}_progress_{shard}"


def progress_keys(run_id: str, shards: int = PROGRESS_SHARDS) -> list[str]:
    return [progress_key(run_id, shard) for shard in range(shards)]


def round_key(run_id: str, fragment: int, version: int, base: str = "") -> str:
    """Where the daemons holding replica ``base`` (a digest) of fragment ``fragment`` at ``version`` meet. Two
    replicas at one version with different digests (a fork) never share a round: averaging the same delta into
    different bases would keep them apart; they are reconciled by adoption (the heavier wins) instead."""
    return f"{run_id}_round_{fragment}_{version}" + (f"_{base}" if base else "")


def head_key(run_id: str) -> str:
    """Where daemons note how far the run got (``HeadRecord``): it outlives them, so that a newcomer that finds no
    live holder of the run's state knows there is one to wait for."""
    return f"{run_id}_head"


def open_rounds_key(run_id: str, fragment: int, version: int, base: str) -> str:
    """Where the round of fragment ``fragment`` at ``version`` from replica ``base`` (a digest) is announced once it
    opened, so that the others holding that replica join it early. Each daemon reads only the keys of the rounds it
    could join, and only the first daemons of a round announce it: a read returns a few announcements, however
    large the swarm."""
    return f"{run_id}_open_{fragment}_{version}_{base}"


def parse_open_round(value: Any) -> Optional[tuple[str, int, int]]:
    """An announcement ``{peer_id, fragment, version}`` as a tuple, or None if malformed."""
    if not isinstance(value, dict) or set(value) != {"peer_id", "fragment", "version"}:
        return None
    peer, fragment, version = value["peer_id"], value["fragment"], value["version"]
    if not (isinstance(peer, str) and 0 < len(peer) < 128 and type(fragment) is int and type(version) is int
            and 0 <= fragment < 4096 and version >= 0):
        return None
    return peer, fragment, version


class ProgressRecord(pydantic.BaseModel):
    """What a daemon publishes about itself every heartbeat. Strict types: no silent conversions."""

    peer_id: constr(strict=True, min_length=1, max_length=128)
    status: StrictStr
    device: constr(strict=True, max_length=128)
    ranks: conint(ge=1, le=1 << 20, strict=True)  # the island's processes (node/island/ranks.py)
    algorithm: constr(strict=True, max_length=32)
    step: conint(ge=0, strict=True)
    version: conint(ge=0, strict=True)  # sum of fragment versions
    fragment_versions: List[conint(ge=0, strict=True)]
    fragment_weights: List[StrictFloat]
    fragment_hashes: List[constr(strict=True, max_length=64)]
    schedule_step: conint(ge=0, strict=True)
    tokens: conint(ge=0, strict=True)
    tokens_per_s: StrictFloat
    loss: Optional[StrictFloat]
    held_out_loss: Optional[StrictFloat]
    # The inner step at which held_out_loss was measured: a reader draws an evaluation once, where it happened.
    held_out_step: Optional[conint(ge=0, strict=True)] = None
    rounds: conint(ge=0, strict=True)
    rounds_skipped: conint(ge=0, strict=True)
    forks_healed: conint(ge=0, strict=True)
    tokens_lost: conint(ge=0, strict=True)
    tokens_carried: conint(ge=0, strict=True) = 0  # work moved onto a newer replica rather than lost
    # Inner steps from a round's snapshot to its merge, over the recent merged rounds (None before the first).
    in_flight_p50: Optional[conint(ge=0, strict=True)] = None
    in_flight_p95: Optional[conint(ge=0, strict=True)] = None
    goodput: StrictFloat
    blocked_s: StrictFloat
    bytes_sent: conint(ge=0, strict=True)
    bytes_received: conint(ge=0, strict=True)
    rejected: conint(ge=0, strict=True)
    rejected_by_kind: Dict[constr(strict=True, min_length=1, max_length=32), conint(ge=0, strict=True)]
    clipped: conint(ge=0, strict=True)
    time: StrictFloat
    # False: behind NAT (``--client-mode``), nobody can open a stream to it; never a reducer or donor.
    reachable: StrictBool

    class Config:
        extra = pydantic.Extra.forbid

    @pydantic.validator("status")
    def _known_status(cls, v: str) -> str:  # noqa: N805 (pydantic signature)
        if v not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}")
        return v

    @pydantic.validator("tokens_per_s", "time", "goodput", "blocked_s")
    def _finite(cls, v: float) -> float:  # noqa: N805
        if not math.isfinite(v) or v < 0:
            raise ValueError("must be finite and non-negative")
        return v

    @pydantic.validator("loss", "held_out_loss")
    def _finite_loss(cls, v: float | None) -> float | None:  # noqa: N805
        if v is not None and not math.isfinite(v):  # an honest daemon publishes None for a loss that is not finite
            raise ValueError("a loss must be finite or null")
        return v

    @pydantic.validator("rejected_by_kind")
    def _few_kinds(cls, v: dict) -> dict:  # noqa: N805
        if len(v) > MAX_REJECTION_KINDS:
            raise ValueError(f"at most {MAX_REJECTION_KINDS} rejection kinds")
        return v

    @pydantic.validator("fragment_weights", each_item=True)
    def _finite_weights(cls, v: float) -> float:  # noqa: N805
        if not math.isfinite(v) or v < 0:
            raise ValueError("fragment weights must be finite and non-negative")
        return v

    @pydantic.root_validator(skip_on_failure=True)
    def _fragments_agree(cls, values: dict) -> dict:  # noqa: N805
        n = len(values["fragment_versions"])
        if not 0 < n <= MAX_FRAGMENTS or len(values["fragment_weights"]) != n or len(values["fragment_hashes"]) != n:
            raise ValueError("fragment lists must be non-empty, at most MAX_FRAGMENTS long and of equal length")
        if values["version"] != sum(values["fragment_versions"]):
            raise ValueError("version must be the sum of fragment versions")
        return values

    def fragment(self, p: int) -> tuple[int, float, str]:
        """The identity of this peer's replica of fragment ``p``."""
        return self.fragment_versions[p], self.fragment_weights[p], self.fragment_hashes[p]


class RunConfigRecord(pydantic.BaseModel):
    """The run's published configuration: a flat mapping of field name to a scalar."""

    fields: Dict[StrictStr, Any]
    started_by: StrictStr
    started_at: StrictFloat
    access: StrictStr = "open"  # "open", or "private": only holders of a join token for ``run_key`` may take part
    run_key: Optional[StrictStr] = None  # fingerprint of a private run's run key (see atoll.protocols.auth)
    # A private run's record is signed by its run key (``config_payload``): a member cannot publish another config
    # (say access "open", or another model) that joiners would take for the run's.
    signature: Optional[StrictBytes] = None

    @pydantic.validator("access")
    def _known_access(cls, v: str) -> str:  # noqa: N805
        if v not in ("open", "private"):
            raise ValueError(f"unknown access {v!r}")
        return v

    class Config:
        extra = pydantic.Extra.forbid


class HeadRecord(pydantic.BaseModel):
    """How far the run got, as one member saw it: its replica's total version at a DHT time."""

    peer_id: constr(strict=True, min_length=1, max_length=128)
    version: conint(ge=0, strict=True)
    time: StrictFloat

    class Config:
        extra = pydantic.Extra.forbid


class RunSchema(pydantic.BaseModel):
    # Progress records live under their shards' keys (``progress_key``), which ``RunRecordValidator`` knows and
    # checks with ``parse_progress``: a second pydantic parse of the most-read records would only cost time.
    config: Dict[BytesWithPublicKey, Optional[RunConfigRecord]]
    head: Dict[BytesWithPublicKey, Optional[HeadRecord]]


def parse_progress(value: Any) -> Optional[ProgressRecord]:
    """A progress record from a DHT value, or None if it is malformed (the DHT may hold foreign data)."""
    try:
        return ProgressRecord.parse_obj(value)
    except (pydantic.ValidationError, TypeError):
        return None


def config_payload(run_id: str, record: RunConfigRecord) -> bytes:
    """What a private run's key signs of its config record: everything but the signature, and the run's id (a
    signature cannot be replayed into another run of the same key)."""
    return msgpack.packb(["atoll-run-config-1", run_id, sorted(record.fields.items()), record.started_by,
                          record.started_at, record.access, record.run_key], use_bin_type=True)


def parse_head(value: Any) -> Optional[HeadRecord]:
    """A run head record from a DHT value, or None if it is malformed."""
    try:
        return HeadRecord.parse_obj(value)
    except (pydantic.ValidationError, TypeError):
        return None


def parse_run_config(value: Any) -> Optional[RunConfigRecord]:
    """A run configuration record from a DHT value, or None if it is malformed."""
    try:
        return RunConfigRecord.parse_obj(value)
    except (pydantic.ValidationError, TypeError):
        return None


def parse_group_record(value: Any) -> Optional[List[List[str]]]:
    """A group decision ``{groups: [[peer ids], ...], time}``: disjoint sorted groups; None if malformed."""
    if not isinstance(value, dict) or set(value) != {"groups", "time"} or not isinstance(value["groups"], list):
        return None
    groups = value["groups"]
    if not 0 < len(groups) <= MAX_GROUP:
        return None
    seen: set[str] = set()
    for members in groups:
        if not isinstance(members, list) or not 0 < len(members) <= MAX_GROUP or not all(
            isinstance(m, str) and 0 < len(m) < 128 for m in members
        ):
            return None
        if len(set(members)) != len(members) or members != sorted(members) or seen & set(members):
            return None
        seen |= set(members)
    if len(seen) > MAX_GROUP:
        return None
    return groups


def revoked_key(run_id: str) -> str:
    """Where the run key's list of revoked members lives (``revocation.RevocationList``)."""
    return f"{run_id}_revoked"


def parse_round_record(value: Any) -> Optional[dict]:
    """A round registration ``{peer_id, weight, time}``, or None if malformed."""
    if not isinstance(value, dict) or set(value) != {"peer_id", "weight", "time"}:
        return None
    peer_id, weight, time_ = value["peer_id"], value["weight"], value["time"]
    if not isinstance(peer_id, str) or not 0 < len(peer_id) < 128:
        return None
    if not isinstance(weight, float) or not math.isfinite(weight) or not 0 < weight <= MAX_ROUND_WEIGHT:
        return None
    if not isinstance(time_, float) or not math.isfinite(time_):
        return None
    return value


def unwrap_subkeys(entry: Any) -> dict[bytes, Any]:
    """Turn ``dht.get(key, latest=True)`` output into ``{subkey: value}``; empty for missing or non-dict values."""
    if entry is None or not isinstance(entry.value, dict):
        return {}
    return {subkey: item.value for subkey, item in entry.value.items() if item is not None}


def replica_key(version: int, weight: float, digest: str) -> tuple[int, float, str]:
    """Order of replicas: a higher version wins, then more merged weight, then the larger hash (tie-break)."""
    return (version, weight, digest)


def heavier(a: tuple[int, float, str], b: tuple[int, float, str]) -> bool:
    """True if replica ``a`` is strictly heavier than ``b``."""
    return replica_key(*a) > replica_key(*b)

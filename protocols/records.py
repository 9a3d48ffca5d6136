"""DHT records of a run: its configuration, per-daemon progress, and round registrations.

Every record lives under a key prefixed with the run id and a subkey that holds its owner's RSA public key
(``[owner:...]``), so hivemind's ``RSASignatureValidator`` lets only the owner write it. Progress and config
records are additionally checked by a pydantic schema (``SchemaValidator``) on every DHT node that stores
them; round registrations are validated by the reader (``parse_round_record``).
"""

from __future__ import annotations

import enum
import math
from typing import Any, Dict, List, Optional

import pydantic.v1 as pydantic
from hivemind.dht.schema import BytesWithPublicKey, RSASignatureValidator, SchemaValidator
from hivemind.dht.validation import RecordValidatorBase
import msgpack
from pydantic.v1 import StrictBytes, StrictFloat, StrictStr, conint, constr

from .auth import JoinToken, MembershipValidator


class Status(enum.StrEnum):
    """A daemon's state as its progress record states it."""

    JOINING = "joining"
    TRAINING = "training"
    LEAVING = "leaving"
    STOPPED = "stopped"  # only in a daemon's final summary, never published


STATUSES = (Status.JOINING.value, Status.TRAINING.value, Status.LEAVING.value)

MAX_FRAGMENTS = 256
MAX_ROUND_WEIGHT = 1e15  # a member's declared weight, in a registration or an averaging part
MAX_NORM = 1e30  # a contribution's declared norm (RDA), from a member or a reducer
MAX_CLOCK_SKEW = 10.0  # seconds another daemon's clock may run ahead of ours before its times are implausible
MAX_REJECTION_KINDS = 32


def config_key(run_id: str) -> str:
    return f"{run_id}_config"


def progress_key(run_id: str) -> str:
    return f"{run_id}_progress"


def round_key(run_id: str, fragment: int, version: int, base: str = "") -> str:
    """Where the daemons holding replica ``base`` (a digest) of fragment ``fragment`` at ``version`` meet. Two
    replicas at one version with different digests (a fork) never share a round: averaging the same delta into
    different bases would keep them apart; they are reconciled by adoption (the heavier wins) instead."""
    return f"{run_id}_round_{fragment}_{version}" + (f"_{base}" if base else "")


def head_key(run_id: str) -> str:
    """Where daemons note how far the run got (``HeadRecord``): it outlives them, so that a newcomer that finds no
    live holder of the run's state knows there is one to wait for."""
    return f"{run_id}_head"


def open_rounds_key(run_id: str) -> str:
    """Where daemons announce the rounds they just registered for, so that others can join them early."""
    return f"{run_id}_open"


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
    rounds: conint(ge=0, strict=True)
    rounds_skipped: conint(ge=0, strict=True)
    forks_healed: conint(ge=0, strict=True)
    tokens_lost: conint(ge=0, strict=True)
    goodput: StrictFloat
    blocked_s: StrictFloat
    bytes_sent: conint(ge=0, strict=True)
    bytes_received: conint(ge=0, strict=True)
    rejected: conint(ge=0, strict=True)
    rejected_by_kind: Dict[constr(strict=True, min_length=1, max_length=32), conint(ge=0, strict=True)]
    clipped: conint(ge=0, strict=True)
    time: StrictFloat

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
    progress: Dict[BytesWithPublicKey, Optional[ProgressRecord]]
    config: Dict[BytesWithPublicKey, Optional[RunConfigRecord]]
    head: Dict[BytesWithPublicKey, Optional[HeadRecord]]


def make_validators(run_id: str, token: Optional[JoinToken] = None) -> list[RecordValidatorBase]:
    """Validators for a daemon's DHT: signatures on owner subkeys, membership, and the run's schema.

    With a join token the daemon signs its records with the token's member key and accepts only records of members
    of the token's run (a private run); without one, it signs with a key of its own and accepts any signed record
    (an open run). The first validator is the signature validator (its ``local_public_key`` is the owner subkey).
    """
    if token is None:
        return [RSASignatureValidator(), MembershipValidator(run_id), SchemaValidator(RunSchema, prefix=run_id)]
    return [RSASignatureValidator(token.member_key),
            MembershipValidator(run_id, token.run_public_key, token.certificate.to_bytes()),
            SchemaValidator(RunSchema, prefix=run_id)]


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

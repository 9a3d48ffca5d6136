"""DHT records of a run: its configuration, per-daemon progress, the run's summaries, and round registrations.

Every record lives under a key prefixed with the run id and a subkey that is exactly its owner's RSA public key
(``[owner:...]``), so hivemind's ``RSASignatureValidator`` lets only the owner write it, and one owner writes one
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
import time as _time
from typing import Any, Callable, Dict, List, Optional, Sequence

import pydantic.v1 as pydantic
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import BytesWithPublicKey, RSASignatureValidator, SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time
import msgpack
from pydantic.v1 import StrictBool, StrictBytes, StrictFloat, StrictStr, conint, constr

from . import validated
from .auth import JoinToken, MembershipValidator, RevocationList, owner_of_subkey, peer_id_of
from .summary import parse_summary, summary_key

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


def make_validators(run_id: str, token: Optional[JoinToken] = None, revocation: Optional[RevocationList] = None,
                    namespaces: Sequence[str] = ()) -> list[RecordValidatorBase]:
    """Validators for a daemon's DHT: signatures on owner subkeys, membership, the run's records, and its schema.

    With a join token the daemon signs its records with the token's member key and accepts only records of members
    of the token's run (a private run) that are not revoked (``revocation``: the list known at start); without one,
    it signs with a key of its own and accepts any signed record (an open run). The first validator is the
    signature validator (its ``local_public_key`` is the owner subkey); the last is the pydantic schema.
    ``namespaces``: more names under which the run's static keys (head, progress) may be written
    (``RunRecordValidator``).
    """
    if token is None:
        return [RSASignatureValidator(), MembershipValidator(run_id), RunRecordValidator(run_id, namespaces=namespaces),
                SchemaValidator(RunSchema, prefix=run_id)]
    return [RSASignatureValidator(token.member_key),
            MembershipValidator(run_id, token.run_public_key, token.certificate.to_bytes()),
            RunRecordValidator(run_id, token.run_public_key, revocation, namespaces=namespaces),
            SchemaValidator(RunSchema, prefix=run_id)]


def _ext_hook(code: int, data: bytes) -> Any:
    """Only hivemind's tuple ext type (0x40) occurs in atoll's values; any other ext type is refused."""
    if code == 0x40:
        return tuple(msgpack.unpackb(data, ext_hook=_ext_hook, raw=False))
    raise ValueError(f"msgpack ext type {code} is not allowed in a record")


def load_value(data: bytes) -> Any:
    """A record's value from its bytes, as hivemind's serializer would load it but refusing ext types other than a
    tuple (a hostile ext value made hivemind's reader fail for good); ``ValueError`` if it does not load."""
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=True)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 (msgpack raises many kinds for garbage)
        raise ValueError(f"undecodable value ({e.__class__.__name__})") from None


def _shape(kind: str, value: Any, run_id: str) -> bool:
    """Whether ``value`` has the shape of a record of ``kind``."""
    if kind == "progress":
        return parse_progress(value) is not None
    if kind == "config":
        return parse_run_config(value) is not None
    if kind == "summary":
        return parse_summary(value) is not None
    if kind == "head":
        return parse_head(value) is not None
    if kind == "open":
        return parse_open_round(value) is not None
    if kind == "round":
        return parse_round_record(value) is not None
    if kind == "group":
        return parse_group_record(value) is not None
    if kind == "revoked":
        return RevocationList.parse(run_id, value) is not None
    return False


class RunRecordValidator(RecordValidatorBase):
    """atoll's rules for every record of the DHT, checked by each node when it stores a record and when it reads
    one (hivemind calls ``validate`` for both), after the signature and the certificate were checked and stripped.

    - The subkey is exactly one owner marker (``auth.owner_of_subkey``): one record per owner key and key.
    - The value is at most ``MAX_VALUE_BYTES`` of its kind and expires at most ``MAX_EXPIRY`` of its kind from now.
    - The value has its kind's shape. The kind of the run's static keys (progress shards, config, summaries,
      head, revocations; head and progress also under the ``namespaces`` given) is known from the key's DHTID. Round
      registrations, group decisions and open-round announcements live under dynamic keys
      (``<run>_round_{fragment}_{version}_{base}``, ``<run>_open_...``) that a DHTID cannot be mapped back to: any
      other key must hold one of those three (in an open run, whose nodes may also hold other runs' records, any of
      atoll's shapes, each with its kind's caps).
    - A progress record lies in its peer's shard (``progress_shard``), or under ``ALL_SHARDS``'s key: nobody can
      crowd another shard's key.
    - In a private run (``run_public_key``): a record claiming a peer id (progress, head, registration, open round)
      claims its signer's (``auth.peer_id_of``: a member's libp2p identity is its member key); its signer is not on
      the revocation list; a revocation list is signed by the run key. Every valid list with a higher serial that
      passes through this validator (stored here, or read from another node) replaces the one it applies.

    Refusals are counted by kind (``refused``) and logged at most once a minute per signing key.
    """

    def __init__(self, run_id: str, run_public_key: Optional[bytes] = None,
                 revocation: Optional[RevocationList] = None, clock: Callable[[], float] = get_dht_time,
                 namespaces: Sequence[str] = ()) -> None:
        self.run_id, self.run_public_key, self.clock = run_id, run_public_key, clock
        self.revocation = revocation
        self.refused: dict[str, int] = {}
        self._last_log: dict[str, float] = {}
        self._kinds: dict[bytes, str] = {}
        self._shards: dict[bytes, int] = {}  # a progress key's shard
        for ns in [run_id, *namespaces]:
            self._kinds[DHTID.generate(source=head_key(ns)).to_bytes()] = "head"
            for shard, name in enumerate(progress_keys(ns)):
                key = DHTID.generate(source=name).to_bytes()
                self._kinds[key], self._shards[key] = "progress", shard
            self._kinds[DHTID.generate(source=progress_key(ns, ALL_SHARDS)).to_bytes()] = "progress"
        self._kinds[DHTID.generate(source=config_key(run_id)).to_bytes()] = "config"
        self._kinds[DHTID.generate(source=summary_key(run_id)).to_bytes()] = "summary"
        self._kinds[DHTID.generate(source=revoked_key(run_id)).to_bytes()] = "revoked"
        self._dynamic = ("round", "group", "open") if run_public_key is not None else (
            "round", "group", "open", "progress", "summary", "head", "config", "revoked")

    @property
    def priority(self) -> int:
        return 1  # after the signature (10) and the certificate (5) were checked and stripped; before the schema

    @property
    def revoked(self) -> frozenset[str]:
        return frozenset(self.revocation.revoked) if self.revocation is not None else frozenset()

    def apply(self, revocation: RevocationList) -> bool:
        """Apply ``revocation`` if it is signed by the run key and newer than the list applied; whether it was."""
        if self.run_public_key is None or not revocation.verify(self.run_public_key):
            return False
        if self.revocation is not None and revocation.serial <= self.revocation.serial:
            return False
        self.revocation = revocation
        validated.forget_all()  # records that passed before may be the revoked members'
        logger.info("applying revocation list %d of run %r: %d member(s) revoked", revocation.serial, self.run_id,
                    len(revocation.revoked))
        return True

    def validate(self, record: DHTRecord) -> bool:
        owner = owner_of_subkey(record.subkey)
        if owner is None:
            return self._refuse("dht_subkey", b"", "its subkey is not exactly one owner key")
        kind = self._kinds.get(record.key)
        kinds = (kind,) if kind is not None else self._dynamic
        if len(record.value) > max(MAX_VALUE_BYTES[k] for k in kinds):
            return self._refuse("dht_size", owner, f"a value of {len(record.value)} bytes")
        try:
            value = load_value(record.value)
        except ValueError as e:
            return self._refuse("dht_schema", owner, str(e))
        kind = next((k for k in kinds if _shape(k, value, self.run_id)), None)
        if kind is None:
            return self._refuse("dht_schema", owner, f"a value that is no {' or '.join(kinds)} record")
        if len(record.value) > MAX_VALUE_BYTES[kind]:
            return self._refuse("dht_size", owner, f"a {kind} value of {len(record.value)} bytes")
        if not record.expiration_time <= self.clock() + MAX_EXPIRY[kind] + MAX_CLOCK_SKEW:
            return self._refuse("dht_expiry", owner, f"a {kind} record expiring in "
                                f"{record.expiration_time - self.clock():.0f} s (at most {MAX_EXPIRY[kind]:.0f})")
        if self.run_public_key is not None:
            signer = peer_id_of(owner)
            if signer is None or signer in self.revoked:
                return self._refuse("dht_revoked", owner, "its signer is revoked")
            if kind in PEER_ID_KINDS and value["peer_id"] != signer:
                return self._refuse("dht_peer_id", owner, f"a {kind} record claiming peer id "
                                                          f"{value['peer_id'][-8:]!r}, not its signer's {signer[-8:]}")
            if kind == "revoked":
                revocation = RevocationList.parse(self.run_id, value)
                if not revocation.verify(self.run_public_key):
                    return self._refuse("dht_revocation", owner, "a revocation list not signed by the run key")
                self.apply(revocation)
        shard = self._shards.get(record.key) if kind == "progress" else None
        if shard is not None and progress_shard(value["peer_id"]) != shard:
            return self._refuse("dht_shard", owner, f"the progress record of peer {value['peer_id'][-8:]!r} in "
                                                    f"shard {shard}, not its own")
        return True

    def _refuse(self, kind: str, owner: bytes, reason: str) -> bool:
        """Count a refused record, and log it at most once a minute per signing key."""
        self.refused[kind] = self.refused.get(kind, 0) + 1
        now, source = _time.monotonic(), hashlib.sha256(owner).hexdigest()[:8]
        if now - self._last_log.get(source, -1e9) > 60:
            if len(self._last_log) > 1000:
                self._last_log.clear()
            self._last_log[source] = now
            logger.warning("refused a DHT record of owner key %s (%s): %s; %d refused so far", source, kind, reason,
                           sum(self.refused.values()))
        return False

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, RunRecordValidator)  # one set of rules per DHT


async def sync_run_validator(revocation: Optional[RevocationList], _dht: Any, node: Any) -> dict[str, int]:
    """Run in the DHT's process (``dht_io.run_in_dht``, with ``functools.partial``): apply ``revocation`` to the
    DHT's ``RunRecordValidator`` (if newer than its own) and return the refusal counts by kind of it and of the
    ``MembershipValidator``."""
    counts: dict[str, int] = {}
    for validator in getattr(node.protocol.record_validator, "_validators", ()):
        if isinstance(validator, RunRecordValidator) and revocation is not None:
            validator.apply(revocation)
        if isinstance(validator, (RunRecordValidator, MembershipValidator)):
            for kind, count in validator.refused.items():
                counts[kind] = counts.get(kind, 0) + count
    return counts


def _validate_dictionary_per_subkey(self: DHTProtocol, key_bytes: bytes, dictionary: Any) -> bool:
    """hivemind's ``DHTProtocol._validate_dictionary``, except that an invalid subkey is dropped alone instead of
    failing the whole dictionary: with the stock rule, one record that became invalid (its signer was revoked, its
    certificate expired) or that a node without atoll's validators stored would hide every honest record under its
    key from each reader. Returns False only if no subkey is valid. A record that passed the same validator
    moments ago is not checked again (``validated``)."""
    if self.record_validator is None:
        return True
    memory = validated.memory_of(self.record_validator)
    invalid = []
    with dictionary.freeze():
        for subkey, (value_bytes, expiration_time) in dictionary.items():
            record = DHTRecord(key_bytes, self.serializer.dumps(subkey), value_bytes, expiration_time)
            if not memory.validate(self.record_validator, record):
                invalid.append(subkey)
    for subkey in invalid:
        del dictionary[subkey]
    if invalid:
        dictionary.latest_expiration_time = max((exp for _, (_, exp) in dictionary.items()), default=float("-inf"))
    return len(dictionary) > 0 or not invalid


DHTProtocol._validate_dictionary = _validate_dictionary_per_subkey  # in every process that imports atoll's records


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
    """Where the run key's list of revoked members lives (``auth.RevocationList``)."""
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

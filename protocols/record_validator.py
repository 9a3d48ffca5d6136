"""What a DHT node of a run accepts: ``make_validators`` builds the validators a daemon's (or a client's) DHT
node checks every stored and returned record with, ``RunRecordValidator`` is the run's own (the owner subkey, a size
cap and an expiry cap per kind of key, the value's shape), and hivemind's per-key dictionary check is replaced so
that one invalid subkey is dropped alone. The schemas and keys it checks against are ``records.py``'s.
"""
from __future__ import annotations

import hashlib
import logging
import time as _time
from typing import Any, Callable, Optional, Sequence

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time
import msgpack

from . import validated
from .auth import JoinToken, MembershipValidator
from .identity import RecordSigner, owner_of_subkey, peer_id_of
from .revocation import RevocationList
from .summary import parse_summary, summary_key

logger = logging.getLogger("atoll")
from .records import (ALL_SHARDS, MAX_CLOCK_SKEW, MAX_EXPIRY, MAX_VALUE_BYTES, PEER_ID_KINDS, RunSchema, config_key, head_key, parse_group_record, parse_head, parse_open_round, parse_progress, parse_round_record, parse_run_config, progress_key, progress_keys, progress_shard, revoked_key)

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
        return [RecordSigner(), MembershipValidator(run_id), RunRecordValidator(run_id, namespaces=namespaces),
                SchemaValidator(RunSchema, prefix=run_id)]
    return [RecordSigner(token.member_key),
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

    - The subkey is exactly one owner marker (``identity.owner_of_subkey``): one record per owner key and key.
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
      claims its signer's (``identity.peer_id_of``: a member's libp2p identity is its member key); its signer is not on
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
        if isinstance(validator, RecordSigner) and validator.refused:
            counts["dht_signature"] = counts.get("dht_signature", 0) + validator.refused
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

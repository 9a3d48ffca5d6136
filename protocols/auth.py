"""Private runs: a run key, signed membership certificates (join tokens), and the DHT validator that enforces them.

The daemon that starts a private run creates a **run key** (Ed25519). Any holder of the run key issues **join tokens**.
A join token is a file holding a fresh Ed25519 key (the member key, which signs the member's DHT records:
``identity.RecordSigner``) and a **certificate**: the run key's signature over (run id, run public key, member public
key, expiry). Only the certificate travels: every DHT record a member writes carries it (``[member:...]`` appended
before the owner's signature, so the signature covers it), and every daemon of a private run refuses, on store
and on read, any record that lacks a certificate binding the record's owner key to the run key. A record carries only
the certificate's *proof* (its expiry and the run key's signature, ``Certificate.proof``): a reader who can check it
knows the run's id and key already, and the member key is the record's owner key, in its subkey (docs/design.md,
"A record carries its certificate's proof"). The run's averaging rounds are formed from those records and its
state is served only to peers that published one, so a daemon without a token can neither write the run's records,
join its rounds, nor download its state.

An observer of the DHT learns certificates but not member keys: a copied certificate is useless without the private
key its owner signs records with.

**One identity per token.** A member's libp2p identity is its member key (``identity_file``), so its peer id is the
key its records are signed with (``identity.peer_id_of``); every reader checks that a record's claimed peer id is
its signer's, and a record's subkey must be exactly one owner marker, so one token is one peer, one record per key.

**Revocation.** A holder of the run key signs a ``RevocationList`` (the peer ids of revoked members, a serial that
only grows) and stores it under ``<run>_revoked``; members read it periodically, republish it, keep it on disk, and
from then on refuse the revoked members' records (``record_validator.RunRecordValidator``) and requests (``is_member``).
A token is also invalid once it expires (``expires_at``, 0 = never).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from .identity import OWNER_RE, MemberKey, owner_of_subkey

CERT_VERSION = 1
MAX_CERT_BYTES = 2048  # a member key (its peer id) is 52 bytes; the certificate about 190
TOKEN_FORMAT = "atoll-join-token-2"  # 1: an RSA member key, before they were Ed25519
_MEMBER_RE = re.compile(rb"\[member:([A-Za-z0-9+/=]+)\]$")
_MEMBER_FORMAT = b"[member:%s]"
MAX_PROOF_BYTES = 96  # msgpack of [a float, 64 bytes]: 76
logger = logging.getLogger("atoll")


class AuthError(ValueError):
    """A run key, join token or certificate that is missing, malformed, forged, expired or for another run."""


def signed_by(run_public_key: bytes, payload: bytes, signature: bytes | None) -> bool:
    """Whether ``signature`` is the run key's signature of ``payload``."""
    if not isinstance(signature, bytes):
        return False
    try:
        Ed25519PublicKey.from_public_bytes(run_public_key).verify(signature, payload)
        return True
    except (InvalidSignature, ValueError):
        return False


def fingerprint(run_public_key: bytes) -> str:
    """Short, stable name of a run key (shown in logs and published in the run's config record)."""
    return hashlib.sha256(run_public_key).hexdigest()[:16]


@dataclass(frozen=True)
class Certificate:
    """The run key's statement that ``member_key`` (a member key's peer id, ``identity.MemberKey.owner``) belongs to
    run ``run_id``."""

    run_id: str
    run_public_key: bytes  # raw Ed25519, 32 bytes
    member_key: bytes
    expires_at: float  # unix time; 0: never
    signature: bytes = b""

    def payload(self) -> bytes:
        return msgpack.packb([CERT_VERSION, self.run_id, self.run_public_key, self.member_key, self.expires_at])

    def to_bytes(self) -> bytes:
        return msgpack.packb([self.payload(), self.signature])

    def proof(self) -> bytes:
        """What a record carries of the certificate: its expiry and signature. The rest is the reader's own (the run's
        id and key) or the record's (the member key is its owner key): ``from_proof`` puts them back."""
        return msgpack.packb([self.expires_at, self.signature])

    @classmethod
    def from_proof(cls, data: bytes, run_id: str, run_public_key: bytes, member_key: bytes) -> Certificate:
        """The certificate a record's ``proof`` stands for, given what the reader knows and the record's owner key
        (parsed, not verified); ``AuthError`` if it is not a proof."""
        if len(data) > MAX_PROOF_BYTES:
            raise AuthError(f"certificate proof of {len(data)} bytes exceeds {MAX_PROOF_BYTES}")
        try:
            expires_at, signature = msgpack.unpackb(data)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise AuthError(f"malformed certificate proof ({e.__class__.__name__})") from None
        if not (isinstance(expires_at, float) and isinstance(signature, bytes) and len(signature) == 64):
            raise AuthError("malformed certificate proof fields")
        return cls(run_id, run_public_key, member_key, expires_at, signature)

    @classmethod
    def from_bytes(cls, data: bytes) -> Certificate:
        """Parse (not verify) a certificate; ``AuthError`` if it is not one."""
        if len(data) > MAX_CERT_BYTES:
            raise AuthError(f"certificate of {len(data)} bytes exceeds {MAX_CERT_BYTES}")
        try:
            payload, signature = msgpack.unpackb(data)
            version, run_id, run_public_key, member_key, expires_at = msgpack.unpackb(payload)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise AuthError(f"malformed certificate ({e.__class__.__name__})") from None
        if version != CERT_VERSION:
            raise AuthError(f"certificate version {version!r} is not {CERT_VERSION}")
        if not (isinstance(run_id, str) and isinstance(run_public_key, bytes) and len(run_public_key) == 32
                and isinstance(member_key, bytes) and 0 < len(member_key) <= 1024
                and isinstance(expires_at, float) and isinstance(signature, bytes) and len(signature) == 64):
            raise AuthError("malformed certificate fields")
        return cls(run_id, run_public_key, member_key, expires_at, signature)

    def verify(self, run_id: str, run_public_key: bytes, now: float | None = None) -> None:
        """Raise ``AuthError`` unless the run key signed this certificate for ``run_id`` and it has not expired."""
        if self.run_public_key != run_public_key:
            raise AuthError(f"certificate is for run key {fingerprint(self.run_public_key)}, "
                            f"this run's is {fingerprint(run_public_key)}")
        if self.run_id != run_id:
            raise AuthError(f"certificate is for run {self.run_id!r}, not {run_id!r}")
        try:
            Ed25519PublicKey.from_public_bytes(run_public_key).verify(self.signature, self.payload())
        except InvalidSignature:
            raise AuthError("certificate signature is invalid") from None
        if self.expires_at and (time.time() if now is None else now) > self.expires_at:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.expires_at))
            raise AuthError(f"certificate expired at {when} UTC")


class RunKey:
    """The private key of a run: whoever holds it admits members (issues join tokens)."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key

    @classmethod
    def generate(cls) -> RunKey:
        return cls(Ed25519PrivateKey.generate())

    @property
    def public_bytes(self) -> bytes:
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        return self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def save(self, path: str | os.PathLike) -> None:
        """Write the key readable by its owner only (atomically: a crash leaves no half-written key)."""
        from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

        raw = self._key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        _write_private(Path(path), json.dumps({"format": "atoll-run-key-1",
                                               "private_key": base64.b64encode(raw).decode()}))

    @classmethod
    def load(cls, path: str | os.PathLike) -> RunKey:
        try:
            doc = json.loads(Path(path).read_text())
            if doc.get("format") != "atoll-run-key-1":
                raise ValueError("not an atoll run key")
            return cls(Ed25519PrivateKey.from_private_bytes(base64.b64decode(doc["private_key"], validate=True)))
        except FileNotFoundError:
            raise AuthError(f"run key {str(path)!r} does not exist") from None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise AuthError(f"run key {str(path)!r} is unreadable ({e})") from None

    @classmethod
    def load_or_create(cls, path: str | os.PathLike) -> tuple[RunKey, bool]:
        """The key at ``path``, created there if missing; the flag says whether it was created."""
        if Path(path).exists():
            return cls.load(path), False
        key = cls.generate()
        key.save(path)
        return key, True

    def sign(self, payload: bytes) -> bytes:
        """An Ed25519 signature of ``payload`` (the run's config record; see ``records.config_payload``)."""
        return self._key.sign(payload)

    def certify(self, run_id: str, member_key: bytes, expires_at: float = 0.0) -> Certificate:
        cert = Certificate(run_id, self.public_bytes, member_key, float(expires_at))
        return Certificate(run_id, self.public_bytes, member_key, float(expires_at), self._key.sign(cert.payload()))

    def issue_token(self, run_id: str, expires_at: float = 0.0) -> JoinToken:
        """A new member: a fresh member key and its certificate."""
        member = MemberKey.generate()
        return JoinToken(member, self.certify(run_id, member.owner, expires_at))


@dataclass(frozen=True)
class JoinToken:
    """What a member daemon needs: its private member key and the run key's certificate for it."""

    member_key: MemberKey
    certificate: Certificate

    @property
    def run_id(self) -> str:
        return self.certificate.run_id

    @property
    def run_public_key(self) -> bytes:
        return self.certificate.run_public_key

    def save(self, path: str | os.PathLike) -> None:
        _write_private(Path(path), json.dumps({
            "format": TOKEN_FORMAT, "run_id": self.run_id, "run_key": fingerprint(self.run_public_key),
            "certificate": base64.b64encode(self.certificate.to_bytes()).decode(),
            "member_key": base64.b64encode(self.member_key.to_bytes()).decode(),
        }, indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike) -> JoinToken:
        """Read and check a token file: ``AuthError`` if it is missing, malformed, not self-consistent or expired."""
        try:
            doc = json.loads(Path(path).read_text())
            if isinstance(doc, dict) and doc.get("format") == "atoll-join-token-1":
                raise ValueError("issued by an older atoll (an RSA member key): ask the run's owner for a new one")
            if not isinstance(doc, dict) or doc.get("format") != TOKEN_FORMAT:
                raise ValueError(f"not an atoll join token (format {TOKEN_FORMAT!r} expected)")
            cert = Certificate.from_bytes(base64.b64decode(doc["certificate"], validate=True))
            member = MemberKey.from_bytes(base64.b64decode(doc["member_key"], validate=True))
        except FileNotFoundError:
            raise AuthError(f"join token {str(path)!r} does not exist") from None
        except AuthError as e:
            raise AuthError(f"join token {str(path)!r}: {e}") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise AuthError(f"join token {str(path)!r} is unreadable ({e})") from None
        token = cls(member, cert)
        if member.owner != cert.member_key:
            raise AuthError(f"join token {str(path)!r}: its certificate is for another member key")
        try:
            cert.verify(cert.run_id, cert.run_public_key)
        except AuthError as e:
            raise AuthError(f"join token {str(path)!r}: {e}") from None
        return token


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class MembershipValidator(RecordValidatorBase):
    """Enforces membership on every DHT record of a private run; strips certificates in an open one.

    With ``run_public_key`` None (an open run, or a client that only reads), records are accepted and a certificate,
    if present, is stripped (so that a daemon without a token can still read a private run's config and say that it
    is private). Otherwise a record is valid only if its subkey names an owner key and its value ends with the proof
    of a certificate for that key (``Certificate.proof``), signed by the run key, for this run, not expired.
    Verified proofs are cached with their owner key.

    Priority 5: signing appends the certificate before ``identity.RecordSigner`` (priority 10) signs the value, and
    validation checks it after that signature was checked and stripped.
    """

    def __init__(self, run_id: str, run_public_key: bytes | None = None, certificate: bytes | None = None) -> None:
        self.run_id, self.run_public_key = run_id, run_public_key
        self._suffix = (_MEMBER_FORMAT % base64.b64encode(Certificate.from_bytes(certificate).proof())
                        if certificate is not None else b"")
        self._verified: dict[tuple[bytes, bytes], float] = {}  # (proof, member key) -> expiry or 0
        self._last_log: dict[str, float] = {}
        # By kind ("dht_member"), read by the daemon (record_validator.sync_run_validator).
        self.refused: dict[str, int] = {}

    @property
    def priority(self) -> int:
        return 5

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value + self._suffix

    def strip_value(self, record: DHTRecord) -> bytes:
        return _MEMBER_RE.sub(b"", record.value)

    def validate(self, record: DHTRecord) -> bool:
        if self.run_public_key is None:
            return True
        owner = owner_of_subkey(record.subkey)
        owners = [owner] if owner is not None else OWNER_RE.findall(record.subkey or b"")[:1]
        match = _MEMBER_RE.search(record.value)
        if owner is None or match is None:
            self._refused(owners[0] if owners else b"", "no membership certificate")
            return False
        try:
            proof = base64.b64decode(match.group(1), validate=True)
        except ValueError:
            self._refused(owners[0], "malformed certificate")
            return False
        if not self.member_of_run(proof, owners[0]):
            self._refused(owners[0], "certificate not valid for this run and owner")
            return False
        return True

    def _refused(self, owner: bytes, reason: str) -> None:
        """Log a refused record, at most once a minute per owner (a flood of bad records must not flood the log)."""
        self.refused["dht_member"] = self.refused.get("dht_member", 0) + 1
        now, key = time.monotonic(), hashlib.sha256(owner).hexdigest()[:8]
        if now - self._last_log.get(key, -1e9) > 60:
            if len(self._last_log) > 1000:
                self._last_log.clear()
            self._last_log[key] = now
            logger.warning("refused a DHT record of owner key %s: %s (the run is private)", key, reason)

    def member_of_run(self, proof: bytes, owner_key: bytes) -> bool:
        """True if ``proof`` proves a valid, unexpired certificate of this run for ``owner_key``."""
        assert self.run_public_key is not None
        expires = self._verified.get((proof, owner_key))
        if expires is None:
            try:
                cert = Certificate.from_proof(proof, self.run_id, self.run_public_key, owner_key)
                cert.verify(self.run_id, self.run_public_key)
            except AuthError:
                return False
            if len(self._verified) > 10_000:  # many distinct valid certificates cannot grow the cache forever
                self._verified.clear()
            expires = self._verified[(proof, owner_key)] = cert.expires_at
        return not (expires and time.time() > expires)

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, MembershipValidator)  # one is enough; a second would append a second certificate

"""A member's key: its libp2p identity, its peer id, its owner marker, and the signature on its DHT records.

A member key is an Ed25519 key (``MemberKey``). Its libp2p peer id holds the public key itself (libp2p's identity
multihash for keys of at most 42 bytes, the ``12D3KooW...`` form), so the owner marker of a record's subkey is that
peer id (``[owner:12D3KooW...]``): a reader gets the record's signer, its peer id and the key to check its signature
from the one marker, with no hash or look-up. ``RecordSigner`` signs and checks records as hivemind's
``RSASignatureValidator`` does (a marker in the key or subkey protects the record; its value carries one
signature over the record with the signature stripped), with a 64-byte signature instead of RSA's 256 and a 52-byte
marker instead of an OpenSSH RSA key's 372: every record of the run is about 600 bytes smaller.
"""

from __future__ import annotations

import base64
import dataclasses
import re

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

# An Ed25519 public key as a libp2p PublicKey protobuf (type 1, 32 bytes of data), in an identity multihash.
_ED25519_PREFIX = b"\x00\x24" + b"\x08\x01\x12\x20"
_ED25519_PEER_ID_RE = re.compile(r"12D3KooW[1-9A-HJ-NP-Za-km-z]{44}")
_RSA_PEER_ID_RE = re.compile(r"Qm[1-9A-HJ-NP-Za-km-z]{44}")  # a sha2-256 multihash: open runs' hivemind identities
_OWNER_SUBKEY_RE = re.compile(rb"\[owner:(12D3KooW[1-9A-HJ-NP-Za-km-z]{44})\]")
OWNER_RE = re.compile(rb"\[owner:(.+?)\]")  # any owner marker, well-formed or not
# A signed value ends with its one signature; nothing else in it may look like one. A loose marker accepted anywhere
# let a member pad a signed value with megabytes that the signature did not cover and stripping removed, past every
# per-record size cap (the review of this change).
_SIGNATURE_SUFFIX_RE = re.compile(rb"\[signature:([A-Za-z0-9+/]{86}==)\]\Z")
_SIGNATURE_MARKER = b"[signature:"
OWNER_FORMAT = b"[owner:%s]"
SIGNATURE_FORMAT = b"[signature:%s]"


class IdentityError(ValueError):
    """A key or identity file that is not an Ed25519 member key."""


def _b58decode(text: str) -> bytes:
    import base58

    return base58.b58decode(text)


def _b58encode(data: bytes) -> str:
    import base58

    return base58.b58encode(data).decode()


class MemberKey:
    """A member's Ed25519 private key: it signs the member's DHT records and is its libp2p identity."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.public_bytes = public
        self.peer_id = _b58encode(_ED25519_PREFIX + public)

    @classmethod
    def generate(cls) -> MemberKey:
        return cls(Ed25519PrivateKey.generate())

    @property
    def owner(self) -> bytes:
        """The key as records name their owner (and certificates their member): its peer id."""
        return self.peer_id.encode()

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def to_bytes(self) -> bytes:
        """The 32-byte private seed."""
        return self._key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    @classmethod
    def from_bytes(cls, seed: bytes) -> MemberKey:
        try:
            return cls(Ed25519PrivateKey.from_private_bytes(seed))
        except (ValueError, TypeError) as e:
            raise IdentityError(f"not an Ed25519 private key ({e})") from None

    def identity_bytes(self) -> bytes:
        """The key as a libp2p identity file (protobuf ``PrivateKey``, type Ed25519: the seed and the public key),
        what ``P2P.create(identity_path=...)`` passes to p2pd."""
        from hivemind.proto import crypto_pb2

        return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519,
                                     data=self.to_bytes() + self.public_bytes).SerializeToString()

    @classmethod
    def from_identity(cls, data: bytes) -> MemberKey:
        """The key of a libp2p identity file; ``IdentityError`` if it is not an Ed25519 identity (an RSA one is
        what atoll wrote before its member keys were Ed25519)."""
        from hivemind.proto import crypto_pb2

        try:
            proto = crypto_pb2.PrivateKey.FromString(data)
        except Exception as e:  # noqa: BLE001 (protobuf raises several kinds for garbage)
            raise IdentityError(f"not a libp2p identity ({e.__class__.__name__})") from None
        if proto.key_type == crypto_pb2.KeyType.RSA:
            raise IdentityError("an RSA identity, which an older atoll wrote; member keys are Ed25519 now: delete "
                                "the file to have a new one made")
        if proto.key_type != crypto_pb2.KeyType.Ed25519 or len(proto.data) != 64:
            raise IdentityError("not a libp2p Ed25519 identity")
        key = cls.from_bytes(proto.data[:32])
        if key.public_bytes != proto.data[32:]:
            raise IdentityError("a libp2p Ed25519 identity whose public key is not its private key's")
        return key


def public_key_of(owner: bytes | str) -> Ed25519PublicKey | None:
    """The Ed25519 public key an owner marker (a peer id of the ``12D3KooW`` form) names; None for anything else."""
    text = owner.decode("ascii", "replace") if isinstance(owner, bytes) else owner
    if not isinstance(text, str) or not _ED25519_PEER_ID_RE.fullmatch(text):
        return None
    try:
        raw = _b58decode(text)
    except ValueError:
        return None
    if len(raw) != len(_ED25519_PREFIX) + 32 or not raw.startswith(_ED25519_PREFIX):
        return None
    return Ed25519PublicKey.from_public_bytes(raw[len(_ED25519_PREFIX):])


def peer_id_of(owner: bytes) -> str | None:
    """The libp2p peer id of the member whose owner marker (and identity) is ``owner``: the marker is that peer id.
    None if ``owner`` is not an Ed25519 member key."""
    return owner.decode() if public_key_of(owner) is not None else None


def is_peer_id(text: object) -> bool:
    """Whether ``text`` is a base58 libp2p peer id: an Ed25519 key's (``12D3KooW...``, a member's) or a sha2-256
    multihash (``Qm...``: an RSA identity, as hivemind makes for an open run's daemon)."""
    if not isinstance(text, str):
        return False
    if _ED25519_PEER_ID_RE.fullmatch(text):
        return public_key_of(text) is not None
    if not _RSA_PEER_ID_RE.fullmatch(text):
        return False
    raw = _b58decode(text)
    return len(raw) == 34 and raw[:2] == b"\x12\x20"


def owner_of_subkey(subkey: bytes | None) -> bytes | None:
    """The owner (a member's peer id) of a DHT record whose serialized subkey is exactly one ``[owner:PEER_ID]``
    marker, in hivemind's canonical encoding; None for anything else (no subkey, extra bytes before or after the
    marker, two markers, another encoding). A signature validator checks only that the owner signed: without this,
    one key could write any number of records under one key (``[owner:K]fake1``, ``[owner:K]fake2``, ...)."""
    if not isinstance(subkey, bytes) or len(subkey) > 4096:
        return None
    try:
        raw = MSGPackSerializer.loads(subkey)
    except Exception:  # noqa: BLE001 (any undecodable subkey is simply not an owner marker)
        return None
    if not isinstance(raw, bytes) or MSGPackSerializer.dumps(raw) != subkey:
        return None
    return owner_of_raw_subkey(raw)


def owner_of_raw_subkey(raw: object) -> bytes | None:
    """``owner_of_subkey`` for a subkey as the DHT returns it to its caller (deserialized)."""
    match = _OWNER_SUBKEY_RE.fullmatch(raw) if isinstance(raw, bytes) else None
    return match.group(1) if match else None


class RecordSigner(RecordValidatorBase):
    """Signs this member's DHT records and checks everyone's, as hivemind's ``RSASignatureValidator`` does with
    Ed25519 member keys: a record whose key or subkey holds an ``[owner:PEER_ID]`` marker is protected, its value
    must end with exactly one ``[signature:...]`` of the owner's key over the record without it (in canonical
    base64, and no other signature marker in the value), and only the owner can write it. A record with no marker
    is not this validator's to refuse (``RunRecordValidator`` requires one); markers of two owners, a marker that
    is no member key, or a missing or wrong signature are refused.
    Priority 10: it signs last (the certificate's proof appended before it is covered) and checks first.
    """

    def __init__(self, key: MemberKey | None = None) -> None:
        self._key = key if key is not None else MemberKey.generate()
        self._marker = OWNER_FORMAT % self._key.owner
        self.refused = 0

    @property
    def local_public_key(self) -> bytes:
        """This member's owner marker: what its subkeys are (the name is hivemind's)."""
        return self._marker

    @property
    def priority(self) -> int:
        return 10

    def sign_value(self, record: DHTRecord) -> bytes:
        if self._marker not in record.key and self._marker not in (record.subkey or b""):
            return record.value
        signature = base64.b64encode(self._key.sign(_payload(record)))
        return record.value + SIGNATURE_FORMAT % signature

    def strip_value(self, record: DHTRecord) -> bytes:
        match = _SIGNATURE_SUFFIX_RE.search(record.value)
        return record.value[:match.start()] if match else record.value

    def validate(self, record: DHTRecord) -> bool:
        """Whether ``record`` is unowned, or its one owner signed it: its value is the signed bytes followed by one
        signature in canonical base64, and nothing before it looks like a signature (one encoding per record)."""
        owners = set(OWNER_RE.findall(record.key)) | set(OWNER_RE.findall(record.subkey or b""))
        if not owners:
            return True
        public = public_key_of(next(iter(owners))) if len(owners) == 1 else None
        match = _SIGNATURE_SUFFIX_RE.search(record.value)
        if public is None or match is None or record.value.count(_SIGNATURE_MARKER) != 1:
            self.refused += 1
            return False
        signature = base64.b64decode(match.group(1))
        if base64.b64encode(signature) != match.group(1):  # the last character's unused bits must be zero
            self.refused += 1
            return False
        try:
            public.verify(signature, _payload(dataclasses.replace(record, value=record.value[:match.start()])))
        except InvalidSignature:
            self.refused += 1
            return False
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, RecordSigner)  # one signer per DHT


def _payload(record: DHTRecord) -> bytes:
    """What a signature covers: the record (key, subkey, value without the signature, expiry), as hivemind's
    ``RSASignatureValidator`` serializes it."""
    return MSGPackSerializer.dumps(dataclasses.astuple(record))


def _patch_peer_id_from_identity() -> None:
    """hivemind's ``PeerID.from_identity`` (which its P2P uses to check that an identity file is not taken by a live
    peer) reads only RSA identities; an Ed25519 identity's peer id is its identity multihash."""
    from hivemind.p2p import PeerID

    original = PeerID.from_identity.__func__
    if getattr(original, "atoll_ed25519", False):
        return

    def from_identity(cls, data: bytes) -> PeerID:  # noqa: ANN001 (a classmethod of hivemind's)
        try:
            return cls(_b58decode(MemberKey.from_identity(data).peer_id))
        except IdentityError:
            return original(cls, data)

    from_identity.atoll_ed25519 = True
    PeerID.from_identity = classmethod(from_identity)


_patch_peer_id_from_identity()

__all__ = ["IdentityError", "MemberKey", "RecordSigner", "is_peer_id", "owner_of_raw_subkey", "owner_of_subkey",
           "peer_id_of", "public_key_of"]

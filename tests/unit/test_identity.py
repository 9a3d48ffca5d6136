"""Member keys: their identity files and peer ids, and the signature on every DHT record (no sockets)."""

import base64
import dataclasses
import json

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

from atoll.node.config import ConfigError, NodeConfig
from atoll.node.rounds.join import membership
from atoll.protocols.auth import AuthError, JoinToken, RunKey
from atoll.protocols.identity import IdentityError, MemberKey, RecordSigner, is_peer_id, peer_id_of, public_key_of
from atoll.protocols.record_validator import make_validators
from atoll.protocols.records import round_key

RUN = "run1"


def _signed(signer: RecordSigner, key: bytes, subkey: bytes, value: bytes) -> DHTRecord:
    record = DHTRecord(key, subkey, value, get_dht_time() + 30)
    return dataclasses.replace(record, value=signer.sign_value(record))


def test_a_member_key_is_its_peer_id_and_its_identity_file():
    key = MemberKey.generate()
    assert key.peer_id.startswith("12D3KooW") and len(key.peer_id) == 52 and is_peer_id(key.peer_id)
    assert key.owner == key.peer_id.encode() and peer_id_of(key.owner) == key.peer_id
    assert public_key_of(key.owner) is not None
    assert public_key_of(key.peer_id[:-1]) is None and public_key_of(key.peer_id + "x") is None  # length
    assert public_key_of("QmRLgQKGKyWcvCzjjQ3qLndsCNgPJJusj3CMSwecqJWHTR") is None  # an RSA key's hash names no key
    # The identity file p2pd reads gives the same peer id (hivemind's check that an identity is free reads it too).
    again = MemberKey.from_identity(key.identity_bytes())
    assert again.peer_id == key.peer_id and str(PeerID.from_identity(key.identity_bytes())) == key.peer_id
    assert MemberKey.from_bytes(key.to_bytes()).peer_id == key.peer_id
    rsa = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes()).SerializeToString()
    with pytest.raises(IdentityError, match="RSA identity, which an older atoll wrote"):
        MemberKey.from_identity(rsa)
    with pytest.raises(IdentityError, match="not a libp2p identity"):
        MemberKey.from_identity(b"\xff" * 40)
    lying = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519,
                                  data=key.to_bytes() + MemberKey.generate().public_bytes).SerializeToString()
    with pytest.raises(IdentityError, match="whose public key is not its private key's"):
        MemberKey.from_identity(lying)


def test_a_record_is_signed_by_its_owner_and_checked_against_the_key_its_marker_names():
    alice, bob = RecordSigner(MemberKey.generate()), RecordSigner(MemberKey.generate())
    key, value = b"k" * 20, MSGPackSerializer.dumps({"a": 1})
    subkey = MSGPackSerializer.dumps(alice.local_public_key)
    record = _signed(alice, key, subkey, value)
    assert record.value != value and bob.validate(record) and alice.validate(record)
    assert bob.strip_value(record) == value
    refused = [
        dataclasses.replace(record, value=record.value.replace(value, MSGPackSerializer.dumps({"a": 2}))),  # tampered
        dataclasses.replace(record, expiration_time=record.expiration_time + 3600),  # kept alive longer
        dataclasses.replace(record, value=value),  # no signature
        dataclasses.replace(record, value=record.value + record.value[len(value):]),  # two
        _signed(bob, key, subkey, value),  # bob cannot sign under alice's marker (bob's signer does not sign it)
        dataclasses.replace(_signed(bob, key, MSGPackSerializer.dumps(bob.local_public_key), value), subkey=subkey),
        _signed(alice, key + bob.local_public_key, subkey, value),  # two owners
        dataclasses.replace(record, subkey=MSGPackSerializer.dumps(b"[owner:ssh-rsa AAAA]")),  # not a member key
    ]
    # One record, one encoding: the signature ends the value, once, in canonical base64. A loose marker let a member
    # pad a signed value with bytes the signature did not cover and the strip removed (past every size cap).
    suffix = record.value[len(value):]
    b64 = suffix[len(b"[signature:"):-1]
    alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    noncanonical = b64[:85] + bytes([alphabet[alphabet.index(b64[85]) ^ 1]]) + b"=="
    assert base64.b64decode(noncanonical) == base64.b64decode(b64) and noncanonical != b64
    refused += [
        dataclasses.replace(record, value=value + b"[signature:" + b"x" * 100_000 + suffix),  # padded
        dataclasses.replace(record, value=value[:2] + suffix + value[2:]),  # moved
        dataclasses.replace(record, value=value + b"[signature:]" + suffix),
        dataclasses.replace(record, value=value + suffix[:-1] + b"\n]"),
        dataclasses.replace(record, value=value + b"[signature:" + noncanonical + b"]"),
        dataclasses.replace(record, value=record.value + b"\n"),
    ]
    for i, bad in enumerate(refused):
        assert not bob.validate(bad), i
        assert not CompositeValidator([RecordSigner()]).validate(bad), i
    assert bob.refused == len(refused)
    assert bob.validate(DHTRecord(key, MSGPackSerializer.dumps(b"plain"), value, record.expiration_time))  # unowned


def test_a_record_of_a_member_is_600_bytes_smaller_than_with_rsa():
    """A round registration as a member stores it (value, certificate's proof, signature; its owner subkey): with an
    RSA member key it was 1,039 bytes a store (docs/results.md, #37), of which 744 were the key and signature."""
    token = RunKey.generate().issue_token(RUN)
    validators = make_validators(RUN, token)
    value = {"peer_id": token.member_key.peer_id, "weight": 1.0, "time": float(get_dht_time())}
    subkey = MSGPackSerializer.dumps(validators[0].local_public_key)
    record = DHTRecord(DHTID.generate(source=round_key(RUN, 0, 5, "ab" * 8)).to_bytes(), subkey,
                       MSGPackSerializer.dumps(value), get_dht_time() + 30)
    chain = CompositeValidator(validators)
    signed = dataclasses.replace(record, value=chain.sign_value(record))
    assert chain.validate(signed) and MSGPackSerializer.loads(chain.strip_value(signed)) == value
    size = len(signed.value) + len(signed.subkey)
    assert size < 400, size
    assert len(signed.value) - len(record.value) < 250  # the proof (104 bytes in base64 and marker) and signature


def test_a_join_token_of_an_older_atoll_is_refused_in_one_line(tmp_path):
    token = RunKey.generate().issue_token(RUN)
    path = tmp_path / "member.token"
    token.save(path)
    assert JoinToken.load(path).member_key.peer_id == token.member_key.peer_id
    doc = json.loads(path.read_text())
    doc["format"] = "atoll-join-token-1"
    doc["member_key"] = base64.b64encode(RSAPrivateKey().to_bytes()).decode()
    path.write_text(json.dumps(doc))
    with pytest.raises(AuthError, match="issued by an older atoll .*ask the run's owner for a new one"):
        JoinToken.load(path)


def test_the_run_owners_identity_file_of_an_older_atoll_is_a_configuration_error(tmp_path):
    (tmp_path / "identity.key").write_bytes(
        crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes()).SerializeToString())
    with pytest.raises(ConfigError, match="identity: .*older atoll.*delete the file"):
        membership(NodeConfig(run_id=RUN, checkpoint_dir=str(tmp_path)))
    (tmp_path / "identity.key").unlink()
    token = membership(NodeConfig(run_id=RUN, checkpoint_dir=str(tmp_path)))
    assert MemberKey.from_identity((tmp_path / "identity.key").read_bytes()).peer_id == token.member_key.peer_id

"""Private runs: certificates, run keys, join tokens and the DHT membership validator (no sockets)."""

import base64
import dataclasses
import json
import os
import stat
import time

import pytest
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from atoll.node.cli import main
from atoll.protocols.auth import AuthError, Certificate, JoinToken, MembershipValidator, RunKey, fingerprint
from atoll.protocols.identity import MemberKey, RecordSigner
from atoll.protocols.record_validator import make_validators


@pytest.fixture(scope="module")
def run_key():
    return RunKey.generate()


@pytest.fixture(scope="module")
def token(run_key):
    return run_key.issue_token("run1")


def test_certificate_round_trips_and_verifies(run_key, token):
    cert = Certificate.from_bytes(token.certificate.to_bytes())
    assert cert == token.certificate
    cert.verify("run1", run_key.public_bytes)
    assert cert.member_key == token.member_key.owner


def test_certificate_for_another_run_or_key_or_tampered_is_refused(run_key, token):
    cert = token.certificate
    with pytest.raises(AuthError, match="for run 'run1', not 'run2'"):
        cert.verify("run2", run_key.public_bytes)
    other = RunKey.generate()
    with pytest.raises(AuthError, match="is for run key"):
        cert.verify("run1", other.public_bytes)
    forged = dataclasses.replace(cert, member_key=MemberKey.generate().owner)
    with pytest.raises(AuthError, match="signature is invalid"):
        forged.verify("run1", run_key.public_bytes)
    # A certificate an outsider signs with its own key and labels with the run's public key does not verify.
    fake = other.certify("run1", cert.member_key)
    fake = dataclasses.replace(fake, run_public_key=run_key.public_bytes)
    with pytest.raises(AuthError, match="signature is invalid"):
        fake.verify("run1", run_key.public_bytes)


def test_certificate_expiry(run_key):
    cert = run_key.certify("run1", MemberKey.generate().owner, expires_at=1000.0)
    cert.verify("run1", run_key.public_bytes, now=999.0)
    with pytest.raises(AuthError, match="expired"):
        cert.verify("run1", run_key.public_bytes, now=1001.0)


@pytest.mark.parametrize("data", [b"", b"\x00" * 10, b"\x92\xc4\x01a\xc4\x01b", b"x" * 5000,
                                  b"\x92\x01\x02"])
def test_malformed_certificates_raise_auth_error(data):
    with pytest.raises(AuthError):
        Certificate.from_bytes(data)


def test_run_key_and_token_files(tmp_path, run_key):
    path = tmp_path / "run.key"
    run_key.save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert RunKey.load(path).public_bytes == run_key.public_bytes
    again, created = RunKey.load_or_create(path)
    assert not created and again.public_bytes == run_key.public_bytes
    token_path = tmp_path / "m.token"
    issued = run_key.issue_token("run1")
    issued.save(token_path)
    assert stat.S_IMODE(os.stat(token_path).st_mode) == 0o600
    loaded = JoinToken.load(token_path)
    assert loaded.certificate == issued.certificate
    assert loaded.member_key.to_bytes() == issued.member_key.to_bytes()
    assert fingerprint(loaded.run_public_key) == fingerprint(run_key.public_bytes)


def test_bad_token_files_are_refused_clearly(tmp_path, run_key):
    with pytest.raises(AuthError, match="does not exist"):
        JoinToken.load(tmp_path / "missing")
    (tmp_path / "junk").write_text("not json")
    with pytest.raises(AuthError, match="unreadable"):
        JoinToken.load(tmp_path / "junk")
    # A token whose certificate names another member key than the one it carries (a spliced token).
    a, b = run_key.issue_token("run1"), run_key.issue_token("run1")
    a.save(tmp_path / "a")
    doc = json.loads((tmp_path / "a").read_text())
    doc["certificate"] = base64.b64encode(b.certificate.to_bytes()).decode()
    (tmp_path / "spliced").write_text(json.dumps(doc))
    with pytest.raises(AuthError, match="another member key"):
        JoinToken.load(tmp_path / "spliced")
    expired = run_key.issue_token("run1", expires_at=time.time() - 1)
    expired.save(tmp_path / "expired")
    with pytest.raises(AuthError, match="expired"):
        JoinToken.load(tmp_path / "expired")
    with pytest.raises(AuthError, match="unreadable"):
        RunKey.load(tmp_path / "junk")


VALUE = {"groups": [["p1"]], "time": 1.0}  # a group decision: well-formed under any key, claims no peer id


def test_a_certificates_proof_stands_for_it_given_the_run_and_the_owner_key(run_key, token):
    """A record carries only the certificate's expiry and signature; with the run's id and key and the record's
    owner key they are the certificate again. Any other owner key, run, or a changed expiry fails to verify."""
    cert = token.certificate
    proof = cert.proof()
    assert len(proof) <= 96 < len(cert.to_bytes())  # the member key (52 bytes) and the run's id and key stay out
    again = Certificate.from_proof(proof, "run1", run_key.public_bytes, cert.member_key)
    assert again == cert
    again.verify("run1", run_key.public_bytes)
    other_member = MemberKey.generate().owner
    with pytest.raises(AuthError, match="signature is invalid"):
        Certificate.from_proof(proof, "run1", run_key.public_bytes, other_member).verify("run1", run_key.public_bytes)
    with pytest.raises(AuthError, match="signature is invalid"):
        Certificate.from_proof(proof, "run2", run_key.public_bytes, cert.member_key).verify("run2",
                                                                                            run_key.public_bytes)
    expiring = run_key.certify("run1", cert.member_key, expires_at=1000.0)
    extended = Certificate.from_proof(dataclasses.replace(expiring, expires_at=1e12).proof()[:-64]
                                      + expiring.signature, "run1", run_key.public_bytes, cert.member_key)
    with pytest.raises(AuthError, match="signature is invalid"):  # a later expiry under the old signature
        extended.verify("run1", run_key.public_bytes)
    for bad in (b"", b"\x92\x01\x02", b"\x92\xcb" + b"\x00" * 8 + b"\xc4\x01a", b"x" * 200):
        with pytest.raises(AuthError):
            Certificate.from_proof(bad, "run1", run_key.public_bytes, cert.member_key)


def test_a_member_record_carries_the_proof_not_the_certificate(run_key, token):
    member = make_validators("run1", token)
    record = _signed(member, b"key", member[0].local_public_key, VALUE)
    assert base64.b64encode(token.certificate.proof()) in record.value
    assert base64.b64encode(token.certificate.to_bytes()) not in record.value


def _signed(validators, key: bytes, subkey: bytes, value) -> DHTRecord:
    """A record as the DHT of a daemon with ``validators`` would send it (value signed by the validator chain)."""
    chain = CompositeValidator(validators)
    record = DHTRecord(key, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), time.time() + 60)
    return dataclasses.replace(record, value=chain.sign_value(record))


def _accepts(validators, record: DHTRecord) -> bool:
    chain = CompositeValidator(validators)
    return chain.validate(record) and MSGPackSerializer.loads(chain.strip_value(record)) is not None


def test_member_records_pass_and_others_are_refused(run_key, token):
    member = make_validators("run1", token)
    ours = make_validators("run1", run_key.issue_token("run1"))  # another member, the reader
    record = _signed(member, b"key", member[0].local_public_key, VALUE)
    assert _accepts(ours, record)
    assert MSGPackSerializer.loads(CompositeValidator(ours).strip_value(record)) == VALUE
    # An outsider with no token: records carry no certificate.
    outsider = make_validators("run1")
    assert not _accepts(ours, _signed(outsider, b"key", outsider[0].local_public_key, VALUE))
    # An outsider with a token of another run key, and a member of another run id under the same key.
    assert not _accepts(ours, _signed(make_validators("run1", RunKey.generate().issue_token("run1")), b"key",
                                      b"", VALUE))
    foreign = make_validators("run1", RunKey.generate().issue_token("run1"))
    assert not _accepts(ours, _signed(foreign, b"key", foreign[0].local_public_key, VALUE))
    other_run = make_validators("run2", run_key.issue_token("run2"))
    assert not _accepts(ours, _signed(other_run, b"key", other_run[0].local_public_key, VALUE))


def test_a_copied_certificate_does_not_admit_its_copier(run_key, token):
    """An outsider that read a member's certificate off the DHT appends it to a record signed with its own key."""
    ours = make_validators("run1", run_key.issue_token("run1"))
    stolen = MembershipValidator("run1", token.run_public_key, token.certificate.to_bytes())
    thief_key = MemberKey.generate()
    thief = [RecordSigner(thief_key), stolen]
    subkey = RecordSigner(thief_key).local_public_key
    assert not _accepts(ours, _signed(thief, b"key", subkey, VALUE))
    # And it cannot sign under the member's owner key, whose private half it lacks: a re-signed value fails.
    member = make_validators("run1", token)
    record = _signed(member, b"key", member[0].local_public_key, VALUE)
    tampered = dataclasses.replace(record, value=record.value.replace(MSGPackSerializer.dumps(VALUE),
                                                                      MSGPackSerializer.dumps({"groups": [["p2"]], "time": 1.0})))
    assert not _accepts(ours, tampered)


def test_open_validators_read_private_records(run_key, token):
    member = make_validators("run1", token)
    record = _signed(member, b"key", member[0].local_public_key, VALUE)
    reader = make_validators("run1")
    assert _accepts(reader, record)
    assert MSGPackSerializer.loads(CompositeValidator(reader).strip_value(record)) == VALUE


def test_token_command(tmp_path, run_key, capsys):
    key_path = tmp_path / "run.key"
    run_key.save(key_path)
    out = tmp_path / "member.token"
    assert main(["token", "--run-key", str(key_path), "--run-id", "r", "--out", str(out), "--expires-in", "2"]) == 0
    token = JoinToken.load(out)
    assert token.run_id == "r" and token.run_public_key == run_key.public_bytes
    assert 7100 < token.certificate.expires_at - time.time() <= 7200
    assert main(["token", "--run-key", str(key_path), "--out", str(out)]) == 2  # never overwrites a token
    assert main(["token", "--run-key", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "exists; a join token is never overwritten" in err and "does not exist" in err


def test_start_refuses_bad_access_flags(tmp_path):
    assert main(["start", "--open", "--join-token", str(tmp_path / "t")]) == 2  # the token file is missing
    (tmp_path / "t").write_text("{}")
    assert main(["start", "--open", "--join-token", str(tmp_path / "t")]) == 2
    assert main(["start", "--join-token", str(tmp_path / "t"), "--run-key", str(tmp_path / "k")]) == 2

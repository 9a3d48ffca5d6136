"""The DHT record rules a hostile member cannot get around (``record_validator.RunRecordValidator``), checked the way
hivemind checks a record on store and on read: through the daemon's whole validator chain (no sockets)."""

import dataclasses
import time

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer
import msgpack

from atoll.node.cli import main
from atoll.node.config import ConfigError, NodeConfig
from atoll.node.faults import Faults
from atoll.node.rounds.join import identity_file, load_revocation, save_revocation
from atoll.protocols.auth import RunKey
from atoll.protocols.identity import is_peer_id, owner_of_subkey, peer_id_of
from atoll.protocols.revocation import RevocationList, newest_revocation
from atoll.protocols.record_validator import RunRecordValidator, _validate_dictionary_per_subkey, make_validators
from atoll.protocols.records import (MAX_FRAGMENTS, MAX_REJECTION_KINDS, config_key, head_key, open_rounds_key,
                                     progress_key, progress_shard, revoked_key, round_key)
from support.records import progress
from atoll.protocols.summary import summary_key

RUN = "run1"


def group_key(*args):  # matchmaking's rule, without importing it here
    return round_key(*args) + "_group"


@pytest.fixture(scope="module")
def run_key():
    return RunKey.generate()


@pytest.fixture(scope="module")
def member(run_key):
    """A member's validators and its peer id (its member key)."""
    token = run_key.issue_token(RUN)
    validators = make_validators(RUN, token)
    return validators, token.member_key.peer_id


@pytest.fixture
def reader(run_key):
    """Another member's validators: what every DHT node of the run applies."""
    return make_validators(RUN, run_key.issue_token(RUN))


def _record(validators, key: str, value, ttl: float = 30.0, subkey: bytes | None = None, raw: bytes | None = None):
    """A record as a daemon with ``validators`` would store it: signed (and certified) by its chain."""
    chain = CompositeValidator(validators)
    subkey = validators[0].local_public_key if subkey is None else subkey
    record = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey),
                       MSGPackSerializer.dumps(value) if raw is None else raw, get_dht_time() + ttl)
    return dataclasses.replace(record, value=chain.sign_value(record))


def _accepts(validators, record) -> bool:
    return CompositeValidator(validators).validate(record)


def _registration(peer: str) -> dict:
    return {"peer_id": peer, "weight": 1.0, "time": float(get_dht_time())}


def _summary(peer: str) -> dict:
    return {"peer_id": peer, "peers": 3, "ranks": 3, "tokens": 10, "tokens_per_s": 1.0, "max_version": 2,
            "bytes_sent": 0, "bytes_received": 0, "time": float(get_dht_time())}


def _refusals(validators) -> dict:
    return next(v for v in validators if isinstance(v, RunRecordValidator)).refused


# ---- one record per member per key ------------------------------------------------------------------------------
def test_subkey_must_be_exactly_one_owner_marker(member, reader):
    validators, me = member
    owner, mine = validators[0].local_public_key, progress_key(RUN, progress_shard(me))
    assert _accepts(reader, _record(validators, mine, progress(me)))
    for subkey in (owner + b"fake1", b"x" + owner, owner + owner, owner[:-1] + b" x]"):
        # hivemind's signature check alone accepts each of these (the owner signed them): 50 fake records did.
        assert not _accepts(reader, _record(validators, mine, progress(me), subkey=subkey)), subkey
    membership = next(v for v in reader if type(v).__name__ == "MembershipValidator")
    assert membership.refused["dht_member"] >= 3  # a private run's certificate check refuses them first
    assert owner_of_subkey(MSGPackSerializer.dumps(owner)) is not None
    assert owner_of_subkey(MSGPackSerializer.dumps(None)) is None  # a plain value, no subkey
    assert owner_of_subkey(MSGPackSerializer.dumps(owner.decode())) is None  # a str, not bytes
    assert owner_of_subkey(b"\xff\x00") is None


def test_open_runs_check_the_subkey_too_but_owner_keys_are_free():
    writer, reader = make_validators(RUN), make_validators(RUN)
    owner = writer[0].local_public_key
    key = progress_key(RUN, progress_shard("anyone"))
    assert _accepts(reader, _record(writer, key, progress("anyone")))  # no binding: keys are free
    assert not _accepts(reader, _record(writer, key, progress("anyone"), subkey=owner + b"2"))
    assert _refusals(reader)["dht_subkey"] == 1


# ---- the peer id a record claims is its signer's ----------------------------------------------------------------
def test_identity_file_of_a_member_key_gives_the_peer_id_readers_check(run_key):
    token = run_key.issue_token(RUN)
    pid = token.member_key.peer_id
    assert str(PeerID.from_identity(token.member_key.identity_bytes())) == pid and is_peer_id(pid)
    assert peer_id_of(b"ssh-ed25519 AAAA") is None and not is_peer_id("Qm" + "x" * 44)
    assert peer_id_of(b"ssh-rsa AAAA") is None and not is_peer_id("12D3KooW" + "x" * 44)
    assert is_peer_id("QmRLgQKGKyWcvCzjjQ3qLndsCNgPJJusj3CMSwecqJWHTR")  # an open run's RSA identity (hivemind's)


def test_a_record_claiming_another_peer_id_is_refused(member, reader, run_key):
    validators, me = member
    other = run_key.issue_token(RUN).member_key.peer_id
    mine = progress_key(RUN, progress_shard(me))
    for key, value in ((mine, progress(other)), (head_key(RUN), {"peer_id": other, "version": 3, "time": 1.0}),
                       (round_key(RUN, 0, 5, "ab"), _registration(other)),
                       (open_rounds_key(RUN, 0, 5, "ab"), {"peer_id": other, "fragment": 0, "version": 5}),
                       (summary_key(RUN), _summary(other))):
        assert not _accepts(reader, _record(validators, key, value)), key
        me_value = dict(value, peer_id=me)
        assert _accepts(reader, _record(validators, key, me_value)), key
    assert _refusals(reader)["dht_peer_id"] == 5


# ---- expiry and size ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key,value,cap", [
    ("progress", "progress", 600), (round_key(RUN, 1, 2), "round", 3600), (group_key(RUN, 1, 2), "group", 3600),
    (open_rounds_key(RUN, 1, 2, "ab"), "open", 3600), (head_key(RUN), "head", 7 * 24 * 3600),
    (summary_key(RUN), "summary", 600)])
def test_expiry_is_capped_per_kind(member, reader, key, value, cap):
    validators, me = member
    key = progress_key(RUN, progress_shard(me)) if key == "progress" else key
    value = {"progress": progress(me), "round": _registration(me), "group": {"groups": [[me]], "time": 1.0},
             "open": {"peer_id": me, "fragment": 1, "version": 2}, "head": {"peer_id": me, "version": 1,
                                                                               "time": 1.0},
             "summary": _summary(me)}[value]
    assert _accepts(reader, _record(validators, key, value, ttl=cap))
    assert not _accepts(reader, _record(validators, key, value, ttl=cap + 60))
    assert not _accepts(reader, _record(validators, key, value, ttl=10 * 365 * 24 * 3600))  # the review's 10 years


def test_sizes_are_capped_and_a_full_progress_record_fits(member, reader):
    validators, me = member
    big = progress(me, MAX_FRAGMENTS, device="d" * 128, fragment_hashes=["f" * 64] * MAX_FRAGMENTS,
                    rejected_by_kind={f"{i:032d}": 10**9 for i in range(MAX_REJECTION_KINDS)})
    assert _accepts(reader, _record(validators, progress_key(RUN, progress_shard(me)), big))
    huge_group = {"groups": [[f"{i:0100d}" for i in range(1000)]], "time": 1.0}  # 100 KB
    assert not _accepts(reader, _record(validators, group_key(RUN, 0, 1), huge_group))
    assert not _accepts(reader, _record(validators, progress_key(RUN, 0), "x" * 40_000))
    assert _refusals(reader)["dht_size"] == 2
    padded = MSGPackSerializer.dumps(_registration(me)) + b"\x00" * 600  # bytes after the value
    assert not _accepts(reader, _record(validators, round_key(RUN, 0, 1), None, raw=padded))
    assert _refusals(reader)["dht_schema"] == 1


# ---- schemas, also under dynamic keys --------------------------------------------------------------------------
def test_dynamic_round_keys_hold_registrations_or_group_decisions_only(member, reader):
    validators, me = member
    rkey, gkey = round_key(RUN, 3, 17, "c0ffee"), group_key(RUN, 3, 17, "c0ffee")
    assert _accepts(reader, _record(validators, rkey, _registration(me)))
    assert _accepts(reader, _record(validators, gkey, {"groups": [sorted([me, "Qmother"])], "time": 1.0}))
    ext = msgpack.packb({"peer_id": me, "weight": msgpack.ExtType(42, b"boom"), "time": 1.0}, use_bin_type=True)
    for value, raw in ((_registration(me) | {"weight": float("nan")}, None), ({"groups": [["b", "a"]], "time": 1.0}, None),
                       (progress(me), None), ("junk", None), (None, ext), (None, b"\xc1garbage"),
                       ({"groups": [[me]], "time": 1.0, "extra": 1}, None)):
        assert not _accepts(reader, _record(validators, rkey, value, raw=raw)), (value, raw)
    assert _refusals(reader)["dht_schema"] == 7
    assert not _accepts(reader, _record(validators, open_rounds_key(RUN, 0, 0, "ab"), {"peer_id": me, "fragment": -1,
                                                                          "version": 0}))
    assert not _accepts(reader, _record(validators, progress_key(RUN, 0), _registration(me)))  # static: its own kind
    assert not _accepts(reader, _record(validators, config_key(RUN), {"fields": {}}))


def test_one_invalid_subkey_is_dropped_alone():
    """hivemind refused a whole dictionary when one of its subkeys failed; atoll drops that subkey only."""

    class Protocol:
        serializer = MSGPackSerializer
        record_validator = CompositeValidator([RunRecordValidator(RUN)])

    writer = make_validators(RUN)
    good = _record(writer, round_key(RUN, 0, 1), _registration("p"))
    strip = CompositeValidator(writer[:2])
    good = dataclasses.replace(good, value=strip.strip_value(good))
    dictionary = DictionaryDHTValue()
    dictionary.store(MSGPackSerializer.loads(good.subkey), good.value, good.expiration_time)
    dictionary.store(b"[owner:junk]extra", MSGPackSerializer.dumps("junk"), get_dht_time() + 10 ** 8)
    assert _validate_dictionary_per_subkey(Protocol(), good.key, dictionary)
    assert list(dict(dictionary.items())) == [MSGPackSerializer.loads(good.subkey)]
    assert dictionary.latest_expiration_time == good.expiration_time
    only_bad = DictionaryDHTValue()
    only_bad.store(b"[owner:junk]", MSGPackSerializer.dumps("junk"), get_dht_time() + 10)
    assert not _validate_dictionary_per_subkey(Protocol(), good.key, only_bad)


# ---- revocation ---------------------------------------------------------------------------------------------------
def test_revocation_list_signature_serial_and_refusal(run_key, member, reader):
    validators, me = member
    rules = next(v for v in reader if isinstance(v, RunRecordValidator))
    assert _accepts(reader, _record(validators, progress_key(RUN, progress_shard(me)), progress(me)))
    first = RevocationList(RUN, 1, (me,), 1.0).signed(run_key)
    forged = RevocationList(RUN, 9, (me,), 1.0).signed(RunKey.generate())
    assert not _accepts(reader, _record(validators, revoked_key(RUN), forged.to_record()))
    assert rules.revocation is None
    assert _accepts(reader, _record(validators, revoked_key(RUN), first.to_record()))  # read: applied
    assert rules.revoked == {me}
    assert not _accepts(reader, _record(validators, progress_key(RUN, progress_shard(me)), progress(me)))
    assert not _accepts(reader, _record(validators, round_key(RUN, 0, 1), _registration(me)))
    assert _refusals(reader)["dht_revoked"] == 2
    # An older (replayed) list takes nobody off: the serial only grows.
    assert not rules.apply(RevocationList(RUN, 1, (), 1.0).signed(run_key)) and rules.revoked == {me}
    assert rules.apply(RevocationList(RUN, 2, (), 2.0).signed(run_key)) and rules.revoked == frozenset()
    newest, bad = newest_revocation(RUN, run_key.public_bytes, [first.to_record(), forged.to_record(), "junk"])
    assert newest == first and bad == 2
    for broken in ({**first.to_record(), "revoked": [me, me]}, {**first.to_record(), "serial": 0},
                   {**first.to_record(), "revoked": ["not a peer id"]}, {**first.to_record(), "x": 1}):
        assert RevocationList.parse(RUN, broken) is None
    assert not first.verify(RunKey.generate().public_bytes)
    replayed = RevocationList("run2", 1, (me,), 1.0, first.signature)  # another run's id
    assert not replayed.verify(run_key.public_bytes)


def test_revocation_is_kept_on_disk(tmp_path, run_key):
    token = run_key.issue_token(RUN)
    cfg = NodeConfig(run_id=RUN, checkpoint_dir=str(tmp_path))
    assert load_revocation(cfg, token) is None
    kept = RevocationList(RUN, 3, (token.member_key.peer_id,), 1.0).signed(run_key)
    save_revocation(str(tmp_path), kept)
    assert load_revocation(cfg, token) == kept
    assert load_revocation(cfg, RunKey.generate().issue_token(RUN)) is None  # not signed by that run's key


# ---- identity files -----------------------------------------------------------------------------------------------
def test_a_private_run_identity_is_the_member_key(tmp_path, run_key):
    token = run_key.issue_token(RUN)
    path, temporary = identity_file(NodeConfig(run_id=RUN, identity=str(tmp_path / "id.key")), token)
    assert path == str(tmp_path / "id.key") and not temporary
    assert str(PeerID.from_identity(open(path, "rb").read())) == token.member_key.peer_id
    assert identity_file(NodeConfig(run_id=RUN, identity=path), token) == (path, False)  # consistent: kept
    with pytest.raises(ConfigError, match="identity: .*another key than the join token's member key"):
        identity_file(NodeConfig(run_id=RUN, identity=path), run_key.issue_token(RUN))
    # The default identity of an older daemon is left alone: a temporary copy of the member key is used instead.
    other = run_key.issue_token(RUN)
    path2, temporary = identity_file(NodeConfig(run_id=RUN, checkpoint_dir=str(tmp_path)), other)
    assert temporary is False and path2 == str(tmp_path / "identity.key")  # created (it did not exist)
    path3, temporary = identity_file(NodeConfig(run_id=RUN, checkpoint_dir=str(tmp_path)), token)
    assert temporary and str(PeerID.from_identity(open(path3, "rb").read())) == token.member_key.peer_id
    assert identity_file(NodeConfig(run_id=RUN), None) == (None, False)  # an open run: as before


# ---- the CLI --------------------------------------------------------------------------------------------------------
def test_revoke_command_refuses_bad_input_with_one_line(tmp_path, run_key, capsys):
    key_path = tmp_path / "run.key"
    run_key.save(key_path)
    peers = ["--initial-peers", "/ip4/127.0.0.1/tcp/9/p2p/QmRLgQKGKyWcvCzjjQ3qLndsCNgPJJusj3CMSwecqJWHTR"]
    assert main(["token", "revoke", "--run-key", str(key_path), *peers, "--peer-id", "nope"]) == 2
    assert main(["revoke", "--run-key", str(key_path), *peers]) == 2
    assert main(["token", "revoke", "--run-key", str(tmp_path / "missing"), *peers, "--peer-id", "x"]) == 2
    RunKey.generate().issue_token("atoll").save(tmp_path / "foreign.token")
    assert main(["revoke", "--run-key", str(key_path), *peers, "--token", str(tmp_path / "foreign.token")]) == 2
    (tmp_path / "junk.token").write_text("{")
    assert main(["revoke", "--run-key", str(key_path), *peers, "--token", str(tmp_path / "junk.token")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 5 and all(line.startswith("atoll: error: ") for line in err)
    assert "is not a peer id" in err[0] and "--token FILE or --peer-id ID" in err[1] and "does not exist" in err[2]
    assert "not run 'atoll' of this run key" in err[3] and "not a readable join token" in err[4]


def test_config_bounds_keep_honest_records_under_the_caps():
    from atoll.node.config import RunConfig

    with pytest.raises(ConfigError, match="heartbeat: at most 200"):
        NodeConfig(heartbeat=201).validate()
    with pytest.raises(ConfigError, match="gather_timeout: at most 885"):
        RunConfig(gather_timeout=900).validate()
    assert time.time() > 0


def test_a_split_sides_records_count_only_on_nodes_told_of_its_namespaces(run_key, member):
    """Fault injection's split sides write the run's progress under namespaces of their own; a node takes them only
    when started with those namespaces (``Faults.namespaces``): the production validators know no fault's names."""
    validators, me = member
    side = Faults(["split_side=2", "split_until=10"]).namespace(RUN, 0)
    record = _record(validators, progress_key(side, progress_shard(me)), progress(me))
    plain = make_validators(RUN, run_key.issue_token(RUN))
    assert not _accepts(plain, record) and _refusals(plain)
    told = make_validators(RUN, run_key.issue_token(RUN), namespaces=Faults(["split_side=0"]).namespaces(RUN))
    assert _accepts(told, record) and side in Faults(["split_side=0"]).namespaces(RUN)
    assert Faults().namespaces(RUN) == ()

"""DHT record schemas reject malformed records; only owners can write their subkeys."""

import math

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from atoll.protocols.identity import RecordSigner
from atoll.protocols.record_validator import make_validators
from atoll.protocols.records import (ALL_SHARDS, PROGRESS_SHARDS, heavier, parse_progress, parse_round_record,
                                     progress_key, progress_shard, unwrap_subkeys)
from support.records import busy_progress


def test_good_progress_record_parses():
    assert parse_progress(busy_progress()).version == 2
    assert parse_progress(busy_progress()).held_out_step is None  # a record without it (an older daemon's) parses
    assert parse_progress(busy_progress(held_out_loss=2.4, held_out_step=8)).held_out_step == 8


@pytest.mark.parametrize(
    "changes",
    [
        {"step": -1}, {"step": 1.5}, {"version": "2"}, {"status": "dancing"}, {"tokens_per_s": math.nan},
        {"fragment_weights": [-1.0]}, {"loss": "low"}, {"fragment_versions": [1, 1]}, {"version": 3},
        {"fragment_hashes": []}, {"goodput": math.nan}, {"extra_field": 1}, {"peer_id": 42}, {"time": math.inf},
        {"rejected_by_kind": {"shape": -1}}, {"rejected_by_kind": {"x" * 33: 1}}, {"rejected_by_kind": {"": 1}},
        {"rejected_by_kind": {f"k{i}": 1 for i in range(33)}}, {"rejected_by_kind": {"shape": 1.0}},
        {"rejected_by_kind": [1]}, {"clipped": -1}, {"peer_id": "Q" * 129}, {"fragment_hashes": ["a" * 65]},
        {"device": "d" * 129}, {"reachable": 1}, {"reachable": "no"}, {"ranks": 0}, {"ranks": 2.0},
        {"held_out_step": -1}, {"held_out_step": 2.0}, {"loss": math.nan}, {"held_out_loss": math.inf},
    ],
)
def test_malformed_progress_records_are_rejected(changes):
    assert parse_progress(busy_progress(**changes)) is None


def test_missing_field_and_non_dict_are_rejected():
    rec = busy_progress()
    del rec["version"]
    assert parse_progress(rec) is None
    assert parse_progress([1, 2]) is None
    assert parse_progress(None) is None


@pytest.mark.parametrize(
    "value, ok",
    [
        ({"peer_id": "Qm1", "weight": 10.0, "time": 1.0}, True),
        ({"peer_id": "Qm1", "weight": 0.0, "time": 1.0}, False),
        ({"peer_id": "Qm1", "weight": math.nan, "time": 1.0}, False),
        ({"peer_id": "Qm1", "weight": 1e30, "time": 1.0}, False),
        ({"peer_id": "", "weight": 1.0, "time": 1.0}, False),
        ({"peer_id": "Qm1", "weight": 1.0}, False),
        ({"peer_id": "Qm1", "weight": 1.0, "time": 1.0, "x": 1}, False),
        ("garbage", False),
    ],
)
def test_round_records(value, ok):
    assert (parse_round_record(value) is not None) == ok


def _record(key, subkey, value):
    return DHTRecord(
        key=DHTID.generate(source=key).to_bytes(), subkey=DHTID.generate(source=subkey).to_bytes()
        if not isinstance(subkey, bytes) else MSGPackSerializer.dumps(subkey),
        value=MSGPackSerializer.dumps(value), expiration_time=get_dht_time() + 10,
    )


def test_the_run_validator_checks_progress_values_and_their_shard():
    rules = make_validators("run1")[2]
    owner = RecordSigner().local_public_key
    key = progress_key("run1", progress_shard("QmPeer"))
    assert rules.validate(_record(key, owner, busy_progress()))
    assert not rules.validate(_record(key, owner, busy_progress(step=-5)))
    elsewhere = progress_key("run1", (progress_shard("QmPeer") + 1) % PROGRESS_SHARDS)
    assert not rules.validate(_record(elsewhere, owner, busy_progress()))  # crowding another shard's key
    assert rules.refused == {"dht_schema": 1, "dht_shard": 1}
    everyone = progress_key("run1", ALL_SHARDS)  # a small swarm's one key: any peer's record, still a progress one
    assert rules.validate(_record(everyone, owner, busy_progress()))
    assert not rules.validate(_record(everyone, owner, {"peer_id": "QmPeer", "weight": 1.0, "time": 1.0}))
    assert rules.refused == {"dht_schema": 2, "dht_shard": 1}


def test_signature_validator_refuses_unsigned_owner_records():
    validator = RecordSigner()
    record = _record(progress_key("run1", 0), validator.local_public_key, busy_progress())
    assert not validator.validate(record)  # an owner subkey without the owner's signature
    signed = DHTRecord(record.key, record.subkey, validator.sign_value(record), record.expiration_time)
    assert validator.validate(signed)


def test_replica_order_and_unwrap():
    assert heavier((3, 0.0, "a"), (2, 99.0, "z"))
    assert heavier((2, 5.0, "a"), (2, 4.0, "z"))
    assert heavier((2, 5.0, "b"), (2, 5.0, "a"))
    assert not heavier((2, 5.0, "a"), (2, 5.0, "a"))
    assert unwrap_subkeys(None) == {}


def test_run_config_records():
    from atoll.protocols.records import parse_run_config

    good = {"fields": {"model": "nano"}, "started_by": "Qm1", "started_at": 1.0}
    assert parse_run_config(good).fields == {"model": "nano"}
    assert parse_run_config({**good, "started_at": "yesterday"}) is None
    assert parse_run_config({**good, "extra": 1}) is None
    assert parse_run_config("garbage") is None


def test_round_keys_separate_replicas_at_one_version():
    from atoll.protocols.matchmaking import group_key
    from atoll.protocols.records import round_key

    assert round_key("r", 1, 5) == "r_round_1_5"
    assert round_key("r", 1, 5, "abc") != round_key("r", 1, 5, "abd")
    assert group_key("r", 1, 5, "abc") == round_key("r", 1, 5, "abc") + "_group"

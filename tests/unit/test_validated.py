"""Verdicts a DHT node remembers (``protocols/validated.py``): a record that passed is not checked again for a
while, unless a revocation list came in between; a refused one is checked every time."""

import dataclasses

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from support.records import progress as progress_fields

from atoll.protocols import validated
from atoll.protocols.auth import RunKey
from atoll.protocols.revocation import RevocationList
from atoll.protocols.record_validator import RunRecordValidator, make_validators
from atoll.protocols.records import progress_key, progress_shard, revoked_key

RUN = "run1"


class Counting:
    """A validator that passes what ``passes`` says, counting its calls."""

    def __init__(self, passes=lambda record: True) -> None:
        self.passes, self.calls = passes, 0

    def validate(self, record) -> bool:
        self.calls += 1
        return self.passes(record)


def _record(value: bytes, expiration: float = 100.0) -> DHTRecord:
    return DHTRecord(b"key", b"subkey", value, expiration)


def test_a_record_that_passed_is_not_checked_again_until_its_time_is_up():
    now = [0.0]
    memory, rules = validated.Remembered(clock=lambda: now[0]), Counting()
    assert memory.validate(rules, _record(b"a")) and memory.validate(rules, _record(b"a"))
    assert rules.calls == 1 and memory.hits == 1
    assert memory.validate(rules, _record(b"b")) and rules.calls == 2  # other bytes: checked
    assert memory.validate(rules, _record(b"a", expiration=101.0)) and rules.calls == 3  # another expiration too
    now[0] = validated.REMEMBER_S + 0.1
    assert memory.validate(rules, _record(b"a")) and rules.calls == 4  # remembered too long ago: checked again


def test_a_refused_record_is_checked_every_time():
    memory, rules = validated.Remembered(), Counting(lambda record: record.value != b"bad")
    assert not memory.validate(rules, _record(b"bad")) and not memory.validate(rules, _record(b"bad"))
    assert rules.calls == 2 and memory.hits == 0


def test_forget_all_makes_every_memory_check_again():
    memory, rules = validated.Remembered(), Counting()
    memory.validate(rules, _record(b"a"))
    validated.forget_all()
    assert memory.validate(rules, _record(b"a")) and rules.calls == 2


def test_memories_are_per_validator_and_bounded(monkeypatch):
    a, b = Counting(), Counting()
    assert validated.memory_of(a) is validated.memory_of(a) is not validated.memory_of(b)
    monkeypatch.setattr(validated, "MAX_REMEMBERED", 3)
    memory, rules = validated.Remembered(), Counting()
    for i in range(10):
        memory.validate(rules, _record(bytes([i])))
    assert len(memory._passed) <= 3


def test_a_revoked_members_record_that_passed_is_refused_once_the_list_is_applied():
    """The real chain of a private run: a member's progress record passes and is remembered; the run key's
    revocation list of that member, read through the same node, makes its next read of the record fail."""
    run_key = RunKey.generate()
    token = run_key.issue_token(RUN)
    writer = make_validators(RUN, token)
    me = token.member_key.peer_id
    reader = CompositeValidator(make_validators(RUN, run_key.issue_token(RUN)))
    memory = validated.Remembered()

    def signed(key: str, value) -> DHTRecord:
        record = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(writer[0].local_public_key),
                           MSGPackSerializer.dumps(value), get_dht_time() + 30)
        return dataclasses.replace(record, value=CompositeValidator(writer).sign_value(record))

    progress = signed(progress_key(RUN, progress_shard(me)), progress_fields(me))
    assert memory.validate(reader, progress) and memory.validate(reader, progress) and memory.hits == 1
    revocation = signed(revoked_key(RUN), RevocationList(RUN, 1, (me,), 1.0).signed(run_key).to_record())
    assert memory.validate(reader, revocation)  # read through this node: applied
    rules = next(v for v in reader._validators if isinstance(v, RunRecordValidator))
    assert rules.revoked == {me}
    assert not memory.validate(reader, progress)

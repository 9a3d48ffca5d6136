"""Which run config a joiner adopts: in a private run, only one signed by the run key (a member cannot hijack
the run's config by claiming an earlier start); in an open run, the one the most keys publish, then the earliest."""

from atoll.node.rounds.join import choose_config
from atoll.protocols.auth import RunKey
from atoll.protocols.records import RunConfigRecord, config_payload


def record(run_key=None, sign_with=None, started_at=100.0, access="private", run_id="r", **fields):
    rec = RunConfigRecord(fields={"model": "nano", **fields}, started_by="QmStarter", started_at=started_at,
                          access=access, run_key=run_key)
    if sign_with is not None:
        rec.signature = sign_with.sign(config_payload(run_id, rec))
    return rec.dict()


def test_a_member_of_a_private_run_takes_only_the_record_signed_by_its_run_key():
    key, other = RunKey.generate(), RunKey.generate()
    token = key.issue_token("r")
    good = record(run_key="fp", sign_with=key)
    hijacks = [
        record(access="open", started_at=1.0),  # the reproduced attack: "open", claiming an earlier start
        record(run_key="fp", started_at=1.0, model="12b"),  # unsigned
        record(run_key="fp", sign_with=other, started_at=1.0),  # signed by another run's key
        record(run_key="fp", sign_with=key, started_at=1.0, run_id="another-run"),  # replayed from another run
        {"fields": "not a dict"},
    ]
    tampered = dict(good, fields={"model": "12b"})  # the signed record with its fields changed
    chosen = choose_config("r", token, [*hijacks, tampered, good])
    assert chosen is not None and chosen.dict() == good
    assert choose_config("r", token, [*hijacks, tampered]) is None


def test_without_a_token_the_earliest_open_record_is_taken():
    early, late = record(access="open", started_at=5.0), record(access="open", started_at=9.0)
    assert choose_config("r", None, [late, {"bad": 1}, early]).started_at == 5.0


def test_an_open_runs_config_is_not_replaced_by_one_later_claim_of_an_earlier_start():
    """Every live daemon of an open run re-publishes the record it adopted (one per key): a member's record
    claiming an earlier start (access, model, clip factor of its choosing) is one against the run's many."""
    run = record(access="open", started_at=50.0)
    hijack = record(access="open", started_at=1.0, model="12b", clip_factor=0.0)
    assert choose_config("r", None, [run, hijack, run, run]).dict() == run
    assert choose_config("r", None, [hijack, run]).dict() == hijack  # one against one: the earliest, as before

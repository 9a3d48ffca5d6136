"""The counters behind the progress record and the summary, and the held-out evaluation's time budget (no
sockets, an injected clock)."""

from types import SimpleNamespace

from atoll.node.metrics import Counters, HeldOut
from atoll.protocols.records import ProgressRecord, Status


def test_held_out_evaluations_stay_within_their_share_of_wall_time(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("atoll.node.metrics.time.monotonic", lambda: clock[0])

    def evaluate():
        clock[0] += 1.0  # every evaluation takes a second
        return 2.0

    counters = Counters(started=0.0)
    held_out = HeldOut(0.1, counters)
    learner = SimpleNamespace(held_out_loss=evaluate, step=0)
    evaluations = 0
    for _ in range(100):  # a merge every second of training
        clock[0] += 1.0
        before = counters.eval_seconds
        held_out.evaluate(learner)
        evaluations += counters.eval_seconds > before
    assert counters.held_out_loss == 2.0 and counters.held_out_step == 0
    # Within the budget (an evaluation runs only if it fits), and not far below it either.
    assert 0.1 * clock[0] - 2.0 <= counters.eval_seconds <= 0.1 * clock[0] and evaluations < 100
    held_out.budget = 1.0  # every merge
    before = counters.eval_seconds
    held_out.evaluate(learner)
    assert counters.eval_seconds == before + 1.0


def test_the_first_evaluation_always_runs_and_the_next_waits_until_it_fits(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("atoll.node.metrics.time.monotonic", lambda: clock[0])

    def evaluate():
        clock[0] += 0.5
        return 3.0

    counters = Counters(started=0.0)
    held_out = HeldOut(0.01, counters)
    learner = SimpleNamespace(held_out_loss=evaluate, step=7)
    clock[0] = 1.0
    held_out.evaluate(learner)  # the first: a figure early, over the budget
    assert (counters.held_out_loss, counters.held_out_step, counters.eval_seconds) == (3.0, 7, 0.5)
    clock[0] = 99.0  # 0.99 s of budget: 0.5 spent, and another 0.5 would not fit
    held_out.evaluate(learner)
    assert counters.eval_seconds == 0.5
    clock[0] = 100.0  # 1.0 s of budget: it fits exactly
    held_out.evaluate(learner)
    assert counters.eval_seconds == 1.0


def test_progress_fields_fit_the_published_record_schema():
    counters = Counters(device="cpu", algorithm="decoupled", status=Status.TRAINING, step=3, tokens=96,
                        loss=float("nan"), held_out_loss=2.5, held_out_step=2, rounds_done=2, rounds_skipped=1)
    rec = {**counters.progress(), "peer_id": "p", "version": 0, "fragment_versions": [0], "fragment_weights": [0.0],
           "fragment_hashes": ["h"], "schedule_step": 3, "bytes_sent": 0, "bytes_received": 0, "rejected": 0,
           "rejected_by_kind": {}, "clipped": 0, "time": 1.0, "reachable": True}
    parsed = ProgressRecord.parse_obj(rec)
    assert parsed.status == "training" and parsed.loss is None and parsed.held_out_loss == 2.5
    assert parsed.held_out_step == 2  # a reader draws the evaluation where it happened
    counters.held_out_loss = float("inf")  # no figure: no step either
    assert ProgressRecord.parse_obj({**rec, **counters.progress()}).held_out_step is None
    assert (parsed.rounds, parsed.rounds_skipped, parsed.step, parsed.tokens) == (2, 1, 3, 96)

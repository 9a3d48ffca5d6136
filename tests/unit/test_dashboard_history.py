"""``atoll dashboard``'s history (``node/ops/dashboard.py``) and curves (``node/ops/curves.py``) against naive
references; its answers to each path; no sockets (the page in a browser is ``tests/integration/test_dashboard.py``, and
pytest needs the two modules' names to differ)."""

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from atoll.node.config import ConfigError
from atoll.node.ops.curves import Series, smoothed
from atoll.node.ops.dashboard import host_allowed, respond, run_dashboard
from atoll.node.ops.history import FORGET_AFTER, History


def record(peer="p1", step=10, loss=2.0, held_out=None, held_out_step=None, version=1, **more):
    rec = {"peer_id": peer, "status": "training", "step": step, "loss": loss, "held_out_loss": held_out,
           "held_out_step": held_out_step, "version": version, "tokens": 100 * step, "bytes_sent": 10 * step,
           "bytes_received": 20 * step, "rounds": version, "rounds_skipped": 0, "rejected": 0, "forks_healed": 0}
    rec.update(more)
    return rec


def doc(t, *records, totals=None):
    records = list(records)
    if totals is None:
        totals = {"peers": len(records), "tokens": sum(r["tokens"] for r in records),
                  "bytes_sent": sum(r["bytes_sent"] for r in records),
                  "bytes_received": sum(r["bytes_received"] for r in records),
                  "max_version": max((r["version"] for r in records), default=0)}
    return {"run_id": "r", "time": float(t), "config": {}, "peers": records if records else None, "totals": totals,
            "summary": {"source": "records", "summarizers": [], "age_s": None}}


@given(st.lists(st.floats(-1e6, 1e6), max_size=60), st.floats(0, 0.99))
def test_smoothing_matches_a_naive_debiased_average(values, weight):
    naive = []
    for i in range(1, len(values) + 1):
        weights = [(1 - weight) * weight ** (i - k) for k in range(1, i + 1)]
        naive.append(sum(w * v for w, v in zip(weights, values)) / sum(weights))
    assert smoothed(values, weight) == pytest.approx(naive, rel=1e-9, abs=1e-6)


@given(st.integers(0, 3000), st.integers(4, 64))
def test_a_series_fed_one_point_at_a_time_keeps_one_even_stride(n, cap):
    series = Series(cap)
    for i in range(n):
        series.add(i)
    kept = series.points()
    assert len(kept) <= cap + 1 and kept == sorted(set(kept))
    if n <= cap:
        assert kept == list(range(n))
    else:
        assert kept[0] == 0 and kept[-1] == n - 1  # the first point, and the newest
        on_stride = kept if (n - 1) % series.stride == 0 else kept[:-1]
        assert {b - a for a, b in zip(on_stride, on_stride[1:])} == {series.stride}  # one resolution throughout
        assert len(on_stride) > cap // 2  # never thinner than it must be


def test_bad_smoothing_and_caps_are_refused():
    with pytest.raises(ValueError):
        smoothed([1.0], 1.0)
    with pytest.raises(ValueError):
        Series(3)


def test_a_loss_point_per_new_step_and_an_evaluation_once_where_it_happened():
    h = History()
    h.add(doc(100, record(step=10, loss=3.0, held_out=3.5, held_out_step=5)))  # evaluated before we saw it: not drawn
    h.add(doc(102, record(step=10, loss=3.0, held_out=3.5, held_out_step=5)))  # republished at the same step
    h.add(doc(104, record(step=30, loss=2.0, held_out=2.5, held_out_step=20)))  # evaluated between the two reads
    h.add(doc(106, record(step=40, loss=1.0, held_out=2.5, held_out_step=20)))  # the same evaluation, repeated
    h.add(doc(108, record(step=50, loss=0.5, held_out=2.0, held_out_step=50)))  # evaluated at this very step
    v = h.view(now=110)
    (loss,) = v["loss"]
    assert (loss["t"], loss["step"], loss["raw"]) == ([100, 104, 106, 108], [10, 30, 40, 50], [3.0, 2.0, 1.0, 0.5])
    assert loss["smooth"] == pytest.approx(smoothed([3.0, 2.0, 1.0, 0.5], 0.9))
    (held_out,) = v["held_out"]
    # step 20 lies halfway between the reads at steps 10 (t=102, the newest at that step) and 30 (t=104)
    assert held_out["step"] == [20, 50] and held_out["value"] == [2.5, 2.0]
    assert held_out["t"] == pytest.approx([103.0, 108.0])  # 102 + (104 - 102) * (20 - 10) / (30 - 10)


def test_run_counters_count_every_island_seen_and_last_round_ages():
    h = History()
    h.add(doc(100, record("a", step=10, version=1), record("b", step=20, version=1)))
    h.add(doc(110, record("a", step=30, version=2)))  # b left: what it did still counts
    v = h.view(now=115)
    assert v["run"]["t"] == [100, 110]
    assert v["run"]["tokens"] == [3000, 5000] and v["run"]["bytes_sent"] == [300, 500]
    assert v["run"]["rounds"] == [2, 3] and v["run"]["version"] == [1, 2]
    assert [i["peer_id"] for i in v["islands"]] == ["a"] and v["seen"] == ["a", "b"]
    assert v["islands"][0]["last_round_s"] == 5.0  # its version grew at the read of t=110
    assert [line["peer_id"] for line in v["loss"]] == ["a", "b"]


def test_a_large_run_read_from_summaries_has_totals_only():
    h = History()
    h.add(doc(100, totals={"peers": 500, "tokens": 7, "bytes_sent": 8, "bytes_received": 9, "max_version": 3}))
    v = h.view(now=100)
    assert v["islands"] == [] and v["run"]["tokens"] == [7] and v["run"]["version"] == [3]
    assert v["run"]["rounds"] == [None]  # summaries do not count rounds: no point, not a zero


def test_figures_a_peer_made_up_are_not_drawn_and_the_page_stays_valid_json():
    h = History()
    h.add(doc(100, record(loss=math.nan, held_out=math.inf, held_out_step=10, tokens_per_s=math.nan)))
    v = h.view(now=100)
    json.dumps(v, allow_nan=False)  # the island's own row carries the NaN: shown as no figure
    assert v["islands"][0]["loss"] is None and v["islands"][0]["tokens_per_s"] is None
    assert respond("/api/state", h, 1.0)[0] == 200
    h.add(doc(101, record(step=11, loss=True)))
    v = h.view(now=101)
    assert v["loss"][0]["raw"] == [] and v["held_out"][0]["value"] == []


def test_history_stays_bounded():
    h = History(points=8)
    for i in range(100):
        h.add(doc(i, record(step=i + 1, held_out=1.0, held_out_step=i + 1)))
    v = h.view()
    assert len(v["loss"][0]["t"]) <= 9 and len(v["held_out"][0]["t"]) <= 9 and len(v["run"]["t"]) <= 9
    assert v["loss"][0]["step"][-1] == 100 and v["run"]["t"][-1] == 99  # every curve ends at its newest point


def test_an_island_gone_for_long_is_forgotten_but_still_counted():
    h = History()
    h.add(doc(100, record("a", step=10), record("b", step=20)))
    h.add(doc(100 + FORGET_AFTER / 2, record("a", step=30)))
    assert sorted(h.view()["seen"]) == ["a", "b"]  # b is only away for now
    h.add(doc(101 + FORGET_AFTER, record("a", step=40)))
    v = h.view()
    assert v["seen"] == ["a"] and [line["peer_id"] for line in v["loss"]] == ["a"]
    assert v["run"]["tokens"][-1] == 100 * 40 + 100 * 20  # b's tokens still count


def test_an_evaluation_before_a_restart_is_not_placed_in_the_new_life():
    h = History()
    h.add(doc(100, record(step=10, loss=1.0)))
    h.add(doc(102, record(step=60, loss=1.0)))  # the old life passed step 35 between these two reads
    h.add(doc(104, record(step=40, loss=2.0, held_out=2.5, held_out_step=35)))  # restarted from step 30's checkpoint
    assert h.view()["held_out"][0]["value"] == []  # step 35 of the new life came before its first read
    h.add(doc(106, record(step=50, loss=2.0, held_out=2.4, held_out_step=50)))
    assert h.view()["held_out"][0]["t"] == [106]


def test_only_loopback_names_reach_a_loopback_dashboard():
    assert host_allowed("127.0.0.1:8470", "127.0.0.1") and host_allowed("localhost:8470", "127.0.0.1")
    assert host_allowed("[::1]:8470", "127.0.0.1")
    assert not host_allowed("attacker.example:8470", "127.0.0.1")  # DNS rebinding
    assert not host_allowed(None, "127.0.0.1") and not host_allowed("", "127.0.0.1")
    assert host_allowed("dashboard.example.org", "0.0.0.0")  # serving others was the operator's choice


def test_each_path_answers():
    h = History()
    h.add(doc(100, record()))
    status, ctype, body = respond("/", h, 2.0)
    assert status == 200 and ctype.startswith("text/html") and b"/api/state" in body and b"http" not in body.replace(
        b'"http://www.w3.org/2000/svg"', b"")  # the page names no other address (the SVG namespace is a name)
    status, ctype, body = respond("/api/state", h, 2.0)
    state = json.loads(body)
    assert status == 200 and ctype == "application/json" and state["interval"] == 2.0 and state["polls"] == 1
    assert respond("/healthz", h, 2.0)[0] == 200
    assert respond("/etc/passwd", h, 2.0)[0] == 404


def test_a_failed_read_is_shown_and_history_kept():
    h = History()
    h.add(doc(100, record()))
    h.failed("reading the run failed: timeout")
    v = h.view(now=101)
    assert v["error"] == "reading the run failed: timeout" and v["polls"] == 1 and v["islands"]
    h.add(doc(102, record(step=11)))
    assert h.view()["error"] is None


@pytest.mark.parametrize("changes, field", [({"interval": 0.0}, "interval"), ({"port": 70000}, "port"),
                                            ({"points": 2}, "history")])
def test_bad_options_are_one_line_errors(changes, field):
    args = {"initial_peers": ["/ip4/127.0.0.1/tcp/1/p2p/QmX"], "run_id": "r", "host": "127.0.0.1", "port": 0,
            "interval": 1.0, "points": 100, **changes}
    with pytest.raises(ConfigError, match=f"^{field}:"):
        run_dashboard(**args)


def test_polling_keeps_going_through_failures_and_says_why():
    import threading

    from atoll.node.ops.dashboard import poll

    stop = threading.Event()
    nothing = {**doc(100), "config": None, "peers": [], "summary": {"source": "records", "summarizers": [],
                                                                    "age_s": None}}
    answers = [nothing, RuntimeError("DHT timeout"), doc(101, record()), nothing]
    errors = []
    h = History()

    def read():
        answer = answers.pop(0)
        if not answers:
            stop.set()
        if isinstance(answer, Exception):
            raise answer
        return answer

    def watched_read():
        errors.append(h.error)
        return read()

    poll(watched_read, h, 0.0, stop)
    # Before each read: the error the previous one left.
    assert errors == [None, "no run 'r' found yet", "reading the run failed: DHT timeout", None]
    assert h.error == "no run 'r' found yet" and h.polls == 1  # only the good read went into the history

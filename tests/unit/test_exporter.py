"""The Prometheus metrics of a daemon (``node/ops/exporter.py``): what a scrape shows is what the daemon counts, in
Prometheus's text format as ``prometheus_client``'s own parser reads it (no sockets: the registry is rendered
directly)."""

import math
import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from atoll.node.ops.exporter import ROUND_RESULTS, DaemonCollector
from atoll.node.metrics import ROUND_SECONDS_BUCKETS, SKIPPED, Counters, Histogram
from atoll.protocols.records import Status
from atoll.protocols.stats import TrafficStats


def scrape(counters, traffic, versions, peers=3):
    registry = CollectorRegistry(auto_describe=False)
    info = {"peer_id": "QmPeer", "run_id": "run", "device": "cpu", "algorithm": "decoupled"}
    registry.register(DaemonCollector(info, counters, lambda: traffic, lambda: versions, lambda: peers))
    samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name, **labels):
    return samples[(name, tuple(sorted((k, str(v)) for k, v in labels.items())))]


def test_a_histogram_counts_like_a_naive_one():
    rng = random.Random(0)
    xs = [rng.expovariate(0.2) for _ in range(500)] + list(ROUND_SECONDS_BUCKETS)  # the bounds themselves too
    hist = Histogram(ROUND_SECONDS_BUCKETS)
    for x in xs:
        hist.observe(x)
    assert hist.counts == [sum(x <= b for x in xs) for b in ROUND_SECONDS_BUCKETS]
    assert hist.count == len(xs) and hist.sum == pytest.approx(math.fsum(xs))


def test_round_ended_counts_by_fragment_and_result_and_times_the_merged_ones():
    c = Counters()
    for p, result, seconds in [(0, "merged", 1.5), (0, "merged", 40.0), (1, "failed", None), (0, SKIPPED, None),
                               (1, SKIPPED, None), (1, "behind", None)]:
        c.round_ended(p, result, seconds)
    assert c.rounds_by_result == {(0, "merged"): 2, (1, "failed"): 1, (0, SKIPPED): 1, (1, SKIPPED): 1,
                                  (1, "behind"): 1}
    assert c.rounds_skipped == 2  # the progress record's total
    assert set(c.round_seconds) == {0} and c.round_seconds[0].count == 2 and c.round_seconds[0].sum == 41.5


def test_a_scrape_shows_what_the_daemon_counts():
    c = Counters(device="cpu", algorithm="decoupled", status=Status.TRAINING, step=120, tokens=61_440,
                 tokens_per_s=2048.5, loss=2.5, held_out_loss=2.75, held_out_step=100, tokens_lost=512,
                 train_seconds=30.25, blocked_seconds=0.5, forks_healed=2, rejoins=1, paused_seconds=12.5, pauses=2)
    c.round_ended(0, "merged", 0.7)
    c.round_ended(0, "merged", 3.0)
    c.round_ended(1, "failed")
    c.checkpoint_at = None
    traffic = TrafficStats(bytes_sent=1000, bytes_received=2000)
    traffic.reject("nan", count=3)
    traffic.reject("wrong_shape")
    s = scrape(c, traffic, versions=[7, 5])
    assert value(s, "atoll_info", peer_id="QmPeer", run_id="run", device="cpu", algorithm="decoupled") == 1
    assert value(s, "atoll_status", status="training") == 1 and value(s, "atoll_status", status="joining") == 0
    assert value(s, "atoll_inner_steps_total") == 120 and value(s, "atoll_tokens_total") == 61_440
    assert value(s, "atoll_tokens_per_second") == 2048.5
    assert value(s, "atoll_loss") == 2.5 and value(s, "atoll_held_out_loss") == 2.75
    assert value(s, "atoll_held_out_step") == 100
    assert value(s, "atoll_train_seconds_total") == 30.25 and value(s, "atoll_blocked_seconds_total") == 0.5
    assert value(s, "atoll_tokens_lost_total") == 512 and value(s, "atoll_forks_healed_total") == 2
    assert value(s, "atoll_rejoins_total") == 1
    assert value(s, "atoll_paused_seconds_total") == 12.5 and value(s, "atoll_pauses_total") == 2
    assert value(s, "atoll_status", status="paused") == 0
    # Every fragment and result from the first scrape, zeros included.
    for p in (0, 1):
        for result in ROUND_RESULTS:
            expected = {(0, "merged"): 2, (1, "failed"): 1}.get((p, result), 0)
            assert value(s, "atoll_rounds_total", fragment=p, result=result) == expected
    assert value(s, "atoll_round_duration_seconds_count", fragment=0) == 2
    assert value(s, "atoll_round_duration_seconds_sum", fragment=0) == pytest.approx(3.7)
    assert value(s, "atoll_round_duration_seconds_bucket", fragment=0, le="0.5") == 0
    assert value(s, "atoll_round_duration_seconds_bucket", fragment=0, le="1.0") == 1
    assert value(s, "atoll_round_duration_seconds_bucket", fragment=0, le="5.0") == 2
    assert value(s, "atoll_round_duration_seconds_bucket", fragment=0, le="+Inf") == 2
    assert value(s, "atoll_replica_version", fragment=0) == 7 and value(s, "atoll_replica_version", fragment=1) == 5
    assert value(s, "atoll_peers") == 3
    assert value(s, "atoll_sent_bytes_total") == 1000 and value(s, "atoll_received_bytes_total") == 2000
    assert value(s, "atoll_rejected_total", kind="nan") == 3
    assert value(s, "atoll_rejected_total", kind="wrong_shape") == 1
    assert math.isnan(value(s, "atoll_checkpoint_age_seconds"))  # no checkpoint yet


def test_a_scrape_shows_the_dht_calls_and_their_bytes_by_kind(monkeypatch):
    from atoll.protocols import dht_io

    monkeypatch.setattr(dht_io, "CALLS", {"get progress": dht_io.CallStats(calls=4, entries=12, bytes=3000),
                                          "store round": dht_io.CallStats(calls=2, bytes=180)})
    s = scrape(Counters(), TrafficStats(), versions=[0])
    assert value(s, "atoll_dht_calls_total", op="get", kind="progress") == 4
    assert value(s, "atoll_dht_value_bytes_total", op="get", kind="progress") == 3000
    assert value(s, "atoll_dht_calls_total", op="store", kind="round") == 2
    assert value(s, "atoll_dht_value_bytes_total", op="store", kind="round") == 180


def test_values_not_known_yet_are_nan_and_a_checkpoint_has_an_age():
    import time

    c = Counters()
    c.checkpoint_at = time.time() - 30
    s = scrape(c, TrafficStats(), versions=[0])
    assert math.isnan(value(s, "atoll_loss")) and math.isnan(value(s, "atoll_held_out_loss"))
    assert 29 <= value(s, "atoll_checkpoint_age_seconds") < 60
    assert value(s, "atoll_status", status="joining") == 1


def test_the_sample_grafana_dashboard_queries_only_metrics_the_daemon_serves():
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana" / "atoll-dashboard.json")
                           .read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = {name for e in exprs for name in re.findall(r"\batoll_[a-z_]+", e)}
    c = Counters(loss=1.0)
    c.round_ended(0, "merged", 1.0)
    c.checkpoint_at = 0.0
    traffic = TrafficStats()
    traffic.reject("nan")
    served = {name for name, _ in scrape(c, traffic, versions=[1])}
    assert used and used <= served, used - served

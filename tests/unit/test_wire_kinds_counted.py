"""``bench_wire_kinds``'s comparison of the DHT RPCs' payload with the records the daemons counted: writes by kind,
reads together (the probe files a small swarm's reads under background), against sums by hand."""

import pytest

from scripts.bench_wire_kinds import against_counted
from scripts.wan_runs import dht_record_bytes


def test_writes_by_kind_and_reads_together_against_the_daemons_counts():
    summaries = [{"dht_calls": {"store progress": {"bytes": 1000}, "get progress": {"bytes": 2000},
                                "get round": {"bytes": 500}}},
                 {"dht_calls": {"store progress": {"bytes": 3000}, "store round": {"bytes": 200}}}]
    counted = dht_record_bytes(summaries)
    assert counted == {"store progress": 4000, "get progress": 2000, "get round": 500, "store round": 200}
    run = {"by_kind": {"rpc_store progress": {"calls": 9, "sent": 9000, "received": 1000},
                       "rpc_store round": {"calls": 2, "sent": 600, "received": 100},
                       "rpc_find background": {"calls": 5, "sent": 500, "received": 7000},
                       "rpc_find progress": {"calls": 1, "sent": 100, "received": 400},
                       "rpc_ping background": {"calls": 3, "sent": 30, "received": 30},
                       "rpc_nudge nudge": {"calls": 4, "sent": 400, "received": 40}},
           "records_counted_by_kind": counted}
    rows = {what: (wire, mine) for what, wire, mine in against_counted(run)}
    assert rows == {"store progress": pytest.approx((10.0, 4.0)), "get (every kind)": pytest.approx((8.0, 2.5)),
                    "store round": pytest.approx((0.7, 0.2))}
    assert [what for what, *_ in against_counted(run)] == ["store progress", "get (every kind)", "store round"]

"""``make demo``'s control-plane table (``scripts/swarm.control_plane``): the daemons' DHT calls by record kind, per
daemon and minute, against the sums taken by hand."""

import pytest

from scripts.swarm import control_plane


def test_the_control_plane_table_sums_the_daemons_calls_per_daemon_minute():
    rows = [{"minutes": 2.0, "dht_calls": {"get progress": {"calls": 40, "bytes": 40 * 1024},
                                           "store progress": {"calls": 10, "bytes": 5 * 1024},
                                           "get group": {"calls": 6, "bytes": 1024}}},
            {"minutes": 1.0, "dht_calls": {"get progress": {"calls": 20, "bytes": 8 * 1024},
                                           "store round": {"calls": 3, "bytes": 3 * 1024}}}]
    table = {kind: rest for kind, *rest in control_plane(rows)}
    assert table["progress"] == pytest.approx([60 / 3, 48 / 3, 10 / 3, 5 / 3])
    assert table["group"] == pytest.approx([6 / 3, 1 / 3, 0.0, 0.0])
    assert table["round"] == pytest.approx([0.0, 0.0, 1.0, 1.0])
    assert [kind for kind, *_ in control_plane(rows)] == ["progress", "round", "group"]  # the most bytes first
    assert control_plane([{"minutes": 0.0, "dht_calls": {}}]) == []

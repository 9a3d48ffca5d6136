"""A harness's settings (``--harness``): parsed and checked, and a daemon without them changes nothing."""

import pytest

from atoll.node import harness as harness_module
from atoll.node.harness import Harness


def test_parse_types_values_and_rejects_bad_ones():
    assert Harness.parse(["step_delay=0.5", "start_together=3", "data_shard=2"]) == Harness(0.5, 3, 2)
    for bad, why in (("nope=1", "unknown harness setting"), ("step_delay=", "unknown harness setting"),
                     ("start_together=x", "bad value"), ("step_delay=-1", "must not be negative"),
                     ("kill_in_round=3", "unknown harness setting")):
        with pytest.raises(ValueError, match=why):
            Harness.parse([bad])


def test_no_settings_change_nothing(monkeypatch):
    monkeypatch.setattr(harness_module.time, "sleep", lambda s: pytest.fail("paced without a step delay"))
    h = Harness.parse([])
    h.pace()
    assert h.start_together == 0 and h.shard(5, 16) == 5


def test_a_step_delay_paces_each_step_and_data_shard_pins_the_shard_within_the_runs_count(monkeypatch):
    slept = []
    monkeypatch.setattr(harness_module.time, "sleep", slept.append)
    Harness.parse(["step_delay=0.25"]).pace()
    assert slept == [0.25]
    assert Harness.parse(["data_shard=2"]).shard(9, 16) == 2
    assert Harness.parse(["data_shard=18"]).shard(9, 16) == 2


def test_step_jitter_varies_each_delay_within_its_share_and_the_seed_repeats_it(monkeypatch):
    slept = []
    monkeypatch.setattr(harness_module.time, "sleep", slept.append)
    h = Harness.parse(["step_delay=0.2", "step_jitter=0.1", "jitter_seed=7"])
    for _ in range(200):
        h.pace()
    assert all(0.18 - 1e-12 <= s <= 0.22 + 1e-12 for s in slept) and len(set(slept)) > 100
    assert abs(sum(slept) / len(slept) - 0.2) < 0.005  # uniform about the delay: mean 0.2, sd 0.0115/sqrt(200)
    again = []
    monkeypatch.setattr(harness_module.time, "sleep", again.append)
    h = Harness.parse(["step_delay=0.2", "step_jitter=0.1", "jitter_seed=7"])
    for _ in range(200):
        h.pace()
    assert again == slept
    other = []
    monkeypatch.setattr(harness_module.time, "sleep", other.append)
    Harness.parse(["step_delay=0.2", "step_jitter=0.1", "jitter_seed=8"]).pace()
    assert other[0] != slept[0]
    with pytest.raises(ValueError, match="at most 1"):
        Harness.parse(["step_jitter=1.5"])

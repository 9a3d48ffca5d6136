"""``dht_setup.start_with_retries``: the bootstrap retries a daemon's DHT and a light command's reader share."""

import pytest

from atoll.protocols import dht_setup


def test_a_start_is_tried_again_two_then_four_seconds_later_and_the_last_error_raised(monkeypatch):
    slept = []
    monkeypatch.setattr(dht_setup.time, "sleep", slept.append)
    outcomes = [RuntimeError("no peer"), RuntimeError("still none"), "started"]

    def start():
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert dht_setup.start_with_retries(start, 3) == "started" and slept == [2, 4]
    slept.clear()
    outcomes[:] = [RuntimeError("a"), RuntimeError("b")]
    with pytest.raises(RuntimeError, match="b"):
        dht_setup.start_with_retries(start, 2)
    assert slept == [2]  # no sleep after the last try
    with pytest.raises(ValueError):
        dht_setup.start_with_retries(start, 0)

"""scripts/stats.py against a hand computation."""

import math

import pytest
from scripts import stats


def test_interval_of_three_values_uses_t_with_two_degrees_of_freedom():
    s = stats.interval([1.0, 2.0, 3.0])
    # mean 2, sd 1, t(0.975, 2) = 4.3027: half-width 4.3027 / sqrt(3)
    assert s["mean"] == 2.0 and s["sd"] == 1.0
    assert s["ci95"] == pytest.approx(4.302653 / math.sqrt(3), rel=1e-4)
    assert (s["low"], s["high"]) == pytest.approx((2.0 - s["ci95"], 2.0 + s["ci95"]))


def test_interval_narrows_with_more_values_of_the_same_spread():
    few, many = stats.interval([1.0, 3.0] * 2), stats.interval([1.0, 3.0] * 10)
    assert many["ci95"] < few["ci95"]


def test_one_value_has_no_interval():
    s = stats.interval([5.0])
    assert s["mean"] == 5.0 and s["ci95"] is None
    assert stats.fmt(s) == "5.000 (n=1)"
    with pytest.raises(ValueError):
        stats.interval([])

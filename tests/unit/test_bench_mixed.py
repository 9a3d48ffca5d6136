"""bench_mixed's arithmetic: a daemon's tokens between its records, a curve read at a token count, and each
configuration compared with the uniform run at the fewer tokens of the two."""

import pytest

from scripts import bench_mixed


def test_tokens_at_interpolates_between_records_and_holds_after_the_last():
    progress = [(10.0, 100), (20.0, 300)]
    assert bench_mixed.tokens_at(progress, 5.0) == 0.0
    assert bench_mixed.tokens_at(progress, 10.0) == 100
    assert bench_mixed.tokens_at(progress, 15.0) == pytest.approx(200)
    assert bench_mixed.tokens_at(progress, 99.0) == 300


def test_a_curve_is_read_between_its_points_and_not_outside_them():
    curve = [(100.0, 4.0), (200.0, 3.0), (400.0, 2.0)]
    assert bench_mixed.at_tokens(curve, 100.0) == 4.0
    assert bench_mixed.at_tokens(curve, 150.0) == pytest.approx(3.5)
    assert bench_mixed.at_tokens(curve, 300.0) == pytest.approx(2.5)
    assert bench_mixed.at_tokens(curve, 400.0) == 2.0
    assert bench_mixed.at_tokens(curve, 50.0) is None and bench_mixed.at_tokens(curve, 401.0) is None


def test_configurations_compare_at_the_fewer_tokens_of_the_two_runs():
    uniform = {"curve": [(100.0, 4.0), (300.0, 2.0)], "held_out_loss_end": 2.0, "goodput": 0.9}
    slower = {"curve": [(100.0, 4.4), (200.0, 3.3)], "held_out_loss_end": 3.0, "goodput": 0.45}
    got = {"uniform": uniform, "slower": slower}
    bench_mixed.compare(got)
    # At 200 tokens (the slower run's last evaluation): 3.3 against the uniform run's 3.0 there.
    assert slower["equal_tokens"] == 200.0
    assert slower["held_out_at_equal_tokens_ratio"] == pytest.approx(1.1)
    assert slower["held_out_end_ratio"] == pytest.approx(1.5) and slower["goodput_ratio"] == pytest.approx(0.5)
    assert uniform["held_out_at_equal_tokens_ratio"] == 1.0


def test_the_slow_delay_makes_a_step_the_papers_share_longer():
    compute = 0.25
    fast = bench_mixed.FAST_DELAY + compute
    slow = bench_mixed.slow_delay(compute) + compute
    assert slow / fast == pytest.approx(1 + bench_mixed.SLOWER)

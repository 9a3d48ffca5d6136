"""scripts/chaos.py's load and restart measures, on hand-made metrics (no processes)."""

from types import SimpleNamespace

import chaos


def daemon(times):
    return SimpleNamespace(metrics=lambda: [{"event": "resumed", "time": times[0] - 1}]
                           + [{"step": i, "tokens": 100 * i, "time": t} for i, t in enumerate(times)])


def test_busy_share_is_the_non_idle_part_of_the_ticks():
    assert chaos.busy_share((1000, 400), (1400, 500)) == 0.75  # 400 ticks, 100 of them idle
    now = chaos.cpu_times()
    assert now[0] >= now[1] >= 0


def test_start_seconds_measure_from_each_spawn_to_the_first_step_after_it():
    daemons = {"d1": daemon([10.0, 11.0, 50.0, 51.0]), "j0": daemon([30.5, 31.0])}
    # d1 was restarted at 45 (first step after it at 50); j0 joined at 20; a start with no step yet is left out.
    spawned = [("d1", 45.0), ("j0", 20.0), ("d1", 60.0)]
    assert chaos.start_seconds(daemons, spawned) == [5.0, 10.5]

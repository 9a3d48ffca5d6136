"""scripts/chaos.py's load and restart measures, on hand-made metrics (no processes)."""

from types import SimpleNamespace

from scripts import chaos


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


def timeline(events):
    """A daemon whose metrics.jsonl is ``events`` (a list of dicts) and whose rounds are its round events."""
    return SimpleNamespace(metrics=lambda: list(events), rounds=lambda: [m for m in events if m.get("event") == "round"])


def steps(times, first_tokens=0, per_step=10):
    return [{"step": i, "tokens": first_tokens + per_step * i, "time": t} for i, t in enumerate(times)]


def test_tokens_in_window_counts_increases_inside_it_and_not_a_restarts_drop():
    # Steps every second from t=0 to t=9 (10 tokens each), a crash, then a restart from a checkpoint at 40 tokens
    # whose steps run t=20..24; the window is [2, 22].
    before = steps(range(10))
    after = [{"step": 4 + i, "tokens": 40 + 10 * i, "time": 20.0 + i} for i in range(5)]
    d = timeline(before + [{"event": "resumed", "time": 19.0}] + after)
    # Inside [2, 22]: increases 2→3 ... 8→9 (7 of them: the 1→2 one starts before the window), then the restart's
    # first record (tokens 40 < 90, not training), then 20→21 and 21→22 (2 increases).
    assert chaos.tokens_in_window([d], 2.0, 22.0) == 10 * (7 + 2)
    assert chaos.tokens_in_window([d, d], 2.0, 22.0) == 2 * 10 * 9
    assert chaos.tokens_in_window([d], 30.0, 40.0) == 0


def test_live_seconds_sum_each_process_lifetime_within_the_window():
    d = timeline(steps([0.0, 1.0, 2.0, 3.0]) + [{"event": "resumed", "time": 9.0}] + steps([10.0, 12.0, 15.0]))
    assert chaos.live_seconds([d], 0.0, 100.0) == 3.0 + 5.0
    assert chaos.live_seconds([d], 1.0, 12.0) == 2.0 + 2.0  # clipped to the records inside the window
    joined = timeline([{"event": "joined", "time": 4.0}] + steps([5.0, 8.0]))
    assert chaos.live_seconds([d, joined], 0.0, 100.0) == 8.0 + 3.0


def test_longest_gap_includes_the_window_edges():
    assert chaos.longest_gap([2.0, 3.0, 7.0], 0.0, 8.0) == 4.0
    assert chaos.longest_gap([1.0, 2.0], 0.0, 10.0) == 8.0  # no round after t=2: the gap runs to the window's end
    assert chaos.longest_gap([], 0.0, 5.0) == 5.0


def test_round_period_is_the_median_interval_per_fragment_and_daemon():
    rounds = [{"event": "round", "fragment": p, "time": t} for p, t in
              [(0, 0.0), (1, 2.5), (0, 10.0), (1, 12.5), (0, 19.0), (1, 23.5)]]
    # Fragment 0: 10, 9; fragment 1: 10, 11; another daemon's fragment 0: 8.
    other = [{"event": "round", "fragment": 0, "time": t} for t in (1.0, 9.0)]
    assert chaos.round_period([timeline(rounds), timeline(other)]) == 10.0
    assert chaos.round_period([timeline([])]) != chaos.round_period([timeline([])])  # NaN without rounds


def test_crash_losses_are_the_tokens_trained_after_the_last_checkpoint_before_each_restart():
    events = (steps([0.0, 1.0, 2.0]) + [{"event": "checkpoint", "tokens": 20, "time": 2.1}]
              + [{"step": 3, "tokens": 30, "time": 3.0}, {"step": 4, "tokens": 40, "time": 4.0}]
              + [{"event": "resumed", "time": 6.0}]  # killed at 40 tokens, checkpoint at 20: 20 lost
              + [{"step": 3, "tokens": 20, "time": 7.0}, {"event": "checkpoint", "tokens": 20, "time": 7.1}]
              + [{"event": "joined", "time": 9.0}]  # a fresh join is not a crash of this daemon's state
              + [{"step": 0, "tokens": 0, "time": 10.0}])
    assert chaos.crash_losses(timeline(events)) == 20


def test_schedule_has_the_same_number_of_each_kind_inside_the_window():
    import random

    faults = chaos.schedule(random.Random(3), 100.0, per_kind=4)
    assert sorted(k for _, k in faults) == sorted(chaos.KINDS * 4)
    times = [t for t, _ in faults]
    assert times == sorted(times) and 10.0 <= times[0] and times[-1] <= 80.0
    assert faults == chaos.schedule(random.Random(3), 100.0, per_kind=4)  # seeded: the same in both twins
    assert faults != chaos.schedule(random.Random(4), 100.0, per_kind=4)


def test_the_fault_free_twin_gets_the_joins_at_the_same_times_and_nothing_else():
    faults = [(11.0, "kill"), (12.5, "join"), (20.0, "freeze"), (31.0, "join"), (40.0, "leave")]
    assert chaos.reference_schedule(faults) == [(12.5, "join"), (31.0, "join")]


def test_kept_tokens_leave_out_what_crashes_and_adoptions_threw_away():
    assert chaos.kept_tokens(1000, 120, 30) == 850
    assert chaos.kept_tokens(1000, 0, 0) == 1000


def test_downtime_is_judged_against_the_fault_free_twins_own_longest_gap():
    # The review's case: decoupled's longest gap 5.5 s against 2.5 s fault-free is 3 s of downtime, not 0.
    d = chaos.downtime(5.5, 2.5)
    assert d["downtime_beyond_fault_free_s"] == 3.0 and d["longest_gap_ratio"] == 2.2
    assert chaos.downtime(2.0, 2.5)["downtime_beyond_fault_free_s"] == 0.0


class FakeSwarm:
    """Records the signals a Chaos sends; no processes."""

    def __init__(self):
        self.daemons, self.calls = {}, []

    def kill(self, name):
        self.calls.append(("kill", name))

    def signal(self, name, sig):
        self.calls.append(("signal", name, sig))


def test_a_fault_that_would_leave_too_few_daemons_waits_and_is_logged_if_it_never_could():
    import random
    import time
    from types import SimpleNamespace as NS

    args = NS(min_live=2, rejoin=(100.0, 100.0), freeze=100.0, visit=100.0)
    c = chaos.Chaos(FakeSwarm(), args, random.Random(0))
    c.state = {"d0": "live", "d1": "live", "d2": "live"}
    assert c.inject(0.0, "freeze")  # 3 live > 2: done
    assert c.swarm.calls[0][0] == "signal" and c.state[c.swarm.calls[0][1]] == "frozen"
    assert not c.inject(0.0, "kill")  # 2 live: it waits, nothing done, nothing logged
    assert len(c.swarm.calls) == 1 and [f["kind"] for f in c.log] == ["freeze"]
    c.run([(0.0, "kill")], duration=0.5, t0=time.monotonic())
    assert [f["kind"] for f in c.log] == ["freeze", "not_injected_kill"]


def test_a_fault_never_lands_on_a_daemon_about_to_die_and_waits_while_too_few_are_left():
    import random
    import time
    from types import SimpleNamespace as NS

    args = NS(min_live=1, rejoin=(100.0, 100.0), freeze=100.0, visit=100.0)
    c = chaos.Chaos(FakeSwarm(), args, random.Random(1))
    c.start = lambda name, delay=0.0: None  # no restarts in this test
    c.state = {"d0": "live", "d1": "live", "d2": "live"}
    c.expect_death = {"d0"}  # its checkpoint kill is armed
    t0 = time.monotonic()
    c.run([(0.0, "freeze"), (0.0, "kill")], duration=0.7, t0=t0)
    hits = [f for f in c.log if f["kind"] in ("freeze", "kill", "not_injected_kill")]
    assert [f["kind"] for f in hits] == ["freeze", "not_injected_kill"]  # d1 or d2 frozen, then only one is left
    assert hits[0]["target"] in ("d1", "d2")

"""Decoupled DiLoCo under deterministic faults: a 3× slower daemon does not slow the others, and a frozen
daemon (SIGSTOP) catches up by downloading newer fragments and contributes again while the others never stop.
Rounds are int4-compressed, so the frozen daemon catches up by replaying the rounds it missed.
"""

import signal

import pytest
from scripts.swarm import LocalSwarm
from support.swarms import assert_replicas_agree, last_step, peer_id, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.waits]

FAST_DELAY, SLOW_DELAY = 0.03, 0.12  # seconds slept per step on top of ~10-20 ms of compute: ≥ 3× slower
COMMON = ["--model", "nano", "--batch-size", "4", "--algorithm", "decoupled", "--sync-every", "40",
          "--gather-timeout", "8", "--round-timeout", "8", "--heartbeat", "1", "--compression", "int4"]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    s = LocalSwarm(tmp_path_factory.mktemp("decoupled"), COMMON)
    try:
        s.start("a", ["--harness", f"step_delay={FAST_DELAY}"], join=False)
        s.start("b", ["--harness", f"step_delay={FAST_DELAY}"])
        s.start("slow", ["--harness", f"step_delay={SLOW_DELAY}"])
        yield s
    finally:
        s.stop_all(timeout=30)


def test_slow_daemon_does_not_slow_the_others(swarm):
    slow = swarm.daemons["slow"]
    ids = {peer_id(d) for d in swarm.daemons.values()}
    # The slow daemon is in the swarm's rounds, not merely alongside them: its part reaches a shared round.
    wait_for(lambda: any(peer_id(slow) in r["contributors"] and len(set(r["contributors"]) & ids) >= 2
                         for n in ("a", "b") for r in swarm.daemons[n].rounds()), 180,
             "the slow daemon to contribute to a shared round")
    wait_for(lambda: all(last_step(d) >= 20 for d in swarm.daemons.values()), 180, "every daemon to train")
    start = {n: last_step(d) for n, d in swarm.daemons.items()}
    # Barrier: the slow daemon advances 60 steps; meanwhile the fast ones must keep their own pace.
    wait_for(lambda: last_step(slow) >= start["slow"] + 60, 180, "the slow daemon to advance 60 steps")
    progress = {n: last_step(d) - start[n] for n, d in swarm.daemons.items()}
    for fast in ("a", "b"):
        assert progress[fast] >= 2 * progress["slow"], progress
    assert_replicas_agree(swarm, ("a", "b", "slow"))


def test_frozen_daemon_catches_up_and_contributes_again(swarm):
    b, a = swarm.daemons["b"], swarm.daemons["a"]
    swarm.signal("b", signal.SIGSTOP)  # b, its DHT process and its p2pd
    try:
        frozen_at = {"a": last_step(a), "a_rounds": len(a.rounds()), "b_adopted": len(
            [m for m in b.metrics() if m.get("event") == "adopted"])}
        wait_for(lambda: len(a.rounds()) >= frozen_at["a_rounds"] + 8, 180, "a to merge 8 rounds while b is frozen")
    finally:
        swarm.signal("b", signal.SIGCONT)
    assert last_step(a) > frozen_at["a"] + 40  # a never stopped
    resumed_round = len(b.rounds())
    wait_for(lambda: len([m for m in b.metrics() if m.get("event") == "adopted"]) > frozen_at["b_adopted"], 120,
             "b to download newer fragments")
    # The rounds b missed are still on its peers' logs: it replays them (a few KB) instead of downloading Θ_p.
    adopted = [m for m in b.metrics() if m.get("event") == "adopted"][frozen_at["b_adopted"]:]
    assert any(m["replayed"] >= 1 for m in adopted), adopted
    me = peer_id(b)
    wait_for(lambda: any(me in r["contributors"] and len(r["contributors"]) >= 2 for r in b.rounds()[resumed_round:]),
             180, "b to contribute to a shared round again")
    assert_replicas_agree(swarm, ("a", "b", "slow"))


def test_no_daemon_crashed_and_none_waited(swarm):
    codes = swarm.stop_all(timeout=60)
    assert all(code == 0 for code in codes.values()), codes
    # Decoupled never blocks the loop on the network: not for the slow daemon, not for a frozen one.
    summaries = {n: [m for m in d.metrics() if m.get("event") == "summary"][-1] for n, d in swarm.daemons.items()}
    assert all(s["blocked_s"] == 0.0 for s in summaries.values()), {n: s["blocked_s"] for n, s in summaries.items()}
    for name, d in swarm.daemons.items():
        log = d.log()
        assert "Traceback" not in log, f"{name}: " + log[log.index("Traceback") - 300:][:3000]


def test_split_swarm_heals_into_identical_replicas(tmp_path):
    """Halves {a, b} and {c, d} are partitioned until their learners reach step SPLIT: each half trains and merges
    on its own (two groups at the same versions: a fork). When they meet, the lighter half adopts the heavier
    replicas, reports the work it lost (its part of the rounds its fork merged; the work no round merged is carried
    onto the new replicas), and afterwards rounds span both halves with identical replicas."""
    split = 250
    with LocalSwarm(tmp_path, COMMON + ["--fragments", "2", "--harness", f"step_delay={FAST_DELAY}",
                                        "--fault", f"split_until={split}"]) as swarm:
        for name, side in zip("abcd", "0011"):
            swarm.start(name, ["--fault", f"split_side={side}"], join=name != "a")
        ids = {n: peer_id(swarm.daemons[n]) for n in "abcd"}
        left, right = {ids["a"], ids["b"]}, {ids["c"], ids["d"]}

        def rounds():
            return [r for d in swarm.daemons.values() for r in d.rounds()]

        def forked_adoptions():
            return [m for d in swarm.daemons.values() for m in d.metrics()
                    if m.get("event") == "adopted" and m.get("forked")]

        def joint_rounds():
            return [r for r in rounds() if set(r["contributors"]) & left and set(r["contributors"]) & right]

        wait_for(lambda: {r["fragment"] for r in joint_rounds()} == {0, 1}, 300,
                 "rounds of every fragment with members of both halves")
        # Both halves merged rounds of their own while apart, and no round mixed them before the split ended.
        assert any(set(r["contributors"]) <= left for r in rounds())
        assert any(set(r["contributors"]) <= right for r in rounds())
        assert all(r["step"] >= split for r in joint_rounds())
        forks = forked_adoptions()
        assert forks, "the lighter half never adopted the heavier half's replicas"
        assert sum(m["lost_tokens"] for m in forks) > 0
        assert_replicas_agree(swarm, "abcd")
        codes = swarm.stop_all(timeout=60)
        assert all(code == 0 for code in codes.values()), codes
        summaries = [m for d in swarm.daemons.values() for m in d.metrics() if m.get("event") == "summary"]
        assert len(summaries) == 4
        assert sum(s["forks_healed"] for s in summaries) >= 1
        assert sum(s["tokens_lost"] for s in summaries) > 0  # the losing half's part of the rounds its fork merged
        assert all(s["tokens_carried"] > 0 for s in summaries)  # each kept what it trained while rounds were out

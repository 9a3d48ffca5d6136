"""``streaming``, ``decoupled`` (fragments, overlap) and ``ddp`` (a gradient all-reduce every step) train three real
daemons; every round ends with identical replicas on all of its contributors."""

import pytest
from scripts.swarm import LocalSwarm
from support.swarms import assert_replicas_agree, peer_id, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.waits]


@pytest.mark.parametrize("algorithm", ["streaming", "decoupled"])
def test_three_daemons_train_with_fragments(algorithm, tmp_path):
    common = ["--model", "nano", "--batch-size", "4", "--algorithm", algorithm, "--sync-every", "40",
              "--gather-timeout", "8", "--round-timeout", "8", "--heartbeat", "1", "--harness", "step_delay=0.03",
              "--overlap", "6", "--eval-budget", "1"]
    with LocalSwarm(tmp_path, common) as swarm:
        for name in "abc":
            swarm.start(name, join=name != "a")
        ids = {peer_id(swarm.daemons[n]) for n in "abc"}

        def multi_member_rounds():
            return [r for n in "abc" for r in swarm.daemons[n].rounds() if len(set(r["contributors"]) & ids) >= 2]

        def everyone_contributed():
            rounds = multi_member_rounds()
            # Each daemon's own record of a shared round, too: a round's members write theirs a moment apart.
            recorded = all(any(len(set(r["contributors"]) & ids) >= 2 for r in swarm.daemons[n].rounds())
                           for n in "abc")
            return len(rounds) >= 6 and set().union(*(r["contributors"] for r in rounds)) >= ids and recorded

        wait_for(everyone_contributed, 240, f"{algorithm}: rounds with several contributors, from every daemon")
        fragments = {r["fragment"] for r in multi_member_rounds()}
        assert len(fragments) >= 2  # the fragments take turns
        assert_replicas_agree(swarm, "abc")
        codes = swarm.stop_all(timeout=60)
        assert all(code == 0 for code in codes.values()), codes
        for name in "abc":
            log = swarm.daemons[name].log()
            assert "Traceback" not in log, log[log.index("Traceback") - 500:][:3000]


def test_ddp_averages_gradients_every_step(tmp_path):
    # 80 steps: more groups than a reducer keeps waiting requests for (64), within their lifetime.
    common = ["--model", "nano", "--batch-size", "4", "--algorithm", "ddp", "--sync-every", "20", "--quorum", "3",
              "--gather-timeout", "8", "--round-timeout", "8", "--heartbeat", "1", "--max-steps", "80",
              "--eval-budget", "1"]
    with LocalSwarm(tmp_path, common) as swarm:
        for name in "abc":
            swarm.start(name, join=name != "a")
        ids = {peer_id(swarm.daemons[n]) for n in "abc"}
        codes = {n: swarm.daemons[n].proc.wait(240) for n in "abc"}
        assert all(code == 0 for code in codes.values()), codes
        for name in "abc":
            rounds = swarm.daemons[name].rounds()
            # Every step was taken together: after 80 steps the replica is at version 80, with all three in it.
            assert [r["version"] for r in rounds] == [20, 40, 60, 80], rounds
            assert all(set(r["contributors"]) == ids for r in rounds), rounds
            assert rounds[-1]["held_out_loss"] < rounds[0]["held_out_loss"]
        assert_replicas_agree(swarm, "abc")
        hashes = {swarm.daemons[n].rounds()[-1]["hash"] for n in "abc"}
        assert len(hashes) == 1, hashes
